"""What the engine is handed from the world outside the log: an executor and a clock."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Protocol

import anyio
import anyio.abc

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import Message, ProcessStarted
from eventsched.projections.cluster import ClusterState


class Outbox(Protocol):
    """Handed to the executor's ``run``: awaiting it sends an observation to the
    inbox; ``state`` is the engine's projection (None before start-up)."""

    async def __call__(self, message: Message, /) -> None: ...

    @property
    def state(self) -> ClusterState | None: ...


class Executor(Protocol):
    """Starts, stops and watches job processes. ``launch`` returns once the job
    has exec'd, or raises ``LaunchError``; what happens to a process later
    comes back through the outbox given to ``run``."""

    fork_safe: bool  # the engine may fork a snapshot writer beside it

    async def launch(
        self, job: int, spec: JobSpec, gpu_ids: list[int], *, attempt: int = ..., node: str | None = ...
    ) -> ProcessStarted: ...

    async def signal(self, job: int, grace_s: float, signum: int = ...) -> None: ...

    def recover(self, running: dict[int, tuple[int, int]], attempts: dict[int, int] | None = ...) -> list[Message]:
        """At start-up, for ``{job: (pid, start_time)}`` the log has running:
        the messages that say how each is now (started, exited, lost)."""
        ...

    async def run(self, send: Outbox, *, task_status: anyio.abc.TaskStatus[None] = ...) -> None: ...

    def job_processes(self) -> dict[int, int]: ...  # {pid: job} of running jobs' processes

    def log_path(self, job: int) -> Path: ...  # where the job's output is

    @property
    def containment(self) -> str: ...  # "cgroup2:<dir>" or "process-group"

    @property
    def memory_limit(self) -> str: ...  # "cgroup2", "cgroup1" or "rlimit-as"

    def lease_ages(self) -> dict[str, float]: ...  # {node: seconds since it last answered}; {} on one machine


class Clock(Protocol):
    """The engine's time: ``clock()`` reads it, ``sleep`` waits on it."""

    def __call__(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    def not_before(self, floor: float) -> None: ...  # read no earlier than floor (the log's last time)


class SteadyClock:
    """The wall clock read at start-up, then moved on by the monotonic clock: a
    step of the wall clock during a run (NTP, a restored VM) moves no deadline
    and stamps no event before the one before it."""

    def __init__(self, wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._origin = wall() - monotonic()

    def __call__(self) -> float:
        return self._origin + self._monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)

    def not_before(self, floor: float) -> None:
        behind = floor - self()
        if behind > 0:  # the wall clock went back across a restart
            self._origin += behind
