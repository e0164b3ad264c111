"""The control socket's reads: every connection reads into the server's one
buffer (connection.py), so a request is whole however the kernel cuts it,
and connections that interleave halves of requests never see each other's
bytes. Against the daemon as installed (connection.py compiled) and as
source (EVENTSCHED_PURE=1)."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import Daemon

from eventsched import _compiled
from eventsched.domain.events import JobSpec, JobSubmitted
from eventsched.runtime.api.connection import READ_CHUNK
from eventsched.storage import log as eventlog
from eventsched.wire import protocol
from eventsched.wire.client import Client


@pytest.fixture(scope="module", params=["installed", "source"])
def daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with pytest.MonkeyPatch.context() as env:
        if request.param == "source":
            env.setenv("EVENTSCHED_PURE", "1")
        with Daemon(tmp_path_factory.mktemp("reads") / "state", gpus="fake:2") as d:
            for gpu in range(2):
                d.cli("pause-gpu", str(gpu))  # nothing launches: the jobs stay as submitted
            assert d.process is not None
            loaded = "runtime/api/connection.cpython" in Path(f"/proc/{d.process.pid}/maps").read_text()
            assert loaded == (request.param == "installed" and "eventsched.runtime.api.connection" in _compiled.compiled())
            yield d


def submitted(daemon: Daemon) -> dict[int, JobSubmitted]:
    return {
        event.job: event
        for batch in eventlog.read_batches(daemon.state_dir / "log")
        for event in batch
        if isinstance(event, JobSubmitted)
    }


def reply(sock: socket.socket) -> protocol.Reply:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "the daemon closed the connection"
            data += chunk
        return data

    (length,) = struct.unpack(">I", exactly(4))
    message = protocol.server_message_decoder.decode(exactly(length))
    assert isinstance(message, protocol.Reply)
    return message


def test_a_request_several_reads_long_arrives_whole(daemon: Daemon) -> None:
    env = {"BIG": "x" * (3 * READ_CHUNK)}  # within max_env_bytes, three reads and more
    with Client(daemon.socket) as c:
        job = c.submit(JobSpec(command=["/bin/true"], gpus=1.0, cwd="/tmp", name="big", env=env))
        after = c.submit(JobSpec(command=["/bin/true"], gpus=1.0, cwd="/tmp", name="after"))
    logged = submitted(daemon)
    assert logged[job].spec.env["BIG"] == env["BIG"]
    assert logged[after].spec.name == "after", "the connection lost its framing after the long request"


def test_connections_sending_halves_of_requests_in_turn_each_get_their_own(daemon: Daemon) -> None:
    def frame(name: str) -> bytes:
        return protocol.frame(protocol.SubmitJob(spec=JobSpec(command=["/bin/echo", name * 500], gpus=1.0, cwd="/tmp", name=name)))

    first, second = frame("first"), frame("second")
    with socket.socket(socket.AF_UNIX) as a, socket.socket(socket.AF_UNIX) as b:
        a.connect(str(daemon.socket))
        b.connect(str(daemon.socket))
        half = len(first) // 2
        a.sendall(first[:half])
        time.sleep(0.2)  # the daemon reads a's half into the shared buffer...
        b.sendall(second)  # ...then all of b's request over it...
        b_reply = reply(b)
        a.sendall(first[half:])  # ...and a's request is still whole
        a_reply = reply(a)
    assert a_reply.ok and b_reply.ok, (a_reply.error, b_reply.error)
    logged = submitted(daemon)
    assert logged[a_reply.data["id"]].spec.command == ["/bin/echo", "first" * 500]
    assert logged[b_reply.data["id"]].spec.command == ["/bin/echo", "second" * 500]


def test_replies_to_a_pipelined_burst_come_back_in_order(daemon: Daemon) -> None:
    names = [f"burst-{i}" for i in range(300)]
    request = b"".join(
        protocol.frame(protocol.SubmitJob(spec=JobSpec(command=["/bin/true"], gpus=1.0, cwd="/tmp", name=n))) for n in names
    )
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(daemon.socket))
        s.sendall(request)
        ids = []
        for _ in names:
            answer = reply(s)
            assert answer.ok, answer.error
            ids.append(answer.data["id"])
    assert ids == sorted(ids)
    logged = submitted(daemon)
    assert [logged[i].spec.name for i in ids] == names


def test_a_connection_whose_replies_cannot_be_written_is_cut_off_and_the_rest_are_written() -> None:
    """The flusher runs inside the engine's loop: a failure there must cost
    the one connection, never the engine (which would stop the daemon)."""
    import asyncio

    from eventsched.runtime.api.connection import Flusher

    class Conn:
        def __init__(self, broken: bool) -> None:
            self.broken, self.flushed, self.cut = broken, 0, ""

        def flush(self) -> None:
            if self.broken:
                raise RuntimeError("a bug in writing replies")
            self.flushed += 1

        def cut_off(self, why: str) -> None:
            self.cut = why

    async def main() -> list[Conn]:
        flusher = Flusher()
        conns = [Conn(False), Conn(True), Conn(False)]
        for conn in conns:
            flusher.soon(conn)
        flusher.flush_all()  # as the engine calls it after a batch
        await asyncio.sleep(0.01)  # the fallback call_soon was cancelled: nothing is written twice
        return conns

    ok, broken, also_ok = asyncio.run(main())
    assert (ok.flushed, also_ok.flushed) == (1, 1)
    assert broken.cut == "could not be written its replies"
