"""The live status panel: a client-side fold of the daemon's event stream.

``PanelModel`` is seeded from one ``status()`` snapshot (which carries its log
sequence) and folds every later event, so nothing is missed or counted twice.
One ``Watcher`` thread per socket folds and calls listeners, which only set
widget values: the kernel's event loop is never touched (no nest_asyncio), so
the panel moves while a cell blocks, and every widget is made on the kernel's
thread (the job rows are fixed slots the watcher fills or hides).
"""

from __future__ import annotations

import functools
import html
import itertools
import threading
import time
from pathlib import Path
from typing import Any, Callable

from eventsched.core.forecast import describe
from eventsched.domain import events as ev
from eventsched.domain.states import ACTIVE, FINAL, TRANSITIONS, WAITING, IllegalTransition, JobState, move
from eventsched.domain.text import table
from eventsched.domain.units import format_duration as human_duration, format_gpu_time

__all__ = ["PanelModel", "Watcher", "StatusPanel", "watcher_for", "render_jobs_html", "render_jobs_text",
           "render_history_html"]

RECENT_FINISHED = 10  # finished jobs the panel keeps showing
ROW_SLOTS = 40  # job rows with buttons, made up front: the watcher's thread only fills them
ACTIONS = ("cancel", "hold", "release", "explain")
TAIL_LINES = 20
THROTTLE_S = 0.2  # widget redraws at most this often; the last change always lands

STATE_COLOURS = {"running": "#2e7d32", "queued": "#1565c0", "held": "#6a1b9a", "succeeded": "#555",
                 "failed": "#c62828", "cancelled": "#8d6e63", "preempted": "#ef6c00", "lost": "#c62828"}


def _share(job: dict[str, Any]) -> float:
    """The share of each assigned GPU a running job holds."""
    if "share" in job:
        return float(job["share"])
    gpus = float(job.get("gpus") or 0)
    return gpus if 0 < gpus < 1 else 1.0


GpuKey = tuple[str, int]  # (node, GPU id): ids repeat across nodes


def gpu_label(key: GpuKey, several_nodes: bool) -> str:
    """``GPU 2`` on one machine, ``node-b:2`` once GPUs are on several nodes."""
    node, gid = key
    return f"{node}:{gid}" if several_nodes else f"GPU {gid}"


class PanelModel:
    """GPUs and jobs as the panel shows them; changed only by ``fold``."""

    def __init__(self) -> None:
        self.gpus: dict[GpuKey, dict[str, Any]] = {}
        self.jobs: dict[int, dict[str, Any]] = {}
        # a cluster's nodes: as the daemon said on connecting (up, down, fenced, lost), then joined or left
        self.node_states: dict[str, str] = {}
        self.policy, self.seq, self.connected, self.error = "", 0, False, ""
        self.bookings_seq = 0  # the last reservation made or cancelled

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> PanelModel:
        model = cls()
        model.gpus = {(str(g.get("node") or "local"), int(g["id"])): dict(g) for g in status.get("gpus", [])}
        model.jobs = {int(j["id"]): dict(j) for j in status.get("jobs", [])}
        model.node_states = {n["name"]: n["state"] for n in status.get("nodes", []) if n.get("state")}
        model.policy, model.seq, model.connected = status.get("policy", ""), int(status.get("seq", 0)), True
        return model

    # views used by renderers
    def several_nodes(self) -> bool:
        return len({node for node, _ in self.gpus}) > 1

    def by_node(self) -> list[tuple[str, list[tuple[GpuKey, dict[str, Any]]]]]:
        """The GPUs grouped by node, nodes and ids in order."""
        return [(node, list(gpus)) for node, gpus in itertools.groupby(sorted(self.gpus.items()), lambda kv: kv[0][0])]

    def node_state(self, node: str) -> str:
        """As ``eventsched nodes`` says it; ``draining`` when every usable GPU is paused."""
        state = self.node_states.get(node, "up")
        usable = [g for (n, _), g in self.gpus.items() if n == node and not g.get("lost")]
        return "draining" if state == "up" and usable and all(g.get("paused") for g in usable) else state

    def running(self) -> list[dict[str, Any]]:
        return sorted((j for j in self.jobs.values() if j["state"] == JobState.RUNNING), key=lambda j: j["id"])

    def queued(self) -> list[dict[str, Any]]:
        waiting = [j for j in self.jobs.values() if j["state"] in WAITING]
        return sorted(waiting, key=lambda j: (j["state"] != JobState.QUEUED, -j.get("priority", 0), j["id"]))

    def finished(self) -> list[dict[str, Any]]:
        done = [j for j in self.jobs.values() if j["state"] not in ACTIVE]
        return sorted(done, key=lambda j: -j["id"])[:RECENT_FINISHED]

    def fold(self, events: list[ev.Event]) -> None:
        for event in events:
            if event.seq and event.seq <= self.seq:
                continue  # already in the snapshot
            handler = _HANDLERS.get(type(event))
            if handler is not None:
                handler(self, event)
            self.seq = max(self.seq, event.seq)
        self._allocate()
        self._forget_old()

    def _allocate(self) -> None:
        on_gpu: dict[GpuKey, list[dict[str, Any]]] = {key: [] for key in self.gpus}
        for job in self.running():
            node = str(job.get("node") or "local")
            for gid in job.get("gpu_ids", []):
                if (node, gid) in on_gpu:
                    on_gpu[(node, gid)].append(job)
        for key, gpu in self.gpus.items():
            on = on_gpu[key]
            gpu.update(allocated=round(min(sum(map(_share, on), 0.0), 1.0), 3), jobs=[j["id"] for j in on])

    def _forget_old(self) -> None:
        done = sorted(j["id"] for j in self.jobs.values() if j["state"] not in ACTIVE)
        for job_id in done[:-RECENT_FINISHED]:
            del self.jobs[job_id]


