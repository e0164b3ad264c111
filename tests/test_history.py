"""The DuckDB read model, `eventsched sql` and `metrics`, against real logs.

Logs are written with the real LogWriter; expected figures are worked out by
hand from the scenario below, never by asking the read model.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pytest

from eventsched.cli.sql import run_sql
from eventsched.domain import events as ev
from eventsched.projections.history import History, open_history, rebuild
from eventsched.projections.metrics import compute_metrics, prometheus_text, run_metrics
from eventsched.storage import log

T0 = 1_699_920_000.0  # a UTC midnight
DAY = 86_400.0
LAST = T0 + DAY + 3600  # ts of the last event of the scenario
PY = sys.executable


def spec(user: str, tenant: str, gpus: float, **kw: object) -> ev.JobSpec:
    return ev.JobSpec(command=["python", "train.py", f"--who={user}"], user=user, tenant=tenant, gpus=gpus, **kw)


def t(x: float) -> float:
    return T0 + x


def scenario_part1() -> list[list[ev.Event]]:
    """Frames as the daemon would append them (each list is one group commit)."""
    s, p, st, ex = ev.JobSubmitted, ev.JobPlaced, ev.JobStarted, ev.JobExited
    return [
        [ev.DaemonStarted(ts=t(0), node="local", pid=1, version="0.1", policy="fifo")],
        [ev.GpuDiscovered(ts=t(0), node="local", gpu=g, uuid=f"GPU-{g}", model="fake", memory_total_mib=16000)
         for g in (0, 1)],
        # job 8: placed, started, then the daemon restarted and lost it
        [s(ts=t(50), job=8, spec=spec("alice", "ml", 0.5))],
        [p(ts=t(60), job=8, node="local", gpu_ids=[0], share=0.5), st(ts=t(61), job=8, pid=800)],
        # job 1: alice, half a GPU, succeeds
        [s(ts=t(100), job=1, spec=spec("alice", "ml", 0.5, name="train-a", priority=3))],
        [p(ts=t(110), job=1, node="local", gpu_ids=[0], share=0.5, gpu_mem_mib=4000)],
        [st(ts=t(111), job=1, pid=101)],
        # job 2: bob, one whole GPU, fails with exit 1
        [s(ts=t(120), job=2, spec=spec("bob", "cv", 1.0))],
        [p(ts=t(130), job=2, node="local", gpu_ids=[1], share=1.0), st(ts=t(131), job=2, pid=102)],
        # job 3: cancelled while queued
        [s(ts=t(150), job=3, spec=spec("alice", "ml", 1.0))],
        [ev.JobCancelled(ts=t(400), job=3, by="uid:1000")],
        [ev.GpuSampled(ts=t(600), node="local", gpu=0, utilization=40.0, memory_used_mib=4000,
                       memory_total_mib=16000, temperature_c=50.0, power_w=100.0),
         ev.GpuSampled(ts=t(600), node="local", gpu=1, utilization=90.0, memory_used_mib=9000,
                       memory_total_mib=16000, temperature_c=70.0, power_w=250.0)],
        [ex(ts=t(1931), job=2, exit_code=1)],
    ]


def scenario_part2() -> list[list[ev.Event]]:
    s, p, st, ex = ev.JobSubmitted, ev.JobPlaced, ev.JobStarted, ev.JobExited
    return [
        # job 4: carol, hits its time limit, requeued, succeeds on the second attempt
        [s(ts=t(2000), job=4, spec=spec("carol", "ml", 1.0, time_limit_s=600, on_time_limit="requeue"))],
        [p(ts=t(2010), job=4, node="local", gpu_ids=[1], share=1.0), st(ts=t(2011), job=4, pid=104)],
        [ev.GpuSampled(ts=t(2400), node="local", gpu=0, utilization=60.0, memory_used_mib=4000,
                       memory_total_mib=16000, temperature_c=55.0, power_w=120.0),
         ev.GpuSampled(ts=t(2400), node="local", gpu=1, utilization=100.0, memory_used_mib=15000,
                       memory_total_mib=16000, temperature_c=80.0, power_w=300.0)],
        [ev.JobCancelRequested(ts=t(2611), job=4, by="timer", reason="time-limit")],
        [ex(ts=t(2612), job=4, exit_code=None, signal=15, reason="time-limit"),
         ev.JobRequeued(ts=t(2612), job=4, reason="time-limit")],
        [p(ts=t(2700), job=4, node="local", gpu_ids=[1], share=1.0), st(ts=t(2701), job=4, pid=204)],
        [ex(ts=t(3001), job=4, exit_code=0)],
        # job 5: bob, cancelled while running (SIGTERM)
        [s(ts=t(3000), job=5, spec=spec("bob", "cv", 0.5))],
        [p(ts=t(3005), job=5, node="local", gpu_ids=[1], share=0.5), st(ts=t(3006), job=5, pid=105)],
        [ev.JobCancelRequested(ts=t(3100), job=5, by="uid:1001")],
        [ex(ts=t(3105), job=5, exit_code=None, signal=15)],
        # job 6: held
        [s(ts=t(3200), job=6, spec=spec("dave", "", 1.0)), ev.JobHeld(ts=t(3201), job=6, by="uid:1002")],
        # job 7: erin, two whole GPUs, still running at the end of the log
        [s(ts=t(3300), job=7, spec=spec("erin", "cv", 2.0))],
        [p(ts=t(3300), job=7, node="local", gpu_ids=[1, 0], share=1.0), st(ts=t(3301), job=7, pid=107)],
        [ev.JobLost(ts=t(3500), job=8, reason="not found after restart")],
        [ex(ts=t(3711), job=1, exit_code=0)],
        # job 9: frank, runs across midnight
        [s(ts=t(DAY - 1900), job=9, spec=spec("frank", "nlp", 1.0))],
        [p(ts=t(DAY - 1800), job=9, node="local", gpu_ids=[0], share=1.0), st(ts=t(DAY - 1800), job=9, pid=109)],
        [ev.GpuPaused(ts=t(DAY), node="local", gpu=1, by="uid:0")],
        [ex(ts=t(DAY + 1800), job=9, exit_code=0)],
        [ev.GpuSampled(ts=LAST, node="local", gpu=0, utilization=20.0, memory_used_mib=100,
                       memory_total_mib=16000, temperature_c=40.0, power_w=60.0)],
    ]


# --- what the scenario means, worked out by hand ------------------------------------

EXPECTED_JOBS = {
    # id: (state, wait_s, run_s, turnaround_s, exit_code, signal, attempts, gpu_ids)
    1: ("succeeded", 11.0, 3600.0, 3611.0, 0, None, 1, [0]),
    2: ("failed", 11.0, 1800.0, 1811.0, 1, None, 1, [1]),
    3: ("cancelled", None, None, 250.0, None, None, 0, []),
    4: ("succeeded", 11.0, 601.0 + 300.0, 1001.0, 0, None, 2, [1]),
    5: ("cancelled", 6.0, 99.0, 105.0, None, 15, 1, [1]),
    6: ("held", None, None, None, None, None, 0, []),
    7: ("running", 1.0, None, None, None, None, 1, [1, 0]),
    8: ("lost", 11.0, 3439.0, 3450.0, None, None, 1, [0]),
    9: ("succeeded", 100.0, 3600.0, 3700.0, 0, None, 1, [0]),
}

# (user, tenant, share, from, to) for every GPU a job held
HELD = [
    ("alice", "ml", 0.5, t(60), t(3500)),  # job 8, until lost
    ("alice", "ml", 0.5, t(110), t(3711)),  # job 1
    ("bob", "cv", 1.0, t(130), t(1931)),  # job 2
    ("carol", "ml", 1.0, t(2010), t(2612)),  # job 4, first attempt
    ("carol", "ml", 1.0, t(2700), t(3001)),  # job 4, second attempt
    ("bob", "cv", 0.5, t(3005), t(3105)),  # job 5
    ("erin", "cv", 1.0, t(3300), LAST),  # job 7, GPU 1, still open
    ("erin", "cv", 1.0, t(3300), LAST),  # job 7, GPU 0, still open
    ("frank", "nlp", 1.0, t(DAY - 1800), t(DAY + 1800)),  # job 9
]


def expected_hours(key: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in HELD:
        out[row[key]] = out.get(row[key], 0.0) + row[2] * (row[4] - row[3]) / 3600
    return out


def write(state: Path, frames: list[list[ev.Event]]) -> int:
    writer = log.LogWriter.open(state / "log")
    try:
        last = 0
        for frame in frames:
            last = writer.append(frame)
        return last
    finally:
        writer.close()


@pytest.fixture
def state(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir()
    write(d, scenario_part1() + scenario_part2())
    return d


def q(history: History, sql: str) -> list[tuple]:
    return history.query(sql)[1]


# --- the read model -------------------------------------------------------------------


def test_jobs_table_agrees_with_the_events(state: Path) -> None:
    h = open_history(state)
    rows = q(h, "SELECT id, state, wait_s, run_s, turnaround_s, exit_code, signal, attempts, gpu_ids "
                "FROM jobs ORDER BY id")
    got = {r[0]: tuple(r[1:]) for r in rows}
    assert set(got) == set(EXPECTED_JOBS)
    for job, want in EXPECTED_JOBS.items():
        state_, wait, run, turn, code, sig, attempts, gpu_ids = got[job]
        assert (state_, code, sig, attempts, gpu_ids) == (want[0], want[4], want[5], want[6], want[7]), job
        for value, expected in zip((wait, run, turn), want[1:4]):
            assert value == pytest.approx(expected) if expected is not None else value is None, job
    row = q(h, "SELECT name, \"user\", tenant, priority, gpus, gpu_mem_mib, command, submitted_at, started_at, "
               "ended_at, node FROM jobs WHERE id = 1")[0]
    assert row == ("train-a", "alice", "ml", 3, 0.5, 0, "python train.py --who=alice", t(100), t(111), t(3711),
                   "local")
    # job 4's started_at is its last attempt; its first start drives the wait
    assert q(h, "SELECT started_at, first_started_at, reason FROM jobs WHERE id = 4")[0] == (t(2701), t(2011), None)
    assert q(h, "SELECT state, ended_at FROM jobs WHERE id = 7")[0] == ("running", None)


def test_job_events_keep_every_state_change_in_order(state: Path) -> None:
    h = open_history(state)
    types = [r[0] for r in q(h, "SELECT type FROM job_events WHERE job = 4 ORDER BY seq")]
    assert types == ["JobSubmitted", "JobPlaced", "JobStarted", "JobCancelRequested", "JobExited",
                     "JobRequeued", "JobPlaced", "JobStarted", "JobExited"]
    n_job_events = sum(1 for e in log.read(state / "log") if hasattr(e, "job"))
    assert q(h, "SELECT count(*) FROM job_events")[0][0] == n_job_events
    assert q(h, "SELECT detail FROM job_events WHERE job = 5 AND type = 'JobExited'")[0][0] == "signal=15"


def test_placements_and_gpu_hours_by_user_tenant_and_day(state: Path) -> None:
    h = open_history(state)
    assert q(h, "SELECT count(*), count(to_ts) FROM placements")[0] == (len(HELD), len(HELD) - 2)
    assert q(h, "SELECT gpu, share, from_ts, to_ts FROM placements WHERE job = 4 ORDER BY from_ts") == [
        (1, 1.0, t(2010), t(2612)), (1, 1.0, t(2700), t(3001))]
    by_user = dict(q(h, 'SELECT "user", gpu_hours FROM gpu_hours_by_user'))
    assert by_user == pytest.approx(expected_hours(0))
    by_tenant = dict(q(h, "SELECT tenant, gpu_hours FROM gpu_hours_by_tenant"))
    assert by_tenant == pytest.approx(expected_hours(1))
    frank = q(h, "SELECT day::VARCHAR, gpu_hours FROM gpu_hours_daily WHERE \"user\" = 'frank' ORDER BY day")
    assert [d for d, _ in frank] == ["2023-11-14", "2023-11-15"]
    assert [hrs for _, hrs in frank] == pytest.approx([0.5, 0.5])
    total_daily = q(h, "SELECT sum(gpu_hours) FROM gpu_hours_daily")[0][0]
    assert total_daily == pytest.approx(sum(expected_hours(0).values()))


def test_gpus_and_utilisation(state: Path) -> None:
    h = open_history(state)
    assert q(h, "SELECT gpu, uuid, paused, lost FROM gpus ORDER BY gpu") == [
        (0, "GPU-0", False, False), (1, "GPU-1", True, False)]
    summary = q(h, "SELECT gpu, samples, utilization_mean, utilization_peak FROM gpu_utilization_summary ORDER BY gpu")
    assert summary == [(0, 3, pytest.approx(40.0), 60.0), (1, 2, pytest.approx(95.0), 100.0)]
    minutes = q(h, "SELECT minute::VARCHAR, utilization_mean FROM gpu_utilization WHERE gpu = 1 ORDER BY minute")
    assert minutes == [("2023-11-14 00:10:00", 90.0), ("2023-11-14 00:40:00", 100.0)]


def test_catch_up_after_more_events_equals_one_pass(tmp_path: Path, state: Path) -> None:
    inc = tmp_path / "inc"
    inc.mkdir()
    n1 = write(inc, scenario_part1())
    h = open_history(inc)
    assert q(h, "SELECT seq FROM _position")[0][0] == n1
    assert q(h, "SELECT state FROM jobs WHERE id = 1")[0][0] == "running"
    assert h.catch_up() == 0
    n2 = write(inc, scenario_part2())
    assert h.catch_up() == n2 - n1
    assert q(h, "SELECT state FROM jobs WHERE id = 1")[0][0] == "succeeded"
    full = open_history(state)
    assert dump(h) == dump(full)


def dump(h: History) -> dict[str, list]:
    tables = ["jobs", "job_events", "submissions", "placements", "placement_events", "gpu_samples", "gpus",
              "gpu_events", "daemon_events", "_position", "gpu_hours_daily", "gpu_utilization"]
    with h.reader() as con:  # one consistent view for all of them
        return {name: con.execute(f"SELECT * FROM {name} ORDER BY ALL").fetchall() for name in tables}


def test_rebuild_from_scratch_equals_incremental(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    h = History(d)
    for frame in scenario_part1() + scenario_part2():  # fold frame by frame, as a tailing reader would
        write(d, [frame])
        h.catch_up()
    incremental = dump(h)
    assert rebuild(d) == sum(len(f) for f in scenario_part1() + scenario_part2())
    assert dump(History(d)) == incremental
    assert dump(History(d, in_memory=True)) == incremental


def test_empty_log_gives_empty_tables(tmp_path: Path) -> None:
    h = open_history(tmp_path)
    assert q(h, "SELECT count(*) FROM jobs")[0][0] == 0
    assert q(h, "SELECT * FROM gpu_hours_by_user") == []


# --- eventsched sql ---------------------------------------------------------------------


def sql(state: Path, query: str, fmt: str = "table") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run_sql(state, query, fmt, out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def test_sql_formats(state: Path) -> None:
    rc, out, _ = sql(state, "SELECT id, state, gpu_ids, wait_s FROM jobs WHERE id IN (1, 7) ORDER BY id", "json")
    assert rc == 0
    assert json.loads(out) == [{"id": 1, "state": "succeeded", "gpu_ids": [0], "wait_s": 11.0},
                               {"id": 7, "state": "running", "gpu_ids": [1, 0], "wait_s": 1.0}]
    rc, out, _ = sql(state, "SELECT id, \"user\", exit_code FROM jobs WHERE id IN (1, 3) ORDER BY id", "csv")
    assert out.splitlines() == ["id,user,exit_code", "1,alice,0", "3,alice,"]
    rc, out, _ = sql(state, "SELECT \"user\", count(*) AS n FROM jobs GROUP BY ALL ORDER BY n DESC, \"user\"")
    lines = out.splitlines()
    assert lines[0].split() == ["user", "n"] and lines[-1] == "(6 rows)"
    # aligned: every value of the count column ends in the same column
    ends = {len(line.rstrip()) for line in lines[2:-1]}
    assert len(ends) == 1 and lines[2].split() == ["alice", "3"]


@pytest.mark.parametrize("statement", [
    "INSERT INTO jobs (id) VALUES (99)",
    "UPDATE jobs SET state = 'failed'",
    "DELETE FROM jobs",
    "DROP TABLE jobs",
    "CREATE TABLE x AS SELECT 1",
    "ALTER TABLE jobs ADD COLUMN x INT",
    "COPY jobs TO '/tmp/jobs.csv'",
    "ATTACH ':memory:' AS other",
    "INSTALL httpfs",
    "LOAD json",
    "PRAGMA enable_profiling",
    "CHECKPOINT",
    "SELECT 1; DELETE FROM jobs",
])
def test_sql_refuses_statements_that_modify(state: Path, statement: str) -> None:
    rc, out, err = sql(state, statement)
    assert rc == 2 and out == ""
    assert err.startswith("eventsched sql: refused:") and err.count("\n") == 1
    assert sql(state, "SELECT count(*) FROM jobs", "csv")[1] == "count_star()\n9\n"


def test_sql_allows_describing(state: Path) -> None:
    assert sql(state, "DESCRIBE jobs")[0] == 0
    assert sql(state, "PRAGMA table_info('jobs')")[0] == 0
    assert sql(state, "SHOW TABLES")[0] == 0


@pytest.mark.parametrize("query, fragment", [
    ("SELEC * FROM jobs", "Parser Error"),
    ("SELECT * FROM nosuchtable", "nosuchtable"),
    ("SELECT nosuchcolumn FROM jobs", "nosuchcolumn"),
])
def test_sql_invalid_query_gets_duckdbs_message_on_one_line(state: Path, query: str, fragment: str) -> None:
    rc, out, err = sql(state, query)
    assert rc == 2 and out == ""
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err


def test_sql_missing_state_dir(tmp_path: Path) -> None:
    rc, _, err = sql(tmp_path / "nope", "SELECT 1")
    assert rc == 1 and "no eventsched state directory" in err


SQL_PROC = """
import sys
from eventsched.cli.sql import run_sql
sys.exit(run_sql(sys.argv[1], sys.argv[2], "json"))
"""


def test_concurrent_sql_processes_agree(state: Path) -> None:
    query = 'SELECT "user", gpu_hours FROM gpu_hours_by_user ORDER BY "user"'
    procs = [subprocess.Popen([PY, "-c", SQL_PROC, str(state), query], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(5)]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 5, results
    outs = [json.loads(o) for o, _ in results]
    assert all(o == outs[0] for o in outs)
    assert {r["user"]: r["gpu_hours"] for r in outs[0]} == pytest.approx(expected_hours(0))


APPENDER = """
import sys, time
from eventsched.domain import events as ev
from eventsched.storage import log
w = log.LogWriter.open(sys.argv[1])
for job in range(1000, 1000 + int(sys.argv[2])):
    s = ev.JobSpec(command=["sleep", "1"], user="load")
    w.append([ev.JobSubmitted(ts=1.7e9 + job, job=job, spec=s)])
    w.append([ev.JobPlaced(ts=1.7e9 + job, job=job, node="local", gpu_ids=[0], share=0.25),
              ev.JobStarted(ts=1.7e9 + job, job=job, pid=job)])
    time.sleep(0.002)
