"""The supervisor's two ways of starting a job in its cgroup give the job the
same world and the user the same messages.

``runtime/launch/_spawn.c`` starts a job with clone3 (CLONE_VM | CLONE_VFORK |
CLONE_INTO_CGROUP) and no copy of the supervisor's memory; where it is not
built (or ``EVENTSCHED_SPAWN=fork``), the supervisor forks. Each test runs
the same jobs both ways through a real executor, zygote and supervisor, and
compares what the jobs saw and what a failed launch said.
"""

from __future__ import annotations

import os
import platform
import pwd
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import anyio
import pytest

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import ProcessExited, ProcessStarted
from eventsched.runtime.launch import cgroups
from eventsched.runtime.launch import supervisor
from eventsched.runtime.launch.executor import Executor, LaunchError

pytestmark = pytest.mark.anyio

HAVE_CGROUPS = cgroups.Cgroups.setup("/nonexistent-probe")[0] is not None


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# what a job can observe of how it was started (its cgroup's name is per job)
SELF_REPORT = r"""
cat /proc/self/cgroup | sed -n 's/^0::.*\/\(job-\)\{0,1\}[^/]*$/0::JOBCGROUP/p'
grep -E '^(SigIgn|SigBlk|Uid|Gid|Groups)' /proc/self/status
ulimit -n; ulimit -c; umask
ls /proc/$$/fd | sort -n | tr '\n' ' '; echo
[ "$(ps -o pgid= -p $$ | tr -d ' ')" = "$$" ] && echo own-group
[ "$(ps -o sid= -p $$ | tr -d ' ')" = "$$" ] && echo own-session
pwd
"""


async def _run(tmp: Path, spec: JobSpec) -> tuple[str, str]:
    """('ok', the job's log) or ('error', the launch error), through a fresh
    executor (so a fresh zygote reads EVENTSCHED_SPAWN)."""
    ex = Executor(tmp)
    send, receive = anyio.create_memory_object_stream[object](10)
    async with anyio.create_task_group() as tg:
        await tg.start(ex.run, send.send)
        try:
            started = await ex.launch(1, spec, [0])
        except LaunchError as e:
            tg.cancel_scope.cancel()
            return "error", str(e)
        assert isinstance(started, ProcessStarted)
        with anyio.fail_after(30):
            exited = await receive.receive()
        tg.cancel_scope.cancel()
    assert isinstance(exited, ProcessExited)
    return "ok", f"exit {exited.exit_code}\n" + ex.log_path(1).read_text()


async def _both_ways(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: JobSpec) -> dict[str, tuple[str, str]]:
    seen = {}
    for mode in ("native", "fork"):
        monkeypatch.setenv("EVENTSCHED_SPAWN", mode)
        seen[mode] = await _run(tmp_path / mode, spec)
    return seen


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux", reason="spawn() is x86-64 Linux")
def test_the_native_spawner_is_built_by_the_install() -> None:
    supervisor._native_handle.clear()
    try:
        assert supervisor._native() is not None, "eventsched/runtime/launch/_spawn.c was not built (no C compiler?)"
    finally:
        supervisor._native_handle.clear()


@pytest.mark.skipif(not HAVE_CGROUPS, reason="no writable cgroup v2 here")
async def test_a_job_sees_the_same_world_either_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = JobSpec(command=["sh", "-c", SELF_REPORT], cwd=str(tmp_path), umask=0o027,
                   rlimits={"nofile": [200, 300], "core": [0, 0]})
    seen = await _both_ways(tmp_path, monkeypatch, spec)
    assert seen["native"] == seen["fork"]
    outcome, log = seen["native"]
    assert outcome == "ok" and log.startswith("exit 0\n"), log
    assert "0::JOBCGROUP" in log  # born in its own cgroup
    ignored = int(re.search(r"SigIgn:\s+([0-9a-f]+)\n", log).group(1), 16)  # type: ignore[union-attr]
    assert not [s for s in supervisor._JOB_DEFAULT_SIGNALS if ignored & (1 << (s - 1))], log
    assert re.search(r"SigBlk:\s+0+\n", log)
    assert "\n200\n0\n0027\n" in log
    assert "\n0 1 2 255 \n" in log or "\n0 1 2 \n" in log or "\n0 1 2 3 \n" in log, log  # nothing of ours leaks
    assert "own-group" in log and "own-session" in log


