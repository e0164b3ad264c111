"""``eventsched sql``'s output: a result as an aligned table, CSV, JSON or Parquet.

Every file is written here, by the client process, as the user who asked: a
root daemon writing to a path a user names could overwrite any file.
"""

from __future__ import annotations

import contextlib
import csv
import decimal
import json
import math
import os
import re
import shutil
import sys
import tempfile
from typing import IO, Any, Callable, TextIO

from eventsched.domain.rlimits import current_umask
from eventsched.domain.text import print_error, table
from eventsched.projections.sql_values import EXIT_BAD_QUERY, EXIT_ERROR, EXIT_OK, SqlError, plain

__all__ = ["FORMATS", "ask_daemon", "format_table", "print_result", "run_sql", "write_parquet"]

FORMATS = ("table", "csv", "json", "parquet")


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
        return json.dumps(plain(value))
    return str(plain(value))


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float, decimal.Decimal)) and not isinstance(value, bool)


def format_table(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    """Aligned columns, numbers right-aligned, a rule under the header, and a row count."""
    right = [any(_numeric(row[i]) for row in rows) and all(row[i] is None or _numeric(row[i]) for row in rows)
             for i in range(len(columns))]
    body = table(columns, [[_cell(v) for v in row] for row in rows], right=right, rule=True)
    return f"{body}\n({len(rows)} row{'s' if len(rows) != 1 else ''})"


def print_result(columns: list[str], rows: list[tuple[Any, ...]], fmt: str, out: TextIO) -> None:
    if fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(["" if v is None else _cell(v) if isinstance(v, (list, tuple, dict)) else plain(v)
                          for v in row] for row in rows)
    elif fmt == "json":
        print(json.dumps([{c: plain(v) for c, v in zip(columns, row)} for row in rows]), file=out)
    else:
        print(format_table(columns, rows), file=out)


# DuckDB types a plain value (JSON-ready: ISO text for times, seconds for an
# INTERVAL, hex for a BLOB) is cast back to; others keep the type Arrow infers.
_SCALAR = re.compile(
    r"(BOOLEAN|TINYINT|SMALLINT|INTEGER|BIGINT|HUGEINT|UTINYINT|USMALLINT|UINTEGER|UBIGINT|UHUGEINT|FLOAT|DOUBLE"
    r"|DECIMAL\(\d{1,2},\s*\d{1,2}\)|VARCHAR|DATE|TIME|TIMESTAMP|TIMESTAMP WITH TIME ZONE|TIMESTAMP_S"
    r"|TIMESTAMP_MS|TIMESTAMP_NS|UUID|INTERVAL|BLOB)(\[\])*"
)


def _cast(column: str, kind: str) -> str:
    if kind == "INTERVAL":
        return f"to_seconds({column})"
    if kind == "BLOB":
        return f"unhex({column})"
    if kind.startswith("TIMESTAMP_") and not kind.endswith("[]"):
        return f"CAST(CAST({column} AS TIMESTAMP) AS {kind})"
    return f"CAST({column} AS {kind})"


def _arrow_column(values: list[Any]) -> Any:
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        # mixed shapes Arrow cannot type: keep each value as its JSON text
        return pa.array([None if v is None else v if isinstance(v, str) else json.dumps(v) for v in values],
                        type=pa.string())


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _copy_parquet(columns: list[str], rows: list[tuple[Any, ...]], types: list[str], path: str) -> None:
    """The rows to ``path`` as Parquet through a private DuckDB, each column cast back to
    its DuckDB type where known (its writer keeps types Arrow's cannot: INTERVAL, UUID ...)."""
    import duckdb
    import pyarrow as pa

    names = [f"c{i}" for i in range(len(columns))]  # result columns may repeat a name
    arrays = [_arrow_column([plain(row[i]) for row in rows]) for i in range(len(columns))]
    raw = pa.Table.from_arrays(arrays, names=names)
    con = duckdb.connect()  # this process's own SQL, over the rows it holds
    try:
        con.register("result", raw)
        exprs = []
        for name, column, kind in zip(names, columns, types):
            expr = _quoted(name)
            if kind and _SCALAR.fullmatch(kind) and not kind.startswith("INTERVAL["):
                candidate = _cast(expr, kind)
                try:
                    con.execute(f"SELECT count({candidate}) FROM result").fetchall()
                    expr = candidate
                except duckdb.Error:
                    pass  # keep the type Arrow inferred
            exprs.append(f"{expr} AS {_quoted(column)}")
        select = f"SELECT {', '.join(exprs)} FROM result"
        quoted_path = "'" + path.replace("'", "''") + "'"
        con.execute(f"COPY ({select}) TO {quoted_path} (FORMAT parquet, COMPRESSION zstd)").fetchall()
    except duckdb.Error as e:  # a full disk, a value Parquet cannot store: said as a failed write
        raise OSError(" ".join(str(e).split())) from None
    finally:
        con.close()


def _replace(path: str, write: Callable[[str], None]) -> None:
    """``write`` a temporary file beside ``path``, then rename it into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_parquet(columns: list[str], rows: list[tuple[Any, ...]], types: list[str],
                  target: str | os.PathLike[str] | IO[bytes]) -> None:
    """Write a result as one Parquet file (zstd): to a path, atomically, or to a binary stream.
    NaN and infinities become NULL, as in the JSON output."""
    if not columns:
        raise OSError("the statement returned no columns")
    if isinstance(target, (str, os.PathLike)):
        return _replace(os.fspath(target), lambda tmp: _copy_parquet(columns, rows, types, tmp))
    with tempfile.TemporaryDirectory() as folder:
        tmp = os.path.join(folder, "result.parquet")
        _copy_parquet(columns, rows, types, tmp)
        with open(tmp, "rb") as f:
            shutil.copyfileobj(f, target)
    target.flush()


def _emit(columns: list[str], rows: list[tuple[Any, ...]], types: list[str], fmt: str,
          output: str | None, out: TextIO) -> None:
    if fmt == "parquet":
        if output in (None, "-"):
            out.flush()
            write_parquet(columns, rows, types, out.buffer if hasattr(out, "buffer") else sys.stdout.buffer)
        else:
            write_parquet(columns, rows, types, output)
    elif output in (None, "-"):
        print_result(columns, rows, fmt, out)
    else:
        def text(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8", newline="") as f:
                print_result(columns, rows, fmt, f)

        _replace(output, text)


def ask_daemon(socket_path: str, sql: str, timeout_s: float) -> dict[str, Any]:
    """``sql`` answered by the daemon, as this user (see ``needs_daemon``)."""
    from eventsched.cli.errors import refusal_exit
    from eventsched.wire import protocol
    from eventsched.wire.client import Client, ClientError

    try:
        with Client(socket_path, timeout=timeout_s) as c:
            result: dict[str, Any] = c.request(protocol.RunSql(query=sql))
            return result
    except ClientError as exc:  # the query refused (2), or no daemon to answer it (1)
        raise SqlError(str(exc), refusal_exit(exc.kind)) from None
    except OSError as exc:  # e.g. the daemon took longer than the client waits
        raise SqlError(f"no answer from the daemon: {exc.strerror or exc}", 1) from None


def run_sql(state_dir: str | os.PathLike[str], sql: str, fmt: str = "table",
            *, out: TextIO | None = None, err: TextIO | None = None,
            via_daemon: Callable[[str], dict[str, Any]] | None = None, output: str | None = None) -> int:
    """Print (or write to ``output``) the result of read-only ``sql`` over the
    history, or ``via_daemon``'s; the exit status."""
    out, err = out or sys.stdout, err or sys.stderr

    def refuse(problem: str, code: int = EXIT_BAD_QUERY) -> int:
        print_error(problem, command="sql", out=err)
        return code

    if fmt not in FORMATS:
        return refuse(f"unknown format {fmt!r} (table, csv, json or parquet)")
    if fmt == "parquet" and (output is None or (output == "-" and out.isatty())):
        return refuse("--format parquet writes a binary file: give -o FILE (or -o - into a pipe)")
    if output not in (None, "-"):
        folder = os.path.dirname(os.path.abspath(output))
        if os.path.isdir(output):
            return refuse(f"{output} is a directory; give a file name to -o")
        if not os.path.isdir(folder):
            return refuse(f"cannot write {output}: no directory {folder}")
    try:
        if via_daemon is not None:
            result = via_daemon(sql)
            columns, rows, types = result["columns"], [tuple(row) for row in result["rows"]], result["types"]
        else:
            from eventsched.projections.sql import query_typed

            columns, rows, types = query_typed(state_dir, sql)
    except SqlError as e:
        return refuse(str(e), e.code)
    try:
        _emit(columns, rows, types, fmt, output, out)
    except OSError as e:
        return refuse(f"cannot write {output or 'the result'}: {e.strerror or e}", EXIT_ERROR)
    return EXIT_OK
