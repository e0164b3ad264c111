"""A client's side of the control socket's framing (a 4-byte big-endian length,
then that many bytes): connect, send, read a frame. The CLI's fast path uses it
too, so it imports only ``_socket`` (``socket.py`` builds enums at import)."""

from __future__ import annotations

import _socket
import os

from eventsched.wire.errors import ClientError, DaemonNotRunning, went_away

__all__ = ["MAX_FRAME_BYTES", "connect", "exchange", "read_frame", "SunPath"]

MAX_FRAME_BYTES = 1 << 30  # a reply larger than this is not the daemon's
SUN_PATH_MAX = 107  # a socket address holds 108 bytes, the last a NUL


class SunPath:
    """``path`` as a socket address that fits, for a ``with`` block: a deep state
    directory's socket is reached as ``/proc/self/fd/N/name`` through its open
    directory, which the kernel resolves like the long path. (A class: the CLI's
    fast path would pay for importing contextlib.)"""

    def __init__(self, path: str) -> None:
        self.path, self.fd = path, -1

    def __enter__(self) -> str:
        path = self.path
        if len(os.fsencode(path)) <= SUN_PATH_MAX:
            return path
        directory, name = os.path.split(path)
        try:
            self.fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            return path  # nothing there to reach: the caller's own error says so
        return f"/proc/self/fd/{self.fd}/{name}"

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def connect(path: str, timeout: float | None = 30.0) -> _socket.socket:
    """A connected socket, or DaemonNotRunning / ClientError saying why not."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        for delay in (0.001, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 0):
            try:
                with SunPath(path) as address:
                    sock.connect(address)
                break
            except BlockingIOError:  # the daemon's listen backlog is full for a moment
                if not delay:
                    raise
                import time

                time.sleep(delay)
    except BaseException as exc:
        sock.close()
        # a path through a file (ENOTDIR) can hold no socket either
        if isinstance(exc, (FileNotFoundError, ConnectionRefusedError, NotADirectoryError)):
            raise DaemonNotRunning(path) from exc
        if isinstance(exc, PermissionError):
            raise ClientError(f"permission denied on the socket {path}") from exc
        if isinstance(exc, OSError) and not isinstance(exc, TimeoutError):
            raise ClientError(f"cannot reach the daemon's socket {path}: {exc.strerror or exc}") from exc
        raise
    return sock


def _exactly(sock: _socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ClientError("the daemon closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: _socket.socket) -> bytes:
    length = int.from_bytes(_exactly(sock, 4), "big")
    if length > MAX_FRAME_BYTES:
        raise ClientError("unexpected message from the daemon")
    return _exactly(sock, length)


def exchange(sock: _socket.socket, data: bytes) -> bytes:
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon already hung up: its reason (e.g. too many connections) is still there to read
    try:
        return read_frame(sock)
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise went_away(exc) from None
