"""A job's story from the log: each event with its time and the fact that caused it.

Each line says what happened and, for a decision, *because* of the fact its
``cause`` names, in the user's terms ("placed on GPU 0 by best-fit — because
job 7 exited"). Environments never appear: whoever sees the metadata sees it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from eventsched.domain import events as ev
from eventsched.domain.gpu_health import describe
from eventsched.domain.text import printable

__all__ = ["StoryLine", "job_story", "describe_fact", "render_explanation"]

RECENT_FACTS = 4096  # facts kept to resolve causes: a decision comes in the same step as its fact


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
    how = (f"killed by signal {e.signal}" if e.signal is not None else "ended without an exit code"
           if e.exit_code is None else f"exited with code {e.exit_code}")
    return how + (f" ({e.reason})" if e.reason else "")


_KILL = "warning signal, then SIGKILL after the grace"
_FACTS: dict[type, Callable[[Any], str]] = {
    ev.JobSubmitted: lambda e: f"job {e.job} was submitted by {e.spec.user or e.cause}",
    ev.JobExited: lambda e: f"job {e.job} {_exit_words(e)}",
    ev.JobLost: lambda e: f"job {e.job} was lost ({e.reason})",
    ev.JobStarted: lambda e: f"job {e.job} started",
    ev.JobsCommanded: lambda e: (f"{e.by} asked to {e.command} job{'s' if len(e.jobs) != 1 else ''} "
                                 + ", ".join(map(str, e.jobs))),
    ev.TimerFired: lambda e: "a deadline came (a time limit, the end of a retry backoff, or an idle spell's length)",
    ev.GpuSampled: lambda e: (f"GPU {e.gpu} reported {e.utilization:.0f}% busy, {e.memory_used_mib} MiB used, "
                              f"{e.temperature_c:.0f} C"),
    ev.GpuPaused: lambda e: f"GPU {e.gpu} was drained: {e.reason}" if e.reason else f"GPU {e.gpu} was paused by {e.by}",
    ev.GpuResumed: lambda e: f"GPU {e.gpu} was resumed by {e.by}",
    ev.GpuErrored: lambda e: f"GPU {e.gpu} failed ({e.error})",
    ev.GpuHealth: lambda e: f"GPU {e.gpu}'s driver reported {describe(e)}",
    ev.PolicyChanged: lambda e: f"the policy was changed to {e.policy} by {e.by}",
    ev.JobUpdated: lambda e: f"job {e.job} was updated by {e.by} ({_changes(e)})",
    ev.DaemonStarted: lambda e: f"the daemon started (policy {e.policy})",
    ev.DaemonStopped: lambda e: "the daemon stopped",
}


_CHANGE_WORDS = {"priority": "priority {}", "time_limit_s": "time limit {:g}s", "gpus": "{:g} GPUs", "name": "name {}"}


def _changes(e: ev.JobUpdated) -> str:
    return ", ".join(_CHANGE_WORDS[k].format(v) for k, v in e.changes().items())


def describe_fact(e: ev.Event) -> str:
    """A stimulus in words, as the cause of something else."""
    words = _FACTS.get(type(e))
    return words(e) if words is not None else f"{type(e).__name__} (seq {e.seq})"


def _cancel_requested(e: ev.JobCancelRequested) -> str:
    if e.rule == "idle" and e.for_job:
        how = "cancelled" if e.reason == "idle" else "requeued"
        return f"idle while job {e.for_job} waits: {_KILL}; {how}"
    if e.reason == "gpu-memory":
        return "asked to stop: GPU memory over request"
    if e.rule == "reservation":
        return f"its GPUs are booked from now ({e.by}): {_KILL}; requeued"
    if e.reason == "preempted" and e.for_job:
        why = {"priority": "a higher priority", "fair-share": "its tenant is under its fair share"}.get(e.rule, e.rule)
        return f"preempted for job {e.for_job} (rule {e.rule}: {why}); {_KILL}"
    return f"asked to stop ({e.reason})"


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


_WHAT: dict[type, Callable[[Any], str]] = {  # one of the job's own events, in words
    ev.JobSubmitted: lambda e: (f"submitted by {e.spec.user or e.cause}: {e.spec.gpus:g} GPU"
                                f"{'s' if e.spec.gpus != 1 else ''}, priority {e.spec.priority}"
                                + (f", task {e.spec.array_index} of array {e.spec.array_id}" if e.spec.array_index >= 0 else "")),
    ev.JobPlaced: lambda e: (f"placed on {_gpus(e.gpu_ids)}{'' if e.node in ('', 'local') else ' of ' + e.node}"
                             f" by {e.policy}"),
    ev.JobStarted: lambda e: f"started, pid {e.pid}",
    ev.JobExited: lambda e: _exit_words(e) + (f" -> {e.outcome}" if e.outcome else ""),
    ev.JobCancelRequested: _cancel_requested,
    ev.JobCancelled: lambda e: f"cancelled by {e.by}",
    ev.JobRequeued: lambda e: f"queued again ({e.reason})" + (" after a backoff" if e.not_before else ""),
    ev.JobHeld: lambda e: f"held by {e.by}",
    ev.JobReleased: lambda e: f"released by {e.by}",
    ev.JobUpdated: lambda e: f"updated by {e.by}: " + _changes(e),
    ev.JobLost: lambda e: f"lost ({e.reason})",
    ev.JobGpuMemoryExceeded: lambda e: (f"GPU memory over request: {e.used_mib} MiB on GPU {e.gpu} > --gpu-mem "
                                        f"{e.request_mib} MiB" + ("; " + _KILL if e.policy == "stop" else " (warned)")),
    ev.JobGpuMemoryWithin: lambda e: f"GPU memory back within request ({e.used_mib} MiB)",
    ev.JobIdle: lambda e: "allocated but idle: its GPUs have been quiet since " + _clock(e.since),
    ev.JobBusy: lambda e: f"busy again after {e.idle_s:.0f} s idle",
}


def job_story(events: Iterable[ev.Event], job: int) -> list[StoryLine]:
    """The story of ``job`` in ``events`` (the log, from the job's submission on)."""
    facts: OrderedDict[int, ev.Event] = OrderedDict()
    out: list[StoryLine] = []
    for e in events:
        if ev.is_stimulus(e):
            facts[e.seq] = e
            if len(facts) > RECENT_FACTS:
                facts.popitem(last=False)
        # a JobsCommanded is told as the cause of the job's own event that follows
        if isinstance(e, ev.JobsCommanded) or getattr(e, "job", None) != job:
            continue
        n = ev.cause_seq(e)
        fact: Any = None if n is None else facts.get(n)
        because = "" if n is None else describe_fact(fact) if fact is not None else f"event {n}"
        words = _WHAT.get(type(e))
        out.append(StoryLine(seq=e.seq, ts=e.ts, type=type(e).__name__, what=words(e) if words else type(e).__name__,
                             because=because, cause=e.cause, cause_seq=n))
    return out


def render_explanation(info: dict[str, Any]) -> str:
    """What ``eventsched explain`` prints for the daemon's answer ``info``
    (``job``, ``reason``, ``story``): every line through ``text.printable``."""
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
        when = f" ({_clock(at)})" if at is not None else ""
        lines.append(f"estimated start: {forecast['text']}{when}, {forecast['assumptions']}")
    elif job.get("exit_reason"):
        lines.append(f"ended: {job['exit_reason']}")
    if job.get("gpu_mem_over"):
        lines.append(f"GPU memory: over request ({job.get('gpu_mem_peak_mib', 0)} MiB seen > --gpu-mem {job['gpu_mem_mib']} MiB)")
    if job.get("idle"):
        lines.append("idle: allocated but idle since " + _clock(job["idle_since"]))
    lines += ["", "story:"]
    for line in info["story"]:
        ts = line["ts"]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 10)}"
        lines.append(f"  {when}  {line['what']}" + (f" (because {line['because']}, event {line['cause_seq']})"
                     if line["because"] else f" [{line['cause']}]" if line["cause"] else ""))
    return "\n".join(printable(x) for x in lines)
