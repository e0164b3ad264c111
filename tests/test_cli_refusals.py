"""One-line refusals of ``eventsched replay``, ``sql``, ``tenant``, ``reserve``
and ``report`` that no other test runs: a real ``eventsched`` process, a real
daemon where the command needs one. Each refusal prints its one line on
stderr, nothing on stdout, exits with its status and changes nothing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import EVENTSCHED, Daemon

TRACE_HEADER = "submit_time,duration,gpus,gpu_mem,user,priority"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # one daemon for the file: its state dir is also the recorded log replay reads
    with Daemon(tmp_path_factory.mktemp("refusals") / "state", gpus="fake:2") as d:
        yield d


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "w.csv"
    path.write_text(f"{TRACE_HEADER}\n0,10,1,,a,0\n1,5,1,,b,0\n")
    return path


def run(*args: str, daemon: Daemon | None = None) -> subprocess.CompletedProcess[str]:
    """``eventsched ARGS``, against ``daemon`` where given."""
    env = daemon.env() if daemon is not None else None
    return subprocess.run([*EVENTSCHED, *args], env=env, capture_output=True, text=True, timeout=60)


def refusal(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The one line a refused command prints, after checking it printed nothing else."""
    assert result.returncode == code and result.stdout == "", (result.returncode, result.stdout, result.stderr)
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.rstrip("\n")


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with a file's content (None for a folder): what a refusal must leave as it was."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


# --- replay ----------------------------------------------------------------------------


def test_replay_as_recorded_needs_a_recorded_log(trace: Path) -> None:
    refused = run("replay", str(trace), "--gpus", "fake:2", "--policy", "fifo", "--policy", "recorded")
    assert refusal(refused) == "eventsched replay: policy 'recorded' needs a recorded log as the source"


def test_replay_as_recorded_refuses_a_config_that_would_change_it(daemon: Daemon, tmp_path: Path) -> None:
    config = tmp_path / "what-if.toml"
    config.write_text("[scheduler]\nmax_queued = 5\n")
    refused = run("replay", str(daemon.state_dir), "--policy", "recorded", "--config", str(config))
    assert refusal(refused) == ("eventsched replay: --config changes what 'recorded' would replay as it was; "
                                "leave one of them out")


def test_replay_refuses_an_out_that_already_holds_a_log_and_leaves_it_alone(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = run("replay", str(trace), "--gpus", "fake:2", "--policy", "fifo", "--out", str(out))
    assert first.returncode == 0, first.stderr
    before = tree(out)
    again = run("replay", str(trace), "--gpus", "fake:2", "--policy", "best-fit", "--policy", "fifo",
                "--out", str(out))
    assert refusal(again) == f"eventsched replay: {out / 'fifo' / 'log'} already holds a log; choose another --out"
    assert tree(out) == before  # not even best-fit's replay, which had a place of its own


def test_a_policy_named_twice_is_replayed_once(trace: Path) -> None:
    twice = ["--policy", "fifo", "--policy", "best-fit", "--policy", "fifo"]
    as_json = run("replay", str(trace), "--gpus", "fake:2", *twice, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert [r["policy"] for r in json.loads(as_json.stdout)["replays"]] == ["fifo", "best-fit"]
    as_table = run("replay", str(trace), "--gpus", "fake:2", *twice)
    assert as_table.returncode == 0, as_table.stderr
    header = as_table.stdout.splitlines()[2]  # under "replay of ..." and a blank line
    assert header.split() == ["fifo", "best-fit"]


# --- tenant ----------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--gpus", "abc"], "--gpus 'abc': a number, or 'none'"),
    (["--gpus", "-1"], "--gpus must be >= 0, not -1"),
    (["--gpu-mem", "lots"], "--gpu-mem 'lots': a number, or 'none'"),
    (["--jobs", "-2"], "--jobs must be >= 0, not -2"),
    (["--gpu-hours-per-month", "nan"], "--gpu-hours-per-month must be >= 0, not nan"),
])
def test_tenant_set_refuses_a_bad_number_and_changes_nothing(daemon: Daemon, args: list[str], message: str) -> None:
    before = run("tenants", "--json", daemon=daemon).stdout
    assert refusal(run("tenant", "set", "ml", *args, daemon=daemon)) == f"eventsched: error: {message}"
    assert run("tenants", "--json", daemon=daemon).stdout == before


def test_tenant_remove_of_an_unknown_tenant(daemon: Daemon) -> None:
    before = run("tenants", "--json", daemon=daemon).stdout
    assert refusal(run("tenant", "remove", "nosuch", daemon=daemon), 1) == "eventsched: error: no tenant 'nosuch'"
    assert run("tenants", "--json", daemon=daemon).stdout == before


# --- reserve ---------------------------------------------------------------------------


def test_reserve_refuses_an_unknown_reservation_and_gpu(daemon: Daemon) -> None:
    assert refusal(run("reserve", "cancel", "99", daemon=daemon), 1) == "eventsched: error: no reservation 99"
    window = ["--start", "now", "--duration", "1h"]
    assert (refusal(run("reserve", "create", "--gpu-ids", "7", *window, daemon=daemon), 1)
            == "eventsched: error: no GPU 7 on local (GPUs here: 0, 1)")
    assert (refusal(run("reserve", "create", "--gpu-ids", "nosuch:0", *window, daemon=daemon), 1)
            == "eventsched: error: no node 'nosuch' (nodes: local)")
    assert (refusal(run("reserve", "create", "--gpu-ids", "local:x", *window, daemon=daemon))
            == "eventsched: error: --gpu-ids: 'x' is not a GPU id or range like 0-3")
    assert run("reserve", "list", "--json", daemon=daemon).stdout.split() == ["[]"]


