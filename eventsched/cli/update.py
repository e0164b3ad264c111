"""``eventsched update JOB [--priority P] [--time-limit T] [--gpus G] [--name N]``:
change a queued or held job, as Slurm's ``scontrol update`` does. The daemon
checks it as it would the changed submission and records it in the log."""

from __future__ import annotations

import argparse
import os

from eventsched.cli.connect import socket_client
from eventsched.cli.errors import UserError
from eventsched.domain.text import print_json, printable
from eventsched.domain.units import parse_duration

__all__ = ["cmd_update"]


def cmd_update(args: argparse.Namespace) -> int:
    from eventsched.wire import protocol

    if args.priority is None and args.time_limit is None and args.gpus is None and args.name is None:
        raise UserError("nothing to update: give --priority, --time-limit, --gpus or --name")
    if os.environ.get("EVENTSCHED_URL"):
        raise UserError("update needs the daemon's socket; over EVENTSCHED_URL it is not offered")
    request = protocol.UpdateJob(job=args.job, priority=args.priority, gpus=args.gpus, name=args.name,
                                 time_limit_s=parse_duration(args.time_limit) if args.time_limit else None)
    with socket_client(args) as c:
        job = c.request(request)
    if args.json:
        print_json(job)
    else:
        limit = "none" if job["time_limit_s"] is None else f"{job['time_limit_s']:g}s"
        print(f"{job['id']}\t{job['state']}\tpriority {job['priority']}, {job['gpus']:g} GPUs, time limit {limit}, "
              f"name {printable(job['name'])}")
    return 0
