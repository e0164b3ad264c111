"""Hostile users: two real unprivileged users against a root daemon.

What the other security tests (test_security_*.py, test_e2e_multiuser.py)
already show is not repeated here: environment visibility on the stream,
held-connection floods, SQL, submit bounds, escape sequences in names. This
module adds: every per-job command on another user's job (cancel, hold,
release, explain, logs, reading the file), a symlink planted where a job's
output will be opened, shell injection through every user-supplied string
(name, --env-setup, --conda, array placeholders, jobs-file fields), a peer
whose credentials cannot be read, and an active request flood from one user
while the other submits (with the latency measured).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import Daemon
from users_harness import VENV_BIN, User, as_user, needs_root, root_daemon, run_as, user_env
from users_harness import public_dir, users  # noqa: F401 (fixtures)

from eventsched.runtime.api.connection import Connection, Context, Flusher
from eventsched.runtime.api.fair_use import FairUse
from eventsched.runtime.api.feed import Feed
from eventsched.runtime.config import ConnectionLimits

ROOT = Path(__file__).resolve().parent.parent
SECRET = "alice-output-secret-7f3a"
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module")
def daemon(public_dir: Path) -> Iterator[Daemon]:  # noqa: F811
    d = root_daemon(public_dir, gpus="fake:2").start()
    try:
        yield d
    finally:
        d.stop()


def _submit(user: User, d: Daemon, *args: str, env: dict[str, str] | None = None) -> int:
    r = as_user(user, d.state_dir, "submit", *args, env=env)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[0])


def _job_file(d: Daemon, job: int) -> Path:
    return d.state_dir / "jobs" / f"{job}.log"


# -- another user's job -----------------------------------------------------------------


@pytest.mark.slow
@needs_root
def test_another_users_job_cannot_be_cancelled_held_released_explained_in_detail_or_read(users, daemon) -> None:  # noqa: F811
    alice, bob = users
    env = user_env(alice, daemon.state_dir, API_TOKEN="tok-" + SECRET)
    running = _submit(alice, daemon, "--gpus", "0.5", "--env-setup", f"export X={SECRET}", "--",
                      "/bin/sh", "-c", 'echo "$X"; sleep 60', env=env)  # the secret: in the set-up, the env and the output only
    queued = _submit(alice, daemon, "--gpus", "2", "--priority", "-5", "--", "/bin/sleep", "60", env=env)
    held = _submit(alice, daemon, "--gpus", "2", "--priority", "-6", "--", "/bin/sleep", "60", env=env)
    assert as_user(alice, daemon.state_dir, "hold", str(held)).returncode == 0
    daemon.wait_states([running], {"running"})
    daemon.wait_for(lambda jobs: _job_file(daemon, running).exists()
                    and SECRET in _job_file(daemon, running).read_text(), what="the job's output")
    before = daemon.jobs()
    for command, jobs in (("cancel", [running, queued, held]), ("hold", [running, queued]), ("release", [held])):
        for job in jobs:
            r = as_user(bob, daemon.state_dir, command, str(job))
            assert r.returncode != 0, (command, job, r.stdout)
            assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    # logs: refused, and no byte of the output anywhere bob can see
    r = as_user(bob, daemon.state_dir, "logs", str(running))
    assert r.returncode != 0 and SECRET not in r.stdout + r.stderr, r
    cat = run_as(bob, ["cat", str(_job_file(daemon, running))])
    assert cat.returncode != 0 and SECRET not in cat.stdout
    # explain: what queue shows and the story, never the environment or set-up
    queue_entry = {j["id"]: j for j in json.loads(as_user(bob, daemon.state_dir, "queue", "--all", "--json").stdout)}
    for job in (running, queued, held):
        r = as_user(bob, daemon.state_dir, "explain", str(job), "--json")
        assert r.returncode == 0, r.stderr
        assert SECRET not in r.stdout and "API_TOKEN" not in r.stdout, r.stdout[:2000]
        assert queue_entry[job]["user"] == alice.name
    mine = as_user(alice, daemon.state_dir, "explain", str(running), "--json")
    assert mine.returncode == 0
    # nothing bob did changed alice's jobs
    after = daemon.jobs()
    for job in (running, queued, held):
        assert after[job]["state"] == before[job]["state"], (job, before[job], after[job])
    assert as_user(alice, daemon.state_dir, "cancel", str(running), str(queued), str(held)).returncode == 0
    daemon.wait_states([running, queued, held], {"cancelled"})


# -- output files -------------------------------------------------------------------------


@pytest.mark.slow
@needs_root
def test_a_symlink_planted_at_a_jobs_output_never_writes_through_to_another_users_file(users, daemon) -> None:  # noqa: F811
    """The job's output is opened by root (zygote supervisor) with O_NOFOLLOW; a
    job running as alice that swaps its own output file for a link to bob's
    file before its retry must not get root to append to (or chown) bob's file."""
    alice, bob = users
    precious = Path(bob.home) / "precious"
    run_as(bob, ["/bin/sh", "-c", f"echo bob-only > {precious}; chmod 600 {precious}"])
    before = precious.stat()
    job_dir = daemon.state_dir / "jobs"
    # attempt 1 plants the link wherever alice can write on the output's path, then fails; attempt 2 opens it
    plant = (
        f'out={job_dir}/$EVENTSCHED_JOB_ID.log; '
        f'rm -f "$out" 2>/dev/null; ln -s {precious} "$out" 2>/dev/null; '
        f'ln -s {precious} {job_dir}/$EVENTSCHED_JOB_ID.planted 2>/dev/null; echo attempt; exit 3'
    )
    job = _submit(alice, daemon, "--gpus", "0.5", "--retries", "1", "--", "/bin/sh", "-c", plant)
    jobs = daemon.wait_states([job], {"failed", "succeeded", "lost"}, timeout=60)
    after = precious.stat()
    assert precious.read_text() == "bob-only\n", "root wrote through the planted link"
    assert (after.st_uid, after.st_gid, after.st_mode, after.st_size) == \
           (before.st_uid, before.st_gid, before.st_mode, before.st_size)
    assert jobs[job]["state"] == "failed"
    # the jobs' folder is root's: alice could not plant anything in it
    assert job_dir.stat().st_uid == 0 and not (job_dir.stat().st_mode & 0o022)
    assert not (job_dir / f"{job}.planted").is_symlink()


