"""``serve --http HOST:PORT``: a small JSON API for remote clients (docs/http-api.md).

Starlette on hypercorn, on the daemon's own event loop (given its socket and a
shutdown trigger, so it installs no signal handlers). A request's bearer token
names a user (``tokens``); the request becomes the ``protocol`` request the
socket would have received, dispatched by ``Server.dispatch`` as that user, so
a token's user may do over HTTP exactly what they may on the socket. Starlette
and hypercorn (the ``http`` extra) are imported only when the API is started.
"""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import logging
import os
import pwd
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio
import anyio.abc
import msgspec

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import RefusalKind, Refused
from eventsched.domain.states import FINAL
from eventsched.domain.text import printable
from eventsched.runtime.api.connection import Peer
from eventsched.runtime.api.metrics_http import read_metrics
from eventsched.wire import protocol
from eventsched.wire.errors import OUT_OF_RANGE
from eventsched.wire.http_client import API_MARK

_MARK_HEADER = (API_MARK[0].lower().encode(), API_MARK[1].encode())

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from eventsched.runtime.api.server import Server

logger = logging.getLogger("eventsched.http")

LIST_PAGE = 250  # jobs per read of the daemon's state when listing
OUTPUT_CHUNK = 256 * 1024  # bytes of a job's output read at a time
OUTPUT_POLL_S = 0.1  # a followed job's output file is looked at this often
STATE_POLL_S = 0.5  # and whether the job has ended, this often (as `logs -f` on the socket)
MAX_BODY_BYTES = protocol.MAX_MESSAGE_BYTES  # the socket's bound on one request
# an oversized body is read and thrown away up to this much before the 413: clients
# that send the whole body before reading would get EPIPE instead of the answer
DISCARD_BODY_BYTES = 16 * MAX_BODY_BYTES
INSTALL_HINT = "serve --http needs the `http` extra: pip install 'eventsched[http]' (Starlette and hypercorn)"
SECRET_ENV = ("EVENTSCHED_TOKEN",)  # never into a job's environment (and so into the log)
ACCOUNT_TTL_S = 60.0  # a user's gid and groups are looked up again after this long
ANONYMOUS = Peer(pid=0, uid=65534, gid=65534, groups=())  # health's asker: who it is does not matter


def read_output(path: str, position: int) -> bytes:
    """Up to OUTPUT_CHUNK bytes of a job's output past ``position`` (b"" before it
    exists); read for the asker, so a link at its path is not followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return b""
    try:
        return os.pread(fd, OUTPUT_CHUNK, position)
    finally:
        os.close(fd)


class HttpSetupError(Exception):
    """``--http`` cannot be served as asked; str() says why, in one line."""


@dataclass
class HttpPlan:
    config: Any  # hypercorn.config.Config, bound to the listening socket's fd
    url: str


def split_address(text: str) -> tuple[str, int]:
    host, colon, port_text = text.rpartition(":")
    if not colon or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise HttpSetupError(f"--http wants HOST:PORT, e.g. 127.0.0.1:8080, not {text!r}")
    return host.removeprefix("[").removesuffix("]"), int(port_text)


def _addresses(host: str) -> list[str]:
    """``host``'s addresses (a name looked up); OSError when it has none."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        return [str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]


def prepare(address: str, *, allow_remote: bool = False) -> HttpPlan:
    """Check ``--http``'s address and bind it, before the daemon starts (so a
    mistake is one line and exit 2, and a port in use is found at once)."""
    host, port = split_address(address)
    try:
        addresses = _addresses(host)
    except OSError as exc:
        raise HttpSetupError(f"--http {address}: cannot resolve {host!r} ({exc.strerror or exc})") from None
    if not allow_remote and not all(ipaddress.ip_address(a).is_loopback for a in addresses):
        raise HttpSetupError(
            f"--http {address} is not a loopback address: tokens and jobs would cross the network in clear text. "
            "Bind 127.0.0.1 and put a TLS reverse proxy in front (docs/http-api.md), "
            "or add --http-allow-remote if something else encrypts the link"
        )
    if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("hypercorn") is None:
        raise HttpSetupError(INSTALL_HINT)
    try:  # bound here, so a port in use is said at once; hypercorn serves this socket (fd://)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=family, backlog=128)
    except OSError as exc:
        raise HttpSetupError(f"--http {address}: {exc.strerror or exc}") from None
    from hypercorn.config import Config

    config = Config()
    bound = listener.getsockname()
    config.bind = [f"fd://{listener.detach()}"]  # hypercorn owns (and closes) it from here on
    config.accesslog = None
    config.errorlog = logger  # through the daemon's JSON log
    config.graceful_timeout = 2.0
    config.keep_alive_timeout = 30.0
    config.h11_max_incomplete_size = 64 * 1024  # request line and headers
    config.include_server_header = False
    shown = f"[{bound[0]}]" if family == socket.AF_INET6 else bound[0]
    return HttpPlan(config=config, url=f"http://{shown}:{bound[1]}")


