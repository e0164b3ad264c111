"""Which jobs ``queue`` lists and ``cancel`` selects: ``--state``, ``--user``
and ``--name``, each a comma-separated list (squeue's and scancel's -t, -u, -n)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eventsched.cli.errors import UserError
from eventsched.domain.states import ACTIVE, JobState

__all__ = ["JobFilter", "job_filter", "parse_states"]

# Slurm's codes and names for the states that have a match here (held jobs are
# Slurm's pending ones with a hold reason: only "held" names them)
SLURM_STATES = {"pd": "queued", "pending": "queued", "r": "running", "cd": "succeeded", "completed": "succeeded",
                "f": "failed", "ca": "cancelled", "canceled": "cancelled", "pr": "preempted", "nf": "lost",
                "node_fail": "lost"}
_NAMES = frozenset(state.value for state in JobState)


def _words(text: str | None) -> frozenset[str]:
    return frozenset(w for w in (part.strip() for part in (text or "").split(",")) if w)


def parse_states(text: str) -> frozenset[str]:
    """``R,pd,held`` -> {"running", "queued", "held"}; an unknown state is a one-line error."""
    states = set()
    for word in _words(text):
        state = SLURM_STATES.get(word.lower(), word.lower())
        if state not in _NAMES:
            raise UserError(f"--state {word!r}: not a job state (one of {', '.join(JobState)}, "
                            f"or Slurm's {', '.join(sorted({k.upper() for k in SLURM_STATES if len(k) <= 2}))})")
        states.add(state)
    if not states:
        raise UserError("--state needs a state, e.g. --state running or -t R")
    return frozenset(states)


@dataclass(frozen=True)
class JobFilter:
    """A job (as ``queue --json`` shows it) passes when it matches every list given."""

    states: frozenset[str] | None
    users: frozenset[str]
    names: frozenset[str]

    def __call__(self, job: dict[str, Any]) -> bool:
        return ((self.states is None or job["state"] in self.states) and (not self.users or job["user"] in self.users)
                and (not self.names or job["name"] in self.names))

    @property
    def finished(self) -> bool:
        """Whether it can match a job that has ended (so the listing must include them)."""
        return self.states is not None and not self.states <= ACTIVE


def job_filter(args: Any) -> JobFilter | None:
    """The filter ``--state``/``--user``/``--name`` ask for; None when none is given."""
    if not (args.state or args.user or args.name):
        return None
    return JobFilter(parse_states(args.state) if args.state else None, _words(args.user), _words(args.name))
