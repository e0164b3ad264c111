"""`eventsched metrics`: the scheduler's figures, from the DuckDB read model
(docs/history-schema.md)."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, TextIO

import duckdb

from eventsched.domain.states import FINAL, JobState
from eventsched.domain.text import print_error, print_json, table
from eventsched.projections.history import History, HistoryError

__all__ = ["compute_metrics", "format_metrics", "prometheus_text", "run_metrics", "STATES"]

STATES: tuple[str, ...] = tuple(s.value for s in JobState)  # every one, so that counts of 0 show too


def _summary(con: duckdb.DuckDBPyConnection, column: str) -> dict[str, float | int | None]:
    return _dicts(con, f'SELECT count({column}) AS count, coalesce(sum({column}), 0.0) AS "sum", '
                       f"avg({column}) AS mean, quantile_cont({column}, 0.5) AS median, "
                       f"quantile_cont({column}, 0.95) AS p95 FROM jobs WHERE {column} IS NOT NULL")[0]


def _dicts(con: duckdb.DuckDBPyConnection, sql: str) -> list[dict[str, Any]]:
    cur = con.execute(sql)
    names = [d[0] for d in cur.description or []]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def compute_metrics(history: History) -> dict[str, Any]:
    """The figures on a current, consistent view of the history."""
    with history.reader() as con:
        position = _dicts(con, "SELECT seq, ts FROM _position")[0]  # ensure_schema always writes the one row
        by_state = dict.fromkeys(STATES, 0)
        for state, n in con.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall():
            by_state[state or "unknown"] = int(n)
        durations = {name: _summary(con, name) for name in ("wait_s", "run_s", "turnaround_s")}
        gpus = _dicts(con, "SELECT node, gpu, samples, utilization_mean, utilization_peak "
                           "FROM gpu_utilization_summary ORDER BY node, gpu")
        hours = {f"gpu_hours_by_{who}": _dicts(con, f'SELECT "{who}", coalesce(gpu_hours, 0.0) AS gpu_hours, jobs '
                                                   f'FROM gpu_hours_by_{who} ORDER BY "{who}"')
                 for who in ("user", "tenant")}
        usage = _dicts(con, "SELECT tenant, quota_gpus, quota_gpu_mem_mib, quota_jobs, weight, gpu_hours, "
                            "gpu_hours_share, gpus_now, running, waiting, mean_wait_s, preempted "
                            "FROM tenant_usage ORDER BY tenant")
        preemptions = _dicts(con, "SELECT count(*) AS n FROM preemptions")[0]["n"]
        forecasts = _dicts(con, "SELECT count(*) AS count, avg(abs_error_s) AS mean_abs_error_s, "
                                "median(abs_error_s) AS median_abs_error_s, avg(error_s) AS mean_error_s "
                                "FROM forecast_errors")[0]
        idle = _dicts(con, 'SELECT user_name AS "user", coalesce(idle_gpu_hours, 0.0) AS idle_gpu_hours, spells, '
                           "jobs FROM idle_gpu_hours ORDER BY user_name")
    return {
        "log_seq": int(position["seq"]), "log_ts": position["ts"],
        "jobs": {"total": sum(by_state.values()), "by_state": by_state,
                 "finished": sum(by_state.get(s, 0) for s in FINAL)},
        **durations, "gpus": gpus, **hours,
        "tenants": usage, "preemptions": preemptions, "forecasts": forecasts, "idle_gpu_hours": idle,
    }


def _num(value: float | int | None, digits: int = 1) -> str:
    return "-" if value is None else str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def _section(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A blank line, the title, and the table indented under it: names on the left, figures right-aligned."""
    text = table(header, rows, right=[False] + [True] * (len(header) - 1), rule=True)
    return ["", title, *("  " + line for line in text.split("\n"))]


