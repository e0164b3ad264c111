"""The Jupyter server side of the JupyterLab sidebar: JSON handlers under
``/eventsched/`` that ask the daemon over its socket, and one thread following
its event stream for the jobs that end. It runs in the Jupyter server's process,
so the daemon applies the rights of the user who runs Jupyter, and the sidebar
keeps working while kernels restart or block. Enabled by
``labextension/jupyter-config/jupyter_server_config.d/eventsched.json``.
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

from eventsched.domain import events as ev
from eventsched.domain.states import FINAL
from eventsched.domain.units import format_duration
from eventsched.wire import protocol
from eventsched.wire.client import Client, ClientError
from eventsched.jupyter.widgets import job_note, read_tail

RECENT_ENDS = 20


class Ends:
    """The jobs that ended lately, from one thread following the event stream:
    a job that starts and ends between two polls of the sidebar is still seen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.recent: deque[dict] = deque(maxlen=RECENT_ENDS)
        self.thread: threading.Thread | None = None

    def follow(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="eventsched-ends", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        seq = 0  # 0: from now on; after a break, from where it stopped
        while True:
            try:
                with Client(timeout=10.0) as c:
                    for batch in c.subscribe(seq + 1 if seq else 0):
                        ended = {e.job for e in batch if isinstance(e, STOPS)}
                        seq = max([seq, *(e.seq for e in batch)])
                        for job in sorted(ended):
                            page = c.request(protocol.ListJobs(all=True, after=job - 1, limit=1))["jobs"]
                            if page and page[0]["id"] == job and page[0]["state"] in FINAL:  # not requeued
                                with self.lock:
                                    self.recent.appendleft(page[0])
            except (ClientError, OSError):
                pass  # no daemon yet, or it restarted: follow again
            time.sleep(1.0)

    def latest(self) -> list[dict]:
        with self.lock:
            return list(self.recent)


STOPS = (ev.JobExited, ev.JobCancelled, ev.JobLost)  # a run stopped: the job may have ended
ENDS = Ends()


def forecast(job: dict, now: float) -> str:
    """A waiting job's forecast start as a range from now (``5m00s to 1h30m``)."""
    low, high = job.get("estimated_start_p10"), job.get("estimated_start_p90")
    if low is None or high is None:
        return ""
    return f"{format_duration(low - now)} to {format_duration(high - now)}"


def gpu_marks(gpu: dict[str, Any], running: list[dict[str, Any]]) -> list[str]:
    """What an operator looks for on a GPU: drained or paused, a job over its memory request, all idle."""
    marks = [f"drained: {gpu['paused_reason']}" if gpu.get("paused_reason") else "paused"] if gpu.get("paused") else []
    on = [j for j in running if gpu["id"] in j.get("gpu_ids", ()) and (j.get("node") or "local") == (gpu.get("node") or "local")]
    if any(j.get("gpu_mem_over") for j in on):
        marks.append("over memory request")
    if on and all(j.get("idle_since") is not None for j in on):
        marks.append("idle")
    return marks


def snapshot(c: Client) -> dict[str, Any]:
    ENDS.follow()
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
            "ended": ENDS.latest(), "now": now}


def output(c: Client, job: int) -> dict[str, Any]:
    """The last lines of a job's output, read as the user who runs Jupyter (the file's permissions decide)."""
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
    """The route's ``ask(client, job, ...)`` of the daemon, as JSON."""

    def initialize(self, ask: Callable[..., dict[str, Any]]) -> None:
        self.ask = ask

    async def answer(self, job: str | None, *more: str) -> None:
        """Ask the daemon in a thread (the client blocks); a refusal is one line with ``ok: false``."""
        parts: tuple[Any, ...] = () if job is None else (int(job), *more)

        def run() -> dict[str, Any]:
            try:
                with Client(timeout=10.0) as c:
                    return self.ask(c, *parts)
            except ClientError as exc:
                return {"ok": False, "message": str(exc).splitlines()[0]}
            except OSError as exc:
                return {"ok": False, "message": f"the daemon could not be reached: {exc}"}

        self.finish(json.dumps(await asyncio.to_thread(run), default=str))


class ReadHandler(DaemonHandler):
    @tornado.web.authenticated
    async def get(self, job: str | None = None) -> None:
        await self.answer(job)


class ActionHandler(DaemonHandler):
    @tornado.web.authenticated
    async def post(self, job: str, action: str) -> None:
        await self.answer(job, action)


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "eventsched.jupyter.server_ext"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    web_app = server_app.web_app
    base = url_path_join(web_app.settings["base_url"], "eventsched")
    web_app.add_handlers(".*$", [
        (url_path_join(base, "state"), ReadHandler, {"ask": snapshot}),
        (url_path_join(base, r"jobs/(\d{1,18})/explain"), ReadHandler, {"ask": explain}),
        (url_path_join(base, r"jobs/(\d{1,18})/output"), ReadHandler, {"ask": output}),
        (url_path_join(base, r"jobs/(\d{1,18})/(cancel|hold|release)"), ActionHandler, {"ask": act}),
    ])
