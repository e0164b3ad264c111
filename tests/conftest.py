"""Checks before any test runs."""

from __future__ import annotations

import os
import signal

import pytest

from eventsched import _compiled

# A compiled module older than its source: this process runs the .py sources
# (eventsched/_compiled.py says so, once), and so does every process the tests
# start, without repeating it. tests/test_compiled.py fails on it in CI.
if os.environ.get("EVENTSCHED_PURE", "") in ("", "0") and _compiled.stale():
    os.environ["EVENTSCHED_PURE"] = "1"

# A shell starts a background command (`scripts/test.sh &`) with Ctrl-C ignored,
# and every process a test starts would inherit that: the tests that press
# Ctrl-C on a CLI process need it to have the default a terminal gives.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The machine-wide install spends minutes in pip, unpacking and byte-compiling
# every dependency, while most tests wait on daemons with a core to spare: it
# starts as soon as the tests are collected, and its test waits for it.
INSTALL_TEST = "test_install_system.py::"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # the install's test last: the background install has the whole run to finish
    items.sort(key=lambda item: INSTALL_TEST in item.nodeid)


def pytest_collection_finish(session: pytest.Session) -> None:
    # (under pytest-xdist every worker collects everything: the first starts it)
    first_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"
    if os.geteuid() == 0 and first_worker and any(INSTALL_TEST in item.nodeid for item in session.items):
        from install_harness import start_install

        start_install()


def pytest_unconfigure(config: pytest.Config) -> None:
    from install_harness import discard_install

    discard_install()
