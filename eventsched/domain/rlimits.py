"""A job's umask and resource limits: the submitter's, never more than the daemon's.

The client sends them in the JobSpec (-1 = RLIM_INFINITY); the daemon validates
and clamps them, and the supervisor applies them in the job's child before it
switches identity, so a hard limit is only ever lowered.
"""

from __future__ import annotations

import os
import resource

TYPE_CHECKING = False  # the CLI's fast path imports this module: no typing
if TYPE_CHECKING:
    from typing import Mapping, Sequence

__all__ = ["NAMES", "INFINITY", "RlimitError", "validate", "clamp", "current", "current_umask"]

INFINITY = resource.RLIM_INFINITY  # -1 in Python on Linux
NAMES: dict[str, int] = {name: getattr(resource, "RLIMIT_" + name.upper())
                         for name in ("nofile", "nproc", "core", "fsize", "as", "data", "stack", "cpu", "memlock")}
_MAX = (1 << 63) - 1


class RlimitError(ValueError):
    """A JobSpec's umask or limits are malformed; ``str(e)`` is the refusal."""


def _value_ok(v: object) -> bool:
    return type(v) is int and (v == INFINITY or 0 <= v <= _MAX)


def validate(rlimits: Mapping[str, Sequence[int]], umask: int = -1) -> None:
    """RlimitError naming the bad entry; a umask of -1 was not sent."""
    if type(umask) is not int or not (umask == -1 or 0 <= umask <= 0o777):
        raise RlimitError(f"umask must be between 0 and 0777, not {umask!r}")
    for name, pair in rlimits.items():
        if name not in NAMES:
            raise RlimitError(f"unknown resource limit {name!r}; known: {', '.join(NAMES)}")
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(_value_ok(v) for v in pair):
            raise RlimitError(f"resource limit {name!r} must be [soft, hard], each >= 0 or -1 for unlimited, "
                              f"not {pair!r}")


def _le(a: int, b: int) -> bool:
    """a <= b, where INFINITY is above everything."""
    return b == INFINITY or (a != INFINITY and a <= b)


def clamp(rlimits: Mapping[str, Sequence[int]], ceiling: Mapping[str, Sequence[int]] | None = None
          ) -> dict[str, list[int]]:
    """Validated, and each soft <= hard <= the ceiling's hard limit (default: this
    process's). Names not asked for are left out: the job keeps the supervisor's."""
    validate(rlimits)
    out: dict[str, list[int]] = {}
    for name, (soft, hard) in rlimits.items():
        top = ceiling[name][1] if ceiling is not None and name in ceiling else resource.getrlimit(NAMES[name])[1]
        hard = hard if _le(hard, top) else top
        out[name] = [soft if _le(soft, hard) else hard, hard]
    return out


def current() -> dict[str, list[int]]:
    return {name: list(resource.getrlimit(res)) for name, res in NAMES.items()}


def current_umask() -> int:
    # the umask can only be read by setting it, then putting it back
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
