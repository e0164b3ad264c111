"""The Python API: ``from eventsched import Client, JobSpec`` and the
other names a notebook needs, whatever the inner layout."""

from __future__ import annotations

import subprocess
import sys

import pytest

import eventsched


def test_every_public_name_imports_from_the_top_package() -> None:
    from eventsched import Client, JobSpec, compare, load_source, open_history, simulate  # noqa: F401

    for name in eventsched.__all__:
        assert getattr(eventsched, name) is not None, name
    assert JobSpec(command=["true"]).command == ["true"]
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        eventsched.Nope  # noqa: B018


def test_importing_the_package_imports_nothing_heavy() -> None:
    # every CLI call imports eventsched: the API must load lazily
    code = "import sys, eventsched; print(sorted(m for m in sys.modules if m.startswith(('duckdb', 'anyio', 'msgspec'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == "[]"
