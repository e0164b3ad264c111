"""24 hours of GPU samples on 8 GPUs: log growth per day, idle daemon CPU.

Log growth. The engine's own path for a sample, on a virtual clock: every
``--interval`` seconds (the default sample interval, 2 s) each GPU gives a
``GpuObserved``; ``gpus.significant`` (what the engine's ``gpus.SampleFilter``
asks) decides whether it is logged; a logged one goes through
``core.handle`` and its events are appended to a real log on disk (fdatasync
per batch, as the daemon commits one batch per sampling round). 24 simulated
hours run in seconds; the figure is the log's size on disk after them. Two
loads: idle GPUs (``FakeBackend``: constant readings, logged once a minute
when stale) and busy GPUs (utilisation, memory and temperature as a bounded
random walk, steps as large as real training jobs show).

Idle daemon CPU. A real ``eventsched serve --gpus fake:8`` with nothing to do,
at the default sample interval and at 10x faster (0.2 s), for ``--idle-s``
seconds each: CPU seconds from /proc, as a share of one core and per day.

    .venv/bin/python bench/bench_samples.py [--hours 24] [--idle-s 60]

Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemon_harness import Daemon  # noqa: E402

from eventsched import core  # noqa: E402
from eventsched.domain import messages as m  # noqa: E402
from eventsched.domain.messages import GpuObserved  # noqa: E402
from eventsched.projections.cluster import ClusterState  # noqa: E402
from eventsched.runtime import gpus as gpus_module  # noqa: E402
from eventsched.runtime.gpus import FakeBackend, significant  # noqa: E402
from eventsched.storage import log as eventlog  # noqa: E402

GPUS = 8
MEM = 81_920


def busy_walk(rng: random.Random, n: int) -> list[list[float]]:
    """Per GPU: [utilisation %, memory MiB, temperature C], a bounded random walk."""
    return [[rng.uniform(60, 100), rng.uniform(20_000, 70_000), rng.uniform(55, 80)] for _ in range(n)]


def step(rng: random.Random, s: list[float]) -> None:
    s[0] = min(100.0, max(0.0, s[0] + rng.gauss(0, 6)))
    s[1] = min(MEM, max(0.0, s[1] + rng.gauss(0, 400)))
    s[2] = min(90.0, max(30.0, s[2] + rng.gauss(0, 1.5)))


def log_growth(hours: float, interval: float, busy: bool) -> tuple[int, int, int, float]:
    """(samples taken, samples logged, log bytes, wall s) for ``hours`` of sampling."""
    rng = random.Random(14)
    backend = FakeBackend(GPUS, MEM)
    # no job runs: skip the fake backend's scan of declared job processes
    # (a file read per sample, which would dominate 24 h of samples)
    gpus_module._declared_processes = dict
    walk = busy_walk(rng, GPUS)
    with tempfile.TemporaryDirectory() as d:
        writer = eventlog.LogWriter.open(Path(d) / "log")
        state = ClusterState()
        now = 1_000_000.0
        started = m.Started(node="local", pid=1, version="bench", gpu_backend=backend.name, gpus=backend.discover(),
                            config=m.SchedulerConfig(node="local"))
        events, _ = core.handle(state, started, now)
        writer.append(events)
        last: dict[int, tuple[float, GpuObserved]] = {}
        taken = logged = 0
        t0 = time.perf_counter()
        end = now + hours * 3600
        while now < end:
            now += interval
            if busy:
                samples = []
                for i, s in enumerate(walk):
                    step(rng, s)
                    samples.append(GpuObserved(node="local", gpu=i, utilization=round(s[0], 1),
                                               memory_used_mib=int(s[1]), memory_total_mib=MEM,
                                               temperature_c=round(s[2], 1), power_w=round(100 + 3 * s[0], 1)))
            else:
                samples = [x for x in backend.sample() if isinstance(x, GpuObserved)]
            batch = []
            for sample in samples:
                taken += 1
                prev_ts, prev = last.get(sample.gpu, (0.0, None))
                if not significant(prev, sample, last_ts=prev_ts, now=now):
                    continue
                last[sample.gpu] = (now, sample)
                logged += 1
                out, _ = core.handle(state, sample, now)
                batch.extend(out)
            if batch:
                writer.append(batch)
        wall = time.perf_counter() - t0
        writer.close()
        size = sum(f.stat().st_size for f in (Path(d) / "log").rglob("*") if f.is_file())
    return taken, logged, size, wall


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its waited-for children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def idle_cpu(interval: float, seconds: float) -> tuple[float, float]:
    """(share of one core, CPU s per day) of an idle daemon sampling every ``interval`` s."""
    with tempfile.TemporaryDirectory() as d:
        daemon = Daemon(Path(d) / "state", gpus=f"fake:{GPUS}:{MEM}")
        # the harness samples every 0.2 s; ask for ``interval`` instead (the last flag wins)
        daemon.extra = ["--sample-interval", str(interval)]
        daemon.start(timeout=60)
        try:
            time.sleep(2.0)  # start-up work done
            pid = daemon.process.pid
            c0, t0 = cpu_s(pid), time.monotonic()
            time.sleep(seconds)
            c1, t1 = cpu_s(pid), time.monotonic()
        finally:
            daemon.stop(signal.SIGTERM)
    share = (c1 - c0) / (t1 - t0)
    return share, share * 86_400


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--interval", type=float, default=2.0, help="sample interval, s (the daemon's default: 2)")
    ap.add_argument("--idle-s", type=float, default=60.0, help="seconds to watch the idle daemon")
    ap.add_argument("--skip-idle", action="store_true")
    args = ap.parse_args()
    days = args.hours / 24
    for busy in (False, True):
        taken, logged, size, wall = log_growth(args.hours, args.interval, busy)
        label = "busy (random walk)" if busy else "idle (constant)"
        print(f"  {GPUS} GPUs, {label:<18} every {args.interval:g} s for {args.hours:g} h: {taken:,} samples, "
              f"{logged:,} logged ({logged / taken:.1%}); log {size / 2**20 / days:.1f} MiB/day "
              f"({size / max(logged, 1):.0f} B per logged sample); simulated in {wall:.1f} s", flush=True)
    if not args.skip_idle:
        for interval in (2.0, 0.2):
            share, per_day = idle_cpu(interval, args.idle_s)
            print(f"  idle daemon, {GPUS} fake GPUs, samples every {interval:g} s: {share:.2%} of a core "
                  f"({per_day / 60:.1f} CPU min/day), over {args.idle_s:g} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
