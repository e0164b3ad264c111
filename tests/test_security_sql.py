"""`eventsched sql` answered by a root daemon runs as the user, never as root.

Unit tests of the statement allow-list, the connection hardening and the
read model's tolerance of absurd numbers; then real unprivileged users attack
one root daemon (started once for the module, with short SQL limits): reading
files, writing files, undoing the hardening, exhausting memory, CPU and the
daemon's SQL slots, and the read model's lock.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Iterator

import duckdb
import pytest
from users_harness import VENV_BIN, as_user, needs_root, root_daemon, run_as, user_env
from users_harness import public_dir, users  # noqa: F401 (fixtures)

from eventsched.domain import events as ev
from eventsched.projections.history import SCHEMA_VERSION, TABLES, VIEWS, History
from eventsched.projections.sql import QueryRefused, SqlError, check_read_only, query
from eventsched.storage import log

pytestmark = pytest.mark.slow

SECRET = "s3cr3t-env-value-7f2a91"
SETUP_SECRET = "s3cr3t-env-setup-c4e8"
TIMEOUT_S = 3.0
MAX_RESULT = 2 << 20
SLOW = "SELECT sum(a.range * b.range) FROM range(2000000) a, range(2000000) b"


# --- the allow-list and the hardening (no daemon) -----------------------------------


@pytest.mark.parametrize("sql", [
    "SELECT 1", "FROM jobs", "VALUES (1)", "DESCRIBE jobs", "SHOW TABLES", "SUMMARIZE jobs",
    "WITH a AS (SELECT 1) SELECT * FROM a", "EXPLAIN SELECT 1", "EXPLAIN ANALYZE SELECT 1",
    "EXPLAIN (FORMAT json) SELECT 1", "explain /* c */ analyze select 1", "EXPLAIN ANALYZE (SELECT 1)",
    "PRAGMA version", "PRAGMA table_info('jobs')", "SELECT 1; SELECT 2",
])
def test_allow_list_lets_reads_through(sql: str) -> None:
    assert check_read_only(sql)


@pytest.mark.parametrize("sql, says", [
    ("COPY (SELECT 'x') TO '/tmp/x' (HEADER false)", "COPY"),
    ("EXPLAIN ANALYZE COPY (SELECT 'x') TO '/tmp/x' (HEADER false)", "EXPLAIN of COPY"),
    ("EXPLAIN COPY (SELECT 1) TO '/tmp/x'", "EXPLAIN of COPY"),
    ("EXPLAIN (ANALYZE) COPY (SELECT 1) TO '/tmp/x'", "EXPLAIN of COPY"),
    ("EXPLAIN /* ANALYZE */ ANALYZE COPY (SELECT 1) TO '/tmp/x'", "EXPLAIN of COPY"),
    ("EXPLAIN ANALYZE SET threads = 64", "EXPLAIN of SET"),
    ("EXPLAIN ANALYZE INSERT INTO jobs VALUES (1)", "EXPLAIN of INSERT"),
    ("SET enable_external_access = true", "SET"),
    ("RESET lock_configuration", "SET"),
    ("ATTACH '/tmp/x.db'", "ATTACH"),
    ("INSTALL httpfs", "LOAD"),
    ("LOAD httpfs", "LOAD"),
    ("CALL pragma_version()", "CALL"),
    ("CREATE TABLE x (a INT)", "CREATE"),
    ("SELECT 1; SET enable_external_access = true", "SET"),
    ("PRAGMA enable_profiling", "PRAGMA enable_profiling"),
])
def test_allow_list_refuses_everything_else(sql: str, says: str) -> None:
    with pytest.raises(QueryRefused) as refusal:
        check_read_only(sql)
    message = str(refusal.value)
    assert message.startswith("refused:") and says in message and "\n" not in message


def _write_log(state: Path, frames: list[list[ev.Event]]) -> None:
    writer = log.LogWriter.open(state / "log")
    try:
        for frame in frames:
            writer.append(frame)
    finally:
        writer.close()


def test_local_queries_are_hardened_too(tmp_path: Path) -> None:
    _write_log(tmp_path, [[ev.JobSubmitted(ts=1.7e9, job=1, spec=ev.JobSpec(command=["true"], user="u"))]])
    columns, rows = query(tmp_path, "SELECT current_setting('enable_external_access'), "
                                    "current_setting('lock_configuration'), "
                                    "current_setting('autoinstall_known_extensions')")
    assert rows == [(False, True, False)]
    for attack in ("SELECT content FROM read_text('/etc/hostname')", "SELECT * FROM glob('/etc/*')"):
        with pytest.raises(SqlError, match="disabled by configuration"):
            query(tmp_path, attack)


def test_the_hardening_holds_even_for_statements_the_allow_list_would_refuse(tmp_path: Path) -> None:
    from eventsched.projections.sql import harden

    con = duckdb.connect()
    harden(con, memory_limit="256MB", threads=1, spill=False)
    target = tmp_path / "written"
    for attack in (f"COPY (SELECT 'x') TO '{target}' (HEADER false)",
                   f"EXPLAIN ANALYZE COPY (SELECT 'x') TO '{target}' (HEADER false)",
                   f"ATTACH '{tmp_path / 'x.db'}' AS x", "INSTALL httpfs", "SET enable_external_access = true",
                   "RESET enable_external_access", "SET lock_configuration = false", "SET memory_limit = '64GB'",
                   "SET temp_directory = '/tmp'"):
        with pytest.raises(duckdb.Error):
            con.execute(attack)
    assert not list(tmp_path.iterdir())
    assert con.execute("SELECT current_setting('memory_limit')").fetchone()[0].startswith("244")


def test_huge_numbers_from_an_old_log_do_not_break_the_read_model(tmp_path: Path) -> None:
    """Submissions from before the bounds: retries past 32 bits, numbers past int64."""
    assert SCHEMA_VERSION >= 2
    big = [
        dict(retries=1099511627776), dict(retries=(1 << 63) + 5, priority=-(1 << 63)),
        dict(gpu_mem_mib=(1 << 64) - 1, time_limit_s=1e300, gpus=1e300, uid=(1 << 64) - 1),
    ]
    _write_log(tmp_path, [[ev.JobSubmitted(ts=1.7e9 + i, job=i + 1, spec=ev.JobSpec(command=["true"], user="u", **kw))]
                          for i, kw in enumerate(big)])
    _, rows = query(tmp_path, "SELECT job, retries, priority, gpu_mem_mib, time_limit_s FROM submissions ORDER BY job")
    assert rows[0][1] == 1099511627776
    assert rows[1][1] == (1 << 63) - 1 and rows[1][2] == -(1 << 63)  # clamped into BIGINT
    assert rows[2][3] == (1 << 63) - 1 and rows[2][4] == 1e300
    _, jobs = query(tmp_path, "SELECT count(*) FROM jobs")
    assert jobs == [(3,)]
    # and the next events still fold
    _write_log(tmp_path, [[ev.JobCancelled(ts=1.8e9, job=1, by="uid:0")]])
    assert query(tmp_path, "SELECT state FROM jobs WHERE id = 1")[1] == [("cancelled",)]


def test_read_model_files_left_loose_by_an_earlier_version_become_private(tmp_path: Path) -> None:
    _write_log(tmp_path, [[ev.JobSubmitted(ts=1.7e9, job=1, spec=ev.JobSpec(command=["true"], user="u"))]])
    lock, db = tmp_path / "history.lock", tmp_path / "history.duckdb"
    os.close(os.open(lock, os.O_CREAT | os.O_RDWR, 0o666))
    os.chmod(lock, 0o666)
    assert query(tmp_path, "SELECT count(*) FROM jobs")[1] == [(1,)]
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600 and stat.S_IMODE(db.stat().st_mode) == 0o600
    os.chmod(db, 0o644)
    _write_log(tmp_path, [[ev.JobCancelled(ts=1.8e9, job=1, by="uid:0")]])
    assert query(tmp_path, "SELECT state FROM jobs")[1] == [("cancelled",)]
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".history-new-")]


def test_sql_limits_come_from_the_environment() -> None:
    from eventsched.runtime.api.sql_sandbox import SqlLimits

    limits = SqlLimits.from_env({"EVENTSCHED_SQL_TIMEOUT_S": "2.5", "EVENTSCHED_SQL_PER_USER": "3",
                                 "EVENTSCHED_SQL_MEMORY_MB": "nonsense", "EVENTSCHED_SQL_TOTAL": "-1"})
    assert (limits.timeout_s, limits.per_user, limits.memory_mb, limits.total) == (2.5, 3, 512, 4)
    assert SqlLimits().max_result_bytes == 16 << 20


# --- a root daemon and two users -------------------------------------------------------




def _one_line_failure(result: subprocess.CompletedProcess, *says: str) -> str:
    assert result.returncode != 0, result.stdout
    err = result.stderr.strip()
    assert err.startswith("eventsched sql:") and "\n" not in err, err
    assert "Traceback" not in result.stderr + result.stdout
    assert any(s in err for s in says), err
    return err


@pytest.fixture(scope="module")
def world(users, public_dir: Path) -> Iterator[dict]:  # noqa: F811 (fixtures)
    alice, bob = users
    limits = {"EVENTSCHED_SQL_TIMEOUT_S": str(TIMEOUT_S), "EVENTSCHED_SQL_MAX_RESULT_BYTES": str(MAX_RESULT),
              "EVENTSCHED_SQL_QUEUE_S": "1"}
    saved = {k: os.environ.get(k) for k in limits}
    os.environ.update(limits)
    daemon = root_daemon(public_dir)
    try:
        daemon.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    state = daemon.state_dir
    try:
        env = user_env(alice, state, ES_TOKEN=SECRET)
        submitted = as_user(alice, state, "submit", "--env-setup", f"export SETUP_TOKEN={SETUP_SECRET}", "--",
                            "/bin/echo", "alice-private-output", env=env)
        assert submitted.returncode == 0, submitted.stderr
        job = int(submitted.stdout.split()[-1])
        daemon.wait_states([job], {"succeeded", "failed"})
        yield {"daemon": daemon, "state": state, "alice": alice, "bob": bob, "job": job, "public": public_dir}
    finally:
        daemon.stop()


def sql_as(user, world: dict, sql: str, *more: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return as_user(user, world["state"], "sql", sql, *more, timeout=timeout)


TIMED_REQUEST = """
import sys, time
from eventsched.wire import protocol
from eventsched.wire.client import Client
client = Client(sys.argv[1], timeout=60)
start = time.monotonic()
try:
    data = client.request(protocol.RunSql(query=sys.argv[2]))
    print(json.dumps({"s": time.monotonic() - start, "rows": data["rows"]}))
