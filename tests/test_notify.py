"""Notification hooks, end to end: a real webhook receiver on 127.0.0.1, a real
daemon, the CLI as real users (a root daemon serving two of them)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
from daemon_harness import free_port
from users_harness import User, as_user, needs_root, public_dir, root_daemon, users  # noqa: F401 (fixtures)

SECRET = "s3cret"


class Receiver:
    """A webhook endpoint: every POST it gets, headers and JSON body."""

    def __init__(self, port: int = 0) -> None:
        got = self.got = []
        arrived = self.arrived = threading.Condition()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with arrived:
                    got.append((dict(self.headers), body))
                    arrived.notify_all()
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        """The first ``count`` messages (their bodies), once they have come."""
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.got) >= count, timeout), f"got {len(self.got)} of {count}"
            return [json.loads(body) for _headers, body in self.got]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def daemon(public_dir: Path) -> Iterator[Any]:  # noqa: F811
    with root_daemon(public_dir) as d:
        yield d


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()



def hook_of(daemon: Any) -> dict[str, Any]:
    listed = daemon.cli("notify", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return next(h for h in json.loads(listed.stdout) if h["uid"] == os.geteuid())


def test_one_signed_message_per_event(daemon: Any, receiver: Receiver) -> None:
    set_ = daemon.cli("notify", "set", "--webhook", receiver.url, "--secret", SECRET, "--on", "end,fail")
    assert set_.returncode == 0, set_.stderr
    assert "(signed)" in set_.stdout and SECRET not in set_.stdout
    quiet = daemon.submit("--gpus", "0.1", "--notify", "fail", "--", "/bin/true")  # succeeds: not asked for
    ok = daemon.submit("--gpus", "0.1", "--gpu-mem", "1024", "--", "/bin/true")
    bad = daemon.submit("--gpus", "0.1", "--", "/bin/sh", "-c", "exit 3")
    daemon.wait_states([quiet, ok, bad], {"succeeded", "failed"})
    bodies = {m["job"]: m for m in receiver.wait(2)}
    time.sleep(1.0)  # nothing more comes: one message per event
    assert len(receiver.got) == 2 and set(bodies) == {ok, bad}
    for headers, body in receiver.got:
        expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(headers["X-Eventsched-Signature"], expected)
    assert bodies[ok]["event"] == "end" and bodies[ok]["state"] == "succeeded" and bodies[ok]["exit_code"] == 0
    assert bodies[bad]["event"] == "fail" and bodies[bad]["exit_code"] == 3
    card = bodies[ok]["report_card"]
    assert card["gpu_mem_mib"] == 1024 and card["run_s"] >= 0 and card["advice"]
    assert hook_of(daemon)["delivered"] >= 2


def test_a_receiver_down_for_a_while_gets_the_retry(daemon: Any) -> None:
    port = free_port()
    assert daemon.cli("notify", "set", "--webhook", f"http://127.0.0.1:{port}/later").returncode == 0
    job = daemon.submit("--gpus", "0.1", "--", "/bin/true")
    daemon.wait_states([job], {"succeeded"})
    deadline = time.monotonic() + 10
    while not hook_of(daemon)["last_failure"] and time.monotonic() < deadline:
        time.sleep(0.1)
    failure = hook_of(daemon)["last_failure"]
    assert f"job {job} end" in failure and "retrying" in failure  # said, not lost
    assert "Connection refused" in daemon.cli("notify", "list").stdout
    assert f"notification of job {job} end (uid {os.geteuid()}) failed" in daemon.stderr()  # and in the daemon's log
    time.sleep(1.0)  # down a while longer
    late = Receiver(port)
    try:
        assert [m["job"] for m in late.wait(1, timeout=30)] == [job]
    finally:
        late.close()


def test_bad_hooks_get_one_line(daemon: Any) -> None:
    for args, says in [(["--webhook", "ftp://example.com/x"], "only http:// and https://"),
                       (["--webhook", "http:///nohost"], "no host"),
                       (["--webhook", "http://example.com", "--on", "sometimes"], "end,fail,preempt,memory"),
                       (["--mail", "mail -s hi me"], "absolute path"),
                       (["--config", "/nonexistent/notify.toml"], "no such file")]:
        out = daemon.cli("notify", "set", *args)
        assert out.returncode != 0 and says in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    out = daemon.cli("submit", "--notify", "sometimes", "--", "/bin/true")
    assert out.returncode == 2 and out.stderr.count("\n") == 1


@needs_root
def test_each_user_hears_only_of_their_own_jobs(daemon: Any, receiver: Receiver,
                                                users: tuple[User, User]) -> None:  # noqa: F811
    alice, bob = users
    state = daemon.state_dir
    config = Path(alice.home) / ".config" / "eventsched"
    config.mkdir(parents=True)
    (config / "notify.toml").write_text(f'webhook = "{receiver.url}"\nsecret = "{SECRET}"\n'
                                        f'mail = ["/usr/bin/tee", "{alice.home}/mail.out"]\n')
    for path in (config.parent, config, config / "notify.toml"):
        os.chown(path, alice.uid, alice.gid)
    set_ = as_user(alice, state, "notify", "set")  # read from her own file, as her
    assert set_.returncode == 0, set_.stderr
    assert "chmod 600" in set_.stderr  # others may read her secret there: she is told
    theirs = as_user(bob, state, "submit", "--gpus", "0.1", "--", "/bin/true")
    mine = as_user(alice, state, "submit", "--gpus", "0.1", "--", "/bin/sh", "-c", "exit 1")
    assert theirs.returncode == 0 and mine.returncode == 0, (theirs.stderr, mine.stderr)
    daemon.wait_states([int(theirs.stdout), int(mine.stdout)], {"succeeded", "failed"})
    time.sleep(1.0)
    assert [(m["job"], m["user"], m["event"]) for m in receiver.wait(1)] == [(int(mine.stdout), alice.name, "fail")]
    mail = Path(alice.home) / "mail.out"  # the mail command ran as her
    assert json.loads(mail.read_text())["job"] == int(mine.stdout) and mail.stat().st_uid == alice.uid
    # bob sees no hook of hers, and his own `clear` leaves hers alone
    assert json.loads(as_user(bob, state, "notify", "list", "--json").stdout) == []
    assert as_user(bob, state, "notify", "clear").returncode == 0
    listed = json.loads(as_user(alice, state, "notify", "list", "--json").stdout)
    assert [(h["user"], h["secret"], h["delivered"]) for h in listed] == [(alice.name, True, 1)]


def test_a_preempted_job_is_told_as_such(daemon: Any, receiver: Receiver) -> None:
    assert daemon.cli("notify", "set", "--webhook", receiver.url, "--on", "preempt").returncode == 0
    low = daemon.submit("--gpus", "2", "--preemptible", "--", "/bin/sleep", "60")
    daemon.wait_states([low], {"running"})
    urgent = daemon.submit("--gpus", "2", "--priority", "100", "--", "/bin/true")
    daemon.wait_states([urgent], {"succeeded"}, timeout=40)
    told = receiver.wait(1)
    assert [(m["job"], m["event"], m["state"]) for m in told] == [(low, "preempt", "preempted")]
    daemon.cli("cancel", str(low))


def test_what_each_exit_is_told_as() -> None:
    from eventsched.domain import events as ev
    from eventsched.domain.states import GPU_MEMORY_OVER
    from eventsched.runtime.notify import kind_of

    def exited(outcome: str, reason: str = "") -> ev.JobExited:
        return ev.JobExited(job=1, exit_code=None, reason=reason, outcome=outcome)

    assert [kind_of(e) for e in (exited("succeeded"), exited("cancelled", "cancelled"), exited("failed"),
                                 exited("preempted", "preempted"), exited("failed", GPU_MEMORY_OVER),
                                 ev.JobLost(job=1), ev.JobCancelled(job=1))] == [
        "end", "end", "fail", "preempt", "memory", "fail", None]
