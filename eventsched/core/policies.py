"""Placement policies: pure ``decide(state, now) -> list[Placement]``, by name.

Every policy obeys the same placement rules (``View``: no over-committed share
or memory, pinned GPUs and nodes, usable GPUs only, gangs on one node at once,
``max_running``); they differ only in the order of jobs and the GPUs picked.
Decisions are deterministic (GPUs in (node, id) order, jobs in queue order,
ties to the lower index, no set iterated): the replay simulator relies on that.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from eventsched.core import budgets, reservations
from eventsched.core.fgd import NodeFragments
from eventsched.core.records import Placement
from eventsched.domain.states import JobState
from eventsched.domain.tenants import DEFAULT_TENANT
from eventsched.projections.cluster import FULL, ClusterState, Job, QueueIndex, runtime_key, usable
from eventsched.projections.model import Capacity, tenant_of, time_limit_of
from eventsched.projections.sortedkeys import SortedKeys

# plain module names: an Enum class attribute costs a lookup on every use (hot paths)
SUCCEEDED = JobState.SUCCEEDED

__all__ = ["Placement", "Policy", "POLICIES", "DEFAULT_POLICY", "REPLAY_ONLY", "View", "usable", "Limits", "fair_shares"]

DEFAULT_POLICY = "best-fit"
# reference policies only a replay can run (they need what a daemon cannot know)
REPLAY_ONLY = {"sjf-oracle": "it knows each job's true duration, which only a replay of a recording or trace has"}
DEFAULT_RUNTIME_S = 3600.0  # prediction when there is no history at all


Policy = Callable[[ClusterState, float], list[Placement]]


class View:
    """Free capacity of the usable GPUs during one decision, less its own placements."""

    def __init__(self, cap: Capacity, default_node: str, free: list[int] | None = None,
                 mem: list[int] | None = None) -> None:
        self.cap, self.default_node = cap, default_node
        # shared, never changed here
        self.node, self.id, self.index, self.node_idx = cap.node, cap.id, cap.index, cap.node_idx
        # copied: the decision subtracts its own placements
        self.free = list(cap.free) if free is None else free
        self.mem = list(cap.mem) if mem is None else mem
        # the largest free share and the most whole free GPUs on one node (-1: not
        # known): every fit test asks one of them
        self.max_known = cap.max_known if free is None else -1
        self.whole_known = -1

    @classmethod
    def of(cls, state: ClusterState) -> View:
        return cls(state.capacity, state.node)

    def copy(self) -> View:
        view = View(self.cap, self.default_node, list(self.free), list(self.mem))
        view.max_known, view.whole_known = self.max_known, self.whole_known
        return view

    def max_free(self) -> int:
        if self.max_known < 0:
            self.max_known = _max_of(self.free)
        return self.max_known

    def most_whole(self) -> int:
        """The most all-free GPUs on one node."""
        if self.whole_known < 0:
            free, most = self.free, 0
            if len(self.node_idx) == 1:  # most machines
                most = _count_at(free, 0, len(free), FULL)
            else:  # asked at almost every fit test of a decision: a plain loop, no tuple per node
                for idxs in self.node_idx.values():
                    most = max(most, _count_at(free, idxs[0], idxs[-1] + 1, FULL))
            self.whole_known = most
        return self.whole_known

    def candidates(self, job: Job, exclude: frozenset[int] = frozenset()) -> list[int]:
        """GPU indices where one of the job's GPUs could go, in (node, id) order."""
        spec = job.spec
        need = job.milli
        free = self.free
        if need == FULL:  # a whole GPU: only the all-free ones (found in C, not a Python loop)
            out = _all_at(free, FULL)
        else:
            out = [i for i, f in enumerate(free) if f >= need]  # the common test first, in one pass
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
        free = self.free
        for i in idxs:
            if milli:
                if free[i] == self.max_known:
                    self.max_known = -1  # it may have been the only one that large
                if free[i] == FULL:
                    self.whole_known = -1
            free[i] -= milli
            self.mem[i] -= mem

    def give(self, idxs: Iterable[int], milli: int, mem: int) -> None:
        for i in idxs:
            self.free[i] += milli
            self.mem[i] += mem
        self.max_known = self.whole_known = -1

    def by_node(self, idxs: list[int]) -> dict[str, list[int]]:
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
        return Placement(job=job.id, node=self.node[idxs[0]], gpu_ids=[self.id[i] for i in idxs],
                         share=job.milli / FULL, mem=job.spec.gpu_mem_mib)


# A chooser picks GPU indices for a job on a view (None: it does not fit now).
Chooser = Callable[[View, Job, frozenset[int]], "list[int] | None"]
End = tuple[float, int, list[int], int, int]  # (end, job, GPU indices, share, memory)


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
    if not exclude and _plain(job):
        if job.count > 1:
            return _whole_gang(view, job.count, tightest=False)
        i = _first_at_least(view.free, job.milli)
        return [i] if i >= 0 else None
    cands = view.candidates(job, exclude)
    if job.count == 1:
        return cands[:1] or None
    return _gang(view, cands, job.count, tightest=False)


def best_fit(view: View, job: Job, exclude: frozenset[int] = frozenset()) -> list[int] | None:
    """Fractional jobs go where the least share remains after them."""
    if job.count == 0:
        return []
    if not exclude and _plain(job):
        if job.count == 1:
            return _tightest_one(view.free, job.milli)
        return _whole_gang(view, job.count, tightest=True)
    cands = view.candidates(job, exclude)
    if not cands:
        return None
    if job.count == 1:
        if job.milli == FULL:
            return [cands[0]]
        free = view.free
        return [min(cands, key=lambda i: (free[i], i))]
    return _gang(view, cands, job.count, tightest=True)


