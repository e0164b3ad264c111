"""The per-shape scan makes exactly the decisions of a walk of the whole queue.

``_reference_*`` below is the scan as it was before: walk the whole queue in
priority (or submission) order, try every shape once, drop a shape that fails.
Every policy runs once as it is now and once with the reference scan patched
in (sjf-backfill: against its old body, kept below), on the same state, and
the placements must be equal:

- on every state of random command sequences (``CoreMachine``'s rules: pins,
  memory, gangs, dependencies, back-off, pauses, samples, restarts, max_running),
- on every state of a seeded run with a backlog of hundreds of jobs in dozens
  of shapes on two nodes, where the no-fit memo lives across many decisions.

Calling the new scan first and the reference second on each state also checks
that the no-fit memo carried on the state's capacity never hides a fitting shape.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant
from test_core_properties import CoreMachine

from eventsched import core
from eventsched.core import policies
from eventsched.core.policies import POLICIES, Chooser, Placement, View
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.projections.cluster import (
    ClusterState,
    Job,
    runtime_key,
    validate_state,
)
from eventsched.projections.model import time_limit_of

# --- the old scan, verbatim but for names --------------------------------------


def _reference_fitting_shapes(state: ClusterState, view: View, choose: Chooser) -> set[tuple[Any, ...]]:
    jobs, q = state.jobs, state.queue
    return {shape for shape, members in q.by_shape.items() if choose(view, jobs[next(iter(members))], frozenset()) is not None}


def _reference_scan(
    state: ClusterState, now: float, order: Iterable[int], choose: Chooser, blocking: bool = False
) -> list[Placement]:
    room = policies._room(state)
    if room is None:
        return []
    view, slots, smallest = room
    live = _reference_fitting_shapes(state, view, choose)
    if not live:
        return []
    jobs = state.jobs
    shape_of = state.queue.shape_of
    out: list[Placement] = []
    for jid in order:
        shape = shape_of[jid]
        if shape not in live and not blocking:
            continue
        job = jobs[jid]
        if not policies._eligible(state, job, now):
            continue
        idxs = choose(view, job, frozenset()) if shape in live else None
        if idxs is None:
            if blocking:
                break
            live.discard(shape)
            if not live:
                break
            continue
        view.take(idxs, job.milli, job.spec.gpu_mem_mib)
        out.append(view.placement(job, idxs))
        slots -= 1
        if slots == 0 or (smallest > 0 and view.max_free() < smallest):
            break
    return out


def _reference_sjf_backfill(state: ClusterState, now: float) -> list[Placement]:
    """Priority first, then shortest predicted runtime (mean of the same user's
    runs of the same job, else the median of all runs: never the true future).

    The first job that does not fit gets a reservation: the time and GPUs at
    which it would fit as running jobs end (by prediction). Later jobs may
    start now only if they end before that time or stay off those GPUs.
    """
    room = policies._room(state)
    if room is None:
        return []
    view, slots, smallest = room
    jobs = state.jobs
    pred_cache: dict[tuple[str, str], float] = {}

    def pred(job: Job) -> float:
        key = runtime_key(job.spec)
        p = pred_cache.get(key)
        if p is None:
            p = pred_cache[key] = state.stats.predict(key, policies.DEFAULT_RUNTIME_S)
        limit = time_limit_of(job, state.config.default_time_limit_s)
        return min(p, limit) if limit is not None else p

    live = _reference_fitting_shapes(state, view, policies.best_fit)
    if not live:
        return []
    shape_of = state.queue.shape_of
    # what will free capacity, and when: this decision's own placements here,
    # running jobs added only if a reservation is needed
    ends: list[tuple[float, int, list[int], int, int]] = []

    def running_ends() -> list[tuple[float, int, list[int], int, int]]:
        # the hot loop of a reservation: pred() inlined
        out_ = []
        index, default, predict = view.index, state.config.default_time_limit_s, state.stats.predict
        for jid in state.running:
            r = jobs[jid]
            p = predict(runtime_key(r.spec), policies.DEFAULT_RUNTIME_S)
            limit = time_limit_of(r, default)
            if limit is not None:
                p = min(p, limit)
            node = r.node
            idxs = [index[(node, g)] for g in r.gpu_ids if (node, g) in index]
            start = r.started_at if r.started_at is not None else now
            out_.append((max(now, start + p), jid, idxs, r.milli, r.mem_mib))
        return out_

    out: list[Placement] = []
    # The head (the first job that cannot start now) gets a reservation; it is
    # worked out from the view and ends as they were then, but only once a
    # later job fits and might delay the head (often none does).
    head: tuple[View, Job, list[tuple[float, int, list[int], int, int]]] | None = None
    reservation: tuple[float, frozenset[int]] | None = None
    for jid in _reference_sjf_order(state):
        shape = shape_of[jid]
        if shape not in live and head is not None:
            continue
        job = jobs[jid]
        if not policies._eligible(state, job, now):
            continue
        if shape not in live:  # the head: it cannot start now
            head = (view.copy(), job, list(ends))
            continue
        idxs = policies.best_fit(view, job, frozenset())
        if idxs is None:
            live.discard(shape)
            if head is None:
                head = (view.copy(), job, list(ends))
            if not live:
                break
            continue
        if head is not None:
            if reservation is None:
                at_view, head_job, head_ends = head
                reservation = policies._reservation(at_view, head_job, running_ends() + head_ends)
            shadow, reserved = reservation
            if set(idxs) & reserved and now + pred(job) > shadow:
                idxs = policies.best_fit(view, job, reserved)
                if idxs is None:
                    continue
        view.take(idxs, job.milli, job.spec.gpu_mem_mib)
        out.append(view.placement(job, idxs))
        ends.append((now + pred(job), job.id, idxs, job.milli, job.spec.gpu_mem_mib))
        slots -= 1
        if slots == 0 or (smallest > 0 and view.max_free() < smallest):
            break
    return out


def _reference_sjf_order(state: ClusterState) -> Iterator[int]:
    """Queued job ids by (-priority, predicted runtime, order), merged lazily.

    Jobs without history all share the global median, so they stream straight
    from the priority index; each key with history is one more sorted stream.
    Nothing is re-sorted, and the merge stops when the scan does.
    """
    q, stats = state.queue, state.stats
    med = stats.median()
    median = policies.DEFAULT_RUNTIME_S if med is None else med
    history = stats.by_key
    by_rkey = _by_rkey(state)
    keys = [k for k in by_rkey if k in history] if len(by_rkey) <= len(history) else [
        k for k in history if k in by_rkey
    ]
    rkey_of = q.rkey_of
    streams: list[Iterator[tuple[int, float, int, int]]] = [
        ((np_, median, o, j) for np_, o, j in q.by_priority if rkey_of[j] not in history)
    ]
    for k in sorted(keys):
        streams.append(_reference_stream(by_rkey[k], stats.predict(k)))
    return (j for _, _, _, j in heapq.merge(*streams))


def _reference_stream(entries: list[tuple[int, int, int]], pred: float) -> Iterator[tuple[int, float, int, int]]:
    # a function, not an inline generator, so each stream keeps its own pred
    return ((np_, pred, o, j) for np_, o, j in entries)


def _by_rkey(state: ClusterState) -> dict[tuple[str, str], list[tuple[int, int, int]]]:
    """The index the old order read: runtime key -> (-priority, order, id), sorted."""
    out: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    for entry in state.queue.by_priority:
        out.setdefault(state.queue.rkey_of[entry[2]], []).append(entry)
    return out


def _by_priority(state: ClusterState) -> Iterator[int]:
    for _, _, jid in state.queue.by_priority:
        yield jid


def _by_order(state: ClusterState) -> Iterator[int]:
    for _, jid in state.queue.by_order:
        yield jid


@contextmanager
def _reference() -> Iterator[None]:
    """fifo, priority, best-fit and fgd on the old scan (no per-shape merge, no memo)."""
    saved = policies._scan, policies._scan_blocking
    policies._scan = lambda state, now, choose, fair_share=False: _reference_scan(  # type: ignore[assignment]
        state, now, _by_priority(state), choose)
    policies._scan_blocking = lambda state, now, order, choose: _reference_scan(  # type: ignore[assignment]
        state, now, _by_order(state), choose, blocking=True)
    try:
        yield
    finally:
        policies._scan, policies._scan_blocking = saved


def assert_same_decisions(state: ClusterState, now: float) -> int:
    """Every policy decides alike on the new and the reference scan; returns the placements seen.

    The reference knows no gang reservations (tests/test_teams.py covers
    them), so both run without; with one tenant, fair share orders as
    best-fit does."""
    seen = 0
    saved = state.config
    state.config = msgspec.structs.replace(saved, reserve_for_gang=False)
    try:
        seen = _same_decisions(state, now)
    finally:
        state.config = saved
    return seen


def _same_decisions(state: ClusterState, now: float) -> int:
    seen = 0
    for name, policy in POLICIES.items():
        new = policy(state, now)
        if name == "sjf-backfill":
            old = _reference_sjf_backfill(state, now)
        else:
            with _reference():
                old = policy(state, now)
        assert new == old, f"{name}: {new} != {old}"
        seen += len(new)
    return seen


# --- random command sequences --------------------------------------------------


class DifferentialMachine(CoreMachine):
    @invariant()
    def same_decisions(self) -> None:
        # the core has just decided on this state (and applied it): decide again
        # at a later time too, so that back-off and held capacity differ
        assert_same_decisions(self.state, self.now)
        assert_same_decisions(self.state, self.now + 30.0)


DifferentialMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestDifferential = DifferentialMachine.TestCase


# --- a seeded backlog --------------------------------------------------------------


def _backlog_run(seed: int, policy: str, steps: int) -> tuple[int, int]:
    """Submissions outpace exits on 2 nodes x 8 GPUs; compare every policy after each step."""
    rng = random.Random(seed)
    state, now = ClusterState(), 1000.0
    for node in ("a", "b"):
        infos = [m.GpuInfo(gpu=i, uuid=f"{node}{i}", model="fake", memory_total_mib=40_000) for i in range(8)]
        core.handle(state, m.Started(node=node, pid=1, version="t", gpu_backend="fake", gpus=infos,
                                     config=m.SchedulerConfig(node=node, policy=policy, retry_backoff_s=5.0)), now)
    states = placements = 0
    for _ in range(steps):
        now += rng.choice([0.0, 1.0, 7.0])
        if state.running and rng.random() < 0.25:
            jid = rng.choice(sorted(state.running))
            core.handle(state, m.ProcessExited(job=jid, exit_code=rng.choice([0, 0, 0, 1])), now)
        elif rng.random() < 0.05:
            core.handle(state, m.GpuObserved(node=rng.choice("ab"), gpu=rng.randrange(8), utilization=10.0,
                                             memory_used_mib=rng.choice([0, 20_000, 39_000]), memory_total_mib=40_000,
                                             temperature_c=40.0, power_w=1.0, foreign_memory_mib=-1), now)
        else:
            ids = sorted(state.jobs)
            spec = ev.JobSpec(
                command=["j"], user=f"u{rng.randrange(4)}", name=f"n{rng.randrange(5)}",
                gpus=rng.choice([0.25, 0.5, 0.5, 1.0, 1.0, 2.0, 4.0, 8.0, 0.0]),
                gpu_mem_mib=rng.choice([0, 0, 5000, 20_000, 35_000]),
                gpu_ids=rng.choice([None, None, None, [0, 1], [5]]),
                node=rng.choice(["", "", "", "a", "b"]),
                priority=rng.randrange(3), retries=rng.choice([0, 1]),
                after=[rng.choice(ids)] if ids and rng.random() < 0.1 else [],
            )
            try:
                core.handle(state, m.Submit(spec=spec), now)
            except m.Refused:  # asks for more than the machine has
                pass
        placements += assert_same_decisions(state, now)
        states += 1
    validate_state(state)
    assert len(state.queue) > 100, "the run should build a backlog"
    return states, placements


def test_backlog_decisions_match_the_reference() -> None:
    states = placements = 0
    for seed, policy in enumerate(sorted(POLICIES)):
        s, p = _backlog_run(seed, policy, 600)
        states, placements = states + s, placements + p
    assert states == 600 * len(POLICIES)
    assert placements > 0, "the comparisons should include non-empty decisions"

