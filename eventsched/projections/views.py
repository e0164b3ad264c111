"""JSON views of jobs and GPUs: what ``queue --json``, ``status --json`` and
``explain`` print, and the notebook panel shows. No environment is in them
(``visibility``): they are shown to every user."""

from __future__ import annotations

from typing import Any

from eventsched.domain.units import FULL
from eventsched.projections.model import Gpu, Job

__all__ = ["job_json", "gpu_json"]


def job_json(job: Job, waiting: Any = None) -> dict[str, Any]:
    """A job as ``queue --json`` shows it; ``waiting`` is its ``explain.Reason``
    (None unless it is queued or held)."""
    s = job.spec
    task = s.array_index >= 0  # an --array task: its array's id (the first task's), its index, %K
    return {
        "id": job.id, "name": s.name or (s.command[0] if s.command else ""), "user": s.user, "state": job.state,
        "priority": s.priority, "gpus": s.gpus,
        "gpu_ids": list(job.gpu_ids),  # kept after the job ends: where it ran
        "submitted_at": job.submitted_at, "started_at": job.started_at, "ended_at": job.ended_at,
        "exit_code": job.exit_code, "signal": job.signal,
        "reason": waiting.text if waiting is not None else None,  # why it waits (explain)
        "reason_kind": waiting.kind if waiting is not None else None,
        "exit_reason": job.reason or job.cancel_reason,  # why its last run ended
        "tenant": s.tenant, "command": list(s.command), "gpu_mem_mib": s.gpu_mem_mib, "node": job.node,
        "pid": job.pid, "attempts": job.attempts, "after": list(s.after), "not_before": job.not_before or None,
        "time_limit_s": s.time_limit_s,
        "array_id": s.array_id if task else None, "array_index": s.array_index if task else None,
        "array_cap": (s.array_cap or None) if task else None,
        # the most GPU memory seen on one GPU this run, over --gpu-mem now; allocated but idle since when
        "gpu_mem_peak_mib": job.gpu_mem_peak_mib, "gpu_mem_over": job.gpu_mem_over,
        "idle": job.state == "running" and job.idle_since is not None,
        "idle_since": job.idle_since if job.state == "running" else None,
    }


def gpu_json(gpu: Gpu) -> dict[str, Any]:
    return {
        "id": gpu.id, "node": gpu.node, "allocated": gpu.used_milli / FULL, "paused": gpu.paused, "lost": gpu.lost,
        "utilization": gpu.utilization, "memory_used_mib": gpu.memory_used_mib,
        "memory_total_mib": gpu.memory_total_mib, "temperature_c": gpu.temperature_c,
        "reserved_mib": gpu.reserved_mib, "foreign_memory_mib": gpu.foreign_memory_mib, "jobs": list(gpu.jobs),
        # the memory each job's processes hold here, and processes of no job
        "job_memory_mib": {str(j): mib for j, mib in gpu.job_memory_mib.items()},
        "foreign_processes": [{"pid": p.pid, "user": p.user or str(p.uid), "used_mib": p.used_mib}
                              for p in gpu.foreign_processes],
        "model": gpu.model, "error": gpu.error,
        "paused_reason": gpu.paused_reason,  # why the scheduler drained it ("" for an operator's pause)
    }
