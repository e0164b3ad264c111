"""What the history says about GPU use: an ended job's report card (shown by
``explain`` and ``logs``) and ``eventsched report``, usage by user, tenant or day. Both
are read-only SQL over the read model, asked as ``eventsched sql`` asks."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from eventsched.domain import report_card
from eventsched.domain.states import FINAL
from eventsched.domain.units import UnitError, format_duration, parse_duration

__all__ = ["card_of", "render_card", "card_after_logs", "cmd_report", "usage_sql"]


def _history(args: argparse.Namespace, sql: str) -> tuple[list[str], list[Any]]:
    """Rows of read-only ``sql`` over the history: the daemon answers where this user cannot read the log."""
    from eventsched.cli.connect import state_dir_of
    from eventsched.cli.status_history import query_for

    return query_for(state_dir_of(args), args.socket, timeout_s=180.0)(sql)


def card_of(args: argparse.Namespace, job: dict[str, Any]) -> dict[str, Any] | None:
    """An ended job's report card (its ``job_efficiency`` row and the advice); None while it has not ended
    or never ran."""
    from eventsched.projections.sql_values import SqlError

    if job.get("state") not in FINAL:
        return None
    try:
        columns, rows = _history(args, f"SELECT * FROM job_efficiency WHERE job = {int(job['id'])}")
    except SqlError:
        return None  # no history to read: the rest of explain still stands
    if not rows:
        return None
    card = dict(zip(columns, rows[0]))
    card["advice"] = report_card.advice(card["gpus"], card["gpus_used_peak"], card["gpu_mem_mib"] or 0,
                                        card["mem_peak_mib"])
    return card


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} %"


def render_card(card: dict[str, Any]) -> str:
    util = (f"mean {_pct(card['utilization_mean'])}, peak {_pct(card['utilization_peak'])} "
            f"({card['samples']} samples)" if card["samples"] else "not sampled")
    peak = card["mem_peak_mib"]
    asked = card["gpu_mem_mib"] or 0
    mem = "no per-job reading" if peak is None else f"peak {report_card.gb(peak)}" + (
        f" of {report_card.gb(asked)} requested" if asked else " (no --gpu-mem request)")
    gpu_hours, idle = card["gpu_hours"], card["idle_gpu_hours"]
    share = f" ({idle / gpu_hours:.0%} of its {gpu_hours:.3g} GPU-hours)" if gpu_hours else ""
    host = "not sampled" if card["host_mem_peak_mib"] is None else f"peak {report_card.gb(card['host_mem_peak_mib'])}"
    return "\n".join([
        "report card:",
        f"  GPU utilisation: {util}",
        f"  GPU memory (per GPU): {mem}",
        f"  host memory: {host}",
        f"  idle while allocated: {idle:.3g} GPU-hours{share}",
        f"  queue wait: {format_duration(card['wait_s'])}",
        f"  advice: {card['advice']}",
    ])


def card_after_logs(args: argparse.Namespace, c: Any) -> None:
    """After ``logs`` of an ended job, its report card on stderr: on a terminal,
    or asked with ``--card`` (piped output stays the job's own)."""
    if not (args.card or sys.stderr.isatty()):
        return
    card = card_of(args, c.explain(args.job)["job"])
    if card:
        print("\n" + render_card(card), file=sys.stderr)


_KEYS = {"user": '"user"', "tenant": "tenant",
         "day": "(DATE '1970-01-01' + floor(first_started_at / 86400)::INTEGER)"}


def usage_sql(by: str, since: float, price: float) -> str:
    """Usage per ``by`` of the jobs that started at or after ``since``, each counted in full."""
    cost = f", sum(gpu_hours) * {float(price)!r} AS cost" if price else ""
    return f"""
SELECT {_KEYS[by]} AS {by}, count(*) AS jobs, sum(gpu_hours) AS gpu_hours, sum(idle_gpu_hours) AS idle_gpu_hours,
       sum(utilization_mean / 100.0 * gpu_hours) / nullif(sum(gpu_hours) FILTER (WHERE utilization_mean IS NOT NULL), 0)
           AS efficiency,
       avg(wait_s) AS mean_wait_s, quantile_cont(wait_s, 0.9) AS p90_wait_s{cost}
FROM job_efficiency WHERE first_started_at >= {float(since)!r}
GROUP BY ALL ORDER BY 1"""


def _markdown(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def cmd_report(args: argparse.Namespace) -> int:
    from eventsched.cli.errors import fail
    from eventsched.cli.sql import _cell, print_result
    from eventsched.projections.sql_values import SqlError
    from eventsched.runtime.config import ConfigError, load_config

    try:
        since = time.time() - parse_duration(args.since)
    except UnitError:
        fail(f"--since {args.since!r}: give a duration such as 30d, 12h, 90m or seconds")
    try:
        price = load_config(args.config).accounting.gpu_hour_price if args.config else 0.0
        columns, values = _history(args, usage_sql(args.by, since, price))
    except ConfigError as exc:
        fail(str(exc))
    except SqlError as exc:
        fail(str(exc), exc.code)
    if not values:
        columns = ["jobs", "gpu_hours"]
    if args.format == "markdown":
        print(_markdown(columns, [[_cell(v) for v in row] for row in values]))
    else:
        print_result(columns, values, args.format, sys.stdout)
    return 0
