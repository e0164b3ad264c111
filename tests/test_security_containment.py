"""Security: containment of jobs.

A process group alone does not contain a job: one that calls ``setsid`` or
``setpgid`` would outlive its cancel and its time limit, keeping GPUs the
scheduler had already given to someone else. So each job attempt runs in its
own cgroup v2 (``eventsched/runtime/launch/cgroups.py``), joined before exec;
and it gets its submitter's umask and resource limits, never above the
daemon's (``eventsched/domain/rlimits.py``).

The quick tests check the pure parts (mountinfo, the clamp) and the executor
on its own; the slow ones run a real root daemon and two real users.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import AsyncIterator, Iterator

import anyio
import daemon_harness
import pytest
from daemon_harness import Daemon
from processes import alive
from users_harness import VENV_BIN, as_user, needs_root, run_as, user_env
from users_harness import public_dir, users  # noqa: F401 (fixtures)

from eventsched.domain import rlimits
from eventsched.domain.events import JobSpec
from eventsched.domain.messages import Message, ProcessExited
from eventsched.runtime.launch import cgroups
from eventsched.runtime.launch.executor import Executor

INF = rlimits.INFINITY

# --- the clamp (pure) ---------------------------------------------------------------


def test_clamp_lowers_hard_to_the_ceiling_and_soft_to_hard() -> None:
    ceiling = {"nofile": [1024, 8192], "core": [0, 0], "stack": [8 << 20, INF]}
    got = rlimits.clamp(
        {"nofile": [INF, INF], "core": [INF, INF], "stack": [INF, INF]}, ceiling
    )
    assert got == {"nofile": [8192, 8192], "core": [0, 0], "stack": [INF, INF]}
    # below the ceiling: kept as asked, a soft limit above the hard one comes down
    assert rlimits.clamp({"nofile": [256, 512]}, ceiling) == {"nofile": [256, 512]}
    assert rlimits.clamp({"nofile": [4096, 512]}, ceiling) == {"nofile": [512, 512]}
    assert rlimits.clamp({"nofile": [100, INF]}, ceiling) == {"nofile": [100, 8192]}
    assert rlimits.clamp({}, ceiling) == {}


def test_clamp_defaults_to_this_process_limits() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert rlimits.clamp({"nofile": [INF, INF]}) == {"nofile": [hard, hard]}
    assert rlimits.current()["nofile"] == [soft, hard]
    old = os.umask(0o077)
    try:
        assert rlimits.current_umask() == 0o077
        assert os.umask(0o077) == 0o077  # read back unchanged
    finally:
        os.umask(old)


@pytest.mark.parametrize(
    "bad, umask, fragment",
    [
        ({"bogus": [1, 1]}, -1, "unknown resource limit 'bogus'"),
        ({"RLIMIT_NOFILE": [1, 1]}, -1, "unknown resource limit"),
        ({"nofile": [-2, 10]}, -1, "must be [soft, hard]"),
        ({"nofile": [1]}, -1, "must be [soft, hard]"),
        ({"nofile": [1, 1 << 64]}, -1, "must be [soft, hard]"),
        ({"nofile": [True, 1]}, -1, "must be [soft, hard]"),
        ({}, 0o1000, "umask"),
        ({}, -5, "umask"),
    ],
)
def test_validate_refuses_clearly(bad, umask, fragment) -> None:
    with pytest.raises(rlimits.RlimitError) as exc:
        rlimits.validate(bad, umask)
    assert fragment in str(exc.value)
    if umask == -1:
        with pytest.raises(rlimits.RlimitError):
            rlimits.clamp(bad)


def test_validate_accepts_what_the_client_sends() -> None:
    rlimits.validate(rlimits.current(), rlimits.current_umask())
    rlimits.validate({}, -1)


# --- cgroup detection (pure, on fake texts) --------------------------------------------

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
UNIFIED = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""
V1_ONLY = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
"""


