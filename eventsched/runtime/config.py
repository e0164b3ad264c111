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
from eventsched.domain.messages import SchedulerConfig
from eventsched.domain.paths import default_socket, default_state_dir
from eventsched.domain.tenants import Tenant, TenantConfig, TenantError, check_tenants
from eventsched.domain.units import UnitError, parse_duration


class ConfigError(Exception):
    """One line naming the file and what is wrong in it."""


class ConnectionLimits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Fair use of the control socket: how many connections, and how much
    unread reply data the daemon holds for them before it stops reading or
    hangs up."""

    # connections of one uid (root and the daemon's user are not counted)
    max_per_user: Annotated[int, msgspec.Meta(ge=1)] = 64
    # every connection; lowered at start to fit the daemon's open-file limit
    max_total: Annotated[int, msgspec.Meta(ge=1)] = 4096
    # replies and events written but not yet read by one uid's connections:
    # a connection that would push it past this is closed (one reply of any
    # size is let through when nothing else of that user is waiting)
    max_unread_bytes_per_user: Annotated[int, msgspec.Meta(ge=1 << 16)] = 32 << 20
    # requests of one uid (all its connections) handed to the engine and not
    # yet answered: beyond this its connections are not read until some are
    # answered, so a flood waits behind itself, not in front of other users
    max_requests_in_flight_per_user: Annotated[int, msgspec.Meta(ge=1)] = 64


class JobLimits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Limits the daemon enforces on the host, not the scheduler: written
    under ``[scheduler]`` in the file, kept out of the recorded
    scheduler settings because no decision depends on them."""

    # a job's program or script, resolved, must lie under one of these ([]: anywhere)
    allowed_script_paths: list[str] = []
    # host memory per job, enforced by the kernel (0: no limit)
    max_host_mem_mib: Annotated[int, msgspec.Meta(ge=0)] = 0


# keys of [scheduler] that belong to JobLimits
JOB_LIMIT_KEYS = ("allowed_script_paths", "max_host_mem_mib")


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


SAMPLE = """\
# eventsched configuration (TOML). Every key is optional.
# Command-line options of `eventsched serve` override what is set here.

gpus = "fake:4:24576"          # omit to use the real GPUs through NVML
policy = "best-fit"            # fifo, priority, best-fit, fair-share, sjf-backfill, fgd
sample_interval_s = 2.0        # seconds between GPU samples

[scheduler]
default_time_limit_s = 86400   # global time limit for every job
kill_grace_s = 10.0            # SIGTERM, then SIGKILL after this long
max_queued = 10000             # submissions beyond this are refused
max_running = 0                # 0 = no limit on concurrent jobs
max_gpu_memory_used_pct = 95.0 # skip GPUs fuller than this
max_gpu_utilization_pct = 100.0
max_gpu_temperature_c = 85.0   # thermal-aware: skip hotter GPUs
retry_backoff_s = 2.0          # first retry delay, doubled each time
max_queued_per_user = 20000    # one user's waiting jobs beyond this are refused
# teams (docs/fair-share.md): score = priority + aging x hours waited + fair share
aging_per_hour = 0.1           # priority points a waiting job gains per hour
fair_share_weight = 10.0       # points of the fair-share factor (policy fair-share)
usage_half_life_s = 86400.0    # recent use fades by half in this long
reserve_for_gang = true        # hold GPUs for a blocked multi-GPU job at the head
reserve_after_s = 30.0         # ... once it has waited this long
preemption = true              # --preemptible jobs may be stopped for more urgent ones
preempt_grace_s = 30           # warning signal, then this long, then SIGKILL; then requeued
preempt_protect_s = 600        # a job preempted once then runs at least this long
# GPU memory and idle jobs (docs/gpu-memory-and-idle.md)
gpu_mem_policy = "warn"        # a job over its --gpu-mem: "warn", or "stop" (signal, kill, failed)
idle_utilization_pct = 5.0     # a job whose GPUs are all at most this busy ...
idle_after_s = 1800            # ... this long is idle (0: not looked for)
idle_policy = "off"            # "off", "requeue" or "stop" an idle job when a waiting job could use it
node_lost_after_s = 60         # several machines: a node gone this long loses its jobs; back sooner, re-adopted
# host limits, enforced by the kernel
# allowed_script_paths = ["/data3/", "/home/"]   # a job's script or program must lie here
# max_host_mem_mib = 32768     # per job (cgroup v2, cgroup v1 as root, else RLIMIT_AS)

# [tenants.vision]             # quotas are ceilings on what runs at once
# users = ["alice", "bob"]
# gpus = 4                     # GPUs (sum of shares)
# gpu_mem_mib = 160000
# jobs = 20
# weight = 2.0                 # fair share among tenants
# preemptible = true           # its jobs over its fair share may be preempted

[limits]                       # what a non-operator may ask for (root and the daemon's user are exempt from the priority ceiling)
max_user_priority = 100        # --priority within [-100, 100]
max_retries = 100
max_time_limit_s = 31622400    # one year
max_command_bytes = 65536
max_env_bytes = 262144         # environment plus --env-setup

[connections]                  # fair use of the socket (root and the daemon's user are exempt from the per-user limit)
max_per_user = 64              # connections held by one user at once
max_total = 4096               # all connections; lowered to fit the open-file limit
max_unread_bytes_per_user = 33554432  # replies a user's clients leave unread before one is cut off
max_requests_in_flight_per_user = 64  # one user's requests being answered at once; the rest wait unread
"""


def sample_config() -> str:
    return SAMPLE


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Everything ``eventsched serve`` runs with, built once by ``serve_config``."""

    state_dir: Path
    socket: Path
    file: FileConfig  # the config file, with --gpus, --policy, --time-limit and --sample-interval applied
    log_level: str = "info"
    ray: str | None = None  # a Ray cluster's address: its nodes run the jobs
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
    if getattr(args, "time_limit", None):
        try:
            scheduler = msgspec.structs.replace(scheduler, default_time_limit_s=parse_duration(args.time_limit))
        except UnitError as exc:
            raise ConfigError(str(exc)) from None
    if scheduler.policy in REPLAY_ONLY:
        raise ConfigError(f"{scheduler.policy} is a reference for replays only: {REPLAY_ONLY[scheduler.policy]}")
    if scheduler.policy not in POLICIES:
        live = ", ".join(p for p in POLICIES if p not in REPLAY_ONLY)
        raise ConfigError(f"unknown policy {scheduler.policy!r}; choose one of {live}")
    file = msgspec.structs.replace(file, scheduler=scheduler, gpus=args.gpus or file.gpus,
                                   sample_interval_s=args.sample_interval or file.sample_interval_s)
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir()
    return ServeConfig(
        state_dir=state_dir,
        socket=Path(args.socket) if args.socket else default_socket(state_dir if args.state_dir else None),
        file=file,
        log_level=args.log_level,
        ray=getattr(args, "ray", None),
        http=getattr(args, "http", None),
        http_allow_remote=getattr(args, "http_allow_remote", False),
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
    if moved and not isinstance(raw.get("job_limits") or {}, dict):
        raise ConfigError(f"config file {where}: job_limits must be a table, like [scheduler]")
    if moved:
        raw["scheduler"] = scheduler
        raw["job_limits"] = {**(raw.get("job_limits") or {}), **moved}
    try:
        config = msgspec.convert(raw, FileConfig)
        check_tenants(plain_tenants(config))
    except (msgspec.ValidationError, TenantError) as exc:
        raise ConfigError(f"config file {where}: {_name_tenant(raw, str(exc))}") from None
    return config


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
