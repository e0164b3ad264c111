"""``eventsched serve``: wire the engine, the socket and the signals together."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from eventsched.core.tenants_report import tenants_report
from eventsched.domain.paths import default_socket, default_state_dir
from eventsched.domain.settings import SettingsError
from eventsched.domain.states import IllegalTransition
from eventsched.domain.units import UnitError, parse_duration
from eventsched.runtime.config import (
    ConfigError,
    ServeConfig,
    load_config,
    plain_tenants,
)
from eventsched.storage import log as eventlog

if TYPE_CHECKING:
    from eventsched.runtime.gpus import GpuBackend


class JsonFormatter(logging.Formatter):
    """One JSON object per line (SPEC I7), for journald or jq."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _fail(message: str) -> int:
    print(f"eventsched: error: {message}", file=sys.stderr)
    return 2


def resolve(args: argparse.Namespace) -> tuple[ServeConfig, Path, Path]:
    config = load_config(args.config)
    scheduler = config.scheduler
    if args.policy:
        scheduler = msgspec.structs.replace(scheduler, policy=args.policy)
    elif config.policy:
        scheduler = msgspec.structs.replace(scheduler, policy=config.policy)
    if getattr(args, "time_limit", None):

        scheduler = msgspec.structs.replace(scheduler, default_time_limit_s=parse_duration(args.time_limit))
    config = msgspec.structs.replace(
        config,
        scheduler=scheduler,
        gpus=args.gpus or config.gpus,
        sample_interval_s=args.sample_interval or config.sample_interval_s,
    )
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir()
    socket_path = Path(args.socket) if args.socket else default_socket(state_dir if args.state_dir else None)
    return config, state_dir, socket_path


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (systemd's default soft
    limit of 1,024 is a handful of users' worth of connections); returns
    (before, after)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


def serve(args: argparse.Namespace) -> int:
    from eventsched.core.policies import POLICIES, REPLAY_ONLY
    from eventsched.runtime.gpus import NvmlUnavailable, parse_gpus_option

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    from eventsched import _compiled

    if stale := _compiled.stale():  # a checkout edited since its build: say which code runs
        logging.getLogger("eventsched.daemon").warning(
            "compiled modules are older than their sources (%s): the old code runs until scripts/setup.sh "
            "rebuilds them (or serve with EVENTSCHED_PURE=1)", ", ".join(stale))
    try:
        config, state_dir, socket_path = resolve(args)
    except (ConfigError, UnitError) as exc:
        return _fail(str(exc))
    if config.scheduler.policy not in POLICIES or config.scheduler.policy in REPLAY_ONLY:
        if config.scheduler.policy in REPLAY_ONLY:
            return _fail(f"{config.scheduler.policy} is a reference for replays only: {REPLAY_ONLY[config.scheduler.policy]}")
        live = ", ".join(p for p in POLICIES if p not in REPLAY_ONLY)
        return _fail(f"unknown policy {config.scheduler.policy!r}; choose one of {live}")
    try:
        if getattr(args, "ray", None):  # issue 12: --gpus is each node's; the daemon's own node has none
            from eventsched.runtime.cluster import ray_cluster

            if config.gpus and config.gpus.strip() != "nvml":
                parse_gpus_option(config.gpus, node=config.scheduler.node)  # a bad value: said now
            try:
                ray_cluster.connect(args.ray, ray_cluster.namespace_for(state_dir))
            except ray_cluster.RayUnavailable as exc:
                return _fail(str(exc))
            backend: GpuBackend = ray_cluster.RayGpus(None, config.scheduler.node, args.ray)
        else:
            backend = parse_gpus_option(config.gpus, node=config.scheduler.node)
    except NvmlUnavailable as exc:
        return _fail(str(exc))
    except ValueError as exc:
        return _fail(f"--gpus: {exc}")
    args.http_plan = None
    if getattr(args, "http", None):  # issue 12: checked and bound before the daemon starts
        from eventsched.runtime.api.http_api import HttpSetupError, prepare

        try:
            args.http_plan = prepare(args.http, allow_remote=getattr(args, "http_allow_remote", False))
        except HttpSetupError as exc:
            return _fail(str(exc))
    try:
        anyio.run(_serve, config, state_dir, socket_path, backend, args)
    except BaseException as exc:  # task groups wrap what their tasks raised
        message = why_it_stopped(exc, state_dir)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2
    return 0


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def why_it_stopped(exc: BaseException, state_dir: Path) -> str | None:
    """One paragraph for an error a user can act on (None: a bug, let it show).

    Whatever a task of the daemon raised reaches here wrapped in an
    ExceptionGroup; the user sees what is wrong, where, and what to do."""
    for leaf in _leaves(exc):
        if isinstance(leaf, eventlog.LogLockedError):
            return f"eventsched: error: {leaf}: another daemon is using {state_dir}"
        if isinstance(leaf, eventlog.LogCorruptError):
            return (
                f"eventsched: error: the event log is damaged, so the daemon did not start.\n  {leaf}.\n"
                f"  Nothing has been dropped or changed: the log stays as it is until you run the repair,\n"
                f"  which keeps the damaged bytes aside; then start the daemon again."
            )
        if isinstance(leaf, eventlog.LogError):
            return f"eventsched: error: {leaf}"
        if isinstance(leaf, SettingsError):
            return f"eventsched: error: {state_dir / 'log'}: {leaf}"
        if isinstance(leaf, IllegalTransition):
            return (f"eventsched: error: the log in {state_dir / 'log'} contradicts itself ({leaf}); "
                    f"check it with `eventsched log verify {state_dir / 'log'}`")
        if isinstance(leaf, PermissionError):
            return f"eventsched: error: {leaf.filename or state_dir}: permission denied (run the daemon as the owner of {state_dir})"
        if isinstance(leaf, OSError) and leaf.errno is not None:
            return f"eventsched: error: {leaf.filename or state_dir}: {leaf.strerror}"
    return None


async def _serve(config: ServeConfig, state_dir: Path, socket_path: Path, backend: GpuBackend, args: argparse.Namespace) -> None:
    from eventsched.runtime.engine import Engine, Query
    from eventsched.runtime.api.server import Server, status

    log = logging.getLogger("eventsched.daemon")
    before, after = raise_open_file_limit()
    log.info("open-file limit %d (soft limit was %d)", after, before)
    engine = Engine(state_dir, config.scheduler, backend, sample_interval_s=config.sample_interval_s,
                    tenants=plain_tenants(config) if config.tenants else None)
    if getattr(args, "ray", None):  # issue 12: the nodes of a Ray cluster run the jobs
        from eventsched.runtime.cluster.ray_cluster import RayExecutor, RayGpus, namespace_for

        engine.executor = RayExecutor(state_dir, node=config.scheduler.node, gpus=config.gpus or "",
                                      state=lambda: engine.state, namespace=namespace_for(state_dir))
        if isinstance(backend, RayGpus):
            backend.executor = engine.executor
    engine.executor.max_host_mem_mib = config.job_limits.max_host_mem_mib  # issue 11: the default limit
    server = Server(engine, socket_path, limits=config.limits, connections=config.connections, job_limits=config.job_limits)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        await tg.start(server.serve)
        if config.jobs_file:  # I2: the daemon follows a jobs file itself, as its owner
            from eventsched.runtime.api.jobs_follower import follow_jobs_file

            await tg.start(follow_jobs_file, server, config.jobs_file)
        if args.metrics_port is not None:
            from eventsched.runtime.api.metrics_http import serve_metrics

            await tg.start(serve_metrics, args.metrics_host, args.metrics_port, state_dir, lambda: engine.call(Query(lambda st: {**status(st), "tenants": tenants_report(st, engine.clock())})))
            log.info("Prometheus metrics on http://%s:%d/metrics", args.metrics_host, args.metrics_port)
        if getattr(args, "http_plan", None) is not None:  # issue 12: the JSON API (http_api.py)
            from eventsched.runtime.api.http_api import serve_http

            await tg.start(serve_http, server, args.http_plan)
        log.info(
            "serving on %s, state in %s, policy %s, gpus %s, pid %d",
            socket_path, state_dir, config.scheduler.policy, backend.name, os.getpid(),
        )
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s: stopping; running jobs keep running", signal.Signals(signum).name)
                await engine.stop(reason=signal.Signals(signum).name)
                tg.cancel_scope.cancel()
                break
