"""The CLI's client of ``serve --http`` (``EVENTSCHED_URL`` and ``EVENTSCHED_TOKEN``):
``client.Client``'s methods that the CLI's commands use and its ``ClientError``, so
the handlers do not know which transport they talk to. Standard library only."""

from __future__ import annotations

import json
import os
from urllib.parse import urlsplit

from eventsched.wire.errors import ClientError, refused

TYPE_CHECKING = False  # typing is costly to import (cli/quick.py's fast path comes here too)
if TYPE_CHECKING:
    from typing import Any, Iterator

__all__ = ["HttpClient", "from_environment", "API_MARK"]

OUTPUT_CHUNK = 64 * 1024  # a job's output is printed as it comes, at most this much at a time
# every answer of the API carries this header: an answer without it is another server's,
# whose JSON (or page) must not be read as a job, a status or a job's output
API_MARK = ("Eventsched-Api", "1")


def from_environment() -> "HttpClient":
    url = os.environ.get("EVENTSCHED_URL", "")
    token = os.environ.get("EVENTSCHED_TOKEN", "")
    if not token:
        raise ClientError(f"EVENTSCHED_URL is set ({url}) but EVENTSCHED_TOKEN is not: make a token with "
                          "`eventsched token create` on the daemon's machine, or unset EVENTSCHED_URL to use "
                          "the local socket")
    return HttpClient(url, token)


class HttpClient:
    def __init__(self, url: str, token: str, *, timeout: float | None = 30.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ClientError(f"EVENTSCHED_URL must look like http://HOST:PORT or https://HOST, not {url!r}")
        self.url = url.rstrip("/")
        self._parts = parts
        self._base = parts.path.rstrip("/")  # behind a proxy, the API may sit under a path
        self.token = token
        self.timeout = timeout
        self._conn: Any = None

    def _connection(self) -> Any:
        if self._conn is None:
            from http.client import HTTPConnection, HTTPSConnection

            kind = HTTPSConnection if self._parts.scheme == "https" else HTTPConnection
            self._conn = kind(self._parts.hostname or "", self._parts.port, timeout=self.timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> "HttpClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, data: bytes | None = None, *, whole: bool = True) -> tuple[Any, bytes]:
        """The response and its body (``whole``: all of it; else only an error's)."""
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json",
                   **({} if data is None else {"Content-Type": "application/json"})}
        again = method == "GET"  # only a GET is sent again: a POST the server may have seen is not repeated
        while True:  # a kept-alive connection the server closed meanwhile: once more, anew
            reused = self._conn is not None
            conn = self._connection()
            try:
                conn.request(method, self._base + path, body=data, headers=headers)
                response = conn.getresponse()
                if response.getheader(API_MARK[0]) != API_MARK[1]:
                    self.close()
                    raise ClientError(f"{self.url} is not an eventsched API (it answered HTTP {response.status} "
                                      f"{response.reason}); check EVENTSCHED_URL")
                return response, response.read() if whole or response.status >= 400 else b""
            except OSError as exc:
                self.close()
                if isinstance(exc, TimeoutError):
                    raise
                if not (again and reused):
                    raise ClientError(f"no eventsched API answers at {self.url} "
                                      f"({getattr(exc, 'strerror', None) or exc}); "
                                      "is the daemon serving with --http?") from None
                again = False

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """The reply's JSON, or ClientError with the API's reason."""
        return self._answer(*self._send(method, path, None if body is None else json.dumps(body).encode()))

    def _answer(self, response: Any, raw: bytes) -> Any:
        try:
            answer = json.loads(raw) if raw else None
        except ValueError:
            answer = None
        if response.status >= 400:
            reason = answer.get("error") if isinstance(answer, dict) else None
            if response.status == 401:
                raise ClientError(f"{self.url}: {reason or 'unauthorized'} (EVENTSCHED_TOKEN)")
            if reason and isinstance(answer, dict):
                raise refused(str(reason), str(answer.get("kind", "")), answer)
            raise ClientError(f"{self.url} answered HTTP {response.status} {response.reason}")
        if answer is None and response.status != 204:
            raise ClientError(f"{self.url} answered something that is not JSON (HTTP {response.status})")
        return answer

    def output(self, job: int, *, follow: bool = False) -> Iterator[bytes]:
        """A job's output as the daemon sends it (``follow``: until the job ends)."""
        from http.client import HTTPException

        received = 0
        while True:
            path = f"/v1/jobs/{int(job)}/logs?offset={received}" + ("&follow=1" if follow else "")
            response, raw = self._send("GET", path, whole=False)
            if response.status >= 400:
                self._answer(response, raw)  # raises: the API's reason
            try:
                while chunk := response.read1(OUTPUT_CHUNK):
                    received += len(chunk)
                    yield chunk
                return  # the whole of it: a cut-short reply raises instead
            except TimeoutError:  # nothing new for a while: ask again from where it stopped
                self.close()
            except (OSError, HTTPException):
                self.close()
                raise ClientError(f"{self.url} stopped sending job {job}'s output before it ended "
                                  "(the daemon stopped?)") from None

    # --- what the CLI's commands call (as client.Client) ----------------------

    def submit(self, spec: Any) -> int:
        return int(self.call("POST", "/v1/jobs", {"spec": _plain(spec)})["id"])

    def submit_array(self, spec: Any, indices: list[int]) -> list[int]:
        return [int(i) for i in self.call("POST", "/v1/jobs", {"spec": _plain(spec), "array": list(indices)})["ids"]]

    def jobs(self, all: bool = False) -> list[dict]:
        return list(self.call("GET", "/v1/jobs?all=1" if all else "/v1/jobs"))

    def status(self) -> dict:
        return dict(self.call("GET", "/v1/status"))

    def cancel_each(self, jobs: list[int], *, arrays: bool = False,
                    array_tasks: list[tuple[int, int]] | None = None) -> dict:
        body = {"jobs": list(jobs), "arrays": arrays, "array_tasks": [list(t) for t in array_tasks or []]}
        return dict(self.call("POST", "/v1/cancel", body))

    def explain(self, job: int) -> dict:
        return dict(self.call("GET", f"/v1/jobs/{int(job)}/explain"))

    def job(self, job: int) -> dict:
        return dict(self.call("GET", f"/v1/jobs/{int(job)}"))

    def ping(self) -> dict:
        return dict(self.call("GET", "/health"))

    # --- what needs the daemon's machine --------------------------------------

    def request(self, req: Any) -> Any:
        raise ClientError("this command is not part of the HTTP API yet; run it on the daemon's machine "
                          "(without EVENTSCHED_URL)")

    def subscribe(self, from_seq: int = 0) -> Iterator[list[Any]]:
        raise ClientError("following events (`status --watch`) needs the daemon's socket; over HTTP run `status` again")

    def __getattr__(self, name: str) -> Any:  # hold, pause_gpu, tenants ...: said clearly, not AttributeError
        if name.startswith("_"):
            raise AttributeError(name)

        def unavailable(*_args: Any, **_kwargs: Any) -> Any:
            raise ClientError(f"`{name.replace('_', '-')}` is not part of the HTTP API; run it on the daemon's "
                              "machine (without EVENTSCHED_URL)")

        return unavailable


def _plain(spec: Any) -> Any:
    """A JobSpec (msgspec Struct) as JSON-able builtins."""
    import msgspec  # already imported by whoever built the JobSpec

    return msgspec.to_builtins(spec)
