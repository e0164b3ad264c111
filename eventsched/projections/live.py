"""The allocation state's live GPUs and jobs, and the records a snapshot
stores them as. Each field is declared once, below: compiled, the classes keep
their fields in C slots; ``GpuRecord`` and ``JobRecord`` (msgspec Structs) are
derived from the same declarations.
"""

from __future__ import annotations

import ast
import os
from typing import Any

import msgspec

from eventsched.domain import events as ev
from eventsched.domain.states import JobState
from eventsched.domain.tenants import DEFAULT_TENANT
from eventsched.domain.units import FULL

__all__ = ["Gpu", "Job", "GpuRecord", "JobRecord"]


class _Live:
    """Equality and repr, field by field. Each ``__init__`` gives every object
    its own containers and sets what mypyc cannot keep in the class (an enum)."""

    def values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _NAMES[type(self)]}

    def record(self) -> Any:
        return msgspec.convert(self, _RECORDS[type(self)], from_attributes=True)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.values() == other.values()  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.values().items())})"


def _assign(obj: _Live, fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        setattr(obj, name, value)


class Gpu(_Live):
    """One GPU as the scheduler sees it: what it is, its last sample, and
    what the scheduler placed on it."""

    node: str
    id: int
    uuid: str = ""
    model: str = ""
    memory_total_mib: int = 0
    paused: bool = False
    lost: bool = False
    error: str = ""
    # last sample (None until the first one)
    sampled_at: float | None = None
    utilization: float | None = None
    memory_used_mib: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    foreign_memory_mib: int = -1
    # what the scheduler placed here
    used_milli: int = 0
    reserved_mib: int = 0
    jobs: list[int] = []
    # from the last sample: quiet (at most idle_utilization_pct) since when (None: busy or
    # never sampled), the memory each job holds here, the processes of no job
    low_since: float | None = None
    job_memory_mib: dict[int, int] = {}
    foreign_processes: list[ev.GpuProcess] = []
    # why it was drained ("" for an operator's pause); the driver's last health reading
    paused_reason: str = ""
    health: ev.GpuHealth | None = None

    def __init__(self, **fields: Any) -> None:
        self.jobs, self.job_memory_mib, self.foreign_processes = [], {}, []
        _assign(self, fields)

    @property
    def key(self) -> tuple[str, int]:
        return (self.node, self.id)

    def copy(self) -> Gpu:
        """A copy whose containers can change apart from this one's (a forecast's working copy)."""
        g = Gpu.from_record(self)
        g.jobs, g.job_memory_mib, g.foreign_processes = list(self.jobs), dict(self.job_memory_mib), list(self.foreign_processes)
        return g

    @staticmethod
    def from_record(r: Any) -> Gpu:
        """A GPU with ``r``'s fields (a ``GpuRecord`` or a ``Gpu``), each by name:
        compiled, a snapshot loads many fast (tests/test_live_records.py finds one missing)."""
        g = Gpu()
        g.node, g.id, g.uuid, g.model, g.memory_total_mib, g.paused = r.node, r.id, r.uuid, r.model, r.memory_total_mib, r.paused
        g.lost, g.error, g.sampled_at, g.utilization, g.memory_used_mib = r.lost, r.error, r.sampled_at, r.utilization, r.memory_used_mib
        g.temperature_c, g.power_w, g.foreign_memory_mib, g.used_milli = r.temperature_c, r.power_w, r.foreign_memory_mib, r.used_milli
        g.reserved_mib, g.jobs, g.low_since, g.job_memory_mib = r.reserved_mib, r.jobs, r.low_since, r.job_memory_mib
        g.foreign_processes, g.paused_reason, g.health = r.foreign_processes, r.paused_reason, r.health
        return g


class Job(_Live):
    """One job as the scheduler sees it: its spec and where it is in its life."""

    id: int
    spec: ev.JobSpec
    state: JobState = JobState.QUEUED
    count: int = 1  # GPUs asked for (0 = CPU only)
    milli: int = FULL  # share of each of them
    order: int = 0  # queue position (FIFO key); a requeue moves it to the back
    submitted_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    node: str = ""
    gpu_ids: list[int] = []
    mem_mib: int = 0  # reserved on each GPU
    policy: str = ""
    pid: int | None = None
    start_time: int = 0
    log_path: str = ""
    attempts: int = 0  # times placed
    retries_used: int = 0
    not_before: float = 0.0
    cancel_reason: str = ""  # set while a stop was requested for a running job
    submitted_seq: int = 0  # where its story starts in the log (explain)
    queued_at: float = 0.0  # since when it waits (aging); a preempted job keeps its own
    # when it should end, as predicted at its start (read by gang reservations)
    predicted_end: float = 0.0
    preemptions: int = 0  # times it was preempted (and requeued)
    # this attempt: the most GPU memory seen on one GPU, over --gpu-mem now, idle since when
    gpu_mem_peak_mib: int = 0
    gpu_mem_over: bool = False
    idle_since: float | None = None
    # for a waiting job a preemption makes room for: its victims' (node, GPU)s, held for it
    room: list[tuple[str, int]] = []

    def __init__(self, **fields: Any) -> None:
        self.gpu_ids, self.room, self.state = [], [], JobState.QUEUED
        _assign(self, fields)

    @property
    def shape(self) -> tuple[Any, ...]:
        """What placement depends on: equal shapes fit or fail together (the tenant
        and a capped array are part of it: a quota or cap holds a shape back whole)."""
        s = self.spec
        ids = None if s.gpu_ids is None else tuple(s.gpu_ids)
        return (self.count, self.milli, s.gpu_mem_mib, ids, s.node, s.tenant, s.array_id if s.array_cap else 0)

    @property
    def tenant(self) -> str:
        return self.spec.tenant or DEFAULT_TENANT

    def copy(self) -> Job:
        """A copy whose containers can change apart from this one's (a forecast's working copy)."""
        j = Job.from_record(self)
        j.gpu_ids = list(self.gpu_ids)
        return j

    @staticmethod
    def from_record(r: Any) -> Job:
        """A job with ``r``'s fields (a ``JobRecord``, or a ``Job``), as ``Gpu.from_record``."""
        j = Job()
        j.id, j.spec, j.state, j.count, j.milli, j.order = r.id, r.spec, r.state, r.count, r.milli, r.order
        j.submitted_at, j.started_at, j.ended_at, j.exit_code = r.submitted_at, r.started_at, r.ended_at, r.exit_code
        j.signal, j.reason, j.node, j.gpu_ids, j.mem_mib, j.policy = r.signal, r.reason, r.node, r.gpu_ids, r.mem_mib, r.policy
        j.pid, j.start_time, j.log_path, j.attempts, j.retries_used = r.pid, r.start_time, r.log_path, r.attempts, r.retries_used
        j.not_before, j.cancel_reason, j.submitted_seq, j.queued_at = r.not_before, r.cancel_reason, r.submitted_seq, r.queued_at
        j.predicted_end, j.preemptions, j.gpu_mem_peak_mib = r.predicted_end, r.preemptions, r.gpu_mem_peak_mib
        j.gpu_mem_over, j.idle_since, j.room = r.gpu_mem_over, r.idle_since, list(r.room)
        return j


def _declared(cls: type) -> list[tuple[str, Any, Any]]:
    """``cls``'s fields as written above: (name, type, default), read from this
    file because a compiled class keeps no annotations."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "live.py"), encoding="utf-8") as f:
        body = next(n for n in ast.parse(f.read()).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body

    def value(e: ast.expr) -> Any:
        return eval(compile(ast.Expression(e), "live.py", "eval"), globals())

    return [(n.target.id, value(n.annotation), msgspec.NODEFAULT if n.value is None else value(n.value))
            for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


# the Structs a snapshot encodes, field for field (msgspec gives each its own empty list or dict)
GpuRecord = msgspec.defstruct("GpuRecord", _declared(Gpu), kw_only=True)
JobRecord = msgspec.defstruct("JobRecord", _declared(Job), kw_only=True)
_RECORDS: dict[type, Any] = {Gpu: GpuRecord, Job: JobRecord}
_NAMES: dict[type, tuple[str, ...]] = {cls: record.__struct_fields__ for cls, record in _RECORDS.items()}
