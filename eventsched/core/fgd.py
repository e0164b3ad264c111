"""Fragmentation math after Weng et al., "Beware of Fragmentation" (USENIX ATC '23),
in milli-GPU: a node's fragmentation for a task type is the free capacity such
a task could not use there; its expected fragmentation weighs the types by
popularity (sim/static_sim.py, replays/alibaba-fgd/README.md).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from eventsched.core.records import TaskType

FULL = 1000  # milli-GPU in one whole GPU


def type_fragmentation(free_milli: Sequence[int], num_gpu: int, gpu_milli: int) -> int:
    """Fragmented milli-GPU of one node for ONE task type: the GPUs too small
    for it if it could be placed, else (CPU-only types included) all free capacity."""
    total = small = fitting = 0
    for f in free_milli:
        total += f
        if f >= gpu_milli:
            fitting += 1
        else:
            small += f
    return total if gpu_milli <= 0 or fitting < num_gpu else small


def fragmentation(free_milli: Sequence[int], workload: Sequence[tuple[int, int, float]]) -> float:
    """Expected fragmented milli-GPU of ONE node: the popularity-weighted sum
    over the workload's (num_gpu, gpu_milli, popularity) types."""
    return math.fsum(p * type_fragmentation(free_milli, k, g) for k, g, p in workload)


class NodeFragments:
    """One node's free shares summed per task type, so a placement's effect costs
    O(types x GPUs placed); ``value()`` and ``after()`` equal ``fragmentation`` exactly
    (same integers, same fsum order), so decisions are those of the full pass."""

    def __init__(self, free_milli: list[int], workload: list[tuple[int, int, float]]) -> None:
        self.workload = workload
        self.total = sum(free_milli)
        self.fitting: list[int] = []  # per type: GPUs with room for it
        self.small: list[int] = []  # per type: free milli on the GPUs without
        for _, g, _ in workload:
            fitting = small = 0
            for f in free_milli:
                if f >= g:
                    fitting += 1
                else:
                    small += f
            self.fitting.append(fitting)
            self.small.append(small)

    def value(self) -> float:
        return math.fsum(p * (small if g > 0 and fitting >= k else self.total)
                         for (k, g, p), fitting, small in zip(self.workload, self.fitting, self.small))

    def after(self, taken_from: list[int], milli: int) -> float:
        """The fragmentation once ``milli`` is taken from each GPU with free shares ``taken_from``."""
        total = self.total - milli * len(taken_from)
        parts = []
        for t, (k, g, p) in enumerate(self.workload):
            fitting, small = self.fitting[t], self.small[t]
            for f in taken_from:
                left = f - milli
                if f >= g:
                    fitting -= 1
                else:
                    small -= f
                if left >= g:
                    fitting += 1
                else:
                    small += left
            parts.append(p * (small if g > 0 and fitting >= k else total))
        return math.fsum(parts)


def fgd_score(delta_milli: float) -> int:
    """floor(100 * sigmoid(-delta / 1000)): smaller growth scores higher; the
    truncation is deliberate, it creates the ties the paper's scheduler has."""
    x = -delta_milli / 1000.0
    if x >= 0:  # numerically safe logistic
        return int(100.0 * (1.0 / (1.0 + math.exp(-x))))
    e = math.exp(x)
    return int(100.0 * (e / (1.0 + e)))


# --- node level, with CPU and GPU-model constraints (the FGD experiment) -----


def target_workload(shapes: Iterable[tuple[int, int, int, tuple[str, ...]]], coverage: float = 0.95) -> list[TaskType]:
    """Target workload M: the most common pod shapes covering ``coverage`` of the pods,
    popularities renormalised to sum to 1."""
    counts = Counter((c, k if g > 0 else 0, g if k > 0 else 0, tuple(spec)) for c, k, g, spec in shapes)
    total = sum(counts.values())
    if total == 0:
        return []
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], -kv[0][0], -kv[0][2], -kv[0][1]))
    kept: list[tuple[tuple[int, int, int, tuple[str, ...]], int]] = []
    acc = 0
    for key, n in ordered:
        kept.append((key, n))
        acc += n
        if acc >= coverage * total:
            break
    return [TaskType(cpu_milli=c, num_gpu=k, gpu_milli=g, spec=spec, popularity=n / acc) for (c, k, g, spec), n in kept]


def node_fragmentation(free_milli: Sequence[int], cpu_free: int, model: str, types: Sequence[TaskType]) -> float:
    """F_n = sum_m p_m * F_n(m) for one node, the scalar reference of ``FragTable``."""
    total = sum(free_milli)
    out = 0.0
    for t in types:
        fits = (t.gpu_milli > 0 and (not t.spec or model in t.spec) and cpu_free >= t.cpu_milli
                and sum(1 for f in free_milli if f >= t.gpu_milli) >= t.num_gpu)
        frag = sum(f for f in free_milli if f < t.gpu_milli) if fits else total
        out += t.popularity * frag
    return out
