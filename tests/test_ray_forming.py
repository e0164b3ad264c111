"""A cluster that forms after its daemon starts, on a real local Ray cluster
(a head without GPUs; GPU nodes ``gpu-a`` and ``gpu-b``, two fake GPUs each,
added while the daemon runs, all on 127.0.0.1). ``serve --wait-nodes 2``:
``health`` fails, saying how many have joined, until both have; a gang job
submitted before any node joined waits, saying for what, and starts once a
node with room has joined."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import EVENTSCHED, Daemon, free_port
from ray_harness import add_node, local_cluster

pytestmark = pytest.mark.slow


def _health(d: Daemon, *args: str) -> subprocess.CompletedProcess:
    return d.cli("health", *args)


def _until_health_says(d: Daemon, text: str, timeout: float = 90) -> subprocess.CompletedProcess:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert d.process is not None and d.process.poll() is None, d.stderr()
        r = _health(d)
        if text in r.stdout + r.stderr:
            return r
        time.sleep(0.3)
    raise AssertionError(f"health never said {text!r}: {r.stdout}{r.stderr}; {d.stderr()}")


def _http_health(port: int) -> tuple[int, bool]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status, json.loads(r.read())["ok"]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["ok"]


def test_a_gang_submitted_before_any_node_joined_waits_then_starts(tmp_path: Path) -> None:
    port = free_port()
    with local_cluster(()) as cluster:
        d = Daemon(tmp_path / "forming", gpus="fake:2:16384")
        d.state_dir.mkdir(parents=True)
        with open(d.state_dir / "daemon.stderr", "ab") as out:  # Daemon.start waits for a healthy daemon: not yet
            d.process = subprocess.Popen([*EVENTSCHED, "serve", "--gpus", d.gpus, "--sample-interval", "0.2",
                                          "--ray", cluster.address, "--wait-nodes", "2", "--http", f"127.0.0.1:{port}"],
                                         env=d.env(), stdout=out, stderr=out, start_new_session=True)
        try:
            waiting = _until_health_says(d, "waiting for nodes: 0 of 2 joined")
            assert waiting.returncode == 1 and waiting.stdout == ""
            assert waiting.stderr.strip() == f"eventsched: waiting for nodes: 0 of 2 joined (daemon pid {d.process.pid})"
            data = _health(d, "--json")
            info = json.loads(data.stdout)
            assert data.returncode == 1 and (info["ok"], info["nodes_up"], info["nodes_wanted"]) == (False, 0, 2)
            assert _http_health(port) == (503, False)  # a load balancer that reads status codes sees it too

            gang = d.submit("--gpus", "2", "--", "sh", "-c", 'echo "on $CUDA_VISIBLE_DEVICES"')
            assert d.jobs()[gang]["state"] == "queued"
            why = "resources: waiting for a node with 2 GPUs; no node has joined yet"
            assert why in d.cli("explain", str(gang)).stdout
            queue = d.cli("queue").stdout.splitlines()
            assert why[:40] in queue[1], queue

            add_node(cluster, "gpu-a")
            assert _until_health_says(d, "waiting for nodes: 1 of 2 joined").returncode == 1
            jobs = d.wait_states([gang], {"succeeded"}, timeout=60)
            assert jobs[gang]["node"] == "gpu-a" and d.cli("logs", str(gang)).stdout.strip() == "on 0,1"

            add_node(cluster, "gpu-b")
            ok = _until_health_says(d, "2 nodes up")
            assert ok.returncode == 0 and ok.stdout.startswith(f"ok: daemon pid {d.process.pid}, log at seq ")
            assert ok.stdout.strip().endswith(", 2 nodes up")
            assert json.loads(_health(d, "--json").stdout)["ok"] is True
            assert _http_health(port) == (200, True)
            # a gang larger than every node it has had is refused, now that nodes have joined
            too_big = d.cli("submit", "--gpus", "3", "--", "true")
            assert too_big.returncode != 0 and "asks for 3 GPUs but the largest node has 2" in too_big.stderr
        finally:
            d.stop()
