"""``eventsched status --history 1h``: per GPU, utilisation and memory
sparklines over the window, and per user today's GPU-hours (UTC), from one SQL
query over the read model (run by the daemon where this user cannot read the log).

The sampler logs a GPU's sample when it changes and at least once a minute, so
a reading holds until the next: a column without samples shows the last reading
before it if at most ``HOLD_S`` old (a stopped daemon's GPUs go blank, not flat).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import time
from typing import Any, Callable

from eventsched.domain.units import UnitError, format_duration, parse_duration

__all__ = ["HOLD_S", "SPARK", "fetch_history", "history_query", "parse_window", "render_history",
           "series_from_rows", "sparkline", "StatusHistory", "query_for", "via_socket"]

SPARK = "▁▂▃▄▅▆▇█"
BLOCKS = " ▏▎▍▌▋▊▉█"
HOLD_S = 90.0  # a reading is carried forward at most this long (the sampler logs at least every 60 s)
DEFAULT_BUCKETS = 60
BAR_WIDTH = 30
REFRESH_S = 10.0  # with --watch, the history is re-read at most this often
MIN_SPAN_S = 10.0  # the shortest window ``fit`` narrows to

Query = Callable[[str], tuple[list[str], list[Any]]]


def parse_window(text: str) -> float:
    """``--history``'s window in seconds (``30m``, ``1h``, ``1d``, ``900``); UserError-ready message on bad input."""
    try:
        seconds = parse_duration(text)
    except UnitError:
        raise UnitError(f"--history {text!r}: give a window like 15m, 1h, 6h or 1d") from None
    if seconds > 31 * 86400:
        raise UnitError(f"--history {text!r}: at most 31 days")
    return seconds


def _num(value: float) -> str:
    return repr(float(value))


def history_query(start: float, end: float, buckets: int, day: dt.date, *, fit: bool = True) -> str:
    """One query (one round trip, one consistent view) for the whole picture; its
    first row (``kind = 'window'``) gives the window's start and column width.
    With ``fit``, a window reaching back before the first sample starts there."""
    s, e, n = _num(start), _num(end), int(buckets)
    first = f"greatest({s}, least({e} - {_num(MIN_SPAN_S)}, coalesce((SELECT min(ts) FROM gpu_samples), {s})))"
    return f"""
WITH w AS (SELECT {first if fit else s} AS start),
     p AS (SELECT start, ({e} - start) / {n} AS width FROM w)
SELECT 'window' AS kind, NULL::VARCHAR AS node, NULL::INTEGER AS gpu, NULL::BIGINT AS b,
       p.start AS util, p.width AS mem, NULL::BIGINT AS total, NULL::DOUBLE AS last_ts,
       NULL::DOUBLE AS last_util, NULL::DOUBLE AS last_mem, NULL::VARCHAR AS "user", NULL::DOUBLE AS hours FROM p
UNION ALL
SELECT 'bucket', node, gpu, CAST(floor((ts - p.start) / p.width) AS BIGINT),
       avg(utilization), avg(memory_used_mib), max(memory_total_mib),
       max(ts), arg_max(utilization, ts), arg_max(memory_used_mib, ts), NULL, NULL
FROM gpu_samples, p WHERE ts >= p.start AND ts <= {e} GROUP BY ALL
UNION ALL
SELECT 'before', node, gpu, -1, NULL, NULL, max(memory_total_mib), max(ts),
       arg_max(utilization, ts), arg_max(memory_used_mib, ts), NULL, NULL
FROM gpu_samples, p WHERE ts < p.start GROUP BY ALL
UNION ALL
SELECT 'gpu', node, gpu, NULL, NULL, NULL, memory_total_mib, NULL, NULL, NULL, NULL, NULL FROM gpus
UNION ALL
SELECT 'user', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, "user", sum(gpu_hours)
FROM gpu_hours_daily WHERE day = DATE '{day.isoformat()}' GROUP BY "user"
"""


