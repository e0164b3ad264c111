"""``eventsched nodes [--json]``: each node, its state, GPUs and jobs (one,
``local``, on one machine; under ``serve --ray`` every Ray node with GPUs)."""

from __future__ import annotations

import argparse
import time

from eventsched.domain.text import print_json, table

__all__ = ["cmd_nodes", "render_nodes"]


def render_nodes(nodes: list[dict]) -> str:
    rows = []
    for n in nodes:
        since = time.strftime("%H:%M:%S", time.localtime(n["since"])) if n.get("since") else ""
        jobs = ",".join(map(str, n["jobs"][:8])) + (",..." if len(n["jobs"]) > 8 else "")
        gpus = f"{n['gpus']}" if n["gpus"] == n["gpus_total"] else f"{n['gpus']}/{n['gpus_total']}"
        rows.append([n["name"], n["state"], gpus, str(n["gpus_busy"]), str(len(n["jobs"])), jobs or "-", since,
                     n.get("reason", "")])
    return table(["NODE", "STATE", "GPUS", "BUSY", "JOBS", "RUNNING", "SINCE", "REASON"], rows)


def cmd_nodes(args: argparse.Namespace) -> int:
    from eventsched.cli.connect import client

    with client(args) as c:
        nodes = c.status().get("nodes", [])
    if args.json:
        print_json(nodes)
    else:
        print(render_nodes(nodes))
    return 0
