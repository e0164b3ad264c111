"""Replay speed: a 100,000-job synthetic workload on 64 GPUs, the Alibaba
openb trace (8,152 pods, dynamic replay), and replay time against the time to
read and decode the same log.

    .venv/bin/python bench/bench_replay.py [--jobs 100000] [--policy best-fit] [--skip-alibaba]

Targets: 100k jobs < 10 s; Alibaba < 5 s. Prints figures only.

Figures measured so far: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

from eventsched.domain.messages import GpuInfo
from eventsched.sim.simulator import simulate
from eventsched.sim.sources import alibaba_workload, trace_workload
from eventsched.sim.traces import TraceJob
from eventsched.storage import log as eventlog

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


def synthetic(n: int, gpus: int, seed: int = 1) -> list[TraceJob]:
    """Poisson arrivals at ~85 % offered load; a mix of shares and gangs."""
    rng = random.Random(seed)
    shapes = [0.25, 0.5, 0.5, 1.0, 1.0, 1.0, 2.0, 4.0]
    jobs = []
    mean_dur = 600.0
    mean_gpus = sum(shapes) / len(shapes)
    gap = mean_dur * mean_gpus / (0.85 * gpus)
    t = 0.0
    for i in range(n):
        t += rng.expovariate(1 / gap)
        jobs.append(TraceJob(submit_time=round(t, 3), duration=round(rng.expovariate(1 / mean_dur) + 1, 3),
                             gpus=rng.choice(shapes), user=f"u{rng.randrange(8)}", priority=rng.choice([0, 0, 0, 1])))
    return jobs


def read_decode_s(log_dir: Path) -> float:
    t0 = time.perf_counter()
    n = sum(len(b) for b in eventlog.read_batches(log_dir))
    dt = time.perf_counter() - t0
    return dt, n


def _instrument() -> list[float]:
    """Wrap core.handle to time it (the rest is the simulator and the log)."""
    import eventsched.sim.simulator as replay

    acc = [0.0]
    inner = replay.core.handle
    clock = time.perf_counter

    class Timed:
        @staticmethod
        def handle(state, msg, now):  # type: ignore[no-untyped-def]
            t = clock()
            try:
                return inner(state, msg, now)
            finally:
                acc[0] += clock() - t

    replay.core = Timed  # type: ignore[assignment]
    return acc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--policy", action="append")
    ap.add_argument("--instrument", action="store_true", help="also time core.handle alone")
    ap.add_argument("--skip-alibaba", action="store_true")
    ap.add_argument("--alibaba-full", action="store_true",
                    help="the whole 1,213-node cluster instead of the default 1/16 node sample")
    args = ap.parse_args()
    policies = args.policy or ["best-fit", "fifo"]
    tmp = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    infos = [GpuInfo(gpu=i, uuid=f"fake-{i}", model="fake", memory_total_mib=81_920) for i in range(args.gpus)]
    work = trace_workload("synthetic", "csv", synthetic(args.jobs, args.gpus), [("local", infos)], f"fake:{args.gpus}")
    core_s = _instrument() if args.instrument else None
    for p in policies:
        if core_s:
            core_s[0] = 0.0
        r = simulate(work, p, tmp / f"syn-{p}")
        if core_s:
            print(f"  core.handle {core_s[0]:.2f} s, simulator + log writing {r.wall_s - core_s[0]:.2f} s")
        rd, n = read_decode_s(tmp / f"syn-{p}" / "log")
        print(f"synthetic {args.jobs} jobs / {args.gpus} GPUs, {p:<12}: {r.wall_s:6.2f} s "
              f"({args.jobs / r.wall_s:,.0f} jobs/s, {r.events:,} events); read+decode {rd:.3f} s "
              f"-> replay = {r.wall_s / rd:.1f}x reading the log", flush=True)
    if not args.skip_alibaba:
        pods = TRACES / "openb_pod_list_default.csv"
        # a full collection of what the synthetic replays left is due now: not inside the timing
        gc.collect()
        t0 = time.perf_counter()
        share = 1.0 if args.alibaba_full else None
        kw = {"node_share": share} if share else {}
        aw = alibaba_workload(pods, TRACES / "openb_node_list_gpu_node.csv", **kw)
        load_s = time.perf_counter() - t0
        for p in policies:
            r = simulate(aw, p, tmp / f"ali-{p}")
            rd, n = read_decode_s(tmp / f"ali-{p}" / "log")
            print(f"alibaba {len(aw.attempts)} GPU pods ({aw.notes[0].split(': ')[-1]}), {p:<12}: {r.wall_s:6.2f} s (+{load_s:.2f} s loading) "
                  f"({len(aw.attempts) / r.wall_s:,.0f} jobs/s, {r.events:,} events); read+decode {rd:.3f} s "
                  f"-> {r.wall_s / rd:.1f}x", flush=True)
    print(f"logs under {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
