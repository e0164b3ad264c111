"""The scheduler settings as the log records them, and how they evolve.

``DaemonStarted.config`` is a dict stamped with ``settings_version`` and upcast on
read, so a newer daemon starts on an older log and an older one refuses a newer log
in one line. To change the shape: bump ``SETTINGS_VERSION`` and add an upcaster,
never editing one that has shipped (a field added with a default needs none unless
older logs should get another value).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from eventsched.domain.messages import SchedulerConfig

__all__ = ["ReservationLimits", "SETTINGS_VERSION", "SettingsError", "settings_dict", "settings_from_dict", "UPCASTERS"]

SETTINGS_VERSION = 6
VERSION_KEY = "settings_version"


class SettingsError(Exception):
    """The recorded settings cannot be read by this version (one line)."""


class ReservationLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a user may book (operators: anything); checked when booked, so not recorded."""

    max_hours_ahead: float = 168.0  # a window may start at most a week ahead
    max_gpu_hours: float = 48.0  # GPU-hours one user holds booked in windows not yet over


def upcast_v1_v2(raw: dict[str, Any]) -> dict[str, Any]:
    """v2 added a per-user queue limit: a v1 log gets its global one, so it decides as it did."""
    return {"max_queued_per_user": raw.get("max_queued", SchedulerConfig().max_queued), **raw}


def upcast_v2_v3(raw: dict[str, Any]) -> dict[str, Any]:
    """v3 added aging, fair share, gang reservations and preemption: off for a v2 log, so it decides as it did."""
    return {"aging_per_hour": 0.0, "fair_share_weight": 0.0, "reserve_for_gang": False, "preemption": False, **raw}


def upcast_v3_v4(raw: dict[str, Any]) -> dict[str, Any]:
    """v4 added idle jobs: off for a v3 log, whose samples hold no per-job memory to check."""
    return {"idle_after_s": 0.0, **raw}


def upcast_v4_v5(raw: dict[str, Any]) -> dict[str, Any]:
    """v5 ages in whole tiers and preempts only for a job that then goes first; a v4 log
    aged continuously and replays as it ran."""
    return {"aging_tiers": False, **raw}


def upcast_v5_v6(raw: dict[str, Any]) -> dict[str, Any]:
    """v6 puts GPUs a stranger uses last; a v5 log placed in (node, id) order."""
    return {"avoid_foreign_gpus": False, **raw}


UPCASTERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: upcast_v1_v2, 2: upcast_v2_v3, 3: upcast_v3_v4, 4: upcast_v4_v5, 5: upcast_v5_v6}


def settings_dict(config: SchedulerConfig) -> dict[str, Any]:
    raw: dict[str, Any] = msgspec.to_builtins(config)
    raw[VERSION_KEY] = SETTINGS_VERSION
    return raw


def settings_from_dict(recorded: dict[str, Any], *, node: str = "local") -> SchedulerConfig:
    if not recorded:
        return SchedulerConfig(node=node)
    raw = dict(recorded)
    version = raw.pop(VERSION_KEY, 1)
    if not isinstance(version, int) or version < 1:
        raise SettingsError(f"the log's scheduler settings have an invalid version {version!r}")
    if version > SETTINGS_VERSION:
        raise SettingsError(f"the log was written by a newer eventsched (scheduler settings version {version}; this one "
                            f"reads up to {SETTINGS_VERSION}): upgrade eventsched to use this state directory")
    while version < SETTINGS_VERSION:
        raw = UPCASTERS[version](raw)
        version += 1
    try:
        return msgspec.convert(raw, SchedulerConfig)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"the log's scheduler settings (version {SETTINGS_VERSION}) are not valid here: {exc}") from None
