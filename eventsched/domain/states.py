"""Job states and the one table of how events move a job between them.

As h11's ``_state.py``: every legal move is keyed by ``(state, event type)``; any
other pair raises ``IllegalTransition`` before anything changes. Every fold reads
it, the read model's SQL included (generated from it), so the state after an exit
is data too (``STOP_OUTCOMES``).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any

from eventsched.domain import events as ev

__all__ = [
    "JobState", "FINAL", "ACTIVE", "WAITING", "DONE_FOR_GOOD", "BLOCKS_DUPLICATES", "SUMMARY_ORDER", "TRANSITIONS",
    "IllegalTransition", "move", "next_state", "can", "exit_outcome", "STOP_OUTCOMES", "GPU_MEMORY_OVER", "WARNED_STOPS",
]


class JobState(StrEnum):
    QUEUED = "queued"
    HELD = "held"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    LOST = "lost"


Q, H, R = JobState.QUEUED, JobState.HELD, JobState.RUNNING
S, F, C, P, L = JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED, JobState.LOST

FINAL = frozenset({S, F, C, L})  # ended: counted as done, with an end time
WAITING = frozenset({Q, H})  # not running, may still run
ACTIVE = frozenset({Q, H, R})  # what `queue` shows without --all
DONE_FOR_GOOD = frozenset({S, F, C})  # ended with an exit code; a lost job may yet come back
# a resubmission is refused while its twin is in one of these: it may still run, or it succeeded
BLOCKS_DUPLICATES = frozenset({Q, H, R, P, S})
SUMMARY_ORDER = (R, Q, H, P, S, F, C, L)  # how a summary of many jobs lists their states

# why a running job was asked to stop (JobCancelRequested.reason) -> the state its
# exit ends in, whatever its exit code ("idle-requeue": preempted, then queued again)
STOP_OUTCOMES: dict[str, JobState] = {
    "cancelled": C, "time-limit": F, "preempted": P, "gpu-memory": F, "idle": C, "idle-requeue": P,
}
# the stops that warn first: the job's --signal (else SIGTERM), SIGKILL after its grace
WARNED_STOPS = frozenset({"preempted", "gpu-memory", "idle", "idle-requeue"})
GPU_MEMORY_OVER = "GPU memory over request"  # JobExited.reason of a job stopped for it


class IllegalTransition(ValueError):
    """An event that does not fit the job's state; nothing was changed."""


def exit_outcome(stop_reason: str, exit_code: int | None, reason: str = "") -> JobState:
    """The state a running job ends in when its process exits; ``stop_reason``:
    why it was asked to stop ("" if not), ``reason``: what the exit report says."""
    if reason == C:  # the executor cancelled it, whatever it had been asked
        return C
    return STOP_OUTCOMES.get(stop_reason) or (S if exit_code == 0 else F)


_BY_NAME = {state.value: state for state in JobState}  # a dict lookup: JobState(name) costs ten times more


def _on_exit(stop_reason: str, event: Any) -> JobState:
    recorded = event.outcome  # the core records the outcome; older logs fall back to the rule
    return _BY_NAME[recorded] if recorded else exit_outcome(stop_reason, event.exit_code, event.reason)


# (state, event type) -> the next state, or a rule computing it from (stop reason, event)
Target = JobState | Callable[[str, Any], JobState]
TRANSITIONS: dict[tuple[str, type[ev.Event]], Target] = {
    (Q, ev.JobPlaced): R, (Q, ev.JobHeld): H, (Q, ev.JobCancelled): C,
    (H, ev.JobReleased): Q, (H, ev.JobCancelled): C,
    (Q, ev.JobUpdated): Q, (H, ev.JobUpdated): H,  # a waiting job's request changed: it keeps waiting
    (R, ev.JobStarted): R, (R, ev.JobCancelRequested): R, (R, ev.JobExited): _on_exit, (R, ev.JobLost): L,
    # findings about a running job (GPU memory against its request, idle or busy): it stays running
    (R, ev.JobGpuMemoryExceeded): R, (R, ev.JobGpuMemoryWithin): R, (R, ev.JobIdle): R, (R, ev.JobBusy): R,
    (F, ev.JobRequeued): Q,  # a retry, a time-limit requeue, an attempt that never launched
    (P, ev.JobRequeued): Q,  # after a preemption
    (L, ev.JobRequeued): Q,  # lost with its node, retried by its retry policy
    (P, ev.JobCancelled): C,
}


def move(state: str, event: ev.Event, stop_reason: str = "") -> JobState:
    """``stop_reason``: why the job was asked to stop, if it was."""
    target = TRANSITIONS.get((state, type(event)))
    if target is None:
        job = getattr(event, "job", "?")
        raise IllegalTransition(f"job {job}: {type(event).__name__} is not allowed while {state}")
    return target if isinstance(target, JobState) else target(stop_reason, event)


def next_state(job: Any, event: ev.Event) -> JobState:
    """``move`` for a job of the allocation projection."""
    return move(job.state, event, job.cancel_reason)


def can(state: str, event_type: type[ev.Event]) -> bool:
    return (state, event_type) in TRANSITIONS