def test_cgroup2_is_found_on_hybrid_and_unified_hosts() -> None:
    assert cgroups.cgroup2_mounts(HYBRID) == [("/", "/sys/fs/cgroup/unified")]
    assert cgroups.cgroup2_mounts(UNIFIED) == [("/", "/sys/fs/cgroup")]
    assert cgroups.cgroup2_mounts(V1_ONLY) == []
    # optional fields before " - " and escaped spaces in the mount point
    odd = "50 22 0:40 / /mnt/my\\040cg rw shared:3 master:1 - cgroup2 none rw\n"
    assert cgroups.cgroup2_mounts(odd) == [("/", "/mnt/my cg")]


def test_own_cgroup_directory_joins_the_mount_and_our_path() -> None:
    proc = "9:name=systemd:/system.slice/eventsched.service\n0::/system.slice/eventsched.service\n"
    assert cgroups.own_cgroup(proc) == "/system.slice/eventsched.service"
    assert cgroups.own_cgroup("4:memory:/x\n") is None
    yes = lambda path: True  # noqa: E731
    assert (
        cgroups.find_own_cgroup_dir(UNIFIED, proc, isdir=yes) == "/sys/fs/cgroup/system.slice/eventsched.service"
    )
    assert cgroups.find_own_cgroup_dir(HYBRID, "0::/\n", isdir=yes) == "/sys/fs/cgroup/unified"
    assert cgroups.find_own_cgroup_dir(V1_ONLY, proc, isdir=yes) is None
    # a mount of a subtree (a container's view): the path is taken relative to its root
    sub = "30 22 0:26 /lxc/c1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    assert cgroups.find_own_cgroup_dir(sub, "0::/lxc/c1/app\n", isdir=yes) == "/sys/fs/cgroup/app"
    assert cgroups.find_own_cgroup_dir(sub, "0::/elsewhere\n", isdir=yes) is None
    assert cgroups.find_own_cgroup_dir(UNIFIED, proc, isdir=lambda p: False) is None


def test_setup_degrades_with_one_reason_where_cgroup2_cannot_be_written(tmp_path: Path, monkeypatch) -> None:
    fake_mount = tmp_path / "cg"  # a plain folder: mkdir works, moving a process in does not
    fake_mount.mkdir()
    texts = {
        "/proc/self/mountinfo": f"41 31 0:38 / {fake_mount} rw - cgroup2 cgroup2 rw\n",
        "/proc/self/cgroup": "0::/\n",
    }
    monkeypatch.setattr(cgroups, "_read", lambda path: texts[path])
    found, why = cgroups.Cgroups.setup(tmp_path / "state")
    assert found is None
    assert why.startswith(f"cgroup v2 not writable at {fake_mount}/eventsched-"), why
    assert list(fake_mount.iterdir()) == []  # nothing left behind
    texts["/proc/self/mountinfo"] = V1_ONLY
    assert cgroups.Cgroups.setup(tmp_path / "state") == (None, "no cgroup v2 mount in /proc/self/mountinfo")


# --- the executor on its own (the daemon's identity) -------------------------------------

HAVE_CGROUPS = cgroups.Cgroups.setup("/nonexistent-probe")[0] is not None
needs_cgroups = pytest.mark.skipif(not HAVE_CGROUPS, reason="no writable cgroup v2 here")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Inbox:
    def __init__(self) -> None:
        self.send_stream, self.receive = anyio.create_memory_object_stream[Message](100)

    async def send(self, m: Message) -> None:
        await self.send_stream.send(m)

    async def next(self, timeout: float = 30) -> Message:
        with anyio.fail_after(timeout):
            return await self.receive.receive()


@contextlib.asynccontextmanager
async def _running(ex: Executor) -> AsyncIterator[Inbox]:
    """``ex`` running in a task group; the host task's errors pass through unwrapped."""
    inbox = Inbox()
    tg = anyio.create_task_group()
    await tg.__aenter__()
    try:
        await tg.start(ex.run, inbox.send)
        yield inbox
    finally:
        tg.cancel_scope.cancel()
        await tg.__aexit__(None, None, None)


