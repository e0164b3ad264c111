"""I/O on one cgroup directory (a job's cgroup v2, or its v1 memory cgroup).

Shared by the daemon and the supervisor, which loads it by path under
``python -I -S``: built-in modules only.
"""

from __future__ import annotations

import _signal
import errno
import os
import time

__all__ = ["write", "read", "join", "procs", "populated", "signal_all", "kill_all", "remove", "oom_kills"]


def write(path: str, text: str) -> None:
    """Write a cgroup control file; never creates one (outside cgroupfs,
    that would pass for success)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def join(path: str) -> None:
    write(os.path.join(path, "cgroup.procs"), "0")


def procs(path: str) -> list[int]:
    return [int(x) for x in read(os.path.join(path, "cgroup.procs")).split()]


def populated(path: str) -> bool:
    for line in read(os.path.join(path, "cgroup.events")).splitlines():
        if line.startswith("populated "):
            return line.split()[1] != "0"
    return bool(procs(path))


def signal_all(path: str, sig: int) -> int:
    """Send ``sig`` to every process in the cgroup, again for any forked
    meanwhile (a few rounds); how many were signalled."""
    seen: set[int] = set()
    for _ in range(4):
        new = [p for p in procs(path) if p not in seen]
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        seen.update(new)
    return len(seen)


def _pause(seconds: float) -> None:
    """Wait by select's relative timeout, not time.sleep, whose absolute
    monotonic deadline libfaketime (the clock tests' daemon) turns invalid."""
    import select

    select.select([], [], [], seconds)


def kill_all(path: str, wait_s: float = 2.0) -> None:
    """SIGKILL everything in the cgroup (``cgroup.kill``, Linux 5.14+, is
    atomic even against a fork bomb; else each pid, again and again), then
    wait at most ``wait_s`` until it is empty."""
    try:
        write(os.path.join(path, "cgroup.kill"), "1")
        each = False
    except OSError:
        each = True
    deadline = time.monotonic() + wait_s
    pause = 0.001
    while populated(path) and time.monotonic() < deadline:
        if each:
            signal_all(path, _signal.SIGKILL)
        _pause(pause)
        pause = min(pause * 2, 0.05)


def remove(path: str, timeout_s: float = 0.0) -> bool:
    """rmdir the (emptied) cgroup, retrying while it is busy; True if it is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                return False
        _pause(0.01)


def oom_kills(path: str) -> int:
    """Processes the kernel killed for the cgroup's memory limit; 0 if unknown."""
    for name in ("memory.events", "memory.oom_control"):
        for line in read(os.path.join(path, name)).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return 0
