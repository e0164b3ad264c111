"""A small synchronous client of the control socket (CLI, notebooks, scripts),
free of anyio and the scheduler's modules so that a CLI call starts fast."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterator

from eventsched.domain.events import Event, JobSpec, decode_many
from eventsched.domain.paths import socket_location
from eventsched.domain.tenants import Tenant
from eventsched.wire import protocol
from eventsched.wire.errors import OUT_OF_RANGE, ClientError, DaemonNotRunning, refused, went_away
from eventsched.wire.framing import connect, exchange, read_frame

if TYPE_CHECKING:
    from _socket import socket

__all__ = ["Client", "ClientError", "DaemonNotRunning", "read_new_output"]


def _frame(message: protocol.Request) -> bytes:
    try:
        return protocol.frame(message)
    except OverflowError:  # a user's number, e.g. --priority 99999999999999999999
        raise ClientError(OUT_OF_RANGE, "invalid") from None
    except UnicodeEncodeError:  # bytes a shell passed that are not UTF-8 text
        raise ClientError("a value is not UTF-8 text", "invalid") from None


def read_new_output(path: str | os.PathLike[str], position: int) -> bytes:
    """What a job's output file holds past ``position`` (b"" before it exists)."""
    try:
        with open(path, "rb") as f:
            f.seek(position)
            return f.read()
    except FileNotFoundError:
        return b""


