"""The predecessors' spellings: ``--mem`` (mgpu_srun), ``--env-setup-cmd``,
``--gpu-ids 0,1`` alone meaning exactly those GPUs, and a one-string command
(``-- "python x.py --lr 3"``, seed 003) run by the shell. End to end against
a real daemon on fake GPUs, plus the notebook magic's parser."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import Daemon

from eventsched import cli
from eventsched.jupyter.magics import parse_submit


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("spellings") / "state", gpus="fake:4:16384") as d:
        yield d


def run_job(d: Daemon, *args: str) -> tuple[dict, str]:
    """Submit, wait for the end; the job as ``queue --json`` shows it, and its output."""
    result = d.cli("submit", *args)
    assert result.returncode == 0, result.stderr
    job = int(result.stdout)
    jobs = d.wait_states([job], {"succeeded", "failed", "cancelled", "lost"})
    return jobs[job], d.cli("logs", str(job)).stdout


def test_gpu_ids_alone_means_exactly_those_gpus(daemon: Daemon) -> None:
    job, out = run_job(daemon, "--gpu-ids", "0,1", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
    assert out.strip() == "0,1"
    assert job["gpus"] == 2 and job["gpu_ids"] == [0, 1]
    job, out = run_job(daemon, "--gpu-ids", "1-3", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
    assert out.strip() == "1,2,3"
    # with --gpus K: K of them
    job, out = run_job(daemon, "--gpus", "1", "--gpu-ids", "2,3", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
    assert out.strip() in ("2", "3") and job["gpus"] == 1


def test_mem_is_gpu_mem_and_env_setup_cmd_is_env_setup(daemon: Daemon) -> None:
    job, out = run_job(
        daemon, "--gpu-ids", "2", "--mem", "8000", "--env-setup-cmd", "export GREETING=from-setup",
        "--", "sh", "-c", "echo $GREETING",
    )
    assert job["state"] == "succeeded"
    assert job["gpu_mem_mib"] == 8000
    assert out.strip() == "from-setup"
    # --mem is admission like --gpu-mem: more than a GPU has is refused in one line
    refused = daemon.cli("submit", "--mem", "999999", "--", "true")
    assert refused.returncode != 0 and "memory" in refused.stderr.lower()
    assert len(refused.stderr.strip().splitlines()) == 1


def test_a_one_string_command_runs_through_the_shell(daemon: Daemon, tmp_path: Path) -> None:
    job, out = run_job(daemon, "--", "echo piped words | tr a-z A-Z; echo second")
    assert out.split("\n")[:2] == ["PIPED WORDS", "second"]
    assert job["state"] == "succeeded"
    assert job["command"] == ["echo piped words | tr a-z A-Z; echo second"]
    assert job["name"] == "echo"
    failing, _ = run_job(daemon, "--", "echo no; exit 4")
    assert failing["exit_code"] == 4
    # one argument naming a file (a path with a blank) is still run as a program
    script = tmp_path / "my job.sh"
    script.write_text("#!/bin/sh\necho ran as a file\n")
    script.chmod(0o755)
    job, out = run_job(daemon, "--", str(script))
    assert out.strip() == "ran as a file"
    # several arguments: never a shell
    job, out = run_job(daemon, "--", "echo", "$HOME;", "x")
    assert out.strip() == "$HOME; x"


def test_the_notebook_magic_reads_the_same_spellings() -> None:
    args, command = parse_submit('--mem 500 --env-setup-cmd "source venv/bin/activate" --gpu-ids 0,1 -- "python x.py --lr 3"')
    spec = cli.build_spec(args, command)
    assert spec.gpu_mem_mib == 500
    assert spec.env_setup == "source venv/bin/activate"
    assert spec.gpus == 2 and spec.gpu_ids == [0, 1]
    assert spec.shell and spec.command == ["python x.py --lr 3"] and spec.name == "python"
    args, command = parse_submit("--gpus 0.5 --gpu-ids 3 -- python x.py --lr 3")
    spec = cli.build_spec(args, command)
    assert spec.gpus == 0.5 and not spec.shell and spec.command == ["python", "x.py", "--lr", "3"]


def test_help_names_the_aliases() -> None:
    import subprocess
    import sys

    text = subprocess.run([sys.executable, "-m", "eventsched.cli", "submit", "--help"], capture_output=True, text=True).stdout
    for word in ("--mem", "--env-setup-cmd", "--array", "--gpu-ids"):
        assert word in text
