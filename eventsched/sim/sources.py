"""Replay sources: a recorded log, a plain CSV or the Alibaba trace, read into
a ``Workload``: the stimuli to feed the core, in order, and each job's
recorded runs. A log's stimuli are its events that are not decisions
(``events.is_stimulus``); a clock that stepped back is flattened.
"""

from __future__ import annotations

import math
import os
import random
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from eventsched import __version__
from eventsched.domain import events as ev
from eventsched.domain import units
from eventsched.domain.messages import (Cancel, ClusterLink, GpuFailed, GpuHealthRead, GpuInfo, GpuObserved, Hold, NodeDown,
                                        NodeUp, PauseGpu, Release, ResumeGpu, SchedulerConfig, SetPolicy,
                                        SetTenants, Started, Stopping, Submit)
from eventsched.domain.messages import CancelReservation, Reserve
from eventsched.domain.settings import settings_from_dict
from eventsched.projections import collector
from eventsched.projections.cluster import runtime_key
from eventsched.storage import log as eventlog

__all__ = ["ReplayError", "Attempt", "Workload", "load_source", "log_workload", "trace_workload", "csv_workload",
           "alibaba_workload"]
MAX_NODES = 10_000  # machines a replay may make up (each a list of fake GPUs)

# ordering classes at equal times: recorded inputs (by seq) first, then
# simulated process ends, then arrivals of a trace, then the clock
_REC, _END, _ARRIVE, _TICK = 0, 1, 2, 3


class ReplayError(Exception):
    """A source that cannot be replayed; str() is one line for the user."""


