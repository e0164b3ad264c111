"""argparse, with one-line errors: imported only when a command needs the
full parser (the fast path of ``quick.py`` does without it)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from eventsched.cli.errors import fail

__all__ = ["Parser"]


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        fail(f"{message} (see `{self.prog} --help`)")
