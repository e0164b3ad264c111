"""Catch-up straight from the log's frames (figures: docs/measured-choices.md).

Decoding every event into a msgspec struct was most of a catch-up's time: the
C extension ``_frames`` walks each frame's msgpack and appends the events of
the types in ``_STORED`` to column buffers, which become Arrow arrays here.
It takes an event only if msgspec would decode it to the same values (the plan
is read from the structs); any other event goes to msgspec and the ordinary
builders, in order, and a frame it cannot walk is undone and decoded the
ordinary way. Each table gets the rows ``history_fold.fold`` would give, in
the same order. Without the extension, or once an upcaster exists, frames go
to ``history_fold.fold``.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import duckdb
import msgspec
import msgspec.inspect as mi
import numpy as np
import pyarrow as pa

from eventsched.domain import events as ev
from eventsched.projections import history_fold as hf

if TYPE_CHECKING:
    from eventsched.storage.log import Frame

try:
    from eventsched.projections import _frames  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: the ordinary decode
    _frames = None  # type: ignore[assignment]

__all__ = ["available", "fold_frames"]

_I64 = (-(1 << 63), (1 << 63) - 1)
_I32 = (-(1 << 31), (1 << 31) - 1)  # INTEGER columns (a larger value is DuckDB's error)

# type -> the fields the fold reads ("spec.user": of the nested spec), and those in INTEGER columns
_STORED: dict[type, tuple[set[str], set[str]]] = {
    ev.GpuSampled: ({"seq", "ts", "node", "gpu", "utilization", "memory_used_mib", "memory_total_mib",
                     "temperature_c", "power_w", "foreign_memory_mib", "job_memory_mib"}, {"gpu"}),
    ev.JobSubmitted: ({"seq", "ts", "job", "cause", "spec.name", "spec.user", "spec.uid", "spec.tenant",
                       "spec.command", "spec.gpus", "spec.gpu_mem_mib", "spec.gpu_ids", "spec.priority",
                       "spec.time_limit_s", "spec.on_time_limit", "spec.retries", "spec.after", "spec.cwd",
                       "spec.content_hash", "spec.node"}, set()),
    ev.JobPlaced: ({"seq", "ts", "job", "cause", "node", "gpu_ids", "share", "gpu_mem_mib", "policy"}, {"gpu_ids"}),
    ev.JobStarted: ({"seq", "ts", "job", "cause", "pid"}, set()),
    ev.JobExited: ({"seq", "ts", "job", "cause", "exit_code", "signal", "reason", "outcome"},
                   {"exit_code", "signal"}),
}


class _Unsupported(Exception):
    """A field the extension has no kind for: its type stays on the ordinary path."""


def _kind(t: Any, path: str) -> int:
    f = _frames
    # scalars without constraints (a Struct equals only one of its own type with the same fields)
    scalars = ((mi.IntType(), f.K_INT), (mi.FloatType(), f.K_FLOAT), (mi.StrType(), f.K_STR), (mi.BoolType(), f.K_BOOL))
    scalar = next((kind for plain, kind in scalars if t == plain), None)
    if scalar is not None:
        return scalar
    if isinstance(t, mi.LiteralType) and all(isinstance(v, str) for v in t.values):
        return f.K_LITERAL
    if isinstance(t, mi.ListType) and t.min_length is None and t.max_length is None:
        if t.item_type == mi.IntType():
            return f.K_LIST_INT
        if t.item_type == mi.StrType() and path.endswith("command"):
            return f.K_CMD  # stored as history_fold._command joins it
        return f.K_EMPTY_LIST  # only an empty one is taken
    if isinstance(t, mi.DictType) and t.min_length is None and t.max_length is None:
        # the maps real logs hold (a job's environment and limits, a sample's
        # memory per job) are checked whole; any other only when empty
        maps = [((mi.StrType(), mi.StrType()), f.K_MAP_STR_STR),
                ((mi.StrType(), mi.ListType(mi.IntType())), f.K_MAP_STR_LIST_INT),
                ((mi.IntType(), mi.IntType()), f.K_MAP_INT_INT)]
        return next((kind for types, kind in maps if types == (t.key_type, t.value_type)), f.K_EMPTY_MAP)
    if isinstance(t, mi.UnionType) and len(t.types) == 2 and isinstance(t.types[1], mi.NoneType):
        inner = _kind(t.types[0], path)
        opt = {f.K_INT: f.K_OPT_INT, f.K_FLOAT: f.K_OPT_FLOAT, f.K_LIST_INT: f.K_OPT_LIST_INT}.get(inner)
        if opt is not None:
            return opt
    if (isinstance(t, mi.StructType) and t.tag_field is None and not t.array_like):
        return f.K_STRUCT
    raise _Unsupported(f"{path}: {t}")


def _default(field: Any, kind: int) -> object:
    if field.required:
        return None
    if field.default_factory is not mi.NODEFAULT:
        if field.default_factory not in (list, dict) or kind == _frames.K_CMD:
            raise _Unsupported(field.name)
        return 0  # an empty list or dict
    value = field.default
    if kind in (_frames.K_STR, _frames.K_LITERAL):
        return value.encode()
    if kind in (_frames.K_INT, _frames.K_OPT_INT, _frames.K_BOOL) and value is not None:
        if isinstance(value, bool) != (kind == _frames.K_BOOL) or not _I64[0] <= value <= _I64[1]:
            raise _Unsupported(field.name)
        return int(value)
    if kind in (_frames.K_FLOAT, _frames.K_OPT_FLOAT) and value is not None:
        return float(value)
    if value is None and kind in (_frames.K_OPT_INT, _frames.K_OPT_FLOAT, _frames.K_OPT_LIST_INT):
        return None
    raise _Unsupported(field.name)


def _plan_type(cls: type) -> tuple[tuple[Any, bytes, list[tuple[Any, ...]]], dict[str, int]]:
    """The extension's plan for one event type, and its field paths -> indices."""
    stored, int32 = _STORED[cls]
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    if info.tag_field != "type" or info.tag != cls.__name__ or info.array_like:
        raise _Unsupported(cls.__name__)
    fields: list[tuple[Any, ...]] = []
    index: dict[str, int] = {}

    def add(struct_fields: Iterable[Any], parent: int, prefix: str) -> None:
        for f in struct_fields:
            path = prefix + f.name
            kind = _kind(f.type, path)
            lo, hi = _I32 if path in int32 else _I64
            lits = tuple(v.encode() for v in f.type.values) if kind == _frames.K_LITERAL else None
            index[path] = len(fields)
            fields.append((f.encode_name.encode(), kind, parent, f.required, path in stored, lo, hi,
                           _default(f, kind), lits))
            if kind == _frames.K_STRUCT:
                add(f.type.fields, index[path], path + ".")

    add(info.fields, -1, "")
    if not stored <= index.keys():
        raise _Unsupported(cls.__name__)
    return (cls, cls.__name__.encode(), fields), index


