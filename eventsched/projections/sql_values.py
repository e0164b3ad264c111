"""What both ends of ``eventsched sql`` share, without DuckDB: the exit
statuses, the error, JSON-ready values, and whether the daemon must answer.
A query the daemon answers imports no more than this on the client's side."""

from __future__ import annotations

import datetime as dt
import decimal
import math
import os
import uuid
from typing import Any

__all__ = ["EXIT_OK", "EXIT_ERROR", "EXIT_BAD_QUERY", "SqlError", "plain", "needs_daemon"]

EXIT_OK = 0
EXIT_ERROR = 1  # the history could not be read (missing state dir, bad log)
EXIT_BAD_QUERY = 2  # the user's SQL: invalid or refused


def plain(value: Any) -> Any:
    """A JSON-ready version of a DuckDB value."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if type(value).__name__ == "MonthDayNano":  # an INTERVAL read through Arrow (the daemon's sandbox)
        return (value.months * 30 + value.days) * 86400.0 + value.nanoseconds / 1e9
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return value


class SqlError(Exception):
    """A query that could not be answered: one line, and the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def needs_daemon(state_dir: str | os.PathLike[str]) -> bool:
    """Whether the daemon must answer: this user cannot read the log here (a
    root daemon's state, or none in this user's default state dir)."""
    log = os.path.join(os.fspath(state_dir), "log")
    return not os.access(log, os.R_OK | os.X_OK)
