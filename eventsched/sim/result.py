"""What one replay produced: a Struct kept apart from the mypyc-compiled
``simulator``, since mypyc would drop a Struct's class options."""

from __future__ import annotations

import msgspec

__all__ = ["ReplayResult"]


class ReplayResult(msgspec.Struct, kw_only=True):
    policy: str
    source: str
    state_dir: str  # holds log/; open_history(state_dir) queries it
    jobs: int
    events: int
    placements: int
    refused: int
    estimated_runtimes: int  # jobs that ran here but never in the recording
    unfinished: int  # jobs neither finished nor cancelled when the replay ended
    sim_start: float
    sim_end: float
    wall_s: float
    notes: list[str] = []
