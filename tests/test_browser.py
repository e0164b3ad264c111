"""A real browser: JupyterLab on localhost, Debian's chromium driven by Playwright.

Opens notebooks/quickstart.ipynb, runs it, and checks on screen that the panel
shows the GPUs and that a submitted job's state changes without any cell being
run again. A screenshot is saved under the test's tmp dir and copied to
test-output/.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time
import urllib.request
from typing import Any
from pathlib import Path

import pytest
from processes import stop_group
from daemon_harness import free_port

pytestmark = [pytest.mark.slow, pytest.mark.browser]

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKEN = "eventsched-test"


@pytest.fixture
def daemon(tmp_path: Path):
    from daemon_harness import Daemon

    d = Daemon(tmp_path / "state").start()
    yield d
    d.stop()


@pytest.fixture
def lab(tmp_path: Path, daemon):
    """JupyterLab serving a copy of quickstart.ipynb; the kernel finds the test's daemon."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    pytest.importorskip("playwright")
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", root / "quickstart.ipynb")
    env = dict(os.environ)
    env.update(
        EVENTSCHED_STATE_DIR=str(daemon.state_dir),
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter-config"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "jupyter-workspaces"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "jupyter-settings"),
    )
    env.pop("EVENTSCHED_SOCKET", None)
    port = free_port()
    log = open(tmp_path / "jupyterlab.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={TOKEN}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"jupyterlab exited: {(tmp_path / 'jupyterlab.log').read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    yield base
    stop_group(server)  # the server and the kernels it started


JOB_STATES_JS = """() => {
  const seen = {};
  for (const el of document.querySelectorAll('.eventsched-panel tr.es-job, .es-handle')) {
    const key = (el.classList.contains('es-handle') ? 'handle:' : 'panel:') + el.dataset.job;
    seen[key] = el.dataset.state;
  }
  return seen;
}"""


def _scroll_to(page: Any, selector: str) -> None:
    """Scroll an element into view for a screenshot, in one step of the page's
    own script: the live panel redraws its parts, and a locator's scroll can
    find the element it resolved already replaced."""
    page.evaluate("sel => document.querySelector(sel)?.scrollIntoView({block: 'nearest'})", selector)


def test_quickstart_in_jupyterlab(lab: str, daemon, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    shot = tmp_path / "quickstart-browser.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{lab}/lab/tree/quickstart.ipynb?token={TOKEN}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            # the kernel is up when the status bar says so
            page.wait_for_function("() => document.body.innerText.includes('Idle')", timeout=60_000)
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")

            # the panel shows one bar per GPU
            page.wait_for_selector(".eventsched-panel .es-gpu", timeout=60_000)
            page.wait_for_function("() => document.querySelectorAll('.eventsched-panel .es-gpu').length === 4",
                                   timeout=30_000)
            panel_text = page.inner_text(".eventsched-panel")
            for gpu in range(4):
                assert f"GPU {gpu}" in panel_text

            # the notebook's first job ends up succeeded, in the panel and in its handle's display
            page.wait_for_selector(".es-handle", timeout=60_000)
            demo = page.get_attribute(".es-handle", "data-job")
            page.wait_for_function(
                f"() => {{ const s = ({JOB_STATES_JS})(); "
                f"return s['panel:{demo}'] === 'succeeded' && s['handle:{demo}'] === 'succeeded'; }}",
                timeout=90_000)
            # the whole notebook ran: the cancelled job shows as such
            page.wait_for_function(
                "() => [...document.querySelectorAll('.eventsched-panel tr.es-job')]"
                ".some(r => r.dataset.state === 'cancelled')", timeout=90_000)

            # a job submitted from a terminal while no cell runs: the panel follows it on its own
            job = str(daemon.submit("--gpus", "0.5", "--name", "from-terminal", "--", "sleep", "3"))
            seen: list[str] = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and seen[-1:] != ["succeeded"]:
                state = page.evaluate(JOB_STATES_JS).get(f"panel:{job}")
                if state and seen[-1:] != [state]:
                    seen.append(state)
                    if state == "running":
                        _scroll_to(page, ".eventsched-panel")
                        page.screenshot(path=str(tmp_path / "quickstart-browser-running.png"), full_page=True)
                time.sleep(0.1)
            assert seen[-1:] == ["succeeded"], seen
            assert "running" in seen, seen

            # history at a glance: a utilisation/memory chart per GPU drawn from the
            # samples, and today's GPU-hours per user, which the jobs above put on the chart
            page.wait_for_function(
                "() => document.querySelectorAll('.eventsched-panel svg.es-spark').length === 4"
                " && document.querySelector('.eventsched-panel svg.es-user-hours rect.es-user-bar')",
                timeout=60_000)
            charts = page.evaluate("""() => [...document.querySelectorAll('.eventsched-panel svg.es-spark')].map(
                s => ({gpu: s.dataset.gpu, util: s.querySelector('path.es-spark-util').getAttribute('d'),
                       mem: s.querySelector('path.es-spark-mem').getAttribute('d'),
                       width: s.getBoundingClientRect().width}))""")
            assert [c["gpu"] for c in charts] == [f"local:{g}" for g in range(4)], charts
            assert all(c["util"].startswith("M") and c["width"] > 100 for c in charts), charts  # drawn, on screen
            bars = page.evaluate("""() => [...document.querySelectorAll(
                '.eventsched-panel svg.es-user-hours g.es-user')].map(
                g => [g.dataset.user, Number(g.querySelector('rect.es-user-bar').getAttribute('width'))])""")
            assert bars and bars[0][0] == pwd.getpwuid(os.geteuid()).pw_name and bars[0][1] > 0, bars
            _scroll_to(page, ".eventsched-panel .es-history")
            page.screenshot(path=str(tmp_path / "quickstart-browser-history.png"), full_page=True)
            _scroll_to(page, ".eventsched-panel")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    out = ROOT / "test-output"
    out.mkdir(exist_ok=True)
    for png in tmp_path.glob("quickstart-browser*.png"):
        shutil.copy(png, out / png.name)
