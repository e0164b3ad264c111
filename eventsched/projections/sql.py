"""`eventsched sql`: read-only SQL over the history (docs/history-schema.md).

Statements are classified by DuckDB's own parser, not by regexes, and run on a
read-only, hardened connection: even one the parser let through could not
change the read model.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import duckdb

from eventsched.projections.history import History, HistoryError
from eventsched.projections.sql_values import EXIT_BAD_QUERY, EXIT_ERROR, SqlError

__all__ = ["query", "query_typed", "SqlError", "check_read_only", "QueryRefused", "harden"]


# Everything else (SET, RESET, ATTACH, COPY, INSTALL, LOAD, CALL, ...) is refused.
_READ_TYPES = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
# PRAGMAs that only describe things; every other one may change settings or data
_READ_PRAGMAS = {
    "table_info", "show", "show_tables", "show_tables_expanded", "database_size",
    "storage_info", "version", "database_list", "functions", "collations", "platform",
}


class QueryRefused(Exception):
    """The statement would change the read model (or is not a query)."""


def _one_line(message: str) -> str:
    """DuckDB's message on one line: drop the caret diagram, keep the hints."""
    lines = (line.strip() for line in message.splitlines())
    return " ".join(t for t in lines if t and not t.startswith("LINE ") and not set(t) <= {"^", " "})


def _explained(text: str) -> list[str]:
    """Where the statement an EXPLAIN explains may start, by DuckDB's grammar:
    after ``EXPLAIN``, ``EXPLAIN ANALYZE``, ``EXPLAIN [ANALYZE] VERBOSE`` or
    ``EXPLAIN (options)``."""
    tokens = [(pos, kind) for pos, kind in duckdb.tokenize(text) if kind != duckdb.token_type.comment]

    def word(i: int) -> str:
        end = tokens[i + 1][0] if i + 1 < len(tokens) else len(text)
        return text[tokens[i][0]:end].strip().lower()

    starts, i = [], 1
    for optional in (("analyze", "analyse"), ("verbose",)):  # in this order, each at most once
        if i < len(tokens) and word(i) in optional:
            starts.append(i)
            i += 1
    starts.append(i)
    if len(tokens) > 1 and word(1).startswith("("):
        depth = 0
        for j in range(1, len(tokens)):
            depth += word(j).count("(") - word(j).count(")")
            if depth <= 0:
                starts.append(j + 1)
                break
    return [text[tokens[k][0]:] for k in sorted(set(starts)) if k < len(tokens)]


def _check_explain(text: str) -> None:
    """EXPLAIN ANALYZE runs its statement: let an EXPLAIN through only when
    every way of reading what it explains is one SELECT."""
    selects = 0
    for inner in _explained(text):
        try:
            statements = duckdb.extract_statements(inner)
        except duckdb.Error:
            continue
        if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
            kind = statements[0].type.name if len(statements) == 1 else "several statements"
            raise QueryRefused(f"refused: EXPLAIN of {kind}; only a SELECT may be explained")
        selects += 1
    if not selects:
        raise QueryRefused("refused: EXPLAIN of something other than a SELECT; only a SELECT may be explained")


def check_read_only(sql: str) -> list[str]:
    """The statements of ``sql`` if all of them only read, by an allow-list (SELECT, which includes
    DESCRIBE, SHOW, SUMMARIZE; EXPLAIN of a SELECT; descriptive PRAGMAs);
    raises QueryRefused."""
    try:
        sql.encode()
    except UnicodeEncodeError:  # bytes a shell passed that are not UTF-8 text
        raise QueryRefused("the query is not UTF-8 text") from None
    statements = duckdb.extract_statements(sql)  # raises duckdb.ParserException
    if not statements:
        raise QueryRefused("empty query")
    out = []
    for statement in statements:
        kind = statement.type
        text = statement.query.strip()
        if kind == duckdb.StatementType.PRAGMA:
            name = text.split(None, 1)[1] if " " in text else ""
            name = name.split("(", 1)[0].split("=", 1)[0].strip().lower()
            if name not in _READ_PRAGMAS:
                raise QueryRefused(f"refused: PRAGMA {name or '?'} is not a read-only statement")
        elif kind not in _READ_TYPES:
            raise QueryRefused(
                f"refused: {kind.name} statements are not read-only queries; "
                "only SELECT, EXPLAIN and descriptive PRAGMAs are allowed"
            )
        elif kind == duckdb.StatementType.EXPLAIN:
            _check_explain(text)
        out.append(text)
    return out


def harden(con: duckdb.DuckDBPyConnection, *, memory_limit: str | None = None, threads: int | None = None,
           spill: bool = True) -> None:
    """Lock ``con`` down before it runs a user's SQL: no files outside the
    database already open, no extensions, then ``lock_configuration`` so no
    statement can undo it; ``spill=False`` keeps it off the disk altogether."""
    settings: list[str] = []
    if not spill:  # temp_directory may only change while external access is on
        settings += ["SET temp_directory = ''", "SET max_temp_directory_size = '0B'"]
    if memory_limit is not None:
        settings.append(f"SET memory_limit = '{memory_limit}'")
    if threads is not None:
        settings.append(f"SET threads = {int(threads)}")
    settings += ["SET autoinstall_known_extensions = false", "SET autoload_known_extensions = false",
                 "SET enable_progress_bar = false"]
    for statement in settings:
        con.execute(statement)
    with contextlib.suppress(duckdb.CatalogException):  # a setting older DuckDBs lack
        con.execute("SET allow_community_extensions = false")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def query(state_dir: str | os.PathLike[str], sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run read-only ``sql`` on a current view of the history; the last result."""
    columns, rows, _ = query_typed(state_dir, sql)
    return columns, rows


def query_typed(state_dir: str | os.PathLike[str], sql: str) -> tuple[list[str], list[tuple[Any, ...]], list[str]]:
    """``query``, with the DuckDB type of each column (``TIMESTAMP``, ``BIGINT[]``...)."""
    try:
        statements = check_read_only(sql)
    except QueryRefused as e:
        raise SqlError(str(e), EXIT_BAD_QUERY) from None
    except duckdb.Error as e:
        raise SqlError(_one_line(str(e)), EXIT_BAD_QUERY) from None
    try:
        history = History(state_dir)
    except HistoryError as e:
        raise SqlError(str(e), EXIT_ERROR) from None
    try:
        with history.reader() as con:
            harden(con)
            columns: list[str] = []
            rows: list[tuple[Any, ...]] = []
            types: list[str] = []
            for text in statements:
                cur = con.execute(text)
                columns = [d[0] for d in cur.description or []]
                types = [str(d[1]) for d in cur.description or []]
                rows = cur.fetchall()
    except duckdb.Error as e:
        raise SqlError(_one_line(str(e)), EXIT_BAD_QUERY) from None
    except Exception as e:  # the log's own errors (corruption) carry a user-facing message
        if isinstance(e, OSError) or type(e).__module__.startswith("eventsched"):
            raise SqlError(str(e), EXIT_ERROR) from None
        raise
    finally:
        history.close()
    return columns, rows, types
