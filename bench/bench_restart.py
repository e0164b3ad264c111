"""Restart on a 10-million-event log: how long until ``serve``
answers again, and what that time is spent on.

Builds, in a temporary directory, a state directory whose log holds
``--events`` events (default 10,000,000):

- a real daemon on ``fake:8`` GPUs, its GPUs paused, is handed ``--jobs``
  jobs (arrays of 1,000) and cancels them all: real job records, ended, as a
  long-lived daemon keeps them for ``queue --all``;
- then GPU samples (``GpuSampled`` of the daemon's node and GPUs) appended
  with the log's own writer until the log holds ``--events``: on a machine
  shared for months, sampling is most of a log;
- the daemon is started once on it (folding everything: the slow way) and
  stopped, which writes its shutdown snapshot.

Then, ``--repeat`` times each, the wall time from ``serve`` starting to its
first answer on the socket: after SIGTERM (snapshot at shutdown, no tail), and
after kill -9 with 40,000 more samples in the log past the snapshot (a tail
under the daemon's 50,000-event snapshot interval). Last, the same start-up's
steps timed in this process (interpreter and imports, opening the log,
loading the snapshot, folding the tail), so the total is accounted for.

    .venv/bin/python bench/bench_restart.py [--events 10000000] [--jobs 100000] [--repeat 3]

Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemon_harness import Daemon  # noqa: E402

from eventsched.domain import events as ev  # noqa: E402
from eventsched.domain.events import JobSpec  # noqa: E402
from eventsched.domain.paths import log_dir, snapshot_dir  # noqa: E402
from eventsched.storage import log as eventlog  # noqa: E402
from eventsched.wire.client import Client  # noqa: E402
from eventsched.wire.errors import ClientError  # noqa: E402

GPUS = 8
TAIL_EVENTS = 40_000  # past the last snapshot, before a kill -9


def add_jobs(daemon: Daemon, n: int) -> None:
    """``n`` job records: submitted on paused GPUs, then cancelled."""
    for gpu in range(GPUS):
        daemon.cli("pause-gpu", str(gpu))
    with Client(daemon.socket, timeout=600) as c:
        for first in range(0, n, 1000):
            k = min(1000, n - first)
            ids = c.submit_array(JobSpec(command=["true"], gpus=1.0, cwd="/tmp"), list(range(k)))
            c.cancel(ids)


def node_of(state_dir: Path) -> str:
    for event in eventlog.read(log_dir(state_dir), from_seq=1):
        if isinstance(event, ev.DaemonStarted):
            return event.node
    raise SystemExit("no DaemonStarted in the log")


def append_samples(state_dir: Path, n: int) -> None:
    """``n`` GPU samples, one per GPU per 5 s, after the log's last event."""
    node = node_of(state_dir)
    writer = eventlog.LogWriter.open(log_dir(state_dir))
    writer._fdatasync = lambda fd: None  # type: ignore[method-assign]  # building the input, not measuring it
    try:
        last = next(iter(eventlog.read(log_dir(state_dir), from_seq=writer.next_seq - 1)))
        now = last.ts
        written = 0
        while written < n:
            batch = []
            for _ in range(64):  # a frame per 64 ticks of every GPU
                now += 5.0
                for gpu in range(GPUS):
                    batch.append(ev.GpuSampled(
                        ts=now, node=node, gpu=gpu, utilization=float(written % 100),
                        memory_used_mib=1024 + written % 4096, memory_total_mib=81920,
                        temperature_c=40.0, power_w=300.0, foreign_memory_mib=0,
                    ))
            batch = batch[: n - written]
            writer.append(batch)
            written += len(batch)
    finally:
        writer.close()


