"""Scheduler figures on this machine, with a real daemon on fake GPUs.

Prints: acknowledged submissions/s over the socket (1 and 8 clients each
waiting for its acknowledgement, the 8 both as connections of one asyncio
process and as 8 processes on the library's blocking ``Client``, and one
client pipelining its requests) with
p50 / p99 acknowledgement latency; wall time of one `eventsched submit` CLI
call; dispatch latency on an idle scheduler (the submission acknowledged ->
the job's first instruction); drain time of 1,000 trivial jobs at 4 at a time
as a ratio to `seq 1000 | xargs -P 4 -n 1 true`, timed just before each drain.

    .venv/bin/python bench/bench_scheduler.py [--quick] [--repeat R] [--only drain,dispatch,...]

With ``--repeat R`` each figure is measured R times (a fresh daemon each) and
the median is printed with every run's value.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemon_harness import Daemon, await_exits, cli_env  # noqa: E402

from eventsched.domain.events import JobSpec  # noqa: E402
from eventsched.wire import protocol  # noqa: E402
from eventsched.wire.client import Client  # noqa: E402

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


async def _pipeline(path: Path, count: int, window: int = 256) -> float:
    """One client sending ``count`` submissions pipelined, ``window`` ahead of
    the replies it has read (requests framed before the clock starts)."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    request = protocol.frame(protocol.SubmitJob(spec=JobSpec(command=["/bin/true"], gpus=1.0, cwd="/tmp")))
    chunk = request * window
    start = time.perf_counter()
    sent = received = 0
    while received < count:
        while sent < count and sent - received < 2 * window:
            n = min(window, count - sent)
            writer.write(chunk if n == window else request * n)
            sent += n
        header = await reader.readexactly(4)
        body = await reader.readexactly(struct.unpack(">I", header)[0])
        reply = protocol.server_message_decoder.decode(body)
        assert reply.ok, reply.error
        received += 1
    elapsed = time.perf_counter() - start
    writer.close()
    return count / elapsed


def _client_process(path: str, count: int, start_at: float, out: "multiprocessing.Queue[list[float]]") -> None:
    """One user's script: its own process, the library's blocking Client,
    each submission waiting for its acknowledgement."""
    client = Client(path)
    spec = JobSpec(command=["/bin/true"], gpus=1.0, cwd="/tmp")
    client.submit(spec)  # connected and warm before the clock starts (one of count)
    while time.time() < start_at:
        time.sleep(0.001)
    latencies = []
    for _ in range(count - 1):
        t0 = time.perf_counter()
        client.submit(spec)
        latencies.append(time.perf_counter() - t0)
    out.put(latencies)


def _submit_processes(path: Path, clients: int, per_client: int) -> tuple[float, list[float]]:
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[list[float]] = ctx.Queue()
    start_at = time.time() + 0.5
    procs = [ctx.Process(target=_client_process, args=(str(path), per_client, start_at, out))
             for _ in range(clients)]
    for proc in procs:
        proc.start()
    latencies = [lat for _ in procs for lat in out.get(timeout=120)]
    elapsed = time.time() - start_at
    for proc in procs:
        proc.join(10)
    return elapsed, latencies


@contextlib.contextmanager
def _bare_server(root: Path, kind: str) -> Iterator[tuple[Path, int]]:
    """bench/bare_commit_server.py on a socket of its own: (socket, pid)."""
    path = root / f"bare-{kind}.sock"
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("bare_commit_server.py")), str(path), str(root / f"bare-{kind}.dat"), kind]
    )
    try:
        deadline = time.monotonic() + 20
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bare {kind} server did not start")
            time.sleep(0.02)
        yield path, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)
        path.unlink(missing_ok=True)


