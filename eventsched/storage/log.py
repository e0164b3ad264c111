"""The event log: segments of checksummed frames, group commit, recovery, tailing.

The on-disk format, the checksum and what recovery tells apart from damage
are in docs/log-format.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import itertools
import os
import re
import secrets
import select
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import msgspec

from eventsched.domain import events as ev
from eventsched.domain.events import Event
from eventsched.storage.fileops import PLAIN, FileOps

__all__ = ["LogError", "LogLockedError", "LogCorruptError", "LogFullError", "LogFatalError", "RecoveryReport",
           "Segment", "LogWriter", "read", "read_batches", "read_frames", "Frame", "decode_frame", "last_seq",
           "follow", "segments", "SegmentScan"]

MAGIC = b"EVSCHLOG"
VERSION = 1
SEGMENT_HEADER = struct.Struct("<8sHHIQ")  # + crc u32 + 4 pad bytes
SEGMENT_HEADER_SIZE = 32
FRAME_HEADER = struct.Struct("<IIQIB3x")
FRAME_HEADER_SIZE = FRAME_HEADER.size  # 24
FRAME_EVENTS = 1  # the only frame type so far: a msgpack array of events
MAX_FRAME = 256 << 20  # a longer length field is damage, not a frame
# bytes 20..24 of every valid frame header: finds candidate frames past a bad one
_FRAME_MARK = bytes([FRAME_EVENTS, 0, 0, 0])
_CHUNK = 1 << 20  # bytes per read while scanning
_ZERO_HEADER = bytes(FRAME_HEADER_SIZE)  # unwritten (preallocated) space
# Zeros written ahead of the frames: a commit inside them changes no file size
# and allocates no block, so fdatasync flushes the data alone.
PREALLOCATE = 1 << 20
TORN_AHEAD = "a write torn in the space written ahead (zeros, then other bytes)"
_SEGMENT_RE = re.compile(r"^(\d{20})\.seg$")
LOCK_NAME = "LOCK"
# Sealed segments an open has checked frame by frame ("NAME SIZE MTIME_NS
# NEXT_SEQ" lines). A sealed segment never changes: while size and mtime hold,
# a restart checks only its header (readers and ``log verify`` still check
# every frame). A cache: lost or stale, it only costs a full check.
VERIFIED_NAME = "verified"


class LogError(Exception):
    """Base of log errors; ``str()`` is a one-line message for a user."""


class LogLockedError(LogError):
    """Another writer holds the log's lock."""


class LogCorruptError(LogError):
    """A bad frame where a torn tail cannot explain it: refuse, never guess."""

    def __init__(self, segment: str | os.PathLike[str], offset: int, detail: str) -> None:
        self.segment = str(segment)
        self.offset = offset
        self.detail = detail
        directory = os.path.dirname(self.segment) or "."
        super().__init__(
            f"log segment {self.segment} is damaged at byte {offset}: {detail}; "
            f"run `eventsched log repair {directory}` to cut the log there "
            f"(the damaged part is kept aside)"
        )


class LogFullError(LogError):
    """The disk is full: this append failed, nothing is damaged, retry later."""


class LogFatalError(LogError):
    """An fsync or I/O error: the writer is dead and must be reopened."""


class RecoveryReport(msgspec.Struct, frozen=True, kw_only=True):
    """What ``LogWriter.open`` cut from a torn tail, for the daemon to log."""

    segment: str
    offset: int  # where the cut starts (end of the last good frame)
    bytes_cut: int
    kept_at: str  # the file holding the cut bytes
    reason: str
    next_seq: int  # the sequence the next append gets


class Segment(msgspec.Struct, frozen=True):
    path: str
    first_seq: int


