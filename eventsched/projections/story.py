"""A job's story from the log: each event with its time and the fact that caused it.

``job_story(events, job)`` is a pure function over events (the daemon feeds
it the log from the job's submission on). Each line says what happened and,
for a decision, *because* of what: the fact its ``cause`` names (``seq:N``),
described in the user's terms ("placed on GPU 0 by best-fit — because job 7
exited"). Environments never appear: a story is shown to whoever may see the
job's metadata.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import msgspec

from eventsched.domain import events as ev

__all__ = ["StoryLine", "job_story", "describe_fact", "render_explanation"]

# facts kept to resolve causes: a decision's fact is emitted in the same step
# as the decision, so it is never far behind it
RECENT_FACTS = 4096


class StoryLine(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    ts: float
    type: str
    what: str  # what happened, in words
    because: str = ""  # the fact that caused it, in words ("" for a fact)
    cause: str = ""  # the raw cause: "uid:1000", "seq:61", "timer", ...
    cause_seq: int | None = None


def _gpus(ids: Iterable[int]) -> str:
    ids = list(ids)
    return f"GPU{'s' if len(ids) != 1 else ''} {','.join(map(str, ids))}" if ids else "no GPU"


def _exit_words(e: ev.JobExited) -> str:
    if e.signal is not None:
        how = f"killed by signal {e.signal}"
    elif e.exit_code is None:
        how = "ended without an exit code"
    else:
        how = f"exited with code {e.exit_code}"
    if e.reason:
        how += f" ({e.reason})"
    return how


def describe_fact(e: ev.Event) -> str:
    """A stimulus in words, as the cause of something else."""
    if isinstance(e, ev.JobSubmitted):
        return f"job {e.job} was submitted by {e.spec.user or e.cause}"
    if isinstance(e, ev.JobExited):
        return f"job {e.job} {_exit_words(e)}"
    if isinstance(e, ev.JobLost):
        return f"job {e.job} was lost ({e.reason})"
    if isinstance(e, ev.JobStarted):
        return f"job {e.job} started"
    if isinstance(e, ev.JobsCommanded):
        return f"{e.by} asked to {e.command} job{'s' if len(e.jobs) != 1 else ''} {', '.join(map(str, e.jobs))}"
    if isinstance(e, ev.TimerFired):
        return "a deadline came (a time limit, the end of a retry backoff, or an idle spell's length)"
    if isinstance(e, ev.GpuSampled):
        return (f"GPU {e.gpu} reported {e.utilization:.0f}% busy, {e.memory_used_mib} MiB used, "
                f"{e.temperature_c:.0f} C")
    if isinstance(e, ev.GpuPaused):
        return f"GPU {e.gpu} was paused by {e.by}"
    if isinstance(e, ev.GpuResumed):
        return f"GPU {e.gpu} was resumed by {e.by}"
    if isinstance(e, ev.GpuErrored):
        return f"GPU {e.gpu} failed ({e.error})"
    if isinstance(e, ev.PolicyChanged):
        return f"the policy was changed to {e.policy} by {e.by}"
    if isinstance(e, ev.DaemonStarted):
        return f"the daemon started (policy {e.policy})"
    if isinstance(e, ev.DaemonStopped):
        return "the daemon stopped"
    return f"{type(e).__name__} (seq {e.seq})"


def _what(e: ev.Event) -> str:
    """One of the job's own events, in words."""
    if isinstance(e, ev.JobSubmitted):
        s = e.spec
        task = f", task {s.array_index} of array {s.array_id}" if s.array_index >= 0 else ""
        return f"submitted by {s.user or e.cause}: {s.gpus:g} GPU{'s' if s.gpus != 1 else ''}, priority {s.priority}{task}"
    if isinstance(e, ev.JobPlaced):
        return f"placed on {_gpus(e.gpu_ids)}{'' if e.node in ('', 'local') else ' of ' + e.node} by {e.policy}"
    if isinstance(e, ev.JobStarted):
        return f"started, pid {e.pid}"
    if isinstance(e, ev.JobExited):
        return f"{_exit_words(e)}" + (f" -> {e.outcome}" if e.outcome else "")
    if isinstance(e, ev.JobCancelRequested):
        if e.rule == "idle" and e.for_job:
            how = "cancelled" if e.reason == "idle" else "requeued"
            return f"idle while job {e.for_job} waits: warning signal, then SIGKILL after the grace; {how}"
        if e.reason == "gpu-memory":
            return "asked to stop: GPU memory over request"
        if e.reason == "preempted" and e.for_job:
            why = {"priority": "a higher priority", "fair-share": "its tenant is under its fair share"}.get(e.rule, e.rule)
            return f"preempted for job {e.for_job} (rule {e.rule}: {why}); warning signal, then SIGKILL after the grace"
        return f"asked to stop ({e.reason})"
    if isinstance(e, ev.JobCancelled):
        return f"cancelled by {e.by}"
    if isinstance(e, ev.JobRequeued):
        return f"queued again ({e.reason})" + (" after a backoff" if e.not_before else "")
    if isinstance(e, ev.JobHeld):
        return f"held by {e.by}"
    if isinstance(e, ev.JobReleased):
        return f"released by {e.by}"
    if isinstance(e, ev.JobLost):
        return f"lost ({e.reason})"
    if isinstance(e, ev.JobGpuMemoryExceeded):  # issue 17
        then = "; warning signal, then SIGKILL after the grace" if e.policy == "stop" else " (warned)"
        return f"GPU memory over request: {e.used_mib} MiB on GPU {e.gpu} > --gpu-mem {e.request_mib} MiB{then}"
    if isinstance(e, ev.JobGpuMemoryWithin):
        return f"GPU memory back within request ({e.used_mib} MiB)"
    if isinstance(e, ev.JobIdle):
        return "allocated but idle: its GPUs have been quiet since " + time.strftime("%H:%M:%S", time.localtime(e.since))
    if isinstance(e, ev.JobBusy):
        return f"busy again after {e.idle_s:.0f} s idle"
    return type(e).__name__


