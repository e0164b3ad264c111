"""`eventsched explain` against a real daemon on fake GPUs: every reason a job
can wait for, the REASON column agreeing with it, and a story whose decisions
name the facts that caused them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from daemon_harness import Daemon

pytestmark = pytest.mark.slow


def explain(daemon: Daemon, job: int) -> dict:
    result = daemon.cli("explain", str(job), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_each_reason_and_the_queue_column_agree(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('policy = "fifo"\n')
    with Daemon(tmp_path / "state", gpus="fake:3:16384", extra=["--config", str(config)]) as d:
        assert d.cli("pause-gpu", "2").returncode == 0
        first = d.submit("--gpus", "1", "--", "/bin/sleep", "60")
        big = d.submit("--gpus", "2", "--", "/bin/true")  # 1 free GPU, one paused: waits for resources
        small = d.submit("--gpus", "0.5", "--", "/bin/true")  # would fit, but FIFO: the big one goes first
        after = d.submit("--gpus", "0", "--after", str(first), "--", "/bin/true")
        held = d.submit("--gpus", "0.5", "--", "/bin/true")
        assert d.cli("hold", str(held)).returncode == 0
        d.wait_states([first], {"running"})

        reasons = {j: explain(d, j)["reason"] for j in (big, small, after, held)}
        assert reasons[big]["kind"] == "resources"
        assert reasons[big]["text"] == ("resources: needs 2 whole GPUs; the largest free set is 1 whole GPU; "
                                        "GPU 2 is paused")
        assert reasons[small]["kind"] == "priority"
        assert reasons[small]["text"] == f"priority: 1 job ahead of it under fifo (first: job {big}, priority 0, root)"
        assert reasons[after] == {**reasons[after], "kind": "dependency", "waits_for": [first]}
        assert reasons[held]["kind"] == "held"
        assert explain(d, first)["reason"] is None

        rows = {j["id"]: j for j in json.loads(d.cli("queue", "--json").stdout)}
        for job, reason in reasons.items():
            assert rows[job]["reason"] == reason["text"] and rows[job]["reason_kind"] == reason["kind"]
        assert rows[first]["reason"] is None
        table = d.cli("queue").stdout
        assert "REASON" in table.splitlines()[0] and "resources: needs 2 whole GPUs" in table

        # the story: the cancel is a fact, the stop and the next placement name it
        assert d.cli("resume-gpu", "2").returncode == 0
        d.wait_states([big], {"running", "succeeded"})
        assert d.cli("cancel", str(first)).returncode == 0
        d.wait_states([first], {"cancelled"})
        story = explain(d, first)["story"]
        whats = [line["what"] for line in story]
        assert whats[0] == "submitted by root: 1 GPU, priority 0"
        assert whats[1] == "placed on GPU 0 by fifo" and story[1]["because"] == f"job {first} was submitted by root"
        assert story[2]["what"].startswith("started, pid ")
        stop = next(line for line in story if line["type"] == "JobCancelRequested")
        assert stop["because"] == f"uid:0 asked to cancel job {first}"
        assert story[-1]["type"] == "JobExited" and story[-1]["what"].endswith("-> cancelled")
        placed_big = next(line for line in explain(d, big)["story"] if line["type"] == "JobPlaced")
        assert placed_big["because"] == "GPU 2 was resumed by uid:0"

        text = d.cli("explain", str(first)).stdout
        assert f"job {first} (sleep, root) is cancelled" in text
        assert f"because uid:0 asked to cancel job {first}" in text

        missing = d.cli("explain", "999")
        assert missing.returncode != 0 and "no job 999" in missing.stderr and "Traceback" not in missing.stderr


def test_queue_limit_reason(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text("[scheduler]\nmax_running = 1\n")
    with Daemon(tmp_path / "state", gpus="fake:2", extra=["--config", str(config)]) as d:
        running = d.submit("--gpus", "0.5", "--", "/bin/sleep", "60")
        waiting = d.submit("--gpus", "0.5", "--", "/bin/true")
        d.wait_states([running], {"running"})
        assert explain(d, waiting)["reason"]["text"] == "queue limit: 1 job running, max_running = 1"
        d.cli("cancel", str(running), str(waiting))


def test_an_ended_jobs_story_is_its_own_and_ends_with_it(tmp_path: Path) -> None:
    """The story of an ended job is read from its submission to its end, not
    to the end of the log: later events change nothing in it."""
    with Daemon(tmp_path / "state", gpus="fake:2:16384") as d:
        done = d.submit("--gpus", "1", "--", "/bin/sh", "-c", "exit 3")
        d.wait_states([done], {"failed"})
        before = explain(d, done)["story"]
        later = [d.submit("--gpus", "1", "--", "/bin/true") for _ in range(5)]
        d.wait_states(later, {"succeeded"})
        after = explain(d, done)["story"]
    assert after == before
    assert [line["type"] for line in after] == ["JobSubmitted", "JobPlaced", "JobStarted", "JobExited"]
    assert "exit" in after[-1]["what"] and "3" in after[-1]["what"]
