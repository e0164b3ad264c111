"""The replay simulator: a recorded log or a trace, through the same core, on a virtual clock.

The daemon and the simulator drive the *same* sans-I/O ``core.handle``. The
simulator supplies what the engine gets from the world:

- *exogenous stimuli* at their recorded times: the daemon's start (its GPUs),
  submissions, GPU samples, operators' commands (cancel, hold / release, pause /
  resume GPU, policy changes), stops;
- *process lifetimes*: a ``Launch`` effect starts a simulated process whose
  ``ProcessStarted`` and ``ProcessExited`` come after the recorded delays of
  that job's run (attempt by attempt: retries and requeues run again), shifted
  by how much earlier or later the replay placed it;
- the clock: a ``WakeAt`` effect becomes a ``Tick`` at that virtual time.

Decisions (``JobPlaced``, ``JobRequeued``, time-limit stops...) are *outputs*:
they are never read from the source, only produced by the core.

Fidelity. Replaying a log under the policy that recorded it reproduces its
placements exactly. Each input carries an ordering key ``(time, class, seq)``:
recorded inputs use their recorded time and sequence number, so inputs that the
daemon handled in one batch (one ``now``) keep their recorded order, and a
process event comes back exactly at its recorded time because its time is
computed as ``recorded_time + shift`` with ``shift`` exactly 0.0 when the
placement happened when it was recorded. The daemon records each timer tick
that decided anything as a ``TimerFired`` fact; the replay ticks at exactly
those moments (a log from before facts and causes were recorded ticks when the
core asks instead, so it is replayed faithfully only up to timer latency).
Stimuli are the events whose ``cause`` is not ``seq:N``: nothing is inferred
from how events happened to be batched into frames. Recorded
clocks that stepped backwards are flattened (running maximum) first.

Sources (``load_source``): a state dir or log dir of ours, a plain CSV
(``traces.load_csv``; needs a machine: ``fake:N[:MIB]``), the Alibaba openb pod
list (with its node list next to it; see ``alibaba_workload`` for the arrival
and duration model, since the trace's own times are not a schedule).

Every replay writes its own log (``<out>/log``), so ``open_history(out)`` and
``eventsched sql`` work on it as on a real state dir.
"""

from __future__ import annotations

import heapq
import math
import os
import random
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from . import __version__, core
from . import events as ev
from . import log as eventlog
from .messages import (
    Cancel,
    GpuFailed,
    GpuInfo,
    GpuObserved,
    Hold,
    Launch,
    Message,
    PauseGpu,
    ProcessExited,
    NeverLaunched,
    ProcessLost,
    ProcessStarted,
    Refused,
    Release,
    ResumeGpu,
    SchedulerConfig,
    SetPolicy,
    Signal,
    Started,
    Stopping,
    Submit,
    Tick,
    WakeAt,
)
from .projections.cluster import ClusterState, runtime_key
from .settings import settings_from_dict

__all__ = [
    "ReplayError",
    "Attempt",
    "Workload",
    "ReplayResult",
    "RECORDED",
    "load_source",
    "log_workload",
    "trace_workload",
    "csv_workload",
    "alibaba_workload",
    "parse_fake_gpus",
    "simulate",
    "placements",
    "compare_placements",
]

RECORDED = "recorded"  # policy name meaning "as the log says, policy changes included"
SIGTERM = 15
FLUSH_EVENTS = 65_536  # events per frame of a replay's log (one fdatasync each)

# ordering classes at equal times: recorded inputs (by seq) first, then
# simulated process ends, then arrivals of a trace, then the clock
_REC, _END, _ARRIVE, _TICK = 0, 1, 2, 3


class ReplayError(Exception):
    """A source that cannot be replayed; str() is one line for the user."""


