"""DuckDB for people who already use it.

``eventsched.history()`` gives the read model as a read-only DuckDB
connection; ``eventsched sql --format parquet -o FILE`` writes a typed Parquet
file, by the client as the user who asked (also when the daemon answers the
query for a user who cannot read a root daemon's log).
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import subprocess
import tempfile
from pathlib import Path

import duckdb
import pytest
from daemon_harness import EVENTSCHED, Daemon, cli_env
from test_history import state, t, write  # noqa: F401 (fixture)
from users_harness import as_user, needs_root, public_dir, root_daemon, users  # noqa: F401

import eventsched
from eventsched.cli.sql import run_sql, write_parquet
from eventsched.domain import events as ev
from eventsched.projections.history import History, HistoryError

TYPED = ("SELECT id, \"user\", to_timestamp(submitted_at) AS submitted, gpu_ids, "
         "CAST(submitted_at AS DECIMAL(18,3)) AS exact, INTERVAL 90 SECOND AS span, "
         "sum(id) OVER () AS total FROM jobs ORDER BY id")


def leftovers() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("eventsched-history-")}


def test_history_is_a_read_only_caught_up_duckdb_connection(state: Path) -> None:
    before = leftovers()
    con = eventsched.history(state)
    assert isinstance(con, duckdb.DuckDBPyConnection)
    with History(state) as h:
        assert con.sql("SELECT * FROM jobs ORDER BY id").fetchall() == h.query("SELECT * FROM jobs ORDER BY id")[1]
        assert con.sql("SELECT seq FROM _position").fetchall() == h.query("SELECT seq FROM _position")[1]
    assert con.table("gpu_hours_by_user").filter("\"user\" = 'frank'").fetchall() == [("frank", 1.0, 1)]
    with pytest.raises(duckdb.Error, match="read-only"):
        con.execute("DELETE FROM jobs")
    # a private snapshot: no lock held on the shared file, nothing left in /tmp
    assert leftovers() == before
    write(state, [[ev.JobSubmitted(ts=t(90_000), job=99, spec=ev.JobSpec(command=["x"], user="zoe"))]])
    with History(state) as h:
        h.reader().__enter__()
        assert h.last_mode == "file"  # the catch-up took the file: nobody else holds it
        assert (99,) in h.query("SELECT id FROM jobs")[1]
    assert (99,) not in con.sql("SELECT id FROM jobs").fetchall()  # the snapshot as of the call
    assert (99,) in eventsched.history(state).sql("SELECT id FROM jobs").fetchall()
    con.close()


def test_the_documented_copy_for_the_duckdb_cli(state: Path, tmp_path: Path) -> None:
    """docs/history-schema.md: copy the snapshot into a DuckDB file of one's own."""
    con = eventsched.history(state)
    con.execute(f"ATTACH '{tmp_path / 'mycopy.duckdb'}' AS mine (READ_WRITE)")
    con.execute("COPY FROM DATABASE history TO mine")
    con.execute("DETACH mine")
    con.execute(f"EXPORT DATABASE '{tmp_path / 'export'}' (FORMAT parquet)")
    mine = duckdb.connect(str(tmp_path / "mycopy.duckdb"))
    assert mine.sql("SELECT * FROM gpu_hours_by_user ORDER BY \"user\"").fetchall() == \
        con.sql("SELECT * FROM gpu_hours_by_user ORDER BY \"user\"").fetchall()
    assert mine.sql(f"SELECT count(*) FROM read_parquet('{tmp_path / 'export' / 'jobs.parquet'}')").fetchall() == \
        con.sql("SELECT count(*) FROM jobs").fetchall()


def test_history_without_a_state_dir_says_so(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="no eventsched state directory"):
        eventsched.history(tmp_path / "nope")
    assert "history" in dir(eventsched)


def test_sql_parquet_keeps_the_types(state: Path, tmp_path: Path) -> None:
    target = tmp_path / "out.parquet"
    err = io.StringIO()
    assert run_sql(state, TYPED, "parquet", output=str(target), err=err) == 0, err.getvalue()
    check_typed_parquet(target, state)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def check_typed_parquet(target: Path, state: Path) -> None:
    con = duckdb.connect()
    kinds = dict(con.sql(f"SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM read_parquet('{target}'))")
                 .fetchall())
    # Parquet has no 128-bit integer: DuckDB's writer stores a HUGEINT as DOUBLE
    assert kinds == {"id": "BIGINT", "user": "VARCHAR", "submitted": "TIMESTAMP WITH TIME ZONE",
                     "gpu_ids": "INTEGER[]", "exact": "DECIMAL(18,3)", "span": "INTERVAL", "total": "DOUBLE"}
    rows = con.sql(f"SELECT id, \"user\", epoch(submitted), gpu_ids, span FROM read_parquet('{target}')").fetchall()
    with History(state) as h:
        expected = h.query("SELECT id, \"user\", submitted_at, gpu_ids FROM jobs ORDER BY id")[1]
    assert [(r[0], r[1], r[3]) for r in rows] == [(e[0], e[1], e[3]) for e in expected]
    assert [r[2] for r in rows] == pytest.approx([e[2] for e in expected])
    assert rows[0][4] == dt.timedelta(seconds=90)


