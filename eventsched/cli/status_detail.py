"""``status --detailed``: the daemon's version, uptime and health, then each
GPU's reservations and the memory each job holds on it, then every active job."""

from __future__ import annotations

import shlex
import time
from typing import Any

from eventsched.domain.text import table
from eventsched.domain.units import format_duration

__all__ = ["cut", "render_detailed"]


def cut(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def render_detailed(status: dict[str, Any], brief: str) -> str:
    """``brief`` (``status``'s own table) framed by the daemon's facts, the GPUs' and the jobs' details."""
    health = status.get("health") or {}
    head = (f"eventsched {status.get('version', '?')}, daemon up {format_duration(status.get('uptime_s')) or '?'}, "
            f"health {health.get('status', '?')}" + "".join(f"; {p}" for p in health.get("problems", ())))
    several = len({g.get("node") for g in status["gpus"]}) > 1
    gpus = table(["GPU", "MODEL", "RESERVED", "FOREIGN", "HELD BY JOBS"], [
        [f"{g['node']}:{g['id']}" if several else g["id"], g.get("model") or "-", f"{g.get('reserved_mib', 0)} MiB",
         f"{g.get('foreign_memory_mib', 0)} MiB",
         ", ".join(f"job {j} {mib} MiB" for j, mib in g.get("job_memory_mib", {}).items()) or "-"]
        for g in status["gpus"]])
    now = time.time()
    order = {"running": 0, "queued": 1, "held": 2}
    rows = [[j["id"], cut(j["name"], 24), j["user"], j["state"], j["priority"], f"{j['gpus']:g}",
             ",".join(map(str, j["gpu_ids"])) or "-", f"{j['gpu_mem_mib']} MiB" if j["gpu_mem_mib"] else "-",
             format_duration(now - (j["started_at"] if j["state"] == "running" and j["started_at"] else j["submitted_at"])),
             cut(shlex.join(j["command"]))]
            for j in sorted(status["jobs"], key=lambda j: (order.get(j["state"], 3), j["id"]))]
    jobs = table(["ID", "NAME", "USER", "STATE", "PRI", "GPUS", "ON", "GPU MEM", "TIME", "COMMAND"], rows) if rows \
        else "no queued or running jobs"
    return "\n\n".join([head, brief, gpus, jobs])
