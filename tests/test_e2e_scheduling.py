"""End to end: a real daemon on fake GPUs, real jobs, the real CLI."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from daemon_harness import Daemon

pytestmark = pytest.mark.slow

FINAL = {"succeeded", "failed", "cancelled", "lost"}


def job_script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def daemon(tmp_path: Path):
    # a short grace before SIGKILL: a job that ignores SIGTERM is killed in 1 s, not the default 10
    (tmp_path / "config.toml").write_text("[scheduler]\nkill_grace_s = 1.0\n")
    with Daemon(tmp_path / "state", gpus="fake:4:16384", extra=["--config", str(tmp_path / "config.toml")]) as d:
        yield d


def test_fractional_jobs_share_a_gpu_and_see_their_device(daemon: Daemon, tmp_path: Path) -> None:
    marker = tmp_path / "go"
    script = job_script(
        tmp_path, "share.sh", f'echo "cvd=$CUDA_VISIBLE_DEVICES job=$EVENTSCHED_JOB_ID"; while [ ! -e {marker} ]; do sleep 0.05; done'
    )
    ids = [daemon.submit("--gpus", "0.5", "--", script) for _ in range(8)]
    jobs = daemon.wait_states(ids, {"running"})
    # 8 half-GPU jobs fill 4 GPUs exactly: two per GPU, never over-committed
    per_gpu: dict[int, int] = {}
    for job in jobs.values():
        assert len(job["gpu_ids"]) == 1
        per_gpu[job["gpu_ids"][0]] = per_gpu.get(job["gpu_ids"][0], 0) + 1
    assert per_gpu == {0: 2, 1: 2, 2: 2, 3: 2}
    assert all(g["allocated"] == pytest.approx(1.0) for g in daemon.status()["gpus"])
    ninth = daemon.submit("--gpus", "0.5", "--", script)
    time.sleep(0.5)
    assert daemon.jobs()[ninth]["state"] == "queued"
    marker.touch()
    jobs = daemon.wait_states(ids + [ninth], {"succeeded"})
    for job_id in ids:
        assert daemon.logs(job_id).strip() == f"cvd={jobs[job_id]['gpu_ids'][0]} job={job_id}"


def test_best_fit_packs_fractional_jobs_and_keeps_whole_gpus_free(daemon: Daemon, tmp_path: Path) -> None:
    hold = job_script(tmp_path, "hold.sh", f"while [ ! -e {tmp_path / 'go'} ]; do sleep 0.05; done")
    a = daemon.submit("--gpus", "0.5", "--", hold)
    daemon.wait_states([a], {"running"})
    b = daemon.submit("--gpus", "0.3", "--", hold)
    c = daemon.submit("--gpus", "0.2", "--", hold)
    jobs = daemon.wait_states([b, c], {"running"})
    gpu_a = jobs[a]["gpu_ids"]
    assert jobs[b]["gpu_ids"] == gpu_a and jobs[c]["gpu_ids"] == gpu_a
    whole = daemon.submit("--gpus", "3", "--", hold)
    jobs = daemon.wait_states([whole], {"running"})
    assert sorted(jobs[whole]["gpu_ids"]) == sorted(set(range(4)) - set(gpu_a))
    (tmp_path / "go").touch()
    daemon.wait_states([a, b, c, whole], {"succeeded"})


def test_pinning_gang_and_refusals(daemon: Daemon, tmp_path: Path) -> None:
    show = job_script(tmp_path, "show.sh", 'echo "$CUDA_VISIBLE_DEVICES"')
    pinned = daemon.submit("--gpus", "1", "--gpu-ids", "3", "--", show)
    ranged = daemon.submit("--gpus", "2", "--gpu-ids", "1-2", "--", show)
    daemon.wait_states([pinned, ranged], {"succeeded"})
    assert daemon.logs(pinned).strip() == "3"
    assert daemon.logs(ranged).strip() == "1,2"
    for bad, reason in (
        (["--gpus", "5"], "GPU"),
        (["--gpu-ids", "9"], "9"),
        (["--gpu-mem", "999999"], "memory"),
        (["--gpus", "1.5"], "gpus"),
    ):
        result = daemon.cli("submit", *bad, "--", show)
        assert result.returncode != 0
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert reason.lower() in result.stderr.lower(), result.stderr
    # nothing refused was queued
    assert set(daemon.jobs()) == {pinned, ranged}


def test_memory_admission_counts_reservations(daemon: Daemon, tmp_path: Path) -> None:
    hold = job_script(tmp_path, "hold.sh", f"while [ ! -e {tmp_path / 'go'} ]; do sleep 0.05; done")
    # 16 GiB GPUs: a 10 GiB and a 0.2-share 8 GiB job cannot share a GPU
    big = [daemon.submit("--gpus", "0.2", "--gpu-mem", "10000", "--", hold) for _ in range(4)]
    jobs = daemon.wait_states(big, {"running"})
    assert sorted(j["gpu_ids"][0] for j in jobs.values()) == [0, 1, 2, 3]
    blocked = daemon.submit("--gpus", "0.2", "--gpu-mem", "8000", "--", hold)
    time.sleep(0.6)
    assert daemon.jobs()[blocked]["state"] == "queued"
    small = daemon.submit("--gpus", "0.2", "--gpu-mem", "4000", "--", hold)
    daemon.wait_states([small], {"running"})
    (tmp_path / "go").touch()
    daemon.wait_states(big + [blocked, small], {"succeeded"})


def test_priority_order_when_capacity_frees(daemon: Daemon, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    hold = job_script(tmp_path, "hold.sh", f"while [ ! -e {gate} ]; do sleep 0.05; done")
    record = tmp_path / "order"
    note = job_script(tmp_path, "note.sh", f'echo "$EVENTSCHED_JOB_ID" >> {record}')
    blocker = daemon.submit("--gpus", "4", "--", hold)
    daemon.wait_states([blocker], {"running"})
    low = daemon.submit("--gpus", "4", "--priority", "1", "--", note)
    high = daemon.submit("--gpus", "4", "--priority", "10", "--", note)
    mid = daemon.submit("--gpus", "4", "--priority", "5", "--", note)
    queue = [j["id"] for j in __import__("json").loads(daemon.cli("queue", "--json").stdout) if j["state"] == "queued"]
    assert queue == [high, mid, low]
    gate.touch()
    daemon.wait_states([low, high, mid], {"succeeded"})
    assert record.read_text().split() == [str(high), str(mid), str(low)]


def test_pause_and_resume_a_gpu(daemon: Daemon, tmp_path: Path) -> None:
    show = job_script(tmp_path, "show.sh", 'echo "$CUDA_VISIBLE_DEVICES"')
    for gpu in range(4):
        assert daemon.cli("pause-gpu", str(gpu)).returncode == 0
    assert all(g["paused"] for g in daemon.status()["gpus"])
    job = daemon.submit("--gpus", "0.5", "--", show)
    time.sleep(0.6)
    assert daemon.jobs()[job]["state"] == "queued"
    assert daemon.cli("resume-gpu", "2").returncode == 0
    daemon.wait_states([job], {"succeeded"})
    assert daemon.logs(job).strip() == "2"
    bad = daemon.cli("pause-gpu", "17")
    assert bad.returncode != 0 and "17" in bad.stderr and "Traceback" not in bad.stderr


def test_cancel_queued_and_running_jobs(daemon: Daemon, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    stubborn = job_script(tmp_path, "stubborn.sh", f"echo $$ > {pidfile}; trap '' TERM; sleep 600 & wait")
    running = daemon.submit("--gpus", "4", "--", stubborn)
    daemon.wait_states([running], {"running"})
    queued = daemon.submit("--gpus", "1", "--", stubborn)
    result = daemon.cli("cancel", str(queued))
    assert result.returncode == 0, result.stderr
    assert daemon.jobs()[queued]["state"] == "cancelled"
    deadline = time.monotonic() + 10
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    assert daemon.cli("cancel", str(running)).returncode == 0
    jobs = daemon.wait_states([running], {"cancelled"}, timeout=30)
    assert jobs[running]["ended_at"] is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # cancelling again, or a job that does not exist: clear one-line errors
    unknown = daemon.cli("cancel", "4242")
    assert unknown.returncode != 0 and "4242" in unknown.stderr and "Traceback" not in unknown.stderr


def test_time_limit_kills_or_requeues(daemon: Daemon, tmp_path: Path) -> None:
    sleeper = job_script(tmp_path, "sleeper.sh", "sleep 60")
    killed = daemon.submit("--gpus", "1", "--time-limit", "1", "--", sleeper)
    jobs = daemon.wait_states([killed], FINAL, timeout=30)
    assert jobs[killed]["state"] in {"failed", "cancelled"}
    assert jobs[killed]["ended_at"] - jobs[killed]["started_at"] < 20
    counter = tmp_path / "runs"
    again = job_script(tmp_path, "again.sh", f"echo run >> {counter}; sleep 60")
    requeued = daemon.submit("--gpus", "1", "--time-limit", "1", "--requeue-on-time-limit", "--", again)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if counter.exists() and len(counter.read_text().split()) >= 2:
            break
        time.sleep(0.1)
    assert len(counter.read_text().split()) >= 2, "a requeued job runs again"
    daemon.cli("cancel", str(requeued))


def test_cuda_argument_is_rewritten(daemon: Daemon, tmp_path: Path) -> None:
    job = daemon.submit("--gpus", "1", "--gpu-ids", "2", "--", "/bin/echo", "train", "--cuda", "0", "--lr", "3")
    daemon.wait_states([job], {"succeeded"})
    assert daemon.logs(job).strip() == "train --cuda 2 --lr 3"


def test_jobs_run_in_the_submitters_directory_without_a_shell(daemon: Daemon, tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    job = daemon.submit("--gpus", "0.1", "--", "/bin/sh", "-c", 'pwd; echo "$1"', "sh", "$(touch pwned)", cwd=str(workdir))
    daemon.wait_states([job], {"succeeded"})
    lines = daemon.logs(job).splitlines()
    assert lines == [str(workdir), "$(touch pwned)"]
    assert not (workdir / "pwned").exists()


def test_failed_job_records_exit_code(daemon: Daemon, tmp_path: Path) -> None:
    job = daemon.submit("--gpus", "0.1", "--", "/bin/sh", "-c", "exit 3")
    jobs = daemon.wait_states([job], {"failed"})
    assert jobs[job]["exit_code"] == 3
    missing = daemon.submit("--gpus", "0.1", "--", "/no/such/program")
    jobs = daemon.wait_states([missing], {"failed"})
    assert jobs[missing]["exit_code"] != 0


def test_interactive_submit_streams_output_and_status_watch_follows(daemon: Daemon, tmp_path: Path) -> None:
    import json
    import subprocess

    from daemon_harness import EVENTSCHED, cli_env

    watch = subprocess.Popen(
        [*EVENTSCHED, "status", "--watch", "--json"], env=cli_env(daemon.state_dir),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        result = daemon.cli("submit", "--interactive", "--gpus", "0.5", "--", "/bin/sh", "-c", "echo first; sleep 0.3; echo second")
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        job = int(lines[0])
        assert lines[1:] == ["first", "second"]
        # the watcher printed a status in which the job was running
        import queue
        import threading

        # a reader thread, since select() cannot see lines already buffered
        lines_out: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines_out.put(l) for l in watch.stdout], daemon=True).start()
        seen_running = False
        while not seen_running:
            try:
                line = lines_out.get(timeout=20)
            except queue.Empty:
                raise AssertionError("status --watch printed nothing for 20 s") from None
            assert line, watch.stderr.read()
            status = json.loads(line)
            seen_running = any(j["id"] == job and j["state"] == "running" for j in status["jobs"])
    finally:
        watch.terminate()
        watch.wait(10)


def test_pipelined_bulk_submission_keeps_order(daemon: Daemon, tmp_path: Path) -> None:
    from eventsched.domain.events import JobSpec
    from eventsched.wire.client import Client, ClientError

    with Client(daemon.socket) as c:
        ids = c.submit_many([JobSpec(command=["/bin/true"], gpus=0.25, cwd="/tmp", name=f"sweep-{i}") for i in range(40)])
        assert ids == sorted(ids) and len(set(ids)) == 40
        jobs = daemon.wait_states(ids, {"succeeded"}, timeout=60)
        assert [jobs[i]["name"] for i in ids] == [f"sweep-{i}" for i in range(40)]
        with pytest.raises(ClientError, match="GPU"):
            c.submit_many([JobSpec(command=["/bin/true"], gpus=1.0, cwd="/tmp"), JobSpec(command=["/bin/true"], gpus=9.0, cwd="/tmp")])
