"""Where eventsched keeps its state. The ``*_location`` functions return plain
strings so that the CLI's client path never imports pathlib (every ``submit``
would pay for it); the others wrap
them in ``Path`` for the daemon's code."""

from __future__ import annotations

import os

TYPE_CHECKING = False  # the CLI's fast path imports this module: no typing
if TYPE_CHECKING:
    from pathlib import Path

# the PATH of a job that brings none
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def state_dir_location() -> str:
    """``$EVENTSCHED_STATE_DIR``, else the user's data directory (XDG)."""
    if explicit := os.environ.get("EVENTSCHED_STATE_DIR"):
        return explicit
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(data_home, "eventsched")


def socket_location(state_dir: str | os.PathLike[str] | None = None) -> str:
    """``$EVENTSCHED_SOCKET``, else ``<state-dir>/eventsched.sock``."""
    return os.environ.get("EVENTSCHED_SOCKET") or os.path.join(os.fspath(state_dir) if state_dir else state_dir_location(), "eventsched.sock")


def default_state_dir() -> Path:
    from pathlib import Path

    return Path(state_dir_location())


def default_socket(state_dir: Path | None = None) -> Path:
    from pathlib import Path

    return Path(socket_location(state_dir))


def log_dir(state_dir: Path) -> Path:
    return state_dir / "log"


def snapshot_dir(state_dir: Path) -> Path:
    return state_dir / "snapshots"
