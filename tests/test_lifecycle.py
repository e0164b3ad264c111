"""The job lifecycle is written once (``domain/states.py``) and every fold reads it alike.

Every (state, event type) pair, legal or not, goes through the allocation
projection (``cluster.apply``), the DuckDB read model (a real log, through
``History``), the notebook panel's model and the what-if fold, and all four
must end in the same state. A pair the table lacks is refused by the
projection (``IllegalTransition``, nothing changed) and ignored by the other
three, which read logs and streams and keep the state they had.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eventsched.domain import events as ev
from eventsched.domain.states import STOP_OUTCOMES, TRANSITIONS, IllegalTransition, JobState
from eventsched.jupyter.widgets import PanelModel
from eventsched.projections.cluster import ClusterState, apply, snapshot_bytes
from eventsched.projections.history import History
from eventsched.sim.whatif import metrics_from_events
from eventsched.storage import log

GPU = ev.GpuDiscovered(seq=1, node="local", gpu=0, uuid="GPU-0", model="fake", memory_total_mib=16000)
REQUIRED: dict[type, dict[str, Any]] = {  # the fields an event of each type cannot do without
    ev.JobSubmitted: {"spec": ev.JobSpec(command=["true"], user="u", gpus=1.0)},
    ev.JobPlaced: {"node": "local", "gpu_ids": [0], "share": 1.0},
    ev.JobStarted: {"pid": 100},
    ev.JobExited: {"exit_code": 0},
    ev.JobGpuMemoryExceeded: {"node": "local", "gpu": 0, "used_mib": 2, "request_mib": 1},
    ev.JobIdle: {"since": 0.0},
}
Step = tuple[type, dict[str, Any]]
RUN: list[Step] = [(ev.JobPlaced, {}), (ev.JobStarted, {})]
# how a job gets to each state; an exit's outcome is left to the rule (as in older logs)
STARTS: dict[str, list[Step]] = {
    "queued": [],
    "held": [(ev.JobHeld, {})],
    "running": RUN,
    "succeeded": RUN + [(ev.JobExited, {})],
    "failed": RUN + [(ev.JobExited, {"exit_code": 1})],
    "cancelled": [(ev.JobCancelled, {})],
    "preempted": RUN + [(ev.JobCancelRequested, {"reason": "preempted"}), (ev.JobExited, {"exit_code": None})],
    "lost": RUN + [(ev.JobLost, {})],
    **{f"running, asked to stop ({why})": RUN + [(ev.JobCancelRequested, {"reason": why})] for why in STOP_OUTCOMES},
}
EXITS: list[dict[str, Any]] = [{}, {"exit_code": 1}, {"exit_code": None, "signal": 9}, {"reason": "cancelled"}, {"outcome": "failed"},
         {"exit_code": 0, "outcome": "preempted"}]
LAST: list[Step] = [(t, dict[str, Any]()) for t in sorted({t for _, t in TRANSITIONS}, key=lambda t: t.__name__)
                    if t is not ev.JobExited] + [(ev.JobExited, kw) for kw in EXITS]
CASES = [(start, step) for start in STARTS for step in LAST]


def history_of(case: int) -> list[ev.Event]:
    """Job ``case``'s events: submitted, brought to its start, then the event under test."""
    start, last = CASES[case]
    steps = [(ev.JobSubmitted, {}), *STARTS[start], last]
    seq0 = 2 + case * 16  # unique across cases, so they share one log
    return [t(seq=seq0 + i, ts=1000.0 + seq0 + i, job=case + 1, **{**REQUIRED.get(t, {}), **kw})
            for i, (t, kw) in enumerate(steps)]


def by_projection(events: list[ev.Event]) -> tuple[str, str, bool]:
    """(state before the last event, state after it, whether it was refused)."""
    state = ClusterState()
    for e in [GPU, *events[:-1]]:
        apply(state, e)
    job = state.jobs[events[-1].job]  # type: ignore[attr-defined]
    before, snap = str(job.state), snapshot_bytes(state)
    try:
        apply(state, events[-1])
    except IllegalTransition:
        assert snapshot_bytes(state) == snap, "a refused event changed the projection"
        return before, before, True
    return before, str(job.state), False


def by_panel(events: list[ev.Event]) -> str:
    model = PanelModel()
    model.fold([GPU, *events])
    return model.jobs[events[-1].job]["state"]  # type: ignore[attr-defined]


def by_whatif(events: list[ev.Event]) -> str:
    states: dict[int, str] = {}
    metrics_from_events([GPU, *events], states)
    return str(states[events[-1].job])  # type: ignore[attr-defined]


def by_read_model(tmp_path: Path, histories: list[list[ev.Event]]) -> dict[int, str]:
    writer = log.LogWriter.open(tmp_path / "log")
    try:
        writer.append([GPU])
        for events in histories:
            writer.append(events)
    finally:
        writer.close()
    with History(tmp_path, in_memory=True) as history:
        return dict(history.query("SELECT id, state FROM jobs")[1])


def test_every_fold_moves_a_job_by_the_one_table(tmp_path: Path) -> None:
    histories = [history_of(i) for i in range(len(CASES))]
    read_model = by_read_model(tmp_path, histories)
    legal: set[tuple[str, type]] = set()
    for case, events in enumerate(histories):
        start, (event_type, kw) = CASES[case]
        before, after, refused = by_projection(events)
        assert before == start.split(",")[0], f"{start} reached {before}"
        seen = {"read model": read_model[case + 1], "panel": by_panel(events), "what-if": by_whatif(events)}
        pair = f"{start} + {event_type.__name__}({kw})"
        assert seen == dict.fromkeys(seen, after), f"{pair}: the projection says {after}"
        assert refused == ((JobState(before), event_type) not in TRANSITIONS), pair
        legal |= set() if refused else {(before, event_type)}
    assert legal == set(TRANSITIONS), "a legal move was never tried"


@pytest.mark.parametrize("why", sorted(STOP_OUTCOMES))
def test_an_exit_after_a_stop_ends_as_the_stop_says(why: str) -> None:
    case = CASES.index((f"running, asked to stop ({why})", (ev.JobExited, {})))
    assert by_projection(history_of(case))[1] == STOP_OUTCOMES[why]
