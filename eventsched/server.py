"""The control socket: authenticates peers, decodes requests, asks the engine.

The user is always the socket's peer (SO_PEERCRED), never a claim in the
request. A malformed, oversized or hostile message gets an error reply and
changes nothing; a client that goes away mid-request harms nothing.

Connections are asyncio protocols rather than anyio streams: a request is
decoded in ``data_received`` and handed to the engine's inbox with a callback
that writes the reply, so a submission costs no task switch of its own. (The
daemon runs anyio on its asyncio backend.) Replies go out in request order
even when a client pipelines requests.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import pwd
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import anyio
import anyio.abc
import msgspec

from . import log as eventlog
from . import messages as msg
from . import protocol
from .admission import SubmitLimits, check_submission
from .engine import Answer, Engine, Query
from .events import Event, encode_many
from .paths import log_dir
from .projections.cluster import ClusterState, gpu_json, job_json

logger = logging.getLogger("eventsched.server")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
# a subscriber further behind than this is cut off (it resubscribes from the
# last seq it saw) rather than growing the daemon's memory without bound
SUBSCRIBER_BACKLOG_BYTES = 16 << 20


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


class Server:
    def __init__(self, engine: Engine, socket_path: Path, *, limits: SubmitLimits = SubmitLimits()) -> None:
        self.engine = engine
        self.socket_path = socket_path
        self.limits = limits
        self.daemon_uid = os.geteuid()

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists() or self.socket_path.is_symlink():
            self.socket_path.unlink()  # stale: the log's lock already proved no daemon runs here
        loop = asyncio.get_running_loop()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            server = await loop.create_unix_server(lambda: Connection(self), str(self.socket_path))
            # anyone may connect; what they may do is decided per request
            # from their credentials
            os.chmod(self.socket_path, 0o666)
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                server.close()
                try:
                    self.socket_path.unlink()
                except FileNotFoundError:
                    pass

    # --- requests -> engine items ---------------------------------------

    def dispatch(self, request: protocol.Request, peer: Peer, reply: Callable[[Any, str | None], None]) -> None:
        """Hand a request to the engine; ``reply`` is called once with its outcome."""
        if isinstance(request, protocol.RunSql):
            # read-only and possibly slow: a worker thread, not the engine
            self._tg.start_soon(self._run_sql, request.query, reply)
            return
        try:
            item, answer = self._translate(request, peer)
        except msg.Refused as refusal:
            reply(None, refusal.reason)
            return
        self.engine.submit_nowait(item, answer, reply)

    def _translate(self, request: protocol.Request, peer: Peer) -> tuple[msg.Message | Query, Answer | None]:
        config = self.engine.config
        if isinstance(request, protocol.SubmitJob):
            return msg.Submit(spec=self._as_peer(request.spec, peer), by=peer.by), _submitted
        if isinstance(request, protocol.ListJobs):
            include_finished = request.all
            return Query(lambda state: list_jobs(state, include_finished)), None
        if isinstance(request, protocol.GetStatus):
            return Query(status), None
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

    async def _run_sql(self, sql: str, reply: Callable[[Any, str | None], None]) -> None:
        from .sqlcmd import SqlError, plain_result, query

        try:
            columns, rows = await anyio.to_thread.run_sync(query, self.engine.state_dir, sql)
        except SqlError as exc:
            reply(None, str(exc))
            return
        except Exception as exc:  # a bug must cost one reply, not the daemon
            logger.exception("sql request failed")
            reply(None, f"internal error: {exc}")
            return
        reply(plain_result(columns, rows), None)

    # --- event streams ----------------------------------------------------

    def history(self, from_seq: int, upto: int) -> list[bytes]:
        payloads = []
        for batch in eventlog.read_batches(log_dir(self.engine.state_dir), from_seq=from_seq):
            kept = [event for event in batch if from_seq <= event.seq <= upto]
            if kept:
                payloads.append(encode_many(kept))
            if batch and batch[-1].seq >= upto:
                break
        return payloads


def _submitted(_state: ClusterState, events: list[Event]) -> dict:
    return {"id": events[0].job, "seq": events[-1].seq}  # type: ignore[attr-defined]


class Connection(asyncio.Protocol):
    """One client connection: framing, ordering of replies, subscriptions."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer: Peer | None = None
        self.buffer = bytearray()
        # replies in request order: a slot per request, written when at the head
        self.slots: collections.deque[list[bytes | None]] = collections.deque()
        self.closed = False
        self.eof = False
        self.subscribed = False
        self._deliver: Callable[[bytes], bool] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.peer = peer_credentials(transport.get_extra_info("socket"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._deliver is not None:
            self.server.engine.unsubscribe(self._deliver)
            self._deliver = None

    def eof_received(self) -> bool:
        # The client may half-close after its last request: answer what is
        # pending first, then close (see _flush).
        self.eof = True
        return bool(self.slots) or self.subscribed

    def data_received(self, data: bytes) -> None:
        if self.subscribed:
            return  # a subscriber has nothing more to say
        self.buffer += data
        header_size = protocol.HEADER.size
        while len(self.buffer) >= header_size and not self.closed:
            try:
                length = protocol.check_length(bytes(self.buffer[:header_size]))
            except protocol.ProtocolError as exc:
                # the stream cannot be re-synchronised after this
                self._reply_now(protocol.Reply(ok=False, error=str(exc)))
                self._hang_up()
                return
            if len(self.buffer) < header_size + length:
                return
            body = bytes(self.buffer[header_size : header_size + length])
            del self.buffer[: header_size + length]
            self._request(body)

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
            message = protocol.Reply(ok=False, error=error) if error is not None else protocol.Reply(ok=True, data=result)
            slot[0] = protocol.frame(message)
            self._flush()

        assert self.peer is not None
        try:
            self.server.dispatch(request, self.peer, reply)
        except Exception as exc:  # a bug must cost one reply, not the daemon
            logger.exception("request %s failed", type(request).__name__)
            reply(None, f"internal error: {exc}")

    def _reply_now(self, message: protocol.Reply) -> None:
        slot: list[bytes | None] = [protocol.frame(message)]
        self.slots.append(slot)
        self._flush()

    def _flush(self) -> None:
        while self.slots and self.slots[0][0] is not None:
            data = self.slots.popleft()[0]
            if not self.closed and self.transport is not None:
                self.transport.write(data)  # type: ignore[arg-type]
        if self.eof and not self.slots and not self.subscribed and self.transport is not None:
            self.transport.close()

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
        """History from ``from_seq`` (read in a thread), then every live batch."""
        assert self.transport is not None
        self.subscribed = True
        backlog: list[bytes] | None = []  # live batches that arrive during the history
        transport = self.transport

        def deliver(payload: bytes) -> bool:
            if self.closed:
                return False
            if backlog is not None:
                backlog.append(payload)
                return True
            if transport.get_write_buffer_size() > SUBSCRIBER_BACKLOG_BYTES:
                transport.close()
                return False
            transport.write(protocol.frame(protocol.EventBatch(payload=payload)))
            return True

        upto = self.server.engine.subscribe(deliver)
        self._deliver = deliver
        transport.write(protocol.frame(protocol.Reply(ok=True, data={"seq": upto})))

        async def send_history() -> None:
            nonlocal backlog
            try:
                if 0 < from_seq <= upto:
                    for payload in await anyio.to_thread.run_sync(self.server.history, from_seq, upto):
                        if self.closed:
                            return
                        transport.write(protocol.frame(protocol.EventBatch(payload=payload)))
            finally:
                pending, backlog = backlog or [], None
                for payload in pending:
                    deliver(payload)

        self.server._tg.start_soon(send_history)


def list_jobs(state: ClusterState, include_finished: bool) -> list[dict]:
    active = ("queued", "running", "held")
    jobs = [job for job in state.jobs.values() if include_finished or job.state in active]
    return [job_json(job) for job in jobs]


def status(state: ClusterState) -> dict:
    return {
        "gpus": [gpu_json(gpu) for gpu in state.all_gpus()],
        "jobs": [job_json(job) for job in state.jobs.values() if job.state in ("queued", "running", "held")],
        "policy": state.policy,
        "seq": state.last_seq,
    }
