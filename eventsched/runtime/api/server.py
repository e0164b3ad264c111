"""The control socket: what a request means and who may make it (``dispatch``).

The user is always the socket's peer (SO_PEERCRED), never a claim in the
request. A malformed, oversized or hostile message gets an error reply and
changes nothing; a client that goes away mid-request harms nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import resource
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Callable, Coroutine

import anyio
import anyio.abc
import msgspec

from eventsched import __version__
from eventsched.core.admission import check_update
from eventsched.core.forecast import ASSUMPTIONS, Calibration, range_basis, run_forecast, shown, working_copy
from eventsched.core.limits import SubmitLimits
from eventsched.core.policies import REPLAY_ONLY
from eventsched.core.tenants_report import tenants_report
from eventsched.domain import messages as msg
from eventsched.domain.events import Event, JobSubmitted
from eventsched.domain.messages import RefusalKind, Refused
from eventsched.domain.paths import log_dir
from eventsched.domain.settings import ReservationLimits
from eventsched.wire.framing import SunPath
from eventsched.domain.states import ACTIVE, DONE_FOR_GOOD, FINAL, JobState
from eventsched.projections.cluster import ClusterState, Job
from eventsched.projections.views import gpu_json, job_json
from eventsched.runtime.api.admission import Admission, account
from eventsched.runtime.api.connection import READ_CHUNK, Connection, Context, Flusher, Peer, Reply
from eventsched.runtime.api.fair_use import OPERATOR_RESERVE, FairUse
from eventsched.runtime.api.feed import Feed
from eventsched.runtime.api.reservations import translate as reservation_request
from eventsched.runtime.api.tokens import TokenStore
from eventsched.runtime.config import ConnectionLimits, JobLimits
from eventsched.runtime.notify import Notifier
from eventsched.runtime.engine import Answer, Engine, Query
from eventsched.storage import log as eventlog
from eventsched.wire import protocol

logger = logging.getLogger("eventsched.server")

# open files kept free of connections (the log, jobs, /proc, SQL, a burst about to be
# refused); each connection may hold a second (a log segment) while it is sent history
FD_RESERVE = 256
ACCEPT_BACKLOG = 128
LISTING_REUSE_S = 0.2  # an unchanged state's listing is reused this long: shorter than anyone reads one


def connection_limit(configured: int) -> int:
    """``configured``, lowered to fit the open-file limit with room to spare."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, (soft - FD_RESERVE - OPERATOR_RESERVE) // 2))


@contextlib.contextmanager
def _answering(reply: Reply, what: str) -> Iterator[None]:
    """A refusal raised inside goes back as the reply; any other error is logged and costs one reply."""
    try:
        yield
    except Refused as refusal:
        reply(None, refusal)
    except Exception as exc:  # a bug or a disk error: not the daemon
        logger.exception("%s failed", what)
        reply(None, Refused(RefusalKind.UNAVAILABLE, f"internal error: {exc}"))


