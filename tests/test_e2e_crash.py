"""kill -9 the daemon while jobs run and clients submit; the restart loses nothing."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from daemon_harness import Daemon, cli_env

pytestmark = pytest.mark.slow


def test_restart_adopts_running_jobs_and_never_runs_one_twice(tmp_path: Path) -> None:
    state = tmp_path / "state"
    runs = tmp_path / "runs"
    runs.mkdir()
    gate = tmp_path / "gate"
    script = tmp_path / "job.sh"
    # each run leaves a file; a job run twice would leave two lines
    script.write_text(f'#!/bin/sh\necho "$EVENTSCHED_JOB_ID" >> {runs}/"$EVENTSCHED_JOB_ID"\n'
                      f'while [ ! -e {gate} ]; do sleep 0.05; done\nexit "$1"\n')
    script.chmod(0o755)
    daemon = Daemon(state, gpus="fake:2:16384").start()
    try:
        quick = daemon.submit("--gpus", "0.5", "--", "/bin/sh", "-c", "exit 7")
        daemon.wait_states([quick], {"failed"})
        long_ok = daemon.submit("--gpus", "0.5", "--", str(script), "0")
        long_bad = daemon.submit("--gpus", "0.5", "--", str(script), "4")
        queued = daemon.submit("--gpus", "2", "--", str(script), "0")
        daemon.wait_states([long_ok, long_bad], {"running"})
        daemon.kill9()
        # the jobs outlive the daemon; one of them ends while it is down
        gate.touch()
        time.sleep(1.0)
        daemon = Daemon(state, gpus="fake:2:16384").start()
        jobs = daemon.wait_states([long_ok, long_bad, queued], {"succeeded", "failed"}, timeout=30)
        assert jobs[quick]["exit_code"] == 7
        assert jobs[long_ok]["state"] == "succeeded" and jobs[long_ok]["exit_code"] == 0
        assert jobs[long_bad]["state"] == "failed" and jobs[long_bad]["exit_code"] == 4
        assert jobs[queued]["state"] == "succeeded"
        for job in (long_ok, long_bad, queued):
            assert (runs / str(job)).read_text().split() == [str(job)], f"job {job} ran more than once"
    finally:
        daemon.stop()


def test_restart_while_a_job_is_still_running_readopts_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    gate = tmp_path / "gate"
    daemon = Daemon(state, gpus="fake:1").start()
    try:
        job = daemon.submit("--", "/bin/sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done; echo done")
        daemon.wait_states([job], {"running"})
        daemon.kill9()
        daemon = Daemon(state, gpus="fake:1").start()
        jobs = daemon.jobs()
        assert jobs[job]["state"] == "running"
        second = daemon.submit("--", "/bin/true")
        time.sleep(0.5)
        assert daemon.jobs()[second]["state"] == "queued", "the adopted job still holds its GPU"
        gate.touch()
        jobs = daemon.wait_states([job, second], {"succeeded"})
        assert daemon.cli("logs", str(job)).stdout.strip() == "done"
    finally:
        daemon.stop()


def test_every_acknowledged_submission_survives_kill9(tmp_path: Path) -> None:
    state = tmp_path / "state"
    daemon = Daemon(state, gpus="fake:2").start()
    acknowledged: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def submitter() -> None:
        while not stop.is_set():
            result = subprocess.run(
                [sys.executable, "-m", "eventsched.cli", "submit", "--gpus", "2", "--priority", "-1", "--", "/bin/true"],
                env=cli_env(state), capture_output=True, text=True,
            )
            if result.returncode == 0:
                with lock:
                    acknowledged.append(int(result.stdout))
            elif "Traceback" not in result.stderr and any(
                    said in result.stderr for said in ("no eventsched daemon", "closed the connection", "went away")):
                time.sleep(0.05)  # killed mid-request: one clear line, and the test goes on
            else:
                raise AssertionError(result.stderr)

    threads = [threading.Thread(target=submitter) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        for _ in range(3):
            time.sleep(1.0)
            daemon.kill9()
            daemon = Daemon(state, gpus="fake:2").start()
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join()
        jobs = daemon.jobs()
        assert len(acknowledged) > 5
        missing = [job for job in acknowledged if job not in jobs]
        assert not missing, f"acknowledged but lost: {missing}"
        assert len(acknowledged) == len(set(acknowledged)), "a job id was handed out twice"
        assert daemon.cli("log", "verify", str(state / "log")).returncode == 0
    finally:
        stop.set()
        daemon.stop()


def test_snapshots_speed_up_start_but_deleting_them_changes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    daemon = Daemon(state, gpus="fake:2").start()
    try:
        done = [daemon.submit("--gpus", "0.5", "--", "/bin/sh", "-c", f"exit {i}") for i in range(4)]
        daemon.wait_states(done, {"succeeded", "failed"})
        daemon.cli("pause-gpu", "1")
        waiting = daemon.submit("--gpus", "2", "--", "/bin/true")
        before = daemon.jobs()
        daemon.stop()  # SIGTERM: records the stop and writes a snapshot
        snapshots = list((state / "snapshots").glob("*"))
        assert snapshots, "a graceful stop leaves a snapshot"
        daemon = Daemon(state, gpus="fake:2").start()
        assert daemon.jobs() == before
        assert daemon.status()["gpus"][1]["paused"]
        daemon.stop()
        for snapshot in snapshots:
            snapshot.unlink()
        daemon = Daemon(state, gpus="fake:2").start()
        assert daemon.jobs() == before
        assert before[waiting]["state"] == "queued"
    finally:
        daemon.stop()
