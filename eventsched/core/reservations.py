"""Booked GPUs (``eventsched reserve``, docs/reservations.md): pure rules over the state.

During a window its GPUs go only to its owner's jobs; before it, another's job
may start there only if predicted to end before the window opens.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.domain.messages import RefusalKind, Refused
from eventsched.domain.units import LAST_TIME
from eventsched.projections.cluster import ClusterState, Job
from eventsched.projections.model import DEFAULT_RUNTIME_S, runtime_key, time_limit_of

__all__ = ["predicted_runtime", "owns", "holds", "held_by", "intruders", "next_edge", "create", "cancel",
           "describe", "listing", "row"]

Hold = Callable[[Job], frozenset[int]]


def predicted_runtime(state: ClusterState, job: Job) -> float | None:
    """Its kind's past runs within its time limit, else the limit; None when nothing predicts it."""
    limit = time_limit_of(job, state.config.default_time_limit_s)
    key = runtime_key(job.spec)
    if key in state.stats.by_key:
        pred = state.stats.predict(key, DEFAULT_RUNTIME_S)
        return min(pred, limit) if limit is not None else pred
    return limit


def owns(state: ClusterState, r: ev.ReservationCreated, job: Job) -> bool:
    spec = job.spec
    if r.tenant:
        tenant = state.tenants.get(r.tenant)
        return spec.tenant == r.tenant or (tenant is not None and spec.user in tenant.users)
    return spec.uid == r.uid if r.uid >= 0 else spec.user == r.user


def _blocks(state: ClusterState, r: ev.ReservationCreated, job: Job, now: float) -> bool:
    """Does ``r`` keep ``job`` off its GPUs now?"""
    if r.end <= now or owns(state, r, job):
        return False
    if r.start <= now:
        return True
    pred = predicted_runtime(state, job)
    return pred is None or now + pred > r.start


def holds(state: ClusterState, index: dict[tuple[str, int], int], now: float) -> Hold | None:
    """The view indices each job must stay off now: booked for another, or being freed
    by a preemption for another job. None when nothing is held (the common case)."""
    live = [r for r in state.reservations.values() if r.end > now]
    rooms = {w: [index[k] for k in state.jobs[w].room if k in index] for w in state.making_room}
    if not live and not rooms:
        return None
    idxs = {r.reservation: [index[(r.node, g)] for g in r.gpu_ids if (r.node, g) in index] for r in live}

    def hold(job: Job) -> frozenset[int]:
        booked = (i for r in live if _blocks(state, r, job, now) for i in idxs[r.reservation])
        return frozenset([*booked, *(i for w, room in rooms.items() if w != job.id for i in room)])

    return hold


def held_by(state: ClusterState, job: Job, now: float) -> ev.ReservationCreated | None:
    """The first reservation (by start) that keeps ``job`` off its GPUs now."""
    found = [r for r in state.reservations.values() if _blocks(state, r, job, now)]
    return min(found, key=lambda r: (r.start, r.reservation), default=None)


def intruders(state: ClusterState, now: float) -> list[tuple[int, ev.ReservationCreated]]:
    """(running job, reservation) of others' jobs in an open window, not already stopping."""
    out: list[tuple[int, ev.ReservationCreated]] = []
    for r in sorted(state.reservations.values(), key=lambda r: r.reservation):
        if not r.start <= now < r.end:
            continue
        for g in r.gpu_ids:
            gpu = state.gpus.get((r.node, g))
            for jid in sorted(gpu.jobs) if gpu is not None else ():
                job = state.jobs[jid]
                if not job.cancel_reason and not owns(state, r, job) and all(j != jid for j, _ in out):
                    out.append((jid, r))
    return out


def next_edge(state: ClusterState, now: float) -> float | None:
    edges = [t for r in state.reservations.values() for t in (r.start, r.end) if t > now]
    return min(edges, default=None)


def _booked_hours(state: ClusterState, uid: int, now: float) -> float:
    return sum(len(r.gpu_ids) * (r.end - max(r.start, now)) / 3600.0
               for r in state.reservations.values() if r.uid == uid and r.end > now)


def _running_into(state: ClusterState, node: str, gpu: int, msg: m.Reserve) -> int | None:
    """A running job of another on ``gpu`` not predicted to end by ``msg``'s start."""
    g = state.gpus.get((node, gpu))
    for jid in sorted(g.jobs) if g is not None else ():
        job = state.jobs[jid]
        if job.spec.uid == msg.uid and msg.uid >= 0:
            continue
        pred = predicted_runtime(state, job)
        if pred is None or (job.started_at if job.started_at is not None else msg.start) + pred > msg.start:
            return jid
    return None


def _check_limits(state: ClusterState, msg: m.Reserve, now: float, ahead: float, gpu_hours: float) -> None:
    if msg.tenant and msg.user not in state.tenants[msg.tenant].users:
        raise Refused(RefusalKind.FORBIDDEN, f"{msg.user} is not a member of tenant {msg.tenant}")
    if msg.start - now > ahead * 3600:
        raise Refused(RefusalKind.OVER_LIMIT, f"a reservation may start at most {ahead:g} h ahead "
                      "([reservations] max_hours_ahead)")
    count = len(msg.gpu_ids) if msg.gpu_ids is not None else msg.gpus
    booked = _booked_hours(state, msg.uid, now) + count * (msg.end - max(msg.start, now)) / 3600.0
    if booked > gpu_hours:
        raise Refused(RefusalKind.OVER_LIMIT, f"that would book {booked:.1f} GPU-hours for {msg.user}, over the "
                      f"limit of {gpu_hours:g} ([reservations] max_gpu_hours)")


