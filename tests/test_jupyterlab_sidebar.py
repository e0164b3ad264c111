"""The JupyterLab sidebar in a real browser: JupyterLab on localhost with the
server extension and the prebuilt labextension that scripts/setup.sh
installs, Debian's chromium driven by Playwright, a real daemon on fake GPUs.

The sidebar belongs to no kernel: it shows jobs submitted from a terminal with
no notebook open, keeps updating across a kernel restart, acts on job rows and
raises a JupyterLab notification when one of the user's jobs ends. Screenshots
go to test-output/.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from processes import stop_group
from test_browser import CHROMIUM, CHROMIUM_FLAGS, ROOT, TOKEN, daemon, free_port, lab  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.browser]

LABEXTENSION = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "eventsched-jupyterlab"


def row(job: int) -> str:
    return f".eventsched-sidebar .es-side-job[data-job='{job}']"


def state_of(page, job: int) -> str | None:
    return page.evaluate(f"() => document.querySelector(\"{row(job)}\")?.dataset.state ?? null")


def wait_state(page, job: int, state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while state_of(page, job) != state:
        assert time.monotonic() < deadline, f"job {job} never shown {state} (last {state_of(page, job)})"
        time.sleep(0.2)


def open_sidebar(browser, lab: str):
    """A JupyterLab page at ``lab`` with the sidebar shown."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{lab}/lab?token={TOKEN}")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=60_000)
    page.wait_for_selector("#eventsched-sidebar", state="attached", timeout=60_000)
    page.evaluate("() => window.jupyterapp.shell.activateById('eventsched-sidebar')")
    # a wider sidebar for the screenshots (the split's sizes are not public API)
    page.evaluate("() => window.jupyterapp.shell._hsplitPanel?.setRelativeSizes([0.3, 0.7, 0])")
    return page


def keep_screenshots(tmp_path: Path) -> None:
    out = ROOT / "test-output"
    out.mkdir(exist_ok=True)
    for png in tmp_path.glob("jupyterlab-sidebar*.png"):
        shutil.copy(png, out / png.name)


