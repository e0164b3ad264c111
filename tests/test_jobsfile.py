"""The seeds' jobs file: ``eventsched submit-file`` and the daemon's own
``jobs_file`` follower, on the seeds' example files (tests/fixtures/seeds/)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from daemon_harness import EVENTSCHED, Daemon

from eventsched.domain.events import JobSpec
from eventsched.domain.jobsfile import (
    CUDA_PLACEHOLDER,
    line_command,
    line_source,
    line_spec,
    our_priority,
    parse_jobs_text,
)
from eventsched.domain.llm import DEFAULT_LLM_CONFIG, parse_llm_config
from eventsched.runtime.api.jobs_follower import Unsafe, open_checked

SEEDS = Path(__file__).parent / "fixtures" / "seeds"


def seed_llm(name: str = "000") -> Any:
    path = SEEDS / f"{name}_llm_config.json"
    return parse_llm_config(path.read_text(), str(path))


# --- the format, pure ------------------------------------------------------------


def test_seed_000_example_parses_with_converted_priorities_gpus_and_commands() -> None:
    jobs, errors = parse_jobs_text((SEEDS / "000_jobs.txt").read_text())
    assert errors == []
    assert [j.line for j in jobs] == [2, 3, 4]  # line 1 is the "#" header
    assert [our_priority(j.priority) for j in jobs] == [0, -1, -2]  # lower-first became higher-first
    assert [j.allowed_gpus for j in jobs] == [[0, 1, 2, 3], [4, 5, 6, 7], None]
    assert [j.conda for j in jobs] == ["ml_env", "ml_env", ""]
    specs = [line_spec(j, resolved_path="/srv/jobs.txt", llm=seed_llm(), base=JobSpec(command=["x"])) for j in jobs]
    assert [s.gpus for s in specs] == [0.5, 1.0, 1.0]  # qwen2.5-3b-inst is half a GPU in the seed's llm_config
    assert specs[0].command == [
        "python", "-u", "/data3/experiments/evaluate.py", "--llm", "qwen2.5-3b-inst", "--mode", "test",
        "--cuda", CUDA_PLACEHOLDER,
    ]
    assert specs[2].command[2:] == ["/data3/experiments/inference.py", "--model", "large", "--batch_size", "32",
                                    "--cuda", CUDA_PLACEHOLDER]
    assert [s.name for s in specs] == ["evaluate.py", "train.py", "inference.py"]
    assert specs[1].source.startswith("/srv/jobs.txt:3:") and len(specs[1].source.rsplit(":", 1)[1]) == 16


def test_seed_001_allowed_gpus_after_the_fourth_comma() -> None:
    jobs, errors = parse_jobs_text((SEEDS / "001_jobs.txt").read_text())
    assert errors == []
    # "2,/path/to/inference.py,,--llm qwen2.5-32b-inst --batch_size 1,4,5,6,7": the seeds split at 4 commas
    last = jobs[-1]
    assert last.args == ["--llm", "qwen2.5-32b-inst", "--batch_size", "1"]
    assert last.allowed_gpus == [4, 5, 6, 7]
    assert jobs[1].allowed_gpus is None  # empty field: any GPU
    llm = seed_llm("001")
    assert [llm.gpus("qwen2.5-7b-inst"), llm.gpus("qwen2.5-3b-inst"), llm.gpus("qwen2.5-32b-inst")] == [1.0, 0.5, 1.0]


def test_comments_blank_lines_crlf_and_short_lines() -> None:
    text = "# header\r\n\r\n   \n  # indented comment\n5,/a.py\r\n7,/b.py,env\n"
    jobs, errors = parse_jobs_text(text)
    assert errors == []
    assert [(j.line, j.priority, j.script, j.conda, j.args, j.allowed_gpus) for j in jobs] == [
        (5, 5, "/a.py", "", [], None),
        (6, 7, "/b.py", "env", [], None),
    ]


def test_bad_lines_are_named_by_number_and_the_rest_still_load() -> None:
    text = "\n".join([
        "0,/ok1.py,,--a 1,",
        "0",  # missing the script
        "high,/x.py,,,",  # priority not a number
        "1,/x.py,,,3-1",  # a range backwards
        "1,/x.py,,,a-b",
        "1,/x.py,,--msg 'unclosed,",
        "1,/x.py,my env,,",  # a conda env name has no spaces
        ",/x.py,,,",
        "2,/ok2.py,,,0-1",
    ])
    jobs, errors = parse_jobs_text(text)
    assert [j.script for j in jobs] == ["/ok1.py", "/ok2.py"]
    assert [e.line for e in errors] == [2, 3, 4, 5, 6, 7, 8]
    reasons = {e.line: e.reason for e in errors}
    assert "priority" in reasons[2] and "script" in reasons[2]
    assert "'high' is not a whole number" in reasons[3]
    assert "allowed_gpus '3-1'" in reasons[4] and "allowed_gpus 'a-b'" in reasons[5]
    assert "quotation" in reasons[6]
    assert "conda_env" in reasons[7]


def test_cuda_is_appended_once_and_relative_scripts_are_taken_from_the_file_folder() -> None:
    jobs, _ = parse_jobs_text("0,train.py,,--cuda 3 --lr 0.1 --cuda=2,\n")
    command = line_command(jobs[0], "/data/proj")
    # the seeds dropped a --cuda of the line and added their own with the assigned ids
    assert command == ["python", "-u", "/data/proj/train.py", "--lr", "0.1", "--cuda", CUDA_PLACEHOLDER]


def test_a_line_is_known_by_file_line_and_content() -> None:
    first, _ = parse_jobs_text("0,/a.py,,--x 1,\n")
    same_text_lower, _ = parse_jobs_text("\n0,/a.py,,--x 1,\n")
    edited, _ = parse_jobs_text("0,/a.py,,--x 2,\n")
    spaced, _ = parse_jobs_text("  0,/a.py,,--x 1,   \n")
    src = line_source("/f.txt", first[0])
    assert src != line_source("/f.txt", same_text_lower[0])  # another line number
    assert src != line_source("/f.txt", edited[0])  # edited in place
    assert src != line_source("/g.txt", first[0])  # another file
    assert src == line_source("/f.txt", spaced[0])  # surrounding blanks are not content


def test_without_llm_config_a_line_needs_one_gpu_and_with_one_the_default() -> None:
    jobs, _ = parse_jobs_text("0,/a.py,,--epochs 3,\n0,/b.py,,--llm mystery-13b,\n")
    base = JobSpec(command=["x"])
    assert [line_spec(j, resolved_path="/f", llm=DEFAULT_LLM_CONFIG, base=base).gpus for j in jobs] == [1.0, 1.0]
    quarter = parse_llm_config('{"default_requirement": 0.25, "models": {}}', "x.json")
    # the seeds' rule: no --llm, or an unknown model -> default_requirement
    assert [line_spec(j, resolved_path="/f", llm=quarter, base=base).gpus for j in jobs] == [0.25, 0.25]


# --- the follower's file checks, on real files ------------------------------------


def _jobs_file(tmp_path: Path, text: str) -> Path:
    """``proj/jobs.txt`` holding ``text``, in a folder of its own."""
    (tmp_path / "proj").mkdir()
    jobs = tmp_path / "proj" / "jobs.txt"
    jobs.write_text(text)
    return jobs


def test_follower_refuses_files_others_could_write(tmp_path: Path) -> None:
    jobs = _jobs_file(tmp_path, "0,/a.py\n")
    folder = jobs.parent
    jobs.chmod(0o644)
    fd, st = open_checked(str(jobs), os.geteuid())
    os.close(fd)
    assert st.st_size == len("0,/a.py\n")
    for mode in (0o666, 0o664, 0o646):
        jobs.chmod(mode)
        with pytest.raises(Unsafe, match="group- or world-writable"):
            open_checked(str(jobs), os.geteuid())
    jobs.chmod(0o600)
    folder.chmod(0o777)  # anyone could replace the file
    with pytest.raises(Unsafe, match="writable by others"):
        open_checked(str(jobs), os.geteuid())
    folder.chmod(0o1777)  # sticky, like /tmp: only the owner may replace it
    os.close(open_checked(str(jobs), os.geteuid())[0])
    folder.chmod(0o755)
    fifo = folder / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(Unsafe, match="not a regular file"):
        open_checked(str(fifo), os.geteuid())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files away")
def test_follower_refuses_a_symlink_planted_by_someone_else(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody").pw_uid
    target = tmp_path / "roots.txt"
    target.write_text("0,/a.py\n")
    link = tmp_path / "jobs.txt"
    link.symlink_to(target)
    os.lchown(link, nobody, -1)
    with pytest.raises(Unsafe, match=f"belongs to uid {nobody}"):
        open_checked(str(link), 0)


# --- end to end: submit-file against a real daemon ----------------------------------


def specs_of(d: Daemon) -> dict[int, dict[str, Any]]:
    """Each job's spec as recorded in the log (JobSubmitted)."""
    out = d.cli("log", "dump", "--json", str(d.state_dir / "log"))
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    return {e["job"]: e["spec"] for e in events if e.get("type") == "JobSubmitted"}


