"""The ``eventsched`` command. Imports are lazy: a ``submit`` from a shell
loop must not pay for anyio, DuckDB or the scheduler core, nor its fast path
(``quick.py``) for argparse or msgspec."""

from __future__ import annotations

import os
import sys

from eventsched.cli.commands import ALIASES, COMMANDS
from eventsched.cli.errors import UserError, fail, refusal_exit
from eventsched.domain.paths import socket_location
from eventsched.domain.units import (UnitError, format_duration as human_duration, parse_array, parse_begin,
                                     parse_duration, parse_gpu_ids, parse_job_ids, parse_signal)

TYPE_CHECKING = False  # typing is costly to import for every CLI call; mypy reads this as True
if TYPE_CHECKING:
    import argparse
    from pathlib import Path
    from typing import Any, Callable

    from eventsched.domain.events import JobSpec
    from eventsched.wire.client import Client


def client(args: argparse.Namespace) -> Client:
    """The daemon's client (``cli/connect.py``, imported only by the commands that talk to it)."""
    from eventsched.cli import connect

    return connect.client(args)


def state_dir_of(args: argparse.Namespace) -> Path:
    from eventsched.cli import connect

    return connect.state_dir_of(args)


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """Options before ``--``, the job's command after it."""
    i = argv.index("--") if "--" in argv else len(argv)
    return argv[:i], argv[i + 1 :]


def build_spec(args: argparse.Namespace, command: list[str]) -> JobSpec:
    from eventsched.domain.events import JobSpec

    spec = JobSpec(**spec_fields(args, command))
    if any("--llm" in word for word in command):  # "--llm NAME" sizes the job from llm_config.json
        from eventsched.cli.submit_file import llm_sized

        spec = llm_sized(args, command, spec)
    return spec


def spec_fields(args: argparse.Namespace | Any, command: list[str]) -> dict[str, Any]:
    """The JobSpec's fields for ``submit``'s options and command (``quick.py`` sends them as they are)."""
    from eventsched.domain import rlimits

    if not command:
        raise UserError("no command given: put it after `--`, e.g. eventsched submit --gpus 1 -- python train.py")
    if args.gpus is not None and not (args.gpus >= 0):
        raise UserError(f"--gpus must be 0, a share in [0.001, 1] or a whole number of GPUs, not {args.gpus}")
    if args.host_mem is not None and args.host_mem <= 0:
        raise UserError(f"--host-mem must be a positive number of MiB, not {args.host_mem}")
    env = dict(os.environ)
    env.pop("EVENTSCHED_TOKEN", None)  # a secret: never in a job's environment (nor so in the log)
    # -- "python x.py --lr 3" runs through the shell; the same string without -- was split into words
    shell = not getattr(args, "shell_free", False) and is_shell_string(command)
    node = args.node or ""
    ids_text = args.gpu_ids
    if ids_text and ":" in ids_text:  # --gpu-ids NODE:0,1
        on, _, ids_text = ids_text.rpartition(":")
        if node and on != node:
            raise UserError(f"--gpu-ids {args.gpu_ids} names node {on!r} but --node says {node!r}")
        node = on
    gpu_ids = parse_gpu_ids(ids_text) if ids_text else None
    warn = parse_signal(args.signal) if args.signal else None  # --signal SIG@SECONDS
    notify = getattr(args, "notify", None)
    if notify:  # --notify end,fail
        from eventsched.cli.notify import kinds

        notify = kinds(notify)
    return dict(
        node=node, command=command, shell=shell, cwd=os.getcwd(), env=env,
        name=args.name or os.path.basename(command[0].split()[0] if shell and command[0].split() else command[0]),
        # --gpu-ids alone means exactly those GPUs; with --gpus K, K of them
        gpus=args.gpus if args.gpus is not None else float(len(gpu_ids)) if gpu_ids else 1.0,
        gpu_mem_mib=args.gpu_mem or 0, gpu_ids=gpu_ids, priority=args.priority,
        time_limit_s=parse_duration(args.time_limit) if args.time_limit else None,
        on_time_limit="requeue" if args.requeue_on_time_limit else "kill",
        tenant=args.tenant or "", after=parse_job_ids(args.after) if args.after else [], retries=args.retries,
        conda=args.conda or "", env_setup=args.env_setup or "", interactive=args.interactive,
        content_hash=content_hash(command, os.getcwd(), args, env) if args.dedupe else "",
        # the job gets our umask and limits (the daemon clamps them to its own)
        umask=rlimits.current_umask(), rlimits=rlimits.current(),
        array_cap=parse_array(args.array)[1] if args.array is not None else 0,  # %K
        session=args.session or "", host_mem_mib=args.host_mem or 0, preemptible=args.preemptible,
        begin=parse_begin(args.begin, __import__("time").time()) if args.begin else 0.0,
        **({"warn_signal": warn[0], "warn_s": warn[1]} if warn else {}),
        **({"notify": notify} if notify else {}),
    )


