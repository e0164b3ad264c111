"""The notebook magics in a real IPython InteractiveShell.

Fast tests need no daemon (parsing, one-line errors, the panel's fold); the
ones marked slow talk to a real ``eventsched serve`` on fake GPUs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from IPython.core.interactiveshell import InteractiveShell

from eventsched.domain import events as ev
from eventsched.jupyter.handle import JobHandle, JobTable, LogText, Message
from eventsched.jupyter.magics import parse_submit, split_sql_line
from eventsched.jupyter.widgets import PanelModel, render_html, render_text

from notebook_harness import ip, magics_of, one_line_error, run, shell  # noqa: F401 (fixtures)


# --- parsing -----------------------------------------------------------------


def test_trailing_gpus_after_the_command_belongs_to_the_command() -> None:
    args, command = parse_submit("--gpus 0.5 python train.py --gpus 2")
    assert args.gpus == 0.5
    assert command == ["python", "train.py", "--gpus", "2"]

    args, command = parse_submit("--gpus 0.25 --name t -- python train.py --gpus 2 --name x")
    assert (args.gpus, args.name) == (0.25, "t")
    assert command == ["python", "train.py", "--gpus", "2", "--name", "x"]


def test_quotes_group_words_like_a_shell() -> None:
    _, command = parse_submit("-- python -c 'print(\"a b\")'")
    assert command == ["python", "-c", 'print("a b")']


def test_a_command_both_before_and_after_the_separator_is_refused(ip, capsys) -> None:
    result, _, err = run(ip, "%gpusubmit python -- echo hi", capsys)
    assert "give only one" in one_line_error(result, err)


def test_bad_option_is_one_line_naming_the_expanded_value(ip, capsys) -> None:
    result, _, err = run(ip, "share = 'half'\n%gpusubmit --gpus $share -- echo hi", capsys)
    line = one_line_error(result, err)
    assert "--gpus" in line and "'half'" in line


def test_brace_expansion_evaluates_python(ip, capsys) -> None:
    result, _, err = run(ip, "low = 3\n%gpusubmit --gpu-ids {low}-{low-2} -- echo hi", capsys)
    assert "'3-1'" in one_line_error(result, err)


def test_no_command_is_explained(ip, capsys) -> None:
    result, _, err = run(ip, "%gpusubmit --gpus 1", capsys)
    assert "no command given" in one_line_error(result, err)


def test_help_prints_options_without_an_error(ip, capsys) -> None:
    result, out, err = run(ip, "%gpusubmit -h", capsys)
    assert result.error_in_exec is None
    assert "--gpu-mem" in out and "%gpusubmit" in out


@pytest.mark.parametrize("magic", ["%gpusubmit -- echo hi", "%gpuqueue", "%gpucancel 1", "%gpustatus",
                                   "%gpuscheduler status"])
def test_no_daemon_says_how_to_start_one(ip, capsys, magic: str) -> None:
    result, _, err = run(ip, magic, capsys)
    line = one_line_error(result, err)
    assert "no eventsched daemon" in line
    assert "%gpuscheduler start --gpus fake:4" in line


def test_config_magic_sets_the_socket(ip, capsys, tmp_path: Path) -> None:
    sock = tmp_path / "elsewhere.sock"
    run(ip, f"%config EventschedMagics.socket = '{sock}'", capsys)
    assert magics_of(ip).socket == str(sock)
    result, _, err = run(ip, "%gpuqueue", capsys)
    assert str(sock) in one_line_error(result, err)


def test_config_state_dir_decides_the_socket(ip, capsys, tmp_path: Path) -> None:
    run(ip, f"%config EventschedMagics.state_dir = '{tmp_path / 'sd'}'", capsys)
    result, _, err = run(ip, "%gpuqueue", capsys)
    assert str(tmp_path / "sd" / "eventsched.sock") in one_line_error(result, err)


def test_cancel_needs_job_ids(ip, capsys) -> None:
    result, _, err = run(ip, "%gpucancel abc", capsys)
    assert "'abc' is not a job id" in one_line_error(result, err)
    result, _, err = run(ip, "%gpucancel", capsys)
    assert "%gpucancel" in one_line_error(result, err)


def test_scheduler_needs_an_action(ip, capsys) -> None:
    result, _, err = run(ip, "%gpuscheduler launch", capsys)
    assert "start" in one_line_error(result, err)
    result, _, err = run(ip, "%gpuscheduler start --bogus", capsys)
    assert "--bogus" in one_line_error(result, err)


def test_scheduler_start_reports_a_daemon_that_dies(ip, capsys, tmp_path: Path) -> None:
    # an unknown policy makes `serve` exit at once: the magic says why, in one line
    state = tmp_path / "dies"
    result, _, err = run(ip, f"%gpuscheduler start --gpus fake:1 --policy no-such-policy --state-dir {state}", capsys)
    line = one_line_error(result, err)
    assert "exited with status" in line
    assert (state / "serve.out").exists()


def test_sql_options_and_errors(ip, capsys) -> None:
    assert split_sql_line("-o df SELECT * FROM jobs WHERE name = 'a b'") == (
        "df", None, "SELECT * FROM jobs WHERE name = 'a b'")
    assert split_sql_line("--state-dir /x -o d SELECT 1") == ("d", "/x", "SELECT 1")
    result, _, err = run(ip, "%gpusql", capsys)
    assert "no query" in one_line_error(result, err)
    result, _, err = run(ip, "%gpusql -o 1x SELECT 1", capsys)
    assert "not a Python name" in one_line_error(result, err)
    result, _, err = run(ip, "%gpusql --frobnicate SELECT 1", capsys)
    assert "--frobnicate" in one_line_error(result, err)


# --- results render as HTML and text ---------------------------------------------


def test_returned_objects_have_html_and_text() -> None:
    jobs = [{"id": 7, "name": "<b>x</b>", "state": "running", "gpus": 0.5, "gpu_ids": [1],
             "submitted_at": 0.0, "started_at": time.time() - 5, "ended_at": None, "exit_code": None}]
    table = JobTable(jobs)
    assert "running" in repr(table) and "7" in repr(table)
    assert "data-state='running'" in table._repr_html_() and "&lt;b&gt;" in table._repr_html_()
    assert "no jobs" in repr(JobTable([]))
    assert Message("started").__repr__() == "started" and "started" in Message("started")._repr_html_()
    assert LogText("a<b")._repr_html_() == "<pre style='max-height:30em;overflow:auto'>a&lt;b</pre>"
    handle = JobHandle(3, "/nonexistent.sock")  # a repr never raises, even with no daemon
    bundle = handle._repr_mimebundle_()
    assert "job 3" in bundle["text/plain"] and "job 3" in bundle["text/html"]


# --- the panel's fold ---------------------------------------------------------


def _status() -> dict[str, Any]:
    gpu = {"allocated": 0.0, "paused": False, "lost": False, "utilization": 0.0, "memory_used_mib": 0,
           "memory_total_mib": 16384, "temperature_c": 30.0, "jobs": []}
    running = {"id": 1, "name": "old", "user": "u", "state": "running", "priority": 0, "gpus": 1.0,
               "gpu_ids": [0], "submitted_at": 1.0, "started_at": 2.0, "ended_at": None, "exit_code": None}
    return {"gpus": [{"id": 0, **gpu}, {"id": 1, **gpu}], "jobs": [running], "policy": "best-fit", "seq": 10}


def test_panel_groups_gpus_by_node_and_keeps_same_ids_apart() -> None:
    """Two nodes both have a GPU 0: the panel shows each under its node, and a
    job placed on node b's GPU 0 fills that bar, not node a's."""
    gpu = {"allocated": 0.0, "paused": False, "lost": False, "utilization": 0.0, "memory_used_mib": 0,
           "memory_total_mib": 16384, "temperature_c": 30.0, "jobs": []}
    status = {"gpus": [{"id": 0, "node": "a", **gpu}, {"id": 0, "node": "b", **gpu}, {"id": 1, "node": "b", **gpu}],
              "jobs": [], "policy": "best-fit", "seq": 1}
    model = PanelModel.from_status(status)
    spec = ev.JobSpec(command=["true"], name="on-b", gpus=1)
    model.fold([
        ev.JobSubmitted(seq=2, ts=1.0, job=7, spec=spec),
        ev.JobPlaced(seq=3, ts=2.0, job=7, node="b", gpu_ids=[0], share=1.0),
        ev.GpuPaused(seq=4, node="a", gpu=0),
    ])
    assert model.gpus[("b", 0)]["allocated"] == 1.0 and model.gpus[("b", 0)]["jobs"] == [7]
    assert model.gpus[("a", 0)]["allocated"] == 0.0 and model.gpus[("a", 0)]["paused"]
    assert not model.gpus[("b", 0)]["paused"]
    text = render_text(model, 3.0)
    # each node's state first (a's only GPU is paused: it takes nothing new), then the GPUs
    assert text.splitlines()[:2] == ["node a: draining", "node b: up"]
    assert [line.split(":")[0] for line in text.splitlines()[2:5]] == ["a", "b", "b"]
    assert "GPU 0" not in text
    page = render_html(model, 3.0)
    assert page.index("node a · draining") < page.index("a:0") < page.index("node b · up") < page.index("b:0")
    assert page.index("b:0") < page.index("b:1")
    model.fold([ev.NodeLeft(seq=5, ts=4.0, node="b", reason="Ray: the node died"),
                ev.GpuResumed(seq=6, node="a", gpu=0)])
    assert render_text(model, 4.0).splitlines()[:2] == ["node a: up", "node b: down"]
    model.fold([ev.NodeJoined(seq=7, ts=5.0, node="b", gpus=2)])
    assert "node b · up" in render_html(model, 5.0)
    # job 7 ends: its bar empties, and its row still says where it ran
    model.fold([ev.JobStarted(seq=8, ts=5.5, job=7, pid=4242),
                ev.JobExited(seq=9, ts=6.0, job=7, exit_code=0, outcome="succeeded")])
    assert model.gpus[("b", 0)]["allocated"] == 0.0 and model.gpus[("b", 0)]["jobs"] == []
    row = next(r for r in render_html(model, 7.0).split("<tr") if "data-job='7'" in r)
    assert "succeeded" in row and ">b:0<" in row


def test_panel_folds_events_after_its_snapshot() -> None:
    model = PanelModel.from_status(_status())
    spec = ev.JobSpec(command=["python", "t.py"], name="t", gpus=0.5)
    model.fold([
        ev.JobSubmitted(seq=9, job=99, spec=spec),  # already in the snapshot: ignored
        ev.JobSubmitted(seq=11, ts=5.0, job=2, spec=spec),
        ev.JobSubmitted(seq=12, ts=5.0, job=3, spec=spec),
    ])
    assert 99 not in model.jobs
    assert [j["id"] for j in model.queued()] == [2, 3]
    model.fold([
        ev.JobPlaced(seq=13, ts=6.0, job=2, node="local", gpu_ids=[1], share=0.5),
        ev.JobStarted(seq=14, ts=6.0, job=2, pid=123, log_path="/tmp/x.log"),
        ev.GpuSampled(seq=15, node="local", gpu=1, utilization=80.0, memory_used_mib=1000,
                      memory_total_mib=16384, temperature_c=70.0, power_w=100.0),
        ev.GpuPaused(seq=16, node="local", gpu=0),
    ])
    assert model.gpus[("local", 0)]["allocated"] == 1.0 and model.gpus[("local", 0)]["paused"]
    assert model.gpus[("local", 1)]["allocated"] == 0.5 and model.gpus[("local", 1)]["utilization"] == 80.0
    assert model.gpus[("local", 1)]["jobs"] == [2]
    assert [j["id"] for j in model.running()] == [1, 2]
    model.fold([
        ev.JobExited(seq=17, ts=9.0, job=1, exit_code=0),
        ev.JobCancelRequested(seq=18, job=2),
        ev.JobExited(seq=19, ts=9.0, job=2, exit_code=None, signal=15),
        ev.JobCancelled(seq=20, job=3),
    ])
    assert {j: model.jobs[j]["state"] for j in (1, 2, 3)} == {1: "succeeded", 2: "cancelled", 3: "cancelled"}
    assert model.gpus[("local", 0)]["allocated"] == 0.0 and model.gpus[("local", 1)]["allocated"] == 0.0
    assert model.seq == 20
    text, page = render_text(model, 10.0), render_html(model, 10.0)
    assert "GPU 1" in text and "PAUSED" in text
    assert "data-state='succeeded'" in page and "data-state='cancelled'" in page


def test_panel_retries_and_requeues_go_back_to_the_queue() -> None:
    model = PanelModel.from_status(_status())
    model.fold([ev.JobExited(seq=11, job=1, exit_code=3), ev.JobRequeued(seq=12, job=1, reason="retry")])
    assert model.jobs[1]["state"] == "queued" and model.gpus[("local", 0)]["allocated"] == 0.0


def test_panel_shows_a_forecast_as_a_range_as_explain_does() -> None:
    model = PanelModel.from_status(_status())
    model.fold([ev.JobSubmitted(seq=11, ts=5.0, job=2, spec=ev.JobSpec(command=["python", "t.py"], name="t", gpus=1)),
                ev.JobForecast(seq=12, ts=5.0, job=2, estimated_start=725.0, p10=305.0, p90=2405.0, by="explain")])
    shown = "starts in about 12 min (80 %: 5 min to 40 min)"
    assert shown in render_text(model, 5.0) and shown in render_html(model, 5.0)
    # once it runs, the forecast is gone from its line
    model.fold([ev.JobPlaced(seq=13, ts=6.0, job=2, node="local", gpu_ids=[1], share=1.0)])
    assert "starts in" not in render_text(model, 6.0) + render_html(model, 6.0)


# --- against a real daemon ---------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    from daemon_harness import Daemon

    d = Daemon(tmp_path_factory.mktemp("es-state")).start()
    yield d
    d.stop()


@pytest.fixture
def live(ip: InteractiveShell, daemon, monkeypatch: pytest.MonkeyPatch) -> InteractiveShell:
    monkeypatch.setenv("EVENTSCHED_STATE_DIR", str(daemon.state_dir))
    return ip


@pytest.mark.slow
def test_submit_with_trailing_gpus_and_expansion(live, daemon, capsys) -> None:
    result, _, err = run(live, "n = 3\nh = %gpusubmit --gpus 0.5 --name job-$n -- echo {n*2} '$n' --gpus 2", capsys)
    assert result.error_in_exec is None, err
    handle = live.user_ns["h"]
    assert isinstance(handle, JobHandle)
    job = daemon.jobs()[handle.id]
    assert job["name"] == "job-3" and job["gpus"] == 0.5
    assert job["command"] == ["echo", "6", "$n", "--gpus", "2"]
    assert handle.wait(timeout=30) == "succeeded"
    assert handle.logs().strip() == "6 $n --gpus 2"
    bundle = handle._repr_mimebundle_()
    assert "succeeded" in bundle["text/plain"] and "data-state='succeeded'" in bundle["text/html"]


@pytest.mark.slow
def test_cell_magic_runs_the_cell_as_a_script(live, capsys, tmp_path: Path) -> None:
    magics_of(live).cell_dir = str(tmp_path)
    result, _, err = run(live, "%%gpusubmit --gpus 0.25 -- --who world\nimport sys\nprint('hello', sys.argv[-1])\n", capsys)
    assert result.error_in_exec is None, err
    handle = result.result
    assert handle.wait(timeout=30) == "succeeded"
    assert handle.logs() == "hello world\n"
    assert handle.info()["name"].startswith("cell-")
    assert len(list((tmp_path / ".eventsched-cells").glob("cell-*.py"))) == 1


@pytest.mark.slow
def test_queue_cancel_and_handle_cancel(live, capsys) -> None:
    result, _, err = run(live, "%gpusubmit --name sleeper -- sleep 60", capsys)
    assert result.error_in_exec is None, err
    sleeper = result.result
    result, _, _ = run(live, "%gpuqueue", capsys)
    assert any(j["id"] == sleeper.id for j in result.result)
    result, _, err = run(live, f"%gpucancel {sleeper.id}", capsys)
    assert result.error_in_exec is None, err
    assert sleeper.wait(timeout=30) == "cancelled"
    result, _, _ = run(live, "%gpuqueue", capsys)
    assert all(j["id"] != sleeper.id for j in result.result)
    result, _, _ = run(live, "%gpuqueue --all", capsys)
    assert any(j["id"] == sleeper.id and j["state"] == "cancelled" for j in result.result)
    other = run(live, "%gpusubmit -- sleep 60", capsys)[0].result
    assert other.cancel().wait(timeout=30) == "cancelled"
    # the handle explains itself as `eventsched explain` does
    why = sleeper.explain()
    assert why.reason is None and why.story[-1]["what"].endswith("-> cancelled")
    assert any("asked to cancel" in line["because"] for line in why.story)
    assert f"job {sleeper.id} (sleeper," in repr(why) and "<ol>" in why._repr_html_()


@pytest.mark.slow
def test_daemon_refusal_is_one_line(live, capsys) -> None:
    result, _, err = run(live, "%gpusubmit --after 987654 -- true", capsys)
    line = one_line_error(result, err)
    assert "987654" in line


@pytest.mark.slow
def test_status_panel_shows_gpus_and_jobs(live, capsys) -> None:
    result, _, err = run(live, "panel = %gpustatus", capsys)
    assert result.error_in_exec is None, err
    panel = live.user_ns["panel"]
    handle = run(live, "%gpusubmit --gpus 0.5 --name watched -- sleep 1", capsys)[0].result
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = {j["id"]: j["state"] for j in panel.watcher.model.jobs.values()}
        if states.get(handle.id) == "succeeded":
            break
        time.sleep(0.1)
    assert states.get(handle.id) == "succeeded"
    shown = f"data-job='{handle.id}' data-state='succeeded'"
    while not any(shown in row.cells.value for row in panel.rows):  # the throttled redraw lands
        assert time.monotonic() < deadline, "the panel never redrew the job as succeeded"
        time.sleep(0.1)
    assert len(panel.gpu_box.children) == 4
    assert "NOTE" in panel.jobs_html.value  # the rows' heading
    bundle = panel._repr_mimebundle_()
    assert "GPU 3" in bundle["text/plain"] and "eventsched-status" in bundle["text/html"]
    panel.job_select.value = handle.id
    assert "(no output yet)" in panel.tail.value
    panel.close()


@pytest.mark.slow
def test_scheduler_start_status_stop(ip, capsys, tmp_path: Path) -> None:
    state = tmp_path / "started"
    result, out, err = run(ip, f"%gpuscheduler start --gpus fake:2 --state-dir {state}", capsys)
    assert result.error_in_exec is None, err
    assert "started" in repr(result.result)
    try:
        result, _, err = run(ip, "%gpuscheduler start --gpus fake:2", capsys)  # remembered: same daemon
        assert "already running" in repr(result.result), err
        result, _, err = run(ip, "%gpuqueue", capsys)
        assert result.error_in_exec is None, err
    finally:
        result, _, err = run(ip, "%gpuscheduler stop", capsys)
    assert "stopped" in repr(result.result), err
    result, _, err = run(ip, "%gpuscheduler status", capsys)
    assert "no eventsched daemon" in one_line_error(result, err)


@pytest.mark.slow
def test_sql_returns_a_dataframe(live, daemon, capsys) -> None:
    handle = run(live, "%gpusubmit --name for-sql -- true", capsys)[0].result
    handle.wait(timeout=30)
    result, _, err = run(live, "%gpusql -o df SELECT id, name, state FROM jobs WHERE name = 'for-sql'", capsys)
    assert result.error_in_exec is None, err
    frame = live.user_ns["df"]
    assert list(frame.columns) == ["id", "name", "state"]
    assert frame.iloc[0]["state"] == "succeeded"
    result, _, err = run(live, "%gpusql SELECT nope FROM jobs", capsys)
    assert "nope" in one_line_error(result, err)
