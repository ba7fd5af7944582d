"""Text that came from somewhere else (a tag, a host's file, a worker's message), made safe to print.

Such text may hold a newline that forges a second line of output, or a terminal escape sequence that moves
the cursor, retitles the window or hides what follows. Before it reaches the terminal, every control
character is written out as an escape (`\\n`, `\\x1b`), and an overlong value is cut with its length said.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]|\n")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: object, keep_tabs: bool = False) -> str:
    """`text` with each control character escaped (a tab kept where `keep_tabs`)."""
    value = str(text)
    if keep_tabs:
        return _CONTROL.sub(lambda m: _NAMED.get(m[0]) or f"\\x{ord(m[0]):02x}", value)
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: _NAMED.get(m[0]) or f"\\x{ord(m[0]):02x}", value)


def shown(text: object, limit: int = 120) -> str:
    """A foreign value quoted for a one-line message: escaped, and cut at `limit` characters."""
    value = printable(text)
    if len(value) > limit:
        value = f"{value[:limit]}… ({len(str(text))} characters)"
    return f"'{value}'"