def _gpu(model: PanelModel, node: str, gpu: int) -> dict[str, Any]:
    return model.gpus.setdefault(
        (node, gpu),
        {"id": gpu, "node": node, "allocated": 0.0, "paused": False, "lost": False, "utilization": None,
         "memory_used_mib": 0, "memory_total_mib": 0, "temperature_c": None, "jobs": []},
    )


def _on_job_submitted(m: PanelModel, e: ev.JobSubmitted) -> None:
    s = e.spec
    m.jobs[e.job] = {
        "id": e.job, "name": s.name or (s.command[0] if s.command else ""), "user": s.user,
        "state": "queued", "priority": s.priority, "gpus": s.gpus, "gpu_ids": [],
        "submitted_at": e.ts, "started_at": None, "ended_at": None, "exit_code": None,
        "command": list(s.command),
    }


# what each job event changes besides the state, once the table has allowed it
_JOB_DETAILS: dict[type, Callable[[dict[str, Any], Any], None]] = {
    ev.JobPlaced: lambda j, e: j.update(
        node=e.node, gpu_ids=list(e.gpu_ids), share=e.share, started_at=e.ts, ended_at=None, exit_code=None,
        cancel_reason="", gpu_mem_over=False, idle_since=None, estimated_start=None),
    ev.JobStarted: lambda j, e: j.update(pid=e.pid, started_at=e.ts, **({"log_path": e.log_path} if e.log_path else {})),
    # an ended job keeps where it ran (only running jobs fill the GPU bars)
    ev.JobExited: lambda j, e: j.update(exit_code=e.exit_code, ended_at=e.ts),
    ev.JobCancelRequested: lambda j, e: j.update(cancel_reason=e.reason),
    **dict.fromkeys((ev.JobCancelled, ev.JobLost), lambda j, e: j.update(ended_at=e.ts)),
    ev.JobRequeued: lambda j, e: j.update(gpu_ids=[], ended_at=None),
    # over its --gpu-mem or back within it; allocated but idle since when (None: busy)
    ev.JobGpuMemoryExceeded: lambda j, e: j.update(gpu_mem_over=True, gpu_mem_used_mib=e.used_mib),
    ev.JobGpuMemoryWithin: lambda j, e: j.update(gpu_mem_over=False, gpu_mem_used_mib=e.used_mib),
    ev.JobIdle: lambda j, e: j.update(idle_since=e.since),
    ev.JobBusy: lambda j, e: j.update(idle_since=None),
    ev.JobUpdated: lambda j, e: j.update({k: v for k, v in e.changes().items() if k != "time_limit_s"}),
}


def _on_job_event(m: PanelModel, e: Any) -> None:
    """Move the job by the one table; an event that does not fit its state is
    ignored, as the projection refuses it."""
    j = m.jobs.get(e.job)
    if j is None:
        return
    try:
        j["state"] = str(move(j["state"], e, j.get("cancel_reason", "")))
    except IllegalTransition:
        return
    details = _JOB_DETAILS.get(type(e))
    if details is not None:
        details(j, e)


