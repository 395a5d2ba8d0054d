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
