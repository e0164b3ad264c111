"""The replay simulator and the what-if comparison.

Recorded logs come from ``record``: a driver that runs ``core.handle`` the way
the engine does (batches of messages sharing one ``now``, one frame per batch,
processes that start and exit after random delays, timers that fire a little
late, samples, operators' commands, a restart) with a seeded random clock.
"""

from __future__ import annotations

import heapq
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from eventsched import core
from eventsched.core.policies import POLICIES, REPLAY_ONLY
from eventsched.domain import events as ev
from eventsched.domain.messages import (
    Cancel,
    GpuInfo,
    GpuObserved,
    Hold,
    Launch,
    PauseGpu,
    ProcessExited,
    ProcessStarted,
    Refused,
    Release,
    ResumeGpu,
    SchedulerConfig,
    SetPolicy,
    Signal,
    Started,
    Stopping,
    Submit,
    Tick,
    WakeAt,
)
from eventsched.projections.cluster import ClusterState, validate_state
from eventsched.sim.compare import compare_placements, placements
from eventsched.sim.simulator import RECORDED, simulate
from eventsched.sim.sources import ReplayError, load_source
from eventsched.sim.whatif import compare, format_comparison, metrics_from_log
from eventsched.storage import log as eventlog

T0 = 1_700_000_000.0


# --- a "real-like" recorder --------------------------------------------------------


def _spec(rng: random.Random, i: int, n_gpus: int) -> ev.JobSpec:
    user = rng.randrange(3)
    dur = round(rng.choice([rng.uniform(0.5, 4), rng.uniform(4, 20)]), 3)
    code = 0 if rng.random() < 0.85 else 1
    gpus = rng.choice([0.25, 0.5, 0.3, 1.0, 1.0, 2.0, 0.1, float(min(4, n_gpus))])
    return ev.JobSpec(
        command=["sim", str(dur), str(code)],
        name=f"task{rng.randrange(5)}",
        user=f"u{user}",
        uid=1000 + user,
        gpus=gpus,
        gpu_mem_mib=rng.choice([0, 0, 0, 2000, 6000]),
        priority=rng.choice([0, 0, 1, 5]),
        time_limit_s=rng.choice([None, None, None, 3.0]),
        on_time_limit=rng.choice(["kill", "requeue"]),
        retries=rng.choice([0, 0, 1, 2]),
        after=[i - 1] if i > 1 and rng.random() < 0.1 else [],
    )


