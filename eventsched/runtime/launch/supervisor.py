"""Per-job supervisor: starts one job, waits for it, records how it ended
(docs/launch-path.md).

Run as ``python -I -S supervisor.py --zygote SOCK_FD`` (its daemon's end is
``zygote.py``), whose workers each supervise one job at a time. Stdlib-only
(besides its siblings ``plan`` and ``cgroupfs``, loaded by path) because its
start-up is part of a launch's latency. ``start(plan)`` starts a job by the C
accelerator (``_spawn.c``) where built, else by a fork and ``_child``.
"""

from __future__ import annotations  # annotations stay strings: typing is never imported (start-up time)

import _signal as signal  # not `signal` nor `socket`: their enum import costs start-up time
import _socket
import errno
import os
import sys
import time

TYPE_CHECKING = False  # mypy reads this as typing.TYPE_CHECKING; typing is never imported here
if TYPE_CHECKING:
    from types import ModuleType
    from typing import NoReturn

    from eventsched.runtime.launch import cgroupfs
    from eventsched.runtime.launch import plan as _plan
    from eventsched.runtime.launch.plan import Plan


def _sibling(name: str) -> ModuleType:
    """A module beside this file (``-I`` keeps this directory off sys.path)."""
    if __package__:
        return getattr(__import__(__package__, fromlist=[name]), name)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        return __import__(name)
    finally:
        del sys.path[0]


if not TYPE_CHECKING:
    cgroupfs, _plan = _sibling("cgroupfs"), _sibling("plan")


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


def _record_exit(attempt: str, exit_code: int | None, sig: int | None, error: str = "", oom: bool = False) -> None:
    _plan.append_record(attempt, exit_code=exit_code, signal=sig, ended_at=time.time(), error=error, oom=oom)


# what a program prints when an allocation fails (RLIMIT_AS): Python, C++,
# glibc/strerror, CUDA, PyTorch, numpy
_ALLOCATION_FAILED = (
    b"MemoryError", b"std::bad_alloc", b"Cannot allocate memory", b"out of memory", b"Unable to allocate",
)