except Exception as exc:
    print(json.dumps({"s": time.monotonic() - start, "error": str(exc)}))
""".replace("import sys, time", "import json, sys, time")


def timed_sql(user, world: dict, sql: str) -> dict:
    """One request, timed from inside the user's process (no CLI start-up in the figure)."""
    done = run_as(user, [f"{VENV_BIN}/python", "-c", TIMED_REQUEST, str(world["daemon"].socket), sql], timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def sandboxes() -> dict[int, int]:
    """pid -> uid of every SQL sandbox process now (-1 if its uids differ)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        if b"eventsched.runtime.api.sql_sandbox" in cmdline:
            uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
            out[int(entry)] = int(uids[0]) if len(set(uids)) == 1 else -1
    return out


def sandboxes_of(uid: int) -> list[int]:
    return [pid for pid, owner in sandboxes().items() if owner == uid]


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


@needs_root
def test_a_user_who_cannot_read_the_log_gets_answers_with_the_hardening_locked(world: dict) -> None:
    bob = world["bob"]
    assert not os.access(world["state"] / "log", os.R_OK) or os.geteuid() == 0
    done = sql_as(bob, world, "SELECT id, \"user\", command FROM jobs ORDER BY id", "--format", "json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert rows and rows[0]["user"] == world["alice"].name and "alice-private-output" in rows[0]["command"]
    settings = sql_as(bob, world, "SELECT current_setting('enable_external_access') AS ext, "
                                  "current_setting('lock_configuration') AS locked, "
                                  "current_setting('autoload_known_extensions') AS autoload, "
                                  "current_setting('temp_directory') AS tmp", "--format", "json")
    assert settings.returncode == 0, settings.stderr
    assert json.loads(settings.stdout) == [{"ext": False, "locked": True, "autoload": False, "tmp": ""}]


@needs_root
def test_files_cannot_be_read_through_sql(world: dict) -> None:
    bob, state = world["bob"], world["state"]
    output = state / "jobs" / f"{world['job']}.log"
    for attack in (
        "SELECT content FROM read_text('/etc/shadow')",
        f"SELECT content FROM read_blob('{output}')",
        f"SELECT * FROM glob('{output.parent}/*')",
        f"SELECT * FROM glob('{state}/log/*')",
        f"SELECT content FROM read_blob('{state}/log/*')",
        "SELECT * FROM read_csv('/etc/shadow')",
    ):
        done = sql_as(bob, world, attack)
        err = _one_line_failure(done, "disabled by configuration")
        assert "root:" not in done.stdout + err and "alice-private-output" not in done.stdout + err


@needs_root
def test_files_cannot_be_written_and_the_hardening_cannot_be_undone(world: dict) -> None:
    bob, public = world["bob"], world["public"]
    targets = [public / "pwn-copy", public / "pwn-explain", Path("/etc") / f"es-pwn-{os.getpid()}"]
    attacks = [
        (f"COPY (SELECT 'x') TO '{targets[0]}' (HEADER false)", "COPY statements"),
        (f"EXPLAIN ANALYZE COPY (SELECT 'x') TO '{targets[1]}' (HEADER false)", "EXPLAIN of COPY"),
        (f"EXPLAIN (ANALYZE) COPY (SELECT 'x') TO '{targets[2]}' (HEADER false)", "EXPLAIN of COPY"),
        ("SET enable_external_access = true", "SET statements"),
        ("RESET lock_configuration", "SET statements"),
        ("SELECT 1; SET enable_external_access = true; SELECT 2", "SET statements"),
        (f"ATTACH '{public}/pwn.db' AS x", "ATTACH statements"),
        ("INSTALL httpfs", "LOAD statements"),
        ("LOAD httpfs", "LOAD statements"),
        ("SELECT * FROM query('SET enable_external_access = true')", "SET", "SELECT", "Parser", "Invalid"),
    ]
    for sql, *says in attacks:
        _one_line_failure(sql_as(bob, world, sql), *says)
    for target in targets:
        assert not target.exists()
    assert not (public / "pwn.db").exists()


@needs_root
def test_a_memory_bomb_is_refused_and_others_are_still_answered(world: dict) -> None:
    alice, bob = world["alice"], world["bob"]
    start = time.monotonic()
    bomb = subprocess.Popen(
        ["setpriv", f"--reuid={bob.uid}", f"--regid={bob.gid}", "--init-groups", "env", "-i",
         *(f"{k}={v}" for k, v in user_env(bob, world["state"]).items()),
         f"{VENV_BIN}/eventsched", "sql", "SELECT repeat('x', 1000000) FROM range(1000)"],
        cwd=bob.home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        time.sleep(0.3)
        answer = timed_sql(alice, world, "SELECT 1")
        # behind the bomb it would wait out the bomb's limit (TIMEOUT_S, 2.7 s more)
        assert answer.get("rows") == [[1]] and answer["s"] < 2.0, answer
        out, err = bomb.communicate(timeout=30)
    finally:
        bomb.kill()
    assert time.monotonic() - start < TIMEOUT_S + 10
    done = subprocess.CompletedProcess(bomb.args, bomb.returncode, out, err)
    _one_line_failure(done, "result too large", "memory")
    assert len(out) < 1000


@needs_root
def test_slow_queries_run_as_the_user_are_killed_at_the_limit_and_cannot_starve_others(world: dict) -> None:
    alice, bob = world["alice"], world["bob"]
    slow = [subprocess.Popen(
        ["setpriv", f"--reuid={bob.uid}", f"--regid={bob.gid}", "--init-groups", "env", "-i",
         *(f"{k}={v}" for k, v in user_env(bob, world["state"]).items()),
         f"{VENV_BIN}/eventsched", "sql", SLOW],
        cwd=bob.home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) for _ in range(4)]
    try:
        # once set up, the sandboxes are bob's through and through (real, effective, saved, fs uid);
        # the others are root's: a spare that knows nothing yet, or one still opening the read model
        bobs = wait_for(lambda: len(pids := sandboxes_of(bob.uid)) >= 2 and pids)
        assert len(bobs) == 2, bobs  # at most 2 of one user's run at once
        assert set(sandboxes().values()) <= {0, bob.uid}
        for pid in bobs:
            assert os.stat(f"/proc/{pid}/mem").st_uid == 0  # not dumpable: bob may not ptrace it or read its memory
        time.sleep(1.2)  # a slow query is slow: past its first second
        answer = timed_sql(alice, world, "SELECT 1")
        assert answer.get("rows") == [[1]] and answer["s"] < 1.0, answer
        assert list(sandboxes().values()).count(bob.uid) <= 2
        results = [p.communicate(timeout=TIMEOUT_S + 20) for p in slow]
    finally:
        for p in slow:
            p.kill()
    errors = [err.strip() for _, err in results]
    timed_out = [e for e in errors if "timed out after 3 s" in e]
    busy = [e for e in errors if "too many SQL queries running" in e]
    assert timed_out and len(timed_out) + len(busy) == 4, errors
    assert all(e.startswith("eventsched sql:") and "\n" not in e for e in errors)
    wait_for(lambda: bob.uid not in sandboxes().values(), timeout=5)


@needs_root
def test_the_query_is_killed_when_its_client_goes_away(world: dict) -> None:
    bob = world["bob"]
    client = subprocess.Popen(
        ["setpriv", f"--reuid={bob.uid}", f"--regid={bob.gid}", "--init-groups", "env", "-i",
         *(f"{k}={v}" for k, v in user_env(bob, world["state"]).items()),
         f"{VENV_BIN}/eventsched", "sql", SLOW],
        cwd=bob.home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        pids = wait_for(lambda: sandboxes_of(bob.uid))
        client.kill()
        client.wait()
        start = time.monotonic()
        wait_for(lambda: not (set(pids) & set(sandboxes())), timeout=TIMEOUT_S - 0.5)
        assert time.monotonic() - start < 1.5
    finally:
        client.kill()


@needs_root
def test_the_read_model_files_are_private(world: dict) -> None:
    bob, state = world["bob"], world["state"]
    assert sql_as(bob, world, "SELECT count(*) FROM jobs").returncode == 0
    for name in ("history.lock", "history.duckdb", "history.duckdb.wal"):
        path = state / name
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
            assert path.stat().st_uid == 0
    probe = ("import fcntl, os, sys\n"
             "try:\n"
             "    fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "except PermissionError:\n"
             "    print('denied')\n"
             "else:\n"
             "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
             "    print('locked')\n")
    for name in ("history.lock", "history.duckdb"):
        done = run_as(bob, [f"{VENV_BIN}/python", "-c", probe, str(state / name)])
        assert done.stdout.strip() == "denied", done.stdout + done.stderr


@needs_root
def test_the_read_model_never_holds_environment_values(world: dict) -> None:
    state = world["state"]
    segments = b"".join(p.read_bytes() for p in (state / "log").iterdir() if p.is_file())
    assert SECRET.encode() in segments and SETUP_SECRET.encode() in segments  # the test means something
    assert sql_as(world["bob"], world, "SELECT count(*) FROM jobs").returncode == 0  # caught up
    with History(state) as history, history.reader() as con:
        names = [r[0] for r in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'").fetchall()]
        assert set(TABLES) <= set(names) and set(VIEWS) <= set(names)
        for name in names:
            text = str(con.execute(f'SELECT * FROM "{name}"').fetchall())
            assert SECRET not in text and SETUP_SECRET not in text, name
    for name in ("history.duckdb", "history.duckdb.wal"):
        path = state / name
        if path.exists():
            data = path.read_bytes()
            assert SECRET.encode() not in data and SETUP_SECRET.encode() not in data
