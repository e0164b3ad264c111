"""The control socket: authenticates peers, decodes requests, asks the engine.

The user is always the socket's peer (SO_PEERCRED), never a claim in the
request. A malformed, oversized or hostile message gets an error reply and
changes nothing; a client that goes away mid-request harms nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from . import log as eventlog
from . import messages as msg
from . import protocol
from .engine import Engine, Query
from .events import encode_many
from .paths import log_dir
from .projections.cluster import ClusterState, gpu_json, job_json

logger = logging.getLogger("eventsched.server")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


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
    def __init__(self, engine: Engine, socket_path: Path) -> None:
        self.engine = engine
        self.socket_path = socket_path
        self.daemon_uid = os.geteuid()

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists() or self.socket_path.is_symlink():
            self.socket_path.unlink()  # stale: the log's lock already proved no daemon runs here
        listener = await anyio.create_unix_listener(self.socket_path)
        # anyone may connect; what they may do is decided per request from
        # their credentials
        os.chmod(self.socket_path, 0o666)
        task_status.started()
        try:
            await listener.serve(self._connection)
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
                try:
                    self.socket_path.unlink()
                except FileNotFoundError:
                    pass

    async def _connection(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
            peer = peer_credentials(raw)
            reader = BufferedByteReceiveStream(stream)
            try:
                while True:
                    try:
                        header = await reader.receive_exactly(protocol.HEADER.size)
                    except anyio.EndOfStream:
                        return
                    try:
                        length = protocol.check_length(header)
                    except protocol.ProtocolError as exc:
                        # the stream cannot be re-synchronised after this
                        await stream.send(protocol.frame(protocol.Reply(ok=False, error=str(exc))))
                        await _hang_up(stream)
                        return
                    body = await reader.receive_exactly(length)
                    try:
                        request = protocol.request_decoder.decode(body)
                    except msgspec.DecodeError as exc:
                        await stream.send(protocol.frame(protocol.Reply(ok=False, error=f"bad request: {exc}")))
                        continue
                    if isinstance(request, protocol.Subscribe):
                        await self._stream_events(stream, request.from_seq)
                        return
                    reply = await self._dispatch(request, peer)
                    await stream.send(protocol.frame(reply))
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, ConnectionError):
                return

    async def _dispatch(self, request: protocol.Request, peer: Peer) -> protocol.Reply:
        try:
            data = await self._answer(request, peer)
        except msg.Refused as refusal:
            return protocol.Reply(ok=False, error=refusal.reason)
        return protocol.Reply(ok=True, data=data)

    async def _answer(self, request: protocol.Request, peer: Peer) -> object:
        engine = self.engine
        if isinstance(request, protocol.SubmitJob):
            events = await engine.call(msg.Submit(spec=self._as_peer(request.spec, peer), by=peer.by))
            return {"id": events[0].job, "seq": events[-1].seq}
        if isinstance(request, protocol.ListJobs):
            return await engine.call(Query(lambda state: list_jobs(state, request.all)))
        if isinstance(request, protocol.GetStatus):
            return await engine.call(Query(status))
        if isinstance(request, protocol.Ping):
            return await engine.call(Query(lambda state: {"ok": True, "pid": os.getpid(), "seq": state.last_seq}))
        if isinstance(request, (protocol.CancelJobs, protocol.HoldJobs, protocol.ReleaseJobs)):
            kind = {protocol.CancelJobs: msg.Cancel, protocol.HoldJobs: msg.Hold, protocol.ReleaseJobs: msg.Release}
            await engine.call(kind[type(request)](jobs=request.jobs, uid=peer.uid, by=peer.by))
            return await engine.call(Query(lambda state: [job_json(state.jobs[j]) for j in request.jobs]))
        if isinstance(request, (protocol.PauseGpu, protocol.ResumeGpu)):
            self._require_operator(peer, "pause or resume a GPU")
            node = request.node or engine.config.node
            kind = msg.PauseGpu if isinstance(request, protocol.PauseGpu) else msg.ResumeGpu
            await engine.call(kind(node=node, gpu=request.gpu, by=peer.by))
            return await engine.call(Query(lambda state: gpu_json(state.gpu(node, request.gpu))))
        if isinstance(request, protocol.SetPolicy):
            self._require_operator(peer, "change the policy")
            await engine.call(msg.SetPolicy(policy=request.policy, by=peer.by))
            return {"policy": request.policy}
        if isinstance(request, protocol.JobLogPath):
            return await engine.call(Query(lambda state: self._log_path(state, request.job, peer)))
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

    async def _stream_events(self, stream: anyio.abc.SocketStream, from_seq: int) -> None:
        upto, live = self.engine.subscribe()
        try:
            await stream.send(protocol.frame(protocol.Reply(ok=True, data={"seq": upto})))
            if 0 < from_seq <= upto:
                for payload in await anyio.to_thread.run_sync(self._history, from_seq, upto):
                    await stream.send(protocol.frame(protocol.EventBatch(payload=payload)))
            async for payload in live:
                await stream.send(protocol.frame(protocol.EventBatch(payload=payload)))
        finally:
            self.engine.unsubscribe(live)

    def _history(self, from_seq: int, upto: int) -> list[bytes]:
        payloads = []
        for batch in eventlog.read_batches(log_dir(self.engine.state_dir), from_seq=from_seq):
            kept = [event for event in batch if from_seq <= event.seq <= upto]
            if kept:
                payloads.append(encode_many(kept))
            if batch and batch[-1].seq >= upto:
                break
        return payloads


async def _hang_up(stream: anyio.abc.SocketStream) -> None:
    """Close after an error reply without a reset that would destroy it.

    Closing with unread bytes in the receive buffer makes the kernel send RST,
    and the peer may lose the reply; so half-close, and discard a little input.
    """
    await stream.send_eof()
    with anyio.move_on_after(1.0):
        discarded = 0
        while discarded < (1 << 20):
            discarded += len(await stream.receive())


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
