"""Speed of the FGD static experiment (Figure 9(a)) on the 8,152-pod Alibaba trace.

    .venv/bin/python bench/bench_static.py            # one seed per policy
    .venv/bin/python bench/bench_static.py --full     # also the 6 x 10-seed run

Target: one policy and seed (8,152 pods + ~2.6k tuned copies) in < 5 s.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from eventsched.sim.static_sim import DEFAULT_SEEDS, POLICIES, run_one, run_static
from eventsched.sim.traces import load_alibaba

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default=str(TRACES))
    ap.add_argument("--full", action="store_true", help="also time all policies x seeds 42-51")
    args = ap.parse_args()
    pod_csv = Path(args.traces) / "openb_pod_list_default.csv"
    node_csv = Path(args.traces) / "openb_node_list_gpu_node.csv"

    t0 = time.perf_counter()
    pods, nodes = load_alibaba(pod_csv, node_csv)
    print(f"load trace: {len(pods)} pods, {len(nodes)} nodes in {time.perf_counter() - t0:.3f} s")
    for pol in POLICIES:
        t0 = time.perf_counter()
        r = run_one(pods, nodes, pol, 42)
        dt = time.perf_counter() - t0
        print(f"{pol:<11} seed 42: {r.pods} arrivals ({len(pods)} trace pods) in {dt:6.3f} s"
              f"  = {r.pods / dt:8.0f} pods/s   unallocated@100% = {r.unallocated[100]:.2f} %")
    if args.full:
        t0 = time.perf_counter()
        run_static(str(pod_csv), str(node_csv), list(POLICIES), DEFAULT_SEEDS)
        print(f"full run, {len(POLICIES)} policies x {len(DEFAULT_SEEDS)} seeds: "
              f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
