"""A job's output over the HTTP API: ``logs``, ``logs -f`` and ``submit
--interactive`` through ``EVENTSCHED_URL``, as they are on the socket.

A root daemon on fake GPUs serves ``--http`` on loopback; two real users
(``users_harness``) and root each hold a token. Users read only their own
jobs' output, root (an operator) anyone's, as on the socket.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import EVENTSCHED, Daemon
from test_http_api import call, free_port
from users_harness import User, as_user, needs_root, public_dir, root_daemon, user_env, users  # noqa: F401

from eventsched.wire.http_client import HttpClient

pytestmark = needs_root

NOISY = "echo out; echo err >&2; printf 'no newline'"


class Setup:
    def __init__(self, daemon: Daemon, url: str, alice: User, bob: User) -> None:
        self.daemon, self.url, self.alice, self.bob = daemon, url, alice, bob
        self.tokens: dict[str, str] = {}

    def http_env(self, name: str) -> dict[str, str]:
        return {"EVENTSCHED_URL": self.url, "EVENTSCHED_TOKEN": self.tokens[name]}

    def cli(self, user: User, *args: str, http: bool = True) -> subprocess.CompletedProcess:
        """``eventsched ARGS`` as ``user``, over HTTP or over the socket."""
        env = user_env(user, self.daemon.state_dir, **(self.http_env(user.name) if http else {}))
        return as_user(user, self.daemon.state_dir, *args, env=env)

    def root(self, *args: str, http: bool = True) -> subprocess.Popen:
        """``eventsched ARGS`` as root (an operator), running."""
        env = {**self.daemon.env(), **(self.http_env("root") if http else {})}
        return subprocess.Popen([*EVENTSCHED, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    def submit(self, user: User, script: str) -> int:
        made = self.cli(user, "submit", "--gpus", "0.25", "--", "sh", "-c", script, http=False)
        assert made.returncode == 0, made.stderr
        return int(made.stdout)


@pytest.fixture(scope="module")
def setup(users: tuple[User, User], public_dir: Path) -> Iterator[Setup]:  # noqa: F811
    port = free_port()
    with root_daemon(public_dir, "--http", f"127.0.0.1:{port}", gpus="fake:2:16384") as daemon:
        s = Setup(daemon, f"http://127.0.0.1:{port}", *users)
        for user in users:
            made = as_user(user, daemon.state_dir, "token", "create", "--name", "logs")
            assert made.returncode == 0, made.stderr
            s.tokens[user.name] = made.stdout.strip()
        made = daemon.cli("token", "create", "--name", "root")
        assert made.returncode == 0, made.stderr
        s.tokens["root"] = made.stdout.strip()
        yield s


def finished(root: subprocess.Popen, timeout: float = 20.0) -> tuple[int, str, str]:
    try:
        out, err = root.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(root.pid, signal.SIGKILL)
        raise
    return root.returncode, out, err


def test_logs_over_http_print_what_the_socket_prints(setup: Setup) -> None:
    alice = setup.alice
    done = setup.submit(alice, NOISY)
    setup.daemon.wait_states([done], {"succeeded"})
    local = setup.cli(alice, "logs", str(done), http=False)
    assert local.returncode == 0 and local.stdout == "out\nerr\nno newline"
    for args in (["logs", str(done)], ["logs", "-f", str(done)], ["logs", "99999"]):
        remote = setup.cli(alice, *args)
        socket = setup.cli(alice, *args, http=False)
        assert (remote.returncode, remote.stdout, remote.stderr) == (socket.returncode, socket.stdout, socket.stderr), args
    assert setup.cli(alice, "logs", "99999").stderr == "eventsched: error: no job 99999\n"


def test_logs_f_over_http_streams_until_the_job_ends(setup: Setup) -> None:
    alice = setup.alice
    job = setup.submit(alice, "echo first; sleep 1.5; echo second")
    setup.daemon.wait_states([job], {"running"})
    follow = setup.cli(alice, "logs", "-f", str(job))
    assert follow.returncode == 0 and follow.stdout == "first\nsecond\n" and follow.stderr == ""
    assert setup.daemon.jobs()[job]["state"] == "succeeded"  # it returned when the job ended, not before


def test_a_user_reads_only_their_own_jobs_output_and_an_operator_anyones(setup: Setup) -> None:
    alice, bob = setup.alice, setup.bob
    job = setup.submit(alice, "echo secret")
    setup.daemon.wait_states([job], {"succeeded"})
    for args in (["logs", str(job)], ["logs", "-f", str(job)]):
        refused = setup.cli(bob, *args)
        assert refused.returncode == 1 and refused.stdout == ""
        assert refused.stderr == f"eventsched: error: job {job} belongs to {alice.name}\n"
        assert "JobLogPath" not in refused.stderr
    status, answer = call(f"{setup.url}/v1/jobs/{job}/logs", token=setup.tokens[bob.name])
    assert status == 403 and "belongs to" in answer["error"]
    status, answer = call(f"{setup.url}/v1/jobs/{job}/logs")
    assert status == 401
    status, answer = call(f"{setup.url}/v1/jobs/{job}/logs?offset=x", token=setup.tokens[alice.name])
    assert status == 400 and "offset" in answer["error"]
    status, answer = call(f"{setup.url}/v1/jobs/{job}/logs?offset=3", token=setup.tokens[alice.name])
    assert (status, answer) == (200, "ret\n")
    operator = setup.root("logs", str(job))
    assert finished(operator) == (0, "secret\n", "")


def test_submit_interactive_over_http_prints_the_output_and_exits_with_the_jobs_status(setup: Setup) -> None:
    alice = setup.alice
    failing = setup.cli(alice, "submit", "--gpus", "0.25", "--interactive", "--", "sh", "-c", "echo working; exit 7")
    assert failing.returncode == 7 and failing.stderr == ""
    job, output = failing.stdout.split("\n", 1)
    assert job.isdigit() and output == "working\n"
    assert setup.cli(alice, "submit", "--gpus", "0.25", "--interactive", "--", "true").returncode == 0
    # killed by a signal: 128 + N, as on the socket
    killed = setup.cli(alice, "submit", "--gpus", "0.25", "--interactive", "--", "sh", "-c", "kill -TERM $$")
    assert killed.returncode == 128 + signal.SIGTERM


def test_ctrl_c_detaches_and_the_job_keeps_running(setup: Setup) -> None:
    interactive = setup.root("submit", "--gpus", "0.25", "--interactive", "--", "sh", "-c", "echo started; sleep 30")
    assert interactive.stdout is not None
    job = int(interactive.stdout.readline())
    assert interactive.stdout.readline() == "started\n"
    interactive.send_signal(signal.SIGINT)
    code, _, err = finished(interactive)
    assert code == 0 and err == f"\ndetached; job {job} keeps running (eventsched logs {job} -f)\n"
    assert setup.daemon.jobs()[job]["state"] == "running"
    assert setup.daemon.cli("cancel", str(job)).returncode == 0


def test_a_silent_job_is_followed_across_reconnections_without_losing_or_repeating_bytes(setup: Setup) -> None:
    job = setup.submit(setup.alice, "echo a; sleep 1.2; echo b; sleep 0.8; printf c")
    # a client that gives up on a silent connection after 0.5 s asks again from where it stopped
    with HttpClient(setup.url, setup.tokens[setup.alice.name], timeout=0.5) as client:
        assert b"".join(client.output(job, follow=True)) == b"a\nb\nc"


def test_attach_over_http_says_it_needs_the_daemons_machine(setup: Setup) -> None:
    attach = setup.cli(setup.alice, "attach", "1")
    assert attach.returncode == 2 and len(attach.stderr.splitlines()) == 1 and "EVENTSCHED_URL" in attach.stderr


def test_sql_tables_name_columns_as_csv_does(setup: Setup) -> None:
    query = 'SELECT user, id AS "Job", count(*) OVER () FROM jobs LIMIT 1'
    for who in ("alice", "root"):  # the daemon answers alice (the log is root's); root reads it here
        def sql(fmt: str) -> str:
            if who == "root":
                return finished(setup.root("sql", "--format", fmt, query))[1]
            return setup.cli(setup.alice, "sql", "--format", fmt, query).stdout

        table, csv = sql("table").splitlines()[0], sql("csv").splitlines()[0]
        assert re.split(r" {2,}", table) == csv.split(",") == ["user", "Job", "count() OVER ()"], who


def test_a_followed_output_cut_short_by_a_stopping_daemon_says_so(tmp_path: Path) -> None:
    port = free_port()
    daemon = Daemon(tmp_path / "state", gpus="fake:1", extra=["--http", f"127.0.0.1:{port}"]).start()
    try:
        token = daemon.cli("token", "create").stdout.strip()
        job = daemon.submit("--", "sh", "-c", "echo started; sleep 8")
        env = {**daemon.env(), "EVENTSCHED_URL": f"http://127.0.0.1:{port}", "EVENTSCHED_TOKEN": token}
        follow = subprocess.Popen([*EVENTSCHED, "logs", "-f", str(job)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert follow.stdout is not None and follow.stdout.readline() == "started\n"
        started = time.monotonic()
        daemon.stop()
        code, _, err = finished(follow, timeout=10)
        assert code == 1 and "stopped sending" in err and len(err.splitlines()) == 1
        assert time.monotonic() - started < 5  # the stream ended with the daemon, not with the job
    finally:
        daemon.stop()
