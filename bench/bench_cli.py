"""CLI start-up: one ``eventsched`` call, from process start to exit, against
``python -c pass`` (the interpreter's own start-up, the baseline) in the same run.

Starts a daemon on fake GPUs in a temporary state directory (stopped by PID
at the end), then runs each command N times, round-robin (so that noise from
other work on the machine falls on all of them alike), and prints p50 / p90
of the wall time and of the CPU time (user + sys, from wait4: steadier on a
busy machine), and each p50 as a multiple of ``python -c pass``'s.

The ``eventsched`` measured is the README's install (``.venv/bin/eventsched``,
made by scripts/setup.sh) unless ``--eventsched PATH`` names another.
``PYTHONDONTWRITEBYTECODE`` is dropped from the commands' environment (a
user's shell does not set it; with it, every call would compile the CLI's
modules again): ``--keep-env`` keeps it.

Run: python bench/bench_cli.py [-n 50] [--eventsched PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall s, child CPU s, exit status) of one run, stdout to /dev/null."""
    t0 = time.perf_counter()
    pid = os.posix_spawn(argv[0], argv, env, file_actions=[(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)])
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    return wall, usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status)


def start_daemon(eventsched: str, state: Path, env: dict[str, str]) -> subprocess.Popen:
    log = open(state / "daemon.log", "wb")
    daemon = subprocess.Popen(
        [eventsched, "serve", "--gpus", "fake:4"], env=env, stdout=log, stderr=log, start_new_session=True
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"the daemon exited: {(state / 'daemon.log').read_text()}")
        if subprocess.run([eventsched, "health"], env=env, capture_output=True).returncode == 0:
            return daemon
        time.sleep(0.1)
    raise SystemExit("the daemon did not start in 30 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=50, help="runs of each command (default 50)")
    ap.add_argument("--eventsched", default=str(ROOT / ".venv/bin/eventsched"), help="the eventsched command to time")
    ap.add_argument("--keep-env", action="store_true", help="keep PYTHONDONTWRITEBYTECODE if it is set")
    opts = ap.parse_args()

    eventsched = opts.eventsched
    with open(eventsched, "rb") as f:  # the interpreter its wrapper runs is the baseline's
        shebang = f.readline().decode(errors="replace").removeprefix("#!").split()
    python = shebang[0] if shebang and os.path.basename(shebang[0]).startswith("python") else sys.executable
    env = dict(os.environ)
    if not opts.keep_env:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    state = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    env["EVENTSCHED_STATE_DIR"] = str(state)
    env.pop("EVENTSCHED_SOCKET", None)
    commands = {
        "python -c pass": [python, "-c", "pass"],
        "python -S -c pass": [python, "-S", "-c", "pass"],
        "eventsched --version": [eventsched, "--version"],
        "eventsched health": [eventsched, "health"],
        "eventsched submit -- true": [eventsched, "submit", "--", "true"],
    }
    daemon: subprocess.Popen | None = None
    try:
        daemon = start_daemon(eventsched, state, env)
        for name, argv in list(commands.items()):  # warm the page cache (and the .pyc files)
            if any(run_once(argv, env)[2] for _ in range(3)):
                print(f"({name} fails with this eventsched: left out)")
                del commands[name]
        wall: dict[str, list[float]] = {name: [] for name in commands}
        cpu: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(opts.n):
            for name, argv in commands.items():
                w, c, code = run_once(argv, env)
                if code != 0:
                    raise SystemExit(f"{name} exited with {code}")
                wall[name].append(w)
                cpu[name].append(c)
    finally:
        if daemon is not None:
            os.kill(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(daemon.pid, signal.SIGKILL)
                daemon.wait()
        shutil.rmtree(state, ignore_errors=True)

    base_wall = statistics.median(wall["python -c pass"])
    base_cpu = statistics.median(cpu["python -c pass"])
    print(f"CLI start-up, N={opts.n} each, round-robin; {eventsched} (python: {python}, {os.cpu_count()} CPUs)")
    print(f"{'command':<28}{'wall p50':>10}{'p90':>9}{'× pass':>8}   {'CPU p50':>9}{'p90':>9}{'× pass':>8}")
    for name in commands:
        w50, c50 = statistics.median(wall[name]), statistics.median(cpu[name])
        print(
            f"{name:<28}{w50 * 1e3:8.1f}ms{pct(wall[name], 90) * 1e3:7.1f}ms{w50 / base_wall:7.2f}×"
            f"   {c50 * 1e3:7.1f}ms{pct(cpu[name], 90) * 1e3:7.1f}ms{c50 / base_cpu:7.2f}×"
        )
    ratio = statistics.median(wall["eventsched submit -- true"]) / base_wall
    print(f"\nsubmit / python -c pass (wall p50): {ratio:.2f}× (target <= 2×)")


if __name__ == "__main__":
    main()