_HANDLERS: dict[type, Callable[[PanelModel, Any], None]] = {
    **dict.fromkeys((ev.DaemonStarted, ev.PolicyChanged), lambda m, e: setattr(m, "policy", e.policy)),
    ev.GpuDiscovered: lambda m, e: _gpu(m, e.node, e.gpu).update(
        memory_total_mib=e.memory_total_mib, model=e.model, lost=False),
    ev.GpuSampled: lambda m, e: _gpu(m, e.node, e.gpu).update(
        utilization=e.utilization, memory_used_mib=e.memory_used_mib, memory_total_mib=e.memory_total_mib,
        temperature_c=e.temperature_c, foreign_processes=[
            {"pid": p.pid, "user": p.user or str(p.uid), "used_mib": p.used_mib} for p in e.foreign_processes]),
    ev.GpuErrored: lambda m, e: m.gpus[(e.node, e.gpu)].update(lost=True) if e.lost and (e.node, e.gpu) in m.gpus else None,
    ev.GpuPaused: lambda m, e: _gpu(m, e.node, e.gpu).update(paused=True, paused_reason=e.reason),
    ev.GpuResumed: lambda m, e: _gpu(m, e.node, e.gpu).update(paused=False, paused_reason=""),
    # the bookings are drawn from the daemon's list: an event only says it changed
    **dict.fromkeys((ev.ReservationCreated, ev.ReservationCancelled), lambda m, e: setattr(m, "bookings_seq", e.seq)),
    ev.JobSubmitted: _on_job_submitted,
    # a forecast shown (by ``explain``), keyed as ``queue --json`` gives one
    ev.JobForecast: lambda m, e: m.jobs[e.job].update(estimated_start=e.estimated_start, estimated_start_p10=e.p10,
                                                      estimated_start_p90=e.p90) if e.job in m.jobs else None,
    **{event_type: _on_job_event for _, event_type in TRANSITIONS},
    ev.NodeJoined: lambda m, e: m.node_states.__setitem__(e.node, "up"),
    ev.NodeLeft: lambda m, e: m.node_states.__setitem__(e.node, "down"),
}


def first_line(exc: BaseException) -> str:
    """An error as one line (its type's name where it says nothing)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _fmt(value: Any, unit: str = "", digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def _elapsed(job: dict[str, Any], now: float) -> str:
    if job["state"] in WAITING:
        start, end = job.get("submitted_at"), now
    else:
        start, end = job.get("started_at"), job.get("ended_at") or now
    return "" if start is None else human_duration(end - start)


def mib_text(mib: float) -> str:
    """``512 MiB``, ``7.8 GiB``: GPU memory for a person."""
    return f"{mib:.0f} MiB" if mib < 1024 else f"{mib / 1024:.1f} GiB"


def gpu_line(gpu: dict[str, Any]) -> str:
    reason = gpu.get("paused_reason")
    flags = (f" DRAINED: {reason}" if reason else " PAUSED") if gpu.get("paused") else ""
    flags += " LOST" if gpu.get("lost") else ""
    # memory held by processes of no job, and whose
    flags += "".join(f" · {p['user']} (pid {p['pid']}) holds {mib_text(p['used_mib'])}"
                     for p in gpu.get("foreign_processes") or ())
    return (
        f"alloc {gpu.get('allocated', 0):.2f} · util {_fmt(gpu.get('utilization'), '%')} · "
        f"mem {mib_text(gpu.get('memory_used_mib') or 0)} of {mib_text(gpu.get('memory_total_mib') or 0)} · "
        f"{_fmt(gpu.get('temperature_c'), '°C')}{flags}"
    )


JOB_COLUMNS = ["ID", "NAME", "STATE", "GPUS", "ON", "TIME", "EXIT", "NOTE"]


def job_note(job: dict[str, Any], now: float) -> str:
    """A running job's GPU memory overrun and idleness; a queued one's forecast start, as ``explain`` says."""
    if job.get("state") == "queued" and job.get("estimated_start") is not None:
        return "starts " + describe(job["estimated_start"], now, job.get("estimated_start_p10"),
                                    job.get("estimated_start_p90"))
    if job.get("state") != "running":
        return ""
    notes = []
    if job.get("gpu_mem_over"):
        notes.append(f"GPU mem over request ({job.get('gpu_mem_used_mib', job.get('gpu_mem_peak_mib', 0))} MiB)")
    if job.get("idle_since") is not None:
        notes.append(f"idle {human_duration(max(0.0, now - job['idle_since']))}")
    return "; ".join(notes)


def _where(job: dict[str, Any]) -> str:
    """Its GPUs, ``gpu-b:0,1`` on a cluster's node: kept once the job has ended."""
    ids = ",".join(map(str, job.get("gpu_ids") or []))
    node = job.get("node") or ""
    return (f"{node}:{ids}" if node not in ("", "local") else ids) if ids else "-"


def _job_cells(job: dict[str, Any], now: float) -> list[str]:
    exit_code = job.get("exit_code")
    return [
        str(job["id"]), str(job.get("name", ""))[:32], job["state"], f"{float(job.get('gpus', 0)):g}",
        _where(job), _elapsed(job, now),
        "" if exit_code is None else str(exit_code), job_note(job, now),
    ]


def _empty_html(text: str) -> str:
    return f"<p class='es-empty'><i>{html.escape(text)}</i></p>"


def _head_html(widths: tuple[int, ...] = ()) -> str:
    return "".join(f"<th style='text-align:left;padding:0 8px{f';width:{widths[i]}px' if widths else ''}'>{c}</th>"
                   for i, c in enumerate(JOB_COLUMNS))


