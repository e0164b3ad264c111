"""What ``eventsched tenants`` shows: each tenant's quota, weight, what it
holds now, its fair share, its recent use and its month's budget, from the state alone."""

from __future__ import annotations

from collections import Counter
from typing import Any

from eventsched.core.budgets import spent, used_gpu_hours
from eventsched.core.policies import fair_shares
from eventsched.domain.states import JobState
from eventsched.domain.units import FULL
from eventsched.projections.cluster import ClusterState

__all__ = ["tenants_report"]


def tenants_report(state: ClusterState, now: float) -> list[dict[str, Any]]:
    shares = fair_shares(state, now)
    waiting = Counter(job.tenant for job in state.jobs.values() if job.state == JobState.QUEUED)
    half_life = state.config.usage_half_life_s
    spent_now = spent(state, now)
    out = []
    for name in sorted(set(shares) | set(state.tenants)):
        tenant = state.tenants.get(name)
        usage = state.usage.get(name)
        milli, mem, jobs = usage.held() if usage is not None else (0, 0, 0)
        share, used, factor = shares.get(name, (0.0, 0.0, 1.0))
        out.append({
            "tenant": name,
            "configured": tenant is not None,
            "users": list(tenant.users) if tenant else [],
            "default_for": list(tenant.default_for) if tenant else [],
            "quota": {k: getattr(tenant, k) if tenant else None for k in ("gpus", "gpu_mem_mib", "jobs")},
            "weight": tenant.weight if tenant else 1.0,
            "preemptible": tenant.preemptible if tenant else False,
            "usage": {"gpus": milli / FULL, "gpu_mem_mib": mem, "jobs": jobs, "queued": waiting.get(name, 0)},
            "fair_share": round(share, 6),
            "recent_share": round(used, 6),
            "fair_share_factor": round(factor, 6),
            "recent_gpu_hours": round((usage.at(now, half_life) if usage else 0.0) / 3600.0, 6),
            "budget": {"gpu_hours_per_month": tenant.gpu_hours_per_month if tenant else None,
                       "action": tenant.budget_action if tenant else "",
                       "used_gpu_hours": round(used_gpu_hours(state, name, now), 6), "spent": name in spent_now},
        })
    return out
