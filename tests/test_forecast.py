"""Start forecasts ("when will my job start?"): the core run forward on a
copy of the state with predicted runtimes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_core import Sched

from eventsched import load_source, simulate
from eventsched.core.forecast import describe, forecast_starts, working_copy
from eventsched.projections.cluster import snapshot_bytes, validate_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from forecast_error import forecast_errors  # noqa: E402


def test_a_forecast_runs_the_queue_forward_and_changes_nothing() -> None:
    s = Sched(gpus=2)
    for name, runtime in (("a", 100.0), ("b", 50.0)):  # history: a takes 100 s, b 50 s
        j = s.submit(name=name)
        s.now += runtime
        s.exit(j)
    s.submit(name="a")
    s.submit(name="a")
    third, big = s.submit(name="b"), s.submit(name="b", gpus=2)
    before = snapshot_bytes(s.state)
    f = forecast_starts(s.state, s.now)
    assert snapshot_bytes(s.state) == before  # a copy ran forward, not the state
    # 'b' starts when the first 'a' ends (100 s); the 2-GPU job when both GPUs are free:
    # the second 'a' ends at 100 s, 'b' at 150 s
    assert {j: t - s.now for j, t in f.starts.items()} == {third: 100.0, big: 150.0} and f.complete
    assert describe(f.starts[big], s.now) == "in about 2 min" and describe(None, s.now).startswith("not within")
    validate_state(working_copy(s.state))


def test_forecasts_are_exact_when_runtimes_are_and_measured_when_not(tmp_path: Path) -> None:
    # one GPU job per row, each user's jobs always take the same time: the
    # predictions are exact once a user's first job ran, so are the forecasts
    rows = ["submit_time,duration,gpus,user"] + [f"{i * 5},{60 if i % 2 else 30},1,{'ann' if i % 2 else 'bob'}"
                                                    for i in range(40)]
    (tmp_path / "w.csv").write_text("\n".join(rows) + "\n")
    result = simulate(load_source(tmp_path / "w.csv", gpus="fake:2"), "best-fit", tmp_path / "r")
    errors = forecast_errors(Path(result.state_dir) / "log")
    assert len(errors) > 20
    # once both users have a finished run (ann's first ends at 65 s) the predictions are exact
    late = [abs(actual - est) for _, made, est, _, _, actual in errors if made >= 65]
    assert len(late) > 15 and max(late) == pytest.approx(0.0, abs=1e-6)
    # before that, ann's jobs were predicted from bob's runs (the median of all): off, and measured
    early = [abs(actual - est) for _, made, est, _, _, actual in errors if made < 65]
    assert early and max(early) > 10
