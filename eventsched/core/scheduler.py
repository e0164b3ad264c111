"""The sans-I/O scheduler: ``handle(state, message, now) -> (events, effects)``.

Time arrives as ``now``, the world as messages. Each event is applied to
``state`` as it is produced, so after ``handle`` the state is the fold of the
events returned; a ``Refused`` message changes nothing (every check runs before
the first event). The daemon and the replay simulator drive this same function.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from eventsched.core import budgets, gpu_watch, preemption, reservations
from eventsched.core.policies import POLICIES, REPLAY_ONLY, decide
from eventsched.core.records import Placement
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.domain.gpu_health import drain_reason, same_reading
from eventsched.domain.messages import Effect, Launch, Notify, RefusalKind, Refused, Signal, WakeAt
from eventsched.domain.settings import settings_dict
from eventsched.domain.states import (
    BLOCKS_DUPLICATES,
    FINAL,
    GPU_MEMORY_OVER,
    WAITING,
    WARNED_STOPS,
    JobState,
    can,
    exit_outcome,
)
from eventsched.domain.tenants import Tenant, TenantError, check_tenants, tenant_of_user
from eventsched.domain.units import MAX_ARRAY_TASKS
from eventsched.projections.cluster import (
    FULL,
    ClusterState,
    Gpu,
    Job,
    apply,
    fit_summary,
    request_of,
)

# plain module names: an Enum class attribute costs a lookup on every use (hot paths)
FAILED = JobState.FAILED
HELD = JobState.HELD
PREEMPTED = JobState.PREEMPTED
QUEUED = JobState.QUEUED
RUNNING = JobState.RUNNING
SUCCEEDED = JobState.SUCCEEDED

__all__ = ["handle", "next_deadline", "check_spec", "NOT_LAUNCHED"]

class _Out:
    """What one message produced, each event applied at once: the message's *fact*
    first, then the *decisions* it leads to, caused by ``seq:N`` (the core stamps
    seqs itself: its caller appends every event in order)."""

    def __init__(self, state: ClusterState, now: float) -> None:
        self.state = state
        self.now = now
        self.events: list[ev.Event] = []
        self.effects: list[Effect] = []
        self.cause = ""  # "seq:N" of this message's fact, once recorded
        self._deferred: ev.Event | None = None

    def _emit(self, event: ev.Event, cause: str | None = None) -> ev.Event:
        if cause is None:
            event = msgspec.structs.replace(event, seq=self.state.last_seq + 1)
        else:
            event = msgspec.structs.replace(event, seq=self.state.last_seq + 1, ts=self.now, cause=cause)
        apply(self.state, event)
        self.events.append(event)
        return event

    def fact(self, event: ev.Event) -> ev.Event:
        """Record what happened (a stimulus); later decisions name it."""
        event = self._emit(event)
        self.cause = f"seq:{event.seq}"
        return event

    def defer(self, event: ev.Event) -> None:
        """A fact worth recording only if some decision follows from it."""
        self._deferred = event

    def decide(self, event: ev.Event) -> ev.Event:
        """Record a decision, caused by this message's fact."""
        if self._deferred is not None:
            self.fact(self._deferred)
            self._deferred = None
        if not self.cause:  # a handler that decides before recording its fact: a bug
            raise AssertionError(f"decision {type(event).__name__} without a recorded cause")
        return self._emit(event, self.cause)


def handle(state: ClusterState, msg: m.Message, now: float) -> tuple[list[ev.Event], list[Effect]]:
    """One message's events (already applied to ``state``) and effects, or ``Refused``."""
    handler = _HANDLERS.get(type(msg))
    if handler is None:
        raise Refused(RefusalKind.INVALID, f"unsupported message {type(msg).__name__}")
    out = _Out(state, now)
    handler(out, msg)
    wake = next_deadline(state, now)
    if wake is not None:
        out.effects.append(WakeAt(at=wake))
    return out.events, out.effects


# --- shared steps ---------------------------------------------------------------


def _schedule(out: _Out) -> None:
    state = out.state
    if state.reservations:
        _clear_reserved(out)
    if not state.queue:
        return
    placements = decide(state, out.now)
    _launch(out, placements)
    if state.tenants and state.queue and budgets.LOWER in budgets.spent(state, out.now).values():
        # what everyone else's jobs left goes to the tenants whose budget is spent
        state.placing_lowered = True
        try:
            lowered = decide(state, out.now)
        finally:
            state.placing_lowered = False
        _launch(out, lowered)
        placements = placements + lowered
    if state.config.preemption and state.queue and _may_preempt(state):
        _preempt(out, frozenset(p.job for p in placements))
    if state.idle_jobs and state.queue and state.config.idle_policy != "off":
        _reclaim_idle(out)


def _launch(out: _Out, placements: list[Placement]) -> None:
    state = out.state
    for p in placements:
        out.decide(ev.JobPlaced(job=p.job, node=p.node, gpu_ids=p.gpu_ids, share=p.share, gpu_mem_mib=p.mem,
                                policy=state.policy))
        job = state.jobs[p.job]
        out.effects.append(Launch(job=p.job, spec=_with_memory_knobs(state, job), node=p.node, gpu_ids=list(p.gpu_ids),
                                  attempt=job.attempts))


