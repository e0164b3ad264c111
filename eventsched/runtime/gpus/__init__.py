"""GPU observation: NVML on real machines, simulated GPUs everywhere else.

Both backends block (the engine calls them in a thread) and report an NVML
error as a ``GpuFailed`` message, never an exception. Health readings are
``health.py`` (docs/gpu-health.md). Fake GPUs take their per-process memory
and utilization from what processes *declare* in their environment
(``FAKE_MEM_VAR``, ``FAKE_UTIL_VAR``): docs/gpu-memory-and-idle.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from eventsched.domain.events import GpuHealth, GpuProcess
from eventsched.domain.messages import GpuFailed, GpuHealthRead, GpuInfo, GpuObserved
from eventsched.domain.units import DEFAULT_FAKE_MEM_MIB, UnitError, parse_fake_gpus
from eventsched.runtime.gpus.health import HEALTH_FAULTS, HealthChanges, NvmlHealth, apply_fault

if TYPE_CHECKING:
    from eventsched.projections.cluster import ClusterState

__all__ = [
    "GpuBackend", "GpuSpecError", "NvmlUnavailable", "NvmlBackend", "FakeBackend", "parse_gpus_option", "significant",
    "SampleFilter", "attribute", "FAKE_MEM_VAR", "FAKE_UTIL_VAR", "TEST_NVML_VAR", "absurd_reading", "DEFAULT_FAKE_MEM_MIB",
    "HEALTH_FAULTS",
]

FAKE_MEM_VAR = "EVENTSCHED_FAKE_GPU_MEM_MIB"
FAKE_UTIL_VAR = "EVENTSCHED_FAKE_GPU_UTIL"
# test only: a Python file loaded in place of ``pynvml`` (tests/fake_nvml.py)
TEST_NVML_VAR = "EVENTSCHED_TEST_NVML"

_MIB = 1024 * 1024


class GpuSpecError(ValueError):
    """A ``--gpus`` value that makes no sense; ``str(e)`` is one line."""


class NvmlUnavailable(RuntimeError):
    """No NVIDIA driver (or no GPU) here; ``str(e)`` says how to use fake GPUs."""


GpuSample = GpuObserved | GpuFailed | GpuHealthRead


@runtime_checkable
class GpuBackend(Protocol):
    name: str  # recorded as DaemonStarted.gpu_backend: "nvml", "fake:4:81920"
    node: str

    def discover(self) -> list[GpuInfo]: ...

    def sample(self, job_pids: Collection[int] = ()) -> list[GpuSample]:
        """``job_pids``: our jobs' processes (a ``{pid: job}`` attributes
        their memory per job); any other is foreign."""
        ...

    def set_load(self, gpu: int, share: float, reserved_mib: int) -> None:
        """What the scheduler placed on ``gpu``: fake GPUs report it back."""
        ...

    def close(self) -> None: ...


# --- NVML -----------------------------------------------------------------


class NvmlBackend:
    """Real GPUs through nvidia-ml-py. Indices are NVML's (PCI bus order); the
    executor sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA agrees."""

    name = "nvml"

    def __init__(self, node: str = "local", nvml: Any = None) -> None:
        self._nvml = pynvml = nvml if nvml is not None else _load_nvml()
        self.node = node
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(
                f"cannot use NVIDIA GPUs here (NVML: {e}); "
                "to run on simulated GPUs, use --gpus fake:N[:MEM_MIB], e.g. --gpus fake:4"
            ) from None
        try:
            count, why = pynvml.nvmlDeviceGetCount(), "NVML found no GPUs"
        except pynvml.NVMLError as e:
            count, why = 0, f"NVML cannot count GPUs ({e})"
        if count == 0:
            pynvml.nvmlShutdown()
            raise NvmlUnavailable(f"{why}; use --gpus fake:N for simulated GPUs")
        self._count = count
        self._health = NvmlHealth(pynvml, node, count)
        self._health_changes = HealthChanges(node)

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
        pids = job_pids if isinstance(job_pids, (set, frozenset, Mapping)) else set(job_pids)
        owners: dict[int, tuple[int, str]] = {}  # one /proc look-up per foreign pid per sample
        samples: list[GpuSample] = [self._sample_one(i, pids, owners) for i in range(self._count)]
        failed = {s.gpu for s in samples if isinstance(s, GpuFailed)}
        xids = self._health.xids()
        for i in range(self._count):  # a failed GPU's counters wait; its Xids do not
            health = self._health_changes.keep(i, None if i in failed else self._health.read(i), xids.get(i, []))
            if health is not None:
                samples.append(health)
        return samples

    def _sample_one(self, i: int, job_pids: Collection[int], owners: dict[int, tuple[int, str]]) -> GpuSample:
        nv = self._nvml
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            util = self._optional(lambda: float(nv.nvmlDeviceGetUtilizationRates(h).gpu), 0.0)
            temp = self._optional(lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)), 0.0)
            power = self._optional(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0, 0.0)
            procs = self._processes(h)
        except nv.NVMLError as e:
            lost = getattr(e, "value", None) == nv.NVML_ERROR_GPU_IS_LOST
            return GpuFailed(node=self.node, gpu=i, error=f"NVML: {e}", lost=lost)
        absurd = absurd_reading(int(mem.used // _MIB), int(mem.total // _MIB), util, temp, power)
        if absurd:  # a driver glitch: recorded as an error, never used for placement
            return GpuFailed(node=self.node, gpu=i, error=f"NVML: absurd reading: {absurd}")
        # the driver cannot list processes: foreign memory unknown (-1), not zero
        jobs, others, foreign = attribute(procs.items(), job_pids, owners) if procs is not None else ({}, [], -1)
        return GpuObserved(node=self.node, gpu=i, utilization=util, memory_used_mib=int(mem.used // _MIB),
                           memory_total_mib=int(mem.total // _MIB), temperature_c=temp, power_w=power,
                           foreign_memory_mib=foreign, job_memory_mib=jobs, foreign_processes=others)

    def _optional(self, read: Callable[[], float], default: float) -> float:
        """A reading the card does not support is absent, not an error."""
        try:
            return read()
        except self._nvml.NVMLError_NotSupported:
            return default

    def _processes(self, h: object) -> dict[int, int] | None:
        """{pid: MiB} of the processes on the GPU (None: the driver cannot say)."""
        nv = self._nvml
        used: dict[int, int] = {}  # pid -> bytes; a pid may be in both lists
        try:
            procs = list(nv.nvmlDeviceGetComputeRunningProcesses(h))
            procs += nv.nvmlDeviceGetGraphicsRunningProcesses(h)
        except nv.NVMLError_NotSupported:
            return None
        for p in procs:  # usedGpuMemory is None when the driver cannot tell (e.g. Windows WDDM)
            used[p.pid] = max(used.get(p.pid, 0), int(p.usedGpuMemory or 0))
        return {pid: b // _MIB for pid, b in used.items()}

    def set_load(self, gpu: int, share: float, reserved_mib: int) -> None:
        pass  # the driver reports what the jobs really use

    def close(self) -> None:
        self._health.close()
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _load_nvml() -> Any:
    """``pynvml``, imported only here (fake GPUs never pay for it), or the
    test-only stand-in that ``TEST_NVML_VAR`` names."""
    path = os.environ.get(TEST_NVML_VAR)
    if not path:
        import pynvml

        return pynvml
    spec = importlib.util.spec_from_file_location("eventsched_test_nvml", path)
    if spec is None or spec.loader is None:
        raise NvmlUnavailable(f"{TEST_NVML_VAR}={path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def absurd_reading(used_mib: int, total_mib: int, util: float, temp_c: float, power_w: float) -> str:
    """What is impossible in one GPU reading ("" when nothing): such a sample
    says the driver is confused, not how the GPU is."""
    if total_mib <= 0 or used_mib < 0 or used_mib > total_mib:
        return f"memory used {used_mib} MiB of {total_mib} MiB"
    if not -40.0 <= temp_c <= 150.0:
        return f"temperature {temp_c:g} C"
    if not 0.0 <= util <= 100.0:
        return f"utilization {util:g} %"
    if not 0.0 <= power_w <= 10_000.0:
        return f"power {power_w:g} W"
    return ""


# --- per-process memory, both backends ----------------------------------------


def attribute(
    procs: Iterable[tuple[int, int]],
    job_pids: Collection[int],
    owners: dict[int, tuple[int, str]] | None = None,
) -> tuple[dict[int, int], list[GpuProcess], int]:
    """One GPU's ``(pid, MiB)`` list as (job -> MiB, the processes of no job,
    their MiB in all). ``job_pids``: pid -> job, or a set that only tells ours
    from foreign; ``owners`` caches pid -> (uid, user)."""
    job_of = job_pids if isinstance(job_pids, Mapping) else None
    jobs: dict[int, int] = {}
    others: list[GpuProcess] = []
    foreign = 0
    for pid, mib in procs:
        if pid in job_pids:
            if job_of is not None:
                job = job_of[pid]
                jobs[job] = jobs.get(job, 0) + mib
            continue
        foreign += mib
        owners = {} if owners is None else owners
        owner = owners.get(pid) or owners.setdefault(pid, _owner(pid))
        others.append(GpuProcess(pid=pid, used_mib=mib, uid=owner[0], user=owner[1]))
    others.sort(key=lambda p: (-p.used_mib, p.pid))
    return jobs, others, foreign


def _owner(pid: int) -> tuple[int, str]:
    """(uid, user name) of a process; (-1, "") when not visible (gone, another pid namespace)."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1, ""
    try:
        return uid, pwd.getpwuid(uid).pw_name
    except KeyError:
        return uid, ""


