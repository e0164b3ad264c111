"""Several machines on Ray: the daemon's side of a cluster (docs/multi-node.md).

``serve --ray ADDRESS|auto`` keeps the daemon the one writer of the one log;
every Ray node that offers GPUs is run by a pinned, detached ``NodeAgent``
actor (``ray_node_actor.py``), named per state dir so that a restarted daemon
finds it again. Messages about an attempt that is not the job's current one
on that node are dropped, so nothing is counted twice. Each job's output is
mirrored, as it grows, into the daemon's ``jobs/<job>.log``.

Ray is imported here only, and only when ``--ray`` is given.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import (
    ClusterLink, Fenced, GpuInfo, Message, NodeDown, NodeUp, ProcessExited, ProcessLost, ProcessStarted, SchedulerConfig,
    StrayKilled, lease_terms,
)
from eventsched.domain.states import JobState
from eventsched.projections.cluster import ClusterState
from eventsched.runtime.gpus import GpuSample
from eventsched.runtime.launch.executor import AlreadyLaunched, Executor, LaunchError
from eventsched.runtime.ports import Outbox

__all__ = ["RayExecutor", "RayGpus", "RayUnavailable", "connect", "node_name", "namespace_for"]

_log = logging.getLogger("eventsched.ray")
_POLL_S = 1.0  # how often the node list is read; an agent's long poll
_MIRROR_S = 0.5  # how often running remote jobs' output is copied here
_CALL_TIMEOUT_S = 30.0
_STRAY_GRACE_S = 2.0  # SIGTERM, then SIGKILL: a stray attempt's grace


class RayUnavailable(RuntimeError):
    """Ray is not installed or the cluster cannot be reached; one line."""


def connect(address: str, namespace: str) -> None:
    """``ray.init`` as a driver of an existing cluster."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--ray needs Ray: pip install 'eventsched[ray]'") from None
    _probe(address)
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING,
                 configure_logging=False)
    except Exception as exc:  # ConnectionError, a bad address: Ray's own words, on one line
        raise RayUnavailable(f"--ray {address}: cannot connect to the Ray cluster: {str(exc).splitlines()[0]}") from None


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT where nothing answers is said at once (``ray.init``
    would retry for minutes)."""
    host, _, port = address.rpartition(":")
    if address == "auto" or "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise RayUnavailable(f"--ray {address}: cannot connect to the Ray cluster: nothing answers there ({why})") from None


def namespace_for(state_dir: Path) -> str:
    """One Ray namespace per state dir."""
    return "eventsched-" + hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:12]


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def node_name(info: dict[str, Any]) -> str | None:
    """Our name for a Ray node (its ``node:NAME`` resource, else ``ray-``
    and its id's first 8 digits), or None when it offers no GPUs."""
    resources = info.get("Resources") or {}
    for key in sorted(resources):
        if key.startswith("node:") and not key.startswith("node:__") and not _is_ip(key[5:]):
            return key[5:]
    if resources.get("GPU", 0) > 0:
        return "ray-" + str(info.get("NodeID", ""))[:8]
    return None


class _Agent:
    def __init__(self, name: str, ray_node: str) -> None:
        self.name, self.ray_node = name, ray_node
        self.actor: Any = None
        self.boot = ""  # its actor's boot id, once it said hello
        self.scope = anyio.CancelScope()
        self.ready = anyio.Event()


class RayExecutor:
    fork_safe = False  # gRPC's threads do not survive a fork: snapshots stay on the loop

    def __init__(self, local: Executor, *, gpus: str, namespace: str) -> None:
        self.local = local  # runs the daemon's own node's jobs
        self.node = local.node
        self.state_dir = local.jobs_dir.parent
        self.gpus_option = gpus or "nvml"
        self.namespace = namespace
        self._agents: dict[str, _Agent] = {}
        self._remote_jobs: dict[int, str] = {}  # job -> node, for jobs launched or adopted remotely
        self._outbox: Outbox | None = None
        self._to_recover: tuple[dict[int, tuple[int, int]], dict[int, int]] = ({}, {})
        self._pulling: dict[int, anyio.Lock] = {}  # job -> held while its output is copied
        self._exchanged: dict[str, float] = {}  # node -> when (monotonic) its agent last answered
        self._fences_told: set[str] = set()  # the ids of the fences sent to the core

    # --- the engine's interface (ports.Executor) -----------------------------------

    def recover(self, running: dict[int, tuple[int, int]], attempts: dict[int, int] | None = None) -> list[Message]:
        """Nothing yet: the own node's jobs are recovered when ``run`` starts,
        a remote node's when its agent answers."""
        self._to_recover = (running, attempts or {})
        return []

    async def launch(
        self, job: int, spec: JobSpec, gpu_ids: list[int], *, attempt: int = 1, node: str | None = None
    ) -> ProcessStarted:
        if node is None or node == self.node:
            return await self.local.launch(job, spec, gpu_ids, attempt=attempt)
        agent = await self._connected(node)
        self._remote_jobs[job] = node
        with anyio.fail_after(_CALL_TIMEOUT_S):
            kind, value = await agent.actor.launch.remote(job, spec, gpu_ids, attempt)
        if kind == "already":
            raise AlreadyLaunched(value)
        if kind == "failed":
            raise LaunchError(value)
        return self._mirrored(value)

    def _mirrored(self, started: ProcessStarted) -> ProcessStarted:
        return msgspec.structs.replace(started, log_path=str(self.log_path(started.job)))

    async def _connected(self, node: str) -> _Agent:
        """The node's agent once it has joined (a restarted daemon places on
        the nodes its log knows before their agents answer again)."""
        with anyio.move_on_after(_CALL_TIMEOUT_S * 2):
            while True:
                agent = self._agents.get(node)
                if agent is not None and agent.actor is not None and agent.ready.is_set():
                    return agent
                await anyio.sleep(0.05)
        raise LaunchError(f"node {node} is not connected")

    async def signal(self, job: int, grace_s: float, signum: int = 0) -> None:
        agent = self._agents.get(self._remote_jobs.get(job, ""))  # no node is named ""
        if agent is None or agent.actor is None:
            await self.local.signal(job, grace_s, signum)
            return
        with contextlib.suppress(Exception):  # the node is gone: its loss is reported apart
            await agent.actor.signal.remote(job, grace_s, signum)

    def job_processes(self) -> dict[int, int]:
        return self.local.job_processes()

    def log_path(self, job: int) -> Path:  # a remote job's output is mirrored there
        return self.local.log_path(job)

    @property
    def containment(self) -> str:
        return self.local.containment

    @property
    def memory_limit(self) -> str:
        return self.local.memory_limit

    async def run(self, send: Outbox, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._outbox = send
        running, attempts = self._to_recover
        state = send.state
        here = {j: v for j, v in running.items() if state is None or state.jobs[j].node in ("", None, self.node)}
        for message in self.local.recover(here, attempts):  # it reads only the attempts of ``here``
            await send(message)  # before the local executor runs: a start is told before its exit
        async with anyio.create_task_group() as tg:
            await tg.start(self.local.run, send)
            tg.start_soon(self._watch_cluster, tg)
            tg.start_soon(self._mirror_loop)
            task_status.started()

    def _state(self) -> ClusterState | None:
        return self._outbox.state if self._outbox is not None else None

    # --- nodes --------------------------------------------------------------------

    async def _watch_cluster(self, tg: anyio.abc.TaskGroup) -> None:
        import ray

        assert self._outbox is not None
        send = self._outbox
        lost, first = False, True
        while True:
            try:
                infos = await anyio.to_thread.run_sync(ray.nodes)
            except Exception as exc:  # the GCS is unreachable
                if not lost:
                    lost = True
                    await send(ClusterLink(lost=True, reason=str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
                await anyio.sleep(_POLL_S)
                continue
            if lost:
                lost = False
                await send(ClusterLink(lost=False, reason="connected again"))
            alive = {name: info["NodeID"] for info in infos if info.get("Alive") and (name := node_name(info)) is not None}
            for name, agent in list(self._agents.items()):
                if alive.get(name) != agent.ray_node:
                    del self._agents[name]
                    agent.scope.cancel()
                    why = "Ray reports the node dead" if name not in alive else "replaced by another Ray node"
                    await send(NodeDown(node=name, reason=why))
            if first:  # nodes the log has up that this cluster does not have
                first = False
                state = self._state()
                for name, info in sorted((state.nodes if state is not None else {}).items()):
                    if info.state == "up" and name not in alive:
                        await send(NodeDown(node=name, reason="not in the cluster when the daemon started"))
            for name, ray_node in sorted(alive.items()):
                if name not in self._agents and name != self.node:
                    agent = self._agents[name] = _Agent(name, ray_node)
                    tg.start_soon(self._run_agent, agent)
            await anyio.sleep(_POLL_S)

    def _make_actor(self, agent: _Agent) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from eventsched.runtime.cluster.ray_node_actor import NodeAgent

        remote = ray.remote(NodeAgent)
        return remote.options(  # type: ignore[attr-defined]
            name=f"eventsched-node-{agent.name}",
            namespace=self.namespace,
            lifetime="detached",  # outlives a daemon's restart: its jobs are re-adopted
            get_if_exists=True,
            num_cpus=0,
            num_gpus=0,  # the scheduler's GPU accounting, not Ray's
            max_restarts=-1,
            max_concurrency=64,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=agent.ray_node, soft=False),
        ).remote(agent.name, str(self.state_dir), self.gpus_option, self.local.max_host_mem_mib)

    def _running_on(self, node: str) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
        state = self._state()
        jobs = [] if state is None else [state.jobs[j] for j in state.running]
        jobs = [job for job in jobs if job.node == node and job.state == JobState.RUNNING]
        return {job.id: (job.pid or 0, job.start_time or 0) for job in jobs}, {job.id: job.attempts for job in jobs}

    async def _join(self, agent: _Agent, restarted: bool) -> None:
        """Tell the core the node is up, then re-adopt its jobs."""
        assert self._outbox is not None
        with anyio.fail_after(120.0):  # a worker's start on a busy node takes seconds
            hello: dict[str, Any] = await agent.actor.hello.remote()
        self._exchanged[agent.name] = time.monotonic()
        if hello["boot"] != agent.boot:  # else a passing failure: the same actor, nothing to tell
            agent.boot = hello["boot"]
            gpus: list[GpuInfo] = hello["gpus"]
            await self._outbox(NodeUp(node=agent.name, gpus=gpus, ray_node=agent.ray_node,
                                       gpu_backend=hello["gpu_backend"], restarted=restarted))
        running, attempts = self._running_on(agent.name)
        await self._kill_strays(agent, attempts)
        self._remote_jobs.update(dict.fromkeys(running, agent.name))
        if running:
            with anyio.fail_after(_CALL_TIMEOUT_S):
                msgs: list[Message] = await agent.actor.recover.remote(running, attempts, self._stops(running))
            for msg in msgs:
                if isinstance(msg, ProcessStarted):
                    msg = self._mirrored(msg)
                elif isinstance(msg, (ProcessExited, ProcessLost)):
                    await self._pull_output(agent, msg.job)
                await self._outbox(msg)
        agent.ready.set()

    async def _kill_strays(self, agent: _Agent, current: dict[int, int]) -> None:
        """Kill and record every attempt alive on the node that is not its
        job's current one there (``current``: job -> attempt, as the log has
        them), so that no job runs twice."""
        assert self._outbox is not None
        with anyio.fail_after(_CALL_TIMEOUT_S):
            live: list[tuple[int, int, int]] = await agent.actor.live_attempts.remote()
        for job, attempt, pid in live:
            state = self._state()  # read now: a launch may have been placed since
            if state is None:
                return  # nothing known yet: nothing is killed
            if current.get(job) == attempt or self._current(agent.name, job, attempt):
                continue  # the job's running attempt here: re-adopted (or being launched)
            j = state.jobs.get(job)
            if j is None:
                why = f"job {job} is not in the log"
            elif j.state == JobState.RUNNING and j.node == agent.name:
                why = f"job {job} runs its attempt {j.attempts} here"
            elif j.state == JobState.RUNNING:
                why = f"job {job} runs on {j.node} (attempt {j.attempts})"
            else:
                why = f"job {job} is {j.state.value}"
            with anyio.fail_after(_CALL_TIMEOUT_S):
                killed: int = await agent.actor.kill_attempt.remote(job, attempt, _STRAY_GRACE_S)
            _log.warning("node %s: killed stray attempt %d of job %d (pid %d): %s", agent.name, attempt, job, pid, why)
            await self._outbox(StrayKilled(node=agent.name, job=job, attempt=attempt, pid=killed or pid,
                                            reason=why))

    async def _run_agent(self, agent: _Agent) -> None:
        from ray.exceptions import RayError

        assert self._outbox is not None
        with agent.scope:
            restarted = False
            while True:
                try:
                    if agent.actor is None:
                        agent.actor = await anyio.to_thread.run_sync(self._make_actor, agent)
                    boot = agent.boot
                    if not boot or restarted:
                        await self._join(agent, restarted=bool(boot))
                        restarted = False
                    boot, items, fences = await agent.actor.poll.remote(_POLL_S, self._lease_terms())
                    self._exchanged[agent.name] = time.monotonic()
                    if fences:
                        await self._record_fences(agent, fences)
                except (RayError, TimeoutError) as exc:
                    # the actor died (Ray restarts it on the same node) or is
                    # slow to start: ask again; a dead node is the watcher's to report
                    _log.info("node %s: agent unavailable (%s); retrying", agent.name, type(exc).__name__)
                    restarted = bool(agent.boot)
                    await anyio.sleep(_POLL_S)
                    continue
                if boot != agent.boot:
                    restarted = True  # Ray restarted the actor: re-join and re-adopt
                    continue
                for attempt, msg in items:
                    job = getattr(msg, "job", -1)
                    if not self._current(agent.name, job, attempt):
                        continue  # an attempt this node no longer has: already counted
                    if isinstance(msg, (ProcessExited, ProcessLost)):
                        await self._pull_output(agent, job)
                        self._remote_jobs.pop(job, None)
                    await self._outbox(msg)

    # --- the lease ----------------------------------------------------------------

    def _lease_terms(self) -> tuple[float, float, float]:
        """(lease_s, kill_by_s, grace_s) for the agents: the core gives a
        node's jobs up only once a node cut off has killed them."""
        state = self._state()
        cfg = state.config if state is not None else SchedulerConfig()
        return (*lease_terms(cfg), cfg.preempt_grace_s)

    def _stops(self, jobs: Collection[int]) -> dict[int, tuple[int, float]]:
        """Each job's ``--signal`` and grace (-1: the daemon's), for a fence."""
        state = self._state()
        known = {} if state is None else {j: state.jobs[j].spec for j in jobs if j in state.jobs}
        return {j: (s.warn_signal, s.warn_s) for j, s in known.items()}

    async def _record_fences(self, agent: _Agent, fences: list[tuple[str, Fenced]]) -> None:
        """Tell the core what the node stopped itself (once each), then let the node forget it."""
        assert self._outbox is not None
        for fid, msg in fences:
            if fid not in self._fences_told:
                self._fences_told.add(fid)
                _log.warning("node %s fenced jobs %s: %s", agent.name, msg.jobs, msg.reason)
                await self._outbox(msg)
        with anyio.fail_after(_CALL_TIMEOUT_S):
            await agent.actor.forget_fences.remote([fid for fid, _ in fences])

    def lease_ages(self) -> dict[str, float]:
        """{node: seconds since its agent last answered}."""
        now = time.monotonic()
        return {name: now - at for name, at in self._exchanged.items()}

    def _current(self, node: str, job: int, attempt: int) -> bool:
        state = self._state()
        j = state.jobs.get(job) if state is not None else None
        return j is not None and j.state == JobState.RUNNING and j.node == node and (attempt < 0 or j.attempts == attempt)

    # --- output -------------------------------------------------------------------

    async def _pull_output(self, agent: _Agent, job: int) -> None:
        """Copy what the job wrote on its node since the last copy (one copy
        at a time per job: the mirror loop and an exit may ask together)."""
        lock = self._pulling.setdefault(job, anyio.Lock())
        async with lock:
            marker = self.local.jobs_dir / f"{job}.mirror-{agent.name}"
            try:
                offset = int(marker.read_text())
            except (OSError, ValueError):
                offset = 0
            while data := await self._output(agent, job, offset):
                fd = os.open(self.log_path(job), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600)
                try:
                    state = self._state() if offset == 0 and os.geteuid() == 0 else None
                    owner = state.jobs.get(job) if state is not None else None
                    if owner is not None and owner.spec.uid >= 0:  # its user reads it by path, as on one machine
                        os.fchown(fd, owner.spec.uid, owner.spec.gid)
                    os.write(fd, data)
                finally:
                    os.close(fd)
                offset += len(data)
                tmp = marker.with_name(marker.name + ".tmp")
                tmp.write_text(str(offset))
                os.replace(tmp, marker)
        if not lock.statistics().tasks_waiting and job not in self._remote_jobs:
            self._pulling.pop(job, None)

    @staticmethod
    async def _output(agent: _Agent, job: int, offset: int) -> bytes:
        try:
            with anyio.fail_after(_CALL_TIMEOUT_S):
                return await agent.actor.output.remote(job, offset)
        except Exception:  # the node is gone: its loss is reported apart
            return b""

    async def _mirror_loop(self) -> None:
        while True:
            await anyio.sleep(_MIRROR_S)
            for job, node in list(self._remote_jobs.items()):
                agent = self._agents.get(node)
                if agent is not None and agent.actor is not None:
                    await self._pull_output(agent, job)

    # --- GPU samples (RayGpus) -----------------------------------------------------

    def sample_all(self) -> list[GpuSample]:
        """Every connected node's samples (called in a worker thread)."""
        import ray

        state = self._state()
        calls = []
        for name, agent in list(self._agents.items()):
            if agent.actor is None or not agent.ready.is_set():
                continue
            gpus = state.node_gpus.get(name, ()) if state is not None else ()
            loads = {gpu.id: (gpu.used_milli / 1000, gpu.reserved_mib) for gpu in gpus}
            calls.append(agent.actor.sample.remote(loads))
        out: list[GpuSample] = []
        for ref in calls:
            try:
                out.extend(ray.get(ref, timeout=10.0))
            except Exception as exc:  # a node going away: its loss is reported apart
                _log.debug("a node's GPU sample failed: %s", exc)
        return out


class RayGpus:
    """The engine's GPU backend on a cluster: the daemon's own node has none
    of ours (a GPU machine joins as a Ray node)."""

    def __init__(self, executor: RayExecutor, node: str, address: str) -> None:
        self.executor = executor
        self.node = node
        self.name = f"ray:{address}"

    def discover(self) -> list[GpuInfo]:
        return []

    def sample(self, job_pids: Collection[int] = ()) -> list[GpuSample]:
        return self.executor.sample_all()

    def set_load(self, gpu: int, share: float, reserved_mib: int) -> None:
        pass

    def close(self) -> None:
        pass