def content_hash(command: list[str], cwd: str, args: argparse.Namespace, env: dict[str, str] | None = None) -> str:
    """--dedupe's key (``domain/dedupe.py``)."""
    from eventsched.domain.dedupe import content_key

    return content_key(command, cwd, args.conda or "", args.env_setup or "", env)


def is_shell_string(command: list[str]) -> bool:
    """One argument with blanks (``-- "python x.py --lr 3"``) is a shell command line, unless a file."""
    return len(command) == 1 and any(c in command[0] for c in " \t\n;|&") and not os.path.exists(command[0])


def split_words(line: str) -> list[str]:
    """A command given as one string without ``--``, split into words as a shell
    would split them; what only a shell would do (``|``, ``;``, ``>``) is refused."""
    import shlex

    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError as exc:  # an unclosed quote
        raise UserError(f"cannot split the command {line!r}: {exc}") from None
    operators = [w for w in words if w and set(w) <= set(lexer.punctuation_chars)]
    if operators:
        raise UserError(f"{line!r} needs a shell ({operators[0]!r}): to run it through one, put it after `--` "
                        f"(submit -- {shlex.quote(line)})")
    return words


def cmd_submit(args: argparse.Namespace, command: list[str]) -> int:
    """One job, or with ``--array`` one task per index, acknowledged together."""
    from eventsched.cli.quick import show_ids

    indices = parse_array(args.array)[0] if args.array is not None else None
    if args.interactive and indices is not None:
        raise UserError("--interactive follows one job; it cannot be combined with --array")
    spec = build_spec(args, command)
    with client(args) as c:
        if indices is not None:
            show_ids(c.submit_array(spec, indices), args.json)
            return 0
        show_ids(job := c.submit(spec), args.json)
        return follow_output(c, job, detach_message=True, exit_status=True) if args.interactive else 0


def list_jobs(c: Client, args: argparse.Namespace) -> list[dict]:
    """``queue``'s jobs (and ``%gpuqueue``'s): those ``--all`` and the filters
    ask for, running first, then the queue in the order it runs."""
    from eventsched.cli.filters import job_filter

    select = job_filter(args)
    jobs = c.jobs(all=args.all or (select is not None and select.finished))
    if select is not None:
        jobs = [j for j in jobs if select(j)]
    order = {"running": 0, "queued": 1, "held": 2}
    jobs.sort(key=lambda j: (order.get(j["state"], 3), -j["priority"] if j["state"] == "queued" else 0, j["id"]))
    return jobs


