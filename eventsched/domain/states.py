"""Job states and the one table of how events move a job between them.

Modelled on h11's ``_state.py``: every legal move is an entry keyed by
``(state, event type)``; a pair that is not in the table is illegal, and
``next_state`` raises ``IllegalTransition`` before anything changes. The
projection folds with it, the core checks commands against it before it
emits anything, and the one rule that is not a plain lookup — what state
follows an exit — is ``exit_outcome``, used by the projection, the read model
and the notebook panel alike.

``JobState`` is a ``StrEnum``: a state compares equal to its name
(``JobState.QUEUED == "queued"``), which is how it appears in JSON, SQL and
the log.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any

from eventsched.domain import events as ev

__all__ = [
    "JobState", "FINAL", "ACTIVE", "WAITING", "TRANSITIONS", "IllegalTransition", "next_state", "exit_outcome",
    "can", "STOP_REASONS", "GPU_MEMORY_OVER", "WARNED_STOPS",
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

FINAL = frozenset({S, F, C, L})  # nothing happens to the job any more
WAITING = frozenset({Q, H})  # not running, may still run
ACTIVE = frozenset({Q, H, R})  # what `queue` shows without --all

# why a running job was asked to stop (JobCancelRequested.reason); issue 17:
# "gpu-memory" (over its --gpu-mem under gpu_mem_policy "stop": ends failed),
# "idle" (idle_policy "stop": ends cancelled), "idle-requeue" (idle_policy
# "requeue": ends preempted, then queued again)
STOP_REASONS = ("cancelled", "time-limit", "preempted", "gpu-memory", "idle", "idle-requeue")
# the stops that warn first: the job's --signal (else SIGTERM), SIGKILL after its grace
WARNED_STOPS = frozenset({"preempted", "gpu-memory", "idle", "idle-requeue"})
GPU_MEMORY_OVER = "GPU memory over request"  # JobExited.reason of a job stopped for it


class IllegalTransition(ValueError):
    """An event that does not fit the job's state; nothing was changed."""


def exit_outcome(stop_reason: str, exit_code: int | None, reason: str = "") -> JobState:
    """The state a running job ends in when its process exits.

    ``stop_reason`` is why it was asked to stop, if it was (``cancelled``,
    ``time-limit``, ``preempted``, or ""); ``reason`` what the exit report
    says. A job asked to stop ends as the stop says, whatever its exit code.
    """
    if stop_reason in ("cancelled", "idle") or reason == "cancelled":
        return C
    if stop_reason in ("preempted", "idle-requeue"):
        return P
    if stop_reason in ("time-limit", "gpu-memory"):
        return F
    return S if exit_code == 0 else F


_BY_NAME = {state.value: state for state in JobState}  # a dict lookup: JobState(name) costs ten times more


def _on_exit(job: Any, event: Any) -> JobState:
    recorded = event.outcome
    return _BY_NAME[recorded] if recorded else exit_outcome(job.cancel_reason, event.exit_code, event.reason)


# (state, event type) -> the next state, or a rule computing it from (job, event)
Target = JobState | Callable[[Any, Any], JobState]
TRANSITIONS: dict[tuple[JobState, type[ev.Event]], Target] = {
    (Q, ev.JobPlaced): R,
    (Q, ev.JobHeld): H,
    (Q, ev.JobCancelled): C,
    (H, ev.JobReleased): Q,
    (H, ev.JobCancelled): C,
    (R, ev.JobStarted): R,
    (R, ev.JobCancelRequested): R,
    (R, ev.JobExited): _on_exit,
    (R, ev.JobLost): L,
    # issue 17: findings about a running job, which stays running
    (R, ev.JobGpuMemoryExceeded): R,
    (R, ev.JobGpuMemoryWithin): R,
    (R, ev.JobIdle): R,
    (R, ev.JobBusy): R,
    (F, ev.JobRequeued): Q,  # a retry (F17), a time-limit requeue (F9), a never-launched attempt
    (P, ev.JobRequeued): Q,  # preemption (F13)
    (L, ev.JobRequeued): Q,  # issue 12: lost with its node, retried by its retry policy
    (P, ev.JobCancelled): C,
}


def next_state(job: Any, event: ev.Event) -> JobState:
    """The state ``event`` moves ``job`` to; ``IllegalTransition`` if none."""
    target = TRANSITIONS.get((job.state, type(event)))
    if target is None:
        raise IllegalTransition(f"job {job.id}: {type(event).__name__} is not allowed while {job.state}")
    return target if isinstance(target, JobState) else target(job, event)


def can(state: str, event_type: type[ev.Event]) -> bool:
    """Whether an event of ``event_type`` is legal for a job in ``state``."""
    return (JobState(state), event_type) in TRANSITIONS
