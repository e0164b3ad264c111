"""History at a glance: `eventsched status --history WINDOW`
and the panel's charts (the browser test sees those on screen)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from daemon_harness import Daemon
from test_history import write

from eventsched.cli.status_history import (
    SPARK,
    bar,
    fetch_history,
    parse_window,
    query_for,
    render_history,
    series_from_rows,
    sparkline,
)
from eventsched.domain import events as ev
from eventsched.domain.units import UnitError
from eventsched.jupyter.widgets import render_history_html

T0 = 1_699_920_000.0  # a UTC midnight (2023-11-14)


def sample(ts: float, gpu: int, util: float, mem: int) -> ev.GpuSampled:
    return ev.GpuSampled(ts=ts, node="local", gpu=gpu, utilization=util, memory_used_mib=mem,
                         memory_total_mib=16000, temperature_c=40.0, power_w=100.0)


def test_columns_hold_the_last_reading_and_go_blank_when_it_is_stale() -> None:
    # window of 10 columns of 60 s from T0; a reading before the window, then one in column 3
    rows = [
        ("before", "local", 0, -1, None, None, 16000, T0 - 30, 50.0, 1000.0, None, None),
        ("bucket", "local", 0, 3, 80.0, 3000.0, 16000, T0 + 200, 90.0, 4000.0, None, None),
        ("gpu", "local", 1, None, None, None, 16000, None, None, None, None, None),
        ("user", None, None, None, None, None, None, None, None, None, "bob", 0.5),
        ("user", None, None, None, None, None, None, None, None, None, "alice", 2.0),
    ]
    data = series_from_rows(rows, T0, 60.0, 10)
    g0, g1 = data["gpus"]
    # column 0 starts 30 s after the earlier reading: held; column 1 (90 s) too; column 2 (150 s) stale
    assert g0["utilization"] == [50.0, 50.0, None, 80.0, 90.0, None, None, None, None, None]  # 300 s: 100 s old
    assert g0["memory_used_mib"][:5] == [1000.0, 1000.0, None, 3000.0, 4000.0]
    assert g0["utilization_last"] == 90.0 and g0["utilization_peak"] == 90.0 and g0["memory_total_mib"] == 16000
    assert g1["utilization"] == [None] * 10 and g1["utilization_last"] is None  # a GPU with no samples: blank
    assert [u["user"] for u in data["users"]] == ["alice", "bob"]


def test_sparkline_and_bar() -> None:
    assert sparkline([0.0, 50.0, 100.0, None, 200.0], 100.0) == "▁▅█ █"
    assert sparkline([1.0], 0.0) == " "
    assert bar(1.0, 2.0, width=4) == "██" and bar(1.0, 8.0, width=1) == "▏" and bar(0.0, 1.0) == ""


@pytest.mark.parametrize("text", ["soon", "-1h", "0", "40d"])
def test_bad_windows_get_one_line(text: str) -> None:
    with pytest.raises(UnitError, match=r"^--history '.*': (give a window like 15m, 1h, 6h or 1d|at most 31 days)$"):
        parse_window(text)
    assert parse_window("1h") == 3600.0 and parse_window("90m") == 5400.0


def test_history_from_a_real_log(tmp_path: Path) -> None:
    """The read model's samples and gpu_hours_daily, through the same query ``status --history`` runs."""
    spec = ev.JobSpec(command=["x"], user="carol", gpus=1.0)
    write(tmp_path, [
        [ev.DaemonStarted(ts=T0, node="local", pid=1, version="0.1", policy="fifo")],
        [ev.GpuDiscovered(ts=T0, node="local", gpu=g, uuid=f"GPU-{g}", model="fake", memory_total_mib=16000)
         for g in (0, 1)],
        [sample(T0 + 10, 0, 0.0, 0), sample(T0 + 10, 1, 0.0, 0)],
        [ev.JobSubmitted(ts=T0 + 100, job=1, spec=spec)],
        [ev.JobPlaced(ts=T0 + 100, job=1, node="local", gpu_ids=[0], share=1.0)],
        [sample(T0 + 1900, 0, 100.0, 8000)],
        [sample(T0 + 3000, 0, 40.0, 16000)],
        [ev.JobExited(ts=T0 + 3700, job=1, exit_code=0)],
    ])
    h = fetch_history(query_for(tmp_path, None), 3600.0, now=T0 + 3600, buckets=6, fit=False)
    assert h["day"] == "2023-11-14" and h["bucket_s"] == 600.0
    g0, g1 = h["gpus"]
    # columns of 600 s: 0 at T0+10, then nothing for over HOLD_S (blank), 100 at T0+1900,
    # blank again (500 s later: no sampler was running), 40 at T0+3000
    assert g0["utilization"] == [0.0, None, None, 100.0, None, 40.0]
    assert g0["memory_used_mib"] == [0.0, None, None, 8000.0, None, 16000.0]
    assert g1["utilization"] == [0.0, None, None, None, None, None]
    # the open placement counts up to the last event in the log (T0+3700): 3600 s of one GPU
    assert h["users"] == [{"user": "carol", "gpu_hours": pytest.approx(1.0)}]
    text = render_history(h)
    assert "local:0  util ▁  █ ▄ " in text and "last 40%" in text and "peak 15.6 GiB" in text
    assert "GPU-hours today (2023-11-14, UTC)" in text and "carol  " + "█" * 30 + "  1" in text
    page = render_history_html(h)
    assert page.count("<svg class='es-spark'") == 2 and "class='es-user-bar'" in page
    assert "M0.0,34.0 L40.0,34.0 M120.0,2.0" in page  # a gap where there is no reading


