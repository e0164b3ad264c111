"""The event log: appends, reads, rotation, recovery of torn tails, refusal of
damage, the writer lock, ENOSPC and EIO, tailing, and the log tools."""

from __future__ import annotations

import errno
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eventsched.domain import events as ev
from eventsched.storage import log, logtools
from eventsched.storage.log import (
    FRAME_HEADER_SIZE,
    SEGMENT_HEADER_SIZE,
    LogCorruptError,
    LogFatalError,
    LogFullError,
    LogLockedError,
    LogWriter,
)

sys.path.insert(0, str(Path(__file__).parent))
from crash_fs import SCRATCH  # noqa: E402
from log_writer_proc import make_event  # noqa: E402

WRITER = str(Path(__file__).parent / "log_writer_proc.py")


def events(first: int, n: int) -> list[ev.Event]:
    return [make_event(s) for s in range(first, first + n)]


def write_log(d: Path, batches: list[int], segment_bytes: int = 64 << 20) -> list[int]:
    """Append batches of the given sizes; return each frame's end offset (one segment)."""
    ends = []
    with LogWriter.open(d, segment_bytes=segment_bytes) as w:
        for n in batches:
            w.append(events(w.next_seq, n))
            ends.append(w._end)
    return ends


def seg_files(d: Path) -> list[Path]:
    return [Path(s.path) for s in log.segments(d)]


def assert_log(d: Path, n: int) -> None:
    """The log holds exactly events 1..n, with the expected content."""
    got = list(log.read(d))
    assert [e.seq for e in got] == list(range(1, n + 1))
    assert got == events(1, n)


# --- appending and reading ------------------------------------------------


def test_append_read_and_reopen(tmp_path: Path) -> None:
    d = tmp_path / "log"
    with LogWriter.open(d) as w:
        assert w.next_seq == 1
        assert w.append(events(1, 3)) == 3
        assert w.append([]) == 3  # nothing to write, nothing written
        # events arrive unstamped from the engine; the log gives them their seq
        unstamped = [msgspec_replace(e, seq=0) for e in events(4, 2)]
        assert w.append(unstamped) == 5
        assert w.next_seq == 6
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert_log(d, 5)
    assert [len(b) for b in log.read_batches(d)] == [3, 2]
    assert [e.seq for e in log.read(d, from_seq=2)] == [2, 3, 4, 5]
    assert [len(b) for b in log.read_batches(d, from_seq=2)] == [2, 2]
    assert list(log.read(d, from_seq=6)) == []
    assert log.last_seq(d) == 5
    with LogWriter.open(d) as w:
        assert w.recovered is None
        assert w.next_seq == 6
        assert w.append_stamped(events(6, 1))[0].seq == 6
        # what the engine broadcasts to subscribers: the stored events' own bytes
        last, payload = w.append_encoded(events(7, 2))
        assert last == 8
    assert_log(d, 8)
    assert ev.decode_many(payload) == list(log.read(d, from_seq=7))


def msgspec_replace(e: ev.Event, **kw: object) -> ev.Event:
    import msgspec

    return msgspec.structs.replace(e, **kw)


def test_missing_or_empty_log_reads_nothing(tmp_path: Path) -> None:
    assert list(log.read(tmp_path / "nope")) == []
    assert log.last_seq(tmp_path / "nope") == 0
    LogWriter.open(tmp_path / "new").close()
    assert list(log.read(tmp_path / "new")) == []
    assert log.last_seq(tmp_path / "new") == 0


def test_rotation_names_segments_by_first_seq(tmp_path: Path) -> None:
    d = tmp_path / "log"
    write_log(d, [5] * 40, segment_bytes=2000)
    segs = log.segments(d)
    assert len(segs) > 3
    assert segs[0].first_seq == 1
    for seg in segs:
        assert Path(seg.path).name == f"{seg.first_seq:020d}.seg"
        assert Path(seg.path).read_bytes()[:8] == b"EVSCHLOG"
    salts = {Path(s.path).read_bytes()[12:16] for s in segs}
    assert len(salts) == len(segs)  # a fresh random salt per segment
    assert_log(d, 200)
    assert [e.seq for e in log.read(d, from_seq=137)] == list(range(137, 201))
    with LogWriter.open(d, segment_bytes=2000) as w:
        assert w.next_seq == 201
        w.rotate()
        w.rotate()  # rotating an empty segment does nothing
        w.append(events(201, 1))
    assert log.segments(d)[-1].first_seq == 201
    assert_log(d, 201)


