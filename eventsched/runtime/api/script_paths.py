"""``allowed_script_paths`` (``[scheduler]`` in the config): what a job may run.

The program found on the job's ``PATH`` as exec would, or for an interpreter
the script it is given, fully resolved, must lie under an allowed path. A shell
command, ``--env-setup`` or inline code can run anything: refused but for an
operator (who may change the config anyway). A script swapped after submission
is not caught: this guards against mistakes and casual misuse, not a user
racing the daemon.
"""

from __future__ import annotations

import os
import re
import shutil

from eventsched.domain.events import JobSpec

__all__ = ["check", "under", "resolve_program", "INTERPRETERS"]

INTERPRETERS = re.compile(
    r"^(python(\d+(\.\d+)?)?|pypy3?|bash|sh|dash|zsh|ksh|perl|ruby|node|Rscript|julia|lua)$"
)
_VALUE_OPTIONS = {"-W", "-X", "-o", "--rcfile", "--init-file"}  # options that take the next word as their value
_INLINE = {"-c", "-m", "-e", "-E", "--eval"}  # the rest of the command is code, not a script


def under(path: str, allowed: list[str]) -> bool:
    """Does resolved ``path`` lie under one of the ``allowed`` paths (resolved too)?"""
    for top in allowed:
        root = os.path.realpath(top)
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return True
    return False


def resolve_program(word: str, cwd: str, path_var: str) -> str | None:
    """Where exec would find ``word`` for the job, resolved; None if nowhere."""
    if "/" in word:
        full = os.path.join(cwd, word)
        return os.path.realpath(full) if os.path.exists(full) else None
    for d in path_var.split(":"):
        found = shutil.which(word, path=os.path.join(cwd, d or "."))
        if found is not None:
            return os.path.realpath(found)
    return None


def _script_argument(args: list[str]) -> str | None:
    """The script an interpreter is given, or None (inline code, no script)."""
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg in _INLINE or (arg.startswith("-") and not arg.startswith("--") and arg[-1:] == "c" and len(arg) > 2):
            return None  # -c CODE, or options run together with it (bash -ec)
        if arg in _VALUE_OPTIONS:
            skip = True
            continue
        if arg == "--":  # the script follows
            return args[i + 1] if i + 1 < len(args) else None
        if arg == "-":  # the program from stdin
            return None
        if arg.startswith("-"):
            continue
        return arg
    return None


def check(spec: JobSpec, allowed: list[str], *, operator: bool) -> str | None:
    """Why ``spec`` may not run under ``allowed``, in one line; None if it may."""
    if not allowed:
        return None
    where = ", ".join(allowed)
    if spec.shell or spec.env_setup:
        if operator:
            return None
        what = "--env-setup" if spec.env_setup and not spec.shell else "a shell command"
        return f"{what} can run anything, so it is refused where scripts must lie under {where}"
    if not spec.command:
        return None
    cwd = spec.cwd or "/"
    program = resolve_program(spec.command[0], cwd, spec.env.get("PATH") or os.defpath)
    if program is None:
        return f"cannot find {spec.command[0]} on the job's PATH (scripts must lie under {where})"
    name = os.path.basename(spec.command[0])
    if INTERPRETERS.match(name) or INTERPRETERS.match(os.path.basename(program)):
        script = _script_argument(spec.command[1:])
        if script is None:
            if operator:
                return None
            return f"{name} without a script file (inline code) is refused where scripts must lie under {where}"
        resolved = os.path.realpath(os.path.join(cwd, script))
        if not under(resolved, allowed):
            return f"{script} (resolved to {resolved}) is not under the allowed script paths: {where}"
        return None
    if not under(program, allowed):
        return f"{spec.command[0]} (resolved to {program}) is not under the allowed script paths: {where}"
    return None
