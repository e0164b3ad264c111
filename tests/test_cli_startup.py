"""The CLI's fast path (``cli/quick.py``, ``wire/lean.py``).

What a user notices is the speed of a ``submit`` from a shell loop; that is
measured in bench/bench_cli.py. Here: the fast path imports nothing heavy,
reads options exactly as argparse does (or leaves them to argparse), sends
the same request the full client would, and fails with the same messages.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eventsched import cli
from eventsched.cli import quick
from eventsched.cli.commands import COMMANDS
from eventsched.domain.units import parse_array
from eventsched.wire import lean, protocol

# what a submit must not pay for: each costs a CLI call milliseconds (or far more)
HEAVY = {
    "argparse", "contextlib", "collections", "json", "re", "typing", "typing_extensions", "socket", "pathlib", "uuid", "decimal", "datetime",
    "msgspec", "duckdb", "anyio", "numpy", "pandas", "eventsched.core", "eventsched.runtime",
    "eventsched.projections", "eventsched.domain.events", "eventsched.domain.states", "eventsched.wire.client",
    "eventsched.wire.protocol",
}

_PROBE = """\
import sys
before = set(sys.modules)
from eventsched.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
sys.stdout.flush()
print("\\nMODULES " + " ".join(sorted(set(sys.modules) - before)))
"""


def run_cli(argv: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ, EVENTSCHED_STATE_DIR=str(tmp_path), **env)
    environ.pop("EVENTSCHED_SOCKET", None)
    return subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, env=environ, timeout=60)


def imported(proc: subprocess.CompletedProcess[str]) -> set[str]:
    return set(proc.stdout.rsplit("MODULES ", 1)[1].split())


@pytest.mark.parametrize(
    "argv",
    [
        ["submit", "--", "true"],
        ["submit", "--gpus", "0.5", "--name=x", "--priority", "3", "--after", "1", "--after=2", "--time-limit", "2h",
         "--gpu-ids", "0,1", "--retries", "2", "--preemptible", "--host-mem", "512", "--", "python", "x.py", "--lr", "3"],
        ["submit", "--array", "0-9%2", "--gpus", "1", "--", "python", "sweep.py", "--seed", "{index}"],
        ["health"],
        ["--version"],
    ],
)
def test_the_fast_path_imports_nothing_heavy(argv: list[str], tmp_path: Path) -> None:
    proc = run_cli(argv, tmp_path)  # no daemon: it gets as far as connecting
    modules = imported(proc)
    heavy = {m for m in modules if m in HEAVY or m.split(".")[0] in HEAVY or m.rsplit(".", 1)[0] in HEAVY}
    assert not heavy, f"`eventsched {' '.join(argv)}` imports {sorted(heavy)}"
    if argv[0] != "--version":
        assert "no eventsched daemon is listening" in proc.stderr


def test_the_probe_sees_the_full_path(tmp_path: Path) -> None:
    # an option the fast path does not read falls back to argparse: the probe must notice
    proc = run_cli(["submit", "--pri", "3", "--", "true"], tmp_path)
    assert "argparse" in imported(proc)
    assert "unrecognized arguments: --pri 3" in proc.stderr  # argparse refused the abbreviation


@pytest.mark.parametrize(
    "argv",
    [
        ["submit", "--", "true"],
        ["submit", "--gpus", "abc", "--", "true"],
        ["submit", "--gpus", "0", "--gpu-ids", "9x", "--", "true"],
        ["submit", "--time-limit", "-5", "--", "true"],
        ["submit", "--array", "5-1", "--", "true"],
        ["submit", "--interactive", "--array", "0-3", "--", "true"],
        ["submit", "--gpus", "1"],
        ["health", "--json"],
        ["health", "extra"],
    ],
)
def test_fast_and_full_paths_fail_alike(argv: list[str], tmp_path: Path) -> None:
    fast = run_cli(argv, tmp_path)
    full = run_cli(argv, tmp_path, EVENTSCHED_NO_QUICK="1")
    assert (fast.stderr, fast.stdout.rsplit("MODULES", 1)[0]) == (full.stderr, full.stdout.rsplit("MODULES", 1)[0])
    assert "Traceback" not in fast.stderr


OPTIONS = COMMANDS["submit"][1]

PARSED = [
    [],
    ["--gpus", "0.5", "--gpu-mem", "2000", "--name", "n", "--priority", "7", "--json"],
    ["--gpus=2", "--mem=100", "--gpu-ids=1,3", "--priority=0", "--name="],
    ["--after", "3", "--after", "4,5", "--after=6", "--retries", "2", "--tenant", "vision"],
    ["--time-limit", "15m", "--requeue-on-time-limit", "--conda", "ml", "--env-setup-cmd", "source x"],
    ["--env-setup", "a", "--env-setup", "b", "--array", "0-99:2%4", "--dedupe", "--session", "tmux"],
    ["--host-mem", "1024", "--llm-config", "l.json", "--preemptible", "--signal", "USR1@60"],
    ["--state-dir", "/tmp/s", "--socket=/tmp/s.sock", "--interactive", "--name", "a=b"],
]
LEFT_TO_ARGPARSE = [
    ["-h"], ["--help"], ["--pri", "3"], ["--priority", "-3"], ["--gpus", "x"], ["--json=1"], ["--session", "zsh"],
    ["positional"], ["--name"], ["--name", "--json"], ["-x"], ["--gpus", "1", "--bogus"],
]


@pytest.mark.parametrize("options", PARSED)
def test_parse_reads_options_as_argparse_does(options: list[str]) -> None:
    fast = quick.parse("submit", options)
    assert fast is not None
    assert vars(fast) == vars(cli.build_parser("submit").parse_args(["submit", *options]))


@pytest.mark.parametrize("options", LEFT_TO_ARGPARSE)
def test_parse_leaves_the_unusual_to_argparse(options: list[str]) -> None:
    assert quick.parse("submit", options) is None


def test_every_submit_option_is_in_the_table() -> None:
    # build_parser adds submit's options from commands.COMMANDS, the table the
    # fast path reads too
    parser = cli.build_parser("submit")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {f for a in sub.choices["submit"]._actions for f in a.option_strings} - {"-h", "--help"}
    assert flags == {f for names, _ in OPTIONS for f in names}


@pytest.mark.parametrize("options", PARSED)
def test_the_fast_path_sends_what_the_full_client_sends(options: list[str], tmp_path: Path) -> None:
    command = ["python", "train.py", "--lr", "3e-4"]
    argv = ["submit", *[o for o in options if o != "--interactive"], "--", *command]
    submission = quick.submit_message(argv, cli.spec_fields)
    assert submission is not None
    args, message = submission
    sent = protocol.request_decoder.decode(lean.packb(message))
    full_args = cli.build_parser("submit").parse_args(argv[: argv.index("--")])
    indices = parse_array(full_args.array)[0] if full_args.array else []
    assert sent == protocol.SubmitJob(spec=cli.build_spec(full_args, command), array=indices)


def test_llm_sizing_and_interactive_take_the_full_path() -> None:
    assert quick.submit_message(["submit", "--", "python", "x.py", "--llm", "qwen"], cli.spec_fields) is None
    assert quick.submit_message(["submit", "--interactive", "--", "true"], cli.spec_fields) is None
    assert quick.submit_message(["submit", "--gpus", "1"], cli.spec_fields) is None  # no command: argparse's


_plain = st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False) | st.text() | st.binary()
_values = st.recursive(_plain, lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(), inner, max_size=20), max_leaves=60)


@given(_values)
def test_lean_msgpack_agrees_with_msgspec(value: Any) -> None:
    assert msgspec.msgpack.decode(lean.packb(value)) == value
    assert lean.unpackb(msgspec.msgpack.encode(value)) == value


@given(st.sampled_from([1 << 64, -(1 << 63) - 1, object(), {1, 2}, 1j]))
def test_lean_refuses_what_it_cannot_encode(value: Any) -> None:
    with pytest.raises(ValueError):
        lean.packb(value)
