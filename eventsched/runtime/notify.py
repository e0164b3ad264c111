"""Per-user notification hooks: a webhook and/or a mail command, told when one
of the user's jobs ends, fails, is preempted or is stopped for its GPU memory
(docs/notifications.md).

The hooks live in the state dir (``notify.json``, 0600), not in the log: a
webhook's secret must not be readable by whoever may read the history. On the
engine's loop a batch only becomes queued messages; one worker thread sends them.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import json
import logging
import os
import queue
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from eventsched.domain import events as ev
from eventsched.domain import report_card
from eventsched.domain.messages import RefusalKind, Refused
from eventsched.domain.states import GPU_MEMORY_OVER
from eventsched.domain.text import has_control
from eventsched.wire.protocol import SetNotify

__all__ = ["KINDS", "Hook", "Notifier", "check_url", "check_hook", "SIGNATURE_HEADER", "sign"]

logger = logging.getLogger("eventsched.notify")

KINDS = ("end", "fail", "preempt", "memory")  # what a hook can be told of
SIGNATURE_HEADER = "X-Eventsched-Signature"
QUEUE_SIZE = 1024  # messages waiting to be sent; past it one is dropped, and that is said
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 60.0
GIVE_UP_AFTER_S = 3600.0  # a message not delivered within this long is given up (and said so)
SEND_TIMEOUT_S = 10.0
MAX_URL = 2048
# the event tags a batch must hold to concern a hook: a byte search on the
# loop, so a batch of samples costs no decoding
_TAGS = (b"JobExited", b"JobLost")


class Hook(msgspec.Struct, kw_only=True):
    uid: int
    user: str = ""
    gid: int = -1
    webhook: str = ""
    secret: str = ""
    on: list[str] = []  # []: every kind
    mail: list[str] = []
    delivered: int = 0
    last_failure: str = ""
    last_failure_at: float = 0.0

    def public(self) -> dict[str, Any]:
        """As ``notify list`` shows it: whether there is a secret, never the secret."""
        shown = msgspec.to_builtins(self)
        shown["secret"] = bool(self.secret)
        shown["on"] = self.on or list(KINDS)
        return shown


def check_url(url: str) -> str | None:
    """Why ``url`` is no webhook (None: it is one): http or https to a host."""
    if len(url) > MAX_URL or has_control(url) or " " in url:
        return f"--webhook {url[:80]!r}: not a URL"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"--webhook {url[:80]!r}: only http:// and https:// URLs are allowed"
    if not parts.hostname:
        return f"--webhook {url[:80]!r}: no host"
    try:
        parts.port  # noqa: B018 (raises for a bad port)
    except ValueError:
        return f"--webhook {url[:80]!r}: bad port"
    return None


def check_hook(request: SetNotify) -> None:
    """Refuse (``Refused``) a hook that could never be delivered."""
    def invalid(reason: str) -> Refused:
        return Refused(RefusalKind.INVALID, reason)

    if request.webhook and (why := check_url(request.webhook)) is not None:
        raise invalid(why)
    if bad := [k for k in request.on if k not in KINDS]:
        raise invalid(f"--on {','.join(bad)}: the kinds are {', '.join(KINDS)}")
    if request.mail and not os.path.isabs(request.mail[0]):
        raise invalid(f"--mail {request.mail[0]!r}: give the program's absolute path (it runs without a shell)")
    if any(has_control(word) for word in request.mail):
        raise invalid("--mail: control characters in the command")
    if request.secret and not request.webhook:
        raise invalid("--secret signs webhook messages: give --webhook too")


def sign(secret: str, body: bytes) -> str:
    """The signature header's value: HMAC-SHA256 of the body under the hook's secret."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def kind_of(event: ev.Event) -> str | None:
    """What a hook is told ``event`` is (None: nothing it hears of)."""
    if isinstance(event, ev.JobLost):
        return "fail"
    if not isinstance(event, ev.JobExited):
        return None
    if event.outcome == "preempted":
        return "preempt"
    if event.reason == GPU_MEMORY_OVER:
        return "memory"
    return "end" if event.outcome in ("succeeded", "cancelled") else "fail"


