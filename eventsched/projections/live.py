"""The allocation state's live GPUs and jobs: native classes, compiled.

The fold reads and writes a job's or a GPU's fields on every event: a
placement alone sets twenty of them. Compiled with mypyc (``setup.py``),
these classes keep their fields in C slots, so the compiled fold, policies
and core reach them directly instead of through Python's generic attribute
lookup (about a tenth of a replay's time when they were msgspec Structs).

Snapshots still encode the Structs of ``records`` (``GpuRecord``,
``JobRecord``), field for field: ``record()`` and ``from_record`` convert, and
``tests/test_live_records.py`` checks the two keep the same fields.
"""

from __future__ import annotations

from typing import Any

import msgspec

from eventsched.domain import events as ev
from eventsched.domain.states import JobState
from eventsched.domain.tenants import DEFAULT_TENANT
from eventsched.domain.units import FULL
from eventsched.projections.records import GpuRecord, JobRecord

__all__ = ["Gpu", "Job"]


class _Live:
    """What a live GPU and job share: equality and repr through their record."""

    def record(self) -> msgspec.Struct:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.record() == other.record()  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        text = repr(self.record())
        return type(self).__name__ + text[text.index("("):]


class Gpu(_Live):
    """One GPU as the scheduler sees it: what it is, its last sample, and
    what the scheduler placed on it. Fields as ``records.GpuRecord``."""

    def __init__(
        self,
        *,
        node: str,
        id: int,
        uuid: str = "",
        model: str = "",
        memory_total_mib: int = 0,
        paused: bool = False,
        lost: bool = False,
        error: str = "",
        sampled_at: float | None = None,
        utilization: float | None = None,
        memory_used_mib: int | None = None,
        temperature_c: float | None = None,
        power_w: float | None = None,
        foreign_memory_mib: int = -1,
        used_milli: int = 0,
        reserved_mib: int = 0,
        jobs: list[int] | None = None,
        low_since: float | None = None,
        job_memory_mib: dict[int, int] | None = None,
        foreign_processes: list[ev.GpuProcess] | None = None,
    ) -> None:
        self.node = node
        self.id = id
        self.uuid = uuid
        self.model = model
        self.memory_total_mib = memory_total_mib
        self.paused = paused
        self.lost = lost
        self.error = error
        # last sample (None until the first one)
        self.sampled_at = sampled_at
        self.utilization = utilization
        self.memory_used_mib = memory_used_mib
        self.temperature_c = temperature_c
        self.power_w = power_w
        self.foreign_memory_mib = foreign_memory_mib
        # what the scheduler placed here
        self.used_milli = used_milli
        self.reserved_mib = reserved_mib
        self.jobs: list[int] = [] if jobs is None else jobs
        # issue 17, from the last sample: since when it has been at most
        # idle_utilization_pct busy, the memory each job holds here, and the
        # processes of no job
        self.low_since = low_since
        self.job_memory_mib: dict[int, int] = {} if job_memory_mib is None else job_memory_mib
        self.foreign_processes: list[ev.GpuProcess] = [] if foreign_processes is None else foreign_processes

    @property
    def key(self) -> tuple[str, int]:
        return (self.node, self.id)

    @property
    def allocated(self) -> float:
        return self.used_milli / FULL

    def copy(self) -> Gpu:
        """A copy whose containers can change apart from this one's (a forecast's working copy)."""
        return Gpu(
            node=self.node, id=self.id, uuid=self.uuid, model=self.model, memory_total_mib=self.memory_total_mib,
            paused=self.paused, lost=self.lost, error=self.error, sampled_at=self.sampled_at,
            utilization=self.utilization, memory_used_mib=self.memory_used_mib, temperature_c=self.temperature_c,
            power_w=self.power_w, foreign_memory_mib=self.foreign_memory_mib, used_milli=self.used_milli,
            reserved_mib=self.reserved_mib, jobs=list(self.jobs), low_since=self.low_since,
            job_memory_mib=dict(self.job_memory_mib), foreign_processes=list(self.foreign_processes),
        )

    def record(self) -> GpuRecord:
        return msgspec.convert(self, GpuRecord, from_attributes=True)

    @staticmethod
    def from_record(r: GpuRecord) -> Gpu:
        return Gpu(
            node=r.node, id=r.id, uuid=r.uuid, model=r.model, memory_total_mib=r.memory_total_mib, paused=r.paused,
            lost=r.lost, error=r.error, sampled_at=r.sampled_at, utilization=r.utilization,
            memory_used_mib=r.memory_used_mib, temperature_c=r.temperature_c, power_w=r.power_w,
            foreign_memory_mib=r.foreign_memory_mib, used_milli=r.used_milli, reserved_mib=r.reserved_mib,
            jobs=r.jobs, low_since=r.low_since, job_memory_mib=r.job_memory_mib,
            foreign_processes=r.foreign_processes,
        )



