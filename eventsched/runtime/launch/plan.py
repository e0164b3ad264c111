"""What the daemon asks a supervisor to start, and the lines a supervisor
records: the one definition both sides import.

The supervisor loads this module by path under ``python -I -S``, so it imports
built-in modules only: JSON goes through ``_json``, the C half of ``json``,
because ``json`` imports ``re``, whose import would double a supervisor's start-up.
"""

from __future__ import annotations

import os
from _json import encode_basestring_ascii, make_encoder, make_scanner

__all__ = ["Plan", "encode", "decode", "dumps", "append_record"]


class Plan:
    """One job attempt to start. Paths are absolute (supervisors run in /);
    -1 keeps the supervisor's own ``uid`` or ``umask``; ``rlimits`` maps a
    resource name ("nofile") to [soft, hard] (-1 = unlimited); ``cgroup`` and
    ``memory_cgroup`` (v1) are "" for none; ``memory_limit`` says how host
    memory is limited ("" = not at all), so an exit for the limit is told
    apart; ``open_log``: create ``log`` before the job starts, for a terminal
    session that writes it by path."""

    __slots__ = (
        "argv", "env", "cwd", "log", "uid", "gid", "groups", "umask", "rlimits",
        "cgroup", "memory_cgroup", "memory_limit", "open_log",
    )

    def __init__(
        self, argv: list[str], env: dict[str, str], cwd: str = "/", log: str = "", uid: int = -1, gid: int = -1,
        groups: list[int] | None = None, umask: int = -1, rlimits: dict[str, list[int]] | None = None,
        cgroup: str = "", memory_cgroup: str = "", memory_limit: str = "", open_log: bool = False,
    ) -> None:
        self.argv, self.env, self.cwd, self.log = argv, env, cwd, log
        self.uid, self.gid, self.groups, self.umask = uid, gid, groups or [], umask
        self.rlimits, self.open_log = rlimits or {}, open_log
        self.cgroup, self.memory_cgroup, self.memory_limit = cgroup, memory_cgroup, memory_limit


class _Decoding:  # what the C scanner reads off json.JSONDecoder
    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int, parse_constant = float, int, float


# (markers, default, encoder, indent, separators, sort_keys, skipkeys, allow_nan), as json.JSONEncoder passes them
_encoder = make_encoder(None, None, encode_basestring_ascii, None, ":", ",", False, False, False)  # type: ignore[arg-type]
_scan = make_scanner(_Decoding)  # type: ignore[arg-type]


def dumps(value: object) -> str:
    """Compact ASCII JSON of dicts, lists, strings, numbers, booleans and None."""
    return "".join(_encoder(value, 0))


def encode(plan: Plan) -> bytes:
    return dumps({name: getattr(plan, name) for name in Plan.__slots__}).encode()


def decode(data: bytes) -> Plan:
    return Plan(**_scan(data.decode(), 0)[0])


def append_record(attempt: str, **fields: object) -> None:
    """One line of an attempt's record file in one write (O_APPEND): a reader
    takes only whole lines, so it never sees half of one."""
    fd = os.open(attempt, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (dumps(fields) + "\n").encode())
    finally:
        os.close(fd)
