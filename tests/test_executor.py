"""The executor with real processes: environment, --cuda, shells, logs, exits,
signals, run-as-user, and surviving the daemon's death."""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import anyio
import pytest
from processes import alive

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import (
    Message,
    NeverLaunched,
    ProcessExited,
    ProcessLost,
    ProcessStarted,
)
from eventsched.runtime.launch.executor import (
    AlreadyLaunched,
    Executor,
    LaunchError,
    job_argv,
    rewrite_cuda,
)

PY = sys.executable

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Inbox:
    """Collects what the executor reports, like the engine's inbox."""

    def __init__(self) -> None:
        self.tx, self.rx = anyio.create_memory_object_stream[Message](100)

    async def send(self, m: Message) -> None:
        await self.tx.send(m)

    async def next(self, timeout: float = 30) -> Message:
        with anyio.fail_after(timeout):
            return await self.rx.receive()

    def pending(self) -> list[Message]:
        out = []
        while True:
            try:
                out.append(self.rx.receive_nowait())
            except anyio.WouldBlock:
                return out


@asynccontextmanager
async def running(ex: Executor) -> AsyncIterator[Inbox]:
    inbox = Inbox()
    async with anyio.create_task_group() as tg:
        await tg.start(ex.run, inbox.send)  # launches go through its zygote
        yield inbox
        tg.cancel_scope.cancel()


def py(code: str, *args: str) -> list[str]:
    return [PY, "-S", "-c", textwrap.dedent(code), *args]


PRINT_ENV = py(
    """
    import os, sys
    print("CVD=" + repr(os.environ.get("CUDA_VISIBLE_DEVICES")))
    print("JOB=" + os.environ.get("EVENTSCHED_JOB_ID", "-"))
    print("ARGV=" + repr(sys.argv[1:]))
    print("CWD=" + os.getcwd())
    """
)


async def run_job(ex: Executor, job: int, spec: JobSpec, gpu_ids: list[int]) -> tuple[ProcessExited, str]:
    async with running(ex) as inbox:
        started = await ex.launch(job, spec, gpu_ids)
        assert isinstance(started, ProcessStarted) and started.pid > 0 and started.start_time > 0
        exited = await inbox.next()
    assert isinstance(exited, ProcessExited) and exited.job == job
    return exited, ex.log_path(job).read_text() if ex.log_path(job).exists() else ""  # none: it printed nothing


def records(attempt: Path) -> list[dict]:
    """The whole lines of an attempt's file: its pid line, then its exit line."""
    try:
        text = attempt.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1]]


def pid_record(attempt: Path) -> dict:
    return records(attempt)[0]