# --- torn tails: cut, kept aside, appends go on ------------------------------


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:
        yield Path(tmp)


@pytest.mark.slow
def test_truncate_at_every_offset_of_last_frames(scratch: Path) -> None:
    src = scratch / "src"
    # a sealed segment first, then a last segment with frames of varied sizes
    write_log(src, [30, 30], segment_bytes=1)
    ends = write_log(src, [1, 4, 2, 7, 1])
    first_seg, last_seg = seg_files(src)
    data = last_seg.read_bytes()
    seqs_by_end = {SEGMENT_HEADER_SIZE: 60}
    total = 60
    for n, end in zip([1, 4, 2, 7, 1], ends):
        total += n
        seqs_by_end[end] = total
    start = ends[1]  # every offset inside the last three frames, and their ends
    for cut in range(start, len(data) + 1):
        d = scratch / f"t{cut}"
        d.mkdir()
        (d / first_seg.name).write_bytes(first_seg.read_bytes())
        (d / last_seg.name).write_bytes(data[:cut])
        good_end = max(e for e in seqs_by_end if e <= cut)
        n = seqs_by_end[good_end]
        with LogWriter.open(d) as w:
            assert w.next_seq == n + 1
            if cut == good_end:
                assert w.recovered is None
            else:
                r = w.recovered
                assert r is not None
                assert (r.offset, r.bytes_cut, r.next_seq) == (good_end, cut - good_end, n + 1)
                assert Path(r.kept_at).read_bytes() == data[good_end:cut]
                assert Path(r.kept_at).name == f"{last_seg.name}.torn-{good_end}"
            w.append(events(n + 1, 2))
        assert_log(d, n + 2)
        with LogWriter.open(d) as w:
            assert w.recovered is None and w.next_seq == n + 3
        shutil.rmtree(d)  # the next cut's log is a fresh copy; tmpfs is memory


def _frame(salt: int, first: int, evs: list[ev.Event]) -> bytes:
    return log._frame_bytes(salt, first, len(evs), ev.encode_many(evs))


def _salt(seg: Path) -> int:
    return int.from_bytes(seg.read_bytes()[12:16], "little")


@pytest.mark.parametrize(
    "tail",
    ["random", "bad-length", "huge-length", "wrong-salt", "short-header", "zeros-then-bytes"],
)
def test_garbage_tail_is_cut_and_kept(tmp_path: Path, tail: str) -> None:
    d = tmp_path / "log"
    write_log(d, [3, 3, 3])
    (seg,) = seg_files(d)
    rng = random.Random(tail)
    if tail == "random":
        junk = bytes(rng.randrange(256) for _ in range(3000))
    elif tail == "bad-length":  # a real next frame whose length field is wrong
        frame = bytearray(_frame(_salt(seg), 10, events(10, 2)))
        frame[4:8] = (len(frame) - FRAME_HEADER_SIZE - 5).to_bytes(4, "little")
        junk = bytes(frame)
    elif tail == "huge-length":
        frame = bytearray(_frame(_salt(seg), 10, events(10, 2)))
        frame[4:8] = (0xFFFFFFF0).to_bytes(4, "little")
        junk = bytes(frame)
    elif tail == "wrong-salt":  # a complete frame that belongs to another segment
        junk = _frame(_salt(seg) ^ 1, 10, events(10, 2))
    elif tail == "short-header":
        junk = _frame(_salt(seg), 10, events(10, 1))[:FRAME_HEADER_SIZE - 3]
    else:  # a frame torn inside the zeros written ahead: its header never reached the disk
        frame = _frame(_salt(seg), 10, events(10, 2))
        junk = bytes(FRAME_HEADER_SIZE + 40) + frame[FRAME_HEADER_SIZE + 40:]
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(junk)
    assert logtools.verify(d) == 1  # reported, as a torn tail
    with LogWriter.open(d) as w:
        r = w.recovered
        assert r is not None and r.offset == size and r.bytes_cut == len(junk)
        assert Path(r.kept_at).read_bytes() == junk
        assert seg.stat().st_size == size
        assert w.append(events(10, 1)) == 10
    assert_log(d, 10)
    assert logtools.verify(d) == 0


