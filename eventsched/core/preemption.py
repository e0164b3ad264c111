"""Preemption: stop running jobs to start a more urgent waiting one.

Pure, like the policies: ``plan(state, now)`` names the waiting job (the first
in the policy's order, when it cannot start), the victims and the rule, or
None; the core records the decision and signals. Who may be stopped, by which
rule (``priority`` or ``fair-share``), and why it cannot loop: docs/fair-share.md.
Victims are the fewest, lowest-priority, most recently started jobs whose room
lets the waiting job start.
"""

from __future__ import annotations

import msgspec

from eventsched.core.policies import (
    DEFAULT_RUNTIME_S,
    Limits,
    View,
    _eligible,
    _indices,
    _lane_key,
    _offsets,
    best_fit,
    fair_shares,
    oracle_keys,
)
from eventsched.projections.cluster import Capacity, ClusterState, Job

__all__ = ["Preemption", "plan"]


class Preemption(msgspec.Struct, frozen=True, kw_only=True):
    waiting: int  # the job it makes room for
    victims: list[int]
    rule: str  # "priority" or "fair-share"


def _head(state: ClusterState, now: float, offsets: dict[str, float]) -> Job | None:
    """The first waiting job in the policy's order, if it may start."""
    q, policy, best = state.queue, state.policy, None
    if state.config.aging_tiers and policy == "fifo":
        best = q.by_order[0][1]
    elif state.config.aging_tiers and policy == "sjf-backfill":
        predict = state.stats.predict
        best = min((g[0][0], predict(r, DEFAULT_RUNTIME_S), g[0][1], g[0][2]) for r, g in q.by_rkey.items())[3]
    elif state.config.aging_tiers and policy == "sjf-oracle":
        best = min(oracle_keys(state, now))[-1]
    else:
        best = min(_lane_key(entries[0], shape, offsets) for shape, entries in q.shape_queue.items())[2]
    job = state.jobs[best]
    return job if _eligible(state, job, now) and Limits(state, now).blocked(job) is None else None


def plan(state: ClusterState, now: float, placed: frozenset[int] = frozenset()) -> Preemption | None:
    jobs, cfg = state.jobs, state.config
    if state.being_preempted:
        return None  # one preemption at a time: let the last one finish first
    tenants = [name for name, tenant in state.tenants.items() if tenant.preemptible]
    if not state.running_preemptible and not tenants:
        return None  # the common case, asked after every event: answer it without copying
    ids = dict(state.running_preemptible)
    for name in tenants:
        ids.update(state.running_of_tenant.get(name, {}))
    tiers = cfg.aging_tiers
    maybe = [jobs[j] for j in ids if not jobs[j].cancel_reason and not (tiers and j in placed)]
    if not maybe or not state.queue:
        return None  # the common case: nothing may be preempted (kept by the projection)
    offsets = _offsets(state, now, cfg.fair_share_weight) if state.policy == "fair-share" else {}
    waiting = _head(state, now, offsets)
    if waiting is None or waiting.count == 0:
        return None
    q = state.queue
    key = q.key(waiting)
    # with tiers: its priority plus the tiers it waited, and its score as the policy orders
    urgency = q.aged(now) - key[0] if tiers else float(waiting.spec.priority)
    mine = key[0] - offsets.get(waiting.tenant, 0.0)
    shares = fair_shares(state, now)
    under = {t for t, (share, used, _) in shares.items() if used < share}
    over = {t for t, (share, used, _) in shares.items() if used > share}
    chosen: list[tuple[Job, str]] = []
    for r in maybe:
        if r.preemptions and r.started_at is not None and now < r.started_at + cfg.preempt_protect_s:
            continue  # preempted before: protected for a while after its restart
        if not r.spec.preemptible and r.tenant not in over:
            continue  # a preemptible tenant's jobs are fair game only while it is over its share
        if tiers and not (waiting.order < r.order if state.policy == "fifo" else
                          mine < q.aged(now) - r.spec.priority - offsets.get(r.tenant, 0.0)):
            continue  # queued again now, it would go first: the room would not reach the waiting job
        if urgency > r.spec.priority:
            chosen.append((r, "priority"))
        elif waiting.tenant != r.tenant and waiting.tenant in under and r.tenant in over:
            chosen.append((r, "fair-share"))
    if not chosen:
        return None
    # fewest, lowest, most recently started first
    chosen.sort(key=lambda c: (c[0].spec.priority, -(c[0].started_at or 0.0), -c[0].id))
    view = View.of(state)
    hot = {(r.node, g) for r, _ in chosen for g in r.gpu_ids} - view.index.keys()
    if hot:  # a candidate's GPU over a threshold: its heat is the victim's own and goes with it
        cooled = {k: state.gpus[k].copy() for k in hot if k in state.gpus}
        for g in cooled.values():
            g.temperature_c = None
        view = View(Capacity([cooled.get(g.key, g) for g in state.gpu_list], cfg), state.node)
    taken: list[tuple[Job, str]] = []
    for victim, rule in chosen:
        view.give(_indices(view.index, victim), victim.milli, victim.mem_mib)
        taken.append((victim, rule))
        if best_fit(view, waiting) is not None:
            break
    else:
        return None  # even all of them would not make room: preempt nothing
    for victim, rule in list(reversed(taken))[1:]:  # drop any that were not needed after all
        trial = view.copy()
        trial.take(_indices(view.index, victim), victim.milli, victim.mem_mib)
        if best_fit(trial, waiting) is not None:
            view = trial
            taken.remove((victim, rule))
    rules = {rule for _, rule in taken}
    return Preemption(waiting=waiting.id, victims=sorted(v.id for v, _ in taken),
                      rule="priority" if "priority" in rules else "fair-share")