class Client:
    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, timeout: float | None = 30.0) -> None:
        # a string, not a Path: the CLI's import path stays free of pathlib
        self.socket_path: str = os.fspath(socket_path) if socket_path else socket_location()
        self.timeout = timeout
        self._sock: socket | None = None

    def _connect(self) -> socket:
        return connect(self.socket_path, self.timeout)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    _decode = staticmethod(protocol.server_message_decoder.decode)

    def _receive(self, sock: socket) -> protocol.Reply | protocol.EventBatch:
        return self._decode(read_frame(sock))

    def request(self, req: protocol.Request) -> Any:
        """The reply's data, over the shared connection."""
        if self._sock is None:
            self._sock = self._connect()
        try:
            reply = self._decode(exchange(self._sock, _frame(req)))
        except (ClientError, OSError):
            self.close()
            raise
        if not isinstance(reply, protocol.Reply):
            raise ClientError("unexpected message from the daemon")
        if not reply.ok:
            raise refused(reply.error, reply.kind, reply.data)
        return reply.data

    def submit(self, spec: JobSpec) -> int:
        return int(self.request(protocol.SubmitJob(spec=spec))["id"])

    def submit_array(self, spec: JobSpec, indices: list[int]) -> list[int]:
        return [int(i) for i in self.request(protocol.SubmitJob(spec=spec, array=list(indices)))["ids"]]

    def submit_many(self, specs: list[JobSpec]) -> list[int]:
        """Pipelined, so that the daemon can commit them together; stops at the first refusal."""
        ids = []
        for reply in self._pipelined(specs):
            if not reply.ok:
                raise refused(reply.error, reply.kind, reply.data)
            ids.append(int(reply.data["id"]))
        return ids

    def submit_each(self, specs: list[JobSpec]) -> list[int | ClientError]:
        """``submit_many`` where a refusal does not stop the rest: per spec, its id or its refusal."""
        return [
            int(reply.data["id"]) if reply.ok else refused(reply.error, reply.kind, reply.data)
            for reply in self._pipelined(specs)
        ]

    def _pipelined(self, specs: list[JobSpec]) -> list[protocol.Reply]:
        """A window at a time, each sent before the last one's replies are read: the
        daemon stops reading a client that leaves many replies unread, so sending
        everything first could leave both sides waiting."""
        if self._sock is None:
            self._sock = self._connect()
        sock = self._sock
        window = 512
        chunks = [specs[i : i + window] for i in range(0, len(specs), window)]
        replies: list[protocol.Reply | protocol.EventBatch] = []
        try:
            for k in range(len(chunks) + 1):  # window k is sent, then window k - 1's replies read
                if k < len(chunks):
                    sock.sendall(b"".join(_frame(protocol.SubmitJob(spec=spec)) for spec in chunks[k]))
                if k > 0:
                    replies.extend(self._receive(sock) for _ in chunks[k - 1])
        except (ConnectionResetError, BrokenPipeError) as exc:
            self.close()
            raise went_away(exc, "the jobs") from None
        except (ClientError, OSError):
            self.close()
            raise
        if not all(isinstance(reply, protocol.Reply) for reply in replies):
            raise ClientError("unexpected message from the daemon")
        return replies  # type: ignore[return-value]  # every one a Reply (checked above)

    def jobs(self, all: bool = False, page: int = 250) -> list[dict]:
        """In id order, a page at a time so that a long listing never holds the
        daemon's loop long (``page=0``: one reply)."""
        if page <= 0:
            return self.request(protocol.ListJobs(all=all))
        out: list[dict] = []
        after = 0
        while True:
            reply = self.request(protocol.ListJobs(all=all, after=after, limit=page))
            out.extend(reply["jobs"])
            if reply["next"] is None:
                return out
            after = reply["next"] - 1

    def status(self) -> dict:
        return self.request(protocol.GetStatus())

    def cancel(self, jobs: list[int]) -> list[dict]:
        """Those cancelled, or ClientError naming each that was not (the others are cancelled all the same)."""
        result = self.cancel_each(jobs)
        if result["refused"]:
            raise ClientError("; ".join(f"job {r['job']}: {r['reason']}" for r in result["refused"]))
        return result["jobs"]

    def cancel_each(self, jobs: list[int], *, arrays: bool = False,
                    array_tasks: list[tuple[int, int]] | None = None) -> dict:
        """``{"jobs": [cancelled...], "refused": [{"job", "reason"}...]}``; ``arrays``: an
        array's id cancels all its tasks; ``array_tasks``: (array id, index) pairs."""
        return self.request(protocol.CancelJobs(jobs=list(jobs), arrays=arrays, array_tasks=list(array_tasks or [])))

    def hold(self, jobs: list[int]) -> list[dict]:
        return self.request(protocol.HoldJobs(jobs=jobs))

    def release(self, jobs: list[int]) -> list[dict]:
        return self.request(protocol.ReleaseJobs(jobs=jobs))

    def pause_gpu(self, gpu: int, node: str = "") -> dict:
        return self.request(protocol.PauseGpu(gpu=gpu, node=node))

    def resume_gpu(self, gpu: int, node: str = "") -> dict:
        return self.request(protocol.ResumeGpu(gpu=gpu, node=node))

    def tenants(self) -> list[dict]:
        return list(self.request(protocol.ListTenants()))

    def set_tenant(self, name: str, tenant: Tenant | None) -> list[dict]:
        return list(self.request(protocol.SetTenant(name=name, tenant=tenant)))

    def explain(self, job: int) -> dict:
        """Why ``job`` waits now (``reason``, null unless it waits) and its ``story``."""
        return self.request(protocol.ExplainJob(job=job))

    def log_path(self, job: int) -> str:
        return self.request(protocol.JobLogPath(job=job))["path"]

    def ping(self) -> dict:
        return self.request(protocol.Ping())

    def subscribe(self, from_seq: int = 0) -> Iterator[list[Event]]:
        """Events from ``from_seq`` (0: from now on), then live, on a connection of its own."""
        sock = self._connect()
        sock.settimeout(None)
        try:
            reply = self._decode(exchange(sock, protocol.frame(protocol.Subscribe(from_seq=from_seq))))
            if isinstance(reply, protocol.Reply) and not reply.ok:
                raise refused(reply.error, reply.kind, reply.data)
            while True:
                try:
                    message = self._receive(sock)
                except ClientError:
                    return
                if isinstance(message, protocol.EventBatch):
                    yield decode_many(message.payload)
        finally:
            sock.close()