def ids_of(result: subprocess.CompletedProcess) -> list[int]:
    return [int(x) for x in result.stdout.split()]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("jobsfile") / "state", gpus="fake:8:16384") as d:
        for gpu in range(8):  # jobs stay queued: their order and requests can be read
            assert d.cli("pause-gpu", str(gpu)).returncode == 0
        yield d


@pytest.mark.slow
def test_the_seed_example_loads_with_priorities_gpus_conda_and_commands(daemon: Daemon, tmp_path: Path) -> None:
    shutil.copy(SEEDS / "000_jobs.txt", tmp_path / "jobs.txt")
    shutil.copy(SEEDS / "000_llm_config.json", tmp_path / "llm_config.json")
    result = daemon.cli("submit-file", "jobs.txt", cwd=str(tmp_path))  # ./llm_config.json is found
    assert result.returncode == 0, result.stderr
    ids = ids_of(result)
    assert len(ids) == 3
    queue = [j for j in json.loads(daemon.cli("queue", "--json").stdout) if j["id"] in ids]
    # the queue shows them in the order they will run: the seed's priority 0 first
    assert [j["id"] for j in queue] == ids
    assert [(j["priority"], j["gpus"], j["state"]) for j in queue] == [(0, 0.5, "queued"), (-1, 1.0, "queued"), (-2, 1.0, "queued")]
    assert queue[0]["command"][:3] == ["python", "-u", "/data3/experiments/evaluate.py"]
    specs = specs_of(daemon)
    assert [specs[i].get("conda", "") for i in ids] == ["ml_env", "ml_env", ""]
    assert [specs[i].get("gpu_ids") for i in ids] == [[0, 1, 2, 3], [4, 5, 6, 7], None]
    resolved = os.path.realpath(tmp_path / "jobs.txt")
    assert [specs[i]["source"].rsplit(":", 2)[:2] for i in ids] == [[resolved, "2"], [resolved, "3"], [resolved, "4"]]
    explained = json.loads(daemon.cli("explain", str(ids[1]), "--json").stdout)
    assert explained["job"]["state"] == "queued" and explained["reason"] is not None