def record(state_dir: Path, policy: str, seed: int, *, n_jobs: int = 60, n_gpus: int = 4,
           restart: bool = True, switch: str | None = None) -> Path:
    """Run a workload through core.handle like the engine; return the log dir."""
    rng = random.Random(seed)
    state = ClusterState()
    log_dir = state_dir / "log"
    writer = eventlog.LogWriter.open(log_dir)
    inbox: list[tuple[float, int, object, int]] = []
    counter = 0

    def push(at: float, msg: object, token: int = 0) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(inbox, (at, counter, msg, token))

    infos = [GpuInfo(gpu=i, uuid=f"GPU-{i}", model="fake", memory_total_mib=16_000) for i in range(n_gpus)]
    config = SchedulerConfig(policy=policy, retry_backoff_s=0.5, kill_grace_s=1.0)
    push(T0, Started(node="local", pid=1, version="t", gpu_backend=f"fake:{n_gpus}", gpus=infos, config=config))
    t = T0
    for i in range(1, n_jobs + 1):
        t += rng.expovariate(1 / 0.6)
        spec = _spec(rng, i, n_gpus)
        push(round(t, 6), Submit(spec=spec, by=f"uid:{spec.uid}"))
    end = t
    for k in range(int((end - T0) / 2) + 10):  # samples every 2 s
        for g in range(n_gpus):
            push(T0 + 2 * k + 0.01 * g, GpuObserved(
                node="local", gpu=g, utilization=rng.uniform(0, 100), memory_used_mib=rng.randrange(0, 8000),
                memory_total_mib=16_000, temperature_c=50.0, power_w=100.0,
                foreign_memory_mib=rng.choice([-1, 0, 500])))
    for _ in range(n_jobs // 6):  # operators
        at = T0 + rng.uniform(0, end - T0)
        job = rng.randrange(1, n_jobs + 1)
        uid = 1000 + rng.randrange(3) if rng.random() < 0.7 else 0
        cmd = rng.choice(["cancel", "cancel2", "hold", "release", "pause"])
        if cmd == "cancel":
            push(at, Cancel(jobs=[job], uid=uid, by=f"uid:{uid}"))
        elif cmd == "cancel2":
            push(at, Cancel(jobs=[job, min(n_jobs, job + 1)], uid=0, by="uid:0"))
        elif cmd == "hold":
            push(at, Hold(jobs=[job], uid=0, by="uid:0"))
            push(at + rng.uniform(0.5, 5), Release(jobs=[job], uid=0, by="uid:0"))
        elif cmd == "release":
            push(at, Release(jobs=[job], uid=0, by="uid:0"))
        else:
            g = rng.randrange(n_gpus)
            push(at, PauseGpu(node="local", gpu=g, by="uid:0"))
            push(at + rng.uniform(1, 6), ResumeGpu(node="local", gpu=g, by="uid:0"))
    if switch:
        push(T0 + (end - T0) / 2, SetPolicy(policy=switch, by="uid:0"))
    down: tuple[float, float] | None = None
    if restart:
        stop_at = T0 + (end - T0) * 0.6
        push(stop_at, Stopping(node="local", reason="signal"))
        down = (stop_at, stop_at + 1.5)
        push(down[1], Started(node="local", pid=2, version="t", gpu_backend=f"fake:{n_gpus}", gpus=infos,
                              config=config))

    live: dict[int, int] = {}
    work_left: dict[int, float] = {}
    started_at: dict[int, float] = {}
    ticks: set[float] = set()
    clock = T0
    while inbox:
        at = inbox[0][0]
        clock = max(clock, at) + rng.uniform(0.0, 0.003)  # the loop wakes a little late
        if down and down[0] < clock < down[1]:
            clock = down[1]  # the daemon is down: what comes now waits for the restart
        now = clock
        batch = []
        while inbox and inbox[0][0] <= now and len(batch) < 64:
            batch.append(heapq.heappop(inbox))
        produced: list[ev.Event] = []
        effects: list[object] = []
        for _, _, msg, token in batch:
            if isinstance(msg, (ProcessStarted, ProcessExited)):
                if live.get(msg.job) != token:
                    continue  # a stale report of an earlier attempt
                if isinstance(msg, ProcessExited):
                    del live[msg.job]
                    work_left[msg.job] = work_left[msg.job] - (now - started_at.get(msg.job, now))
            if isinstance(msg, Tick):
                ticks.discard(token)
            try:
                events, effs = core.handle(state, msg, now)
            except Refused:
                continue
            if isinstance(msg, ProcessStarted) and events:
                started_at[msg.job] = now
            produced.extend(events)
            effects.extend(effs)
        validate_state(state)
        if produced:
            state.last_seq = writer.append(produced)
        for eff in effects:
            if isinstance(eff, Launch):
                counter += 1
                live[eff.job] = token = counter
                left = work_left.setdefault(eff.job, float(eff.spec.command[1]))
                code = int(eff.spec.command[2])
                s = now + rng.uniform(0.005, 0.05)
                push(s, ProcessStarted(job=eff.job, pid=10_000 + eff.job), token)
                push(s + max(0.01, left), ProcessExited(job=eff.job, exit_code=code), token)
            elif isinstance(eff, Signal):
                if eff.job in live:
                    push(now + rng.uniform(0.01, 0.3), ProcessExited(job=eff.job, exit_code=None, signal=15),
                         live[eff.job])
            elif isinstance(eff, WakeAt):
                key = eff.at
                if key not in ticks:
                    ticks.add(key)
                    push(max(eff.at, now) + rng.uniform(0.001, 0.02), Tick(), key)  # type: ignore[arg-type]
    writer.close()
    return log_dir


# --- fidelity ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(p for p in POLICIES if p not in REPLAY_ONLY))  # (those need the future)
@pytest.mark.parametrize("seed", [1, 2])
def test_replay_under_the_recorded_policy_reproduces_every_placement(tmp_path: Path, policy: str, seed: int) -> None:
    log_dir = record(tmp_path / "rec", policy, seed)
    recorded = placements(log_dir)
    assert len(recorded) > 30
    work = load_source(tmp_path / "rec")
    for name in (RECORDED, policy):
        out = tmp_path / f"replay-{name}"
        result = simulate(work, name, out, validate=True)
        assert compare_placements(log_dir, out / "log") is None, name
        assert result.placements == len(recorded)


def test_recorded_policy_switches_are_followed(tmp_path: Path) -> None:
    log_dir = record(tmp_path / "rec", "fifo", 7, switch="best-fit")
    assert any(type(e) is ev.PolicyChanged for e in eventlog.read(log_dir))
    out = tmp_path / "replay"
    simulate(load_source(log_dir), RECORDED, out)
    assert compare_placements(log_dir, out / "log") is None


def test_replaying_a_replay_gives_the_same_replay(tmp_path: Path) -> None:
    log_dir = record(tmp_path / "rec", "priority", 3)
    simulate(load_source(log_dir), "best-fit", tmp_path / "a")
    simulate(load_source(tmp_path / "a"), "best-fit", tmp_path / "b")
    assert compare_placements(tmp_path / "a" / "log", tmp_path / "b" / "log") is None


def test_another_policy_gives_a_different_valid_history(tmp_path: Path) -> None:
    log_dir = record(tmp_path / "rec", "fifo", 4, n_jobs=80)
    work = load_source(log_dir)
    result = simulate(work, "best-fit", tmp_path / "bf", validate=True)
    assert compare_placements(log_dir, tmp_path / "bf" / "log") is not None
    rec = metrics_from_log(log_dir)
    bf = metrics_from_log(tmp_path / "bf" / "log")
    assert bf.jobs == rec.jobs == result.jobs
    assert bf.mean_wait_s < rec.mean_wait_s  # packing beats head-of-line blocking here


# --- sources -------------------------------------------------------------------------


def write_csv(path: Path, rows: list[str], header: str = "submit_time,duration,gpus,gpu_mem,user,priority") -> Path:
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return path


def test_csv_source_runs_each_job_for_its_duration(tmp_path: Path) -> None:
    src = write_csv(tmp_path / "w.csv", ["0,10,1,,a,0", "0,5,1,,b,0", "1,4,2,,a,0"])
    out = tmp_path / "r"
    result = simulate(load_source(src, gpus="fake:2:1000"), "fifo", out)
    assert result.jobs == 3 and result.unfinished == 0
    runs = {}
    for e in eventlog.read(out / "log"):
        if type(e) is ev.JobStarted:
            runs[e.job] = [e.ts]
        elif type(e) is ev.JobExited:
            runs[e.job].append(e.ts)
    assert runs == {1: [0.0, 10.0], 2: [0.0, 5.0], 3: [10.0, 14.0]}


def test_bad_sources_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ReplayError, match="no such file"):
        load_source(tmp_path / "nope.csv")
    with pytest.raises(ReplayError, match="no event log"):
        load_source(tmp_path)
    bad = write_csv(tmp_path / "bad.csv", ["0,-3,1,,a,0"])
    with pytest.raises(ReplayError, match="bad.csv:2: duration"):
        load_source(bad)
    with pytest.raises(ReplayError, match="not a trace"):
        load_source(write_csv(tmp_path / "x.csv", ["1,2"], header="a,b"))
    with pytest.raises(ReplayError, match="fake:N"):
        load_source(write_csv(tmp_path / "ok.csv", ["0,1,1,,a,0"]), gpus="real:2")
    with pytest.raises(ReplayError, match="unknown policy"):
        simulate(load_source(tmp_path / "ok.csv"), "magic", tmp_path / "o")


