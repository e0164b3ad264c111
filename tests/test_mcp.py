"""`eventsched mcp`: the SDK's own stdio client launches the server against a
real daemon on fake GPUs, as the user who runs it, and calls its tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import anyio
import pytest
from daemon_harness import EVENTSCHED, Daemon
from users_harness import VENV_BIN, as_user, needs_root, root_daemon, user_env
from users_harness import public_dir, users  # noqa: F401 (fixtures)

pytest.importorskip("mcp", reason="the MCP SDK (the `mcp` extra) is not installed")

from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402

TOOLS = {"submit", "queue", "explain", "cancel", "logs", "status", "sql", "report"}


@pytest.fixture(scope="module")
def daemon(public_dir: Path) -> Iterator[Daemon]:  # noqa: F811
    """One GPU, so that a second whole-GPU job must wait for the first."""
    d = root_daemon(public_dir, gpus="fake:1").start()
    try:
        yield d
    finally:
        d.stop()


def call(server: StdioServerParameters, *calls: tuple[str, dict[str, Any]]) -> tuple[set[str], list[Any]]:
    """Start the server, list its tools, make ``calls`` in order: (tool names, each call's result)."""

    async def session() -> tuple[set[str], list[Any]]:
        with anyio.fail_after(60):
            async with stdio_client(server, errlog=sys.stderr) as (read, write):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    names = {tool.name for tool in (await s.list_tools()).tools}
                    return names, [await s.call_tool(name, arguments) for name, arguments in calls]

    return anyio.run(session)


def text(result: Any) -> str:
    return "".join(block.text for block in result.content)


@pytest.mark.slow
def test_an_agent_lists_the_tools_and_is_told_why_a_job_waits(daemon: Daemon) -> None:
    server = StdioServerParameters(command=EVENTSCHED[0], args=[*EVENTSCHED[1:], "mcp"], env=daemon.env())
    long_job = {"command": ["sleep", "120"], "gpus": 1}
    names, (first, second) = call(server, ("submit", long_job), ("submit", long_job))
    assert TOOLS <= names
    assert not first.is_error and not second.is_error, (text(first), text(second))
    running, waiting = int(text(first)), int(text(second))
    daemon.wait_states([running], {"running"})
    _, (said, as_json, queued, status, bad, cancelled) = call(
        server, ("explain", {"job": waiting}), ("explain", {"job": waiting, "json": True}),
        ("queue", {"json": True}), ("status", {}), ("cancel", {"jobs": [999999]}),
        ("cancel", {"jobs": [running, waiting]}))
    jobs = {j["id"]: j for j in json.loads(text(queued))}
    assert {i: j["state"] for i, j in jobs.items()} == {running: "running", waiting: "queued"}
    # what `eventsched explain` prints: why it waits, then its story
    reason = json.loads(text(as_json))["reason"]
    assert reason is not None and "GPU" in reason["text"]
    lines = text(said).splitlines()
    assert lines[:2] == [f"job {waiting} (sleep, {jobs[waiting]['user']}) is queued", f"reason: {reason['text']}"]
    assert "story:" in lines
    assert "queued 1" in text(status)
    assert bad.is_error and text(bad).count("\n") == 0 and "999999" in text(bad)
    assert not cancelled.is_error, text(cancelled)
    daemon.wait_states([running, waiting], {"cancelled"})


@pytest.mark.slow
def test_logs_gives_the_tail_and_sql_and_report_read_the_history(daemon: Daemon) -> None:
    server = StdioServerParameters(command=EVENTSCHED[0], args=[*EVENTSCHED[1:], "mcp"], env=daemon.env())
    job = daemon.submit("--gpus", "0", "--", "sh", "-c", "seq 1 500")
    daemon.wait_states([job], {"succeeded"})
    _, (tail, rows, write, usage, bad_by) = call(
        server, ("logs", {"job": job, "lines": 3}),
        ("sql", {"query": f"SELECT id, state FROM jobs WHERE id = {job}", "format": "json"}),
        ("sql", {"query": "DROP TABLE jobs"}), ("report", {"since": "1d", "format": "json"}),
        ("report", {"by": "planet"}))
    assert text(tail) == "498\n499\n500\n"
    assert json.loads(text(rows)) == [{"id": job, "state": "succeeded"}]
    assert write.is_error and text(write).count("\n") == 0
    # what `eventsched report --format json` prints
    assert json.loads(text(usage)) == json.loads(daemon.cli("report", "--since", "1d", "--format", "json").stdout)
    assert bad_by.is_error and text(bad_by).count("\n") == 0


@pytest.mark.slow
@needs_root
def test_another_users_job_cannot_be_cancelled_through_it(daemon: Daemon, users) -> None:  # noqa: F811
    alice, bob = users
    theirs = as_user(alice, daemon.state_dir, "submit", "--gpus", "0", "--", "sleep", "120")
    assert theirs.returncode == 0, theirs.stderr
    job = int(theirs.stdout)
    # bob's agent: the server runs as bob, in a clean login's environment
    as_bob = StdioServerParameters(
        command="setpriv", cwd=bob.home,
        args=[f"--reuid={bob.uid}", f"--regid={bob.gid}", "--init-groups", "env", "-i",
              *(f"{k}={v}" for k, v in user_env(bob, daemon.state_dir).items()), f"{VENV_BIN}/eventsched", "mcp"])
    _, (refused,) = call(as_bob, ("cancel", {"jobs": [job]}))
    assert refused.is_error
    assert text(refused).count("\n") == 0 and str(job) in text(refused), text(refused)
    assert daemon.jobs()[job]["state"] in ("queued", "running")
    daemon.cli("cancel", str(job))


def test_without_the_sdk_it_says_how_to_install_it(tmp_path: Path) -> None:
    hide_sdk = "import sys; sys.modules['mcp'] = None; from eventsched.cli import main; sys.exit(main(['mcp']))"
    env = {**os.environ, "EVENTSCHED_STATE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", hide_sdk], capture_output=True, text=True, env=env, timeout=30,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "pip install 'eventsched[mcp]'" in proc.stderr