def render_jobs_html(jobs: list[dict[str, Any]], now: float, empty: str = "no jobs") -> str:
    if not jobs:
        return _empty_html(empty)
    rows = "".join(job_row_html(job, now) for job in jobs)
    return f"<table class='es-jobs'><thead><tr>{_head_html()}</tr></thead><tbody>{rows}</tbody></table>"


# fixed column widths (px) where a job's row stands alone, as beside its buttons
SLOT_WIDTHS = (48, 150, 80, 44, 48, 64, 40, 260)


def job_row_html(job: dict[str, Any], now: float, widths: tuple[int, ...] = ()) -> str:
    colour = STATE_COLOURS.get(job["state"], "#000")
    tds = "".join(f"<td style='padding:0 8px;{f'width:{widths[i]}px;' if widths else ''}"
                  f"{'color:' + colour + ';font-weight:bold' if i == 2 else ''}'>"
                  f"{html.escape(c)}</td>" for i, c in enumerate(_job_cells(job, now)))
    return f"<tr class='es-job es-state-{job['state']}' data-job='{job['id']}' data-state='{job['state']}'>{tds}</tr>"


def slot_table(row: str) -> str:
    """One row in a table of fixed widths (a panel row beside its buttons, or their header)."""
    return f"<table class='es-jobs' style='table-layout:fixed'>{row}</table>"


def actions_for(state: str) -> set[str]:
    """The buttons that can do something to a job in ``state``."""
    return {"explain"} | ({"cancel"} if state in ACTIVE else set()) | (
        {"hold"} if state == JobState.QUEUED else {"release"} if state == JobState.HELD else set())


def render_explanation_html(info: dict[str, Any]) -> str:
    """A job's ``explain`` (the daemon's answer) as HTML: its state, why it waits, its story."""
    job, reason = info["job"], info["reason"]
    head = (f"job {job['id']} ({html.escape(job['name'])}, {html.escape(job['user'])}) "
            f"is <b>{html.escape(job['state'])}</b>")
    why = f"<p>reason: {html.escape(reason['text'])}</p>" if reason else ""
    items = "".join(
        f"<li><code>{time.strftime('%H:%M:%S', time.localtime(line['ts']))}</code> {html.escape(line['what'])}"
        + (f" <i>because {html.escape(line['because'])}</i>" if line["because"] else "") + "</li>"
        for line in info["story"]
    )
    return f"<div class='es-explain'><p>{head}</p>{why}<ol>{items}</ol></div>"


def render_jobs_text(jobs: list[dict[str, Any]], now: float, empty: str = "no jobs") -> str:
    return table(JOB_COLUMNS, [_job_cells(j, now) for j in jobs]) if jobs else empty


def render_text(model: PanelModel, now: float) -> str:
    if not model.connected:
        return f"eventsched: {model.error or 'not connected'}"
    several = model.several_nodes()
    lines = [f"node {node}: {model.node_state(node)}" for node, _ in model.by_node()] if several else []
    lines += [f"{gpu_label(key, several)}: {gpu_line(g)}" for key, g in sorted(model.gpus.items())]
    lines.append(f"policy {model.policy} · log seq {model.seq}")
    lines.append(render_jobs_text(model.running() + model.queued(), now, "no queued or running jobs"))
    return "\n".join(lines)


def render_html(model: PanelModel, now: float) -> str:
    if not model.connected:
        return f"<p><b>eventsched:</b> {html.escape(model.error or 'not connected')}</p>"
    rows, several = [], model.several_nodes()
    for node, gpus in model.by_node():
        if several:
            rows.append(f"<tr class='es-node'><th colspan='3' style='text-align:left'>node {html.escape(node)} · "
                        f"{html.escape(model.node_state(node))}</th></tr>")
        for key, g in gpus:
            pct = round(100 * float(g.get("allocated") or 0))
            rows.append(f"<tr><td>{html.escape(gpu_label(key, several))}</td><td>"
                        f"<div style='width:120px;background:#eee'><div style='width:{pct}%;background:#1976d2;"
                        f"height:10px'></div></div></td><td>{html.escape(gpu_line(g))}</td></tr>")
    jobs = render_jobs_html(model.running() + model.queued() + model.finished(), now)
    return (f"<div class='eventsched-status'><table>{''.join(rows)}</table>"
            f"<p>policy {html.escape(model.policy)} · log seq {model.seq}</p>{jobs}</div>")


# history at a glance: SVG of ``cli.status_history``'s data

HISTORY_WINDOW_S = 3600.0  # the panel's charts cover the last hour
HISTORY_REFRESH_S = 15.0  # re-read at most this often, and soon after a job ends
HISTORY_SOON_S = 2.0
SPARK_W, SPARK_H = 240, 36
UTIL_COLOUR, MEM_COLOUR = "#1976d2", "#ef6c00"