def _plain(job: Job) -> bool:
    """No memory request, no pinned GPUs, no pinned node: only the share matters."""
    spec = job.spec
    return not spec.gpu_mem_mib and spec.gpu_ids is None and not spec.node


# The scans below are plain loops: compiled, a loop over a list[int] compares
# unboxed ints, faster than list.index, list.count, max() and their calls
# (the pure-Python build pays the other way round).


def _all_at(free: list[int], value: int) -> list[int]:
    return [i for i, f in enumerate(free) if f == value]


def _max_of(free: list[int]) -> int:
    """``max(free)``, 0 with no GPU."""
    most = free[0] if free else 0
    for f in free:
        if f > most:
            most = f
    return most


def _first_at_least(free: list[int], need: int) -> int:
    """The first index with ``free[i] >= need`` (-1: none)."""
    for i, f in enumerate(free):
        if f >= need:
            return i
    return -1


def _count_at(free: list[int], lo: int, hi: int, value: int) -> int:
    n = 0
    for i in range(lo, hi):
        if free[i] == value:
            n += 1
    return n


def _whole_gang(view: View, k: int, tightest: bool) -> list[int] | None:
    """``_gang`` of a plain job of ``k`` whole GPUs, counted per node instead of listed."""
    if view.most_whole() < k:
        return None  # known without walking the nodes
    free = view.free
    if len(view.node_idx) == 1:  # one node: it is the pick
        return _all_at(free, FULL)[:k]
    pick: tuple[int, int, int] | None = None  # (first index, end index, all-free GPUs) of a node
    for idxs in view.node_idx.values():  # a node's GPUs are contiguous in (node, id) order
        lo, hi = idxs[0], idxs[-1] + 1
        n = _count_at(free, lo, hi, FULL)
        if n >= k and (pick is None or n < pick[2]):
            pick = (lo, hi, n)
            if not tightest:
                break
    if pick is None:
        return None
    lo, hi, _ = pick
    return [i for i in range(lo, hi) if free[i] == FULL][:k]


def _tightest_one(free: list[int], need: int) -> list[int] | None:
    """``best_fit`` of a plain one-GPU job: the first GPU with the least share that still has ``need``."""
    pick, least = -1, 0
    for i, f in enumerate(free):
        if f >= need and (pick < 0 or f < least):
            pick, least = i, f
    return [pick] if pick >= 0 else None


def _eligible(state: ClusterState, job: Job, now: float) -> bool:
    if job.not_before > now:
        return False
    for dep in job.spec.after:
        d = state.jobs.get(dep)
        if d is None or d.state != SUCCEEDED:
            return False
    return True


class Limits:
    """Tenants' quotas and arrays' caps (%K) left during one decision. A tenant
    whose month's budget is spent is held, or placed only in the core's lowered pass."""

    def __init__(self, state: ClusterState, now: float) -> None:
        self.state = state
        self.spent = budgets.spent(state, now) if state.tenants else {}  # tenant -> its budget action
        self.left: dict[str, list[int] | None] = {}  # tenant -> [milli, mem, jobs] left; None: no quota
        self.arrays: dict[int, int] = {}  # array id -> tasks it may still start

    def _tenant_left(self, tenant: str) -> list[int] | None:
        if tenant in self.left:
            return self.left[tenant]
        quota, usage, big = self.state.tenants.get(tenant), self.state.usage.get(tenant), 1 << 62
        left = None
        if quota is not None:
            milli, mem, jobs = usage.held() if usage is not None else (0, 0, 0)
            left = [big if quota.gpus is None else round(quota.gpus * FULL) - milli,
                    big if quota.gpu_mem_mib is None else quota.gpu_mem_mib - mem,
                    big if quota.jobs is None else quota.jobs - jobs]
        self.left[tenant] = left
        return left

    def blocked(self, job: Job) -> str | None:
        """Why ``job`` may not start now because of a quota or cap (None: it may)."""
        spec = job.spec
        if spec.array_cap:
            left = self.arrays.get(spec.array_id)
            if left is None:
                left = self.arrays[spec.array_id] = spec.array_cap - self.state.array_running.get(spec.array_id, 0)
            if left <= 0:
                return "array-cap"
        if not self.state.tenants:
            return None  # no quotas at all (tenant_left would answer None for each)
        if self.spent or self.state.placing_lowered:
            action = self.spent.get(tenant_of(job))
            if action == budgets.HOLD or (action == budgets.LOWER) != self.state.placing_lowered:
                return "budget"
        q = self._tenant_left(tenant_of(job))
        if q is not None and (q[0] < job.count * job.milli or q[1] < job.count * spec.gpu_mem_mib or q[2] < 1):
            return "quota"
        return None

    def take(self, job: Job) -> None:
        if job.spec.array_cap:
            self.arrays[job.spec.array_id] -= 1
        q = self._tenant_left(tenant_of(job)) if self.state.tenants else None
        if q is not None:
            q[0] -= job.count * job.milli
            q[1] -= job.count * job.spec.gpu_mem_mib
            q[2] -= 1


