"""Every value-taking option of every command, read from the command table the
CLI itself is built from (``cli/commands.py``), given hostile values through
the real ``eventsched`` against one real daemon on fake GPUs. Each run exits 0,
1 or 2 without a traceback, a refusal is exactly one line on stderr, the daemon
still answers afterwards, and a refused command queued no job.

A new option is covered without touching this file; a new *positional*
argument may need a plain value in ``positional_base`` so that the rest of
its command line is valid. ``EVENTSCHED_HOSTILE_ALL=1`` runs every value on
every option (about two minutes) instead of the fixed subset.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
from daemon_harness import EVENTSCHED, Daemon

from eventsched.cli.commands import COMMANDS
from eventsched.wire.errors import ClientError

pytestmark = pytest.mark.slow

UNDER_A_FILE = "under-a-file"  # stands for <a regular file>/sub, made per run
VALUES: dict[str, str | bytes] = {
    "huge": "99999999999999999999",
    "minus-one": "-1",
    "zero": "0",
    "nan": "nan",
    "inf": "inf",
    "minus-inf": "-inf",
    "empty": "",
    "long": "x" * 10_000,
    "control": "a\x1b[2J\nb",
    "non-utf8": b"caf\xe9\xff",  # bytes in argv: not valid UTF-8, as a Latin-1 terminal sends them
    UNDER_A_FILE: UNDER_A_FILE,
}

# commands that do not return on their own: they are not run at all
SKIPPED_COMMANDS = {
    "serve": "runs the daemon until it is stopped",
    "attach": "takes over the terminal of a --session job until detached",
    "mcp": "serves MCP on stdio until its input ends",
}
# --watch, --follow and --interactive also never return, but take no value, so
# they are never given; no command here needs a second user (the tests run as
# whoever runs them: root-only options then meet their one-line refusal).

# where the full product is longer than this suite should take, each option
# gets this many of the values, rotating so that every value is used too
VALUES_PER_OPTION = 2
RUN_EVERY_VALUE = os.environ.get("EVENTSCHED_HOSTILE_ALL") == "1"


@dataclass(frozen=True)
class Slot:
    """One value-taking option (or positional argument) of one (sub)command."""
    words: tuple[str, ...]  # the (sub)command: ("reserve", "create")
    flag: str  # "--priority", or a positional's name ("job")
    options: tuple[Any, ...] = field(compare=False)  # the command's whole option list, from the table

    def __str__(self) -> str:
        return " ".join([*self.words, self.flag])


def parsers(table: dict[str, Any] = COMMANDS,
            words: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], list[Any]]]:
    """Every (sub)command the parser builds from the table, with its options."""
    for name, (_help, options) in table.items():
        if not words and name in SKIPPED_COMMANDS:
            continue
        nested = [o["actions"] for _flags, o in options if "actions" in o]
        if nested:
            yield from parsers(nested[0], (*words, name))
        else:
            yield (*words, name), options


def spelling(flags: tuple[str, ...]) -> str:
    """The long spelling of an option (the one a script would write), or a positional's name."""
    return next((f for f in flags if f.startswith("--")), flags[0])


def slots() -> list[Slot]:
    found = []
    for words, options in parsers():
        for flags, kwargs in options:
            if kwargs.get("action") not in ("store_true", "store_false", "count", "version"):
                found.append(Slot(words, spelling(flags), tuple(options)))
    return found


def cases() -> list[tuple[Slot, str]]:
    """Every (option, value) pair, or a fixed subset of them that still gives
    each option ``VALUES_PER_OPTION`` values and uses every value."""
    names = list(VALUES)
    every = [(slot, name) for slot in slots() for name in names]
    if RUN_EVERY_VALUE:
        return every
    chosen = []
    for i, slot in enumerate(slots()):
        for j in range(VALUES_PER_OPTION):
            chosen.append((slot, names[(i * VALUES_PER_OPTION + j) % len(names)]))
    return chosen


def case_id(slot: Slot, value: str) -> str:
    return f"{slot} {value}"


CASES = cases()


def test_the_chosen_cases_cover_every_option_and_every_value() -> None:
    assert {slot for slot, _ in CASES} == set(slots())
    assert {value for _, value in CASES} == set(VALUES)
    assert not SKIPPED_COMMANDS.keys() & {slot.words[0] for slot in slots()}


# --- the world each command line is run in ---------------------------------------------