ESCAPE = textwrap.dedent(
    """
    import os, signal, sys, time
    d = sys.argv[1]
    def child(how):
        pid = os.fork()
        if pid == 0:
            if how == "setsid":
                os.setsid()
            else:
                os.setpgid(0, 0)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # needs the SIGKILL
            open(os.path.join(d, how + ".pid"), "w").write(str(os.getpid()))
            time.sleep(1000)
            os._exit(0)
    child("setsid")
    child("setpgid")
    while not all(os.path.exists(os.path.join(d, n + ".pid")) for n in ("setsid", "setpgid")):
        time.sleep(0.02)
    if sys.argv[2] == "wait-deaf":  # only the cgroup's SIGKILL ends it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(d, "ready"), "w").close()
    if sys.argv[2].startswith("wait"):
        time.sleep(1000)
    """
)


def _wait(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _escaped_pids(d: Path) -> list[int]:
    return [int((d / f"{how}.pid").read_text()) for how in ("setsid", "setpgid")]


@pytest.fixture
def leftovers() -> Iterator[list[int]]:
    """PIDs to SIGKILL after the test: whatever a failed test left behind."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _all_die(pids: list[int]) -> None:
    assert _wait(lambda: not any(alive(p) for p in pids), timeout=10), [p for p in pids if alive(p)]


@needs_cgroups
@pytest.mark.anyio
@pytest.mark.parametrize("mode, sig", [("wait", signal.SIGTERM), ("wait-deaf", signal.SIGKILL)])
async def test_executor_cancel_reaches_processes_that_left_the_group(
        tmp_path: Path, mode: str, sig: int, leftovers: list[int]) -> None:
    ex = Executor(tmp_path / "state")
    assert ex.containment.startswith("cgroup2:")
    out = tmp_path / "out"
    out.mkdir()
    async with _running(ex) as inbox:
        started = await ex.launch(1, JobSpec(command=[sys.executable, "-S", "-c", ESCAPE, str(out), mode]), [0])
        await anyio.to_thread.run_sync(_wait, (out / "ready").exists)
        leftovers.extend(pids := _escaped_pids(out))
        cg = Path(ex.containment.removeprefix("cgroup2:")) / "job-1-0"
        assert set(pids) | {started.pid} <= set(cgroups.procs(str(cg)))
        assert pids[0] in ex.job_process_ids()  # its GPU memory is the job's
        await ex.signal(1, grace_s=0.5)
        exited = await inbox.next()
        assert isinstance(exited, ProcessExited) and exited.signal == sig
        assert not any(alive(p) for p in pids)
        assert not cg.exists()  # removed by the supervisor


@needs_cgroups
@pytest.mark.anyio
@pytest.mark.parametrize("zygote", [True, False])
async def test_executor_kills_what_a_finished_job_left_behind(
        tmp_path: Path, zygote: bool, leftovers: list[int]) -> None:
    ex = Executor(tmp_path / "state", zygote=zygote)
    out = tmp_path / "out"
    out.mkdir()
    async with _running(ex) as inbox:
        await ex.launch(1, JobSpec(command=[sys.executable, "-S", "-c", ESCAPE, str(out), "exit"]), [0])
        exited = await inbox.next()
        assert isinstance(exited, ProcessExited) and exited.exit_code == 0
        leftovers.extend(pids := _escaped_pids(out))
        # dead by the time the exit is reported: the GPUs are free for real
        assert not any(alive(p) for p in pids)


ADOPT_DAEMON = """
import anyio, json, sys
from pathlib import Path
from eventsched.domain.events import JobSpec
from eventsched.runtime.launch.executor import Executor

async def main():
    ex = Executor(Path(sys.argv[1]))
    s = await ex.launch(1, JobSpec(command=json.loads(sys.argv[2])), [0])
    print(s.pid, flush=True)
    await ex.run(lambda m: anyio.sleep(0))

anyio.run(main)
"""


@needs_cgroups
@pytest.mark.anyio
async def test_an_adopted_job_is_found_by_its_cgroup_and_cancelled_whole(
        tmp_path: Path, leftovers: list[int]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    state = tmp_path / "state"
    command = [sys.executable, "-S", "-c", ESCAPE, str(out), "wait-deaf"]
    daemon = subprocess.Popen([sys.executable, "-c", ADOPT_DAEMON, str(state), json.dumps(command)],
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(daemon.stdout.readline())  # type: ignore[union-attr]
        assert _wait((out / "ready").exists)
    finally:
        daemon.kill()  # the daemon dies; the job and its supervisor do not
        daemon.wait()
    leftovers.extend(pids := _escaped_pids(out) + [pid])
    ex = Executor(state)
    assert ex.recover({1: (pid, 0)}) == []
    assert set(pids) <= ex.job_process_ids()  # found through its cgroup, setsid'd child too
    async with _running(ex) as inbox:
        await ex.signal(1, grace_s=0.3)
        exited = await inbox.next()
        assert isinstance(exited, ProcessExited) and exited.signal == signal.SIGKILL
    assert not any(alive(p) for p in pids)


@pytest.mark.anyio
@pytest.mark.parametrize("use_cgroups", [True, False])
async def test_executor_applies_umask_and_limits_clamped(tmp_path: Path, use_cgroups: bool) -> None:
    import resource

    if use_cgroups and not HAVE_CGROUPS:
        pytest.skip("no writable cgroup v2 here")
    ex = Executor(tmp_path / "state", cgroups=use_cgroups)
    assert ex.containment.startswith("cgroup2:") == use_cgroups or ex.containment == "process-group"
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = tmp_path / "made"
    code = textwrap.dedent(
        f"""
        import os, resource
        open({str(target)!r}, "w").close()
        print("mode", oct(os.stat({str(target)!r}).st_mode & 0o777))
        print("nofile", *resource.getrlimit(resource.RLIMIT_NOFILE))
        print("core", *resource.getrlimit(resource.RLIMIT_CORE))
        """
    )
    spec = JobSpec(
        command=[sys.executable, "-S", "-c", code],
        umask=0o077,
        rlimits={"nofile": [256, INF], "core": [0, 0]},
    )
    async with _running(ex) as inbox:
        await ex.launch(1, spec, [0])
        exited = await inbox.next()
        assert isinstance(exited, ProcessExited) and exited.exit_code == 0, ex.log_path(1).read_text()
    log = ex.log_path(1).read_text()
    assert "mode 0o600" in log
    assert f"nofile 256 {hard}" in log  # unlimited asked, the daemon's hard limit given
    assert "core 0 0" in log


@pytest.mark.anyio
async def test_executor_refuses_malformed_limits_with_a_clear_reason(tmp_path: Path) -> None:
    from eventsched.runtime.launch.executor import LaunchError

    ex = Executor(tmp_path / "state")
    with pytest.raises(LaunchError, match="unknown resource limit 'bogus'"):
        await ex.launch(1, JobSpec(command=["/bin/true"], rlimits={"bogus": [1, 1]}), [0])


# --- a real root daemon, real users ----------------------------------------------------

JOB_SCRIPT = """\
#!/bin/sh
# $1: a folder for pid files; $2: "wait" or "exit"
d=$1
mkdir -p "$d"
setsid sh -c 'echo $$ > "$0/setsid.pid"; exec sleep 1000' "$d" &
python3 -c '
import os, signal, sys, time
os.setpgid(0, 0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1] + "/setpgid.pid", "w").write(str(os.getpid()))
time.sleep(1000)' "$d" &
while [ ! -s "$d/setsid.pid" ] || [ ! -s "$d/setpgid.pid" ]; do sleep 0.05; done
echo $$ > "$d/main.pid"
[ "$2" = exit ] && exit 0
wait
"""

FORGE = """\
import json, sys
from eventsched.wire.client import Client
from eventsched.domain.events import JobSpec
spec = JobSpec(command=["sh", "-c", "echo nofile $(ulimit -Hn); echo core $(ulimit -Hc)"], gpus=0,
               cwd="/tmp", rlimits=json.loads(sys.argv[2]), umask=0)
