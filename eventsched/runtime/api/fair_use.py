"""Per-user fair use of the control socket: connections, requests in the engine
and unread replies, bounded per uid. Root and the daemon's user are never held
back, and may connect past the total so they can still look when users hold every slot.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Protocol

from eventsched.runtime.config import ConnectionLimits

logger = logging.getLogger("eventsched.server")

OPERATOR_RESERVE = 32  # root and the daemon's user may connect this far beyond max_total


class Member(Protocol):
    """What the accounting asks of a connection."""

    def unread(self) -> int: ...

    def resume_share(self) -> None: ...


class FairUse:
    def __init__(self, limits: ConnectionLimits, operators: frozenset[int], max_total: int) -> None:
        self.limits = limits
        self.operators = operators
        self.max_total = max_total
        self.open_total = 0
        self.open_by_uid: dict[int, set[Member]] = {}
        self._refusals: collections.Counter[int] = collections.Counter()
        self.in_flight_by_uid: collections.Counter[int] = collections.Counter()
        # connections waiting for their user's share to free up, woken in order
        self._waiting: dict[int, dict[Member, None]] = {}

    def admit(self, member: Member, uid: int, pid: int) -> str | None:
        """Count ``member`` in, or say why it is refused."""
        operator = uid in self.operators
        mine = self.open_by_uid.setdefault(uid, set())
        refusal = None
        if self.open_total >= self.max_total + (OPERATOR_RESERVE if operator else 0):
            refusal = f"too many connections to the daemon (limit {self.max_total}); try again later"
        elif not operator and len(mine) >= self.limits.max_per_user:
            refusal = f"too many connections from uid {uid} (limit {self.limits.max_per_user})"
        if refusal is not None:
            if not mine:
                del self.open_by_uid[uid]
            self._refusals[uid] += 1
            count = self._refusals[uid]
            if count & (count - 1) == 0:  # 1, 2, 4, 8...: visible, never a flood of its own
                logger.warning("refused connection %d from uid %d (pid %d): %s", count, uid, pid, refusal)
            return refusal
        mine.add(member)
        self.open_total += 1
        return None

    def release(self, member: Member, uid: int) -> None:
        mine = self.open_by_uid.get(uid)
        if mine is not None and member in mine:
            mine.discard(member)
            self.open_total -= 1
            if not mine:
                del self.open_by_uid[uid]
        self._waiting.get(uid, {}).pop(member, None)

    def may_dispatch(self, member: Member, uid: int) -> bool:
        """May ``member`` hand its user's next request to the engine now? If
        not, it waits unread until one of theirs is answered."""
        if uid in self.operators or self.in_flight_by_uid[uid] < self.limits.max_requests_in_flight_per_user:
            return True
        self._waiting.setdefault(uid, {})[member] = None
        return False

    def dispatched(self, uid: int) -> None:
        self.in_flight_by_uid[uid] += 1

    def answered(self, uid: int) -> None:
        self.in_flight_by_uid[uid] -= 1
        if self.in_flight_by_uid[uid] <= 0:
            del self.in_flight_by_uid[uid]
        waiting = self._waiting.get(uid)
        if not waiting:
            return
        free = self.limits.max_requests_in_flight_per_user - self.in_flight_by_uid[uid]
        loop = asyncio.get_running_loop()
        for member in list(waiting)[: max(1, free)]:
            del waiting[member]
            loop.call_soon(member.resume_share)
        if not waiting:
            del self._waiting[uid]

    def may_buffer(self, uid: int, size: int) -> bool:
        """May ``size`` more bytes wait unread for ``uid``? One reply of any
        size may, when nothing else of theirs waits."""
        if uid in self.operators:
            return True
        waiting = self.unread_by(uid)
        return waiting == 0 or waiting + size <= self.limits.max_unread_bytes_per_user

    def unread_by(self, uid: int) -> int:
        """What ``uid``'s connections leave unread (0 for operators: never limited)."""
        if uid in self.operators:
            return 0
        return sum(member.unread() for member in self.open_by_uid.get(uid, ()))
