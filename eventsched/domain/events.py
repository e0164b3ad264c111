"""Every fact eventsched knows, one frozen tagged msgspec Struct each, past tense.

The log (``storage/log.py``) stores these and nothing else; every projection is a fold
over them. Schema evolution (``tests/test_events.py`` holds it against ``tests/fixtures/``):

1. A new field goes at the end of its struct, with a default, so older payloads decode.
2. A field is never removed, renamed, reordered or retyped; a tag is never reused.
3. A shape that must change gets a new struct and tag (``JobPlacedV2``) and an
   upcaster in ``UPCASTERS``: projections only ever see the newest shapes.
4. Unknown fields are ignored, so a newer version's log decodes while its tags are known.

``cause`` says what made an event happen (``"uid:1000"``, ``"seq:42"`` for a
decision taken because of event 42, ``"timer"``, ``"nvml"``...), so one job's
whole story can be told from the log.
"""

from __future__ import annotations

import operator
from typing import Callable, Literal, Union, cast

import msgspec

from eventsched.domain.tenants import Tenant

__all__ = ["Event", "JobSpec", "DaemonStarted", "DaemonStopped", "GpuDiscovered", "GpuSampled", "GpuErrored",
           "GpuPaused", "GpuResumed", "GpuHealth", "PolicyChanged", "JobSubmitted", "JobPlaced", "JobStarted", "JobExited",
           "JobCancelRequested", "JobCancelled", "JobRequeued", "JobHeld", "JobReleased", "JobLost",
           "JobUpdated", "UPDATABLE", "TenantsConfigured", "JobForecast", "GpuProcess", "JobGpuMemoryExceeded", "JobGpuMemoryWithin",
           "JobIdle", "JobBusy", "NodeJoined", "NodeLeft", "NodeActorRestarted", "ClusterDisconnected",
           "StrayAttemptKilled", "NodeFenced", "ReservationCreated", "ReservationCancelled", "AnyEvent", "TimerFired", "JobsCommanded", "is_stimulus", "cause_seq", "encode",
           "decode", "decode_many", "stamp"]


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=True):
    seq: int = 0  # the position in the log, stamped on append
    ts: float = 0.0  # UNIX seconds, from the engine's clock or the simulator's virtual one
    cause: str = ""


class JobSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a user asked for. Stored inside ``JobSubmitted``; never mutated."""

    command: list[str]
    user: str = ""
    uid: int = -1
    gid: int = -1
    groups: list[int] = []
    home: str = ""
    cwd: str = "/"
    env: dict[str, str] = {}
    name: str = ""
    gpus: float = 1.0  # below 1: a share of one GPU; else that many whole GPUs; 0: CPU only
    gpu_mem_mib: int = 0  # per GPU; 0 = no memory request
    gpu_ids: list[int] | None = None  # allowed physical ids; None = any
    priority: int = 0  # higher runs first
    time_limit_s: float | None = None
    on_time_limit: Literal["kill", "requeue"] = "kill"
    tenant: str = ""
    after: list[int] = []  # run only when these jobs succeeded
    retries: int = 0
    conda: str = ""
    env_setup: str = ""
    shell: bool = False  # True only when the user asked for a shell
    interactive: bool = False
    content_hash: str = ""
    node: str = ""  # "" = any node
    # the submitter's umask (-1: the daemon's) and limits, clamped at launch (rlimits.py)
    umask: int = -1
    rlimits: dict[str, list[int]] = {}
    array_id: int = 0  # an array task: the first task's id (0: none) ...
    array_index: int = -1  # ... and this task's index
    array_cap: int = 0  # %K: at most that many of its tasks running at once (0: any)
    preemptible: bool = False  # may be stopped to start a more urgent job
    warn_signal: int = 0  # `--signal SIG@SECONDS`: on preemption, this signal (0: SIGTERM) ...
    warn_s: float = -1.0  # ... then SIGKILL this much later (-1: preempt_grace_s)
    session: str = ""  # "tmux" or "screen": run inside a detached terminal session
    host_mem_mib: int = 0  # host memory limit (0: the daemon's max_host_mem_mib, if any)
    source: str = ""  # a jobs-file line, "PATH:LINE:SHA": submitted once, ever
    begin: float = 0.0  # `--begin`: not placed before this UNIX time (0: no such wait)
    notify: list[str] = []  # `--notify end,fail`: what its owner's hook is told of ([]: what the hook says)


class DaemonStarted(Event, frozen=True, kw_only=True):
    node: str
    pid: int
    version: str
    policy: str
    gpu_backend: str = ""  # "nvml" or "fake:N:MIB"
    config: dict[str, str | int | float | bool | None] = {}


class DaemonStopped(Event, frozen=True, kw_only=True):
    node: str
    reason: str = ""


class GpuDiscovered(Event, frozen=True, kw_only=True):
    node: str
    gpu: int  # physical index, as CUDA_VISIBLE_DEVICES names it
    uuid: str
    model: str
    memory_total_mib: int


class GpuProcess(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A process on a GPU that belongs to no job: whose, how much."""

    pid: int
    used_mib: int
    uid: int = -1  # -1: unknown (e.g. a process in another pid namespace)
    user: str = ""


