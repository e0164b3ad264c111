"""A big state and the loop: the state is frozen out of the cyclic
collector's full passes after a load and after each full pass (new garbage
cycles are still collected), and snapshots are written by a forked child."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from eventsched import core
from eventsched.domain import events as ev
from eventsched.domain.messages import (
    Message,
    PauseGpu,
    SchedulerConfig,
    Started,
    Submit,
)
from eventsched.domain.paths import snapshot_dir
from eventsched.domain.states import JobState
from eventsched.projections import collector
from eventsched.projections.cluster import ClusterState
from eventsched.testing import local_engine
from eventsched.runtime.gpus import FakeBackend
from eventsched.storage import log as eventlog


@pytest.fixture
def clean_collector() -> Iterator[None]:
    """Leave the interpreter's collector as the test found it."""
    yield
    collector.thaw()
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


def test_what_paused_made_goes_to_the_oldest_generation_and_its_cycles_are_still_collected(clean_collector: None) -> None:
    collector.thaw()
    gc.collect()
    with collector.paused():
        state = [Node() for _ in range(10_000)]
        garbage_cycle()
    assert gc.get_count()[0] < 100  # not waiting in generation 0 for a young pass to walk it
    assert gc.get_freeze_count() == 0  # nothing left out of the collector
    assert gc.collect() >= 2  # the next full pass still finds the cycle
    assert len(state) == 10_000


def test_paused_leaves_frozen_objects_frozen(clean_collector: None) -> None:
    collector.thaw()
    kept = [Node() for _ in range(1000)]
    collector.freeze_survivors()
    frozen = gc.get_freeze_count()
    with collector.paused():
        made = [Node() for _ in range(1000)]
    # the engine's frozen state is not handed back (unfrozen, the count would be 0); another
    # thread of this process may free a few frozen objects meanwhile, which lowers it a little
    assert frozen >= 1000 and gc.get_freeze_count() >= frozen - 100
    assert len(kept) == len(made)


def test_survivors_of_a_full_pass_are_frozen_and_new_cycles_still_collected(clean_collector: None) -> None:
    collector.thaw()
    with collector.freezing_after_full_collections():
        state = [Node() for _ in range(10_000)]
        gc.collect()
        assert gc.get_freeze_count() >= len(state)  # the long-lived objects left every generation
        garbage_cycle()
        assert gc.collect() >= 2  # a cycle made after the freeze is still found
    assert collector._freeze_after_full not in gc.callbacks  # a daemon's engine ended: as before
    frozen = gc.get_freeze_count()
    gc.collect()
    # no more freezing (another thread of this process may free a few frozen objects meanwhile)
    assert frozen - 100 <= gc.get_freeze_count() <= frozen


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

    collector.thaw()
    seen: list[bool] = []
    original = collector.freeze_survivors

    def spy() -> None:
        seen.append(gc.isenabled())
        original()

    collector.freeze_survivors = spy  # type: ignore[assignment]
    try:
        state = local_engine(state_dir, backend)._load_state()
    finally:
        collector.freeze_survivors = original  # type: ignore[assignment]
    assert sum(job.state == JobState.QUEUED for job in state.jobs.values()) == 2000
    assert seen == [False]  # frozen before the collector came back on
    assert gc.isenabled()
    assert gc.get_freeze_count() > 2000 * 5  # every job's objects, not only the jobs


def _fill_and_snapshot(tmp_path: Path, fork_safe: bool) -> tuple[Path, int]:
    """An engine that snapshots every 50 events takes 120 submissions; the
    snapshot files it left and the log's last seq."""
    state_dir = tmp_path / "state"
    engine = local_engine(state_dir, FakeBackend(1), snapshot_every=50)
    engine.executor.fork_safe = fork_safe

    async def main() -> int:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.call(PauseGpu(node="local", gpu=0))  # every job waits: no process is started
            for _ in range(120):
                await engine.call(Submit(spec=ev.JobSpec(command=["true"], gpus=1, uid=0, user="root")))
            assert engine.state is not None
            last = engine.state.last_seq
            with anyio.fail_after(10):  # a forked writer ends on its own
                while engine._snapshot_child is not None:
                    await anyio.sleep(0.02)
            if fork_safe:
                assert engine._snapshot_child is None
            await engine.stop()
        return last

    last = anyio.run(main)
    return snapshot_dir(state_dir), last


