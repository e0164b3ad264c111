"""Teams: tenants' quotas, fair share, aging, the
gang reservation and preemption, through the sans-I/O core; the daemon end to
end is in tests/test_e2e_teams.py."""

from __future__ import annotations

import signal

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from test_core import Sched, placed
from test_core_properties import NGPUS, NODE, CoreMachine

from eventsched.core.explain import waiting_reason
from eventsched.core.policies import POLICIES, fair_shares
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.domain.tenants import Tenant
from eventsched.domain.units import FULL


def teams(gpus: int = 4, **config: object) -> Sched:
    return Sched(gpus=gpus, **config)


def refused(s: Sched, uid: int = 1000, **spec: object) -> str:
    spec.setdefault("command", ["python", "train.py"])
    return s.refused(m.Submit(spec=ev.JobSpec(uid=uid, user=f"u{uid}", **spec)))  # type: ignore[arg-type]


def set_tenant(s: Sched, name: str, **fields: object) -> None:
    s.do(m.SetTenant(name=name, tenant=Tenant(**fields), by="uid:0"))  # type: ignore[arg-type]


# --- quotas ---------------------------------------------------------------------


def test_a_tenant_with_one_gpu_runs_one_job_at_a_time_and_explain_says_quota() -> None:
    s = teams()
    set_tenant(s, "vision", users=["u1000"], gpus=1)
    jobs = [s.submit() for _ in range(3)]
    assert [s.st(j) for j in jobs] == ["running", "queued", "queued"]
    reason = waiting_reason(s.state, jobs[1], s.now)
    assert reason is not None and reason.kind == "quota"
    assert reason.text.startswith("quota: tenant vision has 1 of its 1 GPUs in use (quota gpus = 1)")
    s.exit(jobs[0])
    assert [s.st(j) for j in jobs] == ["succeeded", "running", "queued"]
    # another tenant's jobs are not held back by vision's quota
    other = s.submit(uid=2000)
    assert s.st(other) == "running"


def test_quotas_on_jobs_and_memory_and_fractional_shares_add_up() -> None:
    s = teams()
    set_tenant(s, "nlp", users=["u1000"], jobs=2, gpu_mem_mib=10_000)
    a, b, c = (s.submit(gpus=0.25, gpu_mem_mib=4000) for _ in range(3))
    assert [s.st(j) for j in (a, b, c)] == ["running", "running", "queued"]  # jobs = 2
    s.exit(a)
    assert s.st(c) == "running"
    set_tenant(s, "nlp", users=["u1000"], gpus=0.5)  # now: half a GPU at once
    d, e = s.submit(gpus=0.25), s.submit(gpus=0.25)
    assert s.st(d) == "queued" and s.st(e) == "queued"  # b and c hold 0.5 already
    assert waiting_reason(s.state, d, s.now).text.startswith("quota: tenant nlp has 0.5 of its 0.5 GPUs")


def test_a_job_that_can_never_fit_its_quota_is_refused_naming_it() -> None:
    s = teams()
    set_tenant(s, "vision", users=["u1000"], gpus=1, gpu_mem_mib=8000)
    assert refused(s, gpus=2) == "asks for 2 GPUs but tenant vision's quota is 1 GPUs at once"
    assert refused(s, gpus=1, gpu_mem_mib=9000) == (
        "asks for 9000 MiB of GPU memory but tenant vision's quota is 8000 MiB at once")
    set_tenant(s, "vision", users=["u1000"], jobs=0)
    assert refused(s, ) == "tenant vision may run no jobs (quota jobs = 0)"


