"""``eventsched token create|list|revoke``: API tokens for ``serve --http`` (issue 12).

Always over the daemon's socket, whatever ``EVENTSCHED_URL`` says: the daemon
learns who is asking from the socket's peer credentials, so a token is only
ever made for the user who runs this (or, by root, for ``--user``).
"""

from __future__ import annotations

import argparse
import json
import pwd
import sys
import time
from typing import Any

from eventsched.cli.errors import UserError
from eventsched.domain.paths import socket_location
from eventsched.domain.text import table

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("token", help="API tokens for the HTTP API (serve --http): create, list, revoke")
    actions = p.add_subparsers(dest="token_command", parser_class=type(p), metavar="ACTION")
    actions.required = True
    q = actions.add_parser("create", parents=[common], help="print a new token for you (shown once; only its hash is kept)")
    q.add_argument("--name", default="", help="a name to know it by (default token-ID)")
    q.add_argument("--user", metavar="NAME", help="root only: a token of this user")
    q.add_argument("--json", action="store_true")
    q = actions.add_parser("list", parents=[common], help="your tokens (root: everyone's)")
    q.add_argument("--json", action="store_true")
    q = actions.add_parser("revoke", parents=[common], help="revoke a token by its id or name")
    q.add_argument("token", metavar="ID|NAME")


def _uid_of(name: str) -> int:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise UserError(f"no user {name!r} on this machine") from None


def run(args: argparse.Namespace) -> int:
    from eventsched.wire import protocol
    from eventsched.wire.client import Client

    with Client(args.socket or socket_location(args.state_dir)) as c:
        if args.token_command == "create":
            for_uid = _uid_of(args.user) if args.user else -1
            made = c.request(protocol.CreateToken(name=args.name, for_uid=for_uid))
            if args.json:
                json.dump(made, sys.stdout, indent=2)
                sys.stdout.write("\n")
            else:
                print(made["token"])
                print(
                    f"token {made['id']} ({made['name']}) for {made['user']}: shown only this once. Use it as\n"
                    f"  EVENTSCHED_URL=http://HOST:PORT EVENTSCHED_TOKEN=<token> eventsched queue",
                    file=sys.stderr,
                )
            return 0
        if args.token_command == "list":
            tokens = c.request(protocol.ListTokens())
            if args.json:
                json.dump(tokens, sys.stdout, indent=2)
                sys.stdout.write("\n")
            elif not tokens:
                print("no tokens (make one with `eventsched token create`)")
            else:
                rows = [[t["id"], t["name"], t["user"], time.strftime("%Y-%m-%d %H:%M", time.localtime(t["created"]))]
                        for t in tokens]
                print(table(["ID", "NAME", "USER", "CREATED"], rows))
            return 0
        gone = c.request(protocol.RevokeToken(token=args.token))
        print(f"revoked token {gone['id']} ({gone['name']}) of {gone['user']}")
        return 0
