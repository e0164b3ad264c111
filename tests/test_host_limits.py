"""Host memory limits (`submit --host-mem MIB`, `[scheduler] max_host_mem_mib`),
end to end: a real daemon, real memory hogs killed by the kernel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import Daemon

pytestmark = pytest.mark.slow

FINAL = {"succeeded", "failed", "cancelled", "lost"}
# allocates and touches 400 MiB (bytearray zero-fills: every page is written)
HOG = "import sys; b = bytearray(400 << 20); print('survived', len(b)); sys.stdout.flush()"


class LimitedDaemon(Daemon):
    """A daemon whose environment picks the enforcement (EVENTSCHED_MEMORY_LIMIT)."""

    mode: str = ""

    def env(self) -> dict[str, str]:
        env = super().env()
        if self.mode:
            env["EVENTSCHED_MEMORY_LIMIT"] = self.mode
        return env


def start(tmp_path: Path, max_mib: int = 0, mode: str = "") -> LimitedDaemon:
    config = tmp_path / "config.toml"
    config.write_text(f"[scheduler]\nmax_host_mem_mib = {max_mib}\n")
    d = LimitedDaemon(tmp_path / "state", gpus="fake:2", extra=["--config", str(config)])
    d.mode = mode
    return d.start()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[LimitedDaemon]:
    d = start(tmp_path, max_mib=1024)
    try:
        yield d
    finally:
        d.stop()


def python() -> str:
    import sys

    return sys.executable


def test_a_memory_hog_is_killed_by_its_limit_and_fails_with_that_reason(daemon: LimitedDaemon) -> None:
    mode = daemon.status()["memory_limit"]
    assert mode in ("cgroup2", "cgroup1", "rlimit-as")
    hog = daemon.submit("--gpus", "0", "--host-mem", "100", "--", python(), "-c", HOG)
    small = daemon.submit("--gpus", "0", "--host-mem", "100", "--", python(), "-c", "b = bytearray(10 << 20)")
    jobs = daemon.wait_states([hog, small], FINAL, timeout=60)
    assert jobs[hog]["state"] == "failed"
    assert jobs[hog]["exit_reason"] == "host memory limit", jobs[hog]
    assert "survived" not in daemon.cli("logs", str(hog)).stdout
    assert jobs[small]["state"] == "succeeded" and jobs[small]["exit_reason"] in ("", None)


def test_the_configured_maximum_is_the_limit_of_a_job_that_sets_none(tmp_path: Path) -> None:
    d = start(tmp_path, max_mib=100)
    try:
        hog = d.submit("--gpus", "0", "--", python(), "-c", HOG)
        jobs = d.wait_states([hog], FINAL, timeout=60)
        assert jobs[hog]["state"] == "failed" and jobs[hog]["exit_reason"] == "host memory limit"
    finally:
        d.stop()


def test_host_mem_above_the_maximum_is_refused_in_one_line(daemon: LimitedDaemon) -> None:
    result = daemon.cli("submit", "--gpus", "0", "--host-mem", "4096", "--", "true")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "eventsched: error: --host-mem 4096 MiB is above this machine's limit of 1024 MiB per job"
    ]
    result = daemon.cli("submit", "--gpus", "0", "--host-mem", "-5", "--", "true")
    assert result.returncode == 2 and "positive number of MiB" in result.stderr and "Traceback" not in result.stderr
    assert json.loads(daemon.cli("queue", "--all", "--json").stdout) == []


def test_under_rlimit_as_an_allocation_failure_is_reported_as_the_memory_limit(tmp_path: Path) -> None:
    d = start(tmp_path, mode="rlimit-as")
    try:
        assert d.status()["memory_limit"] == "rlimit-as"
        hog = d.submit("--gpus", "0", "--host-mem", "300", "--", python(), "-c", HOG)
        plain = d.submit("--gpus", "0", "--host-mem", "300", "--", python(), "-c", "raise SystemExit(3)")
        jobs = d.wait_states([hog, plain], FINAL, timeout=60)
        assert jobs[hog]["state"] == "failed" and jobs[hog]["exit_reason"] == "host memory limit"
        assert "MemoryError" in d.cli("logs", str(hog)).stdout
        # an ordinary failure under the same limit is not blamed on memory
        assert jobs[plain]["exit_code"] == 3 and jobs[plain]["exit_reason"] in ("", None)
    finally:
        d.stop()
