"""What-if in one line, for a notebook: ``whatif`` replays a history under each
policy by the very path of ``eventsched replay`` and charts the comparison;
``job_whatif`` asks the daemon when a queued job would start had it asked for
other resources.
"""

from __future__ import annotations

import contextlib
import html
import io
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import msgspec

from eventsched.domain.text import table as aligned
from eventsched.domain.units import UnitError, format_duration, parse_duration

__all__ = ["whatif", "Comparison", "job_whatif", "Alternatives", "in_window", "Rows"]

DEFAULT_POLICIES = ("fifo", "best-fit", "sjf-backfill")
CHART = (("mean_wait_s", "mean wait"), ("p95_wait_s", "p95 wait"), ("makespan_s", "makespan"))
UNITS = (("h", 3600.0), ("min", 60.0), ("s", 1.0))


def in_window(events: Iterable[Any], since_s: float) -> list[Any]:
    """The events of the jobs submitted in the ``since_s`` seconds up to the
    last submission (and every event of no job: GPUs, daemon starts)."""
    from eventsched.domain import events as ev

    events = list(events)
    submitted = [e for e in events if type(e) is ev.JobSubmitted]
    if not submitted:
        return events
    cutoff = max(e.ts for e in submitted) - since_s
    early = {e.job for e in submitted if e.ts < cutoff}
    return [e for e in events if getattr(e, "job", None) not in early]


def whatif(policies: Sequence[str] = DEFAULT_POLICIES, config: str | os.PathLike[str] | None = None,
           source: str | os.PathLike[str] | None = None, since: str | float | None = None, *,
           gpus: str | None = None, nodes: int = 1, out: str | os.PathLike[str] | None = None,
           chart: bool = True) -> Comparison:
    """Replay ``source`` (default: your daemon's state directory; or a CSV, a
    log or state directory) under each policy (``recorded``: as the log was
    made) with the ``[scheduler]``/``[tenants]`` of ``config``; ``since``
    (``7d``, or seconds) measures only the jobs submitted in that window before
    the last submission (earlier jobs still run and take GPUs); ``gpus``
    (``fake:8``) gives a CSV a machine. Draws the chart in IPython; a source,
    policy or config that cannot be used raises ``ValueError``."""
    from eventsched.cli.replay import replay_table
    from eventsched.domain.paths import default_state_dir
    from eventsched.sim.whatif import metrics_from_events
    from eventsched.storage import log as eventlog

    if isinstance(policies, str):
        policies = [policies]
    if not policies:
        raise ValueError("name at least one policy, e.g. policies=['best-fit', 'fair-share']")
    window = None if since is None else float(since) if isinstance(since, (int, float)) else _window(since)
    with contextlib.ExitStack() as stack:  # without ``out``, the replays' logs go once read
        where = Path(out) if out is not None else stack.enter_context(tempfile.TemporaryDirectory(
            prefix="eventsched-whatif-", ignore_cleanup_errors=True))
        table = replay_table(str(source or default_state_dir()), list(policies),
                             config=None if config is None else str(config), gpus=gpus, nodes=nodes, out=str(where))
        if window is not None:  # the same rows, measured over the window's jobs only
            for row in table["replays"]:
                row.update(msgspec.to_builtins(metrics_from_events(in_window(eventlog.read(row["log"]), window))))
            table["since_s"] = window
    table["out"] = None if out is None else str(out)
    result = Comparison(table)
    if chart:
        result.show_chart()
    return result


def _window(text: str) -> float:
    try:
        return parse_duration(text)
    except UnitError:
        raise ValueError(f"--since {text!r}: give a window like 7d, 12h or 90m") from None


def _time_unit(seconds: float) -> tuple[str, float]:
    """The unit a chart of times up to ``seconds`` reads best in."""
    return next(((u, size) for u, size in UNITS if seconds >= 3 * size), UNITS[-1])


class Rows:
    """A result table: ``rows`` (one dict each), as a sequence; ``.to_dataframe()`` for pandas."""

    rows: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def to_dataframe(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.rows)


