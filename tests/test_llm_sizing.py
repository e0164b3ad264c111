"""LLM-aware sizing: the seeds' llm_config.json and ``--llm NAME``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import Daemon

from eventsched.domain.llm import (
    LlmConfigError,
    gpus_for_share,
    llm_name,
    parse_llm_config,
)

SEEDS = Path(__file__).parent / "fixtures" / "seeds"


# --- the file and the rule, pure ------------------------------------------------


def test_seed_files_give_each_model_its_share() -> None:
    for seed, big in (("000", 2.0), ("001", 1.0)):
        path = SEEDS / f"{seed}_llm_config.json"
        llm = parse_llm_config(path.read_bytes(), str(path))
        assert llm.gpus("qwen2.5-3b-inst") == 0.5
        assert llm.gpus("qwen2.5-7b-inst") == 1.0
        assert llm.gpus("qwen2.5-32b-inst") == big  # seed 000 gives the 32B model two whole GPUs
        assert llm.gpus("llama-3-70b") == 1.0  # unknown: default_requirement


def test_unknown_models_get_default_requirement_and_big_shares_whole_gpus() -> None:
    llm = parse_llm_config('{"default_requirement": 0.3, "models": {"huge": 1.5}}', "llm.json")
    assert llm.gpus("not-listed") == 0.3
    assert llm.gpus(None) == 0.3
    assert llm.gpus("huge") == 2.0  # the seeds gave 1.5 ceil(1.5) whole GPUs
    assert gpus_for_share(1.0) == 1.0 and gpus_for_share(3.0) == 3.0


def test_llm_name_in_arguments() -> None:
    assert llm_name(["--mode", "test", "--llm", "qwen2.5-7b-inst"]) == "qwen2.5-7b-inst"
    assert llm_name(["--llm=qwen2.5-3b-inst", "--llm", "other"]) == "qwen2.5-3b-inst"  # the first one
    assert llm_name(["--llmx", "a", "--epochs", "3"]) is None
    assert llm_name(["--llm"]) is None


@pytest.mark.parametrize(
    ("text", "must_say"),
    [
        ("{not json", "not valid JSON"),
        ('{"models": {}}', 'missing key "default_requirement"'),
        ('{"default_requirement": 1.0}', 'missing key "models"'),
        ('{"default_requirement": 1.0, "models": {"qwen2.5-7b-inst": -1}}', '"models"."qwen2.5-7b-inst" must be more than 0'),
        ('{"default_requirement": 1.0, "models": {"qwen2.5-7b-inst": "half"}}', '"models"."qwen2.5-7b-inst" must be a number'),
        ('{"default_requirement": true, "models": {}}', '"default_requirement" must be a number'),
        ('{"default_requirement": 0, "models": {}}', '"default_requirement" must be more than 0'),
        ('{"default_requirement": 1, "models": [1, 2]}', '"models" must be an object'),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_a_malformed_file_is_one_error_naming_file_and_key(text: str, must_say: str) -> None:
    with pytest.raises(LlmConfigError) as info:
        parse_llm_config(text, "/etc/llm_config.json")
    message = str(info.value)
    assert message.startswith("/etc/llm_config.json: ") and must_say in message and "\n" not in message


def test_keys_the_seeds_never_read_are_ignored() -> None:
    llm = parse_llm_config('{"default_requirement": 1, "models": {"a": 0.5}, "comment": "mine"}', "x")
    assert llm.gpus("a") == 0.5


# --- end to end: eventsched submit and submit-file ---------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("llm") / "state", gpus="fake:8:16384") as d:
        for gpu in range(8):  # nothing runs: the requests stay readable
            assert d.cli("pause-gpu", str(gpu)).returncode == 0
        yield d


def gpus_of(d: Daemon, job: int) -> float:
    return float(d.jobs()[job]["gpus"])


@pytest.mark.slow
def test_submit_sizes_llm_jobs_from_the_config(daemon: Daemon, tmp_path: Path) -> None:
    config = str(SEEDS / "000_llm_config.json")
    small = daemon.submit("--llm-config", config, "--", "true", "--llm", "qwen2.5-3b-inst", "--mode", "test")
    big = daemon.submit("--llm-config", config, "--", "true", "--llm=qwen2.5-32b-inst")
    unknown = daemon.submit("--llm-config", config, "--", "true", "--llm", "mystery-7b")
    explicit = daemon.submit("--llm-config", config, "--gpus", "1", "--", "true", "--llm", "qwen2.5-3b-inst")
    plain = daemon.submit("--", "true", "--epochs", "3")
    assert [gpus_of(daemon, j) for j in (small, big, unknown, explicit, plain)] == [0.5, 2.0, 1.0, 1.0, 1.0]


@pytest.mark.slow
def test_llm_config_is_found_in_the_current_folder_then_the_state_dir(daemon: Daemon, tmp_path: Path) -> None:
    (tmp_path / "llm_config.json").write_text('{"default_requirement": 0.25, "models": {"tiny": 0.1}}')
    here = daemon.submit("--", "true", "--llm", "tiny", cwd=str(tmp_path))
    unknown = daemon.submit("--", "true", "--llm", "other", cwd=str(tmp_path))
    assert [gpus_of(daemon, here), gpus_of(daemon, unknown)] == [0.1, 0.25]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(SEEDS / "001_llm_config.json", daemon.state_dir / "llm_config.json")
    try:
        from_state_dir = daemon.submit("--", "true", "--llm", "qwen2.5-3b-inst", cwd=str(elsewhere))
        assert gpus_of(daemon, from_state_dir) == 0.5
    finally:
        (daemon.state_dir / "llm_config.json").unlink()


@pytest.mark.slow
def test_a_malformed_llm_config_refuses_the_submission_in_one_line(daemon: Daemon, tmp_path: Path) -> None:
    bad = tmp_path / "llm_config.json"
    bad.write_text('{"default_requirement": 1.0, "models": {"qwen2.5-7b-inst": -2}}')
    before = len(daemon.jobs())
    result = daemon.cli("submit", "--", "true", "--llm", "qwen2.5-7b-inst", cwd=str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "llm_config.json" in result.stderr and '"models"."qwen2.5-7b-inst"' in result.stderr
    missing = daemon.cli("submit", "--llm-config", str(tmp_path / "nope.json"), "--", "true", "--llm", "x")
    assert missing.returncode == 2 and "nope.json" in missing.stderr and missing.stderr.count("\n") == 1
    via_file = daemon.cli("submit-file", "--llm-config", str(bad), str(SEEDS / "000_jobs.txt"))
    assert via_file.returncode == 2 and '"models"."qwen2.5-7b-inst"' in via_file.stderr
    assert len(daemon.jobs()) == before  # nothing submitted


@pytest.mark.slow
def test_submit_file_sizes_lines_with_llm_config_option(daemon: Daemon, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.txt"
    shutil.copy(SEEDS / "001_jobs.txt", jobs)
    result = daemon.cli("submit-file", str(jobs), "--llm-config", str(SEEDS / "001_llm_config.json"), "--json")
    assert result.returncode == 0, result.stderr
    ids = json.loads(result.stdout)["ids"]
    assert [gpus_of(daemon, j) for j in ids] == [1.0, 0.5, 1.0]