# -- shell injection ---------------------------------------------------------------------------


@pytest.mark.slow
@needs_root
def test_no_user_string_reaches_a_shell_as_anyone_else(users, daemon) -> None:  # noqa: F811
    marks = Path(tempfile.mkdtemp(prefix="es-inject-"))  # under /tmp: every user reaches it
    marks.chmod(0o1777)
    try:
        _no_user_string_reaches_a_shell(users, daemon, marks)
    finally:
        shutil.rmtree(marks, ignore_errors=True)


def _no_user_string_reaches_a_shell(users: tuple[User, User], daemon: Daemon, marks: Path) -> None:
    alice, bob = users

    def mark(name: str) -> str:
        return str(marks / name)

    def inject(name: str) -> str:
        return f"$(touch {mark(name)});`touch {mark(name + 'b')}`;touch {mark(name + 'c')}"
    ids = [
        _submit(alice, daemon, "--gpus", "0.5", "--name", inject("name"), "--", "/bin/true"),
        _submit(alice, daemon, "--gpus", "0.5", "--name", "x", "--conda", "base; " + inject("conda"), "--", "/bin/true"),
        # --env-setup is a shell line by design: it runs, but as alice
        _submit(alice, daemon, "--gpus", "0.5", "--env-setup", f"touch {mark('setup')}", "--", "/bin/true"),
        _submit(alice, daemon, "--gpus", "0.5", "--", "/bin/echo", "{index}", inject("argv")),
    ]
    r = as_user(alice, daemon.state_dir, "submit", "--gpus", "0.5", "--array", "0-1", "--name", "{index}" + inject("arrname"),
                "--", "/bin/echo", "{index};" + inject("array"))
    assert r.returncode == 0, r.stderr
    ids += [int(i) for i in r.stdout.split()]
    # the jobs file: every field hostile
    jobs_file = Path(alice.home) / "jobs.txt"
    lines = [
        f"0,/bin/echo;{inject('jscript')},,--x 1,",
        f"0,/bin/true,base;{inject('jconda')},,",
        f"0,/bin/true,,\"$(touch {mark('jargs')})\" ';touch {mark('jargs2')}',",
        f"0,/bin/true,,,0;{inject('jgpus')}",
    ]
    jobs_file.write_text("\n".join(lines) + "\n")
    os.chown(jobs_file, alice.uid, alice.gid)
    r = as_user(alice, daemon.state_dir, "submit-file", str(jobs_file))
    assert "Traceback" not in r.stderr, r.stderr
    ids += [int(i) for i in r.stdout.split()]
    daemon.wait_states(ids, {"succeeded", "failed"}, timeout=60)
    # bob's view of those jobs (queue, explain) runs nothing either
    assert as_user(bob, daemon.state_dir, "queue", "--all").returncode == 0
    for job in ids:
        as_user(bob, daemon.state_dir, "explain", str(job))
    made = {p.name: p.stat().st_uid for p in marks.iterdir()}
    assert made == {"setup": alice.uid}, f"files made by injected shell code (name: owner uid): {made}"


# -- credentials ------------------------------------------------------------------------


