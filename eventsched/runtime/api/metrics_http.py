"""`serve --metrics-port`: wait, run and turnaround times, GPU use and GPU-hours for Prometheus.

A tiny HTTP/1.0 responder. The figures come from the DuckDB read model, in a
worker thread so a scrape never stalls the engine; live gauges from the projection.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio
import anyio.abc

from eventsched.domain.states import ACTIVE

if TYPE_CHECKING:
    from eventsched.runtime.engine import Engine

logger = logging.getLogger("eventsched.metrics")

MAX_REQUEST_BYTES = 8192


def live_gauges(status: dict[str, Any]) -> str:
    """Gauges of the scheduler's present state (queue depth, allocation)."""
    counts: dict[str, int] = dict.fromkeys(sorted(ACTIVE), 0)
    for job in status["jobs"]:
        counts[job["state"]] = counts.get(job["state"], 0) + 1
    lines = _gauge("eventsched_jobs_active", "Jobs queued, running or held now.",
                   [f'eventsched_jobs_active{{state="{s}"}} {n}' for s, n in counts.items()])
    lines += _gauge("eventsched_gpu_allocated_share", "Share of each GPU allocated to jobs (0..1).",
                    [f'eventsched_gpu_allocated_share{{gpu="{g["node"]}:{g["id"]}"}} {g["allocated"]:g}'
                     for g in status["gpus"]])
    tenants = status.get("tenants") or []
    for key, name, what in (
        ("fair_share", "eventsched_tenant_fair_share_ratio", "A tenant's fair share: its weight over all weights."),
        ("recent_share", "eventsched_tenant_recent_use_ratio", "A tenant's part of the recent (decayed) GPU use."),
        ("fair_share_factor", "eventsched_tenant_fair_share_factor", "2^(-recent use / fair share): 1 unused, 0.5 at its share."),
    ):
        if tenants:
            lines += _gauge(name, what,
                            [f'{name}{{tenant="{_label(t["tenant"])}"}} {float(t[key]):g}' for t in tenants])
    lines += _gauge("eventsched_log_seq", "Sequence number of the last committed event.",
                    [f"eventsched_log_seq {status['seq']}"])
    return "\n".join(lines) + "\n"


def _gauge(name: str, what: str, samples: list[str]) -> list[str]:
    return [f"# HELP {name} {what}", f"# TYPE {name} gauge", *samples]


def _label(value: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def history_text(state_dir: Path) -> str:
    from eventsched.projections.history import History
    from eventsched.projections.metrics import compute_metrics, prometheus_text

    with History(state_dir) as history:
        history.catch_up()
        return prometheus_text(compute_metrics(history))


async def read_metrics(engine: Engine) -> str:
    """A scrape's answer (this endpoint's and the HTTP API's ``GET /metrics``)."""
    from eventsched.core.tenants_report import tenants_report
    from eventsched.runtime.api.server import status
    from eventsched.runtime.engine import Query

    now = await engine.call(Query(lambda st: {**status(st), "tenants": tenants_report(st, engine.clock())}))
    return live_gauges(now) + await anyio.to_thread.run_sync(history_text, engine.state_dir)


async def serve_metrics(host: str, port: int, read: Callable[[], Awaitable[str]], *,
                        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    async def respond(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            request = b""
            with anyio.move_on_after(5):
                while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST_BYTES:
                    try:
                        request += await stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break
            parts = request.split(b"\r\n", 1)[0].split()
            if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
                try:
                    body = await read()
                    status, ctype = "200 OK", "text/plain; version=0.0.4; charset=utf-8"
                except Exception as exc:  # a scrape must never take the daemon down
                    logger.warning("metrics scrape failed: %s", exc)
                    body, status, ctype = f"metrics unavailable: {exc}\n", "500 Internal Server Error", "text/plain"
            else:
                body, status, ctype = "try GET /metrics\n", "404 Not Found", "text/plain"
            data = body.encode()
            head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n\r\n"
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(head.encode() + data)

    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    task_status.started()
    await listener.serve(respond)