def format_metrics(m: dict[str, Any]) -> str:
    out = [f"history up to event {m['log_seq']}"]
    counts = [[s, str(n)] for s, n in m["jobs"]["by_state"].items()]
    out += _section("jobs", ["state", "jobs"], counts + [["total", str(m["jobs"]["total"])]])
    rows = [[label, _num(m[key]["count"]), _num(m[key]["mean"]), _num(m[key]["median"]), _num(m[key]["p95"])]
            for label, key in (("wait", "wait_s"), ("run", "run_s"), ("turnaround", "turnaround_s"))]
    out += _section("times (seconds)", ["", "jobs", "mean", "median", "p95"], rows)
    rows = [[f"{g['node']}:{g['gpu']}", str(g["samples"]), _num(g["utilization_mean"]), _num(g["utilization_peak"])]
            for g in m["gpus"]]
    out += _section("GPU utilisation (%)", ["gpu", "samples", "mean", "peak"], rows or [["-", "0", "-", "-"]])
    for title, key, label in (("GPU-hours per user", "gpu_hours_by_user", "user"),
                              ("GPU-hours per tenant", "gpu_hours_by_tenant", "tenant")):
        rows = [[r[label] or "(none)", str(r["jobs"]), _num(r["gpu_hours"], 3)] for r in m[key]]
        out += _section(title, [label, "jobs", "GPU-hours"], rows or [["-", "0", "0.000"]])
    if m["idle_gpu_hours"]:
        rows = [[r["user"] or "(none)", str(r["jobs"]), str(r["spells"]), _num(r["idle_gpu_hours"], 3)]
                for r in m["idle_gpu_hours"]]
        out += _section("Idle GPU-hours per user (allocated, at most idle_utilization_pct busy)",
                        ["user", "jobs", "spells", "idle GPU-hours"], rows)
    fc = m["forecasts"]
    if fc["count"]:
        out += ["", f"Start forecasts: {fc['count']} checked against the real start; mean absolute error "
                    f"{_num(fc['mean_abs_error_s'])} s, median {_num(fc['median_abs_error_s'])} s "
                    f"(mean error {_num(fc['mean_error_s'])} s: > 0 = later than forecast)"]
    if m["tenants"]:
        rows = [[r["tenant"] or "(none)", _num(r["quota_gpus"]), _num(r["weight"]), _num(r["gpus_now"], 2),
                 str(r["running"]), str(r["waiting"]), _num(r["mean_wait_s"]), _num(r["gpu_hours"], 3),
                 _num(100 * (r["gpu_hours_share"] or 0.0)), str(r["preempted"])] for r in m["tenants"]]
        out += _section(f"Tenants ({m['preemptions']} preemptions in all)",
                        ["tenant", "quota", "weight", "GPUs now", "running", "waiting",
                         "mean wait s", "GPU-hours", "% of all", "preempted"], rows)
    return "\n".join(out)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, Any]) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}" if labels else ""


