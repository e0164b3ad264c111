"""Append batches to a log on a worker thread, in order, one frame each: for
a producer that need not wait for each to be durable (a replay). The write,
the fdatasync and the checksum release the GIL, so they overlap its work.
Not the daemon: it replies only after its own commit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from eventsched.domain.events import Event
from eventsched.storage.log import LogWriter

__all__ = ["BackgroundAppender"]

_DONE = None  # the last item on the queue


class BackgroundAppender:
    """The first failure stops all later appends (a log never gets a gap) and
    is raised by the next ``append`` or ``finish``; at most ``depth`` batches wait."""

    def __init__(self, writer: LogWriter, depth: int = 2) -> None:
        self.writer = writer
        self._queue: queue.Queue[Sequence[Event] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._finished = False
        self._thread = threading.Thread(target=self._run, name="eventsched-log-appender", daemon=True)
        self._thread.start()

    def append(self, events: Sequence[Event]) -> None:
        self._raise_failure()
        if self._finished:
            raise RuntimeError("append after finish")
        self._queue.put(events)

    def finish(self) -> None:
        """Wait until every batch handed over is durable; raise the first failure."""
        if not self._finished:
            self._finished = True
            self._queue.put(_DONE)
            self._thread.join()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is _DONE:
                return
            if self._error is None:  # after a failure, drain the queue without writing
                try:
                    self.writer.append(batch)
                except BaseException as exc:  # handed to the producer's thread
                    self._error = exc
