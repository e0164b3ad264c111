"""What a client of the control socket raises, full (``client.py``) or lean
(``lean.py``), so that ``except ClientError`` catches both. Imports nothing."""

from __future__ import annotations

__all__ = ["ClientError", "DaemonNotRunning", "refused", "went_away", "OUT_OF_RANGE"]

# what msgpack (the socket's frames, the log) can hold; a bigger number is refused before it is sent
OUT_OF_RANGE = "a number out of range (integers from -2**63 to 2**64-1)"


class ClientError(Exception):
    """The daemon refused a request (or could not be asked), str() saying why in one line;
    ``kind``: its ``RefusalKind`` ("": no answer); ``existing``: the job a conflict is with."""

    def __init__(self, message: str, kind: str = "", existing: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.existing = existing


def refused(error: str, kind: str, data: object) -> ClientError:
    existing = data.get("existing") if isinstance(data, dict) else None
    return ClientError(error, kind, existing if isinstance(existing, int) else None)


class DaemonNotRunning(ClientError):
    def __init__(self, path: str) -> None:
        super().__init__(f"no eventsched daemon is listening on {path}; start one with "
                         f"`eventsched serve` (or `eventsched serve --gpus fake:4` without GPUs)")
        self.path = path


def went_away(exc: OSError, what: str = "the request") -> ClientError:
    """The daemon hung up (or died) between a request and its reply."""
    return ClientError(f"the daemon went away before answering ({exc.strerror}); whether it took {what} is "
                       "in its log: check with `eventsched queue` once it is back")
