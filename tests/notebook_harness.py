"""What the notebook tests share: a real IPython shell with the magics loaded
(the ``shell`` and ``ip`` fixtures: import them), a cell run as a user would
run it, and the one line a refused magic prints."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from eventsched.jupyter.magics import EventschedMagics

# the magics' settings a test may change: put back after each
TRAITS = ("socket", "state_dir", "default_gpus", "scheduler_gpus", "cell_dir")


def magics_of(ip: InteractiveShell) -> EventschedMagics:
    return next(c for c in ip.configurables if isinstance(c, EventschedMagics))


def run(ip: InteractiveShell, code: str, capsys: pytest.CaptureFixture[str]) -> tuple[Any, str, str]:
    """Run a cell as a user would; return (result, stdout, stderr)."""
    result = ip.run_cell(code, store_history=False)
    out, err = capsys.readouterr()
    return result, out, err


def one_line_error(result: Any, err: str) -> str:
    """The one line a refused magic printed (no traceback, nothing else)."""
    assert isinstance(result.error_in_exec, UsageError), (result.error_in_exec, err)
    lines = [l for l in err.splitlines() if l.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def error_of(ip: InteractiveShell, code: str, capsys: pytest.CaptureFixture[str]) -> str:
    result, _, err = run(ip, code, capsys)
    return one_line_error(result, err)


@pytest.fixture(scope="module")
def shell() -> InteractiveShell:
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "eventsched.jupyter")
    return ip


@pytest.fixture
def ip(shell: InteractiveShell, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[InteractiveShell]:
    """The shell, pointed at an empty state dir (no daemon) unless a test says otherwise."""
    monkeypatch.setenv("EVENTSCHED_STATE_DIR", str(tmp_path / "nostate"))
    monkeypatch.delenv("EVENTSCHED_SOCKET", raising=False)
    magics = magics_of(shell)
    saved = {t: getattr(magics, t) for t in TRAITS}
    yield shell
    for name, value in saved.items():
        setattr(magics, name, value)
