"""How the CLI says a user's mistake: one line on stderr, exit status 2."""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

__all__ = ["EXIT_USAGE", "UserError", "fail"]

EXIT_USAGE = 2


class UserError(Exception):
    """A mistake of the user's: printed as one line, exit status 2."""


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    print(f"eventsched: error: {message}", file=sys.stderr)
    raise SystemExit(code)
