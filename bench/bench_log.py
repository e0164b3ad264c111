"""Benchmark of the event log (prints figures; asserts nothing).

    python bench/bench_log.py [--events 1000000] [--dir DIR]

1. batch of 1 event per fdatasync, against a bare loop of os.write + fdatasync
   of the very same frame bytes (target: >= 80 % of the bare loop's events/s),
   and against the same writer appending (no zeros written ahead);
2. batches of 1,000 events, stamping and encoding included (target >= 500k/s);
3. read + decode of a 1M-event log (target >= 1M events/s), in a fresh process;
4. open + recover of that log (target < 2 s), in a fresh process;
   peak RSS of 3 and 4 from getrusage (target < 200 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from eventsched.domain import events as ev
from eventsched.storage import log


def realistic(n: int, first: int = 1) -> list[ev.Event]:
    """Mostly GPU samples, with a job submission every tenth event."""
    out: list[ev.Event] = []
    for s in range(first, first + n):
        if s % 10 == 0:
            spec = ev.JobSpec(
                command=["python", "train.py", "--lr", "3e-4", f"--seed={s}"],
                user="alice", uid=1000, gid=1000, cwd="/home/alice/proj", gpus=0.5,
                gpu_mem_mib=8000, priority=2, content_hash="9f2c1e",
            )
            out.append(ev.JobSubmitted(ts=1.7e9 + s, cause="uid:1000", job=s, spec=spec))
        else:
            out.append(ev.GpuSampled(
                ts=1.7e9 + s, cause="nvml", node="local", gpu=s % 8, utilization=float(s % 100),
                memory_used_mib=1000 + s % 5000, memory_total_mib=81920, temperature_c=55.0, power_w=310.2,
                foreign_memory_mib=0,
            ))
    return out


def bench_batch1(d: Path, n: int, rounds: int) -> tuple[float, float, float]:
    """events/s of (bare appending loop, ours, ours appending without zeros
    written ahead), median over interleaved rounds."""
    evs = realistic(n)
    bare_rates, ours_rates, appending_rates = [], [], []
    for r in range(rounds):
        sub = d / f"b1-{r}"
        w = log.LogWriter.open(sub)
        first = w.next_seq
        # the exact bytes ours will write, for the bare loop
        frames = [
            log._frame_bytes(w._salt, first + i, 1, ev.encode_many(ev.stamp([e], first + i))) for i, e in enumerate(evs)
        ]
        fd = os.open(sub / "bare", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t = time.perf_counter()
        for f in frames:
            os.write(fd, f)
            os.fdatasync(fd)
        bare_rates.append(n / (time.perf_counter() - t))
        os.close(fd)
        t = time.perf_counter()
        for e in evs:
            w.append((e,))
        ours_rates.append(n / (time.perf_counter() - t))
        w.close()
        w = log.LogWriter.open(d / f"b1-appending-{r}", preallocate=0)
        t = time.perf_counter()
        for e in evs:
            w.append((e,))
        appending_rates.append(n / (time.perf_counter() - t))
        w.close()
    return statistics.median(bare_rates), statistics.median(ours_rates), statistics.median(appending_rates)


def bench_batch1000(d: Path, batches: int) -> float:
    evs = realistic(1000)
    w = log.LogWriter.open(d / "b1000")
    t = time.perf_counter()
    for _ in range(batches):
        w.append(evs)
    rate = batches * 1000 / (time.perf_counter() - t)
    w.close()
    return rate


def bench_follow(d: Path, n: int = 100) -> tuple[float, float]:
    """(CPU seconds an idle follower burns in 1 s, median ms from append's start to the follower)."""
    w = log.LogWriter.open(d / "follow")
    stop = threading.Event()
    returned: dict[int, float] = {}
    lat: list[float] = []

    def tail() -> None:
        for batch in log.follow(d / "follow", stop=stop, poll_max_s=1.0):
            now = time.perf_counter()
            lat.extend(now - returned.get(e.seq, now) for e in batch)

    t = threading.Thread(target=tail)
    t.start()
    time.sleep(0.2)
    c0 = time.process_time()
    time.sleep(1.0)
    idle_cpu = time.process_time() - c0
    for e in realistic(n):
        returned[w.next_seq] = time.perf_counter()
        w.append((e,))
        time.sleep(0.005)
    time.sleep(0.2)
    stop.set()
    t.join()
    w.close()
    return idle_cpu, statistics.median(lat) * 1e3


def build(d: Path, total: int) -> None:
    w = log.LogWriter.open(d)
    chunk = realistic(1000)
    for _ in range(total // 1000):
        w.append(chunk)
    w.close()


CHILD = r"""
import json, resource, sys, time
from eventsched.storage import log
what, d = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if what == "read":
    n = 0
    for batch in log.read_batches(d):
        n += len(batch)
else:
    w = log.LogWriter.open(d)
    n = w.next_seq - 1
    w.close()
dt = time.perf_counter() - t
print(json.dumps({"n": n, "s": dt, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def child(what: str, d: Path) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, what, str(d)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--batch1", type=int, default=3000, help="events per batch-of-1 round")
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        d = Path(tmp)
        bare, ours, appending = bench_batch1(d, a.batch1, rounds=3)
        print(f"batch 1   : bare os.write+fdatasync {bare:10,.0f} ev/s | eventsched {ours:10,.0f} ev/s "
              f"| ratio {ours / bare:6.1%}  (target >= 80%)")
        print(f"            written ahead (zeros, PREALLOCATE) vs appending (preallocate=0): {ours:10,.0f} vs "
              f"{appending:10,.0f} ev/s = {ours / appending:.2f}x")
        rate = bench_batch1000(d, 300)
        print(f"batch 1000: {rate:10,.0f} ev/s incl. stamping+encoding  (target >= 500,000)")
        idle, wake = bench_follow(d)
        print(f"follow    : idle CPU {idle * 1e3:.1f} ms per s (inotify), follower has the event {wake:.2f} ms after append starts")
        big = d / "big"
        t = time.perf_counter()
        build(big, a.events)
        size = sum(os.path.getsize(s.path) for s in log.segments(big))
        print(f"built     : {a.events:,} events, {size / 1e6:.1f} MB, {len(log.segments(big))} segment(s) "
              f"in {time.perf_counter() - t:.2f} s")
        r = child("read", big)
        print(f"read      : {r['n']:,} events in {r['s']:.2f} s = {r['n'] / r['s']:10,.0f} ev/s  "
              f"(target >= 1,000,000), peak RSS {r['rss_mb']:.0f} MB")
        o = child("open", big)
        print(f"open      : recover {o['n']:,} events in {o['s']:.2f} s (target < 2 s), peak RSS {o['rss_mb']:.0f} MB "
              f"(target < 200 MB)")


if __name__ == "__main__":
    main()
