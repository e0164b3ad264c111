"""A node cut off from the daemon stops its own jobs before they run elsewhere.

A node agent holds a lease, renewed by every call from the daemon. Here a
real Ray cluster (a head without GPUs, ``gpu-a`` and ``gpu-b`` with two GPUs
each, all on 127.0.0.1) and a real daemon with short settings
(``node_lease_s = 3``, ``node_lost_after_s = 8``). The cut is the raylet of
``gpu-b`` stopped with SIGSTOP: the head's Ray declares the node dead and the
daemon can no longer reach its agent, while the agent's own worker process
and the job run on, as they would on a machine behind a broken switch.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from daemon_harness import Daemon
from processes import alive
from ray_harness import add_node, local_cluster
from test_ray_cluster import _log_events, _nodes, _wait_nodes_up

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import Fenced, ProcessExited
from eventsched.runtime.cluster.ray_node_actor import NodeAgent
from eventsched.sim.compare import compare_placements
from eventsched.sim.simulator import RECORDED, simulate
from eventsched.sim.sources import load_source

pytestmark = pytest.mark.slow

NODES = ("gpu-a", "gpu-b")
LEASE_S, LOST_AFTER_S = 3.0, 8.0
# the head's Ray declares a silent raylet dead within seconds, not half a minute
HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
          "health_check_failure_threshold": 3}

# the job: its pid and a monotonic time (one clock: every node is this machine), every 0.2 s
WRITER = """import os, sys, time
while True:
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()} {time.monotonic():.3f}\\n")
    time.sleep(0.2)