@pytest.mark.parametrize("finished", [True, False])
def test_verify_of_a_live_log_waits_out_a_frame_in_flight(tmp_path: Path, finished: bool) -> None:
    """What `log verify` reads while the daemon writes: a frame whose body is
    there and whose header is not yet. While a writer holds the log it looks
    again, so a write that finishes is no torn tail; one that does not is."""
    d = tmp_path / "log"
    write_log(d, [3, 3, 3])
    (seg,) = seg_files(d)
    size = seg.stat().st_size
    frame = _frame(_salt(seg), 10, events(10, 2))
    with open(seg, "ab") as f:
        f.write(bytes(FRAME_HEADER_SIZE) + frame[FRAME_HEADER_SIZE:])
    holder = log.try_lock(str(d / log.LOCK_NAME))  # as the live daemon's writer holds it
    assert holder is not None

    def finish() -> None:
        fd = os.open(seg, os.O_WRONLY)
        try:
            os.pwrite(fd, frame[:FRAME_HEADER_SIZE], size)
        finally:
            os.close(fd)

    timer = threading.Timer(0.03, finish)  # the writer's copy finishing
    if finished:
        timer.start()
    try:
        assert logtools.verify(d) == (0 if finished else 1)
    finally:
        if finished:
            timer.join()
        os.close(holder)
    if finished:
        assert [e.seq for e in log.read(d)] == list(range(1, 12))


@pytest.mark.parametrize("zeros", [FRAME_HEADER_SIZE, 4096, 3 << 20])
def test_zeros_after_the_last_frame_are_space_written_ahead(tmp_path: Path, zeros: int) -> None:
    """What a crash leaves of a preallocated segment (or a file that grew while
    its data never reached the disk): nothing to cut, the next frame goes
    where the zeros start, and readers stop there."""
    d = tmp_path / "log"
    write_log(d, [3, 3, 3])
    (seg,) = seg_files(d)
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(bytes(zeros))
    assert logtools.verify(d) == 0
    assert [e.seq for e in log.read(d)] == list(range(1, 10))
    assert log.last_seq(d) == 9
    with LogWriter.open(d) as w:
        assert w.recovered is None
        assert w._end == size  # the next frame goes where the zeros start
        assert w.append(events(10, 2)) == 11
        assert seg.stat().st_size >= size + zeros
    assert_log(d, 11)
    assert seg.stat().st_size == size + len(_frame(_salt(seg), 10, events(10, 2)))  # cut to its frames on close


def test_a_commit_writes_ahead_and_sealing_cuts_it(tmp_path: Path) -> None:
    d = tmp_path / "log"
    w = LogWriter.open(d, segment_bytes=4096)
    try:
        (first,) = seg_files(d)
        assert first.stat().st_size == log.SEGMENT_HEADER_SIZE + log.PREALLOCATE
        w.append(events(1, 3))
        assert first.stat().st_size == log.SEGMENT_HEADER_SIZE + log.PREALLOCATE  # no size change per commit
        big = [ev.JobSubmitted(ts=1.0, job=100 + i, spec=ev.JobSpec(command=["x" * 200])) for i in range(20)]
        w.append(big)  # past segment_bytes: the next append rotates
        sealed_at = w._end
        w.append(events(30, 1))
        first_sealed, second = seg_files(d)
        assert first_sealed.stat().st_size == sealed_at  # sealed: ends at its last frame
        assert second.stat().st_size == log.SEGMENT_HEADER_SIZE + log.PREALLOCATE
        assert [e.seq for e in log.read(d)] == list(range(1, 25))
    finally:
        w.close()
    assert logtools.verify(d) == 0


def test_no_room_to_write_ahead_commits_the_frame_alone(tmp_path: Path) -> None:
    d = tmp_path / "log"
    w = LogWriter.open(d)
    try:
        w._allocated = w._end  # as if the zeros were used up
        real = w._pwrite

        def no_room_for_much(fd: int, data: bytes | memoryview, offset: int) -> int:
            if len(data) > 64 << 10:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data, offset)

        w._pwrite = no_room_for_much  # type: ignore[method-assign]
        assert w.append(events(1, 2)) == 2
        (seg,) = seg_files(d)
        assert seg.stat().st_size == w._end  # the frame alone
    finally:
        w.close()
    assert_log(d, 2)


