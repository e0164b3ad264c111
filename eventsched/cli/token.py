"""``eventsched token create|list|revoke``: API tokens for ``serve --http``.
Always over the socket, whose peer credentials say who is asking."""

from __future__ import annotations

import argparse
import pwd
import sys
import time

from eventsched.cli.connect import socket_client
from eventsched.cli.errors import UserError
from eventsched.domain.text import print_json, table

__all__ = ["run"]


def _uid_of(name: str) -> int:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise UserError(f"no user {name!r} on this machine") from None


def run(args: argparse.Namespace) -> int:
    from eventsched.wire import protocol

    with socket_client(args) as c:
        if args.token_command == "create":
            for_uid = _uid_of(args.user) if args.user else -1
            made = c.request(protocol.CreateToken(name=args.name, for_uid=for_uid))
            if args.json:
                print_json(made)
            else:
                print(made["token"])
                print(f"token {made['id']} ({made['name']}) for {made['user']}: shown only this once. Use it as\n"
                      f"  EVENTSCHED_URL=http://HOST:PORT EVENTSCHED_TOKEN=<token> eventsched queue", file=sys.stderr)
        elif args.token_command == "list":
            tokens = c.request(protocol.ListTokens())
            if args.json:
                print_json(tokens)
            elif not tokens:
                print("no tokens (make one with `eventsched token create`)")
            else:
                rows = [[t["id"], t["name"], t["user"], time.strftime("%Y-%m-%d %H:%M", time.localtime(t["created"]))]
                        for t in tokens]
                print(table(["ID", "NAME", "USER", "CREATED"], rows))
        else:
            gone = c.request(protocol.RevokeToken(token=args.token))
            print(f"revoked token {gone['id']} ({gone['name']}) of {gone['user']}")
    return 0
