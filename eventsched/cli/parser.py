"""argparse from the command table (``commands.py``), with one-line errors;
imported only when a command needs the full parser."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, NoReturn

from eventsched.cli.commands import COMMANDS
from eventsched.cli.errors import fail

if TYPE_CHECKING:
    from eventsched.cli.commands import Option

__all__ = ["Parser", "build"]


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # an abbreviation (`queue --state`) is an error, never taken for the
        # one option it happens to begin (`--state-dir`)
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        fail(f"{message} (see `{self.prog} --help`)")


def _add(parser: argparse.ArgumentParser, options: list[Option]) -> None:
    exclusive = None
    for flags, given in options:
        kwargs = dict(given)
        actions = kwargs.pop("actions", None)
        if actions is not None:
            sub = parser.add_subparsers(dest=flags[0], parser_class=Parser, required=True, **kwargs)
            for name, (what, inner) in actions.items():
                _add(sub.add_parser(name, help=what), inner)
        elif kwargs.pop("exclusive", False):
            exclusive = exclusive or parser.add_mutually_exclusive_group()
            exclusive.add_argument(*flags, **kwargs)
        else:
            parser.add_argument(*flags, **kwargs)


def build(only: str | None = None) -> Parser:
    """The whole parser, or with ``only`` just that command's (faster)."""
    from eventsched import __version__

    parser = Parser(prog="eventsched", description="GPU job scheduler for a shared machine")
    parser.add_argument("--version", action="version", version=f"eventsched {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=Parser, metavar="COMMAND", required=True)
    for name, (what, options) in COMMANDS.items():
        if only is None or only == name:
            _add(sub.add_parser(name, help=what), options)
    return parser
