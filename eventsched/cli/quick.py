"""The fast path of ``eventsched submit`` (and ``health``, ``--version``).

A sweep queued from a shell loop is one short process per job, so a
``submit`` should cost little more than the interpreter's own start-up.
argparse (with the ``re``, ``gettext`` and ``locale`` it imports), msgspec
(``typing``, ``uuid``, ``decimal``, ``datetime``) and ``socket.py`` each cost
more than everything else such a call does; this path needs none of them:

- ``SUBMIT_OPTIONS`` is the one table of ``submit``'s options: ``build_parser``
  adds them to argparse, and ``parse`` reads the plain spellings of them
  (``--opt VALUE``, ``--opt=VALUE``, flags) with the same ``type``,
  ``choices``, ``dest`` and defaults;
- the job is built by the same ``spec_fields`` as the full path, and sent by
  ``wire.lean`` (msgpack by hand over ``_socket``).

Anything this path does not read exactly as argparse would (``--help``, an
abbreviated or unknown option, a value that starts with ``-``, a bad value,
``--interactive``, ``--llm`` sizing, a user's mistake that needs its message)
returns None *before anything is sent*, and the full parser takes over: its
behaviour and messages are the contract (SPEC §2), this is only a shortcut.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing itself costs a CLI call ~3 ms; mypy reads this as True
if TYPE_CHECKING:
    from typing import Any, Callable

    Option = tuple[tuple[str, ...], dict[str, Any]]  # (flags, add_argument's keyword arguments)

__all__ = ["COMMON_OPTIONS", "SUBMIT_OPTIONS", "HEALTH_OPTIONS", "Args", "parse", "plan", "submit_message"]

COMMON_OPTIONS: list[Option] = [
    (("--state-dir",), {"help": "state directory (default $EVENTSCHED_STATE_DIR or ~/.local/share/eventsched)"}),
    (("--socket",), {"help": "control socket (default $EVENTSCHED_SOCKET or <state-dir>/eventsched.sock)"}),
]

# `eventsched submit`'s options, in --help's order (build_parser adds them)
SUBMIT_OPTIONS: list[Option] = [
    (("--gpus",), {"type": float, "help": "share of one GPU (0.1-1.0) or a whole number of GPUs (default 1)"}),
    (("--gpu-mem", "--mem"), {"dest": "gpu_mem", "type": int, "metavar": "MIB", "help": "GPU memory needed on each GPU, MiB (--mem: mgpu_srun's spelling)"}),
    (("--gpu-ids",), {"metavar": "LIST", "help": "GPU ids, e.g. 1,3 or 0-3: alone, exactly these GPUs; with --gpus K, K of them; NODE:0,1 on a cluster"}),
    (("--node",), {"metavar": "NAME", "help": "run on this node of a cluster (`eventsched nodes` lists them)"}),
    (("--priority",), {"type": int, "default": 0, "help": "higher runs first (default 0)"}),
    (("--name",), {}),
    (("--time-limit",), {"metavar": "SECONDS", "help": "kill after this long (90, 15m, 2h)"}),
    (("--requeue-on-time-limit",), {"action": "store_true", "help": "requeue at the back instead of killing for good"}),
    (("--tenant",), {}),
    (("--after",), {"action": "append", "metavar": "JOB", "help": "run only after JOB succeeded (repeatable)"}),
    (("--retries",), {"type": int, "default": 0, "help": "retry a failed job up to N times"}),
    (("--conda",), {"metavar": "ENV", "help": "activate this conda environment first"}),
    (("--env-setup", "--env-setup-cmd"), {"dest": "env_setup", "metavar": "CMD", "help": 'shell set-up run first, e.g. "source venv/bin/activate"'}),
    (("--array",), {"metavar": "SPEC", "help": "one task per index: 0-99, 1,3,5 or 0-99:2, with %%K for at most K at once; {index} in the command is the index"}),
    (("--dedupe",), {"action": "store_true", "help": "refuse if an identical job is queued, running or succeeded"}),
    (("--interactive",), {"action": "store_true", "help": "stream the job's output here; Ctrl+C detaches"}),
    (("--session",), {"choices": ["tmux", "screen"], "help": "run in a detached terminal session (eventsched attach JOB)"}),
    (("--host-mem",), {"type": int, "metavar": "MIB", "help": "host memory limit, MiB (enforced by the kernel)"}),
    (("--llm-config",), {"metavar": "FILE", "help": "llm_config.json for --llm NAME in the command (default ./llm_config.json)"}),
    (("--preemptible",), {"action": "store_true", "help": "may be stopped (and requeued) for a more urgent job"}),
    (("--signal",), {"metavar": "SIG@SECONDS", "help": "when preempted: this signal first, SIGKILL SECONDS later (default TERM@preempt_grace_s)"}),
    (("--json",), {"action": "store_true"}),
]

# the plain spellings of `health` that the fast path reads (build_parser has the rest)
HEALTH_OPTIONS: list[Option] = [(("--json",), {"action": "store_true"})]

# the kwargs ``parse`` understands; an option with any other one is left to argparse
_UNDERSTOOD = frozenset({"dest", "type", "default", "action", "choices", "help", "metavar"})


class Args:
    """What ``parse`` read: an attribute per option, as argparse's Namespace has."""

    command: str

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # called only for a name no option defines
        raise AttributeError(name)


