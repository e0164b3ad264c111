"""argparse, with one-line errors: imported only when a command needs the
full parser (the fast path of ``quick.py`` does without it)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from eventsched.cli.errors import fail

__all__ = ["Parser", "positive_seconds"]


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        fail(f"{message} (see `{self.prog} --help`)")


def positive_seconds(text: str) -> float:
    """An interval in seconds that must be finite and above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return value