with Client(sys.argv[1]) as c:
    print(c.submit(spec))
"""


@pytest.fixture(scope="module")
def scripts(public_dir: Path) -> Path:  # noqa: F811
    folder = public_dir / "scripts-containment"
    folder.mkdir(mode=0o755, exist_ok=True)
    (folder / "escape.sh").write_text(JOB_SCRIPT)
    (folder / "escape.sh").chmod(0o755)
    (folder / "forge.py").write_text(FORGE)
    (folder / "forge.py").chmod(0o644)
    (folder / "config.toml").write_text("[scheduler]\nkill_grace_s = 1.0\n")
    return folder


@pytest.fixture(scope="module")
def daemon(public_dir: Path, scripts: Path):  # noqa: F811
    """A root daemon with hard limits below the users' (nofile 8192, no core files)."""
    saved = daemon_harness.EVENTSCHED
    daemon_harness.EVENTSCHED = ["prlimit", "--nofile=4096:8192", "--core=0:0", "--", *saved]
    try:
        d = Daemon(public_dir / "state-containment", gpus="fake:2",
                   extra=["--config", str(scripts / "config.toml")]).start()
    finally:
        daemon_harness.EVENTSCHED = saved
    try:
        yield d
    finally:
        d.stop()


def _submit(user, daemon: Daemon, *args: str) -> int:
    r = as_user(user, daemon.state_dir, "submit", "--gpus", "0.5", *args)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip())