def wait_for(cond, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# --- environment, --cuda, no shell -------------------------------------------------


async def test_job_sees_its_gpus_and_job_id(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    exited, log = await run_job(ex, 7, JobSpec(command=PRINT_ENV, cwd=str(tmp_path)), [1, 3])
    assert exited.exit_code == 0 and exited.signal is None
    assert "CVD='1,3'" in log and "JOB=7" in log and f"CWD={tmp_path}" in log


async def test_jobs_launched_one_after_another_each_get_their_own_env_and_log(tmp_path: Path) -> None:
    # after the first, launches use a pre-started supervisor: same contract
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        await anyio.sleep(0.1)
        for job in range(1, 6):
            await ex.launch(job, JobSpec(command=PRINT_ENV + [f"--cuda={job}"]), [job, 0])
            exited = await inbox.next()
            assert exited == ProcessExited(job=job, exit_code=0)
    for job in range(1, 6):
        log = ex.log_path(job).read_text()
        assert f"CVD='{job},0'" in log and f"JOB={job}\n" in log and f"--cuda={job},0" in log


async def test_cpu_only_job_sees_no_gpu(tmp_path: Path) -> None:
    _, log = await run_job(Executor(tmp_path), 1, JobSpec(command=PRINT_ENV, gpus=0), [])
    assert "CVD=''" in log


async def test_user_env_is_passed_but_cannot_override_the_assignment(tmp_path: Path) -> None:
    code = "import os; print(os.environ['MY_VAR'], os.environ['CUDA_VISIBLE_DEVICES'])"
    spec = JobSpec(command=py(code), env={"MY_VAR": "hello", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    _, log = await run_job(Executor(tmp_path), 1, spec, [2])
    assert log.strip() == "hello 2"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--cuda", "0", "--lr", "1"], ["--cuda", "2,5", "--lr", "1"]),
        (["--cuda=0,1", "x"], ["--cuda=2,5", "x"]),
        (["--epochs", "3"], ["--epochs", "3"]),
    ],
)
async def test_cuda_argument_is_rewritten_with_assigned_ids(tmp_path: Path, args, expected) -> None:
    _, log = await run_job(Executor(tmp_path), 1, JobSpec(command=PRINT_ENV + args), [2, 5])
    assert f"ARGV={expected!r}" in log


def test_rewrite_cuda_leaves_cpu_jobs_and_the_program_alone() -> None:
    assert rewrite_cuda(["p", "--cuda", "x", "--cuda"], [1]) == ["p", "--cuda", "1", "--cuda"]
    assert rewrite_cuda(["prog", "--cuda", "0"], []) == ["prog", "--cuda", "0"]


async def test_plain_command_is_never_interpreted_by_a_shell(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = f"$(touch {marker}); `touch {marker}` | > {marker}"
    spec = JobSpec(command=["echo", evil, "*"], cwd=str(tmp_path))
    assert job_argv(spec, [0]) == ["echo", evil, "*"]  # no bash -c
    exited, log = await run_job(Executor(tmp_path), 1, spec, [0])
    assert exited.exit_code == 0
    assert log == f"{evil} *\n"  # literally, no globbing either
    assert not marker.exists()


# --- the only shells ---------------------------------------------------------------


async def test_env_setup_runs_in_a_shell_before_the_command(tmp_path: Path) -> None:
    (tmp_path / "activate").write_text("export GREETING=hi\nexport CUDA_VISIBLE_DEVICES=9\n")
    code = "import os, sys; print(os.environ['GREETING'], os.environ['CUDA_VISIBLE_DEVICES'], sys.argv[1])"
    spec = JobSpec(
        command=py(code, "it's $(not) run"),
        env_setup=f"source {tmp_path}/activate",
    )
    exited, log = await run_job(Executor(tmp_path), 1, spec, [4])
    assert exited.exit_code == 0
    # the set-up ran; the job still sees its GPU; its arguments stay literal
    assert log.strip() == "hi 4 it's $(not) run"


async def test_failing_env_setup_stops_the_job_with_a_message(tmp_path: Path) -> None:
    spec = JobSpec(command=["touch", str(tmp_path / "ran")], env_setup="source /no/such/venv/bin/activate")
    exited, log = await run_job(Executor(tmp_path), 1, spec, [0])
    assert exited.exit_code != 0
    assert "environment set-up failed" in log
    assert not (tmp_path / "ran").exists()


async def test_conda_env_is_activated(tmp_path: Path) -> None:
    # A stand-in conda: `conda info --base` and the conda.sh it points to.
    base = tmp_path / "conda"
    (base / "etc/profile.d").mkdir(parents=True)
    (base / "etc/profile.d/conda.sh").write_text('conda() { export CONDA_DEFAULT_ENV="$2"; }\n')
    fake = tmp_path / "bin/conda"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho {base}\n")
    fake.chmod(0o755)
    spec = JobSpec(
        command=py("import os; print('ENV=' + os.environ['CONDA_DEFAULT_ENV'])"),
        conda="my env",
        env={"PATH": f"{fake.parent}:/usr/bin:/bin"},
    )
    exited, log = await run_job(Executor(tmp_path), 1, spec, [0])
    assert exited.exit_code == 0, log
    assert log.strip() == "ENV=my env"


# --- logs, exits, launch failures ----------------------------------------------------


async def test_output_log_holds_stdout_and_stderr_privately(tmp_path: Path) -> None:
    code = "import sys; print('to out', flush=True); print('to err', file=sys.stderr)"
    ex = Executor(tmp_path)
    _, log = await run_job(ex, 3, JobSpec(command=py(code)), [0])
    assert log == "to out\nto err\n"
    assert ex.log_path(3) == tmp_path / "jobs/3.log"
    assert stat.S_IMODE(ex.log_path(3).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "jobs").stat().st_mode) & 0o077 in (0, 0o011)


async def test_exit_code_is_reported(tmp_path: Path) -> None:
    exited, _ = await run_job(Executor(tmp_path), 1, JobSpec(command=py("raise SystemExit(3)")), [0])
    assert (exited.exit_code, exited.signal) == (3, None)


async def test_death_by_signal_is_reported(tmp_path: Path) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    exited, _ = await run_job(Executor(tmp_path), 1, JobSpec(command=py(code)), [0])
    assert (exited.exit_code, exited.signal) == (None, signal.SIGSEGV)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        (JobSpec(command=["no-such-program-xyz"]), "command not found: no-such-program-xyz"),
        (JobSpec(command=["/no/such/file"]), "No such file"),
        (JobSpec(command=["true"], cwd="/no/such/dir"), "/no/such/dir"),
        (JobSpec(command=[]), "empty command"),
        (JobSpec(command=["echo", "a\0b"]), "embedded null byte"),
    ],
)
async def test_launch_failure_is_one_clear_line(tmp_path: Path, spec: JobSpec, fragment: str) -> None:
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        with pytest.raises(LaunchError) as info:
            await ex.launch(1, spec, [0])
        assert fragment in str(info.value) and "\n" not in str(info.value)
        await anyio.sleep(0.2)
        assert inbox.pending() == []  # the engine records the failure, not us


