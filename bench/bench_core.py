"""Core decision time with 10,000 queued jobs on 64 GPUs (target: under 1 ms).

Prints figures; asserts nothing. Run: python bench/bench_core.py [--policy NAME]
[--tenants 20]: the jobs come from 20 tenants (one user each, weights 1-3, a
quota of 8 GPUs each, every tenth job --preemptible).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from eventsched import core
from eventsched.core.policies import POLICIES, REPLAY_ONLY
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.domain.tenants import Tenant
from eventsched.projections.cluster import ClusterState

QUEUED = 10_000


def build(nodes: int, per_node: int, policy: str, fill: float = 1.0, tenants: int = 0) -> tuple[ClusterState, float]:
    """A machine whose GPUs are all busy (``fill`` of each taken), with QUEUED jobs waiting."""
    state = ClusterState()
    now = 1_000.0
    for n in range(nodes):
        node = "local" if nodes == 1 else f"node{n}"
        infos = [m.GpuInfo(gpu=i, uuid=f"{node}-{i}", model="fake", memory_total_mib=80_000) for i in range(per_node)]
        core.handle(state, m.Started(node=node, pid=1, version="b", gpu_backend="fake", gpus=infos,
                                     config=m.SchedulerConfig(node=node, policy=policy)), now)
    for k in range(tenants):
        core.handle(state, m.SetTenant(name=f"t{k}", tenant=Tenant(users=[f"u{k}"], weight=1.0 + k % 3, gpus=8.0)), now)

    def who(i: int) -> dict[str, object]:
        if not tenants:
            return {}
        return {"user": f"u{i % tenants}", "uid": 1000 + i % tenants, "preemptible": i % 10 == 0}

    for i in range(nodes * per_node):  # fill every GPU
        core.handle(state, m.Submit(spec=ev.JobSpec(command=["run"], gpus=fill, name="fill", **who(i))), now)  # type: ignore[arg-type]
    shapes = [0.25, 0.5, 1.0, 2.0, 0.1]
    for i in range(QUEUED):
        spec = ev.JobSpec(command=["run", str(i)], gpus=shapes[i % len(shapes)], priority=i % 5, name=f"j{i % 7}",
                          **who(i))  # type: ignore[arg-type]
        core.handle(state, m.Submit(spec=spec), now)
    return state, now


def timed(state: ClusterState, msg: m.Message, now: float, n: int = 200) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        core.handle(state, msg, now)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def report(label: str, ms: list[float]) -> None:
    ms = sorted(ms)
    print(f"  {label:<44} p50 {statistics.median(ms):7.3f} ms   p99 {ms[int(len(ms) * 0.99) - 1]:7.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", action="append", help="default: every policy")
    ap.add_argument("--freeze", action="store_true", help="gc.freeze() after loading, as a daemon may")
    ap.add_argument("--tenants", type=int, default=0, help="jobs from this many tenants with quotas (e.g. 20)")
    args = ap.parse_args()
    for policy in args.policy or [p for p in POLICIES if p not in REPLAY_ONLY]:
        for nodes, per in ((1, 64), (8, 8)):
            state, now = build(nodes, per, policy, tenants=args.tenants)
            if args.freeze:
                gc.collect()
                gc.freeze()
            teams = f", {args.tenants} tenants" if args.tenants else ""
            print(f"{policy}: {len(state.queue)} queued{teams}, {len(state.gpus)} GPUs ({nodes} x {per}), all busy")
            # a Submit into a full machine (the job queues); Cancel it back so the queue stays 10k
            sub = []
            for _ in range(200):
                t = time.perf_counter()
                events, _ = core.handle(state, m.Submit(spec=ev.JobSpec(command=["x"], gpus=0.5)), now)
                sub.append((time.perf_counter() - t) * 1e3)
                core.handle(state, m.Cancel(jobs=[events[0].job], uid=0), now)
            report("Submit (machine full)", sub)
            report("Tick (machine full)", timed(state, m.Tick(), now))
            # one GPU frees: the exit, then the placement of the next job(s)
            ex = []
            for _ in range(200):
                jid = next(iter(sorted(state.running)))
                t = time.perf_counter()
                core.handle(state, m.ProcessExited(job=jid, exit_code=0), now)
                ex.append((time.perf_counter() - t) * 1e3)
            report("ProcessExited -> place the next job(s)", ex)
            # worst case: every GPU has 0.05 free, one tiny job could use it but is
            # pinned to a paused GPU, so the whole queue is scanned for nothing
            state2, _ = build(nodes, per, policy, fill=0.95, tenants=args.tenants)
            first = state2.all_gpus()[0]
            core.handle(state2, m.PauseGpu(node=first.node, gpu=first.id), now)
            core.handle(state2, m.Submit(spec=ev.JobSpec(command=["x"], gpus=0.05, gpu_ids=[first.id], node=first.node)), now)
            report("Tick, fragments nobody can use (full scan)", timed(state2, m.Tick(), now, 20))


if __name__ == "__main__":
    main()
