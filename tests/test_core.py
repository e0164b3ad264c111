"""The sans-I/O core, feature by feature, through ``core.handle`` only."""

from __future__ import annotations

import msgspec
import pytest

from eventsched import core
from eventsched.core.policies import POLICIES
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.projections import snapshot
from eventsched.projections.cluster import (
    ClusterState,
    IllegalTransition,
    apply,
    snapshot_bytes,
    state_from_snapshot,
    validate_state,
)
from eventsched.projections.views import gpu_json, job_json
from eventsched.storage import snapshots

OWNER = 1000


class Sched:
    """A core with a log: every event handle returns is kept for re-folding."""

    def __init__(self, gpus: int = 4, mem: int = 16000, **config: object) -> None:
        self.state = ClusterState()
        self.log: list[ev.Event] = []
        self.now = 100.0
        infos = [m.GpuInfo(gpu=i, uuid=f"GPU-{i}", model="fake", memory_total_mib=mem) for i in range(gpus)]
        self.do(m.Started(node="local", pid=1, version="t", gpu_backend="fake", gpus=infos,
                          config=m.SchedulerConfig(**config)))  # type: ignore[arg-type]

    def do(self, msg: m.Message, at: float | None = None) -> tuple[list[ev.Event], list[m.Effect]]:
        if at is not None:
            self.now = at
        events, effects = core.handle(self.state, msg, self.now)
        self.log.extend(events)
        validate_state(self.state)
        return events, effects

    def submit(self, uid: int = OWNER, by: str = "", **spec: object) -> int:
        spec.setdefault("command", ["python", "train.py"])
        events, _ = self.do(m.Submit(spec=ev.JobSpec(uid=uid, user=f"u{uid}", **spec), by=by or f"uid:{uid}"))  # type: ignore[arg-type]
        assert isinstance(events[0], ev.JobSubmitted)
        return events[0].job

    def refused(self, msg: m.Message) -> str:
        before = snapshot_bytes(self.state)
        with pytest.raises(m.Refused) as info:
            core.handle(self.state, msg, self.now)
        assert snapshot_bytes(self.state) == before, "a refused message changed the state"
        return info.value.reason

    def refused_submit(self, **spec: object) -> str:
        spec.setdefault("command", ["python", "train.py"])
        return self.refused(m.Submit(spec=ev.JobSpec(uid=OWNER, **spec)))  # type: ignore[arg-type]

    def exit(self, job: int, code: int | None = 0, at: float | None = None, **kw: object):
        return self.do(m.ProcessExited(job=job, exit_code=code, **kw), at=at)  # type: ignore[arg-type]

    def job(self, jid: int):
        return self.state.jobs[jid]

    def on(self, jid: int) -> list[int]:
        return list(self.job(jid).gpu_ids)

    def st(self, jid: int) -> str:
        return self.job(jid).state


def placed(events: list[ev.Event]) -> dict[int, list[int]]:
    return {e.job: e.gpu_ids for e in events if isinstance(e, ev.JobPlaced)}


# --- fractional GPUs ------------------------------------------------------------


def test_two_halves_share_one_gpu_and_a_third_half_takes_another():
    s = Sched(gpus=2)
    a, b, c = (s.submit(gpus=0.5) for _ in range(3))
    assert s.on(a) == s.on(b) == [0]
    assert s.on(c) == [1]
    assert gpu_json(s.state.gpu("local", 0))["allocated"] == 1.0


def test_a_gpu_is_never_over_committed():
    s = Sched(gpus=1)
    ids = [s.submit(gpus=0.3) for _ in range(4)]
    assert [s.st(j) for j in ids] == ["running"] * 3 + ["queued"]
    assert s.state.gpu("local", 0).used_milli == 900
    s.exit(ids[0])
    assert s.st(ids[3]) == "running"


@pytest.mark.parametrize("gpus", [1.5, -1.0, float("nan"), float("inf")])
def test_a_share_that_is_neither_a_fraction_nor_whole_gpus_is_refused(gpus):
    s = Sched()
    assert "--gpus" in s.refused_submit(gpus=gpus)