def _pids(folder: Path) -> list[int]:
    return [int((folder / f"{n}.pid").read_text()) for n in ("setsid", "setpgid", "main")]




@pytest.mark.slow
@needs_root
def test_status_says_how_jobs_are_contained(daemon: Daemon) -> None:
    containment = daemon.status()["containment"]
    assert containment == "process-group" or containment.startswith("cgroup2:/")
    if containment == "process-group":
        assert "jobs that leave their process group escape cancel" in daemon.stderr()


def _escaping_job(user, daemon: Daemon, scripts: Path, name: str, mode: str, *args: str) -> tuple[int, Path]:
    """A job whose children leave its process group, writing their pids to ``~/name``."""
    if not daemon.status()["containment"].startswith("cgroup2:"):
        pytest.skip("this machine gives the daemon no writable cgroup v2")
    folder = Path(user.home) / name
    return _submit(user, daemon, *args, "--", str(scripts / "escape.sh"), str(folder), mode), folder


def _started(daemon: Daemon, job: int, folder: Path) -> list[int]:
    assert _wait(lambda: (folder / "main.pid").exists()), daemon.jobs()[job]
    return _pids(folder)


@pytest.mark.slow
@needs_root
def test_cancel_kills_every_process_of_the_job_even_those_that_left_its_group(
        users, daemon, scripts, leftovers) -> None:  # noqa: F811
    alice, _ = users
    job, folder = _escaping_job(alice, daemon, scripts, "cancel", "wait")
    leftovers.extend(pids := _started(daemon, job, folder))
    assert all(alive(p) for p in pids)
    r = as_user(alice, daemon.state_dir, "cancel", str(job))
    assert r.returncode == 0, r.stderr
    daemon.wait_states([job], {"cancelled"})
    # SIGTERM to all, then (kill_grace_s = 1) the cgroup is killed: the
    # setpgid child ignores SIGTERM
    _all_die(pids)


@pytest.mark.slow
@needs_root
def test_a_child_left_behind_by_a_finished_job_is_killed(users, daemon, scripts, leftovers) -> None:  # noqa: F811
    alice, _ = users
    job, folder = _escaping_job(alice, daemon, scripts, "leftover", "exit")
    daemon.wait_states([job], {"succeeded"})
    leftovers.extend(pids := _pids(folder)[:2])
    assert not any(alive(p) for p in pids)  # already dead when the exit was recorded


@pytest.mark.slow
@needs_root
def test_the_time_limit_kills_the_escaped_children(users, daemon, scripts, leftovers) -> None:  # noqa: F811
    _, bob = users
    job, folder = _escaping_job(bob, daemon, scripts, "limit", "wait", "--time-limit", "2s")
    leftovers.extend(pids := _started(daemon, job, folder))
    jobs = daemon.wait_states([job], {"failed", "cancelled", "lost", "succeeded"}, timeout=20)
    assert jobs[job]["state"] != "succeeded"
    _all_die(pids)