def series_from_rows(rows: list[Any], start: float, bucket_s: float, buckets: int) -> dict[str, Any]:
    """Per GPU the columns (None: no reading), from ``history_query``'s rows."""
    gpus: dict[tuple[str, int], dict[str, Any]] = {}
    users: list[dict[str, Any]] = []
    for kind, node, index, b, mean_util, mean_mem, total, last_ts, last_util, last_mem, user, hours in rows:
        if kind == "window":
            continue
        if kind == "user":
            users.append({"user": user or "", "gpu_hours": float(hours or 0.0)})
            continue
        g = gpus.setdefault((node, int(index)), {"memory_total_mib": None, "by_bucket": {}, "before": None})
        if total is not None:
            g["memory_total_mib"] = max(int(total), g["memory_total_mib"] or 0)
        if kind == "bucket" and int(b) >= 0:  # a sample right at the window's end: the last column
            g["by_bucket"][min(int(b), buckets - 1)] = (float(mean_util), float(mean_mem), float(last_ts),
                                                        float(last_util), float(last_mem))
        elif kind == "before":
            g["before"] = (float(last_ts), float(last_util), float(last_mem))
    out = []
    for (node, index), g in sorted(gpus.items()):
        readings: list[tuple[float | None, float | None]] = []
        held: tuple[float, float, float] | None = g["before"]  # (when, utilisation, memory) of the last reading
        for i in range(buckets):
            if (seen := g["by_bucket"].get(i)) is not None:
                held = seen[2:]
                readings.append(seen[:2])
            else:
                fresh = held is not None and start + i * bucket_s - held[0] <= HOLD_S
                readings.append(held[1:] if fresh and held is not None else (None, None))
        util, mem = [u for u, _ in readings], [m for _, m in readings]
        known_util = [u for u in util if u is not None]
        known_mem = [m for m in mem if m is not None]
        out.append({
            "node": node, "gpu": index, "memory_total_mib": g["memory_total_mib"],
            "utilization": util, "memory_used_mib": mem,
            "utilization_last": known_util[-1] if known_util else None,
            "utilization_mean": sum(known_util) / len(known_util) if known_util else None,
            "utilization_peak": max(known_util) if known_util else None,
            "memory_used_mib_last": known_mem[-1] if known_mem else None,
            "memory_used_mib_peak": max(known_mem) if known_mem else None,
        })
    users.sort(key=lambda u: (-u["gpu_hours"], u["user"]))
    return {"gpus": out, "users": users}


def fetch_history(run_query: Query, window_s: float, *, now: float | None = None,
                  buckets: int = DEFAULT_BUCKETS, fit: bool = True) -> dict[str, Any]:
    """Per-GPU columns over the last ``window_s`` seconds (``fit``: or since the
    first sample, if later) and today's GPU-hours per user."""
    end = time.time() if now is None else now
    day = dt.datetime.fromtimestamp(end, dt.timezone.utc).date()
    _columns, rows = run_query(history_query(end - window_s, end, buckets, day, fit=fit))
    window = next((r for r in rows if r[0] == "window"), None)
    start = float(window[4]) if window is not None else end - window_s
    bucket_s = (end - start) / buckets
    return {"window_s": end - start, "asked_s": window_s, "start": start, "end": end, "bucket_s": bucket_s,
            "buckets": buckets, "day": day.isoformat(), **series_from_rows(rows, start, bucket_s, buckets)}


def sparkline(values: list[float | None], top: float) -> str:
    """One character per value, ``▁`` (0) to ``█`` (``top``); a space where there is no reading."""
    out = []
    for v in values:
        if v is None or top <= 0 or math.isnan(v):
            out.append(" ")
        else:
            level = min(max(v / top, 0.0), 1.0)
            out.append(SPARK[min(int(level * len(SPARK)), len(SPARK) - 1)])
    return "".join(out)


