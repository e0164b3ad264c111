"""The seeds' ``config.json`` (seed 000's schema), accepted by ``serve --config X.json``.

Each key is translated by ``SEED_KEYS`` (which also says why a key is ignored),
then validated by ``config.config_from_dict`` like a TOML file; eventsched's
own keys pass through, any other is refused by name. Relative paths are taken
from the config file's folder.
"""

from __future__ import annotations

import json
import math
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import msgspec

from eventsched.domain.llm import LLM_CONFIG_NAME
from eventsched.domain.messages import SchedulerConfig

__all__ = ["SeedConfigError", "translate_file", "seed_config_to_dict", "SEED_KEYS"]


class SeedConfigError(ValueError):
    """One line: ``config file X: what is wrong`` (load_config makes it a ConfigError)."""


_Convert = Callable[[Any, str], Any]


def _number(value: Any, key: str, *, low: float, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} must be a number, not {json.dumps(value)}")
    if value < low or (low_open and value == low) or value > high:
        bound = f"more than {low:g}" if low_open else f"at least {low:g}"
        if high != math.inf:
            bound += f" and at most {high:g}"
        raise ValueError(f"{key} must be {bound}, not {value:g}")
    return float(value)


def _whole(value: Any, key: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, float) and value.is_integer()):
        raise ValueError(f"{key} must be a whole number, not {json.dumps(value)}")
    if value < low:
        raise ValueError(f"{key} must be at least {low}, not {value:g}")
    return int(value)


_seconds = partial(_number, low=0, low_open=True)


def _fraction_pct(value: Any, key: str) -> float:
    return round(_number(value, key, low=0, high=1, low_open=True) * 100, 6)


def _gib_to_mib(value: Any, key: str) -> int:
    return round(_number(value, key, low=0) * 1024)


