"""The TOML config file, validated at start with clear errors, and ``ServeConfig``:
the file overridden by the command line, what the daemon is built from."""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

from eventsched.core.limits import SubmitLimits
from eventsched.domain.gpu_health import PREFIX as HEALTH_PREFIX
from eventsched.domain.gpu_health import GpuHealthConfig
from eventsched.domain.messages import SchedulerConfig, lease_margin_s, lease_terms
from eventsched.domain.settings import ReservationLimits
from eventsched.domain.paths import default_socket, default_state_dir
from eventsched.domain.tenants import Tenant, TenantConfig, TenantError, check_tenants
from eventsched.domain.units import UnitError, parse_duration


class ConfigError(Exception):
    """One line naming the file and what is wrong in it."""


class ConnectionLimits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Fair use of the control socket (root and the daemon's user are exempt;
    ``COMMENTS`` says what each means)."""

    max_per_user: Annotated[int, msgspec.Meta(ge=1)] = 64
    max_total: Annotated[int, msgspec.Meta(ge=1)] = 4096
    max_unread_bytes_per_user: Annotated[int, msgspec.Meta(ge=1 << 16)] = 32 << 20
    # a user's flood waits behind itself, not in front of other users
    max_requests_in_flight_per_user: Annotated[int, msgspec.Meta(ge=1)] = 64


class JobLimits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Host limits, written under ``[scheduler]`` but kept out of the recorded
    settings: no scheduling decision depends on them."""

    allowed_script_paths: list[str] = []
    max_host_mem_mib: Annotated[int, msgspec.Meta(ge=0)] = 0


JOB_LIMIT_KEYS = ("allowed_script_paths", "max_host_mem_mib")  # keys of [scheduler] that belong to JobLimits


