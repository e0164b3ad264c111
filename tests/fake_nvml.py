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
- ``ok``: healthy again (a GPU coming back).

Two ways in: ``FakeNvml()`` passed as ``NvmlBackend(nvml=...)``, or, for a
real daemon, ``EVENTSCHED_TEST_NVML=<this file>`` with
``EVENTSCHED_TEST_NVML_SCRIPT=<json>``: ``{"gpus": N, "mem_mib": M,
"faults": [[after_s, gpu, fault], ...]}`` (seconds after the daemon loads NVML).
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Any

import pynvml

_MIB = 1024 * 1024


class FakeNvml:
    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(self, gpus: int = 2, mem_mib: int = 40960, script: list[tuple[float, int, str]] | None = None) -> None:
        self.n = gpus
        self.mem_mib = mem_mib
        self.faults: dict[int, str] = {}
        self.script = sorted(script or [])
        self.started = time.monotonic()
        self.calls = 0

    def set_fault(self, gpu: int, fault: str) -> None:
        if fault == "ok":
            self.faults.pop(gpu, None)
        else:
            self.faults[gpu] = fault

    def _advance(self) -> None:
        elapsed = time.monotonic() - self.started
        while self.script and self.script[0][0] <= elapsed:
            _, gpu, fault = self.script.pop(0)
            self.set_fault(gpu, fault)

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
        pass

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


def _from_env() -> FakeNvml:
    raw = os.environ.get("EVENTSCHED_TEST_NVML_SCRIPT", "")
    spec = json.loads(raw) if raw else {}
    script = [(float(a), int(g), str(f)) for a, g, f in spec.get("faults", [])]
    return FakeNvml(int(spec.get("gpus", 2)), int(spec.get("mem_mib", 40960)), script)


_DEFAULT: FakeNvml | None = None


def __getattr__(name: str) -> Any:
    """Loaded as a module (``EVENTSCHED_TEST_NVML``): one fake, from the script."""
    global _DEFAULT
    if name.startswith("__"):
        raise AttributeError(name)
    if _DEFAULT is None:
        _DEFAULT = _from_env()
    return getattr(_DEFAULT, name)
