"""What a policy decides: one job placed on GPUs of a node.

A frozen msgspec Struct, kept apart from ``policies`` because that module is
compiled with mypyc (``setup.py``), which would drop a Struct's class options.
"""

from __future__ import annotations

import msgspec

__all__ = ["Placement"]


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    job: int
    node: str
    gpu_ids: list[int]
    share: float  # of each GPU (1.0 for whole GPUs, 0.0 for CPU-only jobs)
    mem: int  # MiB reserved on each GPU
