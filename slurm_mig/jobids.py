"""The order of job ids, as Slurm sorts jobs of equal priority and submit time: by number.

Slurm's queue breaks ties (same priority, same submit time) by job id, then array task id, as numbers: job
99 before job 100. Ids here are text: "123" (a job, or an array task Slurm split off under its own id), "123_4"
(an array's task the controller shows by its array id, controller/queue.py), "123#2" (a replayed job's second
run, sim/workloads.load_outcomes_db), or a synthetic workload's "p9". Compared as text "100" came before "99"
and "5_10" before "5_9". :func:`job_id_key` compares the runs of digits as numbers and the rest as text, so
the simulator's queue (sim/workloads.Workload) and the controller's (Store's queue order) agree with Slurm's.
"""

from __future__ import annotations

import re

_DIGITS = re.compile(r"([0-9]+)")


def job_id_key(job_id: str | int) -> tuple:
    """A sort key for ``job_id``: its runs of ASCII digits as numbers, the text between them as text ("99" <
    "100" < "100_2" < "100_10" < "101"; "p9" < "p10"). The parts alternate text, number, text, ... from the
    start, so two keys compare part by part without mixing types; the id itself ends a tie ("07" vs "7")."""
    text = str(job_id)
    parts = _DIGITS.split(text)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), text