def _read_verified(directory: str) -> dict[str, tuple[int, int, int]]:
    """VERIFIED_NAME's entries ({} if missing or unreadable)."""
    try:
        with open(os.path.join(directory, VERIFIED_NAME), "rb") as f:
            lines = f.read(1 << 20).decode("ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    out: dict[str, tuple[int, int, int]] = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 4 and _SEGMENT_RE.match(parts[0]) and all(x.isdigit() for x in parts[1:]):
            out[parts[0]] = (int(parts[1]), int(parts[2]), int(parts[3]))
    return out


def _write_verified(directory: str, entries: dict[str, tuple[int, int, int]]) -> None:
    """Replace VERIFIED_NAME (best effort: it is a cache)."""
    path = os.path.join(directory, VERIFIED_NAME)
    tmp = path + ".tmp"
    text = "".join(f"{name} {size} {mtime} {seq}\n" for name, (size, mtime, seq) in sorted(entries.items()))
    with contextlib.suppress(OSError):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, text.encode("ascii"))
        finally:
            os.close(fd)
        os.replace(tmp, path)


def segments(directory: str | os.PathLike[str]) -> list[Segment]:
    """The segment files of a log, oldest first ([] when there is no log)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    d = os.fspath(directory)
    return sorted((Segment(os.path.join(d, n), int(n[:20])) for n in names if _SEGMENT_RE.match(n)),
                  key=lambda s: s.first_seq)


def _segment_header(salt: int, first_seq: int) -> bytes:
    head = SEGMENT_HEADER.pack(MAGIC, VERSION, SEGMENT_HEADER_SIZE, salt, first_seq)
    return head + struct.pack("<I4x", zlib.crc32(head))


def _parse_segment_header(data: bytes, path: str) -> tuple[int, int] | str:
    """(salt, first_seq), or a description of what is wrong."""
    if len(data) < SEGMENT_HEADER_SIZE:
        return f"segment header is short ({len(data)} of {SEGMENT_HEADER_SIZE} bytes)"
    magic, version, size, salt, first_seq = SEGMENT_HEADER.unpack_from(data)
    if magic != MAGIC:
        return "not an eventsched log segment (bad magic)"
    (crc,) = struct.unpack_from("<I", data, SEGMENT_HEADER.size)
    if crc != zlib.crc32(data[: SEGMENT_HEADER.size]):
        return "segment header checksum mismatch"
    if version != VERSION or size != SEGMENT_HEADER_SIZE:
        return f"segment version {version} is not supported by this eventsched"
    m = _SEGMENT_RE.match(os.path.basename(path))
    if m and int(m.group(1)) != first_seq:
        return f"segment header says first sequence {first_seq}, its name says {int(m.group(1))}"
    return salt, first_seq


def _frame_bytes(salt: int, first_seq: int, count: int, payload: bytes) -> bytes:
    rest = FRAME_HEADER.pack(0, len(payload), first_seq, count, FRAME_EVENTS)[4:]
    crc = zlib.crc32(payload, zlib.crc32(rest, salt))
    return struct.pack("<I", crc) + rest + payload


class SegmentScan:
    """Walk the frames of one segment file, stopping at the first bad one.

    Once ``frames()`` is exhausted, ``end`` is just past the last valid frame
    and ``problem`` None (clean end) or what is wrong there. Big ``pread``
    chunks and memoryviews: no copy per frame, memory bounded by the chunk.
    """

    def __init__(self, path: str, *, offset: int | None = None, next_seq: int | None = None) -> None:
        self.path = path
        self.salt = 0
        self.first_seq = 0
        self.end = offset if offset is not None else SEGMENT_HEADER_SIZE
        self.next_seq = next_seq or 0
        self.problem: str | None = None
        self.unwritten = False  # stopped at zeros the writer wrote ahead (PREALLOCATE)
        self.header_ok = False
        self.size = 0
        self._fd = -1

    def __enter__(self) -> "SegmentScan":
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self._fd).st_size
        parsed = _parse_segment_header(os.pread(self._fd, SEGMENT_HEADER_SIZE, 0), self.path)
        if isinstance(parsed, str):
            self.problem = parsed
            self.end = 0
        else:
            self.header_ok = True
            self.salt, self.first_seq = parsed
            if not self.next_seq:
                self.next_seq = self.first_seq
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def frames(self) -> Iterator[tuple[int, int, int, memoryview]]:
        if not self.header_ok:
            return
        fd, salt, size = self._fd, self.salt, self.size
        unpack = FRAME_HEADER.unpack_from
        crc32 = zlib.crc32
        offset, seq = self.end, self.next_seq
        buf = memoryview(b"")
        base = offset  # file offset of buf[0]
        while True:
            pos = offset - base
            if pos + FRAME_HEADER_SIZE > len(buf):
                if offset >= size:
                    break  # clean end
                buf, base, pos = memoryview(os.pread(fd, _CHUNK, offset)), offset, 0
                if len(buf) < FRAME_HEADER_SIZE:
                    self.problem = f"short frame header ({len(buf)} bytes before end of file)"
                    break
            if buf[pos : pos + FRAME_HEADER_SIZE] == _ZERO_HEADER:
                self.unwritten = True  # where the writer has not got to yet
                break
            crc, length, first, count, ftype = unpack(buf, pos)
            if length > MAX_FRAME:
                self.problem = f"bad frame length {length}"
                break
            stop = pos + FRAME_HEADER_SIZE + length
            if stop > len(buf):
                buf, base, pos = memoryview(os.pread(fd, max(_CHUNK, FRAME_HEADER_SIZE + length), offset)), offset, 0
                stop = FRAME_HEADER_SIZE + length
                if stop > len(buf):
                    self.problem = (
                        f"frame of {length} bytes runs past end of file "
                        f"({len(buf) - FRAME_HEADER_SIZE} bytes there)"
                    )
                    break
            if crc != crc32(buf[pos + FRAME_HEADER_SIZE : stop], crc32(buf[pos + 4 : pos + FRAME_HEADER_SIZE], salt)):
                self.problem = "frame checksum mismatch"
                break
            if ftype != FRAME_EVENTS or buf[pos + 21 : pos + 24] != b"\0\0\0":
                self.problem = f"unknown frame type {ftype}"
                break
            if first != seq or count == 0:
                self.problem = f"frame has sequence {first} (count {count}), expected {seq}"
                break
            yield offset, first, count, buf[pos + FRAME_HEADER_SIZE : stop]
            offset += FRAME_HEADER_SIZE + length
            seq += count
            self.end, self.next_seq = offset, seq

    def run(self) -> "SegmentScan":
        for _ in self.frames():
            pass
        return self

    def check_ahead(self) -> None:
        """Past unwritten zeros, any other byte is a write torn inside the space
        written ahead: that is the scan's problem then."""
        offset = self.end
        while self.unwritten and offset < self.size:
            chunk = os.pread(self._fd, _CHUNK, offset)
            if not chunk:
                break
            if chunk.count(0) != len(chunk):
                self.problem = TORN_AHEAD
                break
            offset += len(chunk)

    @property
    def data_size(self) -> int:
        """The bytes holding the header and frames (the file, less unused zeros)."""
        return self.end if self.unwritten else self.size

    def valid_frame_after(self, offset: int) -> int | None:
        """Offset of a valid frame somewhere after ``offset``: a torn tail has
        none, damage in the middle of a log does."""
        fd, size, start = self._fd, self.size, offset + 1
        while start + FRAME_HEADER_SIZE <= size:
            chunk = os.pread(fd, _CHUNK + FRAME_HEADER_SIZE, start)
            i = chunk.find(_FRAME_MARK, 20)
            while i != -1:
                cand = start + i - 20
                if self._valid_at(cand):
                    return cand
                i = chunk.find(_FRAME_MARK, i + 1)
            start += _CHUNK
        return None

    def _valid_at(self, offset: int) -> bool:
        head = os.pread(self._fd, FRAME_HEADER_SIZE, offset)
        if len(head) < FRAME_HEADER_SIZE:
            return False
        crc, length, first, count, _ = FRAME_HEADER.unpack(head)
        if count == 0 or first < self.next_seq or length > MAX_FRAME:
            return False
        if offset + FRAME_HEADER_SIZE + length > self.size:
            return False
        payload = os.pread(self._fd, length, offset + FRAME_HEADER_SIZE)
        return crc == zlib.crc32(payload, zlib.crc32(head[4:], self.salt))


