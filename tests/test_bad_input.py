"""Bad input through every entry point: a one-line error, nothing changed."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import msgspec
import pytest
from daemon_harness import Daemon

from eventsched.domain.messages import lease_terms
from eventsched.domain.units import UnitError as UserError
from eventsched.domain.units import parse_duration, parse_gpu_ids
from eventsched.runtime.config import ConfigError, load_config
from eventsched.wire import protocol


def test_gpu_id_lists_and_ranges() -> None:
    assert parse_gpu_ids("1,3") == [1, 3]
    assert parse_gpu_ids("0-3") == [0, 1, 2, 3]
    assert parse_gpu_ids("5,0-1") == [0, 1, 5]
    for bad in ("x", "3-1", "-1", ",", "1-"):
        with pytest.raises(UserError):
            parse_gpu_ids(bad)


def test_durations() -> None:
    assert parse_duration("90") == 90
    assert parse_duration("1h30m") == 5400
    assert parse_duration("2d") == 172800
    for bad in ("soon", "5x", "h", "0"):
        with pytest.raises(UserError):
            parse_duration(bad)


def test_cli_without_a_daemon_says_how_to_start_one(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "nothing-here")
    for args in (["queue"], ["status"], ["submit", "--", "true"], ["cancel", "1"]):
        result = d.cli(*args)
        assert result.returncode != 0
        assert "eventsched serve" in result.stderr
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["submit", "--gpus", "many", "--", "true"],
        ["submit", "--gpu-ids", "a-b", "--", "true"],
        ["submit", "--time-limit", "forever", "--", "true"],
        ["submit", "--gpus", "1"],
        ["cancel", "abc"],
        ["queue", "--", "ls"],
        ["frobnicate"],
        ["serve", "--gpus", "fake:0"],
        ["serve", "--gpus", "fake:x"],
        ["serve", "--policy", "nonsense", "--gpus", "fake:1"],
        ["serve", "--config", "/no/such/file.toml", "--gpus", "fake:1"],
        ["serve", "--sample-interval", "-1", "--gpus", "fake:1"],  # must not reach the sampler
        ["serve", "--sample-interval", "nan", "--gpus", "fake:1"],
    ],
)
def test_bad_cli_arguments_get_one_line(tmp_path: Path, args: list[str]) -> None:
    result = Daemon(tmp_path / "state").cli(*args)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "state" / "log").exists() or args[0] != "serve"


def test_bad_config_file_is_named(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[scheduler]\nmax_queud = 3\n")
    result = Daemon(tmp_path / "state").cli("serve", "--config", str(config), "--gpus", "fake:1")
    assert result.returncode == 2
    assert "bad.toml" in result.stderr and "max_queud" in result.stderr


def test_a_node_lease_that_ends_too_late_is_refused_with_the_largest_allowed(tmp_path: Path) -> None:
    config = tmp_path / "lease.toml"
    config.write_text("[scheduler]\nnode_lost_after_s = 30\nnode_lease_s = 29\n")
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    assert str(refused.value) == (f"config file {config}: node_lease_s = 29 must be below node_lost_after_s = 30 less "
                                  "a margin of 2.6 s (clock rates, the exchange in flight): under 27.4, or 0 for no lease")
    config.write_text("[scheduler]\nnode_lost_after_s = 30\nnode_lease_s = 27\n")
    assert lease_terms(load_config(config).scheduler) == (27.0, 27.4)
    config.write_text("[scheduler]\nnode_lost_after_s = 30\n")  # unset: three quarters
    assert lease_terms(load_config(config).scheduler) == (22.5, 27.4)
    config.write_text("[scheduler]\nnode_lost_after_s = 0\nnode_lease_s = 5\n")  # jobs given up at once: no lease
    assert lease_terms(load_config(config).scheduler) == (0.0, 0.0)


def raw_exchange(path: Path, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def decode_replies(data: bytes) -> list[protocol.Reply]:
    out = []
    while data:
        (n,) = struct.unpack(">I", data[:4])
        out.append(protocol.server_message_decoder.decode(data[4 : 4 + n]))
        data = data[4 + n :]
    return out


@pytest.mark.slow
def test_hostile_socket_messages_change_nothing(tmp_path: Path) -> None:
    with Daemon(tmp_path / "state", gpus="fake:2") as d:
        job = d.submit("--gpus", "0.5", "--", "/bin/true")
        d.wait_states([job], {"succeeded"})
        before = d.cli("log", "dump", str(d.state_dir / "log")).stdout.count("\n")
        encoder = msgspec.msgpack.Encoder()

        def framed(obj: object) -> bytes:
            body = encoder.encode(obj)
            return struct.pack(">I", len(body)) + body

        cases = [
            framed(b"\x00garbage"),
            struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1",  # never-used msgpack byte
            framed({"type": "SubmitJob", "spec": {"command": "not a list"}}),
            framed({"type": "SubmitJob", "spec": {"command": ["x"], "gpus": "lots"}}),
            framed({"type": "CancelJobs", "jobs": ["1; rm -rf /"]}),
            framed({"type": "NoSuchRequest"}),
            framed([1, 2, 3]),
        ]
        for case in cases:
            replies = decode_replies(raw_exchange(d.socket, case))
            assert len(replies) == 1 and not replies[0].ok and replies[0].error
        # an absurd length is refused without reading (or allocating) it
        for length in (0xFFFFFFF0, protocol.MAX_MESSAGE_BYTES + 1):
            replies = decode_replies(raw_exchange(d.socket, struct.pack(">I", length) + b"xx"))
            assert len(replies) == 1 and not replies[0].ok
            assert replies[0].error == f"message of {length} bytes exceeds the {protocol.MAX_MESSAGE_BYTES}-byte limit"
        # truncated: a header promising more than is sent, then a hang-up
        assert raw_exchange(d.socket, struct.pack(">I", 100) + b"abc") == b""
        # the user in a request is ignored: identity comes from the socket
        spoof = framed({"type": "SubmitJob", "spec": {"command": ["/bin/true"], "uid": 12345, "user": "mallory", "gpus": 0.1}})
        reply = decode_replies(raw_exchange(d.socket, spoof))[0]
        assert reply.ok
        spoofed = d.jobs()[reply.data["id"]]
        assert spoofed["user"] != "mallory"
        # the daemon is unharmed and nothing but the one valid job was added
        assert d.cli("health").returncode == 0
        assert set(d.jobs()) == {job, reply.data["id"]}
        unknown = d.cli("logs", "999")
        assert unknown.returncode == 1 and "999" in unknown.stderr
        after = d.cli("log", "dump", str(d.state_dir / "log")).stdout
        assert after.count("\n") > before


def test_every_command_has_its_fast_parser() -> None:
    """`main` builds only the parser of the command given; none may be missing."""
    from eventsched.cli import COMMANDS, build_parser

    full = build_parser()
    choices = next(a for a in full._subparsers._group_actions).choices  # type: ignore[union-attr]
    assert set(choices) == set(COMMANDS)
    for name in COMMANDS:
        only = build_parser(only=name)
        assert name in next(a for a in only._subparsers._group_actions).choices  # type: ignore[union-attr]
