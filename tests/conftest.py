"""Checks before any test runs."""

from __future__ import annotations

import os

from eventsched import _compiled

# A compiled module older than its source: this process runs the .py sources
# (eventsched/_compiled.py says so, once), and so does every process the tests
# start, without repeating it. tests/test_compiled.py fails on it in CI.
if os.environ.get("EVENTSCHED_PURE", "") in ("", "0") and _compiled.stale():
    os.environ["EVENTSCHED_PURE"] = "1"
