"""argparse types the command-line tools share."""

from __future__ import annotations

import argparse


def at_least(least: int):
    """An argparse type: a whole number of at least ``least`` (0 GPUs is no cluster, 5 columns no frame)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{n} is too small (at least {least})")
        return n
    return parse