@functools.cache
def _plan() -> tuple[list[Any], dict[type, int], list[dict[str, int]]]:
    """(plan for the extension, type -> its index there, per type: field path -> index)."""
    plan: list[Any] = []
    where: dict[type, int] = {}
    fields: list[dict[str, int]] = []
    for cls in _STORED:
        try:
            entry, index = _plan_type(cls)
        except _Unsupported:
            continue  # this type stays on the ordinary path
        where[cls] = len(plan)
        plan.append(entry)
        fields.append(index)
    return plan, where, fields


def available() -> bool:
    """Whether frames are folded by the extension (else they are decoded first)."""
    # a build older than its source only checks a sample's memory per job: no fast path then
    return _frames is not None and getattr(_frames, "STORES_INT_MAPS", 0) == 1 and not ev.UPCASTERS


_decode_event = msgspec.msgpack.Decoder(ev.AnyEvent).decode


def _decode_frame(frame: Frame) -> list[ev.Event]:
    from eventsched.storage import log  # imported when used: the CLI starts faster

    return log.decode_frame(frame)


class _Fallback(Exception):
    """The frame goes the ordinary way (an event's seq is not its position)."""


class FrameChunk:
    """Frames' events: the plan's types in the extension's columns, the others
    as structs, each with the number of its type's column rows before it."""

    def __init__(self) -> None:
        self.plan, self.where, self.fields = _plan()
        self.order: dict[type, None] = {}  # types in order of first appearance
        self.sink = _frames.Sink(self.plan, self.order)
        self.structs: dict[type, list[tuple[int, ev.Event]]] = {}
        self.count, self.last_seq = 0, 0
        self.last_ts: float | None = None
        self._added: list[type] = []  # struct lists appended to by the current frame

    def add(self, frame: Frame, after_seq: int) -> None:
        skip = max(0, after_seq + 1 - frame.first_seq)
        n_order = len(self.order)
        self._added.clear()
        self._odd_kept = 0
        self._odd_last: tuple[int, ev.Event] | None = None
        try:
            fed = self.sink.feed(frame.payload, frame.first_seq, skip,
                                 functools.partial(self._odd, frame, skip))
        except _Fallback:
            self.sink.rollback()
            fed = None
        except (msgspec.DecodeError, UnicodeDecodeError):
            _decode_frame(frame)  # raises what decoding the whole frame raises (LogCorruptError...)
            raise  # (decoding one event alone failed as the whole frame did not: never seen)
        if fed is None:
            self._undo(n_order)
            self._add_decoded(frame, after_seq)
            return
        kept, last_index, last_seq, last_ts = fed
        if self._odd_last is not None and self._odd_last[0] > last_index:
            last_seq, last_ts = self._odd_last[1].seq, self._odd_last[1].ts
        self._count(kept + self._odd_kept, last_seq, last_ts)

    def _odd(self, frame: Frame, skip: int, i: int, start: int, end: int) -> None:
        """An event the extension left to msgspec (called in log order)."""
        e = _decode_event(frame.payload[start:end])
        if e.seq != frame.first_seq + i:
            raise _Fallback
        if i >= skip:
            self._struct(e)
            self._odd_kept += 1
            self._odd_last = (i, e)

    def _struct(self, e: ev.Event) -> None:
        t = type(e)
        self.order.setdefault(t)
        where = self.where.get(t)
        self.structs.setdefault(t, []).append((0 if where is None else self.sink.rows(where), e))
        self._added.append(t)

    def _undo(self, n_order: int) -> None:
        for t in reversed(self._added):
            self.structs[t].pop()
        for t in list(self.order)[n_order:]:
            del self.order[t]

    def _add_decoded(self, frame: Frame, after_seq: int) -> None:
        """The ordinary path for one frame: read_batches' and fold's filters."""
        batch = _decoded(frame, after_seq)
        if batch and batch[0].seq <= after_seq:
            batch = [e for e in batch if e.seq > after_seq]
        if not batch:
            return
        for e in batch:
            self._struct(e)
        self._count(len(batch), batch[-1].seq, batch[-1].ts)

    def _count(self, kept: int, last_seq: int, last_ts: float) -> None:
        if not kept:
            return
        self.count, self.last_seq = self.count + kept, last_seq
        self.last_ts = last_ts if self.last_ts is None else max(self.last_ts, last_ts)

    def touches_gpus(self) -> bool:
        return any(t in hf._GPU_EVENTS for t in self.order)

    def inserts(self) -> tuple[list[tuple[str, hf.Columns]], np.ndarray]:
        """(table, columns) in the order history_fold's _Chunk gives them."""
        out: list[tuple[str, hf.Columns]] = []
        jobs: list[np.ndarray] = []
        for t in self.order:
            structs = self.structs.get(t, [])
            where = self.where.get(t)
            if where is None:
                out.extend(hf._build(t, [e for _, e in structs], jobs))
                continue
            cols = _Columns(self.sink, where, self.fields[where])
            native = _NATIVE[t]
            done = 0
            for pos, run in itertools.groupby(structs, key=operator.itemgetter(0)):  # by the column rows before
                if pos > done:
                    out.extend(native(cols, done, pos, jobs))
                out.extend(hf._build(t, [e for _, e in run], jobs))
                done = pos
            if cols.rows > done:
                out.extend(native(cols, done, cols.rows, jobs))
        return out, hf._touched(jobs)


