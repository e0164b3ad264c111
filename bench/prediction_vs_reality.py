"""Prediction vs reality: is a what-if replay what the other policy really does?

    .venv/bin/python bench/prediction_vs_reality.py [--workload NAME ...] [--keep DIR] [--no-readme]

For each seeded workload: run it live on fake GPUs (a real ``eventsched
serve``, real processes) under policy A, replay A's log under policy B (the
prediction), run the same workload live under B (the reality), and compare
the two on every what-if metric and on the placements. Writes the table into
replays/prediction-vs-reality/README.md (between the ``table`` markers) unless
``--no-readme``. tests/test_prediction.py runs two of these workloads.

Overhead. Each replayed attempt keeps the run time the recording observed
for that job (start to exit as the daemon saw it). Placement-to-start is
*modelled* under another policy (``simulator._Sim.modelled_start``): the
daemon launches one process at a time, so a recorded delay also holds the
launches queued ahead of it, which another policy's placements do not
reproduce; each launch takes the time that job's launch took in the
recording, after the launch before it. Exit to the next placement needs no
model: the daemon places in the same step that handles the exit. Both are
estimated from recording A and printed with each workload. Why the model is
needed, in figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))

from daemon_harness import Daemon

from eventsched.domain import events as ev
from eventsched.sim.compare import placements
from eventsched.sim.simulator import simulate
from eventsched.sim.sources import load_source
from eventsched.sim.whatif import Metrics, metrics_from_log
from eventsched.storage import log as eventlog
from eventsched.wire.client import Client, ClientError

README = REPO / "replays" / "prediction-vs-reality" / "README.md"
FINAL = {"succeeded", "failed", "cancelled"}
# (metric, label, relative tolerance) the acceptance holds each prediction to
CHECKED: list[tuple[str, str, float]] = [
    ("mean_wait_s", "mean wait", 0.05),
    ("p95_wait_s", "p95 wait", 0.05),
    ("makespan_s", "makespan", 0.05),
    ("gpu_utilization", "utilisation", 0.05),
]
SHOWN: list[tuple[str, str]] = [(k, label) for k, label, _ in CHECKED] + [
    ("median_wait_s", "median wait"),
    ("mean_turnaround_s", "mean turnaround"),
    ("fragmentation", "fragmentation"),
    ("fairness", "fairness"),
]


# --- workloads ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    at: float  # seconds after the first submission
    gpus: float
    command: list[str]
    retries: int = 0
    time_limit_s: float | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    about: str
    jobs: list[Job]
    # operators' commands: (at, "cancel" | "hold" | "release", index into jobs)
    # or (at, "pause-gpu" | "resume-gpu", GPU id)
    commands: list[tuple[float, str, int]] = field(default_factory=list)
    gpus: str = "fake:4:16384"


def mixed(seed: int = 1, n: int = 40) -> Workload:
    """The mixed workload: every 0.3 s a sleep of 0.5-3 s asking 0.5, 1 or 2 GPUs."""
    rng = random.Random(seed)
    jobs = [Job(at=round(0.3 * i, 3), gpus=rng.choice([0.5, 1.0, 2.0]),
                command=["sleep", f"{rng.uniform(0.5, 3.0):.2f}"]) for i in range(n)]
    return Workload(f"mixed-s{seed}", f"{n} jobs, one every 0.3 s, sleep 0.5-3 s, 0.5/1/2 GPUs on fake:4", jobs)


SHORT_GAP = 0.015  # s between arrivals on average: more than 4 GPUs serve, so a queue builds
# no gangs here: when a 2-GPU job runs is a race between exits milliseconds
# apart under best-fit, and a live run does not repeat its own p95 then
SHORT_SHARES = [0.25, 0.5, 1.0, 1.0, 1.0]


def short(seed: int = 2, n: int = 120) -> Workload:
    """Jobs of 50-200 ms arriving faster than 4 GPUs serve them: launch and
    commit overhead is a tenth of each job, and a queue builds (waits of tens
    of ms under light load are below the noise of a live run)."""
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for _ in range(n):
        jobs.append(Job(at=round(t, 3), gpus=rng.choice(SHORT_SHARES),
                        command=["sleep", f"{rng.uniform(0.05, 0.2):.3f}"]))
        t += rng.expovariate(1 / SHORT_GAP)
    return Workload(f"short-s{seed}", f"{n} jobs of 50-200 ms, Poisson arrivals every {1000 * SHORT_GAP:.0f} ms "
                    "on average, 0.25/0.5/1 GPU on fake:4", jobs)


def faults(seed: int = 3, n: int = 30) -> Workload:
    """Failures retried once, jobs killed at a 0.5 s time limit, three cancels."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        gpus = rng.choice([0.5, 1.0, 1.0, 2.0])
        secs = f"{rng.uniform(0.3, 1.2):.2f}"
        if i % 6 == 2:
            jobs.append(Job(at=0.25 * i, gpus=gpus, command=["sh", "-c", f"sleep {secs}; exit 1"], retries=1))
        elif i % 7 == 4:
            jobs.append(Job(at=0.25 * i, gpus=gpus, command=["sleep", "3"], time_limit_s=0.5))
        else:
            jobs.append(Job(at=0.25 * i, gpus=gpus, command=["sleep", secs]))
    cancels = [(1.0, "cancel", 3), (2.6, "cancel", 12), (4.1, "cancel", n - 2)]  # one running, two likely queued
    return Workload(f"faults-s{seed}", f"{n} jobs, one every 0.25 s, sleep 0.3-1.2 s, 0.5/1/2 GPUs on fake:4; "
                    "every 6th fails and is retried once (2 s backoff), every 7th runs into a 0.5 s time "
                    "limit, 3 cancels", jobs, cancels)


