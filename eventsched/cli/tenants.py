"""``eventsched tenants`` and ``eventsched tenant set|remove``."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from eventsched.cli.connect import socket_client as _client
from eventsched.domain.text import print_json, table
from eventsched.domain.units import UnitError

__all__ = ["cmd_tenants", "cmd_tenant"]


def cmd_tenants(args: argparse.Namespace) -> int:
    rows = _client(args).tenants()
    if args.json:
        print_json(rows)
        return 0
    print(table(
        ["TENANT", "WEIGHT", "GPUS", "QUOTA", "JOBS", "QUEUED", "SHARE", "RECENT", "FACTOR", "RECENT GPU-H",
         "MONTH GPU-H"],
        [[r["tenant"], f"{r['weight']:g}", f"{r['usage']['gpus']:g}", _quota(r["quota"]),
          str(r["usage"]["jobs"]), str(r["usage"]["queued"]), f"{r['fair_share']:.0%}", f"{r['recent_share']:.0%}",
          f"{r['fair_share_factor']:.2f}", f"{r['recent_gpu_hours']:.2f}", _budget(r["budget"])] for r in rows],
    ))
    return 0


def _budget(b: dict[str, Any]) -> str:
    """This month's GPU-hours, against the budget if there is one: "0.31 of 10", "12.1 of 10 (spent)"."""
    used = f"{b['used_gpu_hours']:.3g}"
    if b["gpu_hours_per_month"] is None:
        return used
    return f"{used} of {b['gpu_hours_per_month']:g}" + (" (spent)" if b["spent"] else "")


def _quota(q: dict[str, Any]) -> str:
    units = (("gpus", "{:g} GPUs"), ("gpu_mem_mib", "{} MiB"), ("jobs", "{} jobs"))
    return ", ".join(unit.format(q[key]) for key, unit in units if q[key] is not None) or "-"


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
                "weight": r["weight"], "preemptible": r["preemptible"], "default_for": r["default_for"]}
        if r["budget"]["gpu_hours_per_month"] is not None:
            base["gpu_hours_per_month"] = r["budget"]["gpu_hours_per_month"]
        if r["budget"]["action"]:
            base["budget_action"] = r["budget"]["action"]
    for key, text in (("gpus", args.gpus), ("gpu_mem_mib", args.gpu_mem), ("jobs", args.jobs),
                      ("gpu_hours_per_month", args.gpu_hours_per_month)):
        if text == "none":
            base.pop(key, None)
        elif text is not None:
            base[key] = _number(key, text)
    as_given: dict[str, Callable[[Any], Any]] = {
        "users": _names, "weight": float, "preemptible": lambda yes_no: yes_no == "yes", "default_for": _names,
        "budget_action": lambda action: "" if action == "default" else action}
    for key, convert in as_given.items():
        if (value := getattr(args, key)) is not None:
            base[key] = convert(value)
    try:
        tenant = msgspec.convert(base, Tenant)
    except msgspec.ValidationError as exc:
        raise UnitError(f"tenant {args.name}: {exc}") from None
    rows = c.set_tenant(args.name, tenant)
    if args.json:
        print_json(rows)
    else:
        print(f"tenant {args.name} set")
    return 0


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _number(key: str, text: str) -> float:
    flag = "--" + key.replace("_mib", "").replace("_", "-")
    try:
        value = float(text)
    except ValueError:
        raise UnitError(f"{flag} {text!r}: a number, or 'none'") from None
    if not value >= 0:
        raise UnitError(f"{flag} must be >= 0, not {text}")
    if value == float("inf"):
        raise UnitError(f"{flag} must be a finite number, or 'none' for no limit")
    return value if key in ("gpus", "gpu_hours_per_month") else int(value)
