"""Snapshots written by a forked child, as Redis's BGSAVE does: encoding a large
state would stall the loop. The child runs none of the other threads' code,
takes no lock they could hold, takes no signal meant for the daemon and ends
with ``os._exit``, so no handler or buffer of the parent's runs twice. Executors
whose threads cannot survive a fork (Ray's gRPC) keep the snapshot on the loop.
"""

from __future__ import annotations

import gc
import os
import signal
import warnings
from pathlib import Path

import anyio

from eventsched.projections import snapshot
from eventsched.projections.cluster import ClusterState

__all__ = ["fork_and_save", "reaped", "wait"]


def fork_and_save(directory: Path, state: ClusterState) -> int:
    """Fork a child that saves ``state`` as it is now; the child's pid."""
    with warnings.catch_warnings():
        # 3.12+ warns of a fork with threads alive: the child runs none of their code
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid != 0:
        return pid
    status = 1
    try:
        # a signal to the child must not reach the parent's loop through the
        # inherited wake-up fd, nor run its handlers
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        gc.disable()  # a collection would touch, and so copy, every page of the state
        # none of the parent's descriptors: above all not the log's lock,
        # which would outlive a daemon that stops meanwhile and refuse its restart
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        snapshot.save(directory, state)
        status = 0
    finally:
        os._exit(status)


async def reaped(pid: int) -> int:
    """Wait for the child without blocking the loop; its exit code."""
    fd = os.pidfd_open(pid)
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)
    return wait(pid)


def wait(pid: int) -> int:
    """Reap the child (blocking); its exit code, 0 if it was reaped already."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return 0
    return os.waitstatus_to_exitcode(status)
