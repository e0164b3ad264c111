"""Launch, signal and reap job processes: the daemon's end (docs/launch-path.md).

Each job runs under its own supervisor (``supervisor.py``), forked by a
zygote, in its own session: it outlives the daemon, like conmon. They share
only the zygote's socket and the job's files in ``jobs/``: ``<job>.<attempt>``
(created with O_EXCL, the commit point, then a JSON record per line: the pid,
then the exit), ``<job>.log`` and, for a plan too big for a message,
``<job>.<attempt>.spec.json``. Exits are noticed without polling; ``recover``
re-adopts supervisors by pidfd after a restart. Where cgroup v2 can be managed
(``cgroups.py``) each attempt is born in its own cgroup; elsewhere jobs are
contained by their process group only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import shlex
import signal as _signal
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from eventsched.domain import rlimits as _rl
from eventsched.domain.events import JobSpec
from eventsched.domain.paths import DEFAULT_PATH
from eventsched.domain.messages import Message, NeverLaunched, ProcessExited, ProcessLost, ProcessStarted
from eventsched.runtime.launch import cgroups as _cg
from eventsched.runtime.launch import sessions as _sessions
from eventsched.runtime.launch.plan import Plan, append_record, encode
from eventsched.runtime.launch.zygote import INLINE_SPEC_BYTES, Zygote

__all__ = ["Executor", "LaunchError", "AlreadyLaunched", "rewrite_cuda", "job_argv", "job_env"]

_READY_TIMEOUT_S = 60.0  # a supervisor that says nothing for this long is broken
_log = logging.getLogger("eventsched.executor")
# an async method run in the executor's task group (anyio wants a coroutine function)
_TaskFn = Callable[..., Coroutine[Any, Any, None]]


class LaunchError(Exception):
    """The job could not be started; ``str(e)`` is a one-line reason."""


class AlreadyLaunched(LaunchError):
    """This (job, attempt) was launched before: it is never launched twice."""


def rewrite_cuda(argv: list[str], gpu_ids: list[int]) -> list[str]:
    """Replace the value of ``--cuda X`` / ``--cuda=X`` with the assigned
    physical ids (the seed scheduler's contract: scripts copy it into
    ``CUDA_VISIBLE_DEVICES``). CPU-only jobs are left alone."""
    if not gpu_ids:
        return list(argv)
    ids, out = _visible(gpu_ids), list(argv)
    for i in range(1, len(out)):
        if out[i] == "--cuda" and i + 1 < len(out):
            out[i + 1] = ids
        elif out[i].startswith("--cuda="):
            out[i] = "--cuda=" + ids
    return out


def _visible(gpu_ids: list[int]) -> str:
    return ",".join(str(g) for g in gpu_ids)


def job_argv(spec: JobSpec, gpu_ids: list[int], *, job: int = 0, log_path: str = "") -> list[str]:
    """The argv to exec: the command itself, or ``bash -c`` only for conda,
    env_setup or a shell command line; for a ``--session`` job, the waiter
    that runs that inside the session (it appends its output to ``log_path``)."""
    argv = _plain_argv(spec, gpu_ids)
    if spec.session:
        return _sessions.session_argv(spec.session, job, argv, log_path or "/dev/null")
    return argv


def _plain_argv(spec: JobSpec, gpu_ids: list[int]) -> list[str]:
    command = rewrite_cuda(spec.command, gpu_ids)
    if not (spec.conda or spec.env_setup or spec.shell):
        return command
    lines: list[str] = []
    fail = '|| { rc=$?; echo "eventsched: environment set-up failed (exit $rc)" >&2; exit $rc; }'
    if spec.conda:
        lines.append(
            '{ __base="$("${CONDA_EXE:-conda}" info --base)" && '
            'source "$__base/etc/profile.d/conda.sh" && '
            f"conda activate {shlex.quote(spec.conda)}; }} {fail}"
        )
    if spec.env_setup:
        # braces, not a subshell: the set-up must change *this* shell's env
        lines.append("{\n" + spec.env_setup + "\n} " + fail)
    # the set-up must not move the job off its GPUs
    lines.append(f"export CUDA_VISIBLE_DEVICES={shlex.quote(_visible(gpu_ids))}")
    # spec.shell: the user asked for a shell command line; otherwise exec argv
    lines.append(" ".join(command) if spec.shell else "exec " + shlex.join(command))
    return ["bash", "-c", "\n".join(lines), f"eventsched-job-{spec.name or 'job'}"]


def job_env(job: int, spec: JobSpec, gpu_ids: list[int], *, home: str = "", user: str = "") -> dict[str, str]:
    """The job's environment: the submitter's, plus what the scheduler owes it."""
    env = dict(spec.env)
    env.setdefault("PATH", DEFAULT_PATH)
    if user:  # running as another user: identity variables must be theirs
        env["USER"] = env["LOGNAME"] = user
    if home:
        env["HOME"] = home
    env["CUDA_VISIBLE_DEVICES"] = _visible(gpu_ids)  # "" hides every GPU
    # NVML numbers GPUs by PCI bus; CUDA's default order may differ
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["EVENTSCHED_JOB_ID"] = str(job)
    if spec.array_index >= 0:  # an --array task
        env["EVENTSCHED_ARRAY_ID"], env["EVENTSCHED_ARRAY_INDEX"] = str(spec.array_id), str(spec.array_index)
    return env


def _read_records(attempt_path: Path) -> tuple[dict | None, dict | None]:
    """(pid record, exit record) of an attempt, each None until written."""
    try:
        data = attempt_path.read_bytes()
    except FileNotFoundError:
        return None, None
    started = ended = None
    for line in data.split(b"\n")[:-1]:  # whole lines only: the last may be half-written
        try:
            record = msgspec.json.decode(line, type=dict)
        except msgspec.DecodeError:  # also a line that is not an object
            continue
        if started is None and "pid" in record:
            started = record
        elif ended is None and "exit_code" in record:
            ended = record
    return started, ended


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, session id, start time) of a live or zombie process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[3]), int(fields[19])


class _Creds(msgspec.Struct, frozen=True):
    uid: int
    gid: int
    groups: list[int]
    home: str
    user: str


_PASSWD_TTL_S = 10.0  # an NSS lookup per launch cost more than the launch's mkdirs
_nss_cache: dict[tuple[Any, ...], tuple[float, Any]] = {}


def _nss(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` (None on KeyError: no such user), remembered for
    ``_PASSWD_TTL_S``: a sweep launches many jobs of one user."""
    now, key = time.monotonic(), (fn, *args)
    hit = _nss_cache.get(key)
    if hit is not None and hit[0] > now:
        return hit[1]
    try:
        value = fn(*args)
    except KeyError:
        value = None
    if len(_nss_cache) > 4096:
        _nss_cache.clear()
    _nss_cache[key] = (now + _PASSWD_TTL_S, value)
    return value