def test_more_gpus_than_the_machine_has_is_refused():
    s = Sched(gpus=4)
    assert "5 GPUs" in s.refused_submit(gpus=5)


def test_cpu_only_job_runs_without_gpus():
    s = Sched(gpus=1)
    s.submit(gpus=1)
    j = s.submit(gpus=0)
    assert s.st(j) == "running" and s.on(j) == []


# --- memory -----------------------------------------------------------------------


def test_memory_request_goes_where_it_fits_and_foreign_memory_counts():
    s = Sched(gpus=2, mem=16000)
    s.do(m.GpuObserved(node="local", gpu=0, utilization=5, memory_used_mib=12000, memory_total_mib=16000,
                       temperature_c=40, power_w=50, foreign_memory_mib=12000))
    j = s.submit(gpus=0.5, gpu_mem_mib=8000)
    assert s.on(j) == [1]
    k = s.submit(gpus=0.5, gpu_mem_mib=8000)
    assert s.on(k) == [1]
    assert s.state.gpu("local", 1).reserved_mib == 16000
    w = s.submit(gpus=0.1, gpu_mem_mib=6000)
    assert s.st(w) == "queued"  # GPU 1 is fully reserved, GPU 0 has only 4000 MiB the others left
    # the foreign process goes away: the waiting job is placed
    s.do(m.GpuObserved(node="local", gpu=0, utilization=0, memory_used_mib=0, memory_total_mib=16000,
                       temperature_c=40, power_w=50, foreign_memory_mib=0))
    assert s.st(w) == "running" and s.on(w) == [0]


def test_memory_request_larger_than_any_gpu_is_refused():
    s = Sched(gpus=2, mem=16000)
    assert "MiB" in s.refused_submit(gpus=1, gpu_mem_mib=20000)


# --- pinning ----------------------------------------------------------------------


def test_pinned_job_waits_for_its_gpu():
    s = Sched(gpus=4)
    a = s.submit(gpus=1, gpu_ids=[2])
    assert s.on(a) == [2]
    b = s.submit(gpus=1, gpu_ids=[2])
    assert s.st(b) == "queued"
    s.exit(a)
    assert s.on(b) == [2]


def test_allowed_set_picks_within_it():
    s = Sched(gpus=4)
    j = s.submit(gpus=2, gpu_ids=[1, 3])
    assert s.on(j) == [1, 3]


def test_unknown_gpu_id_is_refused():
    s = Sched(gpus=4)
    assert "unknown GPU id 7" in s.refused_submit(gpus=1, gpu_ids=[7])
    assert "only 1" in s.refused_submit(gpus=2, gpu_ids=[1])


# --- priority ---------------------------------------------------------------------


def test_higher_priority_runs_first_fifo_within():
    s = Sched(gpus=1)
    blocker = s.submit(gpus=1)
    low = s.submit(gpus=1, priority=0)
    high1 = s.submit(gpus=1, priority=5)
    high2 = s.submit(gpus=1, priority=5)
    s.exit(blocker)
    assert s.st(high1) == "running"
    s.exit(high1)
    assert s.st(high2) == "running"
    s.exit(high2)
    assert s.st(low) == "running"


# --- best-fit packing --------------------------------------------------------------


def test_best_fit_keeps_whole_gpus_free():
    s = Sched(gpus=3)
    a = s.submit(gpus=0.5)
    b = s.submit(gpus=0.7, gpu_ids=[1])
    c = s.submit(gpus=0.3)  # fits both 0 (0.5 left) and 1 (0.3 left): tightest is 1
    assert (s.on(a), s.on(b), s.on(c)) == ([0], [1], [1])
    d = s.submit(gpus=1)
    assert s.on(d) == [2]


def test_small_jobs_pack_onto_one_gpu():
    s = Sched(gpus=4)
    ids = [s.submit(gpus=0.25) for _ in range(4)]
    assert all(s.on(j) == [0] for j in ids)
    assert s.st(s.submit(gpus=3)) == "running"


