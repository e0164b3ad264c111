"""The HTTP API: ``serve --http``, ``eventsched token``,
and the CLI over ``EVENTSCHED_URL``.

A root daemon serves two real unprivileged users (``users_harness``); each
makes a token over the socket as themselves, and the API then acts as that
user with exactly their socket permissions. The CLI's contract (output and
exit codes of submit, queue, cancel, status, explain, health) is checked
over both transports, run as the same user.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from daemon_harness import EVENTSCHED, Daemon, free_port
from users_harness import (  # noqa: F401
    User,
    as_user,
    needs_root,
    public_dir,
    root_daemon,
    user_env,
    users,
)

from eventsched.runtime.api import http_api

JOB_KEYS = {"id", "name", "tenant", "reason", "user", "state", "priority", "gpus", "gpu_ids",
            "submitted_at", "started_at", "ended_at", "exit_code"}
GPU_KEYS = {"id", "allocated", "paused", "utilization", "memory_used_mib", "memory_total_mib", "temperature_c"}



def call(url: str, method: str = "GET", token: str | None = None, body: bytes | None = None) -> tuple[int, Any]:
    """One HTTP request: (status, JSON or text)."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, raw, kind = response.status, response.read(), response.headers.get("content-type", "")
    except urllib.error.HTTPError as exc:
        status, raw, kind = exc.code, exc.read(), exc.headers.get("content-type", "")
    return status, json.loads(raw) if "json" in kind else raw.decode()


