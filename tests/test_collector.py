"""The cyclic collector and a big state (issue 16): the state is frozen out of
full collections after a load and after each full pass, and new garbage
cycles are still collected."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventsched import core
from eventsched.domain import events as ev
from eventsched.domain.messages import Message, PauseGpu, SchedulerConfig, Started, Submit
from eventsched.domain.states import JobState
from eventsched.projections import collector
from eventsched.projections.cluster import ClusterState
from eventsched.runtime.engine import Engine
from eventsched.runtime.gpus import FakeBackend
from eventsched.storage import log as eventlog


@pytest.fixture
def clean_collector() -> Iterator[None]:
    """Leave the interpreter's collector as the test found it."""
    yield
    gc.unfreeze()
    gc.enable()


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def garbage_cycle() -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a


def test_paused_turns_the_collector_off_inside_and_restores_it(clean_collector: None) -> None:
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    with collector.paused():
        pass
    assert not gc.isenabled()  # it was off before: it stays off


def test_survivors_of_a_full_pass_are_frozen_and_new_cycles_still_collected(clean_collector: None) -> None:
    gc.unfreeze()
    with collector.freezing_after_full_collections():
        state = [Node() for _ in range(10_000)]
        gc.collect()
        assert gc.get_freeze_count() >= len(state)  # the long-lived objects left every generation
        garbage_cycle()
        assert gc.collect() >= 2  # a cycle made after the freeze is still found
    assert collector._freeze_after_full not in gc.callbacks  # a daemon's engine ended: as before
    frozen = gc.get_freeze_count()
    gc.collect()
    assert gc.get_freeze_count() == frozen


def test_the_engine_loads_a_state_with_the_collector_off_and_freezes_it(tmp_path: Path, clean_collector: None) -> None:
    # a log of 2,000 jobs queued behind a paused GPU, made by the core itself
    state_dir = tmp_path / "state"
    backend = FakeBackend(1)
    folded = ClusterState()
    events: list[ev.Event] = []
    messages: list[Message] = [
        Started(node="local", pid=1, version="t", gpu_backend=backend.name, gpus=backend.discover(),
                config=SchedulerConfig()),
        PauseGpu(node="local", gpu=0),
        *(Submit(spec=ev.JobSpec(command=["true"], gpus=1, uid=0, user="root")) for _ in range(2000)),
    ]
    for i, message in enumerate(messages):
        made, _ = core.handle(folded, message, 1.0 + i)
        events.extend(made)
    writer = eventlog.LogWriter.open(state_dir / "log")
    writer.append(events)
    writer.close()

    gc.unfreeze()
    seen: list[bool] = []
    original = collector.freeze_survivors

    def spy() -> None:
        seen.append(gc.isenabled())
        original()

    collector.freeze_survivors = spy  # type: ignore[assignment]
    try:
        state = Engine(state_dir, SchedulerConfig(), backend)._load_state()
    finally:
        collector.freeze_survivors = original  # type: ignore[assignment]
    assert sum(job.state == JobState.QUEUED for job in state.jobs.values()) == 2000
    assert seen == [False]  # frozen before the collector came back on
    assert gc.isenabled()
    assert gc.get_freeze_count() > 2000 * 5  # every job's objects, not only the jobs
