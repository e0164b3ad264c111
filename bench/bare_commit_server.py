"""The ceiling for acknowledged submissions on this machine: a server that
does nothing but the durable part of the daemon's job.

It speaks the control socket's framing (4-byte length, then the body) and
answers every request with the same ``{"ok": true, "data": {"id": 1}}``
frame, but only after the requests read in one step of its loop are written
to a preallocated file and fdatasync'ed, as the engine's group commit does.
No decoding, no scheduling, no projection. ``bench/bench_scheduler.py`` runs
the same clients against it and against the daemon in the same minutes.

    python bench/bare_commit_server.py SOCKET FILE asyncio|epoll

``asyncio``: buffered protocols on asyncio's loop, the daemon's transport
layer. ``epoll``: one ``select.epoll`` loop, no asyncio: what leaving asyncio
would be worth. Stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import struct
import sys

from eventsched.wire import protocol

HEADER = struct.Struct(">I")
REPLY = protocol.frame(protocol.Reply(ok=True, data={"id": 1}))
PREALLOCATE = 256 << 20


class CommitFile:
    """Append-only writes over zeros already on disk (as the log's segments):
    an fdatasync then flushes data, not the inode."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(self.fd, bytes(PREALLOCATE))
        os.fsync(self.fd)
        self.offset = 0

    def commit(self, data: bytes) -> None:
        if self.offset + len(data) > PREALLOCATE:
            self.offset = 0
        os.pwrite(self.fd, data, self.offset)
        self.offset += len(data)
        os.fdatasync(self.fd)


def complete_frames(buffer: bytearray) -> int:
    """How many whole requests ``buffer`` starts with; they are removed."""
    count, at = 0, 0
    while len(buffer) - at >= HEADER.size:
        end = at + HEADER.size + HEADER.unpack_from(buffer, at)[0]
        if end > len(buffer):
            break
        count, at = count + 1, end
    del buffer[:at]
    return count


def serve_asyncio(path: str, log: CommitFile) -> None:
    read_buffer = memoryview(bytearray(64 << 10))
    waiting: list[tuple[asyncio.Transport, int]] = []
    scheduled = [False]

    def commit() -> None:
        scheduled[0] = False
        batch = waiting[:]
        waiting.clear()
        log.commit(b"x" * (160 * sum(n for _, n in batch)))
        for transport, n in batch:
            transport.write(REPLY * n)

    class Conn(asyncio.BufferedProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport, self.buffer = transport, bytearray()

        def get_buffer(self, sizehint: int) -> memoryview:
            return read_buffer

        def buffer_updated(self, nbytes: int) -> None:
            self.buffer += read_buffer[:nbytes]
            n = complete_frames(self.buffer)
            if n:
                waiting.append((self.transport, n))
                if not scheduled[0]:
                    scheduled[0] = True
                    asyncio.get_running_loop().call_soon(commit)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
        server = await loop.create_unix_server(Conn, path)
        async with server:
            await stop

    asyncio.run(main())


def serve_epoll(path: str, log: CommitFile) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    listener.setblocking(False)
    poll = select.epoll()
    poll.register(listener.fileno(), select.EPOLLIN)
    conns: dict[int, tuple[socket.socket, bytearray]] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # out of poll(), which PEP 475 would resume
    while True:
        ready = poll.poll()
        batch: list[tuple[socket.socket, int]] = []
        for fd, _ in ready:
            if fd == listener.fileno():
                conn, _ = listener.accept()
                conn.setblocking(False)
                conns[conn.fileno()] = (conn, bytearray())
                poll.register(conn.fileno(), select.EPOLLIN)
                continue
            conn, buffer = conns[fd]
            data = conn.recv(64 << 10)
            if not data:
                poll.unregister(fd)
                del conns[fd]
                conn.close()
                continue
            buffer += data
            n = complete_frames(buffer)
            if n:
                batch.append((conn, n))
        if batch:
            log.commit(b"x" * (160 * sum(n for _, n in batch)))
            for conn, n in batch:
                conn.sendall(REPLY * n)


def main() -> None:
    path, file, kind = sys.argv[1:4]
    log = CommitFile(file)
    {"asyncio": serve_asyncio, "epoll": serve_epoll}[kind](path, log)


if __name__ == "__main__":
    main()