class Server:
    def __init__(
        self,
        engine: Engine,
        socket_path: Path,
        *,
        limits: SubmitLimits = SubmitLimits(),
        connections: ConnectionLimits = ConnectionLimits(),
        job_limits: JobLimits = JobLimits(),
        reservations: ReservationLimits = ReservationLimits(),
        wait_nodes: int = 0,
    ) -> None:
        self.engine = engine
        self.wait_nodes = wait_nodes  # serve --wait-nodes: `health` is not ok until that many nodes have joined
        self._nodes_joined = not wait_nodes  # once they have, a node lost later is `nodes`' to tell
        self.reservation_limits = reservations
        self.socket_path = socket_path
        self.daemon_uid = os.geteuid()
        self.operators = frozenset({0, self.daemon_uid})
        self.admission = Admission(limits, job_limits, self.daemon_uid)
        self.connection_limits = connections
        self.fair_use = FairUse(connections, self.operators, connections.max_total)  # max_total: lowered in serve()
        self.flusher = Flusher()
        self._tokens_store: TokenStore | None = None
        self.notifier = Notifier(engine.state_dir, lambda job: self.engine.state.jobs.get(job) if self.engine.state else None)
        self._sql_runner: Any = None
        self.calibration = Calibration()  # past forecasts' errors: the ranges forecasts give
        self.started = time.monotonic()  # status's uptime_s
        # the last whole listing: ((the state's id, its seq, include_finished), when, the jobs)
        self._last_listing: tuple[tuple[int, int, bool], float, list[dict]] | None = None
        # requests answered by a task of their own, called with (request, peer, reply, connection or None)
        self._tasks: dict[type, Callable[..., Coroutine[Any, Any, None]]] = {
            protocol.RunSql: self._run_sql, protocol.ExplainJob: self._explain,
            protocol.ForecastAlternatives: self._alternatives, protocol.CancelJobs: self._cancel,
            **dict.fromkeys((protocol.CreateToken, protocol.ListTokens, protocol.RevokeToken), self._tokens),
            **dict.fromkeys((protocol.SetNotify, protocol.ListNotify), self._notify),
        }

    def _listing(self, state: ClusterState, include_finished: bool) -> list[dict]:
        """Every job, as ``queue`` lists them; the same listing again within
        LISTING_REUSE_S of an unchanged state, so pollers cost one walk a batch."""
        now = self.engine.clock()
        key = (id(state), state.last_seq, include_finished)
        last = self._last_listing
        if last is not None and last[0] == key and 0 <= now - last[1] < LISTING_REUSE_S:
            return last[2]
        jobs = list_jobs(state, include_finished, now, calibration=self.calibration)
        self._last_listing = (key, now, jobs)
        return jobs

    def _ping(self, state: ClusterState) -> dict[str, Any]:
        """``health``'s answer; on a cluster, nodes up and not ok until ``wait_nodes`` joined."""
        answer: dict[str, Any] = {"ok": True, "pid": os.getpid(), "seq": state.last_seq,
                                  "state_dir": str(self.engine.state_dir)}
        if not state.cluster:
            return answer
        up = answer["nodes_up"] = sum(1 for info in state.nodes.values() if info.state == "up")
        if self.wait_nodes:
            answer["nodes_wanted"] = self.wait_nodes
        self._nodes_joined = self._nodes_joined or up >= self.wait_nodes
        if not self._nodes_joined:
            answer.update(ok=False, waiting=f"waiting for nodes: {up} of {self.wait_nodes} joined")
        return answer

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists() or self.socket_path.is_symlink():
            self.socket_path.unlink()  # stale: serve() found no daemon answering on it
        loop = asyncio.get_running_loop()
        self.fair_use.max_total = connection_limit(self.connection_limits.max_total)
        logger.info(
            "connections: at most %d per user, %d in all (configured %d; open-file limit %d)",
            self.connection_limits.max_per_user, self.fair_use.max_total, self.connection_limits.max_total,
            resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        )
        feed = Feed(self.engine.state_dir, self.operators, lambda: self.engine.committed_seq)
        self.engine.subscribe(feed.fan_out)
        self.engine.subscribe(self.notifier.fan_out)
        self.notifier.start()
        self.engine.on_answered = self.flusher.flush_all
        async with anyio.create_task_group() as tg:
            self._tg = tg
            ctx = Context(
                fair_use=self.fair_use, feed=feed, flusher=self.flusher, dispatch=self.dispatch,
                start_soon=tg.start_soon, read_buffer=memoryview(bytearray(READ_CHUNK)),
            )
            with SunPath(str(self.socket_path)) as address:
                server = await loop.create_unix_server(lambda: Connection(ctx), address, backlog=ACCEPT_BACKLOG)
            os.chmod(self.socket_path, 0o666)  # anyone may connect; what they may do is decided per request
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                server.close()
                self.engine.unsubscribe(feed.fan_out)
                self.engine.unsubscribe(self.notifier.fan_out)
                self.notifier.stop()
                self.engine.on_answered = None
                self.socket_path.unlink(missing_ok=True)

    def dispatch(self, request: protocol.Request, peer: Peer, reply: Reply, conn: Connection | None = None) -> None:
        """Hand a request to the engine (slow ones, or ones that save a file, to
        a task of their own); ``reply`` is called once with its outcome."""
        task = None if type(request) is protocol.SubmitJob else self._tasks.get(type(request))
        if task is not None:
            self._tg.start_soon(task, request, peer, reply, conn)
            return
        try:
            item, answer = self._translate(request, peer)
        except Refused as refusal:
            reply(None, refusal)
            return
        if conn is not None and isinstance(item, Query):
            item = Query(conn.guard(item.read))
        self.engine.submit_nowait(item, answer, reply)

    def _translate(self, request: protocol.Request, peer: Peer) -> tuple[msg.Message | Query, Answer | None]:
        config = self.engine.config
        if isinstance(request, protocol.SubmitJob):
            spec = self.admission.as_peer(request.spec, peer)
            # normalised: the request came through msgspec's decoder (socket or HTTP API)
            if request.array:
                return msg.Submit(spec=spec, by=peer.by, array=list(request.array), normalised=True), _submitted_array
            return msg.Submit(spec=spec, by=peer.by, normalised=True), _submitted
        if isinstance(request, protocol.ListJobs):
            include_finished = request.all
            if request.limit > 0:  # a page, so a long listing never holds the loop for long
                after, limit = request.after, min(request.limit, MAX_JOBS_PAGE)
                return Query(lambda state: list_jobs_page(state, include_finished, self.engine.clock(), after, limit,
                                                             self.calibration)), None
            return Query(lambda state: self._listing(state, include_finished)), None
        if isinstance(request, protocol.GetStatus):
            executor, now = self.engine.executor, self.engine.clock()
            host = {"containment": executor.containment, "memory_limit": executor.memory_limit, "version": __version__}
            ages = executor.lease_ages()  # the cluster executor's, not the log's
            return Query(lambda state: {**status(state, now, ages), **host,
                                        "uptime_s": round(time.monotonic() - self.started, 1)}), None
        if isinstance(request, protocol.Ping):
            return Query(self._ping), None
        if isinstance(request, (protocol.HoldJobs, protocol.ReleaseJobs)):  # CancelJobs: _cancel
            command = msg.Hold if isinstance(request, protocol.HoldJobs) else msg.Release
            ids = list(request.jobs)
            if not ids:  # else an empty, logged no-op any user could repeat forever
                raise Refused(RefusalKind.INVALID, "no job given")
            return command(jobs=ids, uid=peer.uid, by=peer.by), _jobs_json(ids)
        if isinstance(request, protocol.UpdateJob):
            r, operator = request, self.admission.operator(peer.uid)
            check_update(r.priority, r.time_limit_s, r.gpus, r.name, self.admission.limits, operator=operator)
            return msg.Update(job=r.job, uid=peer.uid, by=peer.by, operator=operator, priority=r.priority,
                              time_limit_s=r.time_limit_s, gpus=r.gpus, name=r.name), (
                lambda state, _events: job_json(state.jobs[r.job]))
        if isinstance(request, (protocol.PauseGpu, protocol.ResumeGpu)):
            self._require_operator(peer, "pause or resume a GPU")
            node, gpu = request.node or config.node, request.gpu
            gpu_cmd = msg.PauseGpu if isinstance(request, protocol.PauseGpu) else msg.ResumeGpu
            return gpu_cmd(node=node, gpu=gpu, by=peer.by), lambda state, _events: gpu_json(state.gpu(node, gpu))
        if isinstance(request, protocol.SetPolicy):
            self._require_operator(peer, "change the policy")
            if request.policy in REPLAY_ONLY:
                raise Refused(RefusalKind.INVALID, f"{request.policy} is a reference for replays only: {REPLAY_ONLY[request.policy]}")
            return msg.SetPolicy(policy=request.policy, by=peer.by), lambda state, _events: {"policy": state.policy}
        if isinstance(request, protocol.ListTenants):
            return Query(lambda state: tenants_report(state, self.engine.clock())), None
        if isinstance(request, protocol.SetTenant):
            self._require_operator(peer, "change the tenants")
            name = request.name
            return msg.SetTenant(name=name, tenant=request.tenant, by=peer.by), (
                lambda state, _events: [t for t in tenants_report(state, self.engine.clock()) if t["tenant"] == name]
            )
        if isinstance(request, protocol.JobLogPath):
            job = request.job
            return Query(lambda state: self._log_path(state, job, peer)), None
        if isinstance(request, (protocol.CreateReservation, protocol.ListReservations, protocol.CancelReservation)):
            return reservation_request(request, peer, self.admission.operator(peer.uid), self.reservation_limits,
                                       self.engine.clock)
        raise Refused(RefusalKind.INVALID, f"unsupported request {type(request).__name__}")

    def _require_operator(self, peer: Peer, what: str) -> None:
        if not self.admission.operator(peer.uid):
            raise Refused(RefusalKind.FORBIDDEN, f"only root or the daemon's user may {what}")

    def _log_path(self, state: ClusterState, job_id: int, peer: Peer) -> dict:
        job = state.jobs.get(job_id)
        if job is None:
            raise Refused(RefusalKind.NOT_FOUND, f"no job {job_id}")
        if peer.uid not in (0, job.spec.uid, self.daemon_uid):
            raise Refused(RefusalKind.FORBIDDEN, f"job {job_id} belongs to {job.spec.user}")
        return {"path": str(self.engine.executor.log_path(job_id)), "state": job.state,
                "exit_code": job.exit_code, "signal": job.signal}  # `submit --interactive` exits with them

    def _history(self, from_seq: int) -> Iterator[list[Event]]:
        return eventlog.read_batches(log_dir(self.engine.state_dir), from_seq)

    async def _explain(self, request: protocol.ExplainJob, _peer: Peer, reply: Reply, _conn: Any) -> None:
        """The job's reason now and its story (read in a thread). Metadata only:
        anyone who may see the queue may ask."""
        from eventsched.core.explain import waiting_reason
        from eventsched.projections.story import job_story

        job_id = request.job

        def now_view(state: ClusterState) -> dict[str, Any]:
            job = state.jobs.get(job_id)
            if job is None:
                raise Refused(RefusalKind.NOT_FOUND, f"no job {job_id}")
            reason = waiting_reason(state, job_id, self.engine.clock())
            # a queued job's forecast runs on a copy, in a thread
            copy = working_copy(state) if job.state == JobState.QUEUED else None
            # an ended job's story ends with it: not the month of log since (a lost job may come back)
            until = job.ended_at if job.state in DONE_FOR_GOOD else None
            return {"job": job_json(job, reason), "reason": msgspec.to_builtins(reason), "from_seq": job.submitted_seq,
                    "until_ts": until, "copy": copy}

        def forecast(copy: ClusterState) -> dict[str, Any]:
            now = self.engine.clock()
            self.calibration.catch_up(self._history, copy.last_seq)
            f = run_forecast(copy, now, {job_id}, calibration=self.calibration)
            assumptions = ASSUMPTIONS
            if f.blind:
                assumptions += " (no job has finished here yet, so each is assumed to take an hour)"
            return {**shown(f, job_id, now), "made_at": now, "assumptions": assumptions + range_basis(f)}

        def story(from_seq: int, until_ts: float | None) -> list[dict[str, Any]]:
            events: Iterable[Event] = (e for batch in self._history(max(1, from_seq)) for e in batch)
            if until_ts is not None:  # the log's times never go back
                events = itertools.takewhile(lambda e: e.ts <= until_ts, events)
            return [msgspec.to_builtins(line) for line in job_story(events, job_id)]

        with _answering(reply, "explain"):
            view = await self.engine.call(Query(now_view))
            view["story"] = await anyio.to_thread.run_sync(story, view.pop("from_seq"), view.pop("until_ts"))
            copy = view.pop("copy")
            if copy is not None:
                f = view["forecast"] = await anyio.to_thread.run_sync(forecast, copy)
                if f["estimated_start"] is not None:  # what was shown is recorded, so its error can be measured
                    record = msg.RecordForecast(job=job_id, estimated_start=f["estimated_start"], by="explain",
                                                p10=f["estimated_start_p10"], p90=f["estimated_start_p90"])
                    self.engine.submit_nowait(record, None, lambda *_: None)
            reply(view, None)

    async def _alternatives(self, request: protocol.ForecastAlternatives, _peer: Peer, reply: Reply, _conn: Any) -> None:
        """A queued job's forecast under its own request and each alternative, on a copy, in a thread."""
        from eventsched.core.alternatives import forecast_alternatives

        def copy_of(state: ClusterState) -> ClusterState:
            job = state.jobs.get(request.job)
            if job is None:
                raise Refused(RefusalKind.NOT_FOUND, f"no job {request.job}")
            if job.state != JobState.QUEUED:
                raise Refused(RefusalKind.CONFLICT, f"job {request.job} is {job.state}; only a queued job has a forecast")
            return working_copy(state)

        def forecasts(copy: ClusterState) -> dict[str, Any]:
            now = self.engine.clock()
            self.calibration.catch_up(self._history, copy.last_seq)
            rows = forecast_alternatives(copy, now, request.job, [(a.gpus, a.gpu_mem_mib) for a in request.alternatives],
                                         calibration=self.calibration)
            return {"job": request.job, "made_at": now, "alternatives": rows, "assumptions": ASSUMPTIONS}

        with _answering(reply, "forecast"):
            copy = await self.engine.call(Query(copy_of))
            reply(await anyio.to_thread.run_sync(forecasts, copy), None)

    async def _cancel(self, request: protocol.CancelJobs, peer: Peer, reply: Reply, _conn: Any) -> None:
        """A plan, then one ``Cancel``; a job that ends between the two makes
        the core refuse the ``Cancel`` whole, so the plan is made again."""
        uid = peer.uid
        with _answering(reply, "cancel"):
            for attempt in range(CANCEL_TRIES):
                ids, refused = await self.engine.call(
                    Query(lambda state: cancel_plan(state, request.jobs, request.array_tasks, uid, arrays=request.arrays))
                )
                if not ids:
                    reply({"jobs": [], "refused": refused}, None)
                    return
                try:
                    jobs = await self.engine.call(msg.Cancel(jobs=ids, uid=uid, by=peer.by), _jobs_json(ids))
                except Refused:
                    if attempt + 1 < CANCEL_TRIES:
                        continue  # something ended meanwhile: plan again
                    raise
                reply({"jobs": jobs, "refused": refused}, None)
                return

    def token_store(self) -> TokenStore:
        if self._tokens_store is None:
            self._tokens_store = TokenStore(self.engine.state_dir)
        return self._tokens_store

    async def _tokens(self, request: protocol.Request, peer: Peer, reply: Reply, _conn: Any) -> None:
        """``eventsched token create|list|revoke``, as the peer (an operator: anyone's tokens)."""
        operator = peer.uid in self.operators
        with _answering(reply, "token request"):
            store = self.token_store()  # on the loop, as the HTTP API's lookups: one store
            if isinstance(request, protocol.CreateToken):
                uid = request.for_uid if request.for_uid >= 0 else peer.uid
                if uid != peer.uid and peer.uid != 0:
                    raise Refused(RefusalKind.FORBIDDEN, "only root may create a token for another user")
                record, secret = await anyio.to_thread.run_sync(store.create, uid, request.name)
                reply({**record.public(account(record.uid)[0]), "token": secret}, None)
            elif isinstance(request, protocol.ListTokens):
                reply([r.public(account(r.uid)[0]) for r in store.visible(peer.uid, operator)], None)
            elif isinstance(request, protocol.RevokeToken):
                record = await anyio.to_thread.run_sync(store.revoke, request.token, peer.uid, operator)
                reply(record.public(account(record.uid)[0]), None)

    async def _notify(self, request: protocol.SetNotify | protocol.ListNotify, peer: Peer, reply: Reply, _conn: Any) -> None:
        """``eventsched notify set|list``: the peer's own hook (an operator lists everyone's)."""
        with _answering(reply, "notify request"):
            if isinstance(request, protocol.ListNotify):
                reply(self.notifier.listing(peer.uid, peer.uid in self.operators), None)
            else:
                user = account(peer.uid)[0]
                reply(await anyio.to_thread.run_sync(self.notifier.set, request, peer.uid, peer.gid, user), None)

    async def _run_sql(self, request: protocol.RunSql, peer: Peer, reply: Reply, conn: Connection | None) -> None:
        """Answer in a process that runs the query as ``peer``, killed when its client goes away."""
        from eventsched.projections.sql_values import EXIT_BAD_QUERY, SqlError
        from eventsched.runtime.api.sql_sandbox import SqlRunner

        if self._sql_runner is None:
            self._sql_runner = SqlRunner(self.engine.state_dir)
        gone = conn.gone if conn is not None else (lambda: False)
        with _answering(reply, "sql request"):
            try:
                result = await self._sql_runner.answer(request.query, peer.uid, peer.gid, list(peer.groups), gone)
            except SqlError as exc:  # the user's SQL, or the history could not be read
                raise Refused(RefusalKind.INVALID if exc.code == EXIT_BAD_QUERY else RefusalKind.UNAVAILABLE,
                              str(exc)) from None
            if result is not None:
                reply(result, None)


