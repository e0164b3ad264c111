"""The one command table (``cli/commands.py``), read by argparse and by the
fast path: no command takes an abbreviated option (``queue --state`` is not
``--state-dir``); each refuses it with one line, through the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from eventsched.cli import main
from eventsched.cli.commands import COMMANDS


def parsers(table: dict[str, Any] = COMMANDS, path: tuple[str, ...] = ()) -> Iterator[tuple[list[str], list[Any]]]:
    """Every (sub)command as (words that name it, then its required arguments; its options)."""
    for name, (_help, options) in table.items():
        words = [*path, name]
        actions = [o["actions"] for flags, o in options if "actions" in o]
        if actions:
            yield from parsers(actions[0], tuple(words))
            continue
        required = ["--policy=fifo" for flags, o in options if o.get("required")]
        positional = ["1" for flags, o in options if not flags[0].startswith("-")]
        yield [*words, *positional, *required], options


def abbreviation(options: list[Any]) -> str:
    """The last long option, less its last letter (``--state-dir`` when a command has no other)."""
    longs = [f for flags, _ in options for f in flags if f.startswith("--")] or ["--state-dir"]
    return longs[-1][:-1]


PARSERS = list(parsers())


@pytest.mark.parametrize("argv,options", PARSERS, ids=[" ".join(w for w in argv if w != "1") for argv, _ in PARSERS])
def test_each_command_refuses_an_abbreviation_in_one_line(argv: list[str], options: list[Any], tmp_path: Path) -> None:
    abbr = abbreviation(options)
    words = [*argv, f"{abbr}=x"] + (["--", "true"] if argv[0] == "submit" else [])
    env = dict(os.environ, EVENTSCHED_STATE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "eventsched.cli", *words], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and f"unrecognized arguments: {abbr}=x" in proc.stderr


def test_queue_state_is_not_state_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # queue's own --state (a filter) refuses a path as a state, before asking any daemon
    with pytest.raises(SystemExit) as exit_:
        main(["queue", "--state", str(tmp_path)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(f"eventsched: error: --state {str(tmp_path)!r}: not a job state (")
    # where there is no --state, it is no abbreviation of --state-dir
    with pytest.raises(SystemExit) as exit_:
        main(["status", "--state", str(tmp_path)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"eventsched: error: unrecognized arguments: --state {tmp_path} "
                                       "(see `eventsched --help`)\n")


@pytest.mark.parametrize("argv,options", PARSERS)
def test_no_option_of_any_command_is_taken_abbreviated(argv: list[str], options: list[Any],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from eventsched.cli import build_parser

    parser = build_parser(argv[0])
    for flag in (f for flags, _ in options for f in flags if f.startswith("--") and len(f) > 3):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, f"{flag[:-1]}=1"])
        assert "unrecognized arguments" in capsys.readouterr().err
