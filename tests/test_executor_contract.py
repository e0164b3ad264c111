"""What the engine relies on from an executor (``runtime/ports.py``),
checked on each: this machine's, and the Ray cluster's for the daemon's own
node (without a cluster: its watcher only reports the cluster unreachable).
A Ray node's own jobs are checked on a real local cluster in
tests/test_ray_cluster.py."""

from __future__ import annotations

import getpass
import inspect
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import (
    ClusterLink,
    Message,
    NeverLaunched,
    ProcessExited,
    ProcessStarted,
)
from eventsched.projections.cluster import ClusterState
from eventsched.runtime import ports
from eventsched.runtime.launch.executor import AlreadyLaunched, Executor, LaunchError

pytestmark = pytest.mark.anyio
KINDS = ["local", "ray"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make(kind: str, state_dir: Path) -> ports.Executor:
    local = Executor(state_dir, node="local")
    if kind == "local":
        return local
    from eventsched.runtime.cluster.ray_cluster import RayExecutor

    return RayExecutor(local, gpus="fake:1", namespace="eventsched-contract")


class Outbox:
    """What the engine hands ``run``: collects the messages; no state yet."""

    state: ClusterState | None = None

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message, /) -> None:
        if not isinstance(message, ClusterLink):  # Ray's watcher, without a cluster
            self.messages.append(message)

    async def next_of(self, kind: type, job: int, timeout: float = 30.0) -> Message:
        with anyio.fail_after(timeout):
            while True:
                for m in self.messages:
                    if isinstance(m, kind) and getattr(m, "job", None) == job:
                        return m
                await anyio.sleep(0.02)


@asynccontextmanager
async def running(executor: ports.Executor) -> AsyncIterator[Outbox]:
    outbox = Outbox()
    async with anyio.create_task_group() as tg:
        await tg.start(executor.run, outbox)
        yield outbox
        tg.cancel_scope.cancel()


def spec(*command: str) -> JobSpec:
    return JobSpec(command=list(command), uid=os.getuid(), user=getpass.getuser(), cwd="/tmp")


@pytest.mark.parametrize("kind", KINDS)
def test_it_has_what_the_engine_calls(kind: str, tmp_path: Path) -> None:
    executor = make(kind, tmp_path)
    assert isinstance(executor.fork_safe, bool)
    for name, member in inspect.getmembers(ports.Executor, inspect.isfunction):
        if name.startswith("_"):
            continue
        theirs = inspect.signature(getattr(executor, name))
        for param in list(inspect.signature(member).parameters.values())[1:]:  # past self
            assert param.name in theirs.parameters, f"{kind}: {name}() takes no {param.name}"


@pytest.mark.parametrize("kind", KINDS)
async def test_a_launch_returns_once_started_and_the_exit_comes_back(kind: str, tmp_path: Path) -> None:
    executor = make(kind, tmp_path)
    async with running(executor) as outbox:
        started = await executor.launch(1, spec("sh", "-c", "exit 3"), [], attempt=1, node="local")
        assert isinstance(started, ProcessStarted) and started.job == 1 and started.pid > 0
        exited = await outbox.next_of(ProcessExited, 1)
    assert isinstance(exited, ProcessExited) and exited.exit_code == 3


@pytest.mark.parametrize("kind", KINDS)
async def test_a_second_launch_of_one_attempt_is_refused_and_a_signal_stops_the_job(kind: str, tmp_path: Path) -> None:
    executor = make(kind, tmp_path)
    async with running(executor) as outbox:
        started = await executor.launch(1, spec("sleep", "60"), [], attempt=1, node="local")
        with pytest.raises(AlreadyLaunched):
            await executor.launch(1, spec("sleep", "60"), [], attempt=1, node="local")
        assert executor.job_processes().get(started.pid) == 1
        await executor.signal(1, 5.0)
        exited = await outbox.next_of(ProcessExited, 1)
    assert isinstance(exited, ProcessExited) and exited.exit_code != 0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_launch_that_cannot_start_raises_a_launch_error_in_one_line(kind: str, tmp_path: Path) -> None:
    executor = make(kind, tmp_path)
    async with running(executor):
        with pytest.raises(LaunchError) as failed:
            await executor.launch(1, spec("/nonexistent/program"), [], attempt=1, node="local")
    assert "\n" not in str(failed.value) and "/nonexistent/program" in str(failed.value)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_new_executor_recovers_what_the_last_one_started(kind: str, tmp_path: Path) -> None:
    first = make(kind, tmp_path)
    async with running(first):
        started = await first.launch(1, spec("sleep", "60"), [], attempt=1, node="local")
    again = make(kind, tmp_path)  # the daemon restarted; the job ran on
    recovered = again.recover({1: (started.pid, started.start_time), 2: (0, 0)}, {1: 1, 2: 1})
    async with running(again) as outbox:
        outbox.messages[:0] = recovered  # what the engine enqueues first
        await outbox.next_of(NeverLaunched, 2)  # placed, never launched
        assert not [m for m in outbox.messages if getattr(m, "job", None) == 1]  # re-adopted: nothing to say
        await again.signal(1, 5.0)
        await outbox.next_of(ProcessExited, 1)


def test_this_machines_executor_runs_only_its_own_node(tmp_path: Path) -> None:
    async def main() -> None:
        executor = make("local", tmp_path)
        with pytest.raises(LaunchError, match="node gpu-7"):
            await executor.launch(1, spec("true"), [], attempt=1, node="gpu-7")

    anyio.run(main)