def _credentials(spec: JobSpec, by_name: str = "") -> _Creds | None:
    """Whom to run as; None: as the daemon (not root, or a spec without an
    owner, which only in-process callers can build). ``by_name``: this node's
    name, where the user is looked up by name."""
    if os.geteuid() != 0 or spec.uid < 0:
        return None
    if by_name:
        return _named_credentials(spec.user, by_name)
    pw: pwd.struct_passwd | None = _nss(pwd.getpwuid, spec.uid)
    if pw is None and spec.gid < 0:
        raise LaunchError(f"unknown user id {spec.uid} and no group id given")
    gid = spec.gid if spec.gid >= 0 else pw.pw_gid  # type: ignore[union-attr]
    if spec.groups:
        groups = list(spec.groups)
    elif pw is not None:
        groups = list(_nss(os.getgrouplist, pw.pw_name, gid))
    else:
        groups = [gid]
    home = spec.home or (pw.pw_dir if pw else "/")
    return _Creds(spec.uid, gid, groups, home, pw.pw_name if pw else str(spec.uid))


def _named_credentials(user: str, node: str) -> _Creds:
    """The user of that name as this machine knows them: uids, groups and
    homes differ between machines, so nothing the head saw is taken."""
    pw: pwd.struct_passwd | None = _nss(pwd.getpwnam, user) if user else None
    if pw is None:
        raise LaunchError(f"node {node} has no user {user or '(unnamed)'}")
    groups = list(_nss(os.getgrouplist, pw.pw_name, pw.pw_gid))
    return _Creds(pw.pw_uid, pw.pw_gid, groups, pw.pw_dir, pw.pw_name)


