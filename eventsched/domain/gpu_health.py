"""GPU health: when the driver's readings (``GpuHealth``) take a GPU out of
service until ``resume-gpu`` (docs/gpu-health.md). Pure: no NVML here."""

from __future__ import annotations

from functools import lru_cache
from operator import attrgetter
from typing import Annotated, Any, Literal

import msgspec

from eventsched.domain.events import GpuHealth
from eventsched.domain.messages import SchedulerConfig

__all__ = ["GpuHealthConfig", "drain_reason", "describe", "same_reading", "xid_text", "HEALTHY", "PREFIX"]

PREFIX = "gpu_health_"  # the [gpu_health] keys, as the scheduler's settings record them
_D = SchedulerConfig()

# the Xids an operator meets most (NVIDIA's Xid catalogue); others are shown by number
_XID_NAMES = {
    13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    48: "double-bit ECC error", 63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failed", 74: "NVLink error", 79: "fallen off the bus",
    92: "high single-bit ECC error rate", 94: "contained ECC error", 95: "uncontained ECC error",
    119: "GSP RPC timeout", 120: "GSP error",
}


class GpuHealthConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The config file's ``[gpu_health]``: what drains a GPU. Defaults: the scheduler's."""

    ecc_uncorrected: Annotated[int, msgspec.Meta(ge=0)] = _D.gpu_health_ecc_uncorrected
    ecc_corrected: Annotated[int, msgspec.Meta(ge=0)] = _D.gpu_health_ecc_corrected
    retired_pages: Annotated[int, msgspec.Meta(ge=0)] = _D.gpu_health_retired_pages
    pending: bool = _D.gpu_health_pending
    xids: list[Annotated[int, msgspec.Meta(ge=1)]] = msgspec.field(
        default_factory=lambda: [int(x) for x in _D.gpu_health_xids.split(",")])
    lost: bool = _D.gpu_health_lost
    running: Literal["finish", "requeue"] = _D.gpu_health_running

    def settings(self) -> dict[str, Any]:
        """As ``SchedulerConfig`` fields: the log records scalars (the Xids as "48,79")."""
        raw = msgspec.to_builtins(self)
        raw["xids"] = ",".join(str(x) for x in sorted(set(self.xids)))
        return {PREFIX + k: v for k, v in raw.items()}


HEALTHY = GpuHealth(node="", gpu=-1)  # what a GPU that says nothing reads as


@lru_cache(maxsize=8)
def _xids(text: str) -> frozenset[int]:
    return frozenset(int(x) for x in text.split(",") if x.strip().isdigit())


def xid_text(code: int) -> str:
    name = _XID_NAMES.get(code)
    return f"Xid {code} ({name})" if name else f"Xid {code}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def drain_reason(r: GpuHealth, cfg: SchedulerConfig) -> str:
    """Why ``r`` drains its GPU ("" when it does not)."""
    fatal = [x for x in r.xids if x in _xids(cfg.gpu_health_xids)]
    if fatal:
        return xid_text(fatal[-1])
    if 0 < cfg.gpu_health_ecc_uncorrected <= r.ecc_uncorrected:
        return _count(r.ecc_uncorrected, "uncorrected ECC error")
    if cfg.gpu_health_pending and r.remap_failed:
        return "a memory row could not be remapped (no spare rows left)"
    if cfg.gpu_health_pending and r.pending:
        return "memory repair pending a GPU reset (page retirement or row remap)"
    if 0 < cfg.gpu_health_retired_pages <= r.retired_pages:
        return _count(r.retired_pages, "retired memory page")
    if 0 < cfg.gpu_health_ecc_corrected <= r.ecc_corrected:
        return _count(r.ecc_corrected, "corrected ECC error")
    return ""


def describe(r: GpuHealth) -> str:
    parts = [xid_text(x) for x in r.xids]
    for n, what in ((r.ecc_uncorrected, "uncorrected ECC error"), (r.ecc_corrected, "corrected ECC error"),
                    (r.retired_pages, "retired memory page")):
        if n > 0:
            parts.append(_count(n, what))
    parts += ["memory repair pending a reset"] * r.pending + ["a row remap failed"] * r.remap_failed
    return ", ".join(parts) or "no fault"


_COUNTERS = attrgetter("ecc_uncorrected", "ecc_corrected", "ecc_uncorrected_total", "ecc_corrected_total",
                       "retired_pages", "pending", "remap_failed")


def same_reading(prev: GpuHealth | None, new: GpuHealth) -> bool:
    """Do the counters and flags of ``new`` say what ``prev`` said (Xids are always news)?"""
    return not new.xids and _COUNTERS(prev or HEALTHY) == _COUNTERS(new)
