"""Launch latency: from ``Executor.launch()`` to the job's first instruction,
against a bare ``subprocess.Popen`` of the same command (the floor).

Each job's first instruction prints the wall clock; p50 / p99 over N launches.
Run: python bench/bench_launch.py [N]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from eventsched.events import JobSpec
from eventsched.executor import Executor

JOBS = {
    "python -I -S": [sys.executable, "-I", "-S", "-c", "import time; print(repr(time.time()), flush=True)"],
    "bash": ["bash", "-c", "echo $EPOCHREALTIME"],
}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def bare(cmd: list[str], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.time()
        first = float(subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout.split()[-1])
        out.append(first - t0)
    return out


async def via_executor(
    cmd: list[str], n: int, state: Path, base: int, gap_s: float
) -> tuple[list[float], list[float]]:
    ex = Executor(state)
    tx, rx = anyio.create_memory_object_stream(10)
    first_instr, returned = [], []
    async with anyio.create_task_group() as tg:
        tg.start_soon(ex.run, tx.send)
        for i in range(n):
            job = base + i
            await anyio.sleep(gap_s)  # > 0: an idle scheduler, its spare supervisor warm
            t0 = time.time()
            await ex.launch(job, JobSpec(command=cmd), [0])
            returned.append(time.time() - t0)
            await rx.receive()  # its exit: one at a time, like an idle scheduler
            first_instr.append(float(ex.log_path(job).read_text().split()[-1]) - t0)
        tg.cancel_scope.cancel()
    return first_instr, returned


def show(label: str, xs: list[float]) -> None:
    ms = [x * 1000 for x in xs]
    print(f"  {label:<44} p50 {pct(ms, 50):7.2f} ms   p99 {pct(ms, 99):7.2f} ms   mean {statistics.mean(ms):7.2f} ms")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    load = os.getloadavg()[0]
    print(f"launch latency, {n} launches each, sequential; {os.cpu_count()} CPUs, load average {load:.2f}")
    with tempfile.TemporaryDirectory() as d:
        for k, (name, cmd) in enumerate(JOBS.items()):
            bare(cmd, 3)  # warm the page cache
            b = bare(cmd, n)
            print(f"job: {name}")
            show("bare Popen -> first instruction", b)
            for j, (mode, gap) in enumerate((("idle", 0.05), ("back-to-back", 0.0))):
                first, returned = anyio.run(via_executor, cmd, n, Path(d), k * 10_000 + j * 1000, gap)
                show(f"{mode}: launch() -> first instruction", first)
                show(f"{mode}: launch() -> ProcessStarted returned", returned)
                print(f"    {mode} overhead over bare at p50: {(pct(first, 50) - pct(b, 50)) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
