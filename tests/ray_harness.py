"""A local Ray cluster for the tests: a head without GPUs and GPU nodes that
each declare a ``node:NAME`` resource, all bound to 127.0.0.1, and every
process it started stopped by PID at the end."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

import pytest
from processes import alive, descendants, kill


def add_node(cluster: Any, name: str, gpus: int = 2) -> Any:
    """A GPU node called ``name``, tried twice: a raylet can miss Ray's 30 s
    start-up deadline on a loaded machine."""
    for tries_left in (1, 0):
        try:
            return cluster.add_node(num_cpus=1, num_gpus=gpus, resources={f"node:{name}": 1},
                                    node_ip_address="127.0.0.1")
        except Exception:
            if not tries_left:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def local_cluster(nodes: tuple[str, ...], system_config: dict[str, Any] | None = None) -> Iterator[Any]:
    """The cluster, with ``nodes_by_name``; every Ray process (and job) it
    started ends with it, by PID. ``system_config``: Ray's, for the head (and so the cluster)."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'eventsched[ray]')")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    before = descendants(os.getpid())
    cluster: Any = None
    for tries_left in (1, 0):  # Ray gives a node 30 s to register: a loaded machine can miss it
        try:
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False,
                **({"_system_config": system_config} if system_config else {})})
            break
        except Exception:
            kill(descendants(os.getpid()) - before)
            if not tries_left:
                raise
    try:
        cluster.nodes_by_name = {name: add_node(cluster, name) for name in nodes}
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ours = descendants(os.getpid()) - before
        cluster.shutdown()
        deadline = time.monotonic() + 10
        while (left := {p for p in ours if alive(p)}) and time.monotonic() < deadline:
            time.sleep(0.2)
        kill(left)
        assert not {p for p in ours if alive(p)}, "a Ray process outlived the cluster"