def fair_shares(state: ClusterState, now: float) -> dict[str, tuple[float, float, float]]:
    """tenant -> (share, recent usage share, fair-share factor) of the tenants
    configured, running or waiting: Slurm's classic ``F = 2^(-U/S)`` (docs/fair-share.md)."""
    names = set(state.tenants) | set(state.usage)
    for shape in state.queue.shape_queue:
        names.add(shape[5] or DEFAULT_TENANT)
    half_life = state.config.usage_half_life_s
    usage = {t: (state.usage[t].at(now, half_life) if t in state.usage else 0.0) for t in names}
    weights = {t: (state.tenants[t].weight if t in state.tenants else 1.0) for t in names}
    total_u, total_w = sum(usage.values()), sum(weights.values())
    out = {}
    for t in sorted(names):
        share = weights[t] / total_w if total_w else 0.0
        used = usage[t] / total_u if total_u > 0 else 0.0
        out[t] = (share, used, 2.0 ** (-used / share) if share > 0 else 0.0)
    return out


def _offsets(state: ClusterState, now: float, weight: float) -> dict[str, float]:
    """What each tenant's fair share takes off its jobs' sort keys (a key is
    minus a score, so more fair share means earlier)."""
    if weight <= 0:
        return {}
    return {t: weight * f for t, (_, _, f) in fair_shares(state, now).items()}


def _fits(view: View, job: Job) -> bool:
    """Would a chooser place ``job``? Each fails exactly when no node has ``count`` candidates."""
    if job.count == 0:
        return True
    if _plain(job):
        if job.count == 1:
            return view.max_free() >= job.milli
        return view.most_whole() >= job.count
    cands = view.candidates(job)
    if job.count == 1:
        return bool(cands)
    return any(len(on) >= job.count for on in view.by_node(cands).values())


def _fitting_shapes(state: ClusterState, view: View) -> set[tuple[Any, ...]]:
    """Shapes of queued jobs that fit now, one trial per shape. ``view`` must be
    untouched: a failing shape is remembered (``Capacity.no_fit``) until capacity grows."""
    jobs, no_fit = state.jobs, state.capacity.no_fit
    live = set()
    # a shape's head stands for it (found in O(1), unlike a much-deleted dict's first key)
    for shape, entries in state.queue.shape_queue.items():
        if shape in no_fit:
            continue
        if _fits(view, jobs[entries[0][2]]):
            live.add(shape)
        else:
            no_fit.add(shape)
    return live


def _room(state: ClusterState) -> tuple[View, int, int] | None:
    """(view, job slots, smallest queued share), or None when no queued job can start."""
    limit = state.config.max_running
    slots = limit - len(state.running) if limit > 0 else 1 << 62
    if slots <= 0:
        return None
    cap = state.capacity
    smallest = state.queue.min_milli()
    if smallest > 0 and cap.max_free() < smallest:
        return None  # answered before copying the capacity
    return View(cap, state.node), slots, smallest


def _start(state: ClusterState, now: float) -> tuple[View, int, int, set[tuple[Any, ...]], Limits] | None:
    room = _room(state)
    if room is None:
        return None
    view, slots, smallest = room
    live = _fitting_shapes(state, view)
    return (view, slots, smallest, live, Limits(state, now)) if live else None


def _held_off(view: View, job: Job, held: frozenset[int], choose: Chooser) -> bool:
    """Does ``job`` fail only because booked GPUs are held from it? Then only it waits:
    another job of its shape may own them."""
    return bool(held) and choose(view, job, frozenset()) is not None


def _scan(state: ClusterState, now: float, choose: Chooser, fair_share: bool = False) -> list[Placement]:
    """Place jobs in priority order while capacity lasts, skipping those that do
    not fit or are over a quota or cap. Only the shapes that fit at the start are
    merged by their heads, and one that fails is dropped (capacity only shrinks),
    so the cost grows with the shapes and placements, not the queue."""
    start = _start(state, now)
    if start is None:  # nothing can start: no placement for a reservation to guard
        return []
    view, slots, smallest, live, limits = start
    hold = reservations.holds(state, view.index, now) if state.reservations or state.making_room else None
    offsets = _offsets(state, now, state.config.fair_share_weight) if fair_share else {}
    queues = state.queue.shape_queue
    # (head's key, its position, shape): keys are unique, so nothing else is compared
    lanes = {s: iter(queues[s]) for s in live}  # read in order, never by position
    heap = [(_lane_key(next(lanes[s]), s, offsets), 0, s) for s in live]
    heapq.heapify(heap)
    reserve = _Reservation.for_head(state, now, view, live, offsets, limits) if state.config.reserve_for_gang else None
    jobs = state.jobs
    out: list[Placement] = []
    while heap:
        key, pos, shape = heap[0]
        job = jobs[key[2]]
        if limits.blocked(job):  # the whole shape shares the tenant (and the capped array)
            heapq.heappop(heap)
            continue
        if _eligible(state, job, now):
            held = hold(job) if hold is not None else frozenset()
            idxs = choose(view, job, held)
            if idxs is None:
                if not _held_off(view, job, held, choose):  # nothing more of this shape fits in this decision
                    heapq.heappop(heap)
                    continue
            elif reserve is not None and job.id != reserve.head.id and reserve.collides(idxs, job):
                idxs = choose(view, job, reserve.gpus | held)
                if idxs is None and not _held_off(view, job, held, choose):
                    heapq.heappop(heap)  # this shape fits only on the held GPUs: not searched deeper
                    continue  # (a later job of it with a shorter prediction waits too)
            if idxs is not None and _place(view, limits, out, job, idxs, slots, smallest):
                break
        _advance(heap, lanes[shape], pos, shape, offsets)
    return out


def _place(view: View, limits: Limits, out: list[Placement], job: Job, idxs: list[int], slots: int, smallest: int) -> bool:
    """True when nothing more can start in this decision."""
    view.take(idxs, job.milli, job.spec.gpu_mem_mib)
    limits.take(job)
    out.append(view.placement(job, idxs))
    return len(out) == slots or (smallest > 0 and view.max_free() < smallest)


