"""The replay's log writer on a worker thread (storage/background.py): every
batch lands in order, one frame each; the first failure stops all later
appends and reaches the producer."""

from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path

import pytest

from eventsched.storage import log
from eventsched.storage.background import BackgroundAppender
from eventsched.storage.log import LogFatalError, LogWriter

sys.path.insert(0, str(Path(__file__).parent))
from log_writer_proc import make_event  # noqa: E402


def test_batches_land_in_order_one_frame_each(tmp_path: Path) -> None:
    writer = LogWriter.open(tmp_path)
    appender = BackgroundAppender(writer, depth=1)
    sizes = [5, 1, 300, 2, 64]
    seq = 1
    for n in sizes:
        appender.append([make_event(s) for s in range(seq, seq + n)])
        seq += n
    appender.finish()
    writer.close()
    frames = list(log.read_batches(tmp_path))
    assert [len(f) for f in frames] == sizes
    assert [e for f in frames for e in f] == [make_event(s) for s in range(1, seq)]


def test_a_failure_stops_later_appends_and_is_raised(tmp_path: Path) -> None:
    writer = LogWriter.open(tmp_path)
    calls = 0
    real = writer._fdatasync
    gate = threading.Event()

    def fails_on_the_second_frame(fd: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            gate.set()
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    writer._fdatasync = fails_on_the_second_frame  # type: ignore[method-assign]
    appender = BackgroundAppender(writer, depth=4)
    appender.append([make_event(1), make_event(2)])
    appender.append([make_event(3)])
    appender.append([make_event(4)])  # queued behind the failure: never written
    assert gate.wait(10)
    with pytest.raises(LogFatalError, match="fdatasync"):
        appender.finish()
    with pytest.raises(LogFatalError):  # and again, to whoever asks next
        appender.append([make_event(5)])
    writer.close()
    assert calls == 2
    # the frame whose fdatasync failed was written and may or may not last
    # (the writer is dead, not rolled back); the one queued behind it never is
    assert [e.seq for f in log.read_batches(tmp_path) for e in f] == [1, 2, 3]


def test_finish_twice_is_harmless_and_append_after_it_is_refused(tmp_path: Path) -> None:
    with LogWriter.open(tmp_path) as writer:
        appender = BackgroundAppender(writer)
        appender.append([make_event(1)])
        appender.finish()
        appender.finish()
        with pytest.raises(RuntimeError, match="after finish"):
            appender.append([make_event(2)])
    assert [e.seq for f in log.read_batches(tmp_path) for e in f] == [1]
