"""`submit --session tmux|screen` and `attach`, end to end: a real daemon on
fake GPUs, real tmux and screen sessions, the real CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import EVENTSCHED, Daemon

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/test.sh installs it)"),
]

FINAL = {"succeeded", "failed", "cancelled", "lost"}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with Daemon(tmp_path / "state", gpus="fake:2") as d:
        yield d


def capture(job: int) -> str:
    """What a user attached to the job's session sees on the screen now."""
    name = f"eventsched-{job}"
    result = subprocess.run(["tmux", "-L", name, "capture-pane", "-p", "-t", name], capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else ""


def wait_screen(job: int, text: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    shown = ""
    while time.monotonic() < deadline:
        shown = capture(job)
        if text in shown:
            return shown
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in job {job}'s session; it shows {shown!r}")


def test_tmux_job_shows_its_output_in_the_session_and_its_log_and_records_its_exit(daemon: Daemon, tmp_path: Path) -> None:
    go = tmp_path / "go"
    job = daemon.submit("--gpus", "0", "--session", "tmux", "--",
                        "sh", "-c", f'echo "hello from $EVENTSCHED_JOB_ID"; while [ ! -e {go} ]; do sleep 0.05; done; exit 3')
    shown = wait_screen(job, f"hello from {job}")
    assert daemon.jobs()[job]["state"] == "running"
    assert f"hello from {job}" in shown
    # attach with no terminal: one line that names the command to use
    result = daemon.cli("attach", str(job))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"tmux -L eventsched-{job} attach-session" in result.stderr
    go.touch()
    jobs = daemon.wait_states([job], FINAL)
    assert jobs[job]["state"] == "failed"
    assert jobs[job]["exit_code"] == 3 and jobs[job]["signal"] is None
    assert f"hello from {job}" in daemon.logs(job)
    # the session is gone with the job; attaching says so in one line
    assert capture(job) == ""
    result = daemon.cli("attach", str(job))
    assert result.returncode != 0 and "has ended (failed)" in result.stderr


def test_a_session_job_killed_by_a_signal_is_recorded_with_that_signal(daemon: Daemon) -> None:
    ok = daemon.submit("--gpus", "0", "--session", "tmux", "--", "true")
    killed = daemon.submit("--gpus", "0", "--session", "tmux", "--", "sh", "-c", "kill -9 $$")
    jobs = daemon.wait_states([ok, killed], FINAL)
    assert jobs[ok]["state"] == "succeeded" and jobs[ok]["exit_code"] == 0
    assert jobs[killed]["state"] == "failed"
    assert jobs[killed]["signal"] == 9 and jobs[killed]["exit_code"] is None


def test_cancel_ends_a_session_job_and_its_session(daemon: Daemon) -> None:
    job = daemon.submit("--gpus", "0", "--session", "tmux", "--", "sh", "-c", "echo started; sleep 300")
    wait_screen(job, "started")
    result = daemon.cli("cancel", str(job))
    assert result.returncode == 0, result.stderr
    jobs = daemon.wait_states([job], FINAL)
    assert jobs[job]["state"] == "cancelled"
    deadline = time.monotonic() + 5
    while capture(job) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert capture(job) == "", "the session outlived its cancelled job"


def test_a_restarted_daemon_readopts_a_session_job_and_records_its_exit(tmp_path: Path) -> None:
    go = tmp_path / "go"
    d = Daemon(tmp_path / "state", gpus="fake:2").start()
    try:
        job = d.submit("--gpus", "0", "--session", "tmux", "--",
                       "sh", "-c", f"echo waiting; while [ ! -e {go} ]; do sleep 0.05; done; exit 7")
        wait_screen(job, "waiting")
        d.stop()
        assert "waiting" in capture(job), "the session must outlive the daemon"
        d.start()
        assert d.jobs()[job]["state"] == "running"
        go.touch()
        jobs = d.wait_states([job], FINAL)
        assert jobs[job]["state"] == "failed" and jobs[job]["exit_code"] == 7
    finally:
        d.stop()


def test_missing_tmux_is_refused_at_submit_with_one_line(daemon: Daemon, tmp_path: Path) -> None:
    env = daemon.env()
    env["PATH"] = str(tmp_path / "empty-bin")  # the job's PATH: no tmux on it
    result = subprocess.run([*EVENTSCHED, "submit", "--gpus", "0", "--session", "tmux", "--", "/bin/true"],
                            env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "eventsched: error: tmux is not installed on this machine; apt-get install tmux"
    ]
    assert daemon.jobs() == {}


def test_attach_refuses_a_job_without_a_session(daemon: Daemon, tmp_path: Path) -> None:
    go = tmp_path / "go"
    job = daemon.submit("--gpus", "0", "--", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done")
    daemon.wait_states([job], {"running"})
    result = daemon.cli("attach", str(job))
    go.touch()
    assert result.returncode != 0
    assert "has no terminal session" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(shutil.which("screen") is None, reason="screen is not installed (scripts/test.sh installs it)")
def test_screen_job_logs_its_output_and_records_its_exit(daemon: Daemon, tmp_path: Path) -> None:
    go = tmp_path / "go"
    job = daemon.submit("--gpus", "0", "--session", "screen", "--",
                        "sh", "-c", f"echo screen-says-hi; while [ ! -e {go} ]; do sleep 0.05; done; exit 4")
    daemon.wait_states([job], {"running"})
    deadline = time.monotonic() + 10
    listed = ""
    while time.monotonic() < deadline and f"eventsched-{job}" not in listed:
        listed = subprocess.run(["screen", "-ls"], capture_output=True, text=True).stdout
        time.sleep(0.05)
    assert f".eventsched-{job}\t" in listed  # `screen -r eventsched-JOB` attaches to it
    go.touch()
    jobs = daemon.wait_states([job], FINAL)
    assert jobs[job]["state"] == "failed" and jobs[job]["exit_code"] == 4
    assert "screen-says-hi" in daemon.logs(job)


def test_submit_rejects_an_unknown_session_kind(daemon: Daemon) -> None:
    result = daemon.cli("submit", "--session", "zellij", "--", "true")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--session" in result.stderr
    assert json.loads(daemon.cli("queue", "--all", "--json").stdout) == []
    assert sys.executable  # the CLI ran under this interpreter
