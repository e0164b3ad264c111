"""What-if: the metrics of replays (or of a real log), side by side.

Every metric is a pure fold of the schedule alone (``_SCHEDULE``), so a
daemon's log and its exact replay give identical figures; docs/whatif-metrics.md
defines each one. The read model computes the same waits by SQL: a test holds them equal.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from eventsched.domain import events as ev
from eventsched.domain.states import FINAL, TRANSITIONS, IllegalTransition, JobState, move
from eventsched.domain.text import table as aligned
from eventsched.domain.units import FULL, format_duration
from eventsched.storage import log as eventlog

__all__ = ["Metrics", "metrics_from_log", "metrics_from_events", "compare", "format_comparison", "ROWS"]

NUMPY_FROM = 256  # GPUs from which the fragmentation scan uses numpy

# the events that make a job's schedule; the horizon is the last of them
_JOB_EVENTS: frozenset[type] = frozenset({
    ev.JobSubmitted, ev.JobPlaced, ev.JobStarted, ev.JobExited, ev.JobLost, ev.JobCancelled, ev.JobRequeued,
})
# the schedule and its GPUs; samples, timers, daemon starts and stops are left
# out: a daemon logs them at other times than a simulator does
_SCHEDULE: frozenset[type] = _JOB_EVENTS | frozenset({
    ev.JobHeld, ev.JobReleased, ev.JobUpdated, ev.GpuDiscovered, ev.GpuPaused, ev.GpuResumed, ev.GpuErrored,
})
_MOVES = frozenset(event_type for _, event_type in TRANSITIONS)  # the job events after a submission
QUEUED, RUNNING = JobState.QUEUED, JobState.RUNNING


class Metrics(msgspec.Struct, kw_only=True):
    jobs: int = 0
    finished: int = 0
    started: int = 0
    gpus: int = 0
    makespan_s: float = 0.0
    mean_wait_s: float = 0.0
    median_wait_s: float = 0.0
    p95_wait_s: float = 0.0
    mean_turnaround_s: float = 0.0
    gpu_utilization: float = 0.0
    fragmentation: float = 0.0
    fairness: float = 1.0
    users: int = 0
    # per tenant: jobs, mean wait, GPU-hours and their share of all
    tenant_fairness: float = 1.0
    tenants: dict[str, dict[str, float]] = {}


def _quantile(xs: Sequence[float], q: float) -> float:
    """As numpy's default: linear between order statistics."""
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class _Frag:
    """Free capacity and the shapes that wait, integrated over time."""

    def __init__(self) -> None:
        self.free: dict[tuple[str, int], int] = {}  # usable GPUs only
        self.off: set[tuple[str, int]] = set()  # paused or lost
        self.used: dict[tuple[str, int], int] = {}
        self.waiting: dict[tuple[int, int], int] = {}  # (count, milli) -> jobs
        self.dirty = True
        self.cached = (0, 0)
        self.free_int = 0.0  # free GPU-seconds while someone waited (milli)
        self.unusable_int = 0.0

    def gpu(self, key: tuple[str, int]) -> None:
        """A GPU discovered, or found again after it was lost: usable."""
        self.used.setdefault(key, 0)
        self.set_off(key, False)

    def _sync(self, key: tuple[str, int]) -> None:
        if key in self.off:
            self.free.pop(key, None)
        else:
            self.free[key] = FULL - self.used.get(key, 0)
        self.dirty = True

    def take(self, node: str, ids: list[int], milli: int, sign: int) -> None:
        for g in ids:
            key = (node, g)
            self.used[key] = self.used.get(key, 0) + sign * milli
            self._sync(key)

    def set_off(self, key: tuple[str, int], off: bool) -> None:
        (self.off.add if off else self.off.discard)(key)
        self._sync(key)

    def wait(self, shape: tuple[int, int], sign: int) -> None:
        if not shape[0]:
            return
        n = self.waiting.get(shape, 0) + sign
        if n:
            self.waiting[shape] = n
        else:
            del self.waiting[shape]
        self.dirty = True

    def advance(self, dt: float) -> None:
        if self.dirty:
            self.cached, self.dirty = self._measure(), False
        free, unusable = self.cached
        self.free_int += free * dt
        self.unusable_int += unusable * dt

    def _measure(self) -> tuple[int, int]:
        if not self.waiting:
            return sum(f for f in self.free.values() if f > 0), 0
        frac_min = min((m for (k, m) in self.waiting if k == 1 and m < FULL), default=FULL + 1)
        whole_min = min((k for (k, m) in self.waiting if m >= FULL), default=1 << 30)
        if len(self.free) >= NUMPY_FROM:
            return self._measure_np(frac_min, whole_min)
        full_on = Counter(node for (node, _), f in self.free.items() if f == FULL)
        total = unusable = 0
        for (node, _), f in self.free.items():
            if f > 0:
                total += f
                if not (f >= frac_min or (f == FULL and full_on[node] >= whole_min)):
                    unusable += f
        return total, unusable

    def _measure_np(self, frac_min: int, whole_min: int) -> tuple[int, int]:
        import numpy as np

        keys = list(self.free)
        nodes: dict[str, int] = {}
        node_idx = np.fromiter((nodes.setdefault(n, len(nodes)) for n, _ in keys), dtype=np.int64, count=len(keys))
        free = np.fromiter(self.free.values(), dtype=np.int64, count=len(keys))
        full = free == FULL
        full_on = np.bincount(node_idx, weights=full, minlength=len(nodes))
        ok = (free >= frac_min) | (full & (full_on[node_idx] >= whole_min))
        pos = free > 0
        return int(free[pos].sum()), int(free[pos & ~ok].sum())


