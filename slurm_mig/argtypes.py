"""argparse types the command-line tools share."""

from __future__ import annotations

import argparse
import math


#: The largest count a flag takes: SQLite's (and numpy's) 64-bit integer. `decisions --limit` past it was
#: sqlite3's OverflowError traceback.
MAX_COUNT = 2**63 - 1


def ascii_digits(text: str) -> bool:
    """Is ``text`` one or more ASCII digits 0-9 and nothing else (no sign, no space)? The test before int() on a
    count or a number read from a user: str.isdigit() also takes "²", which int() refuses (a ValueError
    traceback)."""
    return text.isascii() and text.isdigit()


def at_least(least: int):
    """An argparse type: a whole number of at least ``least`` (0 GPUs is no cluster, 5 columns no frame), at most
    MAX_COUNT."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{n} is too small (at least {least})")
        if n > MAX_COUNT:
            raise argparse.ArgumentTypeError(f"{text!r} is too large (at most {MAX_COUNT})")
        return n
    return parse


def number(least: float, most: float, *, more_than: bool = False, unit: str = ""):
    """An argparse type: a finite number from ``least`` (excluded with ``more_than``) to ``most``.

    ``float`` alone takes nan, inf and negatives, which later failed far from the flag (``time.sleep(-1)``
    after a first round, a wait that never ends) or spun (an interval of 0)."""
    what = f" {unit}" if unit else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number{' of ' + unit if unit else ''}: {text!r}") from None
        low_ok = value > least if more_than else value >= least
        if not math.isfinite(value) or not low_ok or value > most:
            low = f"more than {least:g}" if more_than else f"{least:g}"
            raise argparse.ArgumentTypeError(f"{text!r}: give {low} to {most:g}{what}")
        return value
    return parse


def seconds(least: float = 0.0, *, more_than: bool = False):
    """An argparse type: a finite number of seconds from ``least`` up to a day (config.MAX_TIMEOUT_S, the bound
    of the config's timeouts)."""
    from slurm_mig.config import MAX_TIMEOUT_S

    return number(least, MAX_TIMEOUT_S, more_than=more_than, unit="seconds")


def sim_delay_scale():
    """An argparse type (and the $SLURM_MIG_SIM_DELAY_SCALE parser): the simulated backend's delay factor, a finite
    number from 0 to config.MAX_SIM_DELAY_SCALE, the bound of [node].sim_delay_scale."""
    from slurm_mig.config import MAX_SIM_DELAY_SCALE

    return number(0.0, MAX_SIM_DELAY_SCALE, unit="times the measured create/destroy seconds")