HTTP_STATUS = {RefusalKind.INVALID: 400, RefusalKind.FORBIDDEN: 403, RefusalKind.NOT_FOUND: 404,
               RefusalKind.CONFLICT: 409, RefusalKind.UNAVAILABLE: 503, RefusalKind.OVER_LIMIT: 429}


class ApiError(Refused):
    """A refusal with a status of its own rather than its kind's (401, 413)."""

    def __init__(self, status: int, kind: RefusalKind, reason: str) -> None:
        super().__init__(kind, reason)
        self.status = status


def _unauthorized(reason: str) -> ApiError:
    return ApiError(401, RefusalKind.FORBIDDEN, reason)


class SubmitBody(msgspec.Struct, forbid_unknown_fields=True):
    spec: JobSpec
    array: list[int] = []


class CancelBody(msgspec.Struct, forbid_unknown_fields=True):
    jobs: list[int] = []
    arrays: bool = False
    array_tasks: list[tuple[int, int]] = []


class Api:
    """The endpoints, each called with (request, the token's user; ANONYMOUS for health),
    each turning an HTTP request into a socket request as that user."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self._accounts: dict[int, tuple[float, Peer | None]] = {}
        self.stopping = asyncio.Event()  # set when the API stops: followed outputs end at once

    def peer_of(self, uid: int) -> Peer | None:
        """``uid`` as the socket would see it: gid and groups from the user
        database (cached for ACCOUNT_TTL_S); None if the user is gone."""
        now = time.monotonic()
        cached = self._accounts.get(uid)
        if cached is not None and now - cached[0] < ACCOUNT_TTL_S:
            return cached[1]
        try:
            entry = pwd.getpwuid(uid)
            groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
            peer: Peer | None = Peer(pid=0, uid=uid, gid=entry.pw_gid, groups=groups)
        except KeyError:
            peer = None
        if len(self._accounts) > 4096:
            self._accounts.clear()
        self._accounts[uid] = (now, peer)
        return peer

    def authenticate(self, request: Request) -> Peer:
        header = request.headers.get("authorization", "")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise _unauthorized("missing token: send `Authorization: Bearer TOKEN` (make one with `eventsched token create`)")
        record = self.server.token_store().lookup(secret.strip())
        if record is None:
            client = request.client.host if request.client else "?"
            logger.warning("refused a request from %s: unknown or revoked token", client)
            raise _unauthorized("unknown or revoked token")
        peer = self.peer_of(record.uid)
        if peer is None:
            raise _unauthorized(f"the user of token {record.id} (uid {record.uid}) no longer exists")
        return peer

    async def ask(self, request: protocol.Request, peer: Peer) -> Any:
        done: asyncio.Future[tuple[Any, Refused | None]] = asyncio.get_running_loop().create_future()

        def reply(result: Any, error: Refused | None) -> None:
            if not done.done():
                done.set_result((result, error))

        self.server.dispatch(request, peer, reply)
        result, error = await done
        if error is not None:
            raise error
        return result

    async def body(self, request: Request, kind: type[msgspec.Struct]) -> Any:
        length = request.headers.get("content-length")
        announced_over = length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES)
        data = bytearray()
        seen = 0
        try:
            async for chunk in request.stream():
                seen += len(chunk)
                if seen <= MAX_BODY_BYTES:
                    data += chunk
                elif seen > DISCARD_BODY_BYTES:
                    break
        except Exception:  # noqa: BLE001 - an announced 413 goes out whatever the stream did
            if not announced_over:
                raise
        if announced_over or seen > MAX_BODY_BYTES:
            raise ApiError(413, RefusalKind.OVER_LIMIT, f"the body is over the {MAX_BODY_BYTES}-byte limit")
        try:
            decoded = msgspec.json.decode(bytes(data), type=kind)
            # JSON's integers have no bound, the log's (msgpack) do: one it could not write is refused
            # here, as the socket's frames cannot carry one at all
            msgspec.msgpack.encode(decoded)
        except msgspec.ValidationError as exc:
            raise Refused(RefusalKind.INVALID, f"bad request: {exc}") from None
        except OverflowError:
            raise Refused(RefusalKind.INVALID, f"bad request: {OUT_OF_RANGE}") from None
        # msgspec raises UnicodeDecodeError for a string not UTF-8, RecursionError for deep nesting
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise Refused(RefusalKind.INVALID, f"malformed JSON: {printable(str(exc))}") from None
        return decoded

    async def health(self, request: Request, peer: Peer) -> Any:
        answer = await self.ask(protocol.Ping(), peer)
        body = {k: v for k, v in answer.items() if k != "state_dir"}  # no token: no paths either
        if body.get("ok", True):
            return body
        from starlette.responses import JSONResponse

        return JSONResponse(body, status_code=503)  # still waiting for nodes: a load balancer sees it too

    async def metrics(self, request: Request, peer: Peer) -> str:
        return await read_metrics(self.server.engine)

    async def submit(self, request: Request, peer: Peer) -> Any:
        body: SubmitBody = await self.body(request, SubmitBody)
        spec = body.spec
        if any(name in spec.env for name in SECRET_ENV):
            spec = msgspec.structs.replace(spec, env={k: v for k, v in spec.env.items() if k not in SECRET_ENV})
        return await self.ask(protocol.SubmitJob(spec=spec, array=body.array), peer)

    async def jobs(self, request: Request, peer: Peer) -> Any:
        everything = _flag(request, "all")
        # a page at a time, as the CLI asks: a long queue never holds the loop for long
        out: list[Any] = []
        after = 0
        while True:
            page = await self.ask(protocol.ListJobs(all=everything, after=after, limit=LIST_PAGE), peer)
            out.extend(page["jobs"])
            if page["next"] is None:
                return out
            after = page["next"] - 1

    async def job(self, request: Request, peer: Peer) -> Any:
        job_id = request.path_params["job"]
        if job_id > 0:  # the page that starts at this id: one job looked at, not the whole list
            page = await self.ask(protocol.ListJobs(all=True, after=job_id - 1, limit=1), peer)
            if page["jobs"] and page["jobs"][0]["id"] == job_id:
                return page["jobs"][0]
        raise Refused(RefusalKind.NOT_FOUND, f"no job {job_id}")

    async def cancel(self, request: Request, peer: Peer) -> Any:
        body: CancelBody = await self.body(request, CancelBody)
        if not body.jobs and not body.array_tasks:
            raise Refused(RefusalKind.INVALID, "no job id given")
        cancel = protocol.CancelJobs(jobs=body.jobs, arrays=body.arrays, array_tasks=body.array_tasks)
        return await self.ask(cancel, peer)

    async def cancel_one(self, request: Request, peer: Peer) -> Any:
        job_id = request.path_params["job"]
        result = await self.ask(protocol.CancelJobs(jobs=[job_id]), peer)
        if result["refused"]:
            refused = result["refused"][0]
            raise Refused(refused["kind"], f"job {job_id}: {refused['reason']}")
        return result["jobs"][0]

    async def explain(self, request: Request, peer: Peer) -> Any:
        return await self.ask(protocol.ExplainJob(job=request.path_params["job"]), peer)

    async def logs(self, request: Request, peer: Peer) -> Any:
        """The job's output from byte ``offset`` on; ``follow``: until the job ends.
        One cut short (the client gone, the daemon stopping) ends without HTTP's
        last chunk, so no client takes it as whole."""
        follow = _flag(request, "follow")
        offset = request.query_params.get("offset", "0")
        if not (offset.isdecimal() and len(offset) <= 18):  # 18 digits: an offset a file can have
            raise Refused(RefusalKind.INVALID, f"offset must be a byte count, not {printable(offset[:40])!r}")
        ask = protocol.JobLogPath(job=request.path_params["job"])
        info = await self.ask(ask, peer)  # who may read it: the socket's rule (the owner or an operator)

        async def stream(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/octet-stream")]})
            position, state, checked = int(offset), info["state"], time.monotonic()
            while not (self.stopping.is_set() or await request.is_disconnected()):
                chunk = await anyio.to_thread.run_sync(read_output, info["path"], position)
                if chunk:
                    position += len(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                elif not follow or state in FINAL:  # this read, after the end, caught the last output
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                else:
                    await anyio.sleep(OUTPUT_POLL_S)
                    if time.monotonic() - checked >= STATE_POLL_S:
                        try:
                            state, checked = (await self.ask(ask, peer))["state"], time.monotonic()
                        except Refused:  # the daemon stopping or overloaded: cut short
                            return

        return stream

    async def status(self, request: Request, peer: Peer) -> Any:
        return await self.ask(protocol.GetStatus(), peer)


def _flag(request: Request, name: str) -> bool:
    return request.query_params.get(name, "").lower() in ("1", "true", "yes")


def build_app(api: Api) -> Starlette:
    from starlette.applications import Starlette
    from starlette.convertors import IntegerConvertor, register_url_convertor
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    def endpoint(handler: Callable[[Request, Peer], Awaitable[Any]], created: int = 200,
                 token: bool = True) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                result = await handler(request, api.authenticate(request) if token else ANONYMOUS)
            except Refused as exc:
                status = exc.status if isinstance(exc, ApiError) else HTTP_STATUS[exc.kind]
                headers = {"WWW-Authenticate": 'Bearer realm="eventsched"'} if status == 401 else None
                body: dict[str, Any] = {"error": exc.reason, "kind": exc.kind}
                if exc.existing is not None:
                    body["existing"] = exc.existing
                return JSONResponse(body, status_code=status, headers=headers)
            except Exception as exc:  # a bug must cost one reply, not the daemon
                logger.exception("HTTP %s %s failed", request.method, request.url.path)
                return JSONResponse({"error": f"internal error: {exc}"}, status_code=500)
            if callable(result):  # an ASGI reply of its own: a job's output, streamed
                return result
            if isinstance(result, str):
                return PlainTextResponse(result, media_type="text/plain; version=0.0.4; charset=utf-8")
            return Response(msgspec.json.encode(result), status_code=created, media_type="application/json")

        return run

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = RefusalKind.NOT_FOUND if exc.status_code == 404 else RefusalKind.INVALID  # no route, or not that method
        where = printable(request.url.path[:200])
        return JSONResponse({"error": f"{exc.detail}: {request.method} {where}", "kind": kind}, status_code=exc.status_code)

    class JobId(IntegerConvertor):
        regex = "[0-9]{1,18}"  # a longer one is no job (a 404), never a number int() refuses (a 500)

    register_url_convertor("job", JobId())
    routes = [
        Route("/health", endpoint(api.health, token=False), methods=["GET"]),
        Route("/metrics", endpoint(api.metrics), methods=["GET"]),
        Route("/v1/jobs", endpoint(api.submit, created=201), methods=["POST"]),
        Route("/v1/jobs", endpoint(api.jobs), methods=["GET"]),
        Route("/v1/jobs/{job:job}", endpoint(api.job), methods=["GET"]),
        Route("/v1/jobs/{job:job}", endpoint(api.cancel_one), methods=["DELETE"]),
        Route("/v1/jobs/{job:job}/explain", endpoint(api.explain), methods=["GET"]),
        Route("/v1/jobs/{job:job}/logs", endpoint(api.logs), methods=["GET"]),
        Route("/v1/cancel", endpoint(api.cancel), methods=["POST"]),
        Route("/v1/status", endpoint(api.status), methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, middleware=[Middleware(_Marked)])


class _Marked:
    """Puts ``API_MARK`` on every answer, refusals and unknown routes included."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def marked(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), _MARK_HEADER]}
            await send(message)

        await self.app(scope, receive, marked if scope["type"] == "http" else send)


async def serve_http(server: Server, plan: HttpPlan, *,
                     task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    from hypercorn.asyncio import serve

    api = Api(server)
    app = build_app(api)
    # a plain asyncio task asked to stop and given time to finish: a cancel
    # scope would leave its shutdown half done
    stop = asyncio.Event()
    task = asyncio.ensure_future(serve(app, plan.config, shutdown_trigger=stop.wait, mode="asgi"))  # type: ignore[arg-type]
    task_status.started()
    logger.info("HTTP API on %s (tokens: `eventsched token create`)", plan.url)
    try:
        await asyncio.wait({task})  # returns if hypercorn stops by itself
    finally:
        api.stopping.set()
        stop.set()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({task}, timeout=plan.config.graceful_timeout + 1.0)
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is not None:
            logger.error("the HTTP API stopped: %s", task.exception())
