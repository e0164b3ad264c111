"""The frameworks' own cooperative GPU-memory knobs, for a job (docs/gpu-memory-and-idle.md).

A job submitted with ``--gpu-mem`` gets the fraction of its GPU it asked for in
``XLA_PYTHON_CLIENT_MEM_FRACTION`` (JAX reads it) and ``EVENTSCHED_GPU_MEM_FRACTION``
(PyTorch has no variable of its own: a script calls ``torch_memory_fraction()``).
Both are cooperative: the scheduler still watches what each job's processes hold.
"""

from __future__ import annotations

import os

__all__ = ["torch_memory_fraction"]


def torch_memory_fraction(device: int | None = None) -> float | None:
    """Cap PyTorch's allocator at the job's ``--gpu-mem`` on every visible GPU (or only
    ``device``), before allocating, so that it refuses to grow into a neighbour's
    memory; the fraction set, or None (no ``--gpu-mem``)."""
    try:
        fraction = float(os.environ.get("EVENTSCHED_GPU_MEM_FRACTION", ""))
    except ValueError:
        return None
    if not 0.0 < fraction <= 1.0:
        return None
    import torch  # only here: the scheduler itself never needs torch

    for d in [device] if device is not None else range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(fraction, d)
    return fraction
