"""One launch interface, two implementations, one contract.

``supervisor.start(plan)`` starts a job by the C accelerator
(``eventsched/runtime/launch/_spawn.c``: clone3 into the job's cgroup, no copy
of the supervisor's memory) where it is built, else by the portable reference
(a fork, and the child set up in Python). Every test here runs against both:
the job must see the same world and a failed start must say the same one line.

Where the accelerator is not built its cases fail under CI (``CI=true``), so a
machine without a compiler cannot go green having tested one implementation;
elsewhere they skip.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import anyio
import pytest

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import ProcessExited
from eventsched.runtime.launch import cgroups, supervisor
from eventsched.runtime.launch.executor import Executor
from eventsched.runtime.launch.plan import Plan

HAVE_CGROUPS = cgroups.Cgroups.setup("/nonexistent-probe")[0] is not None
PATH = "/usr/local/bin:/usr/bin:/bin"
Start = Callable[[Plan], "int | supervisor.Failure | None"]


@pytest.fixture(params=["accelerator", "reference"])
def start(request: pytest.FixtureRequest) -> Start:
    return supervisor.clone_start if request.param == "accelerator" else supervisor.fork_start


@pytest.fixture
def cgroup(tmp_path: Path) -> Iterator[str]:
    """A job cgroup of its own where this machine has a writable cgroup v2, else ""."""
    parent, _ = cgroups.Cgroups.setup(tmp_path) if HAVE_CGROUPS else (None, "")
    if parent is None:
        yield ""
        return
    path = parent.create(1, 0)
    yield path
    cgroups.kill_all(path)
    cgroups.remove(path, timeout_s=2.0)
    parent.remove_parent()


def run(start: Start, plan: Plan, log: Path) -> tuple[str, str]:
    """('ok', the exit code and the job's output) or ('error', the one line)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1)  # as in a supervisor: fds 1 and 2 are the job's log
    os.dup2(fd, 2)
    try:
        result = start(plan)
    finally:
        for target, fd_saved in zip((1, 2), saved):
            os.dup2(fd_saved, target)
            os.close(fd_saved)
        os.close(fd)
    if result is None:
        why = "the accelerator (eventsched/runtime/launch/_spawn.c) is not built here"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    if isinstance(result, supervisor.Failure):
        return "error", result
    _, status = os.waitpid(result, 0)
    return "ok", f"exit {os.waitstatus_to_exitcode(status)}\n" + log.read_text()


# what a job can observe of how it was started (its cgroup's name is per job)
SELF_REPORT = r"""
cat /proc/self/cgroup | sed -n 's/^0::.*\/\(job-\)\{0,1\}[^/]*$/0::JOBCGROUP/p'
grep -E '^(SigIgn|SigBlk)' /proc/self/status
ulimit -n; ulimit -c; umask
(cd /proc/$$/fd && echo FDS *)  # the shell's own, with no pipeline being set up
[ "$(ps -o pgid= -p $$ | tr -d ' ')" = "$$" ] && echo own-group
[ "$(ps -o sid= -p $$ | tr -d ' ')" = "$$" ] && echo own-session
pwd; echo "$GREETING"
"""


def test_a_job_gets_its_world(start: Start, cgroup: str, tmp_path: Path) -> None:
    plan = Plan(["sh", "-c", SELF_REPORT], {"PATH": PATH, "GREETING": "hi there"}, cwd=str(tmp_path),
                umask=0o027, rlimits={"nofile": [200, 300], "core": [0, 0]}, cgroup=cgroup)
    outcome, log = run(start, plan, tmp_path / "log")
    assert outcome == "ok" and log.startswith("exit 0\n"), log
    assert ("0::JOBCGROUP" in log) == bool(cgroup), log  # born in (or joined) its own cgroup
    ignored = int(re.search(r"SigIgn:\s+([0-9a-f]+)\n", log).group(1), 16)  # type: ignore[union-attr]
    assert not [s for s in supervisor._JOB_DEFAULT_SIGNALS if ignored & (1 << (s - 1))], log
    assert re.search(r"SigBlk:\s+0+\n", log)
    assert "\n200\n0\n0027\n" in log
    assert re.search(r"\nFDS 0 1 2( 255)?\n", log), log  # nothing of ours leaks (bash keeps 255)
    assert "own-group\nown-session\n" in log
    assert log.endswith(f"\n{tmp_path}\nhi there\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching identity needs root")
def test_a_job_takes_the_submitters_identity(start: Start, tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    work = Path(tempfile.mkdtemp(prefix="eventsched-user-"))  # pytest's tmp_path is root's alone
    try:
        os.chown(work, nobody.pw_uid, nobody.pw_gid)
        script = "id -u; id -g; id -G; umask; pwd; touch mine; ls -n mine | cut -d' ' -f3"
        plan = Plan(["sh", "-c", script], {"PATH": PATH}, cwd=str(work), uid=nobody.pw_uid,
                    gid=nobody.pw_gid, groups=[nobody.pw_gid], umask=0o077)
        outcome, log = run(start, plan, tmp_path / "log")
    finally:
        shutil.rmtree(work)
    uid, gid = str(nobody.pw_uid), str(nobody.pw_gid)
    assert (outcome, log.splitlines()) == ("ok", ["exit 0", uid, gid, gid, "0077", str(work), uid])


@pytest.mark.parametrize(
    "argv, env, cwd, expected",
    [
        (["no-such-program-xyz"], {}, "/", "command not found: no-such-program-xyz"),
        (["/no/such/file"], {}, "/", "cannot execute /no/such/file: No such file or directory"),
        (["true"], {}, "/no/such/dir", "cannot change to directory /no/such/dir: No such file or directory"),
        (["NOT_EXECUTABLE"], {}, "/", "cannot execute {plain}: Permission denied"),
        (["/"], {}, "/", "cannot execute /: Permission denied"),
        (["echo", "a\0b"], {}, "/", "cannot execute echo: embedded null byte"),
        (["true"], {"A=B": "c"}, "/", "cannot execute true: illegal environment variable name"),
    ],
)
def test_a_failed_start_says_why_in_one_line(
    start: Start, tmp_path: Path, argv: list[str], env: dict[str, str], cwd: str, expected: str
) -> None:
    plain = tmp_path / "plain-file"
    plain.write_text("not a program\n")
    plain.chmod(stat.S_IRUSR | stat.S_IWUSR)
    argv = [str(plain) if a == "NOT_EXECUTABLE" else a for a in argv]
    plan = Plan(argv, {"PATH": PATH, **env}, cwd=cwd)
    assert run(start, plan, tmp_path / "log") == ("error", expected.format(plain=plain))


def test_a_cgroup_that_cannot_be_joined_is_a_failed_start(start: Start, tmp_path: Path) -> None:
    plan = Plan(["true"], {"PATH": PATH}, cgroup=str(tmp_path / "job-1-0"))
    expected = f"cannot join cgroup {tmp_path}/job-1-0: No such file or directory"
    assert run(start, plan, tmp_path / "log") == ("error", expected)


@pytest.mark.parametrize("runnable_later", [True, False])
def test_the_path_is_searched_like_execvp(start: Start, tmp_path: Path, runnable_later: bool) -> None:
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
    plan = Plan(["myprog"], {"PATH": f"{tmp_path}/missing:{first}:{later}:{PATH}"})
    expected = ("ok", "exit 0\nlater\n") if runnable_later else ("error", "cannot execute myprog: Permission denied")
    assert run(start, plan, tmp_path / "log") == expected


def test_a_kernel_without_clone3_into_a_cgroup_falls_back_to_the_fork(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    class OldKernel:  # clone3 before Linux 5.7: CLONE_INTO_CGROUP is an unknown flag
        @staticmethod
        def spawn(*args: object) -> tuple[int, str, int]:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(supervisor, "_native", [OldKernel])
    plan = Plan(["sh", "-c", "echo forked"], {"PATH": PATH})
    assert supervisor.clone_start(plan) is None  # the caller forks instead...
    assert run(supervisor.start, plan, tmp_path / "log") == ("ok", "exit 0\nforked\n")
    assert supervisor.clone_start(plan) is None  # ...and never tries clone3 again


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("spawn", ["", "fork"])
async def test_the_daemon_starts_jobs_either_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spawn: str) -> None:
    # end to end, through the executor, a zygote and its worker
    monkeypatch.setenv("EVENTSCHED_SPAWN", spawn)
    ex = Executor(tmp_path)
    send, receive = anyio.create_memory_object_stream[object](10)
    async with anyio.create_task_group() as tg:
        await tg.start(ex.run, send.send)
        await ex.launch(1, JobSpec(command=["sh", "-c", "cat /proc/self/cgroup; echo $EVENTSCHED_JOB_ID"]), [0])
        with anyio.fail_after(30):
            exited = await receive.receive()
        tg.cancel_scope.cancel()
    assert exited == ProcessExited(job=1, exit_code=0)
    log = ex.log_path(1).read_text()
    assert log.endswith("\n1\n") and ("/job-1-0\n" in log) == HAVE_CGROUPS, log
