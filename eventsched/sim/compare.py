"""Fidelity: does a replay place the same jobs on the same GPUs, in the same
order, as the recording it replayed?"""

from __future__ import annotations

import os

from eventsched.domain import events as ev
from eventsched.storage import log as eventlog

__all__ = ["placements", "compare_placements"]


def placements(log_dir: str | os.PathLike[str]) -> list[tuple[int, str, tuple[int, ...]]]:
    """(submission ordinal, node, GPU ids) of every JobPlaced, in log order."""
    ordinal: dict[int, int] = {}
    out = []
    for e in eventlog.read(log_dir):
        if type(e) is ev.JobSubmitted:
            ordinal[e.job] = len(ordinal) + 1
        elif type(e) is ev.JobPlaced:
            out.append((ordinal.get(e.job, -e.job), e.node, tuple(e.gpu_ids)))
    return out


def compare_placements(recorded_log: str | os.PathLike[str], replay_log: str | os.PathLike[str]) -> str | None:
    """None when the replay placed the same jobs on the same GPUs in the same
    order as the recording; else a one-line description of the first difference."""
    a, b = placements(recorded_log), placements(replay_log)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"placement #{i + 1}: recorded job {x[0]} on {x[1]}:{list(x[2])}, replay job {y[0]} on {y[1]}:{list(y[2])}"
    if len(a) != len(b):
        return f"recorded {len(a)} placements, replay {len(b)}"
    return None
