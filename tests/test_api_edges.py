"""The daemon's front doors at their edges, as a client meets them: HTTP
requests with a wrong method, path, body, token or token file; the tokens a
user may not make or revoke; an ``--http`` port already taken; and a jobs
file the daemon follows that is missing, too big, owned by nobody, looped,
removed and back, or next to a bad ``llm_config.json``.

A real ``eventsched serve`` each (one with ``--http`` on 127.0.0.1, one
following a jobs file). Each refusal is checked as the client sees it (the
status and JSON body, or the one log line) and so is that nothing changed.
"""

from __future__ import annotations

import http.client
import json
import os
import pwd
import socket
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from daemon_harness import EVENTSCHED, Daemon, free_port, http_daemon, wait_http

from eventsched.domain.events import JobSpec
from eventsched.runtime.api.tokens import MAX_TOKENS_PER_USER, TOKEN_FILE, digest
from eventsched.wire import protocol
from eventsched.wire.client import Client

ME = pwd.getpwuid(os.geteuid()).pw_name
KEPT_SECRET = "est_" + "k" * 43  # a token in the file the daemon starts with
GONE_SECRET = "est_" + "g" * 43  # its user has no account any more


def _uid_without_account() -> int:
    uid = 4242
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


GONE_UID = _uid_without_account()


