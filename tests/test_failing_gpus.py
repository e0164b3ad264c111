"""GPUs that fail: NVML's own errors, GPUs that vanish and come back, absurd readings.

``tests/fake_nvml.py`` stands in for ``pynvml`` and raises nvidia-ml-py's own
exception types, so the real ``NvmlBackend`` code runs on every fault. The
sans-I/O core turns each fault into a ``GpuErrored`` event (once per change),
a lost GPU takes nothing new and its running jobs are stopped and requeued
like a preemption (no retry spent: the fault is the GPU's), and a GPU that
reads well again is back (``GpuDiscovered``). The slow test runs a real
daemon whose NVML is the fake, with faults scripted over time.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pynvml
import pytest

from eventsched import core
from eventsched.domain import events as ev
from eventsched.domain.messages import (
    GpuFailed,
    GpuObserved,
    ProcessExited,
    ProcessStarted,
    SchedulerConfig,
    Signal,
    Started,
    Submit,
)
from eventsched.projections.cluster import ClusterState
from eventsched.runtime.gpus import NvmlBackend, absurd_reading

sys.path.insert(0, str(Path(__file__).parent))
from fake_nvml import FakeNvml

FAKE_NVML = Path(__file__).parent / "fake_nvml.py"


def backend(gpus: int = 2) -> tuple[NvmlBackend, FakeNvml]:
    nv = FakeNvml(gpus)
    return NvmlBackend(nvml=nv), nv


# --- the real backend on NVML's own errors ---------------------------------------


@pytest.mark.parametrize(
    "fault, error, lost",
    [
        ("lost", "NVML: GPU is lost", True),
        ("timeout", "NVML: Timeout", False),
        ("unknown", "NVML: Unknown Error", False),
        ("xid", "NVML: Unknown Error", False),  # fails half-way through a sample
        ("gone", "NVML: Not Found", False),
        ("negative-mem", "NVML: absurd reading: memory used -512 MiB of 40960 MiB", False),
        ("overfull", "NVML: absurd reading: memory used 41984 MiB of 40960 MiB", False),
        ("hot", "NVML: absurd reading: temperature 300 C", False),
    ],
)
def test_each_nvml_fault_is_a_gpu_failed_message_for_that_gpu_only(fault: str, error: str, lost: bool) -> None:
    b, nv = backend()
    nv.set_fault(1, fault)
    healthy, failed = b.sample()
    assert isinstance(healthy, GpuObserved) and healthy.gpu == 0
    assert failed == GpuFailed(node="local", gpu=1, error=error, lost=lost)


def test_the_fake_raises_nvidia_ml_pys_own_exception_types() -> None:
    nv = FakeNvml(1)
    for fault, kind in [("lost", pynvml.NVMLError_GpuIsLost), ("timeout", pynvml.NVMLError_Timeout),
                        ("unknown", pynvml.NVMLError_Unknown)]:
        nv.set_fault(0, fault)
        with pytest.raises(kind):
            nv.nvmlDeviceGetMemoryInfo(0)


def test_a_gpu_lost_at_start_up_is_not_discovered() -> None:
    b, nv = backend()
    nv.set_fault(0, "lost")
    assert [g.gpu for g in b.discover()] == [1]


def test_sane_readings_are_not_absurd() -> None:
    assert absurd_reading(0, 81920, 0.0, 30.0, 60.0) == ""
    assert absurd_reading(81920, 81920, 100.0, 95.0, 700.0) == ""
    assert "utilization" in absurd_reading(0, 81920, 180.0, 30.0, 60.0)
    assert "power" in absurd_reading(0, 81920, 50.0, 30.0, -5.0)


# --- the core: each fault an event, a lost GPU takes nothing, its jobs requeued ----------


class Cluster:
    """The sans-I/O core fed by the real backend over the fake NVML."""

    def __init__(self, gpus: int = 2) -> None:
        self.b, self.nv = backend(gpus)
        self.state = ClusterState()
        self.now = 100.0
        self.do(Started(node="local", pid=1, version="t", gpu_backend="nvml", gpus=self.b.discover(),
                        config=SchedulerConfig()))

    def do(self, msg: object) -> tuple[list[ev.Event], list[object]]:
        self.now += 1.0
        events, effects = core.handle(self.state, msg, self.now)  # type: ignore[arg-type]
        if events:
            self.state.last_seq = events[-1].seq
        return events, effects  # type: ignore[return-value]

    def sample(self) -> list[ev.Event]:
        out: list[ev.Event] = []
        for msg in self.b.sample():
            out += self.do(msg)[0]
        return out

    def submit(self, gpus: float = 1.0) -> int:
        events, _ = self.do(Submit(spec=ev.JobSpec(command=["train"], uid=1000, user="a", gpus=gpus), by="uid:1000"))
        return next(e.job for e in events if isinstance(e, ev.JobSubmitted))

    def gpus_of(self, job: int) -> list[int]:
        return list(self.state.jobs[job].gpu_ids)


def test_a_lost_gpu_is_one_event_takes_nothing_and_its_job_is_requeued_then_it_comes_back() -> None:
    c = Cluster(2)
    c.sample()
    a = c.submit()
    assert c.gpus_of(a) == [0]
    c.do(ProcessStarted(job=a, pid=4242, start_time=1))

    c.nv.set_fault(0, "lost")
    events, effects = [], []
    for msg in c.b.sample():
        e, f = c.do(msg)
        events += e
        effects += f
    errored = [e for e in events if isinstance(e, ev.GpuErrored)]
    assert [(e.gpu, e.lost) for e in errored] == [(0, True)]
    assert [(e.job, e.by) for e in events if isinstance(e, ev.JobCancelRequested)] == [(a, "gpu-lost")]
    assert [s.job for s in effects if isinstance(s, Signal)] == [a]
    # the same fault again and again: no new event (the log does not grow every sample)
    for _ in range(5):
        assert not [e for e in c.sample() if isinstance(e, ev.GpuErrored)]
    # nothing new goes on the lost GPU
    b = c.submit()
    assert c.gpus_of(b) == [1]
    waiting = c.submit()
    assert c.state.jobs[waiting].state == "queued"
    # the job stopped: requeued without spending a retry
    events, _ = c.do(ProcessExited(job=a, exit_code=None, signal=15))
    assert c.state.jobs[a].state == "queued"
    assert [e.reason for e in events if isinstance(e, ev.JobRequeued)] == ["preempted"]
    assert c.state.jobs[a].retries_used == 0
    # the GPU comes back: it is discovered again and takes the waiting jobs
    c.nv.set_fault(0, "ok")
    events = c.sample()
    assert [e.gpu for e in events if isinstance(e, ev.GpuDiscovered)] == [0]
    gpu0 = c.state.gpus[("local", 0)]
    assert not gpu0.lost and not gpu0.error
    assert c.gpus_of(a) == [0] or c.gpus_of(waiting) == [0]


@pytest.mark.parametrize("fault", ["negative-mem", "overfull", "hot", "timeout", "xid"])
def test_a_bad_reading_is_recorded_once_as_an_error_and_never_used(fault: str) -> None:
    c = Cluster(1)
    c.sample()
    before = c.state.gpus[("local", 0)].memory_used_mib
    c.nv.set_fault(0, fault)
    events = c.sample() + c.sample() + c.sample()
    assert [type(e).__name__ for e in events] == ["GpuErrored"]
    gpu = c.state.gpus[("local", 0)]
    assert gpu.memory_used_mib == before and gpu.temperature_c < 100  # the absurd values went nowhere
    assert not gpu.lost
    job = c.submit(0.5)
    assert c.gpus_of(job) == [0]  # an error that is not a loss does not stop placement
    c.nv.set_fault(0, "ok")
    assert [type(e).__name__ for e in c.sample()][:2] == ["GpuSampled", "GpuDiscovered"]
    assert not c.state.gpus[("local", 0)].error
    c.nv.set_fault(0, fault)
    assert [type(e).__name__ for e in c.sample()] == ["GpuErrored"]  # a new fault is news again


def test_a_gpu_back_from_failure_is_not_thinned_away_by_the_engine() -> None:
    """The engine logs a sample only when it changed; the first good sample
    after a failure must pass even when it equals the last one logged."""
    from eventsched.runtime.gpus import SampleFilter

    c = Cluster(1)
    samples = SampleFilter()
    sample = c.b.sample()[0]
    assert isinstance(sample, GpuObserved)
    assert samples.keep(sample, 10.0, c.state)
    assert not samples.keep(sample, 10.5, c.state)  # the same again: thinned
    c.do(GpuFailed(node="local", gpu=0, error="NVML: GPU is lost", lost=True))
    assert samples.keep(sample, 11.0, c.state), "the GPU would stay lost until a reading changed"


# --- a real daemon on the fake NVML -------------------------------------------------


@pytest.mark.slow
def test_a_daemon_rides_out_failing_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real daemon whose NVML is the fake: GPU 0 is lost under a running
    job and comes back; GPU 1 reads 300 C, then times out, then heals. Each
    fault goes in once the daemon has recorded the one before (not at fixed
    times): a busy machine slows the story down but cannot skip a step of it."""
    from daemon_harness import Daemon

    from eventsched.storage import log as eventlog

    faults = tmp_path / "faults"
    monkeypatch.setenv("EVENTSCHED_TEST_NVML", str(FAKE_NVML))
    monkeypatch.setenv("EVENTSCHED_TEST_NVML_SCRIPT",
                       json.dumps({"gpus": 2, "mem_mib": 40960, "faults_file": str(faults)}))

    def inject(gpu: int, fault: str) -> None:
        with open(faults, "a") as f:
            f.write(f"{gpu} {fault}\n")

    def events() -> list[ev.Event]:
        return list(eventlog.read(tmp_path / "state" / "log"))

    def placed_on(job: int) -> list[tuple[int, ...]]:
        return [tuple(e.gpu_ids) for e in events() if isinstance(e, ev.JobPlaced) and e.job == job]

    def recorded(d: Daemon, gpu: int, error: str) -> None:
        d.wait_for(lambda _: any(isinstance(e, ev.GpuErrored) and (e.gpu, e.error) == (gpu, error) for e in events()),
                   20, f"GPU {gpu}'s {error!r} to be recorded")
        time.sleep(1.0)  # and it lasts a few samples more

    with Daemon(tmp_path / "state", gpus="nvml") as d:
        # twice the GPU 0 can hold: the second waits
        first = d.submit("--gpus", "1", "--", "sleep", "60")
        second = d.submit("--gpus", "1", "--", "sleep", "60")
        d.wait_states([first, second], {"running"})
        on_zero = first if placed_on(first) == [(0,)] else second
        # GPU 0 is lost under its job: stopped, requeued (no retry spent), placed again when 0 returns
        inject(0, "lost")
        d.wait_for(lambda jobs: any(isinstance(e, ev.JobRequeued) and e.job == on_zero for e in events()),
                   20, "the job on the lost GPU to be requeued")
        inject(1, "hot")
        recorded(d, 1, "NVML: absurd reading: temperature 300 C")
        inject(1, "timeout")
        recorded(d, 1, "NVML: Timeout")
        inject(1, "ok")
        inject(0, "ok")
        d.wait_for(lambda jobs: len(placed_on(on_zero)) == 2 and jobs[on_zero]["state"] == "running",
                   20, "the job to run again on the GPU that came back")
        log = events()
        errored = [(e.gpu, e.lost, e.error) for e in log if isinstance(e, ev.GpuErrored)]
        assert (0, True, "NVML: GPU is lost") in errored
        assert (1, False, "NVML: absurd reading: temperature 300 C") in errored
        assert (1, False, "NVML: Timeout") in errored
        assert len(errored) == len(set(errored)) == 3, f"a fault that lasts is recorded once: {errored}"
        assert not [e for e in log if isinstance(e, ev.GpuSampled) and e.temperature_c > 150]
        assert placed_on(on_zero)[-1] == (0,)
        assert not _placed_while_lost(log)
        assert d.process is not None and d.process.poll() is None, "the daemon stays up"
        assert d.cli("log", "verify", str(tmp_path / "state" / "log")).returncode == 0


def _placed_while_lost(log: list[ev.Event]) -> list[ev.Event]:
    lost: set[int] = set()
    bad: list[ev.Event] = []
    for e in log:
        if isinstance(e, ev.GpuErrored) and e.lost:
            lost.add(e.gpu)
        elif isinstance(e, ev.GpuDiscovered):
            lost.discard(e.gpu)
        elif isinstance(e, ev.JobPlaced) and lost & set(e.gpu_ids):
            bad.append(e)
    return bad
