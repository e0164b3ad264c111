"""Decisions that do not grow with the backlog.

Two seeded plain-CSV workloads of 100,000 jobs on ``fake:64:81920``
(durations uniform 60-7,200 s, GPU requests from 0.25, 0.5, 1, 1, 2, 4,
20 users, priorities 0-2), differing only in the mean gap between
submissions: 100 s (about 0.8x offered load) and 20 s (about 4x, the backlog
grows to tens of thousands). Prints the replay time of each and their ratio
(target: within 2x, both under 10 s), then the core decision time with
100,000 queued jobs in 50 shapes on 64 GPUs, per policy (target: p99 < 1 ms),
with the shapes mixed at random and with the fitting ones behind the rest.

    .venv/bin/python bench/bench_backlog.py [--jobs 100000] [--policy best-fit]
        [--skip-replay] [--skip-core] [--core-policy NAME ...]

Prints figures only; asserts nothing.

Figures measured so far: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import tempfile
import time
from pathlib import Path

from eventsched import core
from eventsched.core.policies import POLICIES
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.projections.cluster import ClusterState
from eventsched.sim.simulator import simulate
from eventsched.sim.sources import load_source

GPUS = "fake:64:81920"
REQUESTS = [0.25, 0.5, 1, 1, 2, 4]
GAPS = {"0.8x (mean gap 100 s)": 100.0, "4x (mean gap 20 s)": 20.0}
QUEUED = 100_000


def write_workload(path: Path, n: int, mean_gap: float, seed: int = 16) -> None:
    """The CSV workload: Poisson arrivals with ``mean_gap``."""
    rng = random.Random(seed)
    t = 0.0
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["submit_time", "duration", "gpus", "user", "priority"])
        for _ in range(n):
            t += rng.expovariate(1 / mean_gap)
            w.writerow([round(t, 3), round(rng.uniform(60, 7200), 3), rng.choice(REQUESTS),
                        f"u{rng.randrange(20)}", rng.randrange(3)])


def replay_s(path: Path, policy: str) -> float:
    """Wall time of ``eventsched replay`` minus the CLI: load and simulate."""
    t0 = time.perf_counter()
    workload = load_source(path, gpus=GPUS)
    with tempfile.TemporaryDirectory() as out:
        simulate(workload, policy, out)
    return time.perf_counter() - t0


def bench_replay(n: int, policy: str) -> None:
    times = {}
    with tempfile.TemporaryDirectory() as d:
        for label, gap in GAPS.items():
            path = Path(d) / f"gap{gap:g}.csv"
            write_workload(path, n, gap)
            times[label] = replay_s(path, policy)
            print(f"  replay {n:,} jobs, {label:<24} {policy}: {times[label]:7.1f} s", flush=True)
    quiet, busy = times.values()
    print(f"  ratio overloaded / quiet: {busy / quiet:.1f}x (target <= 2x)", flush=True)


def build(policy: str, big_first: bool) -> tuple[ClusterState, float]:
    """64 GPUs all busy, QUEUED jobs waiting in 50 shapes.

    Uniform: 5 requests x 10 memory sizes, drawn at random. Big-first: what an
    overloaded best-fit queue turns into, 99 % gangs of 2-8 GPUs (45 shapes,
    priorities 1-2) in front of 1 % small jobs (5 shapes, priority 0), so the
    GPU an exit frees fits only jobs at the back.
    """
    state = ClusterState()
    now = 1_000.0
    infos = [m.GpuInfo(gpu=i, uuid=f"g{i}", model="fake", memory_total_mib=81_920) for i in range(64)]
    core.handle(state, m.Started(node="local", pid=1, version="b", gpu_backend="fake", gpus=infos,
                                 config=m.SchedulerConfig(node="local", policy=policy, max_queued=200_000)), now)
    for _ in range(64):
        core.handle(state, m.Submit(spec=ev.JobSpec(command=["run"], gpus=1, name="fill")), now)
    rng = random.Random(16)
    for i in range(QUEUED):
        small = not big_first or i % 100 == 0
        gpus = rng.choice([0.25, 0.5, 1.0, 2.0, 4.0] if not big_first else [0.25, 0.5, 1.0, 0.75, 0.125] if small
                          else [2.0, 4.0, 8.0])
        mem = 1000 * rng.randrange(10 if not big_first else 1 if small else 15)
        prio = rng.randrange(3) if not big_first else 0 if small else 1 + rng.randrange(2)
        spec = ev.JobSpec(command=["run", str(i)], gpus=gpus, gpu_mem_mib=mem, priority=prio,
                          name=f"j{i % 7}", user=f"u{i % 20}", uid=1000 + i % 20)
        core.handle(state, m.Submit(spec=spec), now)
    return state, now


def report(label: str, ms: list[float]) -> None:
    ms = sorted(ms)
    print(f"    {label:<40} p50 {statistics.median(ms):7.3f} ms   p99 {ms[int(len(ms) * 0.99) - 1]:7.3f} ms",
          flush=True)


def bench_core(policy: str, big_first: bool, n: int = 300) -> None:
    state, now = build(policy, big_first)
    mix = "big-first" if big_first else "uniform"
    print(f"  {policy}: {len(state.queue):,} queued in {len(state.queue.by_shape)} shapes ({mix}), 64 GPUs, all busy",
          flush=True)
    sub = []
    for _ in range(n):
        t = time.perf_counter()
        events, _ = core.handle(state, m.Submit(spec=ev.JobSpec(command=["x"], gpus=0.5)), now)
        sub.append((time.perf_counter() - t) * 1e3)
        submitted = events[0]
        assert isinstance(submitted, ev.JobSubmitted)
        core.handle(state, m.Cancel(jobs=[submitted.job], uid=0), now)
    report("Submit (machine full)", sub)
    ex = []
    for _ in range(n):  # a job ends: the exit, then the placement of the next job(s)
        jid = min(state.running)
        t = time.perf_counter()
        core.handle(state, m.ProcessExited(job=jid, exit_code=0), now)
        ex.append((time.perf_counter() - t) * 1e3)
    report("ProcessExited -> place the next job(s)", ex)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--policy", default="best-fit", help="replay policy")
    ap.add_argument("--core-policy", action="append", help="default: every policy")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--skip-core", action="store_true")
    args = ap.parse_args()
    if not args.skip_replay:
        bench_replay(args.jobs, args.policy)
    if not args.skip_core:
        for big_first in (False, True):
            for policy in args.core_policy or list(POLICIES):
                bench_core(policy, big_first)


if __name__ == "__main__":
    main()