def _shape(g: float) -> tuple[int, int]:
    """(GPUs, milli-share of each) of a request of ``g`` GPUs."""
    return (0, 0) if g <= 0 else (1, max(1, round(g * FULL))) if g < 1 else (int(g), FULL)


def metrics_from_log(log_dir: str | os.PathLike[str]) -> Metrics:
    return metrics_from_events(eventlog.read(log_dir))


def metrics_from_events(events: Any, states: dict[int, str] | None = None) -> Metrics:
    """The metrics of ``events``; an event the transition table refuses is left out."""
    state: dict[int, str] = {} if states is None else states
    stop: dict[int, str] = {}  # why each running job was asked to stop, if it was
    submitted: dict[int, float] = {}
    user: dict[int, str] = {}
    tenant: dict[int, str] = {}
    shape: dict[int, tuple[int, int]] = {}
    first_start: dict[int, float] = {}
    ended: dict[int, float] = {}
    open_place: dict[int, tuple[float, str, list[int], int]] = {}  # job -> (from, node, ids, milli)
    spans: list[tuple[int, float, float, float]] = []  # (job, from, to, gpus) of each placement
    frag = _Frag()
    gpus: set[tuple[str, int]] = set()
    first_ts: float | None = None
    last_job_ts = 0.0
    clock: float | None = None

    def end_place(job: int, ts: float) -> None:
        p = open_place.pop(job, None)
        if p is not None:
            t0, node, ids, milli = p
            spans.append((job, t0, ts, milli * len(ids) / FULL))
            frag.take(node, ids, milli, -1)

    at_horizon = (0.0, 0.0)  # the fragmentation integrals up to the last job event
    for e in events:
        tp = type(e)
        was = ""
        if tp in _MOVES:
            job = e.job
            was = state.get(job, "")
            try:
                to = state[job] = move(was, e, stop.get(job, ""))
            except IllegalTransition:
                continue
            if tp is ev.JobCancelRequested or tp is ev.JobPlaced:
                stop[job] = e.reason if tp is ev.JobCancelRequested else ""
        if tp not in _SCHEDULE:
            continue  # samples, timers, daemon starts: when they were logged is not the schedule
        ts = e.ts
        # integrate from the first submission: idle time before it is not the schedule's
        if first_ts is not None and clock is not None and ts > clock:
            frag.advance(ts - clock)
        clock = ts if clock is None else max(clock, ts)
        if tp is ev.GpuDiscovered:
            key = (e.node, e.gpu)
            gpus.add(key)
            frag.gpu(key)
        elif tp is ev.GpuPaused or tp is ev.GpuResumed or (tp is ev.GpuErrored and e.lost):
            frag.set_off((e.node, e.gpu), tp is not ev.GpuResumed)
        elif tp is ev.JobSubmitted:
            job = e.job
            submitted[job] = ts
            if first_ts is None:
                first_ts = ts
            user[job] = e.spec.user
            tenant[job] = e.spec.tenant or "default"
            shape[job] = _shape(e.spec.gpus)
            state[job] = QUEUED
            frag.wait(shape[job], 1)
        elif tp is ev.JobUpdated and e.gpus is not None and was:  # a waiting job asks for other GPUs now
            if was == QUEUED:
                frag.wait(shape[e.job], -1)
                frag.wait(_shape(e.gpus), 1)
            shape[e.job] = _shape(e.gpus)
        elif was:  # a job event the table allowed: waiting, placed and ended follow from the states
            if (was == QUEUED) != (to == QUEUED):
                frag.wait(shape[job], 1 if to == QUEUED else -1)
            if was == RUNNING != to:
                end_place(job, ts)
            if to in FINAL:
                ended[job] = ts
            elif was in FINAL:
                ended.pop(job, None)
            if tp is ev.JobPlaced:
                milli = round(e.share * FULL) if e.gpu_ids else 0
                open_place[job] = (ts, e.node, list(e.gpu_ids), milli)
                frag.take(e.node, e.gpu_ids, milli, 1)
            elif tp is ev.JobStarted:
                first_start.setdefault(job, ts)
        if tp in _JOB_EVENTS:
            last_job_ts = ts
            at_horizon = (frag.free_int, frag.unusable_int)

    m = Metrics(jobs=len(submitted), gpus=len(gpus), finished=len(ended), started=len(first_start))
    if first_ts is None:
        return m
    horizon = last_job_ts
    for job in list(open_place):
        end_place(job, horizon)
    m.makespan_s = max(0.0, horizon - first_ts)
    waits = sorted(first_start[j] - submitted[j] for j in first_start if j in submitted)
    if waits:
        m.mean_wait_s, m.median_wait_s, m.p95_wait_s = sum(waits) / len(waits), _quantile(waits, 0.5), _quantile(waits, 0.95)
    turn = [ended[j] - submitted[j] for j in ended if j in submitted]
    if turn:
        m.mean_turnaround_s = sum(turn) / len(turn)
    allocated = sum(gpus_ * (t1 - t0) for _, t0, t1, gpus_ in spans)
    if gpus and m.makespan_s > 0:
        m.gpu_utilization = allocated / (len(gpus) * m.makespan_s)
    free_int, unusable_int = at_horizon
    m.fragmentation = unusable_int / free_int if free_int > 0 else 0.0
    window = max(max(submitted.values()), first_ts + m.makespan_s / 2)  # fairness in the arrival window
    m.users, m.fairness = _jain(spans, submitted, window, user)
    _, m.tenant_fairness = _jain(spans, submitted, window, tenant)
    m.tenants = _per_tenant(spans, tenant, submitted, first_start, window)
    return m


