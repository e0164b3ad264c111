"""A stand-in for ``pynvml`` that fails the way real GPUs do (test only).

It answers the calls ``eventsched.runtime.gpus.NvmlBackend`` makes and raises
nvidia-ml-py's own exceptions (``pynvml.NVMLError(code)`` is the matching
subclass: ``NVMLError_GpuIsLost``, ``NVMLError_Timeout``...), so the real
backend's error paths run. Faults per GPU:

- ``lost``: every call on it raises ``NVMLError_GpuIsLost`` (Xid 79, fallen off the bus);
- ``timeout``: reading its memory raises ``NVMLError_Timeout``;
- ``unknown``: reading its memory raises ``NVMLError_Unknown``;
- ``xid``: memory reads fine, then the temperature raises ``NVMLError_Unknown``
  (an Xid 13/43-style fault half-way through a sample);
- ``gone``: its handle cannot be had (``NVMLError_NotFound``), as if unplugged;
- ``negative-mem``, ``hot`` (300 C), ``overfull`` (used > total): absurd readings;
- ``ok``: healthy again (a GPU coming back; reset: its health counters clear).

Health faults (read by ``eventsched.runtime.gpus.health``; a GPU given none
supports no ECC, as a consumer card): ``ecc`` (one more uncorrected ECC
error), ``ecc-corrected``, ``retired`` (a page retired, pending a reset),
``remap`` (a row remap pending), ``remap-failed``, ``xid:N`` (an Xid event N
on the NVML event set).

Two ways in: ``FakeNvml()`` passed as ``NvmlBackend(nvml=...)``, or, for a
real daemon, ``EVENTSCHED_TEST_NVML=<this file>`` with
``EVENTSCHED_TEST_NVML_SCRIPT=<json>``: ``{"gpus": N, "mem_mib": M,
"faults": [[after_s, gpu, fault], ...], "faults_file": PATH}`` (seconds after
the daemon loads NVML; a line "GPU FAULT" appended to the faults file applies
at the next NVML call, for a test that injects a fault when it is ready;
``"released_file": PATH`` gets a line per release call, ``nvmlEventSetFree`` and
``nvmlShutdown``, for a test that checks the daemon lets NVML go).
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Any

import pynvml

from eventsched.domain.events import GpuHealth
from eventsched.runtime.gpus.health import apply_fault

_MIB = 1024 * 1024


class FakeNvml:
    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(self, gpus: int = 2, mem_mib: int = 40960, script: list[tuple[float, int, str]] | None = None,
                 faults_file: str = "", released_file: str = "") -> None:
        self.n = gpus
        self.mem_mib = mem_mib
        self.faults: dict[int, str] = {}
        self.script = sorted(script or [])
        self.started = time.monotonic()
        self.calls = 0
        self.health: dict[int, GpuHealth] = {}  # GPUs given health faults (the others support no ECC)
        self.xid_queue: list[tuple[int, int]] = []  # (gpu, Xid) waiting on the event set
        self.faults_file, self._faults_read = faults_file, 0
        self.released_file = released_file

    def _released(self, call: str) -> None:
        if self.released_file:
            with open(self.released_file, "a") as f:
                f.write(call + "\n")

    def __getattr__(self, name: str) -> Any:
        """NVML's constants and exception types, as pynvml has them."""
        if name.startswith(("NVML", "nvmlEventType")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def set_fault(self, gpu: int, fault: str) -> None:
        if fault == "ok":
            self.faults.pop(gpu, None)
            if gpu in self.health:
                self.health[gpu] = GpuHealth(node="", gpu=gpu, ecc_uncorrected=0, ecc_corrected=0)
        elif fault in ("ecc", "ecc-corrected", "retired", "remap", "remap-failed") or fault.startswith("xid:"):
            zero = GpuHealth(node="", gpu=gpu, ecc_uncorrected=0, ecc_corrected=0)
            self.health[gpu], xid = apply_fault(self.health.get(gpu, zero), fault)
            if xid:
                self.xid_queue.append((gpu, xid))
        else:
            self.faults[gpu] = fault

    def _advance(self) -> None:
        elapsed = time.monotonic() - self.started
        while self.script and self.script[0][0] <= elapsed:
            _, gpu, fault = self.script.pop(0)
            self.set_fault(gpu, fault)
        if self.faults_file and os.path.exists(self.faults_file):
            with open(self.faults_file) as f:
                f.seek(self._faults_read)
                text = f.read()
            whole = text[:text.rfind("\n") + 1]  # a line still being written waits
            self._faults_read += len(whole)
            for line in whole.splitlines():
                gpu, fault = line.split()
                self.set_fault(int(gpu), fault)

    def _raise_if(self, gpu: int, *faults: str) -> None:
        fault = self.faults.get(gpu)
        if fault == "lost":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if fault in faults:
            code = {"timeout": pynvml.NVML_ERROR_TIMEOUT, "gone": pynvml.NVML_ERROR_NOT_FOUND}
            raise pynvml.NVMLError(code.get(fault, pynvml.NVML_ERROR_UNKNOWN))

    # --- the calls NvmlBackend makes ---

    def nvmlInit(self) -> None:
        self.started = time.monotonic()

    def nvmlShutdown(self) -> None:
        self._released("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self.calls += 1
        self._advance()
        if not 0 <= i < self.n:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._raise_if(i, "gone")
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        self._raise_if(h)
        return f"GPU-fakenvml-{h}"

    def nvmlDeviceGetName(self, h: int) -> bytes:
        self._raise_if(h)
        return b"Fake NVML GPU"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        self._raise_if(h, "timeout", "unknown")
        total = self.mem_mib * _MIB
        used = {"negative-mem": -512 * _MIB, "overfull": total + 1024 * _MIB}.get(self.faults.get(h, ""), 0)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        self._raise_if(h)
        return SimpleNamespace(gpu=0, memory=0)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        self._raise_if(h, "xid")
        return 300 if self.faults.get(h) == "hot" else 35

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self._raise_if(h)
        return 60_000

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        self._raise_if(h)
        return []

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[Any]:
        self._raise_if(h)
        return []

    # --- health: ECC, retired pages, row remaps, Xid events ---

    def _health(self, h: int) -> GpuHealth:
        self._raise_if(h)
        if h not in self.health:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.health[h]

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        r = self._health(h)
        volatile = counter == pynvml.NVML_VOLATILE_ECC
        if kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return max(0, r.ecc_uncorrected if volatile else r.ecc_uncorrected_total)
        return max(0, r.ecc_corrected if volatile else r.ecc_corrected_total)

    def nvmlDeviceGetRetiredPages(self, h: int, cause: int) -> list[int]:
        r = self._health(h)
        n = max(0, r.retired_pages) if cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR else 0
        return [0x1000 * (i + 1) for i in range(n)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        r = self._health(h)
        return pynvml.NVML_FEATURE_ENABLED if r.pending and r.retired_pages > 0 else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        r = self._health(h)
        return (0, int(r.pending or r.remap_failed), int(r.pending), int(r.remap_failed))

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlEventSetFree(self, events: object) -> None:
        self._released("nvmlEventSetFree")

    def nvmlDeviceGetSupportedEventTypes(self, h: int) -> int:
        return pynvml.nvmlEventTypeXidCriticalError

    def nvmlDeviceRegisterEvents(self, h: int, types: int, events: object) -> None:
        pass

    def nvmlEventSetWait(self, events: object, timeout_ms: int) -> Any:
        self._advance()
        if not self.xid_queue:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        gpu, xid = self.xid_queue.pop(0)
        return SimpleNamespace(device=gpu, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid)

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h


def _from_env() -> FakeNvml:
    raw = os.environ.get("EVENTSCHED_TEST_NVML_SCRIPT", "")
    spec = json.loads(raw) if raw else {}
    script = [(float(a), int(g), str(f)) for a, g, f in spec.get("faults", [])]
    return FakeNvml(int(spec.get("gpus", 2)), int(spec.get("mem_mib", 40960)), script, str(spec.get("faults_file", "")),
                    str(spec.get("released_file", "")))


_DEFAULT: FakeNvml | None = None


def __getattr__(name: str) -> Any:
    """Loaded as a module (``EVENTSCHED_TEST_NVML``): one fake, from the script."""
    global _DEFAULT
    if name.startswith("__"):
        raise AttributeError(name)
    if _DEFAULT is None:
        _DEFAULT = _from_env()
    return getattr(_DEFAULT, name)
