"""A job's report card: the one rule that turns what a job used into what it
should ask for next time. ``SUGGEST_SQL`` is the same rule for the read model's
``job_efficiency`` view, built from the same constants, so ``explain`` and SQL
never disagree.
"""

from __future__ import annotations

import math

from eventsched.domain.messages import SchedulerConfig

__all__ = ["IDLE_PCT", "suggest", "advice", "SUGGEST_SQL", "gb"]

IDLE_PCT = SchedulerConfig().idle_utilization_pct  # a GPU at most this busy is idle
MEM_HEADROOM = 1.25  # ask for a quarter more than the peak: a run's peak varies
MEM_SLACK = 0.75  # a request within this share of the suggestion is close enough
MIB_PER_GB = 1024
GPU_NOISE = 0.05  # of a GPU: a peak this far over a whole number rounds down


def suggest(gpus: float, gpus_used_peak: float | None, gpu_mem_mib: int,
            mem_peak_mib: int | None) -> tuple[float, int]:
    """(GPUs, GPU memory per GPU in MiB) to ask for next time; the request itself
    where the samples say nothing better. GPUs: the peak GPUs busy at once less
    a twentieth (noise), rounded up (whole-GPU jobs only: a share has no smaller count).
    Memory: the peak plus headroom in whole GB, when the request is well above
    it or below the peak."""
    new_gpus = gpus
    if gpus >= 2 and gpus_used_peak is not None:
        new_gpus = float(min(gpus, max(1, math.ceil(gpus_used_peak - GPU_NOISE))))
    new_mem = gpu_mem_mib
    if gpu_mem_mib > 0 and mem_peak_mib is not None:
        fit = math.ceil(mem_peak_mib * MEM_HEADROOM / MIB_PER_GB) * MIB_PER_GB  # whole GB, in MiB
        if fit <= gpu_mem_mib * MEM_SLACK or mem_peak_mib > gpu_mem_mib:
            new_mem = fit
    return new_gpus, new_mem


def gb(mib: float) -> str:
    return f"{mib / MIB_PER_GB:.1f}".removesuffix(".0") + " GB"


def advice(gpus: float, gpus_used_peak: float | None, gpu_mem_mib: int, mem_peak_mib: int | None) -> str:
    new_gpus, new_mem = suggest(gpus, gpus_used_peak, gpu_mem_mib, mem_peak_mib)
    parts = []
    if new_gpus != gpus:
        parts.append(f"asked {gpus:g} GPUs, used at most {gpus_used_peak:.1f}: ask for {new_gpus:g}")
    if new_mem != gpu_mem_mib and mem_peak_mib is not None:
        where = "over the" if mem_peak_mib > gpu_mem_mib else "of"
        parts.append(f"peak {gb(mem_peak_mib)} {where} {gb(gpu_mem_mib)} requested: ask for {gb(new_mem)}")
    return "; ".join(parts) or "the request fits what it used"


def _sql() -> tuple[str, str]:
    """``suggest`` over the columns gpus, gpus_used_peak, gpu_mem_mib, mem_peak_mib."""
    gpus = (f"CASE WHEN gpus >= 2 AND gpus_used_peak IS NOT NULL "
            f"THEN least(gpus, greatest(1, ceil(gpus_used_peak - {GPU_NOISE}::DOUBLE)))::DOUBLE ELSE gpus END")
    fit = f"(ceil(mem_peak_mib * {MEM_HEADROOM}::DOUBLE / {MIB_PER_GB}) * {MIB_PER_GB})::BIGINT"
    mem = (f"CASE WHEN gpu_mem_mib > 0 AND mem_peak_mib IS NOT NULL AND ({fit} <= gpu_mem_mib * {MEM_SLACK}::DOUBLE "
           f"OR mem_peak_mib > gpu_mem_mib) THEN {fit} ELSE gpu_mem_mib END")
    return gpus, mem


SUGGEST_SQL = _sql()  # (suggested GPUs, suggested GPU memory MiB) as SQL expressions
