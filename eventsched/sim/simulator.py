"""The replay simulator: a recorded log or a trace, through the same core, on a virtual clock.

The simulator supplies what the engine gets from the world: recorded stimuli
at their recorded times, simulated processes whose start and exit follow each
attempt's recorded delays (shifted by how much earlier or later the replay
placed it), and ``Tick``s for ``WakeAt``. Decisions are only ever the core's
outputs, never read from the source. Why a replay under the recording's policy
reproduces it exactly: replays/README.md. Every replay writes its own log
(``<out>/log``), so ``open_history(out)`` works on it as on a real state dir.
"""

from __future__ import annotations

import heapq
import math
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from eventsched import core
from eventsched.core import budgets
from eventsched.domain import events as ev
from eventsched.domain.messages import (Cancel, Hold, Launch, Message, NeverLaunched, PauseGpu, ProcessExited,
                                        ProcessLost, ProcessStarted, Refused, Release, ResumeGpu,
                                        SchedulerConfig, Signal, Started, Submit, Tick, Update, WakeAt)
from eventsched.domain.states import FINAL, WAITING, JobState
from eventsched.domain.tenants import Tenant
from eventsched.projections import collector
from eventsched.projections.cluster import ClusterState, runtime_key
from eventsched.sim.result import ReplayResult
from eventsched.sim.sources import _END, _REC, _TICK, Attempt, ReplayError, Workload, _started_message
from eventsched.storage import log as eventlog
from eventsched.storage.background import BackgroundAppender

__all__ = ["RECORDED", "ReplayResult", "simulate"]

RECORDED = "recorded"  # policy name meaning "as the log says, policy changes included"
SIGTERM = 15
FLUSH_EVENTS = 65_536  # events per frame of a replay's log (one fdatasync each)


# job states in which each command still applies
_CAN: dict[type, frozenset[str]] = {
    Cancel: frozenset({JobState.QUEUED, JobState.HELD, JobState.PREEMPTED, JobState.RUNNING}),
    Hold: frozenset({JobState.QUEUED}),
    Release: frozenset({JobState.HELD}),
}


