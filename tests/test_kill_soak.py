"""A few rounds of the kill soak (bench/soak_kill.py; the long run is 200+ rounds).

Each round: a storm of submissions from three client processes, jobs that
record each run and exit with a code derived from their id, segment rotations
and snapshots in flight; kill -9 of the zygote, a supervisor or a job's process
group (the daemon must stay up and record the job as failed or lost), then kill
-9 of the daemon; restart and check that nothing acknowledged is missing, no
job ran twice, every exit code is right, ``log verify`` passes and the DuckDB
model equals a rebuild from the log.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import soak_kill

pytestmark = pytest.mark.slow


def test_six_kill_rounds_lose_nothing_and_run_nothing_twice(tmp_path: Path) -> None:
    # component_every=1: each round first kills a job's process group, a
    # supervisor or the zygote (two of each), then the daemon
    figures = soak_kill.run_soak(tmp_path, 6, seed=7, component_every=1, log=None)
    assert figures.problems == []
    assert figures.rounds == 6 and figures.daemon_kills == 6
    assert figures.acknowledged > 50, "the storm submitted too little to prove anything"
    # every acknowledged job ended and was checked (a few more: taken, but the
    # client was killed before it read the reply)
    assert figures.jobs_checked >= figures.acknowledged
    assert sum(figures.component_kills.values()) >= 3
    assert figures.segments > 3, "no segment rotation happened"
    assert figures.snapshots_on_disk >= 1
    assert figures.client_errors, "no client ever met the kill mid-request"
