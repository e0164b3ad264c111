"""Attacks on a root daemon, run as an unprivileged user by test_security_daemon.

``python attack_daemon.py SOCKET MODE ARGS...``; every mode is bounded in
count and time, talks only to the daemon's unix socket, and prints one JSON
line (``holding`` modes then keep their connections until stdin closes, or
for at most 120 s).
"""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import sys
import time
from typing import Callable

from eventsched.domain.events import JobSpec, JobSubmitted, decode_many
from eventsched.wire import protocol
from eventsched.wire.client import Client, ClientError

SOCKET = sys.argv[1]


def connect(timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(SOCKET)
    return s


def say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def hold() -> None:
    """Keep every connection open until the test closes our stdin (max 120 s)."""
    say("holding")
    select.select([sys.stdin], [], [], 120.0)


def read_stream(sock: socket.socket, until: Callable[[list], bool], deadline: float) -> tuple[bytes, list]:
    """Read server messages until ``until(events)`` or the deadline; returns raw bytes and events."""
    raw = bytearray()
    events: list = []
    buf = bytearray()
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            break
        if not chunk:
            break
        raw += chunk
        buf += chunk
        while len(buf) >= 4:
            (n,) = protocol.HEADER.unpack(bytes(buf[:4]))
            if len(buf) < 4 + n:
                break
            message = protocol.server_message_decoder.decode(bytes(buf[4 : 4 + n]))
            del buf[: 4 + n]
            if isinstance(message, protocol.EventBatch):
                events.extend(decode_many(message.payload))  # as the panel and status --watch do
        if until(events):
            break
    return bytes(raw), events


def submissions(raw: bytes, events: list, secrets: list[str]) -> dict:
    return {
        "found": [secret for secret in secrets if secret.encode() in raw],
        "jobs": [
            {"job": e.job, "user": e.spec.user, "name": e.spec.name, "command": e.spec.command,
             "env": e.spec.env, "env_setup": e.spec.env_setup, "gpus": e.spec.gpus}
            for e in events if isinstance(e, JobSubmitted)
        ],
        "last_seq": events[-1].seq if events else 0,
    }


def watch(marker: str, *secrets: str) -> None:
    """Live from now until a job named ``marker`` is submitted (30 s at most)."""
    sock = connect()
    sock.sendall(protocol.frame(protocol.Subscribe(from_seq=0)))
    say("ready")
    seen = lambda events: any(isinstance(e, JobSubmitted) and e.spec.name == marker for e in events)  # noqa: E731
    raw, events = read_stream(sock, seen, time.monotonic() + 30)
    say(submissions(raw, events, list(secrets)))


def history(upto: str, *secrets: str) -> None:
    """Everything from seq 1 up to ``upto``."""
    sock = connect()
    sock.sendall(protocol.frame(protocol.Subscribe(from_seq=1)))
    target = int(upto)
    raw, events = read_stream(sock, lambda ev: bool(ev) and ev[-1].seq >= target, time.monotonic() + 30)
    say(submissions(raw, events, list(secrets)))


def flood(count: str) -> None:
    """Open up to ``count`` connections (20 s at most); tell held from refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    n = min(int(count), hard - 64)
    socks: list[socket.socket] = []
    errors: list[str] = []
    deadline = time.monotonic() + 20
    while len(socks) < n and time.monotonic() < deadline:
        try:
            socks.append(connect(2.0))
        except BlockingIOError:  # the listen backlog is full: the daemon is busy refusing
            time.sleep(0.001)
        except OSError as exc:
            errors.append(str(exc))
            if len(errors) > 20:
                break
    refused: dict[str, int] = {}
    closed = 0
    pending = {s.fileno(): s for s in socks}
    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLIN)
    quiet_since = time.monotonic()
    end = time.monotonic() + 10
    while pending and time.monotonic() < end and time.monotonic() - quiet_since < 1.5:
        ready = poller.poll(200)
        for fd, _ in ready:
            poller.unregister(fd)
            s = pending.pop(fd)
            quiet_since = time.monotonic()
            try:
                s.settimeout(1.0)
                head = s.recv(4)
                if len(head) < 4:
                    closed += 1
                    continue
                (length,) = protocol.HEADER.unpack(head)
                body = b""
                while len(body) < length:
                    chunk = s.recv(length - len(body))
                    if not chunk:
                        break
                    body += chunk
                reply = protocol.server_message_decoder.decode(body)
                refused[reply.error] = refused.get(reply.error, 0) + 1
            except (OSError, ValueError) as exc:
                errors.append(f"reading: {exc}")
    say({"opened": len(socks), "held": len(pending), "refused": refused, "closed": closed, "errors": errors[:5]})
    hold()


def unread_listings(pipelined: str, connections: str) -> None:
    """One connection with ``pipelined`` ListJobs(all), plus ``connections``
    connections with one each; nothing is ever read."""
    request = protocol.frame(protocol.ListJobs(all=True))
    socks = []
    s = connect()
    s.sendall(request * int(pipelined))
    socks.append(s)
    for _ in range(int(connections)):
        s = connect()
        s.sendall(request)
        socks.append(s)
    say({"connections": len(socks)})
    hold()


def unread_subscriptions(count: str) -> None:
    socks = []
    for _ in range(int(count)):
        s = connect()
        s.sendall(protocol.frame(protocol.Subscribe(from_seq=1)))
        socks.append(s)
    say({"connections": len(socks)})
    hold()


def probe() -> None:
    """How long a submit and an ``sql "SELECT 1"`` take, each on a fresh connection."""
    out: dict[str, object] = {}
    start = time.monotonic()
    with Client(SOCKET, timeout=20) as c:
        out["job"] = c.submit(JobSpec(command=["/bin/true"], gpus=0, name="probe", env={"PATH": "/usr/bin:/bin"}))
    out["submit_s"] = time.monotonic() - start
    start = time.monotonic()
    try:
        with Client(SOCKET, timeout=20) as c:
            out["sql"] = c.request(protocol.RunSql(query="SELECT 1 AS one"))
    except ClientError as exc:
        out["sql"] = {"error": str(exc)}
    out["sql_s"] = time.monotonic() - start
    say(out)


def fill(count: str, command_bytes: str) -> None:
    """A job holding both GPUs, then ``count`` queued jobs with big commands."""
    blocker = JobSpec(command=["/bin/sleep", "600"], gpus=2, name="blocker", env={})
    filler = "x" * int(command_bytes)
    specs = [JobSpec(command=["/bin/true", filler, str(i)], gpus=1, name=f"fill{i}", env={}) for i in range(int(count))]
    with Client(SOCKET, timeout=60) as c:
        ids = c.submit_many([blocker])
        ids += c.submit_many(specs)
    say({"submitted": len(ids)})


MODES = {"watch": watch, "history": history, "flood": flood, "unread-listings": unread_listings,
         "unread-subscriptions": unread_subscriptions, "probe": probe, "fill": fill}

if __name__ == "__main__":
    os.umask(0o077)
    MODES[sys.argv[2]](*sys.argv[3:])
