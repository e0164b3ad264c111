"""Counting the jobs ahead of a few queued jobs by rank gives the numbers of
the walk of the whole queue (so that a page of ``queue --json`` need not
walk a 100,000-job queue)."""

from __future__ import annotations

import random

from eventsched import core
from eventsched.core import explain
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.projections.cluster import ClusterState


def _compare(state: ClusterState, now: float, rng: random.Random) -> int:
    queued = sorted(j for _, _, j in state.queue.by_priority)
    if not queued:
        return 0
    wanted = set(rng.sample(queued, max(1, min(len(queued) // 64, rng.choice([1, 2, 5])))))
    assert len(wanted) * 64 <= len(state.queue)  # so _ahead_of counts by rank
    by_rank = explain._ahead_of(state, now, wanted)
    order = state.queue.by_order if state.policy == "fifo" else state.queue.by_priority
    by_walk = explain._ahead_by_walk(state, now, wanted, (k[-1] for k in order))
    assert by_rank == by_walk, (state.policy, now, wanted)
    return sum(count for count, _ in by_rank.values())


def _run(seed: int, policy: str, steps: int) -> int:
    rng = random.Random(seed)
    state, now = ClusterState(), 1000.0
    infos = [m.GpuInfo(gpu=i, uuid=f"g{i}", model="fake", memory_total_mib=40_000) for i in range(4)]
    core.handle(state, m.Started(node="local", pid=1, version="t", gpu_backend="fake", gpus=infos,
                                 config=m.SchedulerConfig(policy=policy, retry_backoff_s=50.0,
                                                          aging_per_hour=rng.choice([0.0, 0.1]))), now)
    counted = 0
    for _ in range(steps):
        now += rng.choice([0.0, 1.0, 7.0, 40.0])
        if state.running and rng.random() < 0.3:
            jid = rng.choice(sorted(state.running))  # failures with retries back off: not eligible for a while
            core.handle(state, m.ProcessExited(job=jid, exit_code=rng.choice([0, 0, 1, 1])), now)
        else:
            ids = sorted(state.jobs)
            spec = ev.JobSpec(
                command=["j"], user=f"u{rng.randrange(3)}", gpus=rng.choice([0.5, 1.0, 1.0, 2.0, 4.0]),
                priority=rng.randrange(3), retries=rng.choice([0, 1, 2]),
                after=[rng.choice(ids)] if ids and rng.random() < 0.15 else [],
            )
            try:
                core.handle(state, m.Submit(spec=spec), now)
            except m.Refused:  # --after a job that already failed
                pass
        if len(state.queue) >= 64:
            counted += _compare(state, now, rng)
            counted += _compare(state, now + 100.0, rng)  # back-offs over: more jobs eligible
    return counted


def test_rank_counts_equal_the_walk_for_every_order() -> None:
    counted = sum(_run(seed, policy, 500) for seed, policy in enumerate(["fifo", "best-fit", "priority", "fair-share"]))
    assert counted > 1000, "the comparisons should include jobs with many ahead of them"
