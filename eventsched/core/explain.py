"""Why a job waits, in the user's terms (SPEC N1): a pure function of the state.

``waiting_reason(state, job_id, now)`` answers for a queued or held job with
one of the reasons Slurm users know from ``squeue``'s REASON column, made
specific: ``held``, ``dependency``, ``backoff``, ``queue limit``,
``resources`` (what it needs against what is free, and which GPUs are out of
play and why) or ``priority`` (it would fit, but jobs ahead of it go first).
The daemon answers ``explain`` and fills the ``reason`` column of ``queue``
with it; nothing here changes the state.
"""

from __future__ import annotations

from typing import Any

import msgspec

from eventsched.core.policies import View, best_fit
from eventsched.domain.states import WAITING, JobState
from eventsched.projections.cluster import FULL, ClusterState, Gpu, Job, usable

__all__ = ["Reason", "waiting_reason", "waiting_reasons", "unusable_reason", "REASON_KINDS"]

REASON_KINDS = ("held", "dependency", "backoff", "queue limit", "resources", "priority", "scheduling")


class Reason(msgspec.Struct, frozen=True, kw_only=True):
    kind: str  # one of REASON_KINDS
    text: str  # one line for a person
    ahead: int = 0  # waiting jobs the policy considers before this one
    first_ahead: int | None = None
    waits_for: list[int] = []  # dependency: the jobs not yet succeeded
    blocked_gpus: dict[str, str] = {}  # "node:gpu" -> why it takes nothing new


def _gpu_label(gpu: Gpu, single_node: bool) -> str:
    return f"GPU {gpu.id}" if single_node else f"GPU {gpu.node}:{gpu.id}"


def unusable_reason(gpu: Gpu, state: ClusterState) -> str | None:
    """Why ``gpu`` takes no new job (None when it may)."""
    cfg = state.config
    if gpu.lost:
        return f"is lost ({gpu.error})" if gpu.error else "is lost"
    if gpu.paused:
        return "is paused"
    if usable(gpu, cfg):
        return None
    if gpu.temperature_c is not None and gpu.temperature_c > cfg.max_gpu_temperature_c:
        return f"is over its temperature threshold ({gpu.temperature_c:.0f} C > {cfg.max_gpu_temperature_c:g} C)"
    if gpu.utilization is not None and gpu.utilization > cfg.max_gpu_utilization_pct:
        return f"is over its utilisation threshold ({gpu.utilization:.0f}% > {cfg.max_gpu_utilization_pct:g}%)"
    return f"is over its memory threshold ({cfg.max_gpu_memory_used_pct:g}% used)"


def _ahead_of(state: ClusterState, now: float, wanted: set[int]) -> dict[int, tuple[int, int | None]]:
    """For each job in ``wanted``: how many eligible waiting jobs the policy
    considers before it, and the first of them. One walk of the queue."""
    if state.policy == "fifo":
        order = (jid for _, jid in state.queue.by_order)
    else:  # every other policy scans in priority order first
        order = (jid for _, _, jid in state.queue.by_priority)
    jobs = state.jobs
    out: dict[int, tuple[int, int | None]] = {}
    count, first = 0, None
    for jid in order:
        if jid in wanted:
            out[jid] = (count, first)
            if len(out) == len(wanted):
                break
        if _eligible(state, jobs[jid], now):
            count += 1
            first = jid if first is None else first
    return out


def _eligible(state: ClusterState, job: Job, now: float) -> bool:
    return job.not_before <= now and all(
        (d := state.jobs.get(dep)) is not None and d.state == JobState.SUCCEEDED for dep in job.spec.after
    )


def _request_text(job: Job) -> str:
    spec = job.spec
    if job.count == 0:
        return "no GPU"
    if job.milli < FULL:
        need = f"{job.milli / FULL:g} of a GPU"
    else:
        need = f"{job.count} whole GPU{'s' if job.count > 1 else ''}"
    if spec.gpu_mem_mib:
        need += f" with {spec.gpu_mem_mib} MiB free on each"
    if spec.gpu_ids is not None:
        need += f" among GPUs {','.join(map(str, spec.gpu_ids))}"
    if spec.node:
        need += f" on node {spec.node}"
    return need