def _jain(spans: list[tuple[int, float, float, float]], submitted: dict[int, float], window: float,
          group: dict[int, str]) -> tuple[int, float]:
    """(groups, Jain's index over them of GPU-time got / demanded in the window)."""
    demand: dict[str, float] = {}
    got: dict[str, float] = {}
    for job, t0, t1, g in spans:
        if g <= 0 or submitted.get(job, math.inf) > window:
            continue
        u = group[job]
        demand[u] = demand.get(u, 0.0) + g * (t1 - t0)
        got[u] = got.get(u, 0.0) + g * max(0.0, min(t1, window) - t0)
    xs = [min(1.0, got.get(u, 0.0) / d) for u, d in demand.items() if d > 0]
    sq = sum(x * x for x in xs)
    return len(xs), (sum(xs) ** 2) / (len(xs) * sq) if xs and sq > 0 else (1.0 if len(xs) <= 1 else 0.0)


def _per_tenant(spans: list[tuple[int, float, float, float]], tenant: dict[int, str], submitted: dict[int, float],
                first_start: dict[int, float], window: float) -> dict[str, dict[str, float]]:
    """Per tenant: jobs, mean wait, GPU-hours, and its share of those run in the arrival
    window (where a policy's choice shows: in the end everyone had all they asked)."""
    out: dict[str, dict[str, float]] = {}
    for job, t in tenant.items():
        row = out.setdefault(t, {"jobs": 0, "waits": 0, "wait_sum": 0.0, "gpu_hours": 0.0, "in_window": 0.0})
        row["jobs"] += 1
        if job in first_start:
            row["waits"] += 1
            row["wait_sum"] += first_start[job] - submitted[job]
    for job, t0, t1, g in spans:
        row = out[tenant[job]]
        row["gpu_hours"] += g * (t1 - t0) / 3600.0
        row["in_window"] += g * max(0.0, min(t1, window) - t0) / 3600.0
    total = sum(r["in_window"] for r in out.values())
    return {t: {"jobs": r["jobs"], "mean_wait_s": r["wait_sum"] / r["waits"] if r["waits"] else 0.0,
                "gpu_hours": r["gpu_hours"], "gpu_hours_share": r["in_window"] / total if total else 0.0}
            for t, r in sorted(out.items())}