class Setup:
    def __init__(self, daemon: Daemon, url: str, alice: User, bob: User) -> None:
        self.daemon, self.url, self.alice, self.bob = daemon, url, alice, bob
        self.tokens: dict[str, str] = {}

    def token(self, user: User, name: str = "main") -> str:
        made = as_user(user, self.daemon.state_dir, "token", "create", "--name", name)
        assert made.returncode == 0, made.stderr
        return made.stdout.strip()

    def cli(self, user: User, transport: str, *args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
        """``eventsched ARGS`` as ``user``, over the socket or over HTTP
        (``http-full``: without the CLI's fast path, cli/quick.py)."""
        env = user_env(user, self.daemon.state_dir)
        if transport.startswith("http"):
            env.update(EVENTSCHED_URL=self.url, EVENTSCHED_TOKEN=self.tokens[user.name])
        if transport.endswith("full"):
            env.update(EVENTSCHED_NO_QUICK="1")
        return as_user(user, self.daemon.state_dir, *args, env=env, cwd=cwd)

    def submit(self, token: str, command: list[str], **spec: Any) -> tuple[int, Any]:
        body = json.dumps({"spec": {"command": command, "gpus": 0.5, **spec}}).encode()
        return call(self.url + "/v1/jobs", "POST", token, body)

    def jobs(self) -> dict[int, dict[str, Any]]:
        return self.daemon.jobs()


@pytest.fixture(scope="module")
def setup(users: tuple[User, User], public_dir: Path) -> Iterator[Setup]:  # noqa: F811
    port = free_port()
    with root_daemon(public_dir, "--http", f"127.0.0.1:{port}", gpus="fake:2:16384") as daemon:
        s = Setup(daemon, f"http://127.0.0.1:{port}", *users)
        for user in users:
            s.tokens[user.name] = s.token(user)
        yield s


# --- tokens: who a request acts as -------------------------------------------------


@pytest.mark.slow
@needs_root
def test_a_tokens_user_cancels_their_own_job_and_nobody_elses(setup: Setup) -> None:
    alice, bob = setup.alice, setup.bob
    a, b = setup.tokens[alice.name], setup.tokens[bob.name]
    # whatever identity the body claims, the job is the token's user's
    status, made = setup.submit(a, ["sleep", "60"], user="root", uid=0, gid=0, cwd=alice.home)
    assert status == 201, made
    job = made["id"]
    status, shown = call(f"{setup.url}/v1/jobs/{job}", token=b)  # anyone may see the queue's metadata
    assert status == 200 and shown["user"] == alice.name
    setup.daemon.wait_states([job], {"running"})

    status, answer = call(f"{setup.url}/v1/jobs/{job}", "DELETE", b)
    assert status == 403 and "belongs to" in answer["error"]
    status, answer = call(f"{setup.url}/v1/cancel", "POST", b, json.dumps({"jobs": [job]}).encode())
    assert status == 200 and answer["jobs"] == [] and "belongs to" in answer["refused"][0]["reason"]
    time.sleep(0.3)
    assert setup.jobs()[job]["state"] == "running"

    status, answer = call(f"{setup.url}/v1/jobs/{job}", "DELETE", a)
    assert status == 200 and answer["id"] == job
    assert setup.daemon.wait_states([job], {"cancelled"})[job]["user"] == alice.name


@pytest.mark.slow
@needs_root
def test_bad_missing_and_revoked_tokens_get_401_and_change_nothing(setup: Setup) -> None:
    alice, bob = setup.alice, setup.bob
    spare = setup.token(alice, "spare")
    status, made = setup.submit(spare, ["sleep", "60"], cwd=alice.home)
    assert status == 201
    victim = made["id"]
    setup.daemon.wait_states([victim], {"running"})

    # only root makes a token of another user; bob cannot revoke alice's token; alice can
    impostor = as_user(bob, setup.daemon.state_dir, "token", "create", "--user", alice.name)
    assert impostor.returncode == 1 and "only root" in impostor.stderr
    refused = as_user(bob, setup.daemon.state_dir, "token", "revoke", "spare")
    assert refused.returncode == 1 and "no token 'spare' of yours" in refused.stderr
    revoked = as_user(alice, setup.daemon.state_dir, "token", "revoke", "spare")
    assert revoked.returncode == 0, revoked.stderr
    mine = json.loads(as_user(alice, setup.daemon.state_dir, "token", "list", "--json").stdout)
    assert [t["name"] for t in mine] == ["main"] and all(t["user"] == alice.name for t in mine)
    everyone = {(t["user"], t["name"]) for t in json.loads(setup.daemon.cli("token", "list", "--json").stdout)}
    assert everyone == {(alice.name, "main"), (bob.name, "main")}

    before = setup.jobs()
    body = json.dumps({"spec": {"command": ["true"]}}).encode()
    for token in (None, "", "est_not-a-token", spare, setup.tokens[alice.name] + "x"):
        for method, path, data in (("POST", "/v1/jobs", body), ("DELETE", f"/v1/jobs/{victim}", None),
                                   ("POST", "/v1/cancel", json.dumps({"jobs": [victim]}).encode()),
                                   ("GET", "/v1/jobs", None), ("GET", "/metrics", None)):
            status, answer = call(setup.url + path, method, token, data)
            assert status == 401, (token, path, answer)
            assert "token" in answer["error"]
    time.sleep(0.3)
    after = setup.jobs()
    assert after.keys() == before.keys() and after[victim]["state"] == "running"
    assert setup.daemon.cli("cancel", str(victim)).returncode == 0

    # only a hash is kept, in a file nobody else can read
    stored = setup.daemon.state_dir / "api-tokens.json"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    text = stored.read_text()
    assert setup.tokens[alice.name] not in text and spare not in text


@pytest.mark.slow
@needs_root
def test_malformed_or_oversized_bodies_get_one_line_and_change_nothing(setup: Setup) -> None:
    token = setup.tokens[setup.alice.name]
    before = setup.jobs().keys()
    for body, status_wanted, words in (
        (b"{not json", 400, "malformed JSON"),
        (b'{"spec": {"gpus": 1}}', 400, "missing required field `command`"),
        (b'{"spec": {"command": ["true"]}, "shell": 1}', 400, "unknown field"),
        (b'[1, 2]', 400, "bad request"),
        (b'{"spec": {"command": ["true"], "env": {"A": "' + b"x" * (2 << 20) + b'"}}}', 413, "limit"),
    ):
        status, answer = call(setup.url + "/v1/jobs", "POST", token, body)
        assert status == status_wanted, answer
        assert words in answer["error"] and "\n" not in answer["error"]
    status, answer = call(setup.url + "/v1/cancel", "POST", token, b"{")
    assert status == 400 and "malformed JSON" in answer["error"]
    status, answer = call(setup.url + "/v1/nothing-here", token=token)
    assert status == 404 and "error" in answer
    assert setup.jobs().keys() == before


@pytest.mark.slow
@needs_root
def test_health_answers_anyone_and_metrics_a_token(setup: Setup) -> None:
    status, health = call(setup.url + "/health")
    assert status == 200 and health["ok"] is True and health["seq"] > 0
    assert call(setup.url + "/metrics")[0] == 401
    status, text = call(setup.url + "/metrics", token=setup.tokens[setup.bob.name])
    assert status == 200 and "eventsched_jobs_active" in text and "eventsched_log_seq" in text


@pytest.mark.slow
@needs_root
def test_the_token_never_reaches_a_jobs_environment_or_the_log(setup: Setup) -> None:
    alice = setup.alice
    token = setup.tokens[alice.name]
    out = Path(alice.home) / "token-seen"
    ran = setup.cli(alice, "http", "submit", "--gpus", "0.1", "--", "sh", "-c",
                    f'echo "${{EVENTSCHED_TOKEN:-none}}" > {out}')
    assert ran.returncode == 0, ran.stderr
    setup.daemon.wait_states([int(ran.stdout)], {"succeeded"})
    assert out.read_text().strip() == "none"
    dump = setup.daemon.cli("log", "dump", str(setup.daemon.state_dir / "log"))
    assert dump.returncode == 0 and token not in dump.stdout


# --- the CLI's contract, over both transports ---------------------------------------


@pytest.mark.slow
@needs_root
@pytest.mark.parametrize("transport", ["socket", "http", "http-full"])
def test_the_cli_contract_holds_over_both_transports(setup: Setup, transport: str) -> None:
    alice, bob = setup.alice, setup.bob

    def cli(*args: str, user: User = alice) -> subprocess.CompletedProcess:
        return setup.cli(user, transport, *args)

    # submit: the id alone; --json an object; a refusal one line, exit non-zero
    first = cli("submit", "--gpus", "0.5", "--name", f"c-{transport}", "--", "sleep", "60")
    assert first.returncode == 0 and first.stdout.strip().isdigit() and first.stderr == "", first.stderr
    job = int(first.stdout)
    second = cli("submit", "--json", "--gpus", "0.25", "--", "true")
    assert second.returncode == 0 and set(json.loads(second.stdout)) == {"id"}
    refused = cli("submit", "--after", "99999", "--", "true")
    assert refused.returncode == 1 and refused.stderr == "eventsched: error: --after: no job 99999\n"
    others = int(cli("submit", "--gpus", "0.25", "--", "sleep", "60", user=bob).stdout)
    setup.daemon.wait_states([job, others], {"running"})
    setup.daemon.wait_states([json.loads(second.stdout)["id"]], {"succeeded"})

    # queue: a JSON array with the contract's keys; the table names the job
    queue = cli("queue", "--json")
    assert queue.returncode == 0
    listed = {j["id"]: j for j in json.loads(queue.stdout)}
    assert JOB_KEYS <= set(listed[job]) and listed[job]["user"] == alice.name and listed[job]["state"] == "running"
    table = cli("queue")
    assert table.returncode == 0 and table.stdout.startswith("ID") and f"c-{transport}" in table.stdout

    # status: gpus with the contract's keys; the table
    status = cli("status", "--json")
    assert status.returncode == 0 and all(GPU_KEYS <= set(g) for g in json.loads(status.stdout)["gpus"])
    assert cli("status").stdout.startswith("GPU")

    # explain, health
    explained = cli("explain", "--json", str(job))
    assert explained.returncode == 0 and json.loads(explained.stdout)["job"]["id"] == job
    assert cli("explain", "99999").stderr == "eventsched: error: no job 99999\n"
    health = cli("health")
    assert health.returncode == 0 and health.stdout.startswith("ok: daemon pid")

    # cancel: what it can, one line for each other job, exit 1 if any
    cancelled = cli("cancel", str(job), str(others), "99999")
    assert cancelled.returncode == 1
    assert cancelled.stdout.startswith(f"{job}\t") and len(cancelled.stdout.splitlines()) == 1
    assert cancelled.stderr.splitlines() == [f"job {others}: belongs to {bob.name}", "job 99999: no such job"]
    assert cli("cancel", str(others), user=bob).returncode == 0
    nothing = cli("cancel", "12_x")
    assert nothing.returncode == 2 and len(nothing.stderr.splitlines()) == 1
    setup.daemon.wait_states([job, others], {"cancelled"})


@pytest.mark.slow
@needs_root
def test_both_transports_print_the_same(setup: Setup) -> None:
    alice = setup.alice
    for args in (["queue", "--all", "--json"], ["queue", "--all"], ["explain", "1"], ["cancel", "1"]):
        over_socket = setup.cli(alice, "socket", *args)
        over_http = setup.cli(alice, "http", *args)
        assert (over_http.returncode, over_http.stdout, over_http.stderr) == \
            (over_socket.returncode, over_socket.stdout, over_socket.stderr), args


# --- start-up and client mistakes (no daemon needed) ------------------------------------


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EVENTSCHED_") or k == "EVENTSCHED_PURE"}
    return subprocess.run([*EVENTSCHED, *args], env={**environ, **env}, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("address", "words"),
    [("0.0.0.0:8080", "not a loopback address"), ("nonsense", "HOST:PORT"), ("127.0.0.1:99999", "HOST:PORT")],
)
def test_serve_refuses_a_public_or_bad_http_address(tmp_path: Path, address: str, words: str) -> None:
    result = _cli("serve", "--gpus", "fake:1", "--state-dir", str(tmp_path), "--http", address)
    assert result.returncode == 2 and words in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "log").exists()  # refused before anything started


