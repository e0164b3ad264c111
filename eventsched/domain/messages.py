"""What goes into the sans-I/O core (messages: stimuli) and what comes out (effects).

The core turns one message into the events to append and the effects for the
engine to perform. Messages are never stored; the events they produce are.
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
    aging_per_hour: float = 0.1  # a priority tier per 10 hours waited
    aging_tiers: bool = True  # whole tiers at fixed times (False: continuous, as logs before v5 ran)
    fair_share_weight: float = 10.0  # fair share is worth up to 10 priority points
    usage_half_life_s: float = 86400.0  # recent usage decays by half in this long
    # a blocked gang job at the head gets its GPUs reserved (smaller jobs backfill
    # only if predicted to end first) once it has waited this long: a short wait
    # is left to plain backfill, which packs better (Slurm's bf_min_age_reserve)
    reserve_for_gang: bool = True
    reserve_after_s: float = 30.0
    preemption: bool = True  # preempt preemptible jobs for more urgent ones
    preempt_grace_s: float = 30.0  # warning signal, then this long, then SIGKILL
    preempt_protect_s: float = 600.0  # a job preempted once then runs at least this long
    # --- GPU memory over request, idle jobs (docs/gpu-memory-and-idle.md) ---
    gpu_mem_policy: Literal["warn", "stop"] = "warn"
    idle_utilization_pct: float = 5.0  # every GPU of a job at most this busy ...
    idle_after_s: float = 1800.0  # ... for this long: idle (0: not looked for)
    idle_policy: Literal["off", "requeue", "stop"] = "off"
    # --- several machines (docs/multi-node.md) ---------------------------------
    node_lost_after_s: float = 60.0  # gone this long, its running jobs are lost (back sooner: re-adopted)
    # a node that heard nothing from the daemon this long stops its jobs itself, so
    # that a node cut off never runs a job given to another (0: none; None: see lease_terms)
    node_lease_s: float | None = None
    avoid_foreign_gpus: bool = True  # in an equal fit, GPUs where a stranger holds memory come last
    # --- GPU health (docs/gpu-health.md): what drains a GPU ----------------------
    gpu_health_ecc_uncorrected: int = 1  # uncorrected ECC errors since the last reset (0: never)
    gpu_health_ecc_corrected: int = 0  # corrected ones (0: never)
    gpu_health_retired_pages: int = 0  # retired memory pages (0: never)
    gpu_health_pending: bool = True  # a page retirement or row remap waiting for a reset, or a failed remap
    gpu_health_xids: str = "48,63,64,74,79,92,94,95"  # Xid events that drain
    gpu_health_lost: bool = False  # a lost GPU stays drained when it reads again
    gpu_health_running: Literal["finish", "requeue"] = "finish"  # the drained GPU's running jobs
    budget_action: Literal["hold", "lower-priority"] = "hold"  # a tenant over its month's GPU-hours
    reservation_policy: Literal["requeue", "flag"] = "requeue"  # another's job on GPUs a window opens on


def lease_margin_s(node_lost_after_s: float) -> float:
    """How much sooner than ``node_lost_after_s`` a cut-off node has killed its jobs:
    2 % for clock rates, 2 s for an exchange in flight (docs/multi-node.md, the lease)."""
    return 2.0 + 0.02 * node_lost_after_s


def lease_terms(cfg: SchedulerConfig) -> tuple[float, float]:
    """(lease_s, kill_by_s): a node quiet for ``lease_s`` signals its jobs, and has killed
    them by ``kill_by_s``; (0, 0) when jobs are given up at once or no lease fits."""
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
    node: str
    pid: int
    version: str
    gpu_backend: str
    gpus: list[GpuInfo]
    config: SchedulerConfig
    tenants: dict[str, Tenant] | None = None  # from the config file (None: keep the log's)


class RecordForecast(Message, frozen=True):
    job: int
    estimated_start: float
    by: str = ""
    p10: float | None = None
    p90: float | None = None


class SetTenants(Message, frozen=True):
    """All tenants at once: a replay's stimulus for an operator's ``TenantsConfigured``."""

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
    array: list[int] = []  # --array: one task per index, all accepted or none
    # the spec's types are already what the log will decode (msgspec decoded it,
    # or ``events.normalise_spec``): the core need not normalise it again
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
    """Change a waiting job's request (None: keep); only its owner or an ``operator``."""

    job: int
    uid: int
    by: str = ""
    operator: bool = False
    priority: int | None = None
    time_limit_s: float | None = None
    gpus: float | None = None
    name: str | None = None


class Reserve(Message, frozen=True):
    """Book ``gpu_ids``, or any ``gpus`` of one node. ``limits``: (hours ahead,
    GPU-hours booked) a user may not exceed; None for an operator or a replay."""

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
    """On restart: the job's supervisor and exit record are gone."""

    job: int
    reason: str = ""


class NeverLaunched(Message, frozen=True):
    """On restart: placed, but no attempt directory exists: safe to place again."""

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
    job_memory_mib: dict[int, int] = {}
    foreign_processes: list[GpuProcess] = []


class GpuFailed(Message, frozen=True):
    node: str
    gpu: int
    error: str
    lost: bool = False


class GpuHealthRead(Message, frozen=True):
    reading: GpuHealth


class NodeUp(Message, frozen=True):
    """A node's executor is up (``restarted``: its actor was restarted, the node stayed)."""

    node: str
    gpus: list[GpuInfo]
    ray_node: str = ""
    gpu_backend: str = ""
    restarted: bool = False


class NodeDown(Message, frozen=True):
    node: str
    reason: str = ""


class ClusterLink(Message, frozen=True):
    lost: bool
    reason: str = ""


class StrayKilled(Message, frozen=True):
    node: str
    job: int
    attempt: int
    pid: int = 0
    reason: str = ""


class Fenced(Message, frozen=True):
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
    """Tell the operators, in the daemon's log at warning level (e.g. a GPU drained)."""

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
