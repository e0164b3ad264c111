"""When will a queued job start, and how sure is that?

The scheduler's own core runs forward on copies of the state, over ``SAMPLES``
sampled futures of the running jobs' ends; a job's forecast is its median start
over them, and its 80 % range is scaled by how recent forecasts erred
(docs/whatif-metrics.md). Pure: the state is never changed.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from eventsched.core import scheduler as core
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.domain.states import JobState
from eventsched.projections import collector
from eventsched.projections.cluster import ClusterState, Job, runtime_key
from eventsched.projections.model import TenantUsage, time_limit_of

_ACTIVE = (JobState.QUEUED, JobState.RUNNING, JobState.HELD)

__all__ = ["Forecast", "Calibration", "shown", "range_basis", "forecast_starts", "run_forecast", "working_copy",
           "describe", "ASSUMPTIONS", "MAX_STEPS"]

DEFAULT_RUNTIME_S = 3600.0  # a job nobody has seen run: an hour (as sjf-backfill assumes)
MAX_STEPS = 2000  # simulated exits per forecast: beyond that, "not within the forecast"
ASSUMPTIONS = "if running jobs take their predicted times and nobody submits a job that goes first"
SLACK_S = 10.0  # scores compare waits plus 10 s: a second off a wait of a second is no failure
MIN_SCORES = 20
WINDOW = 500  # the most recent forecasts scored: the workload drifts
LOOK_BACK = 100_000  # events a daemon reads back for them: a first explain stays quick on a long log
RUNS_KEPT = 200  # each kind's most recent runs: its spread, as the workload drifts
JOBS_KEPT = 100_000  # jobs whose kind is remembered, the most recent
KINDS_KEPT = 10_000  # kinds whose runs are kept, those that ran last
MIN_RUNS = 3  # a kind with fewer runs is predicted as the core predicts it
GUESS = (math.log(0.5), math.log(3.0))  # the range before there is anything to score
SAMPLES = 9  # futures sampled: the median start over them is steadier than any one's
SAMPLE_JOBS = 2_000  # beyond this many jobs to copy, the copies cost more than one future: one is run


class Forecast(msgspec.Struct, frozen=True, kw_only=True):
    starts: dict[int, float]  # queued job -> estimated start (UNIX seconds), the median
    low: dict[int, float] = {}  # its 80 % range: 10th percentile
    high: dict[int, float] = {}  # and 90th
    calibrated: bool = False  # the range rests on MIN_SCORES scored forecasts, not the guess
    made_at: float
    horizon: float  # how far the forecast ran (a job not in starts starts after this, if ever)
    complete: bool  # every wanted job got a start
    blind: bool = False  # no run had finished yet: every runtime was the 1-hour default


class Calibration:
    """The last ``WINDOW`` forecasts shown scored against their ``JobPlaced``, and each kind's recent run times."""

    def __init__(self) -> None:
        self.seq = 0  # the last event folded
        self.open: dict[int, tuple[float, float]] = {}  # job -> (made at, forecast wait)
        self.scores: deque[float] = deque(maxlen=WINDOW)
        self.kind: dict[int, tuple[str, str]] = {}  # job -> its runtime key (the last JOBS_KEPT submitted)
        self.since: dict[int, float] = {}  # running job -> when it started
        self.runs: dict[tuple[str, str], deque[float]] = {}  # kind -> its last RUNS_KEPT run times (s)
        self._lock = threading.Lock()  # one catch-up at a time; readers copy what they read

    def catch_up(self, read: Callable[[int], Iterable[list[ev.Event]]], last_seq: int) -> None:
        """Fold the log past what was folded: ``read(seq)`` gives its events from ``seq`` on."""
        with self._lock:
            for batch in read(max(self.seq + 1, last_seq - LOOK_BACK)):
                self.fold(batch)

    def fold(self, events: list[ev.Event]) -> None:
        for e in events:
            self.seq = max(self.seq, e.seq)
            if isinstance(e, ev.JobForecast):
                self.open.pop(e.job, None)  # the newest forecast of a job counts, once
                self.open[e.job] = (e.ts, e.estimated_start - e.ts)
                if len(self.open) > WINDOW:
                    del self.open[next(iter(self.open))]
            elif isinstance(e, ev.JobSubmitted):
                self.kind[e.job] = runtime_key(e.spec)
                if len(self.kind) > JOBS_KEPT:
                    del self.kind[next(iter(self.kind))]
            elif isinstance(e, (ev.JobPlaced, ev.JobStarted)):
                self.since[e.job] = e.ts
            elif isinstance(e, ev.JobExited):
                began, key = self.since.pop(e.job, None), self.kind.get(e.job)
                if began is not None and key is not None:  # the kinds that ran last are kept
                    runs = self.runs.pop(key, None) or deque(maxlen=RUNS_KEPT)
                    runs.append(e.ts - began)
                    self.runs[key] = runs
                    if len(self.runs) > KINDS_KEPT:
                        del self.runs[next(iter(self.runs))]
            if isinstance(e, (ev.JobPlaced, ev.JobCancelled)) and e.job in self.open:
                made, wait = self.open.pop(e.job)
                if isinstance(e, ev.JobPlaced):
                    self.scores.append(_score(e.ts - made, wait))

    def runs_of(self, key: tuple[str, str]) -> list[float]:
        """The kind's recent run times (s), ascending."""
        with self._lock:
            return sorted(self.runs.get(key, ()))

    def bounds(self, now: float) -> tuple[float, float] | None:
        """The 10th and 90th percentile scores (None: too few yet). Forecasts still open count
        with the wait so far, a lower bound, so the longest waits are not left out."""
        scores = sorted(list(self.scores) + [_score(now - made, wait) for made, wait in list(self.open.values())])
        if len(scores) < MIN_SCORES:
            return None
        return scores[len(scores) // 10], scores[min(len(scores) - 1, len(scores) * 9 // 10)]


def _score(actual_wait: float, forecast_wait: float) -> float:
    return math.log((max(0.0, actual_wait) + SLACK_S) / (max(0.0, forecast_wait) + SLACK_S))


def _scaled(wait: float, score: float) -> float:
    return max(0.0, (wait + SLACK_S) * math.exp(score) - SLACK_S)


def _predicted(state: ClusterState, job: Job) -> float:
    p = state.stats.predict(runtime_key(job.spec), DEFAULT_RUNTIME_S)
    limit = time_limit_of(job, state.config.default_time_limit_s)
    return min(p, limit) if limit is not None else p


def _running_remaining(state: ClusterState, job: Job, ran: float, all_runs: list[int],
                       calibration: Calibration | None, salt: int = 0) -> float:
    """How much longer a running job runs, having run ``ran`` s: as one of its kind's
    recent runs that lasted longer did (as long again if none did), so that the
    first of many to end comes sooner than any one's mean end. A kind with fewer
    than ``MIN_RUNS`` runs goes as ``_remaining`` says."""
    runs = calibration.runs_of(runtime_key(job.spec)) if calibration is not None else []
    if len(runs) < MIN_RUNS:
        return _remaining(state, job, ran, all_runs)
    rest = _pick(runs, ran, job, salt)
    return _within_limit(state, job, ran, rest - ran if rest is not None else ran)


def _pick(runs: list[float] | list[int], ran: float, job: Job, salt: int = 0) -> float | None:
    """One of the sorted ``runs`` longer than ``ran``, spread by job id and future, not random (None: none)."""
    i = bisect.bisect_right(runs, ran)
    u = (job.id * 0.6180339887 + salt * 0.7548776662) % 1  # a different spread for each future
    return runs[i + int(u * (len(runs) - i))] if i < len(runs) else None


def _remaining(state: ClusterState, job: Job, ran: float, runs: list[int]) -> float:
    """Its prediction less ``ran``; past it, as one of all ``runs`` (ms) that lasted as long did."""
    p = _predicted(state, job)
    if ran < p:
        return p - ran
    rest = _pick(runs, ran * 1000, job)
    return _within_limit(state, job, ran, rest / 1000 - ran if rest is not None else ran)


def _within_limit(state: ClusterState, job: Job, ran: float, rest: float) -> float:
    limit = time_limit_of(job, state.config.default_time_limit_s)
    return min(rest, limit - ran) if limit is not None else rest


def forecast_starts(state: ClusterState, now: float, wanted: set[int] | None = None,
                    max_steps: int = MAX_STEPS, calibration: Calibration | None = None) -> Forecast:
    return run_forecast(working_copy(state), now, wanted, max_steps, calibration)


@collector.paused()  # a copy of a long queue would set off full collections of the whole heap
def working_copy(state: ClusterState) -> ClusterState:
    """A copy of what a forecast needs, without the finished jobs the active ones do not wait for."""
    sim = ClusterState()
    sim.last_seq, sim.node, sim.policy, sim.config = state.last_seq, state.node, state.policy, state.config
    sim.cluster, sim.nodes = state.cluster, dict(state.nodes)  # what check_spec asks of a cluster
    sim.gpus = {k: g.copy() for k, g in state.gpus.items()}
    keep = {j.id for j in state.jobs.values() if j.state in _ACTIVE}
    keep |= {d for jid in list(keep) for d in state.jobs[jid].spec.after if d in state.jobs}
    sim.jobs = {jid: state.jobs[jid].copy() for jid in keep}
    sim.next_job_id, sim.next_order = state.next_job_id, state.next_order
    sim.recent_shapes = type(state.recent_shapes)(state.recent_shapes, maxlen=state.recent_shapes.maxlen)
    sim.stats.by_key = dict(state.stats.by_key)
    sim.stats.sorted = state.stats.sorted
    sim.tenants = dict(state.tenants)
    sim.reservations, sim.last_reservation = dict(state.reservations), state.last_reservation
    sim.usage = {t: TenantUsage(u.recent, u.as_of) for t, u in state.usage.items()}
    sim._derive()
    return sim


@collector.paused()  # its steps make garbage without cycles, and the copy's objects look long-lived
def run_forecast(sim: ClusterState, now: float, wanted: set[int] | None, max_steps: int = MAX_STEPS,
                 calibration: Calibration | None = None) -> Forecast:
    """Run the core forward on ``sim`` (a copy: it is changed)."""
    queued = {j.id for j in sim.jobs.values() if j.state == JobState.QUEUED}
    wanted = queued if wanted is None else wanted & queued
    blind = not sim.stats.sorted
    if not wanted:
        return Forecast(starts={}, made_at=now, horizon=now, complete=True)
    # a pristine copy for the other futures, while copies are cheap; all share ``max_steps``
    spare = working_copy(sim) if calibration is not None and SAMPLES > 1 and len(sim.jobs) <= SAMPLE_JOBS else None
    runs = [_forward(sim, now, wanted, max_steps, calibration, 0)]
    steps = runs[0][2]
    while spare is not None and len(runs) < SAMPLES and steps + runs[-1][2] <= max_steps:
        last = len(runs) == SAMPLES - 1
        runs.append(_forward(spare if last else working_copy(spare), now, wanted, max_steps, calibration, len(runs)))
        steps += runs[-1][2]
    # the median start over the futures (one that never started it: after them all)
    mids = {j: statistics.median_low(r[0].get(j, math.inf) for r in runs) for j in wanted}
    starts = {j: mid for j, mid in mids.items() if math.isfinite(mid)}
    complete = len(starts) == len(wanted)
    t = max(r[1] for r in runs)
    known = calibration.bounds(now) if calibration is not None else None
    lo, hi = known or GUESS
    return Forecast(starts=starts, made_at=now, horizon=t if not complete else max(starts.values(), default=now),
                    complete=complete, blind=blind, calibrated=known is not None,
                    low={j: now + min(_scaled(s - now, lo), s - now) for j, s in starts.items()},
                    high={j: now + max(_scaled(s - now, hi), s - now) for j, s in starts.items()})


def _forward(sim: ClusterState, now: float, wanted: set[int], max_steps: int,
             calibration: Calibration | None, salt: int) -> tuple[dict[int, float], float, int]:
    """One sampled future (``salt``): the placements' starts, how far it ran, in how many steps."""
    ends: list[tuple[float, int, str, int]] = []
    order = itertools.count()  # ties go in the order pushed
    all_runs = sim.stats.sorted
    for jid in sim.running:
        job = sim.jobs[jid]
        ran = now - (job.started_at if job.started_at is not None else now)
        rest = _running_remaining(sim, job, ran, all_runs, calibration, salt)
        # what waits for an end does not start "at the next decision"
        ends.append((now + max(1.0, rest), next(order), "end", jid))
    heapq.heapify(ends)
    starts: dict[int, float] = {}
    t = now

    def feed(msg: m.Message, at: float) -> None:
        events, effects = core.handle(sim, msg, at)
        for e in events:
            if isinstance(e, ev.JobPlaced):
                if e.job in wanted:
                    starts[e.job] = at
                heapq.heappush(ends, (at + _predicted(sim, sim.jobs[e.job]), next(order), "end", e.job))
        for eff in effects:
            if isinstance(eff, m.Signal):  # a stop asked (a time limit, a preemption): it ends after the grace
                heapq.heappush(ends, (at + min(eff.grace_s, 1.0), next(order), "end", eff.job))
            elif isinstance(eff, m.WakeAt) and eff.at > at:
                heapq.heappush(ends, (eff.at, next(order), "tick", 0))

    feed(m.Tick(), now)  # what could start right now (backoff over, a fresh decision)
    steps = 0
    while ends and len(starts) < len(wanted) and steps < max_steps:
        t, _, kind, jid = heapq.heappop(ends)
        steps += 1
        if kind == "tick":
            feed(m.Tick(), t)
            continue
        ending = sim.jobs.get(jid)
        if ending is None or ending.state != JobState.RUNNING:
            continue  # ended already (a stop and its predicted end both queued)
        feed(m.ProcessExited(job=jid, exit_code=0), t)
    return starts, t, steps


def shown(f: Forecast, job: int, now: float) -> dict[str, Any]:
    """What ``explain`` and ``queue --json`` show of ``job``'s forecast (None: beyond it)."""
    start = f.starts.get(job)
    return {"estimated_start": start, "estimated_start_p10": f.low.get(job), "estimated_start_p90": f.high.get(job),
            "calibrated": f.calibrated, "text": describe(start, now, f.low.get(job), f.high.get(job))}


def range_basis(f: Forecast) -> str:
    if f.calibrated:
        return "; the 80 % range from how the recent forecasts shown here erred"
    return f"; the 80 % range is a wide guess until {MIN_SCORES} forecasts shown here can be checked"


def describe(start: float | None, now: float, low: float | None = None, high: float | None = None) -> str:
    """"in about 12 min (80 %: 5 min to 40 min)" for a person (None: beyond the forecast)."""
    if start is None:
        return "not within the forecast (too many jobs ahead, or it cannot fit what will free)"
    wait = start - now  # under a second is not "now": it waits for the next decision
    text = "at the next decision" if wait < 1 else f"in about {_span(wait)}"
    if low is not None and high is not None:
        text += f" (80 %: {_span(low - now)} to {_span(high - now)})"
    return text


def _span(wait: float) -> str:
    wait = max(0.0, wait)
    if wait < 90:
        return f"{wait:.0f} s"
    if wait < 5400:
        return f"{wait / 60:.0f} min"
    if wait < 2 * 86400:
        return f"{wait / 3600:.1f} h"
    return f"{wait / 86400:.1f} days" if math.isfinite(wait) else "never"
