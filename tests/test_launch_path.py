"""The launch path: a supervisor forked by the zygote gets its plan with the
request (no spec.json unless it is too big for one message), creates the
job's log itself (at its first output: a launch creates one inode, its
attempt record, before the job runs), and records the job's cgroups in its pid record so that a
restarted daemon can still clear them."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import anyio
import anyio.abc
import pytest

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import Message, ProcessExited, ProcessStarted
from eventsched.runtime.launch import cgroupfs, cgroups
from eventsched.runtime.launch.executor import Executor
from eventsched.runtime.launch.zygote import INLINE_SPEC_BYTES

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def running(ex: Executor) -> AsyncIterator[anyio.abc.ObjectReceiveStream[Message]]:
    tx, rx = anyio.create_memory_object_stream[Message](100)
    async with anyio.create_task_group() as tg:
        await tg.start(ex.run, tx.send)  # launches go through its zygote
        yield rx
        tg.cancel_scope.cancel()


async def _run(ex: Executor, job: int, spec: JobSpec) -> ProcessExited:
    async with running(ex) as rx:
        started = await ex.launch(job, spec, [0])
        assert isinstance(started, ProcessStarted)
        with anyio.fail_after(30):
            exited = await rx.receive()
    assert isinstance(exited, ProcessExited)
    return exited


async def test_a_zygote_launch_writes_no_spec_file(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    code = "import os; print(os.environ['EVENTSCHED_JOB_ID'])"
    exited = await _run(ex, 7, JobSpec(command=[sys.executable, "-S", "-c", code]))
    assert exited.exit_code == 0
    attempt = tmp_path / "jobs/7.0"
    assert not (tmp_path / "jobs/7.0.spec.json").exists()
    assert ex.log_path(7).read_text() == "7\n"
    # created by the supervisor, as the daemon would: private to the job's owner
    assert stat.S_IMODE(ex.log_path(7).stat().st_mode) == 0o600
    # the attempt is one file, a line per record: the pid line, then the exit line
    started, ended = (json.loads(line) for line in attempt.read_text().splitlines())
    assert {"cgroup", "memory_cgroup"} <= started.keys()
    parent = ex.containment.removeprefix("cgroup2:")
    assert started["cgroup"] == (f"{parent}/job-7-0" if ex.containment != "process-group" else "")
    assert ended["exit_code"] == 0
    assert sorted(p.name for p in attempt.parent.iterdir()) == ["7.0", "7.log"]
    assert stat.S_IMODE(attempt.stat().st_mode) == 0o600


async def test_a_launch_creates_one_file_and_the_log_comes_with_the_first_output(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    assert (await _run(ex, 5, JobSpec(command=["true"]))).exit_code == 0
    assert os.listdir(tmp_path / "jobs") == ["5.0"]  # no directory, no log: it printed nothing


async def test_a_plan_too_big_for_one_message_goes_through_spec_json(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    big = "x" * (INLINE_SPEC_BYTES + 1000)
    code = "import os; print(len(os.environ['BIG']))"
    spec = JobSpec(command=[sys.executable, "-S", "-c", code], env={"BIG": big, "PATH": os.environ["PATH"]})
    exited = await _run(ex, 8, spec)
    assert exited.exit_code == 0
    assert ex.log_path(8).read_text() == f"{len(big)}\n"
    spec_file = tmp_path / "jobs/8.0.spec.json"  # beside the attempt file
    assert spec_file.exists() and stat.S_IMODE(spec_file.stat().st_mode) == 0o600


async def test_a_failed_start_is_still_recorded(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    async with running(ex):
        with pytest.raises(Exception, match="command not found"):
            await ex.launch(9, JobSpec(command=["no-such-command-eventsched"]), [0])
    ended = json.loads((tmp_path / "jobs/9.0").read_text())  # the exit line alone: it never started
    assert ended["exit_code"] == 127 and "command not found" in ended["error"]


@pytest.mark.skipif(cgroups.Cgroups.setup("/nonexistent-probe")[0] is None, reason="no writable cgroup v2 here")
def test_a_restarted_daemon_clears_the_cgroup_a_lost_job_left(tmp_path: Path) -> None:
    ex = Executor(tmp_path)
    parent = ex.containment.removeprefix("cgroup2:")
    os.makedirs(f"{parent}/job-1-0")
    left = subprocess.Popen(["sleep", "100"], start_new_session=True)  # what the job left behind
    try:
        cgroupfs.write(f"{parent}/job-1-0/cgroup.procs", str(left.pid))
        # its supervisor recorded the start (with the job's cgroup), then died
        record = {"pid": 999999, "start_time": 1, "supervisor_pid": 999999, "supervisor_start_time": 1,
                  "cgroup": f"{parent}/job-1-0", "memory_cgroup": "", "started_at": 0.0}
        (tmp_path / "jobs/1.0").write_text(json.dumps(record) + "\n")
        [lost] = ex.recover({1: (999999, 1)})
        assert "supervisor gone" in lost.reason  # type: ignore[attr-defined]
        assert left.wait(timeout=10) == -signal.SIGKILL
        assert not os.path.exists(f"{parent}/job-1-0")
    finally:
        left.kill()
        left.wait()
        os.rmdir(parent)