# --- sql -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_sql_says_when_its_output_cannot_be_written(daemon: Daemon, tmp_path: Path, fmt: str) -> None:
    # a name the file system takes, but not with the temporary file's prefix and suffix around it
    target = tmp_path / ("x" * 245 + f".{fmt}")
    refused = run("sql", "SELECT 1 AS x", "--format", fmt, "-o", str(target), daemon=daemon)
    assert refusal(refused, 1) == f"eventsched sql: cannot write {target}: File name too long"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("query, message", [
    ("DELETE FROM jobs", "refused: DELETE statements are not read-only queries; "
                         "only SELECT, EXPLAIN and descriptive PRAGMAs are allowed"),
    ("SELEC 1", 'Parser Error: syntax error at or near "SELEC"'),
])
def test_sql_the_daemon_refuses_is_refused_as_here(daemon: Daemon, tmp_path: Path, query: str, message: str) -> None:
    # a state dir without a readable log: the daemon at --socket answers, and refuses as a local query would
    via_daemon = run("sql", "--state-dir", str(tmp_path), "--socket", str(daemon.socket), query)
    here = run("sql", query, daemon=daemon)
    assert refusal(via_daemon) == refusal(here) == f"eventsched sql: {message}"
    assert list(tmp_path.iterdir()) == []


# --- report ----------------------------------------------------------------------------


def test_report_refuses_a_bad_config(daemon: Daemon, tmp_path: Path) -> None:
    config = tmp_path / "eventsched.toml"
    config.write_text("[accounting]\ngpu_hour_pric = 2.5\n")
    assert refusal(run("report", "--config", str(config), daemon=daemon)) == (
        f"eventsched: error: config file {config}: Object contains unknown field `gpu_hour_pric` - at `$.accounting`")
    missing = tmp_path / "none.toml"
    assert (refusal(run("report", "--config", str(missing), daemon=daemon))
            == f"eventsched: error: config file {missing} does not exist")


# --- exit statuses: 2 for what the user asked, 1 when the history cannot be read ---------------


@pytest.mark.parametrize("below", ["", "sub"], ids=["the-file", "under-the-file"])
def test_replay_into_an_out_that_is_a_file_is_one_line(trace: Path, tmp_path: Path, below: str) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("mine\n")
    out = a_file / below if below else a_file
    refused = run("replay", str(trace), "--gpus", "fake:1", "--policy", "fifo", "--out", str(out))
    assert refusal(refused) == f"eventsched replay: cannot create log directory {out / 'fifo' / 'log'}: Not a directory"
    assert a_file.read_text() == "mine\n"


def test_sql_and_report_without_a_state_dir_or_daemon_exit_1(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    no_daemon = (f"no eventsched daemon is listening on {missing / 'eventsched.sock'}; start one with "
                 "`eventsched serve` (or `eventsched serve --gpus fake:4` without GPUs)")
    assert refusal(run("sql", "--state-dir", str(missing), "SELECT 1"), 1) == f"eventsched sql: {no_daemon}"
    assert refusal(run("report", "--state-dir", str(missing)), 1) == f"eventsched: error: {no_daemon}"


def test_a_damaged_log_exits_1_from_sql_and_report_alike(tmp_path: Path) -> None:
    log = tmp_path / "state" / "log"
    log.mkdir(parents=True)
    (log / "00000000000000000001.seg").write_bytes(b"not a segment" * 20)
    damaged = (f"log segment {log / '00000000000000000001.seg'} is damaged at byte 0: not an eventsched log "
               f"segment (bad magic); run `eventsched log repair {log}` to cut the log there "
               "(the damaged part is kept aside)")
    state = str(tmp_path / "state")
    assert refusal(run("sql", "--state-dir", state, "SELECT 1"), 1) == f"eventsched sql: {damaged}"
    assert refusal(run("report", "--state-dir", state), 1) == f"eventsched: error: {damaged}"


def test_a_socket_path_through_a_file_is_no_daemon_not_a_traceback(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    state = blocker / "state"
    assert refusal(run("queue", "--state-dir", str(state)), 1) == (
        f"eventsched: error: no eventsched daemon is listening on {state / 'eventsched.sock'}; start one with "
        "`eventsched serve` (or `eventsched serve --gpus fake:4` without GPUs)")


@pytest.mark.parametrize("option", [["--array", "18446744073709551616"], ["--priority", "99999999999999999999"],
                                    ["--gpu-ids", "99999999999999999999"], ["--after", "99999999999999999999"]],
                         ids=lambda o: o[0])
def test_a_number_the_socket_cannot_carry_is_one_line_and_submits_nothing(daemon: Daemon, option: list[str]) -> None:
    before = daemon.jobs()
    refused = run("submit", *option, "--", "true", daemon=daemon)
    assert refusal(refused) == "eventsched: error: a number out of range (integers from -2**63 to 2**64-1)"
    assert daemon.jobs() == before
