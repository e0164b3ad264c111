"""Helpers for testing code built on eventsched's engine, as ``trio.testing``
is for trio: a clock that moves only when told, and an engine on this
machine's executor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

from eventsched.domain.messages import SchedulerConfig
from eventsched.runtime.engine import Engine, prepare_state_dir
from eventsched.runtime.gpus import FakeBackend, GpuBackend
from eventsched.runtime.launch.executor import Executor

__all__ = ["FakeClock", "local_engine"]


class FakeClock:
    """A ``ports.Clock`` whose time moves only by ``advance``: a sleeper
    wakes when the time it waits for is reached, never on its own."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, anyio.Event]] = []

    def __call__(self) -> float:
        return self._now

    def not_before(self, floor: float) -> None:
        self._now = max(self._now, floor)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await anyio.lowlevel.checkpoint()
            return
        entry = (self._now + seconds, anyio.Event())
        self._sleepers.append(entry)
        try:
            await entry[1].wait()
        finally:
            if entry in self._sleepers:
                self._sleepers.remove(entry)

    def advance(self, seconds: float) -> None:
        self._now += seconds
        for entry in [e for e in self._sleepers if e[0] <= self._now]:
            self._sleepers.remove(entry)
            entry[1].set()


def local_engine(state_dir: Path, backend: GpuBackend | None = None, config: SchedulerConfig | None = None,
                 **kwargs: Any) -> Engine:
    """An engine on this machine's executor, as ``eventsched serve`` builds one
    (``kwargs``: the engine's own, ``clock=FakeClock()`` for one)."""
    config = config or SchedulerConfig()
    prepare_state_dir(state_dir)
    executor = Executor(state_dir, node=config.node)
    return Engine(state_dir, config, backend or FakeBackend(1), executor=executor, **kwargs)
