"""A real daemon with 100,000 queued jobs.

Starts ``eventsched serve --gpus fake:64:81920`` in a temporary state dir
(best-fit, queue limits raised), fills its 64 GPUs with long ``sleep`` jobs
so that every later job waits, then prints:

- submit rate with an empty queue and with ``--jobs`` queued (pipelined
  ``Client.submit_many``, ``--rounds`` probes at each length, each probe's
  jobs cancelled after it; and one-at-a-time round trips), and the ratio of
  the medians (target: within 20 %);
- the daemon's RSS with the backlog;
- decision time in the live daemon: a running job is cancelled and the next
  job placed; the cancel's round trip includes the decision, the commit's
  fdatasync and the reply (p50/p99 over ``--decisions`` cancels);
- ``queue --json`` wall time, and the longest stall it causes: one-at-a-time
  submissions from a second client while it runs (max latency during the
  listing minus the median without it);
- restart time: SIGTERM (snapshot at shutdown, empty tail) and kill -9 after
  more submissions (last snapshot + the tail), until ``health`` answers.

    .venv/bin/python bench/bench_daemon_backlog.py [--jobs 100000] [--decisions 30]

Prints figures only; asserts nothing. Other processes on the machine skew
every figure: compare ratios taken in one run.

Figures measured so far: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemon_harness import EVENTSCHED, Daemon  # noqa: E402

from eventsched.domain.events import JobSpec  # noqa: E402
from eventsched.wire.client import Client  # noqa: E402

GPUS = 64
SETTLE_S = 5.0  # quiet time before each rate measurement
CONFIG = """\
policy = "best-fit"