def _wait(predicate: Callable[[], Any], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def log_lines(daemon: Daemon) -> list[dict[str, Any]]:
    """The daemon's JSON log lines so far."""
    text = (daemon.state_dir / "daemon.stderr").read_text()
    lines: list[dict[str, Any]] = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:  # not JSON, or the last line still being written
            continue
    return lines


def said(daemon: Daemon, message: str) -> int:
    """How many log lines are ``message`` exactly."""
    return sum(line["msg"] == message for line in log_lines(daemon))


def no_traceback(daemon: Daemon) -> None:
    assert "Traceback" not in (daemon.state_dir / "daemon.stderr").read_text()


# --- the HTTP API --------------------------------------------------------------------


class Api:
    def __init__(self, daemon: Daemon, port: int, token: str) -> None:
        self.daemon, self.port, self.token = daemon, port, token
        self.url = f"http://127.0.0.1:{port}"

    def call(self, path: str, method: str = "GET", token: str | None = None,
             body: bytes | None = None) -> tuple[int, Any, Any]:
        """One request: (status, JSON body, headers)."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = token if " " in token else f"Bearer {token}"
        request = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, raw, got = response.status, response.read(), response.headers
        except urllib.error.HTTPError as exc:
            status, raw, got = exc.code, exc.read(), exc.headers
        return status, json.loads(raw), got

    def raw(self, head: str, body: bytes = b"") -> tuple[int, Any]:
        """``head`` (request line and headers) and ``body`` sent as they are, all at once."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
            sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
            response = http.client.HTTPResponse(sock)
            response.begin()
            return response.status, json.loads(response.read())

    def tokens(self) -> list[dict[str, Any]]:
        listed = self.daemon.cli("token", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        return json.loads(listed.stdout)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    # a token file from before: one token of ours, one of a user since removed; left readable by others
    stored = [{"id": "0000kept", "name": "kept", "uid": os.geteuid(), "created": 1.0, "sha256": digest(KEPT_SECRET)},
              {"id": "0000gone", "name": "gone", "uid": GONE_UID, "created": 2.0, "sha256": digest(GONE_SECRET)}]
    daemon, port = http_daemon(tmp_path_factory.mktemp("api") / "state", stored, mode=0o644)
    try:
        yield Api(daemon, port, KEPT_SECRET)
        no_traceback(daemon)
    finally:
        daemon.stop()


def test_a_token_file_others_could_read_is_closed_and_its_tokens_still_work(api: Api) -> None:
    path = api.daemon.state_dir / TOKEN_FILE
    status, answer, _ = api.call("/v1/status", token=KEPT_SECRET)  # the file is read when first needed
    assert status == 200 and "gpus" in answer
    assert said(api.daemon, f"{path} was readable by others (mode 644); made it 0600") == 1
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert {(t["id"], t["name"]) for t in api.tokens()} == {("0000kept", "kept"), ("0000gone", "gone")}


def test_a_token_whose_user_is_gone_is_401_and_submits_nothing(api: Api) -> None:
    before = api.daemon.jobs()
    body = json.dumps({"spec": {"command": ["true"], "gpus": 0}}).encode()
    for method, path, data in (("POST", "/v1/jobs", body), ("GET", "/v1/jobs", None), ("GET", "/metrics", None)):
        status, answer, headers = api.call(path, method, GONE_SECRET, data)
        assert status == 401, answer
        assert answer == {"error": f"the user of token 0000gone (uid {GONE_UID}) no longer exists", "kind": "forbidden"}
        assert headers["WWW-Authenticate"] == 'Bearer realm="eventsched"'
    assert api.daemon.jobs() == before


def test_another_scheme_or_a_token_not_of_ours_is_401(api: Api) -> None:
    missing = "missing token: send `Authorization: Bearer TOKEN` (make one with `eventsched token create`)"
    for header, error in ((f"Basic {KEPT_SECRET}", missing), ("Bearer   ", missing),
                          ("Bearer " + "k" * 43, "unknown or revoked token"),  # without our prefix
                          ("Bearer " + KEPT_SECRET + "k" * 300, "unknown or revoked token")):  # far too long
        status, answer, headers = api.call("/v1/jobs", token=header)
        assert (status, answer) == (401, {"error": error, "kind": "forbidden"}), header
        assert headers["WWW-Authenticate"] == 'Bearer realm="eventsched"'


def test_a_method_a_path_does_not_take_is_405_naming_both_and_changes_nothing(api: Api) -> None:
    before = api.daemon.jobs()
    body = json.dumps({"spec": {"command": ["true"], "gpus": 0}}).encode()
    for method, path in (("PUT", "/v1/jobs"), ("PATCH", "/v1/jobs/1"), ("POST", "/v1/status"),
                         ("DELETE", "/v1/status"), ("GET", "/v1/cancel"), ("POST", "/health"),
                         ("DELETE", "/v1/jobs/1/logs")):
        status, answer, _ = api.call(path, method, api.token, body if method in ("PUT", "POST", "PATCH") else None)
        assert (status, answer) == (405, {"error": f"Method Not Allowed: {method} {path}", "kind": "invalid"}), (method, path)
    assert api.daemon.jobs() == before


def test_a_path_no_route_takes_is_404_with_or_without_a_token(api: Api) -> None:
    for path in ("/v1/jobs/abc", "/v1/jobs/-1", "/v1/jobs/1/nothing", "/v2/jobs", "/"):
        for token in (None, api.token):
            status, answer, _ = api.call(path, token=token)
            assert (status, answer) == (404, {"error": f"Not Found: GET {path}", "kind": "not_found"}), path


def test_a_job_that_does_not_exist_is_404(api: Api) -> None:
    for job in (0, 99999):
        status, answer, _ = api.call(f"/v1/jobs/{job}", token=api.token)
        assert (status, answer) == (404, {"error": f"no job {job}", "kind": "not_found"})


def test_a_cancel_without_a_job_id_is_400(api: Api) -> None:
    for body in (b"{}", b'{"arrays": true}', b'{"jobs": [], "array_tasks": []}'):
        status, answer, _ = api.call("/v1/cancel", "POST", api.token, body)
        assert (status, answer) == (400, {"error": "no job id given", "kind": "invalid"}), body


@pytest.mark.parametrize("size", [2 << 20, 17 << 20], ids=["over-the-limit", "over-what-is-read-before-the-answer"])
def test_a_chunked_body_over_the_limit_is_413_and_submits_nothing(api: Api, size: int) -> None:
    """No Content-Length to refuse it by: the body is counted as it comes."""
    before = api.daemon.jobs()
    body = b'{"spec": {"command": ["true"], "gpus": 0, "env": {"A": "' + b"x" * size + b'"}}}'
    step = 1 << 20
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + step]), body[i : i + step]) for i in range(0, len(body), step))
    head = (f"POST /v1/jobs HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer {api.token}\n"
            "Content-Type: application/json\nTransfer-Encoding: chunked\nConnection: close\n")
    status, answer = api.raw(head, chunked + b"0\r\n\r\n")
    assert (status, answer) == (413, {"error": "the body is over the 1048576-byte limit", "kind": "over_limit"})
    assert api.daemon.jobs() == before