def _step_path(values: list[float | None], top: float) -> str:
    """An SVG path of a sample-and-hold series: one flat step per column, gaps where there is no reading."""
    if top <= 0 or not values:
        return ""
    width = SPARK_W / len(values)
    parts: list[str] = []
    pen_down = False  # False: the next step starts a new segment
    for i, v in enumerate(values):
        if v is None:
            pen_down = False
            continue
        y = SPARK_H - 2 - min(max(v / top, 0.0), 1.0) * (SPARK_H - 4)
        parts.append(f"{'L' if pen_down else 'M'}{i * width:.1f},{y:.1f} L{(i + 1) * width:.1f},{y:.1f}")
        pen_down = True
    return " ".join(parts)


def render_history_html(h: dict[str, Any]) -> str:
    """Per GPU a small utilisation (blue) and memory (orange) chart; per user a GPU-hours bar for the day."""
    esc = html.escape
    rows = []
    for g in h["gpus"]:
        name = f"{g['node']}:{g['gpu']}"
        total = float(g["memory_total_mib"] or max([m for m in g["memory_used_mib"] if m is not None] or [0]))
        util_last, mem_last = g["utilization_last"], g["memory_used_mib_last"]
        title = (f"GPU {name}, last {human_duration(h['window_s'], 'span')}: "
                 f"utilisation mean {_fmt(g['utilization_mean'], '%')}, peak {_fmt(g['utilization_peak'], '%')}; "
                 f"memory peak {_fmt(g['memory_used_mib_peak'], ' MiB')}")
        rows.append(
            f"<tr class='es-history-gpu' data-gpu='{esc(name)}'><td style='padding:0 8px'>GPU {g['gpu']}</td><td>"
            f"<svg class='es-spark' data-gpu='{esc(name)}' width='{SPARK_W}' height='{SPARK_H}' "
            f"viewBox='0 0 {SPARK_W} {SPARK_H}' role='img' aria-label='{esc(title)}'><title>{esc(title)}</title>"
            f"<rect width='{SPARK_W}' height='{SPARK_H}' fill='#f5f5f5'/>"
            f"<path class='es-spark-mem' d='{_step_path(g['memory_used_mib'], total)}' fill='none' "
            f"stroke='{MEM_COLOUR}' stroke-width='1.5'/>"
            f"<path class='es-spark-util' d='{_step_path(g['utilization'], 100.0)}' fill='none' "
            f"stroke='{UTIL_COLOUR}' stroke-width='1.5'/></svg></td>"
            f"<td style='padding:0 8px'><span style='color:{UTIL_COLOUR}'>util {_fmt(util_last, '%')}</span> · "
            f"<span style='color:{MEM_COLOUR}'>mem {_fmt(None if mem_last is None else mem_last / 1024, ' GiB', 1)}"
            f" of {total / 1024:.1f} GiB</span></td></tr>")
    if not rows:
        rows.append("<tr><td><i>no GPU samples yet</i></td></tr>")
    users = h["users"]
    top = max((u["gpu_hours"] for u in users), default=0.0)
    bar_w, row_h, label_w = 200, 16, 110  # and room for "12.5 GPU-min" after the bar
    bars = []
    for i, u in enumerate(users):
        who = u["user"] or "(none)"
        width, y = 0.0 if top <= 0 else max(1.0, u["gpu_hours"] / top * bar_w), i * row_h
        bars.append(
            f"<g class='es-user' data-user='{esc(who)}'><text x='0' y='{y + 12}' font-size='11'>{esc(who[:16])}</text>"
            f"<rect class='es-user-bar' x='{label_w}' y='{y + 3}' width='{width:.1f}' height='{row_h - 5}' "
            f"fill='#2e7d32'/><text x='{label_w + width + 4:.1f}' y='{y + 12}' font-size='11'>"
            f"{format_gpu_time(u['gpu_hours'] * 3600)}</text></g>")
    height = max(1, len(users)) * row_h
    chart = (f"<svg class='es-user-hours' width='{label_w + bar_w + 90}' height='{height}' role='img' "
             f"aria-label='GPU time per user today'>{''.join(bars)}</svg>" if users
             else _empty_html("no GPU time yet today"))
    return (f"<div class='es-history'><p style='margin:4px 0'><b>last {human_duration(h['window_s'], 'span')}</b> · "
            f"<span style='color:{UTIL_COLOUR}'>utilisation</span> and "
            f"<span style='color:{MEM_COLOUR}'>memory</span> per GPU</p><table>{''.join(rows)}</table>"
            f"<p style='margin:4px 0'><b>GPU time today</b> ({esc(h['day'])}, UTC)</p>{chart}</div>")


Listener = Callable[[PanelModel], None]


