"""Fuzzed input: the control socket, jobs files and config files.

Every input gets a result or a clear one-line error, never a traceback, and
nothing already accepted changes. The quick part is hypothesis over the
parsers; the slow part fires a few thousand mutated and random frames at a
real root daemon as ``nobody`` (bench/fuzz_socket.py; its 100,000-frame run
is the documented command in docs/reliability.md).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from daemon_harness import EVENTSCHED, Daemon, cli_env
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_bad_input import decode_replies, raw_exchange

from eventsched.domain.jobsfile import parse_jobs_text
from eventsched.runtime.config import ConfigError, FileConfig, load_config, sample_config
from eventsched.wire import protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import fuzz_socket

FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- config files ------------------------------------------------------------------


def _one_line_or_config(path: Path) -> None:
    try:
        assert isinstance(load_config(path), FileConfig)
    except ConfigError as exc:
        said = str(exc)
        assert said and "\n" not in said.strip() and "Traceback" not in said, said


@pytest.mark.parametrize("text", [
    "scheduler = 5",                      # a section given as a number
    'scheduler = "abc"',                  # ... or as a string
    "job_limits = 3\n[scheduler]\nmax_host_mem_mib = 3\n",
    "[scheduler]\nallowed_script_paths = 3\n[job_limits]\nx = 1\n",
    b'gpus = "\xff\xfe"\n',               # not UTF-8
    "sample_interval_s = -1",             # a sampler that never sleeps
    "sample_interval_s = nan",
    "[scheduler]\nnode_lease_s = 60\n",  # a lease that ends after the daemon gives the node's jobs up
    "[scheduler]\nnode_lease_s = -1\n",
])
def test_config_files_that_once_gave_a_traceback_or_were_taken_get_one_line(tmp_path: Path, text: str | bytes) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert "\n" not in str(refused.value) and str(path) in str(refused.value)


def test_a_config_path_that_is_a_folder_or_unreadable_gets_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)


_TOML_VALUES = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(str),
    st.floats(allow_nan=True).map(lambda f: "nan" if f != f else ("inf" if f == float("inf") else ("-inf" if f == float("-inf") else repr(f)))),
    st.text(max_size=20).map(lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'),
    st.booleans().map(lambda b: "true" if b else "false"),
    st.lists(st.integers(-5, 5), max_size=4).map(str),
    st.just("{}"), st.just("[[1], 2]"), st.just('{ a = 1 }'),
)
SAMPLE = sample_config()
_KEYS = sorted({line.split("=")[0].strip(" #") for line in SAMPLE.splitlines() if "=" in line and not line.startswith("[")}
               | {"scheduler", "limits", "connections", "tenants", "job_limits", "users", "x"})
_SECTIONS = ["", "[scheduler]", "[limits]", "[connections]", "[tenants.a]", "[tenants]", "[job_limits]", "[x]"]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_SECTIONS), st.sampled_from(_KEYS), _TOML_VALUES), max_size=8))
def test_fuzzed_config_files_get_a_config_or_one_line(tmp_path_factory: pytest.TempPathFactory,
                                                      entries: list[tuple[str, str, str]]) -> None:
    by_section: dict[str, list[str]] = {}
    for section, key, value in entries:
        by_section.setdefault(section, []).append(f"{key} = {value}")
    text = "\n".join("\n".join(([s] if s else []) + lines) for s, lines in sorted(by_section.items()))
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    path.write_text(text)
    _one_line_or_config(path)


@FUZZ
@given(st.binary(max_size=400))
def test_mutated_sample_configs_get_a_config_or_one_line(tmp_path_factory: pytest.TempPathFactory, noise: bytes) -> None:
    sample = bytearray(SAMPLE.encode())
    for i, b in enumerate(noise[:40]):  # overwrite a few bytes at places the noise picks
        sample[(b * 131 + i * 977) % len(sample)] = noise[-1 - i]
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    path.write_bytes(bytes(sample))
    _one_line_or_config(path)


# -- jobs files ---------------------------------------------------------------------

_FIELD = st.one_of(st.text(max_size=12), st.sampled_from(["0", "-3", "0-3", "4,5,6,7", "1-0", "9" * 30, "--llm x",
                                                           "'unclosed", "a\x00b", "\x1b[2J", "\ud800", "${HOME}", "$(id)"]))


@FUZZ
@given(st.lists(st.lists(_FIELD, min_size=0, max_size=7).map(",".join), max_size=12).map("\n".join))
@example("0,\ud800")  # found by this test: a lone surrogate raised UnicodeEncodeError while hashing the line
def test_fuzzed_jobs_files_give_jobs_or_one_line_per_bad_line(text: str) -> None:
    jobs, errors = parse_jobs_text(text)
    lines = text.split("\n")
    for job in jobs:
        assert 1 <= job.line <= len(lines) and job.script
    for error in errors:
        assert 1 <= error.line <= len(lines)
        assert error.reason and "\n" not in error.reason


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_as_a_jobs_file_give_jobs_or_one_line_per_bad_line(data: bytes) -> None:
    _jobs, errors = parse_jobs_text(data.decode("utf-8", "surrogateescape"))
    assert all(e.reason and "\n" not in e.reason for e in errors)


@pytest.mark.slow
def test_submit_file_and_serve_config_never_show_a_traceback(tmp_path: Path) -> None:
    """The same inputs through the real CLI: one line on stderr, exit non-zero."""
    (tmp_path / "jobs.txt").write_bytes(b"0,a.py,,--lr 3\n\xff\xfe,\x00\n1,'b,,\"unclosed\n")
    (tmp_path / "bad.toml").write_text("scheduler = 5\n")
    env = cli_env(tmp_path / "state")
    for args in (["submit-file", str(tmp_path / "jobs.txt")],
                 ["serve", "--gpus", "fake:1", "--config", str(tmp_path / "bad.toml")],
                 ["serve", "--gpus", "fake:1", "--config", str(tmp_path)]):
        result = subprocess.run([*EVENTSCHED, *args], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and "Traceback" not in result.stderr, (args, result.stderr)


# -- the control socket ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("bad", [
    # bad UTF-8 in a string: msgspec raises UnicodeDecodeError (not DecodeError)
    b"\x82\xa4type\xa9SubmitJob\xa4spec\x81\xa7command\x91\xa2\xc8x",
    # 5,000 nested arrays: msgspec raises RecursionError
    b"\x82\xa4type\xa4Ping\xa1x" + b"\x91" * 5000 + b"\x01",
], ids=["not-utf8", "deeply-nested"])
def test_a_malformed_request_gets_an_error_reply_and_the_connection_goes_on(tmp_path: Path, bad: bytes) -> None:
    """Found by the fuzzer: these errors escaped the connection's handler: the
    client got no reply, the connection was dropped, the daemon logged a traceback."""
    frames = b"".join(struct.pack(">I", len(m)) + m for m in (bad, msgspec.msgpack.encode({"type": "Ping"})))
    with Daemon(tmp_path / "state", gpus="fake:1") as d:
        replies = decode_replies(raw_exchange(d.socket, frames))
        assert [r.ok for r in replies] == [False, True]
        assert "bad request" in replies[0].error and "\n" not in replies[0].error
        assert "Traceback" not in d.stderr()


@pytest.mark.slow
def test_a_refused_request_is_echoed_on_one_line_without_terminal_escapes(tmp_path: Path) -> None:
    """Found by the fuzzer: a bad tag was echoed raw in the error, newlines and
    escape sequences included, so the "one line" a client prints was not."""
    bad = msgspec.msgpack.encode({"type": "List\n\x1b[2Jjobs", "all": True})
    with Daemon(tmp_path / "state", gpus="fake:1") as d:
        (reply,) = decode_replies(raw_exchange(d.socket, struct.pack(">I", len(bad)) + bad))
        assert not reply.ok and "bad request" in reply.error
        assert "\n" not in reply.error and "\x1b" not in reply.error, reply.error


@pytest.mark.slow
def test_hold_or_release_of_no_jobs_is_refused_and_logs_nothing(tmp_path: Path) -> None:
    """Found by the fuzzer: HoldJobs/ReleaseJobs with an empty list were
    accepted and each appended an empty JobsCommanded event (and an
    fdatasync): any user could grow the log without bound with no-ops."""
    from eventsched.storage.log import last_seq
    from eventsched.wire.client import Client

    with Daemon(tmp_path / "state", gpus="fake:1", extra=["--sample-interval", "3600"]) as d:
        before = last_seq(d.state_dir / "log")
        frames = b"".join(struct.pack(">I", len(b)) + b for b in (
            msgspec.msgpack.encode({"type": "HoldJobs", "jobs": []}),
            msgspec.msgpack.encode({"type": "ReleaseJobs", "jobs": []})))
        replies = decode_replies(raw_exchange(d.socket, frames))
        assert [r.ok for r in replies] == [False, False] and all("no job" in r.error for r in replies), replies
        with Client(d.socket) as c:  # the daemon's own position: nothing was appended meanwhile
            c.ping()
        assert last_seq(d.state_dir / "log") == before


@pytest.mark.slow
def test_http_bodies_that_are_not_utf8_or_too_deep_get_a_400(tmp_path: Path) -> None:
    import http.client

    from eventsched.wire.client import Client

    port = fuzz_socket._free_port()
    with Daemon(tmp_path / "state", gpus="fake:1", extra=["--http", f"127.0.0.1:{port}"]) as d:
        with Client(d.socket) as c:
            token = c.request(protocol.CreateToken(name="t"))["token"]
        statuses = []
        for body in (b'{"spec": {"command": ["/bin/\xc1true"]}}', b'{"spec": ' * 2000):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/jobs", body=body, headers={"Authorization": f"Bearer {token}"})
            statuses.append(conn.getresponse().status)
            conn.close()
        assert statuses == [400, 400]
        assert "Traceback" not in d.stderr()


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="the fuzzer sends as nobody to a root daemon: needs root and setpriv")


@pytest.mark.slow
@needs_root
def test_three_thousand_fuzzed_frames_from_nobody_change_nothing_accepted() -> None:
    # its own folder under /tmp (pytest's tmp_path is 0700: nobody could not reach the socket)
    figures = fuzz_socket.fuzz(3000, seed=5, workers=1)
    assert figures["problems"] == []
    outcomes = figures["outcomes"]
    assert outcomes.get("reply-error", 0) > 1000, outcomes  # most frames are refused ...
    assert outcomes.get("reply-ok", 0) > 10, outcomes  # ... some mutations are still valid requests
    assert outcomes.get("fragment-closed", 0) > 100, outcomes
    # bounded by what was accepted, plus the allocator's arenas (fuzz_socket.rss_bound_kib)
    accepted = figures["acknowledged_jobs"]
    grew = figures["rss_kib_after"] - figures["rss_kib_before"]
    assert grew < fuzz_socket.rss_bound_kib(accepted), (figures["rss_kib_after"], accepted)
