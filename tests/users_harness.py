"""Two real unprivileged users and a root daemon, for the security tests.

The users are created with ``useradd`` for the test module and removed (with
their homes) afterwards. The CLI runs as them exactly as a person on a shared
machine would run it: ``setpriv --reuid --regid --init-groups env -i
PATH=<venv>/bin:/usr/bin:/bin EVENTSCHED_STATE_DIR=<state> eventsched ...``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import Daemon

VENV_BIN = str(Path(sys.executable).parent)
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="needs root and useradd to create real users")


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str


def _create_user(name: str) -> User:
    subprocess.run(["userdel", "-r", name], capture_output=True)  # a leftover of a killed run
    for attempt in range(20):  # another test process may hold the passwd lock a moment
        added = subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", "--user-group", name],
                               capture_output=True, text=True)
        if added.returncode == 0:
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"useradd {name}: {added.stderr.strip()}")
    entry = pwd.getpwnam(name)
    return User(name=name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir)


def _remove_user(user: User) -> None:
    subprocess.run(["pkill", "-KILL", "-u", str(user.uid)], capture_output=True)
    subprocess.run(["userdel", "-r", "-f", user.name], capture_output=True)


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[User, User]]:
    """Two fresh users, alice and bob (names unique to this run)."""
    suffix = str(os.getpid())[-5:]
    alice = _create_user(f"esa{suffix}")
    bob = _create_user(f"esb{suffix}")
    try:
        yield alice, bob
    finally:
        _remove_user(alice)
        _remove_user(bob)


@pytest.fixture(scope="module")
def third_user() -> Iterator[User]:
    """carol: a user who is neither alice nor bob."""
    carol = _create_user(f"esc{str(os.getpid())[-5:]}")
    try:
        yield carol
    finally:
        _remove_user(carol)


@pytest.fixture(scope="module")
def public_dir() -> Iterator[Path]:
    """A root-owned, world-traversable folder that holds a root daemon's state."""
    public = Path(tempfile.mkdtemp(prefix="es-sec-"))
    public.chmod(0o755)
    try:
        yield public
    finally:
        shutil.rmtree(public, ignore_errors=True)


def root_daemon(public: Path, *extra: str, gpus: str = "fake:2") -> Daemon:
    """A root daemon whose state lives in ``public/state`` (not yet started)."""
    return Daemon(public / "state", gpus=gpus, extra=list(extra))


def base_env(user: User) -> dict[str, str]:
    """A clean login's environment, keeping the test run's choice of sources over stale compiled modules."""
    pure = {"EVENTSCHED_PURE": os.environ["EVENTSCHED_PURE"]} if "EVENTSCHED_PURE" in os.environ else {}
    return {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": user.home, **pure}


def user_env(user: User, state_dir: Path, **more: str) -> dict[str, str]:
    return {**base_env(user), "USER": user.name, "EVENTSCHED_STATE_DIR": str(state_dir), **more}


def as_user(user: User, state_dir: Path, *args: str, timeout: float = 30.0, cwd: str | None = None,
            input: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``eventsched ARGS`` as ``user`` against the daemon of ``state_dir``."""
    return run_as(user, [f"{VENV_BIN}/eventsched", *args], timeout=timeout, cwd=cwd, input=input,
                  env=env or user_env(user, state_dir))


def run_as(user: User, argv: list[str], *, timeout: float = 30.0, env: dict[str, str] | None = None,
           cwd: str | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """Run any program as ``user`` (a Python attack script, ``cat``, ...)."""
    return subprocess.run(
        ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups",
         "env", "-i", *(f"{k}={v}" for k, v in (env or base_env(user)).items()), *argv],
        cwd=cwd or user.home, capture_output=True, text=True, timeout=timeout, input=input,
    )