def _paths(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise ValueError(f"{key} must be a list of folder paths, not {json.dumps(value)}")
    return list(value)


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a file path, not {json.dumps(value)}")
    return value


_IGNORED = None
# section -> seed key -> (eventsched key path, converter), or None: known and ignored (the comment says why)
SEED_KEYS: dict[str, dict[str, tuple[tuple[str, ...], _Convert] | None]] = {
    "scheduler": {
        "job_timeout_s": (("scheduler", "default_time_limit_s"), _seconds),
        "num_gpus": _IGNORED,  # GPUs come from NVML, or --gpus fake:N
        "max_workers": _IGNORED,  # no worker pool: one event loop places
        "worker_timeout_s": _IGNORED,  # idem
        "graceful_shutdown_timeout_s": _IGNORED,  # jobs keep running when the daemon stops
    },
    "gpu": {
        "memory_threshold": (("scheduler", "max_gpu_memory_used_pct"), _fraction_pct),  # 0-1 -> %
        "load_threshold": (("scheduler", "max_gpu_utilization_pct"), _fraction_pct),  # 0-1 -> %
        "monitor_interval_s": (("sample_interval_s",), _seconds),
        "allocation_precision": _IGNORED,  # shares are exact (thousandths of a GPU)
        "utilization_window_s": _IGNORED,  # history is in the log (`eventsched sql`)
    },
    "jobs": {
        "queue_size_limit": (("scheduler", "max_queued"), partial(_whole, low=1)),
        "max_concurrent_jobs": (("scheduler", "max_running"), partial(_whole, low=0)),
        "max_assignment_attempts": _IGNORED,  # a job waits in the queue until it fits
        "assignment_retry_wait_s": _IGNORED,  # idem
    },
    "files": {
        "jobs_file": (("jobs_file",), _text),  # the daemon follows it (jobs_follower)
        "llm_config_file": (("llm_config_file",), _text),  # must be llm_config.json beside the jobs file: checked below
        "state_file": _IGNORED,  # the state is the event log in --state-dir
        "log_file": _IGNORED,  # the daemon logs JSON lines to stderr
        "monitor_interval_s": _IGNORED,  # the jobs file is looked at every second
    },
    # always JSON lines to stderr (`serve --log-level`); rotation is journald's
    "logging": dict.fromkeys(("level", "structured", "max_log_size_mb", "backup_count", "metrics_enabled"), _IGNORED),
    "security": {
        "allowed_script_paths": (("scheduler", "allowed_script_paths"), _paths),
        "max_memory_per_job_gb": (("scheduler", "max_host_mem_mib"), _gib_to_mib),  # only if enable_resource_limits
        "enable_resource_limits": _IGNORED,  # a switch, read below
    },
}


def _unknown(where: str, key: str, known: set[str]) -> SeedConfigError:
    return SeedConfigError(f"config file {where}: unknown key {key!r} (known: {', '.join(sorted(known))})")


def seed_config_to_dict(
    raw: Any, where: str, folder: str, ours: type, scheduler_extra: Iterable[str] = ()
) -> dict[str, Any]:
    """The seed's parsed JSON as eventsched's config dict (SeedConfigError: one line). The
    fields of ``ours`` (``FileConfig``, passed in: no import cycle) and of [scheduler] pass through."""
    if not isinstance(raw, dict):
        raise SeedConfigError(f"config file {where}: expected a JSON object of sections (scheduler, gpu, jobs, files, ...)")
    our_top = {f.name for f in msgspec.structs.fields(ours)}
    our_scheduler = {f.name for f in msgspec.structs.fields(SchedulerConfig)} | set(scheduler_extra)
    out: dict[str, Any] = {}
    scheduler: dict[str, Any] = {}
    for section, body in raw.items():
        seed = SEED_KEYS.get(section)
        if seed is None:
            if section not in our_top:
                raise _unknown(where, section, set(SEED_KEYS) | our_top)
            out[section] = body
            continue
        if not isinstance(body, dict):
            raise SeedConfigError(f"config file {where}: {section} must be an object of settings, not {json.dumps(body)}")
        own = our_scheduler if section == "scheduler" else set()  # eventsched's own keys pass through
        limits_on = body.get("enable_resource_limits", True) if section == "security" else True
        if not isinstance(limits_on, bool):
            raise SeedConfigError(f"config file {where}: security.enable_resource_limits must be true or false")
        for key, value in body.items():
            name = f"{section}.{key}"
            if key not in seed:
                if key in own:
                    scheduler[key] = value
                    continue
                raise _unknown(where, name, {f"{section}.{k}" for k in (*seed, *own)})
            rule = seed[key]
            if rule is None:
                continue
            target, convert = rule
            try:
                converted = convert(value, name)
            except ValueError as exc:
                raise SeedConfigError(f"config file {where}: {exc}") from None
            if name == "security.max_memory_per_job_gb" and not limits_on:
                continue
            if target[0] == "scheduler":
                scheduler[target[1]] = converted
            else:
                out[target[0]] = converted
    if scheduler:
        out["scheduler"] = scheduler
    if isinstance(out.get("jobs_file"), str) and out["jobs_file"]:  # from the config file's folder
        out["jobs_file"] = os.path.normpath(os.path.join(folder, out["jobs_file"]))
    llm_file = out.pop("llm_config_file", None)
    if llm_file is not None and out.get("jobs_file"):
        wanted = os.path.join(os.path.dirname(out["jobs_file"]), LLM_CONFIG_NAME)
        if os.path.normpath(os.path.join(folder, llm_file)) != wanted:
            raise SeedConfigError(
                f"config file {where}: files.llm_config_file: the daemon reads {wanted} (llm_config.json next to "
                f"the jobs file), not {llm_file}; move or link it there"
            )
    return out


def translate_file(path: str | Path, ours: type, scheduler_extra: Iterable[str] = ()) -> dict[str, Any]:
    """``serve --config X.json``: read and translate (``config_from_dict`` validates)."""
    where = str(path)
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise SeedConfigError(f"config file {where} does not exist") from None
    except OSError as exc:
        raise SeedConfigError(f"config file {where}: {exc.strerror or exc}") from None
    try:
        raw = json.loads(data)
    except UnicodeDecodeError:
        raise SeedConfigError(f"config file {where}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise SeedConfigError(f"config file {where}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    folder = os.path.dirname(os.path.abspath(where))
    return seed_config_to_dict(raw, where, folder, ours, scheduler_extra)