class Attempt(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded run of a job: times are absolute recorded times (or, for a
    trace, relative to a placement at 0). ``None`` = it did not happen."""

    placed: float
    started: float | None = None
    start_seq: int = 0
    ended: float | None = None  # a natural end: exit or loss, not after a stop request
    end_seq: int = 0
    stop_requested: float | None = None  # when a stop (cancel, time limit...) was asked
    stopped: float | None = None  # when the process exited after that request
    exit_code: int | None = 0
    signal: int | None = None
    reason: str = ""
    lost: bool = False


class Workload(msgspec.Struct, kw_only=True):
    """Everything a replay needs from a source, policy-independent."""

    name: str
    kind: str  # "log", "csv", "alibaba"
    # (time, class, seq, message): exogenous inputs in the order to feed them
    stimuli: list[tuple[float, int, float, Any]]
    attempts: dict[int, list[Attempt]]  # by the submission's ordinal (1-based)
    recorded_policy: str = ""
    instant_start: bool = False  # a trace: ProcessStarted right with the Launch
    timer_times: list[tuple[float, int]] = []  # (time, seq) of each recorded TimerFired
    legacy: bool = False  # a log without causes: its timers are not known, ticks come from the core
    policy_changes: int = 0  # operators' policy switches in the recording
    default_runtime: float = 3600.0  # for jobs that never ran in the recording
    runtime_by_key: dict[str, float] = {}
    notes: list[str] = []


class ReplayResult(msgspec.Struct, kw_only=True):
    policy: str
    source: str
    state_dir: str  # holds log/; open_history(state_dir) queries it
    jobs: int
    events: int
    placements: int
    refused: int
    estimated_runtimes: int  # jobs that ran here but never in the recording
    unfinished: int  # jobs neither finished nor cancelled when the replay ended
    sim_start: float
    sim_end: float
    wall_s: float
    notes: list[str] = []


# --- sources ----------------------------------------------------------------------------


def parse_fake_gpus(text: str) -> tuple[int, int]:
    """``fake:N[:MIB]`` -> (N, MIB)."""
    parts = text.split(":")
    try:
        if parts[0] != "fake" or len(parts) not in (2, 3):
            raise ValueError
        n = int(parts[1])
        mib = int(parts[2]) if len(parts) == 3 else 81_920
        if n <= 0 or mib <= 0:
            raise ValueError
    except ValueError:
        raise ReplayError(f"--gpus must look like fake:N[:MEM_MIB] (e.g. fake:8:81920), got {text!r}") from None
    return n, mib


def _log_dir_of(path: Path) -> Path | None:
    for cand in (path / "log", path):
        if cand.is_dir() and eventlog.segments(cand):
            return cand
    return None


def load_source(source: str | os.PathLike[str], *, gpus: str | None = None, seed: int = 0) -> Workload:
    """A state dir, a log dir, a plain CSV or an Alibaba openb pod list."""
    path = Path(source)
    if path.is_dir():
        log_dir = _log_dir_of(path)
        if log_dir is None:
            raise ReplayError(f"{path}: no event log here (expected a state dir with log/, or a log dir)")
        return log_workload(log_dir)
    if not path.is_file():
        raise ReplayError(f"{path}: no such file or directory")
    try:
        with open(path, encoding="utf-8") as f:
            head = ""
            for line in f:
                if line.strip() and not line.lstrip().startswith("#"):
                    head = line
                    break
    except (OSError, UnicodeDecodeError) as e:
        raise ReplayError(f"{path}: cannot read: {e}") from None
    columns = {c.strip() for c in head.split(",")}
    from .traces import TraceError

    try:
        if {"submit_time", "duration", "gpus"} <= columns:
            n, mib = parse_fake_gpus(gpus) if gpus else (8, 81_920)
            return csv_workload(path, n, mib)
        if {"name", "num_gpu", "gpu_milli"} <= columns:
            node_csv = path.parent / "openb_node_list_gpu_node.csv"
            if not node_csv.is_file():
                raise ReplayError(f"{path}: an Alibaba pod list needs {node_csv.name} next to it")
            return alibaba_workload(path, node_csv, seed=seed)
    except TraceError as e:
        raise ReplayError(str(e)) from None
    raise ReplayError(
        f"{path}: not a trace I know (a plain CSV needs the header submit_time,duration,gpus; "
        "an Alibaba pod list name,...,num_gpu,gpu_milli,...)"
    )


def _started_message(
    node: str, gpus: list[GpuInfo], config: SchedulerConfig, backend: str, pid: int = 0, version: str = __version__
) -> Started:
    return Started(node=node, pid=pid, version=version, gpu_backend=backend, gpus=gpus, config=config)


def _config_of(e: ev.DaemonStarted) -> SchedulerConfig:
    config = settings_from_dict(dict(e.config), node=e.node)
    return msgspec.structs.replace(config, policy=e.policy or config.policy)


# Events an operator's command leaves, one per job named (cancel, hold, release).


_COMMANDS = {"cancel": Cancel, "hold": Hold, "release": Release}


def _legacy_command(e: ev.Event) -> bool:
    """In a log written before commands and causes were recorded, a user's
    cancel, hold or release is the per-job event itself (one per job)."""
    if isinstance(e, ev.JobCancelRequested):
        return e.reason == "cancelled" and not e.cause.startswith("dependency:")
    return not e.cause.startswith(("dependency:", "seq:"))


def log_workload(log_dir: str | os.PathLike[str]) -> Workload:
    """Read a recorded log into stimuli and per-job attempts.

    A stimulus is an event whose ``cause`` is not ``seq:N`` (``events.is_stimulus``):
    what a user, a process, a GPU or the clock did. Decisions name the stimulus
    that caused them and are never read back as inputs, only compared.
    """
    try:
        events = [e for batch in eventlog.read_batches(log_dir) for e in batch]
    except eventlog.LogError as err:
        raise ReplayError(f"{log_dir}: cannot read the log: {err}") from None
    # a log from before causes were recorded: its user commands are per-job
    # events, and when its timers fired is not known (see Workload.timer_times)
    legacy = not any(e.cause.startswith("seq:") for e in events)
    stimuli: list[tuple[float, int, float, Any]] = []
    attempts: dict[int, list[dict[str, Any]]] = {}
    ordinal: dict[int, int] = {}  # recorded job id -> submission ordinal
    timer_times: list[tuple[float, int]] = []
    recorded_policy = ""
    policy_changes = 0
    clock = -math.inf
    start: tuple[float, int, ev.DaemonStarted, list[GpuInfo]] | None = None

    def flush_start() -> None:
        nonlocal start
        if start is not None:
            t, seq, d, infos = start
            msg = _started_message(d.node, infos, _config_of(d), d.gpu_backend, d.pid, d.version)
            stimuli.append((t, _REC, float(seq), msg))
            start = None

    for e in events:
        t = clock = max(clock, e.ts)  # a clock stepped back is flattened
        seq = e.seq
        stimulus = ev.is_stimulus(e)
        if isinstance(e, ev.GpuDiscovered):  # part of the DaemonStarted before it
            if start is not None:
                start[3].append(GpuInfo(gpu=e.gpu, uuid=e.uuid, model=e.model, memory_total_mib=e.memory_total_mib))
            continue
        if isinstance(e, ev.PolicyChanged) and e.by == "config":
            continue  # recorded by the core itself when a restart brings another policy
        if stimulus:
            flush_start()  # the DaemonStarted's own decisions are over
        if isinstance(e, ev.DaemonStarted):
            recorded_policy = recorded_policy or e.policy
            start = (t, seq, e, [])
        elif isinstance(e, ev.JobSubmitted):
            ordinal[e.job] = len(ordinal) + 1
            stimuli.append((t, _REC, float(seq), ("submit", e.job, Submit(spec=e.spec, by=e.cause))))
        elif isinstance(e, ev.GpuSampled):
            stimuli.append((t, _REC, float(seq), GpuObserved(
                node=e.node, gpu=e.gpu, utilization=e.utilization, memory_used_mib=e.memory_used_mib,
                memory_total_mib=e.memory_total_mib, temperature_c=e.temperature_c, power_w=e.power_w,
                foreign_memory_mib=e.foreign_memory_mib)))
        elif isinstance(e, ev.GpuErrored):
            if stimulus and e.cause != "daemon":  # not the core's own finding at start-up
                stimuli.append((t, _REC, float(seq), GpuFailed(node=e.node, gpu=e.gpu, error=e.error, lost=e.lost)))
        elif isinstance(e, ev.GpuPaused):
            stimuli.append((t, _REC, float(seq), PauseGpu(node=e.node, gpu=e.gpu, by=e.by)))
        elif isinstance(e, ev.GpuResumed):
            stimuli.append((t, _REC, float(seq), ResumeGpu(node=e.node, gpu=e.gpu, by=e.by)))
        elif isinstance(e, ev.PolicyChanged):
            if stimulus:
                policy_changes += 1
                stimuli.append((t, _REC, float(seq), ("policy", SetPolicy(policy=e.policy, by=e.by))))
        elif isinstance(e, ev.DaemonStopped):
            stimuli.append((t, _REC, float(seq), Stopping(node=e.node, reason=e.reason)))
        elif isinstance(e, ev.TimerFired):
            timer_times.append((t, seq))
        elif isinstance(e, ev.JobsCommanded):
            stimuli.append((t, _REC, float(seq), ("jobs", list(e.jobs), _COMMANDS[e.command], e.by)))
        elif isinstance(e, (ev.JobCancelled, ev.JobHeld, ev.JobReleased)):
            if legacy and _legacy_command(e):
                cls = Cancel if isinstance(e, ev.JobCancelled) else Hold if isinstance(e, ev.JobHeld) else Release
                stimuli.append((t, _REC, float(seq), ("jobs", [e.job], cls, e.cause)))
        elif isinstance(e, ev.JobCancelRequested):
            _attempt(attempts, e.job)["stop_requested"] = t
            if legacy and _legacy_command(e):
                stimuli.append((t, _REC, float(seq), ("jobs", [e.job], Cancel, e.cause)))
        elif isinstance(e, ev.JobPlaced):
            attempts.setdefault(e.job, []).append({"placed": t})
        elif isinstance(e, ev.JobStarted):
            a = _attempt(attempts, e.job)
            a["started"], a["start_seq"] = t, seq
        elif isinstance(e, ev.JobExited):
            a = _attempt(attempts, e.job)
            a.update(exit_code=e.exit_code, signal=e.signal, reason=e.reason, end_seq=seq)
            if "stop_requested" in a:
                a["stopped"] = t
            else:
                a["ended"] = t
        elif isinstance(e, ev.JobLost):
            a = _attempt(attempts, e.job)
            a.update(ended=t, end_seq=seq, lost=True, reason=e.reason)
    flush_start()
    if not recorded_policy:
        raise ReplayError(f"{log_dir}: the log has no DaemonStarted event; nothing to replay on")

    by_ordinal: dict[int, list[Attempt]] = {}
    runtimes: dict[str, list[float]] = {}
    specs: dict[int, ev.JobSpec] = {}  # recorded job id -> its spec
    for _, _, _, item in stimuli:
        if isinstance(item, tuple) and item[0] == "submit":
            specs[item[1]] = item[2].spec
    for rid, runs in attempts.items():
        if rid not in ordinal:
            continue
        out = []
        for a in runs:
            if "placed" not in a:
                continue
            out.append(msgspec.convert(a, Attempt))
            if a.get("started") is not None and a.get("ended") is not None and not a.get("lost"):
                spec = specs.get(rid)
                key = "\0".join(runtime_key(spec)) if spec is not None else ""
                runtimes.setdefault(key, []).append(a["ended"] - a["started"])
        by_ordinal[ordinal[rid]] = out
    # Re-key job references by submission ordinal: the replay's ids may differ.
    fixed: list[tuple[float, int, float, Any]] = []
    for t, c, s, item in stimuli:
        if isinstance(item, tuple) and item[0] == "submit":
            msg = item[2]
            if msg.spec.after:  # dependencies by submission ordinal too
                spec = msgspec.structs.replace(msg.spec, after=[ordinal.get(a, -1) for a in msg.spec.after])
                msg = Submit(spec=spec, by=msg.by)
            item = ("submit", ordinal[item[1]], msg)
        elif isinstance(item, tuple) and item[0] == "jobs":
            item = ("jobs", [ordinal.get(j, -j) for j in item[1]], item[2], item[3])
        fixed.append((t, c, s, item))
    every = sorted(x for xs in runtimes.values() for x in xs)
    median = every[len(every) // 2] if every else 3600.0
    return Workload(
        name=str(log_dir), kind="log", stimuli=fixed, attempts=by_ordinal, recorded_policy=recorded_policy,
        timer_times=sorted(timer_times), default_runtime=median, policy_changes=policy_changes, legacy=legacy,
        runtime_by_key={k: sorted(v)[len(v) // 2] for k, v in runtimes.items()},
    )


def _attempt(attempts: dict[int, list[dict[str, Any]]], job: int) -> dict[str, Any]:
    runs = attempts.setdefault(job, [])
    if not runs:
        runs.append({})
    return runs[-1]


def trace_workload(
    name: str,
    kind: str,
    jobs: Sequence[Any],
    machine: list[tuple[str, list[GpuInfo]]],
    backend: str,
    notes: Iterable[str] = (),
) -> Workload:
    """Stimuli for a list of ``traces.TraceJob`` on a machine of (node, GPUs)."""
    stimuli: list[tuple[float, int, float, Any]] = []
    for k, (node, infos) in enumerate(machine):
        stimuli.append((-math.inf, _REC, float(k), ("start", node, infos, backend)))
    attempts: dict[int, list[Attempt]] = {}
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].submit_time, i))
    for n, i in enumerate(order, start=1):
        j = jobs[i]
        # one command for all: runtime predictions (sjf-backfill) learn per user,
        # from runs that ended, as they would on a real machine
        spec = ev.JobSpec(
            command=[kind], user=j.user, gpus=j.gpus, gpu_mem_mib=j.gpu_mem_mib, priority=j.priority,
            env={"TRACE_ROW": str(i + 1)},
        )
        stimuli.append((float(j.submit_time), _ARRIVE, float(n), ("submit", n, Submit(spec=spec, by="trace"))))
        attempts[n] = [Attempt(placed=0.0, started=0.0, ended=float(j.duration), exit_code=0)]
    return Workload(name=name, kind=kind, stimuli=stimuli, attempts=attempts, instant_start=True, notes=list(notes))


def csv_workload(path: str | os.PathLike[str], n_gpus: int, mib: int) -> Workload:
    from .traces import load_csv

    jobs = load_csv(path)
    infos = [GpuInfo(gpu=i, uuid=f"fake-{i}", model="fake", memory_total_mib=mib) for i in range(n_gpus)]
    notes = []
    too_big = sum(1 for j in jobs if j.gpus > n_gpus or j.gpu_mem_mib > mib)
    if too_big:
        notes.append(f"{too_big} jobs ask for more than fake:{n_gpus}:{mib} has; they never run")
    return trace_workload(str(path), "csv", jobs, [("local", infos)], f"fake:{n_gpus}:{mib}", notes)


# Memory of the Alibaba GPU models (the trace's requests never use it: no gpu_mem)
_MODEL_MIB = {"T4": 15_360, "P100": 16_384, "V100M16": 16_384, "V100M32": 32_768, "A10": 24_576}
ALIBABA_LOAD = 0.95  # offered GPU load of the synthetic arrival process
ALIBABA_MAX_DURATION = 3600.0
# The pod list asks for 98 % of the 6,212 GPUs in all: on the whole cluster
# nothing would ever wait. A seeded sample of the nodes makes the stream contend.
ALIBABA_NODE_SHARE = 1 / 16


def alibaba_workload(
    pod_csv: str | os.PathLike[str], node_csv: str | os.PathLike[str], *, seed: int = 0,
    load: float = ALIBABA_LOAD, node_share: float = ALIBABA_NODE_SHARE,
) -> Workload:
    """The openb pods as a dynamic workload on the openb GPU nodes.

    The trace's time columns are not a schedule (censored, a snapshot of pods
    alive at the end; see traces/README.md), so this model is synthetic:

    - the cluster is a seeded sample of ``node_share`` (1/16) of the nodes,
      the same share of every node shape: the whole pod list fits the whole
      cluster at once (98 % of its GPUs), so on all of it nothing would wait;
    - every GPU pod arrives once, in the trace's order (= creation order);
      CPU-only pods (num_gpu = 0) are left out: they use no GPU; pods larger
      than any sampled node are left out too;
    - durations are drawn (seeded) from the observed lifetimes
      deletion - creation of the pods that *finished* (Succeeded / Failed),
      the only uncensored durations in the trace, capped at 1 hour (so that
      the stream reaches a steady state well within its span);
    - arrivals are a Poisson process whose rate makes the offered GPU load
      (sum of gpus x duration over capacity x span) equal to ``load`` (0.95);
    - a pod asks num_gpu whole GPUs, or gpu_milli/1000 of one GPU; CPU and
      host memory are not modelled (our scheduler has none), nor GPU models.
    """
    from .traces import AlibabaNode, TraceJob, load_alibaba

    pods, nodes = load_alibaba(pod_csv, node_csv)
    finished = sorted(
        float(p.deletion_time - p.creation_time)
        for p in pods
        if p.pod_phase in ("Succeeded", "Failed") and p.creation_time is not None and p.deletion_time is not None
        and p.deletion_time > p.creation_time
    )
    if not finished:
        finished = [3600.0]
    rng = random.Random(seed)
    if node_share < 1.0:
        shapes: dict[tuple[str, int], list[AlibabaNode]] = {}
        for node in nodes:
            shapes.setdefault((node.model, node.gpus), []).append(node)
        keep: set[str] = set()
        for group in shapes.values():
            k = max(1, round(len(group) * node_share))
            keep.update(n.name for n in rng.sample(group, k))
        nodes = [n for n in nodes if n.name in keep]
    biggest = max((n.gpus for n in nodes), default=0)
    gpu_pods = [p for p in pods if 0 < p.num_gpu <= biggest]
    capacity = sum(n.gpus for n in nodes)
    durations = [min(ALIBABA_MAX_DURATION, max(1.0, rng.choice(finished))) for _ in gpu_pods]
    demand = [p.num_gpu if p.gpu_milli >= 1000 else p.gpu_milli / 1000 for p in gpu_pods]
    work = sum(d * g for d, g in zip(durations, demand))
    span = work / (load * capacity) if capacity else 1.0
    mean_gap = span / max(1, len(gpu_pods))
    t = 0.0
    jobs = []
    for p, d, g in zip(gpu_pods, durations, demand):
        jobs.append(TraceJob(submit_time=round(t, 3), duration=round(d, 3), gpus=g, user=p.qos))
        t += rng.expovariate(1.0 / mean_gap) if mean_gap > 0 else 0.0
    machine = []
    for node in nodes:
        mib = _MODEL_MIB.get(node.model, 32_768)
        machine.append((node.name, [
            GpuInfo(gpu=i, uuid=f"{node.name}-{i}", model=node.model, memory_total_mib=mib) for i in range(node.gpus)
        ]))
    notes = [
        f"Alibaba openb: {len(gpu_pods)} GPU pods of {len(pods)} (CPU-only ones left out) "
        f"on a seeded {node_share:.3g} sample of the nodes: {len(nodes)} nodes / {capacity} GPUs",
        f"synthetic schedule (seed {seed}): Poisson arrivals at {load:.0%} offered GPU load over "
        f"{span / 3600:.1f} h; durations drawn from the {len(finished)} finished pods' lifetimes, capped at 1 h",
        "users = the pods' QoS class (LS, BE, Burstable, Guaranteed)",
    ]
    return trace_workload(str(pod_csv), "alibaba", jobs, machine, "alibaba-openb", notes)


# --- the simulator ----------------------------------------------------------------------


# job states in which each command still applies
_CAN: dict[type, frozenset[str]] = {
    Cancel: frozenset({"queued", "held", "preempted", "running"}),
    Hold: frozenset({"queued"}),
    Release: frozenset({"held"}),
}


class _Sim:
    """One replay: a state, a heap of pending inputs, a log being written."""

    def __init__(self, workload: Workload, policy: str, state_dir: Path, validate: bool) -> None:
        self.w = workload
        self.policy = policy
        # RECORDED follows the log's policy switches; a named policy holds throughout
        self.follow_recorded = policy == RECORDED
        # the recording's own policy throughout: tick exactly when the daemon did
        self.exact = workload.kind == "log" and not workload.legacy and (
            policy == RECORDED or (policy == workload.recorded_policy and not workload.policy_changes)
        )
        self.state = ClusterState()
        self.validate = validate
        self.writer = eventlog.LogWriter.open(state_dir / "log")
        if self.writer.next_seq != 1:
            self.writer.close()
            raise ReplayError(f"{state_dir / 'log'} already holds a log; replays need a fresh directory")
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
        self.refused = 0
        self.placements = 0
        self.estimated = 0
        self.now = 0.0
        self.started_at: float | None = None
        self.notes: list[str] = list(workload.notes)

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
            from .projections.cluster import validate_state

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
            self.writer.append(self.buffer)
            self.buffer = []

    def tick(self) -> None:
        self.handle(Tick())  # records a TimerFired when it decides anything

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
                    msg = Submit(spec=msgspec.structs.replace(msg.spec, after=after), by=msg.by)
                # the id the core will give it, known before its Launch effects run
                job = self.state.next_job_id
                self.ordinal_of[job] = ordinal
                if any(type(e) is ev.JobSubmitted and e.job == job for e in self.handle(msg)):
                    self.id_of[ordinal] = job
                else:
                    del self.ordinal_of[job]
            elif kind == "jobs":
                _, ordinals, cls, cause = item
                ok = _CAN[cls]
                jobs = self.state.jobs
                # in another policy's world some of them may be past this already
                ids = [self.id_of[o] for o in ordinals if o in self.id_of and jobs[self.id_of[o]].state in ok]
                if ids:
                    self.handle(cls(jobs=ids, uid=0, by=cause))
            elif kind == "policy":
                if self.follow_recorded:
                    self.handle(item[1])
            elif kind == "start":  # a trace's machine: one Started per node
                _, node, infos, backend = item
                # no queue limit: a trace's burst is a workload, not abuse
                cfg = SchedulerConfig(node=node, policy=self.policy, max_queued=1 << 40, max_queued_per_user=1 << 40)
                self.handle(_started_message(node, infos, cfg, backend))
            elif kind == "tick":
                self.tick()
                return
        elif isinstance(item, Started):
            if not self.follow_recorded:
                item = msgspec.structs.replace(item, config=msgspec.structs.replace(item.config, policy=self.policy))
            self.handle(item)
        else:
            self.handle(item)

    def process(self, item: Any) -> None:
        kind = item[0]
        if kind == "tick":
            self.ticks.discard(item[1])
            self.tick()
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
            if heap and (i >= n or heap[0][:3] < stimuli[i][:3]):
                t, _, _, _, item = heapq.heappop(heap)
                if item[0] == "tick" and i >= n and not self._tick_useful(heap):
                    idle_ticks += 1
                    if idle_ticks > 10_000:
                        break
                    continue
                self.now = max(self.now, t)
                self.process(item)
            else:
                t = stimuli[i][0]
                item = stimuli[i][3]
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
        return bool(st.running) or any(st.jobs[j].not_before > self.now for j in st.backoff)


def simulate(
    workload: Workload,
    policy: str,
    state_dir: str | os.PathLike[str],
    *,
    validate: bool = False,
) -> ReplayResult:
    """Replay ``workload`` under ``policy`` (``RECORDED`` = as the log says),
    writing its log to ``<state_dir>/log``. ``validate`` checks the state's
    invariants after every step (tests)."""
    from .policies import POLICIES

    if policy != RECORDED and policy not in POLICIES:
        raise ReplayError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)} (or {RECORDED})")
    if policy == RECORDED and workload.kind != "log":
        raise ReplayError(f"policy {RECORDED!r} needs a recorded log as the source")
    t0 = time.perf_counter()
    out = Path(state_dir)
    # the Started of a log replay, under another policy, gets that policy
    sim = _Sim(workload, policy, out, validate)
    try:
        sim.run()
    finally:
        sim.writer.close()
    st = sim.state
    unfinished = sum(1 for j in st.jobs.values() if j.state not in ("succeeded", "failed", "cancelled", "lost"))
    notes = list(sim.notes)
    if sim.estimated:
        notes.append(
            f"{sim.estimated} jobs never ran in the recording; their runtime is the median recorded runtime "
            "of the same user's same job (else of all jobs)"
        )
    if unfinished:
        notes.append(f"{unfinished} jobs had not finished when the inputs ran out")
    return ReplayResult(
        policy=policy if policy != RECORDED else f"{RECORDED} ({workload.recorded_policy})",
        source=workload.name,
        state_dir=str(out),
        jobs=len(st.jobs),
        events=sim.next_seq - 1,
        placements=sim.placements,
        refused=sim.refused,
        estimated_runtimes=sim.estimated,
        unfinished=unfinished,
        sim_start=sim.started_at if sim.started_at is not None else 0.0,
        sim_end=sim.now,
        wall_s=time.perf_counter() - t0,
        notes=notes,
    )


# --- fidelity ------------------------------------------------------------------------------


def placements(log_dir: str | os.PathLike[str]) -> list[tuple[int, str, tuple[int, ...]]]:
    """(submission ordinal, node, GPU ids) of every JobPlaced, in log order."""
    ordinal: dict[int, int] = {}
    out = []
    for e in eventlog.read(log_dir):
        if type(e) is ev.JobSubmitted:
            ordinal[e.job] = len(ordinal) + 1
        elif type(e) is ev.JobPlaced:
            out.append((ordinal.get(e.job, -e.job), e.node, tuple(e.gpu_ids)))
    return out


def compare_placements(recorded_log: str | os.PathLike[str], replay_log: str | os.PathLike[str]) -> str | None:
    """None when the replay placed the same jobs on the same GPUs in the same
    order as the recording; else a one-line description of the first difference."""
    a, b = placements(recorded_log), placements(replay_log)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"placement #{i + 1}: recorded job {x[0]} on {x[1]}:{list(x[2])}, replay job {y[0]} on {y[1]}:{list(y[2])}"
    if len(a) != len(b):
        return f"recorded {len(a)} placements, replay {len(b)}"
    return None
