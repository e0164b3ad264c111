"""The allocation projection: ``apply(state, event)`` folds one event into a
mutable ``ClusterState``, the only code that changes one. Shares are integer
milli-GPU (1000 = one GPU) so that sums never drift. The indices derived from
the facts are rebuilt when a snapshot loads; ``validate_state`` checks them.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import math
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from eventsched.domain import events as ev
from eventsched.domain.messages import SchedulerConfig, lease_terms
from eventsched.domain.settings import settings_from_dict
from eventsched.domain.states import FINAL, IllegalTransition, JobState, next_state
from eventsched.domain.tenants import Tenant
from eventsched.domain.units import FULL
from eventsched.projections.model import (DEFAULT_RUNTIME_S, RECENT_SHAPES, Capacity, Gpu, Job, QueueIndex,
                                          RuntimeStats, TenantUsage, fit_summary, free_memory_of, request_of,
                                          runtime_key, tenant_of, time_limit_of, usable)
from eventsched.projections.records import NodeInfo, StateSnapshot

# plain module names: an Enum class attribute costs a lookup on every use (hot paths)
QUEUED = JobState.QUEUED
RUNNING = JobState.RUNNING
IDLE_STOPS = ("idle", "idle-requeue")  # stops of an idle job for a waiting one

__all__ = ["IllegalTransition", "Gpu", "Job", "QueueIndex", "Capacity", "usable", "ClusterState", "NodeInfo",
           "nodes_view", "apply", "request_of", "fit_summary", "FULL", "runtime_key", "snapshot_bytes",
           "state_from_snapshot", "validate_state"]


class ClusterState:
    """Everything the scheduler knows now. Mutated only by ``apply``."""

    def __init__(self) -> None:
        self.last_seq: int = 0
        self.node: str = "local"
        self.policy: str = "best-fit"
        self.config: SchedulerConfig = SchedulerConfig()
        self.gpus: dict[tuple[str, int], Gpu] = {}
        self.jobs: dict[int, Job] = {}
        self.next_job_id: int = 1
        self.next_order: int = 1
        self.recent_shapes: deque[tuple[int, int]] = deque(maxlen=RECENT_SHAPES)
        self.stats = RuntimeStats()
        self.tenants: dict[str, Tenant] = {}  # as last configured
        # tenant -> what it holds (rebuilt from the running jobs) and its recent use (in snapshots)
        self.usage: dict[str, TenantUsage] = {}
        # not facts, never in a snapshot: a replay's true durations and GPU pauses ahead
        # (paused at, resumed at, node, GPU) for the sjf-oracle policy
        self.oracle: dict[int, float] = {}
        self.oracle_pauses: list[tuple[float, float, str, int]] = []
        # set by the core only while it places the jobs of tenants whose budget is spent (not a fact)
        self.placing_lowered: bool = False
        self.nodes: dict[str, NodeInfo] = {}  # a cluster's nodes (a single machine has none)
        # on a Ray cluster nodes may join later: a job larger than the nodes up now may wait
        self.cluster: bool = False
        self.reservations: dict[int, ev.ReservationCreated] = {}  # booked GPUs, not cancelled
        self.last_reservation: int = 0  # the highest reservation id given
        self._derive()

    def _derive(self) -> None:
        """(Re)build every index that is a function of the facts above."""
        self.gpu_list: list[Gpu] = sorted(self.gpus.values(), key=_gpu_order)
        self.node_gpus: dict[str, list[Gpu]] = {}  # node -> its GPUs by id
        for gpu in self.gpu_list:
            self.node_gpus.setdefault(gpu.node, []).append(gpu)
        self._capacity: Capacity | None = None  # built when a policy first asks
        # (node, gpu_mem_mib) -> what check_spec needs; only GPU discovery and loss change it
        self.fit_cache: dict[tuple[str, int], tuple[int, int, int]] = {}
        self.queue = QueueIndex(self.config.aging_per_hour, self.config.aging_tiers)
        self.running: dict[int, None] = {}  # running job ids (order not meaningful)
        self.array_running: dict[int, int] = {}  # capped array id -> its tasks running
        # running jobs as (predicted end, id), sorted: a gang reservation reads the first few
        self.ends: list[tuple[float, int]] = []
        # running jobs a preemption may look at without walking them all
        self.running_preemptible: dict[int, None] = {}
        self.running_of_tenant: dict[str, dict[int, None]] = {}
        self.being_preempted: dict[int, None] = {}
        self.making_room: dict[int, None] = {}  # waiting jobs with a room (Job.room)
        for usage in self.usage.values():
            usage.milli = usage.mem = usage.jobs = 0
        self.backoff: dict[int, None] = {}  # queued jobs with a not_before
        # array id -> its tasks that have ended (what `queue` folds an array into)
        self.array_ended: collections.Counter[int] = collections.Counter(
            j.spec.array_id for j in self.jobs.values() if j.spec.array_index >= 0 and j.state in FINAL
        )
        self.queued_with_deps: dict[int, None] = {}  # queued jobs with --after: maybe not eligible yet
        # running jobs with a time limit and no stop asked -> when it falls due; the heap
        # finds the earliest (stale entries are dropped when met)
        self.deadlines: dict[int, float] = {}
        self._due: list[tuple[float, int]] = []
        # running jobs whose GPUs are all quiet -> when they count as idle (a heap as
        # above); those flagged idle and not being stopped; those stopped for it
        self.idle_due: dict[int, float] = {}
        self._idle_heap: list[tuple[float, int]] = []
        self.idle_jobs: dict[int, None] = {}
        self.reclaiming: dict[int, None] = {}
        self.dependents: dict[int, list[int]] = {}
        self.by_hash: dict[tuple[int, str], int] = {}  # (uid, --dedupe hash) -> job
        self.by_source: dict[tuple[int, str], int] = {}  # (uid, jobs-file line) -> job
        self.queued_by_uid: dict[int, int] = {}
        self.shape_counts: dict[tuple[int, int], int] = {}
        for shape in self.recent_shapes:
            self.shape_counts[shape] = self.shape_counts.get(shape, 0) + 1
        for job in sorted(self.jobs.values(), key=lambda j: j.id):
            self._index_submitted(job)
            if job.state == QUEUED:
                self._enter_queue(job)
                if job.room:
                    self.making_room[job.id] = None
            elif job.state == RUNNING:
                self.running[job.id] = None
                bisect.insort(self.ends, (job.predicted_end, job.id))
                self._track_deadline(job)
                self._hold(job, +1)
                if job.cancel_reason == "preempted":
                    self.being_preempted[job.id] = None
                if job.cancel_reason in IDLE_STOPS:
                    self.reclaiming[job.id] = None
                self._track_idle(job)

    def _index_submitted(self, job: Job) -> None:
        for dep in job.spec.after:
            self.dependents.setdefault(dep, []).append(job.id)
        if job.spec.content_hash:
            self.by_hash[(job.spec.uid, job.spec.content_hash)] = job.id
        if job.spec.source:
            self.by_source[(job.spec.uid, job.spec.source)] = job.id

    def _enter_queue(self, job: Job) -> None:
        self.queue.add(job)
        uid = job.spec.uid
        self.queued_by_uid[uid] = self.queued_by_uid.get(uid, 0) + 1
        if job.not_before > 0:
            self.backoff[job.id] = None
        if job.spec.after:
            self.queued_with_deps[job.id] = None

    def _leave_queue(self, job: Job) -> None:
        self.queue.remove(job)
        if job.room:
            job.room = []
            del self.making_room[job.id]
        uid = job.spec.uid
        left = self.queued_by_uid[uid] - 1
        if left:
            self.queued_by_uid[uid] = left
        else:
            del self.queued_by_uid[uid]
        self.backoff.pop(job.id, None)
        self.queued_with_deps.pop(job.id, None)

    def _hold(self, job: Job, sign: int) -> None:
        """Count a job's resources in (+1) or out of (-1) its tenant's usage
        and its array's running tasks."""
        tenant = tenant_of(job)
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage()
        usage.milli += sign * job.count * job.milli
        usage.mem += sign * job.count * job.mem_mib
        usage.jobs += sign
        mine = self.running_of_tenant.setdefault(tenant, {})
        if sign > 0:
            mine[job.id] = None
            if job.spec.preemptible:
                self.running_preemptible[job.id] = None
        else:
            mine.pop(job.id, None)
            if not mine:
                del self.running_of_tenant[tenant]
            self.running_preemptible.pop(job.id, None)
            self._stopped_preempting(job)
        if job.spec.array_cap:
            aid = job.spec.array_id
            n = self.array_running.get(aid, 0) + sign
            if n:
                self.array_running[aid] = n
            else:
                self.array_running.pop(aid, None)

    def _stopped_preempting(self, job: Job) -> None:
        """``job`` is no longer being preempted. After the last victim the room
        is whole and no longer held: its job is first in line for it now."""
        if self.being_preempted.pop(job.id, 0) is None and not self.being_preempted:
            for waiting in self.making_room:
                self.jobs[waiting].room = []
            self.making_room.clear()

    def _age_usage(self, tenant: str, ts: float) -> None:
        """Bring ``tenant``'s recent use up to ``ts`` before what it holds changes."""
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage(as_of=ts)
        usage.advance(ts, self.config.usage_half_life_s)

    def _track_deadline(self, job: Job) -> None:
        """Record when ``job``'s time limit falls due (or that none does)."""
        limit = time_limit_of(job, self.config.default_time_limit_s)
        if job.state != RUNNING or job.cancel_reason or limit is None or job.started_at is None:
            self.deadlines.pop(job.id, None)
            return
        due = job.started_at + limit
        if self.deadlines.get(job.id) != due:
            self.deadlines[job.id] = due
            heapq.heappush(self._due, (due, job.id))

    def quiet_since(self, job: Job) -> float | None:
        """Since when every GPU of running ``job`` has been at most
        ``idle_utilization_pct`` busy (None: one is busy, or never sampled)."""
        if not job.gpu_ids:
            return None
        since = job.started_at or 0.0
        for gid in job.gpu_ids:
            gpu = self.gpus.get((job.node, gid))
            if gpu is None or gpu.low_since is None:
                return None
            if gpu.low_since > since:
                since = gpu.low_since
        return since

    def _track_idle(self, job: Job) -> None:
        """Keep ``idle_due`` and ``idle_jobs`` in step with one job."""
        jid = job.id
        if job.state != RUNNING or job.cancel_reason or self.config.idle_after_s <= 0:
            self.idle_due.pop(jid, None)
            self.idle_jobs.pop(jid, None)
            return
        if job.idle_since is not None:
            self.idle_due.pop(jid, None)
            self.idle_jobs[jid] = None
            return
        self.idle_jobs.pop(jid, None)
        quiet = self.quiet_since(job)
        if quiet is None:
            self.idle_due.pop(jid, None)
            return
        due = quiet + self.config.idle_after_s
        if self.idle_due.get(jid) != due:
            self.idle_due[jid] = due
            heapq.heappush(self._idle_heap, (due, jid))

    def next_idle_due(self) -> float | None:
        """The earliest time a running job counts as idle, if any."""
        heap = self._idle_heap
        while heap and self.idle_due.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # stale: busy again, ended, flagged or stopped
        return heap[0][0] if heap else None

    def _gpu_changed(self, gpu: Gpu) -> None:
        """Bring the capacity index in step with one GPU's new numbers."""
        cap = self._capacity
        if cap is None:
            return
        i = cap.index.get((gpu.node, gpu.id))
        if (i is not None) != usable(gpu, self.config) or (
                i is not None and self.config.avoid_foreign_gpus and cap.foreign[i] != (gpu.foreign_memory_mib > 0)):
            self._capacity = None  # the usable set or its order changed: rebuild when next asked
        elif i is not None:
            cap.set_gpu(i, FULL - gpu.used_milli, free_memory_of(gpu))

    def gpu(self, node: str, gpu: int) -> Gpu:
        try:
            return self.gpus[(node, gpu)]
        except KeyError:
            raise KeyError(f"no GPU {gpu} on node {node!r}") from None

    def all_gpus(self) -> list[Gpu]:
        return list(self.gpu_list)

    @property
    def capacity(self) -> Capacity:
        """Free capacity of the usable GPUs now (read-only for callers)."""
        if self._capacity is None:
            self._capacity = Capacity(self.gpu_list, self.config)
        return self._capacity

    def fit(self, node: str, mem_mib: int) -> tuple[int, int, int]:
        """``fit_summary`` of the GPUs of ``node`` (all nodes: ""), cached."""
        key = (node, mem_mib)
        hit = self.fit_cache.get(key)
        if hit is None:
            if len(self.fit_cache) >= 1024:
                self.fit_cache.clear()  # many distinct memory requests: stay small
            gpus = self.node_gpus.get(node, []) if node else self.gpu_list
            hit = self.fit_cache[key] = fit_summary(gpus, mem_mib)
        return hit

    def next_time_limit(self) -> float | None:
        """The earliest time a running job's time limit falls due, if any."""
        due = self._due
        while due and self.deadlines.get(due[0][1]) != due[0][0]:
            heapq.heappop(due)  # stale: the job ended, was stopped, or restarted
        return due[0][0] if due else None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterState):
            return NotImplemented
        return snapshot_bytes(self) == snapshot_bytes(other)


