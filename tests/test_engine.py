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


@pytest.mark.slow
def test_an_observation_refused_by_a_full_disk_is_handled_again_once_there_is_room(tmp_path: Path) -> None:
    """Found in CI (issue 14): a job placed on a nearly full disk could not
    launch, and the exit saying so met the full log, was refused with its
    batch and, having no requester to tell, was dropped: the job stayed
    "running" with no process for ever. Now it is handled again later."""
    import os
    import signal

    from eventsched.domain import events as ev
    from eventsched.domain.messages import Submit
    from eventsched.domain.states import JobState
    from eventsched.storage.log import LogFullError

    engine = make(tmp_path)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.call(Submit(spec=ev.JobSpec(command=["sleep", "30"], gpus=1, uid=0, user="root")))
            with anyio.fail_after(10):
                while engine.state is None or not engine.state.jobs[1].pid:
                    await anyio.sleep(0.05)
            pid = engine.state.jobs[1].pid
            try:
                assert engine.log is not None
                append = engine.log.append_encoded
                refused: list[int] = []

                def full(events: list[ev.Event]) -> tuple[int, bytes]:
                    refused.append(len(events))
                    raise LogFullError("no space left on the log's disk")

                engine.log.append_encoded = full  # type: ignore[method-assign]
                await engine.tell(ProcessExited(job=1, exit_code=3))  # as the executor says it
                with anyio.fail_after(5):
                    while not refused:
                        await anyio.sleep(0.02)
                engine.log.append_encoded = append  # type: ignore[method-assign]  # room again
                with anyio.fail_after(5):
                    while engine.state.jobs[1].state == JobState.RUNNING:
                        await anyio.sleep(0.05)
                job = engine.state.jobs[1]
                assert (job.state, job.exit_code) == (JobState.FAILED, 3)
            finally:
                os.kill(pid, signal.SIGKILL)  # the test's own sleep, by its pid
                await engine.stop()

    anyio.run(main)


def test_quick_commits_run_on_the_loop_and_a_slow_disk_moves_them_to_the_commit_thread(tmp_path: Path) -> None:
    """While fdatasync is quick a commit runs on the loop (no hand-off to a
    thread); once one is slow, the next ones go to the commit thread, so the
    loop keeps running everything else for an fdatasync's length."""
    import time

    from eventsched.domain.messages import PauseGpu, ResumeGpu

    engine = make(tmp_path)
    gaps: list[float] = []

    ticking: list[anyio.CancelScope] = []

    async def ticker() -> None:
        with anyio.CancelScope() as scope:
            ticking.append(scope)
            last = time.monotonic()
            while True:
                await anyio.sleep(0.001)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

    paused = [False]

    async def toggle(n: int) -> list[bool]:
        used_thread = []
        for _ in range(n):
            kind = ResumeGpu if paused[0] else PauseGpu
            await engine.call(kind(node=engine.config.node, gpu=0, by="test"))
            paused[0] = not paused[0]
            used_thread.append(engine._commit_in_thread)
        return used_thread

    async def until_quick() -> None:
        # the first commits after start-up can take a few ms here (the new
        # segment's zeros being written back): quick ones follow
        with anyio.fail_after(10):
            while (await toggle(1)) != [False]:
                pass

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            try:
                assert engine.log is not None
                await until_quick()  # quick: on the loop
                quick = engine.log._fdatasync

                def slow(fd: int) -> None:
                    time.sleep(0.06)
                    quick(fd)

                engine.log._fdatasync = slow  # type: ignore[method-assign]
                assert await toggle(1) == [True]  # that one held the loop; the next ones will not
                tg.start_soon(ticker)
                assert await toggle(4) == [True] * 4
                ticking[0].cancel()
                assert gaps and max(gaps) < 0.03, f"the loop stalled {max(gaps) * 1000:.0f} ms in a 60 ms commit"
                engine.log._fdatasync = quick  # type: ignore[method-assign]
                await until_quick()  # quick again: back on the loop
                assert engine.state is not None and engine.state.last_seq == engine.log.next_seq - 1
                assert engine.state.gpu(engine.config.node, 0).paused == paused[0]
            finally:
                await engine.stop()

    anyio.run(main)