class _Declared(NamedTuple):
    ppid: int
    mem: int
    util: float | None
    gpus: tuple[int, ...] | None  # None: every GPU


def _declared_processes() -> dict[int, _Declared]:
    """Fake GPUs: every process here that declares a GPU use in its
    environment, less the children that only inherited their parent's declaration."""
    mem_key, util_key = FAKE_MEM_VAR.encode() + b"=", FAKE_UTIL_VAR.encode() + b"="
    found: dict[int, _Declared] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                data = f.read()
        except OSError:  # gone, or another user's
            continue
        if mem_key not in data and util_key not in data:
            continue
        env = dict(item.partition(b"=")[::2] for item in data.split(b"\0") if item)
        try:
            mem = max(0, int(env.get(FAKE_MEM_VAR.encode(), b"0")))
            util_raw = env.get(FAKE_UTIL_VAR.encode())
            util = None if util_raw is None else min(100.0, max(0.0, float(util_raw)))
        except ValueError:
            continue  # not a number: declares nothing
        visible = env.get(b"CUDA_VISIBLE_DEVICES")
        try:
            gpus = None if visible is None else tuple(int(x) for x in visible.split(b",") if x.strip())
        except ValueError:
            gpus = ()
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        found[int(name)] = _Declared(ppid, mem, util, gpus)
    # a child that inherited the very same declaration holds nothing more
    return {pid: d for pid, d in found.items() if not (d.ppid in found and found[d.ppid][1:] == d[1:])}


