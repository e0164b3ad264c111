"""``eventsched attach JOB``: tmux or screen attached to a ``--session`` job, in
place of this process; anyone but the job's owner (whose the session's server
is) is refused before anything runs."""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import subprocess
import sys

from eventsched.cli.errors import UserError

__all__ = ["run", "find_session"]


def find_session(job: int) -> str:
    """"tmux" or "screen": the kind of the calling user's live session of ``job``, or ""."""
    from eventsched.runtime.launch.sessions import session_name

    name = session_name(job)
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL}
    if shutil.which("tmux"):
        if subprocess.run(["tmux", "-L", name, "has-session", "-t", f"={name}"], **quiet).returncode == 0:  # type: ignore[call-overload]
            return "tmux"
    if shutil.which("screen"):
        listed = subprocess.run(["screen", "-ls", name], text=True, **quiet)  # type: ignore[call-overload]
        if any(line.split("\t")[1:2] and line.split("\t")[1].endswith("." + name) for line in listed.stdout.splitlines()):
            return "screen"
    return ""


def run(args: argparse.Namespace) -> int:
    from eventsched.cli.connect import client
    from eventsched.runtime.launch.sessions import attach_argv
    from eventsched.wire import protocol

    job = args.job
    if os.environ.get("EVENTSCHED_URL"):
        raise UserError(f"attach runs tmux or screen on the daemon's machine: run it there, without EVENTSCHED_URL "
                        f"(`eventsched logs -f {job}` follows the output from here)")
    with client(args) as c:
        c.request(protocol.JobLogPath(job=job))  # refuses another user's job (not an operator's)
        info = c.explain(job)["job"]
    try:
        me = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        me = str(os.getuid())
    if info["user"] != me:
        raise UserError(f"job {job} belongs to {info['user']}: only they can attach to its session")
    state = info["state"]
    if state in ("queued", "held"):
        raise UserError(f"job {job} is {state}: its session starts when it runs")
    if state != "running":
        raise UserError(f"job {job} has ended ({state}): its session is gone; `eventsched logs {job}` shows its output")
    kind = find_session(job)
    if not kind:
        raise UserError(f"job {job} has no terminal session (submit it with --session tmux or --session screen)")
    argv = attach_argv(kind, job)
    if not os.isatty(0):
        raise UserError(f"attach needs a terminal; {' '.join(argv)} is the command")
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        raise UserError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
