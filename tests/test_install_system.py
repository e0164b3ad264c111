"""A machine-wide install serves every user: scripts/install-system.sh, then a
root daemon, then a real unprivileged user's submit, queue, logs and sql."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from install_harness import finished_install
from users_harness import User, needs_root, users  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow, needs_root]


def _as(user: User, prefix: Path, socket: Path, *args: str) -> subprocess.CompletedProcess:
    # exactly what a login shell after the install gives a user: the system
    # PATH and the socket from /etc/profile.d, nothing of the test's venv
    env = [f"PATH={prefix}/bin:/usr/bin:/bin", f"HOME={user.home}", f"EVENTSCHED_SOCKET={socket}"]
    return subprocess.run(
        ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", "env", "-i", *env,
         "eventsched", *args],
        cwd=user.home, capture_output=True, text=True, timeout=60,
    )


def test_a_non_root_user_uses_a_machine_wide_install(users) -> None:  # noqa: F811
    alice, _ = users
    top, code, output = finished_install()
    assert code == 0, output
    prefix, state, run = top / "usr", top / "var-lib-eventsched", top / "run"
    run.mkdir(mode=0o755)
    socket = run / "eventsched.sock"
    daemon = None
    try:
        # the interpreter is not a private one (e.g. under /root)
        assert os.access(prefix / "bin" / "eventsched", os.X_OK)
        daemon = subprocess.Popen([str(prefix / "bin" / "eventsched"), "serve", "--gpus", "fake:2",
                                   "--state-dir", str(state), "--socket", str(socket)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 30
        while _as(alice, prefix, socket, "health").returncode != 0:
            assert daemon.poll() is None and time.monotonic() < deadline, "daemon did not start"
            time.sleep(0.2)

        submitted = _as(alice, prefix, socket, "submit", "--gpus", "0.5", "--", "/bin/sh", "-c", "echo hello from $(id -un)")
        assert submitted.returncode == 0, submitted.stderr
        job = int(submitted.stdout)
        for _ in range(100):
            rows = json.loads(_as(alice, prefix, socket, "queue", "--all", "--json").stdout)
            if [r["state"] for r in rows if r["id"] == job] == ["succeeded"]:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"job {job} did not succeed: {rows}")
        assert _as(alice, prefix, socket, "logs", str(job)).stdout.strip() == f"hello from {alice.name}"
        sql = _as(alice, prefix, socket, "sql", "SELECT user, state FROM jobs", "--format", "json")
        assert sql.returncode == 0, sql.stderr
        assert json.loads(sql.stdout) == [{"user": alice.name, "state": "succeeded"}]
        assert oct(state.stat().st_mode & 0o777) == "0o711"
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(20)
