"""The frameworks' own cooperative GPU-memory knobs, for a job.

A job submitted with ``--gpu-mem`` is launched with the fraction of its GPU
that it asked for in two variables (the user's own values win):

- ``XLA_PYTHON_CLIENT_MEM_FRACTION``: JAX reads it itself and preallocates
  that much instead of its default 75 %;
- ``EVENTSCHED_GPU_MEM_FRACTION``: for PyTorch, which has no variable of its
  own; a script calls ``eventsched.torch_memory_fraction()`` once, and the
  caching allocator then refuses (``torch.cuda.OutOfMemoryError``) to grow
  past the request instead of taking a neighbour's memory.

Both are cooperative: the scheduler still watches what each job's processes
hold (``gpu_mem_policy``), since a process may allocate outside them.
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
    """Cap PyTorch's allocator at the job's ``--gpu-mem`` on every visible GPU
    (or only ``device``); returns the fraction set, or None when the job asked
    for no memory (nothing is changed then). Call it before allocating::

        import eventsched, torch
        eventsched.torch_memory_fraction()
    """
    fraction = gpu_mem_fraction()
    if fraction is None:
        return None
    import torch  # only here: the scheduler itself never needs torch

    devices = [device] if device is not None else range(torch.cuda.device_count())
    for d in devices:
        torch.cuda.set_per_process_memory_fraction(fraction, d)
    return fraction
