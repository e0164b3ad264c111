"""``eventsched reserve create|list|cancel``: GPUs booked ahead for a user or a tenant."""

from __future__ import annotations

import argparse
import time

from eventsched.cli.connect import socket_client
from eventsched.cli.errors import UserError
from eventsched.domain.text import print_json, table
from eventsched.domain.units import UnitError, parse_begin, parse_duration, parse_gpu_ids
from eventsched.wire.protocol import CancelReservation, CreateReservation, ListReservations

__all__ = ["run"]

WIDTH = 72  # columns of the timeline
MIN_SPAN_S = 24 * 3600.0  # the timeline shows at least the coming day ...
MAX_SPAN_S = 7 * 24 * 3600.0  # ... and at most the coming week


def run(args: argparse.Namespace) -> int:
    wanted = _create(args) if args.reserve_command == "create" else None  # bad input: said before connecting
    with socket_client(args) as c:
        if wanted is not None:
            made = c.request(wanted)
            if args.json:
                print_json(made)
            else:
                print(f"reservation {made['id']}: {_gpus(made)} for {made['owner']} {_when(made, time.time())}")
        elif args.reserve_command == "cancel":
            c.request(CancelReservation(reservation=args.reservation))
            print(f"reservation {args.reservation} cancelled")
        else:
            listed = c.request(ListReservations())
            if args.json:
                print_json(listed["reservations"])
            elif args.timeline:
                print(timeline(listed))
            else:
                print(_table(listed))
    return 0


def _create(args: argparse.Namespace) -> CreateReservation:
    now = time.time()
    if args.start is None or args.duration is None:
        raise UserError("give the window: --start WHEN --duration D")
    try:
        start = parse_begin(args.start, now)
        duration = parse_duration(args.duration)
    except UnitError as exc:
        raise UserError(str(exc).replace("--begin", "--start").replace("time limit", "--duration")) from None
    if (args.gpus is None) == (args.gpu_ids is None):
        raise UserError("give either --gpus K or --gpu-ids LIST")
    node, ids = "", args.gpu_ids
    if ids is not None and ":" in ids:  # NODE:0,1
        node, _, ids = ids.rpartition(":")
    return CreateReservation(
        start=start, end=start + duration, user=args.user or "", tenant=args.tenant or "", gpus=args.gpus or 0,
        gpu_ids=parse_gpu_ids(ids) if ids is not None else None, node=node, name=args.name or "")


def _gpus(r: dict) -> str:
    return f"GPU{'s' if len(r['gpu_ids']) > 1 else ''} {','.join(map(str, r['gpu_ids']))}"


def _when(r: dict, now: float) -> str:
    def at(t: float) -> str:
        return time.strftime("%H:%M:%S" if abs(t - now) < 20 * 3600 else "%a %d %b %H:%M", time.localtime(t))
    return f"{at(r['start'])}–{at(r['end'])}"


def _table(listed: dict) -> str:
    now = listed["now"]
    rows = [[r["id"], r["owner"], r["name"] or "-", f"{r['node']}:{','.join(map(str, r['gpu_ids']))}", _when(r, now),
             "open" + (f", flagged: jobs {','.join(map(str, r['intruders']))}" if r["intruders"] else "")
             if r["active"] else f"in {_span(r['start'] - now)}"] for r in listed["reservations"]]
    if not rows:
        return "no reservations"
    return table(["ID", "FOR", "NAME", "GPUS", "WINDOW", "STATE"], rows)


def _span(s: float) -> str:
    return f"{s / 3600:.1f}h" if s >= 3600 else f"{s / 60:.0f}m" if s >= 60 else f"{s:.0f}s"


def timeline(listed: dict) -> str:
    """Who holds which GPU from now on: a row per GPU, a column per slot, the
    letter of the reservation holding it (legend below), ``.`` where free."""
    now, rows = listed["now"], listed["reservations"]
    span = min(MAX_SPAN_S, max([MIN_SPAN_S] + [r["end"] - now for r in rows]))
    slot = span / WIDTH
    letters = {r["id"]: chr(ord("A") + i % 26) for i, r in enumerate(rows)}
    lines = [f"{'':10} {time.strftime('%a %H:%M', time.localtime(now))}{'':{WIDTH - 19}}"
             f"{time.strftime('%a %H:%M', time.localtime(now + span))}  (one column = {_span(slot)})"]
    for gpu in listed["gpus"]:
        node, _, gid = gpu.rpartition(":")
        cells = ["."] * WIDTH
        for r in rows:
            if r["node"] == node and int(gid) in r["gpu_ids"]:
                lo, hi = int((r["start"] - now) // slot), int(-(-(r["end"] - now) // slot))
                for i in range(max(0, lo), min(WIDTH, hi)):
                    cells[i] = letters[r["id"]]
        lines.append(f"GPU {gpu:6} {''.join(cells)}")
    lines += [f"  {letters[r['id']]} = reservation {r['id']}: {r['owner']} {_when(r, now)}" for r in rows]
    return "\n".join(lines)
