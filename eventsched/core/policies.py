"""Placement policies: pure ``decide(state, now) -> list[Placement]``, by name.

Every policy obeys the same placement rules (``View``): a GPU's share is never
over-committed (integer milli-GPU), a memory request must fit in what neither
reservations, our jobs' observed use nor foreign processes hold, pinned /
allowed GPU ids and nodes are honoured, paused / lost GPUs and GPUs over the
configured thresholds get nothing new, a multi-GPU job gets all its GPUs on one
node at once or waits (gang), and ``max_running`` is respected. Policies only
differ in the order they consider jobs and in which GPUs they pick.

Decisions are deterministic: GPUs are scanned in (node, id) order, jobs in
queue order, ties broken by the lower index; no sets are iterated, nothing is
random. The replay simulator relies on that.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import msgspec

from eventsched.core.fgd import fragmentation
from eventsched.domain.states import JobState
from eventsched.projections.cluster import FULL, ClusterState, Job, runtime_key, usable

# plain module names: an Enum class attribute costs a lookup on every use (hot paths)
SUCCEEDED = JobState.SUCCEEDED

__all__ = ["Placement", "Policy", "POLICIES", "DEFAULT_POLICY", "View", "usable"]

DEFAULT_POLICY = "best-fit"
DEFAULT_RUNTIME_S = 3600.0  # prediction when there is no history at all


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    job: int
    node: str
    gpu_ids: list[int]
    share: float  # of each GPU (1.0 for whole GPUs, 0.0 for CPU-only jobs)
    mem: int  # MiB reserved on each GPU


class Policy(Protocol):
    def __call__(self, state: ClusterState, now: float) -> list[Placement]: ...


class View:
    """Free capacity of the usable GPUs during one decision.

    Placements taken in the decision are subtracted here, so one decision
    never over-commits; the state itself changes only when the core applies
    the resulting JobPlaced events.
    """

    def __init__(self, state: ClusterState) -> None:
        cap = state.capacity  # kept up to date by the projection
        self.default_node = state.node
        # shared, never changed here
        self.node, self.id, self.index = cap.node, cap.id, cap.index
        self.nodes, self.node_idx = cap.nodes, cap.node_idx
        # copied: the decision subtracts its own placements
        self.free = list(cap.free)
        self.mem = list(cap.mem)

    def copy(self) -> View:
        other = object.__new__(View)
        other.__dict__.update(self.__dict__)
        other.free = list(self.free)
        other.mem = list(self.mem)
        return other

    def max_free(self) -> int:
        return max(self.free, default=0)

    def candidates(self, job: Job, exclude: frozenset[int] = frozenset()) -> list[int]:
        """GPU indices where one of the job's GPUs could go, in (node, id) order."""
        spec = job.spec
        need = job.milli
        out = [i for i, f in enumerate(self.free) if f >= need]  # the common test first, in one pass
        if spec.gpu_mem_mib:
            mem, memfree = spec.gpu_mem_mib, self.mem
            out = [i for i in out if memfree[i] >= mem]
        if exclude:
            out = [i for i in out if i not in exclude]
        if spec.gpu_ids is not None:
            allowed, ids = spec.gpu_ids, self.id
            out = [i for i in out if ids[i] in allowed]
        if spec.node:
            node, nodes = spec.node, self.node
            out = [i for i in out if nodes[i] == node]
        return out

    def can_take(self, job: Job, i: int) -> bool:
        """Is GPU index ``i`` one of ``candidates(job)``?"""
        spec = job.spec
        return (
            self.free[i] >= job.milli
            and (not spec.gpu_mem_mib or self.mem[i] >= spec.gpu_mem_mib)
            and (spec.gpu_ids is None or self.id[i] in spec.gpu_ids)
            and (not spec.node or self.node[i] == spec.node)
        )

    def take(self, idxs: list[int], milli: int, mem: int) -> None:
        for i in idxs:
            self.free[i] -= milli
            self.mem[i] -= mem

    def give(self, idxs: Iterable[int], milli: int, mem: int) -> None:
        for i in idxs:
            self.free[i] += milli
            self.mem[i] += mem

    def by_node(self, idxs: list[int]) -> dict[str, list[int]]:
        """``idxs`` grouped by node, nodes in order (one pass)."""
        out: dict[str, list[int]] = {}
        nodes = self.node
        for i in idxs:
            on = out.get(nodes[i])
            if on is None:
                out[nodes[i]] = [i]
            else:
                on.append(i)
        return out

    def placement(self, job: Job, idxs: list[int]) -> Placement:
        if not idxs:
            return Placement(job=job.id, node=job.spec.node or self.default_node, gpu_ids=[], share=0.0, mem=0)
        return Placement(
            job=job.id,
            node=self.node[idxs[0]],
            gpu_ids=[self.id[i] for i in idxs],
            share=job.milli / FULL,
            mem=job.spec.gpu_mem_mib,
        )


