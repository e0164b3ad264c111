"""``eventsched nodes [--json]``: each node, its state, GPUs and jobs (one,
``local``, on one machine; under ``serve --ray`` every Ray node with GPUs)."""

from __future__ import annotations

import argparse
import time

from eventsched.domain.text import print_json, table
from eventsched.domain.units import format_duration

__all__ = ["cmd_nodes", "render_nodes"]


def render_nodes(nodes: list[dict]) -> str:
    rows = []
    for n in nodes:
        since = time.strftime("%H:%M:%S", time.localtime(n["since"])) if n.get("since") else ""
        jobs = ",".join(map(str, n["jobs"][:8])) + (",..." if len(n["jobs"]) > 8 else "")
        gpus = f"{n['gpus']}" if n["gpus"] == n["gpus_total"] else f"{n['gpus']}/{n['gpus_total']}"
        # seconds since the daemon last heard from the node: a node's lease runs out at node_lease_s
        lease = format_duration(n["lease_age_s"]) if n.get("lease_age_s") is not None else "-"
        rows.append([n["name"], n["state"], gpus, str(n["gpus_busy"]), str(len(n["jobs"])), jobs or "-", since,
                     lease, n.get("reason", "")])
    return table(["NODE", "STATE", "GPUS", "BUSY", "JOBS", "RUNNING", "SINCE", "LEASE", "REASON"], rows)


def cmd_nodes(args: argparse.Namespace) -> int:
    from eventsched.cli.connect import client

    with client(args) as c:
        nodes = c.status().get("nodes", [])
    if args.json:
        print_json(nodes)
    else:
        print(render_nodes(nodes))
    return 0
