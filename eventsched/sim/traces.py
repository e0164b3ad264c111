"""Trace importers: the Alibaba "openb" GPU trace and a plain CSV of jobs.

The plain CSV (``submit_time,duration,gpus[,gpu_mem,user,priority,tenant]``,
columns by name, ``#`` comments) is described in replays/README.md; a bad row
raises ``TraceError`` naming the file and line. ``load_alibaba`` reads the
openb pod and node lists, whose time columns are censored, not a schedule.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import msgspec

__all__ = ["TraceError", "AlibabaPod", "AlibabaNode", "TraceJob", "load_alibaba", "load_csv"]


class TraceError(ValueError):
    """A trace file is unreadable or has a bad row; str() is one line for the user."""


class AlibabaPod(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int  # 0, or number of GPUs
    gpu_milli: int  # per-GPU share 1..1000 (0 when num_gpu == 0)
    gpu_spec: tuple[str, ...] = ()  # allowed GPU models; empty = any
    qos: str = ""
    pod_phase: str = ""
    creation_time: int | None = None
    deletion_time: int | None = None
    scheduled_time: int | None = None


class AlibabaNode(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


class TraceJob(msgspec.Struct, frozen=True, kw_only=True):
    """One job of a replayable trace (same GPU convention as events.JobSpec.gpus)."""

    submit_time: float
    duration: float
    gpus: float  # 0 = CPU-only; 0 < g < 1 share of one GPU; integer >= 1 whole GPUs
    gpu_mem_mib: int = 0
    user: str = ""
    priority: int = 0
    tenant: str = ""


T = TypeVar("T")


def _rows(path: str | os.PathLike[str], required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield (line number, row) for each data row; checks the header first."""
    try:
        f = open(path, newline="", encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    with f:
        reader = csv.reader(f)
        header: list[str] | None = None
        for fields in reader:
            lineno = reader.line_num
            if not fields or (len(fields) == 1 and not fields[0].strip()) or fields[0].lstrip().startswith("#"):
                continue
            if header is None:
                header = [h.strip() for h in fields]
                missing = [c for c in required if c not in header]
                if missing:
                    raise TraceError(f"{path}:{lineno}: header must name {', '.join(required)};"
                                     f" missing {', '.join(missing)} (got {','.join(header)})")
                continue
            if len(fields) != len(header):
                raise TraceError(f"{path}:{lineno}: expected {len(header)} fields, got {len(fields)}")
            yield lineno, {h: v.strip() for h, v in zip(header, fields)}
        if header is None:
            raise TraceError(f"{path}: empty file (a header line is required)")


def _field(path: object, lineno: int, row: dict[str, str], col: str,
           conv: Callable[[str], T], ok: Callable[[T], bool] = lambda v: True,
           what: str = "", default: T | None = None) -> T:
    raw = row.get(col, "")
    if raw == "" and default is not None:
        return default
    try:
        v = conv(raw)
    except (ValueError, OverflowError):
        kind = "an integer" if conv in (int, _opt_int) else "a number"
        raise TraceError(f"{path}:{lineno}: {col} must be {kind}, got {raw!r}") from None
    if isinstance(v, float) and not math.isfinite(v):
        raise TraceError(f"{path}:{lineno}: {col} must be finite, got {raw!r}")
    if not ok(v):
        raise TraceError(f"{path}:{lineno}: {col} must be {what}, got {raw!r}")
    return v


def _opt_int(raw: str) -> int | None:
    return None if raw == "" else int(raw)


def _count(path: object, lineno: int, row: dict[str, str], col: str) -> int:
    return _field(path, lineno, row, col, int, lambda v: v >= 0, ">= 0")


_POD_COLS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
_NODE_COLS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")


def load_alibaba(pod_csv: str | os.PathLike[str], node_csv: str | os.PathLike[str]
                 ) -> tuple[list[AlibabaPod], list[AlibabaNode]]:
    """Read an openb pod list and node list. Raises TraceError on a bad row."""
    pods: list[AlibabaPod] = []
    for n, r in _rows(pod_csv, _POD_COLS):
        k = _count(pod_csv, n, r, "num_gpu")
        g = _field(pod_csv, n, r, "gpu_milli", int, lambda v: 0 <= v <= 1000, "in 0..1000")
        if k > 0 and g == 0:
            raise TraceError(f"{pod_csv}:{n}: gpu_milli must be > 0 when num_gpu is {k}")
        if k == 0:
            g = 0  # a CPU-only pod has no GPU share, whatever the column says
        times = {col: _field(pod_csv, n, r, col, _opt_int) if col in r else None
                 for col in ("creation_time", "deletion_time", "scheduled_time")}
        pods.append(AlibabaPod(
            name=r["name"], cpu_milli=_count(pod_csv, n, r, "cpu_milli"), memory_mib=_count(pod_csv, n, r, "memory_mib"),
            num_gpu=k, gpu_milli=g,
            gpu_spec=tuple(s for s in r.get("gpu_spec", "").split("|") if s), qos=r.get("qos", ""),
            pod_phase=r.get("pod_phase", r.get("pod_phrase", "")), **times))
    nodes = [AlibabaNode(gpus=_field(node_csv, n, r, "gpu", int, lambda v: 0 <= v <= 64, "in 0..64"), name=r["sn"],
                         cpu_milli=_count(node_csv, n, r, "cpu_milli"), memory_mib=_count(node_csv, n, r, "memory_mib"),
                         model=r["model"])
             for n, r in _rows(node_csv, _NODE_COLS)]
    return pods, nodes


def _gpus_ok(v: float) -> bool:
    return v == 0 or 0 < v < 1 or (v >= 1 and v == int(v))


def load_csv(path: str | os.PathLike[str]) -> list[TraceJob]:
    """Read a plain job CSV (format in the module docstring), in file order."""
    jobs: list[TraceJob] = []
    for n, r in _rows(path, ("submit_time", "duration", "gpus")):
        jobs.append(TraceJob(
            submit_time=_field(path, n, r, "submit_time", float, lambda v: v >= 0, ">= 0"),
            duration=_field(path, n, r, "duration", float, lambda v: v > 0, "> 0"),
            gpus=_field(path, n, r, "gpus", float, _gpus_ok, "0, a share in (0, 1) or a whole number of GPUs"),
            gpu_mem_mib=_field(path, n, r, "gpu_mem", int, lambda v: v >= 0, ">= 0", default=0),
            user=r.get("user", ""), priority=_field(path, n, r, "priority", int, default=0),
            tenant=r.get("tenant", "")))
    return jobs