@pytest.mark.slow
@needs_root
def test_the_submitters_umask_and_open_file_limit_are_the_jobs(users, daemon) -> None:  # noqa: F811
    alice, _ = users
    job_cmd = "umask; ulimit -Sn; ulimit -Hn; touch $HOME/umask-made; stat -c %a $HOME/umask-made"
    r = run_as(alice, ["sh", "-c", f"umask 077; ulimit -n 256; eventsched submit --gpus 0 -- sh -c '{job_cmd}'"],
               env=user_env(alice, daemon.state_dir))
    assert r.returncode == 0, r.stderr
    job = int(r.stdout.strip())
    daemon.wait_states([job], {"succeeded"})
    lines = (daemon.state_dir / "jobs" / f"{job}.log").read_text().split()
    assert lines == ["0077", "256", "256", "600"], lines


@pytest.mark.slow
@needs_root
def test_a_user_cannot_raise_a_hard_limit_above_the_daemons(users, daemon, scripts) -> None:  # noqa: F811
    import resource

    alice, _ = users
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] <= 8192:
        pytest.skip("the users' own hard limit is not above the daemon's here")
    # the ordinary CLI: the user's hard limit (the test's, above 8192) comes down to the daemon's
    job = _submit(alice, daemon, "--gpus", "0", "--", "sh", "-c", "echo $(ulimit -Sn) $(ulimit -Hn) $(ulimit -Hc)")
    daemon.wait_states([job], {"succeeded"})
    out = (daemon.state_dir / "jobs" / f"{job}.log").read_text().split()
    assert out[1:] == ["8192", "0"], out
    assert int(out[0]) <= 8192
    # a forged request: unlimited everything
    forged = run_as(alice, [f"{VENV_BIN}/python", str(scripts / "forge.py"), str(daemon.socket),
                            json.dumps({"nofile": [INF, INF], "core": [INF, INF]})])
    assert forged.returncode == 0, forged.stderr
    job = int(forged.stdout.strip())
    daemon.wait_states([job], {"succeeded"})
    out = (daemon.state_dir / "jobs" / f"{job}.log").read_text().split()
    assert out == ["nofile", "8192", "core", "0"], out
    # an unknown limit is refused, at submission or at launch, with its name
    bad = run_as(alice, [f"{VENV_BIN}/python", str(scripts / "forge.py"), str(daemon.socket),
                         json.dumps({"bogus": [1, 1]})])
    if bad.returncode == 0:
        job = int(bad.stdout.strip())
        jobs = daemon.wait_states([job], {"failed"})
        assert "unknown resource limit 'bogus'" in json.dumps(jobs[job])
    else:
        assert "unknown resource limit 'bogus'" in bad.stderr


@needs_cgroups
def test_kill_all_falls_back_to_sigkill_of_each_pid_without_cgroup_kill(tmp_path: Path, monkeypatch) -> None:
    from eventsched.runtime.launch import cgroupfs

    cg, why = cgroups.Cgroups.setup(tmp_path)
    assert cg is not None, why
    path = cg.create(1, 0)
    sleepers = [subprocess.Popen(["sleep", "100"], start_new_session=True) for _ in range(3)]
    try:
        for p in sleepers:
            cgroupfs.write(os.path.join(path, "cgroup.procs"), str(p.pid))
        assert sorted(cgroups.procs(path)) == sorted(p.pid for p in sleepers)
        real_write = cgroupfs.write

        def no_kill_file(target: str, text: str) -> None:  # a kernel before 5.14
            if target.endswith("cgroup.kill"):
                raise FileNotFoundError(target)
            real_write(target, text)

        monkeypatch.setattr(cgroupfs, "write", no_kill_file)
        cgroups.kill_all(path)
        assert [p.wait(timeout=5) for p in sleepers] == [-signal.SIGKILL] * 3
        assert cgroups.remove(path, timeout_s=2.0)
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
        cg.remove_parent()


@pytest.mark.anyio
async def test_the_posix_spawn_path_takes_the_umask_too(tmp_path: Path) -> None:
    # no cgroup and no limit to change: the supervisor posix_spawns the job
    ex = Executor(tmp_path / "state", cgroups=False)
    target = tmp_path / "made"
    async with _running(ex) as inbox:
        await ex.launch(1, JobSpec(command=["touch", str(target)], umask=0o077), [0])
        exited = await inbox.next()
        assert isinstance(exited, ProcessExited) and exited.exit_code == 0
    assert target.stat().st_mode & 0o777 == 0o600