async def test_a_job_is_never_launched_twice(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    marker = tmp_path / "runs"
    spec = JobSpec(command=["sh", "-c", f"echo run >> {marker}"])
    async with running(ex) as inbox:
        await ex.launch(1, spec, [0])
        with pytest.raises(AlreadyLaunched):
            await ex.launch(1, spec, [0])
        with pytest.raises(AlreadyLaunched):  # nor by another executor (a restarted daemon)
            await Executor(tmp_path).launch(1, spec, [0])
        await inbox.next()
        # a retry / requeue is a new attempt, and appends to the same log
        await ex.launch(1, spec, [0], attempt=1)
        await inbox.next()
    assert marker.read_text() == "run\nrun\n"


# --- signals ---------------------------------------------------------------------------


async def test_signal_terminates_the_process_group(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        started = await ex.launch(1, JobSpec(command=["sh", "-c", "sleep 100 & sleep 100; wait"]), [0])
        await ex.signal(1, grace_s=30)
        exited = await inbox.next()
    assert exited == ProcessExited(job=1, exit_code=None, signal=signal.SIGTERM)
    assert not alive(started.pid)


async def test_signal_kills_a_job_that_ignores_sigterm_after_the_grace(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = f"""
        import signal, time
        signal.signal(signal.SIGTERM, lambda *a: print("ignoring TERM", flush=True))
        open({str(ready)!r}, "w").close()
        while True:
            time.sleep(1)
    """
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        await ex.launch(1, JobSpec(command=py(code)), [0])
        await anyio.to_thread.run_sync(wait_for, ready.exists)
        with anyio.fail_after(1):  # signal() must not wait out the grace period
            await ex.signal(1, grace_s=0.5)
        assert inbox.pending() == []
        exited = await inbox.next()
    assert (exited.exit_code, exited.signal) == (None, signal.SIGKILL)
    assert "ignoring TERM" in ex.log_path(1).read_text()


async def test_signal_for_an_unknown_or_finished_job_is_harmless(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        await ex.signal(99, grace_s=0)  # never launched: nothing to do, nothing reported
        await anyio.sleep(0.2)
        assert inbox.pending() == []
        started = await ex.launch(1, JobSpec(command=["true"]), [0])
        exited = await inbox.next()
        assert isinstance(exited, ProcessExited) and exited.job == 1 and exited.exit_code == 0
        assert 1 not in ex.running_jobs()
        await ex.signal(1, grace_s=0)  # already gone: no second exit, no error
        await anyio.sleep(0.2)
        assert inbox.pending() == []
        assert started.pid > 0


async def test_leftover_background_processes_are_killed_when_the_job_ends(tmp_path: Path) -> None:
    pidfile = tmp_path / "bg"
    cmd = ["sh", "-c", f"sleep 1000 & echo $! > {pidfile}"]
    exited, _ = await run_job(Executor(tmp_path), 1, JobSpec(command=cmd), [0])
    assert exited.exit_code == 0
    bg = int(pidfile.read_text())
    await anyio.to_thread.run_sync(wait_for, lambda: not alive(bg))


async def test_a_killed_supervisor_makes_the_job_lost(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        started = await ex.launch(1, JobSpec(command=["sleep", "100"]), [0])
        sup = pid_record(tmp_path / "jobs/1.0")["supervisor_pid"]
        os.kill(sup, signal.SIGKILL)
        msg = await inbox.next()
    assert isinstance(msg, ProcessLost) and msg.job == 1 and str(started.pid) in msg.reason
    os.killpg(started.pid, signal.SIGKILL)


async def test_stopping_a_supervisor_stops_its_job_and_records_it(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        await ex.launch(1, JobSpec(command=["sleep", "100"]), [0])
        sup = pid_record(tmp_path / "jobs/1.0")["supervisor_pid"]
        os.kill(sup, signal.SIGTERM)
        assert await inbox.next() == ProcessExited(job=1, exit_code=None, signal=signal.SIGTERM)


async def test_job_process_ids_cover_the_job_and_its_children(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    child = tmp_path / "child"
    async with running(ex) as inbox:
        started = await ex.launch(1, JobSpec(command=["sh", "-c", f"sleep 100 & echo $! > {child}; wait"]), [0])
        await anyio.to_thread.run_sync(wait_for, lambda: child.exists() and child.read_text().strip())
        pids = ex.job_process_ids()
        assert {started.pid, int(child.read_text())} <= pids and os.getpid() not in pids
        assert ex.running_jobs() == {1: started.pid}
        await ex.signal(1, grace_s=0)
        await inbox.next()
    assert ex.job_process_ids() == set() and ex.running_jobs() == {}


# --- the daemon dies, the jobs do not ------------------------------------------------

DAEMON = """
import anyio, json, sys
from pathlib import Path
from eventsched.domain.events import JobSpec
from eventsched.runtime.launch.executor import Executor

async def main():
    ex = Executor(Path(sys.argv[1]))
    jobs = json.loads(sys.argv[2])
    out = {}
    for job, cmd in jobs.items():
        s = await ex.launch(int(job), JobSpec(command=cmd), [0])
        out[job] = [s.pid, s.start_time]
    print(json.dumps(out), flush=True)
    await ex.run(lambda m: anyio.sleep(0))

anyio.run(main)
"""


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _release(fifo: Path, code: str) -> None:
    with open(fifo, "w") as f:  # the job blocks reading until this
        f.write(code)


async def test_jobs_survive_a_killed_daemon_and_are_recovered(tmp_path: Path) -> None:
    state = tmp_path / "state"
    fifo_b, fifo_c = _fifo(tmp_path / "b"), _fifo(tmp_path / "c")
    wait_exit = "import sys; raise SystemExit(int(open(sys.argv[1]).read()))"
    jobs = {
        "1": py("raise SystemExit(5)"),  # finishes while the daemon is dead
        "2": py(wait_exit, str(fifo_b)),  # runs on; the log knows it started
        "3": py(wait_exit, str(fifo_c)),  # runs on; the log never recorded its start
    }
    daemon = subprocess.Popen([PY, "-c", DAEMON, str(state), json.dumps(jobs)], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(daemon.stdout.readline())
        wait_for(lambda: len(records(state / "jobs/1.0")) == 2)  # pid, exit
    finally:
        daemon.kill()
        daemon.wait()
    assert alive(pids["2"][0]) and alive(pids["3"][0])

    ex = Executor(state)
    msgs = ex.recover(
        {
            1: tuple(pids["1"]),
            2: tuple(pids["2"]),
            3: (0, 0),  # launched, but the log never recorded it as started
            4: (0, 0),  # placed, never launched
        }
    )
    assert msgs == [
        ProcessExited(job=1, exit_code=5),
        ProcessStarted(job=3, pid=pids["3"][0], start_time=pids["3"][1], log_path=str(ex.log_path(3))),
        NeverLaunched(job=4, reason="the daemon stopped before launching it"),
    ]
    async with running(ex) as inbox:
        await anyio.to_thread.run_sync(_release, fifo_b, "0")
        assert await inbox.next() == ProcessExited(job=2, exit_code=0)
        await anyio.to_thread.run_sync(_release, fifo_c, "7")
        assert await inbox.next() == ProcessExited(job=3, exit_code=7)
        with pytest.raises(AlreadyLaunched):  # the restarted daemon cannot run them again
            await ex.launch(2, JobSpec(command=jobs["2"]), [0])


async def test_adopted_job_can_be_signalled(tmp_path: Path) -> None:
    daemon = subprocess.Popen(
        [PY, "-c", DAEMON, str(tmp_path), json.dumps({"1": ["sleep", "100"]})],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = json.loads(daemon.stdout.readline())
    finally:
        daemon.kill()
        daemon.wait()
    ex = Executor(tmp_path)
    assert ex.recover({1: tuple(pids["1"])}) == []
    async with running(ex) as inbox:
        await ex.signal(1, grace_s=5)
        assert await inbox.next() == ProcessExited(job=1, exit_code=None, signal=signal.SIGTERM)


@pytest.mark.parametrize("torn", [False, True])
def test_recover_reports_lost_when_the_supervisor_vanished(tmp_path: Path, torn: bool) -> None:
    attempt = tmp_path / "jobs/1.0"
    attempt.parent.mkdir(parents=True)
    # a supervisor that recorded a start, then died without an exit record
    # (its exit line cut short, if torn)
    started = json.dumps({"pid": 999999, "start_time": 1, "supervisor_pid": 999999, "supervisor_start_time": 1})
    attempt.write_text(started + "\n" + ('{"exit_code": 0, "signal": nu' if torn else ""))
    (tmp_path / "jobs/2.0").touch()  # died before starting its job
    msgs = Executor(tmp_path).recover({1: (999999, 1), 2: (0, 0)})
    assert [type(m) for m in msgs] == [ProcessLost, ProcessLost]
    assert "999999" in msgs[0].reason


# --- the zygote: one long-lived process forks every supervisor -------------------------


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # [state, ppid, pgrp, session, ...]


def parent_of(pid: int) -> int:
    return int(_stat(pid)[1])


def zombie_children(ppid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                st = _stat(int(name))
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(st[1]) == ppid and st[0] == "Z":
                out.append(int(name))
    return out


def supervisor_of(state: Path, job: int) -> int:
    return pid_record(state / f"jobs/{job}.0")["supervisor_pid"]


async def test_launches_are_forked_by_one_zygote_in_its_own_session(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        for job in (1, 2):
            await ex.launch(job, JobSpec(command=["sleep", "100"]), [0])
        sup1, sup2 = supervisor_of(tmp_path, 1), supervisor_of(tmp_path, 2)
        zygote = parent_of(sup1)
        assert parent_of(sup2) == zygote and parent_of(zygote) == os.getpid()
        # none shares the daemon's session, nor each other's
        sessions = {_stat(p)[3] for p in (zygote, sup1, sup2)}
        assert len(sessions) == 3 and str(os.getsid(0)) not in sessions
        for job in (1, 2):
            await ex.signal(job, grace_s=5)
            assert isinstance(await inbox.next(), ProcessExited)
    await anyio.to_thread.run_sync(wait_for, lambda: not alive(zygote))  # stopped with run()


async def test_a_killed_zygote_leaves_jobs_running_and_launches_still_work(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        first = await ex.launch(1, JobSpec(command=["sleep", "100"]), [0])
        zygote = parent_of(supervisor_of(tmp_path, 1))
        os.kill(zygote, signal.SIGKILL)
        await anyio.to_thread.run_sync(wait_for, lambda: not alive(zygote))
        assert alive(first.pid) and alive(supervisor_of(tmp_path, 1))
        # the next launches restart the zygote
        await ex.launch(2, JobSpec(command=PRINT_ENV), [3])
        assert await inbox.next() == ProcessExited(job=2, exit_code=0)
        assert "CVD='3'" in ex.log_path(2).read_text()
        await ex.launch(3, JobSpec(command=["sleep", "100"]), [0])
        new_zygote = parent_of(supervisor_of(tmp_path, 3))
        assert new_zygote != zygote and parent_of(new_zygote) == os.getpid()
        # the orphaned supervisor still reports its job's end
        for job in (1, 3):
            await ex.signal(job, grace_s=5)
            assert await inbox.next() == ProcessExited(job=job, exit_code=None, signal=signal.SIGTERM)


async def test_one_worker_supervises_job_after_job_and_carries_nothing_over(tmp_path: Path) -> None:
    # a launch costs no fork when a worker is idle; the next job must not
    # inherit the last one's directory, umask, or log
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    show = py("import os; u = os.umask(0); print('CWD=' + os.getcwd(), 'UMASK=%o' % u)")
    ex = Executor(tmp_path / "state")
    own_umask = os.umask(0o022)
    os.umask(own_umask)
    async with running(ex) as inbox:
        await ex.launch(1, JobSpec(command=show, cwd=str(first_dir), umask=0o077), [0])
        assert await inbox.next() == ProcessExited(job=1, exit_code=0)
        await ex.launch(2, JobSpec(command=show, cwd=str(second_dir)), [0])
        assert await inbox.next() == ProcessExited(job=2, exit_code=0)
        worker = supervisor_of(tmp_path / "state", 1)
        assert supervisor_of(tmp_path / "state", 2) == worker and alive(worker)
        # idle, it holds neither job's directory nor log
        await anyio.to_thread.run_sync(wait_for, lambda: os.readlink(f"/proc/{worker}/fd/1") == os.devnull)
        assert os.readlink(f"/proc/{worker}/cwd") == "/"
    assert ex.log_path(1).read_text().split() == [f"CWD={first_dir}", "UMASK=77"]
    assert ex.log_path(2).read_text().split() == [f"CWD={second_dir}", f"UMASK={own_umask:o}"]
    await anyio.to_thread.run_sync(wait_for, lambda: not alive(worker))  # stopped with run()


async def test_a_launch_given_to_a_worker_that_died_idle_still_starts(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        await ex.launch(1, JobSpec(command=["true"]), [0])
        assert await inbox.next() == ProcessExited(job=1, exit_code=0)
        worker = supervisor_of(tmp_path, 1)
        os.kill(worker, signal.SIGKILL)
        await anyio.to_thread.run_sync(wait_for, lambda: not alive(worker))
        with anyio.fail_after(10):  # not the minute a silent supervisor is given
            await ex.launch(2, JobSpec(command=PRINT_ENV), [1])
            assert await inbox.next() == ProcessExited(job=2, exit_code=0)
        assert supervisor_of(tmp_path, 2) != worker
        assert "CVD='1'" in ex.log_path(2).read_text()


async def test_an_answer_whose_pipe_was_dropped_still_reports_the_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # out of descriptors, the kernel drops the pipe a worker sends: the job
    # itself is watched, and its worker's record read once written
    import socket as _socket

    from eventsched.runtime.launch import zygote

    real = _socket.recv_fds

    def dropping(sock: _socket.socket, bufsize: int, maxfds: int, flags: int = 0) -> tuple:
        data, fds, msg_flags, addr = real(sock, bufsize, maxfds, flags)
        for fd in fds:
            os.close(fd)
        return data, [], msg_flags, addr

    monkeypatch.setattr(zygote.socket, "recv_fds", dropping)
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        await ex.launch(1, JobSpec(command=["sh", "-c", "sleep 0.5; exit 3"]), [0])
        await ex.launch(2, JobSpec(command=["true"]), [0])
        with anyio.fail_after(20):
            exits = {m.job: m for m in [await inbox.next(), await inbox.next()]}
    assert exits == {1: ProcessExited(job=1, exit_code=3), 2: ProcessExited(job=2, exit_code=0)}


async def test_workers_outlive_the_daemon_only_as_long_as_their_job(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    async with running(ex) as inbox:
        long = await ex.launch(1, JobSpec(command=["sleep", "100"]), [0])
        await ex.launch(2, JobSpec(command=["true"]), [0])
        assert await inbox.next() == ProcessExited(job=2, exit_code=0)
        busy, idle = supervisor_of(tmp_path, 1), supervisor_of(tmp_path, 2)
        assert busy != idle
    # run() is over, as when the daemon stops or dies: the idle worker exits,
    # the busy one supervises its job to the end
    await anyio.to_thread.run_sync(wait_for, lambda: not alive(idle))
    assert alive(busy) and alive(long.pid)
    os.kill(long.pid, signal.SIGTERM)
    await anyio.to_thread.run_sync(wait_for, lambda: not alive(busy))
    # its exit is recorded, as a restarted daemon finds it
    assert Executor(tmp_path).recover({1: (long.pid, long.start_time)}) == [
        ProcessExited(job=1, exit_code=None, signal=signal.SIGTERM)
    ]


async def test_many_launches_at_once_leave_no_zombie_supervisors(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    marker = tmp_path / "ran"
    spec = JobSpec(command=["sh", "-c", f"echo $EVENTSCHED_JOB_ID >> {marker}"])
    async with running(ex) as inbox:
        async with anyio.create_task_group() as tg:
            for job in range(1, 51):
                tg.start_soon(ex.launch, job, spec, [0])
        exits = [await inbox.next() for _ in range(50)]
        assert sorted(m.job for m in exits) == list(range(1, 51))
        assert {(m.exit_code, m.signal) for m in exits} == {(0, None)}
        zygote = [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if _is_zygote(p)][0]
        await anyio.to_thread.run_sync(wait_for, lambda: zombie_children(zygote) == [])
    assert sorted(int(x) for x in marker.read_text().split()) == list(range(1, 51))


def _is_zygote(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"--zygote" in f.read() and parent_of(pid) == os.getpid()
    except (FileNotFoundError, ProcessLookupError):
        return False


async def test_cold_start_fallback_runs_jobs_the_same(tmp_path: Path) -> None:
    ex = Executor(tmp_path, zygote=False)
    exited, log = await run_job(ex, 7, JobSpec(command=PRINT_ENV + ["--cuda", "0"]), [2])
    assert exited.exit_code == 0
    assert "CVD='2'" in log and "JOB=7" in log and "'--cuda', '2'" in log
    async with running(ex):
        with pytest.raises(LaunchError, match="command not found: nope-xyz"):
            await ex.launch(8, JobSpec(command=["nope-xyz"]), [0])


@pytest.mark.parametrize("zygote", [True, False])
async def test_job_starts_with_no_signal_ignored(tmp_path: Path, zygote: bool) -> None:
    # supervisors ignore SIGHUP/SIGINT, and a daemon started with `&` by a
    # script inherits SIGINT and SIGQUIT ignored; a job must not inherit that
    saved = [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGQUIT)]
    try:
        ex = Executor(tmp_path, zygote=zygote)
        exited, log = await run_job(ex, 1, JobSpec(command=["grep", "SigIgn", "/proc/self/status"]), [0])
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGQUIT, saved[1])
    ignored = int(log.split()[1], 16)
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGPIPE, signal.SIGTERM, signal.SIGCHLD,
                signal.SIGXFSZ):
        assert not ignored & (1 << (sig - 1)), sig


async def test_a_relative_state_dir_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the zygote and its supervisors run in /: they must be given absolute paths
    monkeypatch.chdir(tmp_path)
    for zygote in (True, False):
        ex = Executor(Path(f"state-{zygote}"), zygote=zygote)
        exited, log = await run_job(ex, 1, JobSpec(command=PRINT_ENV), [0])
        assert exited.exit_code == 0 and "JOB=1" in log


DAEMON_RUNNING = """
import anyio, json, os, sys
from pathlib import Path
from eventsched.domain.events import JobSpec
from eventsched.runtime.launch.executor import Executor

async def main():
    ex = Executor(Path(sys.argv[1]))
    async with anyio.create_task_group() as tg:
        await tg.start(ex.run, lambda m: anyio.sleep(0))
        out = {}
        for job, cmd in json.loads(sys.argv[2]).items():
            s = await ex.launch(int(job), JobSpec(command=cmd), [0])
            out[job] = [s.pid, s.start_time]
        print(json.dumps(out), flush=True)
        await anyio.sleep_forever()

anyio.run(main)
"""


async def test_killed_daemon_leaves_zygote_launched_jobs_running_and_recoverable(tmp_path: Path) -> None:
    state = tmp_path / "state"
    fifo = _fifo(tmp_path / "f")
    wait_exit = "import sys; raise SystemExit(int(open(sys.argv[1]).read()))"
    jobs = {"1": py(wait_exit, str(fifo)), "2": ["sleep", "100"]}
    daemon = subprocess.Popen(
        [PY, "-c", DAEMON_RUNNING, str(state), json.dumps(jobs)], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = json.loads(daemon.stdout.readline())
        zygote = parent_of(supervisor_of(state, 1))
        assert parent_of(zygote) == daemon.pid
    finally:
        daemon.kill()
        daemon.wait()
    await anyio.to_thread.run_sync(wait_for, lambda: not alive(zygote))  # EOF from the dead daemon
    assert alive(pids["1"][0]) and alive(pids["2"][0])

    ex = Executor(state)
    assert ex.recover({1: tuple(pids["1"]), 2: tuple(pids["2"])}) == []
    async with running(ex) as inbox:
        await anyio.to_thread.run_sync(_release, fifo, "4")
        assert await inbox.next() == ProcessExited(job=1, exit_code=4)
        await ex.signal(2, grace_s=5)
        assert await inbox.next() == ProcessExited(job=2, exit_code=None, signal=signal.SIGTERM)


# --- as root, jobs run as their user --------------------------------------------------

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="run-as-user needs root")


@root_only
async def test_root_daemon_runs_the_job_as_its_user(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    work = Path(tempfile.mkdtemp(prefix="eventsched-user-"))
    try:
        os.chown(work, nobody.pw_uid, nobody.pw_gid)
        script = "id -u; id -g; id -G; echo HOME=$HOME USER=$USER; pwd; touch mine"
        spec = JobSpec(
            command=["sh", "-c", script],
            uid=nobody.pw_uid,
            gid=nobody.pw_gid,
            home="/home/nobody-ish",
            cwd=str(work),
        )
        ex = Executor(tmp_path)
        exited, log = await run_job(ex, 1, spec, [0])
        assert exited.exit_code == 0, log
        uid, gid, groups, env, cwd = log.splitlines()
        assert (int(uid), int(gid)) == (nobody.pw_uid, nobody.pw_gid)
        assert 0 not in {int(g) for g in groups.split()}  # root's groups dropped
        assert env == "HOME=/home/nobody-ish USER=nobody"
        assert cwd == str(work)
        assert (work / "mine").stat().st_uid == nobody.pw_uid
        assert ex.log_path(1).stat().st_uid == nobody.pw_uid
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()


@root_only
async def test_user_cannot_reach_a_directory_only_root_can(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    nobody = pwd.getpwnam("nobody")
    spec = JobSpec(command=["true"], uid=nobody.pw_uid, cwd=str(private))
    with pytest.raises(LaunchError, match="Permission denied"):
        await Executor(tmp_path).launch(1, spec, [0])
