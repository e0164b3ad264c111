"""GPU health as the driver reports it, for both backends (docs/gpu-health.md).

A reading the GPU does not support is -1 (no reading), never an error; a GPU
that stays sick adds nothing to the log (``HealthChanges``). Fake GPUs take
faults by name (``apply_fault``), as tests/fake_nvml.py does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import msgspec

from eventsched.domain.events import GpuHealth
from eventsched.domain.gpu_health import same_reading
from eventsched.domain.messages import GpuHealthRead

__all__ = ["NvmlHealth", "HealthChanges", "apply_fault", "HEALTH_FAULTS"]

XID_WAIT_MS = 1  # how long one wait for an Xid event may block the sampler's thread
MAX_XIDS = 64  # events taken per sample: a storm waits for the next one


class HealthChanges:
    """The readings worth sending: a change or an Xid. The core compares
    again, with what the log last said."""

    def __init__(self, node: str) -> None:
        self._node = node
        self._last: dict[int, GpuHealth] = {}

    def keep(self, gpu: int, reading: GpuHealth | None, xids: list[int]) -> GpuHealthRead | None:
        """``reading`` None: the GPU cannot be read now; its Xids still count,
        with what it said last."""
        prev = self._last.get(gpu)
        if reading is None:
            if not xids:
                return None
            reading = prev or GpuHealth(node=self._node, gpu=gpu)
        reading = msgspec.structs.replace(reading, xids=list(xids))
        if same_reading(prev, reading):  # (a first reading of nothing says nothing either)
            return None
        self._last[gpu] = msgspec.structs.replace(reading, xids=[])
        return GpuHealthRead(reading=reading)


class NvmlHealth:
    """Health readings and Xid events of NVML's GPUs ``0..count-1``: Xids are
    waited for with a short timeout, in the sampler's thread."""

    def __init__(self, nvml: Any, node: str, count: int) -> None:
        self._nv, self._node, self._count = nvml, node, count
        self._events = self._event_set()

    def _event_set(self) -> Any:
        """An event set with every GPU that can report Xids (None: none can)."""
        nv = self._nv
        try:
            events = nv.nvmlEventSetCreate()
        except (nv.NVMLError, AttributeError):  # an NVML too old for events
            return None
        registered = 0
        for i in range(self._count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                if nv.nvmlDeviceGetSupportedEventTypes(h) & nv.nvmlEventTypeXidCriticalError:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, events)
                    registered += 1
            except nv.NVMLError:
                continue  # this GPU reports no Xids; its counters are still read
        if not registered:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(events)
            return None
        return events

    def xids(self) -> dict[int, list[int]]:
        nv = self._nv
        out: dict[int, list[int]] = {}
        for _ in range(MAX_XIDS if self._events is not None else 0):
            try:
                data = nv.nvmlEventSetWait(self._events, XID_WAIT_MS)
            except nv.NVMLError:  # Timeout: no more now; anything else: try again next sample
                break
            if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                continue
            try:
                gpus = [int(nv.nvmlDeviceGetIndex(data.device))]
            except nv.NVMLError:  # an event of no one GPU is every GPU's, as NVIDIA's device plugin reads it
                gpus = list(range(self._count))
            for gpu in gpus:
                out.setdefault(gpu, []).append(int(data.eventData))
        return out

    def read(self, i: int) -> GpuHealth | None:
        """GPU ``i``'s counters and flags (None: it cannot be read now)."""
        nv = self._nv
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)

            def ecc(kind: int, counter: int) -> int:
                return self._supported(lambda: int(nv.nvmlDeviceGetTotalEccErrors(h, kind, counter)), -1)

            unc, cor = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
            causes = (nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                      nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
            retired = self._supported(lambda: sum(len(nv.nvmlDeviceGetRetiredPages(h, c)) for c in causes), -1)
            pages_pending = self._supported(
                lambda: int(nv.nvmlDeviceGetRetiredPagesPendingStatus(h) == nv.NVML_FEATURE_ENABLED), 0)
            # (rows corrected, rows uncorrected, remap pending, remap failed): Ampere and newer
            rows = self._supported(lambda: tuple(nv.nvmlDeviceGetRemappedRows(h)), (0, 0, 0, 0))
            return GpuHealth(node=self._node, gpu=i, ecc_uncorrected=ecc(unc, nv.NVML_VOLATILE_ECC),
                             ecc_corrected=ecc(cor, nv.NVML_VOLATILE_ECC),
                             ecc_uncorrected_total=ecc(unc, nv.NVML_AGGREGATE_ECC),
                             ecc_corrected_total=ecc(cor, nv.NVML_AGGREGATE_ECC), retired_pages=retired,
                             pending=bool(pages_pending or rows[2]), remap_failed=bool(rows[3]))
        except nv.NVMLError:  # not "not supported": a fault, which the sample reports; skip it this time
            return None

    def _supported(self, read: Callable[[], Any], unsupported: Any) -> Any:
        nv = self._nv
        try:
            return read()
        # (a driver or binding older than the call: not supported either)
        except (nv.NVMLError_NotSupported, getattr(nv, "NVMLError_FunctionNotFound", nv.NVMLError_NotSupported),
                AttributeError):
            return unsupported

    def close(self) -> None:
        if self._events is not None:
            with contextlib.suppress(self._nv.NVMLError):
                self._nv.nvmlEventSetFree(self._events)
            self._events = None


# what a fake GPU can be made to report (tests/fake_nvml.py knows the same names)
HEALTH_FAULTS = ("ecc", "ecc-corrected", "retired", "remap", "remap-failed", "xid:N")


def apply_fault(reading: GpuHealth, fault: str) -> tuple[GpuHealth, int]:
    """``reading`` after ``fault`` (one of ``HEALTH_FAULTS``), and the Xid it raises (0: none)."""
    def counted(*fields: str) -> dict[str, int]:  # -1 (no reading) counts from 0
        return {f: max(getattr(reading, f), 0) + 1 for f in fields}

    changes: dict[str, dict[str, Any]] = {
        "ecc": counted("ecc_uncorrected", "ecc_uncorrected_total"),
        "ecc-corrected": counted("ecc_corrected", "ecc_corrected_total"),
        "retired": {**counted("retired_pages"), "pending": True},
        "remap": {"pending": True},
        "remap-failed": {"remap_failed": True},
    }
    if fault in changes:
        return msgspec.structs.replace(reading, **changes[fault]), 0
    if fault.startswith("xid:") and fault[4:].isdigit():
        return reading, int(fault[4:])
    raise ValueError(f"unknown GPU health fault {fault!r}; known: {', '.join(HEALTH_FAULTS)}")