def _free_text(state: ClusterState, job: Job, view: View) -> str:
    """What is free now, among the GPUs this job may use."""
    spec = job.spec
    allowed = [i for i in range(len(view.free))
               if (spec.gpu_ids is None or view.id[i] in spec.gpu_ids) and (not spec.node or view.node[i] == spec.node)]
    if not allowed:
        return "none of the GPUs it may use takes new jobs"
    if job.milli < FULL:
        best = max(view.free[i] for i in allowed)
        text = f"the largest free share is {best / FULL:g}"
    else:
        per_node: dict[str, int] = {}
        for i in allowed:
            if view.free[i] == FULL and (not spec.gpu_mem_mib or view.mem[i] >= spec.gpu_mem_mib):
                per_node[view.node[i]] = per_node.get(view.node[i], 0) + 1
        most = max(per_node.values(), default=0)
        text = f"the largest free set is {most} whole GPU{'s' if most != 1 else ''}"
    if spec.gpu_mem_mib:
        text += f", the most free memory {max(view.mem[i] for i in allowed)} MiB"
    return text


def waiting_reason(state: ClusterState, job_id: int, now: float) -> Reason | None:
    """Why job ``job_id`` is not running now; None unless it is queued or held."""
    return waiting_reasons(state, now, [job_id]).get(job_id)


def waiting_reasons(state: ClusterState, now: float, job_ids: list[int] | None = None) -> dict[int, Reason]:
    """``waiting_reason`` of many jobs at once (default: every waiting job),
    in one walk of the queue: what ``queue``'s REASON column needs."""
    if job_ids is None:
        job_ids = [j.id for j in state.jobs.values() if j.state in WAITING]
    waiting = [state.jobs[j] for j in job_ids if j in state.jobs and state.jobs[j].state in WAITING]
    if not waiting:
        return {}
    ahead = _ahead_of(state, now, {j.id for j in waiting if j.state == JobState.QUEUED})
    blocked = {f"{g.node}:{g.id}": why for g in state.gpu_list if (why := unusable_reason(g, state)) is not None}
    view = View(state)
    fits: dict[Any, bool] = {}  # by shape: equal shapes fit or fail together
    out: dict[int, Reason] = {}
    for job in waiting:
        shape = job.shape
        if shape not in fits:
            fits[shape] = job.count == 0 or best_fit(view, job) is not None
        out[job.id] = _reason(state, job, now, ahead.get(job.id, (0, None)), fits[shape], blocked, view)
    return out


def _reason(state: ClusterState, job: Job, now: float, ahead: tuple[int, int | None], fits: bool,
            blocked: dict[str, str], view: View) -> Reason:
    if job.state == JobState.HELD:
        return Reason(kind="held", text=f"held: `eventsched release {job.id}` lets it run")
    waits = [dep for dep in job.spec.after if (d := state.jobs.get(dep)) is None or d.state != JobState.SUCCEEDED]
    if waits:
        states = ", ".join(f"job {dep} ({state.jobs[dep].state if dep in state.jobs else 'unknown'})" for dep in waits)
        return Reason(kind="dependency", text=f"dependency: waits for {states} to succeed", waits_for=waits)
    if job.not_before > now:
        return Reason(kind="backoff",
                      text=f"backoff: retry {job.retries_used} of {job.spec.retries} may start in {job.not_before - now:.0f}s")
    limit = state.config.max_running
    if limit > 0 and len(state.running) >= limit:
        return Reason(kind="queue limit", text=f"queue limit: {len(state.running)} job{'s' if len(state.running) != 1 else ''} running, "
                      f"max_running = {limit}")
    n, first = ahead
    jobs_ahead = f"{n} job{'s' if n != 1 else ''} ahead of it"
    if not fits:
        single = len(state.node_gpus) <= 1
        parts = [f"resources: needs {_request_text(job)}; {_free_text(state, job, view)}"]
        for g in state.gpu_list:
            why = blocked.get(f"{g.node}:{g.id}")
            if why and (job.spec.gpu_ids is None or g.id in job.spec.gpu_ids):
                parts.append(f"{_gpu_label(g, single)} {why}")
        if n:
            parts.append(jobs_ahead)
        return Reason(kind="resources", text="; ".join(parts), ahead=n, first_ahead=first, blocked_gpus=blocked)
    if first is not None:
        head = state.jobs[first]
        return Reason(
            kind="priority",
            text=(f"priority: {jobs_ahead} under {state.policy} (first: job {head.id}, priority "
                  f"{head.spec.priority}, {head.spec.user or 'uid ' + str(head.spec.uid)})"),
            ahead=n, first_ahead=first, blocked_gpus=blocked,
        )
    return Reason(kind="scheduling", text="scheduling: it fits now and is placed at the next decision",
                  blocked_gpus=blocked)
