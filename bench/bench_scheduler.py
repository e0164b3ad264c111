"""Scheduler figures on this machine, with a real daemon on fake GPUs.

Prints: acknowledged submissions/s over the socket (1 and 8 clients) with p50 /
p99 acknowledgement latency; wall time of one `eventsched submit` CLI call;
dispatch latency on an idle scheduler (submit -> the job's first instruction);
drain time of 1,000 trivial jobs at 4 at a time as a ratio to `xargs -P 4`.

    .venv/bin/python bench/bench_scheduler.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemon_harness import Daemon, cli_env  # noqa: E402

from eventsched.domain.events import JobSpec  # noqa: E402
from eventsched.wire import protocol  # noqa: E402

EVENTSCHED_BIN = str(Path(sys.executable).parent / "eventsched")


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def _client(path: Path, count: int, latencies: list[float]) -> None:
    reader, writer = await asyncio.open_unix_connection(str(path))
    # priority -1 on a paused machine: nothing is launched, we measure the
    # acknowledgement path alone
    request = protocol.frame(protocol.SubmitJob(spec=JobSpec(command=["/bin/true"], gpus=1.0, cwd="/tmp")))
    for _ in range(count):
        start = time.perf_counter()
        writer.write(request)
        header = await reader.readexactly(4)
        body = await reader.readexactly(struct.unpack(">I", header)[0])
        latencies.append(time.perf_counter() - start)
        reply = protocol.server_message_decoder.decode(body)
        assert reply.ok, reply.error
    writer.close()


async def _submit_storm(path: Path, clients: int, per_client: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    start = time.perf_counter()
    await asyncio.gather(*(_client(path, per_client, latencies) for _ in range(clients)))
    return time.perf_counter() - start, latencies


def bench_submissions(root: Path, total: int) -> None:
    for clients in (1, 8):
        with Daemon(root / f"storm{clients}", gpus="fake:4") as d:
            for gpu in range(4):
                d.cli("pause-gpu", str(gpu))
            elapsed, lat = asyncio.run(_submit_storm(d.socket, clients, total // clients))
            print(
                f"submissions, {clients} client(s): {len(lat) / elapsed:,.0f} acknowledged/s "
                f"(p50 {pct(lat, 50) * 1e3:.2f} ms, p99 {pct(lat, 99) * 1e3:.2f} ms)   target >= 10,000/s with 8"
            )


def bench_cli_submit(root: Path, n: int) -> None:
    with Daemon(root / "cli", gpus="fake:4") as d:
        for gpu in range(4):
            d.cli("pause-gpu", str(gpu))
        env = cli_env(d.state_dir)
        walls = []
        for _ in range(n):
            start = time.perf_counter()
            subprocess.run([EVENTSCHED_BIN, "submit", "--", "/bin/true"], env=env, check=True, capture_output=True)
            walls.append(time.perf_counter() - start)
        bare = []
        for _ in range(n):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            bare.append(time.perf_counter() - start)
        print(
            f"one `eventsched submit` CLI call: p50 {pct(walls, 50) * 1e3:.1f} ms, p99 {pct(walls, 99) * 1e3:.1f} ms wall "
            f"(bare `python -c pass`: {pct(bare, 50) * 1e3:.1f} ms)   target < 80 ms"
        )


def bench_dispatch(root: Path, n: int) -> None:
    from eventsched.wire.client import Client

    with Daemon(root / "dispatch", gpus="fake:4") as d:
        stamp_dir = root / "stamps"
        stamp_dir.mkdir()
        latencies = []
        bare = []
        with Client(d.socket) as c:
            for i in range(n):
                out = stamp_dir / f"{i}"
                # the job's first instruction writes the clock
                spec = JobSpec(command=[sys.executable, "-I", "-S", "-c", f"import time;open({str(out)!r},'w').write(repr(time.time()))"], gpus=0.1, cwd="/tmp")
                start = time.time()
                c.submit(spec)
                while not out.exists() or not out.read_text():
                    time.sleep(0.0005)
                latencies.append(float(out.read_text()) - start)
                out.unlink()
                start = time.time()
                subprocess.Popen(spec.command).wait()
                bare.append(float(out.read_text()) - start)
                out.unlink()
        print(
            f"dispatch latency, idle scheduler (submit -> first instruction): p50 {pct(latencies, 50) * 1e3:.1f} ms, "
            f"p99 {pct(latencies, 99) * 1e3:.1f} ms (bare spawn of the same command: p50 {pct(bare, 50) * 1e3:.1f} ms)   target p50 < 20 ms"
        )


def bench_drain(root: Path, n: int) -> None:
    from eventsched.wire.client import Client

    commands = [["/bin/true"] for _ in range(n)]
    start = time.perf_counter()
    subprocess.run(["xargs", "-P", "4", "-n", "1", "/bin/true"], input="\n".join("x" for _ in range(n)), text=True, check=True)
    xargs_s = time.perf_counter() - start
    with Daemon(root / "drain", gpus="fake:4") as d:
        with Client(d.socket) as c:
            start = time.perf_counter()
            # one pipelined batch, as a script submitting a sweep would
            ids = c.submit_many([JobSpec(command=cmd, gpus=1.0, cwd="/tmp") for cmd in commands])
            pending = set(ids)
            for batch in c.subscribe(from_seq=1):
                pending.difference_update(e.job for e in batch if type(e).__name__ == "JobExited")
                if not pending:
                    break
            drain_s = time.perf_counter() - start
    print(
        f"drain {n} trivial jobs, 4 at a time: {drain_s:.2f} s vs xargs -P 4 {xargs_s:.2f} s "
        f"= {drain_s / xargs_s:.1f}x   target within 3x (task-spooler 2.1x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller counts")
    args = parser.parse_args()
    scale = 0.2 if args.quick else 1.0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bench_submissions(root, int(20_000 * scale))
        bench_cli_submit(root, int(50 * scale) or 5)
        bench_dispatch(root, int(100 * scale) or 10)
        bench_drain(root, int(1000 * scale))


if __name__ == "__main__":
    main()