def _gpu_order(gpu: Gpu) -> tuple[str, int]:
    return (gpu.node, gpu.id)


def _job(state: ClusterState, job_id: int) -> Job:
    job = state.jobs.get(job_id)
    if job is None:
        raise IllegalTransition(f"no job {job_id}")
    return job


def _release(state: ClusterState, job: Job, ts: float) -> None:
    """Give back the shares and memory a running job held."""
    for gid in job.gpu_ids:
        gpu = state.gpus.get((job.node, gid))
        if gpu is None:
            continue
        gpu.used_milli -= job.milli
        gpu.reserved_mib -= job.mem_mib
        if job.id in gpu.jobs:
            gpu.jobs.remove(job.id)
        state._gpu_changed(gpu)
    if job.id in state.running:
        state._age_usage(tenant_of(job), ts)
        state._hold(job, -1)
        _forget_end(state, job)
    state.running.pop(job.id, None)
    state.deadlines.pop(job.id, None)
    state.idle_due.pop(job.id, None)
    state.idle_jobs.pop(job.id, None)
    state.reclaiming.pop(job.id, None)


def apply(state: ClusterState, event: ev.Event) -> None:
    """Fold one event into ``state``. Raises ``IllegalTransition`` (changing
    nothing) when the event does not fit; ignores events it has no use for."""
    handler = _HANDLERS.get(type(event))
    if handler is not None:
        handler(state, event)
    if event.seq > state.last_seq:
        state.last_seq = event.seq


