"""GPU memory and idle jobs in the core: declared GPU memory enforced,
allocated-but-idle jobs flagged and (opt-in) reclaimed; every finding a decision naming its fact, and
the log folds back to the live state."""

from __future__ import annotations

import signal

import msgspec

from eventsched.core.scheduler import handle
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.domain.states import GPU_MEMORY_OVER
from eventsched.projections.cluster import (
    ClusterState,
    apply,
    snapshot_bytes,
    state_from_snapshot,
    validate_state,
)
from eventsched.runtime.gpus import FakeBackend, attribute, significant
from tests.test_core import Sched


def sample(s: Sched, gpu: int, util: float = 50.0, jobs: dict[int, int] | None = None,
           foreign: list[ev.GpuProcess] | None = None, at: float | None = None) -> tuple[list[ev.Event], list[m.Effect]]:
    return s.do(m.GpuObserved(node="local", gpu=gpu, utilization=util, memory_used_mib=sum((jobs or {}).values()),
                              memory_total_mib=16000, temperature_c=40.0, power_w=100.0,
                              foreign_memory_mib=sum(p.used_mib for p in foreign or []),
                              job_memory_mib=jobs or {}, foreign_processes=foreign or []), at=at)


def of(events: list[ev.Event], kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


def refold(s: Sched) -> None:
    """The log folds to the live state, and a snapshot round-trips it."""
    fresh = ClusterState()
    for e in s.log:
        apply(fresh, e)
    assert snapshot_bytes(fresh) == snapshot_bytes(s.state)
    validate_state(state_from_snapshot(snapshot_bytes(s.state)))


# --- memory ---------------------------------------------------------------------


def test_a_job_over_its_gpu_mem_is_warned_once_and_cleared_when_back_within():
    s = Sched(gpus=2)
    j = s.submit(gpus=1, gpu_mem_mib=4000)
    events, effects = sample(s, 0, jobs={j: 3000})
    assert not of(events, ev.JobGpuMemoryExceeded)
    events, effects = sample(s, 0, jobs={j: 5000})
    (over,) = of(events, ev.JobGpuMemoryExceeded)
    fact = of(events, ev.GpuSampled)[0]
    assert (over.job, over.gpu, over.used_mib, over.request_mib, over.policy) == (j, 0, 5000, 4000, "warn")
    assert over.cause == f"seq:{fact.seq}"
    assert not [e for e in effects if isinstance(e, m.Signal)]  # warn: no signal
    assert s.job(j).gpu_mem_over and s.job(j).gpu_mem_peak_mib == 5000
    events, _ = sample(s, 0, jobs={j: 5200})
    assert not of(events, ev.JobGpuMemoryExceeded)  # once per crossing
    events, _ = sample(s, 0, jobs={j: 3900})
    (back,) = of(events, ev.JobGpuMemoryWithin)
    assert back.used_mib == 3900 and not s.job(j).gpu_mem_over
    refold(s)


def test_a_job_without_a_request_is_never_over_and_foreign_processes_are_kept():
    s = Sched(gpus=1)
    j = s.submit(gpus=0.5)
    carol = ev.GpuProcess(pid=4242, used_mib=6000, uid=1002, user="carol")
    events, _ = sample(s, 0, jobs={j: 9000}, foreign=[carol])
    assert not of(events, ev.JobGpuMemoryExceeded)
    gpu = s.state.gpus[("local", 0)]
    assert gpu.foreign_processes == [carol] and gpu.foreign_memory_mib == 6000
    # counted against placement, as before: a 0.5 share asking 8000 MiB does not fit beside them
    k = s.submit(gpus=0.5, gpu_mem_mib=8000)
    assert s.st(k) == "queued"
    refold(s)


def test_stop_policy_warns_with_the_jobs_signal_then_it_ends_failed_without_retry():
    s = Sched(gpus=1, gpu_mem_policy="stop", preempt_grace_s=20.0)
    j = s.submit(gpus=1, gpu_mem_mib=2000, retries=3, warn_signal=int(signal.SIGUSR1), warn_s=7.0)
    s.do(m.ProcessStarted(job=j, pid=555))
    events, effects = sample(s, 0, jobs={j: 2500})
    over, stop = of(events, ev.JobGpuMemoryExceeded)[0], of(events, ev.JobCancelRequested)[0]
    assert over.policy == "stop" and stop.reason == "gpu-memory" and stop.cause == over.cause
    (sig,) = [e for e in effects if isinstance(e, m.Signal)]
    assert (sig.signum, sig.grace_s, sig.reason) == (int(signal.SIGUSR1), 7.0, "gpu-memory")
    events, _ = s.exit(j, None, signal=int(signal.SIGKILL))
    (exited,) = of(events, ev.JobExited)
    assert (exited.outcome, exited.reason) == ("failed", GPU_MEMORY_OVER)
    assert not of(events, ev.JobRequeued)  # it would exceed again
    assert s.job(j).reason == GPU_MEMORY_OVER
    refold(s)


def test_the_launch_carries_the_frameworks_memory_fraction_and_the_log_keeps_the_spec():
    s = Sched(gpus=2, mem=16000)
    events, effects = s.do(m.Submit(spec=ev.JobSpec(command=["x"], uid=1000, gpus=1, gpu_mem_mib=4000)))
    (launch,) = [e for e in effects if isinstance(e, m.Launch)]
    assert launch.spec.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == launch.spec.env["EVENTSCHED_GPU_MEM_FRACTION"] == "0.2500"
    assert of(events, ev.JobSubmitted)[0].spec.env == {}
    _, effects = s.do(m.Submit(spec=ev.JobSpec(command=["x"], uid=1000, gpus=0.1,
                                               env={"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"}, gpu_mem_mib=1600)))
    (launch,) = [e for e in effects if isinstance(e, m.Launch)]
    assert launch.spec.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ".9"  # the user's own wins
    assert launch.spec.env["EVENTSCHED_GPU_MEM_FRACTION"] == "0.1000"


# --- idle -----------------------------------------------------------------------


def test_an_idle_job_is_flagged_by_the_timer_and_busy_again_on_a_sample():
    s = Sched(gpus=2, idle_after_s=600.0)
    j = s.submit(gpus=2)
    sample(s, 0, util=0.0, at=200.0)
    _, effects = sample(s, 1, util=3.0, at=210.0)
    assert s.state.idle_due == {j: 810.0}
    assert m.WakeAt(at=810.0) in effects
    events, _ = s.do(m.Tick(), at=810.0)
    timer, idle = of(events, ev.TimerFired)[0], of(events, ev.JobIdle)[0]
    assert (idle.job, idle.since, idle.cause) == (j, 210.0, f"seq:{timer.seq}")
    assert s.job(j).idle_since == 210.0 and s.state.idle_jobs == {j: None}
    events, _ = sample(s, 1, util=3.0, at=900.0)  # still quiet: nothing new
    assert not of(events, ev.JobBusy)
    events, _ = sample(s, 0, util=60.0, at=1000.0)
    (busy,) = of(events, ev.JobBusy)
    assert busy.idle_s == 1000.0 - 210.0 and s.job(j).idle_since is None and not s.state.idle_jobs
    refold(s)


def test_a_sample_past_the_idle_deadline_flags_at_once_and_a_busy_gpu_blocks_it():
    s = Sched(gpus=2, idle_after_s=100.0)
    a = s.submit(gpus=1)
    b = s.submit(gpus=1)
    sample(s, 0, util=0.0, at=150.0)
    sample(s, 1, util=90.0, at=150.0)
    events, _ = sample(s, 0, util=1.0, at=300.0)  # no tick came: the sample finds it
    assert [(e.job, e.since) for e in of(events, ev.JobIdle)] == [(a, 150.0)]
    assert s.job(b).idle_since is None and b not in s.state.idle_due
    refold(s)


def test_idle_after_zero_looks_for_nothing():
    s = Sched(gpus=1, idle_after_s=0.0)
    s.submit(gpus=1)
    events, effects = sample(s, 0, util=0.0, at=500.0)
    assert not s.state.idle_due and not [e for e in effects if isinstance(e, m.WakeAt)]


def test_idle_policy_stop_reclaims_an_idle_job_only_when_someone_could_use_it():
    s = Sched(gpus=1, idle_after_s=60.0, idle_policy="stop", preempt_grace_s=15.0)
    idle = s.submit(gpus=1)
    sample(s, 0, util=0.0, at=100.0)
    events, effects = s.do(m.Tick(), at=160.0)
    assert of(events, ev.JobIdle) and not of(events, ev.JobCancelRequested)  # nobody waits
    events, effects = s.do(m.Submit(spec=ev.JobSpec(command=["y"], uid=2000, user="u2000", gpus=1)), at=170.0)
    waiting = of(events, ev.JobSubmitted)[0].job
    (stop,) = of(events, ev.JobCancelRequested)
    assert (stop.job, stop.reason, stop.for_job, stop.rule) == (idle, "idle", waiting, "idle")
    assert stop.cause == f"seq:{of(events, ev.JobSubmitted)[0].seq}"
    (sig,) = [e for e in effects if isinstance(e, m.Signal)]
    assert (sig.grace_s, sig.reason) == (15.0, "idle")
    # no second reclaim while this one is stopping
    events, _ = s.do(m.Submit(spec=ev.JobSpec(command=["z"], uid=2000, user="u2000", gpus=1)), at=171.0)
    assert not of(events, ev.JobCancelRequested)
    events, _ = s.exit(idle, None, signal=int(signal.SIGTERM), at=175.0)
    (exited,) = of(events, ev.JobExited)
    assert (exited.outcome, exited.reason) == ("cancelled", "idle")
    assert s.st(waiting) == "running"
    refold(s)


def test_idle_policy_requeue_puts_the_idle_job_back_in_the_queue():
    s = Sched(gpus=1, idle_after_s=60.0, idle_policy="requeue")
    idle = s.submit(gpus=1)
    sample(s, 0, util=0.0, at=100.0)
    s.do(m.Tick(), at=160.0)
    events, _ = s.do(m.Submit(spec=ev.JobSpec(command=["y"], uid=2000, user="u2000", gpus=1)), at=170.0)
    assert of(events, ev.JobCancelRequested)[0].reason == "idle-requeue"
    events, _ = s.exit(idle, None, signal=int(signal.SIGTERM), at=175.0)
    assert of(events, ev.JobExited)[0].outcome == "preempted"
    assert [(e.job, e.reason) for e in of(events, ev.JobRequeued)] == [(idle, "idle")]
    assert s.st(idle) == "queued"
    refold(s)


# --- the runtime side: attribution and what is worth logging -----------------


def test_attribute_splits_job_and_foreign_memory():
    jobs, others, foreign = attribute([(10, 100), (11, 50), (99, 700)], {10: 1, 11: 1})
    assert jobs == {1: 150} and foreign == 700 and [p.pid for p in others] == [99]
    jobs, others, foreign = attribute([(10, 100), (99, 700)], {10})  # a plain set: ours, job unknown
    assert jobs == {} and foreign == 700


def test_a_job_memory_move_is_worth_logging_below_the_gpu_memory_step():
    base = m.GpuObserved(node="n", gpu=0, utilization=50.0, memory_used_mib=1000, memory_total_mib=81920,
                         temperature_c=40.0, power_w=100.0, job_memory_mib={1: 1000})
    same = msgspec.structs.replace(base, job_memory_mib={1: 1010})
    moved = msgspec.structs.replace(base, job_memory_mib={1: 1100})
    arrived = msgspec.structs.replace(base, job_memory_mib={1: 1000, 2: 1})
    assert not significant(base, same, last_ts=0.0, now=1.0)
    assert significant(base, moved, last_ts=0.0, now=1.0)
    assert significant(base, arrived, last_ts=0.0, now=1.0)


def test_fake_gpus_read_declared_processes(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "EVENTSCHED_FAKE_GPU_MEM_MIB": "1234", "EVENTSCHED_FAKE_GPU_UTIL": "0",
           "CUDA_VISIBLE_DEVICES": "1"}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        b = FakeBackend(2, 8000)
        b.set_load(1, 1.0, 500)
        for _ in range(50):  # until the child has exec'd
            s0, s1 = b.sample({child.pid: 7})
            if s1.job_memory_mib:
                break
        assert s1.job_memory_mib == {7: 1234} and s1.utilization == 0.0
        assert s1.memory_used_mib == 1234 and not s0.job_memory_mib
        s0, s1 = b.sample({})  # not a job's: foreign, with its owner
        assert s1.foreign_memory_mib == 1234 and [p.pid for p in s1.foreign_processes] == [child.pid]
        assert s1.foreign_processes[0].uid == os.getuid()
    finally:
        child.kill()
        child.wait()


def test_the_same_messages_give_the_same_decisions():
    """Feeding the same messages to a fresh core gives the same events (what replay relies on)."""
    def run() -> list[ev.Event]:
        st = ClusterState()
        out: list[ev.Event] = []
        infos = [m.GpuInfo(gpu=0, uuid="g", model="f", memory_total_mib=16000)]
        cfg = m.SchedulerConfig(idle_after_s=10.0, idle_policy="stop", gpu_mem_policy="stop")
        msgs: list[tuple[float, m.Message]] = [
            (0.0, m.Started(node="local", pid=1, version="t", gpu_backend="fake", gpus=infos, config=cfg)),
            (1.0, m.Submit(spec=ev.JobSpec(command=["a"], uid=1, gpus=1, gpu_mem_mib=100))),
            (2.0, m.GpuObserved(node="local", gpu=0, utilization=0.0, memory_used_mib=50, memory_total_mib=16000,
                                temperature_c=1.0, power_w=1.0, job_memory_mib={1: 50})),
            (20.0, m.Tick()),
            (21.0, m.Submit(spec=ev.JobSpec(command=["b"], uid=2, gpus=1))),
        ]
        for t, msg in msgs:
            events, _ = handle(st, msg, t)
            out += events
        return out
    assert run() == run()


def test_the_panel_folds_the_flags_from_the_same_events():
    from eventsched.jupyter.widgets import PanelModel, render_text

    s = Sched(gpus=1, idle_after_s=60.0)
    j = s.submit(gpus=1, gpu_mem_mib=1000, name="nb")
    carol = ev.GpuProcess(pid=4242, used_mib=600, uid=1002, user="carol")
    sample(s, 0, util=0.0, jobs={j: 1500}, foreign=[carol], at=100.0)
    s.do(m.Tick(), at=160.0)
    model = PanelModel()
    model.connected = True
    model.fold(s.log)
    text = render_text(model, 220.0)
    assert "GPU mem over request (1500 MiB); idle 2m" in text
    assert "carol (pid 4242) holds 600 MiB" in text
    sample(s, 0, util=80.0, jobs={j: 900}, at=230.0)
    model.fold(s.log[-3:])
    assert "GPU mem over" not in render_text(model, 240.0) and "idle" not in render_text(model, 240.0)