CANCEL_TRIES = 5


def cancel_plan(
    state: ClusterState, ids: list[int], array_tasks: list[tuple[int, int]], uid: int, *, arrays: bool = False
) -> tuple[list[int], list[dict[str, Any]]]:
    """(the ids ``uid`` may cancel, [{"job", "reason", "kind"}] for the rest). With
    ``arrays`` an array's id stands for its unfinished tasks; ``(array, index)`` names one."""
    wanted: dict[int, None] = {}
    refused: list[dict[str, Any]] = []
    by_array: dict[int, list[Job]] | None = None

    def tasks_of(array: int) -> list[Job]:
        nonlocal by_array
        if by_array is None:  # one walk of the jobs, only when an array is named
            by_array = {}
            for job in state.jobs.values():
                if job.spec.array_index >= 0:
                    by_array.setdefault(job.spec.array_id, []).append(job)
        return by_array.get(array, [])

    def refuse(job: int | str, kind: RefusalKind, reason: str) -> None:
        refused.append({"job": job, "reason": reason, "kind": kind})

    def theirs(job: Job) -> bool:
        return uid in (0, job.spec.uid)

    def consider(label: int | str, job: Job) -> None:
        if not theirs(job):
            refuse(label, RefusalKind.FORBIDDEN, f"belongs to {job.spec.user or 'uid ' + str(job.spec.uid)}")
        elif job.state in FINAL:
            refuse(label, RefusalKind.CONFLICT, f"already {job.state}")
        else:
            wanted[job.id] = None

    for jid in dict.fromkeys(ids):
        job = state.jobs.get(jid)
        if job is None:
            refuse(jid, RefusalKind.NOT_FOUND, "no such job")
        elif arrays and job.spec.array_index >= 0 and job.spec.array_id == jid and theirs(job):  # all its tasks
            tasks = tasks_of(jid)
            live = [t.id for t in tasks if t.state not in FINAL]
            if not live:
                refuse(jid, RefusalKind.CONFLICT, f"array already finished (all {len(tasks)} tasks)")
            wanted.update(dict.fromkeys(live))
        else:
            consider(jid, job)
    for array, index in dict.fromkeys(tuple(pair) for pair in array_tasks):
        label = f"{array}_{index}"
        task = next((t for t in tasks_of(array) if t.spec.array_index == index), None)
        if task is None:
            if tasks_of(array):
                refuse(label, RefusalKind.NOT_FOUND, f"array {array} has no task {index}")
            elif array in state.jobs:
                refuse(label, RefusalKind.INVALID, f"job {array} is not an array")
            else:
                refuse(label, RefusalKind.NOT_FOUND, f"no array {array}")
        else:
            consider(label, task)
    return list(wanted), refused


