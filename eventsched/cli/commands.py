"""The one table of ``eventsched``'s commands and their options, read by
``parser.build`` (argparse) and ``quick.parse`` (the fast path, so: plain data).

Each option is ``(flags, add_argument's keyword arguments)``, plus our own
``exclusive`` (such options exclude each other) and ``actions`` (on a
positional ACTION: that command's own sub-commands).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    Option = tuple[tuple[str, ...], dict[str, Any]]
    Command = tuple[str, list[Option]]  # (help, options)

__all__ = ["ALIASES", "COMMANDS", "COMMON", "positive_seconds"]


def positive_seconds(text: str) -> float:
    """An interval in seconds that must be finite and above zero."""
    from argparse import ArgumentTypeError

    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return value


def arg(*flags: str, **kwargs: Any) -> Option:
    """One option, spelled as argparse's ``add_argument`` takes it."""
    return flags, kwargs


def command(what: str, *options: Option, common: bool = True) -> Command:
    """A command's help line and options (``--state-dir`` and ``--socket`` first, unless not ``common``)."""
    return what, [*COMMON, *options] if common else list(options)


def actions(dest: str, **commands: Command) -> Option:
    """A positional ACTION naming one of ``commands`` (``log verify``, ``token create``)."""
    return (dest,), {"metavar": "ACTION", "actions": commands}


COMMON: list[Option] = [
    arg("--state-dir", help="state directory (default $EVENTSCHED_STATE_DIR or ~/.local/share/eventsched)"),
    arg("--socket", help="control socket (default $EVENTSCHED_SOCKET or <state-dir>/eventsched.sock)"),
]
JSON = arg("--json", action="store_true")
JOBS = arg("jobs", nargs="+", metavar="JOB")
GPU = arg("gpu", metavar="[NODE:]ID", help="a GPU id, or NODE:ID on a cluster")
JOB = arg("job", type=int)
# which jobs: queue's filters, and cancel's selection (as squeue's and scancel's -t, -u, -n)
FILTERS = [
    arg("-t", "--state", "--status", metavar="S[,S..]", help="only jobs in these states: queued, held, running, "
        "succeeded, failed, cancelled, preempted, lost, or Slurm's PD, R, CD, F, CA, PR (any case)"),
    arg("-u", "--user", metavar="U[,U..]", help="only these users' jobs"),
    arg("-n", "--name", metavar="N[,N..]", help="only jobs of these names"),
]

