"""When would a waiting job start had it asked for less (or more)? The forecast,
once per request, on working copies where only that job's request differs."""

from __future__ import annotations

from typing import Any

import msgspec

from eventsched.core import scheduler as core
from eventsched.core.forecast import Calibration, run_forecast, shown, working_copy
from eventsched.domain.messages import RefusalKind, Refused
from eventsched.projections.cluster import ClusterState
from eventsched.projections.model import request_of

__all__ = ["with_request", "forecast_alternatives", "MAX_ALTERNATIVES"]

MAX_ALTERNATIVES = 8  # each is a forward run of the core: a question, not a sweep


def with_request(state: ClusterState, job_id: int, gpus: float | None, gpu_mem_mib: int | None) -> ClusterState:
    """A working copy in which queued ``job_id`` asks for ``gpus`` and ``gpu_mem_mib`` (None: as it does)."""
    sim = working_copy(state)
    job = sim.jobs[job_id]
    changes = {k: v for k, v in (("gpus", gpus), ("gpu_mem_mib", gpu_mem_mib)) if v is not None}
    if changes:  # its shape is a key of the queue: out under the old, in under the new
        sim._leave_queue(job)
        job.spec = msgspec.structs.replace(job.spec, **changes)
        job.count, job.milli = request_of(job.spec)
        sim._enter_queue(job)
    return sim


def forecast_alternatives(state: ClusterState, now: float, job_id: int,
                          alternatives: list[tuple[float | None, int | None]],
                          calibration: Calibration | None = None) -> list[dict[str, Any]]:
    """One row per request, the job's own first, as ``explain`` shows it; one that could never run says why."""
    if len(alternatives) > MAX_ALTERNATIVES:
        raise Refused(RefusalKind.INVALID, f"{len(alternatives)} alternatives; ask about {MAX_ALTERNATIVES} at most at once")
    rows = []
    for gpus, mem in [(None, None), *alternatives]:
        sim = with_request(state, job_id, gpus, mem)
        spec = sim.jobs[job_id].spec
        row: dict[str, Any] = {"gpus": spec.gpus, "gpu_mem_mib": spec.gpu_mem_mib}
        try:
            core.check_spec(sim, spec)
        except Refused as refusal:
            rows.append({**row, "estimated_start": None, "estimated_start_p10": None, "estimated_start_p90": None,
                         "calibrated": False, "text": refusal.reason})
            continue
        rows.append({**row, **shown(run_forecast(sim, now, {job_id}, calibration=calibration), job_id, now)})
    return rows
