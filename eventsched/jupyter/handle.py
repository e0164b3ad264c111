"""What the magics return: a job handle and small result tables. Each renders
as HTML and as text, reading the daemon when displayed (its state *now*); in a
live kernel a handle's display is also a widget the panel's thread keeps current.
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any, Sequence

from eventsched.domain.states import FINAL
from eventsched.jupyter.whatif import Alternatives, Rows, alternatives_of, job_whatif
from eventsched.jupyter.widgets import (STATE_COLOURS, existing_watcher, render_explanation_html, render_jobs_html,
                                        render_jobs_text, watcher_for)
from eventsched.wire.client import Client, read_new_output

__all__ = ["JobHandle", "JobTable", "LogText", "Message", "Explanation"]


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class LogText(str):
    """A job's output: a ``str`` that notebooks show as preformatted text."""

    def _repr_html_(self) -> str:
        return f"<pre style='max-height:30em;overflow:auto'>{html.escape(self)}</pre>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


class Message:
    """A one-line outcome (daemon started, jobs cancelled...)."""

    def __init__(self, text: str, **data: Any) -> None:
        self.text, self.data = text, data

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return f"<p class='es-message'>{html.escape(self.text)}</p>"


class JobTable(Rows):
    """A list of jobs (``queue --json`` shape)."""

    def __init__(self, jobs: list[dict[str, Any]], empty: str = "no jobs") -> None:
        self.jobs = self.rows = jobs
        self.empty = empty

    def __repr__(self) -> str:
        return render_jobs_text(self.jobs, time.time(), self.empty)

    def _repr_html_(self) -> str:
        return render_jobs_html(self.jobs, time.time(), self.empty)


class Explanation:
    """A job's ``explain``: ``.reason`` (a dict, or None), ``.story`` (a list of
    dicts, one per event); shown as text or as an HTML list in a notebook."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        self.reason: dict[str, Any] | None = info["reason"]
        self.story: list[dict[str, Any]] = info["story"]

    def __repr__(self) -> str:
        from eventsched.projections.story import render_explanation

        return render_explanation(self.info)

    def _repr_html_(self) -> str:
        return render_explanation_html(self.info)


class JobHandle:
    """One submitted job. ``state``, ``info()``, ``wait()``, ``logs()``, ``cancel()``."""

    def __init__(self, job_id: int, socket_path: str | Path) -> None:
        self.id, self.socket_path = int(job_id), Path(socket_path)

    def info(self) -> dict[str, Any]:
        """The job as ``eventsched queue --json --all`` shows it."""
        with Client(self.socket_path) as c:
            for job in c.jobs(all=True):
                if job["id"] == self.id:
                    return job
        raise LookupError(f"the daemon knows no job {self.id}")

    @property
    def state(self) -> str:
        return self.info()["state"]

    def wait(self, timeout: float | None = None, poll: float = 0.2) -> str:
        """Block until the job has finished; return its final state (``TimeoutError``
        after ``timeout`` seconds; an interrupt stops the waiting, not the job)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (state := self.state) not in FINAL:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id} is still {state} after {timeout:g}s")
            time.sleep(poll)
        if (watcher := existing_watcher(self.socket_path)) is not None:
            watcher.settle(self.id)
        return state

    def log_path(self) -> str:
        with Client(self.socket_path) as c:
            return c.log_path(self.id)

    def logs(self, tail: int | None = None) -> LogText:
        """The job's output so far (the last ``tail`` lines if given)."""
        try:
            text = Path(self.log_path()).read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            text = ""
        if tail is not None:
            text = "\n".join(text.splitlines()[-tail:])
        return LogText(text)

    def follow(self, poll: float = 0.1) -> str:
        """Print the output as it comes until the job ends; interrupt to detach."""
        path, position = self.log_path(), 0
        try:
            while True:
                state = self.state
                chunk = read_new_output(path, position)
                if chunk:
                    position += len(chunk)
                    print(chunk.decode("utf-8", "replace"), end="", flush=True)
                if state in FINAL:
                    return state
                time.sleep(poll)
        except KeyboardInterrupt:
            print(f"\ndetached; job {self.id} keeps running")
            return self.state

    def explain(self) -> "Explanation":
        """Why the job waits (``.reason``) and its story (``.story``), as ``eventsched explain``."""
        with Client(self.socket_path) as c:
            return Explanation(c.explain(self.id))

    def whatif(self, gpus: float | Sequence[float] = (), gpu_mem: int | Sequence[int] = ()) -> Alternatives:
        """When this queued job would start had it asked for ``gpus`` GPUs and/or
        ``gpu_mem`` MiB (one value or several), beside its own request."""
        return job_whatif(self.socket_path, self.id, alternatives_of(gpus, gpu_mem))

    def cancel(self) -> "JobHandle":
        with Client(self.socket_path) as c:
            c.cancel([self.id])
        return self

    def _summary(self, job: dict[str, Any] | None) -> tuple[str, str]:
        if job is None:
            return "unknown", f"job {self.id}"
        where = f" on GPU {','.join(map(str, job['gpu_ids']))}" if job.get("gpu_ids") else ""
        exit_code = "" if job.get("exit_code") is None else f", exit {job['exit_code']}"
        return job["state"], f"job {self.id} {job.get('name', '')}: {job['state']}{where}{exit_code}"

    def _current(self) -> dict[str, Any] | None:
        try:
            return self.info()
        except Exception:  # a repr must never raise
            return None

    def __repr__(self) -> str:
        return f"<JobHandle {self._summary(self._current())[1]}>"

    def _html(self, state: str, text: str) -> str:
        colour = STATE_COLOURS.get(state, "#000")
        return (f"<span class='es-handle' data-job='{self.id}' data-state='{state}'>"
                f"<b style='color:{colour}'>●</b> {html.escape(text)}</span>")

    def _repr_html_(self) -> str:
        return self._html(*self._summary(self._current()))

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        state, text = self._summary(self._current())
        data: dict[str, Any] = {"text/plain": f"<JobHandle {text}>", "text/html": self._html(state, text)}
        if _in_kernel():
            data.update(self._live_view())
        return data

    def _live_view(self) -> dict[str, Any]:
        """A widget kept current by the panel's thread (only in a live kernel)."""
        import ipywidgets as w

        view = w.HTML(value=self._repr_html_())

        def update(model: Any) -> None:
            job = model.jobs.get(self.id)
            if job is not None:
                value = self._html(*self._summary(job))
                if value != view.value:
                    view.value = value

        watcher_for(self.socket_path).add_listener(update)
        return {k: v for k, v in view._repr_mimebundle_().items() if k != "text/plain"}
