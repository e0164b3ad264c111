"""The engine's edges, on a fake clock and a recording executor: a stop
before it ran, a full inbox, a full disk, slow commits, group commit, and
timers that fire when the clock is moved, not after a real wait."""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from pathlib import Path
from collections.abc import Collection
from typing import Any, Callable

import anyio
import anyio.abc
import pytest

from eventsched.domain import events as ev
from eventsched.domain.messages import (
    GpuObserved,
    Message,
    PauseGpu,
    ProcessExited,
    ProcessStarted,
    Refused,
    ResumeGpu,
    SchedulerConfig,
    Submit,
)
from eventsched.domain.states import JobState
from eventsched.runtime import engine as engine_mod
from eventsched.runtime.engine import Engine, Query
from eventsched.runtime.gpus import FakeBackend, GpuSample
from eventsched.runtime.ports import Outbox
from eventsched.storage import log as eventlog
from eventsched.storage.fileops import FileOps
from eventsched.testing import FakeClock


class Recorder:
    """An executor that starts nothing: it records what the engine asks."""

    fork_safe = True

    def __init__(self) -> None:
        self.launched: list[int] = []
        self.signalled: list[int] = []

    async def launch(self, job: int, spec: ev.JobSpec, gpu_ids: list[int], *, attempt: int = 1,
                     node: str | None = None) -> ProcessStarted:
        self.launched.append(job)
        return ProcessStarted(job=job, pid=10_000 + job, start_time=1)

    async def signal(self, job: int, grace_s: float, signum: int = 0) -> None:
        self.signalled.append(job)

    def recover(self, running: dict[int, tuple[int, int]], attempts: dict[int, int] | None = None) -> list[Message]:
        return []

    async def run(self, send: Outbox, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await anyio.sleep_forever()

    def job_processes(self) -> dict[int, int]:
        return {}


class Disk(FileOps):
    """The log's disk: ``full`` refuses writes (ENOSPC), ``slow_s`` delays each
    fdatasync; ``in_thread`` says, for each fdatasync, whether it ran off the loop."""

    def __init__(self) -> None:
        self.full = False
        self.slow_s = 0.0
        self.refused = 0
        self.in_thread: list[bool] = []

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:  # type: ignore[override]
        if self.full:
            self.refused += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return FileOps.pwrite(fd, data, offset)

    def fdatasync(self, fd: int) -> None:  # type: ignore[override]
        self.in_thread.append(threading.current_thread() is not threading.main_thread())
        time.sleep(self.slow_s)
        FileOps.fdatasync(fd)


class WatchedDisk(Disk):
    """A Disk whose fdatasyncs, while ``ticks`` (a loop ticker's count) is set,
    also wait, boundedly, for the loop to turn at least once meanwhile, and
    record in ``turns`` how often it did. A loop stalled by the commit shows as
    0 however busy the machine is; a timed gap between turns would only grow."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks: list[int] | None = None
        self.turns: list[int] = []

    def fdatasync(self, fd: int) -> None:  # type: ignore[override]
        ticks = self.ticks
        before = 0 if ticks is None else ticks[0]
        super().fdatasync(fd)
        if ticks is None:
            return
        off_the_loop = threading.current_thread() is not threading.main_thread()
        deadline = time.monotonic() + 10
        while off_the_loop and ticks[0] == before and self.ticks is ticks and time.monotonic() < deadline:
            time.sleep(0.001)
        if self.ticks is ticks:  # still watched: the ticker was running all along
            self.turns.append(ticks[0] - before)


class Unsampled(FakeBackend):
    """GPUs that send no sample: none joins a batch of requests."""

    def sample(self, job_pids: Collection[int] = ()) -> list[GpuSample]:
        return []


def make(tmp_path: Path, backend: FakeBackend | None = None, **kwargs: Any) -> Engine:
    kwargs.setdefault("executor", Recorder())
    kwargs.setdefault("clock", FakeClock())
    return Engine(tmp_path / "state", SchedulerConfig(), backend or FakeBackend(1), **kwargs)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.01)


def job_spec(**fields: Any) -> ev.JobSpec:
    return ev.JobSpec(command=["true"], uid=0, user="root", cwd="/tmp", **fields)


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
    replies: list[str | None] = []
    sample = GpuObserved(node="local", gpu=0, utilization=1, memory_used_mib=0, memory_total_mib=1,
                         temperature_c=1, power_w=1)

    async def main() -> None:
        for _ in range(4):
            engine.submit_nowait(Query(lambda state: None), None, lambda _r, error: None)
        with pytest.raises(Refused, match="overloaded"):
            await engine.call(Query(lambda state: None))
        engine.submit_nowait(Query(lambda state: None), None, lambda _r, error: replies.append(str(error)))
        await engine.tell(sample)  # dropped: the next sample says the same
        assert engine.backlog == 4
        told = anyio.Event()

        async def exited() -> None:
            await engine.tell(ProcessExited(job=1, exit_code=0))
            told.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(exited)
            await anyio.wait_all_tasks_blocked()
            assert not told.is_set() and engine.backlog == 4  # an exit waits for room rather than being lost
            await tg.start(engine.run)  # takes the batch: room again
            with anyio.fail_after(10):
                await told.wait()
            await engine.stop()

    anyio.run(main)
    assert replies == ["the daemon is overloaded; try again"]


def test_an_observation_refused_by_a_full_disk_is_handled_again_once_there_is_room(tmp_path: Path) -> None:
    """A job's exit that meets a full log is refused with its batch and,
    having no requester to tell, handled again a little later (on the
    engine's clock) rather than dropped, which would leave the job running."""
    disk, clock = Disk(), FakeClock()
    engine = make(tmp_path, log_ops=disk, clock=clock)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.call(Submit(spec=job_spec(gpus=1)))
            await until(lambda: engine.state is not None and engine.state.jobs[1].pid is not None)
            assert engine.state is not None
            disk.full = True
            await engine.tell(ProcessExited(job=1, exit_code=3))  # as the executor says it
            await until(lambda: disk.refused > 0)
            disk.full = False  # room again: the retry comes once the clock says so
            # the state is read again from the log, where the job still runs
            await until(lambda: engine.state is not None and engine.state.jobs[1].state == JobState.RUNNING)
            await anyio.wait_all_tasks_blocked()
            assert engine.state.jobs[1].state == JobState.RUNNING
            clock.advance(engine_mod.RETRY_AFTER_FULL_S)
            await until(lambda: engine.state is not None and engine.state.jobs[1].state != JobState.RUNNING)
            job = engine.state.jobs[1]
            assert (job.state, job.exit_code) == (JobState.FAILED, 3)
            await engine.stop()

    anyio.run(main)


def test_quick_commits_run_on_the_loop_and_a_slow_disk_moves_them_to_the_commit_thread(tmp_path: Path) -> None:
    """While fdatasync is quick a commit runs on the loop (no hand-off to a
    thread); once one is slow, the next ones go to the commit thread, so the
    loop keeps running everything else for an fdatasync's length."""
    disk = WatchedDisk()
    engine = make(tmp_path, log_ops=disk)
    ticks = [0]
    paused = [False]

    async def ticker(task_status: anyio.abc.TaskStatus[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            while True:
                await anyio.sleep(0.001)
                ticks[0] += 1

    async def toggle(n: int) -> list[bool]:
        in_thread = []
        for _ in range(n):
            kind = ResumeGpu if paused[0] else PauseGpu
            await engine.call(kind(node=engine.config.node, gpu=0, by="test"))
            paused[0] = not paused[0]
            in_thread.append(disk.in_thread[-1])
        return in_thread

    async def until_quick() -> None:
        # the first commits after start-up can take a few ms here (the new
        # segment's zeros being written back): quick ones follow
        with anyio.fail_after(10):
            while (await toggle(1)) != [False]:
                pass

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await until_quick()  # quick: on the loop
            disk.slow_s = 0.06
            assert (await toggle(2))[1]  # a slow commit sends the next one to the thread
            scope = await tg.start(ticker)
            disk.ticks = ticks
            assert await toggle(4) == [True] * 4
            disk.ticks = None
            scope.cancel()
            assert len(disk.turns) >= 4 and all(disk.turns), f"the loop stood still in a 60 ms commit: {disk.turns}"
            disk.slow_s = 0.0
            await until_quick()  # quick again: back on the loop
            assert engine.state is not None and engine.log is not None
            assert engine.state.last_seq == engine.log.next_seq - 1
            assert engine.state.gpu(engine.config.node, 0).paused == paused[0]
            await engine.stop()

    anyio.run(main)


def test_a_request_that_arrives_while_the_batch_is_taken_shares_its_commit(tmp_path: Path) -> None:
    """Group commit: the engine lets the loop run once before taking a
    batch, so a request handed over in that step (another client's, just
    read from its socket) is committed in the same frame, one fdatasync for
    both, and each is answered after it."""
    engine = make(tmp_path)
    replies: list[tuple[object, object]] = []

    def submit() -> None:
        engine.submit_nowait(Submit(spec=job_spec(), by="uid:0"), None, lambda result, error: replies.append((result, error)))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            assert engine.log is not None
            # its GPU paused (nothing launches); and the call's answer
            # means the engine is idle, waiting for its inbox
            await engine.call(PauseGpu(node=engine.config.node, gpu=0, by="test"))
            frames_before = sum(1 for _ in eventlog.read_batches(engine.log.directory))
            submit()  # wakes the engine...
            asyncio.get_running_loop().call_soon(submit)  # ...and this one comes in the step after
            await until(lambda: len(replies) >= 2)
            frames = list(eventlog.read_batches(engine.log.directory))[frames_before:]
            submitted = [[type(e) for e in f if type(e) is ev.JobSubmitted] for f in frames]
            assert [len(s) for s in submitted if s] == [2], f"the two submissions' frames: {submitted}"
            assert all(error is None for _, error in replies)
            await engine.stop()

    anyio.run(main)


def test_the_server_is_told_once_a_batch_is_answered_before_its_launches(tmp_path: Path) -> None:
    """on_answered runs once per batch, after every reply of it and before
    its effects: the server writes the acknowledgements then, not a step of
    the loop later, and a client hears back before its job is launched."""
    executor = Recorder()
    engine = make(tmp_path, executor=executor)
    replies: list[int] = []
    told: list[tuple[int, int]] = []  # (replies given, launches asked) by then

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.call(Query(lambda state: None))  # past the start-up batch
            engine.on_answered = lambda: told.append((len(replies), len(executor.launched)))
            for _ in range(3):
                engine.submit_nowait(Submit(spec=job_spec(gpus=0.25), by="uid:0"), None,
                                     lambda result, error: replies.append(1))
            await until(lambda: len(replies) == 3 and len(executor.launched) == 3)
            assert told[0] == (3, 0), f"told {told} of one batch of three submissions"
            await engine.stop()

    anyio.run(main)


def test_a_commit_waits_a_few_loop_steps_for_the_requesters_of_the_last_batch(tmp_path: Path) -> None:
    """Group commit: clients that each wait for their acknowledgement come
    back one after another. While fewer requests wait than the last batch
    answered, the engine lets the loop run a few more steps (GATHER_STEPS)
    so that one fdatasync carries them all; a lone client is not kept waiting."""
    engine = make(tmp_path, Unsampled(1))
    replies: list[int] = []
    batches: list[int] = []  # replies given by the end of each batch

    def submit() -> None:
        spec = job_spec(gpus=4.0)  # waits: nothing launches
        engine.submit_nowait(Submit(spec=spec, by="uid:0"), None, lambda result, error: replies.append(1))

    def after_steps(steps: int) -> None:
        """submit once the loop has run ``steps`` more steps"""
        if steps == 0:
            submit()
        else:
            asyncio.get_running_loop().call_soon(after_steps, steps - 1)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.call(Query(lambda state: None))  # past the start-up batch
            # batches that answered a request (not those of observations alone)
            engine.on_answered = lambda: batches.append(len(replies)) if len(replies) > sum(batches[-1:]) else None
            for _ in range(3):
                submit()
            await until(lambda: len(replies) >= 3)
            assert batches == [3]
            # the three come back, the last two 2 and 4 steps after the first: one commit
            submit(), after_steps(2), after_steps(4)
            await until(lambda: len(replies) >= 6)
            assert batches == [3, 6]
            # bounded: one that comes back later than GATHER_STEPS is not waited for
            submit(), after_steps(engine_mod.GATHER_STEPS + 6)
            await until(lambda: len(replies) >= 8)
            assert batches == [3, 6, 7, 8]
            # the last batch answered one: a lone client takes no extra step
            submit(), after_steps(5)
            await until(lambda: len(replies) >= 10)
            assert batches == [3, 6, 7, 8, 9, 10]
            await engine.stop()

    anyio.run(main)


def test_a_time_limit_fires_when_the_clock_reaches_it_and_not_before(tmp_path: Path) -> None:
    executor, clock = Recorder(), FakeClock()
    engine = make(tmp_path, executor=executor, clock=clock)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.call(Submit(spec=job_spec(gpus=1, time_limit_s=3600.0)))
            await until(lambda: engine.state is not None and engine.state.jobs[1].pid is not None)
            clock.advance(3599.0)
            await anyio.wait_all_tasks_blocked()
            assert executor.signalled == []
            clock.advance(1.0)
            await until(lambda: executor.signalled == [1])
            assert engine.state is not None and engine.state.jobs[1].cancel_reason == "time-limit"
            await engine.stop()

    anyio.run(main)


def test_gpu_samples_come_every_interval_of_the_engines_clock(tmp_path: Path) -> None:
    clock = FakeClock()
    engine = make(tmp_path, clock=clock, sample_interval_s=2.0)
    samples: list[int] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            engine.subscribe(lambda payload: samples.append(len(payload)) or True)
            await anyio.wait_all_tasks_blocked()
            first = len(samples)
            clock.advance(61.0)  # past the minute after which an unchanged sample is logged again
            await until(lambda: len(samples) > first)
            await engine.stop()

    anyio.run(main)