[scheduler]
max_queued = 400000
max_queued_per_user = 400000
"""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def spec(i: int) -> JobSpec:
    # shares and gangs in a few shapes, priorities 0-2: none can start (all GPUs busy)
    return JobSpec(command=["sleep", "3600"], cwd="/tmp", gpus=(0.25, 0.5, 1.0, 2.0, 4.0)[i % 5], priority=i % 3,
                   name=f"b{i % 7}")


def pipelined_rate(client: Client, start: int, n: int) -> float:
    """Submissions/s of ``n`` pipelined jobs; they are cancelled afterwards, so
    each probe finds the queue as long as the one before it did."""
    specs = [spec(start + i) for i in range(n)]
    t = time.perf_counter()
    ids = client.submit_many(specs)
    rate = n / (time.perf_counter() - t)
    client.cancel(ids)
    return rate


def probe_rates(client: Client, start: int, n: int, rounds: int) -> list[float]:
    rates = []
    for r in range(rounds):
        time.sleep(1.0)  # the last probe's cancel and any snapshot written
        rates.append(pipelined_rate(client, start + r * n, n))
    return rates


def one_by_one(client: Client, start: int, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        client.submit(spec(start + i))
        out.append((time.perf_counter() - t) * 1e3)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def fill(daemon: Daemon, n: int, start: int) -> None:
    with Client(daemon.socket, timeout=600) as c:
        done = 0
        while done < n:
            k = min(20_000, n - done)
            c.submit_many([spec(start + done + i) for i in range(k)])
            done += k


def restart_s(daemon: Daemon, how: str) -> float:
    if how == "kill9":
        daemon.kill9()
    else:
        daemon.stop(signal.SIGTERM, timeout=120)
    t = time.perf_counter()
    daemon.start(timeout=600)
    return time.perf_counter() - t


def queue_json_stall(daemon: Daemon) -> tuple[float, float, list[float], int, list[float]]:
    """(wall s of `queue --json`, median submit ms without it, submit ms during
    it, jobs listed, submit ms of the same prober as long again without it:
    the stalls this machine's other load causes anyway)."""
    with Client(daemon.socket, timeout=120) as c:
        quiet = one_by_one(c, 9_000_000, 50)

        def probe(first: int, stop: threading.Event, lat: list[float]) -> None:
            i = first
            while not stop.is_set():
                t = time.perf_counter()
                c.submit(spec(i))
                lat.append((time.perf_counter() - t) * 1e3)
                i += 1

        lat: list[float] = []
        stop = threading.Event()
        th = threading.Thread(target=probe, args=(9_100_000, stop, lat))
        th.start()
        time.sleep(0.2)
        # the listing goes to a file: reading 50 MB of it from a pipe here, and
        # decoding it, would hold this process's GIL and stall the prober
        with tempfile.TemporaryFile() as listing:
            t = time.perf_counter()
            code = subprocess.run([*EVENTSCHED, "queue", "--json"], env=daemon.env(), stdout=listing,
                                  stderr=subprocess.DEVNULL, timeout=600).returncode
            wall = time.perf_counter() - t
            stop.set()
            th.join()
            listing.seek(0)
            listed = len(json.load(listing)) if code == 0 else -1
        alone: list[float] = []
        stop = threading.Event()
        th = threading.Thread(target=probe, args=(9_600_000, stop, alone))
        th.start()
        time.sleep(min(wall, 20.0))
        stop.set()
        th.join()
    return wall, statistics.median(quiet), lat, listed, alone


def decisions_ms(daemon: Daemon, hogs: list[int]) -> list[float]:
    """Round trips of cancelling a running job (the next one is placed in the same batch)."""
    out = []
    with Client(daemon.socket, timeout=120) as c:
        for jid in hogs:
            t = time.perf_counter()
            c.cancel([jid])
            out.append((time.perf_counter() - t) * 1e3)
    return out


def stop_everything(daemon: Daemon) -> None:
    """Pause every GPU (nothing new starts), cancel what runs, stop the daemon."""
    try:
        with Client(daemon.socket, timeout=300) as c:
            for g in range(GPUS):
                c.pause_gpu(g)
            running = [j["id"] for j in c.status()["jobs"] if j["state"] == "running"]
            if running:
                c.cancel(running)
            time.sleep(1.0)
    finally:
        daemon.stop(signal.SIGTERM, timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--probe", type=int, default=10_000, help="jobs per submit-rate measurement")
    ap.add_argument("--rounds", type=int, default=3, help="submit-rate measurements at each queue length")
    ap.add_argument("--decisions", type=int, default=30)
    ap.add_argument("--keep", action="store_true", help="keep the state dir")
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="bench-daemon-backlog-"))
    (state / "config.toml").write_text(CONFIG)
    daemon = Daemon(state / "state", gpus=f"fake:{GPUS}:81920",
                    extra=["--config", str(state / "config.toml"), "--sample-interval", "2"])
    daemon.start(timeout=60)
    try:
        with Client(daemon.socket, timeout=120) as c:
            hogs = c.submit_many([JobSpec(command=["sleep", "3600"], cwd="/tmp", gpus=1, name="hog") for _ in range(GPUS)])
            time.sleep(1.0)
            print(f"daemon pid {daemon.process.pid}, {GPUS} GPUs busy; RSS {rss_mib(daemon.process.pid):.0f} MiB", flush=True)
            time.sleep(SETTLE_S)
            empty_rates = probe_rates(c, 0, args.probe, args.rounds)
            empty_lat = one_by_one(c, 10_000_000, 200)
        t = time.perf_counter()
        fill(daemon, args.jobs - 200, args.probe * args.rounds)
        fill_s = time.perf_counter() - t
        queued = args.jobs
        with Client(daemon.socket, timeout=120) as c:
            print(f"filled to {queued:,} queued in {fill_s:.1f} s ({(args.jobs - args.probe) / fill_s:,.0f} jobs/s)", flush=True)
            # a snapshot (every 50,000 events) was just written: let its I/O settle
            time.sleep(SETTLE_S)
            full_rates = probe_rates(c, 20_000_000, args.probe, args.rounds)
            full_lat = one_by_one(c, 30_000_000, 200)
        empty_rate, full_rate = statistics.median(empty_rates), statistics.median(full_rates)
        print(f"  submit, pipelined ({args.rounds} probes of {args.probe:,} each, median): empty {empty_rate:,.0f}/s "
              f"({', '.join(f'{r:,.0f}' for r in empty_rates)}), {queued:,} queued {full_rate:,.0f}/s "
              f"({', '.join(f'{r:,.0f}' for r in full_rates)}) -> ratio {full_rate / empty_rate:.2f} (target >= 0.8)",
              flush=True)
        print(f"  submit, one at a time: empty p50 {statistics.median(empty_lat):.2f} ms p99 {pct(empty_lat, .99):.2f} ms; "
              f"queued p50 {statistics.median(full_lat):.2f} ms p99 {pct(full_lat, .99):.2f} ms "
              f"-> rate ratio {statistics.mean(empty_lat) / statistics.mean(full_lat):.2f}", flush=True)
        print(f"  daemon RSS with {queued:,} queued: {rss_mib(daemon.process.pid):.0f} MiB", flush=True)
        dec = decisions_ms(daemon, hogs[: args.decisions])
        if dec:
            print(f"  decision (cancel a running job -> next placed, round trip incl. fdatasync): "
                  f"p50 {statistics.median(dec):.2f} ms p99 {pct(dec, .99):.2f} ms over {len(dec)}", flush=True)
        wall, quiet, lat, listed, alone = queue_json_stall(daemon)
        worst = max(lat)
        print(f"  queue --json: {listed:,} jobs in {wall:.2f} s; submit latency median {quiet:.2f} ms; during the "
              f"listing ({len(lat):,} submits) p50 {statistics.median(lat):.1f} ms p99 {pct(lat, .99):.1f} ms "
              f"max {worst:.1f} ms (longest stall ~{worst - quiet:.0f} ms; {sum(x > 100 for x in lat)} over 100 ms); "
              f"the same prober without the listing ({len(alone):,} submits): p99 {pct(alone, .99):.1f} ms "
              f"max {max(alone):.1f} ms ({sum(x > 100 for x in alone)} over 100 ms)", flush=True)
        r1 = restart_s(daemon, "term")
        print(f"  restart after SIGTERM (snapshot at shutdown): {r1:.2f} s", flush=True)
        fill(daemon, 5_000, 40_000_000)
        r2 = restart_s(daemon, "kill9")
        log_mib = sum(f.stat().st_size for f in (daemon.state_dir / "log").rglob("*") if f.is_file()) / 2**20
        print(f"  restart after kill -9 (last snapshot + tail): {r2:.2f} s; log {log_mib:.0f} MiB; "
              f"RSS after restart {rss_mib(daemon.process.pid):.0f} MiB", flush=True)
    finally:
        stop_everything(daemon)
        if not args.keep:
            import shutil

            shutil.rmtree(state, ignore_errors=True)
        else:
            print(f"state kept in {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
