"""Every fact eventsched knows, one frozen tagged msgspec Struct each, past tense.

The log (``storage/log.py``) stores these and nothing else; every projection is a fold
over them.

Schema evolution rules (tested by ``tests/test_events.py`` against the fixture
log in ``tests/fixtures/``):

1. Events evolve *additively*: a new field goes at the end of its struct and
   has a default, so that payloads written before it existed still decode.
2. A field is never removed, renamed, reordered or retyped, and a tag is never
   reused. A field that is no longer needed keeps decoding and is ignored.
3. When a shape really must change, add a new struct with a new tag (e.g.
   ``JobPlacedV2``) and an upcaster in ``UPCASTERS`` that turns the old one
   into the new one on read; projections only ever see the newest shapes.
4. Unknown fields in a payload are ignored (msgspec's default), so a log
   written by a *newer* version still decodes here as long as its tags are
   known.

Every event carries ``seq`` (its position in the log, stamped by the log on
append), ``ts`` (UNIX seconds, from the engine's clock or the simulator's
virtual one) and ``cause`` (what made it happen: ``"uid:1000"`` for a user's
command, ``"seq:42"`` for a decision taken because of event 42, ``"timer"``,
``"nvml"``...), so one job's whole story can be told from the log.
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
    """Base of every event. Subclasses are tagged by their class name."""

    seq: int = 0
    ts: float = 0.0
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
    # GPUs: 0 < gpus < 1 is a share of one GPU; an integer >= 1 is that many
    # whole GPUs (gang placement). 0 means a CPU-only job.
    gpus: float = 1.0
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
    # the submitter's umask (-1 = not sent: the job keeps the daemon's) and
    # resource limits {"nofile": [soft, hard], ...} (-1 = unlimited), see
    # rlimits.py; clamped to the daemon's own hard limits at launch
    umask: int = -1
    rlimits: dict[str, list[int]] = {}
    # an array task: the first task's id and this task's index (0/-1: none);
    # array_cap (%K) = at most that many of its tasks running at once (0: any)
    array_id: int = 0
    array_index: int = -1
    array_cap: int = 0
    preemptible: bool = False  # may be stopped to start a more urgent job
    # `--signal SIG@SECONDS`: on preemption, signal number ``warn_signal`` (0:
    # SIGTERM), then SIGKILL ``warn_s`` seconds later (-1: preempt_grace_s)
    warn_signal: int = 0
    warn_s: float = -1.0
    session: str = ""  # "tmux" or "screen": run inside a detached terminal session
    host_mem_mib: int = 0  # host memory limit (0: the daemon's max_host_mem_mib, if any)
    # a jobs-file line, "PATH:LINE:SHA256-of-the-line": submitted once, ever
    source: str = ""
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
    # memory held by processes that are not eventsched jobs; -1 = unknown
    foreign_memory_mib: int = -1
    # job -> MiB its processes hold on this GPU (NVML's compute processes,
    # mapped by process tree); and the processes that belong to no job
    job_memory_mib: dict[int, int] = {}
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
    """What the driver says of a GPU's health (NVML's ECC counters, retired
    pages, row remapping, Xid events), recorded when it changed; -1: the GPU
    cannot say (no ECC, an older or newer architecture)."""

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
    # the process's start time (clock ticks since boot, /proc/PID/stat field
    # 22): with the pid it names one process even after pid reuse
    start_time: int = 0
    log_path: str = ""


class JobExited(Event, frozen=True, kw_only=True):
    job: int
    exit_code: int | None  # None when killed by a signal
    signal: int | None = None
    reason: str = ""  # "", "cancelled", "time-limit", "launch-failed", ...
    # the state it ended in (states.exit_outcome, computed once by the core);
    # "" in logs written before it was recorded: the fold computes it then
    outcome: str = ""


class JobCancelRequested(Event, frozen=True, kw_only=True):
    """A running job was asked to stop; ``JobExited`` follows when it has."""

    job: int
    by: str = ""
    reason: str = "cancelled"  # or "time-limit", "preempted"
    # a preemption: the waiting job it makes room for, and the rule
    # ("priority": a higher tier; "fair-share": a tenant under its share)
    for_job: int = 0
    rule: str = ""


class JobForecast(Event, frozen=True, kw_only=True):
    """A start time forecast for a queued job, as shown to someone (``explain``):
    recorded so that its error against the real start can be measured."""

    job: int
    estimated_start: float  # the median
    by: str = ""
    p10: float | None = None  # the 80 % range shown with it
    p90: float | None = None


class TenantsConfigured(Event, frozen=True, kw_only=True):
    """The tenants, their quotas and weights from now on: from the
    config at start-up, or an operator's ``tenant set``."""

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
    """A waiting job's request changed (``eventsched update``): the fields
    given; None keeps what it was. The spec a replay or a fold sees is the
    submitted one with every update applied in order."""

    job: int
    by: str = ""
    priority: int | None = None
    time_limit_s: float | None = None
    gpus: float | None = None
    name: str | None = None

    def changes(self) -> dict[str, int | float | str]:
        """The ``JobSpec`` fields this update sets."""
        return {k: v for k in UPDATABLE if (v := getattr(self, k)) is not None}


UPDATABLE = ("priority", "time_limit_s", "gpus", "name")  # the spec fields `update` may change