def test_the_token_variable_never_reaches_a_jobs_environment_from_a_raw_request(api: Api, tmp_path: Path) -> None:
    spec = {"command": ["sh", "-c", 'echo "${EVENTSCHED_TOKEN:-none} $KEPT_VAR"'], "gpus": 0, "cwd": str(tmp_path),
            "env": {"EVENTSCHED_TOKEN": api.token, "KEPT_VAR": "kept", "PATH": os.environ["PATH"]}}
    status, made, _ = api.call("/v1/jobs", "POST", api.token, json.dumps({"spec": spec}).encode())
    assert status == 201, made
    api.daemon.wait_states([made["id"]], {"succeeded"})
    assert api.daemon.logs(made["id"]) == "none kept\n"
    dump = api.daemon.cli("log", "dump", str(api.daemon.state_dir / "log"))
    assert dump.returncode == 0 and api.token not in dump.stdout


@pytest.mark.parametrize("field", ["array", "array_cap", "warn_signal", "host_mem_mib", "array_id"])
def test_a_number_the_log_cannot_hold_is_400_and_the_daemon_lives_on(api: Api, field: str) -> None:
    before = api.daemon.jobs()
    huge = 2 ** 64  # JSON takes it, msgpack (the log) does not
    body: dict[str, Any] = {"spec": {"command": ["true"], "gpus": 0}}
    if field == "array":
        body["array"] = [huge]
    else:
        body["spec"][field] = huge
    status, answer, _ = api.call("/v1/jobs", "POST", api.token, json.dumps(body).encode())
    assert (status, answer) == (400, {"error": "bad request: a number out of range (integers from -2**63 to 2**64-1)",
                                      "kind": "invalid"})
    assert api.call("/health")[0] == 200 and api.daemon.jobs() == before


def test_listing_more_jobs_than_one_page_lists_each_once(api: Api, tmp_path: Path) -> None:
    for gpu in (0, 1):  # the jobs stay queued
        assert api.daemon.cli("pause-gpu", str(gpu)).returncode == 0
    ids: list[int] = []
    try:
        with Client(api.daemon.socket) as client:
            ids = client.submit_many([JobSpec(command=["true"], gpus=1, cwd=str(tmp_path))] * 260)
        status, listed, _ = api.call("/v1/jobs", token=api.token)
        assert status == 200
        assert [job["id"] for job in listed] == sorted(i for i, job in api.daemon.jobs().items() if job["state"] == "queued")
        assert set(ids) <= {job["id"] for job in listed}
    finally:
        with Client(api.daemon.socket) as client:
            client.cancel(ids)
        for gpu in (0, 1):
            assert api.daemon.cli("resume-gpu", str(gpu)).returncode == 0


# --- tokens a user may not make or revoke --------------------------------------------


def test_a_users_token_over_the_limit_is_refused_in_one_line_and_changes_nothing(api: Api) -> None:
    nobody = pwd.getpwnam("nobody")
    with Client(api.daemon.socket) as client:
        made = [client.request(protocol.CreateToken(name=f"n{i}", for_uid=nobody.pw_uid))
                for i in range(MAX_TOKENS_PER_USER)]
    try:
        before = api.tokens()
        refused = api.daemon.cli("token", "create", "--user", "nobody", "--name", "one-more")
        assert (refused.returncode, refused.stdout) == (1, "")
        assert refused.stderr == (f"eventsched: error: uid {nobody.pw_uid} already has {MAX_TOKENS_PER_USER} tokens "
                                  f"(limit {MAX_TOKENS_PER_USER}); revoke some first\n")
        assert api.tokens() == before
    finally:
        with Client(api.daemon.socket) as client:
            for token in made:
                client.request(protocol.RevokeToken(token=token["id"]))


def test_revoking_a_name_several_users_share_asks_for_the_id_unless_one_is_the_operators_own(api: Api) -> None:
    with Client(api.daemon.socket) as client:
        others = [client.request(protocol.CreateToken(name="shared", for_uid=pwd.getpwnam(user).pw_uid))
                  for user in ("nobody", "daemon")]
    before = api.tokens()
    refused = api.daemon.cli("token", "revoke", "shared")
    assert (refused.returncode, refused.stdout) == (2, "")  # asked wrongly: a usage error
    assert refused.stderr == ("eventsched: error: several tokens are named 'shared'; "
                              "revoke one by its id (`eventsched token list`)\n")
    assert api.tokens() == before

    mine = json.loads(api.daemon.cli("token", "create", "--name", "shared", "--json").stdout)
    revoked = api.daemon.cli("token", "revoke", "shared")
    assert (revoked.returncode, revoked.stdout) == (0, f"revoked token {mine['id']} (shared) of {ME}\n"), revoked.stderr
    assert api.tokens() == before
    for token in others:
        assert api.daemon.cli("token", "revoke", token["id"]).returncode == 0