GPU_MEM_FRACTION_VARS = ("EVENTSCHED_GPU_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def _with_memory_knobs(state: ClusterState, job: Job) -> ev.JobSpec:
    """The spec to launch: a ``--gpu-mem`` job gets, as a fraction of its smallest GPU,
    the knobs JAX and ``eventsched.torch_memory_fraction()`` read, unless set.
    Only the launch sees them: the log keeps the spec as submitted."""
    spec = job.spec
    if spec.gpu_mem_mib <= 0 or not job.gpu_ids or all(k in spec.env for k in GPU_MEM_FRACTION_VARS):
        return spec
    totals = [g.memory_total_mib for gid in job.gpu_ids if (g := state.gpus.get((job.node, gid))) is not None]
    total = min((t for t in totals if t > 0), default=0)
    if total <= 0:
        return spec
    fraction = f"{min(1.0, spec.gpu_mem_mib / total):.4f}"
    return msgspec.structs.replace(spec, env={**{k: fraction for k in GPU_MEM_FRACTION_VARS}, **spec.env})


def _clear_reserved(out: _Out) -> None:
    """Others' jobs in an open reservation window: stopped and requeued, or only flagged."""
    if out.state.config.reservation_policy == "requeue":
        for jid, r in reservations.intruders(out.state, out.now):
            _stop(out, jid, f"reservation {r.reservation}", "preempted", rule="reservation")


def _reserve(out: _Out, msg: m.Reserve) -> None:
    rid = msg.reservation or out.state.last_reservation + 1
    out.fact(reservations.create(out.state, msg, out.now, rid))
    _schedule(out)


def _cancel_reservation(out: _Out, msg: m.CancelReservation) -> None:
    out.fact(reservations.cancel(out.state, msg, out.now))
    _schedule(out)


def _reclaim_idle(out: _Out) -> None:
    """An idle job gives way to a waiting job that could use its GPUs (``idle_policy``)."""
    found = gpu_watch.reclaim(out.state, out.now)
    if found is None:
        return
    jid, waiting = found
    reason = "idle" if out.state.config.idle_policy == "stop" else "idle-requeue"
    _stop(out, jid, f"job {waiting}", reason, waiting, "idle")


def _may_preempt(state: ClusterState) -> bool:
    """``preemption.plan``'s cheap first answers, asked here (compiled) after every decision."""
    if state.being_preempted:
        return False
    return bool(state.running_preemptible) or any(t.preemptible for t in state.tenants.values())


def _preempt(out: _Out, placed: frozenset[int]) -> None:
    """Stop the jobs a more urgent waiting job needs, never one ``placed`` in this decision."""
    found = preemption.plan(out.state, out.now, placed)
    if found is None:
        return
    for jid in found.victims:
        _stop(out, jid, f"job {found.waiting}", "preempted", found.waiting, found.rule)


def _stop(out: _Out, jid: int, by: str, reason: str, for_job: int = 0, rule: str = "") -> None:
    out.decide(ev.JobCancelRequested(job=jid, by=by, reason=reason, for_job=for_job, rule=rule))
    out.effects.append(_stop_signal(out.state, out.state.jobs[jid], reason))


def _stop_signal(state: ClusterState, job: Job, reason: str) -> Signal:
    """Warned stops use the job's ``--signal`` and grace (else ``preempt_grace_s``);
    the rest get SIGTERM and ``kill_grace_s``."""
    grace, signum = state.config.kill_grace_s, 0
    if reason in WARNED_STOPS:
        grace = job.spec.warn_s if job.spec.warn_s >= 0 else state.config.preempt_grace_s
        signum = job.spec.warn_signal
    return Signal(job=job.id, grace_s=grace, reason=reason, signum=signum, node=job.node or "local", attempt=job.attempts)


def _cascade(out: _Out, job_id: int) -> None:
    stack = [job_id]
    while stack:
        jid = stack.pop()
        for dep in out.state.dependents.get(jid, ()):
            if out.state.jobs[dep].state in WAITING:
                out.decide(ev.JobCancelled(job=dep, by=f"dependency:job {jid}"))
                stack.append(dep)


def next_deadline(state: ClusterState, now: float) -> float | None:
    """The earliest future time something is due: a time limit or a backoff."""
    due = state.next_time_limit()  # kept by the projection, as is the idle due time
    best = math.inf if due is None else due
    idle = state.next_idle_due()
    if idle is not None and idle < best:
        best = idle
    for jid in state.backoff:
        nb = state.jobs[jid].not_before
        if nb > now:
            best = min(best, nb)
    for due, _ in _nodes_gone_with_jobs(state):
        best = min(best, due)
    edge = reservations.next_edge(state, now) if state.reservations else None
    if edge is not None and edge < best:
        best = edge
    if state.tenants and (month := budgets.next_month(state, now)) is not None:
        best = min(best, month)  # a spent budget starts again
    return None if best == math.inf else best


def _owned(state: ClusterState, ids: list[int], uid: int, verb: str) -> list[Job]:
    jobs: list[Job] = []
    for jid in dict.fromkeys(ids):
        job = state.jobs.get(jid)
        if job is None:
            raise Refused(RefusalKind.NOT_FOUND, f"no job {jid}")
        if uid != 0 and uid != job.spec.uid:
            raise Refused(RefusalKind.FORBIDDEN, f"job {jid} belongs to {job.spec.user or 'uid ' + str(job.spec.uid)}; only its owner or root may {verb} it")
        jobs.append(job)
    return jobs


# --- the daemon -----------------------------------------------------------------


def _started(out: _Out, msg: m.Started) -> None:
    state = out.state
    policy = msg.config.policy
    _known_policy(policy)
    previous = state.policy if state.last_seq or state.jobs else None
    out.fact(ev.DaemonStarted(ts=out.now, cause="daemon", node=msg.node, pid=msg.pid, version=msg.version,
                              policy=policy, gpu_backend=msg.gpu_backend, config=settings_dict(msg.config)))
    if previous is not None and previous != policy:
        out.decide(ev.PolicyChanged(policy=policy, by="config"))
    if msg.tenants is not None and msg.tenants != state.tenants:
        _check_tenants(msg.tenants)
        out.decide(ev.TenantsConfigured(tenants=dict(msg.tenants), by="config"))
    _discovered(out, msg.node, msg.gpus, "not found at start-up")


def _discovered(out: _Out, node: str, gpus: list[m.GpuInfo], missing: str) -> None:
    """``node``'s GPUs as found; those it no longer has are lost."""
    found = set()
    for info in sorted(gpus, key=lambda g: g.gpu):
        found.add(info.gpu)
        out.decide(ev.GpuDiscovered(node=node, gpu=info.gpu, uuid=info.uuid, model=info.model,
                                    memory_total_mib=info.memory_total_mib))
    for gpu in list(out.state.node_gpus.get(node, ())):
        if gpu.id not in found and not gpu.lost:
            out.decide(ev.GpuErrored(node=gpu.node, gpu=gpu.id, error=missing, lost=True))
    _schedule(out)


def _stopping(out: _Out, msg: m.Stopping) -> None:
    out.fact(ev.DaemonStopped(ts=out.now, cause="daemon", node=msg.node, reason=msg.reason))


# --- submissions ------------------------------------------------------------------


def check_spec(state: ClusterState, spec: ev.JobSpec) -> None:
    """Refuse a submission that could never run here, with the reason."""
    if not spec.command or not all(isinstance(a, str) for a in spec.command):
        raise Refused(RefusalKind.INVALID, "the job has no command")
    g = spec.gpus
    if not math.isfinite(g) or g < 0 or (g > 1 and g != int(g)):
        raise Refused(RefusalKind.INVALID, f"--gpus must be 0, a share in [0.001, 1] or a whole number of GPUs, not {g}")
    count, milli = request_of(spec)
    if 0 < g < 1 and round(g * FULL) < 1:
        raise Refused(RefusalKind.INVALID, f"--gpus {g} is below the smallest share (0.001)")
    if spec.gpu_mem_mib < 0:
        raise Refused(RefusalKind.INVALID, f"--gpu-mem must be >= 0 MiB, not {spec.gpu_mem_mib}")
    if spec.time_limit_s is not None and not (math.isfinite(spec.time_limit_s) and spec.time_limit_s > 0):
        raise Refused(RefusalKind.INVALID, f"--time-limit must be a positive number of seconds, not {spec.time_limit_s}")
    if spec.retries < 0:
        raise Refused(RefusalKind.INVALID, f"--retries must be >= 0, not {spec.retries}")
    if spec.gpu_ids is not None and not spec.gpu_ids:
        raise Refused(RefusalKind.INVALID, "--gpu-ids is empty")
    if state.cluster and not state.nodes:
        return  # a cluster still forming: no node has joined yet, so any job waits for one
    if spec.node and spec.node != state.node and spec.node not in state.node_gpus:
        raise Refused(RefusalKind.NOT_FOUND, f"unknown node {spec.node!r}")
    gpus = state.node_gpus.get(spec.node, []) if spec.node else state.gpu_list
    if spec.gpu_ids is not None:
        known = {x.id for x in gpus}
        unknown = sorted(i for i in set(spec.gpu_ids) if i not in known)
        if unknown:
            have = ", ".join(str(i) for i in sorted(known)) or "none"
            raise Refused(RefusalKind.NOT_FOUND, f"unknown GPU id {', '.join(map(str, unknown))} (GPUs here: {have})")
        gpus = [x for x in gpus if x.id in spec.gpu_ids]
    if count == 0:
        return
    # (most GPUs with the memory on one node, GPUs not lost, largest memory); cached: GPUs rarely change
    most, pool, largest = state.fit(spec.node, spec.gpu_mem_mib) if spec.gpu_ids is None else fit_summary(gpus, spec.gpu_mem_mib)
    if most >= count:
        return
    if state.cluster:  # measured against every GPU the cluster has had: a node down may come back
        most = max(Counter(g.node for g in gpus if g.memory_total_mib >= spec.gpu_mem_mib).values(), default=0)
        if most >= count:
            return  # it waits for a node with room (explain says so)
        pool, largest = len(gpus), max((g.memory_total_mib for g in gpus), default=0)
    if not pool:
        raise Refused(RefusalKind.UNAVAILABLE, "no GPU here can take this job (no GPUs, or all allowed ones are lost)")
    if spec.gpu_mem_mib and most < pool:
        raise Refused(RefusalKind.INVALID, f"asks for {spec.gpu_mem_mib} MiB of GPU memory on each of {count} GPU(s) "
                      f"but only {most} GPU(s) have that much (largest: {largest} MiB)")
    where = "allowed GPU(s)" if spec.gpu_ids is not None else "GPU(s) on one node"
    if spec.gpu_ids is None and not spec.node and len(state.node_gpus) > 1:  # say why
        raise Refused(RefusalKind.INVALID, f"asks for {count} GPUs but the largest node has {most}: a job's GPUs are all on one node "
                      f"({len(state.node_gpus)} nodes; ask for at most {most}, or run one job per node)")
    raise Refused(RefusalKind.INVALID, f"asks for {count} GPUs but there are only {most} {where}")


def _submit(out: _Out, msg: m.Submit) -> None:
    state = out.state
    spec = msg.spec
    if not msg.normalised:
        try:  # types (an int where a float belongs) exactly as the log will decode them
            spec = ev.normalise_spec(spec)
        except (msgspec.ValidationError, TypeError) as exc:
            raise Refused(RefusalKind.INVALID, f"bad job spec: {exc}") from None
    try:
        spec = msgspec.structs.replace(spec, tenant=tenant_of_user(state.tenants, spec.user, spec.tenant))
    except TenantError as exc:
        raise Refused(RefusalKind.FORBIDDEN, str(exc)) from None
    check_spec(state, spec)
    _admit_tenant(state, spec)
    for dep in spec.after:
        d = state.jobs.get(dep)
        if d is None:
            raise Refused(RefusalKind.NOT_FOUND, f"--after: no job {dep}")
        if d.state in FINAL and d.state != SUCCEEDED:
            raise Refused(RefusalKind.CONFLICT, f"--after: job {dep} already {d.state}, so this job could never run")
    if spec.content_hash and (spec.uid, spec.content_hash) in state.by_hash:  # per user: no squatting
        dup = state.jobs[state.by_hash[(spec.uid, spec.content_hash)]]
        if dup.state in BLOCKS_DUPLICATES:
            raise Refused(RefusalKind.CONFLICT, f"duplicate of job {dup.id} ({dup.state})", existing=dup.id)
    if spec.source and (spec.uid, spec.source) in state.by_source:  # a jobs-file line, once ever
        existing = state.by_source[(spec.uid, spec.source)]
        raise Refused(RefusalKind.CONFLICT, f"already submitted as job {existing}", existing=existing)
    specs = _array_tasks(state, spec, msg.array) if msg.array else [spec]
    n = len(specs)
    if len(state.queue) + n > state.config.max_queued:
        raise Refused(RefusalKind.OVER_LIMIT, f"the queue is full ({len(state.queue)} jobs waiting, limit {state.config.max_queued})")
    mine = state.queued_by_uid.get(spec.uid, 0)
    if mine + n > state.config.max_queued_per_user:
        raise Refused(RefusalKind.OVER_LIMIT, f"you have {mine} jobs waiting, the limit per user (max_queued_per_user = "
                      f"{state.config.max_queued_per_user}); wait for some to start or cancel some")
    cause = msg.by or "submit"
    for task in specs:  # an array is one fact per task, all in this one batch
        out.fact(ev.JobSubmitted(ts=out.now, cause=cause, job=state.next_job_id, spec=task))
    _schedule(out)


def _admit_tenant(state: ClusterState, spec: ev.JobSpec) -> None:
    tenant = state.tenants.get(spec.tenant)
    if tenant is None:
        return
    count, milli = request_of(spec)
    name = spec.tenant
    if tenant.jobs is not None and tenant.jobs < 1:
        raise Refused(RefusalKind.OVER_LIMIT, f"tenant {name} may run no jobs (quota jobs = {tenant.jobs})")
    if tenant.gpus is not None and count * milli > round(tenant.gpus * FULL):
        raise Refused(RefusalKind.OVER_LIMIT, f"asks for {count * milli / FULL:g} GPUs but tenant {name}'s quota is {tenant.gpus:g} GPUs at once")
    if tenant.gpu_mem_mib is not None and count * spec.gpu_mem_mib > tenant.gpu_mem_mib:
        raise Refused(RefusalKind.OVER_LIMIT, f"asks for {count * spec.gpu_mem_mib} MiB of GPU memory but tenant "
                      f"{name}'s quota is {tenant.gpu_mem_mib} MiB at once")


def _check_tenants(tenants: dict[str, Tenant]) -> None:
    try:
        check_tenants(tenants)
    except TenantError as exc:
        raise Refused(RefusalKind.INVALID, str(exc)) from None


def _set_tenant(out: _Out, msg: m.SetTenant | m.SetTenants) -> None:
    """An operator's change to one tenant (or, replayed, to all)."""
    if isinstance(msg, m.SetTenants):
        tenants = dict(msg.tenants)
    else:
        tenants = dict(out.state.tenants)
        if msg.tenant is None:
            if msg.name not in tenants:
                raise Refused(RefusalKind.NOT_FOUND, f"no tenant {msg.name!r}")
            del tenants[msg.name]
        else:
            tenants[msg.name] = msg.tenant
    _check_tenants(tenants)
    if tenants != out.state.tenants:
        cause = msg.by or "operator"
        out.fact(ev.TenantsConfigured(ts=out.now, cause=cause, tenants=tenants, by=cause))
        _schedule(out)


def _record_forecast(out: _Out, msg: m.RecordForecast) -> None:
    job = out.state.jobs.get(msg.job)
    if job is None or job.state != QUEUED:
        return  # started (or gone) meanwhile: nothing to forecast any more
    out.fact(ev.JobForecast(ts=out.now, cause=msg.by or "forecast", job=msg.job,
                            estimated_start=msg.estimated_start, by=msg.by, p10=msg.p10, p90=msg.p90))


def _array_tasks(state: ClusterState, spec: ev.JobSpec, indices: list[int]) -> list[ev.JobSpec]:
    """One spec per index, ``{index}`` in the command replaced; the array's id is its first task's."""
    if len(indices) > MAX_ARRAY_TASKS:
        raise Refused(RefusalKind.INVALID, f"an array has at most {MAX_ARRAY_TASKS} tasks, not {len(indices)}")
    if len(set(indices)) != len(indices) or any(i < 0 for i in indices):
        raise Refused(RefusalKind.INVALID, "array indices must be distinct and >= 0")
    if spec.array_cap < 0:
        raise Refused(RefusalKind.INVALID, f"--array %K must be at least 1, not {spec.array_cap}")
    first = state.next_job_id
    return [msgspec.structs.replace(spec, command=[a.replace("{index}", str(i)) for a in spec.command],
                                    array_id=first, array_index=i,
                                    content_hash=f"{spec.content_hash}[{i}]" if spec.content_hash else "",
                                    source=f"{spec.source}[{i}]" if spec.source else "") for i in indices]


def _command(out: _Out, msg: m.Cancel | m.Hold | m.Release, command: str) -> tuple[list[Job], str]:
    """The jobs ``msg`` names, checked, with the command recorded as the fact: (jobs, who)."""
    jobs = _owned(out.state, msg.jobs, msg.uid, command)
    for job in jobs:
        if command == "cancel" and job.state in FINAL:
            raise Refused(RefusalKind.CONFLICT, f"job {job.id} already {job.state}")
        if command != "cancel" and job.state not in WAITING:
            why = "; only waiting jobs can be held" if command == "hold" else ", not held"
            raise Refused(RefusalKind.CONFLICT, f"job {job.id} is {job.state}{why}")
    by = msg.by or f"uid:{msg.uid}"
    out.fact(ev.JobsCommanded(ts=out.now, cause=by, command=command, jobs=[j.id for j in jobs], by=by))  # type: ignore[arg-type]
    return jobs, by


def _cancel(out: _Out, msg: m.Cancel) -> None:
    jobs, by = _command(out, msg, "cancel")
    for job in jobs:
        if job.state == RUNNING:
            if job.cancel_reason != "cancelled":
                _stop(out, job.id, by, "cancelled")
        elif can(job.state, ev.JobCancelled):  # a cascade above may have cancelled it already
            out.decide(ev.JobCancelled(job=job.id, by=by))
            _cascade(out, job.id)
    _schedule(out)


def _hold(out: _Out, msg: m.Hold | m.Release) -> None:
    """Hold waiting jobs, or release held ones (a held head no longer blocks a FIFO queue)."""
    hold = isinstance(msg, m.Hold)
    jobs, by = _command(out, msg, "hold" if hold else "release")
    for job in jobs:
        if hold and job.state == QUEUED:
            out.decide(ev.JobHeld(job=job.id, by=by))
        elif not hold and job.state == HELD:
            out.decide(ev.JobReleased(job=job.id, by=by))
    _schedule(out)


def _update(out: _Out, msg: m.Update) -> None:
    """Change a waiting job's request, checked as a submission of the changed spec would be."""
    state = out.state
    job = state.jobs.get(msg.job)
    if job is None:
        raise Refused(RefusalKind.NOT_FOUND, f"no job {msg.job}")
    if not msg.operator and msg.uid != job.spec.uid:
        raise Refused(RefusalKind.FORBIDDEN, f"job {job.id} belongs to {job.spec.user or 'uid ' + str(job.spec.uid)}; "
                      "only its owner, root or the daemon's user may update it")
    if job.state not in WAITING:
        raise Refused(RefusalKind.CONFLICT, f"job {job.id} is {job.state}; only a queued or held job can be updated")
    by = msg.by or f"uid:{msg.uid}"
    event = ev.JobUpdated(ts=out.now, cause=by, job=job.id, by=by, priority=msg.priority,
                          time_limit_s=msg.time_limit_s, gpus=None if msg.gpus is None else float(msg.gpus), name=msg.name)
    spec = msgspec.structs.replace(job.spec, **event.changes())
    if msg.gpus is not None:  # a shape that could never run here, or that its tenant's quota forbids
        check_spec(state, spec)
        _admit_tenant(state, spec)
    out.fact(event)
    _schedule(out)


# --- GPUs and policy ----------------------------------------------------------------


def _pause(out: _Out, msg: m.PauseGpu | m.ResumeGpu) -> None:
    """Only a change is recorded."""
    gpu = out.state.gpus.get((msg.node, msg.gpu))
    if gpu is None:
        have = ", ".join(str(g.id) for g in out.state.node_gpus.get(msg.node, ())) or "none"
        raise Refused(RefusalKind.NOT_FOUND, f"no GPU {msg.gpu} on node {msg.node!r} (GPUs here: {have})")
    pause, cause = isinstance(msg, m.PauseGpu), msg.by or "operator"
    if gpu.paused != pause:
        event = ev.GpuPaused if pause else ev.GpuResumed
        out.fact(event(ts=out.now, cause=cause, node=msg.node, gpu=msg.gpu, by=cause))
        if not pause:
            _schedule(out)


def _known_policy(policy: str) -> None:
    # (the daemon refuses the replay-only ones before they get here)
    if policy not in POLICIES:
        known = ", ".join(p for p in POLICIES if p not in REPLAY_ONLY)
        raise Refused(RefusalKind.NOT_FOUND, f"unknown policy {policy!r}; known: {known}")


def _set_policy(out: _Out, msg: m.SetPolicy) -> None:
    _known_policy(msg.policy)
    if msg.policy != out.state.policy:  # the same policy again decides nothing new
        cause = msg.by or "operator"
        out.fact(ev.PolicyChanged(ts=out.now, cause=cause, policy=msg.policy, by=cause))
        _schedule(out)


def _gpu_observed(out: _Out, msg: m.GpuObserved) -> None:
    gpu = out.state.gpus.get((msg.node, msg.gpu))
    if gpu is None:
        return
    failed = gpu.lost or bool(gpu.error)
    out.fact(ev.GpuSampled(ts=out.now, cause="nvml", node=msg.node, gpu=msg.gpu, utilization=msg.utilization,
                           memory_used_mib=msg.memory_used_mib, memory_total_mib=msg.memory_total_mib,
                           temperature_c=msg.temperature_c, power_w=msg.power_w, foreign_memory_mib=msg.foreign_memory_mib,
                           job_memory_mib=msg.job_memory_mib, foreign_processes=msg.foreign_processes))
    if failed:  # a GPU that failed reads well again: it is back
        out.decide(ev.GpuDiscovered(node=msg.node, gpu=msg.gpu, uuid=gpu.uuid, model=gpu.model,
                                    memory_total_mib=msg.memory_total_mib))
    _watch_gpu(out, out.state.gpus[(msg.node, msg.gpu)])
    _schedule(out)  # memory freed or a GPU cooled down: room may have appeared


def _watch_gpu(out: _Out, gpu: Gpu) -> None:
    """The jobs on ``gpu`` over or back within their ``--gpu-mem``, idle or busy again."""
    state = out.state
    for job, over, used, where in gpu_watch.memory_findings(state, gpu):
        if over:
            policy = state.config.gpu_mem_policy
            out.decide(ev.JobGpuMemoryExceeded(job=job.id, node=job.node, gpu=where, used_mib=used,
                                               request_mib=job.spec.gpu_mem_mib, policy=policy))
            if policy == "stop":
                _stop(out, job.id, "gpu-memory", "gpu-memory")
        else:
            out.decide(ev.JobGpuMemoryWithin(job=job.id, used_mib=used))
    for job, since in gpu_watch.idle_findings(state, gpu, out.now):
        if since >= 0:
            out.decide(ev.JobIdle(job=job.id, since=since))
        else:
            out.decide(ev.JobBusy(job=job.id, idle_s=out.now - (job.idle_since or out.now)))


def _gpu_failed(out: _Out, msg: m.GpuFailed) -> None:
    """A GPU error is recorded once per change; a GPU newly lost has its jobs requeued."""
    gpu = out.state.gpus.get((msg.node, msg.gpu))
    if gpu is not None and gpu.error == msg.error and (gpu.lost or not msg.lost):
        return
    newly_lost = gpu is not None and msg.lost and not gpu.lost
    out.fact(ev.GpuErrored(ts=out.now, cause="nvml", node=msg.node, gpu=msg.gpu, error=msg.error, lost=msg.lost))
    if newly_lost and gpu is not None:
        _requeue_jobs_on(out, gpu, "gpu-lost")
        if out.state.config.gpu_health_lost:
            _drain(out, gpu, "GPU is lost")


def _requeue_jobs_on(out: _Out, gpu: Gpu, by: str) -> None:
    """Stop the running jobs of a failed GPU as if preempted: requeued
    without spending a retry, since the fault is the GPU's, not theirs."""
    for jid in sorted(gpu.jobs):
        job = out.state.jobs[jid]
        if job.state == RUNNING and not job.cancel_reason:
            _stop(out, jid, by, "preempted")


def _gpu_health(out: _Out, msg: m.GpuHealthRead) -> None:
    """A new health reading is recorded; one over a threshold drains its GPU."""
    r = msg.reading
    gpu = out.state.gpus.get((r.node, r.gpu))
    if gpu is None or same_reading(gpu.health, r):
        return
    out.fact(msgspec.structs.replace(r, ts=out.now, cause="nvml"))
    _drain(out, gpu, drain_reason(r, out.state.config))


def _drain(out: _Out, gpu: Gpu, reason: str) -> None:
    """Take a sick GPU out of service until an operator resumes it (docs/gpu-health.md)."""
    if not reason or gpu.paused_reason:
        return
    out.decide(ev.GpuPaused(node=gpu.node, gpu=gpu.id, by="health", reason=reason))
    out.effects.append(Notify(text=f"GPU {gpu.id} on node {gpu.node} drained: {reason}; "
                                   f"`eventsched resume-gpu {gpu.id}` returns it to service"))
    if out.state.config.gpu_health_running == "requeue":
        _requeue_jobs_on(out, gpu, "gpu-health")


# --- the clock and the processes --------------------------------------------------


def _tick(out: _Out, msg: m.Tick) -> None:
    state = out.state
    out.defer(ev.TimerFired(ts=out.now, cause="timer"))
    for jid in sorted(j for j, due in state.deadlines.items() if out.now >= due):
        _stop(out, jid, "timer", "time-limit")
    for jid, since in gpu_watch.due_idle(state, out.now):
        out.decide(ev.JobIdle(job=jid, since=since))
    for due, node in _nodes_gone_with_jobs(state):  # gone too long to come back
        if out.now >= due:
            _lose_jobs_of_node(out, node)
    _schedule(out)


def _process_started(out: _Out, msg: m.ProcessStarted) -> None:
    job, cfg = out.state.jobs.get(msg.job), out.state.config
    if job is None or job.state != RUNNING or job.pid == msg.pid:
        return  # late, duplicate or re-adopted: nothing new to record
    out.fact(ev.JobStarted(ts=out.now, cause=f"pid:{msg.pid}", job=msg.job, pid=msg.pid,
                           start_time=msg.start_time, log_path=msg.log_path))
    if job.cancel_reason:
        # stopped before it had a process: signal it again now
        out.effects.append(_stop_signal(out.state, job, job.cancel_reason))
    elif cfg.aging_tiers and cfg.preemption and out.state.queue and _may_preempt(out.state):
        _preempt(out, frozenset())  # the decision that placed it could not stop it; this one may


def _exited(out: _Out, job: Job, cause: str, exit_code: int | None, signal: int | None, reason: str) -> None:
    outcome = exit_outcome(job.cancel_reason, exit_code, reason)
    if not reason and job.cancel_reason == "gpu-memory":
        reason = GPU_MEMORY_OVER
    out.fact(ev.JobExited(ts=out.now, cause=cause, job=job.id, exit_code=exit_code, signal=signal,
                          reason=reason or job.cancel_reason, outcome=outcome))


def _process_exited(out: _Out, msg: m.ProcessExited) -> None:
    state = out.state
    job = state.jobs.get(msg.job)
    if job is None or job.state != RUNNING:
        return  # an exit reported twice
    stop_reason = job.cancel_reason
    _exited(out, job, f"exit:job {job.id}", msg.exit_code, msg.signal, msg.reason)
    if job.state == FAILED:
        if stop_reason == "time-limit":
            if job.spec.on_time_limit == "requeue":
                out.decide(ev.JobRequeued(job=job.id, reason="time-limit"))
        elif stop_reason == "gpu-memory":
            pass  # it would exceed again: no retry
        elif job.retries_used < job.spec.retries:
            delay = state.config.retry_backoff_s * (2**job.retries_used)
            out.decide(ev.JobRequeued(job=job.id, reason="retry", not_before=out.now + delay))
    elif job.state == PREEMPTED:
        out.decide(ev.JobRequeued(job=job.id, reason="idle" if stop_reason == "idle-requeue" else "preempted"))
    if job.state in FINAL and job.state != SUCCEEDED:
        _cascade(out, job.id)
    _schedule(out)


def _process_lost(out: _Out, msg: m.ProcessLost) -> None:
    job = out.state.jobs.get(msg.job)
    if job is None or job.state != RUNNING:
        return
    out.fact(ev.JobLost(ts=out.now, cause="restart", job=job.id, reason=msg.reason or "lost"))
    _cascade(out, job.id)
    _schedule(out)


NOT_LAUNCHED = "not launched"  # JobExited.reason prefix of an attempt that never ran


def _never_launched(out: _Out, msg: m.NeverLaunched) -> None:
    """Placed, but never launched: a failed attempt that did not run, queued again
    (safe: it cannot have run)."""
    job = out.state.jobs.get(msg.job)
    if job is None or job.state != RUNNING or job.pid:
        return
    _exited(out, job, "restart", None, None, f"{NOT_LAUNCHED}: {msg.reason}")
    if out.state.jobs[job.id].state == FAILED:
        out.decide(ev.JobRequeued(job=job.id, reason="not-launched"))
    _schedule(out)


# --- the nodes of a cluster -------------------------------------------------------


def _node_up(out: _Out, msg: m.NodeUp) -> None:
    """A node's executor is up (joined, or its actor restarted)."""
    state = out.state
    if msg.restarted and msg.node in state.nodes and state.nodes[msg.node].state == "up":
        out.fact(ev.NodeActorRestarted(ts=out.now, cause=f"ray:{msg.node}", node=msg.node,
                                       reason="its executor actor was restarted"))
    else:
        out.fact(ev.NodeJoined(ts=out.now, cause=f"ray:{msg.node}", node=msg.node, ray_node=msg.ray_node,
                               gpu_backend=msg.gpu_backend, gpus=len(msg.gpus)))
    _discovered(out, msg.node, msg.gpus, "not found when the node joined")


def _node_down(out: _Out, msg: m.NodeDown) -> None:
    """A node left: its GPUs take nothing new at once; its jobs end ``lost`` only after
    ``node_lost_after_s``, so a node back sooner has them re-adopted, never launched twice."""
    state = out.state
    info = state.nodes.get(msg.node)
    if info is None or info.state == "down":
        return  # told twice, or a node we never had
    out.fact(ev.NodeLeft(ts=out.now, cause=f"ray:{msg.node}", node=msg.node, reason=msg.reason))
    for gpu in list(state.node_gpus.get(msg.node, ())):
        if not gpu.lost:
            out.decide(ev.GpuErrored(node=gpu.node, gpu=gpu.id, error=f"node {msg.node} left", lost=True))
    if state.config.node_lost_after_s <= 0:
        _lose_jobs_of_node(out, msg.node)
    _schedule(out)


def _lose_jobs_of_node(out: _Out, node: str) -> None:
    """The running jobs of a node gone for good end ``lost``, requeued when allowed."""
    state = out.state
    reason = state.nodes[node].reason if node in state.nodes else ""
    for jid in sorted(j for j in state.running if state.jobs[j].node == node):
        job = state.jobs[jid]
        stop_reason = job.cancel_reason
        out.decide(ev.JobLost(job=jid, reason=f"node {node} left" + (f": {reason}" if reason else "")))
        if stop_reason in ("preempted", "idle-requeue"):
            out.decide(ev.JobRequeued(job=jid, reason="preempted" if stop_reason == "preempted" else "idle"))
        elif not stop_reason and job.retries_used < job.spec.retries:
            delay = state.config.retry_backoff_s * (2**job.retries_used)
            out.decide(ev.JobRequeued(job=jid, reason="retry", not_before=out.now + delay))
        else:
            _cascade(out, jid)


def _nodes_gone_with_jobs(state: ClusterState) -> list[tuple[float, str]]:
    """(when its jobs count as lost, node) of each down node still holding running jobs."""
    down = {name: info.since for name, info in state.nodes.items() if info.state == "down"}
    if not down:
        return []
    holding = {state.jobs[j].node for j in state.running} & down.keys()
    return sorted((down[name] + state.config.node_lost_after_s, name) for name in holding)


def _cluster_link(out: _Out, msg: m.ClusterLink) -> None:
    out.fact(ev.ClusterDisconnected(ts=out.now, cause="ray", reason=msg.reason, lost=msg.lost))


def _stray_killed(out: _Out, msg: m.StrayKilled) -> None:
    """A fact only: the job's own state is the log's already."""
    out.fact(ev.StrayAttemptKilled(ts=out.now, cause=f"ray:{msg.node}", node=msg.node, job=msg.job,
                                   attempt=msg.attempt, pid=msg.pid, reason=msg.reason))


def _fenced(out: _Out, msg: m.Fenced) -> None:
    """A fact only: the node stopped those attempts itself while cut off."""
    out.fact(ev.NodeFenced(ts=out.now, cause=f"ray:{msg.node}", node=msg.node, jobs=list(msg.jobs),
                           attempts=list(msg.attempts), reason=msg.reason))


_HANDLERS: dict[type, Callable[[_Out, Any], None]] = {
    m.NodeUp: _node_up,
    m.NodeDown: _node_down,
    m.ClusterLink: _cluster_link,
    m.StrayKilled: _stray_killed,
    m.Fenced: _fenced,
    m.Started: _started,
    m.Stopping: _stopping,
    m.Submit: _submit,
    m.Cancel: _cancel,
    m.Hold: _hold,
    m.Release: _hold,
    m.Update: _update,
    m.PauseGpu: _pause,
    m.ResumeGpu: _pause,
    m.SetPolicy: _set_policy,
    m.Reserve: _reserve,
    m.CancelReservation: _cancel_reservation,
    m.SetTenant: _set_tenant,
    m.SetTenants: _set_tenant,
    m.RecordForecast: _record_forecast,
    m.Tick: _tick,
    m.ProcessStarted: _process_started,
    m.NeverLaunched: _never_launched,
    m.ProcessExited: _process_exited,
    m.ProcessLost: _process_lost,
    m.GpuObserved: _gpu_observed,
    m.GpuFailed: _gpu_failed,
    m.GpuHealthRead: _gpu_health,
}