class _Watch:
    """A supervisor the executor waits on (launched here or adopted)."""

    __slots__ = ("job", "attempt_path", "pgid", "pidfd", "report", "ended", "cgroup", "memcg", "of_job", "_event")

    def __init__(self, job: int, attempt_path: Path, pgid: int, pidfd: int, *, cgroup: str = "", memcg: str = ""):
        self.job, self.attempt_path = job, attempt_path
        self.pgid = pgid  # the job's pid == its process group == its session
        self.pidfd = pidfd  # readable once the exit is recorded: its worker's pipe, or an adopted supervisor's pidfd
        self.report, self.ended = True, False  # report False: a stray's end, not the job's
        self.cgroup = cgroup  # the job's cgroup v2 directory; "" = none
        self.memcg = memcg  # its cgroup v1 memory directory (host memory limit); "" = none
        # pidfd is the job's own (no pipe came from its worker): its exit is
        # recorded a moment after it turns readable, by a worker that lives on
        self.of_job = False
        self._event: anyio.Event | None = None  # made lazily: recover() runs outside a loop

    def event(self) -> anyio.Event:
        if self._event is None:
            self._event = anyio.Event()
            if self.ended:
                self._event.set()
        return self._event

    def set_ended(self) -> None:
        self.ended = True
        self.event().set()


def _job_cgroup(started: dict, key: str = "cgroup") -> str:
    """The cgroup (or ``memory_cgroup``) an attempt's pid record names, or "":
    only ever a job's own, since it is killed and removed by path."""
    cg = started.get(key)
    return cg if isinstance(cg, str) and os.path.basename(cg).startswith("job-") else ""