def _jobs_json(ids: list[int]) -> Answer:
    return lambda state, _events: [job_json(state.jobs[j]) for j in ids]


def _submitted(_state: ClusterState, events: list[Event]) -> dict:
    return {"id": events[0].job, "seq": events[-1].seq}  # type: ignore[attr-defined]


def _submitted_array(_state: ClusterState, events: list[Event]) -> dict:
    ids = [e.job for e in events if isinstance(e, JobSubmitted)]
    return {"id": ids[0], "ids": ids, "seq": events[-1].seq}


# a listing forecasts start times while at most this many jobs wait (a forward run of the core each)
FORECAST_QUEUE_LIMIT = 200
MAX_JOBS_PAGE = 1000  # jobs per page of a paged listing, at most


def list_jobs_page(state: ClusterState, include_finished: bool, now: float, after: int, limit: int,
                   calibration: Calibration | None = None) -> dict:
    """At most ``limit`` jobs with ids above ``after``, and the id to go on from
    (None: no more); at most ``16 x limit`` ids looked at, so a page stays bounded.
    A job may change between pages (as with ``ps``)."""
    jobs: list[Job] = []
    jid, end, budget = after + 1, state.next_job_id, 16 * limit
    while jid < end and len(jobs) < limit and budget > 0:
        job = state.jobs.get(jid)
        if job is not None and (include_finished or job.state in ACTIVE):
            jobs.append(job)
        jid += 1
        budget -= 1
    return {"jobs": list_jobs(state, include_finished, now, jobs, calibration), "next": jid if jid < end else None}


