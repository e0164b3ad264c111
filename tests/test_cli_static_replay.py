"""``eventsched replay POD_CSV --static``: the README's FGD static packing
experiment, run as a user runs it (a real ``eventsched`` process on the Alibaba
trace), and its one-line refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
POD_CSV = TRACES / "openb_pod_list_default.csv"
NODE_CSV = TRACES / "openb_node_list_gpu_node.csv"
STATIC_POLICIES = "random, dotprod, clustering, packing, best-fit, fgd"

needs_trace = pytest.mark.skipif(not POD_CSV.is_file(), reason="Alibaba trace not here")


def replay_static(source: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "eventsched.cli", "replay", str(source), "--static", *args],
                          capture_output=True, text=True, timeout=120)


def refused(run: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused replay prints, after checking it printed nothing else."""
    assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stdout)
    assert len(run.stderr.splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr
    return run.stderr.strip()


@needs_trace
def test_the_readme_command_prints_each_policy_beside_the_paper() -> None:
    run = replay_static(POD_CSV, "--policy", "best-fit", "--policy", "fgd", "--seeds", "42-43")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == ("FGD Figure 9(a) static experiment: 8152 pods (tuned to 1.3x), "
                        "1213 nodes / 6212 GPUs, seeds 42,43")
    header = lines[3].split()
    assert header[:3] == ["policy", "ours", "paper"] and header[-1] == "x=120"
    rows = {line.split()[0]: line.split() for line in lines[4:6]}
    assert list(rows) == ["best-fit", "fgd"]
    assert rows["best-fit"][2] == "7.09" and rows["fgd"][2] == "4.77"  # the paper's figures, beside ours
    assert float(rows["fgd"][1]) < float(rows["best-fit"][1])  # fragmentation-aware packing leaves less idle
    assert lines[-1].startswith("paper: Weng et al., ATC '23")


@needs_trace
def test_json_gives_every_seeds_run_and_the_seeds_asked_for() -> None:
    run = replay_static(POD_CSV, "--policy", "best-fit", "--seeds", "42,44-45", "--json")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    result = json.loads(run.stdout)
    assert result["seeds"] == [42, 44, 45]
    assert (result["pods"], result["nodes"], result["gpus"]) == (8152, 1213, 6212)
    assert result["node_csv"] == str(NODE_CSV)  # found next to the pod list
    [best_fit] = result["policies"]
    assert best_fit["policy"] == "best-fit" and [r["seed"] for r in best_fit["runs"]] == [42, 44, 45]
    assert best_fit["seed_min"] <= best_fit["median"]["100"] <= best_fit["seed_max"]
    assert best_fit["paper"]["100"] == 7.09


@pytest.mark.parametrize(("seeds", "says"), [
    ("44-42", "bad seed range '44-42'"),
    ("x", "--seeds must look like 42-51 or 1,2,3, got 'x'"),
    ("42-", "--seeds must look like 42-51 or 1,2,3, got '42-'"),
    ("1,,2", "--seeds must look like 42-51 or 1,2,3, got '1,,2'"),
    ("-3", "--seeds must look like 42-51 or 1,2,3, got '-3'"),
], ids=["reversed-range", "not-a-number", "open-range", "empty-part", "negative"])
def test_bad_seeds_are_one_line(seeds: str, says: str) -> None:
    # checked before the trace is looked for: no trace needed
    assert refused(replay_static("pods.csv", "--policy", "fgd", "--seeds", seeds)) == f"eventsched replay: {says}"


def test_a_missing_pod_list_is_one_line(tmp_path: Path) -> None:
    for missing in (tmp_path / "nothing.csv", tmp_path):  # a folder is not the pod list either
        assert refused(replay_static(missing, "--policy", "fgd", "--seeds", "1")) == (
            f"eventsched replay: {missing}: no such file (--static needs the Alibaba openb pod list)")


@needs_trace
def test_a_pod_list_without_its_node_list_beside_it_is_one_line(tmp_path: Path) -> None:
    alone = tmp_path / POD_CSV.name
    shutil.copy(POD_CSV, alone)
    assert refused(replay_static(alone, "--policy", "fgd", "--seeds", "1")) == (
        f"eventsched replay: {tmp_path / NODE_CSV.name}: no such file "
        "(the node list must sit next to the pod list)")


@needs_trace
@pytest.mark.parametrize("policy", ["fifo", "nope"])
def test_a_policy_static_packing_lacks_is_one_line(policy: str) -> None:
    # fifo is a policy of the live scheduler, not of the static experiment
    run = replay_static(POD_CSV, "--policy", "best-fit", "--policy", policy, "--seeds", "1")
    assert refused(run) == (f"eventsched replay: unknown policy {policy!r} for --static; "
                            f"choose from {STATIC_POLICIES}")


def pod_list(tmp_path: Path, pods: int, *extra: str) -> Path:
    """The trace's header and first ``pods`` pods, then ``extra`` lines, with the node list beside them."""
    shutil.copy(NODE_CSV, tmp_path / NODE_CSV.name)
    path = tmp_path / "pods.csv"
    path.write_text("\n".join([*POD_CSV.read_text().splitlines()[: pods + 1], *extra]) + "\n")
    return path


@needs_trace
def test_a_bad_row_in_the_pod_list_names_its_file_and_line(tmp_path: Path) -> None:
    pods = pod_list(tmp_path, 10, "openb-pod-bad,1000,1024,1,1500,,LS,Running,0,1,0")
    assert refused(replay_static(pods, "--policy", "fgd", "--seeds", "1")) == (
        f"eventsched replay: {pods}:12: gpu_milli must be in 0..1000, got '1500'")


@needs_trace
def test_a_pod_list_of_only_its_header_is_one_line(tmp_path: Path) -> None:
    pods = pod_list(tmp_path, 0)
    assert refused(replay_static(pods, "--policy", "fgd", "--seeds", "1")) == (
        f"eventsched replay: {pods}: no pods (only a header line)")


@needs_trace
def test_a_policy_named_twice_runs_once(tmp_path: Path) -> None:
    pods = pod_list(tmp_path, 200)
    run = replay_static(pods, "--policy", "best-fit", "--policy", "best-fit", "--seeds", "1", "--json")
    assert run.returncode == 0, run.stderr
    assert [p["policy"] for p in json.loads(run.stdout)["policies"]] == ["best-fit"]
