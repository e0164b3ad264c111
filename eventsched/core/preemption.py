"""Preemption (F13): stop running jobs to start a more urgent waiting one.

Pure, like the policies: ``plan(state, now)`` names the waiting job, the
victims and the rule, or None; the core records the decision and signals.

The waiting job considered is the one at the head of the queue (the best
score among the first jobs of every shape) when it could not start. A
running job may be stopped for it when

- it was submitted ``--preemptible``, or its tenant is ``preemptible`` and
  over its fair share; and
- a rule says the waiting job is more urgent: ``priority`` (a higher tier
  than the victim's) or ``fair-share`` (the waiting job's tenant is under
  its share and the victim's is over its share).

Victims are the fewest, lowest-priority, most recently started jobs whose
room lets the waiting job start (never one that would still not fit); a job
preempted before is protected for ``preempt_protect_s`` after it restarts,
and nothing new is preempted while an earlier preemption is still stopping,
so preemption cannot loop.
"""

from __future__ import annotations

import msgspec

from eventsched.core.policies import (
    Limits,
    View,
    _eligible,
    _lane_key,
    _offsets,
    best_fit,
    fair_shares,
)
from eventsched.projections.cluster import ClusterState, Job

__all__ = ["Preemption", "plan"]


class Preemption(msgspec.Struct, frozen=True, kw_only=True):
    waiting: int  # the job it makes room for
    victims: list[int]
    rule: str  # "priority" or "fair-share"


def _head(state: ClusterState, now: float) -> Job | None:
    """The waiting job with the best score among the shapes' first jobs."""
    offsets = _offsets(state, now, state.config.fair_share_weight) if state.policy == "fair-share" else {}
    best = None
    for shape, entries in state.queue.shape_queue.items():
        key = _lane_key(entries[0], shape, offsets)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    job = state.jobs[best[2]]
    return job if _eligible(state, job, now) and Limits(state).blocked(job) is None else None


def plan(state: ClusterState, now: float) -> Preemption | None:
    jobs, cfg = state.jobs, state.config
    if state.being_preempted:
        return None  # one preemption at a time: let the last one finish first
    tenants = [name for name, tenant in state.tenants.items() if tenant.preemptible]
    if not state.running_preemptible and not tenants:
        return None  # the common case, asked after every event: answer it without copying
    ids = dict(state.running_preemptible)
    for name in tenants:
        ids.update(state.running_of_tenant.get(name, {}))
    maybe = [jobs[j] for j in ids if not jobs[j].cancel_reason]
    if not maybe:
        return None  # the common case: nothing may be preempted (kept by the projection)
    waiting = _head(state, now)
    if waiting is None or waiting.count == 0:
        return None
    shares = fair_shares(state, now)
    under = {t for t, (share, used, _) in shares.items() if used < share}
    over = {t for t, (share, used, _) in shares.items() if used > share}
    chosen: list[tuple[Job, str]] = []
    for r in maybe:
        if r.preemptions and r.started_at is not None and now < r.started_at + cfg.preempt_protect_s:
            continue  # preempted before: protected for a while after its restart
        if not r.spec.preemptible and r.tenant not in over:
            continue  # a preemptible tenant's jobs are fair game only while it is over its share
        if waiting.spec.priority > r.spec.priority:
            chosen.append((r, "priority"))
        elif waiting.tenant != r.tenant and waiting.tenant in under and r.tenant in over:
            chosen.append((r, "fair-share"))
    if not chosen:
        return None
    # fewest, lowest, most recently started first
    chosen.sort(key=lambda c: (c[0].spec.priority, -(c[0].started_at or 0.0), -c[0].id))
    view = View.of(state)
    taken: list[tuple[Job, str]] = []
    for victim, rule in chosen:
        _give_back(view, victim)
        taken.append((victim, rule))
        if best_fit(view, waiting) is not None:
            break
    else:
        return None  # even all of them would not make room: preempt nothing
    for victim, rule in list(reversed(taken))[1:]:  # drop any that were not needed after all
        trial = view.copy()
        _take_back(trial, victim)
        if best_fit(trial, waiting) is not None:
            view = trial
            taken.remove((victim, rule))
    rules = {rule for _, rule in taken}
    return Preemption(waiting=waiting.id, victims=sorted(v.id for v, _ in taken),
                      rule="priority" if "priority" in rules else "fair-share")


def _indices(view: View, job: Job) -> list[int]:
    return [view.index[(job.node, g)] for g in job.gpu_ids if (job.node, g) in view.index]


def _give_back(view: View, job: Job) -> None:
    view.give(_indices(view, job), job.milli, job.mem_mib)


def _take_back(view: View, job: Job) -> None:
    view.take(_indices(view, job), job.milli, job.mem_mib)
