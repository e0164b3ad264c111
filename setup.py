"""Build: the scheduler's hot path compiled with mypyc, when it can be.

The modules in ``eventsched/_compiled.py`` are the core's per-event path (the
fold, the policies, the transition table) and the replay loop around it;
compiled, a replay and every daemon decision run faster (bench/bench_replay.py,
bench/bench_backlog.py). They are plain, type-checked Python either way:

- ``EVENTSCHED_PURE=1`` at build time installs them uncompiled;
- a build that fails (no C compiler, no Python headers) warns and installs
  them uncompiled (``optional``);
- the supervisor's ``runtime/launch/_spawn.c`` and the history fold's
  ``projections/_frames.c`` are built either way (optional too);
- at run time, ``EVENTSCHED_PURE=1`` or a compiled module older than its
  source makes a process import the .py sources (``eventsched/_compiled.py``).

Everything else is configured in pyproject.toml.
"""

from __future__ import annotations

import os
import runpy

from setuptools import Extension, setup

# read, not imported: nothing of eventsched is importable before the build
COMPILED = list(runpy.run_path("eventsched/_compiled.py")["SOURCES"])


def _extensions() -> list:
    if os.environ.get("EVENTSCHED_PURE", "") not in ("", "0"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:  # a build without build isolation and without mypy
        print("eventsched: mypy is not installed; installing the pure-Python modules")
        return []
    extensions = mypycify(COMPILED, opt_level="3")
    for ext in extensions:
        ext.optional = True  # no compiler: warn, and install the .py sources alone
    return extensions


def _spawn_helper() -> list:
    """The supervisor's launch accelerator, clone3 into the job's cgroup
    (runtime/launch/_spawn.c). Optional: without a C compiler the supervisor
    forks instead (tests/test_native_spawn.py fails under CI then)."""
    return [Extension("eventsched.runtime.launch._spawn", ["eventsched/runtime/launch/_spawn.c"], optional=True)]


def _frames_helper() -> list:
    """The history catch-up's frame walker (projections/_frames.c). Optional:
    without it the log's frames are decoded by msgspec first, slower."""
    return [Extension("eventsched.projections._frames", ["eventsched/projections/_frames.c"], optional=True)]


setup(ext_modules=_extensions() + _spawn_helper() + _frames_helper())
