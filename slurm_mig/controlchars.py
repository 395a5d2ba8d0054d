"""Control characters written visibly, for text that someone else chose and someone's terminal shows.

A job name (``sbatch -J``) or a request path (anyone who can reach the API port, before authentication)
could otherwise move the cursor, clear or retitle an operator's terminal, or hide lines, in the CLI's
output or the controller's log. C0, DEL and C1 become ``\\xNN``, so nothing is lost. So do, as ``\\uNNNN``,
the characters that reorder or hide text without being control characters: the bidirectional overrides,
embeddings and isolates (U+202E shows "abc" as "cba", as in CVE-2021-42574), the invisible ones (zero-width
space, word joiner, byte-order mark: a user "ro\\u200bot" looks like root) and the line and paragraph
separators (U+2028, U+2029), which some terminals and viewers start a new line at. Those past U+FFFF (the tag
characters) as ``\\UNNNNNNNN``."""

from __future__ import annotations

import re

_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_HIDDEN = (0x061C, 0x180E, 0x200B, 0x200E, 0x200F, *range(0x2028, 0x202F), *range(0x2060, 0x2065),
           *range(0x2066, 0x206A), 0xFEFF,
           # drawn as nothing too: the interlinear annotation marks, the shorthand and musical format controls, and
           # the tag characters (U+E0001, U+E0020-E007F: an ASCII copy no terminal shows, "ro" + tags + "ot" looks
           # like "root")
           *range(0xFFF9, 0xFFFC), *range(0x1BCA0, 0x1BCA4), *range(0x1D173, 0x1D17B), *range(0xE0000, 0xE0080))
_CONTROL.update({c: f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}" for c in _HIDDEN})
# Most text has none of them: one search finds that five times faster than translate() walks it (the
# dashboard passes every field of a large site through visible() at each frame: 370,000 strings at 1,600 GPUs).
# Written as ranges: one item per character (the tag characters are 128) made the search 30 times slower.


def _ranges(codes) -> str:
    out, codes = [], sorted(codes)
    start = prev = codes[0]
    for c in [*codes[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(re.escape(chr(start)) + ("-" + re.escape(chr(prev)) if prev != start else ""))
        if c is not None:
            start = prev = c
    return "".join(out)


_ANY = re.compile("[" + _ranges(_CONTROL) + "]")
_ANY_ASCII = re.compile("[" + _ranges(c for c in _CONTROL if c < 0x80) + "]")  # most text: a smaller class


def visible(text: str) -> str:
    """``text`` with every control character written as a visible ``\\xNN`` (``\\uNNNN`` for the bidirectional and
    invisible formatting characters)."""
    return text.translate(_CONTROL) if (_ANY_ASCII if text.isascii() else _ANY).search(text) else text
