"""IPython magics: ``%gpusubmit``, ``%%gpusubmit``, ``%gpuqueue``, ``%gpucancel``,
``%gpustatus``, ``%gpuwhatif``, ``%gpusql`` and ``%gpuscheduler``.

Options are read by the ``eventsched`` command's own parsers, so a magic
accepts exactly what the CLI accepts. IPython expands the *line* first, as for
``!shell`` (``$name``, ``{expression}``; ``$$`` and ``{{``/``}}`` for literals);
the line is then split as a POSIX shell would, but the job runs without a
shell, so a ``$HOME`` that reaches it stays ``$HOME``. A cell body is never
expanded. Errors (bad options, refusals, no daemon) are shown as one line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, NoReturn, TypeVar

import msgspec
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from traitlets import Float, Unicode

from eventsched import cli
from eventsched.domain.paths import default_socket, default_state_dir
from eventsched.domain.states import FINAL
from eventsched.domain.units import UnitError, parse_array
from eventsched.jupyter.handle import JobHandle, JobTable, Message
from eventsched.jupyter.widgets import first_line, read_tail
from eventsched.wire.client import Client, ClientError, DaemonNotRunning

__all__ = ["ArrayHandle", "EventschedMagics", "parse_submit", "subcommand_parser"]

# Kernel plumbing that must not leak into a job's environment.
KERNEL_ENV_PREFIXES = ("JPY_", "PYDEVD_", "MPLBACKEND", "IPY_")
START_TIMEOUT_S = 30.0


class _HelpShown(Exception):
    """``-h`` was given: the help is printed, nothing else happens."""


def subcommand_parser(name: str, prog: str) -> argparse.ArgumentParser:
    """The CLI's own parser of ``eventsched NAME``, raising instead of exiting."""
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = action.choices[name]
    sub.prog = prog
    return _raising(sub)


