"""Teams in replay and what-if: fair share measured on a few
thousand jobs, per-tenant figures, a quota change tried on a recorded
workload, the sjf-oracle reference and its honest note."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from eventsched import load_source, simulate
from eventsched.domain import events as ev
from eventsched.domain.tenants import Tenant
from eventsched.sim.whatif import compare, format_comparison
from eventsched.storage import log as eventlog

REPO = Path(__file__).resolve().parent.parent


def flood_csv(path: Path, users: list[str], jobs: int, seed: int = 3) -> Path:
    rng = random.Random(seed)
    rows = [f"{rng.uniform(0, 60):.1f},{rng.uniform(1800, 5400):.1f},1,{u}" for u in users for _ in range(jobs)]
    path.write_text("submit_time,duration,gpus,user\n" + "\n".join(rows) + "\n")
    return path


def shares_until(log_dir: Path, until: float) -> dict[str, float]:
    """Each tenant's part of the GPU-seconds run in [first submission, first + until]."""
    tenant: dict[int, str] = {}
    start: dict[int, float] = {}
    got: dict[str, float] = {}
    t0 = None
    for batch in eventlog.read_batches(log_dir):
        for e in batch:
            if isinstance(e, ev.JobSubmitted):
                tenant[e.job] = e.spec.tenant
                t0 = e.ts if t0 is None else min(t0, e.ts)
            elif isinstance(e, ev.JobPlaced):
                start[e.job] = e.ts
            elif isinstance(e, ev.JobExited) and e.job in start:
                assert t0 is not None
                span = max(0.0, min(e.ts, t0 + until) - start.pop(e.job))
                got[tenant[e.job]] = got.get(tenant[e.job], 0.0) + span
    total = sum(got.values())
    return {t: g / total for t, g in got.items()}


def test_weights_two_to_one_give_two_to_one_over_a_few_thousand_jobs(tmp_path: Path) -> None:
    work = load_source(flood_csv(tmp_path / "flood.csv", ["ann", "ben"], 2000), gpus="fake:16:81920")
    tenants = {"a": Tenant(users=["ann"], weight=2.0), "b": Tenant(users=["ben"], weight=1.0)}
    result = simulate(work, "fair-share", tmp_path / "fs", tenants=tenants, settings={"usage_half_life_s": 6 * 3600.0})
    share = shares_until(Path(result.state_dir) / "log", 48 * 3600.0)  # both still have work queued then
    assert share["a"] / share["b"] == pytest.approx(2.0, rel=0.10), share
    equal = {"a": Tenant(users=["ann"]), "b": Tenant(users=["ben"])}
    result = simulate(work, "fair-share", tmp_path / "eq", tenants=equal, settings={"usage_half_life_s": 6 * 3600.0})
    share = shares_until(Path(result.state_dir) / "log", 48 * 3600.0)
    assert share["a"] == pytest.approx(0.5, abs=0.05), share
    table = compare([simulate(work, "fair-share", tmp_path / "t", tenants=tenants)])
    assert set(table["replays"][0]["tenants"]) == {"a", "b"}


def test_a_quota_tried_on_a_workload_shows_in_the_comparison(tmp_path: Path) -> None:
    csv = flood_csv(tmp_path / "w.csv", ["ann", "ben", "cat"], 100)
    conf = tmp_path / "quota.toml"
    conf.write_text('[scheduler]\nusage_half_life_s = 3600.0\n[tenants.a]\nusers = ["ann"]\ngpus = 2\n'
                    '[tenants.b]\nusers = ["ben", "cat"]\n')
    out = subprocess.run([sys.executable, "-m", "eventsched.cli", "replay", str(csv), "--gpus", "fake:8",
                          "--policy", "fifo", "--policy", "fair-share", "--config", str(conf), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    table = json.loads(out.stdout)
    for row in table["replays"]:
        assert set(row["tenants"]) == {"a", "b"}
        assert row["tenants"]["a"]["jobs"] == 100 and row["tenants"]["b"]["jobs"] == 200
    # with a ceiling of 2 GPUs, tenant a never holds more than a quarter of 8 GPUs
    for row in table["replays"]:
        assert row["tenants"]["a"]["gpu_hours_share"] <= 0.25 + 1e-9
    text = format_comparison(table)
    assert "per tenant: mean wait / share of the GPU-hours run in the arrival window" in text
    bad = tmp_path / "bad.toml"
    bad.write_text('[tenants.a]\nusers = ["x"]\ngpus = -2\n')
    out = subprocess.run([sys.executable, "-m", "eventsched.cli", "replay", str(csv), "--policy", "fifo",
                          "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "[tenants.a].gpus" in out.stderr and "Traceback" not in out.stderr


def test_sjf_oracle_knows_the_future_and_sjf_backfill_says_when_it_cannot_predict(tmp_path: Path) -> None:
    rows = ["0,3000,1", "0,10,1", "0,20,1", "0,2000,1", "0,30,1", "0,40,1"]
    csv = tmp_path / "w.csv"
    csv.write_text("submit_time,duration,gpus\n" + "\n".join(rows) + "\n")
    work = load_source(csv, gpus="fake:1")
    oracle = simulate(work, "sjf-oracle", tmp_path / "o")
    blind = simulate(work, "sjf-backfill", tmp_path / "b")
    table = compare([blind, oracle])
    by = {r["policy"]: r for r in table["replays"]}
    assert by["sjf-oracle"]["mean_wait_s"] < by["sjf-backfill"]["mean_wait_s"]
    assert any("sjf-backfill had no history to predict from" in n for n in table["notes"])
    # the oracle ran the jobs shortest first (after the first, placed at once)
    placed = [e.job for b in eventlog.read_batches(Path(oracle.state_dir) / "log") for e in b
              if isinstance(e, ev.JobPlaced)]
    assert placed == [1, 2, 3, 5, 6, 4]


def test_the_daemon_refuses_the_replay_only_policy(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "eventsched.cli", "serve", "--gpus", "fake:1", "--policy", "sjf-oracle",
                          "--state-dir", str(tmp_path / "s")], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "sjf-oracle is a reference for replays only" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_the_worked_multi_tenant_replay_is_reproducible(tmp_path: Path) -> None:
    here = REPO / "replays" / "multi-tenant"
    out = subprocess.run([sys.executable, "-m", "eventsched.cli", "replay", str(here / "workload.csv"),
                          "--gpus", "fake:8:81920", "--config", str(here / "tenants.toml"),
                          "--policy", "fifo", "--policy", "best-fit", "--policy", "fair-share", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    want = json.loads((here / "comparison.json").read_text())
    for g, w in zip(got["replays"], want["replays"]):
        assert g["policy"] == w["policy"]
        assert g["tenants"] == w["tenants"] and g["mean_wait_s"] == w["mean_wait_s"]
    fair = {r["policy"]: r for r in got["replays"]}
    assert fair["fair-share"]["tenants"]["nlp"]["mean_wait_s"] < fair["fifo"]["tenants"]["nlp"]["mean_wait_s"] / 5
