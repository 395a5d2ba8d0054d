"""Formatting of the operator views' values, shared by the text renderers and ``--json``: exit statuses,
durations, clock times and figures, each shown as "?" and its value when a stored one is not a real one (text,
a blob, 1e300, infinity) instead of raising.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from slurm_mig.slurm.parsers import format_exit_status
from slurm_mig.store.db import finite


def fmt_exit(status: int | None) -> str:
    """A job's wait status as Slurm prints it ("exit:signal"; the controller's end events say the same)."""
    return format_exit_status(status)


# A duration longer than this (about 270 years) or a time no clock can show is not a real one: a row a
# person or a bug wrote (1e300, infinity, a huge integer). The views show it as "?" and its value
# instead of raising, so one such row cannot take `explain`, `jobs` or the dashboard down.
_MAX_DURATION_S = 10 ** 5 * 86400


def fmt_odd(value: Any) -> str:
    """A stored time or duration that cannot be shown as one: "?" and a short form of the value."""
    try:
        text = f"{float(value):.4g}"
    except (TypeError, ValueError, OverflowError):
        text = str(value)
    return "?" + text[:12]


def fmt_num(value: Any, digits: int = 1) -> str:
    """A stored figure (a decision's latency_ms, a reconfiguration's seconds) with ``digits`` decimals: "12.3";
    "?" and the value for one that is not a number (text, a blob: fmt_odd)."""
    return f"{value:.{digits}f}" if is_number(value) else fmt_odd(value)


def is_number(value: Any) -> bool:
    """Is a stored time a number at all? SQLite keeps whatever a time column was given: text (a date a person
    typed, '2026-11-27') or a blob (a broken page) comes back as str or bytes, on which arithmetic raises."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def elapsed(end: Any, start: Any) -> Any:
    """``max(0, end - start)`` for two stored times; None when either is None; when either is not a number
    (text, a blob) that value, which fmt_duration shows as "?" and the value (fmt_odd) as it shows 1e300."""
    if end is None or start is None:
        return None
    for value in (end, start):
        if not is_number(value):
            return value
    return max(0.0, end - start)


def known(value: Any, default: Any) -> Any:
    """A stored time for arithmetic: ``value``, or ``default`` when it is None or not a number (text, a
    blob), as for a time not recorded."""
    return value if is_number(value) else default


def _order(value: Any) -> float:
    """A stored time or duration as a sort key: one that is not a number (text, a blob) sorts as the largest
    (so an "oldest wait" shows it rather than hides it), not against numbers (which raises)."""
    return value if is_number(value) and value == value else float("inf")


def _seconds(value: Any) -> float | None:
    """``value`` as finite seconds, None when it is not a finite number."""
    if isinstance(value, bool):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) else None


def fmt_duration(seconds: float | None) -> str:
    """12s, 3m05s, 1h02m, 2d03h; "-" for None; "?" and the value for one that is not a duration."""
    if seconds is None:
        return "-"
    f = _seconds(seconds)
    if f is None or f > _MAX_DURATION_S:
        return fmt_odd(seconds)
    s = int(round(max(0.0, f)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def _localtime(t: Any) -> time.struct_time | None:
    f = _seconds(t)
    if f is None:
        return None
    try:
        return time.localtime(f)
    except (OverflowError, OSError, ValueError):  # beyond the platform's time_t or the C library's years
        return None


def fmt_clock(t: float | None) -> str:
    """HH:MM:SS in local time ("-" for None; "?" and the value for one that is not a time)."""
    if t is None:
        return "-"
    lt = _localtime(t)
    return fmt_odd(t) if lt is None else time.strftime("%H:%M:%S", lt)


def fmt_when(t: float | None, now: float) -> str:
    """A clock time, with the date when it is not today, and the year when it is not this year's (a copy of last
    year's database, a clock set ahead)."""
    if t is None:
        return "-"
    lt = _localtime(t)
    if lt is None:
        return fmt_odd(t)
    today = _localtime(now)
    if today is None or lt.tm_year != today.tm_year:
        return time.strftime("%Y-%m-%d %H:%M:%S", lt)
    if time.strftime("%Y-%m-%d", lt) != time.strftime("%Y-%m-%d", today):
        return time.strftime("%m-%d %H:%M:%S", lt)
    return time.strftime("%H:%M:%S", lt)


def to_json(value: Any) -> str:
    """``value`` as standard JSON for the ``--json`` outputs: a time or figure that is not a finite number (an
    infinite time stored by hand or by a bad clock) is null, since Python's ``Infinity``/``NaN`` are not JSON
    and strict parsers (jq, JavaScript) refuse the whole document."""
    return json.dumps(finite(value), indent=2, sort_keys=False, default=str, allow_nan=False)
