"""One type of the FGD target workload (``fgd``).

A frozen msgspec Struct, kept apart from ``fgd`` because that module is
compiled with mypyc (``setup.py``), which would drop a Struct's class options.
"""

from __future__ import annotations

import msgspec

__all__ = ["TaskType"]


class TaskType(msgspec.Struct, frozen=True, kw_only=True):
    """One type of the target workload M: a pod shape and its popularity p_m."""

    cpu_milli: int
    num_gpu: int
    gpu_milli: int  # per GPU; 0 for CPU-only types
    spec: tuple[str, ...] = ()  # allowed GPU models; empty = any
    popularity: float
