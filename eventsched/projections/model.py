"""The indices ``cluster.ClusterState`` keeps so that a decision never walks
every GPU or every queued job; only its fold changes them."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from eventsched.domain import events as ev
from eventsched.domain.messages import SchedulerConfig
from eventsched.domain.states import IllegalTransition
from eventsched.domain.tenants import DEFAULT_TENANT
from eventsched.domain.units import FULL, utc_month
from eventsched.projections.live import Gpu, Job
from eventsched.projections.sortedkeys import SortedKeys

__all__ = ["RECENT_SHAPES", "DEFAULT_RUNTIME_S", "Gpu", "Job", "usable", "Capacity", "fit_summary", "request_of",
           "runtime_key", "QueueIndex", "RuntimeStats", "TenantUsage", "time_limit_of", "free_memory_of",
           "tenant_of", "shape_of"]

RECENT_SHAPES = 1000  # requests remembered for fragmentation-aware placement
RECENT_RUNS = 64  # runtime keys of the runs last added, for ``RuntimeStats.added_since``
DEFAULT_RUNTIME_S = 3600.0  # prediction when there is no history at all


def usable(gpu: Gpu, cfg: SchedulerConfig) -> bool:
    """May this GPU receive a new job? (not paused, not lost, under the health thresholds)"""
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


class Capacity:
    """Free share and memory of the usable GPUs in (node, id) order (with
    ``avoid_foreign_gpus``, a stranger's last on their node): kept in step GPU
    by GPU, rebuilt only when the set of usable GPUs changes."""

    def __init__(self, gpus: list[Gpu], cfg: SchedulerConfig) -> None:
        ok = [g for g in gpus if usable(g, cfg)]
        if cfg.avoid_foreign_gpus:  # stable: (node, id) order otherwise
            ok.sort(key=lambda g: (g.node, g.foreign_memory_mib > 0))
        self.foreign = [g.foreign_memory_mib > 0 for g in ok]
        self.node = [g.node for g in ok]
        self.id = [g.id for g in ok]
        self.free = [FULL - g.used_milli for g in ok]
        self.mem = [free_memory_of(g) for g in ok]
        self.index = {(g.node, g.id): i for i, g in enumerate(ok)}
        self.nodes: list[str] = []  # in order
        self.node_idx: dict[str, list[int]] = {}  # node -> its indices, in order
        for i, node in enumerate(self.node):
            if node not in self.node_idx:
                self.nodes.append(node)
                self.node_idx[node] = []
            self.node_idx[node].append(i)
        # shapes that found no room here: a memo valid until some GPU's free
        # share or memory grows, as shrinking cannot make them fit
        self.no_fit: set[tuple[Any, ...]] = set()
        # the largest free share, kept until a GPU's changes (-1: not known):
        # a submission to a full cluster is answered without copying ``free``
        self.max_known = -1

    def set_gpu(self, i: int, free: int, mem: int) -> None:
        """GPU index ``i`` now has ``free`` share and ``mem`` MiB free."""
        if free > self.free[i] or mem > self.mem[i]:
            self.no_fit.clear()  # a shape that found no room may find it now
        if free != self.free[i]:
            self.max_known = -1
        self.free[i] = free
        self.mem[i] = mem

    def max_free(self) -> int:
        """The largest free share of one GPU (0 with no usable GPU)."""
        if self.max_known < 0:
            most = self.free[0] if self.free else 0
            for f in self.free:  # compiled, a loop beats max()'s call and rich compares
                if f > most:
                    most = f
            self.max_known = most
        return self.max_known

    def same(self, other: Capacity) -> bool:
        """Equal capacity (the no-fit memo is a cache, not part of it)."""
        return (self.node, self.id, self.free, self.mem, self.index, self.nodes, self.node_idx) == (
            other.node, other.id, other.free, other.mem, other.index, other.nodes, other.node_idx)


def fit_summary(gpus: list[Gpu], mem_mib: int) -> tuple[int, int, int]:
    """Of ``gpus`` not lost: (most with at least ``mem_mib`` on one node, how
    many, the largest memory)."""
    pool = [g for g in gpus if not g.lost]
    per_node: dict[str, int] = {}
    for g in pool:
        if g.memory_total_mib >= mem_mib:
            per_node[g.node] = per_node.get(g.node, 0) + 1
    largest = max((g.memory_total_mib for g in pool), default=0)
    return max(per_node.values(), default=0), len(pool), largest


def request_of(spec: ev.JobSpec) -> tuple[int, int]:
    """(number of GPUs, milli-share of each) for a spec's ``gpus``."""
    g = spec.gpus
    if g <= 0:
        return (0, 0)
    if g < 1:
        return (1, max(1, round(g * FULL)))
    return (int(g), FULL)


def time_limit_of(job: Job, default: float | None) -> float | None:
    """The tighter of the job's own limit and ``default`` (None: no limit)."""
    own = job.spec.time_limit_s
    own = own if own is not None and own > 0 else None
    default = default if default is not None and default > 0 else None
    if own is None or default is None:
        return own if default is None else default
    return min(own, default)


def free_memory_of(gpu: Gpu) -> int:
    """Memory a new job may reserve on ``gpu``: what neither our reservations,
    the observed use of our jobs, nor processes outside the scheduler hold."""
    used = gpu.memory_used_mib or 0
    foreign = max(0, gpu.foreign_memory_mib)
    ours = max(0, used - foreign)
    return gpu.memory_total_mib - foreign - max(gpu.reserved_mib, ours)


def tenant_of(job: Job) -> str:
    """``job.tenant`` again, compiled: the fold asks it (and ``shape_of``) for every placement
    and end (tests/test_backlog_structures.py checks they agree)."""
    return job.spec.tenant or DEFAULT_TENANT


def shape_of(job: Job) -> tuple[Any, ...]:
    """``job.shape``: what placement depends on."""
    s = job.spec
    ids = None if s.gpu_ids is None else tuple(s.gpu_ids)
    return (job.count, job.milli, s.gpu_mem_mib, ids, s.node, s.tenant, s.array_id if s.array_cap else 0)


def runtime_key(spec: ev.JobSpec) -> tuple[str, str]:
    """Jobs predicted alike: same user and same name (or command)."""
    return (spec.user, spec.name or " ".join(spec.command))


class QueueIndex:
    """Queued jobs in the orders policies scan them, kept sorted incrementally.

    ``shape_queue`` holds each shape's jobs as (-priority, order, id): a decision
    merges the heads of the shapes that fit instead of walking past the others.
    The other orders (``by_priority``, ``by_order``, and the groups by runtime
    key ``by_rkey`` and ``shape_rkey``) are built when first asked for, then
    kept in step: a daemon that never asks pays nothing for them.
    """

    def __init__(self, aging_per_hour: float = 0.0, tiers: bool = True) -> None:
        # a waiting job gains a priority tier each time the clock passes a multiple of
        # 3600 / aging_per_hour s, all at once, so ``floor(aging x queued_at) - priority``
        # orders them for good (docs/fair-share.md); without tiers it is unfloored
        self.aging = aging_per_hour / 3600.0
        self.tiers = tiers
        self.milli_counts: dict[int, int] = {}  # share asked -> queued jobs asking it
        self.min_known = -1  # min(milli_counts), kept until a share comes or goes (-1: not known)
        self.shape_of: dict[int, tuple[Any, ...]] = {}
        self.by_shape: dict[tuple[Any, ...], dict[int, None]] = {}
        self.shape_queue: dict[tuple[Any, ...], SortedKeys[tuple[float, int, int]]] = {}
        self.rkey_of: dict[int, tuple[str, str]] = {}  # runtime-prediction key of each queued job
        self.own_limits = 0  # queued jobs with a time limit of their own (their predictions may be shorter)
        self._orders = False
        self._by_priority: SortedKeys[tuple[float, int, int]] = SortedKeys()
        self._by_order: SortedKeys[tuple[int, int]] = SortedKeys()
        self._groups = False
        self._by_rkey: dict[tuple[str, str], SortedKeys[tuple[float, int, int]]] = {}
        self._shape_rkey: dict[tuple[Any, ...], dict[tuple[str, str], SortedKeys[tuple[float, int, int]]]] = {}
        # told of each job that enters or leaves, (key, shape, runtime key): an
        # order a policy keeps in step across decisions (sjf-backfill's lanes)
        self.listener: Any = None

    def __len__(self) -> int:
        return len(self.shape_of)

    def key(self, job: Job) -> tuple[float, int, int]:
        """The job's place in priority order: (aged -priority, order, id)."""
        return (self.aged(job.queued_at) - job.spec.priority, job.order, job.id)

    def aged(self, t: float) -> float:
        """What being queued at ``t`` adds to a key: lower is older."""
        if not self.aging:
            return 0.0
        return float(math.floor(self.aging * t)) if self.tiers else self.aging * t

    def _keys(self) -> list[Any]:
        """Every queued job's key (the objects the shapes' queues hold)."""
        return [key for lane in self.shape_queue.values() for key in lane]

    @property
    def by_priority(self) -> SortedKeys[tuple[float, int, int]]:
        self.build_orders()
        return self._by_priority

    @property
    def by_order(self) -> SortedKeys[tuple[int, int]]:
        self.build_orders()
        return self._by_order

    def build_orders(self) -> None:
        """Build the priority and submission orders now (if not yet)."""
        if not self._orders:
            keys = self._keys()
            self._by_priority = SortedKeys(keys)
            self._by_order = SortedKeys([(k[1], k[2]) for k in keys])
            self._orders = True

    @property
    def by_rkey(self) -> dict[tuple[str, str], SortedKeys[tuple[float, int, int]]]:
        self.build_groups()
        return self._by_rkey

    @property
    def shape_rkey(self) -> dict[tuple[Any, ...], dict[tuple[str, str], SortedKeys[tuple[float, int, int]]]]:
        self.build_groups()
        return self._shape_rkey

    def build_groups(self) -> None:
        """Build the runtime-key groups now (if not yet)."""
        if self._groups:
            return
        by_rkey: dict[tuple[str, str], list[Any]] = {}
        shape_rkey: dict[tuple[Any, ...], dict[tuple[str, str], list[Any]]] = {}
        for shape, lane in self.shape_queue.items():
            mine = shape_rkey.setdefault(shape, {})
            for key in lane:
                rkey = self.rkey_of[key[2]]
                by_rkey.setdefault(rkey, []).append(key)
                mine.setdefault(rkey, []).append(key)
        self._by_rkey = {r: SortedKeys(keys) for r, keys in by_rkey.items()}
        self._shape_rkey = {s: {r: SortedKeys(keys) for r, keys in groups.items()} for s, groups in shape_rkey.items()}
        self._groups = True

    def add(self, job: Job) -> None:
        # Any: one boxed tuple shared by every index below (compiled, a typed
        # tuple is a C struct, boxed anew for each container it goes into)
        key: Any = self.key(job)
        n = self.milli_counts.get(job.milli, 0)
        if not n:
            self.min_known = -1
        self.milli_counts[job.milli] = n + 1
        shape = shape_of(job)
        self.shape_of[job.id] = shape
        self.by_shape.setdefault(shape, {})[job.id] = None
        lane = self.shape_queue.get(shape)
        if lane is None:
            lane = self.shape_queue[shape] = SortedKeys()
        lane.add(key)
        rkey = runtime_key(job.spec)
        self.rkey_of[job.id] = rkey
        self.own_limits += job.spec.time_limit_s is not None
        if self._orders:
            self._by_priority.add(key)
            self._by_order.add((job.order, job.id))
        if self._groups:
            _group(self._by_rkey, rkey).add(key)
            _group(self._shape_rkey.setdefault(shape, {}), rkey).add(key)
        if self.listener is not None:
            self.listener.added(key, shape, rkey)

    def remove(self, job: Job) -> None:
        shape = self.shape_of.get(job.id)
        if shape is None:
            raise IllegalTransition(f"job {job.id} is not in the queue")
        key: Any = self.key(job)  # boxed once (see add)
        lane = self.shape_queue[shape]
        if not lane.remove(key):
            raise IllegalTransition(f"job {job.id} is not in the queue at its place")
        if not lane:
            del self.shape_queue[shape]
        del self.shape_of[job.id]
        n = self.milli_counts[job.milli] - 1
        if n:
            self.milli_counts[job.milli] = n
        else:
            del self.milli_counts[job.milli]
            self.min_known = -1
        members = self.by_shape[shape]
        del members[job.id]
        if not members:
            del self.by_shape[shape]
        rkey = self.rkey_of.pop(job.id)
        self.own_limits -= job.spec.time_limit_s is not None
        if self._orders:
            self._by_priority.remove(key)
            self._by_order.remove((job.order, job.id))
        if self._groups:
            _drop(self._by_rkey, rkey, key)
            groups = self._shape_rkey[shape]
            _drop(groups, rkey, key)
            if not groups:
                del self._shape_rkey[shape]
        if self.listener is not None:
            self.listener.removed(key, shape, rkey)

    def min_milli(self) -> int:
        """Smallest share any queued job asks for (0 for CPU-only; FULL+1 if empty)."""
        if self.min_known < 0:
            self.min_known = min(self.milli_counts, default=FULL + 1)
        return self.min_known


def _group(groups: dict[Any, SortedKeys[tuple[float, int, int]]], name: Any) -> SortedKeys[tuple[float, int, int]]:
    """``groups[name]``, made empty if there is none."""
    group = groups.get(name)
    if group is None:
        group = groups[name] = SortedKeys()
    return group


def _drop(groups: dict[Any, SortedKeys[tuple[float, int, int]]], name: Any, key: Any) -> None:
    """Remove ``key`` from the group ``groups[name]`` (and the group once empty)."""
    group = groups[name]
    group.remove(key)
    if not group:
        del groups[name]


class TenantUsage:
    """What one tenant holds now, and its recent use for fair share: GPU-seconds
    decayed with half-life ``H`` as of ``as_of``; with ``rate`` GPUs held since,
    ``recent x 2^-(t-as_of)/H + rate x H/ln2 x (1 - 2^-(t-as_of)/H)`` at t,
    read in O(1) and updated only by a placement or an end.
    """

    __slots__ = ("milli", "mem", "jobs", "recent", "as_of", "month_used", "month_start", "month_end")

    def __init__(self, recent: float = 0.0, as_of: float = 0.0, month_used: float = 0.0) -> None:
        self.milli = 0  # milli-GPUs held (count x share)
        self.mem = 0  # MiB reserved (count x per-GPU)
        self.jobs = 0
        self.recent = recent
        self.as_of = as_of
        # GPU-seconds used in the calendar month (UTC) of ``as_of``, up to it: what a budget counts
        self.month_used = month_used
        self.month_start, self.month_end = utc_month(as_of)

    def at(self, t: float, half_life_s: float) -> float:
        """Recent usage (GPU-seconds, decayed) at time ``t``."""
        dt = t - self.as_of
        if dt <= 0 or half_life_s <= 0:
            return self.recent
        f = 2.0 ** (-dt / half_life_s)
        return self.recent * f + self.milli / FULL * half_life_s / math.log(2) * (1.0 - f)

    def month_at(self, t: float) -> float:
        """GPU-seconds used in the calendar month (UTC) of ``t``, up to ``t`` (not before ``as_of``)."""
        if self.month_start <= t < self.month_end:
            start, base = self.month_start, self.month_used
        else:  # a new month: what was used before it does not count
            start, base = utc_month(t)[0], 0.0
        return base + self.milli / FULL * max(0.0, t - max(self.as_of, start))

    def advance(self, t: float, half_life_s: float) -> None:
        if t > self.as_of:
            self.recent = self.at(t, half_life_s)
            self.month_used = self.month_at(t)
            if not self.month_start <= t < self.month_end:
                self.month_start, self.month_end = utc_month(t)
            self.as_of = t

    def held(self) -> tuple[int, int, int]:
        return (self.milli, self.mem, self.jobs)


class RuntimeStats:
    """Run times of finished runs, in integer ms so that sums do not depend on
    the order the runs ended in; part of the snapshot (retried runs leave no other trace)."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, str], tuple[int, int]] = {}
        self._runs: SortedKeys[int] = SortedKeys()  # every run's ms, in blocks (see ``sorted``)
        # runs not yet in ``_runs``: sorted in only when the median or the list is asked for
        self._pending: list[int] = []
        # the median (s; None: no runs) until a run is added: asked again at every decision
        self._median: float | None = None
        self._median_known = False
        # runs added so far (for ``added_since``), the first mark still answered for, the last runs' keys
        self.mark = 0
        self._base = 0
        self._recent: deque[tuple[str, str]] = deque(maxlen=RECENT_RUNS)

    def add(self, key: tuple[str, str], runtime_s: float) -> None:
        ms = max(0, round(runtime_s * 1000))
        n, total = self.by_key.get(key, (0, 0))
        self.by_key[key] = (n + 1, total + ms)
        self._pending.append(ms)
        self._median_known = False
        self.mark += 1
        self._recent.append(key)

    def added_since(self, mark: int) -> list[tuple[str, str]] | None:
        """The runtime keys of the runs added since ``mark`` (an earlier
        ``self.mark``; None: unknown): only their predictions changed, and,
        when any run was added, those of keys with no runs (the median moved)."""
        n = self.mark - mark
        if mark < self._base or n > len(self._recent) or n < 0:
            return None
        return list(self._recent)[len(self._recent) - n:] if n else []

    def _all_runs(self) -> SortedKeys[int]:
        """Every run's ms in order, the pending ones sorted in first."""
        if self._pending:
            runs = self._runs
            for ms in self._pending:
                runs.add(ms)
            self._pending = []
        return self._runs

    @property
    def sorted(self) -> list[int]:
        """Every run's time in ms, ascending (a copy: snapshots and forecasts)."""
        return list(self._all_runs())

    @sorted.setter
    def sorted(self, runs: list[int]) -> None:
        self._runs = SortedKeys(runs)
        self._pending = []
        self._median_known = False
        self.mark += 1  # set with ``by_key`` (never apart): every prediction may have changed
        self._base = self.mark
        self._recent.clear()

    def median(self) -> float | None:
        if not self._median_known:
            s = self._all_runs()
            m = len(s) // 2
            self._median = None if not s else (s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2) / 1000
            self._median_known = True
        return self._median

    def predict(self, key: tuple[str, str], default: float = 3600.0) -> float:
        """Mean of the same user's runs of the same job, else the median of all."""
        hit = self.by_key.get(key)
        if hit is not None:  # a division: cheaper than any memo of it
            return hit[1] / hit[0] / 1000
        med = self.median()
        return default if med is None else med
