"""Launch cost: from ``Executor.launch()`` to the job's first instruction,
against a bare ``subprocess.Popen`` of the same command (the floor), with
supervisors forked by the zygote (the default) and started cold (fallback).

Prints p50 / p99 latency over N sequential launches (each job's first
instruction prints the wall clock), then a drain: N ``/bin/true`` jobs 4 at a
time through the executor alone (no daemon), wall time and CPU per job
(ours + every descendant's), against ``xargs -P 4``.

Run: python bench/bench_launch.py [N]
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from eventsched.domain.events import JobSpec
from eventsched.runtime.launch.executor import Executor

JOBS = {
    "python -I -S": [sys.executable, "-I", "-S", "-c", "import time; print(repr(time.time()), flush=True)"],
    "bash": ["bash", "-c", "echo $EPOCHREALTIME"],
}
MODES = {"zygote": True, "cold": False}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def cpu_s() -> float:
    """CPU of this process and of every descendant reaped so far."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


def bare(cmd: list[str], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.time()
        first = float(subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout.split()[-1])
        out.append(first - t0)
    return out


async def via_executor(
    cmd: list[str], n: int, state: Path, base: int, gap_s: float, zygote: bool
) -> tuple[list[float], list[float]]:
    ex = Executor(state, zygote=zygote, cgroups=os.environ.get("BENCH_CGROUPS", "1") == "1")
    tx, rx = anyio.create_memory_object_stream(10)
    first_instr, returned = [], []
    async with anyio.create_task_group() as tg:
        await tg.start(ex.run, tx.send)
        for i in range(n):
            job = base + i
            await anyio.sleep(gap_s)  # > 0: an idle scheduler
            t0 = time.time()
            await ex.launch(job, JobSpec(command=cmd), [0])
            returned.append(time.time() - t0)
            await rx.receive()  # its exit: one at a time, like an idle scheduler
            first_instr.append(float(ex.log_path(job).read_text().split()[-1]) - t0)
        tg.cancel_scope.cancel()
    return first_instr, returned


async def drain(n: int, state: Path, base: int, zygote: bool, width: int = 4) -> None:
    """n jobs, ``width`` at a time: a new launch as soon as one exits."""
    ex = Executor(state, zygote=zygote)
    tx, rx = anyio.create_memory_object_stream(n)
    async with anyio.create_task_group() as tg:
        await tg.start(ex.run, tx.send)
        running = 0
        for i in range(n):
            if running == width:
                await rx.receive()
                running -= 1
            await ex.launch(base + i, JobSpec(command=["/bin/true"]), [0])
            running += 1
        for _ in range(running):
            await rx.receive()
        tg.cancel_scope.cancel()


def show(label: str, xs: list[float]) -> None:
    ms = [x * 1000 for x in xs]
    print(f"  {label:<44} p50 {pct(ms, 50):7.2f} ms   p99 {pct(ms, 99):7.2f} ms   mean {statistics.mean(ms):7.2f} ms")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    load = os.getloadavg()[0]
    print(f"launch latency, {n} launches each, sequential; {os.cpu_count()} CPUs, load average {load:.2f}")
    with tempfile.TemporaryDirectory() as d:
        base = 0
        for name, cmd in JOBS.items():
            bare(cmd, 3)  # warm the page cache
            b = bare(cmd, n)
            print(f"job: {name}")
            show("bare Popen -> first instruction", b)
            for mode, zygote in MODES.items():
                for gap_name, gap in (("idle", 0.05), ("back-to-back", 0.0)):
                    base += 1000
                    first, returned = anyio.run(via_executor, cmd, n, Path(d), base, gap, zygote)
                    label = f"{mode}, {gap_name}:"
                    show(f"{label} launch() -> first instruction", first)
                    show(f"{label} launch() -> ProcessStarted", returned)
                    print(f"    overhead over bare at p50: {(pct(first, 50) - pct(b, 50)) * 1000:.2f} ms")

        jobs = 4 * n
        print(f"drain: {jobs} /bin/true jobs, 4 at a time (executor only, no daemon)")
        c0, t0 = cpu_s(), time.perf_counter()
        subprocess.run(["xargs", "-P", "4", "-n", "1", "/bin/true"], input="x\n" * jobs, text=True, check=True)
        xargs_wall, xargs_cpu = time.perf_counter() - t0, cpu_s() - c0
        print(f"  {'xargs -P 4':<12} {xargs_wall:6.2f} s   CPU {xargs_cpu / jobs * 1000:6.2f} ms/job")
        for mode, zygote in MODES.items():
            base += 1000
            c0, t0 = cpu_s(), time.perf_counter()
            anyio.run(drain, jobs, Path(d), base, zygote)
            wall, cpu = time.perf_counter() - t0, cpu_s() - c0
            print(
                f"  {mode:<12} {wall:6.2f} s   CPU {cpu / jobs * 1000:6.2f} ms/job   "
                f"= {wall / xargs_wall:.1f}x xargs"
            )


if __name__ == "__main__":
    main()
