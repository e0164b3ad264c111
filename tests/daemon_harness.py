"""Start a real ``eventsched serve`` process on fake GPUs and talk to it.

Shared by the end-to-end tests, the notebook tests and the benchmarks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eventsched.wire.client import Client
from eventsched.wire.errors import ClientError

EVENTSCHED = [sys.executable, "-m", "eventsched.cli"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (tests bind only there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(daemon: "Daemon", port: int, timeout: float = 20.0) -> None:
    """Until ``daemon``'s ``--http`` API on 127.0.0.1:``port`` answers: its socket answers first,
    the HTTP server a moment later."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            assert time.monotonic() < deadline, daemon.stderr()
            time.sleep(0.05)


def http_daemon(state: Path, tokens: list[dict[str, Any]], mode: int = 0o600) -> tuple["Daemon", int]:
    """A started daemon on fake GPUs with ``--http`` on a free 127.0.0.1 port, its API answering;
    its token file (written before it starts, with ``mode``) holds ``tokens``."""
    state.mkdir(parents=True, exist_ok=True)
    (state / "api-tokens.json").write_text(json.dumps({"version": 1, "tokens": tokens}))
    (state / "api-tokens.json").chmod(mode)
    port = free_port()
    daemon = Daemon(state, gpus="fake:2:16384", extra=["--http", f"127.0.0.1:{port}"]).start()
    try:
        wait_http(daemon, port)
    except BaseException:
        daemon.stop()
        raise
    return daemon, port


def cli_env(state_dir: Path, socket: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["EVENTSCHED_STATE_DIR"] = str(state_dir)
    env.pop("EVENTSCHED_SOCKET", None)
    if socket is not None:
        env["EVENTSCHED_SOCKET"] = str(socket)
    return env


@dataclass
class Daemon:
    state_dir: Path
    gpus: str = "fake:4:16384"
    extra: list[str] = field(default_factory=list)
    socket_path: Path | None = None  # default: <state-dir>/eventsched.sock
    process: subprocess.Popen | None = None

    @property
    def socket(self) -> Path:
        return self.socket_path or self.state_dir / "eventsched.sock"

    def env(self) -> dict[str, str]:
        return cli_env(self.state_dir, self.socket_path)

    def start(self, timeout: float = 20.0) -> "Daemon":
        self.state_dir.mkdir(parents=True, exist_ok=True)
        stderr = open(self.state_dir / "daemon.stderr", "ab")
        self.process = subprocess.Popen(
            [*EVENTSCHED, "serve", "--gpus", self.gpus, "--sample-interval", "0.2", *self.extra],
            env=self.env(),
            stdout=stderr,
            stderr=stderr,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._kill_group()
                raise RuntimeError(f"daemon exited with {self.process.returncode}: {self.stderr()}")
            if self._answers():
                return self
            time.sleep(0.05)
        self._kill_group()
        raise RuntimeError(f"daemon did not answer within {timeout}s: {self.stderr()}")

    def _kill_group(self) -> None:
        """A daemon that did not come up leaves nothing running: no test stops it."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: it and its helpers
        self.process.wait()

    def _answers(self) -> bool:
        """What ``eventsched health`` checks, asked from this process: polling
        with a CLI process each time would compete with the daemon starting."""
        try:
            with Client(self.socket, timeout=5.0) as client:
                return bool(client.ping().get("ok", True))
        except (OSError, ClientError):
            return False

    def stderr(self) -> str:
        try:
            return (self.state_dir / "daemon.stderr").read_text()[-4000:]
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def cli(self, *args: str, timeout: float = 30.0, cwd: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*EVENTSCHED, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )

    def submit(self, *args: str, cwd: str | None = None) -> int:
        result = self.cli("submit", *args, cwd=cwd)
        assert result.returncode == 0, result.stderr
        return int(result.stdout.strip())

    def logs(self, job: int) -> str:
        result = self.cli("logs", str(job))
        assert result.returncode == 0, result.stderr
        return result.stdout

    def jobs(self) -> dict[int, dict[str, Any]]:
        """What ``queue --all --json`` prints, by job id. Asked from this
        process (the tests poll it): the same request, through JSON as the CLI
        prints it, without starting a Python process every tenth of a second."""
        with Client(self.socket) as client:
            listed = client.jobs(all=True)
        return {job["id"]: job for job in json.loads(json.dumps(listed))}

    def status(self) -> dict[str, Any]:
        result = self.cli("status", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def wait_for(self, predicate, timeout: float = 20.0, what: str = "condition") -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        jobs: dict[int, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            jobs = self.jobs()
            if predicate(jobs):
                return jobs
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; jobs: {json.dumps(jobs, indent=1)[:3000]}")

    def wait_states(self, ids: list[int], states: set[str], timeout: float = 20.0) -> dict[int, dict[str, Any]]:
        return self.wait_for(
            lambda jobs: all(jobs.get(i, {}).get("state") in states for i in ids),
            timeout,
            f"jobs {ids} to reach {states}",
        )

    def wait_log_quiet(self, quiet_s: float = 1.0, timeout: float = 20.0) -> int:
        """Wait until the log has grown by nothing for ``quiet_s``: after the
        last job ends the GPU sampler still records the GPUs going idle, and a
        test that reads the log as a finished history needs its end fixed."""
        deadline = time.monotonic() + timeout
        with Client(self.socket) as client:
            seq, since = client.status()["seq"], time.monotonic()
            while time.monotonic() < deadline:
                time.sleep(0.1)
                now = client.status()["seq"]
                if now != seq:
                    seq, since = now, time.monotonic()
                elif time.monotonic() - since >= quiet_s:
                    return seq
        raise AssertionError(f"the log was still growing after {timeout} s (seq {seq})")

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def await_exits(client: Any, from_seq: int, jobs: set[int] | list[int]) -> int:
    """Follow ``client``'s event stream from ``from_seq`` until every one of
    ``jobs`` has exited; how many of them failed (a non-zero exit code)."""
    pending = set(jobs)
    failed = 0
    for batch in client.subscribe(from_seq=from_seq):
        for e in batch:
            if type(e).__name__ == "JobExited" and e.job in pending:
                pending.discard(e.job)
                failed += e.exit_code != 0
        if not pending:
            return failed
    return failed
