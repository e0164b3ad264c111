"""GPU memory and idle jobs end to end on fake GPUs: a job over its
--gpu-mem is warned, and stopped under gpu_mem_policy = "stop"; an idle job
is flagged and, under the opt-in idle_policy, reclaimed when someone waits.
Each replays exactly.

Fake GPUs see what processes declare in their environment
(``EVENTSCHED_FAKE_GPU_MEM_MIB``, ``EVENTSCHED_FAKE_GPU_UTIL``), through the
same per-process attribution as NVML's list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from daemon_harness import Daemon

from eventsched import load_source, simulate
from eventsched.domain import events as ev
from eventsched.storage import log as eventlog

pytestmark = pytest.mark.slow


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "eventsched.toml"
    path.write_text(text)
    return str(path)


def decisions(events: list[ev.Event]) -> list[tuple]:
    kinds = (ev.JobPlaced, ev.JobCancelRequested, ev.JobRequeued, ev.JobGpuMemoryExceeded, ev.JobGpuMemoryWithin,
             ev.JobIdle, ev.JobBusy)
    return [(type(e).__name__, e.job, tuple(getattr(e, "gpu_ids", ())), getattr(e, "reason", ""), e.ts)
            for e in events if isinstance(e, kinds)]


def replays_exactly(state_dir: Path, out: Path) -> list[tuple]:
    live = [e for batch in eventlog.read_batches(state_dir / "log") for e in batch]
    result = simulate(load_source(state_dir), "recorded", out)
    replayed = [e for batch in eventlog.read_batches(Path(result.state_dir) / "log") for e in batch]
    assert decisions(replayed) == decisions(live)
    return decisions(live)


HOG = ["--", "sh", "-c", "EVENTSCHED_FAKE_GPU_MEM_MIB=3000 exec sleep 60"]


def test_a_job_over_its_gpu_memory_is_warned_and_shown(tmp_path: Path) -> None:
    with Daemon(tmp_path / "state", gpus="fake:2:8000") as d:
        hog = d.submit("--gpus", "1", "--gpu-mem", "1000", *HOG)
        jobs = d.wait_for(lambda js: js.get(hog, {}).get("gpu_mem_over"), what="the over-memory flag")
        assert jobs[hog]["state"] == "running" and jobs[hog]["gpu_mem_peak_mib"] == 3000
        queue = d.cli("queue").stdout
        assert "GPU memory over request (3000 > 1000 MiB)" in queue
        story = d.cli("explain", str(hog)).stdout
        assert "GPU memory over request: 3000 MiB on GPU" in story and "(warned)" in story
        gpu = next(g for g in d.status()["gpus"] if g["id"] == jobs[hog]["gpu_ids"][0])
        assert gpu["job_memory_mib"] == {str(hog): 3000}
        assert d.cli("cancel", str(hog)).returncode == 0
        d.wait_states([hog], {"cancelled"})
        state_dir = d.state_dir
    live = replays_exactly(state_dir, tmp_path / "replay")
    assert ("JobGpuMemoryExceeded", hog) in [(k, j) for k, j, *_ in live]


def test_under_the_stop_policy_it_is_signalled_and_ends_failed(tmp_path: Path) -> None:
    conf = config(tmp_path, '[scheduler]\ngpu_mem_policy = "stop"\npreempt_grace_s = 2.0\n')
    with Daemon(tmp_path / "state", gpus="fake:1:8000", extra=["--config", conf]) as d:
        hog = d.submit("--gpus", "0.5", "--gpu-mem", "1000", *HOG)
        fine = d.submit("--gpus", "0.5", "--gpu-mem", "1000", "--", "sh", "-c",
                        "EVENTSCHED_FAKE_GPU_MEM_MIB=500 exec sleep 3")
        jobs = d.wait_states([hog, fine], {"failed", "succeeded"}, timeout=30)
        assert (jobs[hog]["state"], jobs[hog]["exit_reason"]) == ("failed", "GPU memory over request")
        assert jobs[fine]["state"] == "succeeded"  # its neighbour kept within its request
        story = d.cli("explain", str(hog)).stdout
        assert "asked to stop: GPU memory over request" in story
        state_dir = d.state_dir
    replays_exactly(state_dir, tmp_path / "replay")


def test_an_idle_job_is_flagged_and_reclaimed_when_someone_waits(tmp_path: Path) -> None:
    conf = config(tmp_path, '[scheduler]\nidle_after_s = 1.0\nidle_policy = "stop"\npreempt_grace_s = 2.0\n')
    with Daemon(tmp_path / "state", gpus="fake:1", extra=["--config", conf]) as d:
        idle = d.submit("--gpus", "1", "--", "sh", "-c", "EVENTSCHED_FAKE_GPU_UTIL=0 exec sleep 60")
        jobs = d.wait_for(lambda js: js.get(idle, {}).get("idle"), what="the idle flag")
        assert jobs[idle]["idle_since"] is not None
        assert f"job {idle}: idle since" in d.cli("status").stdout
        assert "idle since" in d.cli("queue").stdout
        waiting = d.submit("--gpus", "1", "--", "sleep", "0.3")
        jobs = d.wait_states([idle, waiting], {"cancelled", "succeeded"}, timeout=30)
        assert (jobs[idle]["state"], jobs[idle]["exit_reason"]) == ("cancelled", "idle")
        assert jobs[waiting]["state"] == "succeeded"
        story = d.cli("explain", str(idle)).stdout
        assert "allocated but idle" in story and f"idle while job {waiting} waits" in story
        rows = json.loads(d.cli("sql", "SELECT user_name, idle_gpu_hours FROM idle_gpu_hours",
                                "--format", "json").stdout)
        assert len(rows) == 1 and rows[0]["idle_gpu_hours"] > 0
        state_dir = d.state_dir
    live = replays_exactly(state_dir, tmp_path / "replay")
    kinds = [k for k, j, *_ in live if j == idle]
    assert kinds[:3] == ["JobPlaced", "JobIdle", "JobCancelRequested"]
