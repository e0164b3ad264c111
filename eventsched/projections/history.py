"""The DuckDB read model: the whole event log folded into tables people query
(schema, units and the locking protocol: ``docs/history-schema.md``).

DuckDB allows one read-write process per file, or many read-only ones, so the
file belongs to nobody: whoever wants a current view catches it up under an
exclusive ``flock`` of ``history.lock``, then reads it read-only under a shared
one. Whoever cannot write it in time answers from a private in-memory copy
caught up from the log: as current, only slower. No long-lived process keeps
the file open, so the daemon never blocks ``eventsched sql``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from eventsched.domain import paths
from eventsched.projections.history_fold import ensure_schema, position
from eventsched.projections.history_frames import fold_frames
from eventsched.projections.history_schema import SCHEMA_VERSION, TABLES, VIEWS

__all__ = ["History", "HistoryError", "open_history", "rebuild", "SCHEMA_VERSION", "TABLES", "VIEWS"]

if TYPE_CHECKING:
    from eventsched.storage.log import Frame

DB_NAME = "history.duckdb"
LOCK_NAME = "history.lock"


class HistoryError(Exception):
    """A problem a user can act on (missing state dir, unreadable log)."""


def _log_frames(log_dir: Path, from_seq: int) -> Iterator[Frame]:
    if not log_dir.is_dir():
        return iter(())
    from eventsched.storage import log  # the log module is optional at import time

    return log.read_frames(log_dir, from_seq=from_seq)


def _log_last_seq(log_dir: Path) -> int:
    if not log_dir.is_dir():
        return 0
    from eventsched.storage import log

    return int(log.last_seq(log_dir))


def _flock(fd: int, kind: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def _private(fd: int) -> None:
    """Make a file we own 0600."""
    st = os.fstat(fd)
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.fchmod(fd, 0o600)


def _open_lock(path: Path) -> int:
    """The lock file, readable and writable by its owner alone: anyone who
    could open it could flock it and stall every catch-up and query (a root
    daemon's users ask the daemon instead). PermissionError if it is not ours."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        _private(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_private_db(db_path: Path) -> None:
    """Create an empty database file at ``db_path`` with mode 0600. DuckDB
    uses the umask and refuses an empty file: it is made in a 0700 folder
    beside it and renamed into place, never seen with a looser mode."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=".history-new-", dir=db_path.parent) as folder:
        tmp = Path(folder) / db_path.name
        with duckdb.connect(str(tmp)) as con:
            ensure_schema(con)
        os.chmod(tmp, 0o600)
        os.rename(tmp, db_path)


def _private_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        _private(fd)
    finally:
        os.close(fd)


def _drop_db(db_path: Path) -> None:
    for path in (db_path, db_path.with_name(db_path.name + ".wal")):
        path.unlink(missing_ok=True)


def _is_lock_conflict(exc: duckdb.Error) -> bool:
    return isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower()


class History:
    """A handle on the read model of one state directory; it keeps no
    connection open between calls, so a long-lived holder never blocks readers."""

    def __init__(self, state_dir: str | os.PathLike[str], *, lock_timeout_s: float = 5.0,
                 in_memory: bool = False, write_wait_s: float | None = None) -> None:
        self.state_dir = Path(state_dir)
        if not self.state_dir.is_dir():
            raise HistoryError(f"no eventsched state directory at {self.state_dir}")
        self.log_dir = paths.log_dir(self.state_dir)
        self.db_path = self.state_dir / DB_NAME
        self.lock_path = self.state_dir / LOCK_NAME
        self.lock_timeout_s = lock_timeout_s
        # how long a reader waits to catch the file up before it reads a private copy
        self.write_wait_s = lock_timeout_s if write_wait_s is None else write_wait_s
        self.force_memory = in_memory
        self._mem: duckdb.DuckDBPyConnection | None = None
        # how the last view was obtained: "file", "memory-copy" or "memory-log"
        self.last_mode = ""

    def catch_up(self) -> int:
        """Fold new log events into the database file; returns events added."""
        if self.force_memory:
            return self._catch_up_memory()
        try:
            fd = _open_lock(self.lock_path)
        except PermissionError:
            return 0  # not ours to write (a root daemon's); its owner keeps it current
        try:
            if not _flock(fd, fcntl.LOCK_EX, self.lock_timeout_s):
                return 0  # someone else is writing or reading; they are current
            return self._try_catch_up_file() or 0
        finally:
            os.close(fd)  # closing releases the flock

    def _try_catch_up_file(self) -> int | None:
        """``_catch_up_file``; None when a process outside the protocol holds the file."""
        try:
            return self._catch_up_file()
        except duckdb.Error as exc:
            if _is_lock_conflict(exc):
                return None
            raise

    def _catch_up_file(self) -> int:
        if not self.db_path.exists():
            _create_private_db(self.db_path)
        for path in (self.db_path, self.db_path.with_name(self.db_path.name + ".wal")):
            _private_path(path)
        con = duckdb.connect(str(self.db_path))
        try:
            ensure_schema(con)
            after = position(con)
            last = _log_last_seq(self.log_dir)
            if after > last:
                # The model read a tail a crash then cut from the log (a reader can see
                # a frame before its fdatasync): the log is the truth, start again from it.
                con.close()
                _drop_db(self.db_path)
                _create_private_db(self.db_path)
                con = duckdb.connect(str(self.db_path))
                after = 0
            return fold_frames(con, _log_frames(self.log_dir, after + 1), after, last)
        finally:
            con.close()

    def _catch_up_memory(self) -> int:
        if self._mem is None:
            self._mem = duckdb.connect(":memory:")
            ensure_schema(self._mem)
        after = position(self._mem)
        return fold_frames(self._mem, _log_frames(self.log_dir, after + 1), after)

    @contextlib.contextmanager
    def reader(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection on a view that includes every event in the log now.

        Prefer ``query``; use this for several queries on one consistent view.
        Do not write through it (the file one is read-only anyway).
        """
        if self.force_memory:
            yield self._memory_from_log()
            return
        try:
            fd = _open_lock(self.lock_path)
        except PermissionError:
            # not ours (a root daemon's read model): a private view from the log
            try:
                yield self._memory_from_log()
            finally:
                self._replace_mem(None)
            return
        try:
            con = self._open_current(fd)
            try:
                yield con
            finally:
                if con is not self._mem:
                    con.close()
        finally:
            os.close(fd)

    def _open_current(self, fd: int) -> duckdb.DuckDBPyConnection:
        wrote = _flock(fd, fcntl.LOCK_EX, self.write_wait_s) and self._try_catch_up_file() is not None
        # Downgrade (or wait) to shared: other readers may now open it too.
        if _flock(fd, fcntl.LOCK_SH, self.lock_timeout_s) and self.db_path.exists():
            try:
                con = duckdb.connect(str(self.db_path), read_only=True)
            except duckdb.Error as exc:
                if not _is_lock_conflict(exc):
                    raise
            else:
                if wrote or position(con) >= _log_last_seq(self.log_dir):
                    self.last_mode = "file"
                    return con
                return self._memory_copy(con)
        return self._memory_from_log()

    def _memory_copy(self, file_con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
        """The file is behind and we may not write it: copy it, catch up privately."""
        file_con.close()
        mem = duckdb.connect(":memory:")
        mem.execute(f"ATTACH '{self.db_path}' AS disk (READ_ONLY)")
        mem.execute("COPY FROM DATABASE disk TO memory")
        mem.execute("DETACH disk")
        ensure_schema(mem)
        self._replace_mem(mem)
        self._catch_up_memory()
        self.last_mode = "memory-copy"
        return mem

    def _memory_from_log(self) -> duckdb.DuckDBPyConnection:
        self._catch_up_memory()
        self.last_mode = "memory-log"
        return self._mem  # type: ignore[return-value]

    def _replace_mem(self, con: duckdb.DuckDBPyConnection | None) -> None:
        if self._mem is not None:
            self._mem.close()
        self._mem = con

    def query(self, sql: str, params: list[Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read query on a current view: (column names, rows)."""
        with self.reader() as con:
            cur = con.execute(sql, params or [])
            columns = [d[0] for d in cur.description or []]
            return columns, cur.fetchall()

    def close(self) -> None:
        self._replace_mem(None)

    def __enter__(self) -> "History":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_history(state_dir: str | os.PathLike[str], **kwargs: Any) -> History:
    """A History for ``state_dir``, caught up with its log."""
    history = History(state_dir, **kwargs)
    history.catch_up()
    return history


def rebuild(state_dir: str | os.PathLike[str]) -> int:
    """Throw the database file away and fold the whole log again; events folded."""
    history = History(state_dir)
    fd = _open_lock(history.lock_path)
    try:
        if not _flock(fd, fcntl.LOCK_EX, 60.0):
            raise HistoryError(f"{history.lock_path} is busy; try again when queries finish")
        _drop_db(history.db_path)
        return history._catch_up_file()
    finally:
        os.close(fd)