def _check_start(scan: SegmentScan, expected: int) -> None:
    if scan.header_ok and scan.first_seq != expected:
        raise LogCorruptError(scan.path, 0, f"segment starts at sequence {scan.first_seq}, expected {expected}")


class Frame(NamedTuple):
    """One valid frame, undecoded."""

    path: str
    offset: int
    first_seq: int
    n_events: int
    payload: memoryview


def decode_frame(frame: Frame) -> list[Event]:
    """A frame's events, or ``LogCorruptError`` as ``read_batches`` raises it."""
    try:
        return ev.decode_many(frame.payload)
    except msgspec.DecodeError as e:
        why = f"frame has a valid checksum but does not decode ({e}); written by a newer eventsched?"
        raise LogCorruptError(frame.path, frame.offset, why) from None


def cut_aside(directory: str, path: str, offset: int, data: bytes, ops: FileOps = PLAIN) -> str:
    """Cut ``path`` at ``offset`` durably, the bytes cut (``data``) first kept
    in a file beside it, whose name is returned."""
    target = f"{path}.torn-{offset}"
    n = 1
    while os.path.exists(target):
        target = f"{path}.torn-{offset}.{n}"
        n += 1
    ops.write_new(target, data)
    ops.fsync_dir(directory)  # the kept bytes' name is on disk before the cut can be
    fd = ops.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        ops.ftruncate(fd, offset)
        ops.fsync(fd)  # the cut must be durable before anything is appended
    finally:
        ops.close(fd)
    return target