class _Sim:
    """One replay: a state, a heap of pending inputs, a log being written."""

    def __init__(self, workload: Workload, policy: str, state_dir: Path, validate: bool,
                 settings: dict[str, Any] | None = None, tenants: dict[str, Tenant] | None = None) -> None:
        self.settings = dict(settings or {})  # a what-if's changes (None: as recorded)
        self.tenants = tenants
        self.w = workload
        self.policy = policy
        self.follow_recorded = policy == RECORDED  # a named policy holds throughout
        # the recording's own policy throughout: tick exactly when the daemon did
        self.exact = workload.kind == "log" and not workload.legacy and (
            policy == RECORDED or (policy == workload.recorded_policy and not workload.policy_changes)
        )
        self.state = ClusterState()
        if policy == "sjf-oracle":  # it knows the operators' pauses ahead
            self.state.oracle_pauses = _pause_windows(workload.stimuli)
        self.validate = validate
        self.writer = eventlog.LogWriter.open(state_dir / "log")
        if self.writer.next_seq != 1:
            self.writer.close()
            raise ReplayError(f"{state_dir / 'log'} already holds a log; replays need a fresh directory")
        # the log is written behind the replay, frame by frame (storage/background.py)
        self.appender = BackgroundAppender(self.writer)
        self.buffer: list[ev.Event] = []
        self.next_seq = 1
        self.heap: list[tuple[float, int, float, int, Any]] = []
        self.counter = 0
        self.ticks: set[float] = set()
        self.live: dict[int, int] = {}  # job -> token of its current simulated process
        self.stopping: set[int] = set()  # jobs whose stop-exit is already scheduled
        self.launches: dict[int, int] = {}
        self.ordinal_of: dict[int, int] = {}  # replay job id -> submission ordinal
        self.id_of: dict[int, int] = {}  # submission ordinal -> replay job id
        self.refused = self.placements = self.estimated = 0
        self.now = 0.0
        self.started_at: float | None = None
        self.notes: list[str] = list(workload.notes)
        # under another policy launches queue differently: model the launcher
        self.model_launch = workload.kind == "log" and policy != RECORDED and (
            policy != workload.recorded_policy or workload.policy_changes > 0
        )
        self.launcher_free = -math.inf
        self.modelled_launches = 0

    # -- feeding the core --

    def handle(self, msg: Message) -> list[ev.Event]:
        try:
            events, effects = core.handle(self.state, msg, self.now)
        except Refused:
            self.refused += 1
            return []
        if events:  # stamped by the core with the next seqs of this replay's log
            self.next_seq = events[-1].seq + 1
            self.buffer.extend(events)
            for e in events:
                if type(e) is ev.JobPlaced:
                    self.placements += 1
        if self.validate:
            from eventsched.projections.cluster import validate_state

            validate_state(self.state)
        for eff in effects:
            if isinstance(eff, Launch):
                self.launch(eff)
            elif isinstance(eff, Signal):
                self.signal(eff)
            elif isinstance(eff, WakeAt):
                self.wake(eff.at)
        return events

    def flush(self) -> None:
        if self.buffer:
            self.appender.append(self.buffer)
            self.buffer = []

    def close(self, failed: bool = False) -> None:
        """Wait for the log, then close it; after a ``failed`` replay, that failure is the one raised."""
        try:
            self.appender.finish()
        except Exception:
            if not failed:
                raise
        finally:
            self.writer.close()

    def maybe_flush(self) -> None:
        if len(self.buffer) >= FLUSH_EVENTS:
            self.flush()

    def push(self, t: float, cls: int, seq: float, item: Any) -> None:
        self.counter += 1
        heapq.heappush(self.heap, (t, cls, seq, self.counter, item))

    # -- effects --

    def attempt_for(self, job: int) -> tuple[Attempt, bool]:
        n = self.launches.get(job, 0)
        self.launches[job] = n + 1
        runs = self.w.attempts.get(self.ordinal_of.get(job, -1))
        if runs:
            return runs[min(n, len(runs) - 1)], False
        # never ran in the recording: the median recorded runtime of its kind
        spec = self.state.jobs[job].spec
        d = self.w.runtime_by_key.get("\0".join(runtime_key(spec)), self.w.default_runtime)
        return Attempt(placed=0.0, started=0.0, ended=d, exit_code=0), True

    def true_duration(self, ordinal: int, spec: ev.JobSpec) -> float:
        """How long the job's first run takes in this replay (sjf-oracle)."""
        runs = self.w.attempts.get(ordinal)
        if runs:
            a = runs[0]
            end = a.ended if a.ended is not None else a.stopped
            if end is not None and a.started is not None:
                return max(0.0, end - a.started)
        return self.w.runtime_by_key.get("\0".join(runtime_key(spec)), self.w.default_runtime)

    def launch(self, eff: Launch) -> None:
        job = eff.job
        a, estimated = self.attempt_for(job)
        if estimated and self.launches[job] == 1:
            self.estimated += 1
        self.counter += 1
        token = self.live[job] = self.counter
        self.stopping.discard(job)
        shift = self.now - a.placed  # exactly 0.0 when placed when recorded
        start_now = self.w.instant_start or estimated
        if a.started is not None:
            if start_now:
                self.push(self.now, _REC, -1.0, ("start", job, token, ProcessStarted(job=job, pid=0)))
            else:
                if self.model_launch and a.launch_s is not None:
                    shift = self.modelled_start(a.launch_s) - a.started
                self.push(a.started + shift, _REC, float(a.start_seq),
                          ("start", job, token, ProcessStarted(job=job, pid=0)))
        if a.ended is not None:
            cls, key = (_REC, float(a.end_seq)) if a.end_seq else (_END, float(token))
            if a.lost:
                msg: Message = ProcessLost(job=job, reason=a.reason)
            elif a.started is None and a.reason.startswith(core.NOT_LAUNCHED):
                # the recording's daemon stopped before launching it
                msg = NeverLaunched(job=job, reason=a.reason.removeprefix(f"{core.NOT_LAUNCHED}: "))
            else:
                msg = ProcessExited(job=job, exit_code=a.exit_code, signal=a.signal, reason=a.reason)
            self.push(a.ended + shift, cls, key, ("end", job, token, msg))

    def modelled_start(self, launch_s: float) -> float:
        """When the daemon's launcher, one process at a time, would start a process placed
        now: a recorded delay also holds launches queued ahead then, which another policy lacks."""
        t = max(self.now, self.launcher_free) + launch_s
        self.launcher_free = t
        self.modelled_launches += 1
        return t

    def signal(self, eff: Signal) -> None:
        job = eff.job
        if job not in self.live or job in self.stopping:
            return
        self.stopping.add(job)
        runs = self.w.attempts.get(self.ordinal_of.get(job, -1)) or []
        n = self.launches.get(job, 1) - 1
        a = runs[min(n, len(runs) - 1)] if runs else None
        token = self.live[job]  # whichever end comes first wins
        if a is not None and a.stop_requested is not None and a.stopped is not None:
            t = a.stopped + (self.now - a.stop_requested)
            msg = ProcessExited(job=job, exit_code=a.exit_code, signal=a.signal, reason=a.reason)
            self.push(t, _REC, float(a.end_seq), ("end", job, token, msg))
        else:
            msg = ProcessExited(job=job, exit_code=None, signal=SIGTERM)
            self.push(self.now, _END, float(token), ("end", job, token, msg))

    def wake(self, at: float) -> None:
        if self.exact:
            return  # the recorded ticks are inputs (see run)
        at = max(at, self.now)
        if at not in self.ticks:
            self.ticks.add(at)
            self.push(at, _TICK, 0.0, ("tick", at))

    # -- inputs --

    def feed(self, item: Any) -> None:
        self.maybe_flush()
        if isinstance(item, tuple):
            kind = item[0]
            if kind == "submit":
                _, ordinal, msg = item
                if msg.spec.after:
                    after = [self.id_of.get(a, 0) for a in msg.spec.after]
                    msg = Submit(spec=msgspec.structs.replace(msg.spec, after=after), by=msg.by, normalised=msg.normalised)
                # the id the core will give it, known before its Launch effects run
                job = self.state.next_job_id
                self.ordinal_of[job] = ordinal
                if self.policy == "sjf-oracle":  # the reference policy knows the future
                    self.state.oracle[job] = self.true_duration(ordinal, msg.spec)
                if any(type(e) is ev.JobSubmitted and e.job == job for e in self.handle(msg)):
                    self.id_of[ordinal] = job
                else:
                    del self.ordinal_of[job]
                    self.state.oracle.pop(job, None)
            elif kind == "jobs":
                _, ordinals, cls, cause = item
                ok = _CAN[cls]
                jobs = self.state.jobs
                # in another policy's world some of them may be past this already
                ids = [self.id_of[o] for o in ordinals if o in self.id_of and jobs[self.id_of[o]].state in ok]
                if ids:
                    self.handle(cls(jobs=ids, uid=0, by=cause))
            elif kind == "update":  # a waiting job's request changed, if it still waits in this world
                _, ordinal, e = item
                updated = self.id_of.get(ordinal)
                if updated is not None and self.state.jobs[updated].state in WAITING:
                    self.handle(Update(job=updated, uid=0, by=e.by, operator=True, **e.changes()))
            elif kind == "policy":
                if self.follow_recorded:
                    self.handle(item[1])
            elif kind == "tenants":  # an operator's change, unless a what-if sets the tenants
                if self.tenants is None:
                    self.handle(item[1])
            elif kind == "start":  # a trace's machine: one Started per node
                _, node, infos, backend = item
                # no queue limit: a trace's burst is a workload, not abuse
                cfg = SchedulerConfig(node=node, policy=self.policy, max_queued=1 << 40, max_queued_per_user=1 << 40)
                started = _started_message(node, infos, self._what_if(cfg), backend)
                self.handle(msgspec.structs.replace(started, tenants=self.tenants))
            elif kind == "tick":  # a Tick records a TimerFired only when it decides anything
                self.handle(Tick())
                return
        elif isinstance(item, Started):
            if not self.follow_recorded:
                item = msgspec.structs.replace(item, config=self._what_if(
                    msgspec.structs.replace(item.config, policy=self.policy)))
                if self.tenants is not None:
                    item = msgspec.structs.replace(item, tenants=self.tenants)
            self.handle(item)
        else:
            self.handle(item)

    def _what_if(self, config: SchedulerConfig) -> SchedulerConfig:
        if not self.settings:
            return config
        try:
            return msgspec.convert({**msgspec.to_builtins(config), **self.settings}, SchedulerConfig)
        except msgspec.ValidationError as exc:
            raise ReplayError(f"what-if settings: {exc}") from None

    def process(self, item: Any) -> None:
        kind = item[0]
        if kind == "tick":
            self.ticks.discard(item[1])
            self.handle(Tick())
            return
        self.maybe_flush()
        _, job, token, msg = item
        if self.live.get(job) != token:
            return  # a process that was stopped (or never started) before this
        if kind == "end":
            del self.live[job]
            self.stopping.discard(job)
        self.handle(msg)

    def run(self) -> None:
        stimuli = list(self.w.stimuli)
        if self.exact:
            # the daemon ticked a little after the deadline it was asked for;
            # ticking when it did keeps every input in its recorded order
            stimuli.extend((t, _REC, float(seq), ("tick", None)) for t, seq in self.w.timer_times)
        stimuli.sort(key=lambda s: (s[0], s[1], s[2]))
        i, n = 0, len(stimuli)
        heap = self.heap
        idle_ticks = 0
        while i < n or heap:
            if heap and (i >= n or _earlier(heap[0], stimuli[i])):
                t, _, _, _, item = heapq.heappop(heap)
                if item[0] == "tick" and i >= n and not self._tick_useful(heap):
                    idle_ticks += 1
                    if idle_ticks > 10_000:
                        break
                    continue
                self.now = max(self.now, t)
                self.process(item)
            else:
                t, _, _, item = stimuli[i]
                i += 1
                if t > -math.inf:
                    self.now = max(self.now, t)
                    if self.started_at is None:
                        self.started_at = t
                self.feed(item)
        self.flush()

    def _tick_useful(self, heap: list[Any]) -> bool:
        """With no inputs left, a tick matters only while something could still happen."""
        if any(item[0] != "tick" for *_, item in heap):
            return True
        st = self.state
        return (bool(st.running) or any(st.jobs[j].not_before > self.now for j in st.backoff)
                or budgets.next_month(st, self.now) is not None)


