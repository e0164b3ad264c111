"""Event subscriptions: each committed batch to every subscriber, and each new
subscriber's history from the log, as its user may see it. History is read in
chunks, a few subscriptions of one user at a time, so a stalled one holds little.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Protocol

import anyio

from eventsched.domain.events import Event, encode_many
from eventsched.domain.paths import log_dir
from eventsched.domain.visibility import BatchView, redact_events
from eventsched.storage import log as eventlog

HISTORY_CHUNK_BYTES = 256 << 10  # history is read and sent in chunks of about this size
HISTORY_PER_USER = 2  # subscriptions of one user being sent history at once (the others wait)


class Subscriber(Protocol):
    def deliver(self, view: BatchView) -> None: ...


class Feed:
    def __init__(self, state_dir: Path, operators: frozenset[int], committed: Callable[[], int]) -> None:
        self.state_dir = state_dir
        self.operators = operators
        self.committed = committed  # the last sequence number the engine made durable
        self.subscribers: set[Subscriber] = set()
        self.limiter = anyio.CapacityLimiter(4)  # worker threads reading history
        self._slots: dict[int, asyncio.Semaphore] = {}

    def subscribe(self, subscriber: Subscriber) -> int:
        """Register ``subscriber``; the seq its history runs up to (taken in the
        same step, so history plus the live batches lose nothing)."""
        self.subscribers.add(subscriber)
        return self.committed()

    def fan_out(self, payload: bytes) -> bool:
        if self.subscribers:
            view = BatchView(payload, self.operators)
            for subscriber in list(self.subscribers):
                subscriber.deliver(view)
        return True

    def slot(self, uid: int) -> asyncio.Semaphore:
        """Held by one of ``uid``'s subscriptions while it is sent history."""
        return self._slots.setdefault(uid, asyncio.Semaphore(HISTORY_PER_USER))

    def history(self, from_seq: int) -> Iterator[list[Event]]:
        return eventlog.read_batches(log_dir(self.state_dir), from_seq=from_seq)

    def chunk(self, cursor: Iterator[list[Event]], from_seq: int, upto: int, viewer: int) -> tuple[list[bytes], bool]:
        """The next ~HISTORY_CHUNK_BYTES of ``cursor`` as ``viewer`` may see it;
        True once ``upto`` is reached. Runs in a worker thread."""
        payloads: list[bytes] = []
        size = 0
        for batch in cursor:
            kept = redact_events([event for event in batch if from_seq <= event.seq <= upto], viewer, self.operators)
            if kept:
                payload = encode_many(kept)
                if len(payload) > HISTORY_CHUNK_BYTES and len(kept) > 1:
                    # a big group commit goes out in pieces, each paced
                    parts = -(-len(payload) // HISTORY_CHUNK_BYTES)
                    step = -(-len(kept) // parts)
                    payloads.extend(encode_many(kept[i : i + step]) for i in range(0, len(kept), step))
                else:
                    payloads.append(payload)
                size += len(payload)
            if batch and batch[-1].seq >= upto:
                return payloads, True
            if size >= HISTORY_CHUNK_BYTES:
                return payloads, False
        return payloads, True
