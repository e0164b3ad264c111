"""One submit over the HTTP API (``serve --http``) against one over the socket,
in the same run on the same daemon.

Starts a daemon on fake GPUs in a temporary state directory (stopped by PID
at the end) with ``--http 127.0.0.1:PORT``, makes a token, then times N
submissions of a CPU-only ``true`` each way, alternating (so that noise from
other work on the machine falls on both alike), in two shapes:

- kept: one client for all of them (a kept-alive HTTP connection; one socket
  connection), which is what a script or notebook does;
- fresh: a new connection per submission, which is what one CLI call does
  (its process start-up aside: bench_cli.py measures that).

Prints p50 / p90 in milliseconds, and HTTP's p50 as a multiple of the socket's.

Run: python bench/bench_http.py [-n 300]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eventsched.domain.events import JobSpec  # noqa: E402
from eventsched.wire.client import Client  # noqa: E402
from eventsched.wire.http_client import HttpClient  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=300, help="submissions each way and shape (default 300)")
    opts = parser.parse_args()
    eventsched = str(Path(sys.executable).parent / "eventsched")
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        state = Path(tmp)
        env = {**os.environ, "EVENTSCHED_STATE_DIR": str(state)}
        env.pop("EVENTSCHED_URL", None)
        port = free_port()
        log = open(state / "daemon.log", "wb")
        daemon = subprocess.Popen([eventsched, "serve", "--gpus", "fake:4", "--http", f"127.0.0.1:{port}"],
                                  env=env, stdout=log, stderr=log, start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while subprocess.run([eventsched, "health"], env=env, capture_output=True).returncode != 0:
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the daemon did not start: {(state / 'daemon.log').read_text()[-2000:]}")
                time.sleep(0.1)
            made = subprocess.run([eventsched, "token", "create"], env=env, capture_output=True, text=True, check=True)
            token, url = made.stdout.strip(), f"http://127.0.0.1:{port}"
            spec = JobSpec(command=["true"], gpus=0.0, cwd=tmp, env={"PATH": "/usr/bin:/bin"})

            socket_kept, http_kept = Client(str(state / "eventsched.sock")), HttpClient(url, token)
            shapes: dict[str, dict[str, Callable[[], object]]] = {
                "kept": {"socket": lambda: socket_kept.submit(spec), "http": lambda: http_kept.submit(spec)},
                "fresh": {
                    "socket": lambda: Client(str(state / "eventsched.sock")).submit(spec),
                    "http": lambda: HttpClient(url, token).submit(spec),
                },
            }
            for calls in shapes.values():  # warm up both paths (imports, first connection)
                for submit in calls.values():
                    for _ in range(10):
                        submit()
            print(f"one submit, p50 / p90 in ms over {opts.n} each (daemon on fake:4, same run, alternating)")
            for shape, calls in shapes.items():
                times: dict[str, list[float]] = {way: [] for way in calls}
                for _ in range(opts.n):
                    for way, submit in calls.items():
                        t0 = time.perf_counter()
                        submit()
                        times[way].append(time.perf_counter() - t0)
                p50 = {way: pct(ts, 50) * 1000 for way, ts in times.items()}
                for way, ts in times.items():
                    print(f"  {shape:5s} {way:6s}  p50 {p50[way]:6.2f}  p90 {pct(ts, 90) * 1000:6.2f}")
                print(f"  {shape:5s} http / socket p50: {p50['http'] / p50['socket']:.1f}x")
            socket_kept.close()
            http_kept.close()
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


if __name__ == "__main__":
    main()
