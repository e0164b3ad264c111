"""GPU-hour budgets (docs/fair-share.md): a tenant that has used its month's
``gpu_hours_per_month`` has its waiting jobs held until the next UTC month, or
placed only on what other tenants leave. The use is read at the decision's
``now``, so a replay meets each budget when the recording did.
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
    usage = state.usage.get(name)
    return usage.month_at(now) / 3600.0 if usage is not None else 0.0


def spent(state: ClusterState, now: float) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, tenant in state.tenants.items():
        budget = tenant.gpu_hours_per_month
        if budget is not None and used_gpu_hours(state, name, now) >= budget:
            out[name] = action_of(state, tenant)
    return out


def next_month(state: ClusterState, now: float) -> float | None:
    """When the budgets start again, if a spent one (not 0) may hold back a waiting job."""
    if state.queue and any(state.tenants[name].gpu_hours_per_month for name in spent(state, now)):
        return utc_month(now)[1]
    return None


def budget_text(state: ClusterState, name: str, now: float) -> str:
    tenant = state.tenants[name]
    until = time.strftime("%Y-%m-%d", time.gmtime(utc_month(now)[1]))
    used = used_gpu_hours(state, name, now)
    what = "held" if action_of(state, tenant) == HOLD else "placed only after every other tenant's jobs"
    return (f"budget: tenant {name} has used {used:.3g} of its {tenant.gpu_hours_per_month:g} GPU-hours this month; "
            f"{what} until {until} (UTC)")