# A chooser picks GPU indices for a job on a view (None: it does not fit now).
Chooser = Callable[[View, Job, frozenset[int]], "list[int] | None"]


def _gang(view: View, cands: list[int], k: int, tightest: bool) -> list[int] | None:
    """k GPUs on one node: the first node that has them, or (tightest) the node
    with the fewest candidates that still has k, keeping big nodes whole."""
    best: list[int] | None = None
    for on in view.by_node(cands).values():
        if len(on) < k:
            continue
        if not tightest:
            return on[:k]
        if best is None or len(on) < len(best):
            best = on
    return None if best is None else best[:k]


def first_fit(view: View, job: Job, exclude: frozenset[int] = frozenset()) -> list[int] | None:
    if job.count == 0:
        return []
    cands = view.candidates(job, exclude)
    if job.count == 1:
        return cands[:1] or None
    return _gang(view, cands, job.count, tightest=False)


def best_fit(view: View, job: Job, exclude: frozenset[int] = frozenset()) -> list[int] | None:
    """Fractional jobs go where the least share remains after them (F5)."""
    if job.count == 0:
        return []
    cands = view.candidates(job, exclude)
    if not cands:
        return None
    if job.count == 1:
        if job.milli == FULL:
            return [cands[0]]
        free = view.free
        return [min(cands, key=lambda i: (free[i], i))]
    return _gang(view, cands, job.count, tightest=True)


def _eligible(state: ClusterState, job: Job, now: float) -> bool:
    if job.not_before > now:
        return False
    for dep in job.spec.after:
        d = state.jobs.get(dep)
        if d is None or d.state != SUCCEEDED:
            return False
    return True


def _slots(state: ClusterState) -> int:
    limit = state.config.max_running
    return limit - len(state.running) if limit > 0 else 1 << 62


def _fitting_shapes(state: ClusterState, view: View, choose: Chooser) -> set[tuple[Any, ...]]:
    """Shapes of queued jobs that would fit now (one trial per shape, not per job)."""
    jobs, q = state.jobs, state.queue
    return {shape for shape, members in q.by_shape.items() if choose(view, jobs[next(iter(members))], frozenset()) is not None}


def _room(state: ClusterState) -> tuple[View, int, int] | None:
    """Free capacity (view, job slots, smallest queued share), or None when
    no queued job can start: no slot left, or no GPU has the smallest share."""
    slots = _slots(state)
    if slots <= 0:
        return None
    view = View(state)
    smallest = state.queue.min_milli()
    if smallest > 0 and view.max_free() < smallest:
        return None
    return view, slots, smallest


def _scan(
    state: ClusterState,
    now: float,
    order: Iterable[int],
    choose: Chooser,
    blocking: bool = False,
) -> list[Placement]:
    """Place jobs in ``order`` while capacity lasts.

    Only shapes that fit at the start are tried, a shape that fails is dropped
    for the rest of the decision (capacity only shrinks within it), and the
    scan stops when no shape is left, so a long queue costs little.
    """
    room = _room(state)
    if room is None:
        return []
    view, slots, smallest = room
    live = _fitting_shapes(state, view, choose)
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
        if not _eligible(state, job, now):
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


