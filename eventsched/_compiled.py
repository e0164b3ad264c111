"""The modules ``setup.py`` compiles with mypyc, and how to run their .py
sources instead.

Compiled, the core's per-event path runs about 1.5x faster; the sources stay
the reference. ``EVENTSCHED_PURE=1`` in the environment makes every process
that imports eventsched load the sources (``prefer_sources``): for a debugger,
a profiler that should see Python frames, or the test that checks both builds
decide alike. Standard library only: ``setup.py`` reads ``SOURCES`` from this
file before anything is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["SOURCES", "MODULES", "prefer_sources", "compiled", "stale", "orphans"]

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
    "eventsched/runtime/api/connection.py",
)
MODULES = tuple(s.removesuffix(".py").replace("/", ".") for s in SOURCES)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Finds the compiled modules' .py files ahead of their extensions."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name not in MODULES:
            return None
        source = os.path.join(_ROOT, *name.split(".")) + ".py"
        return importlib.util.spec_from_file_location(name, source)


def prefer_sources() -> None:
    if not any(isinstance(f, _SourceFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceFirst())


def _extension(source: str) -> str | None:
    """The compiled module built in place beside ``source``, if any."""
    folder, stem = os.path.split(os.path.join(_ROOT, source.removesuffix(".py")))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, stem + suffix)
        if os.path.exists(path):
            return path
    return None


def compiled() -> list[str]:
    """The modules this process imported from a compiled extension."""
    out = []
    for name in MODULES:
        spec = getattr(sys.modules.get(name), "__spec__", None)
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            out.append(name)
    return out


def stale() -> list[str]:
    """Sources edited after their compiled module was built, and compiled
    modules whose source is no longer compiled (``orphans``): until
    ``scripts/setup.sh`` runs again, Python would import the old code."""
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
    out = []
    for folder, _dirs, files in os.walk(os.path.join(_ROOT, "eventsched")):
        for name in files:
            stem = name.split(".", 1)[0]
            if not any(name == stem + suffix for suffix in importlib.machinery.EXTENSION_SUFFIXES):
                continue
            source = os.path.relpath(os.path.join(folder, stem + ".py"), _ROOT)
            if stem + ".py" in files and source not in SOURCES:
                out.append(os.path.relpath(os.path.join(folder, name), _ROOT))
    return sorted(out)
