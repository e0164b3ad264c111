"""Where eventsched keeps its state, per SPEC §2."""

from __future__ import annotations

import os
from pathlib import Path


def default_state_dir() -> Path:
    """``$EVENTSCHED_STATE_DIR``, else the user's data directory (XDG)."""
    explicit = os.environ.get("EVENTSCHED_STATE_DIR")
    if explicit:
        return Path(explicit)
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data_home) / "eventsched"


def default_socket(state_dir: Path | None = None) -> Path:
    """``$EVENTSCHED_SOCKET``, else ``<state-dir>/eventsched.sock``."""
    explicit = os.environ.get("EVENTSCHED_SOCKET")
    if explicit:
        return Path(explicit)
    return (state_dir or default_state_dir()) / "eventsched.sock"


def log_dir(state_dir: Path) -> Path:
    return state_dir / "log"


def snapshot_dir(state_dir: Path) -> Path:
    return state_dir / "snapshots"
