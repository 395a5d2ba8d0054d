"""Row converters (a jobs, nodes or reconfig_journal row to its models.py type) and the small value helpers the
Store's methods share (the time now, JSON without infinities, a text's size, a state checked)."""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from slurm_mig.store.models import (
    Job,
    JournalEntry,
    JournalStep,
    Node,
    bound_instances_from_json,
    dumps,
    loads,
)


def _now(now: float | None) -> float:
    return time.time() if now is None else float(now)


def finite(value: Any) -> Any:
    """``value`` (JSON-ready) with every infinite or NaN float as None: JSON cannot hold them, and a policy may
    well say "never" (frag-aware reserves a GPU until ``inf`` behind jobs without a time limit)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _dumps_finite(value: Any) -> str:
    """``dumps(finite(value))``, walking ``value`` only when JSON refuses one of its floats: a decision's
    inputs at 10,000 queued jobs are some 100,000 values, and most hold no infinite or NaN float."""
    try:
        return dumps(value)
    except ValueError:
        return dumps(finite(value))


def _utf8_len(text: str) -> int:
    """The bytes ``text`` takes in the database (UTF-8); ``dumps`` writes ASCII, so mostly ``len``."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _row_job(r: dict) -> Job:
    return Job(
        job_id=r["job_id"], user=r["user"], name=r["name"], partition=r["partition"], profile=r["profile"],
        count=r["count"], time_limit_s=r["time_limit_s"], state=r["state"], reason=r["reason"],
        submit_time=r["submit_time"], start_time=r["start_time"], end_time=r["end_time"], node=r["node"],
        # Most rows hold no instance: "[]" is not decoded (a tick reads every queued job's row, 2-3 times).
        instances=() if r["instances"] in ("[]", None, "") else bound_instances_from_json(loads(r["instances"], [])),
        priority_order=r["priority_order"],
        exit_code=r["exit_code"], updated_at=r["updated_at"],
        # Absent from a version-2 database that the read-only views open without migrating it.
        blocked=r.get("blocked"),
        run=r.get("run") or 1,  # absent before version 4
        uid=r.get("uid"),  # absent before version 8
        suspended_s=r.get("suspended_s"), suspended_since=r.get("suspended_since"),  # absent before version 9
    )


def _row_node(r) -> Node:
    return Node(r["name"], r["state"], r["last_seen"], r["health"], loads(r["health_detail"], {}), r["agent_version"])


def row_journal(r: dict) -> JournalEntry:
    return JournalEntry(
        id=r["id"], node=r["node"], gpu=r["gpu"], from_layout=r["from_layout"], to_layout=r["to_layout"],
        steps=tuple(JournalStep(s["action"], s["profile"], int(s["start"])) for s in loads(r["steps"], [])),
        progress=r["progress"], step_log=tuple(loads(r["step_log"], [])), state=r["state"], outcome=r["outcome"],
        error=r["error"], decision_id=r["decision_id"], created_at=r["created_at"], started_at=r["started_at"],
        updated_at=r["updated_at"], finished_at=r["finished_at"],
    )


def _check_state(state: str, allowed: Sequence[str], what: str) -> str:
    if state not in allowed:
        raise ValueError(f"unknown {what} {state!r} (expected one of: {', '.join(allowed)})")
    return state
