"""``eventsched sql``'s output: a result as an aligned table, CSV or JSON.

The query itself (read-only statements, the hardened connection) is
``projections.sql``; a user who cannot read the log is answered by the daemon
(``needs_daemon``) with the same rules.
"""

from __future__ import annotations

import csv
import decimal
import json
import math
import os
import sys
from typing import Any, Callable, TextIO

from eventsched.domain.text import table
from eventsched.projections.sql import EXIT_BAD_QUERY, EXIT_OK, SqlError, _plain, query

__all__ = ["format_table", "format_csv", "format_json", "print_result", "run_sql"]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value != value or value in (math.inf, -math.inf):
            return str(value)
        if value == int(value) and abs(value) < 1e15:
            return f"{value:.1f}"
        return f"{value:.3f}" if abs(value) >= 0.001 else f"{value:.3g}"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(_plain(value))
    return str(_plain(value))


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float, decimal.Decimal)) and not isinstance(value, bool)


def format_table(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    """Aligned columns, numbers right-aligned, a rule under the header, and a row count."""
    right = [any(_numeric(row[i]) for row in rows) and all(row[i] is None or _numeric(row[i]) for row in rows)
             for i in range(len(columns))]
    body = table(columns, [[_cell(v) for v in row] for row in rows], right=right, rule=True)
    return f"{body}\n({len(rows)} row{'s' if len(rows) != 1 else ''})"


def format_csv(columns: list[str], rows: list[tuple[Any, ...]], out: TextIO) -> None:
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if v is None else _cell(v) if isinstance(v, (list, tuple, dict)) else _plain(v)
                         for v in row])


def format_json(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    """A JSON array of objects, one per row."""
    return json.dumps([{c: _plain(v) for c, v in zip(columns, row)} for row in rows], indent=None)


def print_result(columns: list[str], rows: list[tuple[Any, ...]], fmt: str, out: TextIO) -> None:
    if fmt == "csv":
        format_csv(columns, rows, out)
    elif fmt == "json":
        print(format_json(columns, rows), file=out)
    else:
        print(format_table(columns, rows), file=out)


def run_sql(state_dir: str | os.PathLike[str], sql: str, fmt: str = "table",
            *, out: TextIO | None = None, err: TextIO | None = None,
            via_daemon: Callable[[str], dict[str, Any]] | None = None) -> int:
    """Print the result of read-only ``sql`` over the history; the exit status.

    ``via_daemon`` asks the daemon instead (see ``needs_daemon``).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    if fmt not in ("table", "csv", "json"):
        print(f"eventsched sql: unknown format {fmt!r} (table, csv or json)", file=err)
        return EXIT_BAD_QUERY
    try:
        if via_daemon is not None:
            result = via_daemon(sql)
            columns, rows = result["columns"], [tuple(row) for row in result["rows"]]
        else:
            columns, rows = query(state_dir, sql)
    except SqlError as e:
        print(f"eventsched sql: {e}", file=err)
        return e.code
    print_result(columns, rows, fmt, out)
    return EXIT_OK