# --- gang -------------------------------------------------------------------------


def test_gang_job_gets_all_its_gpus_at_once_or_waits():
    s = Sched(gpus=4)
    small = [s.submit(gpus=1) for _ in range(3)]
    gang = s.submit(gpus=2)
    assert s.st(gang) == "queued" and s.on(gang) == []
    s.exit(small[0])
    assert s.on(gang) == [0, 3]


# --- pause / resume ---------------------------------------------------------------


def test_paused_gpu_gets_nothing_new_and_running_jobs_go_on():
    s = Sched(gpus=1)
    a = s.submit(gpus=0.5)
    events, _ = s.do(m.PauseGpu(node="local", gpu=0, by="uid:0"))
    assert isinstance(events[0], ev.GpuPaused)
    b = s.submit(gpus=0.5)
    assert s.st(a) == "running" and s.st(b) == "queued"
    events, effects = s.do(m.ResumeGpu(node="local", gpu=0))
    assert placed(events) == {b: [0]}
    assert any(isinstance(x, m.Launch) and x.job == b for x in effects)


def test_pausing_an_unknown_gpu_is_refused():
    s = Sched(gpus=1)
    assert "no GPU 9" in s.refused(m.PauseGpu(node="local", gpu=9))


# --- cancel -----------------------------------------------------------------------


def test_cancel_queued_and_running_jobs():
    s = Sched(gpus=1)
    run = s.submit(gpus=1)
    wait = s.submit(gpus=1)
    events, effects = s.do(m.Cancel(jobs=[wait], uid=OWNER))
    by = f"uid:{OWNER}"
    n = events[0].seq
    # the command is a fact; the cancellation is a decision that names it
    assert events == [
        ev.JobsCommanded(seq=n, ts=s.now, cause=by, command="cancel", jobs=[wait], by=by),
        ev.JobCancelled(seq=n + 1, ts=s.now, cause=f"seq:{n}", job=wait, by=by),
    ]
    assert s.st(wait) == "cancelled"
    events, effects = s.do(m.Cancel(jobs=[run], uid=OWNER))
    assert isinstance(events[1], ev.JobCancelRequested) and events[1].cause == f"seq:{events[0].seq}"
    assert [x for x in effects if isinstance(x, m.Signal)] == [m.Signal(job=run, grace_s=10.0, reason="cancelled")]
    assert s.st(run) == "running"  # until the process is gone
    s.exit(run, None, signal=15)
    assert s.st(run) == "cancelled"
    assert job_json(s.job(run))["state"] == "cancelled"


def test_only_owner_or_root_may_cancel():
    s = Sched(gpus=1)
    j = s.submit(gpus=1)
    assert "belongs to" in s.refused(m.Cancel(jobs=[j], uid=2000))
    s.do(m.Cancel(jobs=[j], uid=0))
    assert s.job(j).cancel_reason == "cancelled"


def test_cancel_unknown_or_finished_job_is_refused():
    s = Sched(gpus=1)
    j = s.submit(gpus=1)
    assert s.refused(m.Cancel(jobs=[99], uid=0)) == "no job 99"
    s.exit(j)
    assert "already succeeded" in s.refused(m.Cancel(jobs=[j], uid=0))


# --- time limits -----------------------------------------------------------------


def test_time_limit_kills_the_job():
    s = Sched(gpus=1)
    j = s.submit(gpus=1, time_limit_s=60)
    _, effects = s.do(m.Tick(), at=s.now)
    assert m.WakeAt(at=s.job(j).started_at + 60) in effects
    events, effects = s.do(m.Tick(), at=s.now + 61)
    assert [(e.job, e.reason) for e in events if isinstance(e, ev.JobCancelRequested)] == [(j, "time-limit")]
    assert any(isinstance(x, m.Signal) and x.reason == "time-limit" for x in effects)
    s.exit(j, None, signal=15)
    assert s.st(j) == "failed" and s.job(j).reason == "time-limit"


