"""Commits that overlap: the engine decides the next batches while the last
one's fdatasync runs, writes them as one frame when it returns, and
acknowledges and launches nothing before its own batch is durable."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

from eventsched import core
from eventsched.domain import events as ev
from eventsched.domain.messages import PauseGpu, Refused, Submit
from eventsched.domain.paths import log_dir
from eventsched.projections.cluster import ClusterState
from eventsched.runtime import engine as engine_module
from eventsched.runtime.engine import Query
from eventsched.storage import log as L
from test_crash_states import _messages
from test_engine import Disk, Recorder as Executor, Unsampled, job_spec, make, until


class GatedDisk(Disk):
    """A disk whose fdatasyncs off the loop wait until the test lets each one
    through (``let_one``); ``begun`` counts those that have started."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: threading.Semaphore | None = None
        self.begun = 0

    def fdatasync(self, fd: int) -> None:  # type: ignore[override]
        if self.gate is not None and threading.current_thread() is not threading.main_thread():
            self.begun += 1
            assert self.gate.acquire(timeout=10), "the test never let this fdatasync through"
        super().fdatasync(fd)

    def let_one(self) -> None:
        assert self.gate is not None
        self.gate.release()

    def open_gate(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.release(100)


def test_the_next_batch_is_decided_while_a_sync_runs_and_waits_for_its_own(tmp_path: Path) -> None:
    disk, executor = GatedDisk(), Executor()
    engine = make(tmp_path, Unsampled(2), log_ops=disk, executor=executor)
    replies: dict[str, Refused | None] = {}

    def submit(name: str) -> None:
        def reply(_result: object, error: Refused | None) -> None:
            replies[name] = error

        engine.submit_nowait(Submit(spec=job_spec(gpus=1), by="uid:0"), None, reply)

    def logged_submissions() -> int:
        return sum(type(e) is ev.JobSubmitted for e in L.read(log_dir(tmp_path / "state")))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.call(Query(lambda state: None))  # past the start-up batch
            disk.slow_s = 0.01  # a slow disk: the next fdatasyncs run off the loop
            await engine.call(PauseGpu(node=engine.config.node, gpu=0, by="test"))
            disk.slow_s, disk.gate = 0.0, threading.Semaphore(0)
            try:
                submit("a")  # placed on GPU 1: a launch waits for its batch
                await until(lambda: disk.begun == 1)
                submit("b")  # waits for a GPU
                # b is decided while a's fdatasync is in flight, not yet written...
                await until(lambda: engine.state is not None and 2 in engine.state.jobs)
                await anyio.wait_all_tasks_blocked()
                assert logged_submissions() == 1
                # ...and nothing is acknowledged or launched before it returns
                assert replies == {} and executor.launched == []
                disk.let_one()  # a's fdatasync returns: a is released, b written and synced next
                await until(lambda: "a" in replies and executor.launched == [1] and disk.begun == 2)
                await anyio.wait_all_tasks_blocked()
                assert logged_submissions() == 2
                assert "b" not in replies, "b was acknowledged before its own fdatasync returned"
                disk.let_one()
                await until(lambda: "b" in replies)
                assert replies == {"a": None, "b": None} and executor.launched == [1]
            finally:
                disk.open_gate()
            await engine.stop()

    anyio.run(main)


def write_batches(w: L.LogWriter, n: int) -> None:
    state = ClusterState()
    for batch in _messages(n + 1)[:n]:
        w.write([e for msg in batch for e in core.handle(state, msg, 1000.0)[0]])
        w.sync()


def test_a_second_frame_is_not_written_before_the_first_is_synced(tmp_path: Path) -> None:
    """Of two frames written since a sync, a power cut can keep the second
    and lose the first: a hole that recovery must refuse as damage (the
    crash-state enumeration found it). So one frame at most waits for a sync."""
    with L.LogWriter.open(tmp_path / "log") as w:
        write_batches(w, 1)
        w.write([ev.PolicyChanged(policy="fifo", by="test")])
        with pytest.raises(L.LogError, match="before the last one was synced"):
            w.write([ev.PolicyChanged(policy="fifo", by="test")])
        w.sync()
        w.write([ev.PolicyChanged(policy="fifo", by="test")])


def test_a_sync_makes_the_frame_written_durable_and_with_nothing_new_costs_nothing(tmp_path: Path) -> None:
    disk = Disk()
    w = L.LogWriter.open(tmp_path / "log", ops=disk)
    try:
        write_batches(w, 2)
        w.write([ev.PolicyChanged(policy="fifo", by="test")])
        synced = len(disk.in_thread)
        assert w.synced_seq == w.next_seq - 2
        assert w.sync() == w.next_seq - 1 == w.synced_seq and len(disk.in_thread) == synced + 1
        assert w.sync() == w.synced_seq and len(disk.in_thread) == synced + 1
    finally:
        w.close()


def _started_logged(tmp_path: Path) -> bool:
    return any(type(e) is ev.JobStarted for e in L.read(log_dir(tmp_path / "state")))


def test_a_start_nobody_waits_on_joins_the_next_commit_someone_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's start has no reply and no effect: it costs no fdatasync of its
    own, and is durable before any answer that could show it."""
    monkeypatch.setattr(engine_module, "LAZY_COMMIT_S", 60.0)
    disk = Disk()
    engine = make(tmp_path, Unsampled(1), log_ops=disk)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.call(Submit(spec=job_spec(gpus=1), by="uid:0"))
            syncs = len(disk.in_thread)
            await until(lambda: engine.state is not None and engine.state.jobs[1].pid is not None)  # decided
            await anyio.wait_all_tasks_blocked()
            assert len(disk.in_thread) == syncs and not _started_logged(tmp_path)
            await engine.call(Query(lambda state: None))  # an answer waits for it
            assert len(disk.in_thread) == syncs + 1 and _started_logged(tmp_path)
            await engine.stop()

    anyio.run(main)


def test_a_start_nobody_waits_on_is_durable_soon_all_the_same(tmp_path: Path) -> None:
    engine = make(tmp_path, Unsampled(1))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.call(Submit(spec=job_spec(gpus=1), by="uid:0"))
            await until(lambda: _started_logged(tmp_path) and engine.log is not None
                        and engine.log.synced_seq == engine.log.next_seq - 1)
            await engine.stop()

    anyio.run(main)


def test_a_start_nobody_waited_on_is_written_when_the_engine_is_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "LAZY_COMMIT_S", 60.0)
    engine = make(tmp_path, Unsampled(1))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.call(Submit(spec=job_spec(gpus=1), by="uid:0"))
            await until(lambda: engine.state is not None and engine.state.jobs[1].pid is not None)
            assert not _started_logged(tmp_path)
            tg.cancel_scope.cancel()  # no Stopping recorded: nothing else made it durable

    anyio.run(main)
    assert _started_logged(tmp_path)
