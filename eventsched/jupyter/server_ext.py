"""The Jupyter server side of the JupyterLab sidebar: a few JSON handlers
under ``/eventsched/`` that ask the daemon over its socket.

It runs in the Jupyter server's process, so the daemon sees the user who runs
Jupyter and applies that user's rights; the sidebar belongs to no kernel and
keeps working while kernels restart or block. Enabled by
``labextension/jupyter-config/jupyter_server_config.d/eventsched.json`` (scripts/setup.sh
copies it into the venv).
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import threading
import time
from collections import deque
from typing import Any, Callable

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from eventsched.domain.units import format_duration
from eventsched.wire import protocol
from eventsched.wire.client import Client, ClientError
from eventsched.jupyter.widgets import job_note, read_tail

RECENT_ENDS = 20


class Ends:
    """The jobs that ended lately, found by comparing each poll's active jobs
    with the last one's: a job that left the active list is looked up once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: set[int] = set()
        self.high = -1  # the highest job id seen; -1 before the first poll
        self.recent: deque[dict] = deque(maxlen=RECENT_ENDS)

    def update(self, c: Client, jobs: list[dict]) -> list[dict]:
        with self.lock:
            ids = {j["id"] for j in jobs}
            top = max(ids, default=0)
            # jobs newer than the last poll, which may have ended before it saw them
            # (the first poll: a few just below the active ones)
            after = max(0, top - RECENT_ENDS) if self.high < 0 else self.high
            newer = c.request(protocol.ListJobs(all=True, after=after, limit=RECENT_ENDS * 5))["jobs"]
            for job in sorted(self.active - ids):  # left the active list since the last poll
                page = c.request(protocol.ListJobs(all=True, after=job - 1, limit=1))["jobs"]
                newer.extend(page[:1])
            for job in sorted(newer, key=lambda j: j.get("ended_at") or 0):
                if job["ended_at"] is not None and job["id"] not in ids:
                    self.recent.appendleft(job)
            self.active = ids
            self.high = max([self.high, top, *(j["id"] for j in newer)])
            return list(self.recent)


ENDS = Ends()


def forecast(job: dict, now: float) -> str:
    """A waiting job's forecast start as a range from now (``5m00s to 1h30m``)."""
    low, high = job.get("estimated_start_p10"), job.get("estimated_start_p90")
    if low is None or high is None:
        return ""
    return f"{format_duration(low - now)} to {format_duration(high - now)}"


def gpu_marks(gpu: dict[str, Any], running: list[dict[str, Any]]) -> list[str]:
    """What an operator looks for on a GPU: drained or paused, a job over its
    memory request, every job on it idle."""
    marks = [f"drained: {gpu['paused_reason']}" if gpu.get("paused_reason") else "paused"] if gpu.get("paused") else []
    on = [j for j in running if gpu["id"] in j.get("gpu_ids", ()) and (j.get("node") or "local") == (gpu.get("node") or "local")]
    if any(j.get("gpu_mem_over") for j in on):
        marks.append("over memory request")
    if on and all(j.get("idle_since") is not None for j in on):
        marks.append("idle")
    return marks


def snapshot(c: Client) -> dict[str, Any]:
    status = c.status()
    jobs = c.jobs()
    now = time.time()
    running = [j for j in jobs if j["state"] == "running"]
    for job in jobs:
        job["forecast"] = forecast(job, now) if job["state"] == "queued" else ""
        job["note"] = job_note(job, now) if job["state"] == "running" else ""
    for gpu in status["gpus"]:
        gpu["marks"] = gpu_marks(gpu, running)
    return {"user": pwd.getpwuid(os.geteuid()).pw_name, "gpus": status["gpus"], "jobs": jobs,
            "ended": ENDS.update(c, jobs), "now": now}


def output(c: Client, job: int) -> dict[str, Any]:
    """The last lines of a job's output, read as the user who runs Jupyter
    (the file's own permissions decide, as for ``eventsched logs``)."""
    path = c.log_path(job)
    if not os.access(path, os.R_OK):
        return {"ok": False, "message": f"job {job}: its output {path} cannot be read by you"}
    return {"ok": True, "text": read_tail(path) or "(no output yet)"}


def act(c: Client, job: int, action: str) -> dict[str, Any]:
    """cancel, hold or release one job; a refusal as one line."""
    if action == "cancel":
        refusals = c.cancel_each([job])["refused"]
        if refusals:
            return {"ok": False, "message": f"job {job}: {refusals[0]['reason']}"}
    else:
        getattr(c, action)([job])
    return {"ok": True, "message": f"job {job}: {action} done"}


def explain(c: Client, job: int) -> dict[str, Any]:
    from eventsched.projections.story import render_explanation

    return {"ok": True, "text": render_explanation(c.explain(job))}


class DaemonHandler(APIHandler):
    async def answer(self, ask: Callable[[Client], dict[str, Any]]) -> None:
        """``ask`` the daemon in a thread (the client blocks); a refusal or an
        absent daemon is a one-line message with ``ok: false``."""

        def run() -> dict[str, Any]:
            try:
                with Client(timeout=10.0) as c:
                    return ask(c)
            except ClientError as exc:
                return {"ok": False, "message": str(exc).splitlines()[0]}
            except OSError as exc:
                return {"ok": False, "message": f"the daemon could not be reached: {exc}"}

        self.finish(json.dumps(await asyncio.to_thread(run), default=str))


class StateHandler(DaemonHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        await self.answer(snapshot)


class ExplainHandler(DaemonHandler):
    @tornado.web.authenticated
    async def get(self, job: str) -> None:
        await self.answer(lambda c: explain(c, int(job)))


class OutputHandler(DaemonHandler):
    @tornado.web.authenticated
    async def get(self, job: str) -> None:
        await self.answer(lambda c: output(c, int(job)))


class ActionHandler(DaemonHandler):
    @tornado.web.authenticated
    async def post(self, job: str, action: str) -> None:
        await self.answer(lambda c: act(c, int(job), action))


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "eventsched.jupyter.server_ext"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    web_app = server_app.web_app
    base = url_path_join(web_app.settings["base_url"], "eventsched")
    web_app.add_handlers(".*$", [
        (url_path_join(base, "state"), StateHandler),
        (url_path_join(base, r"jobs/(\d{1,18})/explain"), ExplainHandler),
        (url_path_join(base, r"jobs/(\d{1,18})/output"), OutputHandler),
        (url_path_join(base, r"jobs/(\d{1,18})/(cancel|hold|release)"), ActionHandler),
    ])