def test_time_limit_requeue_goes_to_the_back():
    s = Sched(gpus=1, default_time_limit_s=30.0)
    a = s.submit(gpus=1, on_time_limit="requeue")
    b = s.submit(gpus=1)
    s.do(m.Tick(), at=s.now + 31)
    events, _ = s.exit(a, None, signal=15)
    assert [type(e) for e in events][:2] == [ev.JobExited, ev.JobRequeued]
    assert s.st(b) == "running" and s.st(a) == "queued"
    s.exit(b)
    assert s.st(a) == "running" and s.job(a).attempts == 2


# --- thresholds -------------------------------------------------------------------


def test_hot_or_busy_gpus_are_skipped():
    s = Sched(gpus=2, max_gpu_temperature_c=80.0, max_gpu_utilization_pct=90.0)
    s.do(m.GpuObserved(node="local", gpu=0, utilization=10, memory_used_mib=0, memory_total_mib=16000,
                       temperature_c=85, power_w=1))
    s.do(m.GpuObserved(node="local", gpu=1, utilization=95, memory_used_mib=0, memory_total_mib=16000,
                       temperature_c=50, power_w=1))
    j = s.submit(gpus=0.5)
    assert s.st(j) == "queued"
    s.do(m.GpuObserved(node="local", gpu=0, utilization=10, memory_used_mib=0, memory_total_mib=16000,
                       temperature_c=60, power_w=1))
    assert s.on(j) == [0]


def test_new_thresholds_apply_at_once_to_every_node():
    s = Sched(gpus=1, max_gpu_temperature_c=80.0)
    s.do(m.GpuObserved(node="local", gpu=0, utilization=10, memory_used_mib=0, memory_total_mib=16000,
                       temperature_c=85, power_w=1))
    j = s.submit(gpus=1.0)
    assert s.st(j) == "queued"
    # a GPU-less node joins with a laxer threshold: the hot GPU elsewhere is usable again
    s.do(m.Started(node="cpu-box", pid=2, version="t", gpu_backend="fake", gpus=[],
                   config=m.SchedulerConfig(node="cpu-box", max_gpu_temperature_c=90.0)))
    assert s.on(j) == [0]


# --- dependencies, hold / release ----------------------------------------------------


def test_after_runs_only_when_the_dependency_succeeded():
    s = Sched(gpus=2)
    a = s.submit(gpus=1)
    b = s.submit(gpus=1, after=[a])
    assert s.st(b) == "queued"
    s.exit(a, 0)
    assert s.st(b) == "running"


def test_after_a_failed_job_the_dependent_is_cancelled():
    s = Sched(gpus=2)
    a = s.submit(gpus=1)
    b = s.submit(gpus=1, after=[a])
    c = s.submit(gpus=1, after=[b])
    s.exit(a, 1)
    assert (s.st(b), s.st(c)) == ("cancelled", "cancelled")
    assert "already failed" in s.refused_submit(after=[a])
    assert "no job 42" in s.refused_submit(after=[42])


def test_hold_and_release():
    s = Sched(gpus=1)
    run = s.submit(gpus=1)
    j = s.submit(gpus=1)
    s.do(m.Hold(jobs=[j], uid=OWNER))
    assert s.st(j) == "held"
    s.exit(run)
    assert s.st(j) == "held"
    events, _ = s.do(m.Release(jobs=[j], uid=OWNER))
    assert s.st(j) == "running"
    assert "belongs to" in s.refused(m.Hold(jobs=[j], uid=7))
    assert "only waiting jobs" in s.refused(m.Hold(jobs=[j], uid=OWNER))


# --- retries ----------------------------------------------------------------------


