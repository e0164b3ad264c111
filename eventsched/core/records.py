"""What the core's decisions are made of: a placement and an FGD task type.

msgspec Structs, kept apart from those modules because mypyc compiles them
and would drop a Struct's class options (``kw_only``, ``frozen``).
"""

from __future__ import annotations

import msgspec

__all__ = ["Placement", "TaskType"]


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    job: int
    node: str
    gpu_ids: list[int]
    share: float  # of each GPU (1.0 for whole GPUs, 0.0 for CPU-only jobs)
    mem: int  # MiB reserved on each GPU


class TaskType(msgspec.Struct, frozen=True, kw_only=True):
    """One type of the target workload M: a pod shape and its popularity p_m."""

    cpu_milli: int
    num_gpu: int
    gpu_milli: int  # per GPU; 0 for CPU-only types
    spec: tuple[str, ...] = ()  # allowed GPU models; empty = any
    popularity: float
