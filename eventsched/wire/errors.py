"""What a client of the control socket raises: shared by the full client
(``client.py``) and the lean one-request client (``lean.py``), so that
``except ClientError`` catches both. Imports nothing."""

from __future__ import annotations

__all__ = ["ClientError", "DaemonNotRunning", "went_away"]


class ClientError(Exception):
    """The daemon refused a request; str() is its one-line reason."""


class DaemonNotRunning(ClientError):
    def __init__(self, path: str) -> None:
        super().__init__(
            f"no eventsched daemon is listening on {path}; start one with "
            f"`eventsched serve` (or `eventsched serve --gpus fake:4` without GPUs)"
        )
        self.path = path


def went_away(exc: OSError) -> ClientError:
    """The daemon hung up (or died) between a request and its reply."""
    return ClientError(
        f"the daemon went away before answering ({exc.strerror}); whether it took the request is "
        "in its log: check with `eventsched queue` once it is back"
    )