class Accounting(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """What GPU time costs, for `eventsched report --config` (no decision depends on it)."""

    gpu_hour_price: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class FileConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """What a config file may set; command-line options override it."""

    gpus: str | None = None
    policy: str | None = None
    sample_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    scheduler: SchedulerConfig = SchedulerConfig()
    limits: SubmitLimits = SubmitLimits()
    connections: ConnectionLimits = ConnectionLimits()
    job_limits: JobLimits = JobLimits()
    tenants: dict[str, TenantConfig] = {}
    jobs_file: str | None = None  # a jobs file the daemon follows itself
    accounting: Accounting = Accounting()
    reservations: ReservationLimits = ReservationLimits()
    gpu_health: GpuHealthConfig = GpuHealthConfig()  # recorded as [scheduler]'s gpu_health_* settings


# what each key of `config-sample` means; the values printed are the settings' own defaults
COMMENTS = {
    "gpus": "unset: the real GPUs through NVML",
    "policy": "unset: [scheduler] policy",
    "sample_interval_s": "seconds between GPU samples",
    "jobs_file": "unset: none; else a jobs file the daemon follows itself",
    "scheduler.node": "this machine's name among several",
    "scheduler.policy": "fifo, priority, best-fit, fair-share, sjf-backfill, fgd",
    "scheduler.default_time_limit_s": "unset: no time limit; else every job's, in seconds",
    "scheduler.kill_grace_s": "SIGTERM, then SIGKILL after this long",
    "scheduler.max_queued": "submissions beyond this are refused",
    "scheduler.max_queued_per_user": "one user's waiting jobs beyond this are refused",
    "scheduler.max_running": "0 = no limit on concurrent jobs",
    "scheduler.max_gpu_memory_used_pct": "skip GPUs fuller than this",
    "scheduler.max_gpu_utilization_pct": "skip GPUs busier than this",
    "scheduler.max_gpu_temperature_c": "thermal-aware: skip hotter GPUs (e.g. 85)",
    "scheduler.retry_backoff_s": "first retry delay, doubled each time",
    "scheduler.aging_per_hour": "priority points a waiting job gains per hour (docs/fair-share.md)",
    "scheduler.aging_tiers": "aging in whole tiers at fixed times (false: continuous)",
    "scheduler.fair_share_weight": "points of the fair-share factor (policy fair-share)",
    "scheduler.usage_half_life_s": "recent use fades by half in this long",
    "scheduler.reserve_for_gang": "hold GPUs for a blocked multi-GPU job at the head",
    "scheduler.reserve_after_s": "... once it has waited this long",
    "scheduler.preemption": "--preemptible jobs may be stopped for more urgent ones",
    "scheduler.preempt_grace_s": "warning signal, then this long, then SIGKILL; then requeued",
    "scheduler.preempt_protect_s": "a job preempted once then runs at least this long",
    "scheduler.gpu_mem_policy": 'a job over its --gpu-mem: "warn", or "stop" (docs/gpu-memory-and-idle.md)',
    "scheduler.idle_utilization_pct": "a job whose GPUs are all at most this busy ...",
    "scheduler.idle_after_s": "... this long is idle (0: not looked for)",
    "scheduler.idle_policy": '"off", "requeue" or "stop" an idle job when a waiting job could use it',
    "scheduler.node_lost_after_s": "several machines: a node gone this long loses its jobs",
    "scheduler.node_lease_s": "a node that hears nothing from the daemon this long stops its jobs itself (0: never; unset: 3/4 of node_lost_after_s)",
    "scheduler.avoid_foreign_gpus": "on an equal fit, prefer GPUs no process outside the scheduler uses",
    "scheduler.budget_action": 'a tenant past its gpu_hours_per_month: "hold" its jobs or "lower-priority"',
    "limits": "what a non-operator may ask for (root and the daemon's user are exempt from the priority ceiling)",
    "limits.max_user_priority": "--priority within [-this, this]",
    "limits.max_retries": "--retries at most this",
    "limits.max_time_limit_s": "--time-limit at most this (one year)",
    "limits.max_gpu_mem_mib": "--gpu-mem at most this, per GPU",
    "limits.max_command_bytes": "the command line, all arguments together",
    "limits.max_env_bytes": "environment plus --env-setup",
    "limits.max_name_chars": "--name at most this long",
    "limits.max_after": "--after dependencies of one job",
    "limits.max_gpu_ids": "GPU ids named by one job",
    "connections": "fair use of the socket (root and the daemon's user are exempt from the per-user limit)",
    "connections.max_per_user": "connections held by one user at once",
    "connections.max_total": "all connections; lowered to fit the open-file limit",
    "connections.max_unread_bytes_per_user": "replies a user's clients leave unread before one is cut off",
    "connections.max_requests_in_flight_per_user": "one user's requests being answered at once; the rest wait",
    "job_limits": "host limits, enforced by the kernel (also accepted under [scheduler])",
    "job_limits.allowed_script_paths": 'a job\'s script or program must lie here ([]: anywhere; e.g. ["/data3/"])',
    "gpu_health": "what drains a GPU: nothing new goes there until `eventsched resume-gpu` (docs/gpu-health.md)",
    "gpu_health.ecc_uncorrected": "uncorrected ECC errors since the last GPU reset (0: never)",
    "gpu_health.ecc_corrected": "corrected ECC errors since the last GPU reset (0: never)",
    "gpu_health.retired_pages": "retired memory pages (0: never)",
    "gpu_health.pending": "a page retirement or row remap waiting for a GPU reset, or a failed remap",
    "gpu_health.xids": "Xid events that drain (others are recorded only)",
    "gpu_health.lost": "a lost GPU stays drained when it reads again (false: back by itself)",
    "gpu_health.running": '"finish": its running jobs finish; "requeue": stopped and requeued',
    "accounting": "what GPU time costs: `eventsched report --config FILE` adds a cost column",
    "accounting.gpu_hour_price": "price of one GPU-hour (0: no cost column)",
    "reservations": "what a user may book with `eventsched reserve create` (operators: anything, for anyone)",
    "reservations.max_hours_ahead": "a window may start at most this many hours ahead",
    "reservations.max_gpu_hours": "GPU-hours one user may hold booked in windows not yet over",
    "scheduler.reservation_policy": 'another\'s job on booked GPUs when the window opens: "requeue" or "flag"',
    "job_limits.max_host_mem_mib": "host memory per job (0: no limit; cgroup v2, cgroup v1 as root, else RLIMIT_AS)",
}
TENANTS_EXAMPLE = """
# [tenants.vision]             # quotas are ceilings on what runs at once
# users = ["alice", "bob"]
# gpus = 4                     # GPUs (sum of shares)
# gpu_mem_mib = 160000
# jobs = 20
# weight = 2.0                 # fair share among tenants
# preemptible = true           # its jobs over its fair share may be preempted
# gpu_hours_per_month = 500    # budget per calendar month (UTC); then [scheduler] budget_action
# budget_action = "hold"       # or "lower-priority": this tenant's own action
"""


def sample_config(form: str = "toml") -> str:
    """Every key with its default (``FileConfig()``), as TOML with a comment a
    key, or as JSON for ``serve --config X.json``."""
    import json

    defaults = msgspec.to_builtins(FileConfig())
    # the [gpu_health] section is where these are set
    defaults["scheduler"] = {k: v for k, v in defaults["scheduler"].items() if not k.startswith(HEALTH_PREFIX)}
    if form == "json":
        return json.dumps(defaults, indent=2) + "\n"

    def row(setting: str, key: str) -> str:
        return f"{setting:<30} # {COMMENTS[key]}" if key in COMMENTS else setting

    def rows(table: dict[str, Any], prefix: str = "") -> list[str]:  # None: unset, which TOML cannot write
        return [row(f"# {k} =" if v is None else f"{k} = {json.dumps(v)}", prefix + k)
                for k, v in table.items() if not isinstance(v, dict)]

    text = ["# eventsched configuration (TOML), every key at its default: all are optional.",
            "# Command-line options of `eventsched serve` override what is set here.", "", *rows(defaults)]
    for section, table in defaults.items():
        if isinstance(table, dict) and table:
            text += ["", row(f"[{section}]", section), *rows(table, section + ".")]
    return "\n".join(text) + "\n" + TENANTS_EXAMPLE


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Everything ``eventsched serve`` runs with, built once by ``serve_config``."""

    state_dir: Path
    socket: Path
    file: FileConfig  # the config file, with --gpus, --policy, --time-limit and --sample-interval applied
    log_level: str = "info"
    log_file: Path | None = None  # the daemon's log, rotated by size (else stderr)
    ray: str | None = None  # a Ray cluster's address: its nodes run the jobs
    wait_nodes: int = 0  # `health` says "waiting" until this many nodes have joined
    http: str | None = None  # HOST:PORT of the JSON API
    http_allow_remote: bool = False
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """``serve``'s command line over its config file; ``ConfigError`` (one line) for a bad value."""
    from eventsched.core.policies import POLICIES, REPLAY_ONLY

    file = load_config(args.config)
    scheduler = file.scheduler
    if args.policy or file.policy:
        scheduler = msgspec.structs.replace(scheduler, policy=args.policy or file.policy)
    if args.time_limit:
        try:
            scheduler = msgspec.structs.replace(scheduler, default_time_limit_s=parse_duration(args.time_limit))
        except UnitError as exc:
            raise ConfigError(str(exc)) from None
    if scheduler.policy in REPLAY_ONLY:
        raise ConfigError(f"{scheduler.policy} is a reference for replays only: {REPLAY_ONLY[scheduler.policy]}")
    if scheduler.policy not in POLICIES:
        live = ", ".join(p for p in POLICIES if p not in REPLAY_ONLY)
        raise ConfigError(f"unknown policy {scheduler.policy!r}; choose one of {live}")
    scheduler = msgspec.structs.replace(scheduler, **file.gpu_health.settings())
    file = msgspec.structs.replace(file, scheduler=scheduler, gpus=args.gpus or file.gpus,
                                   sample_interval_s=args.sample_interval or file.sample_interval_s)
    if args.wait_nodes is not None and not args.ray:
        raise ConfigError("--wait-nodes needs --ray: nodes join a Ray cluster")
    if args.wait_nodes is not None and args.wait_nodes < 1:
        raise ConfigError(f"--wait-nodes must be at least 1, not {args.wait_nodes}")
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir()
    return ServeConfig(
        state_dir=state_dir,
        socket=Path(args.socket) if args.socket else default_socket(state_dir if args.state_dir else None),
        file=file,
        log_level=args.log_level,
        log_file=Path(args.log_file) if args.log_file else None,
        ray=args.ray,
        wait_nodes=args.wait_nodes or 0,
        http=args.http,
        http_allow_remote=args.http_allow_remote,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
    )


def load_config(path: str | Path | None) -> FileConfig:
    if path is None:
        return FileConfig()
    if str(path).endswith(".json"):  # the seeds' config.json, translated (seed_config.py)
        from eventsched.runtime.seed_config import SeedConfigError, translate_file

        try:
            return config_from_dict(translate_file(path, FileConfig, JOB_LIMIT_KEYS), str(path))
        except SeedConfigError as exc:
            raise ConfigError(str(exc)) from None
    try:
        raw: dict[str, Any] = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:  # a folder, no permission, not UTF-8
        raise ConfigError(f"config file {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    return config_from_dict(raw, str(path))


def config_from_dict(raw: dict[str, Any], where: str) -> FileConfig:
    """Validate a parsed config (TOML, or a seed's JSON translated to it)."""
    raw = dict(raw)
    # a section given as a number or a string is msgspec's to name below, not a TypeError here
    scheduler = dict(raw["scheduler"]) if isinstance(raw.get("scheduler"), dict) else {}
    moved = {k: scheduler.pop(k) for k in JOB_LIMIT_KEYS if k in scheduler}
    if moved:
        if not isinstance(raw.get("job_limits") or {}, dict):
            raise ConfigError(f"config file {where}: job_limits must be a table, like [scheduler]")
        raw["scheduler"] = scheduler
        raw["job_limits"] = {**(raw.get("job_limits") or {}), **moved}
    try:
        config = msgspec.convert(raw, FileConfig)
        check_tenants(plain_tenants(config))
    except (msgspec.ValidationError, TenantError) as exc:
        raise ConfigError(f"config file {where}: {_name_tenant(raw, str(exc))}") from None
    if (why := _lease_problem(config.scheduler)) is not None:
        raise ConfigError(f"config file {where}: {why}")
    return config


def _lease_problem(s: SchedulerConfig) -> str | None:
    """A node's lease must run out, and its jobs be killed, before the daemon
    gives them to another node (node_lost_after_s = 0 gives them at once: no lease can)."""
    if s.node_lease_s is None or s.node_lease_s == 0 or s.node_lost_after_s <= 0:
        return None
    if s.node_lease_s < 0:
        return f"node_lease_s = {s.node_lease_s:g} must be 0 (no lease) or more"
    margin = lease_margin_s(s.node_lost_after_s)
    if lease_terms(s) == (0.0, 0.0):
        return (f"node_lease_s = {s.node_lease_s:g} must be below node_lost_after_s = {s.node_lost_after_s:g} "
                f"less a margin of {margin:g} s (clock rates, the exchange in flight): "
                f"under {max(s.node_lost_after_s - margin, 0):g}, or 0 for no lease")
    return None


def plain_tenants(config: FileConfig) -> dict[str, Tenant]:
    """The tenants as the core records them."""
    return {name: t.plain() for name, t in config.tenants.items()}


def _name_tenant(raw: dict[str, Any], error: str) -> str:
    """msgspec says ``$.tenants[...]``: name the tenant instead."""
    if "$.tenants[...]" not in error:
        return error
    for name, body in (raw.get("tenants") or {}).items():
        try:
            msgspec.convert(body, TenantConfig)
        except msgspec.ValidationError:
            return error.replace("$.tenants[...]", f"[tenants.{name}]")
    return error
