"""The fast path of ``eventsched submit`` (and ``health``, ``--version``).

A ``submit`` from a shell loop should cost little more than the interpreter's
start-up, and argparse, msgspec and ``socket.py`` each cost more than that. So
``parse`` reads the plain spellings of the command table's options and
``wire.lean`` sends the job; anything it cannot read exactly as argparse would
returns None *before anything is sent*, and the full parser takes over.
"""

from __future__ import annotations

import os
import sys

from eventsched.cli.commands import COMMANDS

TYPE_CHECKING = False  # typing is costly to import; mypy reads this as True
if TYPE_CHECKING:
    from typing import Any, Callable

__all__ = ["Args", "parse", "plan", "submit_message", "show_health", "show_ids"]

# the kwargs ``parse`` understands; an option with any other one is left to argparse
_UNDERSTOOD = frozenset({"dest", "type", "default", "action", "choices", "help", "metavar"})


class Args:
    """What ``parse`` read: an attribute per option, as argparse's Namespace has."""
    command: str

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # called only for a name no option defines
        raise AttributeError(name)


def parse(command: str, argv: list[str]) -> Args | None:
    """``argv`` (the options after ``command``, before ``--``) as argparse
    would read them, or None where this cannot be sure it reads them the same."""
    lookup: dict[str, tuple[str, dict[str, Any]]] = {}
    values: dict[str, Any] = {"command": command}
    for flags, options in COMMANDS[command][1]:
        dest = str(options.get("dest") or flags[0].lstrip("-").replace("-", "_"))
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
            if i == n or argv[i].startswith("-"):  # argparse has its own rules for these (negative numbers, ...)
                return None
            value = argv[i]
            i += 1
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


def plan(argv: list[str], build: Callable[[Args, list[str]], dict[str, Any]]) -> Callable[[], int] | None:
    """The fast path's command for ``argv``, ready to run (nothing is sent
    yet), or None for the full path. ``build`` is ``cli.spec_fields``."""
    if os.environ.get("EVENTSCHED_NO_QUICK"):  # the full path for everything (tests compare the two)
        return None
    remote = bool(os.environ.get("EVENTSCHED_URL"))  # over HTTP (wire/http_client.py), never the socket
    if argv == ["--version"]:
        return _version
    if argv[:1] == ["health"] and not remote:
        health = parse("health", argv[1:])
        return None if health is None else lambda: show_health(_request(health, {"type": "Ping"}), health.json)
    submission = submit_message(argv, build)
    if submission is None:
        return None
    args, message = submission
    return lambda: _submit(args, message, remote=remote)


def submit_message(argv: list[str],
                   build: Callable[[Args, list[str]], dict[str, Any]]) -> tuple[Args, dict[str, Any]] | None:
    """``submit ... -- COMMAND``'s options and its ``SubmitJob`` as a dict for
    ``wire.lean``, or None where the full path must read ``argv``."""
    if argv[:1] != ["submit"] or "--" not in argv:
        return None  # not a submit, or no command: argparse's message
    cut = argv.index("--")
    args = parse("submit", argv[1:cut])
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


def _request(args: Args, message: dict[str, Any]) -> Any:
    from eventsched.domain.paths import socket_location
    from eventsched.wire.lean import request

    return request(args.socket or socket_location(args.state_dir), message)


def show_health(info: dict[str, Any], as_json: bool) -> int:
    """``health``'s answer, on either path: exit 1 while a cluster's daemon
    waits for its nodes (``serve --wait-nodes``), so a script can wait for 0."""
    up = info.get("nodes_up")  # a cluster's daemon only
    if as_json:
        from eventsched.domain.text import print_json

        print_json(info)
    elif not info.get("ok", True):
        print(f"eventsched: {info.get('waiting', 'not ready')} (daemon pid {info['pid']})", file=sys.stderr)
    else:
        nodes = "" if up is None else f", {up} node{'s' if up != 1 else ''} up"
        print(f"ok: daemon pid {info['pid']}, log at seq {info['seq']}{nodes}")
    return 0 if info.get("ok", True) else 1


def show_ids(ids: int | list[int], as_json: bool) -> None:
    """A submission's job id (an array's: one a line), on either path."""
    if as_json:
        from eventsched.domain.text import print_json

        print_json({"ids": ids} if isinstance(ids, list) else {"id": ids})
    elif isinstance(ids, list):
        sys.stdout.write("".join(f"{i}\n" for i in ids))
    else:
        print(ids)
    sys.stdout.flush()


def _submit(args: Args, message: dict[str, Any], *, remote: bool = False) -> int:
    if remote:  # the same submission as JSON to the HTTP API (POST /v1/jobs)
        from eventsched.wire.http_client import from_environment

        with from_environment() as c:
            data = c.call("POST", "/v1/jobs", {"spec": message["spec"], "array": message.get("array", [])})
    else:
        data = _request(args, message)
    show_ids([int(i) for i in data["ids"]] if "array" in message else int(data["id"]), args.json)
    return 0
