"""Crash tests with real processes and real SIGKILLs: every acknowledged event
survives, in order, with no gaps, and the log always reopens for appends."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eventsched.domain import events as ev
from eventsched.storage import log, logtools
from eventsched.storage.log import LogWriter

sys.path.insert(0, str(Path(__file__).parent))
from log_writer_proc import make_event  # noqa: E402

WRITER = str(Path(__file__).parent / "log_writer_proc.py")


class Writer:
    """A writer subprocess whose acknowledged sequence numbers we collect."""

    def __init__(self, d: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, WRITER, str(d), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.acked = 0
        self.opened = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            if not raw.endswith(b"\n"):
                break  # a line cut by the kill is no acknowledgement
            line = raw.decode().strip()
            if line.startswith("open"):
                self.opened.set()
            elif line.isdigit():
                self.acked = int(line)

    def finish(self, timeout: float = 60) -> int:
        self.proc.wait(timeout=timeout)
        self._thread.join(timeout)
        return self.proc.returncode


EXPECTED: list[ev.Event] = []  # make_event(n) at n - 1, made once: each round rereads the whole log


def check_prefix(d: Path, acked: int) -> int:
    """The log is events 1..n with n >= acked, each with its expected content."""
    n = 0
    for e in log.read(d):
        n += 1
        if n > len(EXPECTED):
            EXPECTED.append(make_event(n))
        assert e == EXPECTED[n - 1], f"event {n} is wrong or out of order: {e}"
    assert n >= acked, f"acknowledged event {acked} lost (log ends at {n})"
    return n


@pytest.mark.slow
def test_sigkill_loop_never_loses_an_acknowledged_event(tmp_path: Path) -> None:
    d = tmp_path / "log"
    rng = random.Random(20240611)
    acked = 0
    rounds = 60
    for r in range(rounds):
        w = Writer(d, "--segment-bytes", "32768", "--max-batch", "40", "--seed", str(r))
        if rng.random() < 0.85:  # usually mid write storm; sometimes during start-up and recovery
            assert w.opened.wait(60), w.proc.stderr.read() if w.proc.stderr else ""
        time.sleep(rng.uniform(0.0, 0.06))
        w.proc.send_signal(signal.SIGKILL)
        assert w.finish() == -signal.SIGKILL
        acked = max(acked, w.acked)
        n = check_prefix(d, acked)
        acked = n  # what a reader saw is what the next writer must keep
    assert acked > 500, "the writer hardly wrote anything: the loop tests nothing"
    with LogWriter.open(d, segment_bytes=32768) as lw:
        assert lw.next_seq == acked + 1 or lw.next_seq > acked
    assert logtools.verify(d) == 0
    assert len(log.segments(d)) > 5  # kills landed across rotations too


ROTATION_STAGES = ["rotate:created", "rotate:written", "rotate:synced", "rotate:renamed", "rotate:dir-synced"]


@pytest.mark.parametrize("stage", ROTATION_STAGES)
def test_crash_during_rotation(tmp_path: Path, stage: str) -> None:
    d = tmp_path / "log"
    w = Writer(d, "--segment-bytes", "3000", "--max-batch", "10", "--crash-at", stage)
    assert w.finish() == -signal.SIGKILL
    assert w.acked > 0
    segs_before = log.segments(d)
    # rotation runs before the next append writes anything: the log is exactly what was acked
    assert check_prefix(d, w.acked) == w.acked
    with LogWriter.open(d, segment_bytes=3000) as lw:
        assert not list(d.glob("*.tmp"))
        assert lw.next_seq == w.acked + 1
        assert lw.recovered is None
        last = lw.append([make_event(s) for s in range(w.acked + 1, w.acked + 21)])
    assert check_prefix(d, last) == last
    assert len(log.segments(d)) >= len(segs_before)
    # and a writer process carries on from there, rotating again
    w2 = Writer(d, "--segment-bytes", "3000", "--count", "200")
    assert w2.finish() == 0
    assert check_prefix(d, w2.acked) == last + 200
    assert logtools.verify(d) == 0
