"""What a user may submit: bounded numbers, per-user queue and --dedupe, escaped names.

Unit tests of the admission bounds and the core's per-user rules, then the
same attacks made by real unprivileged users against a root daemon.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from users_harness import as_user, needs_root, public_dir, root_daemon, users  # noqa: F401 (fixtures)

from eventsched import core
from eventsched.core.admission import check_submission
from eventsched.core.limits import SubmitLimits
from eventsched.domain.events import JobSpec
from eventsched.domain.messages import (
    GpuInfo,
    Refused,
    SchedulerConfig,
    Started,
    Submit,
)
from eventsched.domain.text import printable
from eventsched.projections.cluster import ClusterState, validate_state

LIMITS = SubmitLimits()


def spec(**kw: object) -> JobSpec:
    return JobSpec(command=["/bin/true"], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("field, value, says", [
    ("retries", 1099511627776, "--retries must be between 0 and 100"),
    ("retries", -1, "--retries"),
    ("priority", 101, "--priority 101 is outside [-100, 100]"),
    ("priority", -10**12, "--priority"),
    ("time_limit_s", 1e300, "--time-limit"),
    ("gpu_mem_mib", 1 << 40, "--gpu-mem"),
    ("after", list(range(1, 2000)), "--after"),
    ("name", "n" * 201, "--name"),
])
def test_out_of_bounds_numbers_and_sizes_are_refused_with_the_bound(field: str, value: object, says: str) -> None:
    with pytest.raises(Refused) as refusal:
        check_submission(spec(**{field: value}), LIMITS, operator=False)
    assert says in refusal.value.reason
    assert "\n" not in refusal.value.reason


def test_malformed_resource_limits_and_umask_are_refused_at_submit() -> None:
    check_submission(spec(umask=0o077, rlimits={"nofile": [256, 1024]}), LIMITS, operator=False)
    for bad in (dict(rlimits={"bogus": [1, 1]}), dict(rlimits={"nofile": [-5, 10]}), dict(umask=0o7777)):
        with pytest.raises(Refused):
            check_submission(spec(**bad), LIMITS, operator=False)


def test_operators_may_use_priorities_above_the_ceiling_but_not_unbounded_retries() -> None:
    check_submission(spec(priority=10_000), LIMITS, operator=True)
    with pytest.raises(Refused):
        check_submission(spec(retries=10**9), LIMITS, operator=True)


def test_environment_and_command_sizes_are_capped() -> None:
    check_submission(spec(env={"HOME": "/home/a", "PATH": "/usr/bin"}), LIMITS, operator=False)
    with pytest.raises(Refused, match="environment and --env-setup are .* bytes; at most 262144"):
        check_submission(spec(env={"BIG": "x" * (1 << 20)}), LIMITS, operator=False)
    with pytest.raises(Refused, match="the command is .* bytes; at most 65536"):
        check_submission(JobSpec(command=["/bin/echo", "y" * 70_000]), LIMITS, operator=False)


@pytest.mark.parametrize("char", ["y", "é", "日", "\U0001f600", "\udc80"])
def test_the_command_cap_counts_utf8_bytes_to_the_byte(char: str) -> None:
    """Exactly at the cap is admitted and one byte over is refused, whatever
    the characters (the cheap bound that skips encoding must not shift it)."""
    width = len(char.encode("utf-8", "surrogatepass"))
    room = 65536 - len("/bin/echo") - 2  # each word counts one byte more (its separator)
    fits = char * (room // width) + "z" * (room % width)
    check_submission(JobSpec(command=["/bin/echo", fits]), LIMITS, operator=False)
    with pytest.raises(Refused, match="the command is 65537 bytes; at most 65536"):
        check_submission(JobSpec(command=["/bin/echo", fits + "z"]), LIMITS, operator=False)


def test_printable_escapes_terminal_control_and_bidi_characters() -> None:
    assert printable("train\x1b]0;pwned\x07") == "train\\x1b]0;pwned\\x07"
    assert printable("a\u202eb\x9bc") == "a\\u202eb\\x9bc"
    assert printable("résumé 日本 tab-free") == "résumé 日本 tab-free"


def _state(**config: object) -> ClusterState:
    state = ClusterState()
    started = Started(node="local", pid=1, version="t", gpu_backend="fake:1",
                      gpus=[GpuInfo(gpu=0, uuid="u0", model="fake", memory_total_mib=1000)],
                      config=SchedulerConfig(**config))  # type: ignore[arg-type]
    core.handle(state, started, 0.0)  # the core folds what it emits into the state
    return state


def _submit(state: ClusterState, uid: int, **kw: object) -> int:
    events, _ = core.handle(state, Submit(spec=JobSpec(command=["x"], uid=uid, gpus=1, **kw)), 1.0)  # type: ignore[arg-type]
    validate_state(state)
    return events[0].job  # type: ignore[attr-defined]


def test_one_user_cannot_fill_the_queue_and_others_still_submit() -> None:
    state = _state(max_queued_per_user=2)
    for _ in range(3):  # the first runs, two wait
        _submit(state, uid=1000)
    with pytest.raises(Refused, match="you have 2 jobs waiting, the limit per user"):
        _submit(state, uid=1000)
    assert _submit(state, uid=1001) == 4


def test_dedupe_is_per_user_so_nobody_can_squat_a_hash() -> None:
    state = _state()
    _submit(state, uid=1000, content_hash="abc")
    with pytest.raises(Refused, match="duplicate of job 1"):
        _submit(state, uid=1000, content_hash="abc")
    assert _submit(state, uid=1001, content_hash="abc") == 2


# --- real users against a root daemon -----------------------------------------


@pytest.fixture(scope="module")
def daemon(public_dir: Path):  # noqa: F811
    config = public_dir / "serve.toml"
    config.write_text("[scheduler]\nmax_queued_per_user = 3\n")
    config.chmod(0o644)
    d = root_daemon(public_dir, "--config", str(config)).start()
    try:
        yield d
    finally:
        d.stop()


def _log_seq(d) -> int:
    return int(d.cli("health").stdout.split("seq ")[1])


@pytest.mark.slow
@needs_root
def test_unbounded_numbers_from_a_user_are_refused_and_nothing_is_logged(users, daemon) -> None:  # noqa: F811
    alice, _ = users
    before = _log_seq(daemon)
    for args in (["--retries", "1099511627776"], ["--priority", "1000000"], ["--time-limit", "99999999999"]):
        r = as_user(alice, daemon.state_dir, "submit", *args, "--", "/bin/true")
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert _log_seq(daemon) == before
    sql = as_user(alice, daemon.state_dir, "sql", "SELECT count(*) AS n FROM jobs", "--format", "json")
    assert sql.returncode == 0, sql.stderr
    # root is an operator: its high priority is accepted
    job = daemon.submit("--priority", "1000", "--gpus", "0", "--", "/bin/true")
    daemon.wait_states([job], {"succeeded"})


@pytest.mark.slow
@needs_root
def test_per_user_queue_limit_and_dedupe_across_users(users, daemon) -> None:  # noqa: F811
    alice, bob = users
    blocker = int(as_user(bob, daemon.state_dir, "submit", "--gpus", "0", "--", "/bin/sleep", "30").stdout)
    waiting = [int(as_user(bob, daemon.state_dir, "submit", "--gpus", "0", "--after", str(blocker), "--",
                           "/bin/true").stdout) for _ in range(3)]
    refused = as_user(bob, daemon.state_dir, "submit", "--gpus", "0", "--after", str(blocker), "--", "/bin/true")
    assert refused.returncode != 0 and "limit per user" in refused.stderr and "Traceback" not in refused.stderr
    # alice is not affected by bob's full queue
    ok = as_user(alice, daemon.state_dir, "submit", "--gpus", "0", "--after", str(blocker), "--", "/bin/true")
    assert ok.returncode == 0, ok.stderr
    assert as_user(bob, daemon.state_dir, "cancel", str(blocker), *map(str, waiting)).returncode == 0
    # bob's --dedupe hash does not block alice's identical job
    first = as_user(bob, daemon.state_dir, "submit", "--dedupe", "--gpus", "0", "--", "/bin/echo", "same", cwd="/tmp")
    assert first.returncode == 0, first.stderr
    dup = as_user(bob, daemon.state_dir, "submit", "--dedupe", "--gpus", "0", "--", "/bin/echo", "same", cwd="/tmp")
    assert dup.returncode != 0 and "duplicate" in dup.stderr
    theirs = as_user(alice, daemon.state_dir, "submit", "--dedupe", "--gpus", "0", "--", "/bin/echo", "same", cwd="/tmp")
    assert theirs.returncode == 0, theirs.stderr


@pytest.mark.slow
@needs_root
def test_a_job_name_cannot_inject_escape_sequences_into_another_users_terminal(users, daemon) -> None:  # noqa: F811
    alice, bob = users
    evil = "x\x1b]0;owned\x07\x1b[2J"
    r = as_user(bob, daemon.state_dir, "submit", "--gpus", "0", "--name", evil, "--", "/bin/sleep", "5")
    assert r.returncode == 0, r.stderr
    job = int(r.stdout)
    queue = as_user(alice, daemon.state_dir, "queue", "--all")
    assert queue.returncode == 0, queue.stderr
    assert "\x1b" not in queue.stdout and "\x07" not in queue.stdout
    assert "x\\x1b]0;owned\\x07" in queue.stdout
    # --json keeps the exact name (JSON escapes it)
    rows = json.loads(as_user(alice, daemon.state_dir, "queue", "--all", "--json").stdout)
    assert [j["name"] for j in rows if j["id"] == job] == [evil]
    sql = as_user(alice, daemon.state_dir, "sql", f"SELECT name FROM jobs WHERE id = {job}")
    assert sql.returncode == 0 and "\x1b" not in sql.stdout, sql.stdout
    daemon.cli("cancel", str(job))


def test_the_sample_config_carries_the_limits() -> None:
    from eventsched.runtime.config import load_config, sample_config

    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"es-sample-{os.getpid()}.toml"
    path.write_text(sample_config())
    try:
        config = load_config(path)
    finally:
        path.unlink()
    assert config.limits.max_user_priority == 100
    assert config.scheduler.max_queued_per_user == 20000