def test_tenant_membership_is_checked_and_recorded_on_the_job() -> None:
    s = teams()
    set_tenant(s, "vision", users=["u1000", "u2000"], default_for=["u1000"])
    set_tenant(s, "nlp", users=["u1000"])
    assert s.job(s.submit()).spec.tenant == "vision"  # listed in two: their default
    assert s.job(s.submit(tenant="nlp")).spec.tenant == "nlp"
    assert s.job(s.submit(uid=3000)).spec.tenant == "default"  # nobody lists u3000
    assert refused(s, tenant="robotics") == "--tenant robotics: no such tenant (tenants: nlp, vision)"
    assert s.refused(m.Submit(spec=ev.JobSpec(command=["x"], uid=2000, user="u2000", tenant="nlp"))) == (
        "--tenant nlp: you (u2000) are not one of its users")
    # a user in two tenants with no default among them: refused, nothing changed
    assert s.refused(m.SetTenant(name="nlp", tenant=Tenant(users=["u2000"]), by="uid:0")).startswith(
        "user 'u2000' is in tenants 'vision', 'nlp': list them in default_for")


def test_tenant_changes_are_facts_and_history_keeps_what_the_quota_was() -> None:
    s = teams()
    set_tenant(s, "vision", users=["u1000"], gpus=1)
    set_tenant(s, "vision", users=["u1000"], gpus=3)
    configured = [e for e in s.log if isinstance(e, ev.TenantsConfigured)]
    assert [e.tenants["vision"].gpus for e in configured] == [1.0, 3.0]
    assert all(e.by == "uid:0" and e.cause == "uid:0" for e in configured)
    # the same tenants again decide nothing
    events, _ = s.do(m.SetTenant(name="vision", tenant=Tenant(users=["u1000"], gpus=3), by="uid:0"))
    assert events == []


def test_a_restart_with_other_tenants_in_the_config_records_them() -> None:
    s = teams()
    infos = [m.GpuInfo(gpu=i, uuid=f"GPU-{i}", model="fake", memory_total_mib=16000) for i in range(4)]
    tenants = {"vision": Tenant(users=["u1000"], gpus=2)}
    events, _ = s.do(m.Started(node="local", pid=2, version="t", gpu_backend="fake", gpus=infos,
                               config=m.SchedulerConfig(), tenants=tenants))
    configured = [e for e in events if isinstance(e, ev.TenantsConfigured)]
    assert len(configured) == 1 and configured[0].by == "config" and configured[0].cause == f"seq:{events[0].seq}"
    # the same config again: nothing new; no [tenants] in the config (None): the log's stay
    for again in (tenants, None):
        events, _ = s.do(m.Started(node="local", pid=3, version="t", gpu_backend="fake", gpus=infos,
                                   config=m.SchedulerConfig(), tenants=again))
        assert not any(isinstance(e, ev.TenantsConfigured) for e in events)
    assert s.state.tenants == tenants


# --- fair share -------------------------------------------------------------------


def _flood(weights: dict[str, float], hours: float = 24.0, gpus: int = 8) -> dict[str, float]:
    """Tenants each keep hundreds of 1-GPU jobs (30 to 90 minutes, seeded)
    waiting on ``gpus`` GPUs under the fair-share policy; returns each one's
    share of the GPU-hours run in ``hours``."""
    import random

    rng = random.Random(7)
    s = teams(gpus=gpus, policy="fair-share", usage_half_life_s=6 * 3600.0)
    uid_of = {}
    for k, (name, w) in enumerate(sorted(weights.items())):
        uid_of[name] = 3000 + k
        set_tenant(s, name, users=[f"u{3000 + k}"], weight=w)
    runtime = {}
    for _ in range(300):  # more than any tenant can run in the time
        for name in weights:
            runtime[s.submit(uid=uid_of[name])] = rng.uniform(1800.0, 5400.0)
    used = {name: 0.0 for name in weights}
    t_end = s.now + hours * 3600
    while True:
        jid = min(s.state.running, key=lambda j: s.job(j).started_at + runtime[j])
        end = s.job(jid).started_at + runtime[jid]
        if end > t_end:
            break
        assert {s.job(j).tenant for _, _, j in s.state.queue.by_priority} == set(weights), "a tenant ran out of work"
        used[s.job(jid).tenant] += runtime[jid]
        s.exit(jid, at=end)
    total = sum(used.values())
    return {name: used[name] / total for name in weights}


def test_equal_weights_share_the_gpus_half_and_half() -> None:
    share = _flood({"a": 1.0, "b": 1.0})
    assert share["a"] == pytest.approx(0.5, abs=0.05)