def bar(value: float, top: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar in eighths of a character."""
    if top <= 0 or value <= 0:
        return ""
    eighths = max(1, round(value / top * width * 8))
    return "█" * (eighths // 8) + (BLOCKS[eighths % 8] if eighths % 8 else "")


def _gib(mib: float | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f} GiB"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def render_history(h: dict[str, Any]) -> str:
    """The text ``status --history`` prints after the status table."""
    since = "" if h["window_s"] >= h.get("asked_s", h["window_s"]) - 1e-6 else ", since the first sample"
    lines = [f"History, last {format_duration(h['window_s'], 'span')}{since} "
             f"(one column per {format_duration(h['bucket_s'], 'span')}; ▁ idle/empty … █ 100% or full; blank: no sample)"]
    if not h["gpus"]:
        lines.append("  no GPU samples yet")
    for g in h["gpus"]:
        name = f"{g['node']}:{g['gpu']}"
        pad = " " * len(name)
        total = g["memory_total_mib"] or max([m for m in g["memory_used_mib"] if m is not None] or [0])
        lines.append(f"  {name}  util {sparkline(g['utilization'], 100.0)}  last {_pct(g['utilization_last'])}"
                     f"  mean {_pct(g['utilization_mean'])}  peak {_pct(g['utilization_peak'])}")
        lines.append(f"  {pad}  mem  {sparkline(g['memory_used_mib'], float(total))}  last "
                     f"{_gib(g['memory_used_mib_last'])} of {_gib(total)}  peak {_gib(g['memory_used_mib_peak'])}")
    lines += ["", f"GPU-hours today ({h['day']}, UTC)"]
    if not h["users"]:
        lines.append("  none yet")
    top = max((u["gpu_hours"] for u in h["users"]), default=0.0)
    width = max((len(u["user"] or "(none)") for u in h["users"]), default=0)
    for u in h["users"]:
        lines.append(f"  {(u['user'] or '(none)').ljust(width)}  {bar(u['gpu_hours'], top).ljust(BAR_WIDTH)}"
                     f"  {u['gpu_hours']:.3g}")
    return "\n".join(lines)


def query_for(state_dir: str | os.PathLike[str], socket: str | None, timeout_s: float = 60.0) -> Query:
    """Run SQL here when this user can read the log, else ask the daemon (as ``eventsched sql`` does)."""
    from eventsched.domain.paths import socket_location
    from eventsched.projections.sql_values import needs_daemon

    if not needs_daemon(state_dir):
        from eventsched.projections.sql import query

        return lambda sql: query(state_dir, sql)
    return via_socket(socket or socket_location(state_dir), timeout_s)


def via_socket(socket_path: str | os.PathLike[str], timeout_s: float = 60.0) -> Query:
    """SQL answered by the daemon at ``socket_path``, as this user."""

    def run(sql: str) -> tuple[list[str], list[Any]]:
        from eventsched.cli.sql import ask_daemon

        result = ask_daemon(os.fspath(socket_path), sql, timeout_s)
        return list(result["columns"]), [tuple(row) for row in result["rows"]]

    return run


class StatusHistory:
    """``status --history``'s data (re-read at most every ``REFRESH_S`` under ``--watch``) and text."""

    def __init__(self, window: str, state_dir: str | os.PathLike[str], socket: str | None) -> None:
        self.window_s = parse_window(window)
        self.run_query = query_for(state_dir, socket)
        self._data: dict[str, Any] | None = None
        self._read_at = -math.inf

    def data(self) -> dict[str, Any]:
        from eventsched.cli.errors import fail
        from eventsched.projections.sql_values import SqlError

        if self._data is None or time.monotonic() - self._read_at >= REFRESH_S:
            try:
                self._data = fetch_history(self.run_query, self.window_s)
            except SqlError as exc:  # exits as `eventsched sql` would for the same cause
                fail(f"--history: the history could not be read: {exc}", exc.code)
            self._read_at = time.monotonic()
        return self._data