def _pause_windows(stimuli: list[tuple[float, int, float, Any]]) -> list[tuple[float, float, str, int]]:
    """(paused at, resumed at, node, GPU) for every recorded pause, in time
    order; one never resumed lasts forever. A log's stimuli are in its order."""
    opened: dict[tuple[str, int], float] = {}
    windows: list[tuple[float, float, str, int]] = []
    for t, _, _, msg in stimuli:
        if isinstance(msg, PauseGpu):
            opened.setdefault((msg.node, msg.gpu), t)
        elif isinstance(msg, ResumeGpu) and (msg.node, msg.gpu) in opened:
            windows.append((opened.pop((msg.node, msg.gpu)), t, msg.node, msg.gpu))
    windows.extend((t, math.inf, node, gpu) for (node, gpu), t in opened.items())
    return sorted(windows)


def _earlier(pending: tuple[float, int, float, int, Any], stimulus: tuple[float, int, float, Any]) -> bool:
    """``pending[:3] < stimulus[:3]``, without two new slices per input."""
    if pending[0] != stimulus[0]:
        return pending[0] < stimulus[0]
    if pending[1] != stimulus[1]:
        return pending[1] < stimulus[1]
    return pending[2] < stimulus[2]


def simulate(workload: Workload, policy: str, state_dir: str | os.PathLike[str], *, validate: bool = False,
             settings: dict[str, Any] | None = None, tenants: dict[str, Tenant] | None = None) -> ReplayResult:
    """Replay ``workload`` under ``policy`` (``RECORDED`` = as the log says) into
    ``<state_dir>/log``; ``settings`` and ``tenants`` replace the recorded ones (a what-if)."""
    from eventsched.core.policies import POLICIES

    if policy != RECORDED and policy not in POLICIES:
        raise ReplayError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)} (or {RECORDED})")
    if policy == RECORDED and workload.kind != "log":
        raise ReplayError(f"policy {RECORDED!r} needs a recorded log as the source")
    t0 = time.perf_counter()
    out = Path(state_dir)
    if policy == RECORDED and (settings or tenants is not None):
        raise ReplayError(f"policy {RECORDED!r} replays the recording as it was: it takes no what-if settings")
    sim = _Sim(workload, policy, out, validate, settings, tenants)
    try:  # the fold makes no cycles: the collector's full passes would only walk the state
        with collector.paused():
            sim.run()
    except BaseException:
        sim.close(failed=True)
        raise
    sim.close()  # the log complete and durable before the result is returned
    st = sim.state
    unfinished = sum(1 for j in st.jobs.values() if j.state not in FINAL)
    notes = list(sim.notes)
    if sim.estimated:
        notes.append(f"{sim.estimated} jobs never ran in the recording; their runtime is the median recorded "
                     "runtime of the same user's same job (else of all jobs)")
    if sim.modelled_launches:
        notes.append(_launch_note(workload))
    if unfinished:
        notes.append(f"{unfinished} jobs had not finished when the inputs ran out")
    if policy == "sjf-backfill" and workload.kind != "log" and len({runtime_key(j.spec) for j in st.jobs.values()}) <= 1:
        notes.append("sjf-backfill had no history to predict from: this trace has no users or job names, so every "
                     "job got the same prediction (the mean of all runs so far) and it ordered them by priority and "
                     "arrival, as best-fit does; see sjf-oracle for what a perfect predictor would do")
    return ReplayResult(
        policy=policy if policy != RECORDED else f"{RECORDED} ({workload.recorded_policy})", source=workload.name,
        state_dir=str(out), jobs=len(st.jobs), events=sim.next_seq - 1, placements=sim.placements,
        refused=sim.refused, estimated_runtimes=sim.estimated, unfinished=unfinished,
        sim_start=sim.started_at if sim.started_at is not None else 0.0, sim_end=sim.now,
        wall_s=time.perf_counter() - t0, notes=notes)


def _launch_note(workload: Workload) -> str:
    costs = sorted(a.launch_s for runs in workload.attempts.values() for a in runs if a.launch_s is not None)
    median = costs[len(costs) // 2] if costs else 0.0
    return ("placement-to-start latency is modelled, estimated from the recording: one launch at a time, each "
            f"taking the time its job's launch took there (median {1000 * median:.1f} ms); run times as recorded")
