"""One request on the control socket without msgspec: the CLI's fast path.

A ``submit`` from a shell loop is one short process per job, and importing
msgspec costs more than the rest of such a call. A request is a dict laid out
as msgspec lays out the tagged ``Request`` struct (``protocol.py``), the reply a
plain dict; what ``packb`` cannot encode raises ``ValueError`` before anything
is sent, so a caller can fall back to the full client.
"""

from __future__ import annotations

import _struct

from eventsched.wire.errors import ClientError, refused
from eventsched.wire.framing import connect, exchange

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["packb", "unpackb", "request"]

_DOUBLE = _struct.Struct(">d")
_CONSTANTS = {0xC0: None, 0xC2: False, 0xC3: True}


def _pack(value: Any, out: bytearray) -> None:
    kind = type(value)
    if kind is str:
        data = value.encode()
        _length(out, len(data), 0xA0, 32, 0xD9)
        out += data
    elif value is None:
        out.append(0xC0)
    elif kind is bool:
        out.append(0xC3 if value else 0xC2)
    elif kind is int:
        if 0 <= value < 0x80:
            out.append(value)
        elif -32 <= value < 0:
            out.append(value & 0xFF)
        elif not -(1 << 63) <= value < 1 << 64:
            raise ValueError(f"integer {value} does not fit in 64 bits")
        elif value >= 0:
            out += b"\xcf" + value.to_bytes(8, "big")
        else:
            out += b"\xd3" + value.to_bytes(8, "big", signed=True)
    elif kind is float:
        out += b"\xcb" + _DOUBLE.pack(value)
    elif kind is list or kind is tuple:
        _length(out, len(value), 0x90, 16, 0xDB)
        for item in value:
            _pack(item, out)
    elif kind is dict:
        _length(out, len(value), 0x80, 16, 0xDD)
        for key, item in value.items():
            _pack(key, out)
            _pack(item, out)
    elif kind is bytes:
        n = len(value)
        out += (b"\xc4" + n.to_bytes(1, "big")) if n < 0x100 else (b"\xc6" + n.to_bytes(4, "big"))
        out += value
    else:
        raise ValueError(f"cannot encode a {kind.__name__}")


def _length(out: bytearray, n: int, fixed: int, limit: int, code8: int) -> None:
    """A str's, list's or map's length: in its type byte below ``limit``, else
    after the code for 8 (str only), 16 or 32 bits (``code8`` + 0, 1, 2)."""
    if n < limit:
        out.append(fixed | n)
    elif n < 0x100 and fixed == 0xA0:
        out += bytes((code8, n))
    else:
        wide = n >= 0x10000
        out += bytes((code8 + 1 + wide,)) + n.to_bytes(4 if wide else 2, "big")


def packb(value: Any) -> bytes:
    """``value`` (None, bool, int, float, str, bytes, list, tuple, dict) as msgpack;
    ValueError (UnicodeEncodeError for a str that is not UTF-8) for anything else."""
    out = bytearray()
    _pack(value, out)
    return bytes(out)


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        start = self.pos
        self.pos = end = start + n
        if end > len(self.data):
            raise ValueError("truncated msgpack")
        return self.data[start:end]

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")

    def value(self) -> Any:
        b = self.take(1)[0]
        if b < 0x80:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0xA0 <= b < 0xC0:
            return self.take(b & 0x1F).decode()
        if 0x90 <= b < 0xA0:
            return [self.value() for _ in range(b & 0x0F)]
        if 0x80 <= b < 0x90:
            return self.mapping(b & 0x0F)
        if b in _CONSTANTS:
            return _CONSTANTS[b]
        if b in (0xD9, 0xDA, 0xDB):
            return self.take(self.uint(1 << (b - 0xD9))).decode()
        if b in (0xC4, 0xC5, 0xC6):
            return self.take(self.uint(1 << (b - 0xC4)))
        if b in (0xCC, 0xCD, 0xCE, 0xCF):
            return self.uint(1 << (b - 0xCC))
        if b in (0xD0, 0xD1, 0xD2, 0xD3):
            return int.from_bytes(self.take(1 << (b - 0xD0)), "big", signed=True)
        if b == 0xCB:
            return _DOUBLE.unpack(self.take(8))[0]
        if b in (0xDC, 0xDD):
            return [self.value() for _ in range(self.uint(2 if b == 0xDC else 4))]
        if b in (0xDE, 0xDF):
            return self.mapping(self.uint(2 if b == 0xDE else 4))
        raise ValueError(f"msgpack type 0x{b:02x} is not supported here")

    def mapping(self, n: int) -> dict[Any, Any]:
        return {self.value(): self.value() for _ in range(n)}  # the key is read first


def unpackb(data: bytes) -> Any:
    """One msgpack value (no extension types); ValueError if malformed."""
    reader = _Reader(data)
    value = reader.value()
    if reader.pos != len(data):
        raise ValueError("trailing bytes after a msgpack value")
    return value


def request(path: str, message: dict[str, Any], timeout: float | None = 30.0) -> Any:
    """The reply's ``data``, or ClientError with the daemon's reason; a ValueError
    (from ``packb``, before connecting) means nothing was sent."""
    body = packb(message)
    sock = connect(path, timeout)
    try:
        reply = unpackb(exchange(sock, len(body).to_bytes(4, "big") + body))
    except ValueError:
        raise ClientError("unexpected message from the daemon") from None
    finally:
        sock.close()
    if type(reply) is not dict or reply.get("type") != "Reply":
        raise ClientError("unexpected message from the daemon")
    if not reply.get("ok"):
        raise refused(str(reply.get("error", "")), str(reply.get("kind", "")), reply.get("data"))
    return reply.get("data")
