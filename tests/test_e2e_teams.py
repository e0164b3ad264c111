"""Teams end to end: a real daemon on fake GPUs with tenants in
its config, real jobs, the real CLI; the scheduler's rules themselves are
tested through the core in tests/test_teams.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from daemon_harness import Daemon
from users_harness import as_user, public_dir, root_daemon, users  # noqa: F401

from eventsched import load_source, simulate
from eventsched.domain import events as ev
from eventsched.storage import log as eventlog

pytestmark = pytest.mark.slow


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "eventsched.toml"
    path.write_text(text)
    return str(path)


def test_a_one_gpu_quota_runs_one_job_at_a_time_and_says_so(tmp_path: Path) -> None:
    conf = config(tmp_path, '[tenants.vision]\nusers = ["root"]\ngpus = 1\n')
    go = tmp_path / "go"
    hold = script(tmp_path, "hold.sh", f"while [ ! -e {go} ]; do sleep 0.05; done")
    with Daemon(tmp_path / "state", gpus="fake:4:16384", extra=["--config", conf]) as d:
        ids = [d.submit("--", hold) for _ in range(3)]
        jobs = d.wait_states(ids[:1], {"running"})
        time.sleep(0.5)
        jobs = d.jobs()
        assert [jobs[i]["state"] for i in ids] == ["running", "queued", "queued"]
        assert jobs[ids[0]]["tenant"] == "vision"
        explained = json.loads(d.cli("explain", str(ids[1]), "--json").stdout)
        assert explained["reason"]["kind"] == "quota"
        assert "tenant vision has 1 of its 1 GPUs in use (quota gpus = 1)" in explained["reason"]["text"]
        assert "quota:" in d.cli("queue").stdout
        tenants = {t["tenant"]: t for t in json.loads(d.cli("tenants", "--json").stdout)}
        assert tenants["vision"]["quota"]["gpus"] == 1 and tenants["vision"]["usage"] == {
            "gpus": 1.0, "gpu_mem_mib": 0, "jobs": 1, "queued": 2}
        assert "vision" in d.cli("tenants").stdout
        # the operator raises the quota at run time: a fact, and the next job starts
        r = d.cli("tenant", "set", "vision", "--gpus", "2")
        assert r.returncode == 0, r.stderr
        d.wait_states(ids[:2], {"running"})
        assert d.jobs()[ids[2]]["state"] == "queued"
        go.touch()
        d.wait_states(ids, {"succeeded"})
        out = d.cli("sql", "SELECT tenant, gpus FROM tenant_configs ORDER BY seq", "--format", "json")
        assert [(r["tenant"], r["gpus"]) for r in json.loads(out.stdout)] == [("vision", 1.0), ("vision", 2.0)]
        usage = json.loads(d.cli("sql", "SELECT * FROM tenant_usage", "--format", "json").stdout)
        row = next(r for r in usage if r["tenant"] == "vision")
        assert row["quota_gpus"] == 2.0 and row["jobs"] == 3 and row["gpu_hours"] > 0
        prom = d.cli("metrics", "--prometheus").stdout
        assert 'eventsched_tenant_quota_gpus{tenant="vision"} 2' in prom
    # the recorded log replays exactly: the config's tenants and the operator's change included
    from eventsched.sim.compare import compare_placements

    state = tmp_path / "state"
    result = simulate(load_source(state), "recorded", tmp_path / "replay")
    assert compare_placements(state / "log", Path(result.state_dir) / "log") is None
    replayed = [e for b in eventlog.read_batches(Path(result.state_dir) / "log") for e in b
                if isinstance(e, ev.TenantsConfigured)]
    assert [t.tenants["vision"].gpus for t in replayed] == [1.0, 2.0]


def test_bad_tenant_configs_and_options_get_one_line(tmp_path: Path) -> None:
    cases = {
        '[tenants.vision]\nusers = ["a"]\ngpuz = 1\n': "Object contains unknown field `gpuz` - at `[tenants.vision]`",
        '[tenants.vision]\nusers = ["a"]\ngpus = -1\n': "Expected `float` >= 0.0 - at `[tenants.vision].gpus`",
        '[tenants.a]\nusers = ["x"]\n[tenants.b]\nusers = ["x"]\n': "user 'x' is in tenants 'a', 'b'",
    }
    for text, expected in cases.items():
        d = Daemon(tmp_path / "bad", gpus="fake:1", extra=["--config", config(tmp_path, text)])
        r = d.cli("serve", "--gpus", "fake:1", "--config", str(tmp_path / "eventsched.toml"))
        assert r.returncode != 0 and expected in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    conf = config(tmp_path, '[tenants.vision]\nusers = ["someone-else"]\n')
    with Daemon(tmp_path / "state", gpus="fake:2", extra=["--config", conf]) as d:
        r = d.cli("submit", "--tenant", "vision", "--", "true")
        assert r.returncode == 1 and r.stderr.strip().endswith("--tenant vision: you (root) are not one of its users")
        r = d.cli("submit", "--signal", "NOPE@3", "--", "true")
        assert r.returncode == 2 and "unknown signal 'NOPE'" in r.stderr
        r = d.cli("tenant", "set", "vision", "--weight", "-1")
        assert r.returncode != 0 and "weight" in r.stderr and "Traceback" not in r.stderr
        assert d.jobs() == {}  # nothing was accepted


def test_preemption_warns_the_victim_requeues_it_and_replays_exactly(tmp_path: Path) -> None:
    warned, trapping = tmp_path / "warned", tmp_path / "trapping"
    # the victim checkpoints on its warning signal, then finishes on its second run
    victim = script(tmp_path, "victim.sh", (
        f'if [ -e {warned} ]; then echo resumed; exit 0; fi\n'
        f'trap \'echo "USR1 $EVENTSCHED_JOB_ID" > {warned}; exit 0\' USR1\n'
        f'touch {trapping}\n'
        'while true; do sleep 0.05; done'))
    with Daemon(tmp_path / "state", gpus="fake:2") as d:
        low = d.submit("--gpus", "2", "--preemptible", "--signal", "USR1@5", "--", victim)
        d.wait_for(lambda _: trapping.exists(), what="the victim to set its trap")  # a warning before would kill it
        high = d.submit("--gpus", "1", "--priority", "10", "--", "sleep", "0.5")
        jobs = d.wait_states([low, high], {"succeeded"}, timeout=30)
        assert warned.read_text().strip() == f"USR1 {low}"
        row = json.loads(d.cli("sql", f"SELECT attempts, state FROM jobs WHERE id = {low}", "--format", "json").stdout)
        assert row == [{"attempts": 2, "state": "succeeded"}]  # preempted once, requeued, then done
        story = d.cli("explain", str(low)).stdout
        assert f"preempted for job {high} (rule priority: a higher priority)" in story
        assert "queued again (preempted)" in story
        n = json.loads(d.cli("sql", "SELECT victim, for_job, rule FROM preemptions", "--format", "json").stdout)
        assert n == [{"victim": low, "for_job": high, "rule": "priority"}]
        state_dir = d.state_dir
    # replaying the log reproduces every placement and preemption
    live = [e for batch in eventlog.read_batches(state_dir / "log") for e in batch]
    result = simulate(load_source(state_dir), "recorded", tmp_path / "replay")
    replayed = [e for batch in eventlog.read_batches(Path(result.state_dir) / "log") for e in batch]

    def decisions(events: list[ev.Event]) -> list[tuple]:
        return [(type(e).__name__, e.job, tuple(getattr(e, "gpu_ids", ())), getattr(e, "for_job", 0))
                for e in events if isinstance(e, (ev.JobPlaced, ev.JobCancelRequested, ev.JobRequeued))]

    assert decisions(replayed) == decisions(live)
    assert ("JobCancelRequested", low, (), high) in decisions(live)


def test_two_tenants_of_equal_weight_share_the_gpus_half_and_half(tmp_path: Path) -> None:
    conf = config(tmp_path, (
        'policy = "fair-share"\n[scheduler]\nusage_half_life_s = 30.0\n'
        '[tenants.a]\nusers = ["root"]\ndefault_for = ["root"]\n[tenants.b]\nusers = ["root"]\n'))
    with Daemon(tmp_path / "state", gpus="fake:2", extra=["--config", conf]) as d:
        for gpu in ("0", "1"):
            assert d.cli("pause-gpu", gpu).returncode == 0
        # a floods first, then b: under FIFO a would take the first 20 starts
        ids = {t: [d.submit("--tenant", t, "--", "sleep", "0.3") for _ in range(20)] for t in ("a", "b")}
        for gpu in ("0", "1"):
            assert d.cli("resume-gpu", gpu).returncode == 0
        jobs = d.wait_states(ids["a"] + ids["b"], {"succeeded"}, timeout=60)
    starts = sorted((jobs[j]["started_at"], t) for t in ids for j in ids[t])
    first_half = [t for _, t in starts[:20]]
    assert 9 <= first_half.count("a") <= 11, first_half


def test_a_two_gpu_job_starts_behind_a_stream_of_one_gpu_jobs(tmp_path: Path) -> None:
    """A big job behind small ones, end to end: on 2 GPUs a 2-GPU job at priority 0,
    then a 1-GPU job a second; once it has waited reserve_after_s (1 s here)
    the reservation starts it as the jobs on its GPUs end (docs/fair-share.md:
    the bound)."""
    conf = config(tmp_path, "[scheduler]\nreserve_after_s = 1.0\n")
    with Daemon(tmp_path / "state", gpus="fake:2", extra=["--config", conf]) as d:
        first = d.submit("--", "sleep", "2")
        big = d.submit("--gpus", "2", "--", "sleep", "0.5")
        submitted = time.monotonic()
        stream = []
        for _ in range(12):
            stream.append(d.submit("--", "sleep", "2"))
            time.sleep(1.0)
            if d.jobs()[big]["state"] != "queued":
                break
        jobs = d.wait_states([big], {"running", "succeeded"}, timeout=10)
        waited = jobs[big]["started_at"] - jobs[big]["submitted_at"]
        # bound: reserve_after_s (1 s) + what the jobs on its GPUs had left (at most 2 s each)
        assert waited < 1.0 + 2.0 + 2.0, f"the 2-GPU job waited {waited:.1f}s"
        assert time.monotonic() - submitted < 12


def test_tenants_with_real_users_and_only_operators_change_them(users, public_dir) -> None:  # noqa: F811
    """Two real unprivileged users against a root daemon: each lands in the
    tenant that lists them, a tenant they are not in is refused, and only
    root may change the tenants."""
    alice, bob = users
    conf = public_dir / "teams.toml"
    conf.write_text(f'[tenants.vision]\nusers = ["{alice.name}"]\ngpus = 1\n[tenants.nlp]\nusers = ["{bob.name}"]\n')
    conf.chmod(0o644)
    d = root_daemon(public_dir, "--config", str(conf)).start()
    try:
        r = as_user(alice, d.state_dir, "submit", "--json", "--", "/bin/true")
        assert r.returncode == 0, r.stderr
        job = json.loads(r.stdout)["id"]
        r = as_user(alice, d.state_dir, "submit", "--tenant", "nlp", "--", "/bin/true")
        assert r.returncode == 1 and f"--tenant nlp: you ({alice.name}) are not one of its users" in r.stderr
        r = as_user(bob, d.state_dir, "tenant", "set", "nlp", "--gpus", "4")
        assert r.returncode == 1 and "only root or the daemon's user may change the tenants" in r.stderr
        assert d.cli("tenant", "set", "nlp", "--gpus", "4").returncode == 0  # root may
        r = as_user(bob, d.state_dir, "tenants", "--json")
        assert r.returncode == 0, r.stderr
        tenants = {t["tenant"]: t for t in json.loads(r.stdout)}
        assert tenants["nlp"]["quota"]["gpus"] == 4 and tenants["vision"]["users"] == [alice.name]
        assert d.jobs()[job]["tenant"] == "vision"
    finally:
        d.stop()


def test_explain_forecasts_a_start_records_it_and_measures_its_error(tmp_path: Path) -> None:
    """'When will my job start?': a queued job's forecast from the
    core run forward, recorded when shown, checked against the real start."""
    with Daemon(tmp_path / "state", gpus="fake:1") as d:
        for _ in range(2):  # history: this job takes about three seconds, long enough
            # that the third is still queued after the CLI calls below on a busy machine
            job = d.submit("--name", "step", "--", "sleep", "3")
            d.wait_states([job], {"succeeded"})
        first = d.submit("--name", "step", "--", "sleep", "3")
        d.wait_states([first], {"running"})
        second = d.submit("--name", "step", "--", "sleep", "3")
        third = d.submit("--name", "step", "--", "sleep", "3")
        listed = {j["id"]: j for j in json.loads(d.cli("queue", "--json").stdout)}
        assert listed[first]["estimated_start"] is None  # running
        assert listed[third]["estimated_start"] > listed[second]["estimated_start"] > time.time() - 1
        shown = json.loads(d.cli("explain", str(third), "--json").stdout)
        assert shown["forecast"]["estimated_start"] == pytest.approx(listed[third]["estimated_start"], abs=1.0)
        r = d.cli("explain", str(third))
        text = r.stdout
        assert r.returncode == 0, r.stderr
        assert "estimated start: in about" in text and "if running jobs take their predicted times" in text
        d.wait_states([second, third], {"succeeded"}, timeout=40)
        rows = json.loads(d.cli("sql", "SELECT job, abs_error_s FROM forecast_errors", "--format", "json").stdout)
        assert [r["job"] for r in rows] == [third, third]  # recorded each time it was shown
        assert all(r["abs_error_s"] < 1.5 for r in rows), rows  # forecast to within a beat
        metrics = json.loads(d.cli("metrics", "--json").stdout)
        assert metrics["forecasts"]["count"] == 2 and metrics["forecasts"]["mean_abs_error_s"] < 1.5


def test_queue_shows_the_tenant_column_when_several_tenants_have_jobs(tmp_path: Path) -> None:
    conf = config(tmp_path, '[tenants.a]\nusers = ["root"]\ndefault_for = ["root"]\n[tenants.b]\nusers = ["root"]\n')
    with Daemon(tmp_path / "state", gpus="fake:1", extra=["--config", conf]) as d:
        d.submit("--", "sleep", "5")
        assert "TENANT" not in d.cli("queue").stdout  # one tenant: no column
        d.submit("--tenant", "b", "--", "sleep", "5")
        lines = d.cli("queue").stdout.splitlines()
        assert lines[0].split()[:4] == ["ID", "NAME", "USER", "TENANT"]
        assert {line.split()[3] for line in lines[1:]} == {"a", "b"}
        # no forecast history yet: the forecast says what it assumed
        text = d.cli("explain", "2").stdout
        assert "no job has finished here yet, so each is assumed to take an hour" in text