class Watcher:
    """One background thread folding one daemon's events; listeners redraw.
    It re-seeds from ``status()`` whenever the stream breaks, retrying every ``retry_s``."""

    def __init__(self, socket_path: str | Path, retry_s: float = 1.0) -> None:
        self.socket_path, self.retry_s = Path(socket_path), retry_s
        self.model = PanelModel()
        self.lock = threading.RLock()
        self._listeners: list[Listener] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None
        self._last_draw = 0.0
        self._drawn_seq = -1  # the model's seq when listeners last ran

    def settle(self, job_id: int, timeout: float = 10.0) -> None:
        """Wait (briefly) until the displays show ``job_id`` finished, so a cell that
        waited for it ends with the panel showing it (a busy machine redraws slowly)."""
        if self._thread is None or not self._thread.is_alive():
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if not self.model.connected:
                    return
                job = self.model.jobs.get(job_id)
                if (job is None or job["state"] in FINAL) and self._drawn_seq >= self.model.seq:
                    return
            time.sleep(0.02)

    def add_listener(self, listener: Listener) -> None:
        with self.lock:
            self._listeners.append(listener)
            listener(self.model)
        self.start()

    def remove_listener(self, listener: Listener) -> None:
        with self.lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"eventsched-watch {self.socket_path}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Ends the thread at the next event (GPU samples arrive every few seconds)."""
        self._stop.set()

    def _run(self) -> None:
        from eventsched.wire.client import Client, ClientError, DaemonNotRunning

        while not self._stop.is_set():
            try:
                with Client(self.socket_path, timeout=10.0) as client:
                    status = client.status()
                    with self.lock:
                        self.model = PanelModel.from_status(status)
                    self._draw(force=True)
                    for batch in client.subscribe(from_seq=self.model.seq + 1):
                        with self.lock:
                            self.model.fold(batch)
                        self._draw()
                        if self._stop.is_set():
                            return
                message = "the daemon closed the event stream; reconnecting"
            except DaemonNotRunning:
                message = "no daemon running (start one with %gpuscheduler start --gpus fake:4)"
            except (ClientError, OSError) as exc:
                message = f"connection lost ({exc}); reconnecting"
            with self.lock:
                self.model.connected, self.model.error = False, message
            self._draw(force=True)
            self._stop.wait(self.retry_s)

    def _draw(self, force: bool = False) -> None:
        """Call listeners, at most every THROTTLE_S; a timer delivers the last change."""
        with self.lock:
            now = time.monotonic()
            if not force and now - self._last_draw < THROTTLE_S:
                if self._timer is None:
                    self._timer = threading.Timer(THROTTLE_S, self._draw, kwargs={"force": True})
                    self._timer.daemon = True
                    self._timer.start()
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._last_draw, self._drawn_seq = now, self.model.seq
            for listener in list(self._listeners):
                try:
                    listener(self.model)
                except Exception:  # a closed widget must not stop the others
                    self._listeners.remove(listener)


_watchers: dict[Path, Watcher] = {}
_watchers_lock = threading.Lock()


def existing_watcher(socket_path: str | Path) -> Watcher | None:
    with _watchers_lock:
        return _watchers.get(Path(socket_path))


def watcher_for(socket_path: str | Path) -> Watcher:
    """The one watcher of this socket in this kernel."""
    key = Path(socket_path)
    with _watchers_lock:
        if key not in _watchers:
            _watchers[key] = Watcher(key)
        return _watchers[key]