def _value(v: float | int | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "NaN"
    return (("+Inf" if v > 0 else "-Inf") if math.isinf(v) else repr(v)) if isinstance(v, float) else str(v)


def _scaled(value: Any, scale: float) -> float | int:
    """``value`` in base units; whole numbers print without a fraction (``2``, not ``2.0``)."""
    v = float(value) * scale
    return int(v) if v.is_integer() and abs(v) < 2**53 else v


def prometheus_text(m: dict[str, Any]) -> str:
    """The figures in the text exposition format 0.0.4 (``promtool check metrics``
    passes): counters end in ``_total``, base units (seconds, bytes, ``_ratio``)."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, dict[str, Any], Any]]) -> None:
        lines.append(f"# HELP {name} {help_text.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}")
        lines.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            lines.append(f"{name}{suffix}{_labels(labels)} {_value(value)}")

    family("eventsched_jobs", "gauge", "Jobs by state.",
           [("", {"state": s}, n) for s, n in m["jobs"]["by_state"].items()])
    for key, name, what in (("wait_s", "eventsched_job_wait_seconds", "Submission to first start."),
                            ("run_s", "eventsched_job_run_seconds", "Time running, completed attempts."),
                            ("turnaround_s", "eventsched_job_turnaround_seconds", "Submission to end, finished jobs.")):
        s = m[key]
        family(name, "summary", what, [("", {"quantile": "0.5"}, s["median"]), ("", {"quantile": "0.95"}, s["p95"]),
                                       ("_sum", {}, float(s["sum"])), ("_count", {}, s["count"])])
    for stat in ("mean", "peak"):
        family(f"eventsched_gpu_utilization_{stat}_percent", "gauge",
               f"{stat.title()} GPU utilisation over all samples.",
               [("", {"node": g["node"], "gpu": g["gpu"]}, g[f"utilization_{stat}"]) for g in m["gpus"]])
    for who in ("user", "tenant"):
        family(f"eventsched_{who}_gpu_seconds_total", "counter", f"GPU time used (share x seconds) per {who}.",
               [("", {who: r[who] or ""}, float(r["gpu_hours"]) * 3600.0) for r in m[f"gpu_hours_by_{who}"]])
    tenants = m["tenants"]
    for key, name, what, scale in (
            ("quota_gpus", "eventsched_tenant_quota_gpus", "GPUs a tenant may hold at once.", 1.0),
            ("quota_gpu_mem_mib", "eventsched_tenant_quota_gpu_memory_bytes",
             "GPU memory a tenant may reserve at once.", float(1 << 20)),
            ("quota_jobs", "eventsched_tenant_quota_jobs", "Jobs a tenant may run at once.", 1.0),
            ("weight", "eventsched_tenant_weight", "A tenant's fair-share weight.", 1.0),
            ("gpus_now", "eventsched_tenant_gpus_in_use", "GPUs (shares) a tenant's jobs hold now.", 1.0),
            ("gpu_hours_share", "eventsched_tenant_gpu_time_share_ratio",
             "A tenant's part of all GPU time (0..1).", 1.0),
            ("waiting", "eventsched_tenant_jobs_waiting", "A tenant's jobs queued or held.", 1.0)):
        family(name, "gauge", what, [("", {"tenant": r["tenant"] or ""}, _scaled(r[key], scale))
                                     for r in tenants if r[key] is not None])
    family("eventsched_tenant_preemptions_total", "counter", "A tenant's jobs preempted.",
           [("", {"tenant": r["tenant"] or ""}, r["preempted"]) for r in tenants])
    family("eventsched_preemptions_total", "counter", "Jobs preempted for more urgent ones.",
           [("", {}, m["preemptions"])])
    family("eventsched_user_idle_gpu_seconds_total", "counter",
           "GPU time held while idle (share x seconds) per user.",
           [("", {"user": r["user"] or ""}, float(r["idle_gpu_hours"]) * 3600.0)
            for r in m["idle_gpu_hours"]])
    fc = m["forecasts"]
    if fc["count"]:
        family("eventsched_forecast_abs_error_seconds", "gauge",
               "Mean absolute error of the start forecasts shown, against the real starts.",
               [("", {}, float(fc["mean_abs_error_s"]))])
    family("eventsched_log_last_seq", "gauge", "Last log sequence included in these figures.", [("", {}, m["log_seq"])])
    return "\n".join(lines) + "\n"


def run_metrics(state_dir: str | os.PathLike[str], fmt: str = "table", *, out: TextIO | None = None,
                err: TextIO | None = None) -> int:
    """Print the metrics as a table, ``json`` or ``prometheus`` text; exit status."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        with History(state_dir) as history:
            m = compute_metrics(history)
    except Exception as e:  # the log's own errors (corruption) carry a user-facing message too
        if not isinstance(e, (HistoryError, OSError, duckdb.Error)) and not type(e).__module__.startswith("eventsched"):
            raise
        print_error(str(e), command="metrics", out=err)
        return 1
    if fmt == "json":
        print_json(m, out)
    else:
        out.write(prometheus_text(m) if fmt == "prometheus" else format_metrics(m) + "\n")
    return 0