def _daemon_started(state: ClusterState, e: ev.DaemonStarted) -> None:
    config = settings_from_dict(dict(e.config), node=e.node)
    state.node, state.policy = e.node, e.policy
    state.cluster = e.gpu_backend.partition(":")[0] == "ray"
    aging_changed = (config.aging_per_hour, config.aging_tiers) != (state.config.aging_per_hour, state.config.aging_tiers)
    state.config = config
    state._capacity = None  # thresholds may have changed
    for jid in state.running:  # and the default time limit, and what counts as idle
        state._track_deadline(state.jobs[jid])
        state._track_idle(state.jobs[jid])
    if aging_changed:  # the queue's order depends on the aging rate
        state._derive()


def _tenants_configured(state: ClusterState, e: ev.TenantsConfigured) -> None:
    state.tenants = dict(e.tenants)


def _gpu_discovered(state: ClusterState, e: ev.GpuDiscovered) -> None:
    gpu = state.gpus.get((e.node, e.gpu))
    if gpu is None:
        gpu = Gpu(node=e.node, id=e.gpu)
        state.gpus[(e.node, e.gpu)] = gpu
        bisect.insort(state.gpu_list, gpu, key=_gpu_order)
        bisect.insort(state.node_gpus.setdefault(e.node, []), gpu, key=_gpu_order)
    gpu.uuid, gpu.model, gpu.memory_total_mib = e.uuid, e.model, e.memory_total_mib
    gpu.lost, gpu.error = False, ""
    state._capacity = None
    state.fit_cache.clear()


