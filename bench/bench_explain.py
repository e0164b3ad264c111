"""``explain`` of one job on a 10,000-job queue (target: under 0.5 s).

Times what the daemon does for ``explain``: the waiting reason, the forecast's
working copy and the forecast itself, for the first, the middle and the last
job submitted, on 64 GPUs all busy, with a runtime history of 2,000 finished
runs (the predictions a forecast runs on, and the kinds' runs its futures draw
from, folded as the daemon folds its log), the state frozen out of the
collector as the daemon's is once loaded. Prints wall and CPU seconds (CPU: a
shared machine); asserts nothing.
Run: python bench/bench_explain.py [--policy NAME] [--profile] (EVENTSCHED_PURE=1: the .py sources)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from eventsched import core
from eventsched.core.explain import waiting_reason
from eventsched.core.forecast import Calibration, run_forecast, working_copy
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.projections import collector
from eventsched.projections.cluster import ClusterState

QUEUED = 10_000
GPUS = 64
HISTORY = 2_000


def build(policy: str) -> tuple[ClusterState, float, Calibration]:
    """64 GPUs, a history of finished runs, every GPU busy, QUEUED jobs waiting."""
    rng = random.Random(1)
    state, now, calibration = ClusterState(), 1_000.0, Calibration()
    infos = [m.GpuInfo(gpu=i, uuid=f"GPU-{i}", model="fake", memory_total_mib=80_000) for i in range(GPUS)]

    def handle(msg: m.Message, at: float) -> list[ev.Event]:
        events, _ = core.handle(state, msg, at)
        calibration.fold(events)
        return events

    handle(m.Started(node="local", pid=1, version="b", gpu_backend="fake", gpus=infos,
                     config=m.SchedulerConfig(policy=policy)), now)

    def spec(i: int, gpus: float) -> ev.JobSpec:
        return ev.JobSpec(command=["run"], gpus=gpus, priority=i % 5, name=f"j{i % 7}", user=f"u{i % 11}")

    for i in range(HISTORY):  # one at a time: each runs a lognormal time around its kind's
        job = next(e.job for e in handle(m.Submit(spec=spec(i, 1.0)), now) if isinstance(e, ev.JobSubmitted))
        now += rng.lognormvariate(6 + i % 7 * 0.3, 0.8)
        handle(m.ProcessExited(job=job, exit_code=0), now)
    for i in range(GPUS):
        handle(m.Submit(spec=spec(i, 1.0)), now)
    shapes = [0.25, 0.5, 1.0, 2.0, 0.1]
    for i in range(QUEUED):
        handle(m.Submit(spec=spec(i, shapes[i % len(shapes)])), now + 1)
    return state, now + 600, calibration  # asked ten minutes later: the running jobs are part-way through


def explain(state: ClusterState, job: int, now: float, calibration: Calibration) -> tuple[float, float]:
    """Seconds (wall, CPU) for what the daemon does for ``explain`` of a queued job."""
    t, cpu = time.perf_counter(), time.process_time()
    waiting_reason(state, job, now)
    run_forecast(working_copy(state), now, {job}, calibration=calibration)
    return time.perf_counter() - t, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", action="append", help="default: best-fit, fair-share, fgd and sjf-backfill")
    ap.add_argument("--runs", type=int, default=5, help="runs per job; the fastest counts (a shared machine)")
    ap.add_argument("--profile", action="store_true", help="cProfile one explain of the middle job")
    args = ap.parse_args()
    for policy in args.policy or ["best-fit", "fair-share", "fgd", "sjf-backfill"]:
        state, now, calibration = build(policy)
        collector.freeze_survivors()  # as the daemon does once it has loaded its state
        queued = sorted(j.id for j in state.jobs.values() if j.state == "queued")
        print(f"{policy}: {len(queued)} queued, {GPUS} GPUs all busy, {HISTORY} finished runs")
        for label, job in (("first", queued[0]), ("middle", queued[len(queued) // 2]), ("last", queued[-1])):
            wall, cpu = min(explain(state, job, now, calibration) for _ in range(args.runs))
            f = run_forecast(working_copy(state), now, {job}, calibration=calibration)
            where = f"starts in {(f.starts[job] - now) / 3600:.1f} h" if job in f.starts else "beyond the forecast"
            print(f"  explain of the {label:<6} job submitted  best of {args.runs}: {wall:6.3f} s "
                  f"({cpu:6.3f} s CPU)   ({where})")
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(explain, state, queued[len(queued) // 2], now, calibration)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        collector.thaw()


if __name__ == "__main__":
    main()