def _dest(flags: tuple[str, ...], options: dict[str, Any]) -> str:
    return str(options.get("dest") or flags[0].lstrip("-").replace("-", "_"))


def parse(command: str, argv: list[str], table: list[Option]) -> Args | None:
    """``argv`` (the options after ``command``, before ``--``) as argparse
    would read them with ``table``'s options, or None where this cannot be
    sure it reads them the same (argparse then reads them, and says why)."""
    lookup: dict[str, tuple[str, dict[str, Any]]] = {}
    values: dict[str, Any] = {"command": command}
    for flags, options in table:
        dest = _dest(flags, options)
        values[dest] = options.get("default", False if options.get("action") == "store_true" else None)
        if options.keys() <= _UNDERSTOOD:  # else: not in lookup, so its use falls back
            for flag in flags:
                lookup[flag] = (dest, options)
    i, n = 0, len(argv)
    while i < n:
        word = argv[i]
        i += 1
        flag, eq, value = word.partition("=")
        found = lookup.get(flag) if word.startswith("--") else None
        if found is None:  # -h, an abbreviation, a positional, a typo: argparse's to judge
            return None
        dest, options = found
        action = options.get("action")
        if action == "store_true":
            if eq:
                return None
            values[dest] = True
            continue
        if not eq:
            if i == n:
                return None
            value = argv[i]
            i += 1
            if value.startswith("-"):  # argparse has its own rules for these (negative numbers, ...)
                return None
        convert = options.get("type")
        if convert is not None:
            try:
                value = convert(value)
            except (TypeError, ValueError):
                return None
        choices = options.get("choices")
        if choices is not None and value not in choices:
            return None
        if action == "append":
            values[dest] = [*(values[dest] or []), value]
        elif action is None:
            values[dest] = value
        else:
            return None
    return Args(**values)


def _socket_path(args: Args) -> str:
    from eventsched.domain.paths import socket_location

    return args.socket or socket_location(args.state_dir)


def _print_json(data: Any) -> None:  # as cli.print_json prints it
    import json

    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def plan(argv: list[str], build: Callable[[Args, list[str]], dict[str, Any]]) -> Callable[[], int] | None:
    """The fast path's command for ``argv``, ready to run (nothing is sent
    yet), or None: then the full parser and handlers run. ``build`` is
    ``cli.spec_fields``: a job's fields from its options and command."""
    if os.environ.get("EVENTSCHED_NO_QUICK"):  # the full path for everything (tests compare the two)
        return None
    remote = bool(os.environ.get("EVENTSCHED_URL"))  # issue 12: over HTTP (wire/http_client.py), never the socket
    if argv == ["--version"]:
        return _version
    if argv[:1] == ["health"] and not remote:
        health = parse("health", argv[1:], COMMON_OPTIONS + HEALTH_OPTIONS)
        return None if health is None else lambda: _health(health)
    submission = submit_message(argv, build)
    if submission is None:
        return None
    args, message = submission
    return lambda: _submit(args, message, remote=remote)


def submit_message(
    argv: list[str], build: Callable[[Args, list[str]], dict[str, Any]]
) -> tuple[Args, dict[str, Any]] | None:
    """``eventsched submit ... -- COMMAND``'s options, and its request as
    ``wire.lean`` sends it (``protocol.SubmitJob`` as a dict, its spec made
    by ``build``), or None where the full path must read ``argv``."""
    if argv[:1] != ["submit"] or "--" not in argv:
        return None  # not a submit, or no command: argparse's message
    cut = argv.index("--")
    args = parse("submit", argv[1:cut], COMMON_OPTIONS + SUBMIT_OPTIONS)
    command = argv[cut + 1 :]
    if args is None or not command or args.interactive or any("--llm" in word for word in command):
        return None
    try:
        message: dict[str, Any] = {"type": "SubmitJob", "spec": build(args, command)}
        if args.array is not None:
            from eventsched.domain.units import parse_array

            message["array"] = parse_array(args.array)[0]
        from eventsched.wire.lean import packb

        packb(message)  # what cannot be encoded here is the full client's to refuse
    except Exception:  # a user's mistake: the full path says it, as it always has
        return None
    return args, message


def _version() -> int:
    from eventsched import __version__

    print(f"eventsched {__version__}")
    return 0


def _health(args: Args) -> int:
    from eventsched.wire.lean import request

    info = request(_socket_path(args), {"type": "Ping"})
    if args.json:
        _print_json(info)
    else:
        print(f"ok: daemon pid {info['pid']}, log at seq {info['seq']}")
    return 0


def _submit(args: Args, message: dict[str, Any], *, remote: bool = False) -> int:
    if remote:  # the same submission as JSON to the HTTP API (POST /v1/jobs)
        from eventsched.wire.http_client import from_environment

        with from_environment() as c:
            data = c.call("POST", "/v1/jobs", {"spec": message["spec"], "array": message.get("array", [])})
    else:
        from eventsched.wire.lean import request

        data = request(_socket_path(args), message)
    if "array" in message:
        ids = [int(i) for i in data["ids"]]
        if args.json:
            _print_json({"ids": ids})
        else:
            sys.stdout.write("".join(f"{i}\n" for i in ids))
        return 0
    job = int(data["id"])
    if args.json:
        _print_json({"id": job})
    else:
        print(job)
    sys.stdout.flush()
    return 0
