"""Folding the log into the read model: each chunk of events becomes columns
per table, inserted in large transactions with the position they reach (the
file is always the fold of an exact prefix of the log). A writer thread
inserts one chunk while the next is converted."""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import shlex
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol

import duckdb
import msgspec
import msgspec.inspect
import numpy as np
import pyarrow as pa

from eventsched.domain import events as ev
from eventsched.projections import collector
from eventsched.projections.history_schema import (_GPUS_SQL, _JOBS_SQL, _PLACEMENTS_SQL, _RAW_DDL,
                                                   _VIEWS_DDL, SCHEMA_VERSION, TABLES, VIEWS)

__all__ = ["fold", "fold_chunks", "ensure_schema", "position"]

CHUNK_EVENTS = 100_000  # big enough for columnar inserts to pay, small enough to bound memory
COMMIT_EVENTS = 1_000_000  # per transaction (see _Writer)

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
    """An object array: it keeps None as NULL for integers and strings alike."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


# A column is a numpy array, an Arrow array (the raw-frame path, see
# history_frames), or a SQL expression (a str) for a constant one.
Columns = dict[str, "np.ndarray | pa.Array | str"]

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
    """A record array of same-typed structs (``astuple`` in C, one numpy call).
    Integers beyond int64 are clamped: one absurd number costs its own precision,
    not the read model."""
    struct_type: type = type(structs[0])  # annotated: mypy then sees it as the hashable cache key
    dtype = _record_type(struct_type)
    rows = list(map(msgspec.structs.astuple, structs))
    try:
        return np.array(rows, dtype=dtype)
    except OverflowError:
        return np.array([_clamped(row, dtype) for row in rows], dtype=dtype)


def _build(t: type, events: list[Any], jobs: list[np.ndarray]) -> list[tuple[str, Columns]]:
    """(table, columns) for same-typed events; the ids of the jobs among them go to ``jobs``."""
    if t in _JOB_DETAIL:
        rec = _records(events)
        jobs.append(rec["job"])
        more = _JOB_TABLES.get(t)
        return [("job_events", _job_event_cols(events, rec)), *(more(events, rec) if more else ())]
    builder = _BUILDERS.get(t)
    return [] if builder is None else list(builder(events))  # None: an event kind this model does not fold


def _touched(jobs: list[np.ndarray]) -> np.ndarray:
    return np.unique(np.concatenate(jobs)) if jobs else np.empty(0, dtype=np.int64)


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
        jobs: list[np.ndarray] = []
        out = [insert for t, events in self.buckets.items() for insert in _build(t, events, jobs)]
        return out, _touched(jobs)

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
    ev.JobCancelRequested: lambda e: f"by={e.by} reason={e.reason}" + (
        f" for_job={e.for_job} rule={e.rule}" if e.for_job else ""),
    ev.JobCancelled: lambda e: f"by={e.by}",
    ev.JobRequeued: lambda e: f"reason={e.reason} not_before={e.not_before:g}",
    ev.JobHeld: lambda e: f"by={e.by}",
    ev.JobReleased: lambda e: f"by={e.by}",
    ev.JobUpdated: lambda e: " ".join([f"by={e.by}", *(f"{k}={v!r}" for k, v in e.changes().items())]),
    ev.JobLost: lambda e: f"reason={e.reason}",
    # GPU memory against --gpu-mem, allocated but idle
    ev.JobGpuMemoryExceeded: lambda e: (f"node={e.node} gpu={e.gpu} used_mib={e.used_mib} "
                                        f"request_mib={e.request_mib} policy={e.policy}"),
    ev.JobGpuMemoryWithin: lambda e: f"used_mib={e.used_mib}",
    ev.JobIdle: lambda e: f"since={e.since!r}",
    ev.JobBusy: lambda e: f"idle_s={e.idle_s!r}",
}


def _job_event_cols(events: list[Any], rec: np.ndarray) -> Columns:
    t = type(events[0])
    names = rec.dtype.names or ()  # a record dtype always has names
    return {
        "seq": rec["seq"], "ts": rec["ts"], "job": rec["job"],
        "type": f"'{t.__name__}'",
        "cause": rec["cause"],
        "detail": _obj(list(map(_JOB_DETAIL[t], events))),
        # outcome: the state an exit ended in, as the core decided it (states.exit_outcome)
        **{k: rec[k] if k in names else "NULL" for k in ("exit_code", "signal", "reason", "outcome")},
    }


def _build_submitted(events: list[ev.JobSubmitted], rec: np.ndarray) -> Iterable[tuple[str, Columns]]:
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


def _build_updated(events: list[ev.JobUpdated], rec: np.ndarray) -> Iterable[tuple[str, Columns]]:
    yield "job_updates", {name: rec[name] for name in ("seq", "ts", "job", "by", *ev.UPDATABLE)}


def _cols(rows: list[tuple[Any, ...]], **kinds: str) -> Columns:
    """Columns named by ``kinds`` (name -> "i8", "f8" or "O") from ``rows`` of values in that order."""
    return {name: _obj(list(values)) if kind == "O" else np.array(values, dtype=kind)
            for (name, kind), values in zip(kinds.items(), zip(*rows))}


def _build_sampled(events: list[ev.GpuSampled]) -> Iterable[tuple[str, Columns]]:
    r = _records(events)
    yield "gpu_samples", {name: r[name] for name in (
        "seq", "ts", "node", "gpu", "utilization", "memory_used_mib", "memory_total_mib", "temperature_c",
        "power_w", "foreign_memory_mib")}
    held = [(e.seq, e.ts, e.node, e.gpu, job, mib) for e in events for job, mib in e.job_memory_mib.items()]
    if held:  # one row per job on the GPU
        yield "job_gpu_memory", _cols(held, seq="i8", ts="f8", node="O", gpu="i8", job="i8", memory_mib="i8")


_GPU_EVENTS = (ev.GpuDiscovered, ev.GpuPaused, ev.GpuResumed, ev.GpuErrored)
_GPU_OPTIONAL = ("uuid", "model", "memory_total_mib", "by", "error", "lost")  # None where a type has none


def _build_gpu_event(events: list[Any]) -> Iterable[tuple[str, Columns]]:
    rows = [(e.seq, e.ts, e.node, e.gpu, type(e).__name__, e.cause, *(getattr(e, k, None) for k in _GPU_OPTIONAL))
            for e in events]
    yield "gpu_events", _cols(rows, seq="i8", ts="f8", node="O", gpu="i8", type="O", cause="O",
                              **dict.fromkeys(_GPU_OPTIONAL, "O"))


_DAEMON_DETAIL: dict[type, Callable[[Any], str]] = {
    ev.DaemonStarted: lambda e: f"pid={e.pid} version={e.version} policy={e.policy} gpus={e.gpu_backend}",
    ev.DaemonStopped: lambda e: f"reason={e.reason}",
    ev.PolicyChanged: lambda e: f"policy={e.policy} by={e.by}",
    ev.NodeJoined: lambda e: f"ray_node={e.ray_node} gpus={e.gpus} backend={e.gpu_backend}",
    ev.NodeLeft: lambda e: f"reason={e.reason}",
    ev.NodeActorRestarted: lambda e: f"reason={e.reason}",
    ev.ClusterDisconnected: lambda e: f"lost={str(e.lost).lower()} reason={e.reason}",
    ev.StrayAttemptKilled: lambda e: f"job={e.job} attempt={e.attempt} pid={e.pid} reason={e.reason}",
    ev.NodeFenced: lambda e: f"jobs={_ids(e.jobs)} attempts={_ids(e.attempts)} reason={e.reason}",
}


def _build_daemon(events: list[Any]) -> Iterable[tuple[str, Columns]]:
    rows = [(e.seq, e.ts, type(e).__name__, e.cause, getattr(e, "node", None), _DAEMON_DETAIL[type(e)](e))
            for e in events]
    yield "daemon_events", _cols(rows, seq="i8", ts="f8", type="O", cause="O", node="O", detail="O")


def _build_tenants(events: list[Any]) -> Iterable[tuple[str, Columns]]:
    """One row per tenant per configuration (a removed tenant is absent from
    the configurations after it)."""
    rows = [(e.seq, e.ts, name, ",".join(t.users), t.gpus, t.gpu_mem_mib, t.jobs, t.weight, t.preemptible, e.by)
            for e in events for name, t in sorted(e.tenants.items())]
    if rows:
        yield "tenant_configs", _cols(rows, seq="i8", ts="f8", tenant="O", users="O", gpus="O", gpu_mem_mib="O",
                                      jobs="O", weight="f8", preemptible="O", by="O")


def _build_forecasts(events: list[Any]) -> Iterable[tuple[str, Columns]]:
    # p10 and p90 are None for a forecast recorded without a range: NaN, then NULL
    rows = [(e.seq, e.ts, e.job, e.estimated_start, e.by, e.p10, e.p90) for e in events]
    yield "forecasts", _cols(rows, seq="i8", ts="f8", job="i8", estimated_start="f8", by="O", p10="f8", p90="f8")


# job event type -> builder(events, their record array) of its tables besides job_events
_JOB_TABLES: dict[type, Callable[[Any, np.ndarray], Iterable[tuple[str, Columns]]]] = {
    ev.JobSubmitted: _build_submitted,
    ev.JobPlaced: _build_placed,
    ev.JobUpdated: _build_updated,
}
# other event type -> builder(events)
_BUILDERS: dict[type, Callable[[Any], Iterable[tuple[str, Columns]]]] = {
    ev.GpuSampled: _build_sampled,
    **{t: _build_gpu_event for t in _GPU_EVENTS},
    **{t: _build_daemon for t in _DAEMON_DETAIL},
    ev.TenantsConfigured: _build_tenants,
    ev.JobForecast: _build_forecasts,
}


def ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create (or, after a schema change, recreate) tables and views."""
    try:
        row = con.execute("SELECT schema_version FROM _position").fetchone()
    except duckdb.CatalogException:
        row = None
    if row is not None and row[0] == SCHEMA_VERSION:
        return  # DDL commits to the catalog: skip it on every routine catch-up
    if row is not None:
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
    """A chunk as Arrow tables: the writer scans them mostly without the GIL."""

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
    rows = pa.table({k: v if isinstance(v, pa.Array) else pa.array(np.ascontiguousarray(v), from_pandas=True)
                     for k, v in cols.items() if not isinstance(v, str)})
    return f"INSERT INTO {table} ({names}) SELECT {exprs} FROM _chunk", rows


