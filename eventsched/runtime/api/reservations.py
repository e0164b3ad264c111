"""``eventsched reserve``'s requests as the core's messages: who books for
whom (a user for themself within the config's limits; an operator for anyone)."""

from __future__ import annotations

import pwd
from collections.abc import Callable
from typing import Any

from eventsched.core import reservations
from eventsched.domain import events as ev
from eventsched.domain import messages as msg
from eventsched.domain.messages import RefusalKind, Refused
from eventsched.domain.settings import ReservationLimits
from eventsched.runtime.api.admission import account
from eventsched.runtime.api.connection import Peer
from eventsched.runtime.engine import Answer, Query
from eventsched.wire import protocol

__all__ = ["translate"]

Request = protocol.CreateReservation | protocol.ListReservations | protocol.CancelReservation


def translate(request: Request, peer: Peer, operator: bool, limits: ReservationLimits,
              clock: Callable[[], float]) -> tuple[msg.Message | Query, Answer | None]:
    if isinstance(request, protocol.ListReservations):
        return Query(lambda state: reservations.listing(state, clock())), None
    if isinstance(request, protocol.CancelReservation):
        rid = request.reservation
        return msg.CancelReservation(reservation=rid, uid=peer.uid, operator=operator, by=peer.by), (
            lambda state, _events: {"id": rid, "cancelled": True})
    r, me = request, account(peer.uid)[0]
    if not operator and r.user and r.user != me:
        raise Refused(RefusalKind.FORBIDDEN, "only root or the daemon's user may book GPUs for another user")
    user, uid = r.user or me, peer.uid
    if user != me:
        try:
            uid = pwd.getpwnam(user).pw_uid
        except KeyError:
            raise Refused(RefusalKind.NOT_FOUND, f"no user {user!r}") from None
    if r.tenant and operator and not r.user:  # a tenant's booking, by no one of it
        user, uid = "", -1
    return msg.Reserve(start=r.start, end=r.end, user=user, uid=uid, tenant=r.tenant, gpus=r.gpus,
                       gpu_ids=r.gpu_ids, node=r.node, name=r.name, by=peer.by,
                       limits=None if operator else (limits.max_hours_ahead, limits.max_gpu_hours)), _created


def _created(state: Any, events: list[ev.Event]) -> dict:
    made = next(e for e in events if isinstance(e, ev.ReservationCreated))
    return reservations.row(state, made, made.ts)