def cmd_queue(args: argparse.Namespace) -> int:
    from eventsched.domain.states import WAITING, JobState
    from eventsched.domain.text import print_json, table

    with client(args) as c:
        jobs = list_jobs(c, args)
    if args.json:
        print_json(jobs)
        return 0
    if not jobs:
        print("no job matches" if args.state or args.user or args.name else "no jobs" if args.all
              else "no queued or running jobs (--all shows finished ones)")
        return 0
    now = __import__("time").time()
    rows = []
    tenant_of: list[str] = []  # each row's tenant: a column when the jobs listed are of several
    folded: set[int] = set()
    for j in jobs:
        array = j.get("array_id")
        if array is not None and not args.expand:  # an array: one line, where its first listed task is
            if array in folded:
                continue
            folded.add(array)
            rows.append(array_row([t for t in jobs if t.get("array_id") == array], now))
        else:
            elapsed = (now - j["submitted_at"] if j["state"] == JobState.QUEUED else None if j["started_at"] is None
                       else (j["ended_at"] or now) - j["started_at"])
            rows.append([j["id"], j["name"][:24], j["user"], j["state"], j["priority"], f"{j['gpus']:g}",
                         ",".join(map(str, j["gpu_ids"])) or "-", human_duration(elapsed),
                         "" if j["exit_code"] is None else j["exit_code"], _short_reason(j)])
        tenant_of.append(j.get("tenant") or "")
    headers = ["ID", "NAME", "USER", "STATE", "PRI", "GPUS", "ON", "TIME", "EXIT", "REASON"]
    nodes = {j.get("node") for j in jobs if j.get("node")}
    if len(nodes) > 1 and len(rows) == len(jobs):  # jobs on several nodes (arrays unfolded)
        headers.insert(6, "NODE")
        for row, j in zip(rows, jobs):  # where it runs, or where it last ran: a finished job keeps its node
            row.insert(6, "-" if j["state"] in WAITING else (j.get("node") or "-"))
    if len(set(tenant_of)) > 1:
        headers.insert(3, "TENANT")
        for row, tenant in zip(rows, tenant_of):
            row.insert(3, tenant)
    print(table(headers, rows))
    return 0


def array_row(tasks: list[dict], now: float) -> list[Any]:
    """An array folded into one ``queue`` line: ``12[0-99]  name ... 3 running, 4 queued, 93 done``."""
    from collections import Counter

    from eventsched.domain.states import FINAL, SUMMARY_ORDER, JobState

    first = tasks[0]
    counts = Counter(t["state"] for t in tasks)
    parts = [f"{counts[s]} {s}" for s in SUMMARY_ORDER if counts[s]]
    parts += [f"{n} {s}" for s, n in counts.items() if s not in SUMMARY_ORDER]
    if first.get("array_done"):  # without --all: the tasks that ended are not listed, only counted
        listed_done = sum(counts[s] for s in FINAL)
        if first["array_done"] > listed_done:
            parts.append(f"{first['array_done'] - listed_done} done")
    on = sorted({g for t in tasks if t["state"] == JobState.RUNNING for g in t["gpu_ids"]})
    waiting = next((t for t in tasks if t.get("reason")), None)
    return [f"{first['array_id']}[{compact_indices([t['array_index'] for t in tasks])}]", first["name"][:24],
            first["user"], ", ".join(parts), first["priority"], f"{first['gpus']:g}", ",".join(map(str, on)) or "-",
            human_duration(now - min(t["submitted_at"] for t in tasks)), "",
            _short_reason(waiting) if waiting is not None else ""]


def compact_indices(indices: list[int]) -> str:
    """``0-99``, ``0-98:2``, ``1,3,7-9`` (cut short past a few pieces)."""
    xs = sorted(set(indices))
    if len(xs) > 2:
        step = xs[1] - xs[0]
        if step > 1 and all(b - a == step for a, b in zip(xs, xs[1:])):
            return f"{xs[0]}-{xs[-1]}:{step}"
    from itertools import groupby

    runs = []
    for _, group in groupby(enumerate(xs), lambda p: p[1] - p[0]):  # consecutive indices share i - x
        run = [x for _, x in group]
        runs.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(runs) if len(runs) <= 4 else ",".join(runs[:3]) + f",...,{xs[-1]}"