def _prepare(chunk: _Events) -> _Prepared:
    inserts, touched = chunk.inserts()
    return _Prepared([_insert(table, cols) for table, cols in inserts], touched, chunk.touches_gpus(),
                     chunk.last_seq, chunk.last_ts, chunk.count)


class _Writer:
    """Appends prepared chunks, COMMIT_EVENTS events per transaction (whole row
    groups, not the WAL); the derived tables are refreshed for the jobs touched
    before the commit that records the position. ``refresh_each_chunk``
    refreshes after each chunk instead, overlapping the next conversion: a job's
    rows depend on its own events alone, so the last refresh leaves the same.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, refresh_each_chunk: bool = False) -> None:
        self.con = con
        self.refresh_each_chunk = refresh_each_chunk
        self.touched: list[np.ndarray] = []
        self.in_transaction = False
        self.uncommitted = 0
        self.committed = 0  # events, over all transactions
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
            if self.refresh_each_chunk:
                self._refresh_jobs(chunk.touched)
            else:
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
            self._refresh_jobs(_touched(self.touched))
        if self.touches_gpus:
            con.execute("DELETE FROM gpus")
            con.execute("INSERT INTO gpus " + _GPUS_SQL)
        con.execute(
            "UPDATE _position SET seq = ?, ts = greatest(coalesce(ts, ?), ?)",
            [self.last_seq, self.last_ts, self.last_ts],
        )
        con.commit()
        self.committed += self.uncommitted
        self.in_transaction, self.uncommitted, self.touched, self.touches_gpus, self.last_ts = False, 0, [], False, None

    def _refresh_jobs(self, touched: np.ndarray) -> None:
        con = self.con
        con.register("_touched", {"job": touched})
        con.execute("DELETE FROM jobs WHERE id IN (SELECT job FROM _touched)")
        con.execute("INSERT INTO jobs " + _JOBS_SQL)
        con.execute("DELETE FROM placements WHERE job IN (SELECT job FROM _touched)")
        con.execute("INSERT INTO placements " + _PLACEMENTS_SQL)
        con.unregister("_touched")

    def rollback(self) -> None:
        if self.in_transaction:
            self.in_transaction = False
            self.con.rollback()


class _Events(Protocol):
    """A chunk of events ready to become columns (``_Chunk``, history_frames' ``FrameChunk``)."""

    count: int
    last_seq: int
    last_ts: float | None

    def inserts(self) -> tuple[list[tuple[str, Columns]], np.ndarray]: ...

    def touches_gpus(self) -> bool: ...


def fold(con: duckdb.DuckDBPyConnection, batches: Iterable[list[ev.Event]], after_seq: int) -> int:
    """Fold frames (events with seq > after_seq) into the model; returns events
    added. On an error the open transaction is rolled back."""
    return fold_chunks(con, _chunks(batches, after_seq))


def _chunks(batches: Iterable[list[ev.Event]], after_seq: int) -> Iterable[_Chunk]:
    """Decoded frames in chunks of at least CHUNK_EVENTS events (the last one fewer)."""
    chunk = _Chunk()
    for batch in batches:
        if batch and batch[0].seq <= after_seq:
            batch = [e for e in batch if e.seq > after_seq]
        if not batch:
            continue
        chunk.add(batch)
        if chunk.count >= CHUNK_EVENTS:
            yield chunk
            chunk = _Chunk()
    if chunk.count:
        yield chunk


@contextlib.contextmanager
def _threads(con: duckdb.DuckDBPyConnection, n: int | None) -> Iterator[None]:
    """DuckDB's worker threads set to ``n`` for a while (a database-wide setting; None: as they are)."""
    row = None if n is None else con.execute("SELECT current_setting('threads')").fetchone()
    before = int(row[0]) if row else n
    if n is None or before == n:
        yield
        return
    con.execute(f"SET threads = {int(n)}")
    try:
        yield
    finally:
        con.execute(f"SET threads = {before}")


def fold_chunks(con: duckdb.DuckDBPyConnection, chunks: Iterable[_Events], *, refresh_each_chunk: bool = False,
                threads: int | None = None) -> int:
    """Insert chunks as they come (see ``fold``); ``threads``: DuckDB's meanwhile."""
    writer = _Writer(con, refresh_each_chunk)
    pending: Future[None] | None = None
    # the decoded events are acyclic and short-lived: the cyclic GC only rescans them
    with collector.paused(), _threads(con, threads), \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="history-fold") as pool:
        try:
            for chunk in chunks:
                prepared = _prepare(chunk)
                if pending is not None:
                    pending.result()
                pending = pool.submit(writer.append, prepared)
            if pending is not None:
                pending.result()
            pool.submit(writer.commit).result()
        except BaseException:
            # one worker runs its tasks in order: the rollback waits for an append in flight
            pool.submit(writer.rollback).result()
            raise
    return writer.committed