def test_a_request_that_arrives_while_the_batch_is_taken_shares_its_commit(tmp_path: Path) -> None:
    """Group commit: the engine lets the loop run once before taking a
    batch, so a request handed over in that step (another client's, just
    read from its socket) is committed in the same frame, one fdatasync for
    both, and each is answered after it."""
    import asyncio

    from eventsched.domain import events as ev
    from eventsched.domain.messages import PauseGpu, Submit
    from eventsched.storage import log as eventlog

    engine = make(tmp_path)
    replies: list[tuple[object, str | None]] = []

    def submit() -> None:
        spec = ev.JobSpec(command=["true"], uid=0, user="root")
        engine.submit_nowait(Submit(spec=spec, by="uid:0"), None, lambda result, error: replies.append((result, error)))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            try:
                assert engine.log is not None
                # its GPU paused (nothing launches); and the call's answer
                # means the engine is idle, waiting for its inbox
                await engine.call(PauseGpu(node=engine.config.node, gpu=0, by="test"))
                frames_before = sum(1 for _ in eventlog.read_batches(engine.log.directory))
                submit()  # wakes the engine...
                asyncio.get_running_loop().call_soon(submit)  # ...and this one comes in the step after
                with anyio.fail_after(10):
                    while len(replies) < 2:
                        await anyio.sleep(0.001)
                frames = list(eventlog.read_batches(engine.log.directory))[frames_before:]
                submitted = [[type(e) for e in f if type(e) is ev.JobSubmitted] for f in frames]
                assert [len(s) for s in submitted if s] == [2], f"the two submissions' frames: {submitted}"
                assert all(error is None for _, error in replies)
            finally:
                await engine.stop()

    anyio.run(main)


def test_the_server_is_told_once_a_batch_is_answered_before_its_launches(tmp_path: Path) -> None:
    """on_answered runs once per batch, after every reply of it and before
    its effects: the server writes the acknowledgements then, not a step of
    the loop later, and a client hears back before its job is launched."""
    from eventsched.domain import events as ev
    from eventsched.domain.messages import Launch, Submit

    engine = make(tmp_path)
    replies: list[int] = []
    performed: list[object] = []
    told: list[tuple[int, int]] = []  # (replies given, effects performed) by then
    perform = engine._perform

    def recording(effect: object) -> None:
        performed.append(effect)
        perform(effect)  # type: ignore[arg-type]

    engine._perform = recording  # type: ignore[method-assign]

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            try:
                await engine.call(Query(lambda state: None))  # past the start-up batch
                engine.on_answered = lambda: told.append((len(replies), len(performed)))
                performed.clear()
                for _ in range(3):
                    spec = ev.JobSpec(command=["true"], uid=0, user="root", cwd="/tmp", gpus=0.25)
                    engine.submit_nowait(Submit(spec=spec, by="uid:0"), None, lambda result, error: replies.append(1))
                with anyio.fail_after(10):
                    while len(replies) < 3 or len(performed) < 3:
                        await anyio.sleep(0.01)
                assert told[0] == (3, 0), f"told {told} of one batch of three submissions"
                assert [type(e) for e in performed[:3]] == [Launch] * 3
            finally:
                await engine.stop()

    anyio.run(main)


def test_a_commit_waits_a_few_loop_steps_for_the_requesters_of_the_last_batch(tmp_path: Path) -> None:
    """Group commit: clients that each wait for their acknowledgement come
    back one after another. While fewer requests wait than the last batch
    answered, the engine lets the loop run a few more steps (GATHER_STEPS)
    so that one fdatasync carries them all; a lone client is not kept waiting."""
    import asyncio

    from eventsched.domain import events as ev
    from eventsched.domain.messages import Submit

    # no GPU sample during the test: it would count as a request waiting
    engine = Engine(tmp_path / "state", SchedulerConfig(), FakeBackend(1), sample_interval_s=3600)
    replies: list[int] = []
    batches: list[int] = []  # replies given by the end of each batch

    def submit() -> None:
        spec = ev.JobSpec(command=["true"], uid=0, user="root", cwd="/tmp", gpus=4.0)  # waits: nothing launches
        engine.submit_nowait(Submit(spec=spec, by="uid:0"), None, lambda result, error: replies.append(1))

    def after_steps(steps: int) -> None:
        """submit once the loop has run ``steps`` more steps"""
        loop = asyncio.get_running_loop()
        if steps == 0:
            submit()
        else:
            loop.call_soon(after_steps, steps - 1)

    async def answered(n: int) -> None:
        with anyio.fail_after(10):
            while len(replies) < n:
                await anyio.sleep(0.01)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            try:
                await engine.call(Query(lambda state: None))  # past the start-up batch
                # batches that answered a request (not those of observations alone)
                engine.on_answered = lambda: batches.append(len(replies)) if len(replies) > sum(batches[-1:]) else None
                for _ in range(3):
                    submit()
                await answered(3)
                assert batches == [3]
                # the three come back, the last two 2 and 4 steps after the first: one commit
                submit(), after_steps(2), after_steps(4)
                await answered(6)
                assert batches == [3, 6]
                # bounded: one that comes back later than GATHER_STEPS is not waited for
                submit(), after_steps(engine_mod.GATHER_STEPS + 6)
                await answered(8)
                assert batches == [3, 6, 7, 8]
                # the last batch answered one: a lone client takes no extra step
                submit(), after_steps(5)
                await answered(10)
                assert batches == [3, 6, 7, 8, 9, 10]
            finally:
                await engine.stop()

    anyio.run(main)
