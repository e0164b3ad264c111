"""The CLI as the predecessors' users expect it: ``cancel A B C`` cancels what
it can and names the rest (exit 1), ``submit --interactive`` exits with the
job's exit code, and ``--dedupe``'s hash covers the job's environment."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import EVENTSCHED, Daemon

from eventsched import core
from eventsched.cli import content_hash, job_exit_status, parse_cancel_ids
from eventsched.domain.dedupe import SESSION_ENV
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.projections.cluster import ClusterState
from eventsched.runtime.api.server import cancel_plan


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("fixes") / "state", gpus="fake:4:16384") as d:
        yield d


# --- cancel -----------------------------------------------------------------------


def test_cancel_cancels_what_it_can_and_reports_each_other_job(daemon: Daemon, tmp_path: Path) -> None:
    running = daemon.submit("--", "sh", "-c", f"while [ ! -e {tmp_path / 'never'} ]; do sleep 0.05; done")
    queued = daemon.submit("--gpus", "4", "--after", str(running), "--", "true")
    done = daemon.submit("--", "true")
    daemon.wait_states([running, done], {"running", "succeeded"})
    daemon.wait_states([done], {"succeeded"})

    result = daemon.cli("cancel", str(running), str(done), "99999", str(queued))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"job {done}: already succeeded", "job 99999: no such job"]
    assert sorted(int(line.split()[0]) for line in result.stdout.splitlines()) == sorted([running, queued])
    jobs = daemon.wait_states([running, queued], {"cancelled"})
    assert jobs[done]["state"] == "succeeded"

    clean = daemon.submit("--gpus", "4", "--after", str(done), "--", "sh", "-c", "sleep 30")
    ok = daemon.cli("cancel", str(clean))
    assert ok.returncode == 0 and ok.stderr == ""
    daemon.wait_states([clean], {"cancelled"})

    nothing = daemon.cli("cancel", str(done), "12_x")
    assert nothing.returncode == 2 and "12_x" in nothing.stderr and len(nothing.stderr.splitlines()) == 1


def test_cancel_plan_names_the_owner_and_spares_others_jobs() -> None:
    state = ClusterState()
    infos = [m.GpuInfo(gpu=i, uuid=f"GPU-{i}", model="fake", memory_total_mib=16000) for i in range(4)]
    core.handle(state, m.Started(node="local", pid=1, version="t", gpu_backend="fake", gpus=infos,
                                 config=m.SchedulerConfig()), 1.0)
    for uid, user in ((1000, "ann"), (1001, "bob")):
        core.handle(state, m.Submit(spec=ev.JobSpec(command=["x"], uid=uid, user=user, gpus=4)), 2.0)
    core.handle(state, m.Submit(spec=ev.JobSpec(command=["x"], uid=1000, user="ann", gpus=4, array_cap=0),
                                array=[0, 1, 2]), 3.0)
    ann, bob, array = 1, 2, 3
    ids, refused = cancel_plan(state, [ann, bob, array], [(array, 2), (array, 7)], 1000, arrays=True)
    assert ids == [ann, array, array + 1, array + 2]
    assert refused == [{"job": bob, "reason": "belongs to bob", "kind": "forbidden"},
                       {"job": f"{array}_7", "reason": f"array {array} has no task 7", "kind": "not_found"}]
    # without ``arrays`` (the Python API's Client.cancel) an id is one job
    ids, _ = cancel_plan(state, [array], [], 1000)
    assert ids == [array]
    # root may cancel anyone's job
    ids, refused = cancel_plan(state, [bob], [], 0)
    assert (ids, refused) == ([bob], [])


def test_cancel_ids_parse_like_slurm() -> None:
    assert parse_cancel_ids(["12", "13,14", "20_3"]) == ([12, 13, 14], [(20, 3)])
    for bad in (["x"], ["12_"], [","]):
        with pytest.raises(Exception) as info:
            parse_cancel_ids(bad)
        assert "job id" in str(info.value)


# --- submit --interactive -----------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "code"),
    [(["sh", "-c", "echo hello; exit 3"], 3), (["sh", "-c", "kill -TERM $$"], 143), (["true"], 0), (["exit 7"], 7)],
)
def test_interactive_exits_with_the_jobs_exit_code(daemon: Daemon, command: list[str], code: int) -> None:
    result = daemon.cli("submit", "--interactive", "--", *command)
    assert result.returncode == code, (result.stdout, result.stderr)
    if code == 3:
        assert result.stdout.splitlines()[1] == "hello"  # the id, then the job's output


def test_exit_status_of_a_job_that_never_ran() -> None:
    assert job_exit_status({"state": "cancelled", "exit_code": None, "signal": None}) == 1
    assert job_exit_status({"state": "failed", "exit_code": None, "signal": 9}) == 137
    assert job_exit_status({"state": "succeeded", "exit_code": 0, "signal": None}) == 0


# --- --dedupe covers the environment -------------------------------------------------


def test_dedupe_hash_covers_the_jobs_environment(daemon: Daemon, tmp_path: Path) -> None:
    def submit(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*EVENTSCHED, "submit", "--dedupe", "--", "sh", "-c", f"while [ ! -e {tmp_path / 'go'} ]; do sleep 0.05; done"],
            env={**daemon.env(), **env}, capture_output=True, text=True, timeout=30, cwd=tmp_path,
        )

    first = submit(LEARNING_RATE="0.1")
    assert first.returncode == 0, first.stderr
    again = submit(LEARNING_RATE="0.1", OLDPWD="/elsewhere", SHLVL="7")  # same job, another terminal
    assert again.returncode != 0 and f"duplicate of job {int(first.stdout)}" in again.stderr
    other = submit(LEARNING_RATE="0.2")  # another environment: another job
    assert other.returncode == 0, other.stderr
    (tmp_path / "go").touch()
    daemon.wait_states([int(first.stdout), int(other.stdout)], {"succeeded"})


def test_content_hash_is_order_free_and_ignores_the_terminal_session() -> None:
    import argparse

    args = argparse.Namespace(conda="", env_setup="")
    base = content_hash(["python", "t.py"], "/w", args, {"A": "1", "B": "2"})
    assert content_hash(["python", "t.py"], "/w", args, {"B": "2", "A": "1"}) == base
    assert content_hash(["python", "t.py"], "/w", args, {"A": "1", "B": "3"}) != base
    assert content_hash(["python", "t.py"], "/w", args, {"A": "1", "B": "2", **{k: "x" for k in SESSION_ENV}}) == base