class _Log:
    """The job's log, created (0600, the job's user's) at the first write, so
    a silent job costs no inode; ``start``: where this attempt's output begins.
    O_NOFOLLOW: a link planted at its path is never written through."""

    __slots__ = ("plan", "fd", "start")

    def __init__(self, plan: Plan) -> None:
        self.plan, self.fd, self.start = plan, -1, 0

    def open(self) -> None:
        p = self.plan
        self.fd = os.open(p.log, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        if p.uid >= 0 and os.geteuid() == 0:
            os.fchown(self.fd, p.uid, p.gid)
        self.start = os.fstat(self.fd).st_size

    def write(self, data: bytes) -> None:
        try:
            if self.fd < 0:
                self.open()
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError:  # a full disk: the job runs on, its output is lost
            pass

    def allocation_failed(self) -> bool:
        """Does this attempt's output end (last 4 KiB) with an allocation failure?"""
        try:
            end = os.fstat(self.fd).st_size
            start = max(self.start, end - 4096)
            tail = os.pread(self.fd, end - start, start) if end > start else b""
        except OSError:
            return False
        return any(word in tail for word in _ALLOCATION_FAILED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _relay(pid: int, out: int, log: _Log) -> None:
    """Copy the pipe ``out`` into the log until the job ``pid`` has ended (by
    pidfd: what it left behind may hold the pipe open), without reaping it: the
    zombie keeps the pgid reserved."""
    import select

    poller = select.poll()
    try:
        job = os.pidfd_open(pid)
    except OSError:  # no pidfd: copy until every writer is gone
        job = -1
    else:
        poller.register(job, select.POLLIN)
    poller.register(out, select.POLLIN)
    try:
        while True:
            for fd, _ in poller.poll():
                if fd == job:
                    return
                data = os.read(out, 65536)
                if data:
                    log.write(data)
                elif job < 0:
                    return
                else:  # EOF: only the job's end is left to wait for
                    poller.unregister(out)
    finally:
        if job >= 0:
            os.close(job)


def _drain(out: int, log: _Log) -> None:
    """What the job and its leftovers wrote before they were killed."""
    os.set_blocking(out, False)
    try:
        while data := os.read(out, 65536):
            log.write(data)
    except OSError:
        pass
    os.close(out)


class Failure(str):
    """Why the job could not be started: one line for the user."""


# default in the job, whatever we did with them (ignored ones survive exec)
# (SIGQUIT too: a non-interactive shell ignores SIGINT and SIGQUIT in what it
# starts with `&`, so a daemon started so would hand both on to every job)
_JOB_DEFAULT_SIGNALS = (
    signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD,
)


def _same_identity(p: Plan) -> bool:
    return p.uid < 0 or (
        p.uid == os.getuid() == os.geteuid()
        and p.gid == os.getgid() == os.getegid()
        # the primary group in the supplementary list adds no permission
        and set(p.groups) - {p.gid} == set(os.getgroups()) - {os.getgid()}
    )


def _le(a: int, b: int) -> bool:
    """a <= b for resource limits, where -1 (RLIM_INFINITY) is above all."""
    return b == -1 or (a != -1 and a <= b)


def _rlimit_changes(p: Plan) -> list[tuple[int, int, int]]:
    """[(resource, soft, hard)] the job's limits differ from ours by, clamped
    again (root could raise a hard limit): never above ours, soft <= hard."""
    if not p.rlimits:
        return []
    import resource

    changes = []
    for name, (soft, hard) in sorted(p.rlimits.items()):
        res = getattr(resource, "RLIMIT_" + name.upper(), None)
        if res is None:
            continue  # the daemon validated them: nothing unknown gets here
        cur_soft, cur_hard = resource.getrlimit(res)
        hard = hard if _le(hard, cur_hard) else cur_hard
        soft = soft if _le(soft, hard) else hard
        if (soft, hard) != (cur_soft, cur_hard):
            changes.append((res, soft, hard))
    return changes


class _Exec:
    """A plan as the kernel takes it, worked out before any child exists."""

    __slots__ = ("paths", "argv", "envp", "cwd", "limits", "identity")

    def __init__(self, p: Plan) -> None:
        self.argv = [os.fsencode(a) for a in p.argv]
        self.envp = [os.fsencode(k + "=" + v) for k, v in p.env.items()]
        self.cwd = os.fsencode(p.cwd)
        argv0 = p.argv[0]
        if "/" in argv0:
            self.paths = [self.argv[0]]
        else:  # where execvp would look: each directory of the job's PATH
            dirs = (p.env.get("PATH") or os.defpath).split(":")
            self.paths = [os.fsencode(os.path.join(d or ".", argv0)) for d in dirs]
        self.limits = _rlimit_changes(p)
        self.identity = None if _same_identity(p) else (p.uid, p.gid, p.groups)


def _prepare(p: Plan) -> _Exec | Failure:
    argv0 = p.argv[0]
    try:
        x = _Exec(p)
    except ValueError as e:  # a lone surrogate no file name can hold
        return Failure("cannot execute %s: %s" % (argv0, e))
    if any(not k or "=" in k for k in p.env):
        return Failure("cannot execute %s: illegal environment variable name" % argv0)
    if any(b"\0" in s for s in (*x.argv, *x.envp, x.cwd)):
        return Failure("cannot execute %s: embedded null byte" % argv0)
    return x


def _failure(p: Plan, step: str, err: int, detail: str = "") -> Failure:
    """The one line for a start that failed at ``step`` with errno ``err`` (0: see ``detail``)."""
    argv0 = p.argv[0]
    if step == "execute" and err == errno.ENOENT and "/" not in argv0:
        return Failure("command not found: %s" % argv0)
    doing = {
        "join cgroup": "join cgroup %s" % p.cgroup,
        "join memory cgroup": "join cgroup %s" % p.memory_cgroup,
        "set resource limits": "set resource limits",
        "switch identity": "switch to uid %d gid %d" % (p.uid, p.gid),
        "change directory": "change to directory %s" % p.cwd,
        "execute": "execute %s" % argv0,
    }.get(step, "start the job")  # signals, setsid, descriptors, umask
    return Failure("cannot %s: %s" % (doing, os.strerror(err) if err else detail))


def start(p: Plan) -> int | Failure:
    """Start the job in its own session (pgid == pid) and cgroups, with its
    umask, limits and identity, only fds 0-2 open; its pid once it has exec'd,
    else why not."""
    started = clone_start(p)
    return fork_start(p) if started is None else started


def fork_start(p: Plan) -> int | Failure:
    """``start`` in portable Python."""
    x = _prepare(p)
    if isinstance(x, Failure):
        return x
    errr, errw = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
    except OSError as e:
        os.close(errr)
        os.close(errw)
        return Failure("cannot fork: %s" % e.strerror)
    if pid == 0:
        _child(p, x, errw)
    os.close(errw)
    report = b""
    while chunk := os.read(errr, 4096):  # EOF once it has exec'd (CLOEXEC), else why not
        report += chunk
    os.close(errr)
    if not report:
        return pid
    os.waitpid(pid, 0)
    step, err, detail = report.decode(errors="replace").split("\n", 2)
    return _failure(p, step, int(err), detail)


def _child(p: Plan, x: _Exec, errw: int) -> NoReturn:
    """The forked child: the steps of ``_spawn.c``'s child, in its order, then
    exec, so every process the job starts is born in its cgroup."""
    step = "reset signals"
    try:
        for s in _JOB_DEFAULT_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        step = "setsid"
        os.setsid()
        for step, cg in (("join cgroup", p.cgroup), ("join memory cgroup", p.memory_cgroup)):
            if cg:
                cgroupfs.join(cg)
        step = "close descriptors"  # all but 0-2 and the error pipe (CLOEXEC)
        os.closerange(3, errw)
        os.closerange(errw + 1, 1 << 20)
        if p.umask >= 0:
            os.umask(p.umask)
        step = "set resource limits"
        if x.limits:
            import resource

            for res, soft, hard in x.limits:  # before setuid: lowers, never raises
                resource.setrlimit(res, (soft, hard))
        step = "switch identity"
        if x.identity is not None:  # groups first, uid last: once uid changes we may not change groups
            os.setgroups(p.groups)
            os.setgid(p.gid)
            os.setuid(p.uid)
        step = "change directory"
        os.chdir(x.cwd)  # as the user, so permissions apply
        step = "execute"
        # like execvp: ENOENT and ENOTDIR mean "look further"; another error
        # (EACCES...) is remembered and reported if nothing else runs
        saved: OSError | None = None
        last: OSError = FileNotFoundError(errno.ENOENT, "")
        for path in x.paths:
            try:
                os.execve(path, x.argv, p.env)
            except (FileNotFoundError, NotADirectoryError) as e:
                last = e
            except OSError as e:
                saved = saved or e
        raise saved or last
    except BaseException as e:  # noqa: BLE001 - report anything, then die
        err = e.errno if isinstance(e, OSError) and e.errno else 0
        try:
            os.write(errw, ("%s\n%d\n%s: %s" % (step, err, type(e).__name__, e)).encode(errors="replace")[:1000])
        finally:
            os._exit(127)


_native: list = []  # [the _spawn module, or None] once looked for


def _accelerator() -> ModuleType | None:
    """``_spawn`` where built with spawn() (x86-64 Linux), unless EVENTSCHED_SPAWN=fork."""
    if not _native:
        module = None
        if os.environ.get("EVENTSCHED_SPAWN", "") != "fork":
            try:
                module = _sibling("_spawn")
            except ImportError:
                pass
        _native.append(module if hasattr(module, "spawn") else None)
    return _native[0]


def clone_start(p: Plan) -> int | Failure | None:
    """``start`` by the C accelerator (clone3 into the job's cgroup); None
    where it is not built or the kernel cannot (then ``fork_start``)."""
    native = _accelerator()
    if native is None:
        return None
    x = _prepare(p)
    if isinstance(x, Failure):
        return x
    fd = -1
    if p.cgroup:
        try:
            fd = os.open(p.cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            return _failure(p, "join cgroup", e.errno or 0)
    memcg = os.fsencode(os.path.join(p.memory_cgroup, "cgroup.procs")) if p.memory_cgroup else None
    try:
        pid, step, err = native.spawn(
            x.paths, x.argv, x.envp, fd, memcg, x.cwd, p.umask, _JOB_DEFAULT_SIGNALS, x.limits, x.identity
        )
    except OSError as e:  # clone3 itself: no process was made
        if e.errno in (errno.ENOSYS, errno.EINVAL, errno.E2BIG):  # a kernel before 5.7: never again
            _native[:] = [None]
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    return pid if pid > 0 else _failure(p, step, err)


def _supervise(attempt: str, sock: _socket.socket, token: str, data: bytes, devnull: int) -> None:
    """Start the job of the attempt whose record is ``attempt``, answer
    ``token`` on ``sock``, copy its output, wait, record its end. ``data``:
    the plan, if sent with the request (else in spec.json)."""
    job_pid, cgroup = [0], [""]

    def forward(signum: int, frame: object) -> None:  # stopping the supervisor stops its job, all of it
        if not (cgroup[0] and cgroupfs.signal_all(cgroup[0], signum)) and job_pid[0]:
            try:
                os.killpg(job_pid[0], signum)
            except OSError:
                pass

    signal.signal(signal.SIGTERM, forward)
    if not data:
        with open(attempt + ".spec.json", "rb") as f:
            data = f.read()
    p = _plan.decode(data)
    log = _Log(p)
    try:
        if p.open_log:
            log.open()
        # the job's stdout and stderr: a pipe whose other end we hold alone once it runs
        out, w = os.pipe2(os.O_CLOEXEC)
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        pid = start(p)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        if isinstance(pid, Failure):
            os.close(out)
            for path in (p.cgroup, p.memory_cgroup):  # the child that joined it is reaped: it is empty
                if path:
                    cgroupfs.remove(path, 0.5)
            error = pid.replace("\n", " ")
            _record_exit(attempt, 127, None, error)
            _send(sock, "%s error %s" % (token, error))
            return
        job_pid[0], cgroup[0] = pid, p.cgroup
        # the cgroup whose oom_kill count tells a kill for the memory limit
        oom_cgroup = {"cgroup1": p.memory_cgroup, "cgroup2": p.cgroup}.get(p.memory_limit, "")
        start_time = _proc_start_time(pid)
        _plan.append_record(
            attempt, pid=pid, start_time=start_time, supervisor_pid=os.getpid(),
            supervisor_start_time=_own_start_time(), started_at=time.time(),
            cgroup=p.cgroup, memory_cgroup=p.memory_cgroup,
        )
        _send(sock, "%s ok %d %d" % (token, pid, start_time))
        _relay(pid, out, log)

        # Not reaped yet, so the zombie keeps its pid (and pgid) reserved
        # while we kill what the job left behind in its process group, and in
        # its cgroup (which holds even what left the group: setsid, setpgid).
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if p.cgroup:  # so the GPUs are free when the exit is recorded
            if cgroupfs.populated(p.cgroup):  # most jobs leave nothing behind
                cgroupfs.kill_all(p.cgroup, 10.0)
        elif p.memory_cgroup:  # no cgroup v2: what is left in the v1 one goes too
            cgroupfs.signal_all(p.memory_cgroup, signal.SIGKILL)
        _drain(out, log)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        oom = False
        if code != 0 and oom_cgroup:
            oom = cgroupfs.oom_kills(oom_cgroup) > 0
        elif code != 0 and p.memory_limit == "rlimit-as":
            oom = log.allocation_failed()
        for path in (p.cgroup, p.memory_cgroup):
            if path:  # else the daemon tries again when it sees us gone
                cgroupfs.remove(path, 2.0)
        _record_exit(attempt, None if code < 0 else code, -code if code < 0 else None, oom=oom)
    finally:
        log.close()


def _noop(signum: int, frame: object) -> None:
    pass


# idle workers kept for the next launches; one more that falls idle exits
_IDLE_WORKERS = 16


def zygote(sock_fd: int) -> int:
    """Hand each launch on the SOCK_SEQPACKET socket ``sock_fd`` to a
    supervisor worker (the messages: docs/launch-path.md). A worker pays once
    for the pages a fresh fork would copy. EOF from the daemon ends us: idle
    workers exit, busy ones once their job's end is recorded."""
    import gc
    import select

    try:
        os.setsid()
    except OSError:
        pass
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _accelerator()  # loaded once here, for every worker forked from us
    sock = _socket.socket(fileno=sock_fd)
    # SIGCHLD only wakes the loop: reaping happens there
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, _noop)
    poller = select.poll()
    poller.register(sock_fd, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    workers: dict[int, tuple[_socket.socket, int]] = {}  # fd of our end of its socket -> (that end, its pid)
    idle: list[_socket.socket] = []  # the workers waiting for a launch
    holding: dict[int, str] = {}  # fd of a busy worker -> the token of the launch it was given

    def drop(w: _socket.socket) -> None:  # closing our end makes it exit once idle
        token = holding.pop(w.fileno(), None)
        if token is not None:  # it died with a launch: if it never answered, this is the answer
            _send(sock, "%s error the supervisor died before starting the job" % token)
        workers.pop(w.fileno(), None)
        poller.unregister(w.fileno())
        if w in idle:
            idle.remove(w)
        w.close()

    def end() -> int:  # idle workers reaped here, so that their CPU time is counted
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


def _fork_worker(sock: _socket.socket, request: bytes, workers: dict, poller: object, wake_r: int, wake_w: int) -> int:
    """Fork a worker for ``request``; the fd of our end of its socket, -1 if
    it could not be forked (the daemon is told)."""
    import select

    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
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


def _worker(sock: _socket.socket, zygote_sock: _socket.socket, request: bytes) -> int:
    """Supervise one job per request, then ask ``zygote_sock`` for the next,
    until EOF there."""
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    while request:
        head, _, data = request.partition(b"\0")  # the plan, if sent with the request
        token, _, attempt = head.decode(errors="surrogateescape").partition(" ")
        # readable (EOF) for the daemon once this launch is done with, or we die
        done_r, done_w = os.pipe2(os.O_CLOEXEC)
        _send(sock, "%s forked %d" % (token, os.getpid()), done_r)
        os.close(done_r)
        try:
            _supervise(attempt, sock, token, data, devnull)
        except BaseException as e:  # noqa: BLE001 - tell, then die
            try:
                _record_exit(attempt, 127, None, "supervisor failed: %s" % e)
            except BaseException:  # noqa: BLE001
                pass
            _send(sock, "%s error supervisor failed: %s" % (token, e))
            return 127
        try:
            # before the daemon learns the job ended, so that its next launch
            # finds us idle (it waits in our socket while we tidy up)
            zygote_sock.send(b"idle")
        except OSError:
            return 0
        finally:
            os.close(done_w)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # back as the zygote made us
        try:
            request = zygote_sock.recv(65536)
        except OSError:
            return 0
    return 0


def _send(sock: _socket.socket, text: str, fd: int = -1) -> None:
    try:
        if fd >= 0:  # with the descriptor (SCM_RIGHTS)
            sock.sendmsg([text.encode()], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fd.to_bytes(4, sys.byteorder))])
        else:
            sock.send(text.encode())
    except OSError:  # the daemon is gone: the next recv says so
        pass


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


if __name__ == "__main__":  # supervisor.py --zygote SOCK_FD
    # _exit: nothing to flush, and interpreter teardown would delay the
    # moment the daemon sees us go
    os._exit(zygote(int(sys.argv[2])))
