"""A cluster still forming, or a node down: a job larger than every node up
now waits for one ("waiting for a node with K GPUs") instead of being refused;
only a job larger than every node the cluster has ever had is refused. One
machine is unchanged. The core alone, driven by messages (no Ray); then
``serve --wait-nodes``'s bad input, and one machine's ``health`` on a real daemon."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
from daemon_harness import EVENTSCHED, Daemon

from eventsched import core
from eventsched.core.alternatives import forecast_alternatives
from eventsched.core.explain import waiting_reason
from eventsched.domain import events as ev
from eventsched.domain.messages import (GpuInfo, Launch, NodeDown, NodeUp, ProcessExited, ProcessStarted, Refused,
                                        SchedulerConfig, Started, Submit, Update)
from eventsched.projections.cluster import ClusterState, validate_state
from eventsched.sim.compare import compare_placements, placements
from eventsched.sim.simulator import RECORDED, simulate
from eventsched.sim.sources import load_source
from eventsched.storage import log as eventlog


def _gpus(n: int, node: str, mib: int = 16_384) -> list[GpuInfo]:
    return [GpuInfo(gpu=i, uuid=f"fake-{node}-{i}", model="fake", memory_total_mib=mib) for i in range(n)]


def _daemon(backend: str, gpus: list[GpuInfo],
            writer: eventlog.LogWriter | None = None) -> tuple[ClusterState, Callable[[Any], list[ev.Event]]]:
    """The core as a daemon on ``backend`` drives it; with ``writer``, every
    event written to a real log and every launch started at once."""
    state, clock = ClusterState(), [1_000.0]

    def feed(msg: Any) -> list[ev.Event]:
        clock[0] += 1.0
        events, effects = core.handle(state, msg, clock[0])
        validate_state(state)
        if writer is not None and events:
            state.last_seq = writer.append(events)
            for eff in effects:
                if isinstance(eff, Launch):
                    feed(ProcessStarted(job=eff.job, pid=100 + eff.job))
        return events

    cfg = SchedulerConfig(node="head", node_lost_after_s=60.0)
    feed(Started(node="head", pid=1, version="t", gpu_backend=backend, gpus=gpus, config=cfg))
    return state, feed


def _submit(feed: Callable[[Any], list[ev.Event]], gpus: float, **spec: Any) -> int:
    events = feed(Submit(spec=ev.JobSpec(command=["true"], gpus=gpus, uid=0, user="root", **spec)))
    return next(e.job for e in events if isinstance(e, ev.JobSubmitted))


def _reason(state: ClusterState, job: int) -> str:
    reason = waiting_reason(state, job, 2_000.0)
    assert reason is not None
    return reason.text


def test_before_any_node_joins_every_job_waits_and_starts_once_a_node_has_room() -> None:
    state, feed = _daemon("ray:127.0.0.1:6379", [])
    gang = _submit(feed, 2)
    pinned = _submit(feed, 1, node="gpu-b")  # a node that has not joined yet
    assert state.jobs[gang].state == state.jobs[pinned].state == "queued"
    assert _reason(state, gang) == "resources: waiting for a node with 2 GPUs; no node has joined yet"
    assert _reason(state, pinned) == "resources: waiting for node gpu-b with 1 GPU; no node has joined yet"
    feed(NodeUp(node="gpu-a", gpus=_gpus(1, "gpu-a"), ray_node="a"))
    assert state.jobs[gang].state == "queued"
    assert _reason(state, gang) == "resources: waiting for a node with 2 GPUs; the largest node up has 1"
    feed(NodeUp(node="gpu-b", gpus=_gpus(2, "gpu-b"), ray_node="b"))
    assert state.jobs[gang].state == "running" and state.jobs[gang].node == "gpu-b"
    assert state.jobs[pinned].state == "queued"  # gpu-b is full now: an ordinary wait
    assert "waiting for" not in _reason(state, pinned)


def test_once_nodes_have_joined_a_job_larger_than_every_node_ever_is_refused() -> None:
    state, feed = _daemon("ray:auto", [])
    feed(NodeUp(node="gpu-a", gpus=_gpus(2, "gpu-a"), ray_node="a"))
    with pytest.raises(Refused, match="asks for 3 GPUs but there are only 2 GPU"):
        _submit(feed, 3)
    with pytest.raises(Refused, match="only 0 GPU"):  # no GPU of the cluster has that much memory
        _submit(feed, 1, gpu_mem_mib=20_000)
    with pytest.raises(Refused, match="unknown node 'gpu-z'"):
        _submit(feed, 1, node="gpu-z")


def test_a_job_that_fits_only_a_node_that_is_down_waits_for_it() -> None:
    state, feed = _daemon("ray:auto", [])
    feed(NodeUp(node="gpu-a", gpus=_gpus(1, "gpu-a"), ray_node="a"))
    feed(NodeUp(node="gpu-b", gpus=_gpus(4, "gpu-b", mib=40_960), ray_node="b"))
    feed(NodeDown(node="gpu-b", reason="Ray reports the node dead"))
    big = _submit(feed, 4)
    roomy = _submit(feed, 1, gpu_mem_mib=30_000)
    assert state.jobs[big].state == state.jobs[roomy].state == "queued"
    assert _reason(state, big) == "resources: waiting for a node with 4 GPUs; the largest node up has 1 (gpu-b down)"
    assert _reason(state, roomy).startswith("resources: waiting for a node with 1 GPU of 30000 MiB")
    with pytest.raises(Refused, match="asks for 5 GPUs but the largest node has 4: a job's GPUs are all on one node"):
        _submit(feed, 5)
    with pytest.raises(Refused, match="asks for 5 GPUs"):  # a change of request is checked alike
        feed(Update(job=big, uid=0, gpus=5))
    # explain's what-if asks the same of its working copy: its own request waits, a larger one is refused
    own, larger = forecast_alternatives(state, 2_000.0, big, [(5, None)])
    assert own["gpus"] == 4 and not own["text"].startswith(("asks for", "no GPU"))
    assert larger["text"].startswith("asks for 5 GPUs but the largest node has 4")
    feed(NodeUp(node="gpu-b", gpus=_gpus(4, "gpu-b", mib=40_960), ray_node="b2"))
    assert state.jobs[big].state == "running" and state.jobs[big].node == "gpu-b"


def test_one_machine_still_refuses_at_once() -> None:
    state, feed = _daemon("fake:2:16384", _gpus(2, "head"))
    with pytest.raises(Refused, match="asks for 3 GPUs but there are only 2"):
        _submit(feed, 3)
    _, bare = _daemon("fake:0", [])
    with pytest.raises(Refused, match="no GPU here can take this job"):
        _submit(bare, 1)
    assert not state.cluster and not state.nodes


def test_replay_of_a_forming_cluster_reproduces_its_placements(tmp_path: Path) -> None:
    writer = eventlog.LogWriter.open(tmp_path / "rec" / "log")
    state, feed = _daemon("ray:auto", [], writer)
    gangs = [_submit(feed, 2) for _ in range(2)]  # both wait for nodes
    feed(NodeUp(node="gpu-a", gpus=_gpus(2, "gpu-a"), ray_node="a"))
    feed(NodeUp(node="gpu-b", gpus=_gpus(2, "gpu-b"), ray_node="b"))
    for jid in gangs:
        feed(ProcessExited(job=jid, exit_code=0))
    writer.close()
    recorded = placements(tmp_path / "rec" / "log")
    assert sorted(p[1] for p in recorded) == ["gpu-a", "gpu-b"]
    simulate(load_source(tmp_path / "rec"), RECORDED, tmp_path / "replay", validate=True)
    assert compare_placements(tmp_path / "rec" / "log", tmp_path / "replay" / "log") is None


@pytest.mark.parametrize("argv, said", [
    (["--wait-nodes", "2"], "eventsched: error: --wait-nodes needs --ray: nodes join a Ray cluster"),
    (["--ray", "127.0.0.1:1", "--wait-nodes", "0"], "eventsched: error: --wait-nodes must be at least 1, not 0"),
])
def test_serve_wait_nodes_bad_input_is_one_line(tmp_path: Path, argv: list[str], said: str) -> None:
    r = subprocess.run([*EVENTSCHED, "serve", "--state-dir", str(tmp_path), *argv], capture_output=True, text=True,
                       timeout=60)
    assert (r.returncode, r.stderr.strip()) == (2, said)
    assert not (tmp_path / "log").exists()


def test_health_on_one_machine_says_nothing_of_nodes(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "one", gpus="fake:1").start()
    try:
        text, data = d.cli("health"), d.cli("health", "--json")
        assert text.returncode == data.returncode == 0
        assert text.stdout.startswith("ok: daemon pid ") and "node" not in text.stdout
        assert set(json.loads(data.stdout)) == {"ok", "pid", "seq", "state_dir"}
    finally:
        d.stop()