def test_weights_two_to_one_share_the_gpus_two_to_one() -> None:
    share = _flood({"a": 2.0, "b": 1.0})
    assert share["a"] / share["b"] == pytest.approx(2.0, rel=0.10)


def test_an_idle_tenant_lends_its_share_up_to_the_quota() -> None:
    s = teams(policy="fair-share")
    set_tenant(s, "a", users=["u1000"], weight=1.0, gpus=3)
    set_tenant(s, "b", users=["u2000"], weight=3.0)
    jobs = [s.submit() for _ in range(4)]
    # b wants nothing: a borrows beyond its 25% share, but never past its quota
    assert [s.st(j) for j in jobs] == ["running", "running", "running", "queued"]
    shares = fair_shares(s.state, s.now)
    assert shares["a"][0] == pytest.approx(0.25) and shares["b"][0] == pytest.approx(0.75)


def test_the_fair_share_factor_is_slurms_classic_one() -> None:
    s = teams(policy="fair-share", usage_half_life_s=3600.0)
    set_tenant(s, "a", users=["u1000"])
    set_tenant(s, "b", users=["u2000"])
    busy = s.submit(gpus=2)
    s.now += 3600.0
    shares = fair_shares(s.state, s.now)
    share, used, factor = shares["a"]
    assert (share, used) == (0.5, 1.0) and factor == pytest.approx(2 ** (-1.0 / 0.5))
    assert shares["b"][2] == 1.0  # used nothing yet
    # two GPUs for an hour with a one-hour half-life: 2 x 3600 / ln 2 x (1 - 1/2)
    assert s.state.usage["a"].at(s.now, 3600.0) == pytest.approx(2 * 3600 / 0.6931471805599453 * 0.5)
    assert s.st(busy) == "running"


# --- aging and the gang reservation ---------------------------------------------------


def test_aging_lets_an_old_low_priority_job_pass_newer_high_priority_ones() -> None:
    s = teams(gpus=1, aging_per_hour=1.0)
    blocker = s.submit()
    old = s.submit(priority=0)
    s.now += 3 * 3600.0  # three hours later: worth 3 points
    newer = s.submit(priority=2)
    s.exit(blocker)
    assert s.st(old) == "running" and s.st(newer) == "queued"
    reason = waiting_reason(s.state, newer, s.now)
    assert reason is not None and reason.score["priority"] == 2.0 and reason.score["age"] == 0.0


def test_a_two_gpu_job_is_not_starved_by_a_stream_of_one_gpu_jobs() -> None:
    """A big job behind small ones: a 2-GPU job at priority 0 behind a stream of 1-GPU
    jobs on 2 GPUs. With the reservation it starts as soon as the GPUs its
    reservation names are free: within one run of the jobs holding them."""
    for reserve, starts in ((False, False), (True, True)):
        s = teams(gpus=2, reserve_for_gang=reserve, reserve_after_s=5.0)
        first = s.submit()
        big = s.submit(gpus=2)
        stream = []
        for k in range(12):
            stream.append(s.submit())
            s.now += 1.0
            running = sorted(s.state.running)
            if running:
                s.exit(running[0])
        assert (s.st(big) in ("running", "succeeded")) is starts, f"reserve_for_gang={reserve}"
        assert s.st(first) == "succeeded"
        if starts:  # placed at the first exit after it had waited reserve_after_s
            placed_at = next(e.ts for e in s.log if isinstance(e, ev.JobPlaced) and e.job == big)
            assert placed_at - s.job(big).submitted_at <= 5.0 + 1.0


def test_a_small_job_with_a_prediction_backfills_before_the_reserved_gang_job() -> None:
    s = teams(gpus=3, reserve_after_s=0.0)
    # history: "long" runs 1000 s, "short" 10 s
    for name, runtime in (("long", 1000.0), ("short", 10.0), ("short", 10.0)):
        j = s.submit(name=name)
        s.now += runtime
        s.exit(j)
    s.submit(name="long")  # on GPU 0 until about now + 1000
    big = s.submit(gpus=3)  # waits for GPU 0: GPUs 0-2 are reserved for it
    short = s.submit(name="short")  # ends long before: may use one of them
    unknown = s.submit(name="never-ran")  # no prediction: may not
    assert s.st(big) == "queued" and s.st(short) == "running" and s.st(unknown) == "queued"
    reason = waiting_reason(s.state, unknown, s.now)
    assert reason is not None and reason.kind == "reserved" and f"held for job {big}" in reason.text


