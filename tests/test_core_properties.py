"""Random sequences of commands, exits and clock ticks through the core, with
the scheduler's invariants checked after every step.

``validate_state`` also checks that every index the projection keeps
incrementally (capacity of the usable GPUs, per-node GPU lists, time-limit
deadlines, the submission-check cache, the queue) equals a recomputation from
the facts, so the rules below also lose GPUs, restart nodes with other
settings and add a second node."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from eventsched import core
from eventsched.core.policies import POLICIES
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.projections.cluster import (
    FULL,
    ClusterState,
    apply,
    snapshot_bytes,
    state_from_snapshot,
    validate_state,
)

NODE = "local"
NGPUS = 4
MEM = 16000
NODE2 = "n2"  # a second, smaller node some runs add
MEM2 = 8000
# "failed" too: a retry or requeue happens in the same step as the exit
FINAL_FOR_GOOD = ("succeeded", "failed", "cancelled", "lost")


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = ClusterState()
        self.log: list[ev.Event] = []  # stamped, as the engine's log holds them
        self.now = 1000.0
        self.final: dict[int, str] = {}
        self.last_events: list[ev.Event] = []

    # --- plumbing -------------------------------------------------------------

    def do(self, msg: m.Message) -> list[ev.Event]:
        before = snapshot_bytes(self.state)
        try:
            events, effects = core.handle(self.state, msg, self.now)
        except m.Refused:
            assert snapshot_bytes(self.state) == before, "a refusal changed the state"
            self.last_events = []
            return []
        # through the log's encoding, exactly as a restart would read them
        stamped = ev.stamp(events, len(self.log) + 1)
        self.log.extend(ev.decode_many(ev.encode_many(stamped)))
        self.state.last_seq = len(self.log)
        for e in effects:
            if isinstance(e, m.Launch):
                assert self.state.jobs[e.job].state == "running"
        self.last_events = events
        return events

    def ids(self) -> list[int]:
        return sorted(self.state.jobs)

    def config(self, node: str, policy: str, limit: float | None = 500.0, hot: float = 85.0) -> m.SchedulerConfig:
        return m.SchedulerConfig(node=node, policy=policy, max_running=self.max_running, default_time_limit_s=limit,
                                 max_gpu_temperature_c=hot, retry_backoff_s=5.0)

    @initialize(policy=st.sampled_from(sorted(POLICIES)), max_running=st.sampled_from([0, 0, 3]))
    def boot(self, policy: str, max_running: int) -> None:
        self.max_running = max_running
        infos = [m.GpuInfo(gpu=i, uuid=f"GPU-{i}", model="fake", memory_total_mib=MEM) for i in range(NGPUS)]
        self.do(m.Started(node=NODE, pid=1, version="t", gpu_backend="fake", gpus=infos, config=self.config(NODE, policy)))

    # --- stimuli --------------------------------------------------------------

    @rule(
        gpus=st.sampled_from([0.0, 0.1, 0.25, 0.3, 0.5, 0.7, 1.0, 2.0, 3.0, 5.0]),
        mem=st.sampled_from([0, 0, 4000, 12000]),
        pinned=st.one_of(st.none(), st.lists(st.integers(0, NGPUS), min_size=1, max_size=3, unique=True)),
        priority=st.integers(0, 3),
        retries=st.integers(0, 2),
        limit=st.sampled_from([None, None, 30.0]),
        on_limit=st.sampled_from(["kill", "requeue"]),
        after=st.integers(0, 40),
        uid=st.sampled_from([1000, 2000]),
        chash=st.sampled_from(["", "", "h1", "h2"]),
        node=st.sampled_from(["", "", "", NODE, NODE2]),
    )
    def submit(self, gpus, mem, pinned, priority, retries, limit, on_limit, after, uid, chash, node) -> None:
        deps = [after] if after in self.state.jobs and after % 3 == 0 else []
        spec = ev.JobSpec(command=["job"], uid=uid, user=f"u{uid}", gpus=gpus, gpu_mem_mib=mem, gpu_ids=pinned,
                          priority=priority, retries=retries, time_limit_s=limit, on_time_limit=on_limit,
                          after=deps, content_hash=chash, name=f"n{priority}", node=node)
        self.do(m.Submit(spec=spec, by=f"uid:{uid}"))

    @precondition(lambda self: self.state.jobs)
    @rule(data=st.data(), uid=st.sampled_from([0, 1000, 2000]), kind=st.sampled_from(["cancel", "hold", "release"]))
    def command(self, data, uid, kind) -> None:
        jid = data.draw(st.sampled_from(self.ids()))
        cls = {"cancel": m.Cancel, "hold": m.Hold, "release": m.Release}[kind]
        self.do(cls(jobs=[jid], uid=uid))

    @precondition(lambda self: self.state.running)
    @rule(data=st.data(), code=st.sampled_from([0, 0, 1, None]))
    def exit(self, data, code) -> None:
        jid = data.draw(st.sampled_from(sorted(self.state.running)))
        self.now += data.draw(st.sampled_from([0.0, 1.0, 20.0]))
        self.do(m.ProcessExited(job=jid, exit_code=code, signal=None if code is not None else 9))

    @precondition(lambda self: self.state.running)
    @rule(data=st.data())
    def started(self, data) -> None:
        jid = data.draw(st.sampled_from(sorted(self.state.running)))
        self.do(m.ProcessStarted(job=jid, pid=10000 + jid))

    @rule(dt=st.sampled_from([0.0, 3.0, 10.0, 40.0, 600.0]))
    def tick(self, dt) -> None:
        self.now += dt
        self.do(m.Tick())

    @rule(gpu=st.integers(0, NGPUS - 1), pause=st.booleans())
    def pause(self, gpu, pause) -> None:
        self.do((m.PauseGpu if pause else m.ResumeGpu)(node=NODE, gpu=gpu))

    @rule(gpu=st.integers(0, NGPUS - 1), foreign=st.sampled_from([-1, 0, 8000]), temp=st.sampled_from([40.0, 90.0]),
          node=st.sampled_from([NODE, NODE, NODE2]))
    def sample(self, gpu, foreign, temp, node) -> None:
        if (node, gpu) not in self.state.gpus:
            return
        total = self.state.gpu(node, gpu).memory_total_mib
        used = self.state.gpu(node, gpu).reserved_mib + max(foreign, 0)
        self.do(m.GpuObserved(node=node, gpu=gpu, utilization=50.0, memory_used_mib=min(used, total),
                              memory_total_mib=total, temperature_c=temp, power_w=100.0, foreign_memory_mib=foreign))

    @rule(policy=st.sampled_from(sorted(POLICIES)))
    def set_policy(self, policy) -> None:
        self.do(m.SetPolicy(policy=policy))

    @rule(gpus=st.integers(1, 3))
    def add_node(self, gpus) -> None:
        infos = [m.GpuInfo(gpu=i, uuid=f"{NODE2}-{i}", model="small", memory_total_mib=MEM2) for i in range(gpus)]
        self.do(m.Started(node=NODE2, pid=2, version="t", gpu_backend="fake", gpus=infos,
                          config=self.config(NODE2, self.state.policy)))

    @rule(
        keep=st.lists(st.integers(0, NGPUS - 1), unique=True),
        limit=st.sampled_from([500.0, 50.0, None]),
        hot=st.sampled_from([85.0, 95.0]),
    )
    def restart(self, keep, limit, hot) -> None:
        """The daemon restarts with other settings; GPUs it no longer finds are lost."""
        infos = [m.GpuInfo(gpu=i, uuid=f"GPU-{i}", model="fake", memory_total_mib=MEM) for i in sorted(keep)]
        self.do(m.Started(node=NODE, pid=3, version="t", gpu_backend="fake", gpus=infos,
                          config=self.config(NODE, self.state.policy, limit, hot)))

    @rule(gpu=st.integers(0, NGPUS - 1), lost=st.booleans())
    def gpu_fails(self, gpu, lost) -> None:
        self.do(m.GpuFailed(node=NODE, gpu=gpu, error="XID 79", lost=lost))

    # --- invariants -------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        validate_state(self.state)  # shares <= 1, gang all-or-nothing, indices in step

    @invariant()
    def placements_obey_the_rules(self) -> None:
        cfg = self.state.config
        for e in self.last_events:
            if isinstance(e, ev.JobPlaced):
                job = self.state.jobs[e.job]
                assert len(e.gpu_ids) == job.count
                for gid in e.gpu_ids:
                    gpu = self.state.gpu(e.node, gid)
                    assert not gpu.paused and not gpu.lost, f"job {e.job} placed on paused/lost GPU {gid}"
                    assert gpu.temperature_c is None or gpu.temperature_c <= cfg.max_gpu_temperature_c
                    if job.spec.gpu_ids is not None:
                        assert gid in job.spec.gpu_ids
        for gpu in self.state.gpus.values():
            assert gpu.used_milli <= FULL
            assert gpu.reserved_mib <= gpu.memory_total_mib
        if cfg.max_running:
            assert len(self.state.running) <= cfg.max_running

    @invariant()
    def final_states_are_final(self) -> None:
        for jid, job in self.state.jobs.items():
            if jid in self.final:
                assert job.state == self.final[jid], f"job {jid} left {self.final[jid]} for {job.state}"
            elif job.state in FINAL_FOR_GOOD:
                self.final[jid] = job.state

    @invariant()
    def the_log_folds_to_the_live_state(self) -> None:
        fresh = ClusterState()
        for e in self.log:
            apply(fresh, e)
        assert fresh == self.state
        assert state_from_snapshot(snapshot_bytes(self.state)) == self.state

    def teardown(self) -> None:
        # drain: cancel everything, let every process exit; all jobs end final
        for _ in range(3):
            live = [j for j, job in self.state.jobs.items() if job.state in ("queued", "held", "running", "preempted")]
            if live:
                self.do(m.Cancel(jobs=live, uid=0))
            for jid in sorted(self.state.running):
                self.do(m.ProcessExited(job=jid, exit_code=None, signal=15))
            validate_state(self.state)
        for job in self.state.jobs.values():
            assert job.state in ("succeeded", "failed", "cancelled", "lost"), (job.id, job.state)
        fresh = ClusterState()
        for e in self.log:
            apply(fresh, e)
        assert fresh == self.state


CoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCore = CoreMachine.TestCase
