"""The control socket: authenticates peers, decodes requests, asks the engine.

The user is always the socket's peer (SO_PEERCRED), never a claim in the
request. A malformed, oversized or hostile message gets an error reply and
changes nothing; a client that goes away mid-request harms nothing.

Each client is a ``connection.Connection``; this module decides what a
request means and who may make it.

Fair use: connections are counted per uid and in all (a refused one gets one
error reply and is closed); a connection is not read while it has many
replies outstanding or unread replies above a high-water mark; a client that
leaves more than its share unread is cut off rather than buffered without
bound. Subscribers see every job's metadata but only their own jobs'
environment (``visibility``); the history part of a subscription is read in
chunks, each sent once the previous one drained.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import os
import pwd
import resource
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import anyio
import anyio.abc
import msgspec

from eventsched.core.admission import check_submission
from eventsched.core.forecast import ASSUMPTIONS, describe, run_forecast, working_copy
from eventsched.core.limits import SubmitLimits
from eventsched.core.policies import REPLAY_ONLY
from eventsched.core.tenants_report import tenants_report
from eventsched.domain import messages as msg
from eventsched.domain.events import Event, JobSubmitted, encode_many
from eventsched.domain.paths import log_dir
from eventsched.domain.states import ACTIVE, FINAL, JobState
from eventsched.domain.visibility import BatchView, redact_events
from eventsched.projections.cluster import ClusterState, Job
from eventsched.projections.views import gpu_json, job_json
from eventsched.runtime.launch import script_paths
from eventsched.runtime.launch import sessions
from eventsched.runtime.config import ConnectionLimits, JobLimits
from eventsched.runtime.api.connection import (
    HISTORY_CHUNK_BYTES,
    HISTORY_PER_USER,
    READ_CHUNK,
    Connection,
    Peer,
)
from eventsched.runtime.engine import Answer, Engine, Query
from eventsched.runtime.api.tokens import TokenStore
from eventsched.storage import log as eventlog
from eventsched.wire import protocol

logger = logging.getLogger("eventsched.server")

# open files kept free of connections: the log, snapshots, jobs' logs and
# supervisors, the GPU sampler's /proc, SQL, and a burst of accepted
# connections about to be refused (asyncio accepts up to the backlog in one
# go); and each connection may hold a second file (a log segment) while it is
# sent history
FD_RESERVE = 256
ACCEPT_BACKLOG = 128
# root and the daemon's user may connect this far beyond max_total, so an
# operator can still look when users hold every slot
OPERATOR_RESERVE = 32


@functools.lru_cache(maxsize=1024)
def account(uid: int) -> tuple[str, str]:
    """User name and home of ``uid`` (cached: NSS lookups are slow)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return str(uid), "/"
    return entry.pw_name, entry.pw_dir


