"""The cyclic garbage collector and a big state (issue 16).

A state of 100,000 queued jobs is millions of long-lived objects that make
almost no reference cycles, yet CPython walks every one of them in each full
collection. Measured in a daemon with 100,000 queued jobs: full collections
of 25-680 ms with the loop stopped, freeing 0-5 objects each, about one per
15,000 submissions, which cost a third of the submission rate. Hence:

- ``paused()``: bulk work that makes no cycles worth chasing (loading a
  snapshot and the log's tail, a replay, the history fold) runs without the
  collector;
- ``freeze_survivors()``: what is alive after a load moves to the permanent
  generation (``gc.freeze``), which no collection walks again; reference
  counting still frees it. ``freezing_after_full_collections()`` does the same
  after each full collection, when exactly the objects that survived it are
  left: each full pass then walks only what was made since the last one, so
  its pause no longer grows with the backlog.

The price: a reference cycle among frozen objects that later becomes garbage
is never collected. The state makes next to none (see above); asyncio's
transports break theirs when a connection closes.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused", "freeze_survivors", "freezing_after_full_collections"]


@contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside; whatever garbage there is goes at the next
    pass after."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def freeze_survivors() -> None:
    """Take every object alive now out of all future collections (O(1))."""
    gc.freeze()


def _freeze_after_full(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()  # the younger generations are empty after a full pass


@contextmanager
def freezing_after_full_collections() -> Iterator[None]:
    """Inside, freeze the survivors of every full collection."""
    gc.callbacks.append(_freeze_after_full)
    try:
        yield
    finally:
        gc.callbacks.remove(_freeze_after_full)