def message(kind: str, event: ev.JobExited | ev.JobLost, job: Any) -> dict[str, Any]:
    """The JSON body: what happened to which job, and its report card once it ran."""
    spec = job.spec
    state, code, signal = ("lost", None, None) if isinstance(event, ev.JobLost) else (
        event.outcome, event.exit_code, event.signal)
    body: dict[str, Any] = {
        "event": kind, "job": event.job, "name": spec.name, "user": spec.user, "state": state,
        "reason": event.reason, "exit_code": code, "signal": signal, "node": job.node, "gpu_ids": list(job.gpu_ids),
        "at": event.ts, "seq": event.seq,
    }
    if job.started_at is not None:
        peak = job.gpu_mem_peak_mib or None
        body["report_card"] = {
            "gpus": spec.gpus, "gpu_mem_mib": spec.gpu_mem_mib, "mem_peak_mib": peak,
            "wait_s": round(job.started_at - job.submitted_at, 3), "run_s": round(event.ts - job.started_at, 3),
            "advice": report_card.advice(spec.gpus, None, spec.gpu_mem_mib, peak),
        }
    return body


class _Delivery(msgspec.Struct, kw_only=True):
    uid: int
    what: str  # "job 7 end": for the log and the failure line
    body: bytes
    first_try: float
    tries: int = 0
    done: list[str] = []  # "webhook", "mail": the ways it has reached (a retry does not repeat them)