def _lane_key(entry: tuple[float, int, int], shape: Any, offsets: dict[str, float]) -> tuple[float, int, int]:
    if not offsets:
        return entry
    return (entry[0] - offsets.get(shape[5] or DEFAULT_TENANT, 0.0), entry[1], entry[2])


class _Reservation:
    """GPUs held (``reserve_for_gang``) for a blocked gang at the head that has waited
    ``reserve_after_s``: those it would get at ``shadow`` as running jobs end; a
    later job may take one only if predicted to end by then."""

    def __init__(self, state: ClusterState, now: float, head: Job, shadow: float, gpus: frozenset[int]) -> None:
        self.state, self.now, self.head, self.shadow, self.gpus = state, now, head, shadow, gpus

    @classmethod
    def for_head(cls, state: ClusterState, now: float, view: View, live: set[Any],
                 offsets: dict[str, float], limits: Limits) -> _Reservation | None:
        queues, jobs = state.queue.shape_queue, state.jobs
        if len(live) == len(queues):
            return None  # every shape can start now, the head's too
        best: tuple[tuple[float, int, int], Any] | None = None
        for shape, entries in queues.items():
            key = _lane_key(entries[0], shape, offsets)
            if best is None or key < best[0]:
                best = (key, shape)
        if best is None or best[1] in live:
            return None  # the head can start now (or nothing waits)
        head = jobs[best[0][2]]
        if head.count < 2 or now - head.queued_at < state.config.reserve_after_s:
            return None
        if not _eligible(state, head, now) or limits.blocked(head):
            return None
        shadow, gpus = _reservation(view, head, _ends_in_order(state, view, now), ordered=True)  # it copies view
        if not gpus:
            return None
        return cls(state, now, head, shadow, gpus)

    def collides(self, idxs: list[int], job: Job) -> bool:
        """Would placing ``job`` on ``idxs`` delay the head?"""
        if not self.gpus.intersection(idxs):
            return False
        spec = self.state.stats
        limit = time_limit_of(job, self.state.config.default_time_limit_s)
        key = runtime_key(job.spec)
        if key in spec.by_key:
            pred = spec.predict(key, DEFAULT_RUNTIME_S)
            pred = min(pred, limit) if limit is not None else pred
        elif limit is not None:
            pred = limit
        else:
            return True  # no prediction: stay off the reserved GPUs
        return self.now + pred > self.shadow


def _ends_in_order(state: ClusterState, view: View, now: float) -> Iterator[End]:
    """The running jobs' ``End``s from ``state.ends`` in (end, id) order, lazily; those overdue end ``now``."""
    ends, jobs, index = state.ends, state.jobs, view.index
    k = bisect.bisect_right(ends, (now, math.inf))
    for jid in sorted([jid for _, jid in ends[:k]]):
        yield _end_entry(jobs[jid], now, index)
    for i in range(k, len(ends)):
        end, jid = ends[i]
        yield _end_entry(jobs[jid], end, index)


def _end_entry(r: Job, end: float, index: dict[tuple[str, int], int]) -> End:
    return (end, r.id, _indices(index, r), r.milli, r.mem_mib)


def _indices(index: dict[tuple[str, int], int], job: Job) -> list[int]:
    """The view indices of ``job``'s usable GPUs."""
    node = job.node
    return [index[(node, g)] for g in job.gpu_ids if (node, g) in index]


def _running_ends(state: ClusterState, view: View, now: float, pred: Callable[[Job], float] | None,
                  extra: list[End]) -> Iterator[End]:
    """The ``End``s of the running jobs and ``extra`` (this decision's placements)
    in (end, job) order, lazily: a reservation reads only as far as its head fits."""
    if pred is None:
        yield from _predicted_ends(state, view, now, extra)
        return
    keys: list[tuple[float, int]] = []
    jobs = state.jobs
    default = state.config.default_time_limit_s
    for jid in state.running:
        r = jobs[jid]
        p = pred(r)
        limit = time_limit_of(r, default)
        if limit is not None:
            p = min(p, limit)
        start = r.started_at if r.started_at is not None else now
        keys.append((max(now, start + p), jid))
    yield from _pop_ends(state, view, keys, extra)


def _pop_ends(state: ClusterState, view: View, keys: list[tuple[float, int]], extra: list[End]) -> Iterator[End]:
    """``keys`` and ``extra`` as ``End``s in order: a heap, as a reservation reads few."""
    mine = {e[1]: e for e in extra}
    keys.extend((e[0], e[1]) for e in extra)
    heapq.heapify(keys)
    jobs, index = state.jobs, view.index
    while keys:
        end, jid = heapq.heappop(keys)
        e = mine.get(jid)
        yield e if e is not None else _end_entry(jobs[jid], end, index)


