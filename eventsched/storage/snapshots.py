"""Snapshots of the allocation projection: an optimisation, never the truth.

A snapshot file is ``snapshot-<seq>.msgpack``: a header (magic, CRC32 of the
payload, payload length) then ``cluster.snapshot_bytes``. It includes every
event up to ``seq``; start-up loads the newest valid one and folds the log's
tail after it. Deleting every snapshot gives the same state, only slower.
Writes are atomic: temp file, fsync, rename, fsync of the directory.
Snapshots hold every job's environment: the directory is 0700 and the files
0600, whoever runs the daemon.
"""

from __future__ import annotations

import contextlib
import logging
import os
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


def _name(seq: int) -> str:
    return f"snapshot-{seq:020d}.msgpack"


def list_snapshots(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(seq, path) of every snapshot file, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        name = p.name
        if name.startswith("snapshot-") and name.endswith(".msgpack"):
            try:
                out.append((int(name[len("snapshot-") : -len(".msgpack")]), p))
            except ValueError:
                continue
    return sorted(out)


def save_bytes(directory: str | os.PathLike[str], seq: int, data: bytes, *, ops: FileOps = PLAIN) -> Path:
    """Write one snapshot payload (from ``snapshot_bytes``) atomically; prune old ones.
    ``ops``: the file calls (a crash-state test records them)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    if d.stat().st_mode & 0o077:
        os.chmod(d, 0o700)  # made by an earlier version: snapshots hold every job's environment
    final = d / _name(seq)
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
    """The newest snapshot that reads back whole, decoded with ``decode``;
    corrupt ones, and ones that do not hold the seq their name says, are skipped."""
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
