"""The frameworks' own cooperative GPU-memory knobs, for a job.

A job submitted with ``--gpu-mem`` gets the fraction of its GPU it asked for
in ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (JAX reads it) and
``EVENTSCHED_GPU_MEM_FRACTION`` (PyTorch has no variable of its own: a script
calls ``eventsched.torch_memory_fraction()``, and the allocator then refuses to
grow past the request instead of taking a neighbour's memory). Both are
cooperative: the scheduler still watches what each job's processes hold.
"""

from __future__ import annotations

import os

__all__ = ["GPU_MEM_FRACTION_VAR", "gpu_mem_fraction", "torch_memory_fraction"]

GPU_MEM_FRACTION_VAR = "EVENTSCHED_GPU_MEM_FRACTION"


def gpu_mem_fraction() -> float | None:
    """The fraction of each of its GPUs this job asked for (None: no ``--gpu-mem``)."""
    raw = os.environ.get(GPU_MEM_FRACTION_VAR, "")
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if 0.0 < value <= 1.0 else None


def torch_memory_fraction(device: int | None = None) -> float | None:
    """Cap PyTorch's allocator at the job's ``--gpu-mem`` on every visible GPU (or
    only ``device``), before allocating; the fraction set, or None (no ``--gpu-mem``)."""
    fraction = gpu_mem_fraction()
    if fraction is None:
        return None
    import torch  # only here: the scheduler itself never needs torch

    for d in [device] if device is not None else range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(fraction, d)
    return fraction
