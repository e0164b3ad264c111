"""File-system steps that durability depends on, written once."""

from __future__ import annotations

import os

__all__ = ["fsync_dir"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a directory's entries durable (a rename or a create in it)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