class Notifier:
    def __init__(self, state_dir: Path, job: Callable[[int], Any]) -> None:
        self.path = state_dir / "notify.json"
        self._job = job  # a job of the engine's state by id (None: unknown)
        self.daemon_uid = os.geteuid()
        self._lock = threading.Lock()  # the hooks, shared by the loop, the worker and the saving threads
        self._save_lock = threading.Lock()  # one save at a time: the newest hooks are written last
        self.hooks: dict[int, Hook] = self._load()
        self._queue: queue.Queue[_Delivery | None] = queue.Queue(QUEUE_SIZE)
        self._thread: threading.Thread | None = None
        self._order = itertools.count()

    def _load(self) -> dict[int, Hook]:
        try:
            return {h.uid: h for h in msgspec.json.decode(self.path.read_bytes(), type=list[Hook])}
        except FileNotFoundError:
            return {}
        except (OSError, msgspec.DecodeError) as exc:
            logger.error("notification hooks: cannot read %s (%s): starting with none", self.path, exc)
            return {}

    def _save(self) -> None:
        with self._save_lock:
            with self._lock:
                data = msgspec.json.encode(list(self.hooks.values()))
            tmp = self.path.with_name(self.path.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)

    def set(self, request: SetNotify, uid: int, gid: int, user: str) -> dict[str, Any]:
        """The peer's own hook, replaced (all empty: removed); in a thread, as it writes the file."""
        check_hook(request)
        if self.daemon_uid != 0 and uid not in (0, self.daemon_uid):
            raise Refused(RefusalKind.FORBIDDEN, f"this daemon runs as uid {self.daemon_uid} and runs no jobs of "
                                                 f"uid {uid}; ask its owner, or run it as root to serve several users")
        with self._lock:
            if not (request.webhook or request.mail):
                had = self.hooks.pop(uid, None) is not None
                hook = None
            else:
                hook = self.hooks[uid] = Hook(uid=uid, user=user, gid=gid, webhook=request.webhook,
                                              secret=request.secret, on=list(request.on), mail=list(request.mail))
        self._save()
        logger.info("notification hook of %s (uid %d) %s", user, uid, "set" if hook else "removed")
        return hook.public() if hook else {"uid": uid, "user": user, "removed": had}

    def listing(self, uid: int, operator: bool) -> list[dict[str, Any]]:
        with self._lock:
            return [h.public() for h in self.hooks.values() if operator or h.uid == uid]

    def fan_out(self, payload: bytes) -> bool:
        """An engine subscriber: queue a message for each hook a batch concerns."""
        if self.hooks and any(tag in payload for tag in _TAGS):
            for event in ev.decode_many(payload):
                if isinstance(event, (ev.JobExited, ev.JobLost)) and (kind := kind_of(event)) is not None:
                    self._consider(kind, event)
        return True  # never dropped: a full queue drops a message and says so

    def _consider(self, kind: str, event: ev.JobExited | ev.JobLost) -> None:
        job = self._job(event.job)
        hook = self.hooks.get(job.spec.uid) if job is not None else None
        if hook is None or kind not in (job.spec.notify or hook.on or KINDS):
            return
        what = f"job {event.job} {kind}"
        body = json.dumps(message(kind, event, job), separators=(",", ":")).encode()
        try:
            self._queue.put_nowait(_Delivery(uid=hook.uid, what=what, body=body, first_try=time.time()))
        except queue.Full:
            self._failed(hook.uid, what, f"more than {QUEUE_SIZE} messages waiting: dropped")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="eventsched-notify", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the worker to stop; a send under way is not waited for long (the thread is a daemon's)."""
        if self._thread is not None:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                logger.warning("stopping with %d notifications undelivered", self._queue.qsize())
            self._thread.join(timeout=1.0)
            self._thread = None

    def _work(self) -> None:
        retries: list[tuple[float, int, _Delivery]] = []  # (when, order, delivery)
        while True:
            if retries and retries[0][0] <= time.monotonic():  # a retry due goes before new messages
                item: _Delivery | None = heapq.heappop(retries)[2]
            else:
                try:
                    item = self._queue.get(timeout=max(0.0, retries[0][0] - time.monotonic()) if retries else None)
                except queue.Empty:
                    continue
            if item is None:
                if retries:
                    logger.warning("stopping with %d notifications undelivered", len(retries))
                return
            failure = self._deliver(item)
            if failure is None:
                continue
            item.tries += 1
            delay = min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** (item.tries - 1))
            final = failure.startswith("!") or time.time() + delay - item.first_try > GIVE_UP_AFTER_S
            self._failed(item.uid, item.what, failure.lstrip("!") + ("; given up" if final else
                                                                     f"; retrying in {delay:g} s"))
            if not final:
                heapq.heappush(retries, (time.monotonic() + delay, next(self._order), item))

    def _deliver(self, item: _Delivery) -> str | None:
        """Send ``item`` to its hook: None once delivered, else why not ("!": no retry can help)."""
        with self._lock:
            hook = self.hooks.get(item.uid)
        if hook is None:
            return None  # removed since: nobody to tell
        failures = []
        for way, send, wanted in (("webhook", self._post, hook.webhook), ("mail", self._mail, hook.mail)):
            if wanted and way not in item.done:
                why = send(hook, item)
                if why is None:
                    item.done.append(way)
                else:
                    failures.append(why)
        if failures:
            return "; ".join(failures)
        with self._lock:
            hook.delivered += 1
        logger.info("notified %s of %s", hook.user, item.what)
        return None

    def _post(self, hook: Hook, item: _Delivery) -> str | None:
        body = item.body
        headers = {"Content-Type": "application/json", "User-Agent": "eventsched"}
        if hook.secret:
            headers[SIGNATURE_HEADER] = sign(hook.secret, body)
        request = urllib.request.Request(hook.webhook, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=SEND_TIMEOUT_S) as response:
                response.read(4096)
        except urllib.error.HTTPError as exc:  # a 4xx but 408 and 429 will say the same again
            final = 400 <= exc.code < 500 and exc.code not in (408, 429)
            return f"{'!' if final else ''}webhook answered HTTP {exc.code}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            return f"webhook: {getattr(reason, 'strerror', None) or reason}"
        return None

    def _mail(self, hook: Hook, item: _Delivery) -> str | None:
        """The mail command, as the hook's owner, without a shell, the message on stdin."""
        drop: dict[str, Any] = {}
        if self.daemon_uid == 0 and hook.uid != 0:  # never as root for someone else
            drop = {"user": hook.uid, "group": hook.gid, "extra_groups": os.getgrouplist(hook.user, hook.gid)
                    if hook.user else []}
        subject = f"eventsched: {item.what}"
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "USER": hook.user, "EVENTSCHED_SUBJECT": subject}
        try:
            done = subprocess.run(hook.mail, input=item.body + b"\n", env=env, cwd="/", capture_output=True,
                                  timeout=SEND_TIMEOUT_S, start_new_session=True, **drop)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"mail command: {getattr(exc, 'strerror', None) or exc}"
        if done.returncode != 0:
            return f"mail command exited {done.returncode}: {done.stderr.decode(errors='replace').strip()[:200]}"
        return None

    def _failed(self, uid: int, what: str, why: str) -> None:
        with self._lock:
            hook = self.hooks.get(uid)
            if hook is not None:
                hook.last_failure, hook.last_failure_at = f"{what}: {why}", time.time()
        logger.warning("notification of %s (uid %d) failed: %s", what, uid, why)