def _predicted_ends(state: ClusterState, view: View, now: float, extra: list[End]) -> Iterator[End]:
    """``_running_ends`` by the stats' predictions: ``_RunningByKey``'s groups merged,
    so each runtime key is predicted once and only the ends read are ordered."""
    lanes = state.queue.listener
    running = lanes.running if isinstance(lanes, _SjfLanes) else _RunningByKey()
    running.sync(state)
    jobs, predict = state.jobs, state.stats.predict
    default = state.config.default_time_limit_s
    # (end, -1, group, position): a group's unread jobs, ahead of equal ends; (end, 0, job, 0): one end
    heap: list[tuple[float, int, int, int]] = []
    groups: list[tuple[float, list[tuple[float, int]]]] = []
    for key, group in running.groups.items():
        p = predict(key, DEFAULT_RUNTIME_S)
        limit = time_limit_of(jobs[group[0][1]], default)  # the default's: none of them has its own
        p = min(p, limit) if limit is not None else p
        heap.append((max(now, group[0][0] + p), -1, len(groups), 0))
        groups.append((p, group))
    for jid in running.alone:
        r = jobs[jid]
        p = predict(running.filed[jid][2], DEFAULT_RUNTIME_S)
        limit = time_limit_of(r, default)
        if limit is not None:
            p = min(p, limit)
        start = r.started_at if r.started_at is not None else now
        heap.append((max(now, start + p), 0, jid, 0))
    heap.extend((e[0], 0, e[1], 0) for e in extra)
    mine = {e[1]: e for e in extra}
    heapq.heapify(heap)
    index = view.index
    while heap:
        end, kind, n, i = heapq.heappop(heap)
        if kind == 0:
            e = mine.get(n)
            yield e if e is not None else _end_entry(jobs[n], end, index)
            continue
        p, group = groups[n]
        # a group's ends come in order but for ties, which the heap orders by job
        while i < len(group) and max(now, group[i][0] + p) == end:
            heapq.heappush(heap, (end, 0, group[i][1], 0))
            i += 1
        if i < len(group):
            heapq.heappush(heap, (max(now, group[i][0] + p), -1, n, i))


class _RunningByKey:
    """The running jobs by runtime key, each group in (start, job) order (so in
    predicted-end order), kept across decisions; jobs with a time limit of
    their own or no start are predicted one by one (``alone``)."""

    def __init__(self) -> None:
        # job -> (start, spec, runtime key) filed under: a new start or spec refiles it
        self.filed: dict[int, tuple[float | None, Any, RuntimeKey]] = {}
        self.groups: dict[RuntimeKey, list[tuple[float, int]]] = {}
        self.alone: dict[int, None] = {}

    def sync(self, state: ClusterState) -> None:
        filed, jobs, running = self.filed, state.jobs, state.running
        for jid in running:
            r = jobs[jid]
            f = filed.get(jid)
            if f is None or f[1] is not r.spec or f[0] != r.started_at:
                if f is not None:
                    self._drop(jid)
                self._file(r)
        if len(filed) > len(running):
            for jid in filed.keys() - running.keys():
                self._drop(jid)

    def _file(self, r: Job) -> None:
        key = runtime_key(r.spec)
        self.filed[r.id] = (r.started_at, r.spec, key)
        if r.started_at is None or time_limit_of(r, None) is not None:
            self.alone[r.id] = None
            return
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = []
        bisect.insort(group, (r.started_at, r.id))

    def _drop(self, jid: int) -> None:
        start, _, key = self.filed.pop(jid)
        if start is None or jid in self.alone:
            self.alone.pop(jid, None)
            return
        group = self.groups[key]
        del group[bisect.bisect_left(group, (start, jid))]
        if not group:
            del self.groups[key]


def _advance(heap: list[tuple[tuple[float, int, int], int, Any]], lane: Iterator[tuple[float, int, int]],
             pos: int, shape: Any, offsets: dict[str, float]) -> None:
    """Replace the heap's top by the next job of its shape."""
    entry = next(lane, None)
    if entry is not None:
        heapq.heapreplace(heap, (_lane_key(entry, shape, offsets), pos + 1, shape))
    else:
        heapq.heappop(heap)


def _scan_blocking(state: ClusterState, now: float, order: Iterable[int], choose: Chooser) -> list[Placement]:
    """Place jobs in ``order`` until the first eligible one that does not fit (no per-shape merge needed)."""
    start = _start(state, now)
    if start is None:
        return []
    view, slots, smallest, live, limits = start
    hold = reservations.holds(state, view.index, now) if state.reservations or state.making_room else None
    jobs, shape_of = state.jobs, state.queue.shape_of
    out: list[Placement] = []
    for jid in order:
        job = jobs[jid]
        if not _eligible(state, job, now) or limits.blocked(job):  # a quota holds back its tenant only
            continue
        held = hold(job) if hold is not None else frozenset()
        idxs = choose(view, job, held) if shape_of[jid] in live else None
        if idxs is None and shape_of[jid] in live and _held_off(view, job, held, choose):
            continue  # kept off booked GPUs: it does not block the others
        if idxs is None or _place(view, limits, out, job, idxs, slots, smallest):
            break
    return out


def _by_order(state: ClusterState) -> Iterator[int]:
    # a generator function, lazy: mypyc builds a generator expression's whole list first
    for _, jid in state.queue.by_order:
        yield jid


def fifo(state: ClusterState, now: float) -> list[Placement]:
    """Submission order; the first job that does not fit blocks the rest."""
    return _scan_blocking(state, now, _by_order(state), first_fit)


def priority(state: ClusterState, now: float) -> list[Placement]:
    """Higher priority first, FIFO within; jobs that do not fit are skipped."""
    return _scan(state, now, first_fit)


def best_fit_policy(state: ClusterState, now: float) -> list[Placement]:
    """Priority order with best-fit packing of fractional jobs (the default)."""
    return _scan(state, now, best_fit)


def fair_share_policy(state: ClusterState, now: float) -> list[Placement]:
    """Best-fit packing by the multifactor score (docs/fair-share.md)."""
    return _scan(state, now, best_fit, fair_share=True)


# --- shortest (predicted) job first, with EASY backfill -------------------------


