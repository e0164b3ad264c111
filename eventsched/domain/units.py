"""The units users write (durations, GPU and job ids, ``fake:N[:MIB]``...): one
parser each, shared by every entry point, raising ``UnitError`` with one line."""

from __future__ import annotations

TYPE_CHECKING = False  # the CLI's fast path imports this module: no typing, no collections.abc
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Final

__all__ = ["FULL", "UnitError", "parse_duration", "parse_begin", "parse_gpu_ids", "parse_job_ids", "parse_fake_gpus",
           "DEFAULT_FAKE_MEM_MIB", "MAX_ARRAY_TASKS", "parse_array", "parse_signal", "format_duration", "format_gpu_time", "utc_month"]

# milli-GPU in one whole GPU: shares are integers, never over-committed by rounding.
# Final: the compiled modules inline it (else a dict lookup per use in hot scans)
FULL: Final = 1000
DEFAULT_FAKE_MEM_MIB = 81_920  # an 80 GiB card
MAX_FAKE_GPUS = 1024
# one submission's tasks: an array is one log frame and one acknowledgement;
# larger sweeps are several arrays (or a jobs file)
MAX_ARRAY_TASKS = 10_000
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class UnitError(ValueError):
    """A value a user wrote that is not what it should be (one line)."""


def parse_duration(text: str) -> float:
    """Seconds, or with a unit: ``90``, ``90s``, ``15m``, ``2h``, ``1d``, ``1h30m``."""
    wrong = UnitError(f"time limit {text!r}: use seconds or units like 90s, 15m, 2h, 1h30m")
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
            raise wrong
    if number or total <= 0:
        raise wrong
    return total


def parse_begin(text: str, now: float) -> float:
    """``--begin``'s UNIX time: ``now+10m``, ``+10m``, ``now``, seconds from now
    (``600``), a clock time (``16:00``: today, or tomorrow once past) or a
    local ISO time (``2026-11-28T15:00``)."""
    t = text.strip()
    rest = t[3:] if t.lower().startswith("now") else t
    wrong = UnitError(f"--begin {text!r}: use now+10m, +10m, seconds from now, 16:00 or 2026-11-28T15:00")
    if not rest:
        return now
    if rest.startswith("+") or ":" not in rest and "-" not in rest:
        try:
            return now + parse_duration(rest.removeprefix("+"))
        except UnitError:
            raise wrong from None
    from datetime import datetime, time, timedelta

    try:
        if "-" not in t:  # a clock time: its next coming
            at = datetime.combine(datetime.fromtimestamp(now).date(), time.fromisoformat(t))
            return (at if at.timestamp() > now else at + timedelta(days=1)).timestamp()
        return datetime.fromisoformat(t).timestamp()
    except ValueError:
        raise wrong from None