class _Columns:
    """One type's column buffers as Arrow arrays (made once, sliced per run),
    from buffers: no pyarrow.compute nor pyarrow.array, whose first calls are slow."""

    def __init__(self, sink: Any, where: int, fields: dict[str, int]) -> None:
        self.sink, self.where, self.fields = sink, where, fields
        self.rows: int = sink.rows(where)
        self._cache: dict[str, Any] = {}

    def _parts(self, name: str) -> tuple[bytes, bytes | None, bytes | None, bytes | None, bytes | None]:
        return self.sink.column(self.where, self.fields[name])  # type: ignore[no-any-return]

    def _array(self, name: str, arrow_type: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
        arr = self._cache.get(name)
        if arr is None:
            data, offsets, valid_bytes, _, _ = self._parts(name)
            if valid is None and valid_bytes is not None:
                valid = np.frombuffer(valid_bytes, dtype=np.uint8).astype(bool)
            if arrow_type == pa.float64():
                valid = _not_nan(np.frombuffer(data, dtype=np.float64), valid)
            arr = _from_buffers(arrow_type, self.rows, data, offsets, valid)
            self._cache[name] = arr
        return arr

    def i64(self, name: str) -> pa.Array:
        return self._array(name, pa.int64())

    def f64(self, name: str) -> pa.Array:
        return self._array(name, pa.float64())

    def text(self, name: str, valid: np.ndarray | None = None) -> pa.Array:
        return self._array(name, pa.large_string(), valid)

    def numbers(self, name: str, dtype: type = np.int64) -> np.ndarray:
        """A non-optional number field as numpy (not Arrow's to_numpy: that imports pandas)."""
        return np.frombuffer(self._parts(name)[0], dtype=dtype)

    def py(self, arr: pa.Array, a: int, b: int) -> list[Any]:
        return arr.slice(a, b - a).to_pylist()  # type: ignore[no-any-return]

    def items(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A list[int] field: every row's items, and how many each row has."""
        _, _, _, flat, counts = self._parts(name)
        assert flat is not None and counts is not None
        return np.frombuffer(flat, dtype=np.int64), np.frombuffer(counts, dtype=np.int64)


def _g(values: list[float]) -> list[str]:
    """``f"{x:g}"`` of each float, each distinct value formatted once."""
    texts: dict[float | str, str] = {}
    out = []
    for x in values:
        key: float | str = repr(x) if x == 0 or math.isnan(x) else x  # -0.0 and 0.0 (equal keys) apart
        text = texts.get(key)
        if text is None:
            texts[key] = text = f"{x:g}"
        out.append(text)
    return out


def _from_buffers(arrow_type: pa.DataType, n: int, data: Any, offsets: Any, valid: np.ndarray | None) -> pa.Array:
    nulls = 0 if valid is None else n - int(np.count_nonzero(valid))
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if valid is not None and nulls else None
    buffers = [bitmap, pa.py_buffer(data)] if offsets is None else [bitmap, pa.py_buffer(offsets), pa.py_buffer(data)]
    return pa.Array.from_buffers(arrow_type, n, buffers, null_count=nulls)


def _not_nan(values: np.ndarray, valid: np.ndarray | None) -> np.ndarray | None:
    """NaN is NULL, as history_fold's pyarrow.array(..., from_pandas=True) makes it."""
    nan = np.isnan(values)
    if not nan.any():
        return valid
    return ~nan if valid is None else valid & ~nan


def _text(values: list[str]) -> pa.Array:
    offsets, data = _frames.texts(values)
    return pa.Array.from_buffers(pa.large_string(), len(values), [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _arrow(values: np.ndarray) -> pa.Array:
    """A numpy int64 or float64 array as Arrow (NaN as NULL)."""
    values = np.ascontiguousarray(values)
    if values.dtype == np.int64:
        return _from_buffers(pa.int64(), len(values), values, None, None)
    return _from_buffers(pa.float64(), len(values), values, None, _not_nan(values, None))


def _job_events(t: type, c: _Columns, a: int, b: int, jobs: list[np.ndarray], detail: list[str],
                **extra: pa.Array) -> tuple[str, hf.Columns]:
    """Rows [a, b) of job_events; their job ids go to ``jobs``."""
    jobs.append(c.numbers("job")[a:b])
    cols: hf.Columns = {
        "seq": c.i64("seq").slice(a, b - a), "ts": c.f64("ts").slice(a, b - a), "job": c.i64("job").slice(a, b - a),
        "type": f"'{t.__name__}'", "cause": c.text("cause").slice(a, b - a), "detail": _text(detail),
        "exit_code": "NULL", "signal": "NULL", "reason": "NULL", "outcome": "NULL",
    }
    cols.update({k: v.slice(a, b - a) for k, v in extra.items()})
    return "job_events", cols


def _native_sampled(c: _Columns, a: int, b: int, jobs: list[np.ndarray]) -> Iterable[tuple[str, hf.Columns]]:
    cols = {"seq": c.i64("seq"), "ts": c.f64("ts"), "node": c.text("node"), "gpu": c.i64("gpu"),
            "utilization": c.f64("utilization"), "memory_used_mib": c.i64("memory_used_mib"),
            "memory_total_mib": c.i64("memory_total_mib"), "temperature_c": c.f64("temperature_c"),
            "power_w": c.f64("power_w"), "foreign_memory_mib": c.i64("foreign_memory_mib")}
    yield "gpu_samples", {k: v.slice(a, b - a) for k, v in cols.items()}
    # job_memory_mib: its (job, MiB) pairs as flat items, one row per pair
    flat, counts = c.items("job_memory_mib")
    first_item = np.cumsum(counts) - counts
    lo, hi = (int(first_item[a]), int(first_item[b - 1] + counts[b - 1])) if b > a else (0, 0)
    if hi > lo:
        rows = np.repeat(np.arange(a, b), counts[a:b] // 2)  # sample of each row
        yield "job_gpu_memory", {
            "seq": _arrow(c.numbers("seq")[rows]), "ts": _arrow(c.numbers("ts", np.float64)[rows]),
            "node": _text(np.array(c.py(c.text("node"), a, b), dtype=object)[rows - a].tolist()),
            "gpu": _arrow(c.numbers("gpu")[rows]),
            "job": _arrow(flat[lo:hi:2]), "memory_mib": _arrow(flat[lo + 1:hi:2])}


def _native_started(c: _Columns, a: int, b: int, jobs: list[np.ndarray]) -> Iterable[tuple[str, hf.Columns]]:
    yield _job_events(ev.JobStarted, c, a, b, jobs, [f"pid={pid}" for pid in c.py(c.i64("pid"), a, b)])


def _native_exited(c: _Columns, a: int, b: int, jobs: list[np.ndarray]) -> Iterable[tuple[str, hf.Columns]]:
    code, signal, reason = c.i64("exit_code"), c.i64("signal"), c.text("reason")
    # history_fold._exit_detail: a signal when there is no exit code, then the reason if any
    detail = [(f"signal={s}" if x is None else f"exit_code={x}") + (f" reason={r}" if r else "")
              for x, s, r in zip(c.py(code, a, b), c.py(signal, a, b), c.py(reason, a, b))]
    yield _job_events(ev.JobExited, c, a, b, jobs, detail, exit_code=code, signal=signal, reason=reason,
                      outcome=c.text("outcome"))


def _native_placed(c: _Columns, a: int, b: int, jobs: list[np.ndarray]) -> Iterable[tuple[str, hf.Columns]]:
    node, ids = c.text("node"), c.text("gpu_ids")
    detail = [f"node={n} gpu_ids={i} share={g}"
              for n, i, g in zip(c.py(node, a, b), c.py(ids, a, b), _g(c.numbers("share", np.float64)[a:b].tolist()))]
    yield _job_events(ev.JobPlaced, c, a, b, jobs, detail)
    # one row per GPU of the placement, idx keeping CUDA_VISIBLE_DEVICES order
    flat, counts = c.items("gpu_ids")
    first_item = np.cumsum(counts) - counts
    rows = np.repeat(np.arange(a, b), counts[a:b])  # event of each row
    lo = int(first_item[a]) if b > a else 0
    yield "placement_events", {
        "seq": _arrow(c.numbers("seq")[rows]), "ts": _arrow(c.numbers("ts", np.float64)[rows]),
        "job": _arrow(c.numbers("job")[rows]), "node": _rows_of(node, rows, a, b),
        "gpu": _arrow(flat[lo:lo + len(rows)]), "idx": _arrow(np.arange(lo, lo + len(rows)) - first_item[rows]),
        "share": _arrow(c.numbers("share", np.float64)[rows]), "gpu_mem_mib": _arrow(c.numbers("gpu_mem_mib")[rows]),
        "policy": _rows_of(c.text("policy"), rows, a, b),
    }


def _rows_of(strings: pa.Array, rows: np.ndarray, a: int, b: int) -> pa.Array:
    """strings[rows]: a slice when each row is there once (one GPU each), as usual."""
    if len(rows) == b - a and np.array_equal(rows, np.arange(a, b)):
        return strings.slice(a, b - a)
    return _text(np.array(strings.to_pylist(), dtype=object)[rows].tolist())


def _native_submitted(c: _Columns, a: int, b: int, jobs: list[np.ndarray]) -> Iterable[tuple[str, hf.Columns]]:
    user, gpus, priority = c.text("spec.user"), c.f64("spec.gpus"), c.i64("spec.priority")
    detail = [f"user={u} gpus={g} priority={p}"
              for u, g, p in zip(c.py(user, a, b), _g(c.numbers("spec.gpus", np.float64)[a:b].tolist()),
                                 c.py(priority, a, b))]
    yield _job_events(ev.JobSubmitted, c, a, b, jobs, detail)
    _, after_counts = c.items("spec.after")
    cols = {
        "seq": c.i64("seq"), "ts": c.f64("ts"), "job": c.i64("job"),
        "name": c.text("spec.name"), "user": user, "uid": c.i64("spec.uid"),
        "tenant": c.text("spec.tenant"), "command": c.text("spec.command"), "gpus": gpus,
        "gpu_mem_mib": c.i64("spec.gpu_mem_mib"), "allowed_gpu_ids": c.text("spec.gpu_ids"),
        "priority": priority, "time_limit_s": c.f64("spec.time_limit_s"),
        "on_time_limit": c.text("spec.on_time_limit"), "retries": c.i64("spec.retries"),
        "after": c.text("spec.after", valid=after_counts != 0),  # _ids(after) or None
        "cwd": c.text("spec.cwd"), "content_hash": c.text("spec.content_hash"), "node": c.text("spec.node"),
    }
    yield "submissions", {k: v.slice(a, b - a) for k, v in cols.items()}


# type -> builder(columns, first row, end row, job ids out) for its rows [a, b)
_NATIVE: dict[type, Callable[[_Columns, int, int, list[np.ndarray]], Iterable[tuple[str, hf.Columns]]]] = {
    ev.GpuSampled: _native_sampled,
    ev.JobSubmitted: _native_submitted,
    ev.JobPlaced: _native_placed,
    ev.JobStarted: _native_started,
    ev.JobExited: _native_exited,
}


# Events per chunk (docs/measured-choices.md). The first and (when the caller
# knows where the log ends) the last are smaller: the writer idles until the
# first comes; the converter idles while the last is inserted.
CHUNK_EVENTS = 250_000
FIRST_CHUNK_EVENTS = 50_000
LAST_CHUNK_EVENTS = 50_000
WRITER_THREADS = 1  # DuckDB's while folding frames: the converting thread has the other core


def _chunk_size(previous: int, left: int | None) -> int:
    """Events for the next chunk (``left``: events left to read, if known),
    growing from FIRST_CHUNK_EVENTS to CHUNK_EVENTS."""
    size = min(FIRST_CHUNK_EVENTS if not previous else previous * 5 // 2, CHUNK_EVENTS)
    if left is not None and LAST_CHUNK_EVENTS < left < size + LAST_CHUNK_EVENTS:
        size = left - LAST_CHUNK_EVENTS  # so that the last one is LAST_CHUNK_EVENTS
    return size


def _chunks(frames: Iterable[Frame], after_seq: int, last_seq: int | None) -> Iterator[FrameChunk]:
    chunk = FrameChunk()
    size = _chunk_size(0, None if last_seq is None else last_seq - after_seq)
    for frame in frames:
        chunk.add(frame, after_seq)
        if chunk.count >= size:
            yield chunk
            left = None if last_seq is None else last_seq - (frame.first_seq + frame.n_events - 1)
            size = _chunk_size(chunk.count, left)
            chunk = FrameChunk()
    if chunk.count:
        yield chunk


def fold_frames(con: duckdb.DuckDBPyConnection, frames: Iterable[Frame], after_seq: int,
                last_seq: int | None = None) -> int:
    """``history_fold.fold`` of ``log.read_frames(dir, after_seq + 1)``, from
    undecoded frames; ``last_seq`` (where the log ends, if known) only sizes the
    chunks. Transactions end elsewhere than ``fold``'s, still at exact prefixes."""
    if not available():
        return hf.fold(con, (_decoded(f, after_seq) for f in frames), after_seq)
    chunks = _chunks(frames, after_seq, last_seq)
    return hf.fold_chunks(con, chunks, refresh_each_chunk=True, threads=WRITER_THREADS)


def _decoded(frame: Frame, after_seq: int) -> list[ev.Event]:
    """read_batches' frame: decoded, less the events before after_seq + 1."""
    return _decode_frame(frame)[max(0, after_seq + 1 - frame.first_seq):]