@pytest.mark.skipif(not HAVE_CGROUPS or os.geteuid() != 0, reason="needs root and cgroup v2")
async def test_the_submitters_identity_is_taken_either_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nobody = pwd.getpwnam("nobody")
    work = Path(tempfile.mkdtemp(prefix="eventsched-user-"))  # pytest's tmp_path is root's alone
    try:
        os.chown(work, nobody.pw_uid, nobody.pw_gid)
        spec = JobSpec(command=["sh", "-c", "id -u; id -g; id -G; pwd; touch mine; ls -n mine | cut -d' ' -f3"],
                       uid=nobody.pw_uid, gid=nobody.pw_gid, cwd=str(work))
        seen = await _both_ways(tmp_path, monkeypatch, spec)
    finally:
        shutil.rmtree(work)
    assert seen["native"] == seen["fork"]
    outcome, log = seen["native"]
    assert outcome == "ok", log
    uid = str(nobody.pw_uid)
    assert log.splitlines()[1:] == [uid, str(nobody.pw_gid), str(nobody.pw_gid), str(work), uid]


@pytest.mark.skipif(not HAVE_CGROUPS, reason="no writable cgroup v2 here")
@pytest.mark.parametrize(
    "command, cwd, expected",
    [
        (["no-such-program-xyz"], "/", "command not found: no-such-program-xyz"),
        (["/no/such/file"], "/", "cannot execute /no/such/file: No such file or directory"),
        (["true"], "/no/such/dir", "cannot change to directory /no/such/dir: No such file or directory"),
        (["NOT_EXECUTABLE"], "/", "cannot execute {path}: Permission denied"),
        (["/"], "/", "cannot execute /: Permission denied"),
    ],
)
async def test_a_failed_start_says_the_same_either_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], cwd: str, expected: str
) -> None:
    plain = tmp_path / "plain-file"
    plain.write_text("not a program\n")
    plain.chmod(stat.S_IRUSR | stat.S_IWUSR)
    command = [str(plain) if c == "NOT_EXECUTABLE" else c for c in command]
    seen = await _both_ways(tmp_path, monkeypatch, JobSpec(command=command, cwd=cwd))
    assert seen["native"] == seen["fork"] == ("error", expected.format(path=plain))


def test_a_kernel_without_clone3_into_a_cgroup_falls_back_to_the_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    class OldKernel:  # clone3 before Linux 5.7: CLONE_INTO_CGROUP is an unknown flag
        @staticmethod
        def spawn(*args: object) -> tuple[int, str, int]:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(supervisor, "_native_handle", [OldKernel])
    spec = {"argv": ["true"], "env": {"PATH": "/usr/bin:/bin"}, "cwd": "/", "cgroup": ""}
    assert supervisor._native_spawn(OldKernel, spec, False, []) is None  # the caller forks instead
    assert supervisor._native() is None  # and never tries again


@pytest.mark.skipif(not HAVE_CGROUPS, reason="no writable cgroup v2 here")
@pytest.mark.parametrize("runnable_later", [True, False])
async def test_the_job_path_is_searched_like_execvp_either_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runnable_later: bool
) -> None:
    # a program that cannot be executed early on PATH: execvp remembers why
    # and goes on; it says so only when nothing later on PATH runs
    first, later = tmp_path / "first", tmp_path / "later"
    first.mkdir()
    later.mkdir()
    (first / "myprog").write_text("#!/bin/sh\necho first\n")
    (first / "myprog").chmod(0o644)
    if runnable_later:
        (later / "myprog").write_text("#!/bin/sh\necho later\n")
        (later / "myprog").chmod(0o755)
    path = f"{tmp_path}/missing:{first}:{later}:/usr/bin:/bin"
    seen = await _both_ways(tmp_path, monkeypatch, JobSpec(command=["myprog"], env={"PATH": path}))
    assert seen["native"] == seen["fork"]
    if runnable_later:
        assert seen["native"] == ("ok", "exit 0\nlater\n")
    else:
        assert seen["native"] == ("error", "cannot execute myprog: Permission denied")
