"""The modules ``setup.py`` compiles with mypyc, and when a process runs
their .py sources instead.

Compiled, the scheduler's per-event path runs faster; the sources stay the
reference. A process imports every compiled module from its source when
``EVENTSCHED_PURE=1`` is set (a debugger, a profiler, the test that checks both
builds decide alike), or when any compiled module is older than its source or
outlived its place in ``SOURCES``: it would run old code (said once on stderr).
All or none, because compiled modules reach into each other's classes.

Cheap to import (every CLI call does) and standard library only:
``setup.py`` reads ``SOURCES`` from this file before anything is installed.
"""

from __future__ import annotations

import _imp
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec

__all__ = ["SOURCES", "MODULES", "install", "compiled", "stale", "orphans"]

SOURCES = (
    "eventsched/domain/states.py",
    "eventsched/projections/sortedkeys.py",
    "eventsched/projections/live.py",
    "eventsched/projections/model.py",
    "eventsched/projections/cluster.py",
    "eventsched/core/fgd.py",
    "eventsched/core/admission.py",
    "eventsched/core/policies.py",
    "eventsched/core/scheduler.py",
    "eventsched/sim/simulator.py",
    "eventsched/runtime/api/fair_use.py",
    "eventsched/runtime/api/connection.py",
)
MODULES = tuple(s.removesuffix(".py").replace("/", ".") for s in SOURCES)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Sources:
    """On ``sys.meta_path``: at the first import of a compiled module, decides
    which build runs; then imports the chosen modules from their .py files."""

    def __init__(self, pure: bool) -> None:
        self.names: frozenset[str] | None = frozenset(MODULES) if pure else None  # None: not decided yet

    def find_spec(self, name: str, path: Sequence[str] | None, target: object = None) -> ModuleSpec | None:
        if self.names is None and name in MODULES:
            self.names = _check()
        if not self.names or name not in self.names:
            return None
        import importlib.util

        return importlib.util.spec_from_file_location(name, os.path.join(_ROOT, *name.split(".")) + ".py")


def _check() -> frozenset[str]:
    old = stale()
    if not old:
        return frozenset()
    sys.stderr.write(f"eventsched: running the .py sources: compiled modules are older than them ({', '.join(old)}); "
                     "scripts/setup.sh rebuilds them\n")
    return frozenset(MODULES) | {p.split(".", 1)[0].replace("/", ".") for p in orphans()}


def install() -> None:
    """Put the choice of build on the import path (``eventsched`` does, once)."""
    if not any(isinstance(f, _Sources) for f in sys.meta_path):
        sys.meta_path.insert(0, _Sources(os.environ.get("EVENTSCHED_PURE", "") not in ("", "0")))


def _extension(source: str) -> str | None:
    """The compiled module built in place beside ``source``, if any."""
    stem = os.path.join(_ROOT, source.removesuffix(".py"))
    return next((stem + s for s in _imp.extension_suffixes() if os.path.exists(stem + s)), None)


def compiled() -> list[str]:
    """The modules this process imported from a compiled extension."""
    from importlib.machinery import ExtensionFileLoader

    return [name for name in MODULES
            if isinstance(getattr(getattr(sys.modules.get(name), "__spec__", None), "loader", None), ExtensionFileLoader)]


def stale() -> list[str]:
    """Sources edited after their compiled module was built, and the sources
    of compiled modules no longer in ``SOURCES`` (``orphans``)."""
    out = [path.split(".", 1)[0] + ".py" for path in orphans()]
    for source in SOURCES:
        ext = _extension(source)
        if ext is not None and os.path.getmtime(os.path.join(_ROOT, source)) > os.path.getmtime(ext):
            out.append(source)
    return out


def orphans() -> list[str]:
    """Compiled modules beside a source that is no longer in ``SOURCES`` (a
    tree built before a module left the list): Python would import them
    instead of the source. ``scripts/setup.sh`` removes them."""
    suffixes = _imp.extension_suffixes()
    out = []
    for folder, _dirs, files in os.walk(os.path.join(_ROOT, "eventsched")):
        for name in files:
            stem = name.split(".", 1)[0]
            source = os.path.relpath(os.path.join(folder, stem + ".py"), _ROOT)
            if any(name == stem + s for s in suffixes) and stem + ".py" in files and source not in SOURCES:
                out.append(os.path.relpath(os.path.join(folder, name), _ROOT))
    return sorted(out)
