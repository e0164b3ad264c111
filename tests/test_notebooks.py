"""The notebooks in notebooks/ run top to bottom in a real kernel against a real
daemon on fake GPUs, and the saved widget state shows the panel with the jobs.
Each run is rendered to docs/notebooks/ (scripts/render_notebooks.py): the
repository shows the notebooks with their outputs; the .ipynb files are kept
without outputs, so that their diffs are the code."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
sys.path.insert(0, str(ROOT / "scripts"))
from render_notebooks import render  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from daemon_harness import Daemon

    d = Daemon(tmp_path / "state").start()
    # the kernel inherits this: the notebooks' magics find this daemon
    monkeypatch.setenv("EVENTSCHED_STATE_DIR", str(d.state_dir))
    monkeypatch.delenv("EVENTSCHED_SOCKET", raising=False)
    yield d
    d.stop()


def execute(name: str, workdir: Path) -> nbformat.NotebookNode:
    shutil.copy(NOTEBOOKS / name, workdir / name)
    nb = nbformat.read(workdir / name, as_version=4)
    client = NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(workdir)}})
    client.execute()
    nbformat.write(nb, workdir / f"executed-{name}")  # kept for a look when a test fails
    if not [o for o in outputs(nb) if o["output_type"] == "error"]:
        render(nb, name)  # a visitor reads the last good run
    return nb


def outputs(nb: nbformat.NotebookNode) -> list[dict[str, Any]]:
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def text_of(nb: nbformat.NotebookNode) -> str:
    parts = []
    for out in outputs(nb):
        if "text" in out:
            parts.append(out["text"])
        for mime in ("text/plain", "text/html"):
            if mime in out.get("data", {}):
                parts.append(out["data"][mime])
    return "\n".join(parts)


def widget_values(nb: nbformat.NotebookNode) -> list[str]:
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    return [str(model["state"].get("value", "")) + str(model["state"].get("description", "")) for model in state.values()]


def test_quickstart_runs_and_the_saved_panel_shows_the_jobs(daemon, tmp_path: Path) -> None:
    nb = execute("quickstart.ipynb", tmp_path)
    assert not [o for o in outputs(nb) if o["output_type"] == "error"]
    text = text_of(nb)
    assert "already running" in text  # the test's daemon was found, not a second one started
    assert "step 3" in text  # job.logs()
    assert "'succeeded'" in text and "'cancelled'" in text
    assert "my GPUs: " in text
    jobs = daemon.jobs()
    by_name = {j["name"]: j for j in jobs.values()}
    assert by_name["demo"]["state"] == "succeeded" and by_name["demo"]["gpus"] == 0.5
    assert by_name["long-one"]["state"] == "cancelled"
    assert by_name["cell-demo"]["state"] == "succeeded"
    assert (tmp_path / ".eventsched-cells").is_dir()

    values = "\n".join(widget_values(nb))
    for gpu in range(4):
        assert f"GPU {gpu}" in values  # one bar per GPU
    demo = by_name["demo"]["id"]
    long_one = by_name["long-one"]["id"]
    # the panel's job table, as the background thread last drew it
    assert f"data-job='{demo}' data-state='succeeded'" in values
    assert f"data-job='{long_one}' data-state='cancelled'" in values
    # the handle's live view followed the job too
    assert f"class='es-handle' data-job='{demo}' data-state='succeeded'" in values
    # rendered for a visitor: the last panel's rows and the day's GPU time in readable units
    page = (ROOT / "docs" / "notebooks" / "quickstart.md").read_text()
    assert f"data-job='{long_one}' data-state='cancelled'" in page and "GPU time today" in page
    assert " GPU-s</text>" in page or " GPU-min</text>" in page


def test_analytics_runs_and_plots(daemon, tmp_path: Path) -> None:
    nb = execute("analytics.ipynb", tmp_path)
    assert not [o for o in outputs(nb) if o["output_type"] == "error"]
    text = text_of(nb)
    assert "work-5" in text and "broken" in text
    assert "failed" in text and "succeeded" in text
    assert any("image/png" in o.get("data", {}) for o in outputs(nb))
    states = json.dumps([j["state"] for j in daemon.jobs().values()])
    assert states.count("succeeded") == 6 and states.count("failed") == 1


def test_whatif_replays_the_daemons_history_and_charts_the_policies(daemon, tmp_path: Path) -> None:
    # laid out like the repo: part 2 reads ../replays/synthetic/workload.csv
    workdir = tmp_path / "notebooks"
    workdir.mkdir()
    (tmp_path / "replays").symlink_to(NOTEBOOKS.parent / "replays")
    nb = execute("whatif.ipynb", workdir)
    assert not [o for o in outputs(nb) if o["output_type"] == "error"]
    text = text_of(nb)
    assert "already running" in text  # it replayed the test's daemon, not a second one
    assert "same placements as the daemon" in text  # fidelity under the recorded policy
    # the comparison tables have a row for the recording and for each policy
    for row in ("as recorded", "recorded (", "fifo", "best-fit", "sjf-backfill"):
        assert f"<th>{row}" in text
    assert text.count("<th>sjf-backfill</th>") == 3  # part 1, %gpuwhatif and part 2
    assert "mean wait (s)" in text and "p95 wait (h)" in text and "makespan (h)" in text
    assert "whatif-0" in text  # the per-job waits queried from a replay's own log
    charts = [o for o in outputs(nb) if "image/png" in o.get("data", {})]
    assert len(charts) == 3  # one per part, and %gpuwhatif's
    # the same in one line: %gpuwhatif's table and chart
    assert "class='es-whatif'" in text
    # a queued job's start under each request, side by side
    assert "(as asked)" in text and text.count("80 %") >= 4
    jobs = {j["name"]: j for j in daemon.jobs().values()}
    assert len(jobs) == 18 and {jobs["blocker"]["state"], jobs["big"]["state"]} == {"cancelled"}
    assert all(j["state"] == "succeeded" for name, j in jobs.items() if name.startswith("whatif-"))
    page = (ROOT / "docs" / "notebooks" / "whatif.md").read_text()
    assert "<th>sjf-backfill</th>" in page and "(as asked)" in page
    assert len(list((ROOT / "docs" / "notebooks" / "whatif_files").glob("*.png"))) == len(charts)
