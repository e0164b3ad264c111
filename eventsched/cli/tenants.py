"""``eventsched tenants`` and ``eventsched tenant set|remove`` (F12)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from eventsched.domain.paths import socket_location
from eventsched.domain.text import table
from eventsched.domain.units import UnitError

if TYPE_CHECKING:
    from eventsched.wire.client import Client

__all__ = ["add_parsers", "cmd_tenants", "cmd_tenant"]


def _client(args: argparse.Namespace) -> Client:
    from eventsched.wire.client import Client

    return Client(args.socket or socket_location(args.state_dir))


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("tenants", parents=[common], help="each tenant: quota, weight, usage now, fair share, recent usage")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("tenant", parents=[common], help="define or remove a tenant at run time (root or the daemon's user)")
    actions = p.add_subparsers(dest="tenant_command", parser_class=type(p), metavar="ACTION")
    actions.required = True
    q = actions.add_parser("set", help="create a tenant or change the keys given (the rest stay as they are)")
    q.add_argument("name")
    q.add_argument("--users", metavar="A,B", help="its users (replaces the list)")
    q.add_argument("--gpus", metavar="N", help="GPUs running at once (shares add up); 'none' for no ceiling")
    q.add_argument("--gpu-mem", metavar="MIB", help="GPU memory reserved at once; 'none' for no ceiling")
    q.add_argument("--jobs", metavar="N", help="jobs running at once; 'none' for no ceiling")
    q.add_argument("--weight", type=float, help="fair-share weight (> 0)")
    q.add_argument("--preemptible", choices=["yes", "no"], help="its jobs over its fair share may be preempted")
    q.add_argument("--default-for", metavar="A,B", help="users for whom this is the tenant when they name none")
    q.add_argument("--json", action="store_true")
    q = actions.add_parser("remove", help="remove a tenant (its users fall back to the default tenant)")
    q.add_argument("name")


def cmd_tenants(args: argparse.Namespace) -> int:
    rows = _client(args).tenants()
    if args.json:
        _print_json(rows)
        return 0
    print(table(
        ["TENANT", "WEIGHT", "GPUS", "QUOTA", "JOBS", "QUEUED", "SHARE", "RECENT", "FACTOR", "RECENT GPU-H"],
        [[r["tenant"], f"{r['weight']:g}", f"{r['usage']['gpus']:g}", _quota(r["quota"]),
          str(r["usage"]["jobs"]), str(r["usage"]["queued"]), f"{r['fair_share']:.0%}", f"{r['recent_share']:.0%}",
          f"{r['fair_share_factor']:.2f}", f"{r['recent_gpu_hours']:.2f}"] for r in rows],
    ))
    return 0


def _quota(q: dict[str, Any]) -> str:
    parts = []
    if q["gpus"] is not None:
        parts.append(f"{q['gpus']:g} GPUs")
    if q["gpu_mem_mib"] is not None:
        parts.append(f"{q['gpu_mem_mib']} MiB")
    if q["jobs"] is not None:
        parts.append(f"{q['jobs']} jobs")
    return ", ".join(parts) or "-"


def cmd_tenant(args: argparse.Namespace) -> int:
    import msgspec

    from eventsched.domain.tenants import Tenant

    c = _client(args)
    if args.tenant_command == "remove":
        c.set_tenant(args.name, None)
        print(f"tenant {args.name} removed")
        return 0
    current = {r["tenant"]: r for r in c.tenants() if r["configured"]}
    base: dict[str, Any] = {}
    if args.name in current:
        r = current[args.name]
        base = {"users": r["users"], **{k: v for k, v in r["quota"].items() if v is not None},
                "weight": r["weight"], "preemptible": r["preemptible"]}
    if args.users is not None:
        base["users"] = _names(args.users)
    for key, text in (("gpus", args.gpus), ("gpu_mem_mib", args.gpu_mem), ("jobs", args.jobs)):
        if text is not None:
            if text == "none":
                base.pop(key, None)
            else:
                base[key] = _number(key, text)
    if args.weight is not None:
        base["weight"] = args.weight
    if args.preemptible is not None:
        base["preemptible"] = args.preemptible == "yes"
    if args.default_for is not None:
        base["default_for"] = _names(args.default_for)
    try:
        tenant = msgspec.convert(base, Tenant)
    except msgspec.ValidationError as exc:
        raise UnitError(f"tenant {args.name}: {exc}") from None
    rows = c.set_tenant(args.name, tenant)
    if args.json:
        _print_json(rows)
    else:
        print(f"tenant {args.name} set")
    return 0


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _number(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UnitError(f"--{key.replace('_mib', '').replace('_', '-')} {text!r}: a number, or 'none'") from None
    if not value >= 0:
        raise UnitError(f"--{key.replace('_mib', '').replace('_', '-')} must be >= 0, not {text}")
    return int(value) if key != "gpus" else value