class JobLost(Event, frozen=True, kw_only=True):
    """The daemon restarted and could find neither the job nor how it ended."""

    job: int
    reason: str = ""


# declared GPU memory and idle allocations (docs/gpu-memory-and-idle.md):
# decisions, whose cause is the GpuSampled or TimerFired that showed it
class JobGpuMemoryExceeded(Event, frozen=True, kw_only=True):
    """A running job's processes hold more memory on one of its GPUs than its
    ``--gpu-mem``; ``policy`` says what follows ("warn" or "stop")."""

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
    """Every GPU of a running job has shown at most ``idle_utilization_pct``
    since ``since``, for ``idle_after_s`` (allocated but idle)."""

    job: int
    since: float


class JobBusy(Event, frozen=True, kw_only=True):
    """An idle job's GPUs are busy again; it was idle ``idle_s`` seconds."""

    job: int
    idle_s: float = 0.0


# the nodes of a Ray cluster (docs/multi-node.md), facts from the cluster
class NodeJoined(Event, frozen=True, kw_only=True):
    """A node of the cluster came up with its GPUs (``GpuDiscovered`` events
    follow as its decisions); ``ray_node`` is Ray's id for it."""

    node: str
    ray_node: str = ""
    gpu_backend: str = ""  # "nvml" or "fake:N:MIB", as sampled there
    gpus: int = 0


class NodeLeft(Event, frozen=True, kw_only=True):
    """A node left the cluster or died: its GPUs are lost and its running
    jobs end ``lost`` (and go back to the queue when their retries allow)."""

    node: str
    reason: str = ""


class NodeActorRestarted(Event, frozen=True, kw_only=True):
    """The node's executor actor was restarted by Ray; the jobs it still
    runs are re-adopted from its supervisors' records."""

    node: str
    reason: str = ""


class ClusterDisconnected(Event, frozen=True, kw_only=True):
    """The daemon lost its connection to the Ray cluster (``lost``) or got it
    back; nothing is decided while it is lost."""

    reason: str = ""
    lost: bool = True


class StrayAttemptKilled(Event, frozen=True, kw_only=True):
    """A node that came back (its executor joined again) still ran an attempt
    that is not its job's current one there (the job was declared lost with
    the node, and requeued, ran elsewhere, or ended): it was killed, so that
    no job runs twice. ``pid``: the killed attempt's job process."""

    node: str
    job: int
    attempt: int
    pid: int = 0
    reason: str = ""


class NodeFenced(Event, frozen=True, kw_only=True):
    """A node heard nothing from the daemon for its lease (``node_lease_s``)
    and stopped its running attempts itself, each with its ``--signal`` and
    then SIGKILL, before the daemon could give its jobs to another node;
    recorded when the node reports it (``jobs`` and ``attempts`` side by side)."""

    node: str
    jobs: list[int]
    attempts: list[int]
    reason: str = ""


class ReservationCreated(Event, frozen=True, kw_only=True):
    """GPUs booked ahead (``eventsched reserve create``): from ``start`` to
    ``end`` they go only to the jobs of ``user`` (uid ``uid``), or of the
    members of ``tenant`` when it is set."""

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
    """A fact from outside the core's decisions (a user, a process, a GPU, the
    clock), as opposed to a decision, whose ``cause`` names the stimulus's
    ``seq``. Replaying the stimuli in order through the core reproduces the
    decisions."""
    return not event.cause.startswith("seq:")


def cause_seq(event: Event) -> int | None:
    """The seq of the fact that caused ``event`` (None for a stimulus)."""
    if not event.cause.startswith("seq:"):
        return None
    try:
        return int(event.cause[4:])
    except ValueError:
        return None


# Upcasters: tag of a retired shape -> function producing the current shape.
# Empty while every shape is still the first of its kind.
UPCASTERS: dict[str, Callable[[Event], Event]] = {}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyEvent)
_list_decoder = msgspec.msgpack.Decoder(list[AnyEvent])


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def encode_many(events: list[Event]) -> bytes:
    """One msgpack array of events: the payload of one log frame."""
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
    """The newest shape of ``event`` (rule 3 of the module docstring)."""
    while (upcaster := UPCASTERS.get(type(event).__name__)) is not None:
        event = upcaster(event)
    return event


_seq_of = operator.attrgetter("seq")


def normalise_spec(spec: JobSpec) -> JobSpec:
    """``spec`` with every value of the type the log decodes it as (an int
    where a float belongs becomes a float, a tuple a list): a spec built in
    Python is recorded as a restart will read it. Raises
    ``msgspec.ValidationError`` or ``TypeError`` for a value of no such type."""
    return msgspec.convert(msgspec.to_builtins(spec), JobSpec)


def stamp(events: list[Event], first_seq: int) -> list[Event]:
    """Give events consecutive sequence numbers starting at ``first_seq``."""
    # the core stamps what it makes itself (a replay's frames of 65,536 events):
    # checked in C, not one interpreted comparison per event
    if list(map(_seq_of, events)) == list(range(first_seq, first_seq + len(events))):
        return list(events)
    return [e if e.seq == seq else msgspec.structs.replace(e, seq=seq) for seq, e in enumerate(events, first_seq)]


def to_builtins(event: Event) -> dict:
    """A JSON-ready dict with the event's type name under ``type``."""
    return msgspec.to_builtins(event)