# --- simulated GPUs -------------------------------------------------------


class FakeBackend:
    """N simulated GPUs whose samples follow what the scheduler placed on them
    (``set_load``); deterministic (jitter from a sample counter)."""

    def __init__(self, n: int, mem_mib: int = DEFAULT_FAKE_MEM_MIB, *, node: str = "local") -> None:
        if n < 1:
            raise GpuSpecError(f"fake GPUs: need at least 1 GPU, got {n}")
        if mem_mib < 1:
            raise GpuSpecError(f"fake GPUs: memory must be at least 1 MiB, got {mem_mib}")
        self.n, self.mem_mib, self.node, self.name = n, mem_mib, node, f"fake:{n}:{mem_mib}"
        self._share, self._reserved, self._foreign = [0.0] * n, [0] * n, [0] * n
        self._failed: dict[int, tuple[str, bool]] = {}
        self._health: dict[int, GpuHealth] = {}  # the faults injected, as the driver would read them
        self._xids: dict[int, list[int]] = {}
        self._health_changes = HealthChanges(node)
        self._tick = 0

    def discover(self) -> list[GpuInfo]:
        return [GpuInfo(gpu=i, uuid=f"GPU-fake-{self.node}-{i}", model="Fake GPU", memory_total_mib=self.mem_mib)
                for i in range(self.n) if not self._failed.get(i, ("", False))[1]]

    def set_load(self, gpu: int, share: float, reserved_mib: int) -> None:
        """Total share (0..1) and reserved MiB on ``gpu``: absolute, not incremental."""
        self._check(gpu)
        self._share[gpu] = min(max(share, 0.0), 1.0)
        self._reserved[gpu] = max(reserved_mib, 0)

    def set_foreign(self, gpu: int, mib: int) -> None:
        self._check(gpu)
        self._foreign[gpu] = max(mib, 0)

    def fail(self, gpu: int, error: str = "simulated failure", *, lost: bool = False) -> None:
        self._check(gpu)
        self._failed[gpu] = (error, lost)

    def inject(self, gpu: int, fault: str) -> None:
        """A health fault on ``gpu`` (one of ``HEALTH_FAULTS``: "ecc", "xid:79"...), read at the next sample."""
        self._check(gpu)
        reading, xid = apply_fault(self._health.get(gpu) or GpuHealth(node=self.node, gpu=gpu), fault)
        self._health[gpu] = reading
        if xid:
            self._xids.setdefault(gpu, []).append(xid)

    def heal(self, gpu: int) -> None:
        """The GPU reads well again (and, reset, its health counters are clear)."""
        self._failed.pop(gpu, None)
        if gpu in self._health:
            self._health[gpu] = GpuHealth(node=self.node, gpu=gpu)

    def _check(self, gpu: int) -> None:
        if not 0 <= gpu < self.n:
            raise IndexError(f"no fake GPU {gpu} (there are {self.n})")

    def sample(self, job_pids: Collection[int] = ()) -> list[GpuSample]:
        self._tick += 1
        out: list[GpuSample] = []
        # the per-process list NVML would give, from the processes' declarations
        per_gpu: list[list[tuple[int, int]]] = [[] for _ in range(self.n)]
        declared_util: list[float | None] = [None] * self.n
        for pid, d in sorted(_declared_processes().items()):
            for g in (range(self.n) if d.gpus is None else d.gpus):
                if 0 <= g < self.n:
                    if d.mem:
                        per_gpu[g].append((pid, d.mem))
                    if d.util is not None:
                        declared_util[g] = min(100.0, (declared_util[g] or 0.0) + d.util)
        owners: dict[int, tuple[int, str]] = {}
        for i in range(self.n):
            if i in self._failed:
                error, lost = self._failed[i]
                out.append(GpuFailed(node=self.node, gpu=i, error=error, lost=lost))
                continue
            share = self._share[i]
            # +-2 points of deterministic jitter on a busy GPU: under the
            # 5-point "significant" threshold, so it does not bloat the log
            jitter = float((self._tick * 7 + i * 3) % 5 - 2) if share > 0 else 0.0
            declared = declared_util[i]
            util = min(100.0, max(0.0, share * 100.0 + jitter)) if declared is None else declared
            jobs, others, foreign_declared = attribute(per_gpu[i], job_pids, owners)
            foreign = self._foreign[i] + foreign_declared
            # jobs that declare nothing stand for their reservation
            ours = max(self._reserved[i], sum(jobs.values()))
            used = min(self.mem_mib, ours + foreign)
            # 30 C and 60 W idle, 80 C and 400 W flat out
            out.append(GpuObserved(node=self.node, gpu=i, utilization=util, memory_used_mib=used,
                                   memory_total_mib=self.mem_mib, temperature_c=round(30.0 + 0.5 * util, 1),
                                   power_w=round(60.0 + 3.4 * util, 1), foreign_memory_mib=foreign,
                                   job_memory_mib=jobs, foreign_processes=others))
        for i in range(self.n):  # a GPU no fault was injected into says nothing of its health
            health = self._health_changes.keep(i, None if i in self._failed else self._health.get(i),
                                               self._xids.pop(i, []))
            if health is not None:
                out.append(health)
        return out

    def close(self) -> None:
        pass


