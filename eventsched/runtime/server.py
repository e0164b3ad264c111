"""The control socket: authenticates peers, decodes requests, asks the engine.

The user is always the socket's peer (SO_PEERCRED), never a claim in the
request. A malformed, oversized or hostile message gets an error reply and
changes nothing; a client that goes away mid-request harms nothing.

Connections are asyncio protocols rather than anyio streams: a request is
decoded in ``data_received`` and handed to the engine's inbox with a callback
that writes the reply, so a submission costs no task switch of its own. (The
daemon runs anyio on its asyncio backend.) Replies go out in request order
even when a client pipelines requests.

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
import logging
import os
import pwd
import resource
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import anyio
import anyio.abc
import msgspec

from eventsched.core.admission import SubmitLimits, check_submission
from eventsched.domain import messages as msg
from eventsched.domain.events import Event, encode_many
from eventsched.domain.paths import log_dir
from eventsched.domain.states import ACTIVE
from eventsched.domain.visibility import BatchView, redact_events
from eventsched.projections.cluster import ClusterState, gpu_json, job_json
from eventsched.runtime.config import ConnectionLimits
from eventsched.runtime.engine import Answer, Engine, Query
from eventsched.storage import log as eventlog
from eventsched.wire import protocol

logger = logging.getLogger("eventsched.server")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
# a subscriber further behind than this is cut off (it resubscribes from the
# last seq it saw) rather than growing the daemon's memory without bound
SUBSCRIBER_BACKLOG_BYTES = 16 << 20
# stop reading a connection while this much of its replies is unread (resume
# at the low mark), or while it has this many requests unanswered
WRITE_HIGH_WATER = 256 << 10
WRITE_LOW_WATER = 64 << 10
MAX_OUTSTANDING_REPLIES = 256
# history is read and sent in chunks of about this size, each once the last drained
HISTORY_CHUNK_BYTES = 256 << 10
# a subscriber whose history has not drained for this long is dropped
SUBSCRIBER_STALL_S = 60.0
# subscriptions of one user being sent history at once (the others wait)
HISTORY_PER_USER = 2
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


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]

    @property
    def by(self) -> str:
        return f"uid:{self.uid}"


def peer_credentials(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    try:
        data = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 1024)
        groups = tuple(struct.unpack(f"{len(data) // 4}I", data))
    except OSError:
        groups = ()
    return Peer(pid=pid, uid=uid, gid=gid, groups=groups)


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
    ) -> None:
        self.engine = engine
        self.socket_path = socket_path
        self.limits = limits
        self.daemon_uid = os.geteuid()
        self.operators = frozenset({0, self.daemon_uid})
        self.connection_limits = connections
        self.max_total = connections.max_total  # lowered in serve() to fit the open-file limit
        self.open_total = 0
        self.open_by_uid: dict[int, set[Connection]] = {}
        self.subscribers: set[Connection] = set()
        self._refusals: collections.Counter[int] = collections.Counter()
        self._history_slots: dict[int, asyncio.Semaphore] = {}

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
        if isinstance(request, protocol.RunSql):
            # read-only and possibly slow: a sandboxed process as the peer, not the engine
            self._tg.start_soon(self._run_sql, request.query, reply, peer)
            return
        if isinstance(request, protocol.ExplainJob):
            self._tg.start_soon(self._explain, request.job, reply)
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
            return msg.Submit(spec=self._as_peer(request.spec, peer), by=peer.by), _submitted
        if isinstance(request, protocol.ListJobs):
            include_finished = request.all
            return Query(lambda state: list_jobs(state, include_finished, self.engine.clock())), None
        if isinstance(request, protocol.GetStatus):
            containment = self.engine.executor.containment  # issue 18: "cgroup2:DIR" or "process-group"
            return Query(lambda state: {**status(state), "containment": containment}), None
        if isinstance(request, protocol.Ping):
            return Query(lambda state: {"ok": True, "pid": os.getpid(), "seq": state.last_seq}), None
        if isinstance(request, (protocol.CancelJobs, protocol.HoldJobs, protocol.ReleaseJobs)):
            kind = {protocol.CancelJobs: msg.Cancel, protocol.HoldJobs: msg.Hold, protocol.ReleaseJobs: msg.Release}
            ids = list(request.jobs)
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
            return msg.SetPolicy(policy=request.policy, by=peer.by), lambda state, _events: {"policy": state.policy}
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
        user, home = account(peer.uid)
        return msgspec.structs.replace(
            spec, user=user, uid=peer.uid, gid=peer.gid, groups=list(peer.groups), home=home
        )

    def _log_path(self, state: ClusterState, job_id: int, peer: Peer) -> dict:
        job = state.jobs.get(job_id)
        if job is None:
            raise msg.Refused(f"no job {job_id}")
        if peer.uid not in (0, job.spec.uid, self.daemon_uid):
            raise msg.Refused(f"job {job_id} belongs to {job.spec.user}")
        return {"path": str(self.engine.executor.log_path(job_id)), "state": job.state}

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
            return {"job": job_json(job, reason), "reason": msgspec.to_builtins(reason), "from_seq": job.submitted_seq}

        def story(from_seq: int) -> list[dict[str, Any]]:
            batches = eventlog.read_batches(log_dir(self.engine.state_dir), from_seq=max(1, from_seq))
            lines = job_story((e for batch in batches for e in batch), job_id)
            return [msgspec.to_builtins(line) for line in lines]

        try:
            view = await self.engine.call(Query(now_view))
            view["story"] = await anyio.to_thread.run_sync(story, view.pop("from_seq"))
        except msg.Refused as refusal:
            reply(None, refusal.reason)
            return
        except Exception as exc:  # a bug must cost one reply, not the daemon
            logger.exception("explain failed")
            reply(None, f"internal error: {exc}")
            return
        reply(view, None)

    async def _run_sql(self, sql: str, reply: Callable[[Any, str | None], None], peer: Peer) -> None:
        """Answer in a process of its own that runs the query as ``peer``
        (``sql_sandbox``), killed when its client goes away."""
        from eventsched.projections.sql import SqlError
        from eventsched.runtime.sql_sandbox import SqlRunner, hung_up

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


def _submitted(_state: ClusterState, events: list[Event]) -> dict:
    return {"id": events[0].job, "seq": events[-1].seq}  # type: ignore[attr-defined]


class Connection(asyncio.Protocol):
    """One client connection: framing, ordering of replies, flow control, subscriptions."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer: Peer | None = None
        self.buffer = bytearray()
        # replies in request order: a slot per request, written when at the head
        self.slots: collections.deque[list[bytes | None]] = collections.deque()
        self.closed = False
        self.admitted = False
        self.eof = False
        self.subscribed = False
        self._processing = False
        self._reading_paused = False
        self._write_paused = False  # asyncio says the write buffer is above the high-water mark
        self._drained = asyncio.Event()
        self._drained.set()
        # live batches that arrive while a subscriber is sent its history
        self._backlog: list[bytes] | None = None
        self._backlog_bytes = 0
        self._slot_bytes = 0  # replies ready but waiting behind an earlier one

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        try:
            self.peer = peer_credentials(transport.get_extra_info("socket"))
        except OSError:
            self.closed = True
            transport.abort()
            return
        refusal = self.server.admit(self)
        if refusal is not None:
            # one clear reply, then the slot is free again at once
            self.closed = True
            transport.write(protocol.frame(protocol.Reply(ok=False, error=refusal)))
            transport.close()
            return
        self.admitted = True
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._drained.set()  # wakes a history sender, which sees closed
        self.slots.clear()
        self._slot_bytes = 0
        self._backlog = None
        if self.admitted:
            self.admitted = False
            self.server.release(self)

    def eof_received(self) -> bool:
        # The client may half-close after its last request: answer what is
        # pending first, then close (see _process). A subscriber that hangs
        # up is gone: close now, so its slot is free at once.
        self.eof = True
        return not self.subscribed and (bool(self.slots) or self._complete_request_waits())

    # --- flow control ------------------------------------------------------

    def pause_writing(self) -> None:
        self._write_paused = True
        self._drained.clear()
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._drained.set()
        self._process()

    def unread(self) -> int:
        """Bytes written to this connection that its client has not read yet."""
        if self.closed or self.transport is None:
            return 0
        return self.transport.get_write_buffer_size() + self._slot_bytes

    def guard(self, read: Callable[[ClusterState], Any]) -> Callable[[ClusterState], Any]:
        """``read``, skipped when nobody will read its answer: the connection
        is gone, or its user already leaves half their share unread (a
        listing can be tens of MB; computing it costs the engine's time)."""

        def guarded(state: ClusterState) -> Any:
            if self.closed:
                return None
            limit = self.server.connection_limits.max_unread_bytes_per_user
            assert self.peer is not None
            waiting = self.server.unread_by(self.peer.uid)
            if waiting >= limit // 2:
                raise msg.Refused(
                    f"uid {self.peer.uid} leaves {waiting} bytes of replies unread (limit {limit}); read them first"
                )
            return read(state)

        return guarded

    def _update_reading(self) -> None:
        if self.closed or self.transport is None:
            return
        pause = not self.subscribed and (self._write_paused or len(self.slots) >= MAX_OUTSTANDING_REPLIES)
        if pause != self._reading_paused:
            self._reading_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _write(self, data: bytes) -> bool:
        """Write, unless this user leaves too much unread: then cut off."""
        if self.closed or self.transport is None:
            return False
        if not self.server.may_buffer(self, len(data)):
            self.cut_off(f"leaves more than {self.server.connection_limits.max_unread_bytes_per_user} bytes unread")
            return False
        self.transport.write(data)
        return True

    def cut_off(self, why: str) -> None:
        """Drop a client that does not read: its unread data goes at once."""
        if self.closed or self.transport is None:
            return
        assert self.peer is not None
        logger.warning("cut off a connection of uid %d (pid %d): it %s", self.peer.uid, self.peer.pid, why)
        self.closed = True
        self.transport.abort()

    # --- requests ----------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.subscribed or self.closed:
            return  # a subscriber has nothing more to say
        self.buffer += data
        self._process()

    def _process(self) -> None:
        """Handle the complete requests in the buffer, as far as flow control allows."""
        if self._processing:
            return
        self._processing = True
        try:
            header_size = protocol.HEADER.size
            while (
                len(self.buffer) >= header_size
                and not self.closed
                and not self.subscribed
                and not self._write_paused
                and len(self.slots) < MAX_OUTSTANDING_REPLIES
            ):
                try:
                    length = protocol.check_length(bytes(self.buffer[:header_size]))
                except protocol.ProtocolError as exc:
                    # the stream cannot be re-synchronised after this
                    self._reply_now(protocol.Reply(ok=False, error=str(exc)))
                    self._hang_up()
                    return
                if len(self.buffer) < header_size + length:
                    break
                body = bytes(self.buffer[header_size : header_size + length])
                del self.buffer[: header_size + length]
                self._request(body)
        finally:
            self._processing = False
        self._update_reading()
        if self.eof and not self.slots and not self.subscribed and not self.closed and self.transport is not None:
            if not self._complete_request_waits():
                self.transport.close()

    def _complete_request_waits(self) -> bool:
        header_size = protocol.HEADER.size
        if len(self.buffer) < header_size:
            return False
        (length,) = protocol.HEADER.unpack(bytes(self.buffer[:header_size]))
        return len(self.buffer) >= header_size + length

    def _request(self, body: bytes) -> None:
        try:
            request = protocol.request_decoder.decode(body)
        except msgspec.DecodeError as exc:
            self._reply_now(protocol.Reply(ok=False, error=f"bad request: {exc}"))
            return
        if isinstance(request, protocol.Subscribe):
            self._subscribe(request.from_seq)
            return
        slot: list[bytes | None] = [None]
        self.slots.append(slot)

        def reply(result: Any, error: str | None) -> None:
            if self.closed:
                return
            message = protocol.Reply(ok=False, error=error) if error is not None else protocol.Reply(ok=True, data=result)
            data = protocol.frame(message)
            if not self.server.may_buffer(self, len(data)):
                self.cut_off(f"leaves more than {self.server.connection_limits.max_unread_bytes_per_user} bytes unread")
                return
            slot[0] = data
            self._slot_bytes += len(data)
            self._flush()

        assert self.peer is not None
        try:
            self.server.dispatch(request, self.peer, reply, self)
        except Exception as exc:  # a bug must cost one reply, not the daemon
            logger.exception("request %s failed", type(request).__name__)
            reply(None, f"internal error: {exc}")

    def _reply_now(self, message: protocol.Reply) -> None:
        data = protocol.frame(message)
        self.slots.append([data])
        self._slot_bytes += len(data)
        self._flush()

    def _flush(self) -> None:
        while self.slots and self.slots[0][0] is not None:
            data = self.slots.popleft()[0]
            assert data is not None
            self._slot_bytes -= len(data)
            if self.closed or self.transport is None:
                return
            self.transport.write(data)  # its size was checked when it was framed
        # answered requests make room for the next ones in the buffer
        self._process()

    def _hang_up(self) -> None:
        """Close after an error reply without a reset that would destroy it:
        half-close now, ignore whatever else the peer sends, close soon."""
        assert self.transport is not None
        self.subscribed = True  # ignore further input
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(1.0, self.transport.close)

    # --- subscriptions ------------------------------------------------------

    def _subscribe(self, from_seq: int) -> None:
        """History from ``from_seq`` (read in chunks in a thread, each sent
        once the previous one drained), then every live batch."""
        assert self.transport is not None and self.peer is not None
        self.subscribed = True
        self._update_reading()  # input is ignored from now on
        self._backlog = []
        # registration and upto in one step of the loop: history up to upto
        # plus the live batches after it lose nothing
        self.server.subscribers.add(self)
        upto = self.server.engine.committed_seq
        self._write(protocol.frame(protocol.Reply(ok=True, data={"seq": upto})))
        self.server._tg.start_soon(self._send_history, from_seq, upto)

    def deliver(self, view: BatchView) -> None:
        """A live batch (called by the server's fan-out)."""
        if self.closed:
            return
        assert self.peer is not None
        payload = view.for_viewer(self.peer.uid)
        if self._backlog is not None:
            self._backlog.append(payload)
            self._backlog_bytes += len(payload)
            if self._backlog_bytes > SUBSCRIBER_BACKLOG_BYTES:
                self.cut_off("fell too far behind during its history")
            return
        if self.unread() > SUBSCRIBER_BACKLOG_BYTES:
            # it resubscribes from the last seq it saw
            self.cut_off(f"left {SUBSCRIBER_BACKLOG_BYTES} bytes of events unread")
            return
        self._write(protocol.frame(protocol.EventBatch(payload=payload)))

    async def _paced_write(self, data: bytes) -> bool:
        """Write once the client has read what it was sent before (False:
        it is gone, or cut off after reading nothing for SUBSCRIBER_STALL_S)."""
        if not self._drained.is_set():
            with anyio.move_on_after(SUBSCRIBER_STALL_S):
                await self._drained.wait()
            if not self._drained.is_set():
                self.cut_off(f"read none of its history for {SUBSCRIBER_STALL_S:g} s")
                return False
        return self._write(data)

    async def _send_history(self, from_seq: int, upto: int) -> None:
        assert self.peer is not None
        server = self.server
        cursor = None
        try:
            if 0 < from_seq <= upto:
                async with server.history_slot(self.peer.uid):
                    cursor = eventlog.read_batches(log_dir(server.engine.state_dir), from_seq=from_seq)
                    done = False
                    while not done and not self.closed:
                        payloads, done = await anyio.to_thread.run_sync(
                            server.history_chunk, cursor, from_seq, upto, self.peer.uid,
                            limiter=server._history_limiter,
                        )
                        for payload in payloads:
                            if not await self._paced_write(protocol.frame(protocol.EventBatch(payload=payload))):
                                return
        except Exception as exc:  # EMFILE, a log problem: cost this subscriber, not the daemon
            logger.warning("history for uid %d failed: %s", self.peer.uid, exc)
            self.cut_off("could not be sent its history")
        finally:
            close = getattr(cursor, "close", None)  # a generator: its segment file closes now
            if close is not None:
                close()
            pending, self._backlog = self._backlog or [], None
            self._backlog_bytes = 0
            for payload in pending:
                if not self._write(protocol.frame(protocol.EventBatch(payload=payload))):
                    break


def list_jobs(state: ClusterState, include_finished: bool, now: float) -> list[dict]:
    from eventsched.core.explain import waiting_reasons

    jobs = [job for job in state.jobs.values() if include_finished or job.state in ACTIVE]
    reasons = waiting_reasons(state, now)  # one walk of the queue for every waiting job
    return [job_json(job, reasons.get(job.id)) for job in jobs]


def status(state: ClusterState) -> dict:
    return {
        "gpus": [gpu_json(gpu) for gpu in state.all_gpus()],
        "jobs": [job_json(job) for job in state.jobs.values() if job.state in ACTIVE],
        "policy": state.policy,
        "seq": state.last_seq,
    }
