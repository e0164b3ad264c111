"""``explain`` of one job on a 10,000-job queue (target: under 0.5 s).

Times what the daemon does for ``explain``: the waiting reason, the forecast's
working copy and the forecast itself, for the first, the middle and the last
job submitted, on 64 GPUs all busy, with a runtime history of 2,000 finished
runs (the predictions a forecast runs on). Prints figures; asserts nothing.
sjf-backfill is not in the default list: on this queue each of its decisions
walks most of the queue, so a forward run of it is slow whatever the forecast does.
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
from eventsched.core.forecast import run_forecast, working_copy
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.projections.cluster import ClusterState

QUEUED = 10_000
GPUS = 64
HISTORY = 2_000


def build(policy: str) -> tuple[ClusterState, float]:
    """64 GPUs, a history of finished runs, every GPU busy, QUEUED jobs waiting."""
    rng = random.Random(1)
    state, now = ClusterState(), 1_000.0
    infos = [m.GpuInfo(gpu=i, uuid=f"GPU-{i}", model="fake", memory_total_mib=80_000) for i in range(GPUS)]
    core.handle(state, m.Started(node="local", pid=1, version="b", gpu_backend="fake", gpus=infos,
                                 config=m.SchedulerConfig(policy=policy)), now)

    def spec(i: int, gpus: float) -> ev.JobSpec:
        return ev.JobSpec(command=["run"], gpus=gpus, priority=i % 5, name=f"j{i % 7}", user=f"u{i % 11}")

    for i in range(HISTORY):  # one at a time: each runs a lognormal time around its kind's
        events, _ = core.handle(state, m.Submit(spec=spec(i, 1.0)), now)
        now += rng.lognormvariate(6 + i % 7 * 0.3, 0.8)
        core.handle(state, m.ProcessExited(job=events[0].job, exit_code=0), now)
    for i in range(GPUS):
        core.handle(state, m.Submit(spec=spec(i, 1.0)), now)
    shapes = [0.25, 0.5, 1.0, 2.0, 0.1]
    for i in range(QUEUED):
        core.handle(state, m.Submit(spec=spec(i, shapes[i % len(shapes)])), now + 1)
    return state, now + 600  # asked ten minutes later: the running jobs are part-way through


def explain(state: ClusterState, job: int, now: float) -> tuple[float, float]:
    """Seconds (wall, CPU) for what the daemon does for ``explain`` of a queued job."""
    t, cpu = time.perf_counter(), time.process_time()
    waiting_reason(state, job, now)
    run_forecast(working_copy(state), now, {job})
    return time.perf_counter() - t, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", action="append", help="default: best-fit, fair-share and fgd")
    ap.add_argument("--runs", type=int, default=5, help="runs per job; the fastest counts (a shared machine)")
    ap.add_argument("--profile", action="store_true", help="cProfile one explain of the middle job")
    args = ap.parse_args()
    for policy in args.policy or ["best-fit", "fair-share", "fgd"]:
        state, now = build(policy)
        queued = sorted(j.id for j in state.jobs.values() if j.state == "queued")
        print(f"{policy}: {len(queued)} queued, {GPUS} GPUs all busy, {HISTORY} finished runs")
        for label, job in (("first", queued[0]), ("middle", queued[len(queued) // 2]), ("last", queued[-1])):
            wall, cpu = min(explain(state, job, now) for _ in range(args.runs))
            f = run_forecast(working_copy(state), now, {job})
            where = f"starts in {(f.starts[job] - now) / 3600:.1f} h" if job in f.starts else "beyond the forecast"
            print(f"  explain of the {label:<6} job submitted  best of {args.runs}: {wall:6.3f} s "
                  f"({cpu:6.3f} s CPU)   ({where})")
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(explain, state, queued[len(queued) // 2], now)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
