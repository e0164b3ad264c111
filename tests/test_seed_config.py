"""The seeds' config.json, accepted by ``eventsched serve --config X.json``."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import EVENTSCHED, Daemon, cli_env

from eventsched.runtime.config import ConfigError, load_config

SEEDS = Path(__file__).parent / "fixtures" / "seeds"


def seed_config() -> dict[str, Any]:
    return json.loads((SEEDS / "000_config.json").read_text())


def write(tmp_path: Path, raw: Any, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(raw) if not isinstance(raw, str) else raw)
    return path


def test_the_seed_example_maps_to_our_settings(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    shutil.copy(SEEDS / "000_config.json", path)
    config = load_config(path)
    s = config.scheduler
    assert s.default_time_limit_s == 3600.0  # scheduler.job_timeout_s
    assert (s.max_gpu_memory_used_pct, s.max_gpu_utilization_pct) == (80.0, 80.0)  # gpu.*_threshold 0.8
    assert config.sample_interval_s == 5.0  # gpu.monitor_interval_s
    assert (s.max_queued, s.max_running) == (1000, 100)  # jobs.queue_size_limit, max_concurrent_jobs
    assert config.job_limits.allowed_script_paths == ["/data3/", "/home/user/", "/tmp/test/"]
    assert config.job_limits.max_host_mem_mib == 32 * 1024  # security.max_memory_per_job_gb
    assert config.jobs_file == str(tmp_path / "jobs.txt")  # relative to the config file's folder


def test_resource_limits_switched_off_drop_the_memory_limit(tmp_path: Path) -> None:
    raw = seed_config()
    raw["security"]["enable_resource_limits"] = False
    assert load_config(write(tmp_path, raw)).job_limits.max_host_mem_mib == 0


def test_our_own_keys_may_sit_in_the_same_file(tmp_path: Path) -> None:
    raw = seed_config()
    raw["policy"] = "fifo"
    raw["limits"] = {"max_retries": 3}
    raw["scheduler"]["kill_grace_s"] = 4.0
    config = load_config(write(tmp_path, raw))
    assert (config.policy, config.limits.max_retries, config.scheduler.kill_grace_s) == ("fifo", 3, 4.0)
    assert config.scheduler.max_queued == 1000  # the seed keys still translated


@pytest.mark.parametrize(
    ("change", "must_say", "suggests"),
    [
        (lambda raw: raw.update(foo=1), "unknown key 'foo' (known: ", ["files", "security", "tenants"]),
        (lambda raw: raw["gpu"].update(memory_treshold=0.5), "unknown key 'gpu.memory_treshold' (known: ",
         ["gpu.memory_threshold"]),
        (lambda raw: raw["scheduler"].update(workers=3), "unknown key 'scheduler.workers' (known: ",
         ["scheduler.max_workers", "scheduler.kill_grace_s"]),  # the seed's keys and ours
    ],
)
def test_an_unknown_key_is_refused_by_name(tmp_path: Path, change: Any, must_say: str, suggests: list[str]) -> None:
    raw = seed_config()
    change(raw)
    path = write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"config file {path}: {must_say}") and "\n" not in message
    known = message.split("(known: ", 1)[1].rstrip(")").split(", ")
    assert all(key in known for key in suggests)


@pytest.mark.parametrize(
    ("change", "must_say"),
    [
        (lambda raw: raw["gpu"].update(memory_threshold=1.5), "gpu.memory_threshold must be more than 0 and at most 1"),
        (lambda raw: raw["jobs"].update(queue_size_limit="many"), "jobs.queue_size_limit must be a whole number"),
        (lambda raw: raw["security"].update(max_memory_per_job_gb=-1), "security.max_memory_per_job_gb must be at least 0"),
        (lambda raw: raw["security"].update(allowed_script_paths="/data3/"), "security.allowed_script_paths must be a list"),
        (lambda raw: raw.update(gpu=3), "gpu must be an object"),
        (lambda raw: raw["files"].update(llm_config_file="/etc/llm.json"), "files.llm_config_file"),
        (lambda raw: raw["scheduler"].update(kill_grace_s="soon"), "kill_grace_s"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key(tmp_path: Path, change: Any, must_say: str) -> None:
    raw = seed_config()
    change(raw)
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, raw))
    assert must_say in str(info.value) and "\n" not in str(info.value)


def test_bad_json_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not valid JSON: .*\(line 1, column 2\)"):
        load_config(write(tmp_path, "{scheduler: 1}"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.json")


@pytest.mark.slow
def test_serve_takes_the_seed_config_and_follows_its_jobs_file(tmp_path: Path) -> None:
    for name, seed in (("config.json", "000_config.json"), ("jobs.txt", "000_jobs.txt"), ("llm_config.json", "000_llm_config.json")):
        shutil.copy(SEEDS / seed, tmp_path / name)
        (tmp_path / name).chmod(0o644)
    with Daemon(tmp_path / "state", gpus="fake:8:16384", extra=["--config", str(tmp_path / "config.json")]) as d:
        jobs = d.wait_for(lambda js: len(js) == 3, what="the seed's three lines")
        by_id = [jobs[i] for i in sorted(jobs)]
        assert [(j["priority"], j["gpus"]) for j in by_id] == [(0, 0.5), (-1, 1.0), (-2, 1.0)]
        dump = d.cli("log", "dump", "--json", str(d.state_dir / "log")).stdout.splitlines()
        started = next(e for e in map(json.loads, dump) if e["type"] == "DaemonStarted")
        # the seed's settings are the daemon's, as recorded
        assert started["config"]["default_time_limit_s"] == 3600.0 and started["config"]["max_queued"] == 1000


@pytest.mark.slow
def test_serve_refuses_an_unknown_seed_key_in_one_line(tmp_path: Path) -> None:
    raw = seed_config()
    raw["gpu"]["overclock"] = True
    path = write(tmp_path, raw)
    result = subprocess.run([*EVENTSCHED, "serve", "--gpus", "fake:1", "--config", str(path)],
                            env=cli_env(tmp_path / "state"), capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.startswith(f"eventsched: error: config file {path}: unknown key 'gpu.overclock' (known: ")
    assert result.stderr.count("\n") == 1