def test_without_the_http_extra_serve_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hypercorn" else real(name, *a))
    with pytest.raises(http_api.HttpSetupError, match=r"pip install 'eventsched\[http\]'"):
        http_api.prepare("127.0.0.1:0")


def test_the_cli_over_http_says_what_is_missing_or_wrong(tmp_path: Path) -> None:
    no_token = _cli("queue", EVENTSCHED_URL="http://127.0.0.1:9")
    assert no_token.returncode == 1 and "EVENTSCHED_TOKEN is not" in no_token.stderr
    nobody = _cli("queue", EVENTSCHED_URL=f"http://127.0.0.1:{free_port()}", EVENTSCHED_TOKEN="est_x")
    assert nobody.returncode == 1 and "no eventsched API answers" in nobody.stderr
    bad_url = _cli("status", EVENTSCHED_URL="ftp://x", EVENTSCHED_TOKEN="est_x")
    assert bad_url.returncode == 1 and "http://HOST:PORT" in bad_url.stderr
    for args in (["status", "--watch"], ["attach", "1"]):
        local_only = _cli(*args, EVENTSCHED_URL="http://127.0.0.1:9", EVENTSCHED_TOKEN="est_x")
        assert local_only.returncode == 2 and "EVENTSCHED_URL" in local_only.stderr, args
    assert all(len(r.stderr.splitlines()) == 1 for r in (no_token, nobody, bad_url))
