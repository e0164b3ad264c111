"""How good are the start forecasts? (issue 17: "when will my job start?")

Replays a workload under a policy, then walks the replay's log: right after
each submission, while the job is still queued, it asks the forecast (the core
run forward on a copy of the state as it was then, with the predicted
runtimes) when the job will start, and compares that with when it did start
in the replay. Prints the number of forecasts, the mean and median absolute
error, the mean error (> 0: it started later than forecast), and the same
next to the jobs' actual waits.

Run: python bench/forecast_error.py [WORKLOAD.csv] [--gpus fake:8:81920] [--policy best-fit]
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
from eventsched.core.forecast import run_forecast, working_copy  # noqa: E402
from eventsched.domain import events as ev  # noqa: E402
from eventsched.domain.states import JobState  # noqa: E402
from eventsched.projections.cluster import ClusterState, apply  # noqa: E402
from eventsched.storage import log as eventlog  # noqa: E402


def forecast_errors(log_dir: Path) -> list[tuple[int, float, float, float]]:
    """(job, forecast made at, forecast start, actual start) for every job queued at its submission."""
    batches = list(eventlog.read_batches(log_dir))
    started: dict[int, float] = {}
    for batch in batches:
        for e in batch:
            if isinstance(e, ev.JobPlaced):
                started.setdefault(e.job, e.ts)
    state = ClusterState()
    out = []
    pending: list[ev.JobSubmitted] = []

    def forecast_pending() -> None:
        # the submissions' own decisions are applied: who is still queued waits
        for s in pending:
            if state.jobs[s.job].state == JobState.QUEUED and s.job in started:
                f = run_forecast(working_copy(state), s.ts, {s.job})
                if s.job in f.starts:
                    out.append((s.job, s.ts, f.starts[s.job], started[s.job]))
        pending.clear()

    for batch in batches:
        for e in batch:
            if ev.is_stimulus(e) and pending:
                forecast_pending()
            apply(state, e)
            if isinstance(e, ev.JobSubmitted):
                pending.append(e)
    forecast_pending()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", nargs="?", default=str(REPO / "replays" / "synthetic" / "workload.csv"))
    ap.add_argument("--gpus", default="fake:8:81920")
    ap.add_argument("--policy", default="best-fit")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = simulate(load_source(args.workload, gpus=args.gpus), args.policy, Path(tmp) / "r")
        rows = forecast_errors(Path(result.state_dir) / "log")
    if not rows:
        print("no job waited: nothing to forecast")
        return
    err = [actual - est for _, _, est, actual in rows]
    abs_err = [abs(x) for x in err]
    waits = [actual - made for _, made, _, actual in rows]
    print(f"{args.workload} under {args.policy} on {args.gpus}: {result.jobs} jobs, {len(rows)} forecasts "
          "(each job queued at its submission, forecast then)")
    print(f"  mean absolute error  {statistics.mean(abs_err):10.1f} s   (mean actual wait {statistics.mean(waits):10.1f} s)")
    print(f"  median abs. error    {statistics.median(abs_err):10.1f} s   (median wait      {statistics.median(waits):10.1f} s)")
    print(f"  mean error           {statistics.mean(err):10.1f} s   (> 0: started later than forecast)")
    print(f"  within 10 % of the wait or 60 s: {sum(1 for a, w in zip(abs_err, waits) if a <= max(60.0, 0.1 * w)) / len(rows):.0%}")


if __name__ == "__main__":
    main()
