"""Job arrays on this machine, with a real daemon on fake GPUs.

Prints:

(a) the wall time of ``eventsched submit --array 0-999 -- true`` (the CLI
    process, start to exit: 1,000 jobs acknowledged in one log frame) on a
    paused machine, so that nothing launches meanwhile; and the daemon's part
    of it: the same array request over an open connection (socket, core,
    append, fdatasync, reply), without the CLI's start-up;
(b) those 1,000 jobs drained on ``--gpus fake:4`` (4 at a time): from the CLI
    call to the last exit, against ``seq 1000 | xargs -P 4 -n 1 true`` timed in
    the same run; the median of ``--drain-repeat`` runs, each with a fresh
    daemon and its own floor.

    .venv/bin/python bench/bench_array.py [--tasks N] [--repeat R] [--drain-repeat D]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemon_harness import Daemon, await_exits, cli_env  # noqa: E402

from eventsched.domain.events import JobSpec  # noqa: E402

# the CLI of this Python's environment, unless EVENTSCHED names another
EVENTSCHED_BIN = os.environ.get("EVENTSCHED") or str(Path(sys.executable).parent / "eventsched")


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def bench_ack(root: Path, tasks: int, repeat: int) -> None:
    from eventsched.wire.client import Client

    with Daemon(root / "ack", gpus="fake:4") as d:
        for gpu in range(4):
            d.cli("pause-gpu", str(gpu))
        env = cli_env(d.state_dir)
        walls: list[float] = []
        for _ in range(repeat):
            start = time.perf_counter()
            out = subprocess.run([EVENTSCHED_BIN, "submit", "--array", f"0-{tasks - 1}", "--", "true"],
                                 env=env, check=True, capture_output=True, text=True)
            walls.append(time.perf_counter() - start)
            ids = out.stdout.split()
            assert len(ids) == tasks, out.stdout[:200]
            d.cli("cancel", ids[0])  # the array's id: every task; keeps the queue small
        plain: list[float] = []  # the floor: one job, same CLI path
        for _ in range(repeat):
            start = time.perf_counter()
            subprocess.run([EVENTSCHED_BIN, "submit", "--", "true"], env=env, check=True, capture_output=True)
            plain.append(time.perf_counter() - start)
        handling: list[float] = []
        with Client(d.socket) as c:
            spec = JobSpec(command=["true"], cwd="/tmp")
            for _ in range(repeat):
                start = time.perf_counter()
                ids_ = c.submit_array(spec, list(range(tasks)))
                handling.append(time.perf_counter() - start)
                c.cancel_each([ids_[0]], arrays=True)
        bare: list[float] = []
        for _ in range(repeat):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            bare.append(time.perf_counter() - start)
    print(
        f"(a) `eventsched submit --array 0-{tasks - 1} -- true`: p50 {pct(walls, 50) * 1e3:.1f} ms, "
        f"max {max(walls) * 1e3:.1f} ms wall over {repeat} calls   target < 100 ms"
    )
    print(f"    one plain `eventsched submit -- true` on the same daemon: p50 {pct(plain, 50) * 1e3:.1f} ms")
    print(
        f"    the daemon's part (one array request over an open connection, through fdatasync): "
        f"p50 {pct(handling, 50) * 1e3:.1f} ms, max {max(handling) * 1e3:.1f} ms; "
        f"bare `python -c pass`: {pct(bare, 50) * 1e3:.1f} ms"
    )


def bench_drain(root: Path, tasks: int, repeat: int) -> None:
    from eventsched.wire.client import Client

    ratios, drains, floors, acks, daemon_cpus, xargs_cpus, failed = [], [], [], [], [], [], 0
    for r in range(repeat):  # a fresh daemon each, its floor timed just before
        cpu0 = children_cpu()
        start = time.perf_counter()
        subprocess.run(f"seq {tasks} | xargs -P 4 -n 1 true", shell=True, check=True)
        xargs_s = time.perf_counter() - start
        xargs_cpus.append(children_cpu() - cpu0)
        with Daemon(root / f"drain-{r}", gpus="fake:4") as d:
            env = cli_env(d.state_dir)
            daemon_pid = d.process.pid if d.process is not None else 0
            cpu_before = _proc_cpu(daemon_pid)
            with Client(d.socket) as c:
                seq = c.ping()["seq"]
                start = time.perf_counter()
                out = subprocess.run(
                    [EVENTSCHED_BIN, "submit", "--array", f"0-{tasks - 1}", "--gpus", "1", "--", "true"],
                    env=env, check=True, capture_output=True, text=True,
                )
                acks.append(time.perf_counter() - start)
                failed += await_exits(c, seq + 1, [int(i) for i in out.stdout.split()])
                drain_s = time.perf_counter() - start
            daemon_cpus.append(_proc_cpu(daemon_pid) - cpu_before)
        drains.append(drain_s)
        floors.append(xargs_s)
        ratios.append(drain_s / xargs_s)
    runs = ", ".join(f"{x:.2f}" for x in ratios)
    print(
        f"(b) drain {tasks} `true` tasks of one array on fake:4, 4 at a time: ratio to "
        f"`seq {tasks} | xargs -P 4 -n 1 true` median {statistics.median(ratios):.2f}x (runs: {runs}); "
        f"drain median {statistics.median(drains):.2f} s (acknowledged after {statistics.median(acks) * 1e3:.0f} ms), "
        f"xargs median {statistics.median(floors):.2f} s   target <= 2.5x" + (f"  ({failed} failed!)" if failed else "")
    )
    print(
        f"    CPU: daemon {statistics.median(daemon_cpus) / tasks * 1e3:.2f} ms/job (its own threads; "
        f"supervisors and jobs not counted), xargs {statistics.median(xargs_cpus) / tasks * 1e3:.2f} ms/job "
        f"(xargs + every `true`); {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )


def _proc_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` itself (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=10, help="runs of (a)")
    parser.add_argument("--drain-repeat", type=int, default=3, help="runs of (b), the median printed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bench_ack(root, args.tasks, args.repeat)
        bench_drain(root, args.tasks, args.drain_repeat)


if __name__ == "__main__":
    main()