def operators(seed: int, n: int = 24) -> Workload:
    """Everything an operator does to a schedule: for the identical-metrics property."""
    rng = random.Random(seed)
    base = faults(seed, n)
    t = base.jobs[-1].at
    cmds: list[tuple[float, str, int]] = [(0.9, "pause-gpu", 1), (2.4, "resume-gpu", 1), (1.5, "hold", 9),
                                          (3.3, "release", 9)]
    cmds += [(round(rng.uniform(0, t), 2), "cancel", rng.randrange(n)) for _ in range(3)]
    return Workload(f"operators-s{seed}", base.about + "; a GPU paused, a job held and released", base.jobs,
                    base.commands + cmds)


WORKLOADS = {"mixed": mixed, "short": short, "short-s5": lambda: short(5), "faults": faults}


# --- running --------------------------------------------------------------------------------


def _spec(job: Job) -> ev.JobSpec:
    return ev.JobSpec(command=job.command, cwd=str(REPO), env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                      name=job.command[0], gpus=job.gpus, retries=job.retries, time_limit_s=job.time_limit_s)


def run_live(work: Workload, policy: str, state_dir: Path, timeout: float = 120.0) -> Path:
    """Run ``work`` on a real daemon under ``policy``; return its state dir."""
    d = Daemon(state_dir, gpus=work.gpus, extra=["--policy", policy]).start()
    try:
        with Client(d.socket) as client:
            _drive(client, work, timeout)
    finally:
        d.stop()
    return state_dir


def _drive(client: Client, work: Workload, timeout: float) -> None:
    # submissions and commands in time order, each at its offset from the start
    actions = sorted([(j.at, "submit", i) for i, j in enumerate(work.jobs)] + work.commands)
    ids: dict[int, int] = {}
    t0 = time.monotonic()
    for at, what, i in actions:
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        _act(client, what, i, work, ids)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {j["id"]: j["state"] for j in client.jobs(all=True)}
        if all(states.get(i) in FINAL for i in ids.values()):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{work.name}: jobs not finished after {timeout} s")


def _act(client: Client, what: str, i: int, work: Workload, ids: dict[int, int]) -> None:
    if what == "submit":
        ids[i] = client.submit(_spec(work.jobs[i]))
    elif what == "pause-gpu":
        client.pause_gpu(i)
    elif what == "resume-gpu":
        client.resume_gpu(i)
    elif i in ids:
        try:
            {"cancel": client.cancel, "hold": client.hold, "release": client.release}[what]([ids[i]])
        except ClientError:
            pass  # the job was past it already: the daemon says so, as it would to an operator


def predict(recorded_state: Path, policy: str, out: Path) -> Path:
    """Replay the recording under ``policy``; return the replay's state dir."""
    simulate(load_source(recorded_state), policy, out)
    return out


# --- overheads estimated from the recording ------------------------------------------------------


def overheads(log_dir: Path) -> dict[str, float]:
    """Median delays the daemon added, read from its own log: placement to
    start, and a process's exit to the placement it made room for."""
    placed: dict[int, float] = {}
    to_start: list[float] = []
    launch: list[float] = []  # what the simulator's launcher model takes per launch
    last_start = float("-inf")
    by_seq: dict[int, ev.Event] = {}
    after_exit: list[float] = []
    for e in eventlog.read(log_dir):
        by_seq[e.seq] = e
        tp = type(e)
        if tp is ev.JobPlaced:
            placed[e.job] = e.ts
            cause = by_seq.get(_cause_seq(e))
            if type(cause) in (ev.JobExited, ev.JobCancelled, ev.JobRequeued) and cause is not None:
                after_exit.append(e.ts - cause.ts)
        elif tp is ev.JobStarted and e.job in placed:
            p = placed.pop(e.job)
            to_start.append(e.ts - p)
            launch.append(e.ts - max(p, last_start))
            last_start = e.ts
    return {
        "place_to_start_ms": 1000 * statistics.median(to_start) if to_start else 0.0,
        "launch_ms": 1000 * statistics.median(launch) if launch else 0.0,
        "exit_to_place_ms": 1000 * statistics.median(after_exit) if after_exit else 0.0,
        "placements_after_exit": float(len(after_exit)),
    }


def _cause_seq(e: ev.Event) -> int:
    cause = getattr(e, "cause", "") or ""
    return int(cause[4:]) if cause.startswith("seq:") and cause[4:].isdigit() else -1


