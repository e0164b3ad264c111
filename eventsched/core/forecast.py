"""When will a queued job start? (issue 17, "when will my job start").

The scheduler's own core runs forward from a copy of the current state on a
virtual clock: every running job is taken to end at its predicted time (F14:
the mean of the same user's runs of the same job, else the median of all
runs, capped by its time limit), each end is fed to ``core.handle`` as an
exit, and the placements the policy then makes are the forecast starts. No
second model: the forecast is what this scheduler would do *if running jobs
take their predicted times and nobody submits a job that goes first*.

Pure: the state passed in is never changed.
"""

from __future__ import annotations

import heapq
import math

import msgspec

from eventsched.core import scheduler as core
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.domain.states import JobState
from eventsched.projections.cluster import (
    ClusterState,
    Job,
    runtime_key,
    state_from_snapshot,
)
from eventsched.projections.model import TenantUsage, time_limit_of

_ACTIVE = (JobState.QUEUED, JobState.RUNNING, JobState.HELD)

__all__ = ["Forecast", "forecast_starts", "forecast_from_snapshot", "run_forecast", "working_copy", "describe", "ASSUMPTIONS", "MAX_STEPS"]

DEFAULT_RUNTIME_S = 3600.0  # a job nobody has seen run: an hour (as sjf-backfill assumes)
MAX_STEPS = 2000  # simulated exits per forecast: beyond that, "not within the forecast"
ASSUMPTIONS = "if running jobs take their predicted times and nobody submits a job that goes first"


class Forecast(msgspec.Struct, frozen=True, kw_only=True):
    starts: dict[int, float]  # queued job -> estimated start (UNIX seconds)
    made_at: float
    horizon: float  # how far the forecast ran (a job not in starts starts after this, if ever)
    complete: bool  # every wanted job got a start
    blind: bool = False  # no run had finished yet: every runtime was the 1-hour default


def _predicted(state: ClusterState, job: Job) -> float:
    p = state.stats.predict(runtime_key(job.spec), DEFAULT_RUNTIME_S)
    limit = time_limit_of(job, state.config.default_time_limit_s)
    return min(p, limit) if limit is not None else p


def forecast_starts(state: ClusterState, now: float, wanted: set[int] | None = None,
                    max_steps: int = MAX_STEPS) -> Forecast:
    """Estimated start of each queued job in ``wanted`` (default: all)."""
    return run_forecast(working_copy(state), now, wanted, max_steps)


def forecast_from_snapshot(data: bytes, now: float, wanted: set[int] | None = None,
                           max_steps: int = MAX_STEPS) -> Forecast:
    """``forecast_starts`` of the state ``data`` holds (``snapshot_bytes``)."""
    return run_forecast(state_from_snapshot(data), now, wanted, max_steps)


def working_copy(state: ClusterState) -> ClusterState:
    """A copy of what a forecast needs: the GPUs, the waiting and running jobs
    (and the jobs they wait for), the runtime history, the tenants. Finished
    jobs are left out, so the copy costs what is active, not all history."""
    sim = ClusterState()
    sim.last_seq, sim.node, sim.policy, sim.config = state.last_seq, state.node, state.policy, state.config
    sim.gpus = {k: g.copy() for k, g in state.gpus.items()}
    keep = {j.id for j in state.jobs.values() if j.state in _ACTIVE}
    keep |= {d for jid in list(keep) for d in state.jobs[jid].spec.after if d in state.jobs}
    sim.jobs = {jid: state.jobs[jid].copy() for jid in keep}
    sim.next_job_id, sim.next_order = state.next_job_id, state.next_order
    sim.recent_shapes = type(state.recent_shapes)(state.recent_shapes, maxlen=state.recent_shapes.maxlen)
    sim.stats.by_key = dict(state.stats.by_key)
    sim.stats.sorted = list(state.stats.sorted)
    sim.tenants = dict(state.tenants)
    sim.usage = {t: TenantUsage(u.recent, u.as_of) for t, u in state.usage.items()}
    sim._derive()
    return sim


def run_forecast(sim: ClusterState, now: float, wanted: set[int] | None, max_steps: int = MAX_STEPS) -> Forecast:
    """Run the core forward on ``sim`` (a copy: it is changed)."""
    queued = {j.id for j in sim.jobs.values() if j.state == JobState.QUEUED}
    wanted = queued if wanted is None else wanted & queued
    blind = not sim.stats.sorted
    if not wanted:
        return Forecast(starts={}, made_at=now, horizon=now, complete=True)
    # (time, order, kind, job): ends of running jobs and the core's wake-ups
    ends: list[tuple[float, int, str, int]] = []
    n = 0
    for jid in sim.running:
        job = sim.jobs[jid]
        start = job.started_at if job.started_at is not None else now
        ends.append((max(now, start + _predicted(sim, job)), n, "end", jid))
        n += 1
    heapq.heapify(ends)
    starts: dict[int, float] = {}
    t = now

    def feed(msg: m.Message, at: float) -> None:
        nonlocal n
        events, effects = core.handle(sim, msg, at)
        for e in events:
            if isinstance(e, ev.JobPlaced):
                if e.job in wanted:
                    starts[e.job] = at
                heapq.heappush(ends, (at + _predicted(sim, sim.jobs[e.job]), n, "end", e.job))
                n += 1
        for eff in effects:
            if isinstance(eff, m.Signal):  # a stop asked (a time limit, a preemption): it ends after the grace
                heapq.heappush(ends, (at + min(eff.grace_s, 1.0), n, "end", eff.job))
                n += 1
            elif isinstance(eff, m.WakeAt) and eff.at > at:
                heapq.heappush(ends, (eff.at, n, "tick", 0))
                n += 1

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
    complete = len(starts) == len(wanted)
    return Forecast(starts=starts, made_at=now, horizon=t if not complete else max(starts.values(), default=now),
                    complete=complete, blind=blind)


def describe(start: float | None, now: float) -> str:
    """"in about 12 min" for a person (None: beyond the forecast)."""
    if start is None:
        return "not within the forecast (too many jobs ahead, or it cannot fit what will free)"
    wait = max(0.0, start - now)
    if wait < 1:
        return "now"
    if wait < 90:
        return f"in about {wait:.0f} s"
    if wait < 5400:
        return f"in about {wait / 60:.0f} min"
    if wait < 2 * 86400:
        return f"in about {wait / 3600:.1f} h"
    return f"in about {wait / 86400:.1f} days" if math.isfinite(wait) else "never"