def _raising(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser``, raising a one-line ``UsageError`` instead of exiting."""
    prog = parser.prog

    def error(message: str) -> NoReturn:
        raise UsageError(f"{prog}: {message} (see {prog} -h)")

    def exit_(status: int = 0, message: str | None = None) -> NoReturn:
        raise _HelpShown  # only after -h: argparse passes a message only from error()

    parser.error = error  # type: ignore[method-assign]
    parser.exit = exit_  # type: ignore[method-assign]
    return parser


def whatif_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%gpuwhatif", description=(
        "Replay a history under other policies, or (--job) forecast when a queued job would start "
        "had it asked for other resources."))
    parser.add_argument("--policy", action="append", default=[], help="a policy to replay under (repeat for more)")
    parser.add_argument("--config", help="a config file whose [scheduler] and [tenants] to replay under")
    parser.add_argument("--since", help="measure only the jobs submitted in this window (7d, 12h) before the last one")
    parser.add_argument("--source", help="a state dir, log dir or CSV (default: this kernel's daemon's history)")
    parser.add_argument("--job", type=int, help="a queued job: forecast it under each --gpus / --gpu-mem instead")
    parser.add_argument("--gpus", action="append", default=[],
                        help="with --job: GPUs it could ask for (repeatable); else a CSV's machine, e.g. fake:8")
    parser.add_argument("--gpu-mem", dest="gpu_mem", type=int, action="append", default=[], metavar="MIB",
                        help="with --job: GPU memory per GPU it could ask for (repeatable)")
    parser.add_argument("--state-dir")
    parser.add_argument("--socket")
    return _raising(parser)


def _split(line: str, prog: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{prog}: cannot split the line: {exc}") from None


def parse_submit(line: str, prog: str = "%gpusubmit") -> tuple[argparse.Namespace, list[str]]:
    """Options, then the command: after ``--``, or from the first word that is
    not an option. Anything after the command's first word (a trailing
    ``--gpus 2`` included) belongs to the command."""
    parser = subcommand_parser("submit", prog)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the job's command (or put it after --)")
    options, after = cli.split_command(_split(line, prog))
    args = parser.parse_args(options)
    before = list(args.command)
    if before and after:
        raise UsageError(f"{prog}: the command is {before[0]!r} but there is also one after `--`; give only one")
    return args, before or after


class ArrayHandle:
    """What ``%gpusubmit --array`` returns: one ``JobHandle`` per task
    (``handles``, ``ids``; ``array_id`` is the first task's id), ``wait()``
    for them all, ``cancel()`` of the whole array; shown as one line."""

    def __init__(self, ids: list[int], socket_path: str | Path) -> None:
        self.ids, self.socket_path = list(ids), Path(socket_path)
        self.array_id = self.ids[0]
        self.handles = [JobHandle(i, self.socket_path) for i in self.ids]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> JobHandle:
        return self.handles[i]

    def states(self) -> dict[int, str]:
        """Each task's state now, by job id."""
        wanted = set(self.ids)
        with Client(self.socket_path) as c:
            return {j["id"]: j["state"] for j in c.jobs(all=True) if j["id"] in wanted}

    def wait(self, timeout: float | None = None, poll: float = 0.2) -> dict[int, str]:
        """Block until every task has finished; return their final states."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            states = self.states()
            if all(states.get(i) in FINAL for i in self.ids):
                return states
            if deadline is not None and time.monotonic() >= deadline:
                left = sum(1 for i in self.ids if states.get(i) not in FINAL)
                raise TimeoutError(f"array {self.array_id}: {left} of {len(self.ids)} tasks not finished after {timeout:g}s")
            time.sleep(poll)

    def cancel(self) -> ArrayHandle:
        with Client(self.socket_path) as c:
            c.cancel_each([self.array_id], arrays=True)
        return self

    def summary(self) -> str:
        head = f"array {self.array_id}: {len(self.ids)} tasks (jobs {self.ids[0]}-{self.ids[-1]})"
        try:
            counts = Counter(self.states().values())
        except Exception:  # a repr must never raise
            return head
        return head + ": " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))

    def __repr__(self) -> str:
        return f"<ArrayHandle {self.summary()}>"

    def _repr_html_(self) -> str:
        import html

        return f"<span class='es-array' data-array='{self.array_id}'>{html.escape(self.summary())}</span>"


T = TypeVar("T")


def user_errors(method: Callable[..., T]) -> Callable[..., T | None]:
    """Turn a user's mistake or the daemon's refusal into one line, no traceback."""

    @functools.wraps(method)
    def wrapper(self: EventschedMagics, *args: Any, **kwargs: Any) -> T | None:
        try:
            return method(self, *args, **kwargs)
        except _HelpShown:
            return None
        except DaemonNotRunning as exc:
            raise UsageError(
                f"no eventsched daemon is listening on {exc.path}. Start one from here with "
                f"`%gpuscheduler start --gpus fake:4` (simulated GPUs; leave out --gpus to use the real ones), "
                f"or in a terminal with `eventsched serve`."
            ) from None
        except (cli.UserError, UnitError, ClientError, LookupError) as exc:
            raise UsageError(first_line(exc)) from None

    return wrapper


@magics_class
class EventschedMagics(Magics):
    """Submit and watch eventsched jobs from IPython. Settable with ``%config``
    (``%config EventschedMagics.state_dir = '/scratch/me/es'``) or in
    ``ipython_config.py`` (``c.EventschedMagics.default_gpus = 0.5``)."""

    socket = Unicode("", help="Control socket; default $EVENTSCHED_SOCKET or <state_dir>/eventsched.sock.").tag(config=True)
    state_dir = Unicode("", help="State directory; default $EVENTSCHED_STATE_DIR or ~/.local/share/eventsched.").tag(config=True)
    default_gpus = Float(
        None, allow_none=True, help="--gpus for %gpusubmit when none is given (None: the daemon's default, 1 GPU)."
    ).tag(config=True)
    scheduler_gpus = Unicode("", help="--gpus for `%gpuscheduler start` when none is given, e.g. 'fake:4'.").tag(config=True)
    cell_dir = Unicode("", help="Where %%gpusubmit saves cells as scripts; default the kernel's working directory.").tag(config=True)
    python = Unicode(sys.executable, help="Interpreter that runs %%gpusubmit cells.").tag(config=True)
    _started: subprocess.Popen[bytes] | None = None  # the daemon `%gpuscheduler start` started

    def resolve_state_dir(self, args: argparse.Namespace | None = None) -> Path:
        given = getattr(args, "state_dir", None) or self.state_dir
        return Path(given).expanduser() if given else default_state_dir()

    def resolve_socket(self, args: argparse.Namespace | None = None) -> Path:
        given = getattr(args, "socket", None) or self.socket
        return Path(given).expanduser() if given else default_socket(self.resolve_state_dir(args))

    @line_cell_magic
    @user_errors
    def gpusubmit(self, line: str, cell: str | None = None) -> JobHandle | ArrayHandle | None:
        """Submit a job; returns a handle whose display follows the job's state.

        Line:  ``%gpusubmit [options] -- COMMAND [ARG...]``
        Cell:  ``%%gpusubmit [options] [-- SCRIPT-ARG...]`` runs the cell as a
        Python script (saved in ``.eventsched-cells/`` under ``cell_dir``).

        Options are those of ``eventsched submit --help``, *before* the command.
        Without ``--`` the command starts at the first word that is not an option
        and takes every word after it: in ``%gpusubmit --gpus 0.5 python train.py
        --gpus 2`` the job gets 0.5 of a GPU and ``train.py`` gets ``--gpus 2``.
        IPython expands ``$name`` and ``{expression}`` in the line (``$$``: a
        literal ``$``); the job runs without a shell unless its command is one
        quoted string with blanks, in the kernel's working directory and
        environment. ``--interactive`` prints its output here until it ends
        (interrupt the kernel to stop watching). ``--array 0-9`` submits one task
        per index (``{{index}}`` in the command: IPython expands single braces)
        and returns an ``ArrayHandle`` (``ids``, ``handles``, ``wait()``, ``cancel()``).
        """
        args, command = parse_submit(line, "%%gpusubmit" if cell is not None else "%gpusubmit")
        if cell is not None:
            command = self._cell_command(cell, command, args)
        if args.gpus is None and not args.gpu_ids and self.default_gpus is not None:
            args.gpus = self.default_gpus  # --gpu-ids alone means exactly those GPUs
        indices = parse_array(args.array)[0] if args.array is not None else None
        if indices is not None and args.interactive:
            raise UsageError("%gpusubmit: --interactive follows one job; it cannot be combined with --array")
        spec = cli.build_spec(args, command)
        env = {k: v for k, v in spec.env.items() if not k.startswith(KERNEL_ENV_PREFIXES)}
        # --dedupe's hash covers the job's environment: the one it gets, without the kernel's plumbing
        digest = cli.content_hash(spec.command, spec.cwd, args, env) if spec.content_hash else ""
        spec = msgspec.structs.replace(spec, env=env, content_hash=digest)
        socket_path = self.resolve_socket(args)
        with Client(socket_path) as c:
            if indices is not None:
                return ArrayHandle(c.submit_array(spec, indices), socket_path)
            handle = JobHandle(c.submit(spec), socket_path)
        if args.interactive:
            handle.follow()
        return handle

    def _cell_command(self, cell: str, script_args: list[str], args: argparse.Namespace) -> list[str]:
        digest = hashlib.sha256(cell.encode()).hexdigest()[:12]
        folder = Path(self.cell_dir or os.getcwd()).expanduser() / ".eventsched-cells"
        path = folder / f"cell-{digest}.py"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(cell)
        except OSError as exc:
            raise UsageError(f"%%gpusubmit: cannot save the cell in {folder}: {exc.strerror}") from None
        if not args.name:
            args.name = f"cell-{digest[:8]}"
        # -u: unbuffered, so the panel's output tail shows prints as they happen
        return [self.python, "-u", str(path), *script_args]

    @line_magic
    @user_errors
    def gpuqueue(self, line: str) -> JobTable | None:
        """``%gpuqueue [--all]``: queued and running jobs (``--all``: finished ones too).
        Returns a table (``.to_dataframe()`` for pandas). ``$var``/``{expr}`` are expanded."""
        args = subcommand_parser("queue", "%gpuqueue").parse_args(_split(line, "%gpuqueue"))
        with Client(self.resolve_socket(args)) as c:
            jobs = cli.list_jobs(c, args)  # the same as `eventsched queue`, filters included
        return JobTable(jobs, "no jobs" if args.all else "no queued or running jobs (%gpuqueue --all shows finished ones)")

    @line_magic
    @user_errors
    def gpucancel(self, line: str) -> JobTable | None:
        """``%gpucancel JOB [JOB...]``: cancel queued or running jobs (ids, or a
        variable: ``%gpucancel $job.id`` / ``%gpucancel {h.id}``). An array's
        id cancels all its tasks; ``12_3`` only task 3 of array 12. Jobs that
        cannot be cancelled (finished, unknown) are named; the others still are."""
        args = subcommand_parser("cancel", "%gpucancel").parse_args(_split(line, "%gpucancel"))
        if not (args.jobs or args.state or args.user or args.name):
            raise UsageError("%gpucancel: name the jobs, or select them with --state, --user or --name")
        with Client(self.resolve_socket(args)) as c:
            result = cli.cancel_jobs(c, args)  # the same as `eventsched cancel`, filters included
        refused = [f"job {r['job']}: {r['reason']}" for r in result["refused"]]
        if refused and not result["jobs"]:
            raise UsageError("%gpucancel: " + "; ".join(refused))
        for line_ in refused:  # the others were cancelled: say which were not
            print(line_, file=sys.stderr)
        return JobTable(result["jobs"])

    @line_magic
    @user_errors
    def gpustatus(self, line: str) -> Any:
        """``%gpustatus``: the live panel (GPUs, jobs with their buttons, a job's output),
        kept current by a background thread while other cells run."""
        from eventsched.jupyter.widgets import StatusPanel

        args = subcommand_parser("status", "%gpustatus").parse_args(_split(line, "%gpustatus"))
        socket_path = self.resolve_socket(args)
        with Client(socket_path) as c:
            status = c.status()  # no daemon: say so now, not in a corner of the panel
        return StatusPanel(socket_path, status)

    @line_magic
    @user_errors
    def gpuwhatif(self, line: str) -> Any:
        """``%gpuwhatif --policy best-fit --policy fair-share [--config FILE] [--since 7d] [--source PATH]``:
        replay this daemon's history (or ``--source``) under each policy, as
        ``eventsched replay`` does; returns the table and draws the chart.
        ``%gpuwhatif --job 12 --gpus 1 [--gpu-mem 20000]``: when would queued
        job 12 start had it asked for that instead, beside its own request."""
        from eventsched.jupyter.whatif import DEFAULT_POLICIES, alternatives_of, job_whatif, whatif

        args = whatif_parser().parse_args(_split(line, "%gpuwhatif"))
        if args.job is None:
            if args.gpu_mem:
                raise UsageError("%gpuwhatif: --gpu-mem goes with --job N")
            source = args.source or str(self.resolve_state_dir(args))
            try:
                return whatif(args.policy or DEFAULT_POLICIES, args.config, source, args.since,
                              gpus=args.gpus[-1] if args.gpus else None)
            except ValueError as exc:
                raise UsageError(f"%gpuwhatif: {first_line(exc)}") from None
        if args.policy or args.config or args.since or args.source:
            raise UsageError("%gpuwhatif --job: give only --gpus and --gpu-mem (policies are for a replay)")
        try:
            gpus = [float(g) for g in args.gpus]
        except ValueError:
            raise UsageError(f"%gpuwhatif: --gpus {args.gpus!r}: give a number of GPUs, e.g. --gpus 1") from None
        if not (gpus or args.gpu_mem):
            raise UsageError("%gpuwhatif --job: say what it could ask for instead: --gpus N and/or --gpu-mem MIB")
        return job_whatif(self.resolve_socket(args), args.job, alternatives_of(gpus, args.gpu_mem))

    @line_cell_magic
    @user_errors
    def gpusql(self, line: str, cell: str | None = None) -> Any:
        """``%gpusql [-o NAME] [--state-dir DIR] SELECT ...`` (or ``%%gpusql`` with the
        query in the cell): read-only SQL over the whole history (DuckDB) as a pandas
        DataFrame, also stored in ``NAME`` with ``-o``. IPython expands the line, not the cell."""
        out, state_dir, query = split_sql_line(line)
        if cell is not None:
            if query:
                raise UsageError("%%gpusql: options only on the line; the query is the cell")
            query = cell
        if not query.strip():
            raise UsageError("%gpusql: no query given, e.g. %gpusql SELECT * FROM jobs")
        if out is not None and not out.isidentifier():
            raise UsageError(f"%gpusql: -o {out!r} is not a Python name")
        frame = self._query(self.resolve_state_dir(argparse.Namespace(state_dir=state_dir)), query)
        if out is not None:
            if self.shell is None:  # only when built by hand, outside IPython
                raise UsageError("%gpusql -o: no IPython shell to store the result in")
            self.shell.user_ns[out] = frame
        return frame

    def _query(self, state_dir: Path, query: str) -> Any:
        import duckdb
        import pandas as pd

        from eventsched.projections.history import HistoryError, open_history

        try:
            columns, rows = open_history(state_dir).query(query)
        except HistoryError as exc:
            raise UsageError(str(exc)) from None
        except duckdb.Error as exc:
            raise UsageError(f"%gpusql: {first_line(exc)}") from None
        return pd.DataFrame(rows, columns=columns)

    @line_magic
    @user_errors
    def gpuscheduler(self, line: str) -> Message | None:
        """``%gpuscheduler start [serve options]`` starts a daemon in the background (the
        options of ``eventsched serve``, e.g. ``--gpus fake:4``) and waits until it answers;
        later magics of this kernel use its state directory and socket. It outlives the
        kernel; its output goes to ``<state-dir>/serve.out``. ``%gpuscheduler status`` says
        whether one answers; ``stop`` shuts it down (its jobs keep running, re-adopted later).
        """
        words = _split(line, "%gpuscheduler")
        if not words or words[0] not in ("start", "stop", "status"):
            raise UsageError("%gpuscheduler: say `start [--gpus fake:4 ...]`, `status` or `stop`")
        action, rest = words[0], words[1:]
        if action == "start":
            return self._start(rest)
        socket_path = self.resolve_socket(subcommand_parser("health", f"%gpuscheduler {action}").parse_args(rest))
        info = _ping(socket_path)
        if action == "status":
            return Message(f"eventsched daemon pid {info['pid']} answers on {socket_path} (log at seq {info['seq']})", **info)
        return self._stop(int(info["pid"]))

    def _start(self, words: list[str]) -> Message:
        args = subcommand_parser("serve", "%gpuscheduler start").parse_args(words)
        state_dir, socket_path = self.resolve_state_dir(args), self.resolve_socket(args)
        with contextlib.suppress(DaemonNotRunning):
            info = _ping(socket_path)
            self._remember(args)
            return Message(f"an eventsched daemon is already running (pid {info['pid']}) on {socket_path}", **info)
        words = [*words, *(["--gpus", self.scheduler_gpus] if args.gpus is None and self.scheduler_gpus else []),
                 *([] if args.state_dir else ["--state-dir", str(state_dir)]),
                 *([] if args.socket else ["--socket", str(socket_path)])]
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            out = open(state_dir / "serve.out", "ab")
        except OSError as exc:
            raise UsageError(f"%gpuscheduler: cannot use {state_dir}: {exc.strerror}") from None
        with out:
            # own session: interrupting the kernel must not reach the daemon
            proc = subprocess.Popen([sys.executable, "-m", "eventsched.cli", "serve", *words], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=state_dir)
        self._started = proc
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            code = proc.poll()
            if code is not None:
                raise UsageError(f"%gpuscheduler: the daemon exited with status {code}: {_last_line(state_dir / 'serve.out')}")
            try:
                _ping(socket_path)
                break
            except ClientError:
                if time.monotonic() > deadline:
                    raise UsageError(f"%gpuscheduler: the daemon (pid {proc.pid}) did not answer within "
                                     f"{START_TIMEOUT_S:g}s; see {state_dir / 'serve.out'}") from None
                time.sleep(0.1)
        self._remember(args)
        return Message(
            f"eventsched daemon started (pid {proc.pid}) on {socket_path}; state in {state_dir}, "
            f"output in {state_dir / 'serve.out'}", pid=proc.pid, socket=str(socket_path), state_dir=str(state_dir),
        )

    def _remember(self, args: argparse.Namespace) -> None:
        """Later magics talk to the daemon just started (or found)."""
        if args.state_dir:
            self.state_dir = str(Path(args.state_dir).expanduser())
        if args.socket:
            self.socket = str(Path(args.socket).expanduser())

    def _stop(self, pid: int) -> Message:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return Message(f"the daemon (pid {pid}) has already gone")
        except PermissionError:
            raise UsageError(f"%gpuscheduler: the daemon (pid {pid}) belongs to another user") from None
        ours = self._started if self._started is not None and self._started.pid == pid else None
        deadline = time.monotonic() + 15
        while ours.poll() is None if ours else _alive(pid):  # a child of ours must be reaped to be gone
            if time.monotonic() > deadline:
                raise UsageError(f"%gpuscheduler: the daemon (pid {pid}) is still running 15s after SIGTERM")
            time.sleep(0.1)
        return Message(f"eventsched daemon (pid {pid}) stopped", pid=pid)


_SQL_OPTION = re.compile(r"\s*(-o|--out|--state-dir)(?:\s+|=)(\S+)")


def split_sql_line(line: str) -> tuple[str | None, str | None, str]:
    """``-o NAME`` / ``--state-dir DIR`` before the query; the query kept as typed
    (its quotes matter to SQL, so it is not split like a shell line)."""
    found: dict[str, str] = {}
    rest = line
    while match := _SQL_OPTION.match(rest):
        found["--state-dir" if match.group(1) == "--state-dir" else "-o"] = match.group(2)
        rest = rest[match.end():]
    rest = rest.strip()
    if rest.startswith("-"):
        raise UsageError(f"%gpusql: unknown option {rest.split()[0]!r}; options are -o NAME and --state-dir DIR")
    return found.get("-o"), found.get("--state-dir"), rest


def _ping(socket_path: Path) -> dict[str, Any]:
    with Client(socket_path, timeout=5.0) as c:
        return c.ping()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _last_line(path: Path) -> str:
    lines = [l for l in read_tail(str(path)).splitlines() if l.strip()]
    return lines[-1] if lines else "(no output)"