# --- choosing a backend ------------------------------------------------------


def parse_gpus_option(text: str | None, *, node: str = "local") -> GpuBackend:
    """``--gpus``: ``fake:N[:MEM_MIB]``, or ``nvml`` (or nothing) for real GPUs."""
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


def significant(prev: GpuObserved | None, new: GpuObserved, *, last_ts: float, now: float,
                min_interval_s: float = 60.0) -> bool:
    """Should ``new`` be logged, given ``prev`` (the last one logged for this
    GPU, at ``last_ts``)? Yes on a meaningful change, or when that is stale."""
    if prev is None or now - last_ts >= min_interval_s:
        return True
    mem_step = min(256, 0.02 * max(new.memory_total_mib, 1))
    return (
        abs(new.utilization - prev.utilization) >= 5.0
        or abs(new.memory_used_mib - prev.memory_used_mib) >= mem_step
        or abs(new.foreign_memory_mib - prev.foreign_memory_mib) >= mem_step
        or abs(new.temperature_c - prev.temperature_c) >= 3.0
        or new.memory_total_mib != prev.memory_total_mib
        or _jobs_moved(prev.job_memory_mib, new.job_memory_mib, mem_step / 4)
        or {p.pid for p in prev.foreign_processes} != {p.pid for p in new.foreign_processes}
    )


class SampleFilter:
    """Which samples the engine logs; a failed GPU's first good reading is always news."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], tuple[float, GpuObserved]] = {}

    def keep(self, sample: GpuObserved, now: float, state: ClusterState) -> bool:
        key = (sample.node, sample.gpu)
        gpu = state.gpus.get(key)
        if gpu is not None and (gpu.lost or gpu.error):
            self._last.pop(key, None)
        prev_ts, prev = self._last.get(key, (0.0, None))
        if not significant(prev, sample, last_ts=prev_ts, now=now):
            return False
        self._last[key] = (now, sample)
        return True


def _jobs_moved(prev: dict[int, int], new: dict[int, int], step: float) -> bool:
    """A job came onto the GPU or left it, or its memory moved by ``step``."""
    if prev.keys() != new.keys():
        return True
    return any(abs(new[j] - prev[j]) >= step for j in new)