def create(state: ClusterState, msg: m.Reserve, now: float, rid: int) -> ev.ReservationCreated:
    if not msg.end > msg.start:
        raise Refused(RefusalKind.INVALID, "--duration must be more than 0")
    if not (msg.start >= 0 and msg.end < LAST_TIME):  # inf and nan fail this too
        raise Refused(RefusalKind.INVALID, "a reservation must end before the year 10000")
    if msg.end <= now:
        raise Refused(RefusalKind.INVALID, "that window is already over")
    if msg.tenant and msg.tenant not in state.tenants:
        raise Refused(RefusalKind.NOT_FOUND, f"no tenant {msg.tenant!r}")
    if msg.limits is not None:
        _check_limits(state, msg, now, *msg.limits)
    node = msg.node or state.node
    if msg.node and msg.node not in state.node_gpus:
        raise Refused(RefusalKind.NOT_FOUND, f"no node {msg.node!r} (nodes: {', '.join(sorted(state.node_gpus)) or 'none'})")
    taken = [r for r in state.reservations.values() if r.node == node and r.start < msg.end and msg.start < r.end]
    have = [g.id for g in state.node_gpus.get(node, []) if not g.lost]
    # a user books what is free by then; only an operator may book GPUs that others' jobs will still hold
    busy = {g: j for g in have if (j := _running_into(state, node, g, msg)) is not None}
    if msg.gpu_ids is not None:
        gpu_ids = sorted(set(msg.gpu_ids))
        unknown = [g for g in gpu_ids if g not in have]
        if not gpu_ids or unknown:
            raise Refused(RefusalKind.NOT_FOUND, f"no GPU {', '.join(map(str, unknown)) or 'given'} on {node} "
                          f"(GPUs here: {', '.join(map(str, have)) or 'none'})")
        clash = [g for g in gpu_ids if g in busy] if msg.limits is not None else []
        if clash:
            job = state.jobs[busy[clash[0]]]
            raise Refused(RefusalKind.CONFLICT, f"GPU {clash[0]} runs job {job.id} of {job.spec.user}, not predicted "
                          "to end by then; book another time or other GPUs, or ask an operator")
        for r in taken:
            if set(r.gpu_ids) & set(gpu_ids):
                raise Refused(RefusalKind.CONFLICT, f"GPU {','.join(map(str, r.gpu_ids))}: {describe(r, now)}")
    else:
        booked = {g for r in taken for g in r.gpu_ids}
        free = sorted((g for g in have if g not in booked and (msg.limits is None or g not in busy)),
                      key=lambda g: g in busy)  # those free by then first
        if msg.gpus < 1 or len(free) < msg.gpus:
            raise Refused(RefusalKind.CONFLICT if msg.gpus >= 1 else RefusalKind.INVALID,
                          f"--gpus must be at least 1, not {msg.gpus}" if msg.gpus < 1 else
                          f"only {len(free)} of {len(have)} GPUs on {node} are free then; asked for {msg.gpus}")
        gpu_ids = free[:msg.gpus]
    return ev.ReservationCreated(ts=now, cause=msg.by or "operator", reservation=rid, node=node, gpu_ids=gpu_ids,
                                 start=msg.start, end=msg.end, user=msg.user, uid=msg.uid, tenant=msg.tenant,
                                 name=msg.name, by=msg.by)


def cancel(state: ClusterState, msg: m.CancelReservation, now: float) -> ev.ReservationCancelled:
    r = state.reservations.get(msg.reservation)
    if r is None:
        raise Refused(RefusalKind.NOT_FOUND, f"no reservation {msg.reservation}")
    if not msg.operator and msg.uid != r.uid and msg.by != r.by:
        raise Refused(RefusalKind.FORBIDDEN, f"reservation {r.reservation} is {_owner(r)}'s; only its owner, "
                      "who booked it, or an operator may cancel it")
    return ev.ReservationCancelled(ts=now, cause=msg.by or "operator", reservation=r.reservation, by=msg.by)


def _owner(r: ev.ReservationCreated) -> str:
    return f"tenant {r.tenant}" if r.tenant else r.user or f"uid {r.uid}"


def _clock(t: float, now: float) -> str:
    fmt = "%H:%M" if abs(t - now) < 20 * 3600 else "%a %d %b %H:%M"
    return time.strftime(fmt, time.localtime(t))


def describe(r: ev.ReservationCreated, now: float) -> str:
    """"reserved for alice 14:00–16:00 (reservation 3)"."""
    return f"reserved for {_owner(r)} {_clock(r.start, now)}–{_clock(r.end, now)} (reservation {r.reservation})"


def listing(state: ClusterState, now: float) -> dict:
    rows = [row(state, r, now) for r in sorted(state.reservations.values(), key=lambda r: (r.start, r.reservation))
            if r.end > now]
    return {"now": now, "reservations": rows, "gpus": [f"{g.node}:{g.id}" for g in state.gpu_list]}


def row(state: ClusterState, r: ev.ReservationCreated, now: float) -> dict:
    """One reservation as ``reserve list --json`` shows it."""
    return {"id": r.reservation, "owner": _owner(r), "user": r.user, "tenant": r.tenant, "name": r.name,
            "node": r.node, "gpu_ids": list(r.gpu_ids), "start": r.start, "end": r.end, "by": r.by,
            "active": r.start <= now < r.end, "intruders": [j for j, x in intruders(state, now) if x is r]}
