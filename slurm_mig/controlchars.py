"""Control characters written visibly, for text that someone else chose and someone's terminal shows.

A job name (``sbatch -J``) or a request path (anyone who can reach the API port, before authentication)
could otherwise move the cursor, clear or retitle an operator's terminal, or hide lines, in the CLI's
output or the controller's log. C0, DEL and C1 become ``\\xNN``, so nothing is lost."""

from __future__ import annotations

_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def visible(text: str) -> str:
    """``text`` with every control character written as a visible ``\\xNN``."""
    return text.translate(_CONTROL)