def _gpu_sampled(state: ClusterState, e: ev.GpuSampled) -> None:
    gpu = state.gpus.get((e.node, e.gpu))
    if gpu is None:
        return  # a sample of a GPU we never discovered is of no use
    gpu.sampled_at, gpu.utilization, gpu.memory_used_mib = e.ts, e.utilization, e.memory_used_mib
    gpu.temperature_c, gpu.power_w, gpu.foreign_memory_mib = e.temperature_c, e.power_w, e.foreign_memory_mib
    # quiet since when, and who holds what (O(jobs on this GPU))
    if e.utilization <= state.config.idle_utilization_pct:
        if gpu.low_since is None:
            gpu.low_since = e.ts
    else:
        gpu.low_since = None
    gpu.job_memory_mib = e.job_memory_mib
    gpu.foreign_processes = e.foreign_processes
    for jid in gpu.jobs:
        job = state.jobs[jid]
        used = e.job_memory_mib.get(jid, 0)
        if used > job.gpu_mem_peak_mib:
            job.gpu_mem_peak_mib = used
        state._track_idle(job)
    state._gpu_changed(gpu)


def _node_joined(state: ClusterState, e: ev.NodeJoined) -> None:
    state.nodes[e.node] = NodeInfo(name=e.node, state="up", since=e.ts, ray_node=e.ray_node,
                                   gpu_backend=e.gpu_backend)


def _node_left(state: ClusterState, e: ev.NodeLeft) -> None:
    info = state.nodes.setdefault(e.node, NodeInfo(name=e.node))
    info.state, info.since, info.reason = "down", e.ts, e.reason


def _node_actor_restarted(state: ClusterState, e: ev.NodeActorRestarted) -> None:
    info = state.nodes.setdefault(e.node, NodeInfo(name=e.node, state="up"))
    info.restarts += 1


def _gpu_errored(state: ClusterState, e: ev.GpuErrored) -> None:
    gpu = state.gpus.get((e.node, e.gpu))
    if gpu is None:
        return
    gpu.error = e.error
    if e.lost:
        gpu.lost = True
        state._gpu_changed(gpu)
        state.fit_cache.clear()


def _gpu_paused_or_resumed(state: ClusterState, e: ev.GpuPaused | ev.GpuResumed) -> None:
    gpu = state.gpus.get((e.node, e.gpu))
    if gpu is not None:
        gpu.paused = isinstance(e, ev.GpuPaused)
        gpu.paused_reason = e.reason if isinstance(e, ev.GpuPaused) else ""
        state._gpu_changed(gpu)


def _gpu_health(state: ClusterState, e: ev.GpuHealth) -> None:
    gpu = state.gpus.get((e.node, e.gpu))
    if gpu is not None:
        gpu.health = e


def _reservation(state: ClusterState, e: ev.ReservationCreated | ev.ReservationCancelled) -> None:
    if isinstance(e, ev.ReservationCreated):
        state.reservations[e.reservation] = e
        state.last_reservation = max(state.last_reservation, e.reservation)
    else:
        state.reservations.pop(e.reservation, None)