def _short_reason(job: dict) -> str:
    """The REASON column: why it waits (or GPU flags), cut to fit; `explain` tells it all."""
    from eventsched.cli.status_detail import cut

    return cut(job.get("reason") or gpu_flags(job))  # a running job's flags: its GPU memory and idleness


def gpu_flags(job: dict) -> str:
    """For a running job: over its ``--gpu-mem``, idle since when."""
    import time

    parts = []
    if job.get("gpu_mem_over"):
        parts.append(f"GPU memory over request ({job.get('gpu_mem_peak_mib', 0)} > {job.get('gpu_mem_mib', 0)} MiB)")
    if job.get("idle") and job.get("idle_since"):
        parts.append("idle since " + time.strftime("%H:%M", time.localtime(job["idle_since"])))
    return "; ".join(parts)


def render_status(status: dict) -> str:
    from eventsched.domain.states import JobState
    from eventsched.domain.text import table

    rows = []
    for g in status["gpus"]:
        mem = f"{g['memory_used_mib']}/{g['memory_total_mib']} MiB"
        util = "" if g["utilization"] is None else f"{g['utilization']:.0f}%"
        temp = "" if g["temperature_c"] is None else f"{g['temperature_c']:.0f}C"
        bar = "#" * round(g["allocated"] * 10)
        state = ("drained" if g.get("paused_reason") else "paused") if g["paused"] else ("lost" if g.get("lost") else "")
        rows.append([g["id"], f"[{bar:<10}] {g['allocated']:.2f}", util, mem, temp, state, ",".join(map(str, g.get("jobs", [])))])
    headers = ["GPU", "ALLOCATED", "UTIL", "MEMORY", "TEMP", "STATE", "JOBS"]
    if len({g.get("node") for g in status["gpus"]}) > 1:  # GPUs of several nodes
        rows = [[g.get("node", "")] + row for g, row in zip(status["gpus"], rows)]
        headers.insert(0, "NODE")
    text = table(headers, rows)
    jobs = status["jobs"]
    running = sum(1 for j in jobs if j["state"] == JobState.RUNNING)
    queued = sum(1 for j in jobs if j["state"] == JobState.QUEUED)
    flagged = [f"job {j['id']}: {flags}" for j in jobs if j["state"] == JobState.RUNNING and (flags := gpu_flags(j))]
    foreign = [f"GPU {g['id']}: {p['user']} pid {p['pid']} holds {p['used_mib']} MiB"
               for g in status["gpus"] for p in g.get("foreign_processes", ())]
    drained = [f"GPU {g['id']} drained: {g['paused_reason']} (resume-gpu {g['id']} returns it)"
               for g in status["gpus"] if g["paused"] and g.get("paused_reason")]
    nodes = status.get("nodes", [])
    if len(nodes) > 1:  # a cluster: each node's state (up, draining, down, fenced, lost)
        text += "\n\nnodes  " + "  ".join(f"{n['name']} {n['state']}" for n in nodes)
    notes = "".join("\n" + line for line in drained + flagged + foreign)
    return f"{text}\n\npolicy {status['policy']}  running {running}  queued {queued}  log seq {status['seq']}{notes}"


def cmd_status(args: argparse.Namespace) -> int:
    from eventsched.domain.text import print_json

    if (args.watch or args.history) and os.environ.get("EVENTSCHED_URL"):
        raise UserError("status --watch and --history need the daemon's socket (events, the read model); "
                        "over EVENTSCHED_URL run `status` alone")
    history = None
    if args.history:  # sparklines and today's GPU-hours (cli/status_history.py)
        from eventsched.cli.status_history import StatusHistory, render_history

        history = StatusHistory(args.history, state_dir_of(args), args.socket)

    def draw(status: dict) -> None:
        extra = ""
        if history is not None:
            status = {**status, "history": history.data()}
            extra = "\n\n" + render_history(status["history"])
        if args.json and args.watch:  # one line per update
            import json

            print(json.dumps(status), flush=True)
        elif args.json:
            print_json(status)
        else:
            text = render_status(status)
            if args.detailed:
                from eventsched.cli.status_detail import render_detailed

                text = render_detailed(status, text)
            print(("\x1b[2J\x1b[H" if args.watch else "") + text + extra, flush=True)

    with client(args) as c:
        draw(c.status())
        if args.watch:
            try:
                for _batch in c.subscribe(from_seq=0):  # redraw on every committed batch: nothing is polled
                    draw(c.status())
            except KeyboardInterrupt:
                return 0
    return 0


