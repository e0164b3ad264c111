"""GPU observation: NVML on real machines, simulated GPUs everywhere else.

Both backends answer the same two questions: which GPUs are there
(``discover``) and how are they now (``sample``). A sample is a list of
``GpuObserved`` / ``GpuFailed`` messages for the engine's inbox; an NVML error
is one of those messages, never an exception. Both calls block (NVML calls
take milliseconds): the engine runs them in a worker thread.

``significant`` is the pure rule that keeps the log lean: a sample is appended
only when it changed meaningfully, or when the last one logged is a minute old.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol, runtime_checkable

from eventsched.domain.messages import GpuFailed, GpuInfo, GpuObserved
from eventsched.domain.units import DEFAULT_FAKE_MEM_MIB, UnitError, parse_fake_gpus

__all__ = [
    "GpuBackend",
    "GpuSpecError",
    "NvmlUnavailable",
    "NvmlBackend",
    "FakeBackend",
    "parse_gpus_option",
    "significant",
    "DEFAULT_FAKE_MEM_MIB",
]

_MIB = 1024 * 1024


class GpuSpecError(ValueError):
    """A ``--gpus`` value that makes no sense; ``str(e)`` is one line."""


class NvmlUnavailable(RuntimeError):
    """No NVIDIA driver (or no GPU) here; ``str(e)`` says how to use fake GPUs."""


GpuSample = GpuObserved | GpuFailed


@runtime_checkable
class GpuBackend(Protocol):
    name: str  # recorded as DaemonStarted.gpu_backend: "nvml", "fake:4:81920"
    node: str

    def discover(self) -> list[GpuInfo]: ...

    def sample(self, job_pids: Collection[int] = ()) -> list[GpuSample]:
        """One observation per GPU. ``job_pids``: the scheduler's jobs and
        their descendants; GPU memory of any other process is foreign (F2)."""
        ...

    def set_load(self, gpu: int, share: float, reserved_mib: int) -> None:
        """What the scheduler placed on ``gpu`` (total share, reserved MiB).
        Real GPUs see their load for themselves and ignore it; fake ones
        report it back, as real ones would."""
        ...

    def close(self) -> None: ...


# --- NVML -----------------------------------------------------------------


class NvmlBackend:
    """Real GPUs through nvidia-ml-py. Indices are NVML's (PCI bus order); the
    executor sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA agrees."""

    name = "nvml"

    def __init__(self, node: str = "local") -> None:
        import pynvml  # only here: fake-GPU daemons and the CLI never pay for it

        self._nvml = pynvml
        self.node = node
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(
                f"cannot use NVIDIA GPUs here (NVML: {e}); "
                "to run on simulated GPUs, use --gpus fake:N[:MEM_MIB], e.g. --gpus fake:4"
            ) from None
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            pynvml.nvmlShutdown()
            raise NvmlUnavailable(f"NVML cannot count GPUs ({e}); use --gpus fake:N for simulated GPUs") from None
        if count == 0:
            pynvml.nvmlShutdown()
            raise NvmlUnavailable("NVML found no GPUs; use --gpus fake:N for simulated GPUs")
        self._count = count

    def discover(self) -> list[GpuInfo]:
        nv = self._nvml
        out = []
        for i in range(self._count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(nv.nvmlDeviceGetUUID(h))
                model = _text(nv.nvmlDeviceGetName(h))
                total = nv.nvmlDeviceGetMemoryInfo(h).total // _MIB
            except nv.NVMLError:
                continue  # a GPU we cannot read now shows up as GpuFailed in samples
            out.append(GpuInfo(gpu=i, uuid=uuid, model=model, memory_total_mib=int(total)))
        return out

    def sample(self, job_pids: Collection[int] = ()) -> list[GpuSample]:
        pids = job_pids if isinstance(job_pids, (set, frozenset)) else set(job_pids)
        return [self._sample_one(i, pids) for i in range(self._count)]

    def _sample_one(self, i: int, job_pids: Collection[int]) -> GpuSample:
        nv = self._nvml
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            util = self._optional(lambda: float(nv.nvmlDeviceGetUtilizationRates(h).gpu), 0.0)
            temp = self._optional(
                lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)), 0.0
            )
            power = self._optional(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0, 0.0)
            foreign = self._foreign_mib(h, job_pids)
        except nv.NVMLError as e:
            lost = getattr(e, "value", None) == nv.NVML_ERROR_GPU_IS_LOST
            return GpuFailed(node=self.node, gpu=i, error=f"NVML: {e}", lost=lost)
        return GpuObserved(
            node=self.node,
            gpu=i,
            utilization=util,
            memory_used_mib=int(mem.used // _MIB),
            memory_total_mib=int(mem.total // _MIB),
            temperature_c=temp,
            power_w=power,
            foreign_memory_mib=foreign,
        )

    def _optional(self, read: Callable[[], float], default: float) -> float:
        """A reading the card does not support is absent, not an error."""
        try:
            return read()
        except self._nvml.NVMLError_NotSupported:
            return default

    def _foreign_mib(self, h: object, job_pids: Collection[int]) -> int:
        nv = self._nvml
        used: dict[int, int] = {}  # pid -> bytes; a pid may be in both lists
        try:
            procs = list(nv.nvmlDeviceGetComputeRunningProcesses(h))
            procs += nv.nvmlDeviceGetGraphicsRunningProcesses(h)
        except nv.NVMLError_NotSupported:
            return -1  # unknown, not zero
        for p in procs:
            if p.pid not in job_pids:
                # usedGpuMemory is None when the driver cannot tell (e.g. Windows WDDM)
                used[p.pid] = max(used.get(p.pid, 0), int(p.usedGpuMemory or 0))
        return sum(used.values()) // _MIB

    def set_load(self, gpu: int, share: float, reserved_mib: int) -> None:
        pass  # the driver reports what the jobs really use

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --- simulated GPUs -------------------------------------------------------


class FakeBackend:
    """N simulated GPUs whose samples follow what the scheduler placed on
    them: the engine calls ``set_load`` after every placement change.
    Deterministic (small jitter from a sample counter), for tests and replay."""

    def __init__(self, n: int, mem_mib: int = DEFAULT_FAKE_MEM_MIB, *, node: str = "local") -> None:
        if n < 1:
            raise GpuSpecError(f"fake GPUs: need at least 1 GPU, got {n}")
        if mem_mib < 1:
            raise GpuSpecError(f"fake GPUs: memory must be at least 1 MiB, got {mem_mib}")
        self.n = n
        self.mem_mib = mem_mib
        self.node = node
        self.name = f"fake:{n}:{mem_mib}"
        self._share = [0.0] * n
        self._reserved = [0] * n
        self._foreign = [0] * n
        self._failed: dict[int, tuple[str, bool]] = {}
        self._tick = 0

    def discover(self) -> list[GpuInfo]:
        return [
            GpuInfo(gpu=i, uuid=f"GPU-fake-{self.node}-{i}", model="Fake GPU", memory_total_mib=self.mem_mib)
            for i in range(self.n)
            if not self._failed.get(i, ("", False))[1]
        ]

    # hooks for the engine and tests
    def set_load(self, gpu: int, share: float, reserved_mib: int) -> None:
        """What the scheduler has placed on ``gpu``: total share (0..1) and
        reserved memory in MiB. Absolute, not incremental."""
        self._check(gpu)
        self._share[gpu] = min(max(share, 0.0), 1.0)
        self._reserved[gpu] = max(reserved_mib, 0)

    def set_foreign(self, gpu: int, mib: int) -> None:
        """Memory held by a process outside the scheduler (F2)."""
        self._check(gpu)
        self._foreign[gpu] = max(mib, 0)

    def fail(self, gpu: int, error: str = "simulated failure", *, lost: bool = False) -> None:
        self._check(gpu)
        self._failed[gpu] = (error, lost)

    def heal(self, gpu: int) -> None:
        self._failed.pop(gpu, None)

    def _check(self, gpu: int) -> None:
        if not 0 <= gpu < self.n:
            raise IndexError(f"no fake GPU {gpu} (there are {self.n})")

    def sample(self, job_pids: Collection[int] = ()) -> list[GpuSample]:
        self._tick += 1
        out: list[GpuSample] = []
        for i in range(self.n):
            if i in self._failed:
                error, lost = self._failed[i]
                out.append(GpuFailed(node=self.node, gpu=i, error=error, lost=lost))
                continue
            share = self._share[i]
            # +-2 points of deterministic jitter on a busy GPU: under the
            # 5-point "significant" threshold, so it does not bloat the log
            jitter = float((self._tick * 7 + i * 3) % 5 - 2) if share > 0 else 0.0
            util = min(100.0, max(0.0, share * 100.0 + jitter))
            used = min(self.mem_mib, self._reserved[i] + self._foreign[i])
            out.append(
                GpuObserved(
                    node=self.node,
                    gpu=i,
                    utilization=util,
                    memory_used_mib=used,
                    memory_total_mib=self.mem_mib,
                    temperature_c=round(30.0 + 0.5 * util, 1),  # 30 C idle, 80 C flat out
                    power_w=round(60.0 + 3.4 * util, 1),  # 60 W idle, 400 W flat out
                    foreign_memory_mib=self._foreign[i],
                )
            )
        return out

    def close(self) -> None:
        pass


# --- choosing a backend ------------------------------------------------------


def parse_gpus_option(text: str | None, *, node: str = "local") -> GpuBackend:
    """``--gpus``: ``fake:N[:MEM_MIB]`` for simulated GPUs, ``nvml`` (or
    nothing) for the real ones. Raises ``GpuSpecError`` for a bad value and
    ``NvmlUnavailable`` when NVML is asked for but absent."""
    text = (text or "").strip()
    if text in ("", "nvml"):
        return NvmlBackend(node=node)
    if not text.startswith("fake"):
        raise GpuSpecError(f"--gpus {text!r}: expected 'nvml' or 'fake:N[:MEM_MIB]' (e.g. fake:4 or fake:2:40960)")
    try:
        n, mem = parse_fake_gpus(text)
    except UnitError as exc:
        raise GpuSpecError(str(exc)) from None
    return FakeBackend(n, mem, node=node)


# --- what is worth logging --------------------------------------------------


def significant(
    prev: GpuObserved | None,
    new: GpuObserved,
    *,
    last_ts: float,
    now: float,
    min_interval_s: float = 60.0,
) -> bool:
    """Should ``new`` be appended, given ``prev`` (the last one logged for this
    GPU, at ``last_ts``)? Yes on a meaningful change or when it is stale."""
    if prev is None or now - last_ts >= min_interval_s:
        return True
    mem_step = min(256, 0.02 * max(new.memory_total_mib, 1))
    return (
        abs(new.utilization - prev.utilization) >= 5.0
        or abs(new.memory_used_mib - prev.memory_used_mib) >= mem_step
        or abs(new.foreign_memory_mib - prev.foreign_memory_mib) >= mem_step
        or abs(new.temperature_c - prev.temperature_c) >= 3.0
        or new.memory_total_mib != prev.memory_total_mib
    )