# --- serve --http mistakes found before anything starts ---------------------------------


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"tokens": [{"id": "x"}]}'],
                         ids=["not-json", "not-an-object", "not-a-token"])
def test_a_damaged_token_file_refuses_every_token_in_one_line_and_is_not_written_over(tmp_path: Path,
                                                                                     damage: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / TOKEN_FILE).write_text(damage)
    (state / TOKEN_FILE).chmod(0o600)
    port = free_port()
    with Daemon(state, gpus="fake:1", extra=["--http", f"127.0.0.1:{port}"]) as daemon:
        api = Api(daemon, port, KEPT_SECRET)
        wait_http(daemon, port)
        status, answer, _ = api.call("/v1/jobs", token=KEPT_SECRET)
        assert status == 503 and answer["kind"] == "unavailable", answer
        why = answer["error"]
        assert why.startswith(f"the token file {state / TOKEN_FILE} cannot be read (") and "\n" not in why
        assert why.endswith("); fix it, or move it aside to start with no tokens")
        for args in (["token", "list"], ["token", "create", "--name", "new"]):
            refused = daemon.cli(*args)
            assert (refused.returncode, refused.stdout, refused.stderr) == (1, "", f"eventsched: error: {why}\n")
        assert (state / TOKEN_FILE).read_text() == damage  # nothing written over what the operator must fix
        (state / TOKEN_FILE).unlink()  # moved aside: no tokens, and a new one works at once
        made = daemon.cli("token", "create", "--name", "new")
        assert made.returncode == 0, made.stderr
        assert api.call("/v1/jobs", token=made.stdout.strip())[0] == 200
        assert "Traceback" not in daemon.stderr()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])  # a name is looked up: localhost is loopback
def test_an_http_port_in_use_is_one_line_and_nothing_starts(tmp_path: Path, host: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("EVENTSCHED_") or k == "EVENTSCHED_PURE"}
        result = subprocess.run([*EVENTSCHED, "serve", "--gpus", "fake:1", "--state-dir", str(tmp_path / "state"),
                                 "--http", f"{host}:{port}"], env=env, capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"eventsched: error: --http {host}:{port}: Address already in use")
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "state" / "log").exists()


def test_an_http_host_that_does_not_resolve_says_so_and_nothing_starts(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVENTSCHED_") or k == "EVENTSCHED_PURE"}
    result = subprocess.run([*EVENTSCHED, "serve", "--gpus", "fake:1", "--state-dir", str(tmp_path / "state"),
                             "--http", "no-such-host.invalid:8080"], env=env, capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout) == (2, "")
    # the name, not the network, is what is wrong: not "is not a loopback address"
    assert result.stderr.startswith("eventsched: error: --http no-such-host.invalid:8080: cannot resolve "
                                    "'no-such-host.invalid' (")
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "state" / "log").exists()


# --- a jobs file the daemon follows ----------------------------------------------------


class Followed:
    def __init__(self, daemon: Daemon, path: Path) -> None:
        self.daemon, self.path = daemon, path
        self.llm = path.parent / "llm_config.json"

    @property
    def refused(self) -> str:
        return f"jobs file {self.path} is not followed: "

    def text(self) -> str:
        return self.path.read_text() if self.path.exists() else ""

    def put(self, text: str, path: Path | None = None) -> None:
        """``text`` into the file at once (a new inode): no look sees half of it."""
        path = path or self.path
        spare = path.with_name(path.name + ".new")
        spare.write_text(text)
        spare.chmod(0o644)
        spare.replace(path)

    def append(self, lines: str) -> int:
        """Add ``lines`` (each ending in a newline); the number of the first."""
        text = self.text()
        self.put(text + lines)
        return len(text.splitlines()) + 1

    def await_said(self, message: str, times: int = 1) -> None:
        _wait(lambda: said(self.daemon, message) >= times, f"the log to say {message!r}")

    def following(self) -> int:
        return said(self.daemon, f"following the jobs file {self.path}")

    def jobs(self) -> dict[int, dict[str, Any]]:
        return self.daemon.jobs()

    def await_jobs(self, count: int) -> dict[int, dict[str, Any]]:
        return self.daemon.wait_for(lambda jobs: len(jobs) == count, what=f"{count} jobs")

    def stays(self, jobs: dict[int, dict[str, Any]]) -> None:
        """Another look at the file submits nothing."""
        time.sleep(1.3)
        assert self.jobs().keys() == jobs.keys()


