"""``eventsched.history()``: the read model as a plain, read-only DuckDB connection.

For people who already use DuckDB (or pandas and polars through it)::

    import eventsched
    con = eventsched.history()                  # caught up with the log now
    con.sql("SELECT * FROM gpu_hours_daily").df()
    jobs = con.table("jobs")                    # a DuckDBPyRelation

The connection is a private snapshot, not the shared file: the model is caught
up, copied table by table into a database file in a private temporary folder,
opened ``read_only`` and unlinked at once, so it holds no lock on the shared
file (a notebook may keep it open for hours without making anyone wait) and
nothing can write through it. Call ``history()`` again for newer events.

Works for anyone who can read the state directory's log (a root daemon's users
ask ``eventsched sql`` instead, which the daemon answers as them).
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
    """A read-only DuckDB connection on the history of ``state_dir``, caught up now.

    ``state_dir`` defaults to the daemon's (``$EVENTSCHED_STATE_DIR``, else the
    user's data directory). Tables and views are those of docs/history-schema.md.
    Raises ``HistoryError`` when there is no state directory there.
    """
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
