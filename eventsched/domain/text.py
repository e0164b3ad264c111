"""Text from users, made safe to print on someone else's terminal.

Job names, commands and users' strings reach other users' terminals through
``queue``, ``status``, ``sql`` and ``explain``. A raw escape sequence there
could retitle a window, hide lines or fake output, so every such string is
printed through ``printable``: control characters (C0, DEL, C1) and the
bidirectional overrides become visible escapes; everything else is kept.
"""

from __future__ import annotations

import re

__all__ = ["printable", "has_control", "table"]

# C0 controls except none, DEL, C1 controls, and the Unicode bidi controls
# that reorder what a terminal shows (the "Trojan Source" characters)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``)."""
    return _CONTROL.sub(_escape, text)


def has_control(text: str) -> bool:
    return _CONTROL.search(text) is not None


def table(headers: list[str], rows: list[list[str]], *, right: list[bool] | None = None, rule: bool = False) -> str:
    """Aligned columns for a terminal: every cell through ``printable`` (names
    are users' text); ``right`` right-aligns columns (numbers), ``rule`` draws
    a line under the header. The one table formatter of the CLI, ``sql`` and
    the notebook's text views."""
    head = [printable(h) for h in headers]
    cells = [[printable(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(head)]
    align = right or [False] * len(head)

    def line(texts: list[str]) -> str:
        return "  ".join(t.rjust(w) if r else t.ljust(w) for t, w, r in zip(texts, widths, align)).rstrip()

    out = [line(head)]
    if rule:
        out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    return "\n".join(out)
