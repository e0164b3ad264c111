"""The sans-I/O scheduler: ``handle(state, message, now) -> (events, effects)``.

``scheduler`` turns one message into events and effects, ``policies`` decide
placements (``fgd`` is the fragmentation-aware one), ``explain`` says why a
job waits, ``admission`` bounds what a user may submit.
"""

from eventsched.core.scheduler import NOT_LAUNCHED, check_spec, handle, next_deadline

__all__ = ["handle", "check_spec", "next_deadline", "NOT_LAUNCHED"]