def test_failed_job_is_retried_with_exponential_backoff():
    s = Sched(gpus=1, retry_backoff_s=2.0)
    j = s.submit(gpus=1, retries=2)
    t0 = s.now
    events, effects = s.exit(j, 1)
    req = [e for e in events if isinstance(e, ev.JobRequeued)]
    assert req[0].reason == "retry" and req[0].not_before == t0 + 2
    assert m.WakeAt(at=t0 + 2) in effects
    assert s.st(j) == "queued"
    s.do(m.Tick(), at=t0 + 1)
    assert s.st(j) == "queued"
    s.do(m.Tick(), at=t0 + 2)
    assert s.st(j) == "running"
    events, _ = s.exit(j, 1, at=t0 + 3)
    assert [e.not_before for e in events if isinstance(e, ev.JobRequeued)] == [t0 + 3 + 4]
    s.do(m.Tick(), at=t0 + 7)
    s.exit(j, 1, at=t0 + 8)
    assert s.st(j) == "failed" and s.job(j).attempts == 3


# --- de-duplication ----------------------------------------------------------------


def test_duplicate_is_refused_with_the_existing_id_until_it_failed():
    s = Sched(gpus=1)
    j = s.submit(gpus=1, content_hash="abc")
    assert f"duplicate of job {j}" in s.refused_submit(gpus=1, content_hash="abc")
    s.exit(j, 1)
    k = s.submit(gpus=1, content_hash="abc")
    s.exit(k, 0)
    assert f"duplicate of job {k} (succeeded)" in s.refused_submit(gpus=1, content_hash="abc")


# --- I9 limits ----------------------------------------------------------------------


def test_queue_limit_and_max_running():
    s = Sched(gpus=4, max_queued=2, max_running=1)
    a = s.submit(gpus=0.1)
    b = s.submit(gpus=0.1)
    c = s.submit(gpus=0.1)
    assert (s.st(a), s.st(b), s.st(c)) == ("running", "queued", "queued")
    assert "queue is full" in s.refused_submit(gpus=0.1)
    s.exit(a)
    assert s.st(b) == "running" and s.st(c) == "queued"


# --- policies ----------------------------------------------------------------------


def test_fifo_blocks_at_the_head_priority_skips():
    # (without a reservation for the blocked gang job: see tests/test_teams.py)
    for policy, expect in (("fifo", "queued"), ("priority", "running")):
        s = Sched(gpus=2, policy=policy, reserve_for_gang=False)
        s.submit(gpus=1)
        big = s.submit(gpus=2)
        small = s.submit(gpus=1)
        assert s.st(big) == "queued"
        assert s.st(small) == expect, policy


def test_set_policy_is_recorded_and_unknown_names_refused():
    s = Sched()
    events, _ = s.do(m.SetPolicy(policy="fifo", by="uid:0"))
    assert events == [ev.PolicyChanged(seq=s.state.last_seq, ts=s.now, cause="uid:0", policy="fifo", by="uid:0")]
    assert s.do(m.SetPolicy(policy="fifo", by="uid:0"))[0] == []  # the same policy again: nothing to record
    assert "unknown policy" in s.refused(m.SetPolicy(policy="nope"))
    assert set(POLICIES) >= {"fifo", "priority", "best-fit", "sjf-backfill", "fgd"}


def test_sjf_backfill_runs_the_historically_short_job_first():
    s = Sched(gpus=1, policy="sjf-backfill")
    for name, dur in (("long", 1000.0), ("short", 10.0)):
        j = s.submit(gpus=1, name=name)
        s.exit(j, 0, at=s.now + dur)
    blocker = s.submit(gpus=1, name="x")
    long = s.submit(gpus=1, name="long")
    short = s.submit(gpus=1, name="short")
    s.exit(blocker, 0, at=s.now + 5)
    assert s.st(short) == "running" and s.st(long) == "queued"


def test_sjf_backfill_does_not_delay_the_head_reservation():
    s = Sched(gpus=2, policy="sjf-backfill")
    for name, dur in (("a", 100.0), ("quick", 10.0), ("slow", 500.0)):
        j = s.submit(gpus=1, name=name)
        s.exit(j, 0, at=s.now + dur)
    a = s.submit(gpus=1, name="a")  # runs ~100 s on GPU 0
    big = s.submit(gpus=2, name="big", priority=1)  # head: waits for GPU 0, reserves both
    slow = s.submit(gpus=1, name="slow")  # would delay big: stays queued
    quick = s.submit(gpus=1, name="quick")  # ends before a: backfilled
    assert s.st(a) == "running" and s.st(big) == "queued"
    assert s.st(quick) == "running" and s.st(slow) == "queued"


