"""Prediction vs reality: a fifo log replayed under best-fit against a live
best-fit run of the same seeded workload, on real daemons and fake GPUs.

bench/prediction_vs_reality.py holds the workloads and the runs (and writes
replays/prediction-vs-reality/README.md); this runs the short-job and the
faults workloads and a 16-job cut of the mixed one (about 30 s on 2 cores).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from eventsched.sim.simulator import RECORDED, simulate
from eventsched.sim.sources import load_source
from eventsched.sim.whatif import metrics_from_log

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import prediction_vs_reality as pvr

P95_SPREAD = 0.15  # a non-deterministic workload's own run-to-run spread of p95 wait (13 % measured)

# (workload, whether its placements repeat from run to run, the metrics held
# to the runs' own spread rather than 5 %, whether its two live runs go at
# once): in short and faults, exits ms apart decide where best-fit puts what;
# short's whole run lasts about 3 s, so a loaded machine's launch latency moves
# its makespan as much as its waits, and its daemons are busy launching: its
# live runs go one after the other; the others' jobs mostly sleep
CASES = [
    (pvr.short, False, ("p95_wait_s", "mean_wait_s", "makespan_s"), False),
    (pvr.faults, False, ("p95_wait_s", "mean_wait_s"), True),
    (lambda: pvr.mixed(1, n=16), True, (), True),  # arrivals and exits far apart next to the daemon's jitter
]
_LABELS = {"p95_wait_s": "p95 wait", "mean_wait_s": "mean wait", "makespan_s": "makespan"}


def _close(o: Any, deterministic: bool, loose: tuple[str, ...]) -> bool:
    if deterministic:  # under a loaded machine's jitter two exits can still swap: the second run must agree
        return not o.misses() and o.same_placements == o.placements[0] == o.placements[1]
    rest = [m for m in o.misses() if not m.startswith(tuple(_LABELS[k] for k in loose))]
    return not rest and max(o.error(k) for k in loose) <= P95_SPREAD


@pytest.mark.slow
@pytest.mark.parametrize("make, deterministic, loose, together", CASES, ids=["short", "faults", "mixed16"])
def test_a_replay_predicts_the_live_run_of_the_other_policy(
    tmp_path: Path, make: Any, deterministic: bool, loose: tuple[str, ...], together: bool
) -> None:
    work = make()
    # a live run of sub-second waits moves with the machine's load: one more
    # live run where the first misses (both are shown in a failure)
    o = pvr.run_workload(work, tmp_path, ("fifo", "best-fit"), together)
    if not _close(o, deterministic, loose):
        first = pvr.table([o])
        tmp_path = tmp_path / "again"
        o = pvr.run_workload(work, tmp_path, ("fifo", "best-fit"), together)
        print("first live run:\n" + first)
    assert o.live.jobs == o.predicted.jobs == len(work.jobs)
    assert o.predicted.finished == o.live.finished
    if deterministic:
        assert not o.misses(), pvr.table([o])  # mean wait, p95 wait, makespan, utilisation within 5 %
    else:
        # p95 of 30 waits is about the second longest. Where exits tie on the
        # workload's 10 ms grid, which ends first decides best-fit's GPUs, and
        # that moved p95 between 1.77 and 2.02 s (13 %) from one run of the
        # faults workload to the next, live and predicted alike: it is held to
        # the runs' own spread; makespan and utilisation stay within 5 %
        # the short workload's mean wait (under half a second) and makespan
        # move with the machine's load as much: they are held to the same spread
        assert _close(o, deterministic, loose), pvr.table([o])
    if deterministic:
        assert o.same_placements == o.placements[0] == o.placements[1], pvr.table([o])
    # and both live logs give their own figures back when replayed exactly
    for live in ("live-fifo", "live-best-fit"):
        simulate(load_source(tmp_path / live), RECORDED, tmp_path / f"exact-{live}")
        assert metrics_from_log(tmp_path / f"exact-{live}" / "log") == metrics_from_log(tmp_path / live / "log")