def _by_priority(state: ClusterState) -> Iterator[int]:
    # Lazy and uncopied: a decision only reads the queue (the core applies
    # the placements after it), and most decisions stop after a few jobs.
    for _, _, jid in state.queue.by_priority:
        yield jid


def _by_order(state: ClusterState) -> Iterator[int]:
    for _, jid in state.queue.by_order:
        yield jid


def fifo(state: ClusterState, now: float) -> list[Placement]:
    """Submission order; the first job that does not fit blocks the rest."""
    return _scan(state, now, _by_order(state), first_fit, blocking=True)


def priority(state: ClusterState, now: float) -> list[Placement]:
    """Higher priority first, FIFO within; jobs that do not fit are skipped."""
    return _scan(state, now, _by_priority(state), first_fit)


def best_fit_policy(state: ClusterState, now: float) -> list[Placement]:
    """Priority order with best-fit packing of fractional jobs (the default)."""
    return _scan(state, now, _by_priority(state), best_fit)


# --- shortest (predicted) job first, with EASY backfill -------------------------


def sjf_backfill(state: ClusterState, now: float) -> list[Placement]:
    """Priority first, then shortest predicted runtime (mean of the same user's
    runs of the same job, else the median of all runs: never the true future).

    The first job that does not fit gets a reservation: the time and GPUs at
    which it would fit as running jobs end (by prediction). Later jobs may
    start now only if they end before that time or stay off those GPUs.
    """
    room = _room(state)
    if room is None:
        return []
    view, slots, smallest = room
    jobs = state.jobs
    pred_cache: dict[tuple[str, str], float] = {}

    def pred(job: Job) -> float:
        key = runtime_key(job.spec)
        p = pred_cache.get(key)
        if p is None:
            p = pred_cache[key] = state.stats.predict(key, DEFAULT_RUNTIME_S)
        limit = job.time_limit(state.config.default_time_limit_s)
        return min(p, limit) if limit is not None else p

    live = _fitting_shapes(state, view, best_fit)
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
            p = predict(runtime_key(r.spec), DEFAULT_RUNTIME_S)
            limit = r.time_limit(default)
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
    for jid in _sjf_order(state):
        shape = shape_of[jid]
        if shape not in live and head is not None:
            continue
        job = jobs[jid]
        if not _eligible(state, job, now):
            continue
        if shape not in live:  # the head: it cannot start now
            head = (view.copy(), job, list(ends))
            continue
        idxs = best_fit(view, job, frozenset())
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
                reservation = _reservation(at_view, head_job, running_ends() + head_ends)
            shadow, reserved = reservation
            if set(idxs) & reserved and now + pred(job) > shadow:
                idxs = best_fit(view, job, reserved)
                if idxs is None:
                    continue
        view.take(idxs, job.milli, job.spec.gpu_mem_mib)
        out.append(view.placement(job, idxs))
        ends.append((now + pred(job), job.id, idxs, job.milli, job.spec.gpu_mem_mib))
        slots -= 1
        if slots == 0 or (smallest > 0 and view.max_free() < smallest):
            break
    return out


def _sjf_order(state: ClusterState) -> Iterator[int]:
    """Queued job ids by (-priority, predicted runtime, order), merged lazily.

    Jobs without history all share the global median, so they stream straight
    from the priority index; each key with history is one more sorted stream.
    Nothing is re-sorted, and the merge stops when the scan does.
    """
    q, stats = state.queue, state.stats
    med = stats.median()
    median = DEFAULT_RUNTIME_S if med is None else med
    history = stats.by_key
    keys = [k for k in q.by_rkey if k in history] if len(q.by_rkey) <= len(history) else [
        k for k in history if k in q.by_rkey
    ]
    rkey_of = q.rkey_of
    streams: list[Iterator[tuple[int, float, int, int]]] = [
        ((np_, median, o, j) for np_, o, j in q.by_priority if rkey_of[j] not in history)
    ]
    for k in sorted(keys):
        streams.append(_stream(q.by_rkey[k], stats.predict(k)))
    return (j for _, _, _, j in heapq.merge(*streams))


