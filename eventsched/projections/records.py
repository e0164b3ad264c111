"""The records a snapshot of the allocation state is made of: GPUs, jobs and
nodes as the scheduler sees them, and the snapshot itself.

They are msgspec Structs (snapshots encode them as they are) and live apart
from the code that folds and indexes them (``model``, ``cluster``): those
modules are compiled with mypyc (``setup.py``), which would drop a Struct's
class options (``kw_only``, ``frozen``), so the Structs stay interpreted. The
live state holds GPUs and jobs as compiled classes with the same fields
(``live.Gpu``, ``live.Job``), converted to and from these on a snapshot.
"""

from __future__ import annotations

import msgspec

from eventsched.domain import events as ev
from eventsched.domain.messages import SchedulerConfig
from eventsched.domain.states import JobState
from eventsched.domain.tenants import Tenant
from eventsched.domain.units import FULL

__all__ = ["GpuRecord", "JobRecord", "NodeInfo", "StateSnapshot"]


class GpuRecord(msgspec.Struct, kw_only=True):
    node: str
    id: int
    uuid: str = ""
    model: str = ""
    memory_total_mib: int = 0
    paused: bool = False
    lost: bool = False
    error: str = ""
    # last sample (None until the first one)
    sampled_at: float | None = None
    utilization: float | None = None
    memory_used_mib: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    foreign_memory_mib: int = -1
    # what the scheduler placed here
    used_milli: int = 0
    reserved_mib: int = 0
    jobs: list[int] = []
    # issue 17, from the last sample: since when its utilisation has been at
    # most idle_utilization_pct (None: busy now, or never sampled), the memory
    # each job holds here, and the processes of no job
    low_since: float | None = None
    job_memory_mib: dict[int, int] = {}
    foreign_processes: list[ev.GpuProcess] = []


class JobRecord(msgspec.Struct, kw_only=True):
    id: int
    spec: ev.JobSpec
    state: JobState = JobState.QUEUED
    count: int = 1  # GPUs asked for (0 = CPU only)
    milli: int = FULL  # share of each of them
    order: int = 0  # queue position (FIFO key); a requeue moves it to the back
    submitted_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    node: str = ""
    gpu_ids: list[int] = []
    mem_mib: int = 0  # reserved on each GPU
    policy: str = ""
    pid: int | None = None
    start_time: int = 0
    log_path: str = ""
    attempts: int = 0  # times placed
    retries_used: int = 0
    not_before: float = 0.0
    cancel_reason: str = ""  # set while a stop was requested for a running job
    submitted_seq: int = 0  # where its story starts in the log (explain)
    queued_at: float = 0.0  # since when it waits (aging); a preempted job keeps its own
    # when it should end, as predicted when it started (gang reservations read
    # this instead of predicting every running job at every decision)
    predicted_end: float = 0.0
    preemptions: int = 0  # times it was preempted (and requeued)
    # issue 17, this attempt: the most GPU memory seen on one of its GPUs;
    # whether it is over its --gpu-mem now (JobGpuMemoryExceeded); since when
    # it has been idle (JobIdle; None: not idle)
    gpu_mem_peak_mib: int = 0
    gpu_mem_over: bool = False
    idle_since: float | None = None


class NodeInfo(msgspec.Struct, kw_only=True):
    """Issue 12: one node of a cluster: ``up`` or ``down`` since ``since``."""

    name: str
    state: str = "up"
    since: float = 0.0
    ray_node: str = ""
    gpu_backend: str = ""
    reason: str = ""  # why it went down
    restarts: int = 0  # of its executor actor



class StateSnapshot(msgspec.Struct, kw_only=True):
    """A ``ClusterState``'s facts (``cluster.snapshot_bytes``); its indices are
    rebuilt from them on load."""

    version: int = 1
    last_seq: int
    node: str
    policy: str
    config: SchedulerConfig
    gpus: list[GpuRecord]
    jobs: list[JobRecord]
    next_job_id: int
    next_order: int
    recent_shapes: list[tuple[int, int]]
    runtime_by_key: list[tuple[str, str, int, int]]
    runtimes_ms: list[int]
    tenants: dict[str, Tenant] = {}
    recent_usage: list[tuple[str, float, float]] = []  # (tenant, GPU-seconds decayed, as of)
    nodes: list[NodeInfo] = []  # issue 12: a cluster's nodes