class GpuSampled(Event, frozen=True, kw_only=True):
    node: str
    gpu: int
    utilization: float  # percent, 0..100
    memory_used_mib: int
    memory_total_mib: int
    temperature_c: float
    power_w: float
    foreign_memory_mib: int = -1  # held by processes that are no job's; -1 = unknown
    job_memory_mib: dict[int, int] = {}  # job -> MiB its process tree holds here
    foreign_processes: list[GpuProcess] = []


class GpuErrored(Event, frozen=True, kw_only=True):
    node: str
    gpu: int  # -1 when the error is not about one GPU (e.g. NVML init)
    error: str
    lost: bool = False  # the GPU disappeared: nothing is placed on it


class GpuPaused(Event, frozen=True, kw_only=True):
    node: str
    gpu: int
    by: str = ""
    reason: str = ""  # why, when the scheduler drained it (by "health"): e.g. "Xid 79 (fallen off the bus)"


class GpuHealth(Event, frozen=True, kw_only=True):
    """The driver's health readings of a GPU, recorded when they changed
    (docs/gpu-health.md); -1: the GPU cannot say (no ECC, another architecture)."""

    node: str
    gpu: int
    ecc_uncorrected: int = -1  # volatile: since the driver loaded or the GPU was reset
    ecc_corrected: int = -1
    ecc_uncorrected_total: int = -1  # aggregate: over the GPU's life
    ecc_corrected_total: int = -1
    retired_pages: int = -1
    pending: bool = False  # a page retirement or row remap waits for a GPU reset
    remap_failed: bool = False  # a row could not be remapped: the memory is out of spares
    xids: list[int] = []  # Xid events since the last reading


class GpuResumed(Event, frozen=True, kw_only=True):
    node: str
    gpu: int
    by: str = ""


class PolicyChanged(Event, frozen=True, kw_only=True):
    policy: str
    by: str = ""


class TimerFired(Event, frozen=True, kw_only=True):
    """The clock reached a deadline (a time limit, the end of a backoff).
    Recorded only when it led to a decision, which names it as its cause."""


class JobsCommanded(Event, frozen=True, kw_only=True):
    """A user's cancel, hold or release of one or more jobs, as accepted.
    The per-job events it leads to name it as their cause."""

    command: Literal["cancel", "hold", "release"]
    jobs: list[int]
    by: str = ""


class JobSubmitted(Event, frozen=True, kw_only=True):
    job: int
    spec: JobSpec


class JobPlaced(Event, frozen=True, kw_only=True):
    job: int
    node: str
    gpu_ids: list[int]  # physical ids, in CUDA_VISIBLE_DEVICES order
    share: float  # of each GPU in gpu_ids (1.0 for whole GPUs)
    gpu_mem_mib: int = 0  # reserved on each GPU
    policy: str = ""


class JobStarted(Event, frozen=True, kw_only=True):
    job: int
    pid: int
    start_time: int = 0  # /proc/PID/stat field 22: with the pid, one process even after pid reuse
    log_path: str = ""


