"""Why a job waits, in the user's terms: a pure function of the state.

The reasons are those Slurm users know from ``squeue``'s REASON column, made
specific; ``explain`` and ``queue``'s REASON column answer with them.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec

from eventsched.core.budgets import budget_text
from eventsched.core import reservations
from eventsched.core.policies import Limits, View, _eligible, _fitting_shapes, _Reservation, best_fit, fair_shares
from eventsched.domain.states import WAITING, JobState
from eventsched.projections.cluster import FULL, ClusterState, Gpu, Job, usable

__all__ = ["Reason", "waiting_reason", "waiting_reasons", "unusable_reason", "REASON_KINDS"]

REASON_KINDS = ("held", "dependency", "begin", "backoff", "queue limit", "quota", "budget", "array limit", "resources",
                "reserved", "priority", "scheduling")


class Reason(msgspec.Struct, frozen=True, kw_only=True):
    kind: str  # one of REASON_KINDS
    text: str  # one line for a person
    ahead: int = 0  # waiting jobs the policy considers before this one
    first_ahead: int | None = None
    waits_for: list[int] = []  # dependency: the jobs not yet succeeded
    blocked_gpus: dict[str, str] = {}  # "node:gpu" -> why it takes nothing new
    score: dict[str, float] = {}  # the multifactor score's parts: priority, age, fair_share, total


def unusable_reason(gpu: Gpu, state: ClusterState) -> str | None:
    """Why ``gpu`` takes no new job (None when it may)."""
    cfg = state.config
    if gpu.lost:
        return f"is lost ({gpu.error})" if gpu.error else "is lost"
    if gpu.paused:
        return f"is drained ({gpu.paused_reason})" if gpu.paused_reason else "is paused"
    if usable(gpu, cfg):
        return None
    if gpu.temperature_c is not None and gpu.temperature_c > cfg.max_gpu_temperature_c:
        return f"is over its temperature threshold ({gpu.temperature_c:.0f} C > {cfg.max_gpu_temperature_c:g} C)"
    if gpu.utilization is not None and gpu.utilization > cfg.max_gpu_utilization_pct:
        return f"is over its utilisation threshold ({gpu.utilization:.0f}% > {cfg.max_gpu_utilization_pct:g}%)"
    return f"is over its memory threshold ({cfg.max_gpu_memory_used_pct:g}% used)"


def _ahead_of(state: ClusterState, now: float, wanted: set[int]) -> dict[int, tuple[int, int | None]]:
    """For each job in ``wanted``: how many eligible waiting jobs the policy considers
    before it, and the first of them; by rank in the sorted queue for a few jobs,
    so the cost grows with the page, and by one walk of the queue for many."""
    fifo, queue, jobs = state.policy == "fifo", state.queue, state.jobs
    order = queue.by_order if fifo else queue.by_priority  # every policy but fifo scans in priority order first

    def key(job: Job) -> tuple[Any, ...]:
        return (job.order, job.id) if fifo else queue.key(job)

    # a rank costs about as much as looking at a few jobs of a walk
    if len(wanted) * 4 > len(order):
        return _ahead_by_walk(state, now, wanted, ((k[-1]) for k in order))
    maybe = set(state.backoff) | set(state.queued_with_deps)
    blocked = sorted(key(jobs[j]) for j in maybe if not _eligible(state, jobs[j], now))
    skip = set(blocked)
    first = next((k for k in order if k not in skip), None)
    out: dict[int, tuple[int, int | None]] = {}
    for jid in wanted:
        k = key(jobs[jid])
        count = order.rank(k) - bisect.bisect_left(blocked, k)
        out[jid] = (count, first[-1] if count and first is not None else None)
    return out


def _ahead_by_walk(state: ClusterState, now: float, wanted: set[int],
                   order: Iterator[int]) -> dict[int, tuple[int, int | None]]:
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


def _request_text(job: Job) -> str:
    spec = job.spec
    if job.count == 0:
        return "no GPU"
    need = f"{job.milli / FULL:g} of a GPU" if job.milli < FULL else f"{job.count} whole GPU{'s' if job.count > 1 else ''}"
    if spec.gpu_mem_mib:
        need += f" with {spec.gpu_mem_mib} MiB free on each"
    if spec.gpu_ids is not None:
        need += f" among GPUs {','.join(map(str, spec.gpu_ids))}"
    if spec.node:
        need += f" on node {spec.node}"
    return need


def _free_text(state: ClusterState, job: Job, view: View) -> str:
    spec = job.spec
    allowed = [i for i in range(len(view.free))
               if (spec.gpu_ids is None or view.id[i] in spec.gpu_ids) and (not spec.node or view.node[i] == spec.node)]
    if not allowed:
        return "none of the GPUs it may use takes new jobs"
    if job.milli < FULL:
        text = f"the largest free share is {max(view.free[i] for i in allowed) / FULL:g}"
    else:
        most = max(Counter(view.node[i] for i in allowed if view.free[i] == FULL
                           and (not spec.gpu_mem_mib or view.mem[i] >= spec.gpu_mem_mib)).values(), default=0)
        text = f"the largest free set is {most} whole GPU{'s' if most != 1 else ''}"
    if spec.gpu_mem_mib:
        text += f", the most free memory {max(view.mem[i] for i in allowed)} MiB"
    return text


def _forming_text(state: ClusterState, job: Job) -> str:
    """For a job larger than every node up now: which node it waits for; else ""."""
    spec = job.spec
    most, _, _ = state.fit(spec.node, spec.gpu_mem_mib)
    if spec.gpu_ids is not None or most >= job.count:
        return ""
    wanted = (f"resources: waiting for {f'node {spec.node}' if spec.node else 'a node'} with {job.count} "
              f"GPU{'s' if job.count != 1 else ''}" + (f" of {spec.gpu_mem_mib} MiB" if spec.gpu_mem_mib else ""))
    if not state.nodes:
        return f"{wanted}; no node has joined yet"
    down = sorted(name for name, info in state.nodes.items() if info.state != "up")
    return (f"{wanted}; the largest node up has {most}"
            + (f" ({', '.join(down)} down)" if down else ""))


def waiting_reason(state: ClusterState, job_id: int, now: float) -> Reason | None:
    """Why job ``job_id`` is not running now; None unless it is queued or held."""
    return waiting_reasons(state, now, [job_id]).get(job_id)


def waiting_reasons(state: ClusterState, now: float, job_ids: list[int] | None = None) -> dict[int, Reason]:
    """``waiting_reason`` of many jobs (default: every waiting one)."""
    if job_ids is None:
        job_ids = [j.id for j in state.jobs.values() if j.state in WAITING]
    waiting = [state.jobs[j] for j in job_ids if j in state.jobs and state.jobs[j].state in WAITING]
    if not waiting:
        return {}
    ahead = _ahead_of(state, now, {j.id for j in waiting if j.state == JobState.QUEUED})
    blocked = {f"{g.node}:{g.id}": why for g in state.gpu_list if (why := unusable_reason(g, state)) is not None}
    view = View.of(state)
    fits: dict[Any, bool] = {}  # by shape: equal shapes fit or fail together
    ctx = _Context(state, now, view)
    out: dict[int, Reason] = {}
    for job in waiting:
        shape = job.shape
        if shape not in fits:
            fits[shape] = job.count == 0 or best_fit(view, job) is not None
        out[job.id] = _reason(state, job, now, ahead.get(job.id, (0, None)), fits[shape], blocked, view, ctx)
    return out


class _Context:
    """What every waiting job's reason may need, worked out once."""

    def __init__(self, state: ClusterState, now: float, view: View) -> None:
        self.state, self.now = state, now
        self.limits = Limits(state, now)
        self.shares = fair_shares(state, now)
        self.reservation: _Reservation | None = None
        if state.config.reserve_for_gang and state.policy in ("priority", "best-fit", "fair-share", "fgd"):
            live = _fitting_shapes(state, view.copy())
            self.reservation = _Reservation.for_head(state, now, view.copy(), live, {}, self.limits)

    def score(self, job: Job) -> dict[str, float]:
        cfg = self.state.config
        age = cfg.aging_per_hour * max(0.0, self.now - job.queued_at) / 3600.0
        fair = 0.0
        if self.state.policy == "fair-share":
            fair = cfg.fair_share_weight * self.shares.get(job.tenant, (0.0, 0.0, 1.0))[2]
        return {"priority": float(job.spec.priority), "age": round(age, 4), "fair_share": round(fair, 4),
                "total": round(job.spec.priority + age + fair, 4)}

    def score_text(self, job: Job) -> str:
        s = self.score(job)
        if self.state.policy == "fifo" or (s["age"] < 0.01 and self.state.policy != "fair-share"):
            return ""
        text = f"; score {s['total']:g} = priority {s['priority']:g} + age {s['age']:g}"
        if self.state.policy == "fair-share":
            share, used, factor = self.shares.get(job.tenant, (0.0, 0.0, 1.0))
            text += (f" + fair share {s['fair_share']:g} (tenant {job.tenant}: share {share:.0%}, "
                     f"recent use {used:.0%}, factor {factor:.2f})")
        return text

    def quota_text(self, job: Job) -> str:
        state = self.state
        if job.spec.array_cap and self.limits.blocked(job) == "array-cap":
            n = state.array_running.get(job.spec.array_id, 0)
            return f"array limit: {n} of array {job.spec.array_id}'s tasks running, at most {job.spec.array_cap} (%{job.spec.array_cap})"
        tenant = state.tenants[job.tenant]
        usage = state.usage.get(job.tenant)
        milli, mem, jobs = usage.held() if usage is not None else (0, 0, 0)
        if tenant.jobs is not None and jobs >= tenant.jobs:
            what = f"{jobs} of its {tenant.jobs} jobs running (quota jobs = {tenant.jobs})"
        elif tenant.gpus is not None and milli + job.count * job.milli > round(tenant.gpus * FULL):
            what = f"{milli / FULL:g} of its {tenant.gpus:g} GPUs in use (quota gpus = {tenant.gpus:g})"
        else:
            what = f"{mem} of its {tenant.gpu_mem_mib} MiB of GPU memory in use (quota gpu_mem_mib = {tenant.gpu_mem_mib})"
        return f"quota: tenant {job.tenant} has {what}; this job needs {_request_text(job)}"