def test_parquet_of_an_empty_result_keeps_its_columns(tmp_path: Path) -> None:
    target = tmp_path / "empty.parquet"
    write_parquet(["id", "at"], [], ["BIGINT", "TIMESTAMP"], target)
    described = duckdb.sql(f"DESCRIBE SELECT * FROM read_parquet('{target}')").fetchall()
    assert [(r[0], r[1]) for r in described] == [("id", "BIGINT"), ("at", "TIMESTAMP")]


@pytest.mark.parametrize("args, message", [
    (["--format", "parquet"], "eventsched sql: --format parquet writes a binary file: give -o FILE"),
    (["--format", "parquet", "-o", "/nonexistent/dir/x.parquet"], "eventsched sql: cannot write /nonexistent/dir/x"),
    (["--format", "csv", "-o", "/"], "eventsched sql: / is a directory; give a file name to -o"),
])
def test_bad_output_options_get_one_line(state: Path, args: list[str], message: str) -> None:
    r = subprocess.run([*EVENTSCHED, "sql", "SELECT 1", *args], env=cli_env(state), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(message) and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == ""


@pytest.mark.slow
def test_parquet_and_history_against_a_running_daemon(tmp_path: Path) -> None:
    with Daemon(tmp_path / "state", gpus="fake:2:16384") as d:
        ids = [d.submit("--gpus", "0.5", "--", "/bin/sh", "-c", f"exit {i % 2}") for i in range(4)]
        d.wait_states(ids, {"succeeded", "failed"}, timeout=30)
        target = tmp_path / "jobs.parquet"
        r = d.cli("sql", "SELECT id, state, to_timestamp(ended_at) AS ended FROM jobs ORDER BY id",
                  "--format", "parquet", "-o", str(target))
        assert r.returncode == 0 and r.stdout == "", r.stderr
        as_json = json.loads(d.cli("sql", "SELECT id, state FROM jobs ORDER BY id", "--format", "json").stdout)
        parquet = duckdb.sql(f"SELECT id, state, ended FROM read_parquet('{target}')").fetchall()
        assert [(row["id"], row["state"]) for row in as_json] == [(p[0], p[1]) for p in parquet]
        assert all(isinstance(p[2], dt.datetime) for p in parquet)
        # to a pipe with -o -
        piped = subprocess.run([*EVENTSCHED, "sql", "SELECT count(*) AS n FROM jobs", "--format", "parquet",
                                "-o", "-"], env=d.env(), capture_output=True, timeout=60)
        assert piped.returncode == 0 and piped.stdout[:4] == b"PAR1", piped.stderr
        con = eventsched.history(d.state_dir)  # while the daemon runs
        assert sorted(con.sql("SELECT id FROM jobs").fetchall()) == [(i,) for i in sorted(ids)]
        assert d.cli("sql", "SELECT 1").returncode == 0  # the open connection blocks nobody


@pytest.mark.slow
@needs_root
def test_a_root_daemons_user_gets_parquet_written_as_themselves(users, public_dir: Path) -> None:  # noqa: F811
    alice, _ = users
    with root_daemon(public_dir) as d:
        job = int(as_user(alice, d.state_dir, "submit", "--", "/bin/true").stdout.strip())
        d.wait_states([job], {"succeeded"})
        query = "SELECT id, \"user\", to_timestamp(submitted_at) AS submitted FROM jobs"
        r = as_user(alice, d.state_dir, "sql", query, "--format", "parquet", "-o", "mine.parquet")
        assert r.returncode == 0, r.stderr
        target = Path(alice.home) / "mine.parquet"
        assert target.stat().st_uid == alice.uid  # written by alice's own process, not the root daemon
        rows = duckdb.sql(f"SELECT id, \"user\", submitted FROM read_parquet('{target}')").fetchall()
        assert [(row[0], row[1]) for row in rows] == [(job, alice.name)] and isinstance(rows[0][2], dt.datetime)
        # a path alice may not write stays unwritten: one line, no traceback
        denied = as_user(alice, d.state_dir, "sql", query, "--format", "parquet", "-o", "/root/stolen.parquet")
        assert denied.returncode == 1 and denied.stderr.startswith("eventsched sql: cannot write /root/stolen")
        assert "Traceback" not in denied.stderr and not Path("/root/stolen.parquet").exists()
