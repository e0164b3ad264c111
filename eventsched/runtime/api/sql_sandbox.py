"""SQL the daemon answers for its users runs here, as the user, never as root.

Each query runs in a short-lived process of its own (``SqlRunner`` in the
daemon, ``main`` in the child), which reads nothing of the query until it can
do no more than the user may: as root it catches the read model up and opens
it read-only, hardens the DuckDB connection, sets resource limits and becomes
the user for good; only then it reads the query and checks it. The daemon
kills it past its limits (``SqlLimits``) or when its client goes away, and
bounds how many run at once, per user and in all.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping

import anyio
import duckdb
import msgspec

from eventsched.projections.history import History, HistoryError
from eventsched.projections.sql import QueryRefused, _one_line, check_read_only, harden
from eventsched.projections.sql_values import EXIT_BAD_QUERY, EXIT_ERROR, SqlError, plain

__all__ = ["SqlLimits", "SqlRunner", "drop_privileges", "main"]

MIB = 1 << 20
MAX_SQL_BYTES = 1 << 20
READY = b"R"  # the child's first byte once it is the user; a reply is a msgpack map, never this
_REPLY_FD = 1
_ENV_PREFIX = "EVENTSCHED_SQL_"


@dataclass(frozen=True)
class SqlLimits:
    """Bounds on the queries the daemon answers (environment: EVENTSCHED_SQL_<NAME>)."""

    # wall clock for the query itself: under the CLI's 30 s socket timeout, so
    # the user reads why rather than a timeout of their own
    timeout_s: float = 25.0
    setup_timeout_s: float = 60.0  # catching the read model up, before the query
    memory_mb: int = 512  # DuckDB's memory_limit (the address-space limit is a backstop above it)
    threads: int = 1
    max_result_bytes: int = 16 * MIB  # of the encoded reply
    per_user: int = 2  # running at once, per user
    total: int = 4  # running at once, in all
    queue_s: float = 3.0  # how long a query waits for a slot before it is refused
    write_wait_s: float = 0.05  # for the read model's write lock (others read it); then a private copy

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "SqlLimits":
        values: dict[str, Any] = {}
        for f in fields(cls):
            kind = float if isinstance(f.default, float) else int
            try:
                value = kind(environ.get(_ENV_PREFIX + f.name.upper(), ""))
            except ValueError:
                continue  # unset, or not a number: the default
            if value > 0:
                values[f.name] = value
        return cls(**values)


# --- the child ------------------------------------------------------------------


PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def drop_privileges(uid: int, gid: int, groups: list[int], *, memory_mb: int, cpu_s: float) -> None:
    """Resource limits (hard = soft: the user can raise none), then become
    ``uid``/``gid``/``groups`` irrevocably. A non-root daemon keeps its user."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # no regular file may grow: a backstop for COPY
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(used.ru_utime + used.ru_stime + cpu_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    # DuckDB keeps its buffers under memory_limit, but not every allocation
    # (a vector of huge strings): this backstop makes those fail fast too
    address_space = _vm_size() + memory_mb * MIB + 256 * MIB
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    if os.geteuid() == 0 and uid != 0:
        os.setgroups(groups)
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) \
                or sorted(set(os.getgroups())) != sorted(set(groups)):
            os._exit(70)
        with contextlib.suppress(PermissionError):
            os.setuid(0)
            os._exit(70)  # could become root again: never run the query
    # the kernel already cleared "dumpable" on the uid change; say it anyway
    _prctl(PR_SET_DUMPABLE, 0)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def _stream(con: Any, text: str, max_bytes: int) -> tuple[list[str], list[list[Any]], list[str]]:
    """One statement's columns, rows as plain values (refused past ``max_bytes``) and DuckDB types."""
    relation = con.sql(text)
    if relation is None:
        return [], [], []
    columns = list(relation.columns)
    types = [str(t) for t in relation.types]
    rows: list[list[Any]] = []
    size = 0
    encode = msgspec.msgpack.Encoder().encode
    for batch in relation.to_arrow_reader(64):
        values = [column.to_pylist() for column in batch.columns]
        for i, column in enumerate(batch.columns):
            kind = column.type
            if getattr(kind, "scale", None) == 0 and str(kind).startswith("decimal"):
                # HUGEINT (sum of BIGINT) travels through Arrow as decimal(38, 0): an integer, as fetchall gives it
                values[i] = [None if v is None else int(v) for v in values[i]]
        for row in zip(*values):
            cells = [plain(v) for v in row]
            try:
                size += len(encode(cells))
            except (OverflowError, TypeError, msgspec.EncodeError) as e:
                raise SqlError(f"a value of the result cannot be sent ({e}); cast it to VARCHAR or DOUBLE",
                               EXIT_BAD_QUERY) from None
            if size > max_bytes:
                raise SqlError(f"result too large: more than {max_bytes / MIB:g} MiB after {len(rows)} rows; "
                               "add a LIMIT or aggregate", EXIT_BAD_QUERY)
            rows.append(cells)
    return columns, rows, types