def start_serving(daemon: Daemon) -> float:
    """Start ``serve``; seconds until a ping is answered on its socket."""
    t0 = time.perf_counter()
    with open(daemon.state_dir / "daemon.stderr", "ab") as err:
        daemon.process = subprocess.Popen(
            [sys.executable, "-m", "eventsched.cli", "serve", "--gpus", daemon.gpus],
            env=daemon.env(), stdout=err, stderr=err, start_new_session=True,
        )
    while True:
        try:
            with Client(daemon.socket, timeout=5) as c:
                c.ping()
            return time.perf_counter() - t0
        except ClientError:
            if daemon.process.poll() is not None:
                raise SystemExit(f"serve exited with {daemon.process.returncode}: {daemon.stderr()}") from None
            time.sleep(0.005)


def steps(state_dir: Path) -> dict[str, float]:
    """The start-up's steps, timed here (the daemon does the same, in this order)."""
    out: dict[str, float] = {}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import eventsched.cli, eventsched.runtime.daemon"], check=True)
    out["a Python process importing the daemon"] = time.perf_counter() - t
    from eventsched.projections import collector, snapshot
    from eventsched.projections.cluster import apply

    t = time.perf_counter()
    writer = eventlog.LogWriter.open(log_dir(state_dir))
    out["opening the log (walking the last segment's frames; the sealed ones were walked once)"] = time.perf_counter() - t
    writer.close()
    with collector.paused():  # as the daemon loads (projections/collector.py)
        t = time.perf_counter()
        state = snapshot.load_latest(snapshot_dir(state_dir))
        assert state is not None
        out[f"loading the newest snapshot ({len(state.jobs):,} jobs)"] = time.perf_counter() - t
        t = time.perf_counter()
        tail = 0
        for batch in eventlog.read_batches(log_dir(state_dir), from_seq=state.last_seq + 1):
            for event in batch:
                apply(state, event)
                tail += 1
        out[f"folding the tail ({tail:,} events)"] = time.perf_counter() - t
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(Path(tmp) / "state", gpus=f"fake:{GPUS}:81920")
        state = daemon.state_dir
        t = time.perf_counter()
        daemon.start(timeout=120)
        add_jobs(daemon, args.jobs)
        daemon.stop(signal.SIGTERM, timeout=120)
        writer = eventlog.LogWriter.open(log_dir(state))
        events_so_far = writer.next_seq - 1
        writer.close()
        print(f"{args.jobs:,} jobs submitted and cancelled: {events_so_far:,} events "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
        t = time.perf_counter()
        append_samples(state, args.events - events_so_far)
        size = sum(f.stat().st_size for f in log_dir(state).iterdir()) / 2**20
        print(f"GPU samples appended up to {args.events:,} events: log {size:,.0f} MiB in "
              f"{len(list(log_dir(state).glob('*.seg')))} segments ({time.perf_counter() - t:.0f} s)", flush=True)
        first = start_serving(daemon)
        daemon.stop(signal.SIGTERM, timeout=600)
        print(f"first start, folding the whole log: {first:.1f} s (then stopped: its snapshot)", flush=True)

        term, kill = [], []
        for _ in range(args.repeat):
            term.append(start_serving(daemon))
            daemon.stop(signal.SIGTERM, timeout=120)
        for _ in range(args.repeat):
            start_serving(daemon)
            daemon.stop(signal.SIGTERM, timeout=120)  # a fresh snapshot, then a tail past it
            append_samples(state, TAIL_EVENTS)
            start_serving(daemon)
            daemon.kill9()
            kill.append(start_serving(daemon))
            daemon.stop(signal.SIGTERM, timeout=120)
        print(f"restart after SIGTERM: median {statistics.median(term):.2f} s "
              f"(runs: {', '.join(f'{x:.2f}' for x in term)})   target < 2 s")
        print(f"restart after kill -9 with {TAIL_EVENTS:,} events past the snapshot: median "
              f"{statistics.median(kill):.2f} s (runs: {', '.join(f'{x:.2f}' for x in kill)})")
        print("where a restart's time goes (after SIGTERM), each step timed alone:")
        for what, s in steps(state).items():
            print(f"  {s:6.2f} s  {what}")
        print(f"  ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
