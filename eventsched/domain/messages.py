"""What goes into the sans-I/O core and what comes out of it.

Messages are stimuli: a user's command, an observation of a process or a GPU,
or the clock. ``core.handle(state, message, now)`` turns one message into the
events to append (see ``events.py``) and the effects for the engine to perform.
Messages are never stored; the events they produce are.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

import msgspec

from eventsched.domain.events import GpuHealth, GpuProcess, JobSpec
from eventsched.domain.tenants import Tenant

__all__ = ["Message", "NodeUp", "NodeDown", "ClusterLink", "StrayKilled", "Fenced", "lease_margin_s", "lease_terms", "Started", "GpuInfo", "Submit", "Cancel",
           "Hold", "Release", "Update", "PauseGpu", "ResumeGpu", "SetPolicy", "SetTenant", "SetTenants",
           "RecordForecast", "Tick", "ProcessStarted", "ProcessExited", "ProcessLost", "NeverLaunched", "GpuObserved",
           "GpuFailed", "GpuHealthRead", "Stopping", "Effect", "Launch", "Signal", "WakeAt", "Notify", "Refused", "RefusalKind", "SchedulerConfig"]


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings the core obeys; recorded in ``DaemonStarted.config``."""

    node: str = "local"
    policy: str = "best-fit"
    default_time_limit_s: float | None = None  # global time limit
    kill_grace_s: float = 10.0  # SIGTERM -> SIGKILL
    max_queued: int = 100_000  # jobs waiting, in all
    max_queued_per_user: int = 20_000  # one user cannot fill the global queue
    max_running: int = 0  # jobs running at once; 0 = no limit
    # GPU health thresholds: a GPU over any of them gets nothing new.
    max_gpu_memory_used_pct: float = 100.0
    max_gpu_utilization_pct: float = 100.0
    max_gpu_temperature_c: float = 1000.0
    retry_backoff_s: float = 2.0  # first retry delay, doubled each time
    # --- teams: aging, quotas, fair share; docs/fair-share.md has the formula
    # a waiting job's score = priority + aging tiers waited
    #                        + fair_share_weight x its tenant's fair-share factor (0..1]
    aging_per_hour: float = 0.1  # a priority tier per 10 hours waited
    aging_tiers: bool = True  # whole tiers at fixed times (False: continuous, as logs before v5 ran)
    fair_share_weight: float = 10.0  # fair share is worth up to 10 priority points
    usage_half_life_s: float = 86400.0  # recent usage decays by half in this long
    # a blocked gang job at the head gets its GPUs reserved: smaller jobs use
    # them only if predicted to end before it could start
    reserve_for_gang: bool = True
    # ... once it has waited this long (Slurm's bf_min_age_reserve): a short
    # wait is left to plain backfill, which packs better
    reserve_after_s: float = 30.0
    preemption: bool = True  # preempt preemptible jobs for more urgent ones
    preempt_grace_s: float = 30.0  # warning signal, then this long, then SIGKILL
    preempt_protect_s: float = 600.0  # a job preempted once then runs at least this long
    # --- GPU memory over request, idle jobs (docs/gpu-memory-and-idle.md) ---
    # a job whose processes hold more GPU memory than its --gpu-mem: "warn"
    # (an event, shown by explain, queue and the panel) or "stop" (its warning
    # signal, SIGKILL after the grace; it ends failed, "GPU memory over request")
    gpu_mem_policy: Literal["warn", "stop"] = "warn"
    # allocated but idle: every GPU of a running job at most this busy ...
    idle_utilization_pct: float = 5.0
    # ... for this long (0: idle jobs are not looked for)
    idle_after_s: float = 1800.0
    # what to do with an idle job while a waiting job could use its GPUs:
    # "off", "requeue" (back to the queue) or "stop" (cancelled, reason "idle")
    idle_policy: Literal["off", "requeue", "stop"] = "off"
    # --- several machines ------------------------------------------------------
    # a node gone this long takes its running jobs to lost (then requeued by
    # their retry policy); back sooner, they are re-adopted (0: lost at once)
    node_lost_after_s: float = 60.0
    # each node's lease: a node that has heard nothing from the daemon this
    # long stops its jobs itself (--signal, then SIGKILL), so that a node cut
    # off never runs a job the daemon has given to another (0: no lease;
    # unset: three quarters of node_lost_after_s, see lease_terms)
    node_lease_s: float | None = None
    # on each node, GPUs where a process outside the scheduler holds memory
    # come last, so an equal fit goes to a GPU no stranger uses
    avoid_foreign_gpus: bool = True
    # --- GPU health (docs/gpu-health.md; the config file's [gpu_health]) ---------
    # a GPU whose driver reports any of these is drained (nothing new until `resume-gpu`)
    gpu_health_ecc_uncorrected: int = 1  # uncorrected ECC errors since the last reset (0: never)
    gpu_health_ecc_corrected: int = 0  # corrected ones (0: never)
    gpu_health_retired_pages: int = 0  # retired memory pages (0: never)
    gpu_health_pending: bool = True  # a page retirement or row remap waiting for a reset, or a failed remap
    gpu_health_xids: str = "48,63,64,74,79,92,94,95"  # Xid events that drain
    gpu_health_lost: bool = False  # a lost GPU stays drained when it reads again
    gpu_health_running: Literal["finish", "requeue"] = "finish"  # the drained GPU's running jobs
    # --- budgets (docs/fair-share.md) ---------------------------------------------
    # a tenant that has used its month's gpu_hours_per_month: its waiting jobs are
    # "hold" (not placed until the next month) or "lower-priority" (placed only on
    # what every other tenant's jobs leave)
    budget_action: Literal["hold", "lower-priority"] = "hold"
    # --- reservations (docs/reservations.md) ----------------------------------------
    # another's job found on reserved GPUs when the window opens: "requeue"
    # (stopped with its --signal, then queued again) or "flag" (shown, left running)
    reservation_policy: Literal["requeue", "flag"] = "requeue"


