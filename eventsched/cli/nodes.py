"""``eventsched nodes [--json]``: each node, its state, GPUs and jobs.

On one machine that is the one node (``local``); under ``serve --ray`` every
Ray node that offers GPUs, ``up`` or ``down`` (it left or died: its GPUs take
nothing new, its jobs ended ``lost``).
"""

from __future__ import annotations

import time

from eventsched.domain.text import print_json, table

__all__ = ["show_nodes", "render_nodes"]


def render_nodes(nodes: list[dict]) -> str:
    rows = []
    for n in nodes:
        since = time.strftime("%H:%M:%S", time.localtime(n["since"])) if n.get("since") else ""
        jobs = ",".join(map(str, n["jobs"][:8])) + (",..." if len(n["jobs"]) > 8 else "")
        gpus = f"{n['gpus']}" if n["gpus"] == n["gpus_total"] else f"{n['gpus']}/{n['gpus_total']}"
        rows.append([n["name"], n["state"], gpus, str(n["gpus_busy"]), str(len(n["jobs"])), jobs or "-", since,
                     n.get("reason", "")])
    return table(["NODE", "STATE", "GPUS", "BUSY", "JOBS", "RUNNING", "SINCE", "REASON"], rows)


def show_nodes(nodes: list[dict], *, as_json: bool) -> int:
    """Print ``nodes`` (``status``'s ``nodes``) as a table or as JSON."""
    if as_json:
        print_json(nodes)
    else:
        print(render_nodes(nodes))
    return 0