def parse_cancel_ids(values: list[str]) -> tuple[list[int], list[tuple[int, int]]]:
    """``12 13,14 20_3``: job (or array) ids, and (array, index) for ``ARRAY_INDEX``."""
    ids: list[int] = []
    tasks: list[tuple[int, int]] = []
    for part in filter(None, (p.strip() for value in values for p in value.split(","))):
        array, underscore, index = part.partition("_")
        try:
            if underscore:
                tasks.append((int(array), int(index)))
            else:
                ids.append(int(part))
        except ValueError:
            raise UserError(f"{part!r} is not a job id (a number, or ARRAY_INDEX like 12_3 for one task of array 12)") from None
    if not ids and not tasks:
        raise UserError("no job id given")
    return ids, tasks


def cancel_jobs(c: Client, args: argparse.Namespace) -> dict:
    """``cancel``'s request (and ``%gpucancel``'s): the ids given, or with
    ``--state``/``--user``/``--name`` every unfinished job that matches (of the
    ids given, if any); the daemon refuses the ones that are not the user's."""
    from eventsched.cli.filters import job_filter

    select = job_filter(args)
    if select is None and not args.jobs:
        raise UserError("name the jobs to cancel, or select them with --state, --user or --name")
    ids, tasks = parse_cancel_ids(args.jobs) if args.jobs else ([], [])
    if select is None:
        return c.cancel_each(ids, arrays=True, array_tasks=tasks)
    named: set[Any] = {*ids, *tasks}  # a job's id, its array's, or its ARRAY_INDEX
    chosen = [j["id"] for j in c.jobs() if select(j) and (
        not args.jobs or not named.isdisjoint((j["id"], j["array_id"], (j["array_id"], j["array_index"]))))]
    if not chosen:
        return {"jobs": [], "refused": []}
    result = c.cancel_each(chosen)
    # a job that ended since it was listed is no failure of a selection
    return {**result, "refused": [r for r in result["refused"] if r.get("kind") != "conflict"]}


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel every job it can; one line on stderr for each it could not, and exit 1."""
    with client(args) as c:
        result = cancel_jobs(c, args)
    if not result["jobs"] and not result["refused"]:  # a selection that matched nothing
        print("no queued, held or running job matches", file=sys.stderr)
    print("".join(f"{job['id']}\t{job['state']}\n" for job in result["jobs"]), end="", flush=True)
    for refused in result["refused"]:
        print(f"job {refused['job']}: {refused['reason']}", file=sys.stderr)
    return 1 if result["refused"] else 0


def cmd_jobs_action(args: argparse.Namespace, action: str) -> int:
    with client(args) as c:
        result = getattr(c, action)(parse_job_ids(args.jobs))
    print("".join(f"{job['id']}\t{job['state']}\n" for job in result), end="")
    return 0


def cmd_gpu_action(args: argparse.Namespace, action: str) -> int:
    node, _, number = str(args.gpu).rpartition(":")  # NODE:ID
    try:
        gpu_id = int(number)
    except ValueError:
        raise UserError(f"{args.gpu!r} is not a GPU id (a number, or NODE:ID like node-a:2)") from None
    with client(args) as c:
        gpu = getattr(c, action)(gpu_id, node=node)
    where = f"{gpu['node']}:" if node and gpu.get("node") else ""  # as it was named
    print(f"gpu {where}{gpu['id']}: {'paused' if gpu['paused'] else 'accepting jobs'}")
    return 0


def follow_output(c: Client, job: int, *, follow: bool = True, detach_message: bool = False,
                  exit_status: bool = False) -> int:
    """Print a job's output file (``follow``: until it ends); ``exit_status``: return its exit status."""
    import time

    from eventsched.domain.states import FINAL
    from eventsched.wire import protocol
    from eventsched.wire.client import read_new_output
    from eventsched.wire.http_client import HttpClient

    try:
        if isinstance(c, HttpClient):  # the file is on the daemon's machine: the daemon sends it
            for chunk in c.output(job, follow=follow):
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            ended = c.job(job) if follow else None
            return job_exit_status(ended) if exit_status and ended else 0
        info = c.request(protocol.JobLogPath(job=job))
        path, position, next_check = info["path"], 0, 0.0
        while True:
            try:
                chunk = read_new_output(path, position)
            except PermissionError:
                raise UserError(f"cannot read {path}: permission denied") from None
            if chunk:
                position += len(chunk)
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            if not follow or info["state"] in FINAL:
                break
            if time.monotonic() >= next_check:
                info = c.request(protocol.JobLogPath(job=job))
                next_check = time.monotonic() + 0.5
                if info["state"] in FINAL:
                    continue  # one more read catches the last output
            time.sleep(0.05)
    except KeyboardInterrupt:
        if detach_message:
            print(f"\ndetached; job {job} keeps running (eventsched logs {job} -f)", file=sys.stderr)
        return 0
    return job_exit_status(info) if exit_status else 0


