"""How the CLI says a user's mistake: one line on stderr, exit status 2."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

__all__ = ["UserError", "fail", "refusal_exit"]


class UserError(Exception):
    """A mistake of the user's: printed as one line, exit status 2."""


def refusal_exit(kind: str) -> int:
    """A refusal's exit status: 2 for a request wrong in itself (a usage error), else 1."""
    return 2 if kind == "invalid" else 1


def fail(message: str, code: int = 2) -> NoReturn:
    from eventsched.domain.text import print_error  # only on this path: every CLI call imports us

    print_error(message)
    raise SystemExit(code)