def _answer(params: dict[str, Any]) -> dict[str, Any]:
    try:
        with contextlib.ExitStack() as stack:
            try:
                history = stack.enter_context(History(params["state_dir"], write_wait_s=params["write_wait_s"]))
                con = stack.enter_context(history.reader())
            except HistoryError as e:
                raise SqlError(str(e), EXIT_ERROR) from None
            except (duckdb.Error, OSError) as e:
                raise SqlError(f"the history could not be read: {_one_line(str(e))}", EXIT_ERROR) from None
            harden(con, memory_limit=f"{params['memory_mb']}MB", threads=params["threads"], spill=False)
            drop_privileges(params["uid"], params["gid"], params["groups"],
                            memory_mb=params["memory_mb"], cpu_s=params["cpu_s"])
            os.write(_REPLY_FD, READY)
            raw = sys.stdin.buffer.read(MAX_SQL_BYTES + 1)
            if len(raw) > MAX_SQL_BYTES:
                raise SqlError(f"query too long: more than {MAX_SQL_BYTES} bytes", EXIT_BAD_QUERY)
            sql = raw.decode("utf-8", "replace")
            try:
                statements = check_read_only(sql)
            except QueryRefused as e:
                raise SqlError(str(e), EXIT_BAD_QUERY) from None
            columns: list[str] = []
            rows: list[list[Any]] = []
            types: list[str] = []
            for text in statements:
                columns, rows, types = _stream(con, text, params["max_result_bytes"])
            return {"columns": columns, "rows": rows, "types": types}
    except SqlError as e:
        return {"error": str(e), "code": e.code}
    except duckdb.OutOfMemoryException as e:
        return {"error": f"out of memory (limit {params['memory_mb']} MB): {_one_line(str(e))}", "code": EXIT_BAD_QUERY}
    except (duckdb.Error, MemoryError, OSError) as e:
        # Arrow reports DuckDB's out-of-memory as OSError
        if isinstance(e, MemoryError) or (isinstance(e, OSError) and "memory" in str(e).lower()):
            return {"error": f"out of memory (limit {params['memory_mb']} MB); add a LIMIT or aggregate",
                    "code": EXIT_BAD_QUERY}
        return {"error": _one_line(str(e)), "code": EXIT_BAD_QUERY}


def main() -> None:
    """The child: on stdin a line of JSON parameters, then (once it answered READY) the query."""
    global _REPLY_FD

    os.umask(0o077)  # the read model's files (database, WAL) are created 0600
    # the answer goes out on a private copy of stdout: nothing else written to fd 1 can corrupt it
    _REPLY_FD = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    line = sys.stdin.buffer.readline(1 << 16)
    if not line:
        os._exit(0)  # a spare (imports done) the daemon retired, or the daemon is gone
    params = json.loads(line)
    reply = _answer(params)
    try:
        data = msgspec.msgpack.encode(reply)
    except (TypeError, OverflowError, msgspec.EncodeError) as e:
        data = msgspec.msgpack.encode({"error": f"a value of the result cannot be sent: {e}", "code": 2})
    view = memoryview(data)
    while view:
        view = view[os.write(_REPLY_FD, view):]
    os._exit(0)  # no interpreter teardown: the answer is out


