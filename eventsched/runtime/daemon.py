"""``eventsched serve``: wire the engine, the socket and the signals together."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from eventsched.domain.settings import SettingsError
from eventsched.domain.states import IllegalTransition
from eventsched.domain.text import print_error
from eventsched.runtime.config import ServeConfig, plain_tenants
from eventsched.storage import log as eventlog

if TYPE_CHECKING:
    from eventsched.runtime.gpus import GpuBackend
    from eventsched.runtime.ports import Executor


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for journald or jq."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class SetupError(Exception):
    """What stops the daemon before it starts (a bad --gpus, no Ray, a port in use): one line."""


# --log-file rotates at this size and keeps this many old files (as `serve --help` says)
LOG_FILE_BYTES = 10 * 1024 * 1024
LOG_FILE_BACKUPS = 5


class PrivateRotatingFile(RotatingFileHandler):
    """Rotated by size, each new file created 0640: the log names users, jobs and paths."""

    def _open(self) -> Any:
        return open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors,
                    opener=lambda path, flags: os.open(path, flags, 0o640))


def log_handler(log_file: Path | None) -> logging.Handler:
    """JSON lines to ``log_file`` (rotated), else to stderr (journald's)."""
    try:
        handler = logging.StreamHandler(sys.stderr) if log_file is None else PrivateRotatingFile(
            log_file, maxBytes=LOG_FILE_BYTES, backupCount=LOG_FILE_BACKUPS, encoding="utf-8")
    except OSError as exc:
        raise SetupError(f"--log-file {log_file}: {exc.strerror}") from None
    handler.setFormatter(JsonFormatter())
    return handler


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (systemd's 1,024 is a
    handful of users' connections); (before, after)."""
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


def serve(config: ServeConfig) -> int:
    try:
        logging.basicConfig(level=config.log_level.upper(), handlers=[log_handler(config.log_file)])
        _refuse_live_socket(config.socket)
        backend = _gpus(config)
        http_plan = None
        if config.http:  # checked and bound before the daemon starts
            from eventsched.runtime.api.http_api import HttpSetupError, prepare

            try:
                http_plan = prepare(config.http, allow_remote=config.http_allow_remote)
            except HttpSetupError as exc:
                raise SetupError(str(exc)) from None
    except SetupError as exc:
        print_error(str(exc))
        return 2
    try:
        anyio.run(_serve, config, backend, http_plan)
    except BaseException as exc:  # task groups wrap what their tasks raised
        message = why_it_stopped(exc, config.state_dir)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2
    finally:
        if backend is not None:  # NVML's event set and handle go with the daemon, as NVML asks
            backend.close()
    return 0


def _refuse_live_socket(socket: Path) -> None:
    """A daemon that answers on ``socket`` keeps it; only a stale one (nothing answers) is taken over."""
    from eventsched.wire.client import Client, ClientError

    try:
        with Client(socket, timeout=5.0) as client:
            info = client.ping()
    except (ClientError, OSError):
        return  # none there, or stale: nothing answers, so serve() takes it over
    raise SetupError(f"{socket}: another daemon answers on this socket (pid {info['pid']}, "
                     f"state dir {info.get('state_dir', '?')}); stop it or give --socket another path")


def _gpus(config: ServeConfig) -> GpuBackend | None:
    """This machine's GPUs; None on a Ray cluster, connected now (its nodes
    run the jobs, ``--gpus`` being each node's)."""
    from eventsched.runtime.gpus import NvmlUnavailable, parse_gpus_option

    gpus, node = config.file.gpus, config.file.scheduler.node
    try:
        if not config.ray:
            return parse_gpus_option(gpus, node=node)
        if gpus and gpus.strip() != "nvml":
            parse_gpus_option(gpus, node=node)  # a bad value: said now, not by each node
    except NvmlUnavailable as exc:
        raise SetupError(str(exc)) from None
    except ValueError as exc:
        raise SetupError(f"--gpus: {exc}") from None
    from eventsched.runtime.cluster import ray_cluster

    try:
        ray_cluster.connect(config.ray, ray_cluster.namespace_for(config.state_dir))
    except ray_cluster.RayUnavailable as exc:
        raise SetupError(str(exc)) from None
    return None


def _executor(config: ServeConfig, backend: GpuBackend | None) -> tuple[GpuBackend, Executor]:
    """The executor (and on a Ray cluster, the GPU backend that samples its nodes)."""
    from eventsched.runtime.engine import prepare_state_dir
    from eventsched.runtime.launch.executor import Executor as LocalExecutor

    prepare_state_dir(config.state_dir)  # before the executor makes jobs/ in it
    node = config.file.scheduler.node
    local = LocalExecutor(config.state_dir, node=node, max_host_mem_mib=config.file.job_limits.max_host_mem_mib)
    if backend is not None:
        return backend, local
    from eventsched.runtime.cluster.ray_cluster import RayExecutor, RayGpus, namespace_for

    assert config.ray is not None
    ray = RayExecutor(local, gpus=config.file.gpus or "", namespace=namespace_for(config.state_dir))
    return RayGpus(ray, node, config.ray), ray


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def why_it_stopped(exc: BaseException, state_dir: Path) -> str | None:
    """What a task of the daemon raised (wrapped in exception groups), as a
    paragraph a user can act on; None for a bug, to let it show."""
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


async def _serve(config: ServeConfig, gpus: GpuBackend | None, http_plan: Any) -> None:
    from eventsched.runtime.api.server import Server
    from eventsched.runtime.engine import Engine

    log = logging.getLogger("eventsched.daemon")
    before, after = raise_open_file_limit()
    log.info("open-file limit %d (soft limit was %d)", after, before)
    file = config.file
    backend, executor = _executor(config, gpus)
    engine = Engine(config.state_dir, file.scheduler, backend, executor=executor, sample_interval_s=file.sample_interval_s,
                    tenants=plain_tenants(file) if file.tenants else None)
    server = Server(engine, config.socket, limits=file.limits, connections=file.connections, job_limits=file.job_limits,
                    reservations=file.reservations, wait_nodes=config.wait_nodes)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        await tg.start(server.serve)
        if file.jobs_file:  # the daemon follows a jobs file itself, as its owner
            from eventsched.runtime.api.jobs_follower import follow_jobs_file

            await tg.start(follow_jobs_file, server, file.jobs_file)
        if config.metrics_port is not None:
            from eventsched.runtime.api.metrics_http import read_metrics, serve_metrics

            await tg.start(serve_metrics, config.metrics_host, config.metrics_port, lambda: read_metrics(engine))
            log.info("Prometheus metrics on http://%s:%d/metrics", config.metrics_host, config.metrics_port)
        if http_plan is not None:
            from eventsched.runtime.api.http_api import serve_http

            await tg.start(serve_http, server, http_plan)
        log.info("serving on %s, state in %s, policy %s, gpus %s, pid %d",
                 config.socket, config.state_dir, file.scheduler.policy, backend.name, os.getpid())
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s: stopping; running jobs keep running", signal.Signals(signum).name)
                await engine.stop(reason=signal.Signals(signum).name)
                tg.cancel_scope.cancel()
                break