def needs_labextension() -> None:
    if not (LABEXTENSION / "package.json").exists():
        pytest.skip("the labextension is not built (scripts/setup.sh builds it; it needs node)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One chromium for the module's tests, each in a page of its own."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


def test_sidebar_follows_the_daemon_without_a_kernel(browser, lab: str, daemon, tmp_path: Path) -> None:  # noqa: F811
    needs_labextension()
    page = open_sidebar(browser, lab)
    try:
        # with no notebook open: one line per GPU, from the server extension
        page.wait_for_function(
            "() => document.querySelectorAll('.eventsched-sidebar .es-side-gpu').length === 4", timeout=30_000)
        assert page.locator(".jp-Notebook").count() == 0
        assert "GPU 0 · alloc" in page.inner_text(".eventsched-sidebar")

        # jobs submitted from a terminal: a running one, and one that waits with its reason and forecast
        running = daemon.submit("--gpus", "2", "--name", "from-terminal", "--", "sh", "-c",
                                "echo hello from the job; sleep 120")
        waiting = daemon.submit("--gpus", "4", "--name", "waits", "--", "sleep", "120")
        wait_state(page, running, "running")
        wait_state(page, waiting, "queued")
        detail = page.inner_text(f"{row(waiting)} .es-side-detail")
        assert "resources" in detail and "starts in" in detail, detail
        # a notebook opens now (not awaited): its kernel starts while the rows are checked below.
        # The sidebar shows what an action did at its next poll, so actions on different
        # rows go together and are then awaited together
        page.evaluate("() => void jupyterapp.commands.execute('docmanager:open', {path: 'quickstart.ipynb'})")

        # the output of a job that runs, opened from its row
        page.click(f"{row(running)} button.es-side-output")
        page.wait_for_selector(f"{row(running)} pre.es-side-explain", timeout=10_000)
        assert "hello from the job" in page.inner_text(f"{row(running)} pre.es-side-explain")
        page.screenshot(path=str(tmp_path / "jupyterlab-sidebar.png"))

        # a paused GPU is marked on its line; a second click hides the output; a refusal shows
        # in the row, in one line (a running job cannot be held); explain shows the daemon's story
        assert daemon.cli("pause-gpu", "3").returncode == 0
        page.click(f"{row(running)} button.es-side-output")
        page.click(f"{row(running)} button.es-side-hold")
        page.click(f"{row(waiting)} button.es-side-explain")
        page.wait_for_selector(".es-side-gpu[data-gpu='local:3'] .es-side-mark", timeout=10_000)
        assert page.inner_text(".es-side-gpu[data-gpu='local:3'] .es-side-mark") == "paused"
        assert page.locator(".es-side-gpu[data-gpu='local:2'] .es-side-mark").count() == 0
        page.wait_for_selector(f"{row(running)} pre.es-side-explain", state="detached", timeout=10_000)
        page.wait_for_selector(f"{row(running)} .es-side-note", timeout=10_000)
        note = page.inner_text(f"{row(running)} .es-side-note")
        assert "only waiting jobs can be held" in note and "\n" not in note.strip(), note
        page.wait_for_selector(f"{row(waiting)} pre.es-side-explain", timeout=10_000)
        assert f"job {waiting} (waits" in page.inner_text(f"{row(waiting)} pre.es-side-explain")
        daemon.cli("resume-gpu", "3")

        # the notebook's kernel restarts; the sidebar keeps following the daemon,
        # and cancel from a row cancels that job at the daemon
        page.wait_for_selector(".jp-Notebook", timeout=60_000)
        page.wait_for_function("() => document.body.innerText.includes('Idle')", timeout=60_000)
        page.evaluate("""async () => {
            const panel = window.jupyterapp.shell.currentWidget;
            await panel.sessionContext.session.kernel.restart(); }""")
        after_restart = daemon.submit("--gpus", "1", "--name", "after-restart", "--", "sleep", "120")
        page.click(f"{row(waiting)} button.es-side-cancel")
        wait_state(page, after_restart, "running")
        wait_state(page, waiting, "cancelled")
        listed = json.loads(daemon.cli("queue", "--all", "--json").stdout)
        assert {j["id"]: j["state"] for j in listed}[waiting] == "cancelled"

        # one of the user's jobs fails: a notification with its exit reason
        failing = daemon.submit("--gpus", "0.5", "--name", "fails", "--", "sh", "-c", "exit 3")
        booked_out = daemon.submit("--gpus", "1", "--name", "booked-out", "--", "sleep", "120")
        toast = page.locator(".Toastify__toast", has_text=f"job {failing} (fails) failed")
        toast.wait_for(timeout=30_000)
        assert "3" in toast.inner_text()
        # its slide-in, for the screenshot (an animation cut short counts as ended)
        toast.evaluate("el => Promise.all(el.getAnimations().map(a => a.finished.catch(() => null)))")
        page.screenshot(path=str(tmp_path / "jupyterlab-sidebar-notification.png"))

        # one of the user's running jobs is stopped and requeued (its GPU booked for someone else from now)
        wait_state(page, booked_out, "running")
        gpu = {j["id"]: j for j in json.loads(daemon.cli("queue", "--json").stdout)}[booked_out]["gpu_ids"][0]
        booked = daemon.cli("reserve", "create", "--user", "nobody", "--gpu-ids", str(gpu), "--start", "now",
                            "--duration", "60s")
        assert booked.returncode == 0, booked.stderr
        toast = page.locator(".Toastify__toast", has_text=f"job {booked_out} (booked-out) stopped and requeued")
        toast.wait_for(timeout=30_000)
    finally:
        page.close()
    keep_screenshots(tmp_path)


@dataclass
class NobodysLab:
    """JupyterLab run by ``nobody`` against a root daemon."""

    daemon: Any
    server: subprocess.Popen
    base: str
    log: Path


@pytest.fixture(scope="module", autouse=True)
def nobodys_lab() -> Iterator[NobodysLab | None]:
    """Started with the module, so that it boots while the first test waits on the sidebar."""
    if os.geteuid() != 0 or not (LABEXTENSION / "package.json").exists():
        yield None  # the test that uses it skips, and says why
        return
    from daemon_harness import Daemon

    public = Path(tempfile.mkdtemp(prefix="es-lab-"))
    public.chmod(0o755)
    home = public / "home"
    home.mkdir()
    nobody = pwd.getpwnam("nobody")
    os.chown(home, nobody.pw_uid, nobody.pw_gid)
    socket = public / "eventsched.sock"
    port = free_port()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "EVENTSCHED_SOCKET": str(socket),
           "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTER_DATA_DIR": str(home / "data"),
           **{k: v for k, v in os.environ.items() if k == "EVENTSCHED_PURE"}}
    log = public / "server.log"
    server = subprocess.Popen(
        ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
         sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.root_dir={home}", f"--IdentityProvider.token={TOKEN}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, cwd=str(home), stdout=subprocess.DEVNULL, stderr=open(log, "wb"), start_new_session=True)
    daemon = Daemon(public / "state", gpus="fake:2", socket_path=socket)
    try:
        daemon.start()
        yield NobodysLab(daemon, server, f"http://127.0.0.1:{port}", log)
    finally:
        stop_group(server)
        daemon.stop()
        shutil.rmtree(public, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run Jupyter as another user")
def test_another_users_job_is_refused_through_the_server_extension(browser, nobodys_lab: NobodysLab | None,
                                                                   tmp_path: Path) -> None:
    """Jupyter run by ``nobody`` against a root daemon: the sidebar's cancel of
    root's job comes back as a one-line refusal in its row, and the job keeps running."""
    needs_labextension()
    assert nobodys_lab is not None
    daemon, server, log = nobodys_lab.daemon, nobodys_lab.server, nobodys_lab.log
    job = daemon.submit("--gpus", "1", "--name", "roots", "--", "sleep", "120")
    base = f"{nobodys_lab.base}/eventsched"

    def ask(path: str, method: str = "GET") -> dict:
        request = urllib.request.Request(f"{base}/{path}", method=method, data=b"" if method == "POST" else None,
                                         headers={"Authorization": f"token {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    deadline = time.monotonic() + 60
    while True:
        assert server.poll() is None, log.read_text()[-2000:]
        try:
            state = ask("state")
            break
        except OSError:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.3)
    assert state["user"] == "nobody" and [j["user"] for j in state["jobs"]] == ["root"], state
    refused = ask(f"jobs/{job}/cancel", "POST")
    assert refused["ok"] is False and refused["message"].startswith(f"job {job}: "), refused
    assert "\n" not in refused["message"]
    unread = ask(f"jobs/{job}/output")  # root's output is not nobody's to read
    assert unread["ok"] is False and "\n" not in unread["message"], unread
    assert daemon.wait_states([job], {"running"})[job]["state"] == "running"
    # without Jupyter's token: refused by Jupyter's own authentication
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(urllib.request.Request(f"{base}/jobs/{job}/cancel", method="POST", data=b""))
    assert denied.value.code == 403
    # the same from the sidebar in a browser: the refusal in the row, in one line
    page = open_sidebar(browser, nobodys_lab.base)
    try:
        page.wait_for_selector(f"{row(job)} button.es-side-cancel", timeout=30_000)
        page.click(f"{row(job)} button.es-side-cancel")
        page.wait_for_selector(f"{row(job)} .es-side-note", timeout=10_000)
        note = page.inner_text(f"{row(job)} .es-side-note").strip()
        assert note.startswith(f"job {job}: ") and "\n" not in note, note
        page.screenshot(path=str(tmp_path / "jupyterlab-sidebar-refusal.png"))
    finally:
        page.close()
    keep_screenshots(tmp_path)
    assert daemon.wait_states([job], {"running"})[job]["state"] == "running"
