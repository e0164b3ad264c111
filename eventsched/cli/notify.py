"""``eventsched notify set|list|clear``: your own notification hook, and
``submit --notify``'s kinds. The hook file is read here, as you; the daemon
learns who sets it from the socket, so nobody sets another's."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from eventsched.cli.connect import socket_client
from eventsched.cli.errors import UserError
from eventsched.domain.text import print_json, table

__all__ = ["run", "kinds", "DEFAULT_FILE"]

DEFAULT_FILE = "~/.config/eventsched/notify.toml"


def kinds(text: str, option: str = "--notify") -> list[str]:
    """``end,fail`` as a list, each a kind a hook can be told of."""
    from eventsched.runtime.notify import KINDS

    chosen = [k.strip() for k in text.split(",") if k.strip()]
    if not chosen or any(k not in KINDS for k in chosen):
        raise UserError(f"{option} {text!r}: give some of {','.join(KINDS)}")
    return chosen


def _from_file(path: Path) -> dict[str, Any]:
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; give --webhook URL or --mail CMD, or write it "
                        f"(docs/notifications.md)") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"{path}: {exc}") from None
    unknown = set(data) - {"webhook", "secret", "on", "mail"}
    if unknown:
        raise UserError(f"{path}: unknown keys {', '.join(sorted(unknown))} (webhook, secret, on, mail)")
    if data.get("secret") and path.stat().st_mode & 0o077:
        print(f"eventsched: warning: {path} holds a secret that others may read (chmod 600 {path})", file=sys.stderr)
    return data


def _request(args: argparse.Namespace) -> Any:
    """The ``SetNotify`` the options (or else the file) ask for; bad input is one line, before connecting."""
    from eventsched.runtime.notify import check_url
    from eventsched.wire.protocol import SetNotify

    given = {k: v for k in ("webhook", "secret", "on", "mail") if (v := getattr(args, k)) is not None}
    if not given or args.config:
        given = {**_from_file(Path(args.config or DEFAULT_FILE).expanduser()), **given}
    on, mail = given.get("on", ""), given.get("mail", [])
    if isinstance(on, list) and all(isinstance(k, str) for k in on):
        on = ",".join(on)
    if not isinstance(on, str):
        raise UserError('on: the kinds, as "end,fail" or a list')
    on = kinds(on, "--on") if on else []
    if isinstance(mail, str):
        mail = shlex.split(mail)
    if not all(isinstance(word, str) for word in mail):
        raise UserError("mail: a command line, or a list of words")
    webhook, secret = str(given.get("webhook", "")), str(given.get("secret", ""))
    if not webhook and not mail:
        raise UserError("give --webhook URL or --mail CMD (or both)")
    if webhook and (why := check_url(webhook)) is not None:
        raise UserError(why)
    return SetNotify(webhook=webhook, secret=secret, on=on, mail=mail)


def run(args: argparse.Namespace) -> int:
    from eventsched.wire.protocol import ListNotify, SetNotify

    wanted = _request(args) if args.notify_command == "set" else None
    with socket_client(args) as c:
        if args.notify_command == "clear":
            removed = c.request(SetNotify())["removed"]
            print("notification hook removed" if removed else "no notification hook to remove")
        elif wanted is not None:
            hook = c.request(wanted)
            if args.json:
                print_json(hook)
            else:
                print(f"notification hook set for {hook['user']}: {_where(hook)}, on {','.join(hook['on'])}")
        else:
            hooks = c.request(ListNotify())
            if args.json:
                print_json(hooks)
            elif not hooks:
                print("no notification hook (set one with `eventsched notify set`)")
            else:
                print(table(["USER", "TO", "ON", "SENT", "LAST FAILURE"], [
                    [h["user"], _where(h), ",".join(h["on"]), h["delivered"], _failure(h)] for h in hooks]))
    return 0


def _where(hook: dict[str, Any]) -> str:
    parts = [hook["webhook"] + (" (signed)" if hook["secret"] else "")] if hook["webhook"] else []
    if hook["mail"]:
        parts.append("mail: " + shlex.join(hook["mail"]))
    return "; ".join(parts)


def _failure(hook: dict[str, Any]) -> str:
    if not hook["last_failure"]:
        return "-"
    return f"{time.strftime('%H:%M:%S', time.localtime(hook['last_failure_at']))} {hook['last_failure']}"