def test_fgd_places_fractional_jobs_without_fragmenting():
    s = Sched(gpus=4, policy="fgd")
    ids = [s.submit(gpus=0.5) for _ in range(4)]
    used = sorted({s.on(j)[0] for j in ids})
    assert len(used) == 2  # halves are paired, two whole GPUs stay free
    assert s.st(s.submit(gpus=2)) == "running"


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_is_deterministic(policy):
    def run() -> bytes:
        s = Sched(gpus=4, policy=policy)
        for i in range(30):
            s.submit(gpus=[0.3, 1, 2, 0.5, 0.2][i % 5], priority=i % 3, name=f"n{i % 4}")
            if i % 4 == 3:
                running = sorted(s.state.running)
                s.exit(running[i % len(running)], i % 2, at=s.now + 7)
        return snapshot_bytes(s.state)

    assert run() == run()


# --- the projection ----------------------------------------------------------------


def test_illegal_transition_raises_and_changes_nothing():
    s = Sched(gpus=1)
    j = s.submit(gpus=1)
    s.exit(j)
    before = snapshot_bytes(s.state)
    with pytest.raises(IllegalTransition):
        apply(s.state, ev.JobPlaced(job=j, node="local", gpu_ids=[0], share=1.0))
    with pytest.raises(IllegalTransition):
        apply(s.state, ev.JobRequeued(job=j))
    assert snapshot_bytes(s.state) == before


def test_duplicate_exit_reports_are_ignored():
    s = Sched(gpus=1)
    j = s.submit(gpus=1)
    s.exit(j)
    assert s.exit(j, 1)[0] == []


def test_restart_marks_missing_gpus_lost_and_records_policy_change():
    s = Sched(gpus=2)
    j = s.submit(gpus=1, gpu_ids=[1])
    infos = [m.GpuInfo(gpu=0, uuid="GPU-0", model="fake", memory_total_mib=16000)]
    events, _ = s.do(m.Started(node="local", pid=2, version="t", gpu_backend="fake", gpus=infos,
                               config=m.SchedulerConfig(policy="fifo")))
    kinds = [type(e) for e in events]
    assert ev.PolicyChanged in kinds and ev.GpuErrored in kinds
    assert s.state.gpu("local", 1).lost and s.st(j) == "running"
    assert s.state.policy == "fifo"


def test_folding_the_log_from_scratch_gives_the_live_state():
    s = Sched(gpus=2)
    a = s.submit(gpus=0.5, retries=1)
    s.submit(gpus=2)
    s.exit(a, 1)
    s.do(m.Tick(), at=s.now + 10)
    fresh = ClusterState()
    for e in s.log:
        apply(fresh, e)
    assert fresh == s.state
    assert state_from_snapshot(snapshot_bytes(s.state)) == s.state


# --- snapshots ----------------------------------------------------------------------


def _stamped(s: Sched) -> list[ev.Event]:
    return ev.stamp(s.log, 1)


def test_snapshot_plus_tail_equals_full_fold_and_deleting_snapshots_is_harmless(tmp_path):
    s = Sched(gpus=2)
    for i in range(6):
        s.submit(gpus=0.5, priority=i)
    s.exit(1, 0, at=s.now + 3)
    log = _stamped(s)
    half = len(log) // 2
    partial = ClusterState()
    for e in log[:half]:
        apply(partial, e)
    snapshot.save(tmp_path, partial)
    restored = snapshot.load_latest(tmp_path)
    assert restored is not None and restored.last_seq == half
    for e in log[half:]:
        apply(restored, e)
    full = ClusterState()
    for e in log:
        apply(full, e)
    assert restored == full
    for p in tmp_path.iterdir():
        p.unlink()
    assert snapshot.load_latest(tmp_path) is None