def test_a_gang_job_gets_its_reservation_only_once_it_has_waited_reserve_after_s() -> None:
    s = teams(gpus=2, reserve_after_s=30.0)
    s.submit(name="long")
    big = s.submit(gpus=2)
    early = s.submit(name="other")
    assert s.st(early) == "running"  # a fresh head: plain backfill
    s.now += 31.0
    late = s.submit(name="never-seen")  # no prediction of its own
    s.exit(early)
    assert s.st(late) == "queued" and s.st(big) == "queued"  # the GPU freed is now held for the head
    assert waiting_reason(s.state, late, s.now).kind == "reserved"


# --- preemption -------------------------------------------------------------------------


def test_a_higher_priority_job_preempts_preemptible_ones_with_their_signal() -> None:
    s = teams(gpus=2, preempt_grace_s=20.0)
    low = [s.submit(uid=2000, preemptible=True, warn_signal=int(signal.SIGUSR1), warn_s=5.0),
           s.submit(uid=2000, preemptible=True)]
    s.now += 10
    keep = s.submit(uid=2000, gpus=0)  # CPU-only: never a victim, it holds nothing wanted
    events, effects = s.do(m.Submit(spec=ev.JobSpec(command=["x"], uid=1000, user="u1000", priority=5), by="uid:1000"))
    urgent = events[0].job
    asks = [e for e in events if isinstance(e, ev.JobCancelRequested)]
    # the fewest: one GPU is enough; the lowest, most recently started first (job 2)
    assert [(e.job, e.reason, e.for_job, e.rule, e.cause) for e in asks] == [
        (low[1], "preempted", urgent, "priority", f"seq:{events[0].seq}")]
    assert effects[0] == m.Signal(job=low[1], grace_s=20.0, reason="preempted", signum=0)
    assert s.st(keep) == "running"
    # the victim ends preempted, is requeued keeping its place, the urgent job starts
    order_before = s.job(low[1]).order
    events, _ = s.exit(low[1], code=None, signal=15)
    kinds = [(type(e).__name__, getattr(e, "job", None)) for e in events]
    assert kinds[:3] == [("JobExited", low[1]), ("JobRequeued", low[1]), ("JobPlaced", urgent)]
    assert events[0].outcome == "preempted"
    victim = s.job(low[1])
    assert victim.state == "queued" and victim.order == order_before and victim.preemptions == 1
    # a victim's own --signal and grace
    s2 = teams(gpus=1)
    v = s2.submit(uid=2000, preemptible=True, warn_signal=int(signal.SIGUSR1), warn_s=5.0)
    _, effects = s2.do(m.Submit(spec=ev.JobSpec(command=["x"], uid=1000, user="u1000", priority=1), by="uid:1000"))
    assert effects[0] == m.Signal(job=v, grace_s=5.0, reason="preempted", signum=int(signal.SIGUSR1))


def test_no_preemption_that_would_not_make_room_nor_of_protected_or_unwilling_jobs() -> None:
    s = teams(gpus=2)
    s.submit(uid=2000)  # not preemptible
    s.submit(uid=2000, preemptible=True)
    events, effects = s.do(m.Submit(spec=ev.JobSpec(command=["x"], uid=1000, user="u1000", gpus=2, priority=9),
                                    by="uid:1000"))
    assert not any(isinstance(e, ev.JobCancelRequested) for e in events) and not any(
        isinstance(e, m.Signal) for e in effects), "stopping one of two would not fit a 2-GPU job"


