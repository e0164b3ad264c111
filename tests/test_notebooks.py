"""The notebooks in notebooks/ run top to bottom in a real kernel against a real
daemon on fake GPUs, and the saved widget state shows the panel with the jobs.
Each run is rendered to docs/notebooks/ (scripts/render_notebooks.py): the
repository shows the notebooks with their outputs; the .ipynb files are kept
without outputs, so that their diffs are the code."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
sys.path.insert(0, str(ROOT / "scripts"))
from render_notebooks import render  # noqa: E402

pytestmark = pytest.mark.slow


@dataclass
class Run:
    """One notebook run against a daemon of its own."""

    daemon: Any
    workdir: Path
    nb: nbformat.NotebookNode
    failure: BaseException | None = None

    def result(self) -> nbformat.NotebookNode:
        if self.failure is not None:
            raise self.failure
        return self.nb


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """The three notebooks run at once, each in its own kernel against its own
    daemon: they spend most of their time waiting on their jobs."""
    from daemon_harness import Daemon

    root = tmp_path_factory.mktemp("notebooks")
    done: dict[str, Run] = {}
    try:
        for name in ("quickstart.ipynb", "analytics.ipynb", "whatif.ipynb"):
            base = root / name.split(".")[0]
            workdir = base / "notebooks"  # laid out like the repo: whatif reads ../replays/synthetic/workload.csv
            workdir.mkdir(parents=True)
            (base / "replays").symlink_to(NOTEBOOKS.parent / "replays")
            shutil.copy(NOTEBOOKS / name, workdir / name)
            done[name] = Run(Daemon(base / "state").start(), workdir, nbformat.read(workdir / name, as_version=4))
        asyncio.run(_execute_all(done))
        for name, run in done.items():
            nbformat.write(run.nb, run.workdir / f"executed-{name}")  # kept for a look when a test fails
            if run.failure is None and not [o for o in outputs(run.nb) if o["output_type"] == "error"]:
                render(run.nb, name)  # a visitor reads the last good run
        yield done
    finally:
        for run in done.values():
            run.daemon.stop()


async def _execute_all(todo: dict[str, Run]) -> None:
    async def one(name: str, run: Run) -> None:
        # the kernel's environment names its daemon: the notebooks' magics find it
        env = {k: v for k, v in os.environ.items() if k != "EVENTSCHED_SOCKET"}
        env["EVENTSCHED_STATE_DIR"] = str(run.daemon.state_dir)
        client = NotebookClient(run.nb, timeout=180, kernel_name="python3",
                                resources={"metadata": {"path": str(run.workdir)}})
        try:
            await client.async_execute(env=env)
        except Exception as exc:  # the test of this notebook reports it
            run.failure = exc

    await asyncio.gather(*(one(name, run) for name, run in todo.items()))


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


def test_quickstart_runs_and_the_saved_panel_shows_the_jobs(runs: dict[str, Run]) -> None:
    run = runs["quickstart.ipynb"]
    nb, daemon = run.result(), run.daemon
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
    assert (run.workdir / ".eventsched-cells").is_dir()

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


def test_analytics_runs_and_plots(runs: dict[str, Run]) -> None:
    run = runs["analytics.ipynb"]
    nb, daemon = run.result(), run.daemon
    assert not [o for o in outputs(nb) if o["output_type"] == "error"]
    text = text_of(nb)
    assert "work-5" in text and "broken" in text
    assert "failed" in text and "succeeded" in text
    assert any("image/png" in o.get("data", {}) for o in outputs(nb))
    states = json.dumps([j["state"] for j in daemon.jobs().values()])
    assert states.count("succeeded") == 6 and states.count("failed") == 1


def test_whatif_replays_the_daemons_history_and_charts_the_policies(runs: dict[str, Run]) -> None:
    run = runs["whatif.ipynb"]
    nb, daemon = run.result(), run.daemon
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
