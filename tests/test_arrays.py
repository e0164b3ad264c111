"""Job arrays (``submit --array``), end to end: a real daemon on fake
GPUs, the real CLI, and a real notebook kernel for ``%gpusubmit --array``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from daemon_harness import Daemon

from eventsched.cli import array_row, compact_indices

FINAL = {"succeeded", "failed", "cancelled", "lost"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("arrays") / "state", gpus="fake:4:16384") as d:
        yield d


def ids_of(result: Any) -> list[int]:
    assert result.returncode == 0, result.stderr
    return [int(line) for line in result.stdout.split()]


def hold_script(tmp_path: Path, marker: Path) -> str:
    path = tmp_path / "hold.sh"
    path.write_text(f"#!/bin/sh\nwhile [ ! -e {marker} ]; do sleep 0.05; done\n")
    path.chmod(0o755)
    return str(path)


# --- no daemon ------------------------------------------------------------------


def test_index_sets_print_compactly() -> None:
    assert compact_indices(list(range(100))) == "0-99"
    assert compact_indices(list(range(0, 99, 2))) == "0-98:2"
    assert compact_indices([1, 3, 7, 8, 9]) == "1,3,7-9"
    assert compact_indices([5]) == "5"
    assert compact_indices([1, 3, 5, 6, 9, 11, 20]) == "1,3,5-6,...,20"


def test_an_array_folds_into_one_queue_line() -> None:
    def task(i: int, state: str, **kw: Any) -> dict[str, Any]:
        return {"id": 12 + i, "array_id": 12, "array_index": i, "state": state, "name": "sweep", "user": "ann",
                "priority": 0, "gpus": 1.0, "gpu_ids": [i] if state == "running" else [], "submitted_at": 0.0,
                "reason": "resources: needs 1 GPU" if state == "queued" else None, **kw}

    tasks = [task(i, "running", array_done=93) for i in range(93, 96)] + [task(i, "queued", array_done=93) for i in range(96, 100)]
    row = array_row(tasks, now=65.0)
    assert row[0] == "12[93-99]"
    assert row[3] == "3 running, 4 queued, 93 done"
    assert row[6] == "93,94,95"
    assert row[9].startswith("resources")


# --- a real daemon ----------------------------------------------------------------


def test_array_prints_every_id_and_each_task_sees_its_index(daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = daemon.cli(
        "submit", "--array", "0-6:2", "--gpus", "0.25", "--",
        "sh", "-c", f'echo "{{index}} $EVENTSCHED_ARRAY_INDEX $EVENTSCHED_ARRAY_ID $EVENTSCHED_JOB_ID" > {out}/task-{{index}}',
    )
    ids = ids_of(result)
    assert len(ids) == 4 and ids == list(range(ids[0], ids[0] + 4)), result.stdout
    # acknowledged together: every task is known as soon as the command returns
    jobs = daemon.jobs()
    assert all(i in jobs for i in ids)
    assert [jobs[i]["array_index"] for i in ids] == [0, 2, 4, 6]
    assert {jobs[i]["array_id"] for i in ids} == {ids[0]}
    daemon.wait_states(ids, {"succeeded"})
    for job, index in zip(ids, [0, 2, 4, 6]):
        # {index} in the command, EVENTSCHED_ARRAY_INDEX, the array's id (its first task's), the task's own id
        assert (out / f"task-{index}").read_text().split() == [str(index), str(index), str(ids[0]), str(job)]

    as_json = daemon.cli("submit", "--array", "1,3", "--json", "--", "true")
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert len(data["ids"]) == 2 and data["ids"][1] == data["ids"][0] + 1


def test_a_bad_array_spec_is_one_line_and_submits_nothing(daemon: Daemon) -> None:
    before = set(daemon.jobs())
    for spec, words in (
        ("", "no index"),
        ("5-1", "backwards"),
        ("0-10:0", "step"),
        ("0-2000000", "at most"),
        ("a-b", "not an index"),
        ("0-3%0", "%k"),
    ):
        result = daemon.cli("submit", "--array", spec, "--", "true")
        assert result.returncode == 2, (spec, result.stdout, result.stderr)
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert words in lines[0].lower(), lines[0]
    assert set(daemon.jobs()) == before


def test_cancel_of_the_array_id_cancels_every_task_and_ARRAY_INDEX_one(daemon: Daemon, tmp_path: Path) -> None:
    hold = hold_script(tmp_path, tmp_path / "never")
    ids = ids_of(daemon.cli("submit", "--array", "0-5", "--gpus", "1", "--", hold))
    daemon.wait_for(lambda jobs: sum(jobs[i]["state"] == "running" for i in ids) == 4, what="4 tasks running")

    one = daemon.cli("cancel", f"{ids[0]}_1")  # Slurm's ARRAY_INDEX: task 1 alone
    assert one.returncode == 0, one.stderr
    jobs = daemon.wait_states([ids[1]], {"cancelled"})
    assert jobs[ids[0]]["state"] == "running"

    whole = daemon.cli("cancel", str(ids[0]))  # the array's id: all its tasks
    assert whole.returncode == 0, whole.stderr
    assert sorted(int(line.split()[0]) for line in whole.stdout.splitlines()) == sorted(set(ids) - {ids[1]})
    jobs = daemon.wait_states(ids, {"cancelled"})
    assert all(jobs[i]["state"] == "cancelled" for i in ids)

    again = daemon.cli("cancel", str(ids[0]))
    assert again.returncode == 1
    assert again.stderr.strip() == f"job {ids[0]}: array already finished (all 6 tasks)"


def test_queue_folds_an_array_into_one_line_and_expand_lists_tasks(daemon: Daemon, tmp_path: Path) -> None:
    marker = tmp_path / "go"
    script = tmp_path / "odd.sh"  # even indices end at once, odd ones wait for the marker
    script.write_text(
        "#!/bin/sh\n[ $((EVENTSCHED_ARRAY_INDEX % 2)) = 0 ] && exit 0\n"
        f"while [ ! -e {marker} ]; do sleep 0.05; done\n"
    )
    script.chmod(0o755)
    ids = ids_of(daemon.cli("submit", "--array", "0-5", "--gpus", "0.25", "--name", "sweep", "--", str(script)))
    array = ids[0]
    daemon.wait_for(
        lambda jobs: [jobs[i]["state"] for i in ids] == ["succeeded", "running"] * 3, what="odd tasks running"
    )

    folded = daemon.cli("queue")
    lines = [line for line in folded.stdout.splitlines() if line.startswith(f"{array}[")]
    assert len(lines) == 1, folded.stdout
    assert lines[0].startswith(f"{array}[1-5:2]") and "sweep" in lines[0]
    assert "3 running, 3 done" in lines[0], lines[0]
    assert not any(line.split()[0] == str(ids[1]) for line in folded.stdout.splitlines()[1:])

    expanded = [line.split()[0] for line in daemon.cli("queue", "--expand").stdout.splitlines()[1:]]
    assert [int(first) for first in expanded if first.isdigit() and int(first) in ids] == ids[1::2]

    # scripts keep one object per job, each with its array fields
    listed = json.loads(daemon.cli("queue", "--all", "--json").stdout)
    tasks = {j["id"]: j for j in listed if j["id"] in ids}
    assert len(tasks) == 6
    assert [tasks[i]["array_index"] for i in ids] == list(range(6))
    assert {tasks[i]["array_id"] for i in ids} == {array}
    plain = [j for j in listed if j["array_id"] is None]
    assert all(j["array_index"] is None for j in plain)

    marker.touch()
    daemon.wait_states(ids, {"succeeded"})
    everything = daemon.cli("queue", "--all").stdout
    assert any(line.startswith(f"{array}[0-5]") and "6 succeeded" in line for line in everything.splitlines()), everything


def test_explain_of_an_array_task_names_its_array(daemon: Daemon, tmp_path: Path) -> None:
    marker = tmp_path / "go"
    hold = hold_script(tmp_path, marker)
    ids = ids_of(daemon.cli("submit", "--array", "0-2%1", "--gpus", "0.25", "--", hold))
    daemon.wait_states([ids[0]], {"running"})
    text = daemon.cli("explain", str(ids[2]))
    assert text.returncode == 0, text.stderr
    assert f"task 2 of array {ids[0]}" in text.stdout
    assert "%1" in text.stdout
    info = json.loads(daemon.cli("explain", str(ids[2]), "--json").stdout)
    assert (info["job"]["array_id"], info["job"]["array_index"], info["job"]["array_cap"]) == (ids[0], 2, 1)
    marker.touch()
    daemon.wait_states(ids, {"succeeded"}, timeout=30)


@pytest.mark.slow
def test_gpusubmit_array_in_a_real_notebook_kernel(daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("EVENTSCHED_STATE_DIR", str(daemon.state_dir))  # the kernel inherits it
    monkeypatch.delenv("EVENTSCHED_SOCKET", raising=False)
    (tmp_path / "show.sh").write_text(f'echo "$1 $EVENTSCHED_ARRAY_INDEX $EVENTSCHED_ARRAY_ID" > {tmp_path}/nb-$1\n')
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext eventsched.jupyter"),
        # {{index}}: IPython expands {expr} in a magic's line; doubled braces stay literal
        nbformat.v4.new_code_cell("h = %gpusubmit --array 0-3 --gpus 0.25 -- sh show.sh {{index}}\nh"),
        nbformat.v4.new_code_cell("states = h.wait(timeout=60)\nprint('IDS', h.ids, sorted(set(states.values())))"),
    ]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(out.get("text", "") for out in nb.cells[2].outputs)
    assert "['succeeded']" in printed, printed
    ids = json.loads(printed.split("IDS", 1)[1].rsplit("[", 1)[0].strip())
    assert len(ids) == 4
    shown = nb.cells[1].outputs[0]["data"]["text/plain"]
    assert f"array {ids[0]}: 4 tasks" in shown
    for index in range(4):
        assert (tmp_path / f"nb-{index}").read_text().split() == [str(index), str(index), str(ids[0])]
    jobs = daemon.jobs()
    assert [jobs[i]["array_index"] for i in ids] == [0, 1, 2, 3]
