"""What new users tripped over, each through the CLI against a real daemon on fake GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from daemon_harness import EVENTSCHED, Daemon, cli_env

from eventsched.runtime.config import FileConfig, load_config


def _serve(state_dir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EVENTSCHED, "serve", "--gpus", "fake:1", *args], env=env,
                          capture_output=True, text=True, timeout=30)


def _gpus(daemon: Daemon) -> list[dict]:
    return daemon.status()["gpus"]


def _until(what: str, check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_live_daemons_socket_is_refused_and_a_stale_one_taken_over(tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    a = Daemon(tmp_path / "a", socket_path=sock).start()
    try:
        pid = a.process.pid
        by_option = _serve(tmp_path / "b", cli_env(tmp_path / "b"), "--socket", str(sock))
        by_env = _serve(tmp_path / "c", cli_env(tmp_path / "c", sock))
        for refused in (by_option, by_env):
            assert refused.returncode == 2, refused.stderr
            line = refused.stderr.strip()
            assert "\n" not in line and f"pid {pid}" in line and str(tmp_path / "a") in line, line
        assert f"daemon pid {pid}" in a.cli("health").stdout  # still A's, still reachable
    finally:
        a.kill9()  # leaves its socket behind: stale
    assert sock.exists()
    with Daemon(tmp_path / "b", socket_path=sock, gpus="fake:1") as b:
        assert f"daemon pid {b.process.pid}" in b.cli("health").stdout


def test_config_sample_prints_the_real_defaults_as_toml_or_json(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "state", gpus="fake:1")
    toml = d.cli("config-sample")
    assert toml.returncode == 0 and "fake" not in toml.stdout
    assert [line for line in toml.stdout.splitlines() if "=" in line and "#" not in line] == []  # each explained
    (tmp_path / "c.toml").write_text(toml.stdout)
    assert load_config(tmp_path / "c.toml") == FileConfig()
    as_json = d.cli("config-sample", "--format", "json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["scheduler"]["max_queued"] == 100_000
    (tmp_path / "new_config.json").write_text(as_json.stdout)
    assert load_config(tmp_path / "new_config.json") == FileConfig()
    d.extra = ["--config", str(tmp_path / "new_config.json")]
    with d:
        assert d.cli("health").returncode == 0


def test_a_temperature_threshold_does_not_block_the_preemption_that_cools_the_gpu(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[scheduler]\nmax_gpu_temperature_c = 70\npreempt_grace_s = 1\n")
    with Daemon(tmp_path / "state", gpus="fake:1", extra=["--config", str(config)]) as d:
        hot = {**d.env(), "EVENTSCHED_FAKE_GPU_UTIL": "100"}  # the job declares a busy GPU: 80 C
        victim = int(subprocess.run([*EVENTSCHED, "submit", "--preemptible", "--", "sleep", "60"], env=hot,
                                    capture_output=True, text=True, check=True).stdout)
        d.wait_states([victim], {"running"})
        _until("the GPU to run hot", lambda: (_gpus(d)[0]["temperature_c"] or 0) > 70)
        urgent = d.submit("--priority", "50", "--", "true")
        d.wait_states([urgent], {"succeeded"}, timeout=30)
        d.cli("cancel", str(victim))


def test_placement_avoids_strangers_gpus_and_never_counts_their_memory_as_free(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "120"], env={**os.environ, "EVENTSCHED_FAKE_GPU_MEM_MIB": "12000",
                                                       "CUDA_VISIBLE_DEVICES": "0"})
    try:
        with Daemon(tmp_path / "state", gpus="fake:2:16384") as d:
            _until("the stranger's memory", lambda: _gpus(d)[0]["foreign_memory_mib"] >= 12000)
            small = d.submit("--gpus", "1", "--gpu-mem", "1000", "--", "sleep", "30")
            assert d.wait_states([small], {"running"})[small]["gpu_ids"] == [1]
            big = d.submit("--gpus", "1", "--gpu-mem", "8000", "--", "true")  # GPU 0 has 4,384 MiB left
            time.sleep(1.5)
            assert d.jobs()[big]["state"] == "queued"
            d.cli("cancel", str(small), str(big))
    finally:
        stranger.kill()
        stranger.wait()


def test_explain_never_says_now_for_a_job_that_must_wait(tmp_path: Path) -> None:
    with Daemon(tmp_path / "state", gpus="fake:1") as d:
        done = [d.submit("--name", "w", "--", "sleep", "2") for _ in range(2)]
        d.wait_states(done, {"succeeded"}, timeout=30)
        blocking = d.submit("--name", "w", "--", "sleep", "8")  # predicted to end in 2 s
        d.wait_states([blocking], {"running"})
        waiting = d.submit("--", "true")
        starts = []
        for _ in range(8):  # the first seconds: then the prediction says it is about to end
            starts += [line for line in d.cli("explain", str(waiting)).stdout.splitlines() if "estimated start" in line]
        assert starts and not [s for s in starts if "now" in s or "next decision" in s], starts
        d.cli("cancel", str(blocking), str(waiting))


def test_small_ones(tmp_path: Path) -> None:
    with Daemon(tmp_path / "state", gpus="fake:1") as d:
        job = d.submit("--", "true")
        d.wait_states([job], {"succeeded"})
        time.sleep(1)  # the read model catches up
        table = d.cli("sql", "SELECT user, id FROM jobs").stdout
        csv = d.cli("sql", "--format", "csv", "SELECT user, id FROM jobs").stdout
        assert table.split()[0] == csv.split(",")[0] == "user", (table, csv)
        refused = d.cli("submit", "--gpus", "-1", "--", "true")
        assert refused.returncode != 0 and "[0.001, 1]" in refused.stderr, refused.stderr
    before = set(Path(tempfile.gettempdir()).glob("eventsched-replay-*"))
    replay = d.cli("replay", str(d.state_dir), "--policy", "fifo")
    assert replay.returncode == 0, replay.stderr
    assert set(Path(tempfile.gettempdir()).glob("eventsched-replay-*")) == before


def test_over_http_logs_names_no_internal_type(tmp_path: Path) -> None:
    env = {**cli_env(tmp_path), "EVENTSCHED_URL": "http://127.0.0.1:9", "EVENTSCHED_TOKEN": "x"}
    result = subprocess.run([*EVENTSCHED, "logs", "1"], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "JobLogPath" not in result.stderr and len(result.stderr.splitlines()) == 1, \
        result.stderr
