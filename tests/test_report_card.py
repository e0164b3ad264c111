"""An ended job's report card: what it used against what it asked for, and one
line of advice, in `explain` and in SQL (`job_efficiency`), on fake GPUs whose
busy-ness and memory the job's processes declare."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
from pathlib import Path

import duckdb
import pytest
from daemon_harness import Daemon

from eventsched.domain import events as ev
from eventsched.domain import report_card as rc
from eventsched.storage import log as eventlog


def test_the_rule_asks_for_the_gpus_and_memory_used() -> None:
    assert rc.advice(4, 1.3, 40960, 9318) == ("asked 4 GPUs, used at most 1.3: ask for 2; "
                                              "peak 9.1 GB of 40 GB requested: ask for 12 GB")
    assert rc.advice(1, 0.9, 8192, 9000) == "peak 8.8 GB over the 8 GB requested: ask for 11 GB"
    assert rc.advice(2, 1.96, 8192, 7000) == "the request fits what it used"  # near its request: no nagging
    assert rc.advice(0.5, 0.1, 0, None) == "the request fits what it used"  # a share, no memory request
    assert rc.suggest(4, 0.0, 0, None) == (1, 0)  # an idle job still needs one GPU


def test_the_sql_rule_is_the_python_rule() -> None:
    con = duckdb.connect()
    for gpus in (0.5, 1, 2, 4, 8):
        for peak in (None, 0, 0.3, 1.0, 1.05, 1.3, 2.05, 3.96, 7.2):
            for request in (0, 1000, 8192, 40960):
                for mem in (None, 0, 500, 9318, 40000, 50000):
                    row = con.execute(
                        f"SELECT {rc.SUGGEST_SQL[0]}, {rc.SUGGEST_SQL[1]} FROM (SELECT ?::DOUBLE AS gpus, "
                        "?::DOUBLE AS gpus_used_peak, ?::BIGINT AS gpu_mem_mib, ?::BIGINT AS mem_peak_mib)",
                        [gpus, peak, request, mem]).fetchone()
                    assert (row[0], row[1]) == rc.suggest(gpus, peak, request, mem), (gpus, peak, request, mem)


# GPU 0 of the job 100 % busy holding 9318 MiB, GPU 1 30 % busy, the other two idle
FOUR_BUT_ONE = ("set -- $(echo $CUDA_VISIBLE_DEVICES | tr , ' '); "
                "CUDA_VISIBLE_DEVICES=$1 EVENTSCHED_FAKE_GPU_UTIL=100 EVENTSCHED_FAKE_GPU_MEM_MIB=9318 sleep 2 & "
                "CUDA_VISIBLE_DEVICES=$2 EVENTSCHED_FAKE_GPU_UTIL=30 sleep 2; wait")


def from_the_log(state_dir: Path, job: int) -> dict:
    """The card's numbers computed straight from the log's events."""
    events = [e for batch in eventlog.read_batches(state_dir / "log") for e in batch]
    placed = next(e for e in events if isinstance(e, ev.JobPlaced) and e.job == job)
    ended = next(e for e in events if isinstance(e, ev.JobExited) and e.job == job)
    samples: dict[int, list[ev.GpuSampled]] = {}
    for e in events:
        if isinstance(e, ev.GpuSampled):
            samples.setdefault(e.gpu, []).append(e)
    held, peaks = [], []
    for gpu in placed.gpu_ids:
        mine = samples[gpu]
        spans = [(s.utilization, min(nxt.ts if nxt else ended.ts, ended.ts) - s.ts)
                 for s, nxt in zip(mine, mine[1:] + [None]) if placed.ts <= s.ts < ended.ts]
        held += spans
        peaks.append(max(u for u, _ in spans))
    mem = [s.job_memory_mib[job] for ss in samples.values() for s in ss if job in s.job_memory_mib]
    return {"utilization_mean": sum(u * t for u, t in held) / sum(t for _, t in held),
            "utilization_peak": max(peaks), "gpus_used_peak": sum(peaks) / 100, "mem_peak_mib": max(mem)}


def test_a_job_asking_four_gpus_that_uses_one_is_told_so(tmp_path: Path) -> None:
    # a process outside the scheduler declaring 0 %: GPUs nobody declares for read 0 %, not their share
    quiet = subprocess.Popen(["sleep", "60"], env={**os.environ, "EVENTSCHED_FAKE_GPU_UTIL": "0"})
    try:
        with Daemon(tmp_path / "state", gpus="fake:4:49152") as d:
            job = d.submit("--gpus", "4", "--gpu-mem", "40960", "--", "sh", "-c", FOUR_BUT_ONE)
            d.wait_states([job], {"succeeded"}, timeout=30)
            shown = d.cli("explain", str(job))
            assert shown.returncode == 0, shown.stderr
            info = json.loads(d.cli("explain", str(job), "--json").stdout)
            rows = list(csv.DictReader(io.StringIO(d.cli("sql", "SELECT * FROM job_efficiency", "--format",
                                                         "csv").stdout)))
            waiting = d.submit("--begin", "+1h", "--", "true")  # has not run: no card
            assert json.loads(d.cli("explain", str(waiting), "--json").stdout)["report_card"] is None
            state_dir = d.state_dir
    finally:
        quiet.kill()
        quiet.wait()
    advice = "asked 4 GPUs, used at most 1.3: ask for 2; peak 9.1 GB of 40 GB requested: ask for 12 GB"
    assert f"advice: {advice}" in shown.stdout
    assert "host memory: not sampled" in shown.stdout and "GPU memory (per GPU): peak 9.1 GB of 40 GB" in shown.stdout
    card = info["report_card"]
    assert card["advice"] == advice and (card["suggested_gpus"], card["suggested_gpu_mem_mib"]) == (2, 12288)
    [row] = [r for r in rows if int(r["job"]) == job]
    truth = from_the_log(state_dir, job)
    for key, value in truth.items():
        assert card[key] == pytest.approx(value), key
        assert float(row[key]) == pytest.approx(value, rel=1e-3), key
    assert card["idle_gpu_hours"] > 0  # two of its GPUs sat idle