def bench_ceiling(root: Path, total: int, repeat: int, daemon_rates: list[float]) -> None:
    """The same 8 client processes against a server that only group-commits
    and acknowledges, run right after the daemon's runs: how far the socket
    and fdatasync path alone lets the daemon go on this machine."""
    for kind, what in (("asyncio", "asyncio's loop (the daemon's transport layer)"), ("epoll", "a bare epoll loop, no asyncio")):
        rates, cpus = [], []
        for _ in range(repeat):
            with _bare_server(root, kind) as (path, pid):
                cpu0 = _proc_cpu(pid)
                elapsed, lat = _submit_processes(path, 8, total // 8)
                cpus.append((_proc_cpu(pid) - cpu0) / len(lat) * 1e6)
                rates.append(len(lat) / elapsed)
        share = statistics.median(daemon_rates) / statistics.median(rates) * 100
        print(
            f"  ceiling: the same 8 processes against a server that only writes, fdatasyncs and acknowledges "
            f"(bench/bare_commit_server.py), on {what}: {_median_line(rates, ',.0f')}/s, "
            f"{statistics.median(cpus):.0f} us of its CPU each; eventsched reaches {share:.0f}% of it"
        )


def _median_line(values: list[float], fmt: str) -> str:
    return f"median {format(statistics.median(values), fmt)} (runs: {', '.join(format(v, fmt) for v in values)})"


def _proc_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid``, all its threads (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_submissions(root: Path, total: int, repeat: int = 1) -> None:
    for clients, how in ((1, "asyncio"), (8, "asyncio"), (8, "processes")):
        rates, p50s, p99s, cpus, client_cpus = [], [], [], [], []
        for r in range(repeat):
            with Daemon(root / f"storm{clients}{how}-{r}", gpus="fake:4") as d:
                for gpu in range(4):
                    d.cli("pause-gpu", str(gpu))
                pid = d.process.pid if d.process is not None else 0
                cpu0 = _proc_cpu(pid)
                if how == "processes":
                    elapsed, lat = _submit_processes(d.socket, clients, total // clients)
                else:
                    own0 = time.process_time()
                    elapsed, lat = asyncio.run(_submit_storm(d.socket, clients, total // clients))
                    client_cpus.append((time.process_time() - own0) / elapsed * 100)
                cpus.append((_proc_cpu(pid) - cpu0) / len(lat) * 1e6)
                rates.append(len(lat) / elapsed)
                p50s.append(pct(lat, 50) * 1e3)
                p99s.append(pct(lat, 99) * 1e3)
        where = {"asyncio": "connections of one asyncio process", "processes": "processes (blocking Client)"}[how]
        print(
            f"submissions, {clients} client {where}, each waiting for its acknowledgement: "
            f"{_median_line(rates, ',.0f')} acknowledged/s, p50 {statistics.median(p50s):.2f} ms, "
            f"p99 {statistics.median(p99s):.2f} ms; daemon CPU {statistics.median(cpus):.0f} us/submission"
            + ("   target >= 15,000/s" if clients == 8 else "")
        )
        if client_cpus and clients > 1:
            # one process answers all its connections in turn: with 8 of them, its round trips bound the rate
            print(f"    the one client process was busy {statistics.median(client_cpus):.0f}% of the time")
        if how == "processes":
            bench_ceiling(root, total, repeat, rates)
    rates, cpus = [], []
    for r in range(repeat):
        with Daemon(root / f"pipeline-{r}", gpus="fake:4") as d:
            for gpu in range(4):
                d.cli("pause-gpu", str(gpu))
            pid = d.process.pid if d.process is not None else 0
            cpu0 = _proc_cpu(pid)
            rates.append(asyncio.run(_pipeline(d.socket, total)))
            cpus.append((_proc_cpu(pid) - cpu0) / total * 1e6)
    print(
        f"submissions, 1 client pipelining: {_median_line(rates, ',.0f')} acknowledged/s; "
        f"daemon CPU {statistics.median(cpus):.0f} us/submission   target >= 50,000/s"
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


def bench_dispatch(root: Path, n: int, repeat: int = 1) -> None:
    from eventsched.wire.client import Client

    p50s, p99s, bares = [], [], []
    for r in range(repeat):
        with Daemon(root / f"dispatch-{r}", gpus="fake:4") as d:
            stamp_dir = root / f"stamps-{r}"
            stamp_dir.mkdir()
            latencies = []
            bare = []
            with Client(d.socket) as c:
                for i in range(n):
                    out = stamp_dir / f"{i}"
                    # the job's first instruction writes the clock (bash: a
                    # Python job's own start-up, ~10 ms, would hide ours)
                    spec = JobSpec(command=["bash", "--norc", "-c", f"printf %s \"$EPOCHREALTIME\" > {out}"], gpus=0.1, cwd="/tmp")
                    c.submit(spec)
                    acked = time.time()  # from the acknowledgement, as the CLI's user sees it
                    while not out.exists() or not out.read_text():
                        time.sleep(0.0005)
                    latencies.append(float(out.read_text()) - acked)
                    out.unlink()
                    start = time.time()
                    subprocess.Popen(spec.command).wait()
                    bare.append(float(out.read_text()) - start)
                    out.unlink()
                    time.sleep(0.02)  # idle: the last job's exit is committed
            p50s.append(pct(latencies, 50) * 1e3)
            p99s.append(pct(latencies, 99) * 1e3)
            bares.append(pct(bare, 50) * 1e3)
    print(
        f"dispatch latency, idle scheduler (acknowledged -> first instruction): p50 {_median_line(p50s, '.1f')} ms, "
        f"p99 {statistics.median(p99s):.1f} ms (bare spawn of the same command: p50 {statistics.median(bares):.1f} ms)   target p50 < 5 ms"
    )


def bench_drain(root: Path, n: int, repeat: int = 1) -> None:
    from eventsched.wire.client import Client

    ratios, drains, floors, cpu_ratios, cpus = [], [], [], [], []
    for r in range(repeat):
        cpu0 = _children_cpu()
        start = time.perf_counter()
        subprocess.run(f"seq {n} | xargs -P 4 -n 1 true", shell=True, check=True)
        xargs_s = time.perf_counter() - start
        xargs_cpu = _children_cpu() - cpu0
        cpu0 = _children_cpu()  # the daemon's whole tree, once it is reaped: zygote, supervisors, jobs
        with Daemon(root / f"drain-{r}", gpus="fake:4") as d:
            with Client(d.socket) as c:
                seq = c.ping()["seq"]
                start = time.perf_counter()
                # one pipelined batch, as a script submitting a sweep would
                ids = c.submit_many([JobSpec(command=["true"], gpus=1.0, cwd="/tmp") for _ in range(n)])
                failed = await_exits(c, seq + 1, ids)
                drain_s = time.perf_counter() - start
        ours_cpu = _children_cpu() - cpu0
        assert not failed, f"{failed} jobs failed"
        drains.append(drain_s)
        floors.append(xargs_s)
        ratios.append(drain_s / xargs_s)
        cpus.append(ours_cpu / n * 1e3)
        cpu_ratios.append(ours_cpu / xargs_cpu)
    print(
        f"drain {n} `true` jobs (submit_many), 4 at a time: ratio to `seq {n} | xargs -P 4 -n 1 true` "
        f"{_median_line(ratios, '.2f')}; drain median {statistics.median(drains):.2f} s, "
        f"xargs median {statistics.median(floors):.2f} s   target <= 2.0x"
    )
    print(
        f"    CPU of the drain (daemon, zygote, supervisors, jobs; daemon start-up included): "
        f"median {statistics.median(cpus):.2f} ms/job = {_median_line(cpu_ratios, '.2f')} x xargs's"
    )
    note = _no_journal_note(root)
    if note:
        print(note)


def _no_journal_note(path: Path) -> str:
    """A warning where ``path`` is on ext4 without a journal (this VM's disk).

    There the kernel gives a new file no inode freed in the last 1-6 minutes:
    it checks the free ones one by one (recently_deleted, find_get_block_common:
    16 % of all CPU in a drain run right after an earlier run's 3,000 files were
    deleted). Each job creates 3 files, xargs none: 2.25-2.82x right after
    earlier runs, 1.60x after 7 idle minutes (perf, the same tree).
    """
    st = os.stat(path)
    try:
        device = os.path.basename(os.readlink(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"))
        journal = Path(f"/sys/fs/ext4/{device}/journal_task").read_text().strip()
    except OSError:  # not ext4, or no sysfs
        return ""
    if journal != "<none>":
        return ""
    return (
        f"    note: {path} is on ext4 without a journal ({device}): a file created there within minutes of many "
        "deletions (an earlier run's) is slower to create, so the drain is slower right after other runs"
    )


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller counts")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each figure (the median is printed)")
    parser.add_argument("--only", default="submissions,cli,dispatch,drain", help="comma-separated figures")
    args = parser.parse_args()
    scale = 0.2 if args.quick else 1.0
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "submissions" in only:
            bench_submissions(root, int(20_000 * scale), args.repeat)
        if "cli" in only:
            bench_cli_submit(root, int(50 * scale) or 5)
        if "dispatch" in only:
            bench_dispatch(root, int(100 * scale) or 10, args.repeat)
        if "drain" in only:
            bench_drain(root, int(1000 * scale), args.repeat)


if __name__ == "__main__":
    main()