def _policy_changed(state: ClusterState, e: ev.PolicyChanged) -> None:
    state.policy = e.policy


def _job_submitted(state: ClusterState, e: ev.JobSubmitted) -> None:
    if e.job in state.jobs:
        raise IllegalTransition(f"job {e.job} already exists")
    count, milli = request_of(e.spec)
    # attributes set one by one: compiled, each is a plain store, where
    # Job(**fields) would set them by name (every submission comes here)
    job = Job()
    job.id, job.spec, job.count, job.milli, job.order = e.job, e.spec, count, milli, state.next_order
    job.submitted_at, job.submitted_seq, job.queued_at = e.ts, e.seq, e.ts
    if e.spec.begin > e.ts:  # --begin: it waits as a retry's backoff does
        job.not_before = e.spec.begin
    state.jobs[e.job] = job
    state.next_job_id = max(state.next_job_id, e.job + 1)
    state.next_order += 1
    state._index_submitted(job)
    state._enter_queue(job)
    if count:
        shape = (count, milli)
        if len(state.recent_shapes) == RECENT_SHAPES:
            old = state.recent_shapes[0]
            n = state.shape_counts[old] - 1
            if n:
                state.shape_counts[old] = n
            else:
                del state.shape_counts[old]
        state.recent_shapes.append(shape)
        state.shape_counts[shape] = state.shape_counts.get(shape, 0) + 1


def _job_placed(state: ClusterState, e: ev.JobPlaced) -> None:
    job = _job(state, e.job)
    to = next_state(job, e)
    gpus = []
    for gid in e.gpu_ids:
        gpu = state.gpus.get((e.node, gid))
        if gpu is None:
            raise IllegalTransition(f"job {e.job} placed on unknown GPU {gid} of {e.node!r}")
        gpus.append(gpu)
    milli = round(e.share * FULL) if e.gpu_ids else 0
    state._leave_queue(job)
    job.state, job.node, job.gpu_ids, job.policy = to, e.node, list(e.gpu_ids), e.policy
    job.milli, job.mem_mib, job.started_at = milli, e.gpu_mem_mib, e.ts
    job.ended_at = job.exit_code = job.signal = job.pid = None
    job.start_time, job.cancel_reason, job.reason = 0, "", ""
    job.attempts += 1
    job.gpu_mem_peak_mib, job.gpu_mem_over, job.idle_since = 0, False, None
    _predict_end(state, job, e.ts)
    for gpu in gpus:
        gpu.used_milli += milli
        gpu.reserved_mib += e.gpu_mem_mib
        gpu.jobs.append(job.id)
        state._gpu_changed(gpu)
    state.running[job.id] = None
    state._track_deadline(job)
    state._track_idle(job)
    state._age_usage(tenant_of(job), e.ts)
    state._hold(job, +1)


def _predict_end(state: ClusterState, job: Job, start: float) -> None:
    """Set ``job.predicted_end``: ``start`` plus its predicted runtime,
    capped by its time limit; keep ``state.ends`` in step."""
    p = state.stats.predict(runtime_key(job.spec), DEFAULT_RUNTIME_S)
    limit = time_limit_of(job, state.config.default_time_limit_s)
    _forget_end(state, job)
    job.predicted_end = start + (min(p, limit) if limit is not None else p)
    bisect.insort(state.ends, (job.predicted_end, job.id))


def _forget_end(state: ClusterState, job: Job) -> None:
    ends, key = state.ends, (job.predicted_end, job.id)
    i = bisect.bisect_left(ends, key)
    if i < len(ends) and ends[i] == key:
        del ends[i]


def _job_started(state: ClusterState, e: ev.JobStarted) -> None:
    job = _job(state, e.job)
    next_state(job, e)
    job.pid, job.start_time, job.log_path, job.started_at = e.pid, e.start_time, e.log_path, e.ts
    _predict_end(state, job, e.ts)
    state._track_deadline(job)
    state._track_idle(job)


def _job_exited(state: ClusterState, e: ev.JobExited) -> None:
    job = _job(state, e.job)
    to = next_state(job, e)
    _release(state, job, e.ts)
    job.state, job.exit_code, job.signal, job.ended_at = to, e.exit_code, e.signal, e.ts
    job.reason = e.reason or job.cancel_reason
    if job.started_at is not None:
        state.stats.add(runtime_key(job.spec), e.ts - job.started_at)
    # the milli-share asked for, should the job be requeued
    job.milli = request_of(job.spec)[1]


def _job_cancel_requested(state: ClusterState, e: ev.JobCancelRequested) -> None:
    job = _job(state, e.job)
    next_state(job, e)
    job.cancel_reason = e.reason
    if e.reason == "preempted":
        state.being_preempted[job.id] = None
        waiting = state.jobs.get(e.for_job)
        if waiting is not None and waiting.state == QUEUED and job.gpu_ids:  # its GPUs are held for the waiting job
            waiting.room = waiting.room + [k for k in ((job.node, g) for g in job.gpu_ids) if k not in waiting.room]
            state.making_room[waiting.id] = None
    else:  # a cancel while being preempted: no longer a preemption
        state._stopped_preempting(job)
    if e.reason in IDLE_STOPS:
        state.reclaiming[job.id] = None
    else:
        state.reclaiming.pop(job.id, None)
    state._track_deadline(job)
    state._track_idle(job)