class Job(_Live):
    """One job as the scheduler sees it: its spec and where it is in its
    life. Fields as ``records.JobRecord``."""

    def __init__(
        self,
        *,
        id: int,
        spec: ev.JobSpec,
        state: JobState = JobState.QUEUED,
        count: int = 1,
        milli: int = FULL,
        order: int = 0,
        submitted_at: float = 0.0,
        started_at: float | None = None,
        ended_at: float | None = None,
        exit_code: int | None = None,
        signal: int | None = None,
        reason: str = "",
        node: str = "",
        gpu_ids: list[int] | None = None,
        mem_mib: int = 0,
        policy: str = "",
        pid: int | None = None,
        start_time: int = 0,
        log_path: str = "",
        attempts: int = 0,
        retries_used: int = 0,
        not_before: float = 0.0,
        cancel_reason: str = "",
        submitted_seq: int = 0,
        queued_at: float = 0.0,
        predicted_end: float = 0.0,
        preemptions: int = 0,
        gpu_mem_peak_mib: int = 0,
        gpu_mem_over: bool = False,
        idle_since: float | None = None,
    ) -> None:
        self.id = id
        self.spec = spec
        self.state = state
        self.count = count  # GPUs asked for (0 = CPU only)
        self.milli = milli  # share of each of them
        self.order = order  # queue position (FIFO key); a requeue moves it to the back
        self.submitted_at = submitted_at
        self.started_at = started_at
        self.ended_at = ended_at
        self.exit_code = exit_code
        self.signal = signal
        self.reason = reason
        self.node = node
        self.gpu_ids: list[int] = [] if gpu_ids is None else gpu_ids
        self.mem_mib = mem_mib  # reserved on each GPU
        self.policy = policy
        self.pid = pid
        self.start_time = start_time
        self.log_path = log_path
        self.attempts = attempts  # times placed
        self.retries_used = retries_used
        self.not_before = not_before
        self.cancel_reason = cancel_reason  # set while a stop was requested for a running job
        self.submitted_seq = submitted_seq  # where its story starts in the log (explain)
        self.queued_at = queued_at  # since when it waits (aging); a preempted job keeps its own
        # when it should end, as predicted when it started (gang reservations
        # read this instead of predicting every running job at every decision)
        self.predicted_end = predicted_end
        self.preemptions = preemptions  # times it was preempted (and requeued)
        # issue 17, this attempt: the most GPU memory seen on one of its GPUs;
        # whether it is over its --gpu-mem now (JobGpuMemoryExceeded); since
        # when it has been idle (JobIdle; None: not idle)
        self.gpu_mem_peak_mib = gpu_mem_peak_mib
        self.gpu_mem_over = gpu_mem_over
        self.idle_since = idle_since

    @property
    def shape(self) -> tuple[Any, ...]:
        """What placement depends on: equal shapes fit or fail together. The
        tenant (quotas) and a capped array (%K) are part of it, so that a
        shape held back by its quota or cap is held back whole."""
        s = self.spec
        ids = None if s.gpu_ids is None else tuple(s.gpu_ids)
        return (self.count, self.milli, s.gpu_mem_mib, ids, s.node, s.tenant, s.array_id if s.array_cap else 0)

    @property
    def tenant(self) -> str:
        return self.spec.tenant or DEFAULT_TENANT

    def copy(self) -> Job:
        """A copy whose containers can change apart from this one's (a forecast's working copy)."""
        return Job(
            id=self.id, spec=self.spec, state=self.state, count=self.count, milli=self.milli, order=self.order,
            submitted_at=self.submitted_at, started_at=self.started_at, ended_at=self.ended_at,
            exit_code=self.exit_code, signal=self.signal, reason=self.reason, node=self.node,
            gpu_ids=list(self.gpu_ids), mem_mib=self.mem_mib, policy=self.policy, pid=self.pid,
            start_time=self.start_time, log_path=self.log_path, attempts=self.attempts,
            retries_used=self.retries_used, not_before=self.not_before, cancel_reason=self.cancel_reason,
            submitted_seq=self.submitted_seq, queued_at=self.queued_at, predicted_end=self.predicted_end,
            preemptions=self.preemptions, gpu_mem_peak_mib=self.gpu_mem_peak_mib, gpu_mem_over=self.gpu_mem_over,
            idle_since=self.idle_since,
        )

    def record(self) -> JobRecord:
        return msgspec.convert(self, JobRecord, from_attributes=True)

    @staticmethod
    def from_record(r: JobRecord) -> Job:
        # field by field, compiled: 0.5 us a job, a fifth of what
        # ``Job(**msgspec.structs.asdict(r))`` takes (a snapshot of 100,000)
        return Job(
            id=r.id, spec=r.spec, state=r.state, count=r.count, milli=r.milli, order=r.order,
            submitted_at=r.submitted_at, started_at=r.started_at, ended_at=r.ended_at, exit_code=r.exit_code,
            signal=r.signal, reason=r.reason, node=r.node, gpu_ids=r.gpu_ids, mem_mib=r.mem_mib, policy=r.policy,
            pid=r.pid, start_time=r.start_time, log_path=r.log_path, attempts=r.attempts,
            retries_used=r.retries_used, not_before=r.not_before, cancel_reason=r.cancel_reason,
            submitted_seq=r.submitted_seq, queued_at=r.queued_at, predicted_end=r.predicted_end,
            preemptions=r.preemptions, gpu_mem_peak_mib=r.gpu_mem_peak_mib, gpu_mem_over=r.gpu_mem_over,
            idle_since=r.idle_since,
        )
