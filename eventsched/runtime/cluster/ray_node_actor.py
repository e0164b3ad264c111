"""The executor of one node of a Ray cluster, run there as an actor.

``ray_cluster.py`` starts one ``NodeAgent`` per GPU node, pinned to it,
detached and named so that it outlives a restart of the daemon. It reserves
no CPU and no GPU (Ray's GPU accounting must not fight the scheduler's) and
runs jobs through the same ``Executor`` as a single machine. It samples the
node's GPUs and hands the daemon, when asked, what happened since: exits,
losses. Plain Python: the daemon wraps it with ``ray.remote``.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import Message
from eventsched.runtime.gpus import FakeBackend, GpuBackend, GpuSample, parse_gpus_option
from eventsched.runtime.launch.executor import AlreadyLaunched, Executor, LaunchError

__all__ = ["NodeAgent", "agent_state_dir"]

_OUTPUT_CHUNK = 1 << 20  # most output bytes handed over per call


def agent_state_dir(state_dir: str, node: str) -> Path:
    """Where a node keeps its jobs' records and output: the daemon's state dir path, on its own disk."""
    return Path(state_dir) / "nodes" / node


class NodeAgent:
    """One node's executor and GPU sampler. Every method is called by the
    daemon through Ray; messages travel as pickled msgspec structs."""

    def __init__(self, node: str, state_dir: str, gpus: str, max_host_mem_mib: int = 0) -> None:
        self.node = node
        self.boot = uuid.uuid4().hex  # a new one per (re)start of the actor
        self.state_dir = agent_state_dir(state_dir, node)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # as on one machine: a user's job reaches its own output by path (a --session writes it so)
        os.chmod(self.state_dir, 0o711 if os.geteuid() == 0 else 0o700)
        self.backend: GpuBackend = parse_gpus_option(gpus, node=node)
        # the submitter is looked up by name here; the daemon's memory ceiling holds here too
        self.executor = Executor(self.state_dir, node=node, resolve_user_by_name=True,
                                 max_host_mem_mib=max_host_mem_mib)
        self._outbox: list[tuple[int, Message]] = []  # (attempt, message)
        self._attempts: dict[int, int] = {}  # job -> the attempt launched or adopted here
        self._wake: asyncio.Event | None = None
        self._runner: asyncio.Task[None] | None = None

    # --- life -------------------------------------------------------------

    async def hello(self) -> dict[str, Any]:
        """Start the executor's watcher (once per actor) and say who we are."""
        if self._runner is None:
            self._wake = asyncio.Event()
            self._runner = asyncio.get_running_loop().create_task(self.executor.run(self._send))
        return {
            "node": self.node,
            "boot": self.boot,
            "pid": os.getpid(),
            "gpus": list(self.backend.discover()),
            "gpu_backend": self.backend.name,
        }

    async def _send(self, message: Message) -> None:
        job = getattr(message, "job", -1)
        self._outbox.append((self._attempts.get(job, -1), message))
        if self._wake is not None:
            self._wake.set()

    async def poll(self, timeout_s: float) -> tuple[str, list[tuple[int, Message]]]:
        """(this actor's boot id, [(attempt, exit or loss)] since the last poll),
        waiting up to ``timeout_s``. A new boot id means Ray restarted the actor."""
        if self._wake is None:  # not started (a restarted actor): say who we are at once
            return self.boot, []
        if not self._outbox:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        out, self._outbox = self._outbox, []
        return self.boot, out

    # --- jobs -------------------------------------------------------------

    async def launch(self, job: int, spec: JobSpec, gpu_ids: list[int], attempt: int) -> tuple[str, Any]:
        """("started", ProcessStarted) | ("already", reason) | ("failed", reason)."""
        self._attempts[job] = attempt
        try:
            started = await self.executor.launch(job, spec, gpu_ids, attempt=attempt)
        except AlreadyLaunched as exc:
            return "already", str(exc)
        except (LaunchError, OSError) as exc:
            return "failed", str(exc)
        return "started", started

    async def signal(self, job: int, grace_s: float, signum: int = 0) -> None:
        await self.executor.signal(job, grace_s, signum)

    def recover(self, running: dict[int, tuple[int, int]], attempts: dict[int, int]) -> list[Message]:
        """After a restart (of the daemon or this actor): ``Executor.recover``
        for the jobs this actor does not already watch."""
        watched = self.executor.running_jobs()
        todo = {j: v for j, v in running.items() if j not in watched}
        self._attempts.update(attempts)
        return self.executor.recover(todo, {j: attempts[j] for j in todo if j in attempts})

    def live_attempts(self) -> list[tuple[int, int, int]]:
        """(job, attempt, job pid) of every attempt whose supervisor is alive here."""
        return self.executor.live_attempts()

    async def kill_attempt(self, job: int, attempt: int, grace_s: float) -> int:
        """Kill a stray attempt (SIGKILL after ``grace_s``), unreported; its job pid, 0 if gone."""
        if self._runner is None:  # the executor's watcher reaps what it kills
            await self.hello()
        return await self.executor.kill_attempt(job, attempt, grace_s)

    def output(self, job: int, offset: int) -> bytes:
        """The job's output from ``offset`` on (at most a chunk), for the daemon to mirror."""
        try:
            with open(self.executor.log_path(job), "rb") as f:
                f.seek(offset)
                return f.read(_OUTPUT_CHUNK)
        except OSError:
            return b""

    # --- GPUs ---------------------------------------------------------------

    def sample(self, loads: dict[int, tuple[float, int]]) -> list[GpuSample]:
        """One observation per GPU; ``loads``: what the scheduler placed on each (``set_load``)."""
        if isinstance(self.backend, FakeBackend):
            for gpu, (share, reserved) in loads.items():
                if 0 <= gpu < self.backend.n:
                    self.backend.set_load(gpu, share, reserved)
        return list(self.backend.sample(self.executor.job_processes()))