# --- damage: detected, refused, never silently truncated --------------------


@pytest.mark.parametrize("where", ["frame-header", "payload", "checksum", "seq-field"])
def test_flipped_bit_mid_log_refuses_to_open(tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "log"
    ends = write_log(d, [3, 3, 3, 3])
    (seg,) = seg_files(d)
    off = ends[0]  # the second frame
    pos = {"frame-header": off + 5, "payload": off + FRAME_HEADER_SIZE + 17, "checksum": off, "seq-field": off + 8}[where]
    data = bytearray(seg.read_bytes())
    data[pos] ^= 0x10
    seg.write_bytes(bytes(data))
    with pytest.raises(LogCorruptError) as info:
        LogWriter.open(d)
    err = info.value
    assert (err.segment, err.offset) == (str(seg), off)
    assert str(seg) in str(err) and f"byte {off}" in str(err) and "eventsched log repair" in str(err)
    assert "\n" not in str(err)
    assert seg.read_bytes() == bytes(data)  # nothing cut
    assert not list(d.glob("*.torn-*"))
    # the lock was released on refusal
    with pytest.raises(LogCorruptError):
        LogWriter.open(d)
    with pytest.raises(LogCorruptError):
        list(log.read(d))
    capsys.readouterr()
    assert logtools.verify(d) == 1
    out = capsys.readouterr().err
    assert str(seg) in out and f"byte {off}" in out
    # repair: cut at the damage, keep the rest aside, then the log works again
    assert logtools.repair(d) == 0
    assert f"byte {off}" in capsys.readouterr().out
    assert Path(f"{seg}.torn-{off}").read_bytes() == bytes(data[off:])
    assert_log(d, 3)
    with LogWriter.open(d) as w:
        assert w.next_seq == 4
        w.append(events(4, 1))
    assert_log(d, 4)
    assert logtools.verify(d) == 0


def test_repair_makes_the_kept_bytes_durable_before_it_cuts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A power cut right after repair's truncate must not lose the bytes it cut:
    the aside file's name reaches the disk (directory fsync) before the cut."""
    from crash_fs import Recorder

    d = tmp_path / "log"
    ends = write_log(d, [3, 3, 3])
    (seg,) = seg_files(d)
    data = bytearray(seg.read_bytes())
    data[ends[0] + FRAME_HEADER_SIZE + 3] ^= 0x10
    seg.write_bytes(bytes(data))
    rec = Recorder(d)
    assert logtools.repair(d, rec) == 0
    kinds = [op.kind for op in rec.ops]
    created = next(i for i, op in enumerate(rec.ops) if op.kind == "create" and ".torn-" in op.path)
    cut = kinds.index("truncate")
    assert "dirsync" in kinds[created:cut], kinds
    capsys.readouterr()


def test_damage_in_sealed_segment_refuses_even_at_its_end(tmp_path: Path) -> None:
    d = tmp_path / "log"
    write_log(d, [4, 4, 4], segment_bytes=1)  # one frame per segment
    segs = seg_files(d)
    middle = segs[1]
    size = middle.stat().st_size
    with open(middle, "r+b") as f:  # damage the last frame of a sealed segment
        f.truncate(size - 1)
    with pytest.raises(LogCorruptError) as info:
        LogWriter.open(d)
    assert info.value.segment == str(middle) and info.value.offset == SEGMENT_HEADER_SIZE
    with pytest.raises(LogCorruptError):
        list(log.read(d))
    assert logtools.repair(d) == 0
    # the damaged segment is cut and every later one moved aside: no gaps
    assert Path(f"{segs[2]}.torn-0").exists()
    assert_log(d, 4)
    with LogWriter.open(d) as w:
        assert w.next_seq == 5


def _runs_of_scan(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The segments whose every frame an open walks, in order."""
    walked: list[str] = []
    original = log.SegmentScan.run

    def run(self: log.SegmentScan) -> log.SegmentScan:
        walked.append(self.path)
        return original(self)

    monkeypatch.setattr(log.SegmentScan, "run", run)
    return walked


def test_a_restart_walks_only_the_last_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "log"
    write_log(d, [3] * 6, segment_bytes=1)  # six segments, five of them sealed
    segs = [str(p) for p in seg_files(d)]
    walked = _runs_of_scan(monkeypatch)
    LogWriter.open(d).close()  # the first open checks every frame, and remembers the sealed ones
    assert walked == segs
    walked.clear()
    with LogWriter.open(d, segment_bytes=1) as w:
        assert w.next_seq == 19
        for _ in range(3):
            w.append(events(w.next_seq, 2))  # new segments: the sixth is sealed now
    assert walked == segs[-1:]
    now = [str(p) for p in seg_files(d)]
    assert len(now) > len(segs)
    walked.clear()
    LogWriter.open(d).close()
    assert walked == now[len(segs) - 1:]  # the newly sealed ones, once, and the last
    assert_log(d, 24)


def test_a_sealed_segment_changed_after_its_check_is_checked_again(tmp_path: Path) -> None:
    d = tmp_path / "log"
    write_log(d, [4, 4, 4], segment_bytes=1)
    LogWriter.open(d).close()
    middle = seg_files(d)[1]
    data = bytearray(middle.read_bytes())
    data[-2] ^= 0x10  # the write changes its mtime
    middle.write_bytes(bytes(data))
    with pytest.raises(LogCorruptError) as info:
        LogWriter.open(d)
    assert info.value.segment == str(middle)


def test_damage_that_keeps_size_and_mtime_is_found_by_readers(tmp_path: Path) -> None:
    # the price of not walking sealed segments at each open (bit rot keeps
    # both): the damage is found where events are read, and by log verify
    d = tmp_path / "log"
    write_log(d, [4, 4, 4], segment_bytes=1)
    LogWriter.open(d).close()
    middle = seg_files(d)[1]
    before = middle.stat()
    data = bytearray(middle.read_bytes())
    data[-2] ^= 0x10
    middle.write_bytes(bytes(data))
    os.utime(middle, ns=(before.st_atime_ns, before.st_mtime_ns))
    LogWriter.open(d).close()
    with pytest.raises(LogCorruptError):
        list(log.read(d))
    assert logtools.verify(d) != 0


def test_an_unreadable_verified_list_costs_only_a_full_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "log"
    write_log(d, [2, 2, 2], segment_bytes=1)
    (d / log.VERIFIED_NAME).write_bytes(b"\xff garbage\n00000000000000000001.seg x y z\n")
    walked = _runs_of_scan(monkeypatch)
    with LogWriter.open(d) as w:
        assert w.next_seq == 7
    assert walked == [str(p) for p in seg_files(d)]
    assert len((d / log.VERIFIED_NAME).read_text().splitlines()) == 2  # written anew
    assert stat.S_IMODE((d / log.VERIFIED_NAME).stat().st_mode) == 0o600


def test_missing_segment_is_a_gap(tmp_path: Path) -> None:
    d = tmp_path / "log"
    write_log(d, [2, 2, 2], segment_bytes=1)
    seg_files(d)[1].unlink()
    with pytest.raises(LogCorruptError, match="expected 3"):
        LogWriter.open(d)
    with pytest.raises(LogCorruptError):
        list(log.read(d))


def test_bad_segment_header(tmp_path: Path) -> None:
    d = tmp_path / "log"
    write_log(d, [2])
    (seg,) = seg_files(d)
    data = bytearray(seg.read_bytes())
    data[0] = ord("X")
    seg.write_bytes(bytes(data))
    with pytest.raises(LogCorruptError, match="bad magic"):
        LogWriter.open(d)


# --- one writer -------------------------------------------------------------


def test_second_writer_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "log"
    with LogWriter.open(d):
        with pytest.raises(LogLockedError, match=f"log {d} is locked by pid {os.getpid()}"):
            LogWriter.open(d)
        code = f"from eventsched.storage.log import LogWriter, LogError\ntry:\n LogWriter.open({str(d)!r})\nexcept LogError as e:\n print(e)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert f"locked by pid {os.getpid()}" in out.stdout
        assert logtools.repair(d) == 1  # repair never runs under a live writer
    with LogWriter.open(d) as w:  # free again once the first one closed
        w.append(events(1, 1))


# --- ENOSPC and EIO ---------------------------------------------------------


def _enospc_after(n_bytes: int):
    def pwrite(fd: int, data: bytes | memoryview, offset: int) -> int:
        if len(data) > n_bytes:  # part goes in, then the disk is full
            if n_bytes:
                return os.pwrite(fd, bytes(data[:n_bytes]), offset)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return pwrite


def test_enospc_fails_the_append_and_damages_nothing(tmp_path: Path) -> None:
    d = tmp_path / "log"
    with LogWriter.open(d) as w:
        w.append(events(1, 5))
        end = w._end
        w._pwrite = _enospc_after(40)  # type: ignore[method-assign]
        with pytest.raises(LogFullError, match="out of disk space"):
            w.append(events(6, 3))
        assert seg_files(d)[0].stat().st_size == end  # partial frame undone
        assert w.next_seq == 6
        assert_log(d, 5)
        with pytest.raises(LogFullError):
            w.append(events(6, 3))
        del w._pwrite  # space is back
        assert w.append(events(6, 3)) == 8
    assert_log(d, 8)
    with LogWriter.open(d) as w:
        assert w.recovered is None and w.next_seq == 9


def test_enospc_during_rotation(tmp_path: Path) -> None:
    d = tmp_path / "log"
    with LogWriter.open(d, segment_bytes=100) as w:
        w.append(events(1, 5))
        w._pwrite = _enospc_after(0)  # type: ignore[method-assign]
        with pytest.raises(LogFullError):
            w.append(events(6, 1))
        assert len(log.segments(d)) == 1 and not list(d.glob("*.tmp"))
        del w._pwrite
        w.append(events(6, 1))
    assert len(log.segments(d)) == 2
    assert_log(d, 6)


def test_fsync_error_is_fatal_and_never_retried(tmp_path: Path) -> None:
    d = tmp_path / "log"
    calls = []

    def failing(fd: int) -> None:
        calls.append(fd)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with LogWriter.open(d) as w:
        w.append(events(1, 2))
        w._fdatasync = failing  # type: ignore[method-assign]
        with pytest.raises(LogFatalError, match="fdatasync"):
            w.append(events(3, 1))
        del w._fdatasync
        with pytest.raises(LogFatalError):
            w.append(events(3, 1))
        assert len(calls) == 1
    # a restart recovers: the log opens and is a clean prefix
    with LogWriter.open(d) as w:
        assert w.next_seq in (3, 4)
        n = w.append(events(w.next_seq, 1))
    assert_log(d, n)


# --- tailing ----------------------------------------------------------------


def test_follow_and_read_while_another_process_appends(tmp_path: Path) -> None:
    d = tmp_path / "log"
    n = 3000
    proc = subprocess.Popen(
        [sys.executable, WRITER, str(d), "--count", str(n), "--segment-bytes", "20000", "--max-batch", "30"],
        stdout=subprocess.PIPE,
        text=True,
    )
    stop = threading.Event()
    seen: list[ev.Event] = []
    prefixes: list[int] = []
    timer = threading.Timer(120, stop.set)  # never hang the suite
    timer.start()
    try:
        for batch in log.follow(d, stop=stop, poll_max_s=0.2):
            seen.extend(batch)
            if len(prefixes) < 20:  # plain reads meanwhile: always a gap-free prefix
                got = [e.seq for e in log.read(d)]
                assert got == list(range(1, len(got) + 1))
                prefixes.append(len(got))
            if seen[-1].seq >= n:
                stop.set()
    finally:
        timer.cancel()
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert seen == events(1, n)
    assert len(log.segments(d)) > 3  # it followed rotations
    # from the middle, and stopping when there is nothing new
    stop2 = threading.Event()
    got2 = []
    for batch in log.follow(d, from_seq=2500, stop=stop2, poll_max_s=0.05):
        got2.extend(batch)
        if got2[-1].seq == n:
            stop2.set()
    assert got2 == events(2500, n - 2499)


def test_follow_returns_when_stopped_while_idle(tmp_path: Path) -> None:
    d = tmp_path / "log"
    write_log(d, [2])
    stop = threading.Event()
    out: list[list[ev.Event]] = []

    def run() -> None:
        out.extend(log.follow(d, stop=stop, poll_max_s=0.05))

    t = threading.Thread(target=run)
    t.start()
    with LogWriter.open(d) as w:
        w.append(events(3, 1))
    while sum(len(b) for b in out) < 3:
        t.join(0.01)
    stop.set()
    t.join(10)
    assert not t.is_alive()
    assert [e for b in out for e in b] == events(1, 3)


# --- property test ----------------------------------------------------------

op = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 12)),
    st.tuples(st.just("reopen"), st.sampled_from([300, 1000, 64 << 20])),
    st.tuples(st.just("rotate"), st.just(0)),
    st.tuples(st.just("read-from"), st.integers(1, 80)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, max_size=25))
def test_any_appends_reopens_rotations_read_back_exactly(ops: list[tuple[str, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "log"
        acked: list[ev.Event] = []
        w = LogWriter.open(d, segment_bytes=500)
        try:
            for name, arg in ops:
                if name == "append":
                    last = w.append(events(len(acked) + 1, arg))
                    acked.extend(events(len(acked) + 1, arg))
                    assert last == len(acked)
                elif name == "reopen":
                    w.close()
                    w = LogWriter.open(d, segment_bytes=arg)
                    assert w.recovered is None and w.next_seq == len(acked) + 1
                elif name == "rotate":
                    w.rotate()
                else:
                    assert list(log.read(d, from_seq=arg)) == acked[arg - 1 :]
                assert list(log.read(d)) == acked
        finally:
            w.close()
        assert log.last_seq(d) == len(acked)
        assert [e for b in log.read_batches(d) for e in b] == acked


# --- the tools ------------------------------------------------------------


def test_verify_and_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "log"
    write_log(d, [2, 3], segment_bytes=1)
    assert logtools.verify(d) == 0
    assert "events 1..5" in capsys.readouterr().out
    assert logtools.dump(d) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5
    assert lines[0].startswith("1 2023-11-14T22:13:21.000Z GpuSampled cause=nvml node=local gpu=1")
    assert "JobSubmitted" in lines[2] and "python" in lines[2]
    assert logtools.dump(d, json=True, from_seq=4) == 0
    import json

    objs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(o["seq"], o["type"]) for o in objs] == [(4, "GpuSampled"), (5, "GpuSampled")]
    assert logtools.verify(tmp_path / "nope") == 2
    assert logtools.dump(tmp_path / "nope") == 2
    assert "no log at" in capsys.readouterr().err
    assert logtools.repair(d) == 0
    assert "nothing to repair" in capsys.readouterr().out


def test_dump_of_damaged_log_prints_what_it_can_then_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "log"
    ends = write_log(d, [2, 2, 2])
    (seg,) = seg_files(d)
    data = bytearray(seg.read_bytes())
    data[ends[0] + 30] ^= 1
    seg.write_bytes(bytes(data))
    assert logtools.dump(d) == 1
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 2
    assert "eventsched log repair" in out.err and "Traceback" not in out.err


def test_random_damage_never_yields_wrong_events_and_tools_never_raise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    write_log(src, [3, 5, 2, 4, 6, 1, 3], segment_bytes=1500)
    files = {p.name: p.read_bytes() for p in seg_files(src)}
    rng = random.Random(7)
    for i in range(150):
        d = tmp_path / f"f{i}"
        d.mkdir()
        victim = rng.choice(sorted(files))
        for name, data in files.items():
            if name == victim:
                b = bytearray(data)
                kind = rng.random()
                if kind < 0.6:
                    b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
                elif kind < 0.8:
                    del b[rng.randrange(len(b)) :]
                else:
                    b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
                data = bytes(b)
            (d / name).write_bytes(data)
        try:
            got = list(log.read(d))
        except log.LogError:
            got = None
        if got is not None:
            assert got == events(1, len(got))  # a prefix of what was written, never garbage
        for tool in (logtools.verify, logtools.dump):
            assert tool(d) in (0, 1)
        try:
            with LogWriter.open(d) as w:
                n = w.next_seq - 1
            # the writer resumes right after the last event a reader sees
            assert got is None or n == len(got)
        except LogCorruptError:
            assert logtools.repair(d) == 0
            with LogWriter.open(d) as w:
                n = w.next_seq - 1
        assert list(log.read(d)) == events(1, n)
        assert logtools.verify(d) == 0 or n == 0
    capsys.readouterr()