def lease_margin_s(node_lost_after_s: float) -> float:
    """How much sooner than ``node_lost_after_s`` a cut-off node has killed
    its jobs, counted from its last exchange with the daemon: 2 % for clock
    rates (two machines' monotonic clocks, and a busy node's late wake-ups),
    and 2 s for the daemon's exchange in flight when it gave the node up."""
    return 2.0 + 0.02 * node_lost_after_s


def lease_terms(cfg: SchedulerConfig) -> tuple[float, float]:
    """(lease_s, kill_by_s): a node quiet for ``lease_s`` signals its jobs,
    and has killed them all ``kill_by_s`` after the daemon's last exchange,
    before the daemon gives them up. Unset, the lease is three quarters of
    ``node_lost_after_s``, and at least a second before ``kill_by_s`` for the
    jobs' --signal; (0, 0) when jobs are given up at once or no lease fits."""
    lost = cfg.node_lost_after_s
    if lost <= 0:
        return 0.0, 0.0
    kill_by = lost - lease_margin_s(lost)
    lease = cfg.node_lease_s if cfg.node_lease_s is not None else min(0.75 * lost, kill_by - 1.0)
    return (lease, kill_by) if 0 < lease < kill_by else (0.0, 0.0)


class Message(msgspec.Struct, frozen=True, kw_only=True):
    pass


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    gpu: int
    uuid: str
    model: str
    memory_total_mib: int


class Started(Message, frozen=True):
    """The daemon started: which GPUs it found, with which settings."""

    node: str
    pid: int
    version: str
    gpu_backend: str
    gpus: list[GpuInfo]
    config: SchedulerConfig
    tenants: dict[str, Tenant] | None = None  # from the config file (None: keep the log's)


class RecordForecast(Message, frozen=True):
    """Record the start forecast someone was shown for a queued job."""

    job: int
    estimated_start: float
    by: str = ""
    p10: float | None = None
    p90: float | None = None


class SetTenants(Message, frozen=True):
    """The whole set of tenants at once: what a replay feeds for a recorded
    ``TenantsConfigured`` that an operator caused."""

    tenants: dict[str, Tenant]
    by: str = ""


class SetTenant(Message, frozen=True):
    """An operator's ``eventsched tenant set`` (or ``tenant remove``: ``tenant`` None)."""

    name: str
    tenant: Tenant | None
    by: str = ""


class Stopping(Message, frozen=True):
    node: str
    reason: str = ""


class Submit(Message, frozen=True):
    spec: JobSpec
    by: str = ""  # "uid:1000"
    # an array (--array): one task per index, all accepted together or none;
    # "{index}" in the command becomes the index
    array: list[int] = []
    # the spec's types already are exactly what the log will decode (it came
    # out of msgspec's decoder or ``events.normalise_spec``): the core need
    # not normalise it again
    normalised: bool = False


class Cancel(Message, frozen=True):
    jobs: list[int]
    uid: int  # the peer's uid: only the owner (or root, uid 0) may cancel
    by: str = ""


class Hold(Message, frozen=True):
    jobs: list[int]
    uid: int
    by: str = ""


class Release(Message, frozen=True):
    jobs: list[int]
    uid: int
    by: str = ""


class Update(Message, frozen=True):
    """``eventsched update JOB``: change a waiting job's request; None keeps a
    field as it is. Only its owner or an ``operator`` (root, the daemon's user)."""

    job: int
    uid: int
    by: str = ""
    operator: bool = False
    priority: int | None = None
    time_limit_s: float | None = None
    gpus: float | None = None
    name: str | None = None


class Reserve(Message, frozen=True):
    """Book GPUs for a user (or a tenant's members) from ``start`` to ``end``:
    ``gpu_ids`` exactly, or any ``gpus`` of one node. ``limits``: (hours
    ahead, GPU-hours booked) a user may not exceed; None for an operator or a replay."""

    start: float
    end: float
    user: str = ""
    uid: int = -1
    tenant: str = ""
    gpus: int = 0
    gpu_ids: list[int] | None = None
    node: str = ""
    name: str = ""
    by: str = ""
    limits: tuple[float, float] | None = None
    reservation: int = 0  # its id as recorded (a replay); 0: the next one