class JobExited(Event, frozen=True, kw_only=True):
    job: int
    exit_code: int | None  # None when killed by a signal
    signal: int | None = None
    reason: str = ""  # "", "cancelled", "time-limit", "launch-failed", ...
    outcome: str = ""  # the state it ended in, computed once by the core ("": older logs, the fold computes it)


class JobCancelRequested(Event, frozen=True, kw_only=True):
    """A running job was asked to stop; ``JobExited`` follows when it has."""

    job: int
    by: str = ""
    reason: str = "cancelled"  # or "time-limit", "preempted"
    for_job: int = 0  # a preemption: the waiting job it makes room for ...
    rule: str = ""  # ... and why: "priority" (a higher tier) or "fair-share" (a tenant under its share)


class JobForecast(Event, frozen=True, kw_only=True):
    """A start forecast shown to someone: recorded to measure its error against the real start."""

    job: int
    estimated_start: float  # the median
    by: str = ""
    p10: float | None = None  # the 80 % range shown with it
    p90: float | None = None


class TenantsConfigured(Event, frozen=True, kw_only=True):
    """The tenants from now on: from the config at start-up, or an operator's ``tenant set``."""

    tenants: dict[str, Tenant]
    by: str = ""


class JobCancelled(Event, frozen=True, kw_only=True):
    """A job that was not running was cancelled: final."""

    job: int
    by: str = ""


class JobRequeued(Event, frozen=True, kw_only=True):
    job: int
    reason: str = ""  # "time-limit", "preempted", "retry"
    not_before: float = 0.0  # retry backoff: not placed before this time


class JobHeld(Event, frozen=True, kw_only=True):
    job: int
    by: str = ""


class JobReleased(Event, frozen=True, kw_only=True):
    job: int
    by: str = ""


class JobUpdated(Event, frozen=True, kw_only=True):
    """A waiting job's request changed (None: kept); a fold's spec is the
    submitted one with every update applied in order."""

    job: int
    by: str = ""
    priority: int | None = None
    time_limit_s: float | None = None
    gpus: float | None = None
    name: str | None = None

    def changes(self) -> dict[str, int | float | str]:
        return {k: v for k in UPDATABLE if (v := getattr(self, k)) is not None}


UPDATABLE = ("priority", "time_limit_s", "gpus", "name")  # the spec fields `update` may change


class JobLost(Event, frozen=True, kw_only=True):
    """The daemon restarted and could find neither the job nor how it ended."""

    job: int
    reason: str = ""


# decisions caused by the GpuSampled or TimerFired that showed them (docs/gpu-memory-and-idle.md)
class JobGpuMemoryExceeded(Event, frozen=True, kw_only=True):
    """A job holds more than its ``--gpu-mem`` on one of its GPUs; ``policy``: "warn" or "stop"."""

    job: int
    node: str
    gpu: int
    used_mib: int
    request_mib: int
    policy: str = "warn"


class JobGpuMemoryWithin(Event, frozen=True, kw_only=True):
    """A job that had exceeded its ``--gpu-mem`` is back within it on every GPU."""

    job: int
    used_mib: int = 0  # the most it now holds on one of its GPUs


class JobIdle(Event, frozen=True, kw_only=True):
    """Every GPU of a running job at most ``idle_utilization_pct`` busy since ``since``, for ``idle_after_s``."""

    job: int
    since: float


class JobBusy(Event, frozen=True, kw_only=True):
    job: int
    idle_s: float = 0.0  # how long it was idle


# the nodes of a Ray cluster (docs/multi-node.md), facts from the cluster
class NodeJoined(Event, frozen=True, kw_only=True):
    """A node came up; its ``GpuDiscovered`` events follow as its decisions."""

    node: str
    ray_node: str = ""  # Ray's id for it
    gpu_backend: str = ""  # "nvml" or "fake:N:MIB", as sampled there
    gpus: int = 0


class NodeLeft(Event, frozen=True, kw_only=True):
    """A node left the cluster or died: its GPUs are lost and its running
    jobs end ``lost`` (and go back to the queue when their retries allow)."""

    node: str
    reason: str = ""


class NodeActorRestarted(Event, frozen=True, kw_only=True):
    """Ray restarted the node's executor actor; its jobs are re-adopted from their supervisors' records."""

    node: str
    reason: str = ""


