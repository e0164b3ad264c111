"""The CLI's edges no other test reaches, through the real ``eventsched`` process:
over ``EVENTSCHED_URL`` a wrong token, commands the HTTP API does not offer, an
array without the fast path, and servers that are not eventsched (a tiny
``http.server`` here); and, without a daemon, option mistakes, a log with a
segment missing, and ``sql -o`` writing text to a file.

Each refusal is one line on stderr, nothing on stdout, its exit status, and
nothing changed.
"""

from __future__ import annotations

import contextlib
import csv
import http.server
import io
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from daemon_harness import EVENTSCHED, Daemon, free_port
from test_log import write_log

NOT_IN_API = "eventsched: error: `{}` is not part of the HTTP API; run it on the daemon's machine (without EVENTSCHED_URL)\n"


def _cli(*args: str, env: dict[str, str], cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*EVENTSCHED, *args], env=env, capture_output=True, text=True, timeout=30, cwd=cwd)


def _plain_env(state_dir: Path, **extra: str) -> dict[str, str]:
    """No EVENTSCHED_* of the caller's but the pure build; the state dir given (no daemon there)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EVENTSCHED_") or k == "EVENTSCHED_PURE"}
    return {**environ, "EVENTSCHED_STATE_DIR": str(state_dir), **extra}


def _refused(result: subprocess.CompletedProcess, stderr: str, code: int) -> None:
    assert (result.returncode, result.stdout, result.stderr) == (code, "", stderr), result.stderr


class HttpDaemon:
    def __init__(self, daemon: Daemon, url: str, token: str, elsewhere: Path) -> None:
        self.daemon, self.url, self.token, self.elsewhere = daemon, url, token, elsewhere

    def cli(self, *args: str, token: str | None = None, quick: bool = True) -> subprocess.CompletedProcess:
        """``eventsched ARGS`` over HTTP only: its state dir holds no socket to fall back on."""
        env = _plain_env(self.elsewhere, EVENTSCHED_URL=self.url, EVENTSCHED_TOKEN=token or self.token)
        if not quick:
            env["EVENTSCHED_NO_QUICK"] = "1"
        return _cli(*args, env=env)


@pytest.fixture(scope="module")
def http_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    port = free_port()
    daemon = Daemon(tmp_path_factory.mktemp("edges"), gpus="fake:2:16384", extra=["--http", f"127.0.0.1:{port}"])
    daemon.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:  # the socket answers first; the HTTP server a moment later
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, daemon.stderr()
                time.sleep(0.05)
        made = daemon.cli("token", "create", "--name", "edges")
        assert made.returncode == 0, made.stderr
        yield HttpDaemon(daemon, url, made.stdout.strip(), tmp_path_factory.mktemp("elsewhere"))
    finally:
        daemon.stop()


# --- over EVENTSCHED_URL, a real daemon -------------------------------------------------


def test_a_wrong_token_is_one_line_and_submits_nothing(http_daemon: HttpDaemon) -> None:
    before = http_daemon.daemon.jobs()
    said = f"eventsched: error: {http_daemon.url}: unknown or revoked token (EVENTSCHED_TOKEN)\n"
    for args, quick in ((["queue"], True), (["status"], True), (["submit", "--", "true"], True),
                        (["submit", "--", "true"], False)):
        _refused(http_daemon.cli(*args, token="est_not-a-token", quick=quick), said, 1)
    assert http_daemon.daemon.jobs() == before


def test_commands_outside_the_http_api_say_so_and_change_nothing(http_daemon: HttpDaemon) -> None:
    job = http_daemon.daemon.submit("--gpus", "0.5", "--", "sleep", "60")
    http_daemon.daemon.wait_states([job], {"running"})
    try:
        for args in (["hold", str(job)], ["release", str(job)], ["pause-gpu", "0"], ["resume-gpu", "1"]):
            _refused(http_daemon.cli(*args), NOT_IN_API.format(args[0]), 1)
        assert http_daemon.daemon.jobs()[job]["state"] == "running"
        assert not any(gpu["paused"] for gpu in http_daemon.daemon.status()["gpus"])
    finally:
        http_daemon.daemon.cli("cancel", str(job))


def test_an_array_over_http_without_the_fast_path(http_daemon: HttpDaemon) -> None:
    made = http_daemon.cli("submit", "--array", "0-2", "--gpus", "0.25", "--name", "edge-array", "--", "true",
                           quick=False)
    assert made.returncode == 0 and made.stderr == "", made.stderr
    ids = [int(line) for line in made.stdout.splitlines()]
    jobs = http_daemon.daemon.jobs()
    assert [(jobs[i]["name"], jobs[i]["array_index"]) for i in ids] == [("edge-array", 0), ("edge-array", 1),
                                                                         ("edge-array", 2)]


def test_nodes_over_http(http_daemon: HttpDaemon) -> None:
    listed = http_daemon.cli("nodes", "--json")
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    assert [(n["name"], n["state"], n["gpus"]) for n in json.loads(listed.stdout)] == [("local", "up", 2)]


def test_llm_sizing_of_a_command_given_as_one_shell_string(http_daemon: HttpDaemon, tmp_path: Path) -> None:
    (tmp_path / "llm_config.json").write_text('{"default_requirement": 0.25, "models": {"tiny": 0.1}}')
    sized = {}
    for command, gpus in ((["true --llm tiny"], 0.1),  # run through sh -c: its words name the model
                          (["true --llm 'tiny"], 1.0),  # no words the shell could split: unsized
                          (["true", "--llm"], 1.0)):  # no model named
        sized[http_daemon.daemon.submit("--", *command, cwd=str(tmp_path))] = gpus
    jobs = http_daemon.daemon.jobs()
    assert {job: jobs[job]["gpus"] for job in sized} == sized


# --- over EVENTSCHED_URL, a server that is not eventsched -------------------------------


@contextlib.contextmanager
def not_eventsched(status: int, body: bytes, kind: str) -> Iterator[tuple[str, list[str]]]:
    """A web server on 127.0.0.1 that answers every request alike; yields its URL and what it was asked."""
    asked: list[str] = []

    class Answer(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_args: Any) -> None:
            pass

        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            asked.append(f"{self.command} {self.path}")
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize(("status", "reason", "body", "kind"), [
    (200, "OK", b"<html>a web page</html>", "text/html"),
    (200, "OK", b"{}", "application/json"),  # JSON, but not an eventsched answer
    (200, "OK", b"[1, 2]", "application/json"),
    (404, "Not Found", b"<html>not found</html>", "text/html"),
    (401, "Unauthorized", b"", "text/plain"),
], ids=["page", "json-object", "json-list", "404", "401"])
def test_a_server_that_is_not_eventsched_is_one_line(tmp_path: Path, status: int, reason: str, body: bytes,
                                                     kind: str) -> None:
    commands = [["queue"], ["status"], ["submit", "--", "true"], ["explain", "1"], ["cancel", "1"], ["logs", "1"],
                ["health"], ["nodes"]]
    with not_eventsched(status, body, kind) as (url, asked):
        env = _plain_env(tmp_path, EVENTSCHED_URL=url, EVENTSCHED_TOKEN="est_x")
        said = f"{url} is not an eventsched API (it answered HTTP {status} {reason}); check EVENTSCHED_URL"
        for args in commands:  # never its page as a job's output, never its JSON as a job or a status
            _refused(_cli(*args, env=env), f"eventsched: error: {said}\n", 1)
        assert len(asked) == len(commands)  # each asked once: nothing retried
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_server_that_never_answers_times_out_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as listening:  # the kernel accepts the connection; nobody ever reads it
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        env = _plain_env(tmp_path, EVENTSCHED_URL=f"http://127.0.0.1:{listening.getsockname()[1]}",
                         EVENTSCHED_TOKEN="est_x")
        waited = subprocess.run([*EVENTSCHED, "queue"], env=env, capture_output=True, text=True, timeout=90)
    _refused(waited, "eventsched: error: the daemon did not answer in time; it may be overloaded (try again)\n", 1)


# --- submit-file --watch while the file and the daemon come and go -----------------------


def _wait(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_watching_a_jobs_file_through_its_removal_and_a_daemon_restart(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "state", gpus="fake:2:16384").start()
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("0,/srv/w1.py,,,\n")
    out, err = tmp_path / "out", tmp_path / "err"
    try:
        with open(out, "w") as stdout, open(err, "w") as stderr:
            watcher = subprocess.Popen([*EVENTSCHED, "submit-file", str(jobs), "--watch"], env=daemon.env(),
                                       stdout=stdout, stderr=stderr)
        try:
            _wait(lambda: out.read_text().strip() != "")
            jobs.unlink()
            _wait(lambda: "is gone" in err.read_text())
            daemon.stop()
            jobs.write_text("0,/srv/w1.py,,,\n1,/srv/w2.py,,,\n")
            _wait(lambda: "is listening" in err.read_text())  # the dropped connection, then no daemon
            daemon.start()  # the line it could not submit goes in now; the first stays submitted once
            _wait(lambda: len(out.read_text().split()) == 2)
        finally:
            watcher.send_signal(signal.SIGINT)
            code = watcher.wait(10)
        assert code == 0
        scripts = [job["command"][2] for job in daemon.jobs().values()]
        assert scripts == ["/srv/w1.py", "/srv/w2.py"]
    finally:
        daemon.stop()
    gone, dropped, down = err.read_text().splitlines()  # each said once, however many looks it lasted
    assert gone == f"eventsched: {jobs} is gone; waiting for it to come back"
    assert re.fullmatch(r"eventsched: the daemon went away before answering \((Broken pipe|Connection reset by peer)\); "
                        r"whether it took the jobs is in its log: check with `eventsched queue` once it is back; "
                        rf"still watching {re.escape(str(jobs))}", dropped), dropped
    assert down == (f"eventsched: no eventsched daemon is listening on {daemon.socket}; start one with `eventsched "
                    f"serve` (or `eventsched serve --gpus fake:4` without GPUs); still watching {jobs}")


# --- without a daemon --------------------------------------------------------------------


@pytest.mark.parametrize("quick", [True, False])
def test_gpu_ids_naming_another_node_than_node(tmp_path: Path, quick: bool) -> None:
    env = _plain_env(tmp_path, **({} if quick else {"EVENTSCHED_NO_QUICK": "1"}))
    refused = _cli("submit", "--node", "node-a", "--gpu-ids", "node-b:0,1", "--", "true", env=env)
    _refused(refused, "eventsched: error: --gpu-ids node-b:0,1 names node 'node-b' but --node says 'node-a'\n", 2)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["queue", "cancel"])
def test_a_state_filter_of_no_states(tmp_path: Path, command: str) -> None:
    refused = _cli(command, "--state", ",", env=_plain_env(tmp_path))
    _refused(refused, "eventsched: error: --state needs a state, e.g. --state running or -t R\n", 2)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_log_with_a_segment_missing_is_damaged_where_the_gap_is(tmp_path: Path) -> None:
    log = tmp_path / "log"
    write_log(log, [2, 3, 1, 2], segment_bytes=1)  # one segment a batch: events 1, 3, 6, 7 start them
    (log / f"{3:020d}.seg").unlink()
    before = _snapshot(log)
    gap = log / f"{6:020d}.seg"
    verified = _cli("log", "verify", str(log), env=_plain_env(tmp_path))
    _refused(verified, f"eventsched log: damaged: segment {gap} at byte 0: segment starts at sequence 6, expected 3; "
                       f"run `eventsched log repair {log}` to cut the log there (the cut part is kept aside)\n", 1)
    dumped = _cli("log", "dump", str(log), env=_plain_env(tmp_path))
    assert dumped.returncode == 1 and [line.split()[0] for line in dumped.stdout.splitlines()] == ["1", "2"]
    assert dumped.stderr == (f"eventsched log: log segment {gap} is damaged at byte 0: segment starts at sequence 6, expected 3; "
                             f"run `eventsched log repair {log}` to cut the log there (the damaged part is kept aside)\n")
    assert _snapshot(log) == before


def test_log_repair_of_no_log(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    _refused(_cli("log", "repair", str(missing), env=_plain_env(tmp_path)),
             f"eventsched log: no log at {missing} (not a directory)\n", 2)
    assert list(tmp_path.iterdir()) == []


# --- sql's text formats written to a file -----------------------------------------------

QUERY = "SELECT 1 AS a, 'inf'::DOUBLE AS b, [1, 2] AS c, {'x': 1} AS d"


@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_sql_writes_a_text_format_to_a_file_as_it_prints_it(http_daemon: HttpDaemon, tmp_path: Path,
                                                            fmt: str) -> None:
    printed = http_daemon.daemon.cli("sql", "--format", fmt, QUERY)
    assert printed.returncode == 0 and printed.stderr == "", printed.stderr
    target = tmp_path / f"out.{fmt}"
    written = http_daemon.daemon.cli("sql", "--format", fmt, "-o", str(target), QUERY)
    assert (written.returncode, written.stdout, written.stderr) == (0, "", "")
    assert target.read_text() == printed.stdout
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temporary file left beside it
    if fmt == "table":
        assert printed.stdout.splitlines()[2].split() == ["1", "inf", "[1,", "2]", '{"x":', "1}"]
    elif fmt == "csv":  # an infinity is NULL outside the table, as in the JSON output
        assert list(csv.reader(io.StringIO(printed.stdout))) == [["a", "b", "c", "d"],
                                                                 ["1", "", "[1, 2]", '{"x": 1}']]