class Attempt(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded run of a job (a trace's times are relative to a placement at 0; None: did not happen)."""

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
    # the launcher's own share of placement-to-start (it starts one process at a time)
    launch_s: float | None = None


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


@collector.paused()  # a workload's objects make no cycles: young collections would only rescan them
def load_source(source: str | os.PathLike[str], *, gpus: str | None = None, seed: int = 0, nodes: int = 1) -> Workload:
    """A state dir, a log dir, a plain CSV or an Alibaba openb pod list."""
    path = Path(source)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise ReplayError(f"{path}: no such file or directory") from None
    except OSError as exc:  # a name too long, a folder it may not enter
        raise ReplayError(f"{path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        log_dir = next((d for d in (path / "log", path) if d.is_dir() and eventlog.segments(d)), None)
        if log_dir is None:
            raise ReplayError(f"{path}: no event log here (expected a state dir with log/, or a log dir)")
        return log_workload(log_dir)
    if not stat.S_ISREG(mode):
        raise ReplayError(f"{path}: not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            head = next((line for line in f if line.strip() and not line.lstrip().startswith("#")), "")
    except (OSError, UnicodeDecodeError) as e:
        raise ReplayError(f"{path}: cannot read: {e}") from None
    columns = {c.strip() for c in head.split(",")}
    from eventsched.sim.traces import TraceError

    try:
        if {"submit_time", "duration", "gpus"} <= columns:
            n, mib = units.parse_fake_gpus(gpus) if gpus else (8, 81_920)
            return csv_workload(path, n, mib, nodes)
        if {"name", "num_gpu", "gpu_milli"} <= columns:
            node_csv = path.parent / "openb_node_list_gpu_node.csv"
            if not node_csv.is_file():
                raise ReplayError(f"{path}: an Alibaba pod list needs {node_csv.name} next to it")
            return alibaba_workload(path, node_csv, seed=seed)
    except (TraceError, units.UnitError) as e:
        raise ReplayError(str(e)) from None
    raise ReplayError(
        f"{path}: not a trace I know (a plain CSV needs the header submit_time,duration,gpus; "
        "an Alibaba pod list name,...,num_gpu,gpu_milli,...)"
    )


def _started_message(node: str, gpus: list[GpuInfo], config: SchedulerConfig, backend: str, pid: int = 0,
                     version: str = __version__) -> Started:
    return Started(node=node, pid=pid, version=version, gpu_backend=backend, gpus=gpus, config=config)


def _config_of(e: ev.DaemonStarted) -> SchedulerConfig:
    config = settings_from_dict(dict(e.config), node=e.node)
    return msgspec.structs.replace(config, policy=e.policy or config.policy)


_COMMANDS = {"cancel": Cancel, "hold": Hold, "release": Release}
# what a legacy log's per-job command event was asked by
_LEGACY_COMMANDS: dict[type, type] = {ev.JobCancelled: Cancel, ev.JobHeld: Hold, ev.JobReleased: Release}
# recorded stimuli that are fed again as one input each, whatever caused them
_INPUTS: dict[type, Callable[[Any], Any]] = {
    ev.NodeLeft: lambda e: NodeDown(node=e.node, reason=e.reason),
    ev.ClusterDisconnected: lambda e: ClusterLink(lost=e.lost, reason=e.reason),
    ev.GpuSampled: lambda e: GpuObserved(
        node=e.node, gpu=e.gpu, utilization=e.utilization, memory_used_mib=e.memory_used_mib,
        memory_total_mib=e.memory_total_mib, temperature_c=e.temperature_c, power_w=e.power_w,
        foreign_memory_mib=e.foreign_memory_mib, job_memory_mib=e.job_memory_mib,
        foreign_processes=e.foreign_processes),
    ev.GpuHealth: lambda e: GpuHealthRead(reading=e),
    ev.GpuResumed: lambda e: ResumeGpu(node=e.node, gpu=e.gpu, by=e.by),
    ev.DaemonStopped: lambda e: Stopping(node=e.node, reason=e.reason),
    # accepted then: booked again as it was, by id
    ev.ReservationCreated: lambda e: Reserve(
        start=e.start, end=e.end, user=e.user, uid=e.uid, tenant=e.tenant, gpu_ids=list(e.gpu_ids),
        node=e.node, name=e.name, by=e.by, reservation=e.reservation),
    ev.ReservationCancelled: lambda e: CancelReservation(reservation=e.reservation, by=e.by),
    ev.JobUpdated: lambda e: ("update", e.job, e),
    ev.JobsCommanded: lambda e: ("jobs", list(e.jobs), _COMMANDS[e.command], e.by),
}


def _legacy_command(e: ev.Event) -> bool:
    """Is ``e`` a user's command in a log from before commands and causes were recorded?"""
    if isinstance(e, ev.JobCancelRequested):
        return e.reason == "cancelled" and not e.cause.startswith("dependency:")
    return not e.cause.startswith(("dependency:", "seq:"))


def log_workload(log_dir: str | os.PathLike[str]) -> Workload:
    """Read a recorded log into stimuli and per-job attempts."""
    try:
        events = [e for batch in eventlog.read_batches(log_dir) for e in batch]
    except eventlog.LogError as err:
        raise ReplayError(f"{log_dir}: cannot read the log: {err}") from None
    # from before causes were recorded: commands are per-job events, timers unknown
    legacy = not any(e.cause.startswith("seq:") for e in events)
    stimuli: list[tuple[float, int, float, Any]] = []
    attempts: dict[int, list[dict[str, Any]]] = {}
    ordinal: dict[int, int] = {}  # recorded job id -> submission ordinal
    specs: dict[int, ev.JobSpec] = {}  # recorded job id -> its spec
    timer_times: list[tuple[float, int]] = []
    recorded_policy = ""
    policy_changes = 0
    clock = -math.inf
    last_start = -math.inf  # the previous JobStarted: its launch was ahead of the next one's
    start: tuple[float, int, ev.DaemonStarted, list[GpuInfo]] | None = None
    start_tenants: dict[str, Any] | None = None  # the tenants its config brought
    node_up: tuple[float, int, ev.NodeJoined | ev.NodeActorRestarted, list[GpuInfo]] | None = None

    def flush() -> None:
        """Feed a DaemonStarted, then a node's arrival, pending with the GPUs found after it."""
        nonlocal start, start_tenants, node_up
        if start is not None:
            t, seq, d, infos = start
            msg = _started_message(d.node, infos, _config_of(d), d.gpu_backend, d.pid, d.version)
            if start_tenants is not None:
                msg = msgspec.structs.replace(msg, tenants=start_tenants)
            stimuli.append((t, _REC, float(seq), msg))
            start, start_tenants = None, None
        if node_up is not None:
            t, seq, e, infos = node_up
            joined = e if isinstance(e, ev.NodeJoined) else None
            stimuli.append((t, _REC, float(seq), NodeUp(
                node=e.node, gpus=infos, ray_node=joined.ray_node if joined else "",
                gpu_backend=joined.gpu_backend if joined else "", restarted=joined is None)))
            node_up = None

    for e in events:
        t = clock = max(clock, e.ts)  # a clock stepped back is flattened
        seq = e.seq
        stimulus = ev.is_stimulus(e)
        if isinstance(e, ev.GpuDiscovered):  # part of the DaemonStarted (or NodeJoined) before it
            owner = start or node_up
            if owner is not None:
                owner[3].append(GpuInfo(gpu=e.gpu, uuid=e.uuid, model=e.model, memory_total_mib=e.memory_total_mib))
            continue
        if isinstance(e, ev.PolicyChanged) and e.by == "config":
            continue  # recorded by the core itself when a restart brings another policy
        if stimulus:
            flush()  # the DaemonStarted's own decisions are over
        convert = _INPUTS.get(type(e))
        if convert is not None:
            stimuli.append((t, _REC, float(seq), convert(e)))
        elif isinstance(e, (ev.NodeJoined, ev.NodeActorRestarted)):  # its GPUs follow
            node_up = (t, seq, e, [])
        elif isinstance(e, ev.DaemonStarted):
            recorded_policy = recorded_policy or e.policy
            start = (t, seq, e, [])
        elif isinstance(e, ev.JobSubmitted):
            ordinal[e.job] = len(ordinal) + 1
            specs[e.job] = e.spec
            stimuli.append((t, _REC, float(seq), ("submit", e.job, Submit(spec=e.spec, by=e.cause, normalised=True))))
        elif isinstance(e, ev.GpuErrored):
            if stimulus and e.cause != "daemon":  # not the core's own finding at start-up
                stimuli.append((t, _REC, float(seq), GpuFailed(node=e.node, gpu=e.gpu, error=e.error, lost=e.lost)))
        elif isinstance(e, ev.GpuPaused):
            if stimulus:  # not a drain: the core decides that again from the GpuHealth before it
                stimuli.append((t, _REC, float(seq), PauseGpu(node=e.node, gpu=e.gpu, by=e.by)))
        elif isinstance(e, ev.PolicyChanged):
            if stimulus:
                policy_changes += 1
                stimuli.append((t, _REC, float(seq), ("policy", SetPolicy(policy=e.policy, by=e.by))))
        elif isinstance(e, ev.TenantsConfigured):
            if stimulus:  # an operator's tenant set / remove
                stimuli.append((t, _REC, float(seq), ("tenants", SetTenants(tenants=dict(e.tenants), by=e.by))))
            else:  # the config's, decided at start-up
                start_tenants = dict(e.tenants)
        elif isinstance(e, ev.TimerFired):
            timer_times.append((t, seq))
        elif isinstance(e, (ev.JobCancelled, ev.JobHeld, ev.JobReleased)):
            if legacy and _legacy_command(e):
                stimuli.append((t, _REC, float(seq), ("jobs", [e.job], _LEGACY_COMMANDS[type(e)], e.cause)))
        elif isinstance(e, ev.JobCancelRequested):
            _attempt(attempts, e.job)["stop_requested"] = t
            if legacy and _legacy_command(e):
                stimuli.append((t, _REC, float(seq), ("jobs", [e.job], Cancel, e.cause)))
        elif isinstance(e, ev.JobPlaced):
            attempts.setdefault(e.job, []).append({"placed": t})
        elif isinstance(e, ev.JobStarted):
            a = _attempt(attempts, e.job)
            a["started"], a["start_seq"] = t, seq
            if "placed" in a:
                a["launch_s"] = t - max(a["placed"], last_start)
            last_start = t
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
    flush()
    if not recorded_policy:
        raise ReplayError(f"{log_dir}: the log has no DaemonStarted event; nothing to replay on")

    by_ordinal: dict[int, list[Attempt]] = {}
    runtimes: dict[str, list[float]] = {}
    for rid, runs in attempts.items():
        if rid not in ordinal:
            continue
        out = by_ordinal[ordinal[rid]] = [msgspec.convert(a, Attempt) for a in runs if "placed" in a]
        for run in out:
            if run.started is not None and run.ended is not None and not run.lost:
                key = "\0".join(runtime_key(specs[rid]))  # every job with an ordinal was submitted
                runtimes.setdefault(key, []).append(run.ended - run.started)
    # Re-key job references by submission ordinal: the replay's ids may differ.
    fixed: list[tuple[float, int, float, Any]] = []
    for t, c, s, item in stimuli:
        if isinstance(item, tuple) and item[0] == "submit":
            msg = item[2]
            if msg.spec.after:  # dependencies by submission ordinal too
                spec = msgspec.structs.replace(msg.spec, after=[ordinal.get(a, -1) for a in msg.spec.after])
                msg = Submit(spec=spec, by=msg.by, normalised=True)  # ints for ints
            item = ("submit", ordinal[item[1]], msg)
        elif isinstance(item, tuple) and item[0] == "jobs":
            item = ("jobs", [ordinal.get(j, -j) for j in item[1]], item[2], item[3])
        elif isinstance(item, tuple) and item[0] == "update":
            item = ("update", ordinal.get(item[1], -item[1]), item[2])
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


def trace_workload(name: str, kind: str, jobs: Sequence[Any], machine: list[tuple[str, list[GpuInfo]]], backend: str,
                   notes: Iterable[str] = ()) -> Workload:
    """Stimuli for a list of ``traces.TraceJob`` on a machine of (node, GPUs)."""
    stimuli: list[tuple[float, int, float, Any]] = [
        (-math.inf, _REC, float(k), ("start", node, infos, backend)) for k, (node, infos) in enumerate(machine)]
    attempts: dict[int, list[Attempt]] = {}
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].submit_time, i))
    for n, i in enumerate(order, start=1):
        j = jobs[i]
        # one command for all: runtime predictions (sjf-backfill) learn per user,
        # from runs that ended, as they would on a real machine
        spec = ev.JobSpec(
            command=[kind], user=j.user, gpus=j.gpus, gpu_mem_mib=j.gpu_mem_mib, priority=j.priority,
            env={"TRACE_ROW": str(i + 1)}, tenant=getattr(j, "tenant", ""),
        )
        stimuli.append((float(j.submit_time), _ARRIVE, float(n), ("submit", n, _trace_submit(spec))))
        attempts[n] = [Attempt(placed=0.0, started=0.0, ended=float(j.duration), exit_code=0)]
    return Workload(name=name, kind=kind, stimuli=stimuli, attempts=attempts, instant_start=True, notes=list(notes))


def _trace_submit(spec: ev.JobSpec) -> Submit:
    """A trace row's submission, normalised once here; one of no valid type is left for the core to refuse."""
    try:
        return Submit(spec=ev.normalise_spec(spec), by="trace", normalised=True)
    except (msgspec.ValidationError, TypeError):
        return Submit(spec=spec, by="trace")


def csv_workload(path: str | os.PathLike[str], n_gpus: int, mib: int, nodes: int = 1) -> Workload:
    """A plain CSV on ``nodes`` machines of ``n_gpus`` fake GPUs each (one is ``local``, several ``node-0``...)."""
    from eventsched.sim.traces import load_csv

    if not 1 <= nodes <= MAX_NODES:
        raise ReplayError(f"--nodes must be between 1 and {MAX_NODES}, not {nodes}")
    jobs = load_csv(path)
    names = ["local"] if nodes == 1 else [f"node-{k}" for k in range(nodes)]
    machine = [(name, [GpuInfo(gpu=i, uuid=f"fake-{name}-{i}" if nodes > 1 else f"fake-{i}", model="fake",
                               memory_total_mib=mib) for i in range(n_gpus)]) for name in names]
    notes = []
    if too_big := sum(1 for j in jobs if j.gpus > n_gpus or j.gpu_mem_mib > mib):
        where = f"fake:{n_gpus}:{mib}" + (" (a job's GPUs are all on one node)" if nodes > 1 else "")
        notes.append(f"{too_big} jobs ask for more than {where} has; they never run")
    return trace_workload(str(path), "csv", jobs, machine, f"fake:{n_gpus}:{mib}", notes)


# Memory of the Alibaba GPU models (the trace's requests never use it: no gpu_mem)
_MODEL_MIB = {"T4": 15_360, "P100": 16_384, "V100M16": 16_384, "V100M32": 32_768, "A10": 24_576}
ALIBABA_LOAD = 0.95  # offered GPU load of the synthetic arrival process
ALIBABA_MAX_DURATION = 3600.0
# The pod list asks for 98 % of the 6,212 GPUs in all: on the whole cluster
# nothing would ever wait. A seeded sample of the nodes makes the stream contend.
ALIBABA_NODE_SHARE = 1 / 16


def alibaba_workload(pod_csv: str | os.PathLike[str], node_csv: str | os.PathLike[str], *, seed: int = 0) -> Workload:
    """The openb pods as a dynamic workload on a seeded sample of the openb GPU
    nodes, with a synthetic schedule: the trace's times are censored, not a
    schedule. The model: replays/README.md (the Alibaba trace as a dynamic workload);
    durations are capped at an hour so the stream reaches a steady state well within its span."""
    from eventsched.sim.traces import AlibabaNode, TraceJob, load_alibaba

    pods, nodes = load_alibaba(pod_csv, node_csv)
    finished = sorted(
        float(p.deletion_time - p.creation_time) for p in pods
        if p.pod_phase in ("Succeeded", "Failed") and p.creation_time is not None and p.deletion_time is not None
        and p.deletion_time > p.creation_time) or [3600.0]
    rng = random.Random(seed)
    shapes: dict[tuple[str, int], list[AlibabaNode]] = {}
    for node in nodes:
        shapes.setdefault((node.model, node.gpus), []).append(node)
    keep: set[str] = set()
    for group in shapes.values():
        keep.update(n.name for n in rng.sample(group, max(1, round(len(group) * ALIBABA_NODE_SHARE))))
    nodes = [n for n in nodes if n.name in keep]
    biggest = max((n.gpus for n in nodes), default=0)
    gpu_pods = [p for p in pods if 0 < p.num_gpu <= biggest]
    capacity = sum(n.gpus for n in nodes)
    durations = [min(ALIBABA_MAX_DURATION, max(1.0, rng.choice(finished))) for _ in gpu_pods]
    demand = [p.num_gpu if p.gpu_milli >= 1000 else p.gpu_milli / 1000 for p in gpu_pods]
    work = sum(d * g for d, g in zip(durations, demand))
    span = work / (ALIBABA_LOAD * capacity) if capacity else 1.0
    mean_gap = span / max(1, len(gpu_pods))
    t = 0.0
    jobs = []
    for p, d, g in zip(gpu_pods, durations, demand):
        jobs.append(TraceJob(submit_time=round(t, 3), duration=round(d, 3), gpus=g, user=p.qos))
        t += rng.expovariate(1.0 / mean_gap) if mean_gap > 0 else 0.0
    machine = [(node.name, [GpuInfo(gpu=i, uuid=f"{node.name}-{i}", model=node.model,
                                    memory_total_mib=_MODEL_MIB.get(node.model, 32_768)) for i in range(node.gpus)])
               for node in nodes]
    notes = [
        f"Alibaba openb: {len(gpu_pods)} GPU pods of {len(pods)} (CPU-only ones left out) "
        f"on a seeded {ALIBABA_NODE_SHARE:.3g} sample of the nodes: {len(nodes)} nodes / {capacity} GPUs",
        f"synthetic schedule (seed {seed}): Poisson arrivals at {ALIBABA_LOAD:.0%} offered GPU load over "
        f"{span / 3600:.1f} h; durations drawn from the {len(finished)} finished pods' lifetimes, capped at 1 h",
        "users = the pods' QoS class (LS, BE, Burstable, Guaranteed)",
    ]
    return trace_workload(str(pod_csv), "alibaba", jobs, machine, "alibaba-openb", notes)

