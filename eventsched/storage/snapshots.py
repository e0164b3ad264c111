"""Snapshots of the allocation projection: an optimisation, never the truth.

``snapshot-<seq>.msgpack`` holds a header (magic, CRC32, length) then the
state after event ``seq``; deleting them all gives the same state, only
slower. They hold every job's environment: directory 0700, files 0600.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Callable, TypeVar

import msgspec

from eventsched.storage.fileops import PLAIN, FileOps

__all__ = ["save_bytes", "load_latest", "list_snapshots", "prune", "KEEP"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

MAGIC = b"ESNAP1\n\0"
HEADER = struct.Struct(">8sIQ")  # magic, crc32, payload length
KEEP = 2  # newest snapshots kept; older ones are pruned
_SNAPSHOT_NAME = re.compile(r"snapshot-([0-9]+)\.msgpack")


def list_snapshots(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(seq, path) of every snapshot file, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((int(m[1]), p) for p in d.iterdir() if (m := _SNAPSHOT_NAME.fullmatch(p.name)))


def save_bytes(directory: str | os.PathLike[str], seq: int, data: bytes, *, ops: FileOps = PLAIN) -> Path:
    """Write one snapshot payload atomically (``ops``: the file calls); prune old ones."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    if d.stat().st_mode & 0o077:
        os.chmod(d, 0o700)  # made by an earlier version: snapshots hold every job's environment
    final = d / f"snapshot-{seq:020d}.msgpack"
    tmp = d / (final.name + ".tmp")
    _unlink(ops, tmp)  # a leftover with another mode; O_EXCL below
    ops.write_new(tmp, HEADER.pack(MAGIC, zlib.crc32(data), len(data)) + data)
    ops.replace(tmp, final)
    ops.fsync_dir(d)
    prune(d, ops=ops)
    return final


def _unlink(ops: FileOps, path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        ops.unlink(path)


def prune(directory: str | os.PathLike[str], keep: int = KEEP, *, ops: FileOps = PLAIN) -> None:
    """Remove all but the ``keep`` newest snapshots and stray temp files."""
    d = Path(directory)
    snaps = list_snapshots(d)
    for _, p in snaps[: max(0, len(snaps) - keep)]:
        _unlink(ops, p)
    for p in d.glob("snapshot-*.tmp"):
        _unlink(ops, p)


def _read(path: Path) -> bytes:
    raw = path.read_bytes()
    if len(raw) < HEADER.size:
        raise ValueError("short header")
    magic, crc, length = HEADER.unpack_from(raw)
    data = raw[HEADER.size :]
    if magic != MAGIC or length != len(data) or zlib.crc32(data) != crc:
        raise ValueError("bad header or checksum")
    return data


def load_latest(directory: str | os.PathLike[str], decode: Callable[[bytes], T],
                seq_of: Callable[[T], int]) -> T | None:
    """The newest snapshot that reads back whole and holds the seq its name says."""
    for seq, path in reversed(list_snapshots(directory)):
        try:
            value = decode(_read(path))
        except (OSError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("skipping snapshot %s: %s", path, exc)
            continue
        if seq_of(value) != seq:
            logger.warning("skipping snapshot %s: it holds seq %d", path, seq_of(value))
            continue
        return value
    return None