"""


# --- the agent alone, without Ray ---------------------------------------------------------


def test_an_agent_that_hears_nothing_for_its_lease_stops_its_job_and_says_so_later(tmp_path: Path) -> None:
    """Polled with a 1 s lease, then left alone: the job gets its own
    ``--signal`` (here SIGINT, which it traps), SIGKILL once ``kill_by_s`` is
    near, and the fence waits on disk until the daemon acknowledges it."""
    trapped = tmp_path / "trapped"
    spec = JobSpec(command=["sh", "-c", f"trap 'echo INT > {trapped}' INT; while :; do sleep 0.1; done"],
                   warn_signal=signal.SIGINT, warn_s=30.0)

    fences_file = tmp_path / "nodes" / "gpu-x" / "fenced.json"

    async def run() -> tuple[list[Any], list[Any], float, Any]:
        agent = NodeAgent("gpu-x", str(tmp_path), "fake:1")
        await agent.hello()
        kind, started = await agent.launch(1, spec, [0], 1)
        assert kind == "started", started
        await agent.poll(0.0, (1.0, 2.5, 30.0))  # the lease's terms, and its last renewal
        t0 = time.monotonic()
        while alive(started.pid):  # only looked at: a call to the agent would renew its lease
            await asyncio.sleep(0.05)
            assert time.monotonic() - t0 < 10, "the job was never stopped"
        took = time.monotonic() - t0
        on_disk = json.loads(fences_file.read_text())
        boot, exits, fences = await agent.poll(5.0, (1.0, 2.5, 30.0))
        agent.forget_fences([fid for fid, _ in fences])
        return exits, fences, took, on_disk

    exits, fences, took, on_disk = asyncio.run(run())
    # signalled at 1 s, its grace (30 s) cut to end by 2.5 s: then SIGKILL
    assert 1.0 <= took < 4.0, took
    assert trapped.read_text().strip() == "INT"
    assert [type(m) for _, m in exits] == [ProcessExited] and exits[0][1].signal == signal.SIGKILL
    (fence,) = [m for _, m in fences]
    assert isinstance(fence, Fenced) and (fence.node, fence.jobs, fence.attempts) == ("gpu-x", [1], [1])
    assert "heard nothing from the daemon" in fence.reason and "node_lease_s = 1" in fence.reason
    assert [(f["jobs"], f["attempts"]) for f in on_disk] == [([1], [1])]  # written down before the signal
    assert json.loads(fences_file.read_text()) == []  # acknowledged


# --- a real cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    with local_cluster(NODES, system_config=HEALTH) as cluster:
        yield cluster


def _lines(path: Path) -> list[tuple[int, float]]:
    out = []
    for line in path.read_text().splitlines():
        pid, t = line.split()
        out.append((int(pid), float(t)))
    return out


def test_a_node_cut_off_stops_its_job_before_the_job_starts_again_elsewhere(
    tmp_path: Path, ray_cluster: Any
) -> None:
    config = tmp_path / "es.toml"
    config.write_text(f"[scheduler]\nnode_lease_s = {LEASE_S}\nnode_lost_after_s = {LOST_AFTER_S}\n"
                      "retry_backoff_s = 0\n")
    d = Daemon(tmp_path / "fence", gpus="fake:2:16384", extra=["--ray", ray_cluster.address, "--config", str(config)])
    d.start(timeout=60)
    script, out = tmp_path / "writer.py", tmp_path / "lines.txt"
    script.write_text(WRITER)
    raylet = ray_cluster.nodes_by_name["gpu-b"].all_processes["raylet"][0].process.pid
    stopped = False
    second_pid = 0
    try:
        _wait_nodes_up(d)
        for gpu in ("gpu-a:0", "gpu-a:1"):  # so that the job lands on gpu-b
            assert d.cli("pause-gpu", gpu).returncode == 0
        job = d.submit("--retries", "1", "--gpus", "1", "--", sys.executable, str(script), str(out))
        jobs = d.wait_for(lambda js: js[job]["state"] == "running" and js[job]["pid"], 60, "running")
        assert jobs[job]["node"] == "gpu-b"
        first_pid = jobs[job]["pid"]
        for gpu in ("gpu-a:0", "gpu-a:1"):
            assert d.cli("resume-gpu", gpu).returncode == 0
        nodes = _nodes(d)
        assert nodes["gpu-b"]["lease_age_s"] is not None and nodes["gpu-b"]["lease_age_s"] < LEASE_S
        deadline = time.monotonic() + 20
        while not out.exists():
            assert time.monotonic() < deadline, "the job never wrote"
            time.sleep(0.1)

        os.kill(raylet, signal.SIGSTOP)  # the cut
        stopped = True
        t_cut = time.monotonic()
        jobs = d.wait_for(lambda js: js[job]["state"] == "running" and js[job]["node"] == "gpu-a"
                          and js[job]["pid"] not in (None, first_pid), 60, "running again on gpu-a")
        second_pid = jobs[job]["pid"]
        deadline = time.monotonic() + 10
        while second_pid not in {pid for pid, _ in _lines(out)}:
            assert time.monotonic() < deadline, "the second copy never wrote"
            time.sleep(0.1)
        time.sleep(1.0)  # a few more lines of the new copy: an old copy still alive would show now

        lines = _lines(out)
        old = [t for pid, t in lines if pid == first_pid]  # on gpu-b, and then on gpu-a (the daemon's view)
        new = [t for pid, t in lines if pid == second_pid]
        assert {pid for pid, _ in lines} == {first_pid, second_pid}
        # the old copy stopped before the new one started: never two at once
        assert max(old) < min(new), (max(old), min(new))
        assert [pid for pid, _ in lines] == [first_pid] * len(old) + [second_pid] * len(new)
        assert [t for _, t in lines] == sorted(t for _, t in lines)
        assert not alive(first_pid)
        assert max(old) > t_cut + 1.0  # the cut did not end it: its node stopped it later

        # the daemon's view: gone longer than node_lost_after_s, its lease long over
        gone = _nodes(d)["gpu-b"]
        assert gone["state"] == "lost" and gone["lease_age_s"] >= LOST_AFTER_S, gone
        assert "gpu-b lost" in d.cli("status").stdout
        table = d.cli("nodes").stdout
        assert "LEASE" in table.splitlines()[0] and " lost " in next(li for li in table.splitlines()
                                                                     if li.startswith("gpu-b"))

        # the node comes back (its raylet, declared dead, ends; a new one of
        # the same name starts): it tells what it stopped, and the log keeps it
        os.kill(raylet, signal.SIGCONT)
        stopped = False
        ray_cluster.remove_node(ray_cluster.nodes_by_name.pop("gpu-b"), allow_graceful=False)
        ray_cluster.nodes_by_name["gpu-b"] = add_node(ray_cluster, "gpu-b")
        deadline = time.monotonic() + 90
        while not (fenced := [e for e in _log_events(d) if e["type"] == "NodeFenced"]):
            assert time.monotonic() < deadline, f"no NodeFenced: {d.stderr()[-2000:]}"
            time.sleep(0.5)
        assert [(e["node"], e["jobs"], e["attempts"]) for e in fenced] == [("gpu-b", [job], [1])]
        assert "heard nothing from the daemon" in fenced[0]["reason"]
        _wait_nodes_up(d, ("gpu-b",))
        assert _nodes(d)["gpu-b"]["lease_age_s"] < LEASE_S

        events = _log_events(d)
        left = next(e for e in events if e["type"] == "NodeLeft" and e["node"] == "gpu-b")
        lost = next(e for e in events if e["type"] == "JobLost" and e["job"] == job)
        assert "node gpu-b left" in lost["reason"] and lost["ts"] - left["ts"] >= LOST_AFTER_S - 0.01
        kinds = [e["type"] for e in events if e.get("job") == job]
        assert kinds.count("JobStarted") == 2 and "JobRequeued" in kinds
        assert not any(e["type"] == "StrayAttemptKilled" for e in events)  # nothing left to kill
        sql = d.cli("sql", "SELECT node, type FROM node_events WHERE type = 'NodeFenced'")
        assert sql.returncode == 0 and "gpu-b" in sql.stdout, sql.stderr
        assert d.cli("log", "verify", str(d.state_dir / "log")).returncode == 0
    finally:
        if stopped:
            os.kill(raylet, signal.SIGCONT)
        d.stop()
        if second_pid and alive(second_pid):  # the test's own job, which would run on till the cluster's end
            os.kill(second_pid, signal.SIGKILL)
    # a NodeFenced is a fact only: replay under the recorded policy reproduces every placement
    simulate(load_source(d.state_dir), RECORDED, tmp_path / "replay")
    assert compare_placements(d.state_dir / "log", tmp_path / "replay" / "log") is None
