"""The executor of one node of a Ray cluster, run there as an actor
(docs/multi-node.md). Plain Python: ``ray_cluster.py`` wraps it with ``ray.remote``.

It runs jobs through the same ``Executor`` as a single machine and holds the
node's lease: every call from the daemon renews it, and a node that has heard
nothing for ``node_lease_s`` stops its jobs itself, all dead before the daemon
can run them elsewhere, and writes down what it stopped (``fenced.json``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import Fenced, Message, ProcessExited, ProcessLost
from eventsched.runtime.gpus import FakeBackend, GpuBackend, GpuSample, parse_gpus_option
from eventsched.runtime.launch.executor import AlreadyLaunched, Executor, LaunchError

__all__ = ["NodeAgent", "agent_state_dir"]

_OUTPUT_CHUNK = 1 << 20  # most output bytes handed over per call
_LEASE_CHECK_S = 0.1  # how often the lease is looked at
_FENCES = "fenced.json"  # what this node stopped itself, until the daemon has recorded it


def agent_state_dir(state_dir: str, node: str) -> Path:
    """The daemon's state dir path, on the node's own disk."""
    return Path(state_dir) / "nodes" / node


class NodeAgent:
    """One node's executor and GPU sampler; messages travel as pickled msgspec structs."""

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
        self._wake = asyncio.Event()  # set when the outbox has something
        self._runner: asyncio.Task[None] | None = None
        self._lease_task: asyncio.Task[None] | None = None  # held: the loop keeps only weak references
        self._renewed = time.monotonic()  # the daemon's last call: the lease runs from it
        # (lease_s, kill_by_s, grace_s) as the daemon last sent them: lease_s
        # after its last call each job gets its --signal, and SIGKILL after its
        # grace (grace_s when it gave none) or kill_by_s after that call,
        # whichever comes first (lease_s 0: no lease; kill_by_s 0: no bound)
        self._terms = (0.0, 0.0, 0.0)
        self._stops: dict[int, tuple[int, float]] = {}  # job -> (its --signal, its grace; -1: grace_s)
        self._expired = False  # this lease ran out and its jobs were stopped
        self._fences: list[dict[str, Any]] = self._read_fences()

    async def hello(self) -> dict[str, Any]:
        """Start the executor's watcher (once per actor) and say who we are."""
        self._renew()
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self.executor.run(self._send))
            self._lease_task = asyncio.get_running_loop().create_task(self._watch_lease())
        return {"node": self.node, "boot": self.boot, "pid": os.getpid(), "gpus": list(self.backend.discover()),
                "gpu_backend": self.backend.name}

    async def _send(self, message: Message) -> None:
        job = getattr(message, "job", -1)
        self._outbox.append((self._attempts.get(job, -1), message))
        if isinstance(message, (ProcessExited, ProcessLost)):
            self._stops.pop(job, None)  # ended: nothing left for a fence to stop
        self._wake.set()

    async def poll(
        self, timeout_s: float, terms: tuple[float, float, float] = (0.0, 0.0, 0.0)
    ) -> tuple[str, list[tuple[int, Message]], list[tuple[str, Fenced]]]:
        """(this actor's boot id, [(attempt, exit or loss)] since the last poll,
        [(id, fence)] not yet acknowledged), waiting up to ``timeout_s``.
        ``terms``: the lease's, as ``__init__`` says."""
        self._renew(terms)
        fences = [(f["id"], Fenced(node=self.node, jobs=f["jobs"], attempts=f["attempts"], reason=f["reason"]))
                  for f in self._fences]
        if self._runner is None:  # not started (a restarted actor): say who we are at once
            return self.boot, [], fences
        if not self._outbox:
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout_s)
        out, self._outbox = self._outbox, []
        return self.boot, out, fences

    # --- jobs -------------------------------------------------------------

    async def launch(self, job: int, spec: JobSpec, gpu_ids: list[int], attempt: int) -> tuple[str, Any]:
        """("started", ProcessStarted) | ("already", reason) | ("failed", reason)."""
        self._renew()
        self._stops[job] = (spec.warn_signal, spec.warn_s)
        self._attempts[job] = attempt
        try:
            started = await self.executor.launch(job, spec, gpu_ids, attempt=attempt)
        except AlreadyLaunched as exc:
            return "already", str(exc)
        except (LaunchError, OSError) as exc:
            return "failed", str(exc)
        return "started", started

    async def signal(self, job: int, grace_s: float, signum: int = 0) -> None:
        self._renew()
        await self.executor.signal(job, grace_s, signum)

    def recover(self, running: dict[int, tuple[int, int]], attempts: dict[int, int],
                stops: dict[int, tuple[int, float]]) -> list[Message]:
        """``Executor.recover`` for the jobs this actor does not already watch
        (``stops``: each job's ``--signal`` and grace, for the lease)."""
        self._renew()
        self._stops.update(stops)
        watched = self.executor.running_jobs()
        todo = {j: v for j, v in running.items() if j not in watched}
        self._attempts.update(attempts)
        return self.executor.recover(todo, attempts)  # it reads only the attempts of ``todo``

    def live_attempts(self) -> list[tuple[int, int, int]]:
        self._renew()
        return self.executor.live_attempts()

    async def kill_attempt(self, job: int, attempt: int, grace_s: float) -> int:
        self._renew()
        if self._runner is None:  # the executor's watcher reaps what it kills
            await self.hello()
        return await self.executor.kill_attempt(job, attempt, grace_s)

    def output(self, job: int, offset: int) -> bytes:
        """The job's output from ``offset`` on (at most a chunk)."""
        self._renew()
        try:
            with open(self.executor.log_path(job), "rb") as f:
                f.seek(offset)
                return f.read(_OUTPUT_CHUNK)
        except OSError:
            return b""

    # --- GPUs ---------------------------------------------------------------

    def sample(self, loads: dict[int, tuple[float, int]]) -> list[GpuSample]:
        """``loads``: what the scheduler placed on each GPU (``set_load``)."""
        self._renew()
        if isinstance(self.backend, FakeBackend):
            for gpu, (share, reserved) in loads.items():
                if 0 <= gpu < self.backend.n:
                    self.backend.set_load(gpu, share, reserved)
        return list(self.backend.sample(self.executor.job_processes()))

    # --- the lease ------------------------------------------------------------

    def _renew(self, terms: tuple[float, float, float] | None = None) -> None:
        self._renewed, self._expired = time.monotonic(), False
        if terms is not None:
            self._terms = terms

    async def _watch_lease(self) -> None:
        while True:
            await asyncio.sleep(_LEASE_CHECK_S)
            lease_s, kill_by_s, grace_s = self._terms
            quiet = time.monotonic() - self._renewed
            if lease_s > 0 and quiet >= lease_s and not self._expired:
                self._expired = True
                await self._fence(quiet, lease_s, kill_by_s, grace_s)

    async def _fence(self, quiet: float, lease_s: float, kill_by_s: float, grace_s: float) -> None:
        """Stop every job running here through the executor's own signal
        path, once written down: the daemon will give them to another node."""
        jobs = sorted(self.executor.running_jobs())
        if not jobs:
            return
        left = kill_by_s - quiet if kill_by_s > 0 else float("inf")  # until every job must be dead
        graces: dict[int, tuple[int, float]] = {}
        for job in jobs:
            signum, grace = self._stops.get(job, (0, -1.0))
            graces[job] = (signum, max(0.0, min(grace_s if grace < 0 else grace, left)))
        longest = max(g for _, g in graces.values())
        self._fences.append({
            "id": uuid.uuid4().hex, "jobs": jobs, "attempts": [self._attempts.get(j, -1) for j in jobs],
            "reason": f"node {self.node} heard nothing from the daemon for {quiet:.1f} s (node_lease_s = {lease_s:g}) "
                      f"and stopped its jobs at {time.strftime('%H:%M:%S')} (its clock): "
                      f"--signal, then SIGKILL within {longest:.1f} s"})
        self._write_fences()
        for job, (signum, grace) in graces.items():
            await self.executor.signal(job, grace, signum)

    def forget_fences(self, ids: list[str]) -> None:
        """The daemon has recorded these fences (``poll`` hands them over until then)."""
        self._renew()
        self._fences = [f for f in self._fences if f["id"] not in ids]
        self._write_fences()

    def _read_fences(self) -> list[dict[str, Any]]:
        try:
            data = json.loads((self.state_dir / _FENCES).read_text())
        except (OSError, ValueError):
            return []
        return [f for f in data if isinstance(f, dict) and "id" in f] if isinstance(data, list) else []

    def _write_fences(self) -> None:
        """Atomically, and on disk before any job is signalled."""
        path = self.state_dir / _FENCES
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self._fences, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