w.close()
"""


def test_queries_while_another_process_appends(state: Path) -> None:
    n = 300
    writer = subprocess.Popen([PY, "-c", APPENDER, str(state / "log"), str(n)])
    seen = []
    try:
        while writer.poll() is None or not seen or seen[-1][0] < n:
            rc, out, err = sql(state, "SELECT count(*) AS n, count(*) FILTER (WHERE state = 'running') AS r, "
                                      "(SELECT count(*) FROM placements WHERE job >= 1000) AS p "
                                      "FROM jobs WHERE \"user\" = 'load'", "json")
            assert rc == 0, err
            row = json.loads(out)[0]
            seen.append((row["n"], row["r"], row["p"]))
            if writer.poll() is not None and len(seen) > 200:
                break
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == 0
    counts = [s[0] for s in seen]
    assert counts == sorted(counts)  # a view never goes back in time
    # every view is a fold of a whole frame prefix: at most one job is submitted but not yet running
    assert all(n_ - r in (0, 1) and p == r for n_, r, p in seen)
    final = sql(state, "SELECT count(*) FROM jobs WHERE state = 'running' AND \"user\" = 'load'", "csv")[1]
    assert final == f"count_star()\n{n}\n"
    assert len(set(counts)) > 1  # we did see it grow


HOLDER = """
import sys, time, duckdb
con = duckdb.connect(sys.argv[1])  # a process outside the locking protocol
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_sql_works_while_a_foreign_process_holds_the_database(state: Path) -> None:
    open_history(state).close()
    holder = subprocess.Popen([PY, "-c", HOLDER, str(state / "history.duckdb"), "30"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        rc, out, err = sql(state, "SELECT count(*) FROM jobs", "csv")
        assert (rc, out) == (0, "count_star()\n9\n"), err
    finally:
        holder.kill()
        holder.wait()


# --- metrics ------------------------------------------------------------------------------


def stats(values: list[float]) -> tuple[float, float, float]:
    arr = np.array(values, dtype=float)
    return float(arr.mean()), float(np.percentile(arr, 50)), float(np.percentile(arr, 95))


def test_metrics_figures(state: Path) -> None:
    m = compute_metrics(History(state))
    want_states = {"queued": 0, "running": 1, "succeeded": 3, "failed": 1, "cancelled": 2, "preempted": 0,
                   "held": 1, "lost": 1}
    assert m["jobs"]["by_state"] == want_states and m["jobs"]["total"] == 9
    for key, idx in (("wait_s", 1), ("run_s", 2), ("turnaround_s", 3)):
        values = [w[idx] for w in EXPECTED_JOBS.values() if w[idx] is not None]
        mean, median, p95 = stats(values)
        assert m[key]["count"] == len(values)
        assert (m[key]["mean"], m[key]["median"], m[key]["p95"]) == pytest.approx((mean, median, p95)), key
    assert [(g["gpu"], g["utilization_mean"], g["utilization_peak"]) for g in m["gpus"]] == [
        (0, pytest.approx(40.0), 60.0), (1, pytest.approx(95.0), 100.0)]
    assert {r["user"]: r["gpu_hours"] for r in m["gpu_hours_by_user"]} == pytest.approx(expected_hours(0))
    assert {r["tenant"]: r["gpu_hours"] for r in m["gpu_hours_by_tenant"]} == pytest.approx(expected_hours(1))


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse_prometheus(text: str) -> dict[tuple[str, tuple], float]:
    """A strict little parser of the text format 0.0.4 (what a scraper checks)."""
    samples: dict[tuple[str, tuple], float] = {}
    types: dict[str, str] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "summary", "histogram", "untyped") and name not in types
            types[name] = kind
            continue
        m = _SAMPLE.match(line)
        assert m, line
        name, _, labels_text, value = m.groups()
        family = re.sub(r"_(sum|count)$", "", name) if name not in types else name
        assert family in types, f"sample {name} before its TYPE"
        labels: list[tuple[str, str]] = []
        if labels_text:
            pos = 0
            while pos < len(labels_text):
                lm = _LABEL.match(labels_text, pos)
                assert lm, line
                labels.append((lm.group(1), re.sub(r"\\(.)", lambda x: {"n": "\n"}.get(x.group(1), x.group(1)),
                                                   lm.group(2))))
                pos = lm.end()
        key = (name, tuple(labels))
        assert key not in samples, f"duplicate {key}"
        samples[key] = float(value)
    return samples


def test_prometheus_text_parses_and_matches(state: Path) -> None:
    m = compute_metrics(History(state))
    samples = parse_prometheus(prometheus_text(m))
    assert samples[("eventsched_jobs", (("state", "succeeded"),))] == 3
    assert samples[("eventsched_job_wait_seconds_count", ())] == 7
    assert samples[("eventsched_job_wait_seconds", (("quantile", "0.95"),))] == pytest.approx(m["wait_s"]["p95"])
    assert samples[("eventsched_user_gpu_seconds_total", (("user", "frank"),))] == pytest.approx(3600.0)
    assert samples[("eventsched_gpu_utilization_peak_percent", (("node", "local"), ("gpu", "1")))] == 100.0


def test_prometheus_labels_are_escaped(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    odd = 'we"ird\\user\nx'
    write(d, [[ev.JobSubmitted(ts=1.0, job=1, spec=ev.JobSpec(command=["x"], user=odd, tenant="t"))],
              [ev.JobPlaced(ts=2.0, job=1, node="n", gpu_ids=[0], share=1.0)],
              [ev.JobExited(ts=3602.0, job=1, exit_code=0)]])
    samples = parse_prometheus(prometheus_text(compute_metrics(History(d))))
    assert samples[("eventsched_user_gpu_seconds_total", (("user", odd),))] == pytest.approx(3600.0)


def test_run_metrics_formats(state: Path) -> None:
    for fmt in ("table", "json", "prometheus"):
        out, err = io.StringIO(), io.StringIO()
        assert run_metrics(state, fmt, out=out, err=err) == 0, err.getvalue()
    table = io.StringIO()
    run_metrics(state, "table", out=table)
    assert "GPU-hours per tenant" in table.getvalue() and "frank" in table.getvalue()
    err = io.StringIO()
    assert run_metrics(state / "missing", "table", out=io.StringIO(), err=err) == 1
    assert err.getvalue().count("\n") == 1


def test_model_ahead_of_a_shortened_log_is_rebuilt(tmp_path: Path) -> None:
    """A power cut can take back a tail the model already read: the log wins."""
    import shutil

    from eventsched.domain.events import JobSpec, JobSubmitted
    from eventsched.projections.history import History
    from eventsched.storage import log as eventlog

    state = tmp_path / "state"
    with eventlog.LogWriter.open(state / "log") as writer:
        writer.append([JobSubmitted(job=i, spec=JobSpec(command=["x"], user="ann"), ts=float(i)) for i in (1, 2)])
    backup = tmp_path / "log-before"
    shutil.copytree(state / "log", backup)
    with eventlog.LogWriter.open(state / "log") as writer:
        writer.append([JobSubmitted(job=3, spec=JobSpec(command=["x"], user="bob"), ts=3.0)])
    history = History(state)
    history.catch_up()
    assert history.query("SELECT count(*) FROM jobs")[1][0][0] == 3
    shutil.rmtree(state / "log")
    shutil.copytree(backup, state / "log")  # the lost tail: only jobs 1 and 2 survived
    history.catch_up()
    columns, rows = history.query("SELECT id FROM jobs ORDER BY id")
    assert [r[0] for r in rows] == [1, 2]


def test_a_catch_up_cut_short_keeps_an_exact_prefix_and_resumes(tmp_path: Path, state: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Several chunks share a transaction: an error mid-way rolls back to the last commit, never between."""
    from eventsched.projections import history_fold as hist

    monkeypatch.setattr(hist, "CHUNK_EVENTS", 2)  # many chunks, several per transaction
    monkeypatch.setattr(hist, "COMMIT_EVENTS", 6)
    frames = list(log.read_batches(state / "log"))

    def cut_short() -> object:
        yield from frames[: len(frames) // 2]
        raise OSError("the disk went away")

    con = duckdb.connect(str(tmp_path / "cut.duckdb"))
    hist.ensure_schema(con)
    with pytest.raises(OSError):
        hist.fold(con, cut_short(), 0)
    pos = hist.position(con)
    assert 0 < pos < frames[len(frames) // 2][0].seq
    n_job_events = sum(1 for f in frames for e in f if hasattr(e, "job") and e.seq <= pos)
    assert con.execute("SELECT count(*) FROM job_events").fetchone()[0] == n_job_events
    assert con.execute("SELECT max(last_seq) FROM jobs").fetchone()[0] <= pos
    hist.fold(con, log.read_batches(state / "log", pos + 1), pos)
    resumed = {name: con.execute(f"SELECT * FROM {name} ORDER BY ALL").fetchall()
               for name in ("jobs", "job_events", "placements", "gpu_samples", "gpus", "_position")}
    con.close()
    full = dump(open_history(state))
    assert resumed == {name: full[name] for name in resumed}