def sjf_backfill(state: ClusterState, now: float) -> list[Placement]:
    """Priority first, then shortest predicted runtime; the first job that does not fit
    gets a reservation that later jobs may not delay (EASY backfill)."""
    # each runtime key and shape predicted once a decision (the stats do not change within it)
    pred_cache: dict[tuple[str, str], float] = {}
    least_cache: dict[Any, float] = {}

    def predicted(key: tuple[str, str]) -> float:
        p = pred_cache.get(key)
        if p is None:
            p = pred_cache[key] = state.stats.predict(key, DEFAULT_RUNTIME_S)
        return p

    def pred(job: Job) -> float:
        p = predicted(runtime_key(job.spec))
        limit = time_limit_of(job, state.config.default_time_limit_s)
        return min(p, limit) if limit is not None else p

    def shortest(shape: Any) -> float | None:
        # a lower bound of the shape's predictions, unless a job has its own time limit
        if state.queue.own_limits:
            return None
        least = least_cache.get(shape)
        if least is None:
            least = least_cache[shape] = min(predicted(r) for r in state.queue.shape_rkey[shape])
        default = state.config.default_time_limit_s
        return min(least, default) if default is not None and default > 0 else least

    return _sjf(state, now, pred, lambda live, has_head: _sjf_order(state, live, has_head), None, shortest)


def sjf_oracle(state: ClusterState, now: float) -> list[Placement]:
    """sjf-backfill with each job's true duration, which only a replay knows: a reference."""
    truth = state.oracle

    def pred(job: Job) -> float:
        return truth.get(job.id, DEFAULT_RUNTIME_S)

    def order(live: set[Any], has_head: Callable[[], bool]) -> Iterator[int]:
        # the whole queue sorted: fine for a reference
        return (key[-1] for key in sorted(oracle_keys(state, now)))

    return _sjf(state, now, pred, order, pred)


def oracle_keys(state: ClusterState, now: float) -> Iterator[tuple[Any, bool, float, int, int]]:
    """sjf-oracle's order of the queued jobs, which its preemptions follow too."""
    truth = state.oracle
    due = _due_before_a_pause(state, now)
    return ((k0, j not in due, truth.get(j, DEFAULT_RUNTIME_S), o, j) for k0, o, j in state.queue.by_priority)


def _due_before_a_pause(state: ClusterState, now: float) -> set[int]:
    """The queued jobs the oracle starts ahead of shorter ones as the next known pause
    would leave too few GPUs for them: by the exchange argument, when ``n * d`` (the
    shorter jobs of its tier times its duration) is under the pause's length."""
    start = next((paused for paused, *_ in state.oracle_pauses if paused > now), None)
    if start is None:
        return set()
    down = {key for key, g in state.gpus.items() if g.paused or g.lost}
    back = [resumed for paused, resumed, node, gpu in state.oracle_pauses
            if paused <= start < resumed and (node, gpu) not in down]
    if not back:
        return set()  # resumed the moment it was paused
    left = len(state.gpus) - len(down) - len(back)
    pause_s = min(back) - start
    truth = state.oracle
    tiers: dict[float, list[float]] = {}
    for k0, _, j in state.queue.by_priority:
        tiers.setdefault(k0, []).append(truth.get(j, DEFAULT_RUNTIME_S))
    for durations in tiers.values():
        durations.sort()
    due: set[int] = set()
    for k0, _, j in state.queue.by_priority:
        if state.jobs[j].count > left:
            d = truth.get(j, DEFAULT_RUNTIME_S)
            if bisect.bisect_left(tiers[k0], d) * d < pause_s:
                due.add(j)
    return due


def _sjf(state: ClusterState, now: float, pred: Callable[[Job], float],
         order: Callable[[set[Any], Callable[[], bool]], Iterator[int]],
         running_pred: Callable[[Job], float] | None,
         shortest: Callable[[Any], float | None] | None = None) -> list[Placement]:
    """Shortest (predicted) job first with EASY backfill (``shortest``: a lower bound of ``pred`` per shape)."""
    start = _start(state, now)
    if start is None:
        return []
    view, slots, smallest, live, limits = start
    hold = reservations.holds(state, view.index, now) if state.reservations or state.making_room else None
    jobs, shape_of = state.jobs, state.queue.shape_of
    # this decision's own placements' ends (running jobs' only if a reservation is needed)
    ends: list[End] = []
    out: list[Placement] = []
    # the first job that cannot start, with the view and ends as then: its
    # reservation is worked out only once a later job might delay it
    head: tuple[View, Job, list[End]] | None = None
    reservation: tuple[float, frozenset[int]] | None = None
    # shapes that fit only on the reserved GPUs: capacity only shrinks during a decision,
    # so only their jobs that end in time need a search
    reserved_only: set[Any] = set()
    for jid in order(live, lambda: head is not None):
        shape = shape_of[jid]
        if shape not in live and head is not None:
            continue
        job = jobs[jid]
        if not _eligible(state, job, now) or limits.blocked(job):
            continue
        if shape in reserved_only and reservation is not None and now + pred(job) > reservation[0]:
            continue
        held = hold(job) if hold is not None else frozenset()
        idxs = best_fit(view, job, held) if shape in live else None
        if idxs is None and shape in live and _held_off(view, job, held, best_fit):
            continue  # kept off booked GPUs: only it waits
        if idxs is None:  # the head (it cannot start now), or a shape that no longer fits
            live.discard(shape)
            if head is None:
                head = (view.copy(), job, list(ends))
            if not live:
                break
            continue
        if head is not None:
            if reservation is None:
                at_view, head_job, head_ends = head
                reservation = _reservation(at_view, head_job, _running_ends(state, view, now, running_pred, head_ends),
                                           ordered=True)
            shadow, reserved = reservation
            if set(idxs) & reserved and now + pred(job) > shadow:
                idxs = best_fit(view, job, reserved | held)
                if idxs is None:
                    if held:
                        continue  # another job of its shape may own the booked GPUs
                    reserved_only.add(shape)
                    least = shortest(shape) if shortest is not None else None
                    if least is not None and now + least > shadow:
                        live.discard(shape)  # none of its jobs ends before the head starts: none is walked
                    continue
        ends.append((now + pred(job), job.id, idxs, job.milli, job.spec.gpu_mem_mib))
        if _place(view, limits, out, job, idxs, slots, smallest):
            break
    return out


