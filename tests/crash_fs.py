"""A recorder of the log's and the snapshots' file calls, and the power-cut
states a record allows (the crash-state tests' file system).

A ``Recorder`` performs each call for real and writes down what it did to the
disk: creates, writes (offset and bytes), truncates, fdatasync/fsync of a file,
renames, unlinks and directory fsyncs. ``crash_states`` then builds from that
record every state a power cut could have left (SQLite's crash VFS, LazyFS,
ALICE), under these rules:

- a file's writes and truncates before its last fdatasync/fsync are on disk;
  the ones after it may each be there, be missing, be cut at any byte (its
  first part landed, or only its later part: pages land in any order), or
  have extended the file with zeros (size on disk, data not), and ones to
  different files or regions land in any subset (POSIX orders none of them);
- directory entries (create, rename, unlink) before the directory's last fsync
  are on disk; the ones after it reach the disk in the order they were made
  (a journaled file system commits metadata in order), so any prefix of them.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from eventsched.storage.fileops import FileOps

__all__ = ["Op", "Recorder", "CrashState", "crash_states", "materialize", "SCRATCH"]

# tmpfs where there is one: tests that fsync thousands of times check what
# the files hold, not the disk's speed
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@dataclass(frozen=True)
class Op:
    """One recorded change. ``kind``: create, write, truncate, sync, rename,
    unlink, dirsync. Paths are relative to the recorder's root; ``inode`` is a
    recorder-local file identity (it survives renames)."""

    kind: str
    inode: int = -1
    path: str = ""
    target: str = ""  # rename's new name
    offset: int = 0  # write's offset; truncate's size
    data: bytes = b""

    @property
    def directory(self) -> str:
        return os.path.dirname(self.target or self.path) or "."


class Recorder(FileOps):
    """Does every call for real and records what it changed under ``root``.

    Files under ``root`` that exist when it starts are the durable baseline.
    Directories must exist before recording starts (the record has no mkdir).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.realpath(root)
        self.ops: list[Op] = []
        self.baseline: dict[str, bytes] = {}
        self._names: dict[str, int] = {}  # relative path -> inode, as the program sees it
        self._fds: dict[int, int] = {}  # fd -> inode
        self._inodes = itertools.count(1)
        for here, _, files in os.walk(self.root):
            for name in files:
                rel = self._rel(os.path.join(here, name))
                with open(os.path.join(here, name), "rb") as f:
                    self.baseline[rel] = f.read()
                self._names[rel] = next(self._inodes)
        self.baseline_inodes = dict(self._names)

    def _rel(self, path: str | os.PathLike[str]) -> str:
        return os.path.relpath(os.path.realpath(path), self.root)

    def _ours(self, path: str | os.PathLike[str]) -> bool:
        rel = self._rel(path)
        return not rel.startswith("..")

    def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:  # type: ignore[override]
        existed = os.path.exists(path)
        fd = os.open(path, flags, mode)
        if self._ours(path):
            rel = self._rel(path)
            if not existed or rel not in self._names:
                inode = self._names[rel] = next(self._inodes)
                self.ops.append(Op("create", inode, rel))
            inode = self._names[rel]
            self._fds[fd] = inode
            if existed and flags & os.O_TRUNC:
                self.ops.append(Op("truncate", inode, rel, offset=0))
        return fd

    def close(self, fd: int) -> None:
        self._fds.pop(fd, None)
        os.close(fd)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:  # type: ignore[override]
        n = os.pwrite(fd, data, offset)
        if fd in self._fds:
            self.ops.append(Op("write", self._fds[fd], offset=offset, data=bytes(data[:n])))
        return n

    def write(self, fd: int, data: bytes | memoryview) -> int:  # type: ignore[override]
        offset = os.lseek(fd, 0, os.SEEK_CUR)
        n = os.write(fd, data)
        if fd in self._fds:
            self.ops.append(Op("write", self._fds[fd], offset=offset, data=bytes(data[:n])))
        return n

    def fdatasync(self, fd: int) -> None:  # type: ignore[override]
        os.fdatasync(fd)
        if fd in self._fds:
            self.ops.append(Op("sync", self._fds[fd]))

    def fsync(self, fd: int) -> None:  # type: ignore[override]
        os.fsync(fd)
        if fd in self._fds:
            self.ops.append(Op("sync", self._fds[fd]))

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)
        if fd in self._fds:
            self.ops.append(Op("truncate", self._fds[fd], offset=size))

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:  # type: ignore[override]
        os.rename(src, dst)
        self._renamed(src, dst)

    def replace(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:  # type: ignore[override]
        os.replace(src, dst)
        self._renamed(src, dst)

    def _renamed(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if self._ours(dst):
            a, b = self._rel(src), self._rel(dst)
            inode = self._names.pop(a)
            self._names[b] = inode
            self.ops.append(Op("rename", inode, a, target=b))

    def unlink(self, path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:  # type: ignore[override]
        os.unlink(path)
        if self._ours(path):
            rel = self._rel(path)
            self.ops.append(Op("unlink", self._names.pop(rel, -1), rel))

    def fsync_dir(self, directory: str | os.PathLike[str]) -> None:
        super().fsync_dir(directory)
        if self._ours(directory):
            self.ops.append(Op("dirsync", path=self._rel(directory)))

    def mark(self) -> int:
        """How many operations so far: a point to cut at."""
        return len(self.ops)


@dataclass
class CrashState:
    """The files a power cut after ``cut`` operations could leave, and how."""

    cut: int
    how: str
    files: dict[str, bytes] = field(default_factory=dict)

    def key(self) -> tuple[tuple[str, bytes], ...]:
        return tuple(sorted(self.files.items()))


def _apply(content: bytearray, op: Op, *, upto: int | None = None, zeros: bool = False) -> None:
    """One write or truncate; ``upto`` keeps only that many bytes of a write,
    ``zeros`` lands its size but not its data."""
    if op.kind == "truncate":
        del content[op.offset :]
        return
    data = op.data if upto is None else op.data[:upto]
    if zeros:
        data = bytes(len(data))
    end = op.offset + len(data)
    if len(content) < op.offset:
        content.extend(bytes(op.offset - len(content)))
    content[op.offset : end] = data


def _names_after(names: dict[str, int], dir_ops: list[Op]) -> dict[str, int]:
    out = dict(names)
    for op in dir_ops:
        if op.kind == "create":
            out[op.path] = op.inode
        elif op.kind == "rename":
            out.pop(op.path, None)
            out[op.target] = op.inode
        elif op.kind == "unlink":
            out.pop(op.path, None)
    return out


def crash_states(rec: Recorder, cut: int, *, byte_step: int = 1, max_subset: int = 8) -> Iterator[CrashState]:
    """Every state (duplicates included) a power cut after ``rec.ops[:cut]`` can leave.

    ``byte_step`` > 1 samples the byte cuts of a torn write (every n-th byte plus
    the first and the last); ``max_subset``: every subset of the unsynced writes
    when there are at most this many, else each one alone dropped.
    """
    synced: dict[int, bytearray] = {}
    pending: dict[int, list[Op]] = {}
    durable_names = dict(rec.baseline_inodes)
    for rel, inode in rec.baseline_inodes.items():
        synced[inode] = bytearray(rec.baseline[rel])
    dir_pending: dict[str, list[Op]] = {}
    for op in rec.ops[:cut]:
        if op.kind in ("write", "truncate"):
            pending.setdefault(op.inode, []).append(op)
        elif op.kind == "sync":
            content = synced.setdefault(op.inode, bytearray())
            for w in pending.pop(op.inode, []):
                _apply(content, w)
        elif op.kind in ("create", "rename", "unlink"):
            if op.kind == "create":
                synced.setdefault(op.inode, bytearray())
            dir_pending.setdefault(op.directory, []).append(op)
        elif op.kind == "dirsync":
            durable_names = _names_after(durable_names, dir_pending.pop(op.path, []))
    still = {id(op) for ops in dir_pending.values() for op in ops}
    unsynced_dir = [op for op in rec.ops[:cut] if id(op) in still]
    writes = [w for ws in pending.values() for w in ws]

    def build(names: dict[str, int], choose: dict[int, tuple[str, int]], how: str) -> CrashState:
        """``choose``: index into ``writes`` -> ("skip"|"all"|"cut"|"tail"|"zeros", bytes)."""
        contents = {inode: bytearray(c) for inode, c in synced.items()}
        for i, w in enumerate(writes):
            mode, n = choose.get(i, ("all", 0))
            if mode == "skip":
                continue
            content = contents.setdefault(w.inode, bytearray())
            if mode == "cut":
                _apply(content, w, upto=n)
            elif mode == "tail":  # the later part landed, not the first n bytes
                _apply(content, Op("write", w.inode, offset=w.offset + n, data=w.data[n:]))
            elif mode == "zeros":
                _apply(content, w, zeros=True)
            else:
                _apply(content, w)
        return CrashState(cut, how, {rel: bytes(contents.get(inode, b"")) for rel, inode in names.items()})

    every_name = _names_after(durable_names, unsynced_dir)
    none = {i: ("skip", 0) for i in range(len(writes))}
    # directory entries: each prefix of the unsynced ones, with all or none of the data
    for p in range(len(unsynced_dir) + 1):
        names = _names_after(durable_names, unsynced_dir[:p])
        yield build(names, {}, f"dir-prefix {p}/{len(unsynced_dir)}, all writes")
        if writes:
            yield build(names, none, f"dir-prefix {p}/{len(unsynced_dir)}, no writes")
    # each unsynced write torn: dropped, cut at each byte, or zeros; the others landed or not
    for i, w in enumerate(writes):
        if w.kind != "write":
            continue
        later_same_file = {j: ("skip", 0) for j in range(i + 1, len(writes)) if writes[j].inode == w.inode}
        cuts = sorted({0, len(w.data) - 1, *range(0, len(w.data), byte_step)} - {-1})
        for n in cuts:
            yield build(every_name, {i: ("cut", n), **later_same_file}, f"write {i} cut at byte {n}")
            if n:
                yield build(every_name, {i: ("tail", n), **later_same_file}, f"write {i} without its first {n} bytes")
        yield build(every_name, {i: ("zeros", 0), **later_same_file}, f"write {i} as zeros")
        yield build(every_name, {i: ("skip", 0)}, f"write {i} dropped")
    # reordering: any subset of the unsynced writes lands
    if 1 < len(writes) <= max_subset:
        for mask in range(1, (1 << len(writes)) - 1):
            choose = {i: ("skip", 0) for i in range(len(writes)) if not mask >> i & 1}
            yield build(every_name, choose, f"writes subset {mask:b}")


def materialize(state: CrashState, root: str | os.PathLike[str], folder: str = "") -> None:
    """Write ``state``'s files (those under ``folder`` only, if given) under
    ``root`` (its directories must exist)."""
    for rel, data in state.files.items():
        if rel.startswith(folder):
            with open(os.path.join(root, rel), "wb") as f:
                f.write(data)