# --- what-if metrics -------------------------------------------------------------------


def test_metrics_match_hand_computed_values(tmp_path: Path) -> None:
    # 2 GPUs. fifo: A(1 GPU, 10 s) and B(2 GPUs, 4 s) at 0; C(0.5, 2 s) at 1.
    # A runs 0-10; B waits for both GPUs: 10-14; C waits behind B (fifo): 14-16.
    src = write_csv(tmp_path / "w.csv", ["0,10,1,,x,0", "0,4,2,,y,0", "1,2,0.5,,y,0"])
    simulate(load_source(src, gpus="fake:2:1000"), "fifo", tmp_path / "f")
    m = metrics_from_log(tmp_path / "f" / "log")
    assert m.jobs == 3 and m.finished == 3
    assert m.makespan_s == pytest.approx(16.0)
    assert m.mean_wait_s == pytest.approx((0 + 10 + 13) / 3)
    assert m.median_wait_s == pytest.approx(10.0)
    assert m.p95_wait_s == pytest.approx(10 + 0.9 * 3)  # linear interpolation
    assert m.mean_turnaround_s == pytest.approx((10 + 14 + 15) / 3)
    # allocated GPU-seconds: 10 + 8 + 1 = 19 of 2 x 16
    assert m.gpu_utilization == pytest.approx(19 / 32)
    # idle capacity: 0-1 one GPU free and B (2 GPUs) waits: stranded; 1-10 one
    # GPU free, C (0.5) could use it (fifo holds it back): not fragmentation;
    # 10-14 nothing free; 14-16 1.5 GPUs free, nobody waits. Stranded 1 of 1+9+3.
    assert m.fragmentation == pytest.approx(1 / 13)
    # fairness over the arrival window [0, 8] (last submit 1 < makespan/2):
    # x got 8 of 10 demanded, y got 0 of 8 + 1: x_ratio 0.8, y_ratio 0 -> Jain (0.8)^2 / (2*0.64) = 0.5
    assert m.fairness == pytest.approx(0.5)


