"""Start forecasts as a median and an 80 % range, calibrated on how past
forecasts erred, measured against the real starts."""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import Daemon
from test_core import Sched

from eventsched import load_source, simulate
from eventsched.core import forecast
from eventsched.core.forecast import MIN_SCORES, Calibration, describe, forecast_starts
from eventsched.domain import events as ev

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from forecast_error import forecast_errors, report  # noqa: E402


def test_the_range_brackets_the_median_and_is_the_same_every_time() -> None:
    s = Sched(gpus=1)
    for runtime in (100.0, 300.0):
        j = s.submit(name="a")
        s.now += runtime
        s.exit(j)
    s.submit(name="a")
    waiting = [s.submit(name="a") for _ in range(3)]
    f = forecast_starts(s.state, s.now)
    assert forecast_starts(s.state, s.now) == f and not f.calibrated
    for j in waiting:
        assert f.low[j] <= f.starts[j] <= f.high[j] and f.low[j] < f.high[j]
    assert f.starts[waiting[0]] - s.now == 200.0  # the running job's predicted end: the mean of its kind


def test_a_job_past_its_prediction_is_not_about_to_end() -> None:
    s = Sched(gpus=1)
    j = s.submit(name="a")
    s.now += 100
    s.exit(j)
    s.submit(name="a")
    s.now += 500  # 400 s over its 100 s prediction
    waiting = s.submit(name="b")
    f = forecast_starts(s.state, s.now)
    assert f.starts[waiting] - s.now >= 1 and describe(f.starts[waiting], s.now) != "now"
    assert describe(s.now + 0.2, s.now) == "at the next decision"


def test_calibration_scales_the_range_by_how_past_forecasts_erred() -> None:
    cal = Calibration()
    rng = random.Random(7)
    for job in range(1, 201):  # each forecast said 600 s; the real wait was 0.5 to 2 times that
        cal.fold([ev.JobForecast(ts=job, seq=2 * job, job=job, estimated_start=job + 600.0),
                  ev.JobPlaced(ts=job + 600 * rng.uniform(0.5, 2.0), seq=2 * job + 1, job=job, node="local",
                               gpu_ids=[0], share=1.0)])
    lo, hi = cal.bounds(now=1000.0) or (0.0, 0.0)
    assert 0.55 < math.exp(lo) < 0.8 and 1.6 < math.exp(hi) < 2.0
    assert Calibration().bounds(0.0) is None and cal.seq == 401
    # a forecast still waiting counts with its wait so far: long waits are not left out
    late = Calibration()
    late.fold([ev.JobForecast(ts=0.0, seq=j, job=j, estimated_start=10.0) for j in range(MIN_SCORES)])
    assert (late.bounds(now=5000.0) or (0, 0))[0] > 3


def generated_log(tmp_path: Path) -> Path:
    """The log of a best-fit replay of 300 jobs of three users on 2 GPUs."""
    rng = random.Random(3)
    rows, t = ["submit_time,duration,gpus,user"], 0.0
    for _ in range(300):
        t += rng.expovariate(1 / 100)
        user = rng.choice(["ann", "bob", "cy"])
        rows.append(f"{t:.1f},{rng.lognormvariate(5.5 if user == 'bob' else 4.5, 0.6):.1f},1,{user}")
    (tmp_path / "w.csv").write_text("\n".join(rows) + "\n")
    result = simulate(load_source(tmp_path / "w.csv", gpus="fake:2"), "best-fit", tmp_path / "r")
    return Path(result.state_dir) / "log"


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """The generated log and its forecasts' errors, worked out once for the tests below."""
    log = generated_log(tmp_path_factory.mktemp("generated"))
    return log, forecast_errors(log)


def test_the_range_covers_about_eight_starts_in_ten_on_a_generated_workload(generated: tuple[Path, list]) -> None:
    log, errors = generated
    assert errors == forecast_errors(log)  # deterministic
    r = report(errors)
    assert r["forecasts"] > 100 and 0.65 <= r["coverage"] <= 0.95, r


def test_the_median_over_sampled_futures_errs_less_than_one_future(generated: tuple[Path, list],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    log, errors = generated
    many = report(errors)
    monkeypatch.setattr(forecast, "SAMPLES", 1)
    one = report(forecast_errors(log))
    assert many["median_abs_error_s"] < 0.9 * one["median_abs_error_s"], (many, one)
    assert many["median_width_s"] < one["median_width_s"] and 0.7 <= many["coverage"] <= 0.9, (many, one)


def test_explain_and_queue_show_the_range(tmp_path: Path) -> None:
    with Daemon(tmp_path / "state", gpus="fake:1") as d:
        job = d.submit("--name", "step", "--", "sleep", "1")
        d.wait_states([job], {"succeeded"})
        first = d.submit("--name", "step", "--", "sleep", "6")
        d.wait_states([first], {"running"})
        second = d.submit("--name", "step", "--", "sleep", "1")
        listed = {j["id"]: j for j in json.loads(d.cli("queue", "--json").stdout)}[second]
        assert listed["estimated_start_p10"] <= listed["estimated_start"] <= listed["estimated_start_p90"]
        shown = json.loads(d.cli("explain", str(second), "--json").stdout)["forecast"]
        assert shown["estimated_start_p10"] <= shown["estimated_start"] <= shown["estimated_start_p90"]
        r = d.cli("explain", str(second))
        assert r.returncode == 0 and "(80 %: " in r.stdout and "wide guess" in r.stdout, r.stdout
        d.wait_states([second], {"succeeded"}, timeout=20)
        time.sleep(0.5)
        rows = json.loads(d.cli("sql", "SELECT covered, width_s FROM forecast_errors", "--format", "json").stdout)
        assert len(rows) == 2 and all(r["width_s"] > 0 and r["covered"] in (True, False) for r in rows)  # each shown
