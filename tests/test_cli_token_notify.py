"""What a user sees from ``eventsched token`` and ``eventsched notify``: a real
daemon, the CLI as a real process, the hook read from real files.

The HTTP API and the hooks' deliveries have tests of their own
(test_http_api.py, test_notify.py); these check the commands' own output,
their one-line refusals, and that a refused command changes nothing."""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from daemon_harness import EVENTSCHED, Daemon

ME = pwd.getpwuid(os.geteuid()).pw_name
HOOK_URL = "http://127.0.0.1:9/hook"  # never called: no job ends here


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with Daemon(tmp_path / "state", gpus="fake:1") as d:
        yield d


def cli(daemon: Daemon, *args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``eventsched ARGS`` against ``daemon``; ``home``: the HOME it runs with."""
    env = daemon.env()
    if home is not None:
        env["HOME"] = str(home)
    return subprocess.run([*EVENTSCHED, *args], env=env, capture_output=True, text=True, timeout=30)


def ok(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 0, run.stderr
    return run.stdout


def error_line(run: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The one line a refused command prints, after checking it printed nothing else."""
    assert run.returncode == code and run.stdout == "", (run.returncode, run.stdout)
    assert len(run.stderr.splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr
    return run.stderr.strip()


# --- token -----------------------------------------------------------------------


def test_token_list_before_any_token(daemon: Daemon) -> None:
    assert ok(cli(daemon, "token", "list")) == "no tokens (make one with `eventsched token create`)\n"
    assert json.loads(ok(cli(daemon, "token", "list", "--json"))) == []


def test_token_create_list_and_revoke(daemon: Daemon) -> None:
    made = cli(daemon, "token", "create", "--name", "laptop")
    token = ok(made).strip()
    assert re.fullmatch(r"est_[\w-]{20,}", token) and made.stdout == token + "\n"  # stdout: the token alone
    told = re.fullmatch(r"token (\w+) \(laptop\) for (\S+): shown only this once\. Use it as\n"
                        r"  EVENTSCHED_URL=http://HOST:PORT EVENTSCHED_TOKEN=<token> eventsched queue\n", made.stderr)
    assert told and told[2] == ME, made.stderr
    laptop_id = told[1]
    as_json = json.loads(ok(cli(daemon, "token", "create", "--name", "ci", "--json")))
    assert as_json["name"] == "ci" and as_json["user"] == ME and as_json["token"].startswith("est_")
    unnamed = cli(daemon, "token", "create")
    assert ok(unnamed).startswith("est_") and "token-" in unnamed.stderr  # named after its id

    lines = ok(cli(daemon, "token", "list")).splitlines()
    assert lines[0].split() == ["ID", "NAME", "USER", "CREATED"] and len(lines) == 4
    rows = {line.split()[1]: line.split() for line in lines[1:]}
    assert rows["laptop"][0] == laptop_id and rows["ci"][0] == as_json["id"]
    assert all(row[2] == ME and re.fullmatch(r"\d{4}-\d\d-\d\d", row[3]) and re.fullmatch(r"\d\d:\d\d", row[4])
               for row in rows.values())
    assert token not in "\n".join(lines) and as_json["token"] not in "\n".join(lines)  # shown only once

    assert ok(cli(daemon, "token", "revoke", "laptop")) == f"revoked token {laptop_id} (laptop) of {ME}\n"
    assert ok(cli(daemon, "token", "revoke", as_json["id"])) == f"revoked token {as_json['id']} (ci) of {ME}\n"
    left = json.loads(ok(cli(daemon, "token", "list", "--json")))
    assert [t["name"] for t in left] == [next(name for name in rows if name.startswith("token-"))]


def test_refused_token_commands_are_one_line_and_change_nothing(daemon: Daemon) -> None:
    ok(cli(daemon, "token", "create", "--name", "laptop"))
    before = ok(cli(daemon, "token", "list", "--json"))
    assert error_line(cli(daemon, "token", "create", "--user", "no-such-user-here")) == (
        "eventsched: error: no user 'no-such-user-here' on this machine")
    assert error_line(cli(daemon, "token", "revoke", "desktop"), code=1) == (
        "eventsched: error: no token 'desktop' of yours (see `eventsched token list`)")
    assert error_line(cli(daemon, "token", "create", "--name", "laptop"), code=1) == (
        "eventsched: error: you already have a token named 'laptop'; revoke it or choose another name")
    assert ok(cli(daemon, "token", "list", "--json")) == before


# --- notify ----------------------------------------------------------------------


def write_hook_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


HOOK_FILE = f'webhook = "{HOOK_URL}"\nsecret = "s3cret"\non = ["end", "fail"]\nmail = "/bin/cat -u"\n'


def test_notify_list_and_clear_with_no_hook(daemon: Daemon) -> None:
    assert ok(cli(daemon, "notify", "list")) == "no notification hook (set one with `eventsched notify set`)\n"
    assert json.loads(ok(cli(daemon, "notify", "list", "--json"))) == []
    assert ok(cli(daemon, "notify", "clear")) == "no notification hook to remove\n"  # nothing to do is no error


def test_notify_set_from_the_default_file_then_clear(daemon: Daemon, tmp_path: Path) -> None:
    home = tmp_path / "home"
    hook_file = write_hook_file(home / ".config" / "eventsched" / "notify.toml", HOOK_FILE)
    set_ = cli(daemon, "notify", "set", home=home)
    assert set_.stderr == ""  # only its owner reads the secret: no warning
    assert ok(set_) == f"notification hook set for {ME}: {HOOK_URL} (signed); mail: /bin/cat -u, on end,fail\n"
    lines = ok(cli(daemon, "notify", "list")).splitlines()
    assert lines[0].split() == ["USER", "TO", "ON", "SENT", "LAST", "FAILURE"]
    assert lines[1].split() == [ME, HOOK_URL, "(signed);", "mail:", "/bin/cat", "-u", "end,fail", "0", "-"]
    [hook] = json.loads(ok(cli(daemon, "notify", "list", "--json")))
    assert (hook["webhook"], hook["secret"], hook["on"], hook["mail"]) == (HOOK_URL, True, ["end", "fail"],
                                                                          ["/bin/cat", "-u"])
    assert "s3cret" not in json.dumps(hook)  # whether it is signed, never the secret

    hook_file.chmod(0o644)
    warned = cli(daemon, "notify", "set", home=home)
    assert ok(warned).startswith("notification hook set")  # set all the same
    assert warned.stderr == (f"eventsched: warning: {hook_file} holds a secret that others may read "
                             f"(chmod 600 {hook_file})\n")
    write_hook_file(hook_file, f'webhook = "{HOOK_URL}"\n', mode=0o644)
    assert cli(daemon, "notify", "set", home=home).stderr == ""  # no secret, nothing to warn of

    assert ok(cli(daemon, "notify", "clear")) == "notification hook removed\n"
    assert json.loads(ok(cli(daemon, "notify", "list", "--json"))) == []


def test_notify_set_from_a_named_file_with_options_over_it(daemon: Daemon, tmp_path: Path) -> None:
    hook_file = write_hook_file(tmp_path / "hook.toml", HOOK_FILE)
    set_ = cli(daemon, "notify", "set", "--config", str(hook_file), "--on", "preempt,memory", "--json")
    hook = json.loads(ok(set_))
    assert (hook["user"], hook["webhook"], hook["on"]) == (ME, HOOK_URL, ["preempt", "memory"])


@pytest.mark.parametrize(("text", "says"), [
    (f'webhook = "{HOOK_URL}"\nurl = "x"\nretries = 3\n',
     "{file}: unknown keys retries, url (webhook, secret, on, mail)"),
    (f'webhook = "{HOOK_URL}\n', "{file}: Illegal character '\\n' (at line 1"),  # the column is tomllib's
    ('on = "end"\n', "give --webhook URL or --mail CMD (or both)"),
    (f'webhook = "{HOOK_URL}"\non = 3\n', 'on: the kinds, as "end,fail" or a list'),
    ("mail = [1, 2]\n", "mail: a command line, or a list of words"),
], ids=["unknown-keys", "bad-toml", "no-webhook-or-mail", "on-not-kinds", "mail-not-words"])
def test_a_bad_hook_file_is_one_line_and_changes_nothing(daemon: Daemon, tmp_path: Path,
                                                         text: str, says: str) -> None:
    ok(cli(daemon, "notify", "set", "--webhook", HOOK_URL, "--on", "fail"))
    before = ok(cli(daemon, "notify", "list", "--json"))
    bad = write_hook_file(tmp_path / "bad.toml", text)
    assert error_line(cli(daemon, "notify", "set", "--config", str(bad))).startswith(
        "eventsched: error: " + says.format(file=bad))
    assert ok(cli(daemon, "notify", "list", "--json")) == before