def _write_spec(attempt_path: Path, data: bytes) -> None:
    """0o600: the environment may hold the user's secrets."""
    path = attempt_path.with_name(attempt_path.name + ".spec.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _remove_cgroups(*paths: str) -> None:
    for path in paths:
        if path:
            _cg.remove(path)


class Executor:
    # the engine may fork a snapshot writer (runtime/snapshot_child.py)
    fork_safe = True

    def __init__(
        self, state_dir: Path, *, node: str = "local", python: str = sys.executable, zygote: bool = True,
        cgroups: bool = True, max_host_mem_mib: int = 0, resolve_user_by_name: bool = False,
    ):
        self.node = node
        # a remote node: the submitter is found by name in its own passwd and group
        self._by_name = resolve_user_by_name
        self.jobs_dir = Path(state_dir) / "jobs"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        # 0o711: other users may reach their own log by path, never list jobs
        os.chmod(self.jobs_dir, 0o711 if os.geteuid() == 0 else 0o700)
        self._python = python
        self._watched: dict[int, _Watch] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._pending: list[tuple[_TaskFn, tuple[object, ...]]] = []
        self._send: Callable[[Message], Awaitable[None]] | None = None
        # one zygote forks the supervisors while ``run`` is active; else one per launch
        self._use_zygote = zygote
        self._zygote: Zygote | None = None
        # each job in its own cgroup where we can make one
        self._cgroups: _cg.Cgroups | None = None
        if cgroups:
            self._cgroups, why = _cg.Cgroups.setup(state_dir)
            if self._cgroups is None:
                _log.warning("%s: jobs that leave their process group escape cancel", why)
            else:
                _log.info("jobs run in their own cgroups under %s", self._cgroups.parent)
            # EVENTSCHED_MEMORY_LIMIT = cgroup2 | cgroup1 | rlimit-as picks one, if available
            forced = os.environ.get("EVENTSCHED_MEMORY_LIMIT", "")
            self.host_memory, why = _cg.HostMemory.setup(state_dir, self._cgroups, forced=forced)
        else:
            self.host_memory, why = _cg.HostMemory("rlimit-as"), "RLIMIT_AS set before exec (cgroups off)"
        _log.info("host memory limits: %s: %s", self.host_memory.mode, why)
        # the daemon's [scheduler] max_host_mem_mib: the limit of jobs that ask for none
        self.max_host_mem_mib = max_host_mem_mib

    @property
    def memory_limit(self) -> str:
        """``cgroup2``, ``cgroup1`` or ``rlimit-as``."""
        return self.host_memory.mode

    def host_mem_limit_mib(self, spec: JobSpec) -> int:
        """A job's own host memory limit, never above the daemon's maximum;
        else the maximum (0: none)."""
        top, own = self.max_host_mem_mib, spec.host_mem_mib
        if own > 0:
            return min(own, top) if top > 0 else own
        return top

    @property
    def containment(self) -> str:
        """``cgroup2:<parent dir>`` or ``process-group``."""
        return self._cgroups.containment if self._cgroups else "process-group"

    def lease_ages(self) -> dict[str, float]:
        return {}  # no other node holds a lease from this one

    def log_path(self, job: int) -> Path:
        return self.jobs_dir / f"{job}.log"

    def _attempt_path(self, job: int, attempt: int) -> Path:
        return self.jobs_dir / f"{job}.{attempt}"

    def _attempts(self) -> dict[int, list[int]]:
        """{job: its attempts} on this disk."""
        out: dict[int, list[int]] = {}
        with contextlib.suppress(OSError):
            for name in os.listdir(self.jobs_dir):
                job, _, attempt = name.partition(".")
                if job.isdecimal() and attempt.isdecimal():
                    out.setdefault(int(job), []).append(int(attempt))
        return out

    async def launch(
        self, job: int, spec: JobSpec, gpu_ids: list[int], *, attempt: int = 0, node: str | None = None
    ) -> ProcessStarted:
        """Start the job; return once it has exec'd. A second launch of the
        same ``attempt`` raises ``AlreadyLaunched``. ``node``: where the job
        was placed; only this executor's own runs here."""
        if node is not None and node != self.node:
            raise LaunchError(f"job {job} is placed on node {node}; this machine is {self.node}")
        if not spec.command:
            raise LaunchError("empty command")
        try:  # the submitter's limits, never above ours (the server validated them too)
            _rl.validate(spec.rlimits, spec.umask)
            limits = _rl.clamp(spec.rlimits)
        except _rl.RlimitError as e:
            raise LaunchError(str(e)) from None
        creds = _credentials(spec, self.node if self._by_name else "")
        attempt_path = self._attempt_path(job, attempt)
        try:  # the commit point: the one inode a launch creates before its job runs
            os.close(os.open(attempt_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        except FileExistsError:
            raise AlreadyLaunched(f"job {job} (attempt {attempt}) was already launched") from None
        except OSError as e:
            raise LaunchError(f"cannot create {attempt_path}: {e.strerror}") from None

        cgroup = ""
        if self._cgroups is not None:
            try:
                cgroup = self._cgroups.create(job, attempt)
            except OSError as e:
                _log.warning("job %d: cannot create its cgroup (%s): contained by its process group only", job, e)
        memory_mib = self.host_mem_limit_mib(spec)
        memory_mode, memcg = "", ""
        if memory_mib > 0:
            memory_mode = self.host_memory.mode
            try:
                memcg = self.host_memory.create(job, attempt, cgroup, memory_mib)
            except OSError as e:
                _log.warning("job %d: cannot limit its memory by cgroup (%s): RLIMIT_AS instead", job, e)
                memory_mode = "rlimit-as"
            if memory_mode == "rlimit-as":
                cap = memory_mib * _cg.MIB
                soft, hard = limits.get("as", [-1, -1])
                limits["as"] = [cap if soft == -1 else min(soft, cap), cap if hard == -1 else min(hard, cap)]
        log_path = self.log_path(job)
        plan = Plan(
            argv=job_argv(spec, gpu_ids, job=job, log_path=os.path.abspath(log_path)),
            env=job_env(job, spec, gpu_ids, home=creds.home if creds else spec.home, user=creds.user if creds else ""),
            cwd=spec.cwd or "/",
            log=os.path.abspath(log_path),  # supervisors run in /
            uid=creds.uid if creds else -1,
            gid=creds.gid if creds else -1,
            groups=creds.groups if creds else None,
            umask=spec.umask,
            rlimits=limits,
            cgroup=cgroup,
            memory_cgroup=memcg,
            memory_limit=memory_mode,
            open_log=bool(spec.session),  # the session writes it by path
        )
        try:
            answer, done_fd = await self._hand_over(attempt_path, encode(plan))
        except OSError as e:
            reason = f"cannot start the supervisor: {e.strerror or e}"
            _remove_cgroups(cgroup, memcg)
            # recorded like a supervisor would, so a restart reads "launch-failed"
            with contextlib.suppress(OSError):
                append_record(str(attempt_path), exit_code=127, signal=None, error=reason)
            raise LaunchError(reason) from None
        words = answer.split(" ", 1)
        if words[0] == "ok":
            pid, start_time = (int(x) for x in words[1].split())
            w = _Watch(job, attempt_path, pid, done_fd, cgroup=cgroup, memcg=memcg)
            if done_fd < 0:
                # No pipe came with the answer (out of descriptors: the kernel
                # drops it). Its worker lives on after the job: watch the job.
                w.pidfd, w.of_job = _open_pidfd(pid, start_time), True
            self._watch(w)
            return ProcessStarted(job=job, pid=pid, start_time=start_time, log_path=str(log_path))
        if done_fd >= 0:
            os.close(done_fd)
        _remove_cgroups(cgroup, memcg)  # the job never ran in them
        if words[0] == "error":
            raise LaunchError(words[1] if len(words) > 1 else "unknown error")
        raise LaunchError(f"the supervisor stopped before starting the job (see {log_path})")

    async def _hand_over(self, attempt_path: Path, data: bytes) -> tuple[str, int]:
        """Give the launch to the long-lived zygote while ``run`` is active
        (restarted if it died), else to one for this launch alone. Returns the
        supervisor's answer ("" if none came) and the fd that turns readable
        once its worker is done with the launch (-1 if none came)."""
        inline = len(data) <= INLINE_SPEC_BYTES
        if not inline:
            _write_spec(attempt_path, data)
        keep = self._use_zygote and self._tg is not None
        for _ in range(2):
            z = self._zygote if keep else None
            if z is None or not z.alive():
                if z is not None:
                    z.retire()
                z = Zygote(self._python)
                if keep:
                    self._zygote = z
            handed = z.submit(attempt_path, data if inline else None)
            if handed is not None:
                break
            z.retire()  # it took nothing: safe to hand over again
        else:
            raise OSError(errno.EPIPE, "the zygote took no launch")
        # Shielded: once a supervisor runs, we must learn its pid even if
        # the engine is being cancelled, or the job would go unwatched.
        with anyio.CancelScope(shield=True), anyio.move_on_after(_READY_TIMEOUT_S):
            await z.wait(*handed)
        if not keep:
            z.retire()
        return handed[1].result, handed[1].pidfd

    async def signal(self, job: int, grace_s: float, signum: int = 0) -> None:
        """SIGTERM (or ``signum``: a preempted job's ``--signal``) every
        process of the job now; SIGKILL them after ``grace_s`` unless the job
        has ended by then. Returns at once."""
        w = self._watched.get(job)
        if w is None or w.pgid <= 0:
            return  # not running here (ended, or never started): nothing to stop
        self._terminate(w, signum or _signal.SIGTERM, grace_s)

    def _terminate(self, w: _Watch, sig: int, grace_s: float) -> None:
        # once each: a second SIGTERM can land inside the job's handler for the first
        if not (w.cgroup and _cg.signal_all(w.cgroup, sig)):
            _killpg(w.pgid, sig)
        self._spawn(self._kill_after, w, grace_s)

    async def _kill_after(self, w: _Watch, grace_s: float) -> None:
        with anyio.move_on_after(max(0.0, grace_s)):
            await w.event().wait()
        if not w.ended:
            if w.cgroup:
                await anyio.to_thread.run_sync(_cg.kill_all, w.cgroup)
            _killpg(w.pgid, _signal.SIGKILL)

    def recover(self, running: dict[int, tuple[int, int]], attempts: dict[int, int] | None = None) -> list[Message]:
        """At start-up, for each job the log believes placed or running
        (``{job: (pid, start_time)}``, pid 0 = never recorded as started):
        report how it ended, re-adopt it, or say it was never launched.
        ``attempts``: each job's current attempt (else its latest on disk), so an
        earlier attempt's exit is never taken for the current one's."""
        out: list[Message] = []
        attempts = dict(attempts or {})
        if running.keys() - attempts.keys():  # the latest on disk
            attempts.update((job, max(tries)) for job, tries in self._attempts().items() if job not in attempts)
        for job, (known_pid, _start) in sorted(running.items()):
            attempt_path = self._attempt_path(job, attempts.get(job, -1))
            if job not in attempts or not os.path.lexists(attempt_path):
                out.append(NeverLaunched(job=job, reason="the daemon stopped before launching it"))
                continue
            started, ended = _read_records(attempt_path)
            if ended is None and started is not None:
                w = self._adopt(job, attempt_path, started)
                if w is not None:
                    if known_pid == 0:
                        out.append(self._started(job, started))
                    self._watch(w)
                    continue
                ended = _read_records(attempt_path)[1]  # it may have just finished
            if ended is not None:
                if started is not None and known_pid == 0:
                    out.append(self._started(job, started))
                out.append(_exited(job, ended))
            elif started is not None:
                _clear_cgroups(started)
                reason = f"supervisor gone without recording an exit (job pid {started['pid']})"
                out.append(ProcessLost(job=job, reason=reason))
            else:
                out.append(ProcessLost(job=job, reason="supervisor gone before starting the job"))
        self._sweep_cgroups()
        return out

    def live_attempts(self) -> list[tuple[int, int, int]]:
        """(job, attempt, job pid) of every attempt on this disk whose supervisor
        is alive without an exit record."""
        out: list[tuple[int, int, int]] = []
        for job, tries in sorted(self._attempts().items()):
            for attempt in sorted(tries):
                w = self._adopt_live(job, attempt)
                if w is not None:
                    os.close(w.pidfd)
                    out.append((job, attempt, w.pgid))
        return out

    async def kill_attempt(self, job: int, attempt: int, grace_s: float) -> int:
        """Stop a stray attempt as ``signal`` does, and wait (a little longer)
        for its supervisor to end; its exit is not reported. Returns the job's
        pid, 0 when it was not alive."""
        w = self._adopt_live(job, attempt)
        if w is None:
            return 0
        w.report = False  # a stray's end is not the job's: nothing to count
        self._watch(w)
        self._terminate(w, _signal.SIGTERM, grace_s)
        with anyio.move_on_after(grace_s + 10.0):
            await w.event().wait()
        return w.pgid

    def _sweep_cgroups(self) -> None:
        """Remove the empty cgroups of attempts whose supervisors were killed
        while we were down (rmdir fails on a populated one: nothing is killed)."""
        parents = [self._cgroups.parent] if self._cgroups is not None else []
        if self.host_memory.mode == "cgroup1":
            parents.append(self.host_memory.parent)
        ours = {w.cgroup for w in self._watched.values()} | {w.memcg for w in self._watched.values()}
        for parent in parents:
            try:
                names = os.listdir(parent)
            except OSError:
                continue
            for name in names:
                path = os.path.join(parent, name)
                if name.startswith("job-") and path not in ours:
                    _cg.remove(path)

    def _started(self, job: int, started: dict) -> ProcessStarted:
        log = str(self.log_path(job))
        return ProcessStarted(job=job, pid=started["pid"], start_time=started["start_time"], log_path=log)

    def _adopt_live(self, job: int, attempt: int) -> _Watch | None:
        """An attempt whose supervisor is alive without an exit record, adopted; else None."""
        attempt_path = self._attempt_path(job, attempt)
        started, ended = _read_records(attempt_path)
        if started is None or ended is not None:
            return None
        return self._adopt(job, attempt_path, started)

    def _adopt(self, job: int, attempt_path: Path, started: dict) -> _Watch | None:
        pidfd = _open_pidfd(started["supervisor_pid"], started["supervisor_start_time"], live=True)
        if pidfd < 0:
            return None
        cgroup, memcg = _job_cgroup(started), _job_cgroup(started, "memory_cgroup")
        return _Watch(job, attempt_path, started["pid"], pidfd, cgroup=cgroup, memcg=memcg)

    async def run(
        self, send: Callable[[Message], Awaitable[None]], *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Report ``ProcessExited`` for every launched or adopted job as it
        ends. While it runs, launches go to one long-lived zygote."""
        async with anyio.create_task_group() as tg:
            self._tg, self._send = tg, send
            if self._use_zygote and self._zygote is None:
                with contextlib.suppress(OSError):  # else the first launch tries again
                    self._zygote = Zygote(self._python)
            try:
                pending, self._pending = self._pending, []
                for fn, args in pending:
                    tg.start_soon(fn, *args)
                task_status.started()
                await anyio.sleep_forever()
            finally:
                self._tg = None
                if self._zygote is not None:
                    # EOF ends it; the supervisors it forked run on
                    self._zygote.retire()
                    self._zygote = None
                if self._cgroups is not None:  # stays while any job's cgroup does
                    self._cgroups.remove_parent()
                self.host_memory.remove_parent()

    def _spawn(self, fn: _TaskFn, *args: object) -> None:
        if self._tg is None:
            self._pending.append((fn, args))
        else:
            self._tg.start_soon(fn, *args)

    def _watch(self, w: _Watch) -> None:
        if w.report:
            self._watched[w.job] = w
        self._spawn(self._wait_exit, w)

    async def _wait_exit(self, w: _Watch) -> None:
        if w.pidfd >= 0:  # -1: it was gone before we could watch it
            try:
                await anyio.wait_readable(w.pidfd)  # the supervisor exited, or its worker is done with it
            finally:
                os.close(w.pidfd)
        ended = _read_records(w.attempt_path)[1]
        if w.of_job:
            ended = await _exit_record(w.attempt_path, ended)
        for cg in (w.cgroup, w.memcg):  # the supervisor removes them, unless killed
            if cg and os.path.isdir(cg):
                await anyio.to_thread.run_sync(_clear, cg, ended is None)
        w.set_ended()
        if not w.report:
            return
        if self._watched.get(w.job) is w:
            del self._watched[w.job]
        assert self._send is not None
        reason = f"supervisor killed without recording an exit (job pid {w.pgid})"
        await self._send(ProcessLost(job=w.job, reason=reason) if ended is None else _exited(w.job, ended))

    def running_jobs(self) -> dict[int, int]:
        """{job: pid} of the jobs being watched."""
        return {j: w.pgid for j, w in self._watched.items() if w.pgid > 0}

    def job_process_ids(self) -> set[int]:
        return set(self.job_processes())

    def job_processes(self) -> dict[int, int]:
        """{pid: job} of every process of a watched job, in its cgroup or its session."""
        sessions = {w.pgid: j for j, w in self._watched.items() if w.pgid > 0}
        pids: dict[int, int] = {}
        for j, w in self._watched.items():  # also what left the session
            if w.cgroup:
                pids.update(dict.fromkeys(_cg.procs(w.cgroup), j))
        if not sessions:
            return pids
        for name in os.listdir("/proc"):
            if name.isdigit():
                stat = _proc_stat(int(name))
                if stat is not None and stat[1] in sessions:
                    pids.setdefault(int(name), sessions[stat[1]])
        return pids


def _open_pidfd(pid: int, start_time: int, live: bool = False) -> int:
    """A pidfd of the process ``pid`` started at ``start_time`` (``live``: and
    not a zombie); -1 if it is gone already, or none can be opened."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return -1
    stat = _proc_stat(pid)  # after opening: if it matches now, the pidfd is it
    if stat is None or stat[2] != start_time or (live and stat[0] in ("Z", "X")):
        os.close(fd)
        return -1
    return fd


async def _exit_record(attempt_path: Path, ended: dict | None) -> dict | None:
    """The exit record of a job watched by its own pidfd, once its worker has
    written it (it empties the job's cgroup first: up to ~10 s)."""
    started = _read_records(attempt_path)[0] or {}
    deadline = anyio.current_time() + 30.0
    while ended is None and anyio.current_time() < deadline:
        stat = _proc_stat(int(started.get("pid", 0))) if started else None
        if stat is not None and stat[2] == started.get("start_time") and stat[0] != "Z":
            deadline = anyio.current_time() + 30.0  # still running (it had no pidfd): no hurry
            await anyio.sleep(0.05)
        else:
            await anyio.sleep(0.01)
        ended = _read_records(attempt_path)[1]
    return ended


def _exited(job: int, ended: dict) -> ProcessExited:
    error = ended.get("error") or ""
    reason = f"launch-failed: {error}" if error else ""
    # the supervisor saw the kernel kill it for its limit (or, under
    # RLIMIT_AS, an allocation failure end it): not a bare signal 9
    if not reason and ended.get("oom") and ended.get("exit_code") != 0:
        reason = "host memory limit"
    return ProcessExited(job=job, exit_code=ended.get("exit_code"), signal=ended.get("signal"), reason=reason)


def _clear(cgroup: str, kill: bool) -> None:
    """Remove a job's cgroup once its supervisor is gone; ``kill``: what is
    left in it first (a supervisor killed before it could)."""
    if kill:
        _cg.kill_all(cgroup)
    _cg.remove(cgroup, timeout_s=2.0 if kill else 0.0)


def _clear_cgroups(started: dict) -> None:
    """The supervisor is gone without recording an exit: whatever is left of
    the job must not keep its GPUs once it is reported lost."""
    for cg in (_job_cgroup(started), _job_cgroup(started, "memory_cgroup")):
        if cg and os.path.isdir(cg):
            _clear(cg, True)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone
