"""`eventsched log verify | dump | repair`: look at and mend a log directory.

Each function prints for a person and returns an exit code; none raises for a
damaged, missing or busy log (those are what these tools are for).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import time
from collections.abc import Callable
from typing import TextIO

import msgspec

from eventsched.domain import events as ev
from eventsched.domain.events import Event
from eventsched.domain.text import print_error
from eventsched.storage import log as L
from eventsched.storage.fileops import PLAIN, FileOps

__all__ = ["verify", "dump", "repair", "format_event"]

_PLAIN = re.compile(r"^[^\s\"'=]+$")


def _err(msg: str) -> None:
    print_error(msg, command="log")


def _missing(directory: str) -> int | None:
    if not os.path.isdir(directory):
        _err(f"no log at {directory} (not a directory)")
        return 2
    return None


class _Finding(msgspec.Struct):
    """The first problem of a log, if any, and how far it is sound."""

    segments: int = 0
    last_seq: int = 0
    size: int = 0
    segment: str = ""
    offset: int = 0
    problem: str = ""
    torn_tail: bool = False  # at the end of the newest segment: the writer cuts it
    later: list[str] = []  # segments after the damaged one


def _inspect(directory: str, *, decode: bool) -> _Finding:
    segs = L.segments(directory)
    found = _Finding(segments=len(segs))
    expected = segs[0].first_seq if segs else 1
    for i, seg in enumerate(segs):
        with L.SegmentScan(seg.path) as scan:
            problem, offset = None, 0
            if not scan.header_ok:
                problem = scan.problem
            elif scan.first_seq != expected:
                problem = f"segment starts at sequence {scan.first_seq}, expected {expected}"
            else:
                for off, _first, count, payload in scan.frames():
                    if decode:
                        try:
                            batch = ev.decode_many(payload)
                        except msgspec.DecodeError as e:
                            problem, offset = f"frame does not decode ({e})", off
                            break
                        if len(batch) != count:
                            problem, offset = f"frame holds {len(batch)} events, header says {count}", off
                            break
                else:
                    scan.check_ahead()
                    if scan.problem is not None:
                        problem, offset = scan.problem, scan.end
                        if i == len(segs) - 1:
                            good = scan.valid_frame_after(scan.end)
                            if good is None:
                                found.torn_tail = True
                            else:
                                problem += f", and a valid frame follows at byte {good}"
                        else:
                            problem += " (in a sealed segment)"
                expected = scan.next_seq
                found.last_seq = scan.next_seq - 1
            found.size += scan.data_size
        if problem is not None:
            found.segment, found.offset, found.problem = seg.path, offset, problem
            found.later = [s.path for s in segs[i + 1 :]]
            break
    return found


IN_FLIGHT_LOOKS = 20  # 10 ms apart: a frame's write takes far less


def _held_by_writer(directory: str) -> bool:
    """Does a live writer hold the log's lock? Read from /proc/locks: taking the
    lock to find out could make a daemon starting then refuse to (False if unknown)."""
    try:
        st = os.stat(os.path.join(directory, L.LOCK_NAME))
        with open("/proc/locks") as f:
            held = f.read()
    except OSError:
        return False
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(key in line.split() for line in held.splitlines())


def verify(directory: str | os.PathLike[str]) -> int:
    """Check every segment, frame and checksum; 0 when the log is sound."""
    d = os.fspath(directory)
    if (code := _missing(d)) is not None:
        return code
    try:
        found = _inspect(d, decode=True)
        if found.segments == 0:
            _err(f"no log segments in {d}")
            return 1
        # a live writer's frame in flight reads as a torn tail (its header not yet
        # copied, its body already there): look again while it finishes
        for _ in range(IN_FLIGHT_LOOKS):
            if not (found.torn_tail and _held_by_writer(d)):
                break
            time.sleep(0.01)
            found = _inspect(d, decode=True)
    except OSError as e:
        _err(f"cannot read log {d}: {e}")
        return 1
    if found.problem:
        where = f"segment {found.segment} at byte {found.offset}: {found.problem}"
        if found.torn_tail:
            _err(f"torn tail: {where}; events up to {found.last_seq} are sound; "
                 "the writer cuts this tail when it next opens the log")
        else:
            _err(f"damaged: {where}; run `eventsched log repair {d}` to cut the log there (the cut part is kept aside)")
        return 1
    print(f"ok: {d}: {found.segments} segment(s), events 1..{found.last_seq}, {found.size} bytes")
    return 0


def _value(v: object) -> str:
    if isinstance(v, str) and _PLAIN.match(v):
        return v
    return msgspec.json.encode(v).decode()


def format_event(event: Event) -> str:
    """One readable line: seq, UTC time, type, then field=value pairs."""
    d = msgspec.to_builtins(event)
    seq, ts, kind = d.pop("seq", 0), d.pop("ts", 0.0), d.pop("type", type(event).__name__)
    when = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="milliseconds")
    fields = " ".join(f"{k}={_value(v)}" for k, v in d.items())
    return f"{seq} {when.replace('+00:00', 'Z')} {kind} {fields}".rstrip()


def dump(directory: str | os.PathLike[str], json: bool = False, from_seq: int = 0, out: TextIO | None = None) -> int:
    """Print one event per line (``json``: one JSON object with ``type`` each)."""
    d = os.fspath(directory)
    if (code := _missing(d)) is not None:
        return code
    stream = out if out is not None else sys.stdout
    encoder = msgspec.json.Encoder()
    line: Callable[[Event], str] = (lambda e: encoder.encode(e).decode()) if json else format_event
    try:
        for batch in L.read_batches(d, max(1, from_seq)):
            stream.write("".join(line(e) + "\n" for e in batch))
        stream.flush()
    except BrokenPipeError:
        # `dump | head`: the reader left; not an error. Keep Python's exit-time flush quiet.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except L.LogError as e:
        stream.flush()
        _err(str(e))
        return 1
    except OSError as e:
        _err(f"cannot read log {d}: {e}")
        return 1
    return 0


def repair(directory: str | os.PathLike[str], ops: FileOps = PLAIN) -> int:
    """Cut the log at its first bad frame, keeping everything cut in files aside.

    The damaged segment is truncated at the bad frame (the rest goes to
    ``<segment>.torn-<offset>``), and any later segment is renamed to
    ``<segment>.torn-0``: sequence numbers must not have gaps, so nothing after
    the damage can stay in the log. Needs the writer stopped (takes its lock).
    """
    d = os.fspath(directory)
    if (code := _missing(d)) is not None:
        return code
    lock_path = os.path.join(d, L.LOCK_NAME)
    try:
        lock = L.try_lock(lock_path)
    except OSError as e:
        _err(f"cannot lock log {d}: {e.strerror}")
        return 1
    if lock is None:
        _err(f"log {d} is locked by pid {L.lock_holder(lock_path)}; stop the daemon before repairing")
        return 1
    try:
        found = _inspect(d, decode=False)
        if not found.problem:
            print(f"log {d} is sound ({found.segments} segment(s), events 1..{found.last_seq}); nothing to repair")
            return 0
        seg = found.segment
        if found.offset < L.SEGMENT_HEADER_SIZE:
            kept = f"{seg}.torn-0"
            ops.rename(seg, kept)
            print(f"moved {seg} aside to {kept}: {found.problem}")
        else:
            with open(seg, "rb") as f:
                f.seek(found.offset)
                data = f.read()
            kept = L.cut_aside(d, seg, found.offset, data, ops)
            print(f"cut {seg} at byte {found.offset} ({found.problem}); {len(data)} bytes kept in {kept}")
        for later in found.later:
            ops.rename(later, f"{later}.torn-0")
            print(f"moved later segment {later} aside to {later}.torn-0")
        ops.fsync_dir(d)
        if found.last_seq == 0:
            print("the log is now empty (its first segment was damaged); everything is kept in the files above")
        else:
            print(f"the log now ends at sequence {found.last_seq}; run `eventsched log verify {d}` to check")
        return 0
    except OSError as e:
        _err(f"repair of {d} failed: {e}")
        return 1
    finally:
        os.close(lock)
