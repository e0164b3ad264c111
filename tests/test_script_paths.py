"""`[scheduler] allowed_script_paths`: what a job may run, checked at submit.
The rule itself on real files (no daemon), then end to end."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import Daemon

from eventsched.domain.events import JobSpec
from eventsched.runtime.api.script_paths import check


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """allowed/ with a script, a program and a link out; outside/ with a script."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "train.py").write_text("print('trained')\n")
    (outside / "evil.py").write_text("print('evil')\n")
    tool = allowed / "tool.sh"
    tool.write_text("#!/bin/sh\necho tool ran\n")
    tool.chmod(0o755)
    (allowed / "link.py").symlink_to(outside / "evil.py")
    return tmp_path


def spec(tree: Path, *command: str, **more: object) -> JobSpec:
    return JobSpec(command=list(command), cwd=str(tree / "allowed"), env={"PATH": "/usr/bin:/bin"}, **more)  # type: ignore[arg-type]


def test_the_rule_on_real_files(tree: Path) -> None:
    allowed = [str(tree / "allowed") + "/"]
    ok = lambda *cmd, **kw: check(spec(tree, *cmd, **kw), allowed, operator=False)  # noqa: E731
    assert ok("python3", "train.py") is None
    assert ok("python3", "-u", str(tree / "allowed" / "train.py"), "--lr", "3") is None
    assert ok("./tool.sh") is None
    assert ok("python3", "../outside/evil.py") is not None  # .. leads out
    assert ok("python3", "link.py") is not None  # a symbolic link leading out
    assert ok("python3", "-c", "print(1)") is not None  # inline code
    assert ok("bash", "-c", "echo hi") is not None
    assert ok("ls") is not None  # /usr/bin/ls is not under the allowed path
    assert ok("no-such-program-here") is not None
    assert ok("echo hi && rm -rf x", shell=True) is not None
    # root and the daemon's user may still run a shell command
    assert check(spec(tree, "echo hi", shell=True), allowed, operator=True) is None
    # an empty list allows anything
    assert check(spec(tree, "ls"), [], operator=False) is None


@pytest.fixture
def daemon(tree: Path) -> Iterator[Daemon]:
    config = tree / "config.toml"
    config.write_text(f'[scheduler]\nallowed_script_paths = ["{tree / "allowed"}/", "/nonexistent/data3/"]\n')
    with Daemon(tree / "state", gpus="fake:2", extra=["--config", str(config)]) as d:
        yield d


@pytest.mark.slow
def test_allowed_script_paths_end_to_end(daemon: Daemon, tree: Path) -> None:
    inside = daemon.submit("--gpus", "0", "--", sys.executable, "train.py", cwd=str(tree / "allowed"))
    program = daemon.submit("--gpus", "0", "--", "./tool.sh", cwd=str(tree / "allowed"))
    jobs = daemon.wait_states([inside, program], {"succeeded", "failed"})
    assert jobs[inside]["state"] == "succeeded" and jobs[program]["state"] == "succeeded"
    assert "trained" in daemon.cli("logs", str(inside)).stdout
    where = f"{tree / 'allowed'}/, /nonexistent/data3/"
    for cwd, script in (
        (tree / "outside", "evil.py"),  # outside
        (tree / "allowed", "../outside/evil.py"),  # a .. escape
        (tree / "allowed", "link.py"),  # a symbolic link leading outside
    ):
        result = daemon.cli("submit", "--gpus", "0", "--", sys.executable, script, cwd=str(cwd))
        assert result.returncode != 0, script
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, lines
        assert f"{script} (resolved to {os.path.realpath(tree / 'outside' / 'evil.py')})" in lines[0]
        assert where in lines[0]  # names the allowed paths
    assert set(daemon.jobs()) == {inside, program}  # nothing refused was queued