# (-priority, label, order, id): the order shortest-job-first scans in (``_SjfLanes``)
SjfKey = tuple[float, float, int, int]
RuntimeKey = tuple[str, str]


def _sjf_order(state: ClusterState, live: set[tuple[Any, ...]], has_head: Callable[[], bool]) -> Iterator[int]:
    """Queued job ids by (-priority, predicted runtime, order), the lanes merged;
    once the scan has its head, a lane whose shape is not ``live`` is dropped unwalked."""
    lanes = _SjfLanes.of(state)
    walks = {shape: iter(lane) for shape, lane in lanes.lanes.items()}
    # (key, shape): keys are unique, so the shape is never compared
    heap = [(next(walk), shape) for shape, walk in walks.items()]
    heapq.heapify(heap)
    while heap:
        key, shape = heap[0]
        if shape not in live and has_head():
            heapq.heappop(heap)  # shapes are never live again within a decision
            continue
        yield key[3]
        nxt = next(walks[shape], None)
        if nxt is None:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, (nxt, shape))


class _SjfLanes:
    """Each shape's queued jobs in shortest-first order, (-priority, label, order,
    id), kept in step with the queue (it listens to its adds and removes). Labels
    are in the predictions' order, equal where they are, so a prediction that
    moves without passing another's moves no key (``sync``)."""

    def __init__(self, q: QueueIndex) -> None:
        self.q = q
        self.label: dict[RuntimeKey, float] = {}  # runtime key of queued jobs -> its label
        self.pred: dict[RuntimeKey, float] = {}  # the predictions the labels were last set by
        self.ranked: list[tuple[float, float, RuntimeKey]] = []  # (prediction, label, key), ascending
        self.lanes: dict[Any, SortedKeys[SjfKey]] = {}
        self.running = _RunningByKey()  # kept here as it lives as long: until the state's indices are rebuilt
        # what the last sync saw: the stats' mark, a queued key come or gone, the keys with no runs
        self.mark = -1
        self.keys_moved = True
        self.no_runs: list[RuntimeKey] = []

    @staticmethod
    def of(state: ClusterState) -> _SjfLanes:
        q, stats = state.queue, state.stats
        lanes = q.listener
        if not isinstance(lanes, _SjfLanes):
            lanes = q.listener = _SjfLanes(q)
        added = None if lanes.keys_moved else stats.added_since(lanes.mark)
        lanes.mark, lanes.keys_moved = stats.mark, False
        predict = stats.predict
        if added is None:  # every queued key predicted anew
            preds = {r: predict(r, DEFAULT_RUNTIME_S) for r in q.by_rkey}
            lanes.sync(preds)
            lanes.no_runs = [r for r in preds if r not in stats.by_key]
        elif added:  # only the keys that ran, and those the median stands for, may have moved
            preds, moved = dict(lanes.pred), []
            for r in itertools.chain(added, lanes.no_runs):
                was = preds.get(r)
                if was is not None:  # queued
                    p = predict(r, DEFAULT_RUNTIME_S)
                    if p != was:
                        preds[r] = p
                        moved.append(r)
            lanes.sync(preds, moved)
            lanes.no_runs = [r for r in lanes.no_runs if r not in stats.by_key]
        return lanes

    def added(self, key: tuple[float, int, int], shape: Any, rkey: RuntimeKey) -> None:
        label = self.label.get(rkey)
        if label is not None:  # else its runtime key is new: ``sync`` files its jobs
            lane = self.lanes.get(shape)
            if lane is None:
                lane = self.lanes[shape] = SortedKeys()
            lane.add((key[0], label, key[1], key[2]))
        else:
            self.keys_moved = True

    def removed(self, key: tuple[float, int, int], shape: Any, rkey: RuntimeKey) -> None:
        label = self.label.get(rkey)
        if label is not None:
            lane = self.lanes[shape]
            lane.remove((key[0], label, key[1], key[2]))
            if not lane:
                del self.lanes[shape]
        if rkey not in self.q.by_rkey:  # its last job left
            self.keys_moved = True

    def sync(self, preds: dict[RuntimeKey, float], moved: list[RuntimeKey] | None = None) -> None:
        """Relabel for ``preds`` (``moved``: the keys changed since the last sync, if
        known). A changed or new key takes its tie's label, else the first of its
        own, its prediction or a midpoint that lies between its neighbours'."""
        ranked, old, label = self.ranked, self.pred, self.label
        if moved is None:
            moved = [r for r, p in preds.items() if old.get(r) != p]
        if not moved and len(preds) == len(old):  # no key new, so none gone either
            return
        if not self.label:  # nothing filed yet: one sort
            self._refile(preds)
            return
        changed = sorted(moved, key=lambda r: (preds[r], r))
        kept = len(preds) - sum(1 for r in moved if r not in old)  # keys of preds that were synced before
        gone = sorted(old.keys() - preds.keys()) if len(old) > kept else []  # no job of theirs waits: none is filed
        for r in itertools.chain(changed, gone):
            if r in old:  # out of the ranks (a changed one until placed again)
                del ranked[bisect.bisect_left(ranked, (old[r], label[r], r))]
        for r in gone:
            del label[r]
        moves: list[tuple[RuntimeKey, float | None]] = []
        for r in changed:
            p = preds[r]
            i = bisect.bisect_left(ranked, (p,))
            if i < len(ranked) and ranked[i][0] == p:
                at: float | None = ranked[i][1]
            else:
                lo, hi = ranked[i - 1][1] if i else -math.inf, ranked[i][1] if i < len(ranked) else math.inf
                at = _between(lo, hi, [label[r], p] if r in label else [p])
            if at is None:  # no float left between the neighbours: every key takes its prediction
                self._refile(preds)
                return
            bisect.insort(ranked, (p, at, r))
            if label.get(r) != at:
                moves.append((r, label.get(r)))
                label[r] = at
        self.pred = preds
        q, lanes = self.q, self.lanes
        for r, was in moves:
            at = label[r]
            for np_, o, j in q.by_rkey[r]:
                lane = lanes.get(q.shape_of[j])
                if lane is None:
                    lane = lanes[q.shape_of[j]] = SortedKeys()
                if was is not None:
                    lane.remove((np_, was, o, j))
                lane.add((np_, at, o, j))

    def _refile(self, preds: dict[RuntimeKey, float]) -> None:
        self.label, self.pred = dict(preds), preds
        self.ranked = sorted((p, p, r) for r, p in preds.items())
        self.lanes = {shape: SortedKeys([(np_, preds[r], o, j) for r, group in groups.items() for np_, o, j in group])
                      for shape, groups in self.q.shape_rkey.items()}


