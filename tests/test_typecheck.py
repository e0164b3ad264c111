"""House style (DESIGN.md item 9): type hints everywhere, mypy clean.

Runs mypy, with the settings in pyproject.toml's [tool.mypy], on the whole
``eventsched`` package, as a contributor would.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Files still being typed by someone else: their errors are reported as a
# warning, not a failure. Empty this set once they are clean.
PENDING = {
    "eventsched/projections/history.py",
    "eventsched/metrics.py",
    "eventsched/sqlcmd.py",
}

_ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+: error: ")


@pytest.mark.slow
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
    errors = [(m["path"], line) for line in proc.stdout.splitlines() if (m := _ERROR.match(line))]
    blocking = [line for path, line in errors if path not in PENDING]
    pending = [line for path, line in errors if path in PENDING]
    if pending:
        warnings.warn(f"{len(pending)} mypy errors in files still being typed:\n" + "\n".join(pending))
    assert not blocking, "mypy errors:\n" + "\n".join(blocking)
    # mypy itself must have run: exit 2 is a bad config or a crash
    assert proc.returncode == 0 or (proc.returncode == 1 and errors), proc.stdout + proc.stderr