def try_lock(lock_path: str) -> int | None:
    """The log's lock file, flock'ed (None: another process holds it); OSError if it cannot be opened."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def lock_holder(lock_path: str) -> str:
    try:
        with open(lock_path) as f:
            pid = f.read().strip()
    except OSError:
        pid = ""
    return pid if pid.isdigit() else "unknown"


class LogWriter:
    """The one appender of a log directory; not thread-safe.

    ``append`` writes a batch as one frame, one ``write`` and one ``fdatasync``
    (group commit); ``write`` and ``sync`` are its halves, for a caller that
    works while ``sync`` runs. ``_pwrite``, ``_fdatasync`` (the write path's
    only system calls) and ``_fault`` (each step of rotation) are attributes
    so that tests can inject errors and crashes.
    """

    _pwrite: Callable[[int, bytes | memoryview, int], int] = staticmethod(os.pwrite)  # type: ignore[assignment]
    _fdatasync: Callable[[int], None] = staticmethod(os.fdatasync)  # type: ignore[assignment]
    _fault: Callable[[str], None] | None = None
    _ops: FileOps = PLAIN  # every other call that changes a file (crash-state tests record them)

    def __init__(self, directory: str, segment_bytes: int, preallocate: int) -> None:  # use LogWriter.open
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.preallocate = preallocate
        self.recovered: RecoveryReport | None = None
        self._lock_fd = -1
        self._fd = -1
        self._path = ""
        self._salt = 0
        self._end = 0
        self._allocated = 0  # the file's size: zeros from _end up to it
        self._next_seq = 1
        self._synced = 0  # the last seq an fdatasync covered
        self._dead: str | None = None

    # -- opening --

    @classmethod
    def open(cls, directory: str | os.PathLike[str], *, segment_bytes: int = 64 << 20, ops: FileOps | None = None,
             preallocate: int = PREALLOCATE) -> "LogWriter":
        self = cls(os.fspath(directory), segment_bytes, preallocate)
        if ops is not None:  # a recorder; production keeps the bare os calls on the write path
            self._ops, self._pwrite, self._fdatasync = ops, ops.pwrite, ops.fdatasync
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
        except OSError as e:
            raise LogError(f"cannot create log directory {self.directory}: {e.strerror}") from None
        self._lock()
        try:
            self._recover()
        except OSError as e:
            self.close()
            raise LogError(f"cannot open log {self.directory}: {e}") from None
        except BaseException:
            self.close()
            raise
        return self

    def _lock(self) -> None:
        lock_path = os.path.join(self.directory, LOCK_NAME)
        try:
            fd = try_lock(lock_path)
        except OSError as e:
            raise LogError(f"cannot open {lock_path}: {e.strerror}") from None
        if fd is None:
            raise LogLockedError(f"log {self.directory} is locked by pid {lock_holder(lock_path)} "
                                 "(another writer is running)")
        with contextlib.suppress(OSError):  # the pid is only for the message a second writer prints
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _recover(self) -> None:
        d = self.directory
        # A crash during rotation can leave a temp file; it never held events.
        for name in os.listdir(d):
            if name.endswith(".seg.tmp"):
                self._ops.unlink(os.path.join(d, name))
        segs = segments(d)
        if not segs:
            self._create_segment(1)
            return
        expected = segs[0].first_seq
        verified = _read_verified(d)
        checked: dict[str, tuple[int, int, int]] = {}
        for seg in segs[:-1]:
            with SegmentScan(seg.path) as scan:
                _check_start(scan, expected)
                st = os.stat(seg.path)
                name = os.path.basename(seg.path)
                known = verified.get(name)
                if scan.header_ok and known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
                    expected = known[2]
                else:
                    scan.run().check_ahead()
                    if scan.problem is not None:
                        raise LogCorruptError(seg.path, scan.end, scan.problem + " (in a sealed segment)")
                    expected = scan.next_seq
                checked[name] = (st.st_size, st.st_mtime_ns, expected)
        if checked != verified:
            _write_verified(d, checked)
        last = segs[-1]
        with SegmentScan(last.path) as scan:
            if not scan.header_ok:
                raise LogCorruptError(last.path, 0, scan.problem or "bad header")
            if len(segs) > 1:
                _check_start(scan, expected)
            scan.run().check_ahead()
            if scan.problem is not None:
                good = scan.valid_frame_after(scan.end)
                if good is not None:
                    raise LogCorruptError(
                        last.path, scan.end, f"{scan.problem}, and a valid frame follows at byte {good}"
                    )
                cut = os.pread(scan._fd, scan.size - scan.end, scan.end)
                kept = cut_aside(d, last.path, scan.end, cut, self._ops)
                self._ops.fsync_dir(d)
                self.recovered = RecoveryReport(segment=last.path, offset=scan.end, bytes_cut=len(cut), kept_at=kept,
                                                reason=scan.problem, next_seq=scan.next_seq)
                self._allocated = scan.end
            else:
                self._allocated = scan.size  # zeros written ahead are kept and used
            self._salt, self._end, self._next_seq = scan.salt, scan.end, scan.next_seq
        self._fd = self._ops.open(last.path, os.O_RDWR | os.O_CLOEXEC)
        self._path, self._synced = last.path, self._next_seq - 1

    def _step(self, stage: str) -> None:
        if self._fault is not None:
            self._fault(stage)

    def _create_segment(self, first_seq: int) -> None:
        """Temp file, header, fdatasync, rename, fsync dir; then append to it."""
        path = os.path.join(self.directory, f"{first_seq:020d}.seg")
        tmp = path + ".tmp"
        salt = secrets.randbits(32)
        header = _segment_header(salt, first_seq)
        ops = self._ops
        fd = ops.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            self._step("rotate:created")
            try:
                self._write_all(fd, header + bytes(self.preallocate), 0)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.preallocate:
                    raise self._write_error(e, "starting a new segment") from None
                try:  # no room to write ahead: the header alone, as before
                    ops.ftruncate(fd, 0)
                    self._write_all(fd, header, 0)
                except OSError as e2:
                    raise self._write_error(e2, "starting a new segment") from None
            self._step("rotate:written")
            try:
                self._fdatasync(fd)
            except OSError as e:
                raise self._die(f"fdatasync of {tmp} failed: {e.strerror}") from None
            self._step("rotate:synced")
            ops.rename(tmp, path)
            self._step("rotate:renamed")
            try:
                ops.fsync_dir(self.directory)
            except OSError as e:
                raise self._die(f"fsync of {self.directory} failed: {e.strerror}") from None
            self._step("rotate:dir-synced")
        except BaseException:
            ops.close(fd)
            with contextlib.suppress(FileNotFoundError):
                ops.unlink(tmp)
            raise
        if self._fd >= 0:
            ops.close(self._fd)
        self._fd, self._path, self._salt = fd, path, salt
        self._end, self._next_seq = SEGMENT_HEADER_SIZE, first_seq
        self._allocated = os.fstat(fd).st_size

    # -- appending --

    @property
    def next_seq(self) -> int:
        """The sequence number the next appended event gets."""
        return self._next_seq

    def append(self, events: Sequence[Event]) -> int:
        """Append a batch durably (one write, one fdatasync); return its last seq."""
        self.append_stamped(events)
        return self._next_seq - 1

    def append_stamped(self, events: Sequence[Event]) -> list[Event]:
        """Like ``append``, returning the events as stored, with their ``seq``."""
        stamped = self._write(events)[0]
        self.sync()
        return stamped

    def append_encoded(self, events: Sequence[Event]) -> tuple[int, bytes]:
        """Like ``append``, also returning what ``write`` returns."""
        written = self.write(events)
        self.sync()
        return written

    def write(self, events: Sequence[Event]) -> tuple[int, bytes]:
        """Write a batch as one frame, not yet durable (``sync`` makes it so);
        return its last seq and the frame's payload, for a caller that sends it on.
        Refused while the last frame is not synced: a power cut could keep the
        second of two and lose the first, a hole recovery must refuse as damage
        (one unsynced frame can only be a torn tail)."""
        payload = self._write(events)[1]
        return self._next_seq - 1, payload

    def sync(self) -> int:
        """Make every frame written durable (no fdatasync when nothing is new);
        return the last durable seq."""
        self._check_alive()
        upto = self._next_seq - 1
        if upto > self._synced:
            try:
                self._fdatasync(self._fd)
            except OSError as e:
                # PostgreSQL's lesson: after a failed fsync the page cache may lie.
                raise self._die(f"fdatasync of {self._path} failed: {e.strerror}") from None
            self._synced = upto
        return self._synced

    @property
    def synced_seq(self) -> int:
        """The last seq a ``sync`` made durable."""
        return self._synced

    def _write(self, events: Sequence[Event]) -> tuple[list[Event], bytes]:
        self._check_alive()
        if self._synced < self._next_seq - 1:
            raise LogError(f"log {self.directory}: a frame written before the last one was synced")
        if not events:
            return [], b""
        if self._end >= self.segment_bytes and self._end > SEGMENT_HEADER_SIZE:
            self.rotate()
        first = self._next_seq
        stamped = ev.stamp(list(events), first)
        payload = ev.encode_many(stamped)
        self._put(_frame_bytes(self._salt, first, len(stamped), payload), len(stamped))
        return stamped, payload

    def _put(self, frame: bytes, count: int) -> None:
        fd, end = self._fd, self._end
        stop = end + len(frame)
        try:
            if stop <= self._allocated or not self.preallocate:
                self._write_all(fd, frame, end)
            else:
                self._write_ahead(fd, frame, end)
        except OSError as e:
            raise self._write_error(e, "appending", truncate_to=end) from None
        self._end = stop
        self._allocated = max(self._allocated, stop)
        self._next_seq += count

    def _write_ahead(self, fd: int, frame: bytes, end: int) -> None:
        """Write ``frame`` at ``end`` followed by ``preallocate`` zeros, so that the
        next commits change no file size; with no room for them, the frame alone."""
        ahead = frame + bytes(self.preallocate)
        try:
            self._write_all(fd, ahead, end)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self._ops.ftruncate(fd, end)
            self._allocated = end
            self._write_all(fd, frame, end)
            return
        self._allocated = end + len(ahead)

    def _write_all(self, fd: int, data: bytes, offset: int) -> None:
        n = self._pwrite(fd, data, offset)
        if n == len(data):
            return
        view, offset = memoryview(data)[n:], offset + n  # a short write: go on
        while view:
            n = self._pwrite(fd, view, offset)
            view, offset = view[n:], offset + n

    def _write_error(self, e: OSError, doing: str, truncate_to: int | None = None) -> LogError:
        if truncate_to is not None:
            try:
                self._ops.ftruncate(self._fd, truncate_to)
            except OSError as e2:
                return self._die(f"cannot undo a failed write to {self._path}: {e2.strerror}")
            self._allocated = truncate_to
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return LogFullError(
                f"log {self.directory} is out of disk space ({e.strerror}) while {doing}; "
                "nothing was written, free some space and retry"
            )
        return self._die(f"write to {self._path} failed: {e.strerror}")

    def _die(self, why: str) -> LogFatalError:
        self._dead = why
        return LogFatalError(f"{why}; the log writer has stopped, restart to recover")

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._die(self._dead)
        if self._fd < 0:
            raise LogError(f"log {self.directory} is closed")

    def rotate(self) -> None:
        """Seal the current segment and start a new one at ``next_seq``."""
        self._check_alive()
        if self._end == SEGMENT_HEADER_SIZE:
            return  # an empty segment: nothing to seal
        self.sync()  # a segment's frames are durable before a newer segment exists
        self._seal()
        self._create_segment(self._next_seq)

    def _seal(self) -> None:
        """Cut the zeros written ahead off the segment, durably, before a newer
        segment exists: a sealed segment ends at its last frame."""
        if self._allocated <= self._end:
            return
        try:
            self._ops.ftruncate(self._fd, self._end)
            self._fdatasync(self._fd)
        except OSError as e:
            raise self._die(f"sealing {self._path} failed: {e.strerror}") from None
        self._allocated = self._end
        self._step("rotate:sealed")

    def close(self) -> None:
        if self._fd >= 0:
            if self._dead is None and self._allocated > self._end:
                # leave the file ending at its last frame; not synced: zeros
                # that come back after a crash are read as unwritten space
                with contextlib.suppress(OSError):
                    self._ops.ftruncate(self._fd, self._end)
            self._ops.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def __enter__(self) -> "LogWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Cursor:
    """A reader's position: which segment, which byte, which sequence next.

    Shared by ``read_batches`` (stops at the end) and ``follow`` (waits there).
    A bad frame at the end of the newest segment is taken for a write in
    progress; it is damage only when a valid frame follows it even after
    re-reading it (the writer is sequential: once a later frame is there, this
    one is finished). Segments are listed *before* reading the current one: if
    a newer segment existed then, the current one was complete before it.
    """

    def __init__(self, directory: str, from_seq: int) -> None:
        self.directory = directory
        self.from_seq = max(1, from_seq)
        self.seg: Segment | None = None
        self.offset = SEGMENT_HEADER_SIZE
        self.next_seq = 0

    def batches(self) -> Iterator[list[Event]]:
        """Every complete frame available now, decoded; returns at the current end."""
        from_seq = self.from_seq
        for frame in self.frames():
            batch = decode_frame(frame)
            if frame.first_seq < from_seq:
                batch = batch[from_seq - frame.first_seq :]
            yield batch

    def frames(self) -> Iterator[Frame]:
        """Every complete frame available now that holds an event at or after
        ``from_seq`` (the first may start before it); returns at the current end."""
        while True:
            segs = segments(self.directory)
            if self.seg is None:
                if not segs:
                    return
                # the newest segment starting at or before from_seq (else the oldest)
                self.seg = next((s for s in reversed(segs) if s.first_seq <= self.from_seq), segs[0])
                self.next_seq = self.seg.first_seq
            seg = self.seg
            newer = [s for s in segs if s.first_seq > seg.first_seq]
            try:
                scan = SegmentScan(seg.path, offset=self.offset, next_seq=self.next_seq).__enter__()
            except FileNotFoundError:
                raise LogError(f"log segment {seg.path} disappeared while reading") from None
            try:
                if not scan.header_ok:
                    raise LogCorruptError(seg.path, 0, scan.problem or "bad segment header")
                from_seq = self.from_seq
                for off, first, count, payload in scan.frames():
                    self.offset, self.next_seq = off + FRAME_HEADER_SIZE + len(payload), first + count
                    if first + count > from_seq:
                        yield Frame(seg.path, off, first, count, payload)
                if scan.problem is not None:
                    if newer:
                        raise LogCorruptError(seg.path, scan.end, scan.problem + " (in a sealed segment)")
                    good = scan.valid_frame_after(scan.end)
                    if good is None:
                        return  # a write in progress, or a torn tail the writer will cut
                    with SegmentScan(seg.path, offset=scan.end, next_seq=scan.next_seq) as again:
                        for _ in again.frames():
                            break
                        if again.end == scan.end:
                            raise LogCorruptError(
                                seg.path, scan.end, f"{scan.problem}, and a valid frame follows at byte {good}"
                            )
                    continue  # it was a write in progress; read on
            finally:
                scan.__exit__()
            if not newer:
                return
            if newer[0].first_seq != self.next_seq:
                raise LogCorruptError(
                    newer[0].path, 0, f"segment starts at sequence {newer[0].first_seq}, expected {self.next_seq}"
                )
            self.seg, self.offset = newer[0], SEGMENT_HEADER_SIZE


def read_batches(directory: str | os.PathLike[str], from_seq: int = 1) -> Iterator[list[Event]]:
    """The events from ``from_seq`` on, one list per frame, streaming."""
    return _Cursor(os.fspath(directory), from_seq).batches()


def read_frames(directory: str | os.PathLike[str], from_seq: int = 1) -> Iterator[Frame]:
    """``read_batches`` before ``decode_frame`` (the first frame may start before ``from_seq``)."""
    return _Cursor(os.fspath(directory), from_seq).frames()


def read(directory: str | os.PathLike[str], from_seq: int = 1) -> Iterator[Event]:
    """The events from ``from_seq`` on, in order, streaming."""
    return itertools.chain.from_iterable(read_batches(directory, from_seq))


def last_seq(directory: str | os.PathLike[str]) -> int:
    """The sequence of the last complete event (0 for an empty or missing log)."""
    segs = segments(directory)
    if not segs:
        return 0
    with SegmentScan(segs[-1].path) as scan:
        if not scan.header_ok:
            raise LogCorruptError(segs[-1].path, 0, scan.problem or "bad segment header")
        return scan.run().next_seq - 1


_IN_CHANGES = 0x002 | 0x008 | 0x080 | 0x100  # IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
_IN_FLAGS = 0o4000 | 0o2000000  # IN_NONBLOCK | IN_CLOEXEC


class _Waiter:
    """Wait for a change in a directory: inotify through ctypes, else backoff sleeps."""

    def __init__(self, directory: str, poll_max_s: float) -> None:
        self.poll_max_s = poll_max_s
        self.fd = -1
        self._sleep = 0.001
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fd = libc.inotify_init1(_IN_FLAGS)
            if fd >= 0:
                if libc.inotify_add_watch(fd, os.fsencode(directory), _IN_CHANGES) >= 0:
                    self.fd = fd
                else:
                    os.close(fd)
        except (OSError, AttributeError):
            self.fd = -1

    def wait(self) -> None:
        if self.fd >= 0:
            poller = select.poll()
            poller.register(self.fd, select.POLLIN)
            if poller.poll(self.poll_max_s * 1000):
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.fd, 65536):
                        pass
            return
        time.sleep(self._sleep)
        self._sleep = min(self._sleep * 2, self.poll_max_s)

    def progressed(self) -> None:
        self._sleep = 0.001

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def follow(directory: str | os.PathLike[str], from_seq: int = 1, *, stop: threading.Event | None = None,
           poll_max_s: float = 1.0) -> Iterator[list[Event]]:
    """Tail a log another process writes: yield each new frame's events, across
    rotations, until ``stop`` is set (checked at least every ``poll_max_s``)."""
    d = os.fspath(directory)
    while not os.path.isdir(d):
        if stop is not None and stop.is_set():
            return
        time.sleep(min(0.05, poll_max_s))
    cursor = _Cursor(d, from_seq)
    waiter = _Waiter(d, poll_max_s)  # watching before the first read: no lost wake-ups
    try:
        while stop is None or not stop.is_set():
            got = False
            for batch in cursor.batches():
                got = True
                yield batch
                if stop is not None and stop.is_set():
                    return
            if got:
                waiter.progressed()
            else:
                waiter.wait()
    finally:
        waiter.close()
