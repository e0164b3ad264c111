"""Per-job supervisor: starts one job, waits for it, records how it ended.

Run by the workers of a long-lived zygote (``supervisor.py --zygote
SOCK_FD``, see ``zygote``): a worker supervises one job at a time and then
waits for the next, so a launch costs neither an interpreter start-up nor,
mostly, a fork; or, as a fallback, run cold as ``python -I -S supervisor.py ATTEMPT
[READY_FD]``. It is a standalone, stdlib-only script (no ``eventsched`` imports, no ``json``, no
``subprocess``) because its start-up time is part of every job's dispatch
latency. Like conmon or containerd-shim it outlives the daemon: it runs in its
own session and talks to the daemon only through the attempt's files (plus
one line on READY_FD, if given, so a live daemon learns the pid without polling):

- reads  ``ATTEMPT.spec.json`` (or gets the same with the zygote's request):
  argv, env, cwd, uid/gid/groups (null = keep),
  cgroup (a cgroup v2 directory the job joins before exec; absent = none),
  memory_cgroup (a cgroup v1 memory directory it joins too; issue 11),
  memory_limit (how its host memory is limited, so an exit for the limit
  is told from any other: ``"oom": true`` in the exit record),
  umask and rlimits (already clamped by the daemon; clamped again here)
- appends to ``ATTEMPT`` (``jobs/ID/N``, the file whose creation by the daemon
  was the launch's commit point), one JSON object per line, each in one write:
  the pid line once the job has exec'd (with the job's cgroups, for a
  restarted daemon to clear), the exit line when it has ended. One file per
  attempt, not a directory with a file per record: on this ext4 each inode
  costs 0.06-0.3 ms of CPU (``docs/launch-path.md``)

Its own stdout/stderr are the job's log (opened by the executor for a cold
start, by the supervisor itself when forked by the zygote), so a supervisor
failure ends up where the user looks.
"""

from __future__ import (
    annotations,  # annotations stay strings: typing is never imported (start-up time)
)

import _signal as signal  # not `signal`: its enum import costs ~4 ms
import errno
import os
import sys
import time

TYPE_CHECKING = False  # mypy reads this as typing.TYPE_CHECKING; typing is never imported here
if TYPE_CHECKING:
    import socket

try:  # the C scanner behind json, without json's 7 ms import of ``re``
    import _json

    class _Ctx:
        strict = True
        object_hook = None
        object_pairs_hook = None
        parse_float = float
        parse_int = int
        parse_constant = float
        memo: dict = {}

    # typeshed wants a make_scanner as the context; C code reads these attributes off any object
    _scan = _json.make_scanner(_Ctx())  # type: ignore[arg-type]

    def _loads(text: str, /) -> dict:  # spec.json is always an object
        return _scan(text, 0)[0]

    _quote = _json.encode_basestring_ascii
except Exception:  # another interpreter: pay for the real thing
    import json

    _loads = json.loads
    _quote = json.dumps


def _proc_start_time(pid: int) -> int:
    """Field 22 of /proc/PID/stat: with the pid, names one process forever."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return 0
    # comm (field 2) may hold spaces and parentheses: split after the last ')'
    return int(data[data.rindex(b")") + 2 :].split()[19])


_own_start: list[tuple[int, int]] = []  # [(our pid, our start time)]: a worker's never changes


def _own_start_time() -> int:
    pid = os.getpid()
    if not _own_start or _own_start[0][0] != pid:  # a fork is a new process
        _own_start[:] = [(pid, _proc_start_time(pid))]
    return _own_start[0][1]


def _append_record(attempt: str, line: str) -> None:
    """One line of the attempt's record in one write (O_APPEND): a reader
    takes only whole lines, so it never sees half of one."""
    fd = os.open(attempt, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _record_exit(attempt: str, exit_code: int | None, sig: int | None, error: str = "", oom: bool = False) -> None:
    _append_record(
        attempt,
        '{"exit_code": %s, "signal": %s, "ended_at": %r, "error": %s, "oom": %s}\n'
        % (
            "null" if exit_code is None else int(exit_code),
            "null" if sig is None else int(sig),
            time.time(),
            _quote(error),
            "true" if oom else "false",
        ),
    )


def _oom_kills(path: str) -> int:
    """The kernel's count of processes killed for the memory limit of the
    cgroup at ``path`` (v2 memory.events or v1 memory.oom_control)."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            with open(os.path.join(path, name), "rb") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith(b"oom_kill "):
                return int(line.split()[1])
    return 0