def test_the_room_a_preemption_makes_is_kept_for_the_job_it_is_made_for() -> None:
    """No other job takes the victims' GPUs while they stop, nor the GPU of
    a victim that stopped first: the urgent job starts once the last has gone."""
    s = teams(gpus=2, preempt_protect_s=0.0)
    victims = [s.submit(uid=2000, gpus=0.5, preemptible=True), s.submit(uid=2000, gpus=1, preemptible=True),
               s.submit(uid=2000, gpus=0.5, preemptible=True)]
    assert s.on(victims[0]) == s.on(victims[2])  # two halves share a GPU
    urgent = s.submit(gpus=2, priority=5)
    stopping = [j for j in victims if s.job(j).cancel_reason == "preempted"]
    assert stopping == victims
    small = s.submit(gpus=0.5)  # it would fit where the first victim was
    s.exit(victims[0], code=None, signal=15)
    assert s.st(small) == "queued" and s.st(urgent) == "queued"
    assert waiting_reason(s.state, small, s.now).text.startswith(
        f"reserved: GPUs 0,1 are being freed for job {urgent} (a preemption)")
    s.exit(victims[1], code=None, signal=15)
    assert s.st(small) == "queued"
    s.exit(victims[2], code=None, signal=15)
    assert s.st(urgent) == "running" and s.st(small) == "queued"


def test_a_preempted_job_is_protected_for_its_minimum_run_time() -> None:
    s = teams(gpus=1, preempt_protect_s=600.0)
    v = s.submit(uid=2000, preemptible=True)
    u1 = s.submit(priority=5)
    s.exit(v, code=None, signal=15)  # preempted, requeued
    s.exit(u1)  # the urgent one ends: the victim runs again
    assert s.st(v) == "running"
    events, _ = s.do(m.Submit(spec=ev.JobSpec(command=["x"], uid=1000, user="u1000", priority=5), by="uid:1000"))
    assert not any(isinstance(e, ev.JobCancelRequested) for e in events)  # protected
    s.now += 601.0
    events, _ = s.do(m.Tick())
    assert [e.job for e in events if isinstance(e, ev.JobCancelRequested)] == [v]


def test_a_tenant_under_its_share_preempts_a_preemptible_tenant_over_it() -> None:
    s = teams(gpus=2, policy="fair-share", usage_half_life_s=3600.0)
    set_tenant(s, "a", users=["u1000"], preemptible=True)
    set_tenant(s, "b", users=["u2000"])
    hogs = [s.submit(), s.submit()]
    s.now += 600.0
    events, _ = s.do(m.Submit(spec=ev.JobSpec(command=["x"], uid=2000, user="u2000"), by="uid:2000"))
    asks = [e for e in events if isinstance(e, ev.JobCancelRequested)]
    assert len(asks) == 1 and asks[0].rule == "fair-share" and asks[0].job in hogs
    # b never preempts a job of a tenant that is not preemptible
    s2 = teams(gpus=1, policy="fair-share")
    set_tenant(s2, "a", users=["u1000"])
    s2.submit()
    s2.now += 600.0
    events, _ = s2.do(m.Submit(spec=ev.JobSpec(command=["x"], uid=2000, user="u2000"), by="uid:2000"))
    assert not any(isinstance(e, ev.JobCancelRequested) for e in events)


# --- arrays' %K cap, in the core ---------------------------------------------------------


def test_an_array_cap_runs_at_most_k_tasks_at_once() -> None:
    s = teams(gpus=4)
    events, _ = s.do(m.Submit(spec=ev.JobSpec(command=["t", "{index}"], uid=1000, user="u1000", array_cap=2),
                              array=list(range(6)), by="uid:1000"))
    ids = [e.job for e in events if isinstance(e, ev.JobSubmitted)]
    assert [s.job(i).spec.command for i in ids[:2]] == [["t", "0"], ["t", "1"]]
    assert {s.job(i).spec.array_id for i in ids} == {ids[0]}
    assert sorted(placed(events)) == ids[:2]
    reason = waiting_reason(s.state, ids[2], s.now)
    assert reason is not None and reason.kind == "array limit"
    events, _ = s.exit(ids[0])
    assert sorted(placed(events)) == [ids[2]]


# --- properties -----------------------------------------------------------------------


class TeamsMachine(CoreMachine):
    """CoreMachine's random commands, with tenants, preemptible jobs and arrays."""

    @initialize(policy=st.sampled_from(sorted(POLICIES)), max_running=st.sampled_from([0, 0, 3]))
    def boot(self, policy: str, max_running: int) -> None:
        super().boot(policy, max_running)
        self.preempted_at: dict[int, list[tuple[float, float | None]]] = {}
        self.do(m.SetTenant(name="a", tenant=Tenant(users=["u1000"], gpus=2.0, preemptible=True), by="uid:0"))
        self.do(m.SetTenant(name="b", tenant=Tenant(users=["u2000"], jobs=2, gpu_mem_mib=20000, weight=2.0),
                            by="uid:0"))

    @rule(gpus=st.sampled_from([0.25, 0.5, 1.0, 2.0]), uid=st.sampled_from([1000, 2000]),
          priority=st.integers(0, 3), preemptible=st.booleans(), cap=st.sampled_from([0, 1, 2]),
          n=st.integers(1, 4))
    def submit_team_job(self, gpus, uid, priority, preemptible, cap, n) -> None:
        spec = ev.JobSpec(command=["t"], uid=uid, user=f"u{uid}", gpus=gpus, priority=priority,
                          preemptible=preemptible, array_cap=cap, gpu_mem_mib=4000 if uid == 2000 else 0)
        self.do(m.Submit(spec=spec, array=list(range(n)) if cap else [], by=f"uid:{uid}"))
        self.note_preemptions()

    @rule(gpus=st.sampled_from([0.25, 1.0, 2.0]), uid=st.sampled_from([1000, 2000]))
    def submit_urgent_job(self, gpus, uid) -> None:
        """A job above every other's priority: what preemption is for."""
        self.do(m.Submit(spec=ev.JobSpec(command=["u"], uid=uid, user=f"u{uid}", gpus=gpus, priority=9),
                         by=f"uid:{uid}"))
        self.note_preemptions()

    def note_preemptions(self) -> None:
        for e in self.last_events:
            # a job stopped because its GPU was lost is not a policy's preemption
            if isinstance(e, ev.JobCancelRequested) and e.reason == "preempted" and e.by != "gpu-lost":
                job = self.state.jobs[e.job]
                self.preempted_at.setdefault(e.job, []).append((e.ts, job.started_at))

    @invariant()
    def quotas_and_caps_are_never_exceeded(self) -> None:
        st_ = self.state
        held: dict[str, list[int]] = {}
        arrays: dict[int, int] = {}
        for jid in st_.running:
            job = st_.jobs[jid]
            h = held.setdefault(job.tenant, [0, 0, 0])
            h[0] += job.count * job.milli
            h[1] += job.count * job.mem_mib
            h[2] += 1
            if job.spec.array_cap:
                arrays[job.spec.array_id] = arrays.get(job.spec.array_id, 0) + 1
                assert arrays[job.spec.array_id] <= job.spec.array_cap, f"array {job.spec.array_id} over its cap"
        for name, (milli, mem, jobs) in held.items():
            quota = st_.tenants.get(name)
            if quota is None:
                continue
            assert quota.gpus is None or milli <= round(quota.gpus * FULL), f"{name} over its GPU quota"
            assert quota.gpu_mem_mib is None or mem <= quota.gpu_mem_mib, f"{name} over its memory quota"
            assert quota.jobs is None or jobs <= quota.jobs, f"{name} over its jobs quota"

    @invariant()
    def no_job_is_preempted_twice_within_its_protected_time(self) -> None:
        self.note_preemptions()
        protect = self.state.config.preempt_protect_s
        for jid, times in self.preempted_at.items():
            for (t1, _), (t2, started) in zip(times, times[1:]):
                assert started is None or t2 >= started + protect or t2 == t1, f"job {jid} preempted again at {t2}"


TeamsMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
TestTeams = TeamsMachine.TestCase
assert NODE and NGPUS  # the machine's GPUs come from CoreMachine's boot
