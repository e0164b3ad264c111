"""Several machines on Ray: what a remote node costs.

Starts a local Ray cluster (``ray.cluster_utils.Cluster``, all on 127.0.0.1: a
head without GPUs and two nodes of two fake GPUs each) and two daemons in the
same run: one single-machine (``--gpus fake:4``) and one on the cluster
(``--ray ADDRESS --gpus fake:2``, 2 nodes x 2 GPUs). For each it prints

- dispatch latency, p50 / p90 over N sequential jobs: from just before
  ``eventsched submit`` is run to the job's first instruction (it prints the
  wall clock), so the CLI's own start-up is in both;
- a drain: 1,000 ``true`` jobs of one GPU each (one ``--array`` submission),
  wall time until the last has ended, and jobs per second.

Both daemons run on this machine, so "remote" here is Ray's path (an actor
call to launch, a long poll for the exit, the output copied back), not a
network's latency.

Run: python bench/bench_ray.py [N_LATENCY] [N_DRAIN]   (needs `pip install 'eventsched[ray]'`)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemon_harness import Daemon  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def latency(d: Daemon, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.time()
        job = d.submit("--gpus", "1", "--", "bash", "-c", "echo $EPOCHREALTIME")
        d.wait_states([job], {"succeeded"}, timeout=60)
        deadline = time.monotonic() + 10
        text = ""
        while time.monotonic() < deadline and not text.strip():
            text = d.cli("logs", str(job)).stdout
            time.sleep(0.02)
        out.append(float(text.split()[-1]) - t0)
    return out


def drain(d: Daemon, n: int) -> float:
    t0 = time.time()
    r = d.cli("submit", "--array", f"0-{n - 1}", "--gpus", "1", "--", "true", timeout=120)
    assert r.returncode == 0, r.stderr
    while True:
        status = d.status()
        if not status["jobs"]:
            return time.time() - t0
        time.sleep(0.2)


def report(name: str, lat: list[float], n_drain: int, wall: float) -> None:
    print(f"{name:<28} dispatch p50 {statistics.median(lat) * 1000:7.1f} ms  p90 {pct(lat, 90) * 1000:7.1f} ms"
          f"   drain {n_drain} jobs: {wall:6.2f} s ({n_drain / wall:6.1f} jobs/s)")


def main() -> None:
    n_lat = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    n_drain = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    try:
        for name in ("gpu-a", "gpu-b"):
            for tries_left in (1, 0):  # Ray gives a node 30 s to register; a loaded machine can miss it
                try:
                    cluster.add_node(num_cpus=1, num_gpus=2, resources={f"node:{name}": 1},
                                     node_ip_address="127.0.0.1")
                    break
                except Exception:
                    if not tries_left:
                        raise
        cluster.wait_for_nodes()
        with tempfile.TemporaryDirectory() as tmp:
            single = Daemon(Path(tmp) / "single", gpus="fake:4:16384").start()
            try:
                lat_single = latency(single, n_lat)
                wall_single = drain(single, n_drain)
            finally:
                single.stop()
            ray_d = Daemon(Path(tmp) / "ray", gpus="fake:2:16384", extra=["--ray", cluster.address]).start(timeout=60)
            try:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    nodes = json.loads(ray_d.cli("nodes", "--json").stdout)
                    if sum(n["gpus"] for n in nodes if n["state"] == "up") == 4:
                        break
                    time.sleep(0.5)
                lat_ray = latency(ray_d, n_lat)
                wall_ray = drain(ray_d, n_drain)
                spread = json.loads(ray_d.cli("sql", "SELECT node, count(*) AS n FROM placements GROUP BY node",
                                              "--format", "json").stdout or "[]")
            finally:
                ray_d.stop()
        print(f"# {os.cpu_count()} CPUs; Ray {__import__('ray').__version__}; "
              f"latency over {n_lat} sequential jobs, drain of {n_drain} one-GPU `true` jobs on 4 GPUs")
        report("single machine (fake:4)", lat_single, n_drain, wall_single)
        report("Ray, 2 nodes x fake:2", lat_ray, n_drain, wall_ray)
        print(f"placements per node (Ray): {spread}")
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
