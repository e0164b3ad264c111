"""The client a command talks to the daemon with (imported lazily: start-up time)."""

from __future__ import annotations

import os

from eventsched.domain.paths import socket_location

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from pathlib import Path

    from eventsched.wire.client import Client


def client(args: argparse.Namespace) -> Client:
    if os.environ.get("EVENTSCHED_URL"):  # the daemon's HTTP API instead of its socket
        from eventsched.wire.http_client import from_environment

        return from_environment()  # type: ignore[return-value]  # the same methods, over HTTP
    return socket_client(args)


def state_dir_of(args: argparse.Namespace) -> Path:
    from pathlib import Path

    from eventsched.domain.paths import default_state_dir

    return Path(args.state_dir) if args.state_dir else default_state_dir()


def socket_client(args: argparse.Namespace) -> Client:
    """The daemon's socket, whatever ``EVENTSCHED_URL`` says."""
    from eventsched.wire.client import Client

    return Client(args.socket or socket_location(args.state_dir))