def _stream(entries: list[tuple[int, int, int]], pred: float) -> Iterator[tuple[int, float, int, int]]:
    # a function, not an inline generator, so each stream keeps its own pred
    return ((np_, pred, o, j) for np_, o, j in entries)


def _reservation(
    view: View, head: Job, ends: list[tuple[float, int, list[int], int, int]]
) -> tuple[float, frozenset[int]]:
    """When and where ``head`` would fit as jobs end in predicted order.

    Capacity only grows as jobs end, so a GPU that could take one of the
    head's GPUs stays able to: count such GPUs per node as ends free them, and
    run ``best_fit`` once, at the first end after which some node has enough.
    """
    future = view.copy()
    need = max(head.count, 1)
    able = set(future.candidates(head))
    per_node: dict[str, int] = {}
    for i in able:
        per_node[future.node[i]] = per_node.get(future.node[i], 0) + 1
    enough = head.count == 0 or max(per_node.values(), default=0) >= need
    for end, _, idxs, milli, mem in sorted(ends, key=lambda e: (e[0], e[1])):
        future.give(idxs, milli, mem)
        for i in idxs:
            if i not in able and future.can_take(head, i):
                able.add(i)
                n = per_node[future.node[i]] = per_node.get(future.node[i], 0) + 1
                enough = enough or n >= need
        if enough:  # best_fit cannot succeed before this (and then it does)
            fit = best_fit(future, head, frozenset())
            if fit is not None:
                return end, frozenset(fit)
    return math.inf, frozenset()  # it cannot fit on what runs now: reserve nothing


# --- fragmentation gradient descent (Weng et al., ATC'23) -----------------------


def fgd(state: ClusterState, now: float) -> list[Placement]:
    """Priority order; each job goes where expected fragmentation grows least,
    the workload being the shapes of the recent submissions."""
    total = sum(state.shape_counts.values())
    workload = [(k, m, n / total) for (k, m), n in sorted(state.shape_counts.items())] if total else []
    if not workload:
        return best_fit_policy(state, now)
    # A node's fragmentation depends only on the multiset of its GPUs' free
    # shares; many nodes (all free, all full) share one, so score each once.
    memo: dict[tuple[int, ...], float] = {}

    def frag(free: list[int]) -> float:
        key = tuple(sorted(free))
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = fragmentation(free, workload)
        return hit

    def choose(view: View, job: Job, exclude: frozenset[int]) -> list[int] | None:
        if job.count == 0:
            return []
        cands = view.candidates(job, exclude)
        if not cands:
            return None
        best: tuple[float, int] | None = None
        pick: list[int] | None = None
        for node, on in view.by_node(cands).items():
            members = view.node_idx[node]
            if len(on) < job.count:
                continue
            free = [view.free[i] for i in members]
            before = frag(free)
            options = [on[: job.count]] if job.count > 1 or job.milli == FULL else [[i] for i in on]
            for idxs in options:
                after = list(free)
                for i in idxs:
                    after[members.index(i)] -= job.milli
                key = (frag(after) - before, idxs[0])
                if best is None or key < best:
                    best, pick = key, idxs
        return pick

    return _scan(state, now, _by_priority(state), choose)


POLICIES: dict[str, Policy] = {
    "fifo": fifo,
    "priority": priority,
    "best-fit": best_fit_policy,
    "sjf-backfill": sjf_backfill,
    "fgd": fgd,
}


def decide(state: ClusterState, now: float) -> list[Placement]:
    """Run the state's current policy (the default when it is unknown)."""
    return POLICIES.get(state.policy, POLICIES[DEFAULT_POLICY])(state, now)