# --- the daemon's side ----------------------------------------------------------


_PACKAGE_PARENT = str(Path(__file__).resolve().parents[3])
_CHILD = "import sys; sys.path.insert(0, sys.argv.pop(1)); from eventsched.runtime.api.sql_sandbox import main; main()"


def _child_env() -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": "/nonexistent"}
    # EVENTSCHED_PURE: the daemon's own build, sources or compiled
    return env | {name: os.environ[name] for name in ("TZ", "EVENTSCHED_PURE") if name in os.environ}


def _demote(pid: int) -> None:
    """Lower every thread of a long query (nice is per thread), so a short one gets the CPU first."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                os.setpriority(os.PRIO_PROCESS, int(tid), 10)


async def _reap(process: Any) -> None:
    if process.returncode is None:  # not reaped yet: its pid (and group, its own session) is still its
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    with anyio.CancelScope(shield=True):
        await process.wait()
        with contextlib.suppress(Exception):
            await process.aclose()


class _UserSlots:
    def __init__(self, n: int) -> None:
        self.semaphore = anyio.Semaphore(n)
        self.holders = 0


class SqlRunner:
    """The daemon's side: admission (per user and in all), one sandboxed process per query."""

    def __init__(self, state_dir: str | os.PathLike[str], limits: SqlLimits | None = None) -> None:
        self.state_dir = os.fspath(state_dir)
        self.limits = limits or SqlLimits.from_env()
        self._total = anyio.Semaphore(self.limits.total)
        self._users: dict[int, _UserSlots] = {}
        # a child started ahead of the next query, its imports done; it knows
        # nothing (no user, no query) until it is handed its parameters
        self._spare: Any = None

    async def _spawn(self) -> Any:
        return await anyio.open_process(
            [sys.executable, "-I", "-c", _CHILD, _PACKAGE_PARENT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd="/", env=_child_env(), start_new_session=True,
        )

    async def _take(self) -> Any:
        """A child for this query (the spare if it is alive), and a new spare."""
        process, self._spare = self._spare, None
        if process is None or process.returncode is not None:
            if process is not None:
                await _reap(process)
            process = await self._spawn()
        try:
            fresh = await self._spawn()
        except OSError:
            return process  # no spare this time (out of processes?): the next query starts its own
        except BaseException:
            await _reap(process)
            raise
        if self._spare is None:
            self._spare = fresh
        else:  # another query made one meanwhile
            await _reap(fresh)
        return process

    async def answer(self, sql: str, uid: int, gid: int, groups: list[int],
                     gone: Callable[[], bool] = lambda: False) -> dict[str, Any] | None:
        """The result of ``sql`` run as ``uid``, or SqlError; None once ``gone()`` (the query killed)."""
        if len(sql.encode("utf-8", "replace")) > MAX_SQL_BYTES:
            raise SqlError(f"query too long: more than {MAX_SQL_BYTES} bytes", EXIT_BAD_QUERY)
        result: dict[str, Any] | None = None
        error: SqlError | None = None
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                while not gone():
                    await anyio.sleep(0.25)
                tg.cancel_scope.cancel()  # kills the query's process (see _run)

            tg.start_soon(watch)
            try:  # a SqlError raised in here would leave the task group wrapped in an exception group
                result = await self._admitted(sql, uid, gid, groups)
            except SqlError as e:
                error = e
            finally:
                tg.cancel_scope.cancel()
        if error is not None:
            raise error
        return result

    async def _admitted(self, sql: str, uid: int, gid: int, groups: list[int]) -> dict[str, Any]:
        limits = self.limits
        slots = self._users.setdefault(uid, _UserSlots(limits.per_user))
        slots.holders += 1
        try:
            async with contextlib.AsyncExitStack() as held:
                with anyio.move_on_after(limits.queue_s) as queued:
                    await held.enter_async_context(slots.semaphore)
                    await held.enter_async_context(self._total)
                if queued.cancelled_caught:
                    raise SqlError(
                        f"too many SQL queries running (at most {limits.per_user} per user and {limits.total} in all); "
                        "try again when yours finish", EXIT_BAD_QUERY)
                return await self._run(sql, uid, gid, groups)
        finally:
            slots.holders -= 1
            if not slots.holders:
                del self._users[uid]

    async def _run(self, sql: str, uid: int, gid: int, groups: list[int]) -> dict[str, Any]:
        limits = self.limits
        params = {
            "state_dir": self.state_dir, "uid": uid, "gid": gid, "groups": list(groups),
            "memory_mb": limits.memory_mb, "threads": limits.threads, "cpu_s": limits.timeout_s * limits.threads + 5,
            "max_result_bytes": limits.max_result_bytes, "write_wait_s": limits.write_wait_s,
        }
        cap = limits.max_result_bytes + MIB  # the child refuses first; this is the daemon's own guard
        process = await self._take()
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        stdout = process.stdout
        data = bytearray()
        try:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await process.stdin.send(json.dumps(params).encode() + b"\n")

            async def receive() -> bytes:
                try:
                    return await stdout.receive(1 << 16)
                except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return b""

            async def read_until_eof() -> bool:  # False when past the cap
                while chunk := await receive():
                    data.extend(chunk)
                    if len(data) > cap:
                        return False
                return True

            with anyio.move_on_after(limits.setup_timeout_s) as setup:
                data.extend(await receive())
            if setup.cancelled_caught:
                raise SqlError(f"the history could not be caught up within {limits.setup_timeout_s:g} s; "
                               "try again", EXIT_ERROR)
            fits = True
            if data[:1] == READY:
                del data[:1]
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await process.stdin.send(sql.encode("utf-8", "replace"))
                await process.stdin.aclose()
                with anyio.move_on_after(limits.timeout_s) as query:
                    with anyio.move_on_after(1.0) as first_second:
                        fits = await read_until_eof()
                    if first_second.cancelled_caught:
                        _demote(process.pid)
                        fits = await read_until_eof()
                if query.cancelled_caught:
                    raise SqlError(f"query timed out after {limits.timeout_s:g} s (the limit for queries the "
                                   "daemon answers); narrow it or add a LIMIT", EXIT_BAD_QUERY)
            else:
                with anyio.move_on_after(limits.setup_timeout_s):
                    fits = await read_until_eof()
            if not fits:
                raise SqlError(f"result too large: more than {limits.max_result_bytes / MIB:g} MiB; "
                               "add a LIMIT or aggregate", EXIT_BAD_QUERY)
            try:
                reply = msgspec.msgpack.decode(bytes(data)) if data else None
            except msgspec.DecodeError:
                reply = None
            if not isinstance(reply, dict):
                raise SqlError(await self._died(process), EXIT_BAD_QUERY)
            if "error" in reply:
                raise SqlError(str(reply["error"]), int(reply.get("code", EXIT_BAD_QUERY)))
            return reply
        finally:
            await _reap(process)

    async def _died(self, process: Any) -> str:
        """Why the child gave no answer, in one line (and its stderr in the daemon's log)."""
        with anyio.move_on_after(5):
            await process.wait()
        err = b""
        with anyio.move_on_after(1), contextlib.suppress(Exception):
            err = await process.stderr.receive(1 << 16)
        code = process.returncode
        if err:
            logging.getLogger("eventsched.sql").warning("sql process ended with %s: %s", code,
                                                        err.decode("utf-8", "replace")[-2000:])
        if code is not None and code < 0:
            try:
                how = signal.Signals(-code).name
            except ValueError:
                how = f"signal {-code}"
        else:
            how = f"status {code}"
        return (f"the query's process ended ({how}) without an answer; it may have passed the memory "
                f"limit ({self.limits.memory_mb} MB) or the CPU limit; add a LIMIT or aggregate")


if __name__ == "__main__":
    main()