def _job_cancelled(state: ClusterState, e: ev.JobCancelled) -> None:
    job = _job(state, e.job)
    to = next_state(job, e)
    if job.state == QUEUED:
        state._leave_queue(job)
    job.state, job.reason, job.ended_at = to, "cancelled", e.ts


def _job_requeued(state: ClusterState, e: ev.JobRequeued) -> None:
    job = _job(state, e.job)
    job.state = next_state(job, e)
    if e.reason == "preempted":
        job.preemptions += 1
    if e.reason not in ("not-launched", "preempted"):  # these keep their place (and age)
        job.order = state.next_order  # to the back of the queue
        state.next_order += 1
        job.queued_at = e.ts
    elif e.reason == "preempted" and state.config.aging_tiers:
        job.queued_at = e.ts  # it keeps its place, but ages afresh: below the job it gave way to
    job.not_before = e.not_before
    if e.reason == "retry":
        job.retries_used += 1
    job.node, job.gpu_ids, job.mem_mib = "", [], 0
    job.pid, job.start_time, job.cancel_reason = None, 0, ""
    job.started_at = job.ended_at = job.exit_code = job.signal = None
    job.gpu_mem_over, job.idle_since = False, None
    state._enter_queue(job)


def _job_held(state: ClusterState, e: ev.JobHeld) -> None:
    job = _job(state, e.job)
    to = next_state(job, e)
    state._leave_queue(job)
    job.state = to


def _job_released(state: ClusterState, e: ev.JobReleased) -> None:
    job = _job(state, e.job)
    job.state = next_state(job, e)  # keeps its place (order) in the queue
    state._enter_queue(job)


def _job_updated(state: ClusterState, e: ev.JobUpdated) -> None:
    job = _job(state, e.job)
    to = next_state(job, e)
    queued = job.state == QUEUED
    if queued:  # its priority and shape are the queue's keys: out under the old, in under the new
        state._leave_queue(job)
    job.spec = msgspec.structs.replace(job.spec, **e.changes())
    job.count, job.milli = request_of(job.spec)
    job.state = to
    if queued:
        state._enter_queue(job)


def _job_lost(state: ClusterState, e: ev.JobLost) -> None:
    job = _job(state, e.job)
    to = next_state(job, e)
    _release(state, job, e.ts)
    job.state, job.reason, job.ended_at = to, e.reason or "lost", e.ts


def _job_gpu_memory(state: ClusterState, e: ev.JobGpuMemoryExceeded | ev.JobGpuMemoryWithin) -> None:
    job = _job(state, e.job)
    next_state(job, e)
    job.gpu_mem_over = isinstance(e, ev.JobGpuMemoryExceeded)


def _job_idle_or_busy(state: ClusterState, e: ev.JobIdle | ev.JobBusy) -> None:
    job = _job(state, e.job)
    next_state(job, e)
    job.idle_since = e.since if isinstance(e, ev.JobIdle) else None
    state._track_idle(job)


def _counting_ended(handler: Callable[[ClusterState, Any], None]) -> Callable[[ClusterState, Any], None]:
    """``handler`` (of an event that may end a job, or bring one back), keeping
    ``ClusterState.array_ended`` in step."""

    def counted(state: ClusterState, e: Any) -> None:
        job = state.jobs.get(e.job)
        ended = job is not None and job.state in FINAL
        handler(state, e)
        if job is not None and job.spec.array_index >= 0 and (job.state in FINAL) != ended:
            state.array_ended[job.spec.array_id] += -1 if ended else 1

    return counted


_HANDLERS: dict[type, Any] = {
    ev.DaemonStarted: _daemon_started,
    ev.GpuDiscovered: _gpu_discovered,
    ev.GpuSampled: _gpu_sampled,
    ev.GpuErrored: _gpu_errored,
    ev.GpuPaused: _gpu_paused_or_resumed,
    ev.GpuResumed: _gpu_paused_or_resumed,
    ev.GpuHealth: _gpu_health,
    ev.ReservationCreated: _reservation,
    ev.ReservationCancelled: _reservation,
    ev.PolicyChanged: _policy_changed,
    ev.JobSubmitted: _job_submitted,
    ev.JobPlaced: _job_placed,
    ev.JobStarted: _job_started,
    ev.JobExited: _counting_ended(_job_exited),
    ev.JobCancelRequested: _job_cancel_requested,
    ev.JobCancelled: _counting_ended(_job_cancelled),
    ev.JobRequeued: _counting_ended(_job_requeued),  # lost -> queued: no longer ended
    ev.JobHeld: _job_held,
    ev.JobReleased: _job_released,
    ev.JobUpdated: _job_updated,
    ev.JobLost: _counting_ended(_job_lost),
    ev.TenantsConfigured: _tenants_configured,
    ev.JobGpuMemoryExceeded: _job_gpu_memory,
    ev.JobGpuMemoryWithin: _job_gpu_memory,
    ev.JobIdle: _job_idle_or_busy,
    ev.JobBusy: _job_idle_or_busy,
    ev.NodeJoined: _node_joined,
    ev.NodeLeft: _node_left,
    ev.NodeActorRestarted: _node_actor_restarted,
}


