"""What users of Slurm and of the predecessors type, through the CLI against
a real root daemon on fake GPUs: ``queue -t R -u alice`` and ``--name``,
``cancel --user/--state/--name`` (each user only their own jobs), ``pause 0``,
``resume 0`` and ``list-jobs --status running``, ``status --detailed`` and a
``status --json`` with version, uptime and health, ``serve --log-level DEBUG``
and ``--log-file`` with rotation, and ``submit "python train.py --lr 1"``
without ``--``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import EVENTSCHED, Daemon
from users_harness import User, as_user, needs_root, public_dir, root_daemon, users  # noqa: F401

import eventsched
from eventsched.runtime.daemon import LOG_FILE_BACKUPS, LOG_FILE_BYTES

# GPU 0 runs jobs; GPUs 1-3 stay paused, so a job sent to GPU 1 waits, queued, for as long as a test needs
RUN, WAIT = ["--gpu-ids", "0"], ["--gpu-ids", "1"]


@pytest.fixture(scope="module")
def daemon(public_dir: Path) -> Iterator[Daemon]:  # noqa: F811
    with root_daemon(public_dir, gpus="fake:4:16384") as d:
        for gpu in "123":
            assert d.cli("pause-gpu", gpu).returncode == 0
        yield d


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def ids_of(d: Daemon, *args: str) -> list[int]:
    """The ids ``queue ARGS --json`` lists."""
    return sorted(j["id"] for j in json.loads(ok(d.cli("queue", *args, "--json"))))


def cancelled(stdout: str) -> list[int]:
    """The ids of ``cancel``'s "ID<tab>cancelled" lines."""
    return sorted(int(line.split("\t")[0]) for line in stdout.splitlines() if line.endswith("\tcancelled"))


def submit_as(user: User, d: Daemon, *args: str) -> int:
    return int(ok(as_user(user, d.state_dir, "submit", *args)))


def test_queue_filters_by_state_user_and_name_in_any_spelling(daemon: Daemon) -> None:
    running = daemon.submit("--name", "q-train", *RUN, "--", "sleep", "300")
    waiting = [daemon.submit("--name", name, *WAIT, "--", "true") for name in ("q-eval", "q-train")]
    daemon.wait_states([running], {"running"})
    assert ids_of(daemon, "-t", "R", "--name", "q-train,q-eval") == [running]
    for spelling in ("PD", "pd", "queued", "QUEUED,held", "pending"):
        assert ids_of(daemon, "--state", spelling, "-n", "q-train,q-eval") == waiting
    assert ids_of(daemon, "--name", "q-train") == [running, waiting[1]]
    assert ids_of(daemon, "-u", "root", "--name", "q-eval") == [waiting[0]]
    assert ids_of(daemon, "--user", "nobody-here") == []
    # the table says the same as --json, and says when nothing matches
    table = ok(daemon.cli("queue", "--state", "running", "--name", "q-train"))
    assert [line.split()[0] for line in table.splitlines()[1:]] == [str(running)]
    assert ok(daemon.cli("queue", "--user", "nobody-here")).strip() == "no job matches"
    # a finished state lists finished jobs without --all
    ok(daemon.cli("cancel", str(waiting[0])))
    assert ids_of(daemon, "-t", "CA", "--name", "q-eval") == [waiting[0]]
    # a state that does not exist: one line, nothing sent
    bad = daemon.cli("queue", "--state", "runing")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "'runing': not a job state" in bad.stderr
    ok(daemon.cli("cancel", "--name", "q-train"))


def test_list_jobs_status_and_pause_resume_are_the_seeds_spellings(daemon: Daemon) -> None:
    running = daemon.submit("--name", "alias", *RUN, "--", "sleep", "300")
    daemon.wait_states([running], {"running"})
    assert ids_of(daemon, "--state", "running") == [running]
    assert sorted(j["id"] for j in json.loads(ok(daemon.cli("list-jobs", "--status", "running", "--json")))) == [running]
    assert ok(daemon.cli("pause", "0")).strip() == "gpu 0: paused"
    assert daemon.status()["gpus"][0]["paused"]
    assert ok(daemon.cli("resume", "0")).strip() == "gpu 0: accepting jobs"
    assert not daemon.status()["gpus"][0]["paused"]
    ok(daemon.cli("cancel", str(running)))


@needs_root
def test_cancel_by_state_user_and_name_takes_only_what_the_user_may(daemon: Daemon, users) -> None:  # noqa: F811
    alice, bob = users
    hers = [submit_as(alice, daemon, "--name", "c-job", *WAIT, "--", "true") for _ in range(2)]
    his = submit_as(bob, daemon, "--name", "c-job", *WAIT, "--", "true")
    other = daemon.submit("--name", "c-other", *WAIT, "--", "true")

    # neither ids nor a filter: one line
    empty = daemon.cli("cancel")
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1 and "--state, --user or --name" in empty.stderr
    # alice's selection takes in bob's job: hers are cancelled, his refused in one line, exit 1
    result = as_user(alice, daemon.state_dir, "cancel", "--name", "c-job", "--state", "PD")
    assert result.returncode == 1 and cancelled(result.stdout) == hers
    assert result.stderr.strip() == f"job {his}: belongs to {bob.name}"
    result = as_user(alice, daemon.state_dir, "cancel", "-u", bob.name)
    assert result.returncode == 1 and result.stderr.strip() == f"job {his}: belongs to {bob.name}"
    assert daemon.jobs()[his]["state"] == "queued"
    # ids and a filter: only the ids named that match
    assert cancelled(ok(daemon.cli("cancel", str(his), str(other), "--user", bob.name))) == [his]
    assert daemon.jobs()[other]["state"] == "queued"
    # nothing matches: said, and no failure
    none = daemon.cli("cancel", "--name", "c-job")
    assert none.returncode == 0 and none.stderr.strip() == "no queued, held or running job matches"
    ok(daemon.cli("cancel", "--state", "queued", "--name", "c-other"))
    assert daemon.jobs()[other]["state"] == "cancelled"


