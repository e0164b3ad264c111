"""The units users write: durations, GPU id lists, job id lists, ``fake:N[:MIB]``.

One parser each, shared by the CLI, the daemon, the notebook magics and the
replay. Each raises ``UnitError`` (a ``ValueError``) with a one-line message
that names what was wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["FULL", "UnitError", "parse_duration", "parse_gpu_ids", "parse_job_ids", "parse_fake_gpus", "DEFAULT_FAKE_MEM_MIB"]

FULL = 1000  # milli-GPU in one whole GPU: shares are integers, never over-committed by rounding
DEFAULT_FAKE_MEM_MIB = 81_920  # an 80 GiB card
MAX_FAKE_GPUS = 1024
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class UnitError(ValueError):
    """A value a user wrote that is not what it should be (one line)."""


def parse_duration(text: str) -> float:
    """Seconds, or with a unit: ``90``, ``90s``, ``15m``, ``2h``, ``1d``, ``1h30m``."""
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not seconds > 0:
            raise UnitError(f"time limit {text!r} must be more than 0 seconds")
        return seconds
    total, number = 0.0, ""
    for ch in text.strip():
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in _DURATION_UNITS and number:
            total += float(number) * _DURATION_UNITS[ch]
            number = ""
        else:
            raise UnitError(f"time limit {text!r}: use seconds or units like 90s, 15m, 2h, 1h30m")
    if number or total <= 0:
        raise UnitError(f"time limit {text!r}: use seconds or units like 90s, 15m, 2h, 1h30m")
    return total


def parse_gpu_ids(text: str) -> list[int]:
    """``"1,3"``, ``"0-3"``, ``"0-1,4"`` -> sorted unique ids."""
    ids: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
                if low > high:
                    raise ValueError
                ids.update(range(low, high + 1))
            else:
                ids.add(int(part))
        except ValueError:
            raise UnitError(f"--gpu-ids: {part!r} is not a GPU id or range like 0-3") from None
    if not ids or min(ids) < 0:
        raise UnitError(f"--gpu-ids: {text!r} names no valid GPU id")
    return sorted(ids)


def parse_job_ids(values: Sequence[str]) -> list[int]:
    """Job ids as given on a command line: ``12 13`` or ``12,13``."""
    ids = []
    for value in values:
        for part in value.split(","):
            if not part.strip():
                continue
            try:
                ids.append(int(part))
            except ValueError:
                raise UnitError(f"{part!r} is not a job id (job ids are numbers)") from None
    if not ids:
        raise UnitError("no job id given")
    return ids


def _positive_int(value: str, what: str, text: str) -> int:
    try:
        n = int(value, 10)
    except ValueError:
        raise UnitError(f"--gpus {text!r}: {what} must be a whole number, not {value!r}") from None
    if n < 1:
        raise UnitError(f"--gpus {text!r}: {what} must be at least 1, not {n}")
    return n


def parse_fake_gpus(text: str) -> tuple[int, int]:
    """``fake:N[:MEM_MIB]`` -> (N, MEM_MIB): simulated GPUs for ``serve`` and ``replay``."""
    kind, _, rest = text.strip().partition(":")
    parts = rest.split(":")
    if kind != "fake" or not rest or len(parts) > 2:
        raise UnitError(f"--gpus {text!r}: expected fake:N[:MEM_MIB], e.g. fake:4 or fake:2:40960")
    n = _positive_int(parts[0], "the number of fake GPUs", text)
    mib = _positive_int(parts[1], "MEM_MIB", text) if len(parts) == 2 else DEFAULT_FAKE_MEM_MIB
    if n > MAX_FAKE_GPUS:
        raise UnitError(f"--gpus {text!r}: at most {MAX_FAKE_GPUS} fake GPUs")
    return n, mib
