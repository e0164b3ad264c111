"""The seam for every call of the log and the snapshots that changes a file:
``PLAIN`` (bare ``os`` functions) in production, a recorder in tests
(``tests/crash_fs.py``).
"""

from __future__ import annotations

import os

__all__ = ["FileOps", "PLAIN", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a directory's entries durable (a rename or a create in it)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileOps:
    """Plain ``os`` calls: what production uses."""

    open = staticmethod(os.open)
    close = staticmethod(os.close)
    pwrite = staticmethod(os.pwrite)
    write = staticmethod(os.write)
    fdatasync = staticmethod(os.fdatasync)
    fsync = staticmethod(os.fsync)
    ftruncate = staticmethod(os.ftruncate)
    rename = staticmethod(os.rename)
    replace = staticmethod(os.replace)
    unlink = staticmethod(os.unlink)
    fsync_dir = staticmethod(fsync_dir)

    def write_new(self, path: str | os.PathLike[str], data: bytes) -> None:
        """Create ``path`` (0600; it must not exist) holding ``data``, fsynced."""
        fd = self.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[self.write(fd, view) :]
            self.fsync(fd)
        finally:
            self.close(fd)


PLAIN = FileOps()