def test_corrupt_newest_snapshot_is_skipped_and_only_two_are_kept(tmp_path):
    s = Sched(gpus=2)
    log = _stamped(s)
    state = ClusterState()
    for e in log:
        apply(state, e)
        snapshot.save(tmp_path, state)
    assert len(snapshots.list_snapshots(tmp_path)) == 2
    newest = snapshots.list_snapshots(tmp_path)[-1][1]
    raw = bytearray(newest.read_bytes())
    raw[-3] ^= 0xFF
    newest.write_bytes(bytes(raw))
    older = snapshot.load_latest(tmp_path)
    assert older is not None and older.last_seq == log[-2].seq


def test_job_json_has_the_queue_contract_keys():
    s = Sched(gpus=1)
    j = s.submit(gpus=0.5, name="train")
    doc = job_json(s.job(j))
    for key in ("id", "name", "user", "state", "priority", "gpus", "gpu_ids", "submitted_at",
                "started_at", "ended_at", "exit_code"):
        assert key in doc
    assert doc["gpu_ids"] == [0] and doc["gpus"] == 0.5 and doc["name"] == "train"
    g = gpu_json(s.state.gpu("local", 0))
    for key in ("id", "allocated", "paused", "utilization", "memory_used_mib", "memory_total_mib", "temperature_c"):
        assert key in g
    msgspec.json.encode([doc, g])  # JSON-ready


def test_cancel_between_placement_and_start_signals_once_the_process_exists() -> None:
    """A job cancelled before its process started must still be stopped."""
    from eventsched import core
    from eventsched.domain.events import JobSpec
    from eventsched.domain.messages import (
        Cancel,
        GpuInfo,
        ProcessStarted,
        SchedulerConfig,
        Signal,
        Started,
        Submit,
    )
    from eventsched.projections.cluster import ClusterState

    state = ClusterState()
    core.handle(state, Started(node="local", pid=1, version="t", gpu_backend="fake:1",
                               gpus=[GpuInfo(gpu=0, uuid="u0", model="m", memory_total_mib=1000)],
                               config=SchedulerConfig()), 0.0)
    events, _ = core.handle(state, Submit(spec=JobSpec(command=["sleep", "60"], uid=1000, gpus=1.0)), 1.0)
    job = events[0].job
    assert state.jobs[job].state == "running"  # placed, launch in flight
    core.handle(state, Cancel(jobs=[job], uid=1000), 2.0)
    _, effects = core.handle(state, ProcessStarted(job=job, pid=4242, start_time=7), 2.1)
    assert [e for e in effects if isinstance(e, Signal) and e.job == job and e.reason == "cancelled"]


def test_a_job_placed_but_never_launched_is_queued_again_on_restart() -> None:
    from eventsched import core
    from eventsched.domain.events import JobSpec
    from eventsched.domain.messages import (
        GpuInfo,
        Launch,
        NeverLaunched,
        SchedulerConfig,
        Started,
        Submit,
    )
    from eventsched.projections.cluster import ClusterState

    state = ClusterState()
    started = Started(node="local", pid=1, version="t", gpu_backend="fake:1",
                      gpus=[GpuInfo(gpu=0, uuid="u0", model="m", memory_total_mib=1000)], config=SchedulerConfig())
    core.handle(state, started, 0.0)
    events, _ = core.handle(state, Submit(spec=JobSpec(command=["true"], uid=1000, gpus=1.0)), 1.0)
    job = events[0].job
    assert state.jobs[job].state == "running"
    # the daemon stopped before the launch began; on restart:
    core.handle(state, started, 5.0)
    events, effects = core.handle(state, NeverLaunched(job=job, reason="stopped"), 5.0)
    assert [type(e).__name__ for e in events][:2] == ["JobExited", "JobRequeued"]
    assert state.jobs[job].state == "running"  # placed again at once on the free GPU
    assert state.jobs[job].attempts == 2
    assert [e for e in effects if isinstance(e, Launch) and e.job == job]


# --- exact output for one stimulus (dask's test_worker_state_machine style) ------------