@pytest.fixture(scope="module")
def followed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Followed]:
    root = tmp_path_factory.mktemp("follow")
    (root / "proj").mkdir()
    path = root / "proj" / "jobs.txt"  # not there yet
    config = root / "serve.toml"
    config.write_text(f'jobs_file = "{path}"\n')
    with Daemon(root / "state", gpus="fake:2:16384", extra=["--config", str(config)]) as daemon:
        for gpu in (0, 1):  # jobs stay queued: what each asked for can be read
            assert daemon.cli("pause-gpu", str(gpu)).returncode == 0
        yield Followed(daemon, path)
        no_traceback(daemon)


def test_a_jobs_file_not_there_yet_is_waited_for_then_followed(followed: Followed) -> None:
    missing = not followed.path.exists()  # as the daemon started, unless another test made it
    if missing:
        followed.await_said(f"jobs file {followed.path} does not exist yet; waiting for it")
        assert followed.jobs() == {}
    before, times = followed.jobs(), followed.following()
    followed.append("0,/srv/a.py,,,\n")
    followed.await_jobs(len(before) + 1)
    if missing:
        followed.await_said(f"following the jobs file {followed.path}", times + 1)


def test_a_last_line_without_its_newline_is_submitted_whole(followed: Followed) -> None:
    """It may be half written: it waits for a look that finds the file as it was."""
    before = followed.jobs()
    followed.put(followed.text() + "0,/srv/b.py,,--n 12345")
    try:
        jobs = followed.await_jobs(len(before) + 1)
        assert jobs[max(jobs)]["command"][3:5] == ["--n", "12345"]
    finally:
        followed.append("\n")
    followed.stays(jobs)


def test_a_bad_line_is_logged_once_by_file_and_line_and_the_rest_still_load(followed: Followed) -> None:
    before = followed.jobs()
    first = followed.append("high,/srv/x.py,,,\n0,/srv/c.py,,,\n")
    jobs = followed.await_jobs(len(before) + 1)
    followed.append("# looked at again\n")
    followed.stays(jobs)
    bad = [line for line in log_lines(followed.daemon) if line["msg"].startswith(f"{followed.path}:{first}: ")]
    assert len(bad) == 1 and bad[0]["level"] == "error", bad
    assert bad[0]["msg"].endswith("priority 'high' is not a whole number (lower runs first, e.g. 0)")


def test_a_jobs_file_over_16_mib_is_not_followed_until_it_shrinks(followed: Followed) -> None:
    text = followed.text()
    before = followed.jobs()
    followed.put(text + "0,/srv/d.py,,,\n" + ("#" * 1023 + "\n") * (17 << 10))
    followed.await_said(followed.refused + "it is larger than 16 MiB")
    followed.stays(before)
    followed.put(text + "0,/srv/d.py,,,\n")
    followed.await_jobs(len(before) + 1)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file away")
def test_a_jobs_file_whose_owner_has_no_account_is_not_followed(followed: Followed) -> None:
    before = followed.jobs()
    followed.append("")
    os.chown(followed.path, GONE_UID, -1)
    try:
        with open(followed.path, "a") as f:  # chown first: no look may take the line before
            f.write("0,/srv/e.py,,,\n")
        followed.await_said(followed.refused + f"its owner, uid {GONE_UID}, has no account "
                            "(no user name, groups or home to run the lines with)")
        followed.stays(before)
    finally:
        os.chown(followed.path, os.geteuid(), -1)
    followed.await_jobs(len(before) + 1)


def test_a_jobs_file_that_is_a_symlink_loop_is_not_followed(followed: Followed) -> None:
    followed.append("")
    before, times = followed.jobs(), followed.following()
    aside = followed.path.with_name("jobs.real")
    followed.path.rename(aside)
    followed.path.symlink_to(followed.path.name)  # itself
    try:
        followed.await_said(followed.refused + "cannot open it: Too many levels of symbolic links")
        followed.stays(before)
    finally:
        followed.path.unlink()
        aside.rename(followed.path)
    followed.await_said(f"following the jobs file {followed.path}", times + 1)
    followed.stays(before)  # what it held was submitted before


