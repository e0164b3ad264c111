"""House style (DESIGN.md item 9): type hints everywhere (``disallow_untyped_defs``), mypy clean.

In the quick suite: a change that drops a type hint fails fast.

Runs mypy, with the settings in pyproject.toml's [tool.mypy], on the whole
``eventsched`` package, as a contributor would.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+: error: ")


def test_package_is_mypy_clean(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    # a fresh cache outside the tree: nothing written into the checkout
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "eventsched", "--cache-dir", str(tmp_path / "mypy-cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in proc.stdout.splitlines() if _ERROR.match(line)]
    assert not errors, "mypy errors:\n" + "\n".join(errors)
    # mypy itself must have run: exit 2 is a bad config or a crash
    assert proc.returncode == 0, proc.stdout + proc.stderr
