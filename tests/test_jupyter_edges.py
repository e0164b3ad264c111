"""The notebook integration's edges: mistakes a user can make in a magic, a
handle's wait, cancel and follow when things do not go to plan, what-if with
options that do not fit, and the server extension's refusals. Each is seen as
the user sees it: one line and no traceback, and nothing changed.

A real IPython InteractiveShell, one real ``eventsched serve`` on fake GPUs for
the module, and (for the sidebar's server side) a real Jupyter server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from processes import stop_group
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import eventsched
from eventsched.jupyter.handle import JobHandle, JobTable
from eventsched.jupyter.magics import ArrayHandle
from eventsched.jupyter.server_ext import gpu_marks
from eventsched.jupyter.whatif import in_window
from eventsched.wire.client import ClientError

from notebook_harness import error_of, ip, magics_of, one_line_error, run, shell  # noqa: F401 (fixtures)
TOKEN = "eventsched-test"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from daemon_harness import Daemon

    d = Daemon(tmp_path_factory.mktemp("es-edges")).start()
    yield d
    d.stop()


@pytest.fixture
def live(ip: InteractiveShell, daemon: Any, monkeypatch: pytest.MonkeyPatch) -> InteractiveShell:
    monkeypatch.setenv("EVENTSCHED_STATE_DIR", str(daemon.state_dir))
    return ip


# --- mistakes caught before any daemon is asked ---------------------------------------


def test_an_unclosed_quote_is_one_line(ip, capsys) -> None:
    line = error_of(ip, "%gpuqueue --name 'half", capsys)
    assert line == "UsageError: %gpuqueue: cannot split the line: No closing quotation"


def test_interactive_and_array_do_not_go_together(ip, capsys) -> None:
    line = error_of(ip, "%gpusubmit --array 0-3 --interactive -- echo {{index}}", capsys)
    assert line == "UsageError: %gpusubmit: --interactive follows one job; it cannot be combined with --array"


def a_file(tmp_path: Path) -> Path:
    """A regular file, where a folder is wanted."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    return blocker


def test_a_cell_that_cannot_be_saved_is_one_line(ip, capsys, tmp_path: Path) -> None:
    blocker = a_file(tmp_path)
    magics_of(ip).cell_dir = str(blocker)
    line = error_of(ip, "%%gpusubmit --gpus 1\nprint('hi')\n", capsys)
    assert line == f"UsageError: %%gpusubmit: cannot save the cell in {blocker / '.eventsched-cells'}: Not a directory"
    assert blocker.read_text() == "not a folder"


ONLY_ALTERNATIVES = "%gpuwhatif --job: give only --gpus and --gpu-mem (policies are for a replay)"


@pytest.mark.parametrize("line, message", [
    ("%gpuwhatif --gpu-mem 8000", "%gpuwhatif: --gpu-mem goes with --job N"),
    ("%gpuwhatif --job 3 --gpus 1 --policy fifo", ONLY_ALTERNATIVES),
    ("%gpuwhatif --job 3 --gpus 1 --since 1d", ONLY_ALTERNATIVES),
    ("%gpuwhatif --job 3 --gpus two", "%gpuwhatif: --gpus ['two']: give a number of GPUs, e.g. --gpus 1"),
])
def test_gpuwhatif_options_that_do_not_fit(ip, capsys, line: str, message: str) -> None:
    assert error_of(ip, line, capsys) == f"UsageError: {message}"


def test_gpusql_takes_the_query_from_the_line_or_the_cell_not_both(ip, capsys) -> None:
    line = error_of(ip, "%%gpusql SELECT 1\nSELECT 2\n", capsys)
    assert line == "UsageError: %%gpusql: options only on the line; the query is the cell"


def test_scheduler_start_in_a_state_dir_that_cannot_be_made(ip, capsys, tmp_path: Path) -> None:
    state = a_file(tmp_path) / "state"
    line = error_of(ip, f"%gpuscheduler start --gpus fake:1 --state-dir {state}", capsys)
    assert line == f"UsageError: %gpuscheduler: cannot use {state}: Not a directory"
    assert magics_of(ip).state_dir != str(state)  # not remembered
    # nothing can listen under a file: the queue says no daemon, in one line
    line = error_of(ip, f"%gpuqueue --state-dir {state}", capsys)
    assert line.startswith(f"UsageError: no eventsched daemon is listening on {state / 'eventsched.sock'}")


