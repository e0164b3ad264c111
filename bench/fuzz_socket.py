"""Fuzz the daemon's control socket: mutated and random frames.

A root daemon on fake GPUs; the frames come from an unprivileged user
(``nobody``, through ``setpriv``), as they would on a shared machine. The
cases, drawn from a seeded generator:

- mutations of valid requests of every type: a field given a value of the
  wrong type (huge and negative integers, NaN, strings, bytes, lists, maps,
  deep nesting), a field dropped or an unknown one added, the tag changed;
- the encoded body mutated at the byte level (bit flips, inserted, deleted
  and duplicated bytes, cut short);
- frames whose header lies: longer or shorter than the body, zero, just over
  the 1 MiB limit, up to 4 GiB; truncated frames; raw random bytes.

Checked at the end: the daemon is still up and answers a normal client; the
log as it was before the fuzzing is a byte-for-byte prefix of the log after;
every job event appended refers to a job acknowledged to the fuzzer (nothing
refused left a trace, and no one else's job was touched), and no
operator-only event (pause, policy, tenants) appeared; the daemon's RSS
before and after (bounded); no traceback in the daemon's log; the jobs that
existed before are unchanged.

Run (as root; figures in docs/reliability.md):

    .venv/bin/python bench/fuzz_socket.py --frames 100000

The same against the HTTP API (``serve --http``; JSON bodies, paths and
tokens mutated; a 5xx or an error that is not one JSON line is a finding):

    .venv/bin/python bench/fuzz_socket.py --http --frames 3000
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
NOBODY = 65534

# -- case generation -------------------------------------------------------------

SEEDS: list[dict[str, Any]] = [
    {"type": "SubmitJob", "spec": {"command": ["/bin/true"], "gpus": 0.25, "name": "fz", "cwd": "/tmp"}},
    {"type": "SubmitJob", "spec": {"command": ["/bin/true"], "gpus": 1, "gpu_ids": [0, 1], "priority": 3,
                                   "time_limit_s": 30.0, "retries": 1, "env": {"A": "b"}, "cwd": "/tmp"},
     "array": [0, 1]},
    {"type": "SubmitJob", "spec": {"command": ["/bin/echo", "{index}"], "gpus": 2, "after": [1], "cwd": "/tmp",
                                   "env_setup": "true", "rlimits": {"nofile": [64, 64]}, "umask": 18}},
    {"type": "ListJobs", "all": True},
    {"type": "ListJobs"},
    {"type": "GetStatus"},
    {"type": "CancelJobs", "jobs": [1, 2], "arrays": True, "array_tasks": [[1, 0]]},
    {"type": "HoldJobs", "jobs": [1]},
    {"type": "ReleaseJobs", "jobs": [1]},
    {"type": "PauseGpu", "gpu": 0},
    {"type": "ResumeGpu", "gpu": 1, "node": "local"},
    {"type": "SetPolicy", "policy": "fifo"},
    {"type": "ListTenants"},
    {"type": "SetTenant", "name": "t", "tenant": {"users": ["x"], "gpus": 1}},
    {"type": "JobLogPath", "job": 1},
    {"type": "ExplainJob", "job": 2},
    {"type": "RunSql", "query": "SELECT count(*) FROM jobs"},
    {"type": "Ping"},
    {"type": "Subscribe", "from_seq": 1},
    {"type": "CreateToken", "name": "fz"},
    {"type": "ListTokens"},
    {"type": "RevokeToken", "token": "fz"},
]
TAGS = sorted({s["type"] for s in SEEDS})
# slow by design (a sandboxed process per query, a stream): drawn less often
RARE = {"RunSql", "Subscribe"}


def _weird(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(16)
    if pick == 0:
        return rng.choice([0, -1, 1, 2**31, -(2**31), 2**63 - 1, -(2**63), 2**64 - 1])
    if pick == 1:
        return rng.choice([math.nan, math.inf, -math.inf, 1e308, -0.0, 1e-300, 0.5])
    if pick == 2:
        return "".join(chr(rng.randrange(0, 0x2FFF)) for _ in range(rng.randrange(0, 40)))
    if pick == 3:
        return rng.choice(["", "\x00", "../../etc/passwd", "$(id)", "`id`", "; rm -rf /tmp/x", "\x1b[2J", "{index}"])
    if pick == 4:
        return os.urandom(rng.randrange(0, 64))
    if pick == 5:
        return None
    if pick == 6:
        return rng.choice([True, False])
    if pick == 7 and depth < 4:
        return [_weird(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if pick == 8 and depth < 4:
        return {str(_weird(rng, depth + 1))[:20]: _weird(rng, depth + 1) for _ in range(rng.randrange(0, 4))}
    if pick == 9:
        return "x" * rng.choice([1000, 70_000, 300_000])  # over the command / environment caps
    if pick == 10:
        return list(range(rng.choice([100, 10_000, 100_000])))  # long arrays, long id lists
    if pick == 11 and depth < 4:
        v: Any = 1
        for _ in range(rng.choice([10, 100, 400])):
            v = [v]  # deep nesting
        return v
    return rng.randrange(-5, 1 << rng.randrange(1, 40))


def _mutate_obj(obj: Any, rng: random.Random) -> Any:
    if isinstance(obj, dict) and obj:
        obj = dict(obj)
        key = rng.choice(list(obj))
        action = rng.randrange(6)
        if action == 0:
            del obj[key]
        elif action == 1:
            obj[rng.choice(["x", "spec", "jobs", "type", "\u00e9", "a" * 300, str(rng.random())])] = _weird(rng)
        elif action == 2 and key == "type":
            obj["type"] = rng.choice(TAGS + ["Nope", "", "submitjob", 7])
        elif action in (2, 3) and isinstance(obj[key], (dict, list)) and obj[key]:
            obj[key] = _mutate_obj(obj[key], rng)
        else:
            obj[key] = _weird(rng)
        return obj
    if isinstance(obj, list) and obj:
        obj = list(obj)
        i = rng.randrange(len(obj))
        obj[i] = _mutate_obj(obj[i], rng) if isinstance(obj[i], (dict, list)) and rng.random() < 0.5 else _weird(rng)
        return obj
    return _weird(rng)


def _mutate_bytes(body: bytes, rng: random.Random) -> bytes:
    data = bytearray(body)
    for _ in range(rng.randrange(1, 5)):
        if not data:
            break
        i = rng.randrange(len(data))
        action = rng.randrange(5)
        if action == 0:
            data[i] ^= 1 << rng.randrange(8)
        elif action == 1:
            data[i:i] = os.urandom(rng.randrange(1, 9))
        elif action == 2:
            del data[i : i + rng.randrange(1, 9)]
        elif action == 3:
            data[i] = rng.choice([0xC1, 0xDD, 0xDF, 0xDB, 0xC6, 0xFF, 0x00, 0x90, 0x80])
        else:
            data[i:i] = data[i : i + rng.randrange(1, 16)]
    return bytes(data)


def make_case(rng: random.Random) -> tuple[str, bytes, bool]:
    """(kind, bytes to send, whether it is one whole frame that deserves exactly one reply)."""
    import msgspec

    enc = msgspec.msgpack.Encoder()
    seed = rng.choice(SEEDS)
    while seed["type"] in RARE and rng.random() < 0.9:
        seed = rng.choice(SEEDS)
    roll = rng.random()
    if roll < 0.45:
        obj = seed
        for _ in range(rng.randrange(1, 4)):
            obj = _mutate_obj(obj, rng)
        try:
            body = enc.encode(obj)
        except (OverflowError, TypeError, ValueError, RecursionError):
            body = enc.encode(seed)
        return "mutated-request", struct.pack(">I", len(body)) + body, len(body) <= 1 << 20
    if roll < 0.75:
        body = _mutate_bytes(enc.encode(seed), rng)
        return "mutated-bytes", struct.pack(">I", len(body)) + body, True
    if roll < 0.82:
        return "valid-or-wrong-type", *_wrong_type(seed, rng, enc)
    if roll < 0.90:
        body = enc.encode(seed)
        length = rng.choice([0, 1, len(body) - 1, len(body) + 1, len(body) + 1000, (1 << 20) + 1,
                             0x7FFFFFFF, 0xFFFFFFFF, rng.randrange(1 << 32)])
        whole = length == 0  # a zero-length frame is whole (and bad)
        return "lying-length", struct.pack(">I", length) + body, whole
    if roll < 0.92:  # nesting deeper than msgspec's recursion limit, in a field or as the spec
        depth = rng.choice([500, 1000, 5000, 50_000])
        inner = rng.choice([b"\x91" * depth, b"\x81\xa1x" * depth])
        body = rng.choice([b"\x82\xa4type\xa4Ping\xa1x", b"\x82\xa4type\xa9SubmitJob\xa4spec"]) + inner + b"\x01"
        return "deep-nesting", struct.pack(">I", len(body)) + body, True
    if roll < 0.95:
        body = enc.encode(seed)
        cut = rng.randrange(0, len(body) + 4)
        return "truncated", (struct.pack(">I", len(body)) + body)[:cut], False
    return "random-bytes", os.urandom(rng.randrange(1, 200)), False


def _wrong_type(seed: dict[str, Any], rng: random.Random, enc: Any) -> tuple[bytes, bool]:
    """Every field of the request swapped for a value of another type, or the
    whole message not a map at all."""
    if rng.random() < 0.2:
        body = enc.encode(rng.choice([[seed["type"]], seed["type"], 1, None, b"\x00", [seed]]))
    else:
        obj = {k: (v if k == "type" else _weird(rng)) for k, v in seed.items()}
        try:
            body = enc.encode(obj)
        except (OverflowError, TypeError, ValueError, RecursionError):
            body = enc.encode(seed)
    return struct.pack(">I", len(body)) + body, True


# -- the worker (runs as nobody) ------------------------------------------------------


def _read_message(sock: socket.socket) -> bytes | None:
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        chunk = sock.recv(min(1 << 20, n - len(body)))
        if not chunk:
            return None
        body += chunk
    return body


STOP_FILE = "stop"  # in the run's folder: the workers end early, and the run is checked as usual


def _asked_to_stop() -> bool:
    where = os.environ.get("FUZZ_STOP_FILE")
    return bool(where) and os.path.exists(where)


def worker(socket_path: str, frames: int, seed: int) -> dict[str, Any]:
    """Send ``frames`` cases; count outcomes; return every id acknowledged to us."""
    from eventsched.wire import protocol

    rng = random.Random(seed)
    stats: collections.Counter[str] = collections.Counter()
    acked: list[int] = []
    samples: list[str] = []  # requests whose error was not one line
    sock: socket.socket | None = None
    t0 = time.monotonic()

    def fresh() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(socket_path)
        return s

    sent = 0
    for _ in range(frames):
        if sent % 100 == 0 and _asked_to_stop():
            break
        sent += 1
        kind, data, whole = make_case(rng)
        stats[kind] += 1
        if not whole:  # a fragment: send it on its own connection, hang up, expect the daemon to follow
            with fresh() as s:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                try:
                    while s.recv(1 << 16):
                        pass
                    stats["fragment-closed"] += 1
                except TimeoutError:
                    stats["fragment-hung"] += 1
                except ConnectionResetError:
                    stats["fragment-reset"] += 1
            continue
        if sock is None:
            sock = fresh()
        try:
            sock.sendall(data)
            body = _read_message(sock)
        except (BrokenPipeError, ConnectionResetError):
            body = None
        except TimeoutError:
            stats["no-reply-in-30s"] += 1
            body = None
        if body is None:
            stats["closed-by-daemon"] += 1
            sock.close()
            sock = None
            continue
        try:
            reply = protocol.server_message_decoder.decode(body)
        except Exception:  # noqa: BLE001 - the daemon sent something undecodable: a finding
            stats["bad-reply"] += 1
            sock.close()
            sock = None
            continue
        if isinstance(reply, protocol.Reply):
            stats["reply-ok" if reply.ok else "reply-error"] += 1
            if reply.ok and isinstance(reply.data, dict) and b"SubmitJob" in data:
                acked.extend(reply.data.get("ids") or [reply.data["id"]])
            if not reply.ok and (not reply.error or "\n" in reply.error.strip()):
                stats["error-not-one-line"] += 1
                if len(samples) < 5:
                    samples.append(f"{data[4:200]!r} -> {reply.error[:300]!r}")
        else:
            stats["event-batch"] += 1
        if b"Subscribe" in data or not isinstance(reply, protocol.Reply):
            sock.close()  # a subscription streams on: start again on a new connection
            sock = None
    if sock is not None:
        sock.close()
    return {"stats": dict(stats), "acked": acked, "samples": samples, "seconds": round(time.monotonic() - t0, 1),
            "sent": sent}


# -- the HTTP API worker ------------------------------------------------------------------

HTTP_TIMEOUT_S = 5.0
HTTP_ROUTES = [("GET", "/health"), ("GET", "/v1/jobs"), ("GET", "/v1/jobs?all=1"), ("POST", "/v1/jobs"),
               ("GET", "/v1/jobs/1"), ("DELETE", "/v1/jobs/1"), ("GET", "/v1/jobs/2/explain"),
               ("POST", "/v1/cancel"), ("GET", "/v1/status")]
HTTP_SEEDS: list[Any] = [
    {"spec": {"command": ["/bin/true"], "gpus": 0.25, "cwd": "/tmp"}},
    {"spec": {"command": ["/bin/echo", "{index}"], "gpus": 1, "cwd": "/tmp"}, "array": [0, 1]},
    {"jobs": [1, 2], "arrays": True, "array_tasks": [[1, 0]]},
]


def make_http_case(rng: random.Random, token: str) -> tuple[str, str, dict[str, str], bytes]:
    import msgspec

    method, path = rng.choice(HTTP_ROUTES)
    if rng.random() < 0.15:
        method = rng.choice(["GET", "POST", "DELETE", "PUT", "PATCH"])
    if rng.random() < 0.15:
        path = rng.choice(["/v1/jobs/", "/v1/jobs/-1", "/v1/jobs/99999999999999999999999", "/v1/jobs/1/../../etc",
                           "/v1/jobs/%00", "/v1/jobs/1/explain?x=" + "a" * 5000, "/" + "v1/" * 200, "/v1/jobs/\u00e9"])
    headers = {"Authorization": f"Bearer {token}"}
    roll = rng.random()
    if roll < 0.05:
        headers = {}
    elif roll < 0.1:
        headers = {"Authorization": rng.choice(["Bearer ", "Bearer x", "Basic Zm9vOmJhcg==", "Bearer " + "a" * 9000,
                                                 f"Bearer {token}x", "bearer " + token])}
    body = b""
    if method in ("POST", "PUT", "PATCH", "DELETE"):
        obj = rng.choice(HTTP_SEEDS)
        pick = rng.random()
        if pick < 0.5:
            for _ in range(rng.randrange(1, 4)):
                obj = _mutate_obj(obj, rng)
            try:
                body = msgspec.json.encode(obj)
            except (OverflowError, TypeError, ValueError, RecursionError, msgspec.EncodeError):
                body = msgspec.json.encode(rng.choice(HTTP_SEEDS))
        elif pick < 0.8:
            body = _mutate_bytes(msgspec.json.encode(obj), rng)
        elif pick < 0.9:
            body = rng.choice([b"", b"null", b"[]", b"1e999", b'{"spec": ' * 2000, b"\xff\xfe", b'"\\ud800"',
                               b'{"spec": {"command": ["\\ud800"]}}', b"{" + b" " * 100000])
        else:
            body = os.urandom(rng.randrange(0, 300))
        headers["Content-Type"] = rng.choice(["application/json", "text/plain", "application/json; charset=latin-1"])
    return method, path, headers, body


def worker_http(port: int, token: str, frames: int, seed: int) -> dict[str, Any]:
    import http.client

    rng = random.Random(seed)
    stats: collections.Counter[str] = collections.Counter()
    acked: list[int] = []
    samples: list[str] = []
    # a kept-alive connection left mid-message by a mangled exchange can wait
    # for bytes that never come: counted as a connection error, then a new one
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
    t0 = time.monotonic()
    sent = 0
    for _ in range(frames):
        if sent % 100 == 0 and _asked_to_stop():
            break
        sent += 1
        method, path, headers, body = make_http_case(rng, token)
        started = time.monotonic()
        try:
            conn.request(method, urllib.parse.quote(path, safe="/?=&%"), body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except (http.client.HTTPException, OSError) as exc:
            stats["connection-" + type(exc).__name__] += 1
            if len(samples) < 8:
                samples.append(f"{type(exc).__name__} after {time.monotonic() - started:.1f}s: {method} {path[:60]} {body[:80]!r}")
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
            continue
        stats[f"status-{resp.status}"] += 1
        if time.monotonic() - started > 2.0:
            stats["slower-than-2s"] += 1
            if len(samples) < 8:
                samples.append(f"slow {time.monotonic() - started:.1f}s: {method} {path[:60]} {body[:80]!r} -> {resp.status}")
        if resp.status >= 500 and len(samples) < 5:
            samples.append(f"{method} {path[:80]} {body[:120]!r} -> {resp.status} {data[:300]!r}")
        if resp.status == 201 and method == "POST":
            try:
                reply = json.loads(data)
                acked.extend(reply.get("ids") or [reply["id"]])
            except (ValueError, KeyError, TypeError):
                stats["bad-201"] += 1
        elif resp.status >= 400 and path.startswith("/v1"):
            try:
                said = json.loads(data)["error"]
                if not said or "\n" in said.strip():
                    stats["error-not-one-line"] += 1
            except (ValueError, KeyError, TypeError):
                stats["error-not-json"] += 1
                if len(samples) < 5:
                    samples.append(f"{method} {path[:80]} -> {resp.status} {data[:200]!r}")
    conn.close()
    return {"stats": dict(stats), "acked": acked, "samples": samples, "seconds": round(time.monotonic() - t0, 1),
            "sent": sent}


# -- the harness (root) ----------------------------------------------------------------


def rss_bound_kib(accepted: int) -> int:
    """How much the daemon may grow: what was accepted (8-9 KiB a job seen;
    a mutated array may be 10,000 jobs) plus the allocator's arenas kept
    after decoding frames of up to 1 MiB (41-102 MiB seen)."""
    return 128 * 1024 + 12 * accepted


def _rss_kib(pid: int) -> tuple[int, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()[0] if value.split() else "0"
    return int(fields.get("VmRSS", 0)), int(fields.get("VmHWM", 0))


def _log_bytes(log_dir: Path) -> dict[str, bytes]:
    """Each segment's committed bytes: its frames, not the zeros written ahead of them."""
    from eventsched.storage import log as eventlog

    out = {}
    for p in sorted(log_dir.glob("*.seg")):
        with eventlog.SegmentScan(str(p)) as scan:
            scan.run()
            out[p.name] = p.read_bytes()[: scan.data_size]
    return out