# what a program prints when an allocation fails (RLIMIT_AS): Python, C++,
# glibc/strerror, CUDA, PyTorch, numpy
_ALLOCATION_FAILED = (
    b"MemoryError", b"std::bad_alloc", b"Cannot allocate memory", b"out of memory", b"Unable to allocate",
)


def _allocation_failed(log_path: str, since: int) -> bool:
    """Does the job's output since offset ``since`` end (last 4 KiB) with an
    allocation failure? Only asked of a job that failed under RLIMIT_AS."""
    try:
        fd = os.open(log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        end = os.fstat(fd).st_size
        start = max(since, end - 4096)
        tail = os.pread(fd, end - start, start) if end > start else b""
    except OSError:
        return False
    finally:
        os.close(fd)
    return any(word in tail for word in _ALLOCATION_FAILED)


def _tell(ready_fd: int, line: str, keep: bool = False) -> None:
    """Say ``line`` on ``ready_fd``, then close it unless ``keep`` (a worker's
    socket to the daemon serves every launch it is given)."""
    if ready_fd < 0:
        return
    try:
        os.write(ready_fd, line.encode())
    except OSError:  # the daemon is gone: the files say it all
        pass
    if keep:
        return
    try:
        os.close(ready_fd)
    except OSError:
        pass


def _execvpe(file: str, argv: list[str], env: dict[str, str]) -> None:
    """os.execvpe without its lazy ``import warnings``, which would fail once
    we are a user who cannot read root's Python. Searches the job's PATH."""
    if "/" in file:
        os.execve(file, argv, env)
    saved: OSError | None = None
    last: OSError = FileNotFoundError(file)
    for d in (env.get("PATH") or os.defpath).split(":"):
        try:
            os.execve(os.path.join(d or ".", file), argv, env)
        except (FileNotFoundError, NotADirectoryError) as e:
            last = e
        except OSError as e:  # e.g. EACCES: remember it, keep looking (like execvp)
            last = e
            if saved is None:
                saved = e
    raise saved if saved is not None else last


class _Failed(Exception):
    """The job could not be started; the message is for the user."""


# default in the job, whatever we did with them (ignored ones survive exec)
# (SIGQUIT too: a non-interactive shell ignores SIGINT and SIGQUIT in what it
# starts with `&`, so a daemon started so would hand both on to every job)
_JOB_DEFAULT_SIGNALS = (
    signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD,
)


def _same_identity(spec: dict) -> bool:
    """True if the job runs as we do: no uid/gid/groups to switch."""
    if spec.get("uid") is None:
        return True
    return (
        spec["uid"] == os.getuid() == os.geteuid()
        and spec["gid"] == os.getgid() == os.getegid()
        # the primary group in the supplementary list adds no permission
        and set(spec.get("groups") or []) - {spec["gid"]} == set(os.getgroups()) - {os.getgid()}
    )


def _le(a: int, b: int) -> bool:
    """a <= b for resource limits, where -1 (RLIM_INFINITY) is above all."""
    if b == -1:
        return True
    return a != -1 and a <= b


def _rlimit_changes(spec: dict) -> list[tuple[int, int, int]]:
    """[(resource, soft, hard)] the job's limits differ from ours by. The
    daemon clamped them already; clamped again (last line of defence, as root
    could raise a hard limit): never above our own hard limit, soft <= hard."""
    wanted = spec.get("rlimits") or {}
    if not wanted:
        return []
    import resource

    changes = []
    for name, pair in sorted(wanted.items()):
        res = getattr(resource, "RLIMIT_" + name.upper(), None)
        if res is None or len(pair) != 2:
            continue  # the daemon validated them: nothing unknown gets here
        soft, hard = int(pair[0]), int(pair[1])
        cur_soft, cur_hard = resource.getrlimit(res)
        if not _le(hard, cur_hard):
            hard = cur_hard
        if not _le(soft, hard):
            soft = hard
        if (soft, hard) != (cur_soft, cur_hard):
            changes.append((res, soft, hard))
    return changes


def _join_cgroup(path: str) -> None:
    """Move the calling process into the cgroup at ``path`` ("0" = ourselves)."""
    fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)


