"""The cyclic garbage collector and a big state (figures: docs/measured-choices.md).

A big state is millions of long-lived objects that make almost no reference
cycles, yet each full collection walks them all, with the loop stopped. So bulk
work runs with the collector paused, survivors are frozen (``gc.freeze``: no
collection walks them again, reference counting still frees them) and young
passes come less often. The price: a cycle among frozen objects that later
becomes garbage is never collected; the state makes next to none.
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
    """No cyclic collection inside. What was made inside moves to the oldest
    generation in O(1) (freeze, then unfreeze), else the next young pass walks
    it all; not once this module froze something: unfreezing would hand that back."""
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
    """Inside, freeze the survivors of every full collection, so each full pass walks only
    what was made since the last: its pause does not grow with the backlog."""
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
