"""A root daemon serves several users: identity from the kernel, jobs run as their submitter."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon_harness import Daemon

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user"),
]


def as_user(user: str, socket: Path, *args: str, cwd: str = "/tmp") -> subprocess.CompletedProcess:
    """Run the CLI as ``user`` (setpriv drops uid, gid and groups)."""
    entry = pwd.getpwnam(user)
    env = {"PATH": os.environ["PATH"], "HOME": entry.pw_dir, "EVENTSCHED_SOCKET": str(socket),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           **{k: v for k, v in os.environ.items() if k == "EVENTSCHED_PURE"}}
    return subprocess.run(
        ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups",
         sys.executable, "-m", "eventsched.cli", *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=30,
    )


def test_jobs_run_as_their_submitter_who_alone_may_cancel_them(tmp_path: Path) -> None:
    public = Path(tempfile.mkdtemp(prefix="es-public-"))
    public.chmod(0o755)
    socket = public / "eventsched.sock"
    # a root daemon's state dir is traversable (0711), so users reach their logs
    daemon = Daemon(public / "state", gpus="fake:2", socket_path=socket)
    try:
        daemon.start()
        result = as_user("nobody", socket, "submit", "--gpus", "0.5", "--", "/bin/sh", "-c", "id -u; id -g; echo $HOME; pwd")
        assert result.returncode == 0, result.stderr
        job = int(result.stdout)
        jobs = daemon.wait_states([job], {"succeeded"})
        nobody = pwd.getpwnam("nobody")
        assert jobs[job]["user"] == "nobody"
        out = as_user("nobody", socket, "logs", str(job))
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [str(nobody.pw_uid), str(nobody.pw_gid), nobody.pw_dir, "/tmp"]

        # root's job cannot be cancelled by nobody, and nobody cannot pause GPUs
        mine = daemon.submit("--gpus", "2", "--priority", "-1", "--", "/bin/sleep", "30")
        refused = as_user("nobody", socket, "cancel", str(mine))
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert daemon.jobs()[mine]["state"] in {"queued", "running"}
        assert as_user("nobody", socket, "pause-gpu", "0").returncode != 0
        assert not daemon.status()["gpus"][0]["paused"]
        # nobody sees the queue (it is not secret) but cannot read root's output
        queue = as_user("nobody", socket, "queue", "--json")
        assert mine in [j["id"] for j in json.loads(queue.stdout)]
        assert as_user("nobody", socket, "logs", str(mine)).returncode != 0
        assert daemon.cli("cancel", str(mine)).returncode == 0
        daemon.wait_states([mine], {"cancelled"})
        # nobody cannot read root's log, yet may query the history: the
        # daemon answers, with the same read-only rules
        sql = as_user("nobody", socket, "sql", "SELECT id, user, state FROM jobs ORDER BY id", "--format", "json")
        assert sql.returncode == 0, sql.stderr
        rows = {r["id"]: r for r in json.loads(sql.stdout)}
        assert rows[job]["user"] == "nobody" and rows[mine]["state"] == "cancelled"
        refused = as_user("nobody", socket, "sql", "DELETE FROM jobs")
        assert refused.returncode == 2 and "refused" in refused.stderr and "Traceback" not in refused.stderr
    finally:
        daemon.stop()
        shutil.rmtree(public, ignore_errors=True)
