"""GPU-hour budgets: a tenant that has used its month's ``gpu_hours_per_month``
gets its waiting jobs held until the next calendar month (UTC), or placed only
on what every other tenant's jobs leave (``budget_action``, docs/fair-share.md).

The use is the projection's fold of the log (``TenantUsage.month_at``: the
GPU-seconds its jobs held this month, shares counted as fractions), read at the
decision's ``now``, so a replay meets each budget when the recording did.
Running jobs are never stopped for a budget: it is checked when a job would start.
"""

from __future__ import annotations

import time

from eventsched.domain.tenants import Tenant
from eventsched.domain.units import utc_month
from eventsched.projections.cluster import ClusterState

__all__ = ["HOLD", "LOWER", "spent", "used_gpu_hours", "action_of", "next_month", "budget_text"]

HOLD, LOWER = "hold", "lower-priority"


def action_of(state: ClusterState, tenant: Tenant) -> str:
    return tenant.budget_action or state.config.budget_action


def used_gpu_hours(state: ClusterState, name: str, now: float) -> float:
    """GPU-hours tenant ``name``'s jobs used this calendar month (UTC), up to ``now``."""
    usage = state.usage.get(name)
    return usage.month_at(now) / 3600.0 if usage is not None else 0.0


def spent(state: ClusterState, now: float) -> dict[str, str]:
    """Tenant -> its budget action, for each tenant that has used its month's budget."""
    out: dict[str, str] = {}
    for name, tenant in state.tenants.items():
        budget = tenant.gpu_hours_per_month
        if budget is not None and used_gpu_hours(state, name, now) >= budget:
            out[name] = action_of(state, tenant)
    return out


def next_month(state: ClusterState, now: float) -> float | None:
    """When the budgets start again, if a spent one (not 0) may hold back a
    waiting job: a decision is due then."""
    if state.queue and any(state.tenants[name].gpu_hours_per_month for name in spent(state, now)):
        return utc_month(now)[1]
    return None


def budget_text(state: ClusterState, name: str, now: float) -> str:
    """Why tenant ``name``'s jobs wait for its budget, in one line."""
    tenant = state.tenants[name]
    until = time.strftime("%Y-%m-%d", time.gmtime(utc_month(now)[1]))
    used = used_gpu_hours(state, name, now)
    what = "held" if action_of(state, tenant) == HOLD else "placed only after every other tenant's jobs"
    return (f"budget: tenant {name} has used {used:.3g} of its {tenant.gpu_hours_per_month:g} GPU-hours this month; "
            f"{what} until {until} (UTC)")
