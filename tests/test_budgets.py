"""GPU-hour budgets end to end: a real daemon on fake GPUs with a tenant whose
month's budget is tiny, real jobs, the real CLI. A spent budget holds the
tenant's jobs (`explain` says so) or places them after everyone else's; the
operator changes it at run time; replaying the log reproduces every placement.
The month's turn, through the core and in a what-if replay. Also: an ended
job's report card after `logs`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
from daemon_harness import Daemon
from test_core import Sched
from test_teams import set_tenant

from eventsched import load_source, simulate
from eventsched.core.budgets import used_gpu_hours
from eventsched.core.explain import waiting_reason
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.domain.tenants import Tenant
from eventsched.domain.units import utc_month
from eventsched.projections.cluster import ClusterState, apply, snapshot_bytes, state_from_snapshot
from eventsched.sim.compare import compare_placements, placements
from eventsched.storage import log as eventlog

# 1.8 GPU-seconds a month: one job of a few seconds spends it
CONFIG = ('[tenants.ml]\nusers = ["root"]\ndefault_for = ["root"]\ngpu_hours_per_month = 0.0005\n'
          '[tenants.other]\nusers = ["root"]\n')


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    base = tmp_path_factory.mktemp("budgets")
    (base / "eventsched.toml").write_text(CONFIG)
    with Daemon(base / "state", gpus="fake:1", extra=["--config", str(base / "eventsched.toml")]) as d:
        spend = d.submit("--", "sleep", "2.5")  # tenant ml, 2.5 GPU-seconds
        d.wait_states([spend], {"succeeded"}, timeout=30)
        yield d


def explained(d: Daemon, job: int) -> dict:
    return json.loads(d.cli("explain", str(job), "--json").stdout)["reason"]


def tenants(d: Daemon) -> dict[str, dict]:
    return {t["tenant"]: t for t in json.loads(d.cli("tenants", "--json").stdout)}


def test_a_tenant_over_its_budget_is_held_and_explain_names_the_budget(daemon: Daemon) -> None:
    held = daemon.submit("--", "true")
    other = daemon.submit("--tenant", "other", "--", "true")
    daemon.wait_states([other], {"succeeded"})  # everyone else's jobs still run
    time.sleep(0.5)
    assert daemon.jobs()[held]["state"] == "queued"
    reason = explained(daemon, held)
    until = time.strftime("%Y-%m-%d", time.gmtime(utc_month(time.time())[1]))
    assert reason["kind"] == "budget"
    used, rest = reason["text"].removeprefix("budget: tenant ml has used ").split(" ", 1)
    assert 0.0005 < float(used) < 0.002  # one job of 2.5 s
    assert rest == f"of its 0.0005 GPU-hours this month; held until {until} (UTC)"
    assert "budget: tenant ml" in daemon.cli("explain", str(held)).stdout
    budget = tenants(daemon)["ml"]["budget"]
    assert budget["gpu_hours_per_month"] == 0.0005 and budget["spent"] and budget["used_gpu_hours"] > 0.0005
    assert " of 0.0005 (spent)" in daemon.cli("tenants").stdout
    # the operator raises the budget at run time: the held job starts
    r = daemon.cli("tenant", "set", "ml", "--gpu-hours-per-month", "1")
    assert r.returncode == 0, r.stderr
    daemon.wait_states([held], {"succeeded"})
    assert tenants(daemon)["ml"]["budget"]["gpu_hours_per_month"] == 1.0
    assert daemon.cli("tenant", "set", "ml", "--gpu-hours-per-month", "0.0005").returncode == 0


def test_lower_priority_places_the_spent_tenants_jobs_after_everyone_elses(daemon: Daemon, tmp_path: Path) -> None:
    go = tmp_path / "go"
    blocker = daemon.submit("--tenant", "other", "--", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done")
    daemon.wait_states([blocker], {"running"})
    r = daemon.cli("tenant", "set", "ml", "--budget-action", "lower-priority")
    assert r.returncode == 0, r.stderr
    assert tenants(daemon)["ml"]["budget"]["gpu_hours_per_month"] == 0.0005  # the other keys stay
    first = daemon.submit("--priority", "5", "--", "true")  # earlier and higher, but its tenant's budget is spent
    second = daemon.submit("--tenant", "other", "--", "true")
    assert "placed only after every other tenant's jobs until" in explained(daemon, first)["text"]
    go.touch()
    jobs = daemon.wait_states([blocker, first, second], {"succeeded"})
    assert jobs[second]["started_at"] < jobs[first]["started_at"]


def test_logs_of_an_ended_job_shows_its_report_card_on_stderr_only_when_asked(daemon: Daemon) -> None:
    job = daemon.submit("--tenant", "other", "--", "echo", "hello")
    daemon.wait_states([job], {"succeeded"})
    plain = daemon.cli("logs", str(job))  # piped: the output alone
    assert plain.stdout == "hello\n" and "report card" not in plain.stderr
    carded = daemon.cli("logs", str(job), "--card")
    assert carded.stdout == "hello\n"
    assert "report card:" in carded.stderr and "  advice: " in carded.stderr


def test_the_month_use_is_the_fold_of_the_log_and_a_replay_reproduces_the_budgets_effect(
        daemon: Daemon, tmp_path: Path) -> None:
    daemon.stop()
    state_dir = daemon.state_dir
    state = ClusterState()
    runs: dict[int, float] = {}
    seconds = 0.0
    for batch in eventlog.read_batches(state_dir / "log"):
        for e in batch:
            apply(state, e)
            if type(e).__name__ == "JobPlaced" and state.jobs[e.job].tenant == "ml":
                runs[e.job] = e.ts
            elif type(e).__name__ == "JobExited" and e.job in runs:
                seconds += e.ts - runs.pop(e.job)
    at = state.usage["ml"].as_of
    assert used_gpu_hours(state, "ml", at) == pytest.approx(seconds / 3600.0)
    restored = state_from_snapshot(snapshot_bytes(state))  # a restart from a snapshot keeps the month's use
    assert used_gpu_hours(restored, "ml", at) == used_gpu_hours(state, "ml", at)
    assert used_gpu_hours(state, "ml", utc_month(at)[1]) == 0.0  # and a new month starts from nothing
    order = [job for job, _, _ in placements(state_dir / "log")]
    assert order.index(3) < order.index(2)  # tenant other's job 3 ran while ml's job 2 was held
    result = simulate(load_source(state_dir), "recorded", tmp_path / "replay")
    assert compare_placements(state_dir / "log", Path(result.state_dir) / "log") is None


def test_through_the_core_a_new_month_starts_every_budget_again() -> None:
    jan31 = datetime(2026, 1, 31, 22, tzinfo=timezone.utc).timestamp()
    feb1 = datetime(2026, 2, 1, tzinfo=timezone.utc).timestamp()
    s = Sched(gpus=2)
    s.now = jan31
    set_tenant(s, "ml", users=["u1000"], gpu_hours_per_month=1.0)
    two = s.submit(gpus=2)
    s.exit(two, at=jan31 + 1800)  # 2 GPUs for half an hour: its 1 GPU-hour is used
    held = s.submit()
    other = s.submit(uid=2000)  # the default tenant has no budget
    assert (s.st(held), s.st(other)) == ("queued", "running")
    reason = waiting_reason(s.state, held, s.now)
    assert reason is not None and reason.kind == "budget"
    assert reason.text == "budget: tenant ml has used 1 of its 1 GPU-hours this month; held until 2026-02-01 (UTC)"
    _, effects = s.do(m.Tick())
    assert m.WakeAt(at=feb1) in effects  # a decision is due when the month turns
    s.do(m.Tick(), at=feb1)
    assert s.st(held) == "running"
    # a job running across the turn counts only its new month's part
    assert used_gpu_hours(s.state, "default", feb1 + 1800) == pytest.approx(0.5)
    assert used_gpu_hours(s.state, "ml", feb1 + 1800) == pytest.approx(0.5)


def test_a_what_if_replay_holds_a_spent_tenant_until_the_month_turns(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"  # times from the epoch: January 1970
    trace.write_text("submit_time,duration,gpus,user\n0,7200,1,ann\n3700,60,1,ann\n3710,60,1,ben\n")
    tenants = {"ml": Tenant(users=["ann"], gpu_hours_per_month=1.0)}
    result = simulate(load_source(trace, gpus="fake:2"), "best-fit", tmp_path / "whatif", tenants=tenants)
    started = {e.job: e.ts for b in eventlog.read_batches(Path(result.state_dir) / "log") for e in b
               if isinstance(e, ev.JobPlaced)}
    assert started[3] == pytest.approx(3710.0)  # ben's tenant has no budget
    assert started[2] == utc_month(0.0)[1]  # ann's second job: when February starts