def _between(lo: float, hi: float, options: list[float]) -> float | None:
    """The first of ``options`` strictly between ``lo`` and ``hi``, else one that is (None: no float is)."""
    for x in options:
        if lo < x < hi:
            return x
    mid = hi - 1.0 if lo == -math.inf else lo + 1.0 if hi == math.inf else lo + (hi - lo) / 2
    return mid if lo < mid < hi else None


def _reservation(view: View, head: Job, ends: Iterable[End], ordered: bool = False) -> tuple[float, frozenset[int]]:
    """When and where ``head`` would fit as jobs end (``ordered``: ``ends`` is sorted).
    Capacity only grows, so count the able GPUs per node as ends free them and run
    ``best_fit`` only once some node has enough."""
    if not ordered:
        ends = sorted(ends, key=lambda e: (e[0], e[1]))
    if head.count > 1 and head.milli == FULL and _plain(head):
        return _whole_gang_reservation(view, head.count, ends)
    future = view.copy()
    need = max(head.count, 1)
    able = set(future.candidates(head))
    per_node: dict[str, int] = {}
    for i in able:
        per_node[future.node[i]] = per_node.get(future.node[i], 0) + 1
    enough = head.count == 0 or max(per_node.values(), default=0) >= need
    for end, _, idxs, milli, mem in ends:
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


def _whole_gang_reservation(view: View, k: int, ends: Iterable[End]) -> tuple[float, frozenset[int]]:
    """``_reservation`` of a plain head of ``k`` whole GPUs (the usual blocked gang),
    counting the all-free GPUs per node, without the general path's view copy: a share never
    exceeds FULL and a job holds a GPU once, so only an all-free GPU can take one of its GPUs."""
    free, node = list(view.free), view.node
    per_node: dict[str, int] = {}
    for i, f in enumerate(free):
        if f == FULL:
            per_node[node[i]] = per_node.get(node[i], 0) + 1
    enough = max(per_node.values(), default=0) >= k
    for end, _, idxs, milli, _ in ends:
        for i in idxs:
            before = free[i]
            free[i] = before + milli
            if before != FULL and free[i] == FULL:
                n = per_node[node[i]] = per_node.get(node[i], 0) + 1
                enough = enough or n >= k
        if enough:  # as in _reservation: best_fit's pick, at the first end where some node has k
            fit = _whole_gang(View(view.cap, view.default_node, free, view.mem), k, tightest=True)
            if fit is not None:
                return end, frozenset(fit)
    return math.inf, frozenset()


# --- fragmentation gradient descent (Weng et al., ATC'23) -----------------------


def fgd(state: ClusterState, now: float) -> list[Placement]:
    """Priority order; each job goes where expected fragmentation (over the recent shapes) grows least."""
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
        free = view.free
        for node, on in view.by_node(cands).items():
            if len(on) < job.count:
                continue
            node_frags = NodeFragments([free[i] for i in view.node_idx[node]], workload)
            before = node_frags.value()
            if job.count > 1 or job.milli == FULL:
                options = [on[: job.count]]
            else:
                # the result depends only on the GPU's free share: score each share once, at its lowest GPU
                lowest: dict[int, int] = {}
                for i in on:
                    f = free[i]
                    if i < lowest.get(f, i + 1):
                        lowest[f] = i
                options = [[i] for i in lowest.values()]
            for idxs in options:
                key = (node_frags.after([free[i] for i in idxs], job.milli) - before, idxs[0])
                if best is None or key < best:
                    best, pick = key, idxs
        return pick

    return _scan(state, now, choose)


POLICIES: dict[str, Policy] = {
    "fifo": fifo,
    "priority": priority,
    "best-fit": best_fit_policy,
    "fair-share": fair_share_policy,
    "sjf-backfill": sjf_backfill,
    "sjf-oracle": sjf_oracle,
    "fgd": fgd,
}


def decide(state: ClusterState, now: float) -> list[Placement]:
    """Run the state's current policy (the default when it is unknown)."""
    return POLICIES.get(state.policy, POLICIES[DEFAULT_POLICY])(state, now)
