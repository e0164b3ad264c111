"""``core.fgd.node_fragmentation`` vectorised (numpy) for the static FGD experiment,
apart from ``core.fgd`` so the daemon and replay never load numpy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from eventsched.core.records import TaskType

__all__ = ["FragTable", "fgd_scores"]


class FragTable:
    """F_n for one target workload; nodes pass their model as an index in `models`."""

    def __init__(self, types: Sequence[TaskType], models: Sequence[str]) -> None:
        self.types = list(types)
        self.cpu = np.array([t.cpu_milli for t in types], dtype=np.int64)
        self.k = np.array([t.num_gpu for t in types], dtype=np.int64)
        self.g = np.array([t.gpu_milli for t in types], dtype=np.int64)
        self.p = np.array([t.popularity for t in types], dtype=np.float64)
        # spec_ok[model, m]: type m may use this model (and is a GPU type)
        self.spec_ok = np.array([[t.gpu_milli > 0 and (not t.spec or mdl in t.spec) for t in types] for mdl in models],
                                dtype=bool).reshape(len(models), len(types))

    def frag(self, free: np.ndarray, cpu_free: np.ndarray, model: np.ndarray) -> np.ndarray:
        """F_n for X node states: free[X, G] (absent GPUs padded with 0), cpu_free[X], model[X]."""
        f = free[:, :, None]
        ge = f >= self.g  # (X, G, M)
        fit = ge.sum(axis=1)
        small = np.where(ge, 0, f).sum(axis=1)
        tot = free.sum(axis=1)
        ok = self.spec_ok[model] & (fit >= self.k) & (cpu_free[:, None] >= self.cpu)
        return np.where(ok, small, tot[:, None]) @ self.p


def fgd_scores(delta: np.ndarray) -> np.ndarray:
    """Vectorised fgd_score: floor(100 * sigmoid(-delta / 1000)) as int64."""
    x = np.clip(-delta / 1000.0, -700.0, 700.0)
    return (100.0 / (1.0 + np.exp(-x))).astype(np.int64)
