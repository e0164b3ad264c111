"""eventsched: a GPU job scheduler for a shared machine, built on an event log.

The Python API a notebook or script needs is importable from here, whatever
the package's inner layout::

    from eventsched import Client, JobSpec
    from eventsched import load_source, simulate, compare, compare_placements, open_history
    eventsched.whatif(policies=["fifo", "best-fit"], since="7d")  # a table, and its chart in a notebook
    con = eventsched.history()  # the read model as a read-only DuckDB connection

Names are resolved on first use, so ``import eventsched`` stays cheap (every
CLI call pays for it). The package's layers: docs/architecture.md.
"""

from __future__ import annotations

TYPE_CHECKING = False  # every CLI call imports this module: no typing
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

from eventsched import _compiled

_compiled.install()  # the .py sources where asked, or where the compiled build is stale

# public name -> the module that defines it
_API = {
    "Client": "eventsched.wire.client",
    "ClientError": "eventsched.wire.client",
    "DaemonNotRunning": "eventsched.wire.client",
    "JobSpec": "eventsched.domain.events",
    "JobState": "eventsched.domain.states",
    "SchedulerConfig": "eventsched.domain.messages",
    "load_source": "eventsched.sim.sources",
    "ReplayError": "eventsched.sim.sources",
    "simulate": "eventsched.sim.simulator",
    "RECORDED": "eventsched.sim.simulator",
    "compare_placements": "eventsched.sim.compare",
    "compare": "eventsched.sim.whatif",
    "format_comparison": "eventsched.sim.whatif",
    "metrics_from_log": "eventsched.sim.whatif",
    "whatif": "eventsched.jupyter.whatif",
    "open_history": "eventsched.projections.history",
    "History": "eventsched.projections.history",
    "history": "eventsched.projections.history_snapshot",
    "torch_memory_fraction": "eventsched.domain.frameworks",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'eventsched' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