_CLONE_INTO_CGROUP = 0x200000000
_SYS_CLONE3 = 435  # the same on every architecture with the generic syscall table (x86-64 too)
_libc_handle: list = []  # [ctypes.CDLL] once loaded; the zygote loads it before forking supervisors


def _libc() -> object | None:
    if not _libc_handle:
        try:
            import ctypes

            _libc_handle.append(ctypes.CDLL(None, use_errno=True))
        except (ImportError, OSError):
            _libc_handle.append(None)
    return _libc_handle[0]


def _fork_into_cgroup(path: str) -> int | None:
    """fork(), the child born inside the cgroup at ``path`` (clone3 with
    CLONE_INTO_CGROUP, Linux 5.7+). Moving a process into a cgroup afterwards
    waits for an RCU grace period (~13 ms on an idle machine); being born
    there costs nothing. The pid (0 in the child), or None where the kernel
    or this Python cannot: then fork and join instead."""
    libc = _libc()
    if libc is None:
        return None
    import ctypes

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    # struct clone_args: flags, pidfd, child_tid, parent_tid, exit_signal,
    # stack, stack_size, tls, set_tid, set_tid_size, cgroup (all u64)
    fields = (_CLONE_INTO_CGROUP, 0, 0, 0, signal.SIGCHLD, 0, 0, 0, 0, 0, fd)
    args = b"".join(v.to_bytes(8, sys.byteorder) for v in fields)
    pid = libc.syscall(_SYS_CLONE3, ctypes.c_char_p(args), ctypes.c_size_t(len(args)))  # type: ignore[attr-defined]
    if pid == 0:
        return 0  # the child: fd is close-on-exec (and closed before exec anyway)
    os.close(fd)
    return pid if pid > 0 else None  # ENOSYS, EINVAL (old kernel), EBUSY...: fork and join


