"""What-if from a notebook (``%gpuwhatif``, ``eventsched.whatif``, ``job.whatif``),
the panel's buttons and its units, in a real IPython shell against a real daemon."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from IPython.core.interactiveshell import InteractiveShell

from eventsched.domain.units import format_gpu_time
from eventsched.jupyter.handle import JobHandle
from eventsched.jupyter.whatif import Alternatives, Comparison, alternatives_of
from eventsched.jupyter.widgets import render_history_html
from eventsched.wire.client import ClientError
from notebook_harness import one_line_error, run, shell  # noqa: F401 (fixtures)

METRICS = ("jobs", "finished", "makespan_s", "mean_wait_s", "median_wait_s", "p95_wait_s", "mean_turnaround_s",
           "gpu_utilization", "fragmentation", "fairness", "tenant_fairness", "events", "refused", "unfinished")


@pytest.mark.parametrize("gpu_seconds, text", [
    (0, "0 GPU-s"), (2.2, "2 GPU-s"), (45, "45 GPU-s"), (204, "3.4 GPU-min"), (900, "15 GPU-min"),
    (4500, "1.25 GPU-h"), (42.3 * 3600, "42.3 GPU-h"), (310 * 3600, "310 GPU-h")])
def test_gpu_time_reads_in_a_unit_its_size_needs(gpu_seconds: float, text: str) -> None:
    assert format_gpu_time(gpu_seconds) == text


def test_the_panel_shows_two_seconds_of_gpu_time_as_seconds() -> None:
    h = {"window_s": 3600.0, "day": "2026-11-28", "gpus": [], "users": [{"user": "ann", "gpu_hours": 2 / 3600}]}
    page = render_history_html(h)
    assert ">2 GPU-s</text>" in page and "0.000" not in page


def test_alternatives_are_each_change_alone_and_together() -> None:
    assert alternatives_of(1) == [(1, None)]
    assert alternatives_of([1, 2], 20000) == [(1, None), (2, None), (None, 20000), (1, 20000), (2, 20000)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    from daemon_harness import Daemon

    d = Daemon(tmp_path_factory.mktemp("es-whatif")).start()
    ids = [d.submit("--gpus", str(g), "--name", f"w{i}", "--", "sleep", "0.3")
           for i, g in enumerate((2, 1, 0.5, 4, 1, 0.25, 2))]
    d.wait_states(ids, {"succeeded"}, timeout=60)
    d.wait_log_quiet()
    yield d
    d.stop()


@pytest.fixture
def live(shell: InteractiveShell, daemon, monkeypatch: pytest.MonkeyPatch) -> InteractiveShell:
    monkeypatch.setenv("EVENTSCHED_STATE_DIR", str(daemon.state_dir))
    monkeypatch.delenv("EVENTSCHED_SOCKET", raising=False)
    return shell


@pytest.mark.slow
def test_gpuwhatif_gives_the_figures_of_eventsched_replay(live, daemon, capsys) -> None:
    # the recorded history (nothing is running: the log's end is fixed)
    cli = daemon.cli("replay", str(daemon.state_dir), "--policy", "fifo", "--policy", "best-fit", "--json")
    assert cli.returncode == 0, cli.stderr
    expected = {r["policy"]: {k: r.get(k) for k in METRICS} for r in json.loads(cli.stdout)["replays"]}
    result, out, err = run(live, "%gpuwhatif --policy fifo --policy best-fit", capsys)
    assert result.error_in_exec is None, err
    table = result.result
    assert isinstance(table, Comparison)
    got = {r["policy"]: {k: r.get(k) for k in METRICS} for r in table.rows}
    assert got == expected and list(got) == ["as recorded", "fifo", "best-fit"]
    assert "Image" in out  # the chart was drawn in the cell
    assert table.chart_png().startswith(b"\x89PNG")
    assert "<th>best-fit</th>" in table._repr_html_() and "mean wait" in repr(table)
    frame = table.to_dataframe()
    assert frame.loc["fifo", "mean_wait_s"] == expected["fifo"]["mean_wait_s"]
    # the Python spelling is the same path
    import eventsched

    again = eventsched.whatif(["fifo"], source=daemon.state_dir, chart=False)
    assert {k: again.row("fifo")[k] for k in METRICS} == expected["fifo"]
    # a window: the jobs submitted in it, all of them here
    windowed = run(live, "%gpuwhatif --policy fifo --since 1d", capsys)[0].result
    assert windowed.row("fifo")["jobs"] == expected["fifo"]["jobs"] and "last 1d" in repr(windowed)


@pytest.mark.slow
def test_gpuwhatif_mistakes_are_one_line(live, capsys) -> None:
    assert "unknown policy 'nope'" in one_line_error(*run(live, "%gpuwhatif --policy nope", capsys)[::2])
    assert "--gpus N and/or --gpu-mem" in one_line_error(*run(live, "%gpuwhatif --job 1", capsys)[::2])
    assert "only a queued job" in one_line_error(*run(live, "%gpuwhatif --job 1 --gpus 1", capsys)[::2])
    assert "no such file" in one_line_error(*run(live, "%gpuwhatif --policy fifo --source /nowhere", capsys)[::2])
    assert "give a window like 7d" in one_line_error(*run(live, "%gpuwhatif --policy fifo --since soon", capsys)[::2])
    result, out, err = run(live, "%gpuwhatif -h", capsys)
    assert result.error_in_exec is None and "--gpu-mem" in out and "%gpuwhatif" in out


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_queued_job_forecast_under_each_alternative(live, daemon, capsys) -> None:
    blocker = daemon.submit("--gpus", "2", "--name", "blocker", "--", "sleep", "60")
    waiting = daemon.submit("--gpus", "4", "--gpu-mem", "8000", "--name", "big", "--", "sleep", "1")
    try:
        daemon.wait_states([blocker], {"running"})
        result, _, err = run(live, f"%gpuwhatif --job {waiting} --gpus 2 --gpu-mem 4000", capsys)
        assert result.error_in_exec is None, err
        alts = result.result
        assert isinstance(alts, Alternatives)
        assert [(r["gpus"], r["gpu_mem_mib"]) for r in alts.rows] == [(4, 8000), (2, 8000), (4, 4000), (2, 4000)]
        for r in alts.rows:  # a range for each: median inside its 80 % interval
            assert r["estimated_start_p10"] <= r["estimated_start"] <= r["estimated_start_p90"], r
            assert "80 %" in r["text"]
        # 2 GPUs are free now; all 4 only once the blocker ends
        assert alts.wait_s(1) < alts.wait_s(0) and alts.wait_s(2) == pytest.approx(alts.wait_s(0), abs=1)
        assert "(as asked)" in repr(alts) and f"data-job='{waiting}'" in alts._repr_html_()
        # the handle asks the same
        handle = JobHandle(waiting, daemon.socket)
        by_handle = handle.whatif(gpus=2)
        assert len(by_handle) == 2 and by_handle.wait_s(1) < by_handle.wait_s(0)
        # more than the machine has: said, not forecast
        too_big = handle.whatif(gpus=8)
        assert too_big.rows[1]["estimated_start"] is None and "only 4 GPU" in too_big.rows[1]["text"]
        with pytest.raises(ClientError, match="8 at most"):  # a question, not a sweep
            handle.whatif(gpus=[0.1 * i for i in range(1, 10)])
    finally:
        daemon.cli("cancel", str(blocker), str(waiting))


@pytest.mark.slow
def test_the_panel_buttons_act_as_the_user(live, daemon, capsys) -> None:
    result, _, err = run(live, "panel = %gpustatus", capsys)
    assert result.error_in_exec is None, err
    panel = live.user_ns["panel"]
    job = daemon.submit("--gpus", "1", "--name", "to-cancel", "--", "sleep", "60")
    try:
        def row() -> Any:
            return next((r for r in panel.rows if r.job == job and "data-state='running'" in r.cells.value), None)

        _wait(lambda: row() is not None)
        r = row()
        assert r.layout.display == "" and not r.buttons["cancel"].disabled
        assert r.buttons["hold"].disabled and r.buttons["release"].disabled  # running: nothing to hold
        r.buttons["hold"].click()  # clicked all the same: the daemon's refusal, in one line
        assert "refused" in panel.action_line.value and "running" in panel.action_line.value
        assert "\n" not in panel.action_line.value
        r.buttons["explain"].click()
        assert "es-explain" in panel.explain_html.value and "to-cancel" in panel.explain_html.value
        r.buttons["cancel"].click()
        assert f"job {job}: cancel asked" in panel.action_line.value
        daemon.wait_states([job], {"cancelled"})
        _wait(lambda: any(x.job == job and "data-state='cancelled'" in x.cells.value for x in panel.rows))
        done = next(x for x in panel.rows if x.job == job)
        assert done.buttons["cancel"].disabled and not done.buttons["explain"].disabled
        # an ended job's explain carries its report card, in readable units
        short = daemon.submit("--gpus", "1", "--name", "short", "--", "sleep", "0.5")
        daemon.wait_states([short], {"succeeded"})
        _wait(lambda: any(x.job == short and "data-state='succeeded'" in x.cells.value for x in panel.rows))
        next(x for x in panel.rows if x.job == short).buttons["explain"].click()
        assert "report card: " in panel.explain_html.value and " GPU-s allocated" in panel.explain_html.value
    finally:
        daemon.cli("cancel", str(job))
        panel.close()


@pytest.mark.slow
def test_the_panel_draws_the_bookings_and_a_paused_gpu(live, daemon, capsys) -> None:
    result, _, err = run(live, "panel = %gpustatus", capsys)
    assert result.error_in_exec is None, err
    panel = live.user_ns["panel"]
    try:
        assert panel.bookings_html.value == ""  # nothing booked: nothing drawn
        made = daemon.cli("reserve", "create", "--gpu-ids", "3", "--start", "+1h", "--duration", "2h", "--json")
        assert made.returncode == 0, made.stderr
        booking = json.loads(made.stdout)["id"]
        _wait(lambda: f"reservation {booking}:" in panel.bookings_html.value)
        assert "GPU local:3 ..A" in panel.bookings_html.value  # booked from an hour on
        assert daemon.cli("pause-gpu", "2").returncode == 0

        def gpu_text(gpu: int) -> str:  # the line beside GPU N's bar
            return next(row.children[1].value for row in panel.gpu_box.children
                        if getattr(row.children[0], "description", "") == f"GPU {gpu}")

        _wait(lambda: "PAUSED" in gpu_text(2))
        assert "PAUSED" not in gpu_text(1)
        daemon.cli("reserve", "cancel", str(booking))
        _wait(lambda: panel.bookings_html.value == "")
    finally:
        daemon.cli("resume-gpu", "2")
        panel.close()
