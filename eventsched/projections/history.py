"""The DuckDB read model: the whole event log folded into tables people query.

Schema and example queries: ``docs/history-schema.md``. Times are DOUBLE UNIX
seconds (like ``queue --json``); durations are seconds; views add DATE /
TIMESTAMP columns (UTC) where grouping by calendar time is the point.

Shape of the model
------------------
* *Raw tables* are appended to, column-wise, straight from the log's frames:
  ``job_events``, ``submissions``, ``placement_events`` (one row per GPU),
  ``gpu_samples``, ``gpu_events``, ``daemon_events``. They never change once
  written, which is what keeps catch-up a cheap bulk insert.
* *Derived tables* ``jobs``, ``placements`` and ``gpus`` are recomputed by SQL
  from the raw tables, but only for the jobs (or GPUs) touched by the events
  just ingested, so catch-up cost follows the new events, not the history.
* ``_position`` holds the last log sequence included; it is updated in the same
  transaction as the rows, so the file is always a fold of an exact log prefix.
* Catch-up turns each chunk of ~100k events into Arrow tables (one bulk
  conversion per event type, see "turning frames into columns") while a writer
  thread inserts the previous chunk; DuckDB scans Arrow without the GIL, so the
  two overlap on two cores.

Ownership and concurrency
-------------------------
DuckDB allows one read-write process per file, or many read-only ones. The file
``<state-dir>/history.duckdb`` belongs to nobody in particular: whoever wants a
current view (the ``sql`` command, ``metrics``, the daemon's metrics endpoint)
takes an exclusive ``flock`` on ``<state-dir>/history.lock``, opens the file
read-write, catches up from the log, closes it, then holds a *shared* flock
while it reads through a read-only connection. Readers therefore run side by
side; a writer waits for them. If the exclusive lock cannot be had in time
(readers keep it busy) and the file is behind the log, or the file is held by
a process outside this protocol, the reader copies the file (or, failing that,
nothing) into a private in-memory database and catches that up from the log:
always correct and current, only slower. No long-lived process keeps the file
open, so the daemon never blocks ``eventsched sql``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import gc
import itertools
import os
import re
import shlex
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import duckdb
import msgspec
import msgspec.inspect
import numpy as np
import pyarrow as pa

from eventsched.domain import events as ev
from eventsched.domain import paths
from eventsched.domain.states import FINAL

__all__ = [
    "History",
    "HistoryError",
    "open_history",
    "rebuild",
    "SCHEMA_VERSION",
    "TABLES",
    "VIEWS",
]

# 2: user-supplied numbers (retries) are BIGINT, so no value an old log holds breaks folding
SCHEMA_VERSION = 3
DB_NAME = "history.duckdb"
LOCK_NAME = "history.lock"
# Events turned into columns at a time during catch-up: big enough for
# columnar inserts to pay, small enough to bound memory on a huge log.
CHUNK_EVENTS = 100_000
# Events per transaction: the position is committed with the rows as always,
# only less often during a long catch-up (see _Writer).
COMMIT_EVENTS = 1_000_000
# Overlap column building with DuckDB inserts (see fold).
PIPELINE = True

FINAL_STATES = tuple(sorted(FINAL))  # for SQL text


class HistoryError(Exception):
    """A problem a user can act on (missing state dir, unreadable log)."""


# --- schema ---------------------------------------------------------------

_RAW_DDL = """
CREATE TABLE IF NOT EXISTS _position (seq BIGINT NOT NULL, ts DOUBLE, schema_version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS job_events (
    seq BIGINT, ts DOUBLE, job BIGINT, type VARCHAR, cause VARCHAR, detail VARCHAR,
    exit_code INTEGER, signal INTEGER, reason VARCHAR, outcome VARCHAR);
CREATE TABLE IF NOT EXISTS submissions (
    seq BIGINT, ts DOUBLE, job BIGINT, name VARCHAR, "user" VARCHAR, uid BIGINT, tenant VARCHAR,
    command VARCHAR, gpus DOUBLE, gpu_mem_mib BIGINT, allowed_gpu_ids VARCHAR, priority BIGINT,
    time_limit_s DOUBLE, on_time_limit VARCHAR, retries BIGINT, after VARCHAR, cwd VARCHAR,
    content_hash VARCHAR, node VARCHAR);
CREATE TABLE IF NOT EXISTS placement_events (
    seq BIGINT, ts DOUBLE, job BIGINT, node VARCHAR, gpu INTEGER, idx INTEGER, share DOUBLE,
    gpu_mem_mib BIGINT, policy VARCHAR);
CREATE TABLE IF NOT EXISTS gpu_samples (
    seq BIGINT, ts DOUBLE, node VARCHAR, gpu INTEGER, utilization DOUBLE, memory_used_mib BIGINT,
    memory_total_mib BIGINT, temperature_c DOUBLE, power_w DOUBLE, foreign_memory_mib BIGINT);
CREATE TABLE IF NOT EXISTS gpu_events (
    seq BIGINT, ts DOUBLE, node VARCHAR, gpu INTEGER, type VARCHAR, cause VARCHAR, uuid VARCHAR,
    model VARCHAR, memory_total_mib BIGINT, "by" VARCHAR, error VARCHAR, lost BOOLEAN);
CREATE TABLE IF NOT EXISTS daemon_events (
    seq BIGINT, ts DOUBLE, type VARCHAR, cause VARCHAR, node VARCHAR, detail VARCHAR);
CREATE TABLE IF NOT EXISTS jobs (
    id BIGINT, name VARCHAR, "user" VARCHAR, uid BIGINT, tenant VARCHAR, command VARCHAR,
    gpus DOUBLE, gpu_mem_mib BIGINT, priority BIGINT, state VARCHAR,
    submitted_at DOUBLE, first_started_at DOUBLE, started_at DOUBLE, ended_at DOUBLE,
    wait_s DOUBLE, run_s DOUBLE, turnaround_s DOUBLE, exit_code INTEGER, signal INTEGER,
    reason VARCHAR, node VARCHAR, gpu_ids INTEGER[], attempts INTEGER, last_seq BIGINT);
CREATE TABLE IF NOT EXISTS placements (
    job BIGINT, seq BIGINT, node VARCHAR, gpu INTEGER, share DOUBLE, gpu_mem_mib BIGINT,
    from_ts DOUBLE, to_ts DOUBLE);
CREATE TABLE IF NOT EXISTS gpus (
    node VARCHAR, gpu INTEGER, uuid VARCHAR, model VARCHAR, memory_total_mib BIGINT,
    discovered_at DOUBLE, paused BOOLEAN, lost BOOLEAN, last_error VARCHAR);
"""

_VIEWS_DDL = """
CREATE OR REPLACE VIEW job_times AS
SELECT id, name, "user", tenant, gpus, state, submitted_at, started_at, ended_at,
       wait_s, run_s, turnaround_s, attempts
FROM jobs;

-- every placement with an end: open placements count up to the last event
CREATE OR REPLACE VIEW placement_spans AS
SELECT p.job, j."user", j.tenant, p.node, p.gpu, p.share, p.gpu_mem_mib, p.from_ts,
       coalesce(p.to_ts, greatest(p.from_ts, (SELECT max(ts) FROM _position))) AS to_ts,
       p.to_ts IS NULL AS open,
       p.share * (coalesce(p.to_ts, greatest(p.from_ts, (SELECT max(ts) FROM _position))) - p.from_ts)
           / 3600.0 AS gpu_hours
FROM placements p LEFT JOIN jobs j ON j.id = p.job;

CREATE OR REPLACE VIEW gpu_hours_by_user AS
SELECT "user", sum(gpu_hours) AS gpu_hours, count(DISTINCT job) AS jobs
FROM placement_spans GROUP BY "user";

CREATE OR REPLACE VIEW gpu_hours_by_tenant AS
SELECT tenant, sum(gpu_hours) AS gpu_hours, count(DISTINCT job) AS jobs
FROM placement_spans GROUP BY tenant;

-- GPU-hours per UTC day, a placement spanning midnight split between days
CREATE OR REPLACE VIEW gpu_hours_daily AS
WITH d AS (
    SELECT "user", tenant, share, from_ts, to_ts,
           unnest(range(floor(from_ts / 86400)::BIGINT, floor(to_ts / 86400)::BIGINT + 1)) AS day_no
    FROM placement_spans)
SELECT (DATE '1970-01-01' + day_no::INTEGER) AS day, "user", tenant,
       sum(share * greatest(0, least(to_ts, (day_no + 1) * 86400.0) - greatest(from_ts, day_no * 86400.0)))
           / 3600.0 AS gpu_hours
FROM d GROUP BY ALL;

CREATE OR REPLACE VIEW gpu_utilization AS
SELECT node, gpu, make_timestamp((floor(ts / 60) * 60 * 1e6)::BIGINT) AS minute,
       count(*) AS samples, avg(utilization) AS utilization_mean, max(utilization) AS utilization_peak,
       avg(memory_used_mib) AS memory_used_mib_mean, max(memory_used_mib) AS memory_used_mib_peak,
       max(temperature_c) AS temperature_c_peak, avg(power_w) AS power_w_mean
FROM gpu_samples GROUP BY ALL;

CREATE OR REPLACE VIEW gpu_utilization_summary AS
SELECT node, gpu, count(*) AS samples, avg(utilization) AS utilization_mean,
       max(utilization) AS utilization_peak, avg(memory_used_mib) AS memory_used_mib_mean,
       max(memory_used_mib) AS memory_used_mib_peak, max(temperature_c) AS temperature_c_peak,
       min(ts) AS first_ts, max(ts) AS last_ts
FROM gpu_samples GROUP BY ALL;

CREATE OR REPLACE VIEW job_state_counts AS
SELECT state, count(*) AS jobs FROM jobs GROUP BY state;
"""

TABLES = (
    "jobs", "job_events", "submissions", "placements", "placement_events",
    "gpu_samples", "gpus", "gpu_events", "daemon_events", "_position",
)
VIEWS = (
    "job_times", "placement_spans", "gpu_hours_by_user", "gpu_hours_by_tenant",
    "gpu_hours_daily", "gpu_utilization", "gpu_utilization_summary", "job_state_counts",
)

# Jobs recomputed from the raw tables, for the ids in the registered `_touched`.
_JOBS_SQL = """
WITH ev AS (
    SELECT * FROM job_events WHERE job IN (SELECT job FROM _touched)
),
marks AS (
    SELECT *,
        max(CASE WHEN type = 'JobStarted' THEN seq END) OVER w AS last_start_seq,
        max(CASE WHEN type = 'JobCancelRequested' THEN seq END) OVER w AS last_cr_seq,
        last_value(CASE WHEN type = 'JobCancelRequested' THEN reason END IGNORE NULLS) OVER w AS last_cr_reason
    FROM ev
    WINDOW w AS (PARTITION BY job ORDER BY seq ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
),
st AS (
    SELECT *,
        CASE type
            WHEN 'JobSubmitted' THEN 'queued'
            WHEN 'JobPlaced' THEN 'running'
            WHEN 'JobStarted' THEN 'running'
            -- the core records the state an exit ends in (JobExited.outcome);
            -- only logs written before it was recorded fall back to the rule
            WHEN 'JobExited' THEN coalesce(nullif(outcome, ''), CASE
                WHEN reason = 'cancelled'
                     OR (coalesce(last_cr_seq, 0) > coalesce(last_start_seq, 0) AND last_cr_reason = 'cancelled')
                    THEN 'cancelled'
                WHEN reason = 'preempted'
                     OR (coalesce(last_cr_seq, 0) > coalesce(last_start_seq, 0) AND last_cr_reason = 'preempted')
                    THEN 'preempted'
                WHEN exit_code = 0 THEN 'succeeded'
                ELSE 'failed' END)
            WHEN 'JobCancelled' THEN 'cancelled'
            WHEN 'JobRequeued' THEN 'queued'
            WHEN 'JobHeld' THEN 'held'
            WHEN 'JobReleased' THEN 'queued'
            WHEN 'JobLost' THEN 'lost'
        END AS state_after
    FROM marks
),
runs AS (
    -- one row per attempt: a JobStarted and the JobExited / JobLost that ended it
    SELECT job, sum(next_ts - ts) AS run_s
    FROM (
        SELECT job, type, ts,
               lead(ts) OVER (PARTITION BY job ORDER BY seq) AS next_ts,
               lead(type) OVER (PARTITION BY job ORDER BY seq) AS next_type
        FROM ev WHERE type IN ('JobStarted', 'JobExited', 'JobLost'))
    WHERE type = 'JobStarted' AND next_type IN ('JobExited', 'JobLost')
    GROUP BY job
),
agg AS (
    SELECT job,
        arg_max(state_after, seq) FILTER (WHERE state_after IS NOT NULL) AS state,
        max(ts) FILTER (WHERE state_after IS NOT NULL) AS state_ts,
        min(ts) FILTER (WHERE type = 'JobSubmitted') AS submitted_at,
        min(ts) FILTER (WHERE type = 'JobStarted') AS first_started_at,
        max(ts) FILTER (WHERE type = 'JobStarted') AS started_at,
        arg_max({'code': exit_code, 'sig': signal, 'reason': reason}, seq)
            FILTER (WHERE type = 'JobExited') AS last_exit,
        arg_max(reason, seq) FILTER (WHERE state_after IS NOT NULL) AS last_reason,
        count(*) FILTER (WHERE type = 'JobStarted') AS attempts,
        max(seq) AS last_seq
    FROM st GROUP BY job
),
last_place AS (
    SELECT job, arg_max(node, seq) AS node, max(seq) AS seq
    FROM placement_events WHERE job IN (SELECT job FROM _touched) GROUP BY job
),
place_ids AS (
    SELECT p.job, list(p.gpu ORDER BY p.idx) AS gpu_ids
    FROM placement_events p JOIN last_place l ON p.job = l.job AND p.seq = l.seq
    GROUP BY p.job
)
SELECT a.job AS id, s.name, s."user", s.uid, s.tenant, s.command, s.gpus, s.gpu_mem_mib, s.priority,
    a.state, a.submitted_at, a.first_started_at, a.started_at,
    CASE WHEN a.state IN ('succeeded', 'failed', 'cancelled', 'lost') THEN a.state_ts END AS ended_at,
    a.first_started_at - a.submitted_at AS wait_s,
    r.run_s,
    CASE WHEN a.state IN ('succeeded', 'failed', 'cancelled', 'lost') THEN a.state_ts - a.submitted_at END
        AS turnaround_s,
    CASE WHEN a.state IN ('succeeded', 'failed', 'cancelled') THEN a.last_exit.code END AS exit_code,
    CASE WHEN a.state IN ('succeeded', 'failed', 'cancelled') THEN a.last_exit.sig END AS signal,
    nullif(CASE WHEN a.state IN ('succeeded', 'failed', 'cancelled', 'preempted')
         THEN coalesce(nullif(a.last_exit.reason, ''), a.last_reason)
         ELSE a.last_reason END, '') AS reason,
    CASE WHEN a.state IN ('queued', 'held') THEN NULL ELSE l.node END AS node,
    CASE WHEN a.state IN ('queued', 'held') OR pi.gpu_ids IS NULL THEN []::INTEGER[] ELSE pi.gpu_ids END
        AS gpu_ids,
    a.attempts::INTEGER AS attempts, a.last_seq
FROM agg a
LEFT JOIN submissions s ON s.job = a.job
LEFT JOIN runs r ON r.job = a.job
LEFT JOIN last_place l ON l.job = a.job
LEFT JOIN place_ids pi ON pi.job = a.job
"""

# A placement holds its GPU share from JobPlaced to the first event that ends
# the attempt (exit, cancel of a not-yet-started job, requeue, loss).
_PLACEMENTS_SQL = """
WITH ends AS (
    SELECT job, seq, ts FROM job_events
    WHERE job IN (SELECT job FROM _touched)
      AND type IN ('JobExited', 'JobCancelled', 'JobRequeued', 'JobLost')
),
p AS (SELECT * FROM placement_events WHERE job IN (SELECT job FROM _touched))
SELECT p.job, p.seq, p.node, p.gpu, p.share, p.gpu_mem_mib, p.ts AS from_ts, e.ts AS to_ts
FROM p ASOF LEFT JOIN ends e ON p.job = e.job AND p.seq < e.seq
"""

_GPUS_SQL = """
WITH g AS (SELECT * FROM gpu_events)
SELECT node, gpu,
    arg_max(uuid, seq) FILTER (WHERE type = 'GpuDiscovered') AS uuid,
    arg_max(model, seq) FILTER (WHERE type = 'GpuDiscovered') AS model,
    arg_max(memory_total_mib, seq) FILTER (WHERE type = 'GpuDiscovered') AS memory_total_mib,
    min(ts) FILTER (WHERE type = 'GpuDiscovered') AS discovered_at,
    coalesce(arg_max(type = 'GpuPaused', seq) FILTER (WHERE type IN ('GpuPaused', 'GpuResumed')), false)
        AS paused,
    coalesce(arg_max(lost AND type = 'GpuErrored', seq)
        FILTER (WHERE type = 'GpuDiscovered' OR (type = 'GpuErrored' AND lost)), false) AS lost,
    arg_max(error, seq) FILTER (WHERE type = 'GpuErrored') AS last_error
FROM g WHERE gpu >= 0 GROUP BY node, gpu
"""


# --- turning frames into columns -------------------------------------------
#
# Per event, Python touches each object once: ``msgspec.structs.astuple`` (C)
# turns a struct into a tuple and numpy converts a whole bucket of tuples into
# a record array in one call. Every column is then a numpy array DuckDB scans
# directly (numbers without the GIL); constant columns (an event's type name,
# NULLs) are SQL literals rather than arrays of the same Python object.


_UNSAFE = re.compile(r"[^\w@%+=:,./ -]", re.ASCII).search


def _command(argv: list[str]) -> str:
    """shlex.join, without quoting each word when no word needs it (the common case)."""
    plain = " ".join(argv)
    if _UNSAFE(plain) is None and plain.count(" ") == len(argv) - 1 and all(argv):
        return plain
    return shlex.join(argv)


def _ids(ids: list[int] | None) -> str | None:
    return None if ids is None else ",".join(map(str, ids))


def _obj(values: list[Any]) -> np.ndarray:
    # object arrays keep None as NULL for integers and strings alike
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


# A column is a numpy array, or a SQL expression (a str) for a constant one.
Columns = dict[str, "np.ndarray | str"]

_NUMPY_TYPE = {msgspec.inspect.IntType: "i8", msgspec.inspect.FloatType: "f8", msgspec.inspect.BoolType: "?"}


@functools.cache
def _record_type(cls: type) -> np.dtype:
    """One numpy field per struct field; strings, lists and optionals stay objects."""
    fields = msgspec.inspect.type_info(cls).fields  # type: ignore[attr-defined]
    return np.dtype([(f.name, _NUMPY_TYPE.get(type(f.type), "O")) for f in fields])


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _clamped(row: tuple[Any, ...], dtype: np.dtype) -> tuple[Any, ...]:
    """``row`` with integers outside int64 clamped into it (int64 fields only)."""
    return tuple(
        min(max(v, _INT64_MIN), _INT64_MAX) if dtype[i].kind == "i" and isinstance(v, int) else v
        for i, v in enumerate(row)
    )


def _records(structs: list[Any]) -> np.ndarray:
    """A record array of same-typed structs, in the structs' field order.

    The log may hold integers beyond int64 (msgspec decodes up to 2**64 - 1,
    and old logs predate the submission bounds): those are clamped, so one
    absurd number costs its own precision, never the whole read model.
    """
    struct_type: type = type(structs[0])  # classes are hashable: the lru_cache key
    dtype = _record_type(struct_type)
    rows = list(map(msgspec.structs.astuple, structs))
    try:
        return np.array(rows, dtype=dtype)
    except OverflowError:
        return np.array([_clamped(row, dtype) for row in rows], dtype=dtype)


class _Chunk:
    """Events of several frames, bucketed by type, turned into column sets."""

    def __init__(self) -> None:
        self.buckets: dict[type, list[ev.Event]] = {}
        self.count = 0
        self.last_seq = 0
        self.last_ts: float | None = None

    def add(self, batch: list[ev.Event]) -> None:
        buckets = self.buckets
        for e in batch:
            t = type(e)
            b = buckets.get(t)
            if b is None:
                buckets[t] = b = []
            b.append(e)
        self.count += len(batch)
        self.last_seq = batch[-1].seq
        self.last_ts = batch[-1].ts if self.last_ts is None else max(self.last_ts, batch[-1].ts)

    def inserts(self) -> tuple[list[tuple[str, Columns]], np.ndarray]:
        """(table, columns) to append, and the ids of the jobs they touch."""
        out: list[tuple[str, Columns]] = []
        jobs: list[np.ndarray] = []
        for t, events in self.buckets.items():
            builder = _BUILDERS.get(t)
            if builder is None:
                continue  # an event kind this model does not fold
            if t in _JOB_DETAIL:
                rec = _records(events)
                jobs.append(rec["job"])
                out.extend(builder(events, rec))
            else:
                out.extend(builder(events, None))
        touched = np.unique(np.concatenate(jobs)) if jobs else np.empty(0, dtype=np.int64)
        return out, touched

    def touches_gpus(self) -> bool:
        return any(t in _GPU_EVENTS for t in self.buckets)


def _exit_detail(e: ev.JobExited) -> str:
    what = f"signal={e.signal}" if e.exit_code is None else f"exit_code={e.exit_code}"
    return f"{what} reason={e.reason}" if e.reason else what


_JOB_DETAIL: dict[type, Callable[[Any], str]] = {
    ev.JobSubmitted: lambda e: f"user={e.spec.user} gpus={e.spec.gpus:g} priority={e.spec.priority}",
    ev.JobPlaced: lambda e: f"node={e.node} gpu_ids={_ids(e.gpu_ids)} share={e.share:g}",
    ev.JobStarted: lambda e: f"pid={e.pid}",
    ev.JobExited: _exit_detail,
    ev.JobCancelRequested: lambda e: f"by={e.by} reason={e.reason}",
    ev.JobCancelled: lambda e: f"by={e.by}",
    ev.JobRequeued: lambda e: f"reason={e.reason} not_before={e.not_before:g}",
    ev.JobHeld: lambda e: f"by={e.by}",
    ev.JobReleased: lambda e: f"by={e.by}",
    ev.JobLost: lambda e: f"reason={e.reason}",
}


def _job_event_cols(events: list[Any], rec: np.ndarray) -> Columns:
    t = type(events[0])
    names = rec.dtype.names or ()  # a record dtype always has names
    return {
        "seq": rec["seq"], "ts": rec["ts"], "job": rec["job"],
        "type": f"'{t.__name__}'",
        "cause": rec["cause"],
        "detail": _obj(list(map(_JOB_DETAIL[t], events))),
        "exit_code": rec["exit_code"] if "exit_code" in names else "NULL",
        "signal": rec["signal"] if "signal" in names else "NULL",
        "reason": rec["reason"] if "reason" in names else "NULL",
        # the state an exit ended in, as the core decided it (states.exit_outcome)
        "outcome": rec["outcome"] if "outcome" in names else "NULL",
    }


def _build_job(events: list[Any], rec: np.ndarray) -> Iterable[tuple[str, Columns]]:
    yield "job_events", _job_event_cols(events, rec)


def _build_submitted(events: list[ev.JobSubmitted], rec: np.ndarray) -> Iterable[tuple[str, Columns]]:
    yield "job_events", _job_event_cols(events, rec)
    specs = rec["spec"].tolist()
    s = _records(specs)
    yield "submissions", {
        "seq": rec["seq"], "ts": rec["ts"], "job": rec["job"],
        "name": s["name"], "user": s["user"], "uid": s["uid"], "tenant": s["tenant"],
        "command": _obj([_command(argv) for argv in s["command"].tolist()]),
        "gpus": s["gpus"], "gpu_mem_mib": s["gpu_mem_mib"],
        "allowed_gpu_ids": _obj([_ids(ids) for ids in s["gpu_ids"].tolist()]),
        "priority": s["priority"], "time_limit_s": s["time_limit_s"], "on_time_limit": s["on_time_limit"],
        "retries": s["retries"],
        "after": _obj([_ids(after) or None for after in s["after"].tolist()]),
        "cwd": s["cwd"], "content_hash": s["content_hash"], "node": s["node"],
    }


def _build_placed(events: list[ev.JobPlaced], rec: np.ndarray) -> Iterable[tuple[str, Columns]]:
    yield "job_events", _job_event_cols(events, rec)
    # one row per GPU of the placement, idx keeping CUDA_VISIBLE_DEVICES order
    gpu_ids = rec["gpu_ids"].tolist()
    counts = np.fromiter(map(len, gpu_ids), dtype=np.int64, count=len(gpu_ids))
    rows = np.repeat(np.arange(len(gpu_ids)), counts)  # event of each row
    first_row = np.cumsum(counts) - counts
    yield "placement_events", {
        "seq": rec["seq"][rows], "ts": rec["ts"][rows], "job": rec["job"][rows], "node": rec["node"][rows],
        "gpu": np.fromiter(itertools.chain.from_iterable(gpu_ids), dtype=np.int64, count=len(rows)),
        "idx": np.arange(len(rows)) - first_row[rows],
        "share": rec["share"][rows], "gpu_mem_mib": rec["gpu_mem_mib"][rows], "policy": rec["policy"][rows],
    }


def _build_sampled(events: list[ev.GpuSampled], rec: None) -> Iterable[tuple[str, Columns]]:
    r = _records(events)
    yield "gpu_samples", {name: r[name] for name in (
        "seq", "ts", "node", "gpu", "utilization", "memory_used_mib", "memory_total_mib", "temperature_c",
        "power_w", "foreign_memory_mib")}


_GPU_EVENTS = (ev.GpuDiscovered, ev.GpuPaused, ev.GpuResumed, ev.GpuErrored)


def _common(events: list[ev.Event]) -> Columns:
    return {
        "seq": np.fromiter((e.seq for e in events), dtype=np.int64, count=len(events)),
        "ts": np.fromiter((e.ts for e in events), dtype=np.float64, count=len(events)),
    }


# GPU and daemon events are few: plain attribute access is fast enough.
def _build_gpu_event(events: list[Any], rec: None) -> Iterable[tuple[str, Columns]]:
    n = len(events)
    cols = _common(events)
    cols["node"] = _obj([e.node for e in events])
    cols["gpu"] = np.fromiter((e.gpu for e in events), dtype=np.int64, count=n)
    cols["type"] = _obj([type(e).__name__ for e in events])
    cols["cause"] = _obj([e.cause for e in events])
    cols["uuid"] = _obj([getattr(e, "uuid", None) for e in events])
    cols["model"] = _obj([getattr(e, "model", None) for e in events])
    cols["memory_total_mib"] = _obj([getattr(e, "memory_total_mib", None) for e in events])
    cols["by"] = _obj([getattr(e, "by", None) for e in events])
    cols["error"] = _obj([getattr(e, "error", None) for e in events])
    cols["lost"] = _obj([getattr(e, "lost", None) for e in events])
    yield "gpu_events", cols


def _daemon_detail(e: Any) -> str:
    if isinstance(e, ev.DaemonStarted):
        return f"pid={e.pid} version={e.version} policy={e.policy} gpus={e.gpu_backend}"
    if isinstance(e, ev.DaemonStopped):
        return f"reason={e.reason}"
    return f"policy={e.policy} by={e.by}"


def _build_daemon(events: list[Any], rec: None) -> Iterable[tuple[str, Columns]]:
    cols = _common(events)
    cols["type"] = _obj([type(e).__name__ for e in events])
    cols["cause"] = _obj([e.cause for e in events])
    cols["node"] = _obj([getattr(e, "node", None) for e in events])
    cols["detail"] = _obj([_daemon_detail(e) for e in events])
    yield "daemon_events", cols


# type -> builder(events, record array of them for job events, else None)
_BUILDERS: dict[type, Callable[[Any, Any], Iterable[tuple[str, Columns]]]] = {
    ev.JobSubmitted: _build_submitted,
    ev.JobPlaced: _build_placed,
    ev.GpuSampled: _build_sampled,
    **{t: _build_job for t in _JOB_DETAIL if t not in (ev.JobSubmitted, ev.JobPlaced)},
    **{t: _build_gpu_event for t in _GPU_EVENTS},
    ev.DaemonStarted: _build_daemon,
    ev.DaemonStopped: _build_daemon,
    ev.PolicyChanged: _build_daemon,
}


# --- folding into a connection ---------------------------------------------


def _schema_version(con: duckdb.DuckDBPyConnection) -> int | None:
    try:
        row = con.execute("SELECT schema_version FROM _position").fetchone()
    except duckdb.CatalogException:
        return None
    return None if row is None else int(row[0])


def ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create (or, after a schema change, recreate) tables and views."""
    version = _schema_version(con)
    if version == SCHEMA_VERSION:
        return  # DDL commits to the catalog: skip it on every routine catch-up
    if version is not None:
        for view in VIEWS:
            con.execute(f"DROP VIEW IF EXISTS {view}")
        for table in TABLES:
            con.execute(f"DROP TABLE IF EXISTS {table}")
    con.execute(_RAW_DDL)
    con.execute("DELETE FROM _position")
    con.execute("INSERT INTO _position VALUES (0, NULL, ?)", [SCHEMA_VERSION])
    con.execute(_VIEWS_DDL)


def position(con: duckdb.DuckDBPyConnection) -> int:
    row = con.execute("SELECT seq FROM _position").fetchone()
    return 0 if row is None else int(row[0])


class _Prepared(msgspec.Struct, frozen=True):
    """A chunk turned into Arrow tables: the writer runs no Python per event and,
    scanning Arrow rather than Python objects, mostly runs without the GIL."""

    inserts: list[tuple[str, pa.Table]]  # (INSERT ... SELECT ... FROM _chunk, its rows)
    touched: np.ndarray
    touches_gpus: bool
    last_seq: int
    last_ts: float | None
    count: int


def _insert(table: str, cols: Columns) -> tuple[str, pa.Table]:
    names = ", ".join(f'"{k}"' for k in cols)
    exprs = ", ".join(v if isinstance(v, str) else f'"{k}"' for k, v in cols.items())
    # from_pandas: None (and NaN) are NULL, as they were in the pandas frames this replaced
    # (a column of a record array is strided: numpy copies it faster than Arrow does)
    rows = pa.table({k: pa.array(np.ascontiguousarray(v), from_pandas=True)
                     for k, v in cols.items() if not isinstance(v, str)})
    return f"INSERT INTO {table} ({names}) SELECT {exprs} FROM _chunk", rows


def _prepare(chunk: _Chunk) -> _Prepared:
    inserts, touched = chunk.inserts()
    return _Prepared([_insert(table, cols) for table, cols in inserts], touched, chunk.touches_gpus(),
                     chunk.last_seq, chunk.last_ts, chunk.count)


class _Writer:
    """Appends prepared chunks to the raw tables, COMMIT_EVENTS events per transaction.

    The derived tables are refreshed once per transaction, for every job its
    chunks touched, just before the commit that also records the position: a
    job spanning several chunks is recomputed once, and big transactions let
    DuckDB write whole row groups to the file instead of through its WAL.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self.con = con
        self.in_transaction = False
        self.uncommitted = 0
        self.committed = 0  # events, over all transactions
        self.touched: list[np.ndarray] = []
        self.touches_gpus = False
        self.last_seq = 0
        self.last_ts: float | None = None

    def append(self, chunk: _Prepared) -> None:
        con = self.con
        if not self.in_transaction:
            con.begin()
            self.in_transaction = True
        for sql, rows in chunk.inserts:
            con.register("_chunk", rows)
            con.execute(sql)
            con.unregister("_chunk")
        if len(chunk.touched):
            self.touched.append(chunk.touched)
        self.touches_gpus |= chunk.touches_gpus
        self.last_seq = chunk.last_seq
        if chunk.last_ts is not None:
            self.last_ts = chunk.last_ts if self.last_ts is None else max(self.last_ts, chunk.last_ts)
        self.uncommitted += chunk.count
        if self.uncommitted >= COMMIT_EVENTS:
            self.commit()

    def commit(self) -> None:
        """Refresh what the open transaction touched, record the position, commit."""
        if not self.in_transaction:
            return
        con = self.con
        if self.touched:
            touched = np.unique(np.concatenate(self.touched))
            con.register("_touched", {"job": touched})
            con.execute("DELETE FROM jobs WHERE id IN (SELECT job FROM _touched)")
            con.execute("INSERT INTO jobs " + _JOBS_SQL)
            con.execute("DELETE FROM placements WHERE job IN (SELECT job FROM _touched)")
            con.execute("INSERT INTO placements " + _PLACEMENTS_SQL)
            con.unregister("_touched")
        if self.touches_gpus:
            con.execute("DELETE FROM gpus")
            con.execute("INSERT INTO gpus " + _GPUS_SQL)
        con.execute(
            "UPDATE _position SET seq = ?, ts = greatest(coalesce(ts, ?), ?)",
            [self.last_seq, self.last_ts, self.last_ts],
        )
        con.commit()
        self.committed += self.uncommitted
        self.in_transaction = False
        self.uncommitted = 0
        self.touched = []
        self.touches_gpus = False
        self.last_ts = None

    def rollback(self) -> None:
        if self.in_transaction:
            self.in_transaction = False
            self.con.rollback()


def fold(con: duckdb.DuckDBPyConnection, batches: Iterable[list[ev.Event]], after_seq: int) -> int:
    """Fold frames (events with seq > after_seq) into the model; returns events added.

    Decoding and column building (Python, holds the GIL) overlap with the
    previous chunk's inserts (DuckDB on Arrow tables, releases it) in one
    writer thread. On an error the open transaction is rolled back: the model
    stays the fold of the prefix committed before it.
    """
    chunk = _Chunk()
    writer = _Writer(con)
    pending: Future[None] | None = None
    # The decoded events are acyclic and short-lived: the cyclic GC only
    # burns time rescanning them (halves decoding time, see bench/).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="history-fold") as pool:
            try:
                for batch in batches:
                    if batch and batch[0].seq <= after_seq:
                        batch = [e for e in batch if e.seq > after_seq]
                    if not batch:
                        continue
                    chunk.add(batch)
                    if chunk.count >= CHUNK_EVENTS:
                        prepared = _prepare(chunk)
                        chunk = _Chunk()
                        if pending is not None:
                            pending.result()
                        pending = pool.submit(writer.append, prepared)
                        if not PIPELINE:
                            pending.result()
                            pending = None
                if chunk.count:
                    prepared = _prepare(chunk)
                    if pending is not None:
                        pending.result()
                    pending = pool.submit(writer.append, prepared)
                if pending is not None:
                    pending.result()
                    pending = None
                pool.submit(writer.commit).result()
            except BaseException:
                if pending is not None:
                    with contextlib.suppress(BaseException):
                        pending.result()
                pool.submit(writer.rollback).result()
                raise
    finally:
        if was_enabled:
            gc.enable()
    return writer.committed


# --- the log ----------------------------------------------------------------


def _log_batches(log_dir: Path, from_seq: int) -> Iterator[list[ev.Event]]:
    if not log_dir.is_dir():
        return iter(())
    from eventsched.storage import log  # the log module is optional at import time

    return log.read_batches(log_dir, from_seq=from_seq)


def _log_last_seq(log_dir: Path) -> int:
    if not log_dir.is_dir():
        return 0
    from eventsched.storage import log

    return int(log.last_seq(log_dir))


# --- locking ----------------------------------------------------------------


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
    """Make a file we own 0600 (an earlier version left it 0644 or 0666)."""
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
    """Create an empty database file at ``db_path`` with mode 0600.

    DuckDB creates files with the process umask and refuses an empty file,
    so it is created in a 0700 folder beside it, made 0600 and renamed into
    place: no other user ever sees it with a looser mode.
    """
    import tempfile

    folder = tempfile.mkdtemp(prefix=".history-new-", dir=db_path.parent)
    try:
        tmp = Path(folder) / db_path.name
        con = duckdb.connect(str(tmp))
        try:
            ensure_schema(con)
        finally:
            con.close()
        os.chmod(tmp, 0o600)
        os.rename(tmp, db_path)
    finally:
        for leftover in Path(folder).glob("*"):
            leftover.unlink(missing_ok=True)
        os.rmdir(folder)


def _private_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        _private(fd)
    finally:
        os.close(fd)


def _is_lock_conflict(exc: duckdb.Error) -> bool:
    return isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower()


# --- the public face ----------------------------------------------------------


class History:
    """A handle on the read model of one state directory.

    It keeps no connection open between calls (see the module docstring), so
    a long-lived holder such as the daemon never blocks other readers.
    """

    def __init__(self, state_dir: str | os.PathLike[str], *, lock_timeout_s: float = 5.0,
                 in_memory: bool = False, write_wait_s: float | None = None) -> None:
        self.state_dir = Path(state_dir)
        if not self.state_dir.is_dir():
            raise HistoryError(f"no eventsched state directory at {self.state_dir}")
        self.log_dir = paths.log_dir(self.state_dir)
        self.db_path = self.state_dir / DB_NAME
        self.lock_path = self.state_dir / LOCK_NAME
        self.lock_timeout_s = lock_timeout_s
        # how long a reader waits to catch the file up before it reads a
        # private copy instead (default: lock_timeout_s)
        self.write_wait_s = lock_timeout_s if write_wait_s is None else write_wait_s
        self.force_memory = in_memory
        self._mem: duckdb.DuckDBPyConnection | None = None
        # how the last view was obtained: "file", "memory-copy" or "memory-log"
        self.last_mode = ""

    # -- writing

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
            try:
                return self._catch_up_file()
            except duckdb.Error as exc:
                if _is_lock_conflict(exc):
                    return 0  # held by a process outside the protocol
                raise
        finally:
            os.close(fd)  # closing releases the flock

    def _catch_up_file(self) -> int:
        if not self.db_path.exists():
            _create_private_db(self.db_path)
        else:
            _private_path(self.db_path)
        _private_path(self.db_path.with_name(self.db_path.name + ".wal"))
        con = duckdb.connect(str(self.db_path))
        try:
            ensure_schema(con)
            after = position(con)
            if after > _log_last_seq(self.log_dir):
                # The model read a tail that never became durable (a reader
                # can see a frame before its fdatasync) and a crash cut it
                # from the log: the log is the truth, so start again from it.
                con.close()
                for stale in (self.db_path, self.db_path.with_name(self.db_path.name + ".wal")):
                    stale.unlink(missing_ok=True)
                _create_private_db(self.db_path)
                con = duckdb.connect(str(self.db_path))
                ensure_schema(con)
                after = 0
            return fold(con, _log_batches(self.log_dir, after + 1), after)
        finally:
            con.close()

    def _catch_up_memory(self) -> int:
        if self._mem is None:
            self._mem = duckdb.connect(":memory:")
            ensure_schema(self._mem)
        after = position(self._mem)
        return fold(self._mem, _log_batches(self.log_dir, after + 1), after)

    # -- reading

    @contextlib.contextmanager
    def reader(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection on a view that includes every event in the log now.

        Prefer ``query``; use this for several queries on one consistent view.
        Do not write through it (the file one is read-only anyway).
        """
        if self.force_memory:
            self._catch_up_memory()
            self.last_mode = "memory-log"
            yield self._mem  # type: ignore[misc]
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
        wrote = False
        if _flock(fd, fcntl.LOCK_EX, self.write_wait_s):
            try:
                self._catch_up_file()
                wrote = True
            except duckdb.Error as exc:
                if not _is_lock_conflict(exc):
                    raise
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
        if self._mem is None:
            self._replace_mem(None)
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
        for suffix in ("", ".wal"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(str(history.db_path) + suffix)
        return history._catch_up_file()
    finally:
        os.close(fd)
