"""`update JOB` (as `scontrol update`), `submit --begin TIME` and `submit-file
--session/--dedupe`, through the CLI against one root daemon on two fake GPUs,
with two real users. A job of root's holds GPU 0 for the whole module, so jobs
pinned there (`--gpu-ids 0`, jobs-file lines ending in `,0`) stay queued."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import EVENTSCHED, Daemon
from users_harness import User, as_user, needs_root, public_dir, root_daemon, users  # noqa: F401  # fixtures

pytestmark = needs_root


@pytest.fixture(scope="module")
def daemon(public_dir: Path) -> Iterator[Daemon]:  # noqa: F811
    with root_daemon(public_dir, gpus="fake:2") as d:
        d.blocker = d.submit("--gpu-ids", "0", "--", "sleep", "600")  # type: ignore[attr-defined]
        d.wait_states([d.blocker], {"running"})  # type: ignore[attr-defined]
        yield d


def _queued(d: Daemon, user: User, *args: str) -> int:
    result = as_user(user, d.state_dir, "submit", "--gpu-ids", "0", *args, "--", "true")
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


def _refused(result, words: str) -> None:
    assert result.returncode != 0, result.stdout
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line and words in line, line


def _history(d: Daemon, sql: str, expect: list, timeout: float = 20.0) -> None:
    """The read model shows ``expect`` for ``sql`` (as CSV rows) once it has caught up."""
    deadline, rows = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        out = d.cli("sql", "--format", "csv", sql)
        rows = out.stdout.strip().splitlines()[1:]
        if rows == expect:
            return
        time.sleep(0.2)
    raise AssertionError(f"{sql}: {rows} != {expect}")


def test_an_update_changes_a_waiting_job_and_the_log_history_and_explain_show_it(
        daemon: Daemon, users: tuple[User, User]) -> None:  # noqa: F811
    alice, _ = users
    job = _queued(daemon, alice, "--priority", "1", "--name", "first")
    result = as_user(alice, daemon.state_dir, "update", str(job), "--priority", "5", "--time-limit", "10m",
                     "--name", "renamed")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{job}\tqueued\tpriority 5") and "time limit 600s" in result.stdout
    shown = daemon.jobs()[job]
    assert (shown["state"], shown["priority"], shown["name"], shown["time_limit_s"]) == ("queued", 5, "renamed", 600.0)
    story = daemon.cli("explain", str(job)).stdout
    assert f"updated by uid:{alice.uid}: priority 5, time limit 600s, name renamed" in story, story
    # a held job too, and it stays held
    assert as_user(alice, daemon.state_dir, "hold", str(job)).returncode == 0
    held = json.loads(as_user(alice, daemon.state_dir, "update", str(job), "--gpus", "0.5", "--json").stdout)
    assert (held["state"], held["gpus"]) == ("held", 0.5)
    _history(daemon, f"SELECT state, name, priority, gpus FROM jobs WHERE id = {job}", ["held,renamed,5,0.5"])
    _history(daemon, f"SELECT count(*) FROM job_updates WHERE job = {job}", ["2"])


def test_an_update_is_refused_for_a_running_or_ended_job_anothers_job_and_an_operators_priority(
        daemon: Daemon, users: tuple[User, User]) -> None:  # noqa: F811
    alice, bob = users
    job = _queued(daemon, alice)
    _refused(daemon.cli("update", str(daemon.blocker), "--priority", "3"),  # type: ignore[attr-defined]
             "is running; only a queued or held job can be updated")
    _refused(as_user(bob, daemon.state_dir, "update", str(job), "--priority", "3"), f"belongs to {alice.name}")
    _refused(as_user(alice, daemon.state_dir, "update", str(job), "--priority", "500"),
             "higher priorities are for operators")
    _refused(as_user(alice, daemon.state_dir, "update", str(job)), "nothing to update")
    _refused(as_user(alice, daemon.state_dir, "update", str(job), "--gpus", "3"), "asks for 3 GPUs")
    _refused(as_user(alice, daemon.state_dir, "update", "99999", "--name", "x"), "no job 99999")
    assert daemon.jobs()[job]["priority"] == 0  # nothing refused changed anything
    assert daemon.cli("update", str(job), "--priority", "500").returncode == 0  # root may
    assert daemon.jobs()[job]["priority"] == 500
    assert as_user(alice, daemon.state_dir, "cancel", str(job)).returncode == 0
    _refused(as_user(alice, daemon.state_dir, "update", str(job), "--name", "x"), "is cancelled")


def test_begin_keeps_a_job_queued_until_its_time_and_explain_says_so(daemon: Daemon) -> None:
    before = time.time()
    job = daemon.submit("--gpus", "0", "--begin", "now+3s", "--", "true")  # nothing else stops a CPU-only job
    waiting = daemon.jobs()[job]
    begin = waiting["not_before"]
    assert waiting["state"] == "queued" and before + 3 <= begin < before + 4
    why = daemon.cli("explain", str(job)).stdout
    clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(begin))
    assert f"reason: begin: waits for its begin time {clock}" in why, why
    ran = daemon.wait_states([job], {"succeeded"}, timeout=20)[job]
    assert ran["started_at"] >= begin
    # the other spellings: +DURATION, seconds, an ISO time; the full parser reads it as the fast path does
    later = [daemon.submit("--gpus", "0", "--begin", when, "--", "true") for when in ("+1h", "3600", "2099-01-01T00:00")]
    full = subprocess.run([*EVENTSCHED, "submit", "--gpus", "0", "--begin", "now+1h", "--", "true"],
                          env={**daemon.env(), "EVENTSCHED_NO_QUICK": "1"}, capture_output=True, text=True, timeout=30)
    later.append(int(full.stdout))
    time.sleep(0.5)
    jobs = daemon.jobs()
    assert all(jobs[j]["state"] == "queued" for j in later)
    assert "2099-01-01 00:00:00" in daemon.cli("explain", str(later[2])).stdout
    assert daemon.cli("cancel", *map(str, later)).returncode == 0
    _refused(daemon.cli("submit", "--begin", "tomorrow", "--", "true"), "--begin 'tomorrow': use now+10m")


def _jobs_file(tmp_path: Path, name: str, lines: list[str]) -> Path:
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(os.environ.get('TMUX', ''))\n")  # ARGS: FILE ...
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_submit_file_dedupe_skips_identical_lines_and_session_runs_each_line_in_tmux(
        daemon: Daemon, tmp_path: Path) -> None:
    same = "0,job.py,,/dev/null 1,0"
    twice = _jobs_file(tmp_path, "twice.txt", [same, same, "0,job.py,,/dev/null 2,0"])
    plain = daemon.cli("submit-file", str(twice), "--json")
    assert len(json.loads(plain.stdout)["ids"]) == 3  # without --dedupe, each line is a job
    again = _jobs_file(tmp_path, "again.txt", [same, same, "0,job.py,,/dev/null 3,0"])
    deduped = daemon.cli("submit-file", str(again), "--dedupe")
    assert deduped.returncode == 0, deduped.stderr
    first = deduped.stdout.split()
    assert len(first) == 2  # the second line is identical to the first's job, queued
    assert "1 line of" in deduped.stderr and "identical to a queued, running or succeeded job" in deduped.stderr
    elsewhere = daemon.cli("submit-file", str(_jobs_file(tmp_path, "third.txt", ["# a copy", same])), "--dedupe", "--json")
    assert json.loads(elsewhere.stdout)["skipped"] == [{"line": 2, "id": int(first[0])}]  # another file, same job
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    out = tmp_path / "tmux.out"
    session = _jobs_file(tmp_path, "session.txt", [f"0,job.py,,{out}"])  # any GPU: GPU 1 is free
    result = daemon.cli("submit-file", str(session), "--session", "tmux")
    assert result.returncode == 0, result.stderr
    job = int(result.stdout)
    daemon.wait_states([job], {"succeeded"}, timeout=30)
    assert out.read_text(), "the line did not run inside a tmux session"


def test_an_update_reorders_the_queue_and_a_replay_follows_it(daemon: Daemon, users: tuple[User, User],  # noqa: F811
                                                               tmp_path: Path) -> None:
    alice, _ = users
    pending = [j for j, info in daemon.jobs().items() if info["state"] in ("queued", "held")]
    daemon.cli("cancel", *map(str, pending))
    first, second = _queued(daemon, alice), _queued(daemon, alice)
    assert as_user(alice, daemon.state_dir, "update", str(second), "--priority", "10").returncode == 0
    daemon.cli("cancel", str(daemon.blocker))  # type: ignore[attr-defined]
    jobs = daemon.wait_states([first, second], {"succeeded"}, timeout=30)
    assert jobs[second]["started_at"] <= jobs[first]["started_at"]
    replay = daemon.cli("replay", str(daemon.state_dir), "--policy", "recorded", "--out", str(tmp_path), timeout=120)
    assert replay.returncode == 0, replay.stderr
    replayed = daemon.cli("sql", "--state-dir", str(tmp_path / "recorded"), "--format", "csv",
                          f"SELECT id, priority FROM jobs WHERE id IN ({first}, {second}) ORDER BY first_started_at")
    assert replayed.stdout.split()[1:] == [f"{second},10", f"{first},0"], replayed.stdout + replayed.stderr