def read_tail(path: str, lines: int = TAIL_LINES, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def render_bookings_html(socket_path: Path) -> str:
    """The reservations as ``reserve list --timeline`` draws them; nothing when there are none."""
    from eventsched.cli.reserve import timeline
    from eventsched.wire.client import Client
    from eventsched.wire.protocol import ListReservations

    with Client(socket_path) as c:
        listed = c.request(ListReservations())
    if not listed["reservations"]:
        return ""
    return f"<b>reservations</b><pre class='es-bookings'>{html.escape(timeline(listed))}</pre>"


def _card_html(socket_path: Path, job: dict[str, Any]) -> str:
    """An ended job's report card, as ``explain`` prints it (nothing while it
    has not ended, or where the history cannot say)."""
    import argparse

    from eventsched.cli.report import card_of

    try:  # the history beside the socket, else the daemon answers
        card = card_of(argparse.Namespace(state_dir=str(socket_path.parent), socket=str(socket_path)), job)
    except Exception:  # the explanation stands without it
        return ""
    if not card:
        return ""
    util = "not sampled" if card["utilization_mean"] is None else f"{card['utilization_mean']:.0f} % busy"
    line = (f"report card: {util}, idle {format_gpu_time(3600 * (card['idle_gpu_hours'] or 0))} of "
            f"{format_gpu_time(3600 * (card['gpu_hours'] or 0))} allocated; {card['advice']}")
    return f"<p class='es-card'>{html.escape(line)}</p>"


@functools.cache
def _panel_class() -> type:
    import ipywidgets as w

    class StatusPanel(w.VBox):
        """GPUs (one bar each), running, queued and recently ended jobs (each with
        cancel, hold, release and explain buttons), and a selected job's output tail."""

        def __init__(self, socket_path: str | Path, status: dict[str, Any]) -> None:
            self.socket_path = Path(socket_path)
            self._log_paths: dict[int, str] = {}
            self.header = w.HTML(value="<b>eventsched</b> · connecting…")
            # Every widget is made here, on the kernel's thread: the watcher's
            # thread only ever sets values (a GPU that appears later shows up
            # in the header and the next %gpustatus).
            self._gpu_rows: dict[GpuKey, tuple[Any, Any]] = {}
            rows: list[Any] = []
            by_node = PanelModel.from_status(status).by_node()
            for node, gpus in by_node:
                if len(by_node) > 1:  # several machines: one heading per node, its GPUs under it
                    rows.append(w.HTML(value=f"<b>node {html.escape(node)}</b>", _dom_classes=["es-node"]))
                for key, _ in gpus:
                    label = gpu_label(key, len(by_node) > 1)
                    bar = w.FloatProgress(min=0.0, max=1.0, description=label, layout=w.Layout(width="320px"))
                    info = w.HTML()
                    self._gpu_rows[key] = (bar, info)
                    css = f"es-gpu-{key[1]}" if len(by_node) == 1 else f"es-gpu-{key[0]}-{key[1]}"
                    rows.append(w.HBox([bar, info], _dom_classes=["es-gpu", css]))
            self.gpu_box = w.VBox(rows)
            self.history_html = w.HTML(value=_empty_html("reading the last hour…"))
            self.history_html.add_class("es-history-box")
            self._history_lock = threading.Lock()
            self._history_busy, self._history_at = False, -HISTORY_REFRESH_S
            self._history_ended: frozenset[int] = frozenset()
            self._bookings_seq = -1
            self.bookings_html = w.HTML(value="")  # who holds which GPU over the coming days
            self.jobs_html = w.HTML(value="")
            # one row per job, with its buttons: made here, filled (or hidden) by the watcher's thread
            self.rows = [self._slot(w) for _ in range(ROW_SLOTS)]
            self.action_line = w.HTML(value="")  # what the last button did, or why it could not
            self.explain_html = w.HTML(value="")
            self.job_select = w.Dropdown(options=[("(select a job)", 0)], value=0, description="output of")
            self.tail = w.HTML(value="")
            super().__init__([self.header, self.gpu_box, self.history_html, self.bookings_html, self.jobs_html, *self.rows,
                              self.action_line, self.explain_html, self.job_select, self.tail])
            self.add_class("eventsched-panel")
            self.job_select.observe(lambda _change: self._redraw_tail(), names="value")
            self.watcher = watcher_for(self.socket_path)
            self.watcher.add_listener(self.update)

        def _slot(self, w: Any) -> Any:
            cells = w.HTML(value="")
            buttons = {a: w.Button(description=a, layout=w.Layout(width="72px"), tooltip=f"{a} this job")
                       for a in ACTIONS}
            row = w.HBox([cells, *buttons.values()], layout=w.Layout(display="none"))
            row.add_class("es-job-row")
            row.job, row.cells, row.buttons = 0, cells, buttons
            for action, button in buttons.items():
                button.on_click(functools.partial(self._act, row, action))
            return row

        def _act(self, row: Any, action: str, _button: Any = None) -> None:
            """A button: act on the row's job as the kernel's user; the outcome
            (or the daemon's refusal) in one line under the rows."""
            from eventsched.wire.client import Client

            job = row.job
            try:
                with Client(self.socket_path, timeout=10.0) as c:
                    if action == "explain":
                        info = c.explain(job)
                        self.explain_html.value = render_explanation_html(info) + _card_html(self.socket_path, info["job"])
                        text = f"job {job}: explained below"
                    else:
                        getattr(c, action)([job])
                        text = f"job {job}: {action} asked"
                colour = "#2e7d32"
            except Exception as exc:  # the refusal, in one line, never raised into a cell
                text, colour = f"{action} job {job} refused: {first_line(exc)}", "#c62828"
            self.action_line.value = f"<span class='es-action' style='color:{colour}'>{html.escape(text)}</span>"

        def _update_rows(self, jobs: list[dict[str, Any]], now: float) -> None:
            more = len(jobs) - len(self.rows)
            self.jobs_html.value = (slot_table(f"<tr>{_head_html(SLOT_WIDTHS)}</tr>") if jobs
                                    else _empty_html("no jobs yet")) + (
                f"<p class='es-more'><i>{more} more not shown (%gpuqueue lists them all)</i></p>" if more > 0 else "")
            for row, job in zip(self.rows, [*jobs, *[None] * (len(self.rows) - len(jobs))]):
                if job is None:
                    row.layout.display, row.job = "none", 0
                    continue
                row.job = job["id"]
                value = slot_table(job_row_html(job, now, SLOT_WIDTHS))
                if row.cells.value != value:
                    row.cells.value = value
                can = actions_for(job["state"])
                for action, button in row.buttons.items():
                    button.disabled = action not in can
                row.layout.display = ""

        # called on the watcher's thread: only sets widget values
        def update(self, model: PanelModel) -> None:
            now = time.time()
            if not model.connected:
                self.header.value = f"<b>eventsched</b> · <span style='color:#c62828'>{html.escape(model.error or 'connecting…')}</span>"
                return
            self.header.value = (f"<b>eventsched</b> · policy {html.escape(model.policy)} · "
                                 f"{len(model.running())} running · {len(model.queued())} queued · seq {model.seq}")
            self._update_gpus(model)
            self._update_rows(model.running() + model.queued() + model.finished(), now)
            options = [("(select a job)", 0)] + [
                (f"{j['id']} {j.get('name', '')} ({j['state']})", j["id"])
                for j in sorted(model.jobs.values(), key=lambda j: -j["id"])
            ]
            if options != list(self.job_select.options):
                value = self.job_select.value
                self.job_select.options = options
                self.job_select.value = value if any(v == value for _, v in options) else 0
            self._log_paths.update({j["id"]: j["log_path"] for j in model.jobs.values() if j.get("log_path")})
            self._redraw_tail()
            self._maybe_refresh_history(model)  # last: a history query may take seconds on a busy machine

        def _update_gpus(self, model: PanelModel) -> None:
            for key, (bar, info) in self._gpu_rows.items():
                if (gpu := model.gpus.get(key)) is None:
                    continue
                bar.value = float(gpu.get("allocated") or 0.0)
                bar.bar_style = "warning" if gpu.get("paused") else ("danger" if gpu.get("lost") else "info")
                info.value = html.escape(gpu_line(gpu))

        def _maybe_refresh_history(self, model: PanelModel) -> None:
            """Re-read the charts in a thread of their own (never on the watcher's): every
            HISTORY_REFRESH_S, and HISTORY_SOON_S after a job ended (its GPU-hours changed)."""
            ended = frozenset(j["id"] for j in model.jobs.values() if j["state"] in FINAL)
            age = time.monotonic() - self._history_at
            with self._history_lock:
                if model.bookings_seq != self._bookings_seq:  # booked or cancelled: redrawn at once
                    self._bookings_seq = model.bookings_seq
                    threading.Thread(target=self._refresh_bookings, name="eventsched-panel-bookings", daemon=True).start()
                if self._history_busy or not (age >= HISTORY_REFRESH_S
                                              or (ended != self._history_ended and age >= HISTORY_SOON_S)):
                    return
                self._history_busy, self._history_ended = True, ended
            threading.Thread(target=self._refresh_history, name="eventsched-panel-history", daemon=True).start()

        def _refresh_history(self) -> None:
            from eventsched.cli.status_history import fetch_history, via_socket

            self._refresh_bookings()  # the timeline moves on with the clock
            try:
                data = fetch_history(via_socket(self.socket_path), HISTORY_WINDOW_S)
                self.history_html.value = render_history_html(data)
            except Exception as exc:  # shown in the panel, never raised into a cell
                self.history_html.value = _empty_html(f"history: {exc}")
            finally:
                with self._history_lock:
                    self._history_at, self._history_busy = time.monotonic(), False

        def _refresh_bookings(self) -> None:
            try:
                self.bookings_html.value = render_bookings_html(self.socket_path)
            except Exception as exc:  # shown in the panel, never raised into a cell
                self.bookings_html.value = _empty_html(f"reservations: {exc}")

        def _redraw_tail(self) -> None:
            job = self.job_select.value
            if not job:
                self.tail.value = ""
                return
            if (path := self._log_paths.get(job)) is None:
                try:
                    from eventsched.wire.client import Client

                    with Client(self.socket_path, timeout=5.0) as c:
                        path = self._log_paths[job] = c.log_path(job)
                except Exception as exc:  # shown in the panel, never raised into a cell
                    self.tail.value = f"<i>{html.escape(str(exc))}</i>"
                    return
            self.tail.value = (f"<pre class='es-tail' style='max-height:20em;overflow:auto;"
                               f"background:#f7f7f7'>{html.escape(read_tail(path)) or '(no output yet)'}</pre>")

        def close(self) -> None:
            self.watcher.remove_listener(self.update)
            super().close()

        def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
            # static viewers (nbviewer, GitHub) get a snapshot instead of "VBox(...)"
            data = super()._repr_mimebundle_(**kwargs) or {}
            with self.watcher.lock:
                data["text/plain"] = render_text(self.watcher.model, time.time())
                data["text/html"] = render_html(self.watcher.model, time.time()) + self.history_html.value
            return data

    return StatusPanel


def StatusPanel(socket_path: str | Path, status: dict[str, Any]) -> Any:  # noqa: N802 - a class, built lazily
    """Create the panel for the GPUs in ``status`` (a ``Client.status()``);
    ipywidgets is imported only when one is made."""
    return _panel_class()(socket_path, status)
