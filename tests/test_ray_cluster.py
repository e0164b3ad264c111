"""Several machines on Ray, on this one machine.

A real Ray cluster (``ray.cluster_utils.Cluster``: a head without GPUs and two
nodes, ``gpu-a`` and ``gpu-b``, each declaring two GPUs and a ``node:NAME``
resource, all bound to 127.0.0.1) and real daemons (``serve --ray``), stopped
by PID. The node-removal test takes ``gpu-b`` away for good; the two after
it take a third node, ``gpu-d``, away and bring it back. The core-level tests
at the top need no Ray.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from daemon_harness import Daemon
from processes import alive
from ray_harness import add_node, local_cluster

from eventsched import core
from eventsched.domain import events as ev
from eventsched.domain.messages import (
    GpuInfo,
    NodeDown,
    NodeUp,
    ProcessExited,
    ProcessStarted,
    Refused,
    SchedulerConfig,
    Started,
    Submit,
    Tick,
)
from eventsched.projections.cluster import ClusterState, nodes_view, validate_state
from eventsched.sim.compare import compare_placements, placements
from eventsched.sim.simulator import RECORDED, simulate
from eventsched.sim.sources import load_source
from eventsched.storage import log as eventlog

pytestmark = pytest.mark.slow

NODES = ("gpu-a", "gpu-b")


# --- the core, without Ray ------------------------------------------------------------


def _gpus(n: int, node: str) -> list[GpuInfo]:
    return [GpuInfo(gpu=i, uuid=f"fake-{node}-{i}", model="fake", memory_total_mib=16_384) for i in range(n)]


def _record(log_dir: Path) -> tuple[ClusterState, list[ev.Event]]:
    """A multi-node day driven through the core and written to a real log:
    two nodes join, jobs spread, one node dies with jobs on it."""
    state = ClusterState()
    writer = eventlog.LogWriter.open(log_dir)
    out: list[ev.Event] = []
    now = 1_000.0

    def feed(msg: Any) -> list[Any]:
        nonlocal now
        now += 1.0
        events, effects = core.handle(state, msg, now)
        validate_state(state)
        if events:
            state.last_seq = writer.append(events)
            out.extend(events)
        return effects

    def run(effects: list[Any]) -> None:
        for eff in effects:
            if type(eff).__name__ == "Launch":
                feed(ProcessStarted(job=eff.job, pid=100 + eff.job))

    cfg = SchedulerConfig(node="head", retry_backoff_s=0.0, node_lost_after_s=0.0)
    feed(Started(node="head", pid=1, version="t", gpu_backend="ray", gpus=[], config=cfg))
    for node in NODES:
        run(feed(NodeUp(node=node, gpus=_gpus(2, node), ray_node=node * 2, gpu_backend="fake:2:16384")))
    spec = ev.JobSpec(command=["true"], gpus=1, uid=0, user="root", retries=1)
    for _ in range(4):
        run(feed(Submit(spec=spec)))
    run(feed(Submit(spec=ev.JobSpec(command=["true"], gpus=2, uid=0, user="root"))))
    assert {state.jobs[j].node for j in state.running} == set(NODES)
    run(feed(NodeDown(node="gpu-b", reason="Ray reports the node dead")))
    run(feed(ProcessExited(job=1, exit_code=0)))
    for jid in sorted(state.running):
        run(feed(ProcessExited(job=jid, exit_code=0)))
    for jid in sorted(state.running):
        run(feed(ProcessExited(job=jid, exit_code=0)))
    writer.close()
    return state, out


def test_a_node_that_dies_takes_its_jobs_to_lost_and_retries_them_elsewhere(tmp_path: Path) -> None:
    state, events = _record(tmp_path / "log")
    lost = [e for e in events if isinstance(e, ev.JobLost)]
    assert lost and all("node gpu-b left" in e.reason for e in lost)
    requeued = {e.job for e in events if isinstance(e, ev.JobRequeued)}
    assert requeued == {e.job for e in lost if state.jobs[e.job].spec.retries}
    # each requeued job ran again, on the node that stayed
    for jid in requeued:
        assert state.jobs[jid].state == "succeeded" and state.jobs[jid].node == "gpu-a"
    view = {n["name"]: n for n in nodes_view(state)}
    assert view["gpu-b"]["state"] == "down" and view["gpu-b"]["gpus"] == 0
    assert view["gpu-a"]["state"] == "up" and view["gpu-a"]["gpus"] == 2


def _two_nodes(lost_after_s: float) -> tuple[ClusterState, Callable[[Any, float], list[Any]]]:
    state = ClusterState()
    clock = [1_000.0]

    def feed(msg: Any, dt: float = 1.0) -> list[Any]:
        clock[0] += dt
        events, effects = core.handle(state, msg, clock[0])
        validate_state(state)
        for eff in effects:
            if type(eff).__name__ == "Launch":
                core.handle(state, ProcessStarted(job=eff.job, pid=100 + eff.job), clock[0])
        return events

    cfg = SchedulerConfig(node="head", retry_backoff_s=0.0, node_lost_after_s=lost_after_s)
    feed(Started(node="head", pid=1, version="t", gpu_backend="ray", gpus=[], config=cfg))
    for node in NODES:
        feed(NodeUp(node=node, gpus=_gpus(2, node), ray_node=node * 2, gpu_backend="fake:2:16384"))
    return state, feed


def test_a_node_back_within_the_grace_keeps_its_running_job_which_is_never_launched_twice() -> None:
    state, feed = _two_nodes(lost_after_s=60.0)
    feed(Submit(spec=ev.JobSpec(command=["true"], gpus=2, uid=0, user="root", node="gpu-b", retries=1)))
    (job,) = state.running
    events = feed(NodeDown(node="gpu-b", reason="Ray reports the node dead"))
    assert [type(e).__name__ for e in events] == ["NodeLeft", "GpuErrored", "GpuErrored"]
    assert state.jobs[job].state == "running"  # not lost yet: the node may come back
    feed(Submit(spec=ev.JobSpec(command=["true"], gpus=1, uid=0, user="root", node="gpu-b")))
    assert state.jobs[job + 1].state == "queued"  # nothing new goes to a node that is gone: it waits for it
    events = feed(Tick(), dt=30.0)
    assert not any(isinstance(e, (ev.JobLost, ev.JobRequeued)) for e in events)
    events = feed(NodeUp(node="gpu-b", gpus=_gpus(2, "gpu-b"), ray_node="new", gpu_backend="fake:2:16384"), dt=5.0)
    assert any(isinstance(e, ev.NodeJoined) for e in events)
    assert state.jobs[job].state == "running" and state.jobs[job].attempts == 1
    feed(ProcessStarted(job=job, pid=100 + job))  # re-adopted: the same process, nothing new recorded
    feed(Tick(), dt=120.0)
    assert state.jobs[job].state == "running"
    feed(ProcessExited(job=job, exit_code=0))
    assert state.jobs[job].state == "succeeded" and state.jobs[job].attempts == 1


def test_a_node_gone_longer_than_the_grace_loses_its_job_which_runs_elsewhere() -> None:
    state, feed = _two_nodes(lost_after_s=60.0)
    feed(Submit(spec=ev.JobSpec(command=["true"], gpus=2, uid=0, user="root", retries=1)))
    (job,) = state.running
    gone = state.jobs[job].node
    feed(NodeDown(node=gone, reason="Ray reports the node dead"))
    assert core.next_deadline(state, 1_003.0) == state.nodes[gone].since + 60.0  # the engine wakes then
    events = feed(Tick(), dt=59.0)
    assert not any(isinstance(e, ev.JobLost) for e in events)
    events = feed(Tick(), dt=1.0)
    lost = [e for e in events if isinstance(e, ev.JobLost)]
    assert [e.job for e in lost] == [job] and f"node {gone} left: Ray reports the node dead" in lost[0].reason
    assert state.jobs[job].state == "running" and state.jobs[job].node != gone  # requeued and placed again
    assert state.jobs[job].attempts == 2


def test_a_gang_larger_than_any_node_is_refused_with_the_reason(tmp_path: Path) -> None:
    state, _ = _record(tmp_path / "log")
    core.handle(state, NodeUp(node="gpu-c", gpus=_gpus(2, "gpu-c")), 5_000.0)
    with pytest.raises(Refused, match="all on one node"):
        core.handle(state, Submit(spec=ev.JobSpec(command=["true"], gpus=3, uid=0)), 5_001.0)


def test_replay_of_a_multi_node_log_reproduces_every_placement(tmp_path: Path) -> None:
    _record(tmp_path / "rec" / "log")
    recorded = placements(tmp_path / "rec" / "log")
    assert {p[1] for p in recorded} == set(NODES)
    result = simulate(load_source(tmp_path / "rec"), RECORDED, tmp_path / "replay", validate=True)
    assert compare_placements(tmp_path / "rec" / "log", tmp_path / "replay" / "log") is None
    assert result.placements == len(recorded)


def test_the_read_model_keeps_each_placements_node_and_the_node_events(tmp_path: Path) -> None:
    from eventsched.projections.history import open_history

    state, _ = _record(tmp_path / "state" / "log")
    h = open_history(tmp_path / "state")
    by_node = dict(h.query("SELECT node, count(*) FROM placements GROUP BY node")[1])
    want: dict[str, int] = {}
    for e in eventlog.read(tmp_path / "state" / "log"):
        if isinstance(e, ev.JobPlaced):
            want[e.node] = want.get(e.node, 0) + len(e.gpu_ids)
    assert by_node == want and set(want) == set(NODES)
    rows = h.query("SELECT node, type FROM node_events ORDER BY seq")[1]
    assert rows == [("gpu-a", "NodeJoined"), ("gpu-b", "NodeJoined"), ("gpu-b", "NodeLeft")]
    assert {r[0] for r in h.query("SELECT node FROM gpu_hours_by_node")[1]} == set(NODES)
    lost = h.query("SELECT count(*) FROM job_events WHERE type = 'JobLost' AND detail LIKE '%node gpu-b left%'")[1]
    assert lost[0][0] == sum(1 for e in eventlog.read(tmp_path / "state" / "log") if isinstance(e, ev.JobLost)) > 0


def test_replay_of_a_csv_on_k_nodes(tmp_path: Path) -> None:
    csv = tmp_path / "w.csv"
    csv.write_text("submit_time,duration,gpus\n" + "".join(f"{i},100,2\n" for i in range(8)))
    result = simulate(load_source(csv, gpus="fake:2", nodes=3), "fifo", tmp_path / "out")
    on = placements(tmp_path / "out" / "log")
    assert result.placements == 8
    assert {p[1] for p in on} == {"node-0", "node-1", "node-2"}  # one 2-GPU job per node at a time
    assert all(len(p[2]) == 2 for p in on)


def test_single_machine_use_never_imports_ray() -> None:
    code = ("import sys, eventsched.cli, eventsched.runtime.daemon, eventsched.runtime.engine, "
            "eventsched.runtime.cluster.ray_cluster, eventsched.runtime.cluster.ray_node_actor, eventsched.sim.simulator; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_serve_ray_without_ray_installed_says_how_to_get_it(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['ray'] = None; from eventsched.cli import main; "
            f"sys.exit(main(['serve', '--state-dir', {str(tmp_path)!r}, '--ray', 'auto']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == "eventsched: error: --ray needs Ray: pip install 'eventsched[ray]'"
    assert not (tmp_path / "log").exists()  # nothing was started or written


def test_serve_ray_at_an_address_where_nothing_answers_fails_at_once(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'eventsched[ray]')")
    import socket

    with socket.socket() as s:  # a port of 127.0.0.1 that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "eventsched.cli", "serve", "--state-dir", str(tmp_path),
                        "--ray", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"eventsched: error: --ray 127.0.0.1:{port}: cannot connect to the Ray cluster: nothing answers there "
        "(Connection refused)"]


# --- a real Ray cluster -----------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    with local_cluster(NODES) as cluster:
        yield cluster


def _ray_daemon(tmp: Path, cluster: Any, name: str, node_lost_after_s: float = 0.0) -> Daemon:
    """A daemon on the cluster; a node that leaves loses its jobs after
    ``node_lost_after_s`` (0 here unless a test is about a node coming back)."""
    config = tmp / f"{name}.toml"
    config.write_text(f"[scheduler]\nnode_lost_after_s = {node_lost_after_s}\n")
    d = Daemon(tmp / name, gpus="fake:2:16384", extra=["--ray", cluster.address, "--config", str(config)])
    d.start(timeout=60)
    return d


def _nodes(d: Daemon) -> dict[str, dict[str, Any]]:
    r = d.cli("nodes", "--json")
    assert r.returncode == 0, r.stderr
    return {n["name"]: n for n in json.loads(r.stdout)}


def _wait_nodes_up(d: Daemon, names: tuple[str, ...] = NODES, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        nodes = _nodes(d)
        if all(nodes.get(n, {}).get("state") == "up" and nodes[n]["gpus"] == 2 for n in names):
            return
        time.sleep(0.3)
    raise AssertionError(f"nodes not up: {_nodes(d)}; {d.stderr()}")


def _stop(d: Daemon) -> None:
    d.stop()


def test_jobs_spread_over_nodes_gangs_stay_on_one_and_targets_are_honoured(
    tmp_path: Path, ray_cluster: Any
) -> None:
    d = _ray_daemon(tmp_path, ray_cluster, "spread")
    try:
        _wait_nodes_up(d)
        nodes = _nodes(d)
        assert set(nodes) >= set(NODES) and all(nodes[n]["gpus"] == 2 and nodes[n]["jobs"] == [] for n in NODES)
        # four one-GPU jobs fill both nodes at once
        ids = [d.submit("--gpus", "1", "--", "sleep", "3") for _ in range(4)]
        jobs = d.wait_states(ids, {"running"}, timeout=60)
        assert {jobs[i]["node"] for i in ids} == set(NODES)
        nodes = _nodes(d)
        assert sorted(nodes["gpu-a"]["jobs"] + nodes["gpu-b"]["jobs"]) == sorted(ids)
        table = d.cli("nodes")
        assert table.returncode == 0 and table.stdout.split()[:9] == ["NODE", "STATE", "GPUS", "BUSY", "JOBS",
                                                                      "RUNNING", "SINCE", "LEASE", "REASON"]
        rows = {line.split()[0]: line.split()[1:5] for line in table.stdout.splitlines()[1:]}
        assert rows["gpu-a"] == ["up", "2", "2", "2"] and rows["gpu-b"] == ["up", "2", "2", "2"]
        status = d.cli("status")
        assert status.returncode == 0 and "NODE" in status.stdout and "gpu-b" in status.stdout
        states = next(line for line in status.stdout.splitlines() if line.startswith("nodes  ")).split()[1:]
        assert {"gpu-a": "up", "gpu-b": "up"}.items() <= dict(zip(states[::2], states[1::2])).items()
        queue = d.cli("queue")
        assert "NODE" in queue.stdout
        d.wait_states(ids, {"succeeded"}, timeout=60)
        # a gang stays on one node; one larger than any node is refused, saying why
        gang = d.submit("--gpus", "2", "--", "sh", "-c", 'echo "on $CUDA_VISIBLE_DEVICES"')
        too_big = d.cli("submit", "--gpus", "3", "--", "true")
        assert too_big.returncode != 0 and "all on one node" in too_big.stderr
        # --node and --gpu-ids NODE:ids target
        on_b = d.submit("--node", "gpu-b", "--", "true")
        on_a1 = d.submit("--gpu-ids", "gpu-a:1", "--", "sh", "-c", 'echo "gpu $CUDA_VISIBLE_DEVICES"')
        jobs = d.wait_states([gang, on_b, on_a1], {"succeeded"}, timeout=60)
        assert len(jobs[gang]["gpu_ids"]) == 2 and jobs[gang]["node"] in NODES
        assert jobs[on_b]["node"] == "gpu-b"
        assert (jobs[on_a1]["node"], jobs[on_a1]["gpu_ids"]) == ("gpu-a", [1])
        # finished jobs keep the node they ran on in the table
        table = d.cli("queue", "--all").stdout.splitlines()
        node_at = table[0].split().index("NODE")
        ran_on = {int(line.split()[0]): line.split()[node_at] for line in table[1:]}
        assert (ran_on[on_b], ran_on[on_a1]) == ("gpu-b", "gpu-a")
        # ... and in explain's story and the history's SQL
        assert "placed on GPU 1 of gpu-a" in d.cli("explain", str(on_a1)).stdout
        rows = json.loads(d.cli("sql", f"SELECT id, node FROM jobs WHERE id IN ({on_b}, {on_a1}) ORDER BY id",
                                "--format", "json").stdout)
        assert [(r["id"], r["node"]) for r in rows] == sorted([(on_b, "gpu-b"), (on_a1, "gpu-a")])
        # the output comes back from the node (logs)
        assert d.cli("logs", str(on_a1)).stdout.strip() == "gpu 1"
        assert d.cli("logs", str(gang)).stdout.strip() in ("on 0,1",)
        unknown = d.cli("submit", "--node", "nowhere", "--", "true")
        assert unknown.returncode != 0 and "unknown node 'nowhere'" in unknown.stderr
        # pause-gpu NODE:ID
        r = d.cli("pause-gpu", "gpu-a:0")
        assert r.returncode == 0, r.stderr
        paused = [(g["node"], g["id"]) for g in d.status()["gpus"] if g["paused"]]
        assert paused == [("gpu-a", 0)]
    finally:
        _stop(d)


def test_head_killed_and_restarted_readopts_every_job_on_every_node(tmp_path: Path, ray_cluster: Any) -> None:
    d = _ray_daemon(tmp_path, ray_cluster, "restart")
    ran, release = tmp_path / "ran.txt", tmp_path / "release"
    # the jobs run until the test has seen them re-adopted, however long the restart takes
    script = (f'echo "$EVENTSCHED_JOB_ID" >> {ran}; while [ ! -e {release} ]; do sleep 0.1; done; '
              'exit $((EVENTSCHED_JOB_ID % 3))')
    try:
        _wait_nodes_up(d)
        ids = [d.submit("--node", node, "--", "sh", "-c", script) for node in (*NODES, *NODES)]
        jobs = d.wait_for(lambda js: all(js[i]["state"] == "running" and js[i]["pid"] for i in ids), 60, "all running")
        assert {jobs[i]["node"] for i in ids} == set(NODES)
        d.kill9()
        d.start(timeout=60)
        readopted = d.wait_for(lambda js: all(js[i]["state"] == "running" for i in ids), 5, "still running")
        assert all(readopted[i]["pid"] == jobs[i]["pid"] for i in ids)  # the same processes, adopted
        nodes = _nodes(d)
        assert sorted(nodes["gpu-a"]["jobs"] + nodes["gpu-b"]["jobs"]) == sorted(ids)
        release.touch()
        jobs = d.wait_states(ids, {"succeeded", "failed"}, timeout=90)
        for i in ids:
            assert jobs[i]["exit_code"] == i % 3, jobs[i]
            assert jobs[i]["state"] == ("succeeded" if i % 3 == 0 else "failed")
            assert jobs[i]["attempts"] == 1 if "attempts" in jobs[i] else True
        launched = ran.read_text().split()
        assert sorted(launched) == sorted(str(i) for i in ids)  # every job ran, none twice
        assert d.cli("log", "verify", str(d.state_dir / "log")).returncode == 0
    finally:
        _stop(d)


def test_a_restarted_node_actor_readopts_its_job(tmp_path: Path, ray_cluster: Any) -> None:
    from eventsched.runtime.cluster.ray_cluster import namespace_for

    d = _ray_daemon(tmp_path, ray_cluster, "actor")
    release = tmp_path / "release"
    try:
        _wait_nodes_up(d)
        # the job runs until the restarted actor has been seen, however long that takes
        job = d.submit("--node", "gpu-a", "--", "sh", "-c",
                       f"echo start; while [ ! -e {release} ]; do sleep 0.1; done; echo end; exit 4")
        d.wait_for(lambda js: js[job]["state"] == "running" and js[job]["pid"], 60, "running")
        # from a driver of its own: Ray's state in this process is the cluster's
        kill = (f"import ray; ray.init(address={ray_cluster.address!r}, namespace={namespace_for(d.state_dir)!r}, "
                "log_to_driver=False); ray.kill(ray.get_actor('eventsched-node-gpu-a'), no_restart=False)")
        subprocess.run([sys.executable, "-c", kill], check=True, timeout=60, capture_output=True)  # Ray restarts it
        deadline = time.monotonic() + 60
        while _nodes(d)["gpu-a"]["restarts"] != 1:
            assert time.monotonic() < deadline, "the actor was never seen restarted"
            time.sleep(0.3)
        assert d.jobs()[job]["state"] == "running"
        release.touch()
        jobs = d.wait_states([job], {"failed", "succeeded", "lost"}, timeout=60)
        assert (jobs[job]["state"], jobs[job]["exit_code"]) == ("failed", 4)  # its own exit, re-adopted
        assert d.cli("logs", str(job)).stdout.split() == ["start", "end"]
        assert _nodes(d)["gpu-a"]["restarts"] == 1
        dump = d.cli("log", "dump", "--json", str(d.state_dir / "log")).stdout
        assert [json.loads(line)["node"] for line in dump.splitlines() if "NodeActorRestarted" in line] == ["gpu-a"]
    finally:
        release.touch()  # a job still waiting ends
        _stop(d)


def test_a_removed_node_loses_its_job_which_is_retried_elsewhere(tmp_path: Path, ray_cluster: Any) -> None:
    d = _ray_daemon(tmp_path, ray_cluster, "remove")
    first, release = tmp_path / "first", tmp_path / "release"
    # the first attempt runs until the test ends (its process outlives the node), a later one briefly
    script = f"echo attempt; if mkdir {first} 2>/dev/null; then while [ ! -e {release} ]; do sleep 0.1; done; fi"
    try:
        _wait_nodes_up(d)
        for gpu in ("gpu-a:0", "gpu-a:1"):  # so that the job lands on gpu-b
            assert d.cli("pause-gpu", gpu).returncode == 0
        job = d.submit("--retries", "1", "--", "sh", "-c", script)
        jobs = d.wait_for(lambda js: js[job]["state"] == "running" and js[job]["pid"], 60, "running")
        assert jobs[job]["node"] == "gpu-b"
        for gpu in ("gpu-a:0", "gpu-a:1"):
            assert d.cli("resume-gpu", gpu).returncode == 0
        ray_cluster.remove_node(ray_cluster.nodes_by_name["gpu-b"])
        jobs = d.wait_states([job], {"succeeded"}, timeout=90)
        assert jobs[job]["node"] == "gpu-a"
        nodes = _nodes(d)
        # gone, with its jobs given up at once (node_lost_after_s = 0 here)
        assert nodes["gpu-b"]["state"] == "lost" and nodes["gpu-b"]["gpus"] == 0
        dump = d.cli("log", "dump", "--json", str(d.state_dir / "log"))
        events = [json.loads(line) for line in dump.stdout.splitlines()]
        kinds = [e["type"] for e in events if e.get("job") == job]
        assert kinds.count("JobPlaced") == 2 and "JobLost" in kinds and "JobRequeued" in kinds
        assert any(e["type"] == "NodeLeft" and e["node"] == "gpu-b" for e in events)
        lost = next(e for e in events if e["type"] == "JobLost")
        assert "node gpu-b left" in lost["reason"]
        assert d.cli("log", "verify", str(d.state_dir / "log")).returncode == 0
    finally:
        release.touch()  # the first attempt, left behind by its node, ends
        _stop(d)
    # replay under the recorded policy reproduces every placement
    out = tmp_path / "replay"
    simulate(load_source(d.state_dir), RECORDED, out)
    assert compare_placements(d.state_dir / "log", out / "log") is None


def test_a_node_back_within_the_grace_has_its_running_job_readopted(tmp_path: Path, ray_cluster: Any) -> None:
    """A node that leaves and comes back (here: its raylet removed,
    a new one with the same ``node:NAME`` started) before ``node_lost_after_s``
    keeps its running job: re-adopted, launched once, its own exit code."""
    d = _ray_daemon(tmp_path, ray_cluster, "back", node_lost_after_s=120.0)
    ran, release = tmp_path / "ran.txt", tmp_path / "release"
    try:
        _third_node(ray_cluster)
        _wait_nodes_up(d, ("gpu-d",))
        # the job runs until its node is back, however long that takes
        job = d.submit("--node", "gpu-d", "--", "sh", "-c",
                       f'echo "$EVENTSCHED_JOB_ID" >> {ran}; while [ ! -e {release} ]; do sleep 0.1; done; exit 3')
        jobs = d.wait_for(lambda js: js[job]["state"] == "running" and js[job]["pid"], 60, "running")
        pid = jobs[job]["pid"]
        ray_cluster.remove_node(ray_cluster.nodes_by_name.pop("gpu-d"))
        deadline = time.monotonic() + 30
        while _nodes(d)["gpu-d"]["state"] != "down":
            assert time.monotonic() < deadline, "the node was never seen gone"
            time.sleep(0.3)
        assert d.jobs()[job]["state"] == "running" and alive(pid)  # within the grace: not lost
        ray_cluster.nodes_by_name["gpu-d"] = add_node(ray_cluster, "gpu-d")
        _wait_nodes_up(d, ("gpu-d",))
        assert d.jobs()[job]["state"] == "running"
        release.touch()
        jobs = d.wait_states([job], {"failed", "succeeded", "lost"}, timeout=90)
        assert jobs[job]["state"] == "failed" and jobs[job]["exit_code"] == 3, jobs[job]
        kinds = [e["type"] for e in _log_events(d) if e.get("job") == job]
        assert "JobLost" not in kinds and "JobRequeued" not in kinds
        assert kinds.count("JobPlaced") == kinds.count("JobStarted") == 1
        assert ran.read_text().split() == [str(job)]  # ran once
        assert not any(e["type"] == "StrayAttemptKilled" for e in _log_events(d))
        assert d.cli("log", "verify", str(d.state_dir / "log")).returncode == 0
    finally:
        release.touch()  # a job still waiting ends
        _stop(d)


def _third_node(cluster: Any) -> None:
    """``gpu-d``, which the last two tests take away and bring back: added
    once, and the second test finds it up again where the first one left it."""
    if "gpu-d" not in cluster.nodes_by_name:
        cluster.nodes_by_name["gpu-d"] = add_node(cluster, "gpu-d")


def _log_events(d: Daemon) -> list[dict[str, Any]]:
    dump = d.cli("log", "dump", "--json", str(d.state_dir / "log"))
    return [json.loads(line) for line in dump.stdout.splitlines()]


def test_a_node_back_after_being_declared_gone_has_its_stray_attempt_killed(
    tmp_path: Path, ray_cluster: Any
) -> None:
    """A removed node's job is lost and runs again elsewhere; its
    first attempt's process (its supervisor runs in its own session) outlives
    the raylet. When a node of the same name (the same per-node state dir)
    joins again, that stray is killed and recorded, never re-adopted."""
    d = _ray_daemon(tmp_path, ray_cluster, "stray")
    ran, first = tmp_path / "ran.txt", tmp_path / "first"
    # the first launch (the one to be stranded) sleeps long, a later one briefly
    script = f'echo "$EVENTSCHED_JOB_ID" >> {ran}; if mkdir {first} 2>/dev/null; then sleep 60; else sleep 1; fi'
    stray_pid = 0
    try:
        _third_node(ray_cluster)
        _wait_nodes_up(d, ("gpu-a", "gpu-d"))
        others = [f"{n}:{g}" for n, info in _nodes(d).items() if n != "gpu-d" and info["state"] == "up"
                  for g in range(info["gpus"])]
        for gpu in others:  # so that the job lands on gpu-d
            assert d.cli("pause-gpu", gpu).returncode == 0
        job = d.submit("--retries", "1", "--", "sh", "-c", script)
        jobs = d.wait_for(lambda js: js[job]["state"] == "running" and js[job]["pid"], 60, "running")
        assert jobs[job]["node"] == "gpu-d"
        stray_pid = jobs[job]["pid"]
        for gpu in others:
            assert d.cli("resume-gpu", gpu).returncode == 0
        ray_cluster.remove_node(ray_cluster.nodes_by_name.pop("gpu-d"))
        jobs = d.wait_states([job], {"succeeded"}, timeout=60)  # lost, requeued, run again elsewhere
        assert jobs[job]["node"] != "gpu-d"
        assert alive(stray_pid), "the removed node's job died with it: nothing stray to show here"
        # a node of the same name joins again, with the same state dir: the stray goes
        ray_cluster.nodes_by_name["gpu-d"] = add_node(ray_cluster, "gpu-d")
        deadline = time.monotonic() + 60
        while not (strays := [e for e in _log_events(d) if e["type"] == "StrayAttemptKilled"]):
            assert time.monotonic() < deadline, f"no StrayAttemptKilled: {d.stderr()[-2000:]}"
            time.sleep(0.5)
        assert [(e["node"], e["job"], e["attempt"], e["pid"]) for e in strays] == [("gpu-d", job, 1, stray_pid)]
        assert not alive(stray_pid)
        _wait_nodes_up(d, ("gpu-a", "gpu-d"))
        events = _log_events(d)
        kinds = [e["type"] for e in events if e.get("job") == job]
        assert "JobLost" in kinds and "JobRequeued" in kinds
        assert d.jobs()[job]["state"] == "succeeded"  # the stray's end counted for nothing
        # the job ran exactly as many times as the log launched it
        assert ran.read_text().split() == [str(job)] * kinds.count("JobStarted") == [str(job)] * 2
        assert d.cli("log", "verify", str(d.state_dir / "log")).returncode == 0
    finally:
        _stop(d)
        if stray_pid and alive(stray_pid):  # the test's own stray, by its pid (its process group)
            os.killpg(stray_pid, signal.SIGKILL)
    # a StrayAttemptKilled is a fact only: replay still reproduces every placement
    out = tmp_path / "replay"
    simulate(load_source(d.state_dir), RECORDED, out)
    assert compare_placements(d.state_dir / "log", out / "log") is None
