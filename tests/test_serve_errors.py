"""`serve` on a state it cannot use says why in one paragraph, exits non-zero,
and shows no traceback: mid-log damage, a log from a newer eventsched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eventsched.domain import events as ev
from eventsched.domain.settings import SETTINGS_VERSION
from eventsched.runtime.daemon import why_it_stopped
from eventsched.storage.log import LogCorruptError, LogWriter, segments
from daemon_harness import Daemon

pytestmark = pytest.mark.slow


def serve(state: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eventsched.cli", "serve", "--gpus", "fake:1", "--state-dir", str(state)],
                          capture_output=True, text=True, timeout=60)


def user_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("{")]  # JSON lines are the daemon's log


def test_damage_in_the_middle_of_the_log_gets_one_paragraph_with_the_repair_command(tmp_path: Path) -> None:
    with LogWriter.open(tmp_path / "log") as w:
        for i in range(5):
            w.append([ev.DaemonStopped(node="local", reason=f"stop {i}")])
    (seg,) = segments(tmp_path / "log")
    data = bytearray(Path(seg.path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(seg.path).write_bytes(bytes(data))
    before = Path(seg.path).read_bytes()

    result = serve(tmp_path)
    lines = user_lines(result.stderr)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "ExceptionGroup" not in result.stderr
    assert lines[0] == "eventsched: error: the event log is damaged, so the daemon did not start."
    assert f"eventsched log repair {tmp_path / 'log'}" in lines[1]
    assert "Nothing has been dropped or changed" in lines[2]
    assert len(lines) == 4
    assert Path(seg.path).read_bytes() == before  # nothing was cut without the repair


def test_a_log_from_a_newer_eventsched_is_refused_in_one_line(tmp_path: Path) -> None:
    with LogWriter.open(tmp_path / "log") as w:
        w.append([ev.DaemonStarted(node="local", pid=1, version="9.0", policy="best-fit",
                                   config={"settings_version": SETTINGS_VERSION + 1, "node": "local"})])
    result = serve(tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert user_lines(result.stderr) == [
        f"eventsched: error: {tmp_path / 'log'}: the log was written by a newer eventsched (scheduler settings "
        f"version {SETTINGS_VERSION + 1}; this one reads up to {SETTINGS_VERSION}): upgrade eventsched to use "
        "this state directory"
    ]


def test_errors_inside_task_groups_are_found_and_bugs_are_not_hidden(tmp_path: Path) -> None:
    nested = BaseExceptionGroup("outer", [ExceptionGroup("inner", [LogCorruptError("/s/log/x.seg", 7, "bad checksum")])])
    assert "log segment /s/log/x.seg is damaged at byte 7" in (why_it_stopped(nested, tmp_path) or "")
    assert why_it_stopped(ExceptionGroup("g", [ZeroDivisionError("bug")]), tmp_path) is None


def test_a_state_directory_deeper_than_a_socket_address_still_serves(tmp_path: Path) -> None:
    # A socket address holds 107 bytes; home directories and CI work trees run deeper.
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    assert len(str(deep / "eventsched.sock")) > 107
    with Daemon(deep) as d:
        job = d.submit("--", "true")
        assert d.wait_states([job], {"succeeded"})[job]["state"] == "succeeded"
        assert (deep / "eventsched.sock").is_socket()
    assert not (deep / "eventsched.sock").exists()
