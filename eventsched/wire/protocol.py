"""The control socket's wire format: messages of msgpack, each after its
4-byte big-endian length. Every request (a tagged union) gets one ``Reply``;
``Subscribe`` then a stream of ``EventBatch``. The requesting user is never in
a request: the server takes it from the socket's peer credentials.
"""

from __future__ import annotations

import struct
from typing import Any, Union

import msgspec

from eventsched.domain.events import JobSpec
from eventsched.domain.tenants import Tenant

MAX_MESSAGE_BYTES = 1 << 20  # a request larger than this is hostile or a bug
HEADER = struct.Struct(">I")


class Request(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    pass


class SubmitJob(Request, frozen=True):
    # the spec's user, uid, gid, groups and home: the server's, from the peer credentials
    spec: JobSpec
    array: list[int] = []  # --array: the indices (one task each), accepted all or none


class ListJobs(Request, frozen=True):
    all: bool = False
    # one page, ids above ``after``, at most ``limit`` (0: every job
    # in one reply); a paged reply is {"jobs": [...], "next": id or null}
    after: int = 0
    limit: int = 0


class GetStatus(Request, frozen=True):
    pass


class CancelJobs(Request, frozen=True):
    # cancels every job it can (see Client.cancel_each); with ``arrays`` an
    # array's id stands for all its tasks, ``array_tasks`` are (array id, index)
    jobs: list[int]
    arrays: bool = False
    array_tasks: list[tuple[int, int]] = []


class HoldJobs(Request, frozen=True):
    jobs: list[int]


class ReleaseJobs(Request, frozen=True):
    jobs: list[int]


class UpdateJob(Request, frozen=True):
    job: int
    priority: int | None = None
    time_limit_s: float | None = None
    gpus: float | None = None
    name: str | None = None


class PauseGpu(Request, frozen=True):
    gpu: int
    node: str = ""


class ResumeGpu(Request, frozen=True):
    gpu: int
    node: str = ""


class SetPolicy(Request, frozen=True):
    policy: str


class ListTenants(Request, frozen=True):
    pass


class SetTenant(Request, frozen=True):
    """A tenant's whole new definition (None: remove it); only root or the daemon's user."""
    name: str
    tenant: Tenant | None = None


class CreateReservation(Request, frozen=True):
    """For ``user`` (default: the caller) or ``tenant``'s members; ``gpu_ids``, or any ``gpus`` of one node."""
    start: float
    end: float
    user: str = ""
    tenant: str = ""
    gpus: int = 0
    gpu_ids: list[int] | None = None
    node: str = ""
    name: str = ""


class ListReservations(Request, frozen=True):
    pass


class CancelReservation(Request, frozen=True):
    reservation: int


class JobLogPath(Request, frozen=True):
    job: int


class ExplainJob(Request, frozen=True):
    job: int


class Alternative(msgspec.Struct, frozen=True, kw_only=True):
    """Another request for a waiting job: None keeps the job's own."""
    gpus: float | None = None
    gpu_mem_mib: int | None = None


class ForecastAlternatives(Request, frozen=True):
    """When a waiting job would start had it asked for each of these instead (its own first)."""
    job: int
    alternatives: list[Alternative] = []


class RunSql(Request, frozen=True):
    """Read-only SQL over the history, for users who cannot read a root daemon's log."""
    query: str


class Ping(Request, frozen=True):
    pass


class Subscribe(Request, frozen=True):
    from_seq: int = 0  # 0 = only events after now


# --- API tokens (`eventsched token`): only over the socket, whose peer is known ---


class CreateToken(Request, frozen=True):
    """The reply holds the secret, which the daemon keeps only as a hash."""
    name: str = ""
    for_uid: int = -1  # -1: the peer itself; another user's: root only


class ListTokens(Request, frozen=True):
    pass


class RevokeToken(Request, frozen=True):
    token: str  # its id or its name


# --- notification hooks (`eventsched notify`): the peer's own, so only over the socket ---


class SetNotify(Request, frozen=True):
    """Replaces the peer's hook; all empty: removes it."""
    webhook: str = ""
    secret: str = ""
    on: list[str] = []  # [] : every kind
    mail: list[str] = []  # a command (argv, no shell) given the message on stdin


class ListNotify(Request, frozen=True):
    pass


AnyRequest = Union[
    SubmitJob, ListJobs, GetStatus, CancelJobs, HoldJobs, ReleaseJobs, PauseGpu,
    ResumeGpu, SetPolicy, ListTenants, SetTenant, JobLogPath, ExplainJob, ForecastAlternatives, RunSql,
    Ping, Subscribe, CreateToken, ListTokens, RevokeToken, UpdateJob,
    CreateReservation, ListReservations, CancelReservation, SetNotify, ListNotify,
]


class Reply(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    ok: bool
    error: str = ""
    kind: str = ""  # a refusal's RefusalKind; its data, if any: {"existing": job}
    data: Any = None


class EventBatch(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    # events already encoded with events.encode_many: the server encodes each
    # batch once, however many subscribers it has
    payload: bytes


AnyServerMessage = Union[Reply, EventBatch]

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(AnyRequest)
server_message_decoder = msgspec.msgpack.Decoder(AnyServerMessage)


def frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


def too_long(length: int) -> str:
    return f"message of {length} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit"
