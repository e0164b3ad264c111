"""The daemon's end of the launch zygote (``supervisor.py --zygote``), whose
workers are reused job after job (docs/launch-path.md)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import subprocess
from pathlib import Path

import anyio

__all__ = ["INLINE_SPEC_BYTES", "Zygote", "ZygoteRequest"]


_SUPERVISOR = str(Path(__file__).with_name("supervisor.py"))  # stdlib only: started with python -I -S
# a plan up to this size travels in the request (the zygote reads 64 KiB);
# a bigger one (a huge environment) is read from spec.json
INLINE_SPEC_BYTES = 60_000


class ZygoteRequest:
    """One launch handed to the zygote, filled in by whoever reads replies."""

    __slots__ = ("pidfd", "forked", "result")

    def __init__(self) -> None:
        self.pidfd = -1  # readable once the worker is done with the launch (a pipe it sent, SCM_RIGHTS)
        self.forked = False
        self.result = ""  # "ok PID START" or "error REASON", from the supervisor


class Zygote:
    """Replies arrive on one socket, tagged with the request's token;
    whichever launch holds ``lock`` reads them for all (no background task,
    so a launch finishes even while ``run`` is being cancelled)."""

    def __init__(self, python: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.popen = subprocess.Popen(
                [python, "-I", "-S", _SUPERVISOR, "--zygote", str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), cwd="/",
                start_new_session=True,  # the daemon's session and signals are not its
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        self.requests: dict[int, ZygoteRequest] = {}
        self.next_token = 0
        self.eof = False  # the zygote and every supervisor it forked closed their end
        self.retired, self.users = False, 0
        self.lock: anyio.Lock | None = None

    def alive(self) -> bool:
        return not self.retired and not self.eof and self.popen.poll() is None

    def submit(self, attempt: Path, spec: bytes | None = None) -> tuple[int, ZygoteRequest] | None:
        """Hand over a launch (``spec``: the encoded plan, else the supervisor
        reads spec.json); None if the zygote did not take it (dead)."""
        self.next_token += 1
        token = self.next_token
        try:  # absolute: the zygote runs in /
            request = f"{token} {os.path.abspath(attempt)}".encode(errors="surrogateescape")
            if spec is not None:
                request += b"\0" + spec  # a path holds no NUL
            self.sock.send(request, socket.MSG_NOSIGNAL)
        except OSError:
            return None
        req = self.requests[token] = ZygoteRequest()
        return token, req

    async def wait(self, token: int, req: ZygoteRequest) -> None:
        """Until the supervisor answered, died, or the zygote and all its
        supervisors are gone (EOF)."""
        if self.lock is None:
            self.lock = anyio.Lock()
        self.users += 1
        try:
            async with self.lock:
                while not self.eof and not (req.forked and req.result):
                    if req.pidfd >= 0:
                        await _wait_readable(self.sock.fileno(), req.pidfd)
                    else:
                        await _wait_readable(self.sock.fileno())
                    self._drain()
                    if req.pidfd >= 0 and not req.result and _readable(req.pidfd):
                        # done (or dead); anything it said was sent before, and is read
                        self._drain()
                        break
        finally:
            self.users -= 1
            self.requests.pop(token, None)
            self._maybe_close()

    def _drain(self) -> None:
        while not self.eof:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 65536, 1, socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data and not fds:
                self.eof = True
                return
            token, _, rest = data.decode(errors="replace").partition(" ")
            req = self.requests.get(int(token)) if token.isdigit() else None
            if req is not None and rest.startswith("forked"):
                req.forked = True
                if fds:
                    req.pidfd = fds.pop(0)
            elif req is not None:  # the first answer stands (a dead worker's zygote may add one)
                req.result = req.result or rest.strip()
            for fd in fds:  # the rest, or all of an abandoned (timed out) launch's
                os.close(fd)

    def retire(self) -> None:
        """No more launches: the zygote exits (its supervisors run on);
        launches in flight still get their answers."""
        if self.retired:
            return
        self.retired = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        # a pidfd, not Popen.wait(timeout), whose sleeps libfaketime (the clock tests) breaks
        with contextlib.suppress(ProcessLookupError):  # already gone and reaped
            pidfd = os.pidfd_open(self.popen.pid)
            try:
                if not _readable(pidfd, timeout_s=2):
                    self.popen.kill()
            finally:
                os.close(pidfd)
        self.popen.wait()
        self._maybe_close()

    def _maybe_close(self) -> None:
        if (self.retired or self.eof) and self.users == 0 and self.sock.fileno() >= 0:
            for req in self.requests.values():
                if req.pidfd >= 0:
                    os.close(req.pidfd)
            self.requests.clear()
            self.sock.close()


def _readable(fd: int, timeout_s: float = 0) -> bool:
    """poll, not select: a busy daemon's descriptors go past select's 1024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


async def _wait_readable(*fds: int) -> None:
    """Until one of ``fds`` is readable: asyncio readers, cheaper than a task
    group of ``anyio.wait_readable`` per launch."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    for fd in fds:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        for fd in fds:
            loop.remove_reader(fd)