def _reason(state: ClusterState, job: Job, now: float, ahead: tuple[int, int | None], fits: bool,
            blocked: dict[str, str], view: View, ctx: _Context) -> Reason:
    if job.state == JobState.HELD:
        return Reason(kind="held", text=f"held: `eventsched release {job.id}` lets it run")
    waits = [dep for dep in job.spec.after if (d := state.jobs.get(dep)) is None or d.state != JobState.SUCCEEDED]
    if waits:
        states = ", ".join(f"job {dep} ({state.jobs[dep].state if dep in state.jobs else 'unknown'})" for dep in waits)
        return Reason(kind="dependency", text=f"dependency: waits for {states} to succeed", waits_for=waits)
    if job.spec.begin > now:  # --begin
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.spec.begin))
        return Reason(kind="begin", text=f"begin: waits for its begin time {at} (in {job.spec.begin - now:.0f}s)")
    if job.not_before > now:
        return Reason(kind="backoff",
                      text=f"backoff: retry {job.retries_used} of {job.spec.retries} may start in {job.not_before - now:.0f}s")
    limit = state.config.max_running
    if limit > 0 and len(state.running) >= limit:
        return Reason(kind="queue limit", text=f"queue limit: {len(state.running)} job{'s' if len(state.running) != 1 else ''} running, "
                      f"max_running = {limit}")
    held_back = ctx.limits.blocked(job)
    if held_back == "budget":
        return Reason(kind="budget", text=budget_text(state, job.tenant, now), score=ctx.score(job))
    if held_back is not None:
        return Reason(kind="quota" if held_back == "quota" else "array limit", text=ctx.quota_text(job),
                      score=ctx.score(job))
    n, first = ahead
    jobs_ahead, res = f"{n} job{'s' if n != 1 else ''} ahead of it", ctx.reservation
    if fits and res is not None and res.head.id != job.id:
        idxs = best_fit(view, job)
        if idxs is not None and res.collides(idxs, job) and best_fit(view, job, res.gpus) is None:
            gpus = ",".join(str(view.id[i]) for i in sorted(res.gpus))
            when = "when the jobs there end" if res.shadow == float("inf") else f"in about {max(0, res.shadow - now):.0f}s (predicted)"
            return Reason(kind="reserved", score=ctx.score(job), first_ahead=res.head.id, text=(
                f"reserved: GPUs {gpus} are held for job {res.head.id} ({res.head.count} GPUs, first in line), "
                f"free {when}; this job fits only there and is not predicted to end before that"))
    hold = reservations.holds(state, view.index, now) if fits else None
    kept_off = hold is not None and best_fit(view, job, hold(job)) is None  # only booked GPUs would take it
    if kept_off and state.reservations and (booked := reservations.held_by(state, job, now)) is not None:
        return Reason(kind="reserved", score=ctx.score(job), text=f"{reservations.describe(booked, now)}"
                      + ("" if booked.start <= now else "; this job is not predicted to end before it begins"))
    if kept_off and state.making_room and job.id not in state.making_room:
        waiting = state.jobs[next(iter(state.making_room))]
        gpus = ",".join(str(g) for _, g in waiting.room)
        return Reason(kind="reserved", score=ctx.score(job), first_ahead=waiting.id, text=(
            f"reserved: GPUs {gpus} are being freed for job {waiting.id} (a preemption); this job fits only there"))
    if not fits:
        text = _forming_text(state, job) if state.cluster else ""
        if not text:
            single = len(state.node_gpus) <= 1
            parts = [f"resources: needs {_request_text(job)}; {_free_text(state, job, view)}"]
            for g in state.gpu_list:
                why = blocked.get(f"{g.node}:{g.id}")
                if why and (job.spec.gpu_ids is None or g.id in job.spec.gpu_ids):
                    parts.append(f"GPU {g.id} {why}" if single else f"GPU {g.node}:{g.id} {why}")
            text = "; ".join([*parts, jobs_ahead] if n else parts)
        return Reason(kind="resources", text=text, ahead=n, first_ahead=first, blocked_gpus=blocked,
                      score=ctx.score(job))
    if first is not None:
        head = state.jobs[first]
        return Reason(
            kind="priority",
            text=(f"priority: {jobs_ahead} under {state.policy} (first: job {head.id}, priority "
                  f"{head.spec.priority}, {head.spec.user or 'uid ' + str(head.spec.uid)}){ctx.score_text(job)}"),
            ahead=n, first_ahead=first, blocked_gpus=blocked, score=ctx.score(job),
        )
    return Reason(kind="scheduling", text="scheduling: it fits now and is placed at the next decision",
                  blocked_gpus=blocked)