@dataclass
class World:
    """The shared daemon and the files the command lines name. A daemon that
    a case brought down is replaced by a fresh one (a fresh state dir: the old
    log may hold what brought it down), so one crash fails one case only."""
    root: Path
    daemon: Daemon | None = None
    held_job: int = 0
    started: int = 0

    @property
    def a_file(self) -> Path:
        return self.root / "a-file"

    def env(self) -> dict[str, str]:
        # a HOME of its own: `notify set` reads ~/.config, and nothing may touch the real one
        assert self.daemon is not None
        return {**self.daemon.env(), "HOME": str(self.root / "home")}

    def job_ids(self) -> set[int] | None:
        """The ids of every job the daemon knows, or None where it does not answer."""
        try:
            return None if self.daemon is None else set(self.daemon.jobs())
        except (OSError, ClientError):
            return None

    def start(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
        self.started += 1
        self.daemon = Daemon(self.root / f"state-{self.started}", gpus="fake:4:16384").start()
        self.held_job = self.daemon.submit("--begin=+1d", "--name=hostile-base", "--", "true")
        assert self.daemon.cli("hold", str(self.held_job)).returncode == 0
        shutil.rmtree(self.root / "log-copy", ignore_errors=True)
        # `log repair` never touches the live log
        shutil.copytree(self.daemon.state_dir / "log", self.root / "log-copy")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("hostile")
    (root / "a-file").write_text("a regular file\n")
    (root / "home").mkdir()
    (root / "trace.csv").write_text("submit_time,duration,gpus,gpu_mem,user,priority\n0,10,1,,a,0\n")
    (root / "jobs.txt").write_text("0,/bin/true,,,\n")
    world = World(root)
    world.start()
    try:
        yield world
    finally:
        assert world.daemon is not None
        world.daemon.stop()


def positional_base(world: World) -> dict[str, str | None]:
    """A plain value for each positional argument (None: leave it out)."""
    return {
        "job": str(world.held_job), "jobs": str(world.held_job), "gpu": "0", "query": "SELECT 1",
        "source": str(world.root / "trace.csv"), "dir": str(world.root / "log-copy"),
        "file": str(world.root / "jobs.txt"), "name": "hostile-tenant", "token": "no-such-token",
        "reservation": "999",
    }


def option_base(ordinal: int) -> dict[str, dict[str, str | None]]:
    """Options a command needs to do anything, by (sub)command."""
    return {
        "cancel": {"--name": "no-such-job", "jobs": None},  # never the held job
        "replay": {"--policy": "fifo", "--gpus": "fake:1"},
        # a window of its own for each run, so accepted ones never collide
        "reserve create": {"--gpus": "1", "--start": f"+{2 + ordinal}h", "--duration": "1h"},
        "notify set": {"--webhook": "http://127.0.0.1:9/hook"},
    }


def command_line(world: World, slot: Slot, value: str | bytes, ordinal: int) -> list[str | bytes]:
    """``slot``'s command with ``value`` in ``slot``, everything else plain."""
    base = {**positional_base(world), **option_base(ordinal).get(" ".join(slot.words), {})}
    args: list[str | bytes] = [*slot.words]
    positionals: list[str | bytes] = []
    for flags, _kwargs in slot.options:
        flag = spelling(flags)
        given = value if flag == slot.flag else base.get(flag)
        if given is None:
            continue
        if flag.startswith("-"):
            # --flag=VALUE: a value that begins with "-" is still the option's
            args.append(flag.encode() + b"=" + given if isinstance(given, bytes) else f"{flag}={given}")
        else:
            positionals.append(given)  # argparse here takes no `--` before them, so "-inf" is an option
    args += positionals
    if slot.words[0] == "submit":
        args += ["--", "true"]
    return args


def limit_memory() -> None:
    """A hostile value must not take the shared machine's memory with it."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize("slot, value", CASES, ids=[case_id(s, v) for s, v in CASES])
def test_a_hostile_value_is_refused_in_one_line_or_taken(world: World, slot: Slot, value: str) -> None:
    before = world.job_ids()
    if before is None:  # an earlier case brought it down (and failed for it)
        world.start()
        before = world.job_ids()
    text = VALUES[value]
    if text == UNDER_A_FILE:
        text = str(world.a_file / "sub")
    ordinal = CASES.index((slot, value))
    cwd = world.root / "cwd" / str(ordinal)  # relative paths among the values ("0", "-1") land here, apart
    cwd.mkdir(parents=True)
    argv = command_line(world, slot, text, ordinal)
    try:
        result = subprocess.run([*EVENTSCHED, *argv], env=world.env(), cwd=cwd, capture_output=True,
                                stdin=subprocess.DEVNULL, timeout=60, preexec_fn=limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail("did not return within 60 s")
    stderr = result.stderr.decode(errors="replace")
    shown = f"exit {result.returncode}, stderr: {stderr[-1500:]!r}"
    assert result.returncode in (0, 1, 2), shown
    assert "Traceback" not in stderr, shown
    if result.returncode != 0:
        assert len(stderr.splitlines()) == 1, shown
    after = world.job_ids()  # lists every job: what a poisoned job would fail at
    assert after is not None, f"the daemon no longer answers ({shown})"
    if result.returncode != 0:
        assert after == before, f"a refused command queued a job ({shown})"