def list_jobs(state: ClusterState, include_finished: bool, now: float, page: list[Job] | None = None,
              calibration: Calibration | None = None) -> list[dict]:
    from eventsched.core.explain import waiting_reasons

    if page is not None:  # one page (list_jobs_page): reasons and array counts for its jobs only
        jobs, reasons = page, waiting_reasons(state, now, [job.id for job in page])
    else:
        jobs = [job for job in state.jobs.values() if include_finished or job.state in ACTIVE]
        reasons = waiting_reasons(state, now)  # one walk of the queue for every waiting job
    forecast = None
    queued = {job.id for job in jobs if job.state == JobState.QUEUED}
    if queued and len(state.queue) <= FORECAST_QUEUE_LIMIT:
        # only for the queued jobs listed: the run stops once they have started
        forecast = run_forecast(working_copy(state), now, queued, calibration=calibration)
    out = [job_json(job, reasons.get(job.id)) for job in jobs]
    for view in out:  # null when not queued, or the queue is too long to forecast per listing
        f = shown(forecast, view["id"], now) if forecast is not None and view["state"] == "queued" else {}
        view.update({k: f.get(k) for k in ("estimated_start", "estimated_start_p10", "estimated_start_p90")})
        if view["array_id"] is not None:
            view["array_done"] = state.array_ended[view["array_id"]]
    return out


def status(state: ClusterState, now: float | None = None, lease_ages: dict[str, float] | None = None) -> dict:
    from eventsched.projections.cluster import nodes_view

    gpus = [gpu_json(gpu) for gpu in state.all_gpus()]
    # "degraded" while a GPU is lost or reports an error: jobs wait or run on fewer GPUs
    problems = [f"GPU {g['id']}{'' if g['node'] == state.node else ' on ' + g['node']}: {'lost' if g['lost'] else g['error']}"
                for g in gpus if g["lost"] or g["error"]]
    return {
        "nodes": nodes_view(state, now, lease_ages),
        "gpus": gpus,
        "jobs": [job_json(job) for job in state.jobs.values() if job.state in ACTIVE],
        "policy": state.policy,
        "seq": state.last_seq,
        "health": {"status": "degraded" if problems else "ok", "problems": problems},
    }