def test_scheduler_start_gives_up_on_a_daemon_that_does_not_answer(ip, capsys, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from eventsched.jupyter import magics

    monkeypatch.setattr(magics, "START_TIMEOUT_S", 0.0)  # as if it were slow to come up
    state = tmp_path / "slow"
    line = error_of(ip, f"%gpuscheduler start --gpus fake:1 --state-dir {state}", capsys)
    started = magics_of(ip)._started
    assert started is not None
    try:
        assert line == (f"UsageError: %gpuscheduler: the daemon (pid {started.pid}) did not answer within 0s; "
                        f"see {state / 'serve.out'}")
        assert magics_of(ip).state_dir != str(state)  # not remembered
    finally:
        os.killpg(started.pid, signal.SIGTERM)
        started.wait(15)
        magics_of(ip)._started = None


def test_python_whatif_needs_a_policy_and_handle_whatif_an_alternative() -> None:
    with pytest.raises(ValueError, match=r"^name at least one policy, e\.g\. policies=\['best-fit', 'fair-share'\]$"):
        eventsched.whatif([], source="/nowhere", chart=False)
    with pytest.raises(ValueError, match=r"^give another request to compare with: gpus=\.\.\. and/or gpu_mem="):
        JobHandle(1, "/nonexistent.sock").whatif()


def test_a_window_over_a_history_with_no_jobs_keeps_every_event() -> None:
    from eventsched.domain import events as ev

    history = [ev.GpuPaused(seq=1, node="local", gpu=0), ev.GpuResumed(seq=2, node="local", gpu=0)]
    assert in_window(history, 60.0) == history


def test_an_array_handle_with_no_daemon_shows_what_it_knows(tmp_path: Path) -> None:
    array = ArrayHandle([5, 6, 7], tmp_path / "none.sock")
    assert len(array) == 3 and array[1].id == 6 and array[-1] is array.handles[-1]
    assert repr(array) == "<ArrayHandle array 5: 3 tasks (jobs 5-7)>"  # a repr never raises


def test_a_gpu_is_marked_for_what_its_jobs_do() -> None:
    gpu = {"id": 1, "paused": False}
    over = {"gpu_ids": [1], "gpu_mem_over": True, "idle_since": None}
    idle = {"gpu_ids": [1], "idle_since": 10.0}
    elsewhere = {"gpu_ids": [1], "node": "b", "gpu_mem_over": True, "idle_since": 10.0}
    assert gpu_marks(gpu, [over]) == ["over memory request"]
    assert gpu_marks(gpu, [idle]) == ["idle"]
    assert gpu_marks(gpu, [over, idle]) == ["over memory request"]  # one busy job: not idle
    both = [{**over, "idle_since": 5.0}]
    assert gpu_marks({**gpu, "paused": True}, both) == ["paused", "over memory request", "idle"]
    assert gpu_marks(gpu, [elsewhere]) == []  # node b's GPU 1 is another GPU


# --- against the module's daemon ------------------------------------------------------


def test_default_gpus_applies_only_when_none_is_given(live, daemon, capsys) -> None:
    magics_of(live).default_gpus = 0.25
    plain = run(live, "%gpusubmit -- true", capsys)[0].result
    given = run(live, "%gpusubmit --gpus 0.5 -- true", capsys)[0].result
    by_ids = run(live, "%gpusubmit --gpu-ids 2 -- true", capsys)[0].result
    jobs = daemon.wait_states([plain.id, given.id, by_ids.id], {"succeeded"})
    assert (jobs[plain.id]["gpus"], jobs[given.id]["gpus"]) == (0.25, 0.5)
    assert jobs[by_ids.id]["gpu_ids"] == [2] and jobs[by_ids.id]["gpus"] == 1


def test_interactive_prints_the_output_until_the_job_ends(live, capsys) -> None:
    result, out, err = run(live, "h = %gpusubmit --interactive -- sh -c 'echo one; sleep 0.3; echo two'", capsys)
    assert result.error_in_exec is None, err
    assert out == "one\ntwo\n"
    assert live.user_ns["h"].state == "succeeded"


def test_interrupting_interactive_detaches_and_the_job_keeps_running(live, daemon, capsys) -> None:
    def interrupt_once_it_prints() -> None:  # as the kernel's interrupt button does
        jobs = daemon.wait_for(lambda js: any(j["name"] == "detach" and j["state"] == "running" for j in js.values()),
                               what="the job to run")
        job = next(j for j in jobs.values() if j["name"] == "detach")
        daemon.wait_for(lambda _: "started" in JobHandle(job["id"], daemon.socket).logs(), what="its output")
        time.sleep(0.5)  # the cell has printed it by now
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_once_it_prints)
    interrupter.start()
    try:
        result, out, err = run(live, "h = %gpusubmit --interactive --name detach -- sh -c 'echo started; sleep 30'",
                               capsys)
    finally:
        interrupter.join()
    handle = live.user_ns["h"]
    try:
        assert result.error_in_exec is None, err
        assert out == f"started\n\ndetached; job {handle.id} keeps running\n"
        assert daemon.jobs()[handle.id]["state"] == "running"
    finally:
        handle.cancel()