def test_a_submission_that_fits_is_its_fact_then_a_placement_naming_it() -> None:
    s = Sched(gpus=2)
    n = s.state.last_seq + 1
    events, effects = s.do(m.Submit(spec=ev.JobSpec(command=["train"], uid=OWNER, user="alice", gpus=1.0),
                                    by=f"uid:{OWNER}"))
    spec = s.job(1).spec
    assert events == [
        ev.JobSubmitted(seq=n, ts=s.now, cause=f"uid:{OWNER}", job=1, spec=spec),
        ev.JobPlaced(seq=n + 1, ts=s.now, cause=f"seq:{n}", job=1, node="local", gpu_ids=[0], share=1.0,
                     gpu_mem_mib=0, policy="best-fit"),
    ]
    assert effects == [m.Launch(job=1, spec=spec, node="local", gpu_ids=[0])]


def test_a_failed_run_with_retries_left_is_requeued_by_its_exit() -> None:
    s = Sched(gpus=1, retry_backoff_s=5.0)
    job = s.submit(gpus=1, retries=1)
    n = s.state.last_seq + 1
    events, effects = s.do(m.ProcessExited(job=job, exit_code=3), at=200.0)
    assert events == [
        ev.JobExited(seq=n, ts=200.0, cause=f"exit:job {job}", job=job, exit_code=3, outcome="failed"),
        ev.JobRequeued(seq=n + 1, ts=200.0, cause=f"seq:{n}", job=job, reason="retry", not_before=205.0),
    ]
    assert effects == [m.WakeAt(at=205.0)]


def test_a_time_limit_is_a_timer_fact_then_a_stop_naming_it() -> None:
    s = Sched(gpus=1, kill_grace_s=2.0)
    job = s.submit(gpus=1, time_limit_s=10.0)
    s.do(m.ProcessStarted(job=job, pid=77), at=100.0)
    n = s.state.last_seq + 1
    events, effects = s.do(m.Tick(), at=111.0)
    assert events == [
        ev.TimerFired(seq=n, ts=111.0, cause="timer"),
        ev.JobCancelRequested(seq=n + 1, ts=111.0, cause=f"seq:{n}", job=job, by="timer", reason="time-limit"),
    ]
    assert effects == [m.Signal(job=job, grace_s=2.0, reason="time-limit")]
    # a tick with nothing due records nothing at all
    assert s.do(m.Tick(), at=111.5) == ([], [])


def test_an_unknown_state_event_pair_is_refused_and_changes_nothing() -> None:
    from eventsched.domain.states import IllegalTransition
    from eventsched.projections.cluster import apply, snapshot_bytes

    s = Sched(gpus=1)
    job = s.submit(gpus=1)
    before = snapshot_bytes(s.state)
    with pytest.raises(IllegalTransition, match="JobReleased is not allowed while running"):
        apply(s.state, ev.JobReleased(seq=s.state.last_seq + 1, job=job))
    assert snapshot_bytes(s.state) == before


def test_a_spec_built_in_python_is_stored_as_the_log_will_decode_it():
    """An int where a float belongs (and a tuple for a list) is normalised
    before it is recorded, so the live state and a restart agree; a spec
    from msgspec's decoder (``normalised``, the socket) is taken as it is."""
    s = Sched()
    events, _ = s.do(m.Submit(spec=ev.JobSpec(command=("python", "x.py"), gpus=1, uid=OWNER, user="u"), by="t"))  # type: ignore[arg-type]
    spec = events[0].spec
    assert type(spec.gpus) is float and type(spec.command) is list
    assert spec == ev.decode(ev.encode(events[0])).spec
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(ev.JobSpec(command=["y"], gpus=2, uid=OWNER)), type=ev.JobSpec)
    assert type(wire.gpus) is float  # what the decoder gives the server
    events, _ = s.do(m.Submit(spec=wire, by="t", normalised=True))
    assert events[0].spec.command == ["y"] and events[0].spec.gpus == 2.0
    assert events[0].spec == ev.decode(ev.encode(events[0])).spec
