"""``eventsched.history()``: the read model as a plain, read-only DuckDB
connection (docs/history-schema.md). A private copy, opened ``read_only`` and
unlinked at once: it holds no lock on the shared file, so a notebook may keep
it open for hours without making anyone wait.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import duckdb

from eventsched.projections.history import History
from eventsched.projections.history_fold import ensure_schema
from eventsched.projections.history_schema import TABLES

__all__ = ["history"]


def history(state_dir: str | os.PathLike[str] | None = None) -> duckdb.DuckDBPyConnection:
    """A read-only DuckDB connection on the history of ``state_dir`` (default:
    the daemon's), caught up now; ``HistoryError`` when there is no state directory."""
    if state_dir is None:
        from eventsched.domain.paths import default_state_dir

        state_dir = default_state_dir()
    folder = tempfile.mkdtemp(prefix="eventsched-history-")  # 0700: only this user sees the copy
    path = Path(folder) / "history.duckdb"
    try:
        with History(state_dir) as model, model.reader() as source:
            copy = duckdb.connect(str(path))
            try:
                ensure_schema(copy)
                copy.execute("DELETE FROM _position")
                for table in TABLES:
                    batches = source.sql(f"SELECT * FROM {table}").to_arrow_reader(100_000)  # noqa: F841
                    copy.execute(f"INSERT INTO {table} SELECT * FROM batches")
                copy.execute("CHECKPOINT")
            finally:
                copy.close()
        con = duckdb.connect(str(path), read_only=True)
    finally:
        # the open connection keeps the file's blocks; the name goes now
        with contextlib.suppress(OSError):
            shutil.rmtree(folder)
    return con
