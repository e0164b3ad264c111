"""Declared GPU memory and idle allocations (docs/gpu-memory-and-idle.md): pure findings.

The core asks these after each ``GpuSampled``, on each tick and after each
scheduling round, and records what they find as decisions caused by that fact.
Reclaim is one at a time, so a waiting job never stops two idle jobs for one place.
"""

from __future__ import annotations

from eventsched.core.policies import Limits, _eligible
from eventsched.domain.units import FULL
from eventsched.projections.cluster import ClusterState, Gpu, Job, usable
from eventsched.projections.model import free_memory_of

__all__ = ["job_gpu_memory", "memory_findings", "idle_findings", "due_idle", "reclaim"]


def job_gpu_memory(state: ClusterState, job: Job) -> tuple[int, int]:
    """(the most memory ``job``'s processes hold on one of its GPUs, that GPU)."""
    most, where = 0, job.gpu_ids[0] if job.gpu_ids else -1
    for gid in job.gpu_ids:
        gpu = state.gpus.get((job.node, gid))
        if gpu is not None:
            used = gpu.job_memory_mib.get(job.id, 0)
            if used > most:
                most, where = used, gid
    return most, where


def memory_findings(state: ClusterState, gpu: Gpu) -> list[tuple[Job, bool, int, int]]:
    """(job, over now, MiB, on which GPU) of the jobs on ``gpu`` whose over/within state changed."""
    out = []
    for jid in gpu.jobs:
        job = state.jobs[jid]
        request = job.spec.gpu_mem_mib
        if request <= 0 or job.cancel_reason:
            continue
        used, where = job_gpu_memory(state, job)
        if (used > request) != job.gpu_mem_over:
            out.append((job, used > request, used, where))
    return out


def idle_findings(state: ClusterState, gpu: Gpu, now: float) -> list[tuple[Job, float]]:
    """The jobs on ``gpu`` that became idle (job, since) or busy again (job, -1)."""
    out = []
    for jid in gpu.jobs:
        job = state.jobs[jid]
        due = state.idle_due.get(jid)
        if due is not None and due <= now:
            out.append((job, due - state.config.idle_after_s))
        elif job.idle_since is not None and not job.cancel_reason and state.quiet_since(job) is None:
            out.append((job, -1.0))
    return out


def due_idle(state: ClusterState, now: float) -> list[tuple[int, float]]:
    """Running jobs whose quiet spell has lasted ``idle_after_s`` by ``now``: (job, since)."""
    after = state.config.idle_after_s
    return sorted((jid, due - after) for jid, due in state.idle_due.items() if due <= now)


def _room_for(state: ClusterState, idle: Job, waiting: Job) -> bool:
    spec = waiting.spec
    if waiting.count == 0 or (spec.node and spec.node != idle.node):
        return False
    mine = set(idle.gpu_ids)
    fits = 0
    for gpu in state.node_gpus.get(idle.node, ()):
        if not usable(gpu, state.config) or (spec.gpu_ids is not None and gpu.id not in spec.gpu_ids):
            continue
        free, mem = FULL - gpu.used_milli, free_memory_of(gpu)
        if gpu.id in mine:
            free += idle.milli
            mem += max(idle.mem_mib, gpu.job_memory_mib.get(idle.id, 0))
        if free >= waiting.milli and mem >= spec.gpu_mem_mib:
            fits += 1
            if fits >= waiting.count:
                return True
    return False


def reclaim(state: ClusterState, now: float) -> tuple[int, int] | None:
    """(idle job to stop, the waiting job it makes room for): the longest idle, for the first head that fits."""
    if state.config.idle_policy == "off" or not state.idle_jobs or not state.queue or state.reclaiming:
        return None
    heads = [e[2] for e in sorted(entries[0] for entries in state.queue.shape_queue.values() if entries)]
    limits = Limits(state, now)
    waiting = [state.jobs[j] for j in heads if _eligible(state, state.jobs[j], now) and limits.blocked(state.jobs[j]) is None]
    if not waiting:
        return None
    idle = sorted(state.idle_jobs, key=lambda j: (state.jobs[j].idle_since or 0.0, j))
    return next(((jid, w.id) for jid in idle for w in waiting if _room_for(state, state.jobs[jid], w)), None)
