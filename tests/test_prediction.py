"""Prediction vs reality: a fifo log replayed under best-fit against a live
best-fit run of the same seeded workload, on real daemons and fake GPUs.

bench/prediction_vs_reality.py holds the workloads and the runs (and writes
replays/prediction-vs-reality/README.md); this runs the short-job and the
faults workloads and a 16-job cut of the mixed one (about 50 s on 2 cores).
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

# (workload, whether its placements repeat from run to run): in short, exits
# ms apart decide where best-fit puts what; in faults, whether a cancel finds
# its job queued or running can go either way by a few ms
CASES = [
    (pvr.short, False),
    (pvr.faults, False),
    (lambda: pvr.mixed(1, n=16), True),  # arrivals and exits far apart next to the daemon's jitter
]


@pytest.mark.slow
@pytest.mark.parametrize("make, deterministic", CASES, ids=["short", "faults", "mixed16"])
def test_a_replay_predicts_the_live_run_of_the_other_policy(tmp_path: Path, make: Any, deterministic: bool) -> None:
    work = make()
    o = pvr.run_workload(work, tmp_path, ("fifo", "best-fit"))
    assert o.live.jobs == o.predicted.jobs == len(work.jobs)
    assert o.predicted.finished == o.live.finished
    assert not o.misses(), pvr.table([o])  # mean wait, p95 wait, makespan, utilisation within 5 %
    if deterministic:
        assert o.same_placements == o.placements[0] == o.placements[1], pvr.table([o])
    # and both live logs give their own figures back when replayed exactly
    for live in ("live-fifo", "live-best-fit"):
        simulate(load_source(tmp_path / live), RECORDED, tmp_path / f"exact-{live}")
        assert metrics_from_log(tmp_path / f"exact-{live}" / "log") == metrics_from_log(tmp_path / live / "log")
