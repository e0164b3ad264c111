"""The engine's edges: a stop before it ran, a full inbox at every entry point."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from eventsched.domain.messages import (
    GpuObserved,
    ProcessExited,
    Refused,
    SchedulerConfig,
)
from eventsched.runtime import engine as engine_mod
from eventsched.runtime.engine import Engine, Pending, Query
from eventsched.runtime.gpus import FakeBackend


def make(tmp_path: Path) -> Engine:
    return Engine(tmp_path / "state", SchedulerConfig(), FakeBackend(1))


def test_stop_before_run_is_harmless_and_later_calls_are_refused(tmp_path: Path) -> None:
    engine = make(tmp_path)

    async def main() -> None:
        await engine.stop()
        with pytest.raises(Refused, match="shutting down"):
            await engine.call(Query(lambda state: None))

    anyio.run(main)


def test_a_full_inbox_refuses_calls_drops_samples_and_keeps_exits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_mod, "INBOX_SIZE", 4)
    engine = make(tmp_path)
    for _ in range(4):
        engine._inbox.append(Pending(Query(lambda state: None)))
    sample = GpuObserved(node="local", gpu=0, utilization=1, memory_used_mib=0, memory_total_mib=1,
                         temperature_c=1, power_w=1)
    replies: list[str | None] = []

    async def main() -> None:
        with pytest.raises(Refused, match="overloaded"):
            await engine.call(Query(lambda state: None))
        engine.submit_nowait(Query(lambda state: None), None, lambda _r, error: replies.append(error))
        await engine.tell(sample)  # dropped: the next sample says the same
        assert len(engine._inbox) == 4
        with anyio.move_on_after(0.1):  # an exit waits for room rather than being lost
            await engine.tell(ProcessExited(job=1, exit_code=0))
        assert len(engine._inbox) == 4
        engine._inbox.popleft()
        await engine.tell(ProcessExited(job=1, exit_code=0))
        assert isinstance(engine._inbox[-1].item, ProcessExited)

    anyio.run(main)
    assert replies == ["the daemon is overloaded; try again"]