def test_wait_timeout_leaves_the_job_alone(live, daemon, capsys) -> None:
    handle = run(live, "%gpusubmit --name slow -- sleep 30", capsys)[0].result
    try:
        daemon.wait_states([handle.id], {"running"})
        with pytest.raises(TimeoutError, match=rf"^job {handle.id} is still running after 0\.3s$"):
            handle.wait(timeout=0.3, poll=0.05)
        assert handle.state == "running"
    finally:
        handle.cancel()
    assert handle.wait(timeout=30) == "cancelled"


def test_a_queued_job_has_no_output_yet_and_tail_keeps_the_last_lines(live, daemon, capsys) -> None:
    first = run(live, "%gpusubmit -- sh -c 'echo 1; echo 2; echo 3; sleep 30'", capsys)[0].result
    after = run(live, f"%gpusubmit --after {first.id} -- true", capsys)[0].result
    try:
        daemon.wait_for(lambda jobs: jobs[first.id]["state"] == "running" and first.logs().count("\n") == 3,
                        what="three lines of output")
        assert first.logs(tail=2) == "2\n3"
        assert after.state == "queued" and after.logs() == ""
    finally:
        run(live, f"%gpucancel {first.id} {after.id}", capsys)


def test_a_job_the_daemon_does_not_know(live, daemon) -> None:
    handle = JobHandle(987654, daemon.socket)
    with pytest.raises(LookupError, match="^the daemon knows no job 987654$"):
        handle.state
    assert repr(handle) == "<JobHandle job 987654>"


def test_cancelling_only_finished_jobs_is_refused_in_one_line(live, daemon, capsys) -> None:
    done = run(live, "%gpusubmit -- true", capsys)[0].result
    assert done.wait(timeout=30) == "succeeded"
    line = error_of(live, f"%gpucancel {done.id}", capsys)
    assert line.startswith(f"UsageError: %gpucancel: job {done.id}: ")
    assert daemon.jobs()[done.id]["state"] == "succeeded"
    with pytest.raises(ClientError, match=rf"^job {done.id}: "):  # the handle says the same
        done.cancel()
    # with one that can be cancelled: that one is, the other named on stderr
    sleeper = run(live, "%gpusubmit -- sleep 30", capsys)[0].result
    result, _, err = run(live, f"%gpucancel {done.id} {sleeper.id}", capsys)
    assert result.error_in_exec is None, err
    assert [j["id"] for j in result.result] == [sleeper.id]
    assert err == line.removeprefix("UsageError: %gpucancel: ") + "\n"
    assert sleeper.wait(timeout=30) == "cancelled"


def test_an_array_waits_times_out_and_cancels_as_one(live, daemon, capsys) -> None:
    result, _, err = run(live, "a = %gpusubmit --gpus 0.25 --array 0-2 -- sleep 30", capsys)
    assert result.error_in_exec is None, err
    array = live.user_ns["a"]
    assert isinstance(array, ArrayHandle) and len(array) == 3
    with pytest.raises(TimeoutError, match=rf"^array {array.array_id}: 3 of 3 tasks not finished after 0\.2s$"):
        array.wait(timeout=0.2, poll=0.05)
    assert array.cancel() is array
    assert array.wait(timeout=30) == {i: "cancelled" for i in array.ids}
    first, last = array.ids[0], array.ids[-1]
    assert repr(array) == f"<ArrayHandle array {array.array_id}: 3 tasks (jobs {first}-{last}): 3 cancelled>"


def test_a_queue_table_is_a_sequence_and_a_dataframe(live, daemon, capsys) -> None:
    done = run(live, "%gpusubmit --name tabled -- true", capsys)[0].result
    done.wait(timeout=30)
    table = run(live, "%gpuqueue --all --name tabled", capsys)[0].result
    assert isinstance(table, JobTable)
    assert table[0]["id"] == done.id
    frame = table.to_dataframe()
    assert frame.loc[0, "id"] == done.id and frame.loc[0, "state"] == "succeeded"


def test_python_whatif_takes_one_policy_as_a_string(daemon) -> None:
    done = daemon.submit("--name", "replayed", "--", "true")
    daemon.wait_states([done], {"succeeded"})
    table = eventsched.whatif("fifo", source=daemon.state_dir, chart=False)
    assert [r["policy"] for r in table.rows] == ["as recorded", "fifo"]
    assert table.row("fifo")["jobs"] == table.row("as recorded")["jobs"] >= 1


