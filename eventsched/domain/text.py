"""Text for a terminal: users' strings made safe, the one table formatter, the
one JSON printer and the one error line. No costly imports: the CLI's fast path
prints through it.

Users' strings reach other users' terminals, where a raw escape sequence could
retitle a window, hide lines or fake output: ``printable`` escapes them.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TextIO

__all__ = ["printable", "has_control", "table", "print_json", "print_error"]

# C0 controls, DEL, C1 controls, and the Unicode bidi controls that reorder
# what a terminal shows (the "Trojan Source" characters)
_CONTROL = [*range(0x20), *range(0x7F, 0xA0), 0x61C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_ESCAPES = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _CONTROL}
_CONTROL_CHARS = frozenset(map(chr, _CONTROL))


def printable(text: str) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``)."""
    return text.translate(_ESCAPES) if has_control(text) else text


def has_control(text: str) -> bool:
    return not _CONTROL_CHARS.isdisjoint(text)


def table(headers: list[str], rows: list[list[Any]], *, right: list[bool] | None = None, rule: bool = False) -> str:
    """Aligned columns, every cell through ``printable`` (None shows as nothing);
    ``right`` right-aligns columns, ``rule`` draws a line under the header."""
    head = [printable(h) for h in headers]
    cells = [["" if c is None else printable(str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(head)]
    align = right or [False] * len(head)

    def line(texts: list[str]) -> str:
        return "  ".join(t.rjust(w) if r else t.ljust(w) for t, w, r in zip(texts, widths, align)).rstrip()

    out = [line(head)]
    if rule:
        out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def print_json(data: Any, out: TextIO | None = None) -> None:
    """``data`` as indented JSON and a newline: every ``--json`` output."""
    import json

    out = out or sys.stdout
    json.dump(data, out, indent=2)
    out.write("\n")


def print_error(message: str, *, command: str = "", out: TextIO | None = None) -> None:
    """The one way a command says what went wrong: one line on stderr (a newline or escape
    sequence in a value the user gave is shown escaped, not obeyed). ``command``: the few
    whose lines scripts already match say ``eventsched sql: ...`` rather than ``eventsched: error: ...``."""
    print(f"eventsched {command}: " if command else "eventsched: error: ", printable(message), sep="",
          file=out or sys.stderr)