def test_a_removed_jobs_file_is_waited_for_and_what_it_held_is_not_submitted_again(followed: Followed) -> None:
    if not followed.path.exists():  # run alone: it must be there and looked at before it goes
        followed.append("")
        time.sleep(1.3)
    text = followed.text()
    before = followed.jobs()
    waiting = f"jobs file {followed.path} does not exist yet; waiting for it"
    times = said(followed.daemon, waiting)
    followed.path.unlink(missing_ok=True)
    followed.await_said(waiting, times + 1)
    followed.put(text + "0,/srv/f.py,,,\n")
    jobs = followed.await_jobs(len(before) + 1)
    followed.stays(jobs)
    assert jobs[max(jobs)]["command"][2] == "/srv/f.py"


@pytest.mark.slow
def test_an_unsafe_or_malformed_llm_config_beside_it_stops_the_following_until_fixed(followed: Followed) -> None:
    before = followed.jobs()
    followed.put('{"default_requirement": 0.25, "models": {"tiny": 0.5}}', followed.llm)
    followed.llm.chmod(0o664)
    followed.append("0,/srv/g.py,,--llm tiny,\n")
    where = f"its LLM config {followed.llm}: "
    followed.await_said(followed.refused + where + "it is group- or world-writable (mode 664): anyone who may write "
                        f"it could run code as its owner; `chmod go-w {followed.llm}` to follow it")
    followed.stays(before)
    if os.geteuid() == 0:
        os.chown(followed.llm, GONE_UID, -1)
        followed.llm.chmod(0o644)
        followed.await_said(followed.refused + where + f"it belongs to uid {GONE_UID}, not to uid 0")
        followed.stays(before)
    cut = '{"default_requirement": 0.25, "models": {"tiny": 0.5'
    followed.put(cut, followed.llm)
    with pytest.raises(json.JSONDecodeError) as bad:
        json.loads(cut)
    followed.await_said(followed.refused + f"{followed.llm}: not valid JSON: {bad.value.msg} "
                        f"(line {bad.value.lineno}, column {bad.value.colno})")
    followed.stays(before)

    followed.put('{"default_requirement": 0.25, "models": {"tiny": 0.5}}', followed.llm)
    jobs = followed.await_jobs(len(before) + 1)
    assert jobs[max(jobs)]["gpus"] == 0.5  # sized by the config once it could be read
    followed.stays(jobs)  # the lines sent again with the new sizes were all submitted before


def test_a_removed_llm_config_sizes_the_next_lines_by_the_default_again(followed: Followed) -> None:
    before = followed.jobs()
    followed.put('{"default_requirement": 0.25, "models": {"tiny": 0.5}}', followed.llm)
    followed.append("0,/srv/h.py,,--llm tiny,\n")
    jobs = followed.await_jobs(len(before) + 1)
    assert jobs[max(jobs)]["gpus"] == 0.5
    followed.llm.unlink()
    time.sleep(1.3)  # seen gone
    followed.append("0,/srv/i.py,,--llm tiny,\n")
    jobs = followed.await_jobs(len(before) + 2)
    assert jobs[max(jobs)]["gpus"] == 1.0  # no config: one GPU, as before there was one
    followed.stays(jobs)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file away")
def test_a_line_its_owner_may_not_submit_is_logged_by_file_and_line(followed: Followed) -> None:
    before = followed.jobs()
    followed.append("")
    os.chown(followed.path, pwd.getpwnam("nobody").pw_uid, -1)  # its lines run as nobody, no operator
    try:
        first = len(followed.text().splitlines()) + 1
        with open(followed.path, "a") as f:
            f.write("1000,/srv/j.py,,,\n0,/srv/k.py,,,\n")
        jobs = followed.await_jobs(len(before) + 1)
        assert jobs[max(jobs)]["user"] == "nobody" and jobs[max(jobs)]["command"][2] == "/srv/k.py"
        followed.stays(jobs)
    finally:
        os.chown(followed.path, os.geteuid(), -1)
    assert said(followed.daemon, f"{followed.path}:{first}: --priority -1000 is outside [-100, 100]; "
                "higher priorities are for operators") == 1