def job_exit_status(info: dict) -> int:
    """A finished job as a shell exit status: its code, 128+N for signal N, 1 if it never ran."""
    from eventsched.domain.states import JobState

    if info.get("signal"):
        return 128 + int(info["signal"])
    if info.get("exit_code") is not None:
        return int(info["exit_code"]) & 0xFF
    return 0 if info["state"] == JobState.SUCCEEDED else 1


def cmd_explain(args: argparse.Namespace) -> int:
    with client(args) as c:
        info = c.explain(args.job)
    from eventsched.cli.report import card_of, render_card
    from eventsched.domain.text import print_json

    card = info["report_card"] = card_of(args, info["job"])  # an ended job's, from the history
    if args.json:
        print_json(info)
    else:
        from eventsched.projections.story import render_explanation

        print(render_explanation(info) + ("\n\n" + render_card(card) if card else ""))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from eventsched.cli.report import card_after_logs

    with client(args) as c:
        status = follow_output(c, args.job, follow=args.follow)
        card_after_logs(args, c)
        return status


def cmd_serve(args: argparse.Namespace) -> int:
    from eventsched.runtime.config import ConfigError, serve_config
    from eventsched.runtime.daemon import serve

    try:
        config = serve_config(args)
    except ConfigError as exc:
        fail(str(exc))
    return serve(config)


def cmd_log(args: argparse.Namespace) -> int:
    from eventsched.storage import logtools

    if args.log_command == "dump":
        return logtools.dump(args.dir, json=args.json, from_seq=args.from_seq)
    return getattr(logtools, args.log_command)(args.dir)  # verify, repair


def cmd_sql(args: argparse.Namespace) -> int:
    from eventsched.cli.sql import ask_daemon, run_sql
    from eventsched.projections.sql_values import needs_daemon

    state_dir = state_dir_of(args)
    via_daemon = None
    if needs_daemon(state_dir):  # the daemon bounds the query itself (catch-up, then its own time limit)
        path = args.socket or socket_location(args.state_dir)
        via_daemon = lambda sql: ask_daemon(path, sql, 180.0)  # noqa: E731
    return run_sql(state_dir, args.query, args.format, via_daemon=via_daemon, output=args.output)


def cmd_metrics(args: argparse.Namespace) -> int:
    from eventsched.projections.metrics import run_metrics

    fmt = "json" if args.json else "prometheus" if args.prometheus else "table"
    return run_metrics(state_dir_of(args), fmt)