COMMANDS: dict[str, Command] = {
    "serve": command(
        "run the scheduler daemon",
        arg("--gpus", help="fake:N[:MEM_MIB] for simulated GPUs; default: NVML"),
        arg("--policy", help="placement policy (fifo, priority, best-fit, fair-share, sjf-backfill, fgd)"),
        arg("--config", help="TOML config file (see `eventsched config-sample`), or the seeds' config.json"),
        arg("--sample-interval", type=positive_seconds, help="seconds between GPU samples (default 2)"),
        arg("--time-limit", help="global time limit for every job (seconds or 2h, 30m ...)"),
        arg("--log-level", type=str.lower, default="info", choices=["debug", "info", "warning", "error"],
            help="in any case (DEBUG or debug)"),
        arg("--log-file", metavar="PATH", help="write the daemon's log (JSON lines) to PATH instead of stderr, "
                                               "created 0640; rotated at 10 MiB, keeping PATH.1 ... PATH.5"),
        arg("--metrics-port", type=int, help="serve Prometheus metrics on this HTTP port (GET /metrics)"),
        arg("--metrics-host", default="127.0.0.1", help="address for --metrics-port (default 127.0.0.1)"),
        arg("--ray", metavar="ADDRESS", help="run jobs on the GPU nodes of this Ray cluster (host:port, or auto); "
                                             "--gpus is then each node's"),
        arg("--wait-nodes", type=int, metavar="N", help="with --ray: `health` fails (\"waiting for nodes: 1 of N "
                                                        "joined\") until N nodes have joined"),
        arg("--http", metavar="HOST:PORT", help="also serve the JSON API for remote clients here, "
                                                "e.g. 127.0.0.1:8080 (docs/http-api.md)"),
        arg("--http-allow-remote", action="store_true",
            help="let --http bind a non-loopback address (only where TLS is handled by something else)"),
    ),
    "submit": command(
        "submit a job: eventsched submit [options] -- COMMAND ..., or [options] 'COMMAND ...' as one quoted "
        "string (split into words as a shell would, run without one)",
        arg("--gpus", type=float, help="share of one GPU (0.1-1.0) or a whole number of GPUs (default 1)"),
        arg("--gpu-mem", "--mem", dest="gpu_mem", type=int, metavar="MIB",
            help="GPU memory needed on each GPU, MiB (--mem: mgpu_srun's spelling)"),
        arg("--gpu-ids", metavar="LIST", help="GPU ids, e.g. 1,3 or 0-3: alone, exactly these GPUs; "
                                              "with --gpus K, K of them; NODE:0,1 on a cluster"),
        arg("--node", metavar="NAME", help="run on this node of a cluster (`eventsched nodes` lists them)"),
        arg("--priority", type=int, default=0, help="higher runs first (default 0)"),
        arg("--name"), arg("--time-limit", metavar="SECONDS", help="kill after this long (90, 15m, 2h)"),
        arg("--requeue-on-time-limit", action="store_true", help="requeue at the back instead of killing for good"),
        arg("--tenant"), arg("--after", action="append", metavar="JOB", help="run only after JOB succeeded (repeatable)"),
        arg("--retries", type=int, default=0, help="retry a failed job up to N times"),
        arg("--conda", metavar="ENV", help="activate this conda environment first"),
        arg("--env-setup", "--env-setup-cmd", dest="env_setup", metavar="CMD",
            help='shell set-up run first, e.g. "source venv/bin/activate"'),
        arg("--array", metavar="SPEC", help="one task per index: 0-99, 1,3,5 or 0-99:2, with %%K for at most K "
                                            "at once; {index} in the command is the index"),
        arg("--dedupe", action="store_true", help="refuse if an identical job is queued, running or succeeded"),
        arg("--interactive", action="store_true", help="stream the job's output here; Ctrl+C detaches"),
        arg("--session", choices=["tmux", "screen"], help="run in a detached terminal session (eventsched attach JOB)"),
        arg("--host-mem", type=int, metavar="MIB", help="host memory limit, MiB (enforced by the kernel)"),
        arg("--llm-config", metavar="FILE",
            help="llm_config.json for --llm NAME in the command (default ./llm_config.json)"),
        arg("--preemptible", action="store_true", help="may be stopped (and requeued) for a more urgent job"),
        arg("--signal", metavar="SIG@SECONDS", help="when preempted: this signal first, SIGKILL SECONDS later "
                                                    "(default TERM@preempt_grace_s)"),
        arg("--begin", metavar="TIME", help="not before TIME: now+10m, +10m, seconds from now, 16:00, "
                                            "2026-11-28T15:00"),
        arg("--notify", metavar="KINDS", help="tell your hook (eventsched notify) of these only: end,fail,preempt,memory"),
        JSON,
    ),
    "queue": command("list queued and running jobs", arg("--all", action="store_true", help="include finished jobs"),
                     arg("--expand", action="store_true",
                         help="one line per array task (arrays are folded into one line otherwise)"), *FILTERS, JSON),
    "status": command(
        "GPUs, allocation and jobs", JSON, arg("--watch", action="store_true", help="keep updating as events arrive"),
        arg("--detailed", action="store_true", help="also the daemon's version, uptime and health, each GPU's "
                                                    "reservations and processes, and each active job"),
        arg("--history", metavar="WINDOW", help="also per-GPU utilisation/memory sparklines over WINDOW (e.g. 1h) "
                                                "and today's GPU-hours per user"),
    ),
    "cancel": command("cancel jobs by id, or every job matching --state/--user/--name (as scancel -t/-u/-n)",
                      arg("jobs", nargs="*", metavar="JOB"), *FILTERS),
    "hold": command("hold queued jobs", JOBS),
    "release": command("release held jobs", JOBS),
    "update": command("change a queued or held job (as scontrol update)", JOB,
                      arg("--priority", type=int), arg("--time-limit", metavar="SECONDS", help="90, 15m, 2h"),
                      arg("--gpus", type=float), arg("--name"), JSON),
    "pause-gpu": command("place nothing new on a GPU", GPU),
    "resume-gpu": command("accept jobs on a GPU again", GPU),
    "explain": command("why a job waits, and its story", JOB, JSON),
    "logs": command("print a job's output", JOB,
                    arg("-f", "--follow", action="store_true", help="keep printing until the job ends"),
                    arg("--card", action="store_true",
                        help="an ended job's report card after the output, on stderr (always shown on a terminal)")),
    "health": command("is the daemon up (exit 0) or not; on a cluster, how many nodes are up "
                      "(exit 1 while serve --wait-nodes waits for them)", JSON),
    "sql": command(
        "read-only SQL over the whole history (DuckDB)",
        arg("query"), arg("--format", choices=["table", "csv", "json", "parquet"], default="table"),
        arg("-o", "--output", metavar="FILE",
            help="write the result to FILE (written by this command, as you; parquet needs it)"),
    ),
    "metrics": command("wait/run times, utilisation, GPU-hours", arg("--json", action="store_true", exclusive=True),
                       arg("--prometheus", action="store_true", exclusive=True)),
    "report": command(
        "GPU-hours used and idle, efficiency, waits and jobs of the jobs started lately",
        arg("--since", default="30d", help="jobs started this long ago or since (default 30d)"),
        arg("--by", choices=["user", "tenant", "day"], default="user"),
        arg("--format", choices=["table", "csv", "json", "markdown"], default="table"),
        arg("--config", metavar="FILE", help="the daemon's config: its [accounting] gpu_hour_price adds a cost column"),
    ),
    "replay": command(
        "replay a log or trace under policies",
        arg("source", help="a state dir, a log dir, or a trace file"),
        arg("--policy", action="append", required=True),
        JSON,
        arg("--static", action="store_true", help="FGD-style static packing experiment (Alibaba trace)"),
        arg("--seeds", default="42-51", help="seeds for --static (default 42-51)"),
        arg("--gpus", help="for CSV traces: fake:N[:MEM_MIB] machine to replay on"),
        arg("--nodes", type=int, metavar="K", help="for CSV traces: K machines of --gpus each (default 1)"),
        arg("--out", help="where replay logs go (default: a temporary directory)"),
        arg("--config", metavar="FILE", help="what-if: replay under this config's [tenants] and [scheduler] keys"),
    ),
    "log": command("inspect the event log", actions(
        "log_command",
        verify=command("check every frame's checksum", arg("dir"), common=False),
        dump=command("one event per line", arg("dir"), JSON, arg("--from-seq", type=int, default=1), common=False),
        repair=command("move damaged frames aside so the log opens again", arg("dir"), common=False),
    ), common=False),
    "submit-file": command(
        "submit the lines of a jobs file (priority,script,conda_env,arguments,allowed_gpus)", arg("file", metavar="FILE"),
        arg("--watch", action="store_true", help="keep following the file for new or edited lines (Ctrl-C stops)"),
        arg("--llm-config", metavar="FILE",
            help="llm_config.json for --llm NAME (default ./llm_config.json, else the state dir's)"),
        arg("--session", choices=["tmux", "screen"], help="run each line in a detached terminal session"),
        arg("--dedupe", action="store_true", help="skip a line identical to a queued, running or succeeded job"),
        JSON,
    ),
    "attach": command("attach to a --session job's terminal (tmux or screen)", JOB),
    "tenants": command("each tenant: quota, weight, usage now, fair share, recent usage", JSON),
    "tenant": command("define or remove a tenant at run time (root or the daemon's user)", actions(
        "tenant_command",
        set=command(
            "create a tenant or change the keys given (the rest stay as they are)",
            arg("name"),
            arg("--users", metavar="A,B", help="its users (replaces the list)"),
            arg("--gpus", metavar="N", help="GPUs running at once (shares add up); 'none' for no ceiling"),
            arg("--gpu-mem", metavar="MIB", help="GPU memory reserved at once; 'none' for no ceiling"),
            arg("--jobs", metavar="N", help="jobs running at once; 'none' for no ceiling"),
            arg("--weight", type=float, help="fair-share weight (> 0)"),
            arg("--preemptible", choices=["yes", "no"], help="its jobs over its fair share may be preempted"),
            arg("--default-for", metavar="A,B", help="users for whom this is the tenant when they name none"),
            arg("--gpu-hours-per-month", metavar="N",
                help="GPU-hours its jobs may use per month (UTC); 'none' for no budget"),
            arg("--budget-action", choices=["hold", "lower-priority", "default"],
                help="once the budget is used: hold its jobs or place them last ('default': [scheduler])"),
            JSON,
            common=False,
        ),
        remove=command("remove a tenant (its users fall back to the default tenant)", arg("name"), common=False),
    )),
    "token": command("API tokens for the HTTP API (serve --http): create, list, revoke", actions(
        "token_command",
        create=command("print a new token for you (shown once; only its hash is kept)",
                       arg("--name", default="", help="a name to know it by (default token-ID)"),
                       arg("--user", metavar="NAME", help="root only: a token of this user"), JSON),
        list=command("your tokens (root: everyone's)", JSON),
        revoke=command("revoke a token by its id or name", arg("token", metavar="ID|NAME")),
    ), common=False),
    "reserve": command("book GPUs ahead for a user or a tenant: create, list, cancel", actions(
        "reserve_command",
        create=command(
            "book GPUs for a window: only the owner's jobs run there then",
            arg("--user", metavar="U", exclusive=True, help="for this user (default you; others: operators only)"),
            arg("--tenant", metavar="T", exclusive=True, help="for the members of this tenant"),
            arg("--gpus", type=int, metavar="K", help="any K GPUs of one node"),
            arg("--gpu-ids", metavar="LIST", help="exactly these GPUs, e.g. 0,1 or NODE:0-1"),
            arg("--start", metavar="WHEN", help="now, +10m, 14:00 or 2026-11-28T14:00 (as submit --begin)"),
            arg("--duration", metavar="D", help="how long: 90, 30m, 2h"),
            arg("--name"), JSON),
        list=command("the reservations not yet over", JSON,
                     arg("--timeline", action="store_true", help="draw who holds which GPU over the coming days")),
        cancel=command("cancel a reservation (its owner, who booked it, or an operator)",
                       arg("reservation", type=int, metavar="ID")),
    ), common=False),
    "notify": command("your notification hooks: a webhook or mail command told of your jobs (docs/notifications.md)",
                      actions(
        "notify_command",
        set=command("set your hook (replaces it); with no options, from ~/.config/eventsched/notify.toml",
                    arg("--webhook", metavar="URL", help="POST a JSON message here (http or https)"),
                    arg("--secret", help="sign each message: HMAC-SHA256 of the body in X-Eventsched-Signature"),
                    arg("--on", metavar="KINDS", help="end,fail,preempt,memory (default: all)"),
                    arg("--mail", metavar="CMD", help="run this command as you, without a shell, the message on stdin"),
                    arg("--config", metavar="FILE", help="read the hook from FILE (default ~/.config/eventsched/notify.toml)"),
                    JSON, common=False),
        list=command("your hook, what it was told and its last failure (root: everyone's)", JSON, common=False),
        clear=command("remove your hook", common=False),
    )),
    "config-sample": command("print every config key at its default", arg("--format", choices=["toml", "json"],
                             default="toml", help="json: for `serve --config X.json`"), common=False),
    "nodes": command("each node: name, state, GPUs, jobs", JSON),
    "mcp": command("serve these commands as tools of an MCP server on stdio, as you (docs/mcp.md)"),
}

# other schedulers' names for commands: each takes the same options as the command it names
ALIASES = {"pause": "pause-gpu", "resume": "resume-gpu", "list-jobs": "queue"}
COMMANDS.update({alias: (f"the same as `{name}`", COMMANDS[name][1]) for alias, name in ALIASES.items()})