class CancelReservation(Message, frozen=True):
    reservation: int
    uid: int = 0
    operator: bool = True
    by: str = ""


class PauseGpu(Message, frozen=True):
    node: str
    gpu: int
    by: str = ""


class ResumeGpu(Message, frozen=True):
    node: str
    gpu: int
    by: str = ""


class SetPolicy(Message, frozen=True):
    policy: str
    by: str = ""


class Tick(Message, frozen=True):
    """The clock moved: time limits, retry backoff and aging are checked."""


class ProcessStarted(Message, frozen=True):
    job: int
    pid: int
    start_time: int = 0
    log_path: str = ""


class ProcessExited(Message, frozen=True):
    job: int
    exit_code: int | None
    signal: int | None = None
    reason: str = ""  # "launch-failed: ..." when the process never started


class ProcessLost(Message, frozen=True):
    """On restart: the job's supervisor and exit record are both gone."""

    job: int
    reason: str = ""


class NeverLaunched(Message, frozen=True):
    """On restart: the job was placed but its launch never began (no attempt
    directory exists), so it can safely be placed again."""

    job: int
    reason: str = ""


class GpuObserved(Message, frozen=True):
    node: str
    gpu: int
    utilization: float
    memory_used_mib: int
    memory_total_mib: int
    temperature_c: float
    power_w: float
    foreign_memory_mib: int = -1
    # job -> MiB its processes hold here; processes of no job
    job_memory_mib: dict[int, int] = {}
    foreign_processes: list[GpuProcess] = []


class GpuFailed(Message, frozen=True):
    node: str
    gpu: int
    error: str
    lost: bool = False


class GpuHealthRead(Message, frozen=True):
    """A GPU's health as its backend read it (recorded when it changed)."""

    reading: GpuHealth


class NodeUp(Message, frozen=True):
    """A cluster node's executor is up with these GPUs
    (``restarted``: its actor was restarted, the node itself stayed)."""

    node: str
    gpus: list[GpuInfo]
    ray_node: str = ""
    gpu_backend: str = ""
    restarted: bool = False


class NodeDown(Message, frozen=True):
    """A cluster node left or died."""

    node: str
    reason: str = ""


class ClusterLink(Message, frozen=True):
    """The connection to the cluster was lost (or is back)."""

    lost: bool
    reason: str = ""


class StrayKilled(Message, frozen=True):
    """A node that came back still ran an attempt that is not its job's
    current one there; the executor killed it (``pid``: its job process)."""

    node: str
    job: int
    attempt: int
    pid: int = 0
    reason: str = ""


class Fenced(Message, frozen=True):
    """A node that heard nothing from the daemon for its lease stopped its
    running attempts itself (``jobs`` and ``attempts`` side by side)."""

    node: str
    jobs: list[int]
    attempts: list[int]
    reason: str = ""


class Effect(msgspec.Struct, frozen=True, kw_only=True):
    pass


class Launch(Effect, frozen=True):
    job: int
    spec: JobSpec
    node: str
    gpu_ids: list[int]
    attempt: int = 1  # the job's placements so far, this one included: tells a retry from a duplicate


class Signal(Effect, frozen=True):
    """Stop a job: SIGTERM to its process group, SIGKILL after ``grace_s``."""

    job: int
    grace_s: float
    reason: str = "cancelled"
    signum: int = 0  # the first signal (0: SIGTERM)
    node: str = "local"  # where the job runs
    attempt: int = 1  # which of its placements is to stop


class Notify(Effect, frozen=True):
    """Tell the operators (the daemon's log, at warning level): e.g. a GPU drained."""

    text: str


class WakeAt(Effect, frozen=True):
    """The core wants a ``Tick`` no later than ``at`` (time limits, backoff)."""

    at: float


class RefusalKind(StrEnum):
    """What sort of refusal: front doors choose an HTTP status or an exit
    code by it, never by the words of the reason."""

    INVALID = "invalid"  # the request itself is wrong: fix it
    FORBIDDEN = "forbidden"  # this user may not
    NOT_FOUND = "not_found"  # it names a job, GPU, node, tenant or token that is not there
    CONFLICT = "conflict"  # the state of things rules it out (already ended, submitted before)
    UNAVAILABLE = "unavailable"  # the daemon cannot take it now (shutting down, overloaded, a fault)
    OVER_LIMIT = "over_limit"  # a limit or quota stands in the way


class Refused(Exception):
    """A command that cannot be accepted; nothing was changed. ``existing``:
    the job a conflict is with (a duplicate, a jobs-file line seen before)."""

    def __init__(self, kind: RefusalKind, reason: str, existing: int | None = None) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.existing = existing