def nodes_view(state: ClusterState, now: float | None = None,
               lease_ages: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Each node (a cluster's, else the one machine) with its state, GPUs and
    jobs; ``lease_ages``: seconds since the daemon's last exchange with each."""
    ages = lease_ages or {}
    names = set(state.nodes) | set(state.node_gpus)
    if not state.nodes:
        names.add(state.node)
    running: dict[str, list[int]] = {}
    for jid in state.running:
        job = state.jobs[jid]
        running.setdefault(job.node or state.node, []).append(jid)
    out = []
    for name in sorted(names):
        info = state.nodes.get(name)
        gpus = state.node_gpus.get(name, [])
        drained = [f"GPU {g.id} drained: {g.paused_reason}" for g in gpus if g.paused and g.paused_reason]
        out.append({
            "name": name,
            "state": _node_state(state, info, gpus, now, ages.get(name)),
            "gpus": sum(1 for g in gpus if not g.lost),
            "gpus_total": len(gpus),
            "gpus_busy": sum(1 for g in gpus if g.used_milli > 0 and not g.lost),
            "jobs": sorted(running.get(name, [])),
            "since": info.since if info is not None else None,
            "reason": "; ".join(([info.reason] if info is not None and info.reason else []) + drained),
            "ray_node": info.ray_node if info is not None else "",
            "restarts": info.restarts if info is not None else 0,
            "lease_age_s": round(ages[name], 1) if name in ages else None,
        })
    return out


def _node_state(state: ClusterState, info: NodeInfo | None, gpus: list[Any], now: float | None,
                age: float | None) -> str:
    """``up``; ``draining`` when every usable GPU is paused (it takes nothing
    new); for a node gone (with ``now``): ``down`` while its lease may hold,
    ``fenced`` once it has run out (the node, if it runs at all, stops its
    jobs itself), ``lost`` past ``node_lost_after_s`` (its jobs given up)."""
    if info is None or info.state == "up":
        usable = [g for g in gpus if not g.lost]
        return "draining" if usable and all(g.paused for g in usable) else "up"
    if now is None:
        return info.state
    gone, cfg = now - info.since, state.config
    if gone >= cfg.node_lost_after_s:
        return "lost"
    lease_s = lease_terms(cfg)[0]
    if lease_s > 0 and max(gone, age or 0.0) >= lease_s:
        return "fenced"
    return "down"


_snap_encoder = msgspec.msgpack.Encoder()
_snap_decoder = msgspec.msgpack.Decoder(StateSnapshot)


def snapshot_bytes(state: ClusterState) -> bytes:
    """The state's facts as msgpack (indices are rebuilt on load)."""
    snap = StateSnapshot(
        last_seq=state.last_seq,
        node=state.node,
        policy=state.policy,
        config=state.config,
        gpus=[g.record() for g in sorted(state.gpus.values(), key=lambda g: (g.node, g.id))],
        jobs=[j.record() for j in sorted(state.jobs.values(), key=lambda j: j.id)],
        next_job_id=state.next_job_id,
        next_order=state.next_order,
        recent_shapes=list(state.recent_shapes),
        runtime_by_key=[(u, n, c, t) for (u, n), (c, t) in sorted(state.stats.by_key.items())],
        runtimes_ms=state.stats.sorted,
        tenants=state.tenants,
        recent_usage=[(t, u.recent, u.as_of) for t, u in sorted(state.usage.items())],
        nodes=[state.nodes[n] for n in sorted(state.nodes)],
        reservations=list(state.reservations.values()),
        month_usage={t: u.month_used for t, u in sorted(state.usage.items()) if u.month_used},
    )
    return _snap_encoder.encode(snap)


def state_from_snapshot(data: bytes) -> ClusterState:
    """Inverse of ``snapshot_bytes``; raises ``msgspec.DecodeError`` on garbage."""
    snap = _snap_decoder.decode(data)
    state = ClusterState()
    state.last_seq, state.node, state.policy, state.config = snap.last_seq, snap.node, snap.policy, snap.config
    state.gpus = {(g.node, g.id): Gpu.from_record(g) for g in snap.gpus}
    state.jobs = {j.id: Job.from_record(j) for j in snap.jobs}
    state.next_job_id, state.next_order = snap.next_job_id, snap.next_order
    state.recent_shapes = deque((tuple(s) for s in snap.recent_shapes), maxlen=RECENT_SHAPES)  # type: ignore[misc]
    state.stats.by_key = {(u, n): (c, t) for u, n, c, t in snap.runtime_by_key}
    state.stats.sorted = list(snap.runtimes_ms)
    state.tenants = dict(snap.tenants)
    month = snap.month_usage
    state.usage = {t: TenantUsage(recent, as_of, month.get(t, 0.0)) for t, recent, as_of in snap.recent_usage}
    state.nodes = {n.name: n for n in snap.nodes}
    state.reservations = {r.reservation: r for r in snap.reservations}
    state.last_reservation = max(state.reservations, default=0)
    state._derive()
    return state


def validate_state(state: ClusterState) -> None:
    """Raise AssertionError when an invariant does not hold (tests call it after every step)."""
    used: dict[tuple[str, int], int] = {key: 0 for key in state.gpus}
    mem: dict[tuple[str, int], int] = {key: 0 for key in state.gpus}
    on: dict[tuple[str, int], list[int]] = {key: [] for key in state.gpus}
    for job in state.jobs.values():
        assert isinstance(job.state, JobState), f"job {job.id} in unknown state {job.state}"
        if job.state == RUNNING:
            assert len(job.gpu_ids) == job.count, f"job {job.id}: gang not all-or-nothing {job.gpu_ids}"
            assert len(set(job.gpu_ids)) == len(job.gpu_ids), f"job {job.id}: a GPU twice"
            for gid in job.gpu_ids:
                key = (job.node, gid)
                used[key] += job.milli
                mem[key] += job.mem_mib
                on[key].append(job.id)
        else:
            assert job.id not in state.running
            assert job.state not in FINAL or job.ended_at is not None, f"job {job.id} final without end"
    for key, gpu in state.gpus.items():
        assert 0 <= gpu.used_milli <= FULL, f"GPU {key} over-committed: {gpu.used_milli}"
        assert gpu.used_milli == used[key], f"GPU {key}: {gpu.used_milli} != {used[key]}"
        assert gpu.reserved_mib == mem[key], f"GPU {key}: reserved {gpu.reserved_mib} != {mem[key]}"
        assert sorted(gpu.jobs) == sorted(on[key]), f"GPU {key}: jobs {gpu.jobs} != {on[key]}"
    queued = sorted(j.id for j in state.jobs.values() if j.state == QUEUED)
    assert sorted(i for _, i in state.queue.by_order) == queued, "queue index out of step"
    assert state.queue.by_priority == sorted(state.queue.by_priority)
    assert state.queue.by_order == sorted(state.queue.by_order)
    per_uid = collections.Counter(j.spec.uid for j in state.jobs.values() if j.state == QUEUED)
    assert state.queued_by_uid == per_uid, "per-user queue counts out of step"
    running = sorted(j.id for j in state.jobs.values() if j.state == RUNNING)
    assert sorted(state.running) == running, "running index out of step"
    assert all(math.isfinite(g.used_milli) for g in state.gpus.values())
    # the incremental indices equal a recomputation from the facts
    fresh = ClusterState()
    fresh.config, fresh.gpus, fresh.jobs = state.config, state.gpus, state.jobs
    fresh._derive()
    assert +state.array_ended == fresh.array_ended, "ended array tasks out of step"
    assert state.capacity.same(fresh.capacity), "capacity index out of step"
    for name in ("gpu_list", "node_gpus", "deadlines", "backoff", "array_running", "ends", "running_preemptible",
                 "running_of_tenant", "being_preempted", "making_room", "idle_due", "idle_jobs", "reclaiming"):
        mine, theirs = getattr(state, name), getattr(fresh, name)
        assert mine == theirs, f"{name} out of step: {mine} != {theirs}"
    # the queue's orders built on demand: built here if they were not (and kept in step from then on)
    for name in ("shape_queue", "by_priority", "by_order", "by_rkey", "shape_rkey"):
        assert getattr(state.queue, name) == getattr(fresh.queue, name), f"queue's {name} out of step"
    assert set(state.deadlines.items()) <= set((j, d) for d, j in state._due), "a deadline missing from the heap"
    assert state.next_time_limit() == min(fresh.deadlines.values(), default=None)
    for (node, mib), hit in state.fit_cache.items():
        assert hit == fresh.fit(node, mib), f"stale fit cache for {node!r}, {mib} MiB"
    assert not state.making_room or state.being_preempted, "room held with no preemption stopping"
    assert state.next_idle_due() == min(fresh.idle_due.values(), default=None), "idle heap out of step"
    held = {t: u.held() for t, u in state.usage.items() if u.held() != (0, 0, 0)}
    fresh_held = {t: u.held() for t, u in fresh.usage.items() if u.held() != (0, 0, 0)}
    assert held == fresh_held, f"tenant usage {held} != {fresh_held}"