def test_status_json_is_stable_and_detailed_shows_daemon_gpus_and_jobs(daemon: Daemon) -> None:
    running = daemon.submit("--name", "st-job", *RUN, "--gpu-mem", "1000", "--", "sleep", "300")
    daemon.wait_states([running], {"running"})
    status = daemon.status()
    assert {"nodes", "gpus", "jobs", "policy", "seq", "containment", "memory_limit"} <= status.keys()
    assert status["version"] == eventsched.__version__
    assert isinstance(status["uptime_s"], float) and status["uptime_s"] > 0
    assert status["health"] == {"status": "ok", "problems": []}
    text = ok(daemon.cli("status", "--detailed"))
    assert text.startswith(f"eventsched {eventsched.__version__}, daemon up ") and "health ok" in text.splitlines()[0]
    assert "HELD BY JOBS" in text and "policy " in text  # the GPUs' details, and status's own table
    line = next(line for line in text.splitlines() if line.startswith(f"{running} "))
    assert "st-job" in line and "running" in line and "1000 MiB" in line and line.endswith("sleep 300")
    ok(daemon.cli("cancel", str(running)))


def test_health_says_degraded_while_a_gpu_is_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML is the tests' fake (tests/fake_nvml.py), scripted: GPU 1 is lost a second after start-up
    monkeypatch.setenv("EVENTSCHED_TEST_NVML", str(Path(__file__).parent / "fake_nvml.py"))
    monkeypatch.setenv("EVENTSCHED_TEST_NVML_SCRIPT", json.dumps({"gpus": 2, "mem_mib": 40960,
                                                                   "faults": [[1.0, 1, "lost"]]}))
    with Daemon(tmp_path / "state", gpus="nvml") as d:
        assert d.status()["health"]["status"] in ("ok", "degraded")
        deadline = time.monotonic() + 15
        while d.status()["health"]["status"] == "ok" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d.status()["health"] == {"status": "degraded", "problems": ["GPU 1: lost"]}
        assert ok(d.cli("status", "--detailed")).splitlines()[0].endswith("health degraded; GPU 1: lost")


def test_a_quoted_command_without_dashes_runs_its_words_without_a_shell(daemon: Daemon) -> None:
    job = daemon.submit("--gpus", "0", "--name", "bare", "echo 'a;b' $HOME \"two words\"")
    done = daemon.wait_states([job], {"succeeded", "failed"})[job]
    assert done["state"] == "succeeded" and done["command"] == ["echo", "a;b", "$HOME", "two words"]
    assert daemon.logs(job) == "a;b $HOME two words\n"  # no shell: $HOME stays as written
    # what only a shell does is refused in one line, and nothing is submitted
    before = len(daemon.jobs())
    for argv, says in ((["echo a | tr a b"], "needs a shell ('|')"), (["python x.py", "--", "y"], "after `--`"),
                       (["python", "train.py"], "one quoted string"), (["'unclosed"], "No closing quotation")):
        refused = daemon.cli("submit", "--gpus", "0", *argv)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and says in refused.stderr, refused.stderr
    assert len(daemon.jobs()) == before
    # with `--`, one string is a shell command line, as before
    piped = daemon.submit("--gpus", "0", "--", "echo piped | tr a-z A-Z")
    daemon.wait_states([piped], {"succeeded"})
    assert daemon.logs(piped) == "PIPED\n"


def test_log_level_in_any_case_and_a_rotated_log_file(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    with open(log, "wb") as f:  # a full log file: the daemon's first line rotates it
        f.truncate(LOG_FILE_BYTES)
    with Daemon(tmp_path / "state", extra=["--log-level", "DEBUG", "--log-file", str(log)]) as d:
        assert d.cli("health").returncode == 0
        entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert (tmp_path / "daemon.log.1").stat().st_size == LOG_FILE_BYTES
    assert stat.S_IMODE(log.stat().st_mode) == 0o640 & ~current_umask()
    assert any(e["level"] == "debug" for e in entries)
    assert any("serving on" in e["msg"] for e in entries)
    assert "serving on" not in (tmp_path / "state" / "daemon.stderr").read_text()  # the file instead of stderr
    # what --help promises is what the daemon does
    help_text = " ".join(ok(subprocess.run([*EVENTSCHED, "serve", "--help"], capture_output=True, text=True)).split())
    assert f"rotated at {LOG_FILE_BYTES >> 20} MiB" in help_text and f"PATH.{LOG_FILE_BACKUPS}" in help_text
    # a level that does not exist, or a log file that cannot be made: one line, exit 2
    for extra, says in ((["--log-level", "LOUD"], "invalid choice: 'loud'"),
                        (["--log-file", str(tmp_path / "no" / "such" / "x.log")], "No such file or directory")):
        r = subprocess.run([*EVENTSCHED, "serve", "--gpus", "fake:1", "--state-dir", str(tmp_path / "s2"), *extra],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
