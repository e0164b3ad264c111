"""Fragmentation math after Weng et al., "Beware of Fragmentation" (USENIX ATC '23).

Pure functions, no I/O. Units are milli-GPU (1000 = one whole GPU).

A node's fragmentation for one task type is the free GPU capacity that a task
of that type could *not* use there; its expected fragmentation is the
popularity-weighted sum over a target workload, as the static experiment
(sim/static_sim.py, replays/alibaba-fgd/README.md) defines it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from eventsched.core.records import TaskType

FULL = 1000  # milli-GPU in one whole GPU


def type_fragmentation(free_milli: Sequence[int], num_gpu: int, gpu_milli: int) -> int:
    """Fragmented milli-GPU of one node for ONE task type (num_gpu, gpu_milli).

    If the task could be placed (gpu_milli > 0 and at least `num_gpu` GPUs have
    >= gpu_milli free), only the GPUs too small for it are fragments: sum of f_i
    with f_i < gpu_milli. Otherwise every free milli on the node is unusable by
    this type, so the whole free capacity counts (this includes CPU-only types,
    gpu_milli == 0, which can never use GPU capacity).
    """
    total = 0
    small = 0
    fitting = 0
    for f in free_milli:
        total += f
        if f >= gpu_milli:
            fitting += 1
        else:
            small += f
    if gpu_milli <= 0 or fitting < num_gpu:
        return total
    return small


def fragmentation(
    free_milli: Sequence[int], workload: Sequence[tuple[int, int, float]]
) -> float:
    """Expected fragmented milli-GPU of ONE node.

    free_milli: free milli-share of each GPU of the node (0..1000 each).
    workload: target task types as (num_gpu, gpu_milli, popularity); the
    popularities sum to 1. num_gpu >= 2 implies gpu_milli == 1000 in practice.

    Returns sum over types of popularity * type_fragmentation(...). Example: a
    node whose only GPU has 500 free, facing only 600-milli tasks, is fully
    fragmented: fragmentation([500], [(1, 600, 1.0)]) == 500.0.
    """
    return math.fsum(
        p * type_fragmentation(free_milli, k, g) for k, g, p in workload
    )


class NodeFragments:
    """One node's free shares summed up per task type of a workload, so that
    the fragmentation after a placement costs O(types x GPUs placed) instead
    of a pass over the node's GPUs per candidate placement.

    ``value()`` and ``after()`` equal ``fragmentation`` of the node before
    and after (each type's fragment is the same integer, summed with fsum in
    the workload's order), so decisions are exactly those of the full pass.
    """

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
        return math.fsum(
            p * (small if g > 0 and fitting >= k else self.total)
            for (k, g, p), fitting, small in zip(self.workload, self.fitting, self.small)
        )

    def after(self, taken_from: list[int], milli: int) -> float:
        """The fragmentation once ``milli`` is taken from each of the GPUs
        whose free shares are ``taken_from``."""
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
    """FGD node score 0..100 from the fragmentation change of a placement.

    score = floor(100 * sigmoid(-delta / 1000)); smaller growth scores higher.
    Truncation is deliberate: it creates the ties the paper's scheduler has.
    """
    x = -delta_milli / 1000.0
    # numerically safe logistic
    if x >= 0:
        s = 1.0 / (1.0 + math.exp(-x))
    else:
        e = math.exp(x)
        s = e / (1.0 + e)
    return int(100.0 * s)


# --- node level, with CPU and GPU-model constraints (the FGD experiment) -----


def target_workload(
    shapes: Iterable[tuple[int, int, int, tuple[str, ...]]], coverage: float = 0.95
) -> list[TaskType]:
    """Target workload M from pod shapes (cpu_milli, num_gpu, gpu_milli, spec).

    Types are counted, sorted by count (desc; ties: larger cpu, then gpu_milli,
    then num_gpu first), and the shortest prefix covering >= `coverage` of the
    pods is kept with popularities renormalised to sum to 1 (memory is
    ignored, gpu_milli is 0 for CPU-only pods).
    """
    counts = Counter(
        (c, k if g > 0 else 0, g if k > 0 else 0, tuple(spec)) for c, k, g, spec in shapes
    )
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
    return [
        TaskType(cpu_milli=c, num_gpu=k, gpu_milli=g, spec=spec, popularity=n / acc)
        for (c, k, g, spec), n in kept
    ]


def node_fragmentation(
    free_milli: Sequence[int], cpu_free: int, model: str, types: Sequence[TaskType]
) -> float:
    """F_n = sum_m p_m * F_n(m) for one node (scalar reference implementation).

    F_n(m) is the free GPU capacity too small for a task of type m when the
    task could otherwise fit (GPU model allowed, enough GPUs, enough CPU), and
    the node's whole free GPU capacity when it could not.
    """
    total = sum(free_milli)
    out = 0.0
    for t in types:
        fits = (
            t.gpu_milli > 0
            and (not t.spec or model in t.spec)
            and cpu_free >= t.cpu_milli
            and sum(1 for f in free_milli if f >= t.gpu_milli) >= t.num_gpu
        )
        frag = sum(f for f in free_milli if f < t.gpu_milli) if fits else total
        out += t.popularity * frag
    return out