def _cgroup_procs(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs"), "rb") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _cgroup_signal(path: str, signum: int) -> None:
    for pid in _cgroup_procs(path):
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def _cgroup_populated(path: str) -> bool:
    try:
        with open(os.path.join(path, "cgroup.events"), "rb") as f:
            for line in f.read().splitlines():
                if line.startswith(b"populated "):
                    return line.split()[1] != b"0"
    except OSError:
        return False
    return bool(_cgroup_procs(path))


def _cgroup_empty(path: str, timeout_s: float = 10.0) -> None:
    """Kill everything left in the job's cgroup and wait (bounded) until it
    is empty, so the GPUs are free when the exit is recorded."""
    if not _cgroup_populated(path):  # most jobs leave nothing behind: nothing to kill
        return
    try:
        fd = os.open(os.path.join(path, "cgroup.kill"), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"1")
            kill = False
        finally:
            os.close(fd)
    except OSError:  # before Linux 5.14: one pid at a time
        kill = True
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while _cgroup_populated(path) and time.monotonic() < deadline:
        if kill:
            _cgroup_signal(path, signal.SIGKILL)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _cgroup_remove(path: str, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() >= deadline:
                return  # the daemon tries again when it sees us gone
        time.sleep(0.01)


def _spawn(spec: dict) -> int:
    """Start the job with posix_spawn (glibc: vfork + exec, so nothing of
    our memory is copied: a fork of a Python process costs milliseconds of
    page faults). Only for jobs that run as we do, with no cgroup to join
    and no resource limit to change. Returns its pid."""
    cwd = spec.get("cwd") or "/"
    try:
        os.chdir(cwd)  # ours, then inherited; same identity, same permissions
    except OSError as e:
        raise _Failed("cannot change to directory %s: %s" % (cwd, e.strerror))
    if spec.get("umask", -1) >= 0:
        os.umask(spec["umask"])  # ours too: it only narrows our own files' modes
    argv, env = spec["argv"], spec["env"]
    argv0 = argv[0]
    paths = _exec_paths(argv0, env)
    saved: OSError | None = None
    last: OSError = FileNotFoundError(argv0)
    for path in paths:
        try:
            return os.posix_spawn(path, argv, env, setsid=True, setsigdef=_JOB_DEFAULT_SIGNALS)
        except (FileNotFoundError, NotADirectoryError) as e:
            last = e
        except OSError as e:  # e.g. EACCES: remember it, keep looking (like execvp)
            last = e
            if saved is None:
                saved = e
        except Exception as e:  # noqa: BLE001 - e.g. a NUL byte in an argument
            raise _Failed("cannot execute %s: %s: %s" % (argv0, type(e).__name__, e))
    err = saved if saved is not None else last
    if isinstance(err, FileNotFoundError) and "/" not in argv0:
        raise _Failed("command not found: %s" % argv0)
    raise _Failed("cannot execute %s: %s" % (argv0, err.strerror or err))


def _child(spec: dict, errw: int, switch: bool, limits: list[tuple[int, int, int]], joined: bool = False) -> None:
    """In the forked child: join the job's cgroup, take the submitter's umask
    and limits, switch identity (if ``switch``), become the job. Never returns.

    Everything here runs as the supervisor, before the job's first
    instruction: the cgroup is joined before anything else can happen, so
    every process the job ever starts is born inside it."""
    doing = "start the job"
    argv0 = spec["argv"][0]
    try:
        for s in _JOB_DEFAULT_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        os.setsid()  # its own session and process group: pgid == pid
        if spec.get("cgroup") and not joined:  # else born there (_fork_into_cgroup)
            doing = "join cgroup %s" % spec["cgroup"]
            _join_cgroup(spec["cgroup"])
        if spec.get("memory_cgroup"):  # cgroup v1 (hybrid host): its memory limit
            doing = "join cgroup %s" % spec["memory_cgroup"]
            _join_cgroup(spec["memory_cgroup"])
        # keep 0-2 (/dev/null, log, log) and the exec-error pipe (CLOEXEC)
        os.closerange(3, errw)
        os.closerange(errw + 1, 1 << 20)
        if spec.get("umask", -1) >= 0:
            os.umask(spec["umask"])
        if limits:
            import resource

            doing = "set resource limits"
            for res, soft, hard in limits:  # before setuid: lowers, never raises
                resource.setrlimit(res, (soft, hard))
        if switch and spec.get("uid") is not None:
            doing = "switch to uid %s gid %s" % (spec["uid"], spec["gid"])
            # groups first, uid last: once uid changes we may not change groups
            os.setgroups(spec.get("groups") or [])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        cwd = spec.get("cwd") or "/"
        doing = "change to directory %s" % cwd
        os.chdir(cwd)  # as the user, so permissions apply
        doing = "execute %s" % argv0
        _execvpe(argv0, spec["argv"], spec["env"])
    except BaseException as e:  # noqa: BLE001 - report anything, then die
        if doing.startswith("execute") and isinstance(e, FileNotFoundError) and "/" not in argv0:
            msg = "command not found: %s" % argv0
        elif isinstance(e, OSError) and e.strerror:
            msg = "cannot %s: %s" % (doing, e.strerror)
        else:
            msg = "cannot %s: %s: %s" % (doing, type(e).__name__, e)
        try:
            os.write(errw, msg.encode(errors="replace")[:1000])
        finally:
            os._exit(127)


_native_handle: list = []  # [the _spawn module, or None] once looked for


def _native() -> object | None:
    """``_spawn`` (built from _spawn.c beside us), whose spawn() starts a job
    in its cgroup without copying our memory; None where it was not built,
    has no spawn() on this architecture, or EVENTSCHED_SPAWN=fork asks for
    the fork path. Loaded by path: ``-I`` keeps our directory off sys.path."""
    if not _native_handle:
        module = None
        if os.environ.get("EVENTSCHED_SPAWN", "") != "fork":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            try:
                import _spawn  # type: ignore[import-not-found]

                module = _spawn if hasattr(_spawn, "spawn") else None
            except ImportError:
                pass
            finally:
                del sys.path[0]
        _native_handle.append(module)
    return _native_handle[0]


def _exec_paths(argv0: str, env: dict[str, str]) -> list[str]:
    """Where execvp would look for ``argv0``: itself, or each of the job's PATH."""
    if "/" in argv0:
        return [argv0]
    return [os.path.join(d or ".", argv0) for d in (env.get("PATH") or os.defpath).split(":")]


def _native_spawn(native: object, spec: dict, switch: bool, limits: list[tuple[int, int, int]]) -> int | None:
    """_fork_exec's work done by _spawn.spawn: the same steps, the same
    messages, no copy of our memory. Returns the job's pid once it has exec'd,
    or None where clone3 itself failed (the caller forks instead)."""
    argv, env = spec["argv"], spec["env"]
    argv0 = argv[0]
    try:
        envp = []
        for key, value in env.items():
            if not key or "=" in key:
                raise ValueError("illegal environment variable name")
            envp.append(os.fsencode(key + "=" + value))
        paths = [os.fsencode(p) for p in _exec_paths(argv0, env)]
        args = [os.fsencode(a) for a in argv]
        cwd = os.fsencode(spec.get("cwd") or "/")
    except (ValueError, TypeError) as e:  # e.g. a NUL byte in an argument
        raise _Failed("cannot execute %s: %s: %s" % (argv0, type(e).__name__, e))
    memcg = spec.get("memory_cgroup") or ""
    identity = (spec["uid"], spec["gid"], spec.get("groups") or []) if switch and spec.get("uid") is not None else None
    fd = -1
    if spec.get("cgroup"):
        try:
            fd = os.open(spec["cgroup"], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise _Failed("cannot join cgroup %s: %s" % (spec["cgroup"], e.strerror))
    try:
        pid, step, err = native.spawn(  # type: ignore[attr-defined]
            paths, args, envp, fd, os.fsencode(os.path.join(memcg, "cgroup.procs")) if memcg else None,
            cwd, spec.get("umask", -1), _JOB_DEFAULT_SIGNALS, limits, identity,
        )
    except OSError as e:  # clone3 itself: no process was made
        if e.errno in (errno.ENOSYS, errno.EINVAL, errno.E2BIG):  # a kernel before 5.7: never again
            _native_handle[:] = [None]
        return None  # the fork path says what is wrong, if anything is
    finally:
        if fd >= 0:
            os.close(fd)
    if pid > 0:
        return pid
    if step == "execute" and err == errno.ENOENT and "/" not in argv0:
        raise _Failed("command not found: %s" % argv0)
    # worded as _child words them
    doing = {
        "join memory cgroup": "join cgroup %s" % memcg,
        "set resource limits": "set resource limits",
        "switch identity": "switch to uid %s gid %s" % (spec.get("uid"), spec.get("gid")),
        "change directory": "change to directory %s" % (spec.get("cwd") or "/"),
        "execute": "execute %s" % argv0,
    }.get(step, "start the job")  # signals, setsid, descriptors, umask
    raise _Failed("cannot %s: %s" % (doing, os.strerror(err)))


def _fork_exec(spec: dict, switch: bool, limits: list[tuple[int, int, int]]) -> int:
    """Start the job in a forked child that joins its cgroup, sets its
    limits and switches identity (if ``switch``: root daemon, job of another
    user) first. Returns its pid once it has exec'd."""
    native = _native()
    if native is not None:
        pid = _native_spawn(native, spec, switch, limits)
        if pid is not None:
            return pid
    errr, errw = os.pipe2(os.O_CLOEXEC)
    born = _fork_into_cgroup(spec["cgroup"]) if spec.get("cgroup") else None
    try:
        pid = os.fork() if born is None else born
    except OSError as e:
        os.close(errr)
        os.close(errw)
        raise _Failed("cannot fork: %s" % e.strerror)
    if pid == 0:
        _child(spec, errw, switch, limits, joined=born is not None)
    os.close(errw)
    chunks = []
    while True:  # EOF when exec succeeded (CLOEXEC), else the child's reason
        chunk = os.read(errr, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(errr)
    if chunks:
        os.waitpid(pid, 0)
        raise _Failed(b"".join(chunks).decode(errors="replace"))
    return pid


def _supervise(
    attempt: str, ready_fd: int, prefix: str, open_log: bool, plan: bytes = b"", keep_ready: bool = False
) -> int:
    """Be the supervisor of the job whose attempt file is ``attempt``: start it, say so on
    ``ready_fd`` (lines start with ``prefix``; closed after, unless
    ``keep_ready``), wait, record its end. ``plan``: the spec, sent with the
    zygote's request (else spec.json)."""
    # The daemon's terminal and its death must not reach us (we are its shim).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    job_pid = [0]
    cgroup = [""]

    def forward(signum: int, frame: object) -> None:  # stopping the supervisor stops its job
        if cgroup[0] and _cgroup_procs(cgroup[0]):  # all of it, even what left its group
            _cgroup_signal(cgroup[0], signum)
        elif job_pid[0]:
            try:
                os.killpg(job_pid[0], signum)
            except OSError:
                pass

    signal.signal(signal.SIGTERM, forward)

    if ready_fd >= 0:  # the job must not inherit it
        os.set_inheritable(ready_fd, False)
    attempt = os.path.abspath(attempt)  # _spawn changes our directory
    if not plan:
        with open(attempt + ".spec.json", "rb") as f:
            plan = f.read()
    spec = _loads(plan.decode())
    if open_log:  # our stdout/stderr become the job's log, as in a cold start
        # created here, as the daemon does for a cold start: 0600, and the
        # job's user owns it (the job writes its own log as itself)
        log = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        if spec.get("uid") is not None and os.geteuid() == 0:
            os.fchown(log, spec["uid"], spec["gid"])
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)

    try:  # where this attempt's output starts in the log (for _allocation_failed)
        log_start = os.fstat(1).st_size
    except OSError:
        log_start = 0
    try:
        same = _same_identity(spec)
        limits = _rlimit_changes(spec)
        if same and not spec.get("cgroup") and not spec.get("memory_cgroup") and not limits:
            pid = _spawn(spec)
        else:
            pid = _fork_exec(spec, not same, limits)
    except _Failed as e:
        for key in ("cgroup", "memory_cgroup"):  # the child that joined it is reaped: it is empty
            if spec.get(key):
                _cgroup_remove(spec[key], 0.5)
        error = str(e).replace("\n", " ")
        _record_exit(attempt, 127, None, error)
        _tell(ready_fd, "%serror %s\n" % (prefix, error), keep_ready)
        return 0
    job_pid[0] = pid
    cgroup[0] = spec.get("cgroup") or ""
    memcg = spec.get("memory_cgroup") or ""
    mode = spec.get("memory_limit") or ""
    # the cgroup whose oom_kill count tells a kill for the memory limit
    oom_cgroup = memcg if mode == "cgroup1" else cgroup[0] if mode == "cgroup2" else ""

    start_time = _proc_start_time(pid)
    # with the cgroups, which a restarted daemon clears if we die (spec.json
    # may not exist: the zygote passes the plan in its request)
    _append_record(
        attempt,
        '{"pid": %d, "start_time": %d, "supervisor_pid": %d, "supervisor_start_time": %d,'
        ' "started_at": %r, "cgroup": %s, "memory_cgroup": %s}\n'
        % (pid, start_time, os.getpid(), _own_start_time(), time.time(), _quote(cgroup[0]), _quote(memcg)),
    )
    _tell(ready_fd, "%sok %d %d\n" % (prefix, pid, start_time), keep_ready)

    # Wait without reaping, so the zombie keeps its pid (and pgid) reserved
    # while we kill what the job left behind in its process group, and in
    # its cgroup (which holds even what left the group: setsid, setpgid).
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    if cgroup[0]:
        _cgroup_empty(cgroup[0])
    elif memcg:  # no cgroup v2: what is left in the v1 one goes too
        _cgroup_signal(memcg, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    oom = False
    if code != 0 and oom_cgroup:
        oom = _oom_kills(oom_cgroup) > 0
    elif code != 0 and mode == "rlimit-as":
        oom = _allocation_failed(spec.get("log") or "", log_start)
    if cgroup[0]:
        _cgroup_remove(cgroup[0])
    if memcg:
        _cgroup_remove(memcg)
    if code < 0:
        _record_exit(attempt, None, -code, oom=oom)
    else:
        _record_exit(attempt, code, None, oom=oom)
    return 0


def _noop(signum: int, frame: object) -> None:
    pass


# idle workers kept for the next launches; one more that falls idle exits
_IDLE_WORKERS = 16


def zygote(sock_fd: int) -> int:
    """Hand each launch to a supervisor worker, so a launch costs neither an
    interpreter start-up nor, most of the time, a fork. ``sock_fd`` is a
    SOCK_SEQPACKET socket to the daemon; one message each way per event:

    - daemon -> us:    ``TOKEN ATTEMPT`` (then NUL and the plan, if it fits)
    - worker -> daemon: ``TOKEN forked WORKER_PID`` with the read end of a
      pipe (SCM_RIGHTS) that turns readable (EOF) once the worker is done
      with this launch: the exit recorded, or the worker dead;
    - worker -> daemon: ``TOKEN ok PID START`` or ``TOKEN error REASON``.

    A worker (``_worker``) is a child of ours that supervises one job at a
    time and then waits for the next launch; we fork one when none is idle.
    A fresh fork costs the copies of every page the supervisor writes
    (~0.6k page faults, ~1 ms); a worker pays them once.

    EOF from the daemon (it stopped or died) ends us: idle workers read EOF
    and exit; busy ones finish supervising their job, record its end, and
    exit then, as a one-job supervisor would.
    """
    import gc
    import select
    import socket

    try:
        os.setsid()
    except OSError:
        pass
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _libc()  # loaded once here: every worker forked from us starts jobs with clone3 at no import cost
    _native()
    sock = socket.socket(fileno=sock_fd)
    # SIGCHLD only wakes the loop: reaping happens there
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, _noop)
    poller = select.poll()
    poller.register(sock_fd, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    workers: dict[int, tuple[socket.socket, int]] = {}  # fd of our end of its socket -> (that end, its pid)
    idle: list[socket.socket] = []  # the workers waiting for a launch
    holding: dict[int, str] = {}  # fd of a busy worker -> the token of the launch it was given

    def drop(w: socket.socket) -> None:  # closing our end makes it exit once idle
        token = holding.pop(w.fileno(), None)
        if token is not None:  # it died with a launch: if it never answered, this is the answer
            _send(sock, "%s error the supervisor died before starting the job" % token)
        workers.pop(w.fileno(), None)
        poller.unregister(w.fileno())
        if w in idle:
            idle.remove(w)
        w.close()

    def end() -> int:
        """The daemon is gone: idle workers exit now (reaped here, so their
        CPU time is counted); busy ones once their job has ended."""
        waiting = [workers[w.fileno()][1] for w in idle]
        for w, _ in list(workers.values()):
            w.close()
        deadline = time.monotonic() + 1.0
        while waiting and time.monotonic() < deadline:
            try:
                if os.waitpid(waiting[-1], os.WNOHANG)[0]:
                    waiting.pop()
                else:
                    time.sleep(0.001)
            except ChildProcessError:
                waiting.pop()
        return 0

    # what exists now is never collected: forked workers do not copy the
    # pages a collection would write to
    gc.freeze()
    while True:
        # workers first: one that said "idle" before its last job's end was
        # seen (and the next launch sent) takes that launch, rather than a fork
        for fd, _ in sorted(poller.poll(), key=lambda event: event[0] == sock_fd):
            if fd == wake_r:
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                _reap()
                continue
            if fd != sock_fd:  # a worker is idle again, or gone
                if fd not in workers:
                    continue
                w = workers[fd][0]
                try:
                    said = w.recv(16)
                except BlockingIOError:
                    continue
                except OSError:
                    said = b""
                if said:
                    holding.pop(fd, None)
                if said and len(idle) < _IDLE_WORKERS:
                    idle.append(w)
                else:
                    drop(w)
                continue
            try:
                request = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                return end()
            if not request:
                return end()  # the daemon is gone: the busy workers run on
            token = request.partition(b" ")[0].decode(errors="replace")
            while idle:
                w = idle.pop()
                try:
                    w.send(request)
                    holding[w.fileno()] = token
                    break
                except OSError:  # it died idle: the next one
                    drop(w)
            else:
                fd = _fork_worker(sock, request, workers, poller, wake_r, wake_w)
                if fd >= 0:
                    holding[fd] = token


def _fork_worker(
    sock: socket.socket, request: bytes, workers: dict, poller: object, wake_r: int, wake_w: int
) -> int:
    """Fork a worker for ``request`` (it stays for the next ones); the fd of
    our end of its socket, -1 if it could not be forked (the daemon is told)."""
    import select
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = os.fork()
    except OSError as e:
        ours.close()
        theirs.close()
        token = request.partition(b" ")[0].decode(errors="replace")
        _send(sock, "%s error cannot fork: %s" % (token, e.strerror))
        return -1
    if pid == 0:
        code = 127
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wake_r)
            os.close(wake_w)
            ours.close()
            for other, _ in workers.values():  # else a sibling would not see the zygote's EOF
                other.close()
            os.setsid()  # its own session: the zygote's end is not its
            code = _worker(sock, theirs, request)
        finally:
            os._exit(code)
    theirs.close()
    ours.setblocking(False)
    workers[ours.fileno()] = (ours, pid)
    poller.register(ours.fileno(), select.POLLIN)  # type: ignore[attr-defined]
    return ours.fileno()


def _worker(sock: socket.socket, zygote_sock: socket.socket, request: bytes) -> int:
    """Supervise one job per request, then ask ``zygote_sock`` for the next.
    EOF there (the zygote is gone: the daemon stopped or died) ends us."""
    umask = os.umask(0o077)
    os.umask(umask)
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    while request:
        head, _, plan = request.partition(b"\0")  # the plan, if sent with the request
        token, _, attempt = head.decode(errors="surrogateescape").partition(" ")
        # readable (EOF) for the daemon once this launch is done with, or we die
        done_r, done_w = os.pipe2(os.O_CLOEXEC)
        _send(sock, "%s forked %d" % (token, os.getpid()), done_r)
        os.close(done_r)
        try:
            _supervise(attempt, sock.fileno(), token + " ", True, plan, keep_ready=True)
        except BaseException as e:  # noqa: BLE001 - tell, then die
            try:
                _record_exit(attempt, 127, None, "supervisor failed: %s" % e)
            except BaseException:  # noqa: BLE001
                pass
            _tell(sock.fileno(), "%s error supervisor failed: %s\n" % (token, e))
            return 127
        try:
            # before the daemon learns the job ended, so that its next launch
            # finds us idle (it waits in our socket while we tidy up)
            zygote_sock.send(b"idle")
        except OSError:
            return 0
        finally:
            os.close(done_w)
        # back as the zygote made us: nothing of that job's stays
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir("/")
        os.umask(umask)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            request = zygote_sock.recv(65536)
        except OSError:
            return 0
    return 0


def _send(sock: socket.socket, text: str, fd: int = -1) -> None:
    import socket

    try:
        if fd >= 0:
            socket.send_fds(sock, [text.encode()], [fd])
        else:
            sock.send(text.encode())
    except OSError:  # the daemon is gone: the next recv says so
        pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str]) -> int:
    if argv[1] == "--zygote":
        return zygote(int(argv[2]))
    try:
        os.setsid()  # detach from the daemon's session (if Popen did not)
    except OSError:
        pass
    return _supervise(argv[1], int(argv[2]) if len(argv) > 2 else -1, "", False)


if __name__ == "__main__":
    # _exit: nothing to flush, and interpreter teardown would delay the
    # moment the daemon's pidfd sees us go (~1-4 ms)
    os._exit(main(sys.argv))
