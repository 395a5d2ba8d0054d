"""What the command-line tools ask of the terminal they print to."""

from __future__ import annotations

import sys


def stdout_is_a_terminal() -> bool:
    """Is standard output a terminal? False when file descriptor 1 was closed at start (``>&-``: a cron line, a
    daemon's child): Python sets sys.stdout to None then, and ``sys.stdout.isatty()`` raised AttributeError (a
    traceback and status 1 for `jobs`, `nodes`, `decisions`, `explain`, `top`; see slurm_mig.cli.main)."""
    out = sys.stdout
    if out is None:
        return False
    try:
        return out.isatty()
    except ValueError:  # a closed file object
        return False


# What the dashboard and `nodes` draw with unless --ascii: rules, slice dots, arrows, ellipses.
DRAWING = "─·→…"


def stdout_can_show(text: str = DRAWING) -> bool:
    """Can standard output's encoding write ``text``? False for an ASCII or Latin-1 output (PYTHONIOENCODING=ascii,
    LANG=de_DE.ISO-8859-1), where the operator tools draw with ASCII characters instead."""
    out = sys.stdout
    try:
        text.encode(getattr(out, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def tolerate_unencodable_output() -> None:
    """Write what standard output's and error's encodings lack as ``\\uNNNN`` instead of raising: with an ASCII or
    Latin-1 output, a job's user or name in other characters ended any command in a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if stream is None or getattr(stream, "errors", None) != "strict" or not hasattr(stream, "reconfigure"):
            continue
        try:
            stream.reconfigure(errors="backslashreplace")
        except (ValueError, OSError, AttributeError):  # closed, or a stream that cannot be reconfigured now
            pass