class _Transport(asyncio.Transport):
    """Just enough of an asyncio transport for ``connection_made``."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock, self.aborted, self.written = sock, False, b""

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.sock if name == "socket" else None

    def abort(self) -> None:
        self.aborted = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.aborted = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


def _context() -> Context:
    """What a connection is handed, with nothing behind the dispatcher."""
    fair_use = FairUse(ConnectionLimits(), frozenset({0}), 8)
    feed = Feed(Path("/nonexistent"), frozenset({0}), lambda: 0)
    return Context(fair_use=fair_use, feed=feed, flusher=Flusher(), dispatch=lambda *_: None,
                   start_soon=lambda *_: None, read_buffer=memoryview(bytearray(64)))


def test_a_peer_whose_credentials_cannot_be_read_is_dropped_unheard() -> None:
    """SO_PEERCRED cannot fail for a live unix socket peer from userspace (a
    peer in another user namespace reads as the overflow uid, not as an
    error), so the code path is driven directly: a socket already gone when
    its credentials are asked for."""
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.close()
    ctx = _context()
    conn = Connection(ctx)
    transport = _Transport(gone)
    conn.connection_made(transport)
    assert transport.aborted and conn.closed and conn.peer is None
    assert ctx.fair_use.open_total == 0 and transport.written == b"", "it was counted or answered without an identity"
    request = b"\x00\x00\x00\x05\x81\xa4type"
    conn.get_buffer(-1)[: len(request)] = request  # as asyncio's transport reads it
    conn.buffer_updated(len(request))  # nothing it sends is read
    assert conn.peer is None and not conn.slots


def test_a_live_peer_reads_as_its_real_uid() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        ctx = _context()
        conn = Connection(ctx)
        conn.connection_made(_Transport(a))
        assert conn.peer is not None and conn.peer.uid == os.getuid() and conn.peer.pid == os.getpid()
        assert ctx.fair_use.open_by_uid == {os.getuid(): {conn}}


# -- fair use under an active flood ---------------------------------------------------------

_FLOOD = r"""
import os, signal, socket, struct, sys, time, msgspec
path, seconds, conns = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
enc = msgspec.msgpack.Encoder()
def frame(o):
    b = enc.encode(o); return struct.pack(">I", len(b)) + b
burst = frame({"type": "ListJobs", "all": True}) * 16 + frame({"type": "GetStatus"}) * 16
socks = []
for _ in range(conns):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.setblocking(False)
    try: s.connect(path); socks.append(s)
    except OSError: s.close()
sent = 0
end = time.monotonic() + seconds
def stop(*_):  # the probe is done: no need to flood on to the end
    global end
    end = 0
signal.signal(signal.SIGTERM, stop)
rounds = 0
while time.monotonic() < end:
    rounds += 1
    if rounds == 2:  # every connection has sent a burst
        print("on", flush=True)
    for s in socks:
        try: s.send(burst); sent += 32
        except (BlockingIOError, InterruptedError): pass
        except OSError: pass
        try:
            while s.recv(1 << 20): pass
        except (BlockingIOError, InterruptedError): pass
        except OSError: pass
print(sent, len(socks))
"""

_PROBE = r"""
import sys, time, json
from eventsched.domain.events import JobSpec
from eventsched.wire.client import Client
out = []
for i in range(int(sys.argv[2])):
    t = time.monotonic()
    with Client(sys.argv[1], timeout=60) as c:
        c.submit(JobSpec(command=["/bin/true"], gpus=0.0, priority=-1, name="probe"))
    out.append(time.monotonic() - t)
    time.sleep(0.1)
print(json.dumps(out))
"""


def _as(user: User, code: str, *args: str) -> list[str]:
    return ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", "env", "-i",
            f"PATH={VENV_BIN}:/usr/bin:/bin", f"HOME={user.home}", f"PYTHONPATH={ROOT}",
            sys.executable, "-c", code, *args]


@pytest.mark.slow
@needs_root
def test_a_request_flood_from_one_user_does_not_starve_anothers_submissions(users, daemon) -> None:  # noqa: F811
    alice, bob = users
    sock = str(daemon.socket)
    # a queue worth listing: every ListJobs in the flood costs the daemon real work
    r = as_user(alice, daemon.state_dir, "submit", "--gpus", "2", "--priority", "-9", "--array", "0-299", "--",
                "/bin/sleep", "600")
    assert r.returncode == 0, r.stderr
    quiet = subprocess.run(_as(bob, _PROBE, sock, "10"), capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    baseline = json.loads(quiet.stdout)
    floods = [subprocess.Popen(_as(alice, _FLOOD, sock, "12", "16"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(4)]
    try:
        for p in floods:
            p.stdout.readline()  # type: ignore[union-attr]  # this one's flood is on
        loud = subprocess.run(_as(bob, _PROBE, sock, "20"), capture_output=True, text=True, timeout=120)
    finally:
        for p in floods:
            p.terminate()
        results = [p.communicate(timeout=60) for p in floods]
    assert loud.returncode == 0, loud.stderr
    under_flood = json.loads(loud.stdout)
    sent = sum(int(out.split()[0]) for out, _ in results if out.strip())
    MEASURED.update(baseline_p50_s=statistics.median(baseline), flood_p50_s=statistics.median(under_flood),
                    flood_max_s=max(under_flood), flood_requests_sent=sent)
    print("hostile users, submit latency:", json.dumps(MEASURED))
    assert sent > 5000, f"the flood was too weak to prove anything ({sent} requests)"
    # each user's requests in the engine are capped, so a flood from others leaves one user's submits quick
    assert statistics.median(under_flood) < 1.5 and max(under_flood) < 3.0, MEASURED
    Daemon.cli(daemon, "cancel", *[str(i) for i in r.stdout.split()])
