"""Text from elsewhere made safe to show on one line: ``printable`` and ``mask_urls``.

Names and values visiontune did not write (a study store's choices and folders, a client's request path, a
server's answer) may hold a newline that forges a second line, an escape sequence that retitles or clears
the terminal, or U+202E that turns the rest of a line around; a storage or data URL may carry a password.
Every line that shows such text goes through these two, so each concern has one place; ``byte_size`` says a
size (a bound a line names) in its unit. Imports nothing.
"""

from __future__ import annotations

import re

# scheme://user:password@host: the password (everything between the first ':' after '//' and the last '@'
# of the authority) becomes ***. The authority ends at '/', '?' or '#'; a password may hold any other.
_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/?#@:\s]*):(?P<secret>[^/?#\s]*)@")


def printable(text: object) -> str:
    """``text`` on one line: control and format characters (newline, ESC, BEL, U+202E) written as escapes
    (``\\n``, ``\\x1b``), so that stored or client-chosen text cannot forge lines or drive the terminal."""
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode() for c in str(text))


def mask_urls(text: object) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` in it written as ``***``, as
    SQLAlchemy shows a database URL (``postgresql://u:***@host/db``)."""
    return _CREDENTIALS.sub(lambda m: f"{m['head']}:***@", str(text))


def shown(text: object) -> str:
    """Stored or received text as a line shows it: passwords masked, control characters escaped."""
    return printable(mask_urls(text))


def byte_size(n: int) -> str:
    """A byte count, exactly, in the largest binary unit that divides it: ``64 MiB``, ``512 KiB``, ``1,500 bytes``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift:,} {unit}"
    return f"{n:,} bytes"
