"""One client connection to the control socket: framing, replies in request
order, flow control and event subscriptions.

asyncio buffered protocols, not anyio streams: a request is handed to the
engine with a callback that writes its reply (no task switch of its own), and
all connections read into one shared buffer. Compiled with mypyc
(``eventsched/_compiled.py``); ``Connection`` stays an ordinary class to Python.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import select
import socket
import struct
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import anyio
import anyio.abc
import msgspec

from eventsched.domain.messages import RefusalKind, Refused
from eventsched.domain.text import printable
from eventsched.domain.visibility import BatchView
from eventsched.projections.cluster import ClusterState
from eventsched.runtime.api.fair_use import FairUse
from eventsched.runtime.api.feed import Feed
from eventsched.wire import protocol

logger = logging.getLogger("eventsched.server")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
SUBSCRIBER_BACKLOG_BYTES = 16 << 20  # further behind: cut off (it resubscribes), not memory without bound
# stop reading a connection while this much of its replies is unread (resume
# at the low mark), or while it has this many requests unanswered
WRITE_HIGH_WATER = 256 << 10
WRITE_LOW_WATER = 64 << 10
MAX_OUTSTANDING_REPLIES = 256
SUBSCRIBER_STALL_S = 60.0  # a subscriber whose history has not drained this long is dropped
READ_CHUNK = 64 << 10  # the shared read buffer: one recv reads at most this much


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


Reply = Callable[[Any, Refused | None], None]


def refusal_reply(refusal: Refused) -> protocol.Reply:
    data = {"existing": refusal.existing} if refusal.existing is not None else None
    return protocol.Reply(ok=False, error=refusal.reason, kind=refusal.kind, data=data)


class Flushable(Protocol):
    def flush(self) -> None: ...

    def cut_off(self, why: str) -> None: ...


class Flusher:
    """Connections with replies ready: written once the engine has answered its
    whole batch (``flush_all``, before the effects are performed), or at the end
    of this loop step for any other reply."""

    def __init__(self) -> None:
        self._unflushed: list[Flushable] = []
        self._handle: asyncio.Handle | None = None

    def soon(self, conn: Flushable) -> None:
        self._unflushed.append(conn)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_soon(self.flush_all)

    def flush_all(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        connections, self._unflushed = self._unflushed, []
        for conn in connections:
            try:
                conn.flush()
            except Exception:  # runs inside the engine's loop: a bug costs this connection, not the engine
                logger.exception("writing replies failed")
                conn.cut_off("could not be written its replies")


class Context:
    def __init__(
        self,
        *,
        fair_use: FairUse,
        feed: Feed,
        flusher: Flusher,
        dispatch: Callable[[protocol.Request, Peer, Reply, Connection], None],
        start_soon: Callable[..., Any],
        read_buffer: memoryview,
    ) -> None:
        self.fair_use = fair_use
        self.feed = feed
        self.flusher = flusher
        self.dispatch = dispatch  # hands a request on (to the engine, or a task); its reply is called once
        self.start_soon = start_soon  # runs a task in the server's task group
        self.read_buffer = read_buffer  # every connection reads into it (see get_buffer)


class Connection(asyncio.BufferedProtocol):
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.fair_use = ctx.fair_use
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
        self._flush_soon = False  # it is in the flusher's list
        self._waiting_share = False  # its user has their share of requests in the engine

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        try:
            self.peer = peer_credentials(transport.get_extra_info("socket"))
        except OSError:
            self.closed = True
            transport.abort()
            return
        refusal = self.fair_use.admit(self, self.peer.uid, self.peer.pid)
        if refusal is not None:
            # one clear reply, then the slot is free again at once
            self.closed = True
            transport.write(protocol.frame(protocol.Reply(ok=False, error=refusal, kind=RefusalKind.OVER_LIMIT)))
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
        self.ctx.feed.subscribers.discard(self)
        if self.admitted:
            self.admitted = False
            assert self.peer is not None
            self.fair_use.release(self, self.peer.uid)

    def eof_received(self) -> bool:
        # a half-close after the last request: answer what is pending, then
        # close; a subscriber that hangs up is gone: close now
        self.eof = True
        return not self.subscribed and (bool(self.slots) or self._complete_request_waits())

    def pause_writing(self) -> None:
        self._write_paused = True
        self._drained.clear()
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._drained.set()
        self._process()

    def unread(self) -> int:
        if self.closed or self.transport is None:
            return 0
        return self.transport.get_write_buffer_size() + self._slot_bytes

    def gone(self) -> bool:
        """Closed, or its client hung up altogether (a half-close is not gone)."""
        if self.closed or self.transport is None:
            return True
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return True
        try:
            poller = select.poll()
            poller.register(sock.fileno(), 0)  # POLLHUP and POLLERR are always reported
            return any(events & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, events in poller.poll(0))
        except (OSError, ValueError):
            return True

    def guard(self, read: Callable[[ClusterState], Any]) -> Callable[[ClusterState], Any]:
        """``read``, skipped when nobody will read its answer: the connection is
        gone, or its user already leaves half their share unread."""

        def guarded(state: ClusterState) -> Any:
            if self.closed:
                return None
            limit = self.fair_use.limits.max_unread_bytes_per_user
            assert self.peer is not None
            waiting = self.fair_use.unread_by(self.peer.uid)
            if waiting >= limit // 2:
                raise Refused(
                    RefusalKind.OVER_LIMIT,
                    f"uid {self.peer.uid} leaves {waiting} bytes of replies unread (limit {limit}); read them first",
                )
            return read(state)

        return guarded

    def _update_reading(self) -> None:
        if self.closed or self.transport is None:
            return
        pause = not self.subscribed and (
            self._write_paused or len(self.slots) >= MAX_OUTSTANDING_REPLIES or self._waiting_share
        )
        if pause != self._reading_paused:
            self._reading_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _write(self, data: bytes) -> bool:
        """Write, unless this user leaves too much unread: then cut off."""
        if self.closed or self.transport is None or not self._may_buffer(len(data)):
            return False
        self.transport.write(data)
        return True

    def _may_buffer(self, size: int) -> bool:
        assert self.peer is not None
        if self.fair_use.may_buffer(self.peer.uid, size):
            return True
        self.cut_off(f"leaves more than {self.fair_use.limits.max_unread_bytes_per_user} bytes unread")
        return False

    def cut_off(self, why: str) -> None:
        if self.closed or self.transport is None:
            return
        assert self.peer is not None
        logger.warning("cut off a connection of uid %d (pid %d): it %s", self.peer.uid, self.peer.pid, why)
        self.closed = True
        self.transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        # shared: asyncio calls buffer_updated right after the recv, before any other reads
        return self.ctx.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self.subscribed or self.closed:
            return  # a subscriber has nothing more to say
        self.buffer += self.ctx.read_buffer[:nbytes]
        self._process()

    def _process(self) -> None:
        """Handle the complete requests in the buffer, as far as flow control allows."""
        if self._processing:
            return
        self._processing = True
        try:
            buffer = self.buffer
            header_size = protocol.HEADER.size
            unpack_header = protocol.HEADER.unpack_from  # read in place: no copy of the header
            while (
                len(buffer) >= header_size
                and not self.closed
                and not self.subscribed
                and not self._write_paused
                and len(self.slots) < MAX_OUTSTANDING_REPLIES
                and self._may_dispatch()
            ):
                (length,) = unpack_header(buffer)
                if length > protocol.MAX_MESSAGE_BYTES:
                    # the stream cannot be re-synchronised after this
                    self._reply_now(protocol.Reply(ok=False, error=protocol.too_long(length), kind=RefusalKind.INVALID))
                    self._hang_up()
                    return
                end = header_size + length
                if len(buffer) < end:
                    break
                body = bytes(buffer[header_size:end])
                del buffer[:end]
                self._request(body)
        finally:
            self._processing = False
        self._update_reading()
        if self.eof and not self.slots and not self.subscribed and not self.closed and self.transport is not None:
            if not self._complete_request_waits():
                self.transport.close()

    def _may_dispatch(self) -> bool:
        assert self.peer is not None
        self._waiting_share = not self.fair_use.may_dispatch(self, self.peer.uid)
        return not self._waiting_share

    def resume_share(self) -> None:
        self._waiting_share = False
        self._process()

    def _complete_request_waits(self) -> bool:
        header_size = protocol.HEADER.size
        if len(self.buffer) < header_size:
            return False
        (length,) = protocol.HEADER.unpack(bytes(self.buffer[:header_size]))
        return len(self.buffer) >= header_size + length

    def _request(self, body: bytes) -> None:
        try:
            request = protocol.request_decoder.decode(body)
        # msgspec raises UnicodeDecodeError for a string not UTF-8, RecursionError for deep nesting
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            # the error may quote the peer's bytes: escape them so it stays one printable line
            error = f"bad request: {printable(str(exc))}"
            self._reply_now(protocol.Reply(ok=False, error=error, kind=RefusalKind.INVALID))
            return
        if isinstance(request, protocol.Subscribe):
            self._subscribe(request.from_seq)
            return
        slot: list[bytes | None] = [None]
        self.slots.append(slot)
        assert self.peer is not None
        uid = self.peer.uid
        self.fair_use.dispatched(uid)
        counted = True

        def reply(result: Any, error: Refused | None) -> None:
            nonlocal counted
            if counted:  # exactly once, even for a connection already gone
                counted = False
                self.fair_use.answered(uid)
            if self.closed:
                return
            data = protocol.frame(refusal_reply(error) if error is not None else protocol.Reply(ok=True, data=result))
            if not self._may_buffer(len(data)):
                return
            slot[0] = data
            self._slot_bytes += len(data)
            # one write per connection for the engine's whole batch
            if not self._flush_soon:
                self._flush_soon = True
                self.ctx.flusher.soon(self)

        try:
            self.ctx.dispatch(request, self.peer, reply, self)
        except Exception as exc:  # a bug must cost one reply, not the daemon
            logger.exception("request %s failed", type(request).__name__)
            reply(None, Refused(RefusalKind.UNAVAILABLE, f"internal error: {exc}"))

    def _reply_now(self, message: protocol.Reply) -> None:
        data = protocol.frame(message)
        self.slots.append([data])
        self._slot_bytes += len(data)
        self.flush()

    def flush(self) -> None:
        self._flush_soon = False
        ready: list[bytes] = []
        while self.slots and self.slots[0][0] is not None:
            data = self.slots.popleft()[0]
            assert data is not None
            self._slot_bytes -= len(data)
            ready.append(data)
        if ready:
            if self.closed or self.transport is None:
                return
            # their sizes were checked when they were framed
            self.transport.write(ready[0] if len(ready) == 1 else b"".join(ready))
        # answered requests make room for the next ones in the buffer
        self._process()

    def _hang_up(self) -> None:
        """Close after an error reply without a reset that would destroy it."""
        assert self.transport is not None
        self.subscribed = True  # ignore further input
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(1.0, self.transport.close)

    def _subscribe(self, from_seq: int) -> None:
        """History from ``from_seq`` (in chunks, each once the last drained), then every live batch."""
        assert self.transport is not None and self.peer is not None
        self.subscribed = True
        self._update_reading()  # input is ignored from now on
        self._backlog = []
        upto = self.ctx.feed.subscribe(self)
        self._write(protocol.frame(protocol.Reply(ok=True, data={"seq": upto})))
        self.ctx.start_soon(self._send_history, from_seq, upto)

    def deliver(self, view: BatchView) -> None:
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
        """Write once the client has read what it was sent before (False: gone or cut off)."""
        if not self._drained.is_set():
            with anyio.move_on_after(SUBSCRIBER_STALL_S):
                await self._drained.wait()
            if not self._drained.is_set():
                self.cut_off(f"read none of its history for {SUBSCRIBER_STALL_S:g} s")
                return False
        return self._write(data)

    async def _send_history(self, from_seq: int, upto: int) -> None:
        assert self.peer is not None
        feed = self.ctx.feed
        cursor = None
        try:
            if 0 < from_seq <= upto:
                async with feed.slot(self.peer.uid):
                    cursor = feed.history(from_seq)
                    done = False
                    while not done and not self.closed:
                        payloads, done = await anyio.to_thread.run_sync(
                            feed.chunk, cursor, from_seq, upto, self.peer.uid, limiter=feed.limiter
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