def cmd_config_sample(args: argparse.Namespace) -> int:
    from eventsched.runtime.config import sample_config

    sys.stdout.write(sample_config(args.format))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from eventsched.cli.quick import show_health

    with client(args) as c:
        return show_health(c.ping(), args.json)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with ``only`` just that command's (faster)."""
    from eventsched.cli.parser import build

    return build(only)


def _import_msgspec_lean() -> None:
    """Import msgspec without typing_extensions (costly; on Python >= 3.11
    msgspec needs nothing from it); the block is lifted at once."""
    if "msgspec" in sys.modules or "typing_extensions" in sys.modules or sys.version_info < (3, 11):
        return
    sys.modules["typing_extensions"] = None  # type: ignore[assignment]  # makes its import fail
    try:
        import msgspec  # noqa: F401
    finally:
        del sys.modules["typing_extensions"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from eventsched.cli.quick import plan

    run = plan(argv, spec_fields)  # submit's common spellings, health, --version: nothing else imported
    if run is None:
        run = parse(argv)
    from eventsched.wire.errors import ClientError

    try:
        return run()
    except (UserError, UnitError) as exc:
        fail(str(exc))
    except ClientError as exc:
        fail(str(exc), code=refusal_exit(exc.kind))
    except BrokenPipeError:
        return 0
    except TimeoutError:
        fail("the daemon did not answer in time; it may be overloaded (try again)", code=1)
    except KeyboardInterrupt:
        return 130


# the commands whose whole handler lives in another module
ELSEWHERE = {"replay": "eventsched.cli.replay.run_replay", "tenants": "eventsched.cli.tenants.cmd_tenants",
             "tenant": "eventsched.cli.tenants.cmd_tenant", "token": "eventsched.cli.token.run",
             "nodes": "eventsched.cli.nodes.cmd_nodes", "attach": "eventsched.cli.attach.run",
             "submit-file": "eventsched.cli.submit_file.cmd_submit_file", "update": "eventsched.cli.update.cmd_update",
             "mcp": "eventsched.cli.mcp_server.run", "report": "eventsched.cli.report.cmd_report",
             "reserve": "eventsched.cli.reserve.run", "notify": "eventsched.cli.notify.run"}


def parse(argv: list[str]) -> Callable[[], int]:
    """The command ``argv`` asks for, read by argparse (one-line usage errors)."""
    _import_msgspec_lean()
    options, command = split_command(argv)
    # building the one parser needed keeps `submit` fast; anything unusual
    # (help, a typo) gets the whole parser and its messages
    first = options[0] if options and not options[0].startswith("-") else None
    parser = build_parser(only=first if first in COMMANDS else None)
    args, rest = parser.parse_known_args(options)
    args.command = ALIASES.get(args.command, args.command)
    if args.command == "submit" and rest and not any(word.startswith("-") for word in rest):
        if command or len(rest) > 1:
            fail("put the command after `--` (submit --gpus 1 -- python train.py) or give it as one quoted string")
        line = rest.pop()  # `submit [options] "python train.py --lr 1"`: its words, run without a shell
        args.shell_free = True
        return lambda: cmd_submit(args, split_words(line))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if command and args.command != "submit":
        fail(f"`--` is only for `submit`, not `{args.command}`")
    if args.command == "submit":
        return lambda: cmd_submit(args, command)
    if args.command in ("hold", "release"):
        return lambda: cmd_jobs_action(args, args.command)
    if args.command in ("pause-gpu", "resume-gpu"):
        return lambda: cmd_gpu_action(args, args.command.replace("-", "_"))
    if args.command in ELSEWHERE:  # a module of its own, imported only to run it
        module, _, name = ELSEWHERE[args.command].rpartition(".")
        handler = getattr(__import__(module, fromlist=[name]), name)
    else:
        handler = globals()["cmd_" + args.command.replace("-", "_")]
    return lambda: handler(args)
