"""What the control socket admits from a user, before the core sees it.

The core checks that a job *could run here*; this that a request is
*reasonable from this user* (bounded numbers and strings, high priorities for
operators). The bounds (``limits.SubmitLimits``) live in an interpreted
module: mypyc would drop a Struct's class options.
"""

from __future__ import annotations

import math

from eventsched.core.limits import SubmitLimits
from eventsched.domain.events import JobSpec
from eventsched.domain.messages import RefusalKind, Refused
from eventsched.domain.rlimits import RlimitError
from eventsched.domain.rlimits import validate as validate_rlimits
from eventsched.domain.text import has_control
from eventsched.domain.units import LAST_TIME

__all__ = ["check_submission", "check_update"]

DAY_S = 86400.0  # the longest --signal warning, as the CLI's SIG@SECONDS allows
MAX_SIGNAL = 64  # Linux's last real-time signal


def _bytes(strings: list[str]) -> int:
    return sum(len(s.encode("utf-8", "surrogatepass")) + 1 for s in strings)


def _within(strings: list[str], limit: int) -> bool:
    """``_bytes(strings) <= limit`` for sure, without encoding: a character is at most 4 bytes."""
    return 4 * sum(map(len, strings)) + len(strings) <= limit


def _check_priority(priority: int, limits: SubmitLimits, operator: bool) -> None:
    if not operator and abs(priority) > limits.max_user_priority:  # operators: any priority
        raise Refused(RefusalKind.FORBIDDEN, f"--priority {priority} is outside [-{limits.max_user_priority}, "
                      f"{limits.max_user_priority}]; higher priorities are for operators")
    if abs(priority) > 1 << 31:
        raise Refused(RefusalKind.INVALID, f"--priority {priority} is too large")


def _check_time_limit(t: float | None, limits: SubmitLimits) -> None:
    if t is not None and not (math.isfinite(t) and 0 < t <= limits.max_time_limit_s):
        raise Refused(RefusalKind.INVALID,
                      f"--time-limit must be between 0 and {limits.max_time_limit_s:g} seconds, not {t:g}")


def _check_gpus(gpus: float, limits: SubmitLimits) -> None:
    if not math.isfinite(gpus) or not 0 <= gpus <= limits.max_gpu_ids:
        raise Refused(RefusalKind.INVALID, f"--gpus must be between 0 and {limits.max_gpu_ids}, not {gpus:g}")


def _check_name(name: str, limits: SubmitLimits) -> None:
    if len(name) > limits.max_name_chars:
        raise Refused(RefusalKind.INVALID, f"--name is {len(name)} characters; at most {limits.max_name_chars}")


def check_update(priority: int | None, time_limit_s: float | None, gpus: float | None, name: str | None,
                 limits: SubmitLimits, *, operator: bool) -> None:
    """``check_submission``'s bounds on the fields an ``update`` changes (None: unchanged)."""
    if priority is None and time_limit_s is None and gpus is None and name is None:
        raise Refused(RefusalKind.INVALID, "nothing to update: give --priority, --time-limit, --gpus or --name")
    if priority is not None:
        _check_priority(priority, limits, operator)
    _check_time_limit(time_limit_s, limits)
    if gpus is not None:
        _check_gpus(gpus, limits)
    if name is not None:
        _check_name(name, limits)


def check_submission(spec: JobSpec, limits: SubmitLimits, *, operator: bool) -> None:
    _check_priority(spec.priority, limits, operator)
    if not 0 <= spec.retries <= limits.max_retries:
        raise Refused(RefusalKind.INVALID, f"--retries must be between 0 and {limits.max_retries}, not {spec.retries}")
    _check_time_limit(spec.time_limit_s, limits)
    if not 0 <= spec.gpu_mem_mib <= limits.max_gpu_mem_mib:
        raise Refused(RefusalKind.INVALID, f"--gpu-mem must be between 0 and {limits.max_gpu_mem_mib} MiB, not {spec.gpu_mem_mib}")
    _check_gpus(spec.gpus, limits)
    if not (math.isfinite(spec.begin) and 0 <= spec.begin < LAST_TIME):
        raise Refused(RefusalKind.INVALID, f"--begin must be a time before the year 10000, not {spec.begin:g}")
    if not (spec.warn_s == -1.0 or 0 <= spec.warn_s <= DAY_S) or not 0 <= spec.warn_signal <= MAX_SIGNAL:
        raise Refused(RefusalKind.INVALID, f"--signal must be SIG@SECONDS, a signal and 0 to {DAY_S:g} seconds")
    if spec.gpu_ids is not None and (len(spec.gpu_ids) > limits.max_gpu_ids
                                     or any(not 0 <= g < 1 << 20 for g in spec.gpu_ids)):
        raise Refused(RefusalKind.INVALID, "--gpu-ids lists too many GPUs or an impossible id")
    if len(spec.after) > limits.max_after or any(not 0 < j < 1 << 53 for j in spec.after):
        raise Refused(RefusalKind.INVALID, f"--after takes at most {limits.max_after} valid job ids")
    _check_name(spec.name, limits)
    # control characters in names are kept (a default name is the command's
    # own) and escaped wherever they are printed (text.printable)
    if has_control(spec.tenant) or len(spec.tenant) > limits.max_name_chars:
        raise Refused(RefusalKind.INVALID, "--tenant must be a short name without control characters")
    words = [*spec.command, spec.conda]
    command = 0 if _within(words, limits.max_command_bytes) else _bytes(words) - 1
    if command > limits.max_command_bytes:
        raise Refused(RefusalKind.INVALID, f"the command is {command} bytes; at most {limits.max_command_bytes}")
    strings = [*spec.env, *spec.env.values(), spec.env_setup]
    env = 0 if _within(strings, limits.max_env_bytes) else _bytes(strings)
    if env > limits.max_env_bytes:
        raise Refused(RefusalKind.INVALID, f"the environment and --env-setup are {env} bytes; at most {limits.max_env_bytes} "
                      "(submit from a shell with a smaller environment, e.g. `env -i PATH=$PATH eventsched submit ...`)")
    if len(spec.cwd) > 4096 or "\0" in spec.cwd:
        raise Refused(RefusalKind.INVALID, "the working directory is not a valid path")
    try:  # the supervisor clamps them to the daemon's own limits; refuse nonsense here
        validate_rlimits(spec.rlimits, spec.umask)
    except RlimitError as exc:
        raise Refused(RefusalKind.INVALID, str(exc)) from None