# --- the comparison ----------------------------------------------------------------------

# (key, label, format) of each row of the table
ROWS: list[tuple[str, str, str]] = [
    ("jobs", "jobs", "{:d}"), ("finished", "finished", "{:d}"), ("makespan_s", "makespan", "dur"),
    ("mean_wait_s", "mean wait", "dur"), ("median_wait_s", "median wait", "dur"), ("p95_wait_s", "p95 wait", "dur"),
    ("mean_turnaround_s", "mean turnaround", "dur"), ("gpu_utilization", "GPU utilisation", "pct"),
    ("fragmentation", "fragmentation", "pct"), ("fairness", "fairness (Jain)", "{:.3f}"),
    ("tenant_fairness", "fairness, tenants", "{:.3f}"),
]


def compare(results: Sequence[Any], *, baseline: tuple[str, str | os.PathLike[str]] | None = None) -> dict[str, Any]:
    """A JSON-ready comparison of replays, each measured from its own log;
    ``baseline`` = (label, log dir) adds a column for a recording itself."""
    rows = []
    if baseline is not None:
        rows.append({"policy": baseline[0], "log": str(baseline[1]), **msgspec.to_builtins(metrics_from_log(baseline[1]))})
    for r in results:
        log_dir = os.path.join(r.state_dir, "log")
        rows.append({"policy": r.policy, "log": log_dir, **msgspec.to_builtins(metrics_from_log(log_dir)), "events": r.events,
                     "refused": r.refused, "unfinished": r.unfinished, "wall_s": round(r.wall_s, 3)})
    notes = list(dict.fromkeys(n for r in results for n in r.notes))
    source = results[0].source if results else (str(baseline[1]) if baseline else "")
    return {"source": source, "replays": rows, "notes": notes}


def _fmt(value: Any, how: str) -> str:
    if value is None:
        return "-"
    return (format_duration(float(value), "decimal") if how == "dur" else f"{100 * float(value):.1f} %"
            if how == "pct" else how.format(value))


def format_comparison(table: dict[str, Any]) -> str:
    cols = table["replays"]
    rows = [[label, *(_fmt(c.get(key), how) for c in cols)] for key, label, how in ROWS]
    tenants = sorted({t for c in cols for t in (c.get("tenants") or {})})
    tenants = tenants if len(tenants) > 1 else []  # one tenant: nothing to compare
    for t in tenants:
        of = [(c.get("tenants") or {}).get(t) for c in cols]
        rows.append(["  " + t, *("-" if r is None else f"{_fmt(r['mean_wait_s'], 'dur')} / "
                                 f"{_fmt(r['gpu_hours_share'], 'pct')}" for r in of)])
    lines = aligned(["", *(str(c["policy"]) for c in cols)], rows, right=[False] + [True] * len(cols)).split("\n")
    if tenants:
        lines.insert(len(ROWS) + 1, "\nper tenant: mean wait / share of the GPU-hours run in the arrival window")
    head = f"replay of {table['source']}" if table.get("source") else "replay"
    return "\n".join([head, "", *lines, *(f"note: {n}" for n in table.get("notes", []))])