def test_the_panel_escapes_what_users_chose() -> None:
    h = {"window_s": 3600.0, "asked_s": 3600.0, "bucket_s": 60.0, "day": "2023-11-14", "gpus": [],
         "users": [{"user": "<b>x</b>", "gpu_hours": 1.0}]}
    page = render_history_html(h)
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page and "no GPU samples yet" in page


@pytest.mark.slow
def test_status_history_against_a_daemon(tmp_path: Path) -> None:
    with Daemon(tmp_path / "state", gpus="fake:2:16384") as d:
        job = d.submit("--gpus", "1", "--gpu-mem", "8000", "--", "/bin/sleep", "1.5")
        d.wait_states([job], {"succeeded"}, timeout=30)
        time.sleep(0.5)
        r = d.cli("status", "--history", "1h")
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert "GPU  ALLOCATED" in out  # the usual status first
        assert "History, last " in out and "since the first sample" in out
        lines = out.splitlines()
        util = {line.split()[0]: line for line in lines if " util " in line and "local:" in line}
        assert set(util) == {"local:0", "local:1"}
        busy = next(g for g, line in util.items() if "█" in line)  # the job's GPU ran at 100 %
        assert "peak 100%" in util[busy]
        mem = lines[lines.index(util[busy]) + 1]
        assert mem.split()[0] == "mem" and any(c in mem for c in SPARK[2:]) and "of 16.0 GiB" in mem
        root = next(line for line in lines if line.startswith("  root "))
        assert "█" in root and float(root.split()[-1]) > 0
        as_json = json.loads(d.cli("status", "--json", "--history", "30m").stdout)
        h = as_json["history"]
        assert as_json["gpus"] and len(h["gpus"]) == 2 and all(len(g["utilization"]) == 60 for g in h["gpus"])
        assert h["users"][0]["user"] == "root" and h["users"][0]["gpu_hours"] > 0
        bad = d.cli("status", "--history", "yesterday")
        assert bad.returncode == 2 and bad.stdout == ""
        assert bad.stderr.strip().endswith("--history 'yesterday': give a window like 15m, 1h, 6h or 1d")
        assert bad.stderr.count("\n") == 1
