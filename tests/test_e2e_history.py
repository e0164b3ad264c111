"""The DuckDB read model against a real daemon's log: SQL agrees with the queue."""

from __future__ import annotations

import json
import statistics
import urllib.request
from pathlib import Path

import pytest
from daemon_harness import Daemon, free_port

pytestmark = pytest.mark.slow



def test_sql_and_metrics_agree_with_the_queue(tmp_path: Path) -> None:
    port = free_port()
    with Daemon(tmp_path / "state", gpus="fake:2:16384", extra=["--metrics-port", str(port)]) as d:
        ids = [d.submit("--gpus", "0.5", "--", "/bin/sh", "-c", f"sleep 0.{i}; exit {i % 3}") for i in range(6)]
        ids.append(d.submit("--gpus", "2", "--", "/bin/sleep", "0.3"))
        cancelled = d.submit("--gpus", "2", "--priority", "-5", "--", "/bin/sleep", "30")
        d.wait_states(ids, {"succeeded", "failed"}, timeout=30)
        d.wait_states([cancelled], {"running"}, timeout=30)
        assert d.cli("cancel", str(cancelled)).returncode == 0
        queue = d.wait_states([cancelled], {"cancelled"}, timeout=30)

        result = d.cli("sql", "SELECT id, user, state, exit_code, gpu_ids, submitted_at, started_at, ended_at FROM jobs ORDER BY id", "--format", "json")
        assert result.returncode == 0, result.stderr
        rows = {row["id"]: row for row in json.loads(result.stdout)}
        assert set(rows) == set(queue)
        for job_id, job in queue.items():
            row = rows[job_id]
            assert row["state"] == job["state"]
            assert row["user"] == job["user"]
            assert row["exit_code"] == job["exit_code"]
            assert sorted(row["gpu_ids"]) == sorted(job["gpu_ids"])
            for key in ("submitted_at", "started_at", "ended_at"):
                assert row[key] == pytest.approx(job[key], abs=1e-3)

        # the metrics' figures, computed here independently from the queue
        waits = [j["started_at"] - j["submitted_at"] for j in queue.values() if j["started_at"] is not None]
        runs = [j["ended_at"] - j["started_at"] for j in queue.values() if j["ended_at"] is not None and j["started_at"] is not None]
        metrics = json.loads(d.cli("metrics", "--json").stdout)
        flat = json.dumps(metrics)
        assert metrics is not None and "wait" in flat
        wait = _find(metrics, "wait")
        assert wait["mean"] == pytest.approx(statistics.mean(waits), abs=0.01)
        run = _find(metrics, "run")
        assert run["mean"] == pytest.approx(statistics.mean(runs), abs=0.01)
        gpu_hours = sum(
            (j["ended_at"] - j["started_at"]) * j["gpus"] / 3600
            for j in queue.values()
            if j["started_at"] is not None
        )
        by_user = d.cli("sql", "SELECT sum(gpu_hours) AS h FROM gpu_hours_by_user", "--format", "json")
        # GPU-hours count the allocation (placement to release); the queue's
        # started_at is the process start, up to ~0.1 s of launch later per job
        launch = sum(j["gpus"] for j in queue.values() if j["started_at"] is not None) * 0.1 / 3600
        assert json.loads(by_user.stdout)[0]["h"] == pytest.approx(gpu_hours, abs=launch)

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            text = response.read().decode()
        assert response.status == 200
        assert 'eventsched_gpu_allocated_share{gpu="local:0"}' in text
        assert "# TYPE" in text and "eventsched_jobs" in text


def _find(metrics: dict, name: str) -> dict:
    """The summary dict for wait/run in the metrics JSON, wherever it nests."""
    stack = [metrics]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key.startswith(name) and isinstance(value, dict) and "mean" in value:
                    return value
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    raise KeyError(name)