def _env(state: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["EVENTSCHED_STATE_DIR"] = str(state)
    env.pop("EVENTSCHED_SOCKET", None)
    env["PYTHONPATH"] = str(ROOT)
    return env


def _cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "eventsched.cli", *args], env=_env(state), capture_output=True,
                          text=True, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fuzz(frames: int, *, seed: int = 1, workers: int = 1, workdir: Path | None = None, http: bool = False) -> dict[str, Any]:
    """Start a root daemon, fire ``frames`` cases at it as nobody, check it; returns the figures."""
    from eventsched.domain.events import decode_many  # noqa: F401 - import check only
    from eventsched.storage import log as eventlog
    from eventsched.wire import protocol

    if os.geteuid() != 0:
        raise SystemExit("fuzz_socket needs root (the frames are sent as nobody to a root daemon)")
    own = workdir is None
    workdir = workdir or Path(tempfile.mkdtemp(prefix="es-fuzz-"))
    workdir.chmod(0o755)
    state = workdir / "state"
    state.mkdir()
    err = open(workdir / "daemon.stderr", "wb")
    port = _free_port()
    # the harness's long job sits on idle fake GPUs: the daemon's own idle
    # detection would flag it after 30 min, a change the fuzzer did not make
    (workdir / "serve.toml").write_text("[scheduler]\nidle_after_s = 0\n")
    daemon = subprocess.Popen([PYTHON, "-m", "eventsched.cli", "serve", "--gpus", "fake:2:16384",
                               "--sample-interval", "3600", "--config", str(workdir / "serve.toml"),
                               *(["--http", f"127.0.0.1:{port}"] if http else [])],
                              env=_env(state), stdout=err, stderr=err, start_new_session=True)
    figures: dict[str, Any] = {"target": "http" if http else "socket", "frames": frames, "seed": seed, "problems": []}
    problems: list[str] = figures["problems"]
    held = ""
    try:
        deadline = time.monotonic() + 60
        while _cli(state, "health").returncode != 0:
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise RuntimeError("the daemon did not start: " + (workdir / "daemon.stderr").read_text()[-2000:])
            time.sleep(0.1)
        # some accepted history the fuzzing must not change: a finished job, a held one, a paused GPU
        done = _cli(state, "submit", "--gpus", "0.5", "--", "/bin/true").stdout.strip()
        # (it outlasts any run: its own end would look like a change; cancelled when done)
        held = _cli(state, "submit", "--gpus", "2", "--", "/bin/sleep", "86400").stdout.strip()
        _cli(state, "hold", held)
        _cli(state, "pause-gpu", "1")
        t_wait = time.monotonic() + 30
        while json.loads(_cli(state, "queue", "--all", "--json").stdout or "[]") and time.monotonic() < t_wait:
            states = {j["id"]: j["state"] for j in json.loads(_cli(state, "queue", "--all", "--json").stdout)}
            if states.get(int(done)) == "succeeded":
                break
            time.sleep(0.1)
        jobs_before = json.loads(_cli(state, "queue", "--all", "--json").stdout)
        log_dir = state / "log"
        log_before = _log_bytes(log_dir)
        seq_before = eventlog.last_seq(log_dir)
        rss_before = _rss_kib(daemon.pid)
        per = [frames // workers + (1 if i < frames % workers else 0) for i in range(workers)]
        target = [str(state / "eventsched.sock")]
        if http:  # a token of nobody's, made by root; the requests then act as nobody
            from eventsched.wire.client import Client

            with Client(state / "eventsched.sock") as c:
                token = c.request(protocol.CreateToken(name="fuzz", for_uid=NOBODY))["token"]
            target = ["--http", str(port), token]
        t0 = time.monotonic()
        procs = [subprocess.Popen(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", PYTHON, __file__, "--worker",
             *target, str(n), str(seed * 1000 + i)],
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/",
                 "FUZZ_STOP_FILE": str(workdir / STOP_FILE)}, cwd="/",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i, n in enumerate(per)]
        print(f"fuzzing: touch {workdir / STOP_FILE} to end early (the run is then checked as usual)",
              file=sys.stderr, flush=True)
        stats: collections.Counter[str] = collections.Counter()
        acked: set[int] = set()
        sent = 0
        for p in procs:
            out, errs = p.communicate()
            if p.returncode != 0:
                problems.append(f"a fuzz worker failed: {errs[-1500:]}")
                continue
            result = json.loads(out.strip().splitlines()[-1])
            stats.update(result["stats"])
            acked.update(result["acked"])
            sent += result["sent"]
            figures.setdefault("error_samples", []).extend(result["samples"])
        figures["seconds"] = round(time.monotonic() - t0, 1)
        figures["frames_sent"] = sent
        figures["frames_per_s"] = round(sent / max(figures["seconds"], 1e-9))
        figures["outcomes"] = dict(sorted(stats.items()))
        figures["acknowledged_jobs"] = len(acked)
        rss_after = _rss_kib(daemon.pid)
        figures["rss_kib_before"], figures["rss_kib_after"], figures["rss_kib_peak"] = rss_before[0], rss_after[0], rss_after[1]
        # the daemon is up and serves a normal client
        if daemon.poll() is not None:
            problems.append(f"the daemon died (exit {daemon.returncode})")
            return figures
        normal = _cli(state, "submit", "--gpus", "0.5", "--", "/bin/true")
        if normal.returncode != 0:
            problems.append(f"a normal submission failed after the fuzzing: {normal.stderr.strip()}")
        # what was accepted before is unchanged
        jobs_after = {j["id"]: j for j in json.loads(_cli(state, "queue", "--all", "--json").stdout)}
        for job in jobs_before:
            if jobs_after.get(job["id"]) != job:
                problems.append(f"job {job['id']} changed: {job} -> {jobs_after.get(job['id'])}")
        log_after = _log_bytes(log_dir)
        for name, data in log_before.items():
            if not log_after.get(name, b"").startswith(data):
                problems.append(f"segment {name} no longer starts with what it held before the fuzzing")
        # nothing refused left a trace; nothing but the fuzzer's own jobs was touched
        foreign: collections.Counter[str] = collections.Counter()
        new_events = [e for batch in eventlog.read_batches(log_dir, seq_before + 1) for e in batch]
        normal_id = int(normal.stdout.strip() or 0)
        for e in new_events:
            kind = type(e).__name__
            jobs = ([e.job] if hasattr(e, "job") else []) + list(getattr(e, "jobs", []) or [])
            if kind in ("GpuSampled", "TimerFired", "GpuErrored"):
                continue
            if not jobs or any(j not in acked and j != normal_id for j in jobs):
                foreign[kind] += 1
                if sum(foreign.values()) <= 5:
                    figures.setdefault("foreign_samples", []).append(repr(e)[:400])
        figures["events_appended"] = len(new_events)
        if foreign:
            problems.append(f"events not explained by an acknowledged request: {dict(foreign)}")
        figures["jobs_submitted_events"] = sum(type(e).__name__ == "JobSubmitted" for e in new_events)
        if figures["jobs_submitted_events"] != len(acked) + 1:
            problems.append(f"{figures['jobs_submitted_events']} submissions logged, {len(acked)} acknowledged + 1 normal")
        if any(k.startswith("status-5") for k in stats) or stats.get("error-not-json") or stats.get("bad-201"):
            problems.append("HTTP: " + json.dumps({k: v for k, v in stats.items() if k.startswith("status-5") or k in ("error-not-json", "bad-201")}))
        if stats.get("bad-reply") or stats.get("no-reply-in-30s") or stats.get("error-not-one-line"):
            problems.append("replies: " + json.dumps({k: stats.get(k) for k in ("bad-reply", "no-reply-in-30s", "error-not-one-line")}))
        bound = rss_bound_kib(len(acked))
        if rss_after[0] - rss_before[0] > bound:
            problems.append(f"RSS grew by {(rss_after[0] - rss_before[0]) // 1024} MiB, over {bound // 1024} MiB "
                            f"for the {len(acked):,} jobs accepted")
        verify = _cli(state, "log", "verify", str(log_dir))
        if verify.returncode != 0:
            problems.append(f"log verify failed: {verify.stdout.strip()} {verify.stderr.strip()}")
    finally:
        if daemon.poll() is None:
            if held:
                _cli(state, "cancel", held)  # the day-long sleep goes with the daemon
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        err.close()
        said = (workdir / "daemon.stderr").read_text(errors="replace")
        figures["daemon_tracebacks"] = said.count("Traceback")
        if figures["daemon_tracebacks"]:
            problems.append("the daemon logged a traceback: " + said[said.index("Traceback"):][:1500])
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return figures


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker" and sys.argv[2] == "--http":
        sys.path.insert(0, str(ROOT))
        print(json.dumps(worker_http(int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(ROOT))
        print(json.dumps(worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="fuzzing processes (connections) at once")
    parser.add_argument("--http", action="store_true", help="fuzz the HTTP API (serve --http) instead of the socket")
    args = parser.parse_args()
    figures = fuzz(args.frames, seed=args.seed, workers=args.workers, http=args.http)
    print(json.dumps(figures, indent=1))
    return 1 if figures["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