def _concerns(e: ev.Event, job: int) -> bool:
    if isinstance(e, ev.JobsCommanded):
        return False  # told as the cause of the job's own event that follows
    return getattr(e, "job", None) == job


def job_story(events: Iterable[ev.Event], job: int) -> list[StoryLine]:
    """The story of ``job`` in ``events`` (the log, from the job's submission on)."""
    facts: OrderedDict[int, ev.Event] = OrderedDict()
    out: list[StoryLine] = []
    for e in events:
        if ev.is_stimulus(e):
            facts[e.seq] = e
            if len(facts) > RECENT_FACTS:
                facts.popitem(last=False)
        if not _concerns(e, job):
            continue
        n = ev.cause_seq(e)
        because = ""
        if n is not None:
            fact: Any = facts.get(n)
            because = describe_fact(fact) if fact is not None else f"event {n}"
        out.append(StoryLine(seq=e.seq, ts=e.ts, type=type(e).__name__, what=_what(e), because=because,
                             cause=e.cause, cause_seq=n))
    return out


def render_explanation(info: dict[str, Any]) -> str:
    """What ``eventsched explain`` prints for the daemon's answer ``info``
    (``job``, ``reason``, ``story``): every line through ``text.printable``."""
    from eventsched.domain.text import printable

    job = info["job"]
    lines = [f"job {job['id']} ({job['name']}, {job['user']}) is {job['state']}"]
    if job.get("array_id") is not None:
        cap = f"; at most {job['array_cap']} of its tasks run at once (%{job['array_cap']})" if job.get("array_cap") else ""
        lines.append(f"array: task {job['array_index']} of array {job['array_id']} "
                     f"(`eventsched cancel {job['array_id']}` cancels every task){cap}")
    if info.get("reason") is not None:
        lines.append(f"reason: {info['reason']['text']}")
    forecast = info.get("forecast")
    if forecast is not None:
        at = forecast["estimated_start"]
        when = f" ({time.strftime('%H:%M:%S', time.localtime(at))})" if at is not None else ""
        lines.append(f"estimated start: {forecast['text']}{when}, {forecast['assumptions']}")
    elif job.get("exit_reason"):
        lines.append(f"ended: {job['exit_reason']}")
    if job.get("gpu_mem_over"):  # issue 17
        lines.append(f"GPU memory: over request ({job.get('gpu_mem_peak_mib', 0)} MiB seen > --gpu-mem {job['gpu_mem_mib']} MiB)")
    if job.get("idle"):
        lines.append("idle: allocated but idle since " + time.strftime("%H:%M:%S", time.localtime(job["idle_since"])))
    lines += ["", "story:"]
    for line in info["story"]:
        ts = line["ts"]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 10)}"
        text = f"  {when}  {line['what']}"
        if line["because"]:
            text += f" (because {line['because']}, event {line['cause_seq']})"
        elif line["cause"]:
            text += f" [{line['cause']}]"
        lines.append(text)
    return "\n".join(printable(x) for x in lines)