@pytest.mark.slow
def test_the_same_file_twice_submits_nothing_and_an_edited_line_is_a_new_job(daemon: Daemon, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("0,/srv/a.py,,--x 1,\n1,/srv/b.py,,--x 2,\n")
    first = daemon.cli("submit-file", str(jobs))
    assert first.returncode == 0, first.stderr
    a, b = ids_of(first)
    again = daemon.cli("submit-file", str(jobs), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == {"ids": [], "skipped": [{"line": 1, "id": a}, {"line": 2, "id": b}], "errors": []}
    plain = daemon.cli("submit-file", str(jobs))
    assert plain.stdout == "" and "2 lines of" in plain.stderr and "already submitted" in plain.stderr
    jobs.write_text("0,/srv/a.py,,--x 1,\n1,/srv/b.py,,--x 3,\n")  # line 2 edited in place
    edited = daemon.cli("submit-file", str(jobs), "--json")
    out = json.loads(edited.stdout)
    assert len(out["ids"]) == 1 and out["skipped"] == [{"line": 1, "id": a}]
    assert daemon.jobs()[out["ids"][0]]["command"][3:5] == ["--x", "3"]


@pytest.mark.slow
def test_bad_lines_name_file_and_line_the_rest_load_and_exit_is_1(daemon: Daemon, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("# mine\n0,/srv/ok.py,,,\n0\nfirst,/srv/x.py,,,\n1,/srv/x.py,,,7-5\n2,/srv/ok2.py,,,0-1\n3,/srv/z.py,,,42\n")
    result = daemon.cli("submit-file", str(jobs))
    assert result.returncode == 1
    assert len(ids_of(result)) == 2  # lines 2 and 6
    errors = result.stderr.strip().splitlines()
    assert [e.split(": ", 1)[0] for e in errors] == [f"{jobs}:3", f"{jobs}:4", f"{jobs}:5", f"{jobs}:7"]
    assert "unknown GPU id 42" in errors[3]  # refused by the daemon, reported the same way
    assert "Traceback" not in result.stderr
    as_json = daemon.cli("submit-file", str(jobs), "--json")
    assert as_json.returncode == 1
    assert [e["line"] for e in json.loads(as_json.stdout)["errors"]] == [3, 4, 5, 7]


@pytest.mark.slow
def test_an_unreadable_file_is_one_line(daemon: Daemon, tmp_path: Path) -> None:
    for target in (tmp_path / "missing.txt", tmp_path):
        result = daemon.cli("submit-file", str(target))
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "cannot read jobs file" in result.stderr, result.stderr
        assert result.stdout == ""


def _wait(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out")


def _watch(daemon: Daemon, jobs: Path, tmp_path: Path) -> subprocess.Popen[bytes]:
    """``submit-file JOBS --watch``, its output in tmp_path/out and tmp_path/err."""
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")
    return subprocess.Popen([*EVENTSCHED, "submit-file", str(jobs), "--watch"], env=daemon.env(), stdout=out, stderr=err)


@pytest.mark.slow
def test_watch_picks_up_appended_lines_and_survives_truncation_and_rewrite(daemon: Daemon, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("0,/srv/w1.py,,,\n")
    watcher = _watch(daemon, jobs, tmp_path)
    try:
        def ids() -> list[int]:
            return [int(x) for x in (tmp_path / "out").read_text().split()]

        _wait(lambda: len(ids()) == 1)
        with open(jobs, "a") as f:  # appended, and half-written for a moment
            f.write("1,/srv/w2.py,,--ep")
            f.flush()
            time.sleep(0.1)
            f.write("ochs 5,\n")
        _wait(lambda: len(ids()) == 2)
        jobs.write_text("")  # truncated
        time.sleep(1.2)
        jobs.write_text("0,/srv/w1.py,,,\n1,/srv/w2.py,,--epochs 5,\n2,/srv/w3.py,,,\n")  # rewritten
        _wait(lambda: len(ids()) == 3)
        time.sleep(1.2)
        assert len(ids()) == 3  # nothing twice
        commands = [daemon.jobs()[i]["command"][2:-2] for i in ids()]
        assert commands == [["/srv/w1.py"], ["/srv/w2.py", "--epochs", "5"], ["/srv/w3.py"]]  # never "--ep"
    finally:
        watcher.send_signal(signal.SIGINT)
        code = watcher.wait(10)
    assert code == 0
    assert "Traceback" not in (tmp_path / "err").read_text()


def test_a_bad_line_found_while_watching_makes_ctrl_c_exit_1(daemon: Daemon, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("0,/srv/w1.py,,,\n")
    watcher = _watch(daemon, jobs, tmp_path)
    try:
        _wait(lambda: (tmp_path / "out").read_text().strip() != "")
        with open(jobs, "a") as f:
            f.write("high,/srv/w2.py,,,\n")  # not a priority
        _wait(lambda: "jobs.txt:2:" in (tmp_path / "err").read_text())
    finally:
        watcher.send_signal(signal.SIGINT)
        code = watcher.wait(10)
    assert code == 1, "a bad line was reported: the run ends as a run of the whole file would"
    assert "Traceback" not in (tmp_path / "err").read_text()


# --- end to end: the daemon follows a jobs file itself ---------------------------------


def _serve_with_jobs_file(state: Path, jobs: Path) -> Daemon:
    config = state.parent / "serve.toml"
    config.write_text(f'jobs_file = "{jobs}"\n')
    return Daemon(state, gpus="fake:2:16384", extra=["--config", str(config)])


@pytest.mark.slow
def test_daemon_follows_its_jobs_file_and_never_submits_a_line_twice(tmp_path: Path) -> None:
    jobs = _jobs_file(tmp_path, "# followed by the daemon\n0,hello.py,,--n 1,1\n")
    script = jobs.parent / "hello.py"
    script.write_text("import os, sys\nprint('cuda', sys.argv[-1], os.environ['CUDA_VISIBLE_DEVICES'])\n")
    with _serve_with_jobs_file(tmp_path / "state", jobs) as d:
        d.wait_for(lambda js: len(js) == 1, what="the first line")
        with open(jobs, "a") as f:
            f.write("1,hello.py,,--n 2,\n")
        jobs_now = d.wait_for(lambda js: len(js) == 2, what="the appended line")
        first = jobs_now[min(jobs_now)]
        assert first["user"] == pwd.getpwuid(os.geteuid()).pw_name  # the file's owner
        assert first["command"][2] == str(script)  # relative to the file's folder
        d.wait_states(list(jobs_now), {"succeeded"})
        # the script saw --cuda rewritten to its GPU, as the seeds passed it
        assert d.cli("logs", str(min(jobs_now))).stdout.strip() == "cuda 1 1"
    with _serve_with_jobs_file(tmp_path / "state", jobs) as d:
        time.sleep(2.5)  # two looks at the file
        assert len(d.jobs()) == 2
    # the daemon's log (both runs): each line submitted once
    assert (d.state_dir / "daemon.stderr").read_text().count("submitted as job") == 2


@pytest.mark.slow
def test_daemon_refuses_a_world_writable_jobs_file_until_fixed(tmp_path: Path) -> None:
    jobs = _jobs_file(tmp_path, "0,/srv/x.py,,,\n")
    jobs.chmod(0o666)
    with _serve_with_jobs_file(tmp_path / "state", jobs) as d:
        _wait(lambda: "is not followed" in d.stderr())  # the first look, however late a busy machine makes it
        time.sleep(2.5)  # two more looks: still refused, and said once
        assert d.jobs() == {}
        refusals = [line for line in d.stderr().splitlines() if "is not followed" in line]
        assert len(refusals) == 1 and "world-writable" in refusals[0]
        jobs.chmod(0o644)
        d.wait_for(lambda js: len(js) == 1, what="the file to be followed once fixed")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon runs a file's lines as its owner")
def test_a_root_daemon_runs_the_lines_as_the_files_owner(tmp_path: Path) -> None:
    jobs = _jobs_file(tmp_path, "0,/srv/x.py,,,\n")
    os.chown(jobs, pwd.getpwnam("nobody").pw_uid, -1)
    assert stat.S_IMODE(jobs.stat().st_mode) & 0o022 == 0
    with _serve_with_jobs_file(tmp_path / "state", jobs) as d:
        jobs_now = d.wait_for(lambda js: len(js) == 1, what="the line")
        assert next(iter(jobs_now.values()))["user"] == "nobody"