def format_duration(seconds: float | None, style: str = "clock") -> str:
    """Seconds for a person, in one of three looks: ``clock`` (``queue``'s
    TIME: ``42s``, ``5m03s``, ``2h05m``), ``decimal`` (replay comparisons:
    ``42.0 s``, ``1.5 min``, ``2.25 h``), ``span`` (a window: ``1h``, ``90s``)."""
    if seconds is None:
        return ""
    if style == "decimal":
        for unit, size, digits in ((" d", 86400, 2), (" h", 3600, 2), (" min", 60, 1)):
            if seconds >= size:
                return f"{seconds / size:.{digits}f}{unit}"
        return f"{seconds:.1f} s"
    if style == "span":
        for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
            if seconds >= size and seconds % size == 0:
                return f"{int(seconds // size)}{unit}"
        return f"{seconds:.3g}s" if seconds < 60 else f"{seconds / 60:.3g}m"
    s = max(0, int(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


LAST_TIME = 253402300800.0  # 10000-01-01 UTC: a time a user gives (--begin, a reservation) is before it
LAST_MONTH_TS = 221845392000.0  # 9000-01-01 UTC: later times count as in that month


def utc_month(ts: float) -> tuple[float, float]:
    """The calendar month (UTC) holding ``ts``: its first second and the next month's."""
    from datetime import datetime, timezone

    # a forecast far ahead stays in a month datetime can hold (its years end at 9999)
    d = datetime.fromtimestamp(min(max(ts, 0.0), LAST_MONTH_TS), timezone.utc)
    start = datetime(d.year, d.month, 1, tzinfo=timezone.utc)
    end = datetime(d.year + d.month // 12, d.month % 12 + 1, 1, tzinfo=timezone.utc)
    return start.timestamp(), end.timestamp()


def format_gpu_time(gpu_seconds: float) -> str:
    """GPU time for a person, its unit chosen by size: ``2 GPU-s``,
    ``3.4 GPU-min``, ``1.25 GPU-h``, ``310 GPU-h`` (three digits at most)."""
    s = max(0.0, float(gpu_seconds))
    if s < 60:
        return f"{s:.1g} GPU-s" if 0 < s < 1 else f"{s:.0f} GPU-s"
    if s < 3600:
        return f"{s / 60:.1f} GPU-min" if s < 600 else f"{s / 60:.0f} GPU-min"
    h = s / 3600
    return f"{h:.2f} GPU-h" if h < 10 else f"{h:.1f} GPU-h" if h < 100 else f"{h:.0f} GPU-h"


def parse_gpu_ids(text: str) -> list[int]:
    """``"1,3"``, ``"0-3"``, ``"0-1,4"`` -> sorted unique ids."""
    ids: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
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
        for part in filter(str.strip, value.split(",")):
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


def parse_array(text: str) -> tuple[list[int], int]:
    """``0-99``, ``1,3,5``, ``0-99:2``, each with an optional ``%K`` ->
    (sorted unique indices, K or 0): Slurm's ``--array`` spelling."""
    spec, pct, cap_text = text.strip().partition("%")
    cap = 0
    if pct:
        try:
            cap = int(cap_text)
        except ValueError:
            raise UnitError(f"--array {text!r}: %K must be a whole number of tasks, not {cap_text!r}") from None
        if cap < 1:
            raise UnitError(f"--array {text!r}: %K must be at least 1")
    indices: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        rng, colon, step_text = part.partition(":")
        try:
            step = int(step_text) if colon else 1
            low, high = (int(x) for x in rng.split("-", 1)) if "-" in rng.lstrip("-") else (int(rng),) * 2
        except ValueError:
            raise UnitError(f"--array {text!r}: {part!r} is not an index, a range like 0-99 or a stepped range like 0-99:2") from None
        if step < 1:
            raise UnitError(f"--array {text!r}: the step in {part!r} must be at least 1")
        if low < 0:
            raise UnitError(f"--array {text!r}: indices start at 0, not {low}")
        if low > high:
            raise UnitError(f"--array {text!r}: the range {part!r} runs backwards")
        if (high - low) // step + 1 + len(indices) > MAX_ARRAY_TASKS:
            raise UnitError(f"--array {text!r}: at most {MAX_ARRAY_TASKS} tasks in one array; submit several")
        indices.update(range(low, high + 1, step))
    if not indices:
        raise UnitError(f"--array {text!r}: no index given (e.g. 0-99, 1,3,5 or 0-99:2)")
    return sorted(indices), cap


def parse_signal(text: str) -> tuple[int, float]:
    """``SIG@SECONDS`` (Slurm's ``--signal``): ``USR1@60``, ``SIGTERM@30``,
    ``10@5``, or ``SIG`` alone -> (signal number, seconds; -1 = the default)."""
    import signal as _signal

    name, at, sec_text = text.strip().partition("@")
    seconds = -1.0
    if at:
        try:
            seconds = float(sec_text)
        except ValueError:
            raise UnitError(f"--signal {text!r}: SECONDS must be a number, as in USR1@60") from None
        if not 0 <= seconds <= 86400:
            raise UnitError(f"--signal {text!r}: SECONDS must be between 0 and 86400")
    if name.isdigit():
        num = int(name)
    else:
        upper = name.upper()
        sig = getattr(_signal, upper if upper.startswith("SIG") else "SIG" + upper, None)
        if not isinstance(sig, _signal.Signals) or upper in ("SIG_DFL", "SIG_IGN"):
            raise UnitError(f"--signal {text!r}: unknown signal {name!r}; use a name like USR1 or TERM, as in USR1@60")
        num = int(sig)
    if num not in {int(s) for s in _signal.valid_signals()} or num in (0, _signal.SIGKILL, _signal.SIGSTOP):
        raise UnitError(f"--signal {text!r}: {name} cannot be a warning signal")
    return num, seconds