def test_best_fit_packs_better_than_fifo(tmp_path: Path) -> None:
    # Half-GPU jobs then whole-GPU jobs on 2 GPUs: first fit spreads nothing here,
    # but fifo's head-of-line blocking makes the 0.5 jobs wait behind a 2-GPU job.
    rows = ["0,100,0.5,,a,0", "0,10,2,,b,0", "0,100,0.5,,a,0", "0,100,0.5,,c,0", "1,50,1,,c,0"]
    src = write_csv(tmp_path / "w.csv", rows)
    work = load_source(src, gpus="fake:2:1000")
    # (without a reservation for the 2-GPU job, which holds its GPUs against
    # the half-GPU jobs: none of them has a runtime to predict)
    no_reserve = {"reserve_for_gang": False}
    results = [simulate(work, p, tmp_path / p, settings=no_reserve) for p in ("fifo", "best-fit")]
    table = compare(results)
    by = {r["policy"]: r for r in table["replays"]}
    assert by["best-fit"]["mean_wait_s"] < by["fifo"]["mean_wait_s"]
    text = format_comparison(table)
    assert "fifo" in text and "best-fit" in text and "makespan" in text


def test_history_read_model_agrees_with_the_fold(tmp_path: Path) -> None:
    from eventsched.projections.history import open_history

    log_dir = record(tmp_path / "rec", "best-fit", 5)
    out = tmp_path / "r"
    simulate(load_source(log_dir), "sjf-backfill", out)
    m = metrics_from_log(out / "log")
    h = open_history(out)
    _, rows = h.query("SELECT count(*), avg(wait_s), avg(turnaround_s) FROM jobs")
    n, wait, turnaround = rows[0]
    assert n == m.jobs
    assert wait == pytest.approx(m.mean_wait_s)
    assert turnaround == pytest.approx(m.mean_turnaround_s)


