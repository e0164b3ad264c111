"""The scheduler settings as the log records them, and how they evolve.

``DaemonStarted.config`` holds them as a plain dict stamped with
``settings_version``; reading one goes dict -> upcasters -> struct (as
eventsourcing's ``upcast_vN_vN1``), so a newer daemon starts on an older log,
and an older daemon meets a newer log with a clear one-line refusal.

To change their shape: bump ``SETTINGS_VERSION`` and register a new
``upcast_v{N}_v{N+1}`` in ``UPCASTERS``; never edit one that has shipped. A
field added with a default needs none unless old logs should get another value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from eventsched.domain.messages import SchedulerConfig

__all__ = ["SETTINGS_VERSION", "SettingsError", "settings_dict", "settings_from_dict", "UPCASTERS"]

SETTINGS_VERSION = 6
VERSION_KEY = "settings_version"


class SettingsError(Exception):
    """The recorded settings cannot be read by this version (one line)."""


def upcast_v1_v2(raw: dict[str, Any]) -> dict[str, Any]:
    """v2 added a per-user queue limit. A v1 log had none: give it one as large
    as its global limit, so replaying or resuming it decides as it did."""
    out = dict(raw)
    out.setdefault("max_queued_per_user", out.get("max_queued", SchedulerConfig().max_queued))
    return out


def upcast_v2_v3(raw: dict[str, Any]) -> dict[str, Any]:
    """v3 added teams: aging, fair share, gang reservations and preemption.
    A v2 log decided by priority alone: switch them off for it, so replaying
    or resuming it decides as it did (a restart with a config records v3)."""
    out = dict(raw)
    out.setdefault("aging_per_hour", 0.0)
    out.setdefault("fair_share_weight", 0.0)
    out.setdefault("reserve_for_gang", False)
    out.setdefault("preemption", False)
    return out


def upcast_v3_v4(raw: dict[str, Any]) -> dict[str, Any]:
    """v4 added the GPU memory and idle settings. A v3 log never looked
    for idle jobs: switch that off for it, so replaying or resuming it decides
    as it did (its samples carry no per-job memory, so the memory check is moot)."""
    out = dict(raw)
    out.setdefault("idle_after_s", 0.0)
    return out


def upcast_v4_v5(raw: dict[str, Any]) -> dict[str, Any]:
    """v5 counts aging in whole tiers, and preempts only for a job that then
    goes first (docs/fair-share.md). A v4 log aged continuously and compared
    raw priorities to preempt: keep that for it, so it replays as it ran."""
    out = dict(raw)
    out.setdefault("aging_tiers", False)
    return out


def upcast_v5_v6(raw: dict[str, Any]) -> dict[str, Any]:
    """v6 puts GPUs a stranger uses last on their node. A v5 log placed in
    plain (node, id) order: keep that for it, so it replays as it ran."""
    return {**raw, "avoid_foreign_gpus": raw.get("avoid_foreign_gpus", False)}


UPCASTERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: upcast_v1_v2, 2: upcast_v2_v3, 3: upcast_v3_v4, 4: upcast_v4_v5, 5: upcast_v5_v6}


def settings_dict(config: SchedulerConfig) -> dict[str, Any]:
    """What ``DaemonStarted.config`` records: the settings and their version."""
    raw: dict[str, Any] = msgspec.to_builtins(config)
    raw[VERSION_KEY] = SETTINGS_VERSION
    return raw


def settings_from_dict(recorded: dict[str, Any], *, node: str = "local") -> SchedulerConfig:
    """The settings a ``DaemonStarted`` recorded, upcast to this version's shape."""
    if not recorded:
        return SchedulerConfig(node=node)
    raw = dict(recorded)
    version = raw.pop(VERSION_KEY, 1)
    if not isinstance(version, int) or version < 1:
        raise SettingsError(f"the log's scheduler settings have an invalid version {version!r}")
    if version > SETTINGS_VERSION:
        raise SettingsError(
            f"the log was written by a newer eventsched (scheduler settings version {version}; this one reads "
            f"up to {SETTINGS_VERSION}): upgrade eventsched to use this state directory"
        )
    while version < SETTINGS_VERSION:
        raw = UPCASTERS[version](raw)
        version += 1
    try:
        return msgspec.convert(raw, SchedulerConfig)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"the log's scheduler settings (version {SETTINGS_VERSION}) are not valid here: {exc}") from None
