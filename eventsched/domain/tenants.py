"""Tenants: teams sharing the GPUs, with quotas on what they hold at once and a
fair-share weight (docs/fair-share.md). The set is a fact in the log, so history
keeps what the quotas were when each decision was made."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = ["Tenant", "TenantConfig", "DEFAULT_TENANT", "TenantError", "check_tenants", "tenant_of_user"]

DEFAULT_TENANT = "default"  # everyone no tenant lists


class TenantError(ValueError):
    """A tenant definition that cannot be used (one line)."""


class Tenant(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    users: list[str] = []
    # ceilings on what runs at once (None: no ceiling); gpus counts shares
    # (two half-GPU jobs are 1 GPU), gpu_mem_mib the memory reserved
    gpus: Annotated[float, msgspec.Meta(ge=0)] | None = None
    gpu_mem_mib: Annotated[int, msgspec.Meta(ge=0)] | None = None
    jobs: Annotated[int, msgspec.Meta(ge=0)] | None = None
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    preemptible: bool = False  # its jobs over its fair share may be preempted
    default_for: list[str] = []  # users whose tenant this is when they name none (if in several)
    # GPU-hours its jobs may use per calendar month (UTC); once used, its waiting
    # jobs are held or placed last (budget_action; "": [scheduler] budget_action)
    gpu_hours_per_month: Annotated[float, msgspec.Meta(ge=0)] | None = None
    budget_action: Literal["", "hold", "lower-priority"] = ""


class TenantConfig(Tenant, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tenant as written in a config file: unknown keys are mistakes there
    (in the log, a newer version's keys are ignored)."""

    def plain(self) -> Tenant:
        return msgspec.convert(msgspec.to_builtins(self), Tenant)


def check_tenants(tenants: dict[str, Tenant]) -> None:
    """Refuse a set of tenants no scheduler could apply: bad names, a user in
    several tenants with no default among them."""
    member: dict[str, list[str]] = {}
    for name, tenant in tenants.items():
        if not name or len(name) > 64 or not all(c.isalnum() or c in "-_." for c in name):
            raise TenantError(f"tenant name {name!r}: use letters, digits, '-', '_' or '.' (at most 64)")
        for user in tenant.default_for:
            if user not in tenant.users:
                raise TenantError(f"tenant {name!r}: default_for lists {user!r}, who is not in its users")
        for user in tenant.users:
            member.setdefault(user, []).append(name)
    for user, names in member.items():
        if len(names) > 1:
            defaults = [n for n in names if user in tenants[n].default_for]
            if len(defaults) != 1:
                raise TenantError(f"user {user!r} is in tenants {', '.join(repr(n) for n in names)}: list them in "
                                  f"default_for of exactly one of them (it is used when they give no --tenant)")


def tenant_of_user(tenants: dict[str, Tenant], user: str, asked: str = "") -> str:
    """The tenant a job of ``user`` counts against: ``asked`` (if it lists them), else
    the one listing them (their default if several), else the default tenant.
    With no tenants configured a label is free and is its own tenant."""
    if not tenants:
        return asked or DEFAULT_TENANT
    if asked:
        tenant = tenants.get(asked)
        if asked == DEFAULT_TENANT and tenant is None:
            if any(user in t.users for t in tenants.values()):
                raise TenantError(f"--tenant {asked}: you are listed in a tenant, so you cannot use the default one")
            return asked
        if tenant is None:
            raise TenantError(f"--tenant {asked}: no such tenant (tenants: {', '.join(sorted(tenants))})")
        if user not in tenant.users:
            raise TenantError(f"--tenant {asked}: you ({user}) are not one of its users")
        return asked
    listed = [n for n, t in tenants.items() if user in t.users]
    if len(listed) == 1:
        return listed[0]
    return next((n for n in listed if user in tenants[n].default_for), DEFAULT_TENANT)