# --- the command -------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "eventsched.cli", "replay", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_compares_policies_as_json_and_table(tmp_path: Path) -> None:
    src = write_csv(tmp_path / "w.csv", [f"{i},{5 + i % 7},{[0.5, 1, 2][i % 3]},,u{i % 3},0" for i in range(30)])
    p = run_cli(str(src), "--gpus", "fake:4", "--policy", "fifo", "--policy", "best-fit", "--json",
                "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert [r["policy"] for r in data["replays"]] == ["fifo", "best-fit"]
    assert all(r["jobs"] == 30 for r in data["replays"])
    assert (tmp_path / "out" / "fifo" / "log").is_dir()
    p = run_cli(str(src), "--gpus", "fake:4", "--policy", "fifo", "--policy", "sjf-backfill")
    assert p.returncode == 0, p.stderr
    assert "sjf-backfill" in p.stdout and "p95 wait" in p.stdout


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    p = run_cli(str(tmp_path / "missing"), "--policy", "fifo")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    src = write_csv(tmp_path / "w.csv", ["0,1,1,,a,0"])
    p = run_cli(str(src), "--policy", "nope")
    assert p.returncode == 2 and "unknown policy" in p.stderr and p.stderr.count("\n") == 1


# --- a real daemon's log ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["best-fit", "fifo"])
def test_replay_of_a_real_daemon_run_reproduces_its_placements(tmp_path: Path, policy: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from daemon_harness import Daemon

    state = tmp_path / "state"
    d = Daemon(state, gpus="fake:4:16384", extra=["--policy", policy]).start()
    try:
        rng = random.Random(11)
        ids = []
        for i in range(24):
            gpus = rng.choice(["0.25", "0.5", "1", "2", "0.5", "1"])
            secs = f"{rng.uniform(0.1, 1.2):.2f}"
            extra = []
            if i % 7 == 3:
                extra += ["--retries", "1"]
                cmd = ["sh", "-c", f"sleep {secs}; exit 1"]
            elif i % 9 == 4:
                extra += ["--time-limit", "0.5"]
                cmd = ["sleep", "3"]
            else:
                cmd = ["sleep", secs]
            ids.append(d.submit("--gpus", gpus, "--priority", str(rng.choice([0, 0, 1])), *extra, "--", *cmd))
            if i == 8:
                d.cli("pause-gpu", "1")
            if i == 14:
                d.cli("resume-gpu", "1")
                d.cli("cancel", str(ids[-2]))
        d.wait_states(ids, {"succeeded", "failed", "cancelled"}, timeout=90)
    finally:
        d.stop()
    log_dir = state / "log"
    assert len(placements(log_dir)) >= 20
    for name in (RECORDED, policy):
        out = tmp_path / f"replay-{name}"
        simulate(load_source(state), name, out)
        assert compare_placements(log_dir, out / "log") is None, name


TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


@pytest.mark.skipif(not (TRACES / "openb_pod_list_default.csv").is_file(), reason="Alibaba trace not here")
def test_alibaba_source_keeps_shares_and_fits_its_node_sample() -> None:
    work = load_source(TRACES / "openb_pod_list_default.csv")
    assert work.kind == "alibaba"
    starts = [s for s in work.stimuli if s[3][0] == "start"]
    submits = [s[3][2].spec for s in work.stimuli if s[3][0] == "submit"]
    biggest = max(len(s[3][2]) for s in starts)
    assert 50 < len(starts) < 120  # a 1/16 sample of 1,213 nodes
    assert all(0 < spec.gpus <= biggest for spec in submits)
    assert any(0 < spec.gpus < 1 for spec in submits)  # fractional gpu_milli kept
    assert len(submits) > 7000
    times = [s[0] for s in work.stimuli if s[3][0] == "submit"]
    assert times == sorted(times)


def test_a_restart_that_requeued_a_never_launched_job_replays_exactly(tmp_path: Path) -> None:
    """The daemon stopped between placing a job and launching it; on restart
    the job was queued again and placed anew. The replay does the same."""
    from eventsched.domain.messages import NeverLaunched

    state = ClusterState()
    log_dir = tmp_path / "rec" / "log"
    writer = eventlog.LogWriter.open(log_dir)
    infos = [GpuInfo(gpu=i, uuid=f"GPU-{i}", model="fake", memory_total_mib=16_000) for i in range(2)]
    config = SchedulerConfig(policy="best-fit")

    def step(msg: object, now: float) -> list[object]:
        events, effects = core.handle(state, msg, now)
        if events:
            state.last_seq = writer.append(events)
        return effects

    started = Started(node="local", pid=1, version="t", gpu_backend="fake:2", gpus=infos, config=config)
    step(started, T0)
    spec = ev.JobSpec(command=["train", "5", "0"], uid=1000, user="ann", gpus=1.0)
    for i in range(3):
        step(Submit(spec=spec, by="uid:1000"), T0 + 1 + i)
    # jobs 1 and 2 placed; the daemon stops before launching job 2
    step(ProcessStarted(job=1, pid=11), T0 + 3.1)
    step(Stopping(node="local", reason="signal"), T0 + 3.2)
    step(started, T0 + 5)
    effects = step(NeverLaunched(job=2, reason="the daemon stopped before launching it"), T0 + 5)
    assert any(isinstance(e, Launch) and e.job == 2 for e in effects)
    step(ProcessStarted(job=2, pid=12), T0 + 5.1)
    step(ProcessExited(job=1, exit_code=0), T0 + 8)
    step(ProcessStarted(job=3, pid=13), T0 + 8.1)
    step(ProcessExited(job=2, exit_code=0), T0 + 10.1)
    step(ProcessExited(job=3, exit_code=0), T0 + 13.1)
    writer.close()

    replay = simulate(load_source(tmp_path / "rec"), "recorded", tmp_path / "replay")
    assert compare_placements(log_dir, tmp_path / "replay" / "log") is None, replay


def test_the_worked_synthetic_replay_is_reproducible() -> None:
    """replays/synthetic's committed comparison is what every policy does
    today: a change to any policy's decisions shows here, and the example
    is rerun (``sh replays/synthetic/run.sh``) with it."""
    here = Path(__file__).resolve().parent.parent / "replays" / "synthetic"
    policies = ["fifo", "priority", "best-fit", "sjf-backfill", "fgd"]
    argv = [sys.executable, "-m", "eventsched.cli", "replay", str(here / "workload.csv"), "--gpus", "fake:8:81920",
            "--json", *(a for p in policies for a in ("--policy", p))]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = {r["policy"]: r for r in json.loads(out.stdout)["replays"]}
    want = {r["policy"]: r for r in json.loads((here / "comparison.json").read_text())["replays"]}
    assert list(got) == policies == list(want)
    for p in policies:
        for figure in ("events", "finished", "mean_wait_s", "p95_wait_s", "makespan_s", "fragmentation"):
            assert got[p][figure] == want[p][figure], (p, figure)