class ClusterDisconnected(Event, frozen=True, kw_only=True):
    """The Ray cluster connection was lost (or is back): nothing is decided while it is lost."""

    reason: str = ""
    lost: bool = True


class StrayAttemptKilled(Event, frozen=True, kw_only=True):
    """A node that came back still ran an attempt that is no longer its job's
    current one there (declared lost with the node): killed, so that no job runs twice."""

    node: str
    job: int
    attempt: int
    pid: int = 0
    reason: str = ""


class NodeFenced(Event, frozen=True, kw_only=True):
    """A node that heard nothing from the daemon for its lease stopped its
    attempts itself before they could be given to another node (docs/multi-node.md)."""

    node: str
    jobs: list[int]
    attempts: list[int]
    reason: str = ""


class ReservationCreated(Event, frozen=True, kw_only=True):
    """GPUs booked from ``start`` to ``end`` for ``user``'s jobs, or ``tenant``'s members' (docs/reservations.md)."""

    reservation: int
    node: str
    gpu_ids: list[int]
    start: float
    end: float
    user: str = ""
    uid: int = -1
    tenant: str = ""
    name: str = ""
    by: str = ""


class ReservationCancelled(Event, frozen=True, kw_only=True):
    reservation: int
    by: str = ""


AnyEvent = Union[DaemonStarted, DaemonStopped, GpuDiscovered, GpuSampled, GpuErrored, GpuPaused, GpuResumed,
                 PolicyChanged, TimerFired, JobsCommanded, JobSubmitted, JobPlaced, JobStarted, JobExited,
                 JobCancelRequested, JobCancelled, JobRequeued, JobHeld, JobReleased, JobLost, TenantsConfigured,
                 JobForecast, JobGpuMemoryExceeded, JobGpuMemoryWithin, JobIdle, JobBusy, NodeJoined, NodeLeft,
                 NodeActorRestarted, ClusterDisconnected, StrayAttemptKilled, JobUpdated, GpuHealth,
                 ReservationCreated, ReservationCancelled, NodeFenced]


def is_stimulus(event: Event) -> bool:
    """A fact from outside the core (a user, a process, a GPU, the clock), not a
    decision: replaying the stimuli through the core reproduces the decisions."""
    return not event.cause.startswith("seq:")


def cause_seq(event: Event) -> int | None:
    if not event.cause.startswith("seq:"):
        return None
    try:
        return int(event.cause[4:])
    except ValueError:
        return None


# tag of a retired shape -> its upcaster (empty while every shape is the first of its kind)
UPCASTERS: dict[str, Callable[[Event], Event]] = {}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyEvent)
_list_decoder = msgspec.msgpack.Decoder(list[AnyEvent])


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def encode_many(events: list[Event]) -> bytes:
    return _encoder.encode(events)


def decode(data: bytes) -> Event:
    return _decoder.decode(data)


def decode_many(data: bytes | memoryview) -> list[Event]:
    # A fresh list of AnyEvent members; cast (not list()) to avoid a copy per frame.
    events = cast(list[Event], _list_decoder.decode(data))
    if UPCASTERS:  # only once a shape has been retired
        events = [upcast(event) for event in events]
    return events


def upcast(event: Event) -> Event:
    while (upcaster := UPCASTERS.get(type(event).__name__)) is not None:
        event = upcaster(event)
    return event


_seq_of = operator.attrgetter("seq")


def normalise_spec(spec: JobSpec) -> JobSpec:
    """``spec`` with every value of the type the log decodes it as (an int for a
    float becomes a float), so it is recorded as a restart will read it."""
    return msgspec.convert(msgspec.to_builtins(spec), JobSpec)


def stamp(events: list[Event], first_seq: int) -> list[Event]:
    # the core stamps what it makes itself (a replay's frames of 65,536 events):
    # checked in C, not one interpreted comparison per event
    if list(map(_seq_of, events)) == list(range(first_seq, first_seq + len(events))):
        return list(events)
    return [e if e.seq == seq else msgspec.structs.replace(e, seq=seq) for seq, e in enumerate(events, first_seq)]


def to_builtins(event: Event) -> dict:
    return msgspec.to_builtins(event)