def test_scheduler_status_names_the_daemon(live, daemon, capsys) -> None:
    result, _, err = run(live, "%gpuscheduler status", capsys)
    assert result.error_in_exec is None, err
    pid = daemon.process.pid
    assert repr(result.result).startswith(f"eventsched daemon pid {pid} answers on {daemon.socket} (log at seq ")
    assert result.result.data["pid"] == pid


def test_scheduler_start_finds_the_running_daemon_by_its_socket(ip, daemon, capsys) -> None:
    result, _, err = run(ip, f"%gpuscheduler start --socket {daemon.socket}", capsys)
    assert result.error_in_exec is None, err
    pid = daemon.process.pid
    assert repr(result.result) == f"an eventsched daemon is already running (pid {pid}) on {daemon.socket}"
    assert magics_of(ip).socket == str(daemon.socket)  # later magics talk to it
    assert run(ip, "%gpuqueue", capsys)[0].error_in_exec is None


# --- a daemon this kernel did not start -----------------------------------------------


def test_scheduler_stop_of_a_daemon_started_elsewhere(ip, capsys, tmp_path: Path) -> None:
    from daemon_harness import Daemon

    other = Daemon(tmp_path / "other", gpus="fake:1").start()
    assert other.process is not None
    reaper = threading.Thread(target=other.process.wait)  # as init would: a stopped daemon leaves no zombie
    reaper.start()
    try:
        result, _, err = run(ip, f"%gpuscheduler stop --socket {other.socket}", capsys)
        assert result.error_in_exec is None, err
        assert repr(result.result) == f"eventsched daemon (pid {other.process.pid}) stopped"
    finally:
        other.stop()
        reaper.join()


# --- the server extension, over HTTP as the sidebar asks it ----------------------------


@pytest.fixture(scope="module")
def jupyter(daemon: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A Jupyter server with the extension, finding the daemon's socket through a
    linked folder, so that a test can take the daemon away or make it unreachable."""
    from daemon_harness import free_port

    root = tmp_path_factory.mktemp("es-jupyter")
    link = root / "daemon"
    link.symlink_to(daemon.socket.parent)
    port = free_port()
    env = {**os.environ, "EVENTSCHED_SOCKET": str(link / daemon.socket.name),
           "JUPYTER_RUNTIME_DIR": str(root / "runtime")}
    log = root / "server.log"
    with open(log, "wb") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
             f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={TOKEN}",
             *(["--allow-root"] if os.geteuid() == 0 else [])],
            env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True, cwd=root)
    base = f"http://127.0.0.1:{port}/eventsched"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, log.read_text()[-2000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.2)
        yield base, link
    finally:
        stop_group(server)


def ask(base: str, path: str, method: str = "GET") -> dict[str, Any]:
    request = urllib.request.Request(f"{base}/{path}", method=method, data=b"" if method == "POST" else None,
                                     headers={"Authorization": f"token {TOKEN}"})
    with urllib.request.urlopen(request, timeout=20) as reply:
        return json.loads(reply.read())


def test_the_server_extension_answers_refusals_in_one_line(jupyter, daemon) -> None:
    base, link = jupyter
    done = daemon.submit("--name", "ended", "--", "true")
    daemon.wait_states([done], {"succeeded"})
    refused = ask(base, f"jobs/{done}/cancel", "POST")
    assert refused["ok"] is False and refused["message"].startswith(f"job {done}: ") and "\n" not in refused["message"]
    assert daemon.jobs()[done]["state"] == "succeeded"
    unknown = ask(base, "jobs/987654/explain")
    assert unknown["ok"] is False and "987654" in unknown["message"] and "\n" not in unknown["message"]
    # the daemon goes away, then its socket's folder is a file: each said in one line
    socket = link / daemon.socket.name
    elsewhere = link.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "a-file").write_text("")
    try:
        link.unlink()
        link.symlink_to(elsewhere)
        gone = ask(base, "state")
        assert gone == {"ok": False, "message": f"no eventsched daemon is listening on {socket}; start one with "
                                                "`eventsched serve` (or `eventsched serve --gpus fake:4` without GPUs)"}
        link.unlink()
        link.symlink_to(elsewhere / "a-file")
        assert ask(base, "state") == gone  # its folder a file now: no daemon there either, in the same words
    finally:
        link.unlink()
        link.symlink_to(daemon.socket.parent)
    back = ask(base, "state")  # the sidebar's next poll works again
    assert "ok" not in back and len(back["gpus"]) == 4