@pytest.mark.parametrize("fork_safe", [True, False], ids=["forked-writer", "on-the-loop"])
def test_snapshots_taken_while_serving_read_back_whole(tmp_path: Path, fork_safe: bool) -> None:
    from eventsched.projections import snapshot as snapshot_mod
    from eventsched.storage import snapshots

    directory, last = _fill_and_snapshot(tmp_path, fork_safe)
    seqs = [seq for seq, _ in snapshots.list_snapshots(directory)]
    assert min(seqs) <= last < max(seqs)  # one written while serving, and the one at shutdown
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert all(p.stat().st_mode & 0o077 == 0 for p in directory.iterdir())  # every job's environment is in them
    state = snapshot_mod.load_latest(directory)
    assert state is not None and state.last_seq >= last
    assert sum(job.state == JobState.QUEUED for job in state.jobs.values()) == 120


def _slow_save(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Snapshot writers (forked: they run this copy too) take ``seconds``."""
    import time

    from eventsched.projections import snapshot as snapshot_mod

    original = snapshot_mod.save

    def slow(directory: object, state: ClusterState) -> Path:
        time.sleep(seconds)
        return original(directory, state)  # type: ignore[arg-type]

    monkeypatch.setattr(snapshot_mod, "save", slow)


def test_a_snapshot_writer_does_not_keep_the_log_locked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a daemon stopped (or killed) while its forked writer still runs must be
    # able to start again at once, not find "another writer" holding the log
    import os
    import time

    from eventsched.runtime import snapshot_child

    _slow_save(monkeypatch, 3.0)
    writer = eventlog.LogWriter.open(tmp_path / "log")
    pid = snapshot_child.fork_and_save(tmp_path / "snapshots", ClusterState())
    try:
        writer.close()  # the daemon is gone; its writer is not
        deadline = time.monotonic() + 5
        while sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd")) != [0, 1, 2]:
            assert time.monotonic() < deadline, "the writer kept the parent's descriptors"
            time.sleep(0.01)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # still writing
        eventlog.LogWriter.open(tmp_path / "log").close()
    finally:
        assert snapshot_child.wait(pid) == 0


def test_stopping_waits_for_the_snapshot_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from eventsched.projections import snapshot as snapshot_mod

    _slow_save(monkeypatch, 1.0)
    state_dir = tmp_path / "state"
    engine = local_engine(state_dir, FakeBackend(1), snapshot_every=20)
    engine.executor.fork_safe = True
    children: list[int] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.call(PauseGpu(node="local", gpu=0))
            for _ in range(30):
                await engine.call(Submit(spec=ev.JobSpec(command=["true"], gpus=1, uid=0, user="root")))
            assert engine._snapshot_child is not None  # still writing
            children.append(engine._snapshot_child)
            await engine.stop()

    anyio.run(main)
    # stopped only once the writer was reaped, and the shutdown's snapshot is the newest
    import os

    with pytest.raises(ChildProcessError):
        os.waitpid(children[0], os.WNOHANG)
    state = snapshot_mod.load_latest(snapshot_dir(state_dir))
    assert state is not None and sum(job.state == JobState.QUEUED for job in state.jobs.values()) == 30


def test_young_passes_are_fewer_inside_and_as_before_after(clean_collector: None) -> None:
    before = gc.get_threshold()
    with collector.fewer_young_passes(5_000):
        assert gc.get_threshold() == (5_000, *before[1:])
        passes = gc.get_stats()[0]["collections"]
        garbage = [[i] for i in range(4_000)]  # fewer allocations than a pass waits for
        assert gc.get_stats()[0]["collections"] - passes <= 1
        del garbage
    assert gc.get_threshold() == before
