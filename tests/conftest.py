"""Checks before any test runs."""

from __future__ import annotations

import os

import pytest

from eventsched import _compiled


def pytest_sessionstart(session: pytest.Session) -> None:
    # a source edited after mypyc built it would be tested as its old code
    # (unless EVENTSCHED_PURE=1 runs the sources themselves)
    stale = [] if os.environ.get("EVENTSCHED_PURE", "") not in ("", "0") else _compiled.stale()
    if stale:
        pytest.exit(f"compiled modules are older than their sources ({', '.join(stale)}): "
                    "run scripts/setup.sh to rebuild them, or EVENTSCHED_PURE=1 to test the sources", returncode=4)
