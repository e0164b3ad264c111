"""Per-job supervisor: starts one job, waits for it, records how it ended.

Run by the executor as ``python -I -S supervisor.py JOBDIR [READY_FD]``, or
pre-started as ``supervisor.py --spare READY_FD`` and handed JOBDIR on stdin
when a job is launched. It is a standalone, stdlib-only script (no ``eventsched`` imports, no ``json``, no
``subprocess``) because its start-up time is part of every job's dispatch
latency. Like conmon or containerd-shim it outlives the daemon: it runs in its
own session and talks to the daemon only through files in JOBDIR (plus one
line on READY_FD, if given, so a live daemon learns the pid without polling):

- reads  ``JOBDIR/spec.json``: argv, env, cwd, uid/gid/groups (null = keep)
- writes ``JOBDIR/pid``  once the job has exec'd (atomically, by rename)
- writes ``JOBDIR/exit`` when the job has ended (atomically, by rename)

Its own stdout/stderr are the job's log (the executor opened it for us), so a
supervisor failure ends up where the user looks.
"""

import os
import _signal as signal  # not `signal`: its enum import costs ~4 ms
import sys
import time

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

    _scan = _json.make_scanner(_Ctx())

    def _loads(text):
        return _scan(text, 0)[0]

    _quote = _json.encode_basestring_ascii
except Exception:  # another interpreter: pay for the real thing
    import json

    _loads = json.loads
    _quote = json.dumps


def _proc_start_time(pid):
    """Field 22 of /proc/PID/stat: with the pid, names one process forever."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return 0
    # comm (field 2) may hold spaces and parentheses: split after the last ')'
    return int(data[data.rindex(b")") + 2 :].split()[19])


def _write_atomic(jobdir, name, text):
    tmp = os.path.join(jobdir, "." + name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.rename(tmp, os.path.join(jobdir, name))


def _record_exit(jobdir, exit_code, sig, error=""):
    _write_atomic(
        jobdir,
        "exit",
        '{"exit_code": %s, "signal": %s, "ended_at": %r, "error": %s}\n'
        % (
            "null" if exit_code is None else int(exit_code),
            "null" if sig is None else int(sig),
            time.time(),
            _quote(error),
        ),
    )


def _tell(ready_fd, line):
    if ready_fd < 0:
        return
    try:
        os.write(ready_fd, line.encode())
    except OSError:  # the daemon is gone: the files say it all
        pass
    try:
        os.close(ready_fd)
    except OSError:
        pass


def _execvpe(file, argv, env):
    """os.execvpe without its lazy ``import warnings``, which would fail once
    we are a user who cannot read root's Python. Searches the job's PATH."""
    if "/" in file:
        os.execve(file, argv, env)
    saved = None
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


def _read_line(fd):
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            return ""
        buf += chunk
    return buf.decode().strip()


def _child(spec, errw):
    """In the forked child: become the job. Never returns."""
    doing = "start the job"
    argv0 = spec["argv"][0]
    try:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(s, signal.SIG_DFL)
        os.setsid()  # its own session and process group: pgid == pid
        # keep 0-2 (/dev/null, log, log) and the exec-error pipe (CLOEXEC)
        os.closerange(3, errw)
        os.closerange(errw + 1, 1 << 20)
        if spec.get("uid") is not None:
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


def main(argv):
    spare = argv[1] == "--spare"
    ready_fd = int(argv[2]) if len(argv) > 2 else -1
    try:
        os.setsid()  # detach from the daemon's session (if Popen did not)
    except OSError:
        pass
    # The daemon's terminal and its death must not reach us (we are its shim).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    job_pid = [0]

    def forward(signum, frame):  # stopping the supervisor stops its job
        if job_pid[0]:
            try:
                os.killpg(job_pid[0], signum)
            except OSError:
                pass

    signal.signal(signal.SIGTERM, forward)

    if spare:
        # Pre-started by the executor so a launch does not wait for Python to
        # start: the job directory arrives on stdin; EOF = not needed after all.
        jobdir = _read_line(0)
        if not jobdir:
            return 0
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    else:
        jobdir = argv[1]
    with open(os.path.join(jobdir, "spec.json"), "rb") as f:
        spec = _loads(f.read().decode())
    if spare:  # our stdout/stderr become the job's log, as in a cold start
        log = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)

    errr, errw = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
    except OSError as e:
        _record_exit(jobdir, 127, None, "cannot fork: %s" % e.strerror)
        _tell(ready_fd, "error cannot fork: %s\n" % e.strerror)
        return 0
    if pid == 0:
        _child(spec, errw)
    job_pid[0] = pid
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
        error = b"".join(chunks).decode(errors="replace").replace("\n", " ")
        _record_exit(jobdir, 127, None, error)
        _tell(ready_fd, "error %s\n" % error)
        return 0

    start_time = _proc_start_time(pid)
    _write_atomic(
        jobdir,
        "pid",
        '{"pid": %d, "start_time": %d, "supervisor_pid": %d, "supervisor_start_time": %d,'
        ' "started_at": %r}\n'
        % (pid, start_time, os.getpid(), _proc_start_time(os.getpid()), time.time()),
    )
    _tell(ready_fd, "ok %d %d\n" % (pid, start_time))

    # Wait without reaping, so the zombie keeps its pid (and pgid) reserved
    # while we kill what the job left behind in its process group.
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        _record_exit(jobdir, None, -code)
    else:
        _record_exit(jobdir, code, None)
    return 0


if __name__ == "__main__":
    # _exit: nothing to flush, and interpreter teardown would delay the
    # moment the daemon's pidfd sees us go (~1-4 ms)
    os._exit(main(sys.argv))
