"""Sick GPUs drained by themselves: ECC errors, retired pages, row remaps, Xid events.

The real ``NvmlBackend`` reads them from ``tests/fake_nvml.py`` (nvidia-ml-py's
own calls, constants and errors); fake GPUs take the same faults through
``FakeBackend.inject``. The sans-I/O core records a reading when it changed
(``GpuHealth``) and drains a GPU over a ``[gpu_health]`` threshold
(``GpuPaused`` by "health", with its reason, and a word to the operators);
its running jobs finish, or are requeued under ``running = "requeue"``;
``resume-gpu`` returns it. The daemon test runs a real daemon whose NVML is
the fake, with faults injected when the test is ready.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from eventsched import core
from eventsched.domain import events as ev
from eventsched.domain.messages import (
    GpuHealthRead,
    Notify,
    ProcessExited,
    ProcessStarted,
    ResumeGpu,
    SchedulerConfig,
    Signal,
    Started,
    Submit,
)
from eventsched.projections.cluster import ClusterState, snapshot_bytes, state_from_snapshot
from eventsched.runtime.gpus import FakeBackend, NvmlBackend
from eventsched.runtime.gpus.health import NvmlHealth

sys.path.insert(0, str(Path(__file__).parent))
from daemon_harness import EVENTSCHED, Daemon, cli_env
from fake_nvml import FakeNvml

FAKE_NVML = Path(__file__).parent / "fake_nvml.py"


def health_of(samples: list[object]) -> dict[int, ev.GpuHealth]:
    return {s.reading.gpu: s.reading for s in samples if isinstance(s, GpuHealthRead)}


# --- reading NVML ---------------------------------------------------------------------


@pytest.mark.parametrize("fault, fields", [
    ("ecc", {"ecc_uncorrected": 1, "ecc_uncorrected_total": 1, "ecc_corrected": 0}),
    ("ecc-corrected", {"ecc_corrected": 1, "ecc_corrected_total": 1, "ecc_uncorrected": 0}),
    ("retired", {"retired_pages": 1, "pending": True}),
    ("remap", {"pending": True, "remap_failed": False}),
    ("remap-failed", {"remap_failed": True}),
    ("xid:48", {"xids": [48]}),
])
def test_nvml_health_readings_reach_the_scheduler_once_per_change(fault: str, fields: dict) -> None:
    nv = FakeNvml(2)
    b = NvmlBackend(nvml=nv)
    # a GPU without ECC (NVML: not supported) reads -1 (no reading), never an error, and says nothing
    assert NvmlHealth(nv, "local", 2).read(0) == ev.GpuHealth(node="local", gpu=0)
    assert health_of(b.sample()) == {}
    nv.set_fault(1, fault)
    changed = health_of(b.sample())
    assert list(changed) == [1]
    assert {k: getattr(changed[1], k) for k in fields} == fields
    assert health_of(b.sample()) == {}, "a reading that stays the same is not sent again"


def test_an_xid_of_a_lost_gpu_still_arrives() -> None:
    nv = FakeNvml(2)
    b = NvmlBackend(nvml=nv)
    b.sample()
    nv.set_fault(0, "lost")
    nv.set_fault(0, "xid:79")
    samples = b.sample()
    assert health_of(samples)[0].xids == [79]
    assert any(type(s).__name__ == "GpuFailed" and s.lost for s in samples)


def test_fake_gpus_take_each_fault_and_heal() -> None:
    b = FakeBackend(2)
    assert health_of(b.sample()) == {}, "a fake GPU with no fault says nothing of its health"
    b.inject(1, "ecc")
    b.inject(1, "xid:94")
    assert health_of(b.sample())[1].ecc_uncorrected == 1
    b.heal(1)
    assert health_of(b.sample())[1].ecc_uncorrected == -1
    with pytest.raises(ValueError, match="unknown GPU health fault"):
        b.inject(0, "melted")


# --- the core: a fact, a drain with its reason, the running jobs per policy ----------------


class Cluster:
    """The sans-I/O core fed by fake GPUs."""

    def __init__(self, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.b = FakeBackend(2, 40960)
        self.state = ClusterState()
        self.now = 100.0
        self.do(Started(node="local", pid=1, version="t", gpu_backend=self.b.name, gpus=self.b.discover(), config=config))

    def do(self, msg: object) -> tuple[list[ev.Event], list[object]]:
        self.now += 1.0
        return core.handle(self.state, msg, self.now)  # type: ignore[arg-type]

    def sample(self) -> tuple[list[ev.Event], list[object]]:
        events, effects = [], []
        for msg in self.b.sample():
            e, f = self.do(msg)
            events += e
            effects += f
        return events, effects

    def run(self, gpus: float = 1.0, gpu_ids: list[int] | None = None) -> int:
        events, _ = self.do(Submit(spec=ev.JobSpec(command=["train"], uid=1000, user="a", gpus=gpus, gpu_ids=gpu_ids),
                                   by="uid:1000"))
        job = next(e.job for e in events if isinstance(e, ev.JobSubmitted))
        if self.state.jobs[job].state == "running":
            self.do(ProcessStarted(job=job, pid=4000 + job, start_time=1))
        return job


def test_an_ecc_fault_drains_the_gpu_its_job_finishes_and_resume_returns_it() -> None:
    c = Cluster()
    c.sample()
    a = c.run(0.5, [0])
    c.b.inject(0, "ecc")
    events, effects = c.sample()
    health = [e for e in events if isinstance(e, ev.GpuHealth)]
    drained = [e for e in events if isinstance(e, ev.GpuPaused)]
    assert len(health) == 1 and health[0].ecc_uncorrected == 1 and health[0].cause == "nvml"
    assert [(e.gpu, e.by, e.reason, e.cause) for e in drained] == [
        (0, "health", "1 uncorrected ECC error", f"seq:{health[0].seq}")]
    assert [f.text for f in effects if isinstance(f, Notify)] == [
        "GPU 0 on node local drained: 1 uncorrected ECC error; `eventsched resume-gpu 0` returns it to service"]
    assert not [f for f in effects if isinstance(f, Signal)], "by default its running job finishes"
    assert c.state.jobs[a].state == "running"
    # nothing new there; the same reading again adds nothing
    b = c.run(0.5, [0])
    assert c.state.jobs[b].state == "queued"
    # a restart from a snapshot knows why, and what the driver last said
    gpu = state_from_snapshot(snapshot_bytes(c.state)).gpus[("local", 0)]
    assert gpu.paused_reason == "1 uncorrected ECC error" and gpu.health == health[0]
    assert not [e for e in c.sample()[0] if not isinstance(e, ev.GpuSampled)]
    # the operator returns it: the waiting job starts; the error count that stays is not news
    events, _ = c.do(ResumeGpu(node="local", gpu=0, by="uid:0"))
    assert [e.job for e in events if isinstance(e, ev.JobPlaced)] == [b]
    assert not [e for e in c.sample()[0] if isinstance(e, (ev.GpuHealth, ev.GpuPaused))]
    # a further error is: drained again
    c.b.inject(0, "ecc")
    assert [e.reason for e in c.sample()[0] if isinstance(e, ev.GpuPaused)] == ["2 uncorrected ECC errors"]


@pytest.mark.parametrize("fault, reason", [
    ("xid:79", "Xid 79 (fallen off the bus)"),
    ("xid:48", "Xid 48 (double-bit ECC error)"),
    ("remap", "memory repair pending a GPU reset (page retirement or row remap)"),
    ("remap-failed", "a memory row could not be remapped (no spare rows left)"),
])
def test_each_default_threshold_drains_with_its_reason(fault: str, reason: str) -> None:
    c = Cluster()
    c.b.inject(1, fault)
    assert [(e.gpu, e.reason) for e in c.sample()[0] if isinstance(e, ev.GpuPaused)] == [(1, reason)]


@pytest.mark.parametrize("fault", ["xid:13", "xid:31", "ecc-corrected", "retired"])
def test_below_the_default_thresholds_a_reading_is_recorded_and_drains_nothing(fault: str) -> None:
    c = Cluster(SchedulerConfig(gpu_health_pending=False))
    c.b.inject(1, fault)
    events = c.sample()[0]
    assert [e.gpu for e in events if isinstance(e, ev.GpuHealth)] == [1]
    assert not [e for e in events if isinstance(e, ev.GpuPaused)]


def test_the_requeue_policy_stops_the_drained_gpus_job_without_spending_a_retry() -> None:
    c = Cluster(SchedulerConfig(gpu_health_running="requeue"))
    a = c.run(1.0, [0])
    c.b.inject(0, "xid:74")
    events, effects = c.sample()
    assert [(e.job, e.by, e.reason) for e in events if isinstance(e, ev.JobCancelRequested)] == [
        (a, "gpu-health", "preempted")]
    assert [s.job for s in effects if isinstance(s, Signal)] == [a]
    events, _ = c.do(ProcessExited(job=a, exit_code=None, signal=15))
    assert c.state.jobs[a].state == "queued" and c.state.jobs[a].retries_used == 0


def test_a_lost_gpu_stays_drained_when_the_config_says_so() -> None:
    c = Cluster(SchedulerConfig(gpu_health_lost=True))
    c.sample()
    c.b.fail(0, "NVML: GPU is lost", lost=True)
    assert [e.reason for e in c.sample()[0] if isinstance(e, ev.GpuPaused)] == ["GPU is lost"]
    c.b.heal(0)
    c.sample()
    gpu = c.state.gpus[("local", 0)]
    assert not gpu.lost and gpu.paused and gpu.paused_reason == "GPU is lost"


def test_an_old_log_without_health_events_still_reads() -> None:
    old = msgspec.msgpack.encode({"type": "GpuPaused", "seq": 3, "ts": 1.0, "cause": "uid:0", "node": "local", "gpu": 1})
    e = ev.decode(old)
    assert isinstance(e, ev.GpuPaused) and e.reason == ""


# --- the config --------------------------------------------------------------------------


@pytest.mark.parametrize("toml, where", [
    ("ecc_uncorrected = -1", "$.gpu_health.ecc_uncorrected"),
    ('xids = [79, "x"]', "$.gpu_health.xids[1]"),
    ('running = "kill"', "$.gpu_health.running"),
    ("ecc = 1", "gpu_health"),
])
def test_a_bad_threshold_is_a_one_line_error(tmp_path: Path, toml: str, where: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(f"[gpu_health]\n{toml}\n")
    r = subprocess.run([*EVENTSCHED, "serve", "--config", str(config), "--gpus", "fake:1"],
                       env=cli_env(tmp_path / "state"), capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and where in r.stderr and "Traceback" not in r.stderr, r.stderr


# --- a real daemon on the fake NVML ---------------------------------------------------------


def test_a_daemon_drains_sick_gpus_and_resume_returns_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from eventsched.sim.compare import compare_placements
    from eventsched.sim.simulator import RECORDED, simulate
    from eventsched.sim.sources import load_source
    from eventsched.storage import log as eventlog

    faults, released = tmp_path / "faults", tmp_path / "released"
    monkeypatch.setenv("EVENTSCHED_TEST_NVML", str(FAKE_NVML))
    monkeypatch.setenv("EVENTSCHED_TEST_NVML_SCRIPT", json.dumps({"gpus": 3, "mem_mib": 40960,
                                                                  "faults_file": str(faults),
                                                                  "released_file": str(released)}))
    state = tmp_path / "state"

    def inject(gpu: int, fault: str) -> None:
        with open(faults, "a") as f:
            f.write(f"{gpu} {fault}\n")

    def drained(d: Daemon, gpu: int, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            g = next(g for g in d.status()["gpus"] if g["id"] == gpu)
            if g["paused"] and g["paused_reason"]:
                return g["paused_reason"]
            time.sleep(0.1)
        raise AssertionError(f"GPU {gpu} was not drained: {d.status()['gpus']}")

    with Daemon(state, gpus="nvml") as d:
        a = d.submit("--gpus", "0.5", "--gpu-ids", "0", "--", "sleep", "300")
        d.wait_states([a], {"running"})
        inject(0, "ecc")
        assert drained(d, 0) == "1 uncorrected ECC error"
        inject(1, "xid:79")
        assert drained(d, 1) == "Xid 79 (fallen off the bus)"
        b = d.submit("--gpus", "0.5", "--gpu-ids", "0,1", "--", "sleep", "300")
        # the reason, where an operator and a user look
        status = d.cli("status").stdout
        assert "drained" in status and "GPU 0 drained: 1 uncorrected ECC error (resume-gpu 0 returns it)" in status
        nodes = d.cli("nodes").stdout
        assert "GPU 0 drained: 1 uncorrected ECC error; GPU 1 drained: Xid 79 (fallen off the bus)" in nodes
        explain = d.cli("explain", str(b)).stdout
        assert "GPU 0 is drained (1 uncorrected ECC error)" in explain, explain
        assert "GPU 1 is drained (Xid 79 (fallen off the bus))" in explain, explain
        # the operators are told; the running job finishes (the default), nothing is placed there
        warned = [json.loads(line)["msg"] for line in d.stderr().splitlines()
                  if line.startswith("{") and json.loads(line)["level"] == "warning"]
        assert any(m.startswith("GPU 0 on node local drained: 1 uncorrected ECC error") for m in warned), warned
        jobs = d.jobs()
        assert jobs[a]["state"] == "running" and jobs[b]["state"] == "queued"
        # resume-gpu returns it: the waiting job starts there
        r = d.cli("resume-gpu", "0")
        assert r.returncode == 0 and "accepting jobs" in r.stdout, r.stderr
        d.wait_states([b], {"running"})
        d.cli("cancel", str(a), str(b))
        d.wait_states([a, b], {"cancelled"})
        assert not released.exists(), "NVML let go while the daemon serves"
    # a stopped daemon frees its Xid event set and shuts NVML down
    assert released.read_text().splitlines() == ["nvmlEventSetFree", "nvmlShutdown"]
    verify = subprocess.run([*EVENTSCHED, "log", "verify", str(state / "log")], env=cli_env(state),
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    log = list(eventlog.read(state / "log"))
    assert [(e.gpu, e.reason) for e in log if isinstance(e, ev.GpuPaused)] == [
        (0, "1 uncorrected ECC error"), (1, "Xid 79 (fallen off the bus)")]
    # the replay folds the health facts and drains the same GPUs: the same placements
    out = tmp_path / "replay"
    simulate(load_source(state), RECORDED, out)
    assert compare_placements(state / "log", out / "log") is None
    replayed = [(e.gpu, e.reason) for e in eventlog.read(out / "log") if isinstance(e, ev.GpuPaused)]
    assert replayed == [(0, "1 uncorrected ECC error"), (1, "Xid 79 (fallen off the bus)")]