def connection_limit(configured: int) -> int:
    """``configured``, lowered to fit the open-file limit with room to spare."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, (soft - FD_RESERVE - OPERATOR_RESERVE) // 2))


class Server:
    def __init__(
        self,
        engine: Engine,
        socket_path: Path,
        *,
        limits: SubmitLimits = SubmitLimits(),
        connections: ConnectionLimits = ConnectionLimits(),
        job_limits: JobLimits = JobLimits(),
    ) -> None:
        self.engine = engine
        self.socket_path = socket_path
        self.limits = limits
        self.job_limits = job_limits  # issue 11: allowed_script_paths, max_host_mem_mib
        self.daemon_uid = os.geteuid()
        self.operators = frozenset({0, self.daemon_uid})
        self.connection_limits = connections
        self.max_total = connections.max_total  # lowered in serve() to fit the open-file limit
        self.open_total = 0
        self.open_by_uid: dict[int, set[Connection]] = {}
        self.subscribers: set[Connection] = set()
        self._refusals: collections.Counter[int] = collections.Counter()
        # requests in the engine per uid, and the connections waiting for their
        # user's share to free up (in order: woken round-robin); issue 14
        self.in_flight_by_uid: collections.Counter[int] = collections.Counter()
        self._waiting_share: dict[int, dict[Connection, None]] = {}
        self._history_slots: dict[int, asyncio.Semaphore] = {}
        self.read_buffer = memoryview(bytearray(READ_CHUNK))  # every connection reads into it (connection.py)
        self._unflushed: list[Connection] = []  # connections with replies ready (flush_soon)
        self._flush_handle: asyncio.Handle | None = None

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists() or self.socket_path.is_symlink():
            self.socket_path.unlink()  # stale: the log's lock already proved no daemon runs here
        loop = asyncio.get_running_loop()
        self.max_total = connection_limit(self.connection_limits.max_total)
        logger.info(
            "connections: at most %d per user, %d in all (configured %d; open-file limit %d)",
            self.connection_limits.max_per_user, self.max_total, self.connection_limits.max_total,
            resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        )
        self._history_limiter = anyio.CapacityLimiter(4)  # worker threads reading history
        self.engine.subscribe(self._fan_out)
        self.engine.on_answered = self.flush_replies
        async with anyio.create_task_group() as tg:
            self._tg = tg
            server = await loop.create_unix_server(lambda: Connection(self), str(self.socket_path), backlog=ACCEPT_BACKLOG)
            # anyone may connect; what they may do is decided per request
            # from their credentials
            os.chmod(self.socket_path, 0o666)
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                server.close()
                self.engine.unsubscribe(self._fan_out)
                self.engine.on_answered = None
                try:
                    self.socket_path.unlink()
                except FileNotFoundError:
                    pass

    # --- requests -> engine items ---------------------------------------

    def dispatch(
        self,
        request: protocol.Request,
        peer: Peer,
        reply: Callable[[Any, str | None], None],
        conn: Connection | None = None,
    ) -> None:
        """Hand a request to the engine; ``reply`` is called once with its outcome."""
        if type(request) is protocol.SubmitJob:  # most requests, by far: straight to the engine
            try:
                item, answer = self._translate(request, peer)
            except msg.Refused as refusal:
                reply(None, refusal.reason)
                return
            self.engine.submit_nowait(item, answer, reply)
            return
        if isinstance(request, protocol.RunSql):
            # read-only and possibly slow: a sandboxed process as the peer, not the engine
            self._tg.start_soon(self._run_sql, request.query, reply, peer)
            return
        if isinstance(request, protocol.ExplainJob):
            self._tg.start_soon(self._explain, request.job, reply)
            return
        if isinstance(request, protocol.CancelJobs):
            self._tg.start_soon(self._cancel, request, peer, reply)
            return
        if isinstance(request, (protocol.CreateToken, protocol.ListTokens, protocol.RevokeToken)):
            self._tg.start_soon(self._tokens, request, peer, reply)  # issue 12: saved in a thread
            return
        try:
            item, answer = self._translate(request, peer)
        except msg.Refused as refusal:
            reply(None, refusal.reason)
            return
        if conn is not None and isinstance(item, Query):
            item = Query(conn.guard(item.read))
        self.engine.submit_nowait(item, answer, reply)

    def _translate(self, request: protocol.Request, peer: Peer) -> tuple[msg.Message | Query, Answer | None]:
        config = self.engine.config
        if isinstance(request, protocol.SubmitJob):
            spec = self._as_peer(request.spec, peer)
            # normalised: the request came through msgspec's decoder (socket or HTTP API)
            if request.array:
                return msg.Submit(spec=spec, by=peer.by, array=list(request.array), normalised=True), _submitted_array
            return msg.Submit(spec=spec, by=peer.by, normalised=True), _submitted
        if isinstance(request, protocol.ListJobs):
            include_finished = request.all
            if request.limit > 0:  # issue 16: a page, so a long listing never holds the loop for long
                after, limit = request.after, min(request.limit, MAX_JOBS_PAGE)
                return Query(lambda state: list_jobs_page(state, include_finished, self.engine.clock(), after, limit)), None
            return Query(lambda state: list_jobs(state, include_finished, self.engine.clock())), None
        if isinstance(request, protocol.GetStatus):
            containment = self.engine.executor.containment  # issue 18: "cgroup2:DIR" or "process-group"
            memory_limit = self.engine.executor.memory_limit  # issue 11: "cgroup2", "cgroup1" or "rlimit-as"
            return Query(lambda state: {**status(state), "containment": containment, "memory_limit": memory_limit}), None
        if isinstance(request, protocol.Ping):
            return Query(lambda state: {"ok": True, "pid": os.getpid(), "seq": state.last_seq}), None
        if isinstance(request, (protocol.HoldJobs, protocol.ReleaseJobs)):  # CancelJobs: _cancel
            kind = {protocol.HoldJobs: msg.Hold, protocol.ReleaseJobs: msg.Release}
            ids = list(request.jobs)
            if not ids:  # else an empty, logged no-op any user could repeat forever (issue 14)
                raise msg.Refused("no job given")
            return kind[type(request)](jobs=ids, uid=peer.uid, by=peer.by), (
                lambda state, _events: [job_json(state.jobs[j]) for j in ids]
            )
        if isinstance(request, (protocol.PauseGpu, protocol.ResumeGpu)):
            self._require_operator(peer, "pause or resume a GPU")
            node, gpu = request.node or config.node, request.gpu
            gpu_cmd = msg.PauseGpu if isinstance(request, protocol.PauseGpu) else msg.ResumeGpu
            return gpu_cmd(node=node, gpu=gpu, by=peer.by), lambda state, _events: gpu_json(state.gpu(node, gpu))
        if isinstance(request, protocol.SetPolicy):
            self._require_operator(peer, "change the policy")
            if request.policy in REPLAY_ONLY:
                raise msg.Refused(f"{request.policy} is a reference for replays only: {REPLAY_ONLY[request.policy]}")
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
        raise msg.Refused(f"unsupported request {type(request).__name__}")

    def _require_operator(self, peer: Peer, what: str) -> None:
        if peer.uid not in (0, self.daemon_uid):
            raise msg.Refused(f"only root or the daemon's user may {what}")

    def _as_peer(self, spec: msg.JobSpec, peer: Peer) -> msg.JobSpec:
        """Replace every identity field with what the kernel says of the peer."""
        if self.daemon_uid != 0 and peer.uid not in (self.daemon_uid, 0):
            raise msg.Refused(
                f"this daemon runs as uid {self.daemon_uid} and cannot run jobs as uid {peer.uid}; "
                "ask its owner, or run the daemon as root to serve several users"
            )
        check_submission(spec, self.limits, operator=peer.uid in (0, self.daemon_uid))
        self._check_host_limits(spec, peer)
        user, home = account(peer.uid)
        return msgspec.structs.replace(
            spec, user=user, uid=peer.uid, gid=peer.gid, groups=list(peer.groups), home=home
        )

    def _check_host_limits(self, spec: msg.JobSpec, peer: Peer) -> None:
        """Issue 11: --session needs its program, --host-mem its ceiling,
        the program its place (``allowed_script_paths``)."""
        refusal = sessions.refusal(spec.session, sessions.default_path(spec.env)) if spec.session else None
        top = self.job_limits.max_host_mem_mib
        if refusal is None and spec.host_mem_mib < 0:
            refusal = f"--host-mem must be a positive number of MiB, not {spec.host_mem_mib}"
        if refusal is None and top > 0 and spec.host_mem_mib > top:
            refusal = f"--host-mem {spec.host_mem_mib} MiB is above this machine's limit of {top} MiB per job"
        if refusal is None:
            operator = peer.uid in (0, self.daemon_uid)
            refusal = script_paths.check(spec, self.job_limits.allowed_script_paths, operator=operator)
        if refusal is not None:
            raise msg.Refused(refusal)

    def _log_path(self, state: ClusterState, job_id: int, peer: Peer) -> dict:
        job = state.jobs.get(job_id)
        if job is None:
            raise msg.Refused(f"no job {job_id}")
        if peer.uid not in (0, job.spec.uid, self.daemon_uid):
            raise msg.Refused(f"job {job_id} belongs to {job.spec.user}")
        return {"path": str(self.engine.executor.log_path(job_id)), "state": job.state,
                "exit_code": job.exit_code, "signal": job.signal}  # `submit --interactive` exits with them

    async def _explain(self, job_id: int, reply: Callable[[Any, str | None], None]) -> None:
        """The job's reason now (from the projection) and its story (the log
        from its submission on, read in a thread). Metadata only: anyone who
        may see the queue may ask."""
        from eventsched.core.explain import waiting_reason
        from eventsched.projections.story import job_story

        def now_view(state: ClusterState) -> dict[str, Any]:
            job = state.jobs.get(job_id)
            if job is None:
                raise msg.Refused(f"no job {job_id}")
            reason = waiting_reason(state, job_id, self.engine.clock())
            # a queued job's forecast runs on a copy, in a thread (issue 17)
            copy = working_copy(state) if job.state == QUEUED_STATE else None
            # an ended job's story ends with it: a month-old job reads its own
            # days of log, not the month since (a lost job may come back)
            until = job.ended_at if job.state in DONE_FOR_GOOD else None
            return {"job": job_json(job, reason), "reason": msgspec.to_builtins(reason), "from_seq": job.submitted_seq,
                    "until_ts": until, "copy": copy}

        def forecast(copy: ClusterState) -> dict[str, Any]:
            now = self.engine.clock()
            f = run_forecast(copy, now, {job_id})
            start = f.starts.get(job_id)
            assumptions = ASSUMPTIONS
            if f.blind:
                assumptions += " (no job has finished here yet, so each is assumed to take an hour)"
            return {"estimated_start": start, "made_at": now, "text": describe(start, now), "assumptions": assumptions}

        def story(from_seq: int, until_ts: float | None) -> list[dict[str, Any]]:
            batches = eventlog.read_batches(log_dir(self.engine.state_dir), from_seq=max(1, from_seq))
            events: Iterable[Event] = (e for batch in batches for e in batch)
            if until_ts is not None:  # the log's times never go back
                events = itertools.takewhile(lambda e: e.ts <= until_ts, events)
            return [msgspec.to_builtins(line) for line in job_story(events, job_id)]

        try:
            view = await self.engine.call(Query(now_view))
            view["story"] = await anyio.to_thread.run_sync(story, view.pop("from_seq"), view.pop("until_ts"))
            copy = view.pop("copy")
            if copy is not None:
                view["forecast"] = await anyio.to_thread.run_sync(forecast, copy)
                start = view["forecast"]["estimated_start"]
                if start is not None:  # what was shown is recorded, so its error can be measured
                    self.engine.submit_nowait(msg.RecordForecast(job=job_id, estimated_start=start, by="explain"),
                                              None, lambda *_: None)
        except msg.Refused as refusal:
            reply(None, refusal.reason)
            return
        except Exception as exc:  # a bug must cost one reply, not the daemon
            logger.exception("explain failed")
            reply(None, f"internal error: {exc}")
            return
        reply(view, None)

    async def _cancel(self, request: protocol.CancelJobs, peer: Peer, reply: Callable[[Any, str | None], None]) -> None:
        """Cancel every job named that can be, and say why not for each of
        the rest (SPEC §2 ``cancel A B ...``): the plan is read from the
        projection, then one ``Cancel`` of the cancellable ones. A job that
        ends between the two makes the core refuse the ``Cancel`` whole (it
        changes nothing), so the plan is read again."""
        uid = peer.uid
        try:
            for attempt in range(CANCEL_TRIES):
                ids, refused = await self.engine.call(
                    Query(lambda state: cancel_plan(state, request.jobs, request.array_tasks, uid, arrays=request.arrays))
                )
                if not ids:
                    reply({"jobs": [], "refused": refused}, None)
                    return
                try:
                    jobs = await self.engine.call(
                        msg.Cancel(jobs=ids, uid=uid, by=peer.by),
                        lambda state, _events: [job_json(state.jobs[j]) for j in ids],
                    )
                except msg.Refused:
                    if attempt + 1 < CANCEL_TRIES:
                        continue  # something ended meanwhile: plan again
                    raise
                reply({"jobs": jobs, "refused": refused}, None)
                return
        except msg.Refused as refusal:
            reply(None, refusal.reason)
        except Exception as exc:  # a bug must cost one reply, not the daemon
            logger.exception("cancel failed")
            reply(None, f"internal error: {exc}")

    def token_store(self) -> TokenStore:
        """The API tokens (issue 12), loaded on first use."""
        from eventsched.runtime.api.tokens import TokenStore

        store = self.__dict__.get("_token_store")
        if store is None:
            store = self._token_store = TokenStore(self.engine.state_dir)
        return store

    async def _tokens(self, request: protocol.Request, peer: Peer, reply: Callable[[Any, str | None], None]) -> None:
        """``eventsched token create|list|revoke``, as the peer (root or the
        daemon's user: anyone's tokens)."""
        operator = peer.uid in self.operators
        try:
            store = self.token_store()  # on the loop, as the HTTP API's lookups: one store
            if isinstance(request, protocol.CreateToken):
                uid = peer.uid
                if request.for_uid >= 0 and request.for_uid != peer.uid:
                    if peer.uid != 0:
                        raise msg.Refused("only root may create a token for another user")
                    uid = request.for_uid
                record, secret = await anyio.to_thread.run_sync(store.create, uid, request.name)
                reply({**record.public(account(record.uid)[0]), "token": secret}, None)
            elif isinstance(request, protocol.ListTokens):
                reply([r.public(account(r.uid)[0]) for r in store.visible(peer.uid, operator)], None)
            elif isinstance(request, protocol.RevokeToken):
                record = await anyio.to_thread.run_sync(store.revoke, request.token, peer.uid, operator)
                reply(record.public(account(record.uid)[0]), None)
        except msg.Refused as refusal:
            reply(None, refusal.reason)
        except Exception as exc:  # a bug or a disk error must cost one reply, not the daemon
            logger.exception("token request failed")
            reply(None, f"could not change the tokens: {exc}")

    async def _run_sql(self, sql: str, reply: Callable[[Any, str | None], None], peer: Peer) -> None:
        """Answer in a process of its own that runs the query as ``peer``
        (``sql_sandbox``), killed when its client goes away."""
        from eventsched.projections.sql import SqlError
        from eventsched.runtime.api.sql_sandbox import SqlRunner, hung_up

        runner = self.__dict__.get("_sql_runner")
        if runner is None:
            runner = self._sql_runner = SqlRunner(self.engine.state_dir)

        def gone() -> bool:  # the connection that asked was closed, or its client died
            conn = next((c for c in self.open_by_uid.get(peer.uid, ()) if c.peer is peer), None)
            if conn is None or conn.closed or conn.transport is None:
                return True
            sock = conn.transport.get_extra_info("socket")
            return sock is None or hung_up(sock)

        try:
            result = await runner.answer(sql, peer.uid, peer.gid, list(peer.groups), gone)
        except SqlError as exc:
            reply(None, str(exc))
            return
        except Exception as exc:  # a bug must cost one reply, not the daemon
            logger.exception("sql request failed")
            reply(None, f"internal error: {exc}")
            return
        if result is not None:
            reply(result, None)

    # --- replies -----------------------------------------------------------

    def flush_soon(self, conn: Connection) -> None:
        """``conn`` has replies ready: they are written once the engine has
        answered its whole batch (``flush_replies``, its ``on_answered``),
        or at the end of this step of the loop for any other reply."""
        self._unflushed.append(conn)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self.flush_replies)

    def flush_replies(self) -> None:
        # straight after the batch rather than a step of the loop later: the
        # clients have their acknowledgements before the effects are performed
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        connections, self._unflushed = self._unflushed, []
        for conn in connections:
            try:
                conn.flush()
            except Exception:  # runs inside the engine's loop: a bug costs this connection, not the engine
                logger.exception("writing replies failed")
                conn.cut_off("could not be written its replies")

    # --- connection accounting ---------------------------------------------

    def admit(self, conn: Connection) -> str | None:
        """Count ``conn`` in, or say why it is refused."""
        assert conn.peer is not None
        uid = conn.peer.uid
        operator = uid in self.operators
        mine = self.open_by_uid.setdefault(uid, set())
        refusal = None
        if self.open_total >= self.max_total + (OPERATOR_RESERVE if operator else 0):
            refusal = f"too many connections to the daemon (limit {self.max_total}); try again later"
        elif not operator and len(mine) >= self.connection_limits.max_per_user:
            refusal = f"too many connections from uid {uid} (limit {self.connection_limits.max_per_user})"
        if refusal is not None:
            if not mine:
                del self.open_by_uid[uid]
            self._refusals[uid] += 1
            count = self._refusals[uid]
            if count & (count - 1) == 0:  # 1, 2, 4, 8...: visible, never a flood of its own
                logger.warning("refused connection %d from uid %d (pid %d): %s", count, uid, conn.peer.pid, refusal)
            return refusal
        mine.add(conn)
        self.open_total += 1
        return None

    def release(self, conn: Connection) -> None:
        assert conn.peer is not None
        mine = self.open_by_uid.get(conn.peer.uid)
        if mine is not None and conn in mine:
            mine.discard(conn)
            self.open_total -= 1
            if not mine:
                del self.open_by_uid[conn.peer.uid]
        self.subscribers.discard(conn)
        self._waiting_share.get(conn.peer.uid, {}).pop(conn, None)

    def may_dispatch(self, conn: Connection) -> bool:
        """May ``conn`` hand its user's next request to the engine now? If
        not, it waits (unread) until one of that user's requests is answered."""
        assert conn.peer is not None
        uid = conn.peer.uid
        if uid in self.operators or self.in_flight_by_uid[uid] < self.connection_limits.max_requests_in_flight_per_user:
            return True
        self._waiting_share.setdefault(uid, {})[conn] = None
        return False

    def dispatched(self, uid: int) -> None:
        self.in_flight_by_uid[uid] += 1

    def answered(self, uid: int) -> None:
        self.in_flight_by_uid[uid] -= 1
        if self.in_flight_by_uid[uid] <= 0:
            del self.in_flight_by_uid[uid]
        waiting = self._waiting_share.get(uid)
        if not waiting:
            return
        free = self.connection_limits.max_requests_in_flight_per_user - self.in_flight_by_uid[uid]
        loop = asyncio.get_running_loop()
        for conn in list(waiting)[: max(1, free)]:
            del waiting[conn]
            loop.call_soon(conn.resume_share)
        if not waiting:
            del self._waiting_share[uid]

    def may_buffer(self, conn: Connection, size: int) -> bool:
        """May ``size`` more bytes wait unread for ``conn``'s user? One reply
        of any size may, when nothing else of theirs waits."""
        assert conn.peer is not None
        if conn.peer.uid in self.operators:
            return True
        waiting = self.unread_by(conn.peer.uid)
        return waiting == 0 or waiting + size <= self.connection_limits.max_unread_bytes_per_user

    def unread_by(self, uid: int) -> int:
        """What ``uid``'s connections leave unread (0 for operators: never limited)."""
        if uid in self.operators:
            return 0
        return sum(c.unread() for c in self.open_by_uid.get(uid, ()))

    # --- event streams ----------------------------------------------------

    def _fan_out(self, payload: bytes) -> bool:
        """The engine's one subscriber: each batch to every connection that
        subscribed, as its user may see it."""
        if self.subscribers:
            view = BatchView(payload, self.operators)
            for conn in list(self.subscribers):
                conn.deliver(view)
        return True

    def history_slot(self, uid: int) -> asyncio.Semaphore:
        """One user's subscriptions are sent their history a few at a time:
        what a stalled one holds (up to one log frame) stays bounded."""
        slot = self._history_slots.get(uid)
        if slot is None:
            slot = self._history_slots[uid] = asyncio.Semaphore(HISTORY_PER_USER)
        return slot

    def history_chunk(self, cursor: Any, from_seq: int, upto: int, viewer: int) -> tuple[list[bytes], bool]:
        """The next ~HISTORY_CHUNK_BYTES of ``cursor`` (a ``read_batches``
        iterator) as ``viewer`` may see it; True once ``upto`` is reached.
        Runs in a worker thread."""
        payloads: list[bytes] = []
        size = 0
        for batch in cursor:
            kept = redact_events([event for event in batch if from_seq <= event.seq <= upto], viewer, self.operators)
            if kept:
                payload = encode_many(kept)
                if len(payload) > HISTORY_CHUNK_BYTES and len(kept) > 1:
                    # a big group commit goes out in pieces, each paced
                    parts = -(-len(payload) // HISTORY_CHUNK_BYTES)
                    step = -(-len(kept) // parts)
                    payloads.extend(encode_many(kept[i : i + step]) for i in range(0, len(kept), step))
                else:
                    payloads.append(payload)
                size += len(payload)
            if batch and batch[-1].seq >= upto:
                return payloads, True
            if size >= HISTORY_CHUNK_BYTES:
                return payloads, False
        return payloads, True


CANCEL_TRIES = 5


def cancel_plan(
    state: ClusterState, ids: list[int], array_tasks: list[tuple[int, int]], uid: int, *, arrays: bool = False
) -> tuple[list[int], list[dict[str, Any]]]:
    """What ``cancel`` may cancel for ``uid`` and, for each other job named,
    why not: (cancellable ids, [{"job", "reason"}]). With ``arrays``, an
    array's id (its first task's) stands for every unfinished task of the
    array; ``(array, index)``
    names one task. Only a job's owner or root may cancel it (as the core)."""
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

    def owner_refusal(job: Job) -> str | None:
        if uid != 0 and uid != job.spec.uid:
            return f"belongs to {job.spec.user or 'uid ' + str(job.spec.uid)}"
        return None

    for jid in dict.fromkeys(ids):
        job = state.jobs.get(jid)
        if job is None:
            refused.append({"job": jid, "reason": "no such job"})
            continue
        why = owner_refusal(job)
        if why is not None:
            refused.append({"job": jid, "reason": why})
            continue
        if arrays and job.spec.array_index >= 0 and job.spec.array_id == jid:  # an array's id: all its tasks
            tasks = tasks_of(jid)
            live = [t.id for t in tasks if t.state not in FINAL]
            if not live:
                refused.append({"job": jid, "reason": f"array already finished (all {len(tasks)} tasks)"})
            wanted.update(dict.fromkeys(live))
        elif job.state in FINAL:
            refused.append({"job": jid, "reason": f"already {job.state}"})
        else:
            wanted[jid] = None
    for array, index in dict.fromkeys(tuple(pair) for pair in array_tasks):
        label = f"{array}_{index}"
        task = next((t for t in tasks_of(array) if t.spec.array_index == index), None)
        if task is None:
            if tasks_of(array):
                why = f"array {array} has no task {index}"
            else:
                why = f"job {array} is not an array" if array in state.jobs else f"no array {array}"
            refused.append({"job": label, "reason": why})
            continue
        why = owner_refusal(task) or (f"already {task.state}" if task.state in FINAL else None)
        if why is not None:
            refused.append({"job": label, "reason": why})
        else:
            wanted[task.id] = None
    return list(wanted), refused


def _submitted(_state: ClusterState, events: list[Event]) -> dict:
    return {"id": events[0].job, "seq": events[-1].seq}  # type: ignore[attr-defined]


def _submitted_array(_state: ClusterState, events: list[Event]) -> dict:
    ids = [e.job for e in events if isinstance(e, JobSubmitted)]
    return {"id": ids[0], "ids": ids, "seq": events[-1].seq}


QUEUED_STATE = JobState.QUEUED
# nothing more happens to a job in these (a lost one may be requeued)
DONE_FOR_GOOD = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

# queue --json forecasts start times while at most this many jobs wait (each
# listing then costs a forward run of the core); explain forecasts any job
FORECAST_QUEUE_LIMIT = 200


MAX_JOBS_PAGE = 1000  # jobs per page of a paged listing, at most


def list_jobs_page(state: ClusterState, include_finished: bool, now: float, after: int, limit: int) -> dict:
    """Issue 16: ``list_jobs`` one page at a time, in id order: the jobs with
    ids above ``after``, at most ``limit`` of them, and the id to go on from
    (None: no more). Ids are looked at one by one from ``after``, at most
    ``16 x limit`` of them per page, so a page stays bounded when most jobs
    have ended. A listing is no longer one instant: a job may change between
    pages (as with ``ps``)."""
    jobs: list[Job] = []
    jid, end, budget = after + 1, state.next_job_id, 16 * limit
    while jid < end and len(jobs) < limit and budget > 0:
        job = state.jobs.get(jid)
        if job is not None and (include_finished or job.state in ACTIVE):
            jobs.append(job)
        jid += 1
        budget -= 1
    return {"jobs": list_jobs(state, include_finished, now, jobs), "next": jid if jid < end else None}


def list_jobs(state: ClusterState, include_finished: bool, now: float, page: list[Job] | None = None) -> list[dict]:
    from eventsched.core.explain import waiting_reasons

    if page is not None:  # one page (list_jobs_page): reasons and array counts for its jobs only
        jobs = page
        reasons = waiting_reasons(state, now, [job.id for job in jobs])
    else:
        jobs = [job for job in state.jobs.values() if include_finished or job.state in ACTIVE]
        reasons = waiting_reasons(state, now)  # one walk of the queue for every waiting job
    starts: dict[int, float] | None = None
    queued = {job.id for job in jobs if job.state == QUEUED_STATE}
    if queued and len(state.queue) <= FORECAST_QUEUE_LIMIT:
        # only for the queued jobs listed: a page of ended jobs runs no forecast,
        # and the run stops once the page's own jobs have started
        starts = run_forecast(working_copy(state), now, queued).starts
    out = [job_json(job, reasons.get(job.id)) for job in jobs]
    for view in out:  # issue 17: null when not queued, or the queue is too long to forecast per listing
        view["estimated_start"] = starts.get(view["id"]) if starts is not None and view["state"] == "queued" else None
    # each array task also says how many of its array's tasks have ended, so
    # `queue` can fold an array into one line without --all
    for view in out:
        if view["array_id"] is not None:
            view["array_done"] = state.array_ended[view["array_id"]]
    return out


def status(state: ClusterState) -> dict:
    from eventsched.projections.cluster import nodes_view

    return {
        "nodes": nodes_view(state),  # issue 12
        "gpus": [gpu_json(gpu) for gpu in state.all_gpus()],
        "jobs": [job_json(job) for job in state.jobs.values() if job.state in ACTIVE],
        "policy": state.policy,
        "seq": state.last_seq,
    }
