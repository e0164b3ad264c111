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

from .fgd import fragmentation
from .messages import SchedulerConfig
from .projections.cluster import FULL, ClusterState, Gpu, Job, runtime_key

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


def usable(gpu: Gpu, cfg: SchedulerConfig) -> bool:
    """May this GPU receive a new job? (F7 pause, lost GPUs, F10 thresholds)"""
    if gpu.paused or gpu.lost:
        return False
    if gpu.sampled_at is None:
        return True
    if gpu.memory_used_mib is not None and gpu.memory_total_mib > 0:
        if 100.0 * gpu.memory_used_mib / gpu.memory_total_mib > cfg.max_gpu_memory_used_pct:
            return False
    if gpu.utilization is not None and gpu.utilization > cfg.max_gpu_utilization_pct:
        return False
    if gpu.temperature_c is not None and gpu.temperature_c > cfg.max_gpu_temperature_c:
        return False
    return True


class View:
    """Free capacity of the usable GPUs during one decision.

    Placements taken in the decision are subtracted here, so one decision
    never over-commits; the state itself changes only when the core applies
    the resulting JobPlaced events.
    """

    def __init__(self, state: ClusterState) -> None:
        cfg = state.config
        gpus = [g for g in state.gpu_list if usable(g, cfg)]
        self.default_node = state.node
        self.node = [g.node for g in gpus]
        self.id = [g.id for g in gpus]
        self.free = [FULL - g.used_milli for g in gpus]
        self.mem = [g.free_memory_mib() for g in gpus]
        self.index = {(g.node, g.id): i for i, g in enumerate(gpus)}
        self.nodes: list[str] = []
        self.node_idx: dict[str, list[int]] = {}
        for i, node in enumerate(self.node):
            if node not in self.node_idx:
                self.nodes.append(node)
                self.node_idx[node] = []
            self.node_idx[node].append(i)
        self.total = sum(self.free)

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
        mem = spec.gpu_mem_mib
        allowed = spec.gpu_ids
        out = []
        free, memfree, ids, nodes = self.free, self.mem, self.id, self.node
        for i in range(len(free)):
            if free[i] < need or (mem and memfree[i] < mem) or i in exclude:
                continue
            if allowed is not None and ids[i] not in allowed:
                continue
            if spec.node and nodes[i] != spec.node:
                continue
            out.append(i)
        return out

    def take(self, idxs: list[int], milli: int, mem: int) -> None:
        for i in idxs:
            self.free[i] -= milli
            self.mem[i] -= mem
            self.total -= milli

    def give(self, idxs: Iterable[int], milli: int, mem: int) -> None:
        for i in idxs:
            self.free[i] += milli
            self.mem[i] += mem
            self.total += milli

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
    for node in view.nodes:
        on = [i for i in cands if view.node[i] == node] if len(view.nodes) > 1 else cands
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
        if d is None or d.state != "succeeded":
            return False
    return True


def _slots(state: ClusterState) -> int:
    limit = state.config.max_running
    return limit - len(state.running) if limit > 0 else 1 << 62


def _fitting_shapes(state: ClusterState, view: View, choose: Chooser) -> set[tuple[Any, ...]]:
    """Shapes of queued jobs that would fit now (one trial per shape, not per job)."""
    jobs, q = state.jobs, state.queue
    return {shape for shape, members in q.by_shape.items() if choose(view, jobs[next(iter(members))], frozenset()) is not None}


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
    slots = _slots(state)
    if slots <= 0:
        return []
    view = View(state)
    smallest = state.queue.min_milli()
    if smallest > 0 and view.max_free() < smallest:
        return []
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
    slots = _slots(state)
    if slots <= 0:
        return []
    view = View(state)
    smallest = state.queue.min_milli()
    if smallest > 0 and view.max_free() < smallest:
        return []
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
        out_ = []
        for jid in state.running:
            r = jobs[jid]
            idxs = [view.index[(r.node, g)] for g in r.gpu_ids if (r.node, g) in view.index]
            start = r.started_at if r.started_at is not None else now
            out_.append((max(now, start + pred(r)), jid, idxs, r.milli, r.mem_mib))
        return out_

    out: list[Placement] = []
    shadow = math.inf
    reserved: frozenset[int] = frozenset()
    have_head = False
    for jid in _sjf_order(state):
        shape = shape_of[jid]
        if shape not in live and have_head:
            continue
        job = jobs[jid]
        if not _eligible(state, job, now):
            continue
        if shape not in live:  # the head: it cannot start now, so it gets a reservation
            have_head = True
            shadow, reserved = _reservation(view, job, running_ends() + ends)
            continue
        idxs = best_fit(view, job, frozenset())
        if idxs is None:
            live.discard(shape)
            if not have_head:
                have_head = True
                shadow, reserved = _reservation(view, job, running_ends() + ends)
            if not live:
                break
            continue
        if have_head and set(idxs) & reserved and now + pred(job) > shadow:
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
    """When and where ``head`` would fit as jobs end in predicted order."""
    future = view.copy()
    for end, _, idxs, milli, mem in sorted(ends, key=lambda e: (e[0], e[1])):
        future.give(idxs, milli, mem)
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

    def choose(view: View, job: Job, exclude: frozenset[int]) -> list[int] | None:
        if job.count == 0:
            return []
        cands = view.candidates(job, exclude)
        if not cands:
            return None
        best: tuple[float, int] | None = None
        pick: list[int] | None = None
        for node in view.nodes:
            members = view.node_idx[node]
            on = [i for i in cands if view.node[i] == node] if len(view.nodes) > 1 else cands
            if len(on) < job.count:
                continue
            free = [view.free[i] for i in members]
            before = fragmentation(free, workload)
            options = [on[: job.count]] if job.count > 1 or job.milli == FULL else [[i] for i in on]
            for idxs in options:
                after = list(free)
                for i in idxs:
                    after[members.index(i)] -= job.milli
                key = (fragmentation(after, workload) - before, idxs[0])
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
