"""The ``eventsched`` command (SPEC §2 is its contract).

Imports are lazy: a ``submit`` from a shell loop must not pay for anyio,
DuckDB or the scheduler core, only for argparse, msgspec and a socket.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from eventsched.domain.paths import socket_location
from eventsched.domain.states import FINAL, JobState
from eventsched.domain.units import (
    UnitError,
    parse_duration,
    parse_gpu_ids,
    parse_job_ids,
)

if TYPE_CHECKING:
    from pathlib import Path

    from eventsched.domain.events import JobSpec
    from eventsched.wire.client import Client

EXIT_USAGE = 2


class UserError(Exception):
    """A mistake of the user's: printed as one line, exit status 2."""


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    print(f"eventsched: error: {message}", file=sys.stderr)
    raise SystemExit(code)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        fail(f"{message} (see `{self.prog} --help`)")


# --- parsing helpers --------------------------------------------------------


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """Options before ``--``, the job's command after it."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


# --- output ---------------------------------------------------------------


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """Aligned columns (``text.table``); None shows as nothing."""
    from eventsched.domain.text import table as aligned

    return aligned(headers, [["" if c is None else str(c) for c in row] for row in rows])


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_gpus(amount: float) -> str:
    return f"{amount:g}"


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


# --- client-side commands -------------------------------------------------


def client(args: argparse.Namespace) -> Client:  # imported lazily (start-up time)
    from eventsched.wire.client import Client

    return Client(args.socket or socket_location(args.state_dir))


def build_spec(args: argparse.Namespace, command: list[str]) -> JobSpec:
    from eventsched.domain import rlimits
    from eventsched.domain.events import JobSpec

    if not command:
        raise UserError("no command given: put it after `--`, e.g. eventsched submit --gpus 1 -- python train.py")
    if args.gpus is not None and not (args.gpus >= 0):
        raise UserError(f"--gpus must be a share in (0, 1] or a whole number of GPUs, not {args.gpus}")
    env = dict(os.environ)
    spec = JobSpec(
        command=command,
        cwd=os.getcwd(),
        env=env,
        name=args.name or os.path.basename(command[0]),
        gpus=1.0 if args.gpus is None else args.gpus,
        gpu_mem_mib=args.gpu_mem or 0,
        gpu_ids=parse_gpu_ids(args.gpu_ids) if args.gpu_ids else None,
        priority=args.priority,
        time_limit_s=parse_duration(args.time_limit) if args.time_limit else None,
        on_time_limit="requeue" if args.requeue_on_time_limit else "kill",
        tenant=args.tenant or "",
        after=parse_job_ids(args.after) if args.after else [],
        retries=args.retries,
        conda=args.conda or "",
        env_setup=args.env_setup or "",
        interactive=args.interactive,
        content_hash=content_hash(command, os.getcwd(), args) if args.dedupe else "",
        # the job gets our umask and limits (the daemon clamps them to its own)
        umask=rlimits.current_umask(),
        rlimits=rlimits.current(),
    )
    return spec


def content_hash(command: list[str], cwd: str, args: argparse.Namespace) -> str:
    import hashlib

    material = json.dumps([command, cwd, args.conda or "", args.env_setup or ""])
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def cmd_submit(args: argparse.Namespace, command: list[str]) -> int:
    spec = build_spec(args, command)
    with client(args) as c:
        job = c.submit(spec)
        if args.json:
            print_json({"id": job})
        else:
            print(job)
        sys.stdout.flush()
        if args.interactive:
            return follow_output(c, job, detach_message=True)
    return 0


def cmd_queue(args: argparse.Namespace) -> int:
    with client(args) as c:
        jobs = c.jobs(all=args.all)
    order = {"running": 0, "queued": 1, "held": 2}
    jobs.sort(key=lambda j: (order.get(j["state"], 3), -j["priority"] if j["state"] == "queued" else 0, j["id"]))
    if args.json:
        print_json(jobs)
        return 0
    if not jobs:
        print("no jobs" if args.all else "no queued or running jobs (--all shows finished ones)")
        return 0
    now = __import__("time").time()
    rows = []
    for j in jobs:
        if j["state"] == JobState.QUEUED:
            elapsed = now - j["submitted_at"]
        elif j["started_at"] is not None:
            elapsed = (j["ended_at"] or now) - j["started_at"]
        else:
            elapsed = None
        rows.append(
            [
                j["id"],
                j["name"][:24],
                j["user"],
                j["state"],
                j["priority"],
                format_gpus(j["gpus"]),
                ",".join(map(str, j["gpu_ids"])) or "-",
                human_duration(elapsed),
                "" if j["exit_code"] is None else j["exit_code"],
                _short_reason(j),
            ]
        )
    print(table(["ID", "NAME", "USER", "STATE", "PRI", "GPUS", "ON", "TIME", "EXIT", "REASON"], rows))
    return 0


def _short_reason(job: dict) -> str:
    """The REASON column (Slurm's NODELIST(REASON)): why it waits, cut to fit;
    `eventsched explain ID` tells the whole of it."""
    text = job.get("reason") or ""
    return text if len(text) <= 60 else text[:57] + "..."


def render_status(status: dict) -> str:
    rows = []
    for g in status["gpus"]:
        mem = f"{g['memory_used_mib']}/{g['memory_total_mib']} MiB"
        util = "" if g["utilization"] is None else f"{g['utilization']:.0f}%"
        temp = "" if g["temperature_c"] is None else f"{g['temperature_c']:.0f}C"
        bar = "#" * round(g["allocated"] * 10)
        state = "paused" if g["paused"] else ("lost" if g.get("lost") else "")
        rows.append([g["id"], f"[{bar:<10}] {g['allocated']:.2f}", util, mem, temp, state, ",".join(map(str, g.get("jobs", [])))])
    text = table(["GPU", "ALLOCATED", "UTIL", "MEMORY", "TEMP", "STATE", "JOBS"], rows)
    jobs = status["jobs"]
    running = sum(1 for j in jobs if j["state"] == JobState.RUNNING)
    queued = sum(1 for j in jobs if j["state"] == JobState.QUEUED)
    return f"{text}\n\npolicy {status['policy']}  running {running}  queued {queued}  log seq {status['seq']}"


def cmd_status(args: argparse.Namespace) -> int:
    def draw(status: dict) -> None:
        if args.json:
            print(json.dumps(status) if args.watch else json.dumps(status, indent=2), flush=True)
        elif args.watch:
            sys.stdout.write("\x1b[2J\x1b[H" + render_status(status) + "\n")
            sys.stdout.flush()
        else:
            print(render_status(status))

    with client(args) as c:
        draw(c.status())
        if args.watch:
            try:
                # redraw on every committed batch of events: nothing is polled
                for _batch in c.subscribe(from_seq=0):
                    draw(c.status())
            except KeyboardInterrupt:
                return 0
    return 0


def cmd_jobs_action(args: argparse.Namespace, action: str) -> int:
    ids = parse_job_ids(args.jobs)
    with client(args) as c:
        result = getattr(c, action)(ids)
    for job in result:
        print(f"{job['id']}\t{job['state']}")
    return 0


def cmd_gpu_action(args: argparse.Namespace, action: str) -> int:
    with client(args) as c:
        gpu = getattr(c, action)(args.gpu)
    print(f"gpu {gpu['id']}: {'paused' if gpu['paused'] else 'accepting jobs'}")
    return 0


def follow_output(c: Client, job: int, *, follow: bool = True, detach_message: bool = False) -> int:
    """Print a job's output file; with ``follow``, until the job ends."""
    import time

    from eventsched.wire import protocol
    from eventsched.wire.client import read_new_output

    final = FINAL
    info = c.request(protocol.JobLogPath(job=job))
    path = info["path"]
    position = 0
    state = info["state"]
    next_check = 0.0
    try:
        while True:
            try:
                chunk = read_new_output(path, position)
            except PermissionError:
                raise UserError(f"cannot read {path}: permission denied") from None
            if chunk:
                position += len(chunk)
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            if not follow or state in final:
                break
            if time.monotonic() >= next_check:
                state = c.request(protocol.JobLogPath(job=job))["state"]
                next_check = time.monotonic() + 0.5
                if state in final:
                    continue  # one more read catches the last output
            time.sleep(0.05)
    except KeyboardInterrupt:
        if detach_message:
            print(f"\ndetached; job {job} keeps running (eventsched logs {job} -f)", file=sys.stderr)
        return 0
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    with client(args) as c:
        info = c.explain(args.job)
    if args.json:
        print_json(info)
    else:
        from eventsched.projections.story import render_explanation

        print(render_explanation(info))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    with client(args) as c:
        return follow_output(c, args.job, follow=args.follow)


# --- local commands ---------------------------------------------------------


def state_dir_of(args: argparse.Namespace) -> Path:
    from pathlib import Path

    from eventsched.domain.paths import default_state_dir

    return Path(args.state_dir) if args.state_dir else default_state_dir()


def cmd_serve(args: argparse.Namespace) -> int:
    from eventsched.runtime.daemon import serve

    return serve(args)


def cmd_log(args: argparse.Namespace) -> int:
    from eventsched.storage import logtools

    if args.log_command == "verify":
        return logtools.verify(args.dir)
    if args.log_command == "dump":
        return logtools.dump(args.dir, json=args.json, from_seq=args.from_seq)
    return logtools.repair(args.dir)


def cmd_sql(args: argparse.Namespace) -> int:
    from eventsched.cli.sql import run_sql
    from eventsched.projections.sql import SqlError, needs_daemon

    state_dir = state_dir_of(args)
    if not needs_daemon(state_dir):
        return run_sql(state_dir, args.query, args.format)
    from eventsched.wire import protocol
    from eventsched.wire.client import Client, ClientError

    # the daemon bounds the query itself (catch-up, then its own time limit)
    c = Client(args.socket or socket_location(args.state_dir), timeout=180.0)

    def via_daemon(sql: str) -> dict[str, Any]:
        try:
            result: dict[str, Any] = c.request(protocol.RunSql(query=sql))
            return result
        except ClientError as exc:
            raise SqlError(str(exc), 2) from None
        except OSError as exc:  # e.g. the daemon took longer than the client waits
            raise SqlError(f"no answer from the daemon: {exc.strerror or exc}", 1) from None

    with c:
        return run_sql(state_dir, args.query, args.format, via_daemon=via_daemon)


def cmd_metrics(args: argparse.Namespace) -> int:
    from eventsched.projections.metrics import run_metrics

    fmt = "json" if args.json else "prometheus" if args.prometheus else "table"
    return run_metrics(state_dir_of(args), fmt)


def cmd_replay(args: argparse.Namespace) -> int:
    from eventsched.cli.replay import run_replay

    return run_replay(args)


def cmd_config_sample(args: argparse.Namespace) -> int:
    from eventsched.runtime.config import sample_config

    sys.stdout.write(sample_config())
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    with client(args) as c:
        info = c.ping()
    if args.json:
        print_json(info)
    else:
        print(f"ok: daemon pid {info['pid']}, log at seq {info['seq']}")
    return 0


# --- the parser -------------------------------------------------------------


COMMANDS = (
    "serve", "submit", "queue", "status", "cancel", "hold", "release", "pause-gpu", "resume-gpu",
    "logs", "explain", "health", "sql", "metrics", "replay", "log", "config-sample",
)


def build_parser(only: str | None = None) -> Parser:
    """The whole parser, or with ``only`` just that command's (faster)."""

    def want(name: str) -> bool:
        return only is None or only == name

    common = Parser(add_help=False)  # parents=[...] must be Parsers too (typeshed)
    common.add_argument("--state-dir", help="state directory (default $EVENTSCHED_STATE_DIR or ~/.local/share/eventsched)")
    common.add_argument("--socket", help="control socket (default $EVENTSCHED_SOCKET or <state-dir>/eventsched.sock)")

    parser = Parser(prog="eventsched", description="GPU job scheduler for a shared machine")
    sub = parser.add_subparsers(dest="command", parser_class=Parser, metavar="COMMAND")
    sub.required = True

    if want("serve"):
        p = sub.add_parser("serve", parents=[common], help="run the scheduler daemon")
        p.add_argument("--gpus", help="fake:N[:MEM_MIB] for simulated GPUs; default: NVML")
        p.add_argument("--policy", help="placement policy (fifo, priority, best-fit, sjf-backfill, fgd)")
        p.add_argument("--config", help="TOML config file (see `eventsched config-sample`)")
        p.add_argument("--sample-interval", type=float, help="seconds between GPU samples (default 2)")
        p.add_argument("--time-limit", help="global time limit for every job (seconds or 2h, 30m ...)")
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
        p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this HTTP port (GET /metrics)")
        p.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port (default 127.0.0.1)")

    if want("submit"):
        p = sub.add_parser("submit", parents=[common], help="submit a job: eventsched submit [options] -- COMMAND ...")
        p.add_argument("--gpus", type=float, help="share of one GPU (0.1-1.0) or a whole number of GPUs (default 1)")
        p.add_argument("--gpu-mem", type=int, metavar="MIB", help="GPU memory needed on each GPU, MiB")
        p.add_argument("--gpu-ids", metavar="LIST", help="allowed GPU ids, e.g. 1,3 or 0-3")
        p.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
        p.add_argument("--name")
        p.add_argument("--time-limit", metavar="SECONDS", help="kill after this long (90, 15m, 2h)")
        p.add_argument("--requeue-on-time-limit", action="store_true", help="requeue at the back instead of killing for good")
        p.add_argument("--tenant")
        p.add_argument("--after", action="append", metavar="JOB", help="run only after JOB succeeded (repeatable)")
        p.add_argument("--retries", type=int, default=0, help="retry a failed job up to N times")
        p.add_argument("--conda", metavar="ENV", help="activate this conda environment first")
        p.add_argument("--env-setup", metavar="CMD", help='shell set-up run first, e.g. "source venv/bin/activate"')
        p.add_argument("--dedupe", action="store_true", help="refuse if an identical job is queued, running or succeeded")
        p.add_argument("--interactive", action="store_true", help="stream the job's output here; Ctrl+C detaches")
        p.add_argument("--json", action="store_true")

    if want("queue"):
        p = sub.add_parser("queue", parents=[common], help="list queued and running jobs")
        p.add_argument("--all", action="store_true", help="include finished jobs")
        p.add_argument("--json", action="store_true")

    if want("status"):
        p = sub.add_parser("status", parents=[common], help="GPUs, allocation and jobs")
        p.add_argument("--json", action="store_true")
        p.add_argument("--watch", action="store_true", help="keep updating as events arrive")

    if any(want(n) for n in ("cancel", "hold", "release")):
        for name, what in (("cancel", "cancel jobs"), ("hold", "hold queued jobs"), ("release", "release held jobs")):
            p = sub.add_parser(name, parents=[common], help=what)
            p.add_argument("jobs", nargs="+", metavar="JOB")

    if any(want(n) for n in ("pause-gpu", "resume-gpu")):
        for name, what in (("pause-gpu", "place nothing new on a GPU"), ("resume-gpu", "accept jobs on a GPU again")):
            p = sub.add_parser(name, parents=[common], help=what)
            p.add_argument("gpu", type=int, metavar="ID")

    if want("explain"):
        p = sub.add_parser("explain", parents=[common], help="why a job waits, and its story")
        p.add_argument("job", type=int)
        p.add_argument("--json", action="store_true")

    if want("logs"):
        p = sub.add_parser("logs", parents=[common], help="print a job's output")
        p.add_argument("job", type=int)
        p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")

    if want("health"):
        p = sub.add_parser("health", parents=[common], help="is the daemon up (exit 0) or not")
        p.add_argument("--json", action="store_true")

    if want("sql"):
        p = sub.add_parser("sql", parents=[common], help="read-only SQL over the whole history (DuckDB)")
        p.add_argument("query")
        p.add_argument("--format", choices=["table", "csv", "json"], default="table")

    if want("metrics"):
        p = sub.add_parser("metrics", parents=[common], help="wait/run times, utilisation, GPU-hours")
        group = p.add_mutually_exclusive_group()
        group.add_argument("--json", action="store_true")
        group.add_argument("--prometheus", action="store_true")

    if want("replay"):
        p = sub.add_parser("replay", parents=[common], help="replay a log or trace under policies")
        p.add_argument("source", help="a state dir, a log dir, or a trace file")
        p.add_argument("--policy", action="append", required=True)
        p.add_argument("--json", action="store_true")
        p.add_argument("--static", action="store_true", help="FGD-style static packing experiment (Alibaba trace)")
        p.add_argument("--seeds", default="42-51", help="seeds for --static (default 42-51)")
        p.add_argument("--gpus", help="for CSV traces: fake:N[:MEM_MIB] machine to replay on")
        p.add_argument("--out", help="where replay logs go (default: a temporary directory)")

    if want("log"):
        p = sub.add_parser("log", help="inspect the event log")
        log_sub = p.add_subparsers(dest="log_command", parser_class=Parser, metavar="ACTION")
        log_sub.required = True
        q = log_sub.add_parser("verify", help="check every frame's checksum")
        q.add_argument("dir")
        q = log_sub.add_parser("dump", help="one event per line")
        q.add_argument("dir")
        q.add_argument("--json", action="store_true")
        q.add_argument("--from-seq", type=int, default=1)
        q = log_sub.add_parser("repair", help="move damaged frames aside so the log opens again")
        q.add_argument("dir")

    if want("config-sample"):
        sub.add_parser("config-sample", help="print a commented sample config file")

    return parser


def _import_msgspec_lean() -> None:
    """Import msgspec without typing_extensions: ~10 ms of every CLI call.

    msgspec only takes ``get_type_hints``, ``Required`` and ``NotRequired``
    from typing_extensions when it is installed (the notebook stack brings
    it), and Python >= 3.11's typing has all three. The block is lifted at
    once, so any later import of typing_extensions works as usual.
    """
    if "msgspec" in sys.modules or "typing_extensions" in sys.modules or sys.version_info < (3, 11):
        return
    sys.modules["typing_extensions"] = None  # type: ignore[assignment]  # makes its import fail
    try:
        import msgspec  # noqa: F401
    finally:
        del sys.modules["typing_extensions"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _import_msgspec_lean()
    options, command = split_command(argv)
    # building the one parser needed keeps `submit` fast; anything unusual
    # (help, a typo) gets the whole parser and its messages
    first = options[0] if options and not options[0].startswith("-") else None
    parser = build_parser(only=first if first in COMMANDS else None)
    args = parser.parse_args(options)
    if command and args.command != "submit":
        fail(f"`--` is only for `submit`, not `{args.command}`")
    handlers: dict[str, Callable[[], int]] = {
        "serve": lambda: cmd_serve(args),
        "submit": lambda: cmd_submit(args, command),
        "queue": lambda: cmd_queue(args),
        "status": lambda: cmd_status(args),
        "cancel": lambda: cmd_jobs_action(args, "cancel"),
        "hold": lambda: cmd_jobs_action(args, "hold"),
        "release": lambda: cmd_jobs_action(args, "release"),
        "pause-gpu": lambda: cmd_gpu_action(args, "pause_gpu"),
        "resume-gpu": lambda: cmd_gpu_action(args, "resume_gpu"),
        "logs": lambda: cmd_logs(args),
        "explain": lambda: cmd_explain(args),
        "health": lambda: cmd_health(args),
        "sql": lambda: cmd_sql(args),
        "metrics": lambda: cmd_metrics(args),
        "replay": lambda: cmd_replay(args),
        "log": lambda: cmd_log(args),
        "config-sample": lambda: cmd_config_sample(args),
    }
    from eventsched.wire.client import ClientError

    try:
        return handlers[args.command]()
    except (UserError, UnitError) as exc:
        fail(str(exc))
    except ClientError as exc:
        fail(str(exc), code=1)
    except BrokenPipeError:
        return 0
    except TimeoutError:
        fail("the daemon did not answer in time; it may be overloaded (try again)", code=1)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