class Comparison(Rows):
    """The what-if table: ``rows`` (one dict per policy, the recording first),
    ``table`` (``eventsched replay --json``'s whole answer)."""

    def __init__(self, table: dict[str, Any]) -> None:
        self.table = table
        self.rows = table["replays"]

    def row(self, policy: str) -> dict[str, Any]:
        return next(r for r in self.rows if r["policy"] == policy)

    def to_dataframe(self) -> Any:
        """One row per policy (the index), the metrics as numbers (seconds, shares)."""
        import pandas as pd

        from eventsched.sim.whatif import ROWS

        keys = [k for k, _, _ in ROWS]
        return pd.DataFrame([{k: r.get(k) for k in keys} for r in self.rows],
                            index=pd.Index([r["policy"] for r in self.rows], name="policy"))

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        from eventsched.sim.whatif import ROWS, _fmt

        return ([""] + [str(r["policy"]) for r in self.rows],
                [[label, *(_fmt(r.get(key), how) for r in self.rows)] for key, label, how in ROWS])

    def _window(self) -> str:
        since = self.table.get("since_s")
        return "" if since is None else f" (jobs of the last {format_duration(since, 'span')})"

    def _title(self) -> str:
        return f"replay of {self.table.get('source', '')}{self._window()}"

    def __repr__(self) -> str:
        from eventsched.sim.whatif import format_comparison

        lines = format_comparison(self.table).split("\n")  # as `eventsched replay` prints it
        return "\n".join([self._title(), *lines[1:]])

    def _repr_html_(self) -> str:
        head, rows = self._cells()
        th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        body = "".join("<tr><th style='text-align:left'>" + html.escape(r[0]) + "</th>"
                       + "".join(f"<td>{html.escape(c)}</td>" for c in r[1:]) + "</tr>" for r in rows)
        notes = "".join(f"<p><i>note: {html.escape(n)}</i></p>" for n in self.table.get("notes", []))
        return (f"<div class='es-whatif'><p>{html.escape(self._title())}</p><table><thead><tr>{th}</tr></thead>"
                f"<tbody>{body}</tbody></table>{notes}</div>")

    def figure(self) -> Any:
        """Mean wait, p95 wait and makespan per policy, as a Figure of its own (pyplot's state is left alone)."""
        from matplotlib.figure import Figure

        unit, size = _time_unit(max((float(r.get(k) or 0) for r in self.rows for k, _ in CHART), default=0.0))
        names = [str(r["policy"]) for r in self.rows]
        fig = Figure(figsize=(10, 0.45 * len(names) + 1.4))
        axes = fig.subplots(1, len(CHART), sharey=True)
        colours = ["tab:gray" if n == "as recorded" else f"C{i}" for i, n in enumerate(names)]
        for ax, (key, label) in zip(axes, CHART):
            ax.barh(names, [float(r.get(key) or 0) / size for r in self.rows], color=colours)
            ax.set(title=label, xlabel=unit)
        axes[0].invert_yaxis()  # first row on top, as in the table
        fig.suptitle(f"lower is better{self._window()}", fontsize=10)
        fig.tight_layout()
        return fig

    def chart_png(self) -> bytes:
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png", dpi=80)
        return buf.getvalue()

    def show_chart(self) -> None:
        try:
            from IPython import get_ipython
            from IPython.display import Image, display
        except ImportError:
            return
        if get_ipython() is not None:
            display(Image(data=self.chart_png(), format="png"))


# --- one job: when would it start had it asked for less? ---------------------------


def _request_text(gpus: float, mem_mib: int) -> str:
    from eventsched.domain.report_card import gb

    return f"{gpus:g} GPU{'s' if gpus != 1 else ''}" + (f", {gb(mem_mib)} each" if mem_mib else "")


def alternatives_of(gpus: float | Sequence[float] = (),
                    gpu_mem: int | Sequence[int] = ()) -> list[tuple[float | None, int | None]]:
    """Each GPU count alone, each memory alone, and (both given) each pair."""
    gpus = [gpus] if isinstance(gpus, (int, float)) else list(gpus)
    gpu_mem = [gpu_mem] if isinstance(gpu_mem, int) else list(gpu_mem)
    pairs: list[tuple[float | None, int | None]] = [(g, None) for g in gpus] + [(None, m) for m in gpu_mem]
    pairs += [(g, m) for g in gpus for m in gpu_mem]
    return list(dict.fromkeys(pairs))


class Alternatives(Rows):
    """A queued job's forecast start under its own request (the first row) and each alternative."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.job, self.made_at = answer["job"], answer["made_at"]
        self.assumptions: str = answer.get("assumptions", "")
        self.rows = answer["alternatives"]
        for i, r in enumerate(self.rows):
            r["request"] = _request_text(r["gpus"], r["gpu_mem_mib"]) + (" (as asked)" if i == 0 else "")

    def _cells(self) -> list[list[str]]:
        return [[r["request"], r["text"]] for r in self.rows]

    def __repr__(self) -> str:
        return "\n".join([f"job {self.job}: when would it start?", aligned(["REQUEST", "STARTS"], self._cells()),
                          f"({self.assumptions})"])

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td></tr>" for a, b in self._cells())
        return (f"<div class='es-job-whatif' data-job='{self.job}'><p>job {self.job}: when would it start?</p>"
                f"<table><thead><tr><th>request</th><th>starts</th></tr></thead><tbody>{body}</tbody></table>"
                f"<p><i>{html.escape(self.assumptions)}</i></p></div>")

    def wait_s(self, i: int) -> float:
        """The forecast wait of row ``i`` from when it was made (inf: beyond the forecast)."""
        start = self.rows[i]["estimated_start"]
        return math.inf if start is None else max(0.0, start - self.made_at)


def job_whatif(socket_path: str | os.PathLike[str], job: int,
               alternatives: Sequence[tuple[float | None, int | None]]) -> Alternatives:
    """Ask the daemon for ``job``'s forecast under each (GPUs, GPU memory MiB)."""
    from eventsched.wire import protocol
    from eventsched.wire.client import Client

    if not alternatives:
        raise ValueError("give another request to compare with: gpus=... and/or gpu_mem=... (MiB)")
    asked = [protocol.Alternative(gpus=None if g is None else float(g), gpu_mem_mib=None if m is None else int(m))
             for g, m in alternatives]
    with Client(Path(socket_path)) as c:
        return Alternatives(c.request(protocol.ForecastAlternatives(job=int(job), alternatives=asked)))
