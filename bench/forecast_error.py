"""How good are the start forecasts and their 80 % ranges?

Replays a workload under a policy, then walks the replay's log: right after
each submission, while the job is still queued, it asks the forecast (the core
run forward on a copy of the state as it was then) when the job will start,
records it as ``explain`` does (so later ranges are calibrated on it), and
compares the median and the range with when the job did start in the replay.
Prints the median absolute error as a share of the median actual wait, how
often the real start fell in the range (the target is 80 %), and the range's
median width.

Run: python bench/forecast_error.py [WORKLOAD.csv ...] [--gpus fake:8:81920] [--policy best-fit]
(default: replays/synthetic/workload.csv and the Alibaba openb trace, when present)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eventsched import load_source, simulate  # noqa: E402
from eventsched.core.forecast import Calibration, run_forecast, working_copy  # noqa: E402
from eventsched.domain import events as ev  # noqa: E402
from eventsched.domain.states import JobState  # noqa: E402
from eventsched.projections.cluster import ClusterState, apply  # noqa: E402
from eventsched.storage import log as eventlog  # noqa: E402

WORKLOADS = [REPO / "replays" / "synthetic" / "workload.csv", REPO.parent / "shared" / "traces" / "openb_pod_list_default.csv"]


def forecast_errors(log_dir: Path) -> list[tuple[int, float, float, float, float, float]]:
    """(job, made at, median, p10, p90, actual start) for every job queued at its submission."""
    batches = list(eventlog.read_batches(log_dir))
    started: dict[int, float] = {}
    for batch in batches:
        for e in batch:
            if isinstance(e, ev.JobPlaced):
                started.setdefault(e.job, e.ts)
    state, calibration = ClusterState(), Calibration()
    out = []
    pending: list[ev.JobSubmitted] = []

    def forecast_pending() -> None:
        # the submissions' own decisions are applied: who is still queued waits
        for s in pending:
            if state.jobs[s.job].state == JobState.QUEUED and s.job in started:
                f = run_forecast(working_copy(state), s.ts, {s.job}, calibration=calibration)
                if s.job in f.starts:
                    out.append((s.job, s.ts, f.starts[s.job], f.low[s.job], f.high[s.job], started[s.job]))
                    calibration.fold([ev.JobForecast(ts=s.ts, job=s.job, estimated_start=f.starts[s.job])])
        pending.clear()

    for batch in batches:
        for e in batch:
            if ev.is_stimulus(e) and pending:
                forecast_pending()
            apply(state, e)
            calibration.fold([e])
            if isinstance(e, ev.JobSubmitted):
                pending.append(e)
    forecast_pending()
    return out


def report(rows: list[tuple[int, float, float, float, float, float]]) -> dict[str, float]:
    waits = [actual - made for _, made, _, _, _, actual in rows]
    abs_err = [abs(actual - est) for _, _, est, _, _, actual in rows]
    return {"forecasts": len(rows), "median_wait_s": statistics.median(waits),
            "median_abs_error_s": statistics.median(abs_err),
            "median_abs_error_share": statistics.median(abs_err) / max(1e-9, statistics.median(waits)),
            "coverage": sum(lo <= a <= hi for *_, lo, hi, a in rows) / len(rows),
            "median_width_s": statistics.median(hi - lo for *_, lo, hi, _ in rows)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="*", default=[str(w) for w in WORKLOADS if w.exists()])
    ap.add_argument("--gpus", default="fake:8:81920")
    ap.add_argument("--policy", default="best-fit")
    args = ap.parse_args()
    for workload in args.workloads:
        with tempfile.TemporaryDirectory() as tmp:
            result = simulate(load_source(workload, gpus=args.gpus), args.policy, Path(tmp) / "r")
            rows = forecast_errors(Path(result.state_dir) / "log")
        if not rows:
            print(f"{workload}: no job waited, nothing to forecast")
            continue
        r = report(rows)
        print(f"{workload} under {args.policy}: {result.jobs} jobs, {r['forecasts']} forecasts (each job queued "
              "at its submission, forecast then)")
        print(f"  median abs. error  {r['median_abs_error_s']:9.0f} s = {r['median_abs_error_share']:.0%} of the "
              f"median wait ({r['median_wait_s']:.0f} s)")
        print(f"  80 % range         covers {r['coverage']:.1%} of real starts; median width {r['median_width_s']:.0f} s")


if __name__ == "__main__":
    main()