# --- comparing ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    work: Workload
    policies: tuple[str, str]
    predicted: Metrics
    live: Metrics
    recorded: Metrics
    same_placements: int  # placements (job, GPUs) both runs made
    placements: tuple[int, int]  # predicted, live
    overheads: dict[str, float]
    wall_s: float

    def error(self, key: str) -> float:
        """Relative error of the prediction on ``key`` (0 when both are 0)."""
        p, live = float(getattr(self.predicted, key)), float(getattr(self.live, key))
        return abs(p - live) / abs(live) if live else (0.0 if p == 0 else float("inf"))

    def misses(self) -> list[str]:
        return [f"{label} off by {100 * self.error(k):.1f} %" for k, label, tol in CHECKED if self.error(k) > tol]


def _placement_set(log_dir: Path) -> set[tuple[int, str, tuple[int, ...]]]:
    return set(placements(log_dir))


def run_workload(work: Workload, root: Path, policies: tuple[str, str] = ("fifo", "best-fit"),
                 together: bool = False) -> Outcome:
    """Live under A, replay A under B, live under B; compare. ``together``: both
    live runs at once, for a workload whose jobs mostly sleep (the two daemons
    then see the same machine load)."""
    a, b = policies
    t0 = time.monotonic()
    if together:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            rec, live = pool.map(lambda p: run_live(work, p, root / f"live-{p}"), policies)
    else:
        rec = run_live(work, a, root / f"live-{a}")
        live = run_live(work, b, root / f"live-{b}")
    pred = predict(rec, b, root / f"predicted-{b}")
    p_set, l_set = _placement_set(pred / "log"), _placement_set(live / "log")
    return Outcome(
        work=work, policies=policies,
        predicted=metrics_from_log(pred / "log"), live=metrics_from_log(live / "log"),
        recorded=metrics_from_log(rec / "log"),
        same_placements=len(p_set & l_set), placements=(len(p_set), len(l_set)),
        overheads=overheads(rec / "log"), wall_s=time.monotonic() - t0,
    )


# --- output ---------------------------------------------------------------------------------------


def _fmt(key: str, value: float) -> str:
    if key in ("gpu_utilization", "fragmentation"):
        return f"{100 * value:.1f} %"
    if key == "fairness":
        return f"{value:.3f}"
    return f"{value:.3f} s"


def table(outcomes: list[Outcome]) -> str:
    """Markdown: one block of rows per workload, predicted vs live per metric."""
    lines = ["| workload | metric | predicted | live | error |", "|---|---|---:|---:|---:|"]
    for o in outcomes:
        a, b = o.policies
        name = f"{o.work.name} ({a} log replayed under {b})"
        for key, label in SHOWN:
            checked = "" if any(k == key for k, _, _ in CHECKED) else " (not checked)"
            err = o.error(key)
            lines.append(f"| {name} | {label}{checked} | {_fmt(key, getattr(o.predicted, key))} | "
                         f"{_fmt(key, getattr(o.live, key))} | {100 * err:.1f} % |")
            name = ""
        pp, lp = o.placements
        lines.append(f"| | placements (job, GPUs) | {pp} | {lp} | {o.same_placements} in common |")
        oh = o.overheads
        lines.append(f"| | overhead, estimated from recording {a} (medians) | placement→start "
                     f"{oh['place_to_start_ms']:.1f} ms, of which launching {oh['launch_ms']:.1f} ms: modelled | "
                     f"exit→next placement {oh['exit_to_place_ms']:.1f} ms: none to model | |")
    return "\n".join(lines)


def write_readme(text: str, path: Path = README) -> None:
    """Replace what is between the table markers of the README."""
    start, end = "<!-- table -->", "<!-- /table -->"
    doc = path.read_text()
    i, j = doc.index(start) + len(start), doc.index(end)
    path.write_text(doc[:i] + "\n" + text + "\n" + doc[j:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="default: all")
    ap.add_argument("--keep", type=Path, help="keep the logs here (default: a temporary dir, removed)")
    ap.add_argument("--no-readme", action="store_true", help="print the table only")
    ap.add_argument("--json", action="store_true", help="also print the outcomes as JSON")
    args = ap.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="eventsched-pvr-"))
    outcomes = []
    for name in args.workload or list(WORKLOADS):
        work = WORKLOADS[name]()
        o = run_workload(work, root / work.name)
        outcomes.append(o)
        verdict = "; ".join(o.misses()) or "all checked metrics within 5 %"
        print(f"{work.name}: {verdict} ({o.wall_s:.1f} s)", file=sys.stderr)
    text = table(outcomes)
    print(text)
    if args.json:
        print(msgspec.json.encode([_as_json(o) for o in outcomes]).decode())
    if not args.no_readme:
        write_readme(text)
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if not any(o.misses() for o in outcomes) else 1


def _as_json(o: Outcome) -> dict[str, Any]:
    return {"workload": o.work.name, "policies": list(o.policies), "predicted": o.predicted, "live": o.live,
            "overheads": o.overheads, "placements": list(o.placements), "same_placements": o.same_placements}


if __name__ == "__main__":
    sys.exit(main())
