"""Text from users, made safe to print on someone else's terminal.

Job names, commands and users' strings reach other users' terminals through
``queue``, ``status``, ``sql`` and ``explain``. A raw escape sequence there
could retitle a window, hide lines or fake output, so every such string is
printed through ``printable``: control characters (C0, DEL, C1) and the
bidirectional overrides become visible escapes; everything else is kept.
"""

from __future__ import annotations

import re

__all__ = ["printable", "has_control"]

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
