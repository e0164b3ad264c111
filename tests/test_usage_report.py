"""`eventsched report`: GPU-hours used and idle, efficiency, waits and jobs by
user, tenant or day, from the history, against a real daemon on fake GPUs."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import Daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("usage") / "state", gpus="fake:2") as d:
        # long enough for GPU samples inside each job's run (efficiency needs one) on a loaded machine
        jobs = [d.submit("--gpus", gpus, "--", "sleep", "1.5") for gpus in ("1", "2", "0.5")]
        d.wait_states(jobs, {"succeeded"}, timeout=30)
        yield d


def rows(d: Daemon, *args: str) -> list[dict[str, str]]:
    done = d.cli("report", "--since", "1d", "--format", "csv", *args)
    assert done.returncode == 0, done.stderr
    return list(csv.DictReader(io.StringIO(done.stdout)))


def test_the_report_sums_to_the_read_models_gpu_hours(daemon: Daemon) -> None:
    metrics = json.loads(daemon.cli("metrics", "--json").stdout)
    total = sum(u["gpu_hours"] for u in metrics["gpu_hours_by_user"])
    assert total > 0
    for by in ("user", "tenant", "day"):
        report = rows(daemon, "--by", by)
        assert sum(float(r["gpu_hours"]) for r in report) == pytest.approx(total), by
        assert sum(int(r["jobs"]) for r in report) == 3
    [mine] = rows(daemon)
    assert 0 <= float(mine["efficiency"]) <= 1 and float(mine["p90_wait_s"]) >= float(mine["mean_wait_s"]) >= 0
    assert float(mine["idle_gpu_hours"]) <= float(mine["gpu_hours"])


def test_a_price_adds_a_cost_column(daemon: Daemon, tmp_path: Path) -> None:
    config = tmp_path / "eventsched.toml"
    config.write_text("[accounting]\ngpu_hour_price = 2.5\n")
    [mine] = rows(daemon, "--config", str(config))
    assert float(mine["cost"]) == pytest.approx(2.5 * float(mine["gpu_hours"]))
    assert "cost" not in rows(daemon)[0]


def test_other_formats_and_bad_input(daemon: Daemon) -> None:
    table = daemon.cli("report").stdout
    assert "gpu_hours" in table and "(1 row)" in table
    assert daemon.cli("report", "--format", "markdown").stdout.startswith("| user | jobs | gpu_hours |")
    assert json.loads(daemon.cli("report", "--format", "json", "--by", "day").stdout)[0]["jobs"] == 3
    bad = daemon.cli("report", "--since", "soon")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
