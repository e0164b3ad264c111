"""The cyclic garbage collector and a big state (figures: docs/measured-choices.md).

A state of 100,000 queued jobs is millions of long-lived objects that make
almost no reference cycles, yet CPython walks every one of them in each full
collection, with the loop stopped, to free next to nothing. Hence:

- ``paused()``: bulk work that makes no cycles worth chasing (loading a
  snapshot and the log's tail, a replay, the history fold, a forecast's copy
  and run) runs without the collector; what it made goes straight to the
  oldest generation (else the first young pass after walks all of it, only to
  move it on);
- ``freeze_survivors()``: what is alive after a load moves to the permanent
  generation (``gc.freeze``), which no collection walks again; reference
  counting still frees it. ``freezing_after_full_collections()`` does the same
  after each full collection, so each full pass walks only what was made since
  the last one: its pause no longer grows with the backlog;
- ``fewer_young_passes()``: while serving, a young pass comes every 10,000
  allocations instead of 700, since each pass costs more as the state grows.
  Young garbage waits a little longer to be found.

The price: a reference cycle among frozen objects that later becomes garbage
is never collected. The state makes next to none; asyncio's transports break
theirs when a connection closes.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused", "freeze_survivors", "thaw", "freezing_after_full_collections", "fewer_young_passes"]

YOUNG_PASS_EVERY = 10_000  # allocations between young passes while serving (CPython: 700)

# whether this process froze anything through this module: kept here because
# gc.get_freeze_count() walks the whole permanent generation, a big state included
_frozen = False


@contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside; whatever garbage there is goes at the next
    full pass after. What was made inside moves to the oldest generation in
    O(1) (freeze, then unfreeze), not walked by the next young pass; not when
    this module froze something already: unfreezing would hand that back to
    full passes."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            if not _frozen:
                gc.freeze()
                gc.unfreeze()  # the permanent generation into the oldest, not walked
            gc.enable()


def freeze_survivors() -> None:
    """Take every object alive now out of all future collections (O(1))."""
    global _frozen
    gc.freeze()
    _frozen = True


def thaw() -> None:
    """Hand every frozen object back to the collector."""
    global _frozen
    gc.unfreeze()
    _frozen = False


def _freeze_after_full(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and info["generation"] == 2:
        freeze_survivors()  # the younger generations are empty after a full pass


@contextmanager
def freezing_after_full_collections() -> Iterator[None]:
    """Inside, freeze the survivors of every full collection."""
    gc.callbacks.append(_freeze_after_full)
    try:
        yield
    finally:
        gc.callbacks.remove(_freeze_after_full)


@contextmanager
def fewer_young_passes(every: int = YOUNG_PASS_EVERY) -> Iterator[None]:
    """Inside, a young pass every ``every`` allocations (the older
    generations' thresholds unchanged)."""
    before = gc.get_threshold()
    gc.set_threshold(every, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
