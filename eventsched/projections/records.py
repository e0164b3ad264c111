"""The msgspec Structs a snapshot of the allocation state is made of, apart
from the compiled modules: mypyc would drop a Struct's class options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from eventsched.domain.events import ReservationCreated
from eventsched.domain.messages import SchedulerConfig
from eventsched.domain.tenants import Tenant

if TYPE_CHECKING:  # built at import time: to a type checker, any Struct
    from typing import Any as GpuRecord
    from typing import Any as JobRecord
else:
    from eventsched.projections.live import GpuRecord, JobRecord

__all__ = ["GpuRecord", "JobRecord", "NodeInfo", "StateSnapshot"]


class NodeInfo(msgspec.Struct, kw_only=True):
    """One node of a cluster: ``up`` or ``down`` since ``since``."""

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
    nodes: list[NodeInfo] = []  # a cluster's nodes
    reservations: list[ReservationCreated] = []  # booked GPUs, not cancelled
    month_usage: dict[str, float] = {}  # tenant -> GPU-seconds used in the month of its recent use's "as of"
