"""Metrics of a simulation and lower bounds to print beside them.

* wait = start - submit (start: when the job's last instance exists);
  JCT = end - submit; bounded slowdown = max(1, JCT / max(run time, 10 s)).
  Over the jobs that started only; None (not available: "n/a" in tables) when
  none did, not 0 (a bounded slowdown of 0 is impossible, its floor is 1). p95:
  linear interpolation between the nearest ranks (numpy's default, Hyndman-Fan type 7).
* makespan = last end - first submit.
* utilisation = compute-slice-seconds held by jobs / (cluster compute slices x makespan).
  A no-MIG job holds all 7 slices of its GPU whatever it uses.
* reconfigurations = layout changes applied (one GPU each).

Lower bounds (valid for every policy here, which run a job either on the
profile it asked for or, no-MIG, on whole GPUs):

* makespan >= max of: the area bound with release times, max over t of
  (t - t0) + (work submitted at or after t) / (cluster compute slices), where
  a job's work is min(size x run time, 7 x run time on 7g) in
  compute-slice-seconds; and each job's submit + its shortest run time.
* mean JCT >= mean of each job's shortest run time (zero wait); mean wait >= 0.

A job's run time is at most its time limit: the simulator ends it there, as
Slurm does.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from slurm_mig.mig.profiles import get_model
from slurm_mig.sim.workloads import Job, Workload, base_kind

BSLD_TAU = 10.0


@dataclass
class Metrics:
    policy: str
    jobs: int
    finished: int
    # None: no job finished, so there is nothing to average (not 0)
    mean_wait_s: float | None
    p95_wait_s: float | None
    max_wait_s: float | None
    mean_jct_s: float | None
    bounded_slowdown: float | None
    makespan_s: float
    utilization: float
    reconfigurations: int
    reconfig_steps: int
    decisions: int
    wall_s: float

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Bounds:
    makespan_s: float
    mean_jct_s: float
    mean_wait_s: float = 0.0


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    k = (len(sorted_vals) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def compute_metrics(result) -> Metrics:
    """Metrics of a :class:`~slurm_mig.sim.engine.SimResult` (finished jobs only for times)."""
    done = [r for r in result.jobs if r.end != math.inf]
    waits = sorted(r.start - r.job.submit_time for r in done)
    jcts = [r.end - r.job.submit_time for r in done]
    bsld = [max(1.0, (r.end - r.job.submit_time) / max(r.duration, BSLD_TAU)) for r in done]
    t0 = min((r.job.submit_time for r in result.jobs), default=0.0)
    makespan = max((r.end for r in done), default=t0) - t0
    slices = result.spec.compute_slices
    util = result.busy_slice_s / (slices * makespan) if makespan > 0 else 0.0
    n = len(done)
    # none finished: no wait, JCT or slowdown to average; reported as not available, never as 0
    return Metrics(
        policy=result.policy, jobs=len(result.jobs), finished=len(done),
        mean_wait_s=sum(waits) / n if n else None, p95_wait_s=_pct(waits, 0.95) if n else None,
        max_wait_s=waits[-1] if n else None,
        mean_jct_s=sum(jcts) / n if n else None, bounded_slowdown=sum(bsld) / n if n else None, makespan_s=makespan,
        utilization=util, reconfigurations=result.reconfigurations, reconfig_steps=result.reconfig_steps,
        decisions=result.decisions, wall_s=result.wall_s,
    )


def _shortest(j: Job) -> tuple[float, float]:
    """(shortest run time, least compute-slice-seconds) over the profile asked for and whole GPUs."""
    size = {"1g": 1, "2g": 2, "3g": 3, "4g": 4, "7g": 7}.get(base_kind(j.profile), 7)
    own = j.duration_s
    whole = j.duration_on("7g")
    if j.time_limit_s:  # the simulator ends a job at its limit, as Slurm does
        own = min(own, j.time_limit_s)
        whole = min(whole, j.time_limit_on("7g"))
    return min(own, whole), j.count * min(size * own, 7 * whole)


def lower_bounds(workload: Workload, gpus: int, model: str | None = None, *,
                 compute_slices: int | None = None) -> Bounds:
    """Makespan and mean-JCT lower bounds for ``workload`` on ``gpus`` GPUs of ``model``, or on a cluster of
    ``compute_slices`` compute slices (a mixed one: ClusterSpec.compute_slices)."""
    jobs = workload.jobs
    if not jobs:
        return Bounds(0.0, 0.0)
    slices = compute_slices or gpus * get_model(model or workload.model).compute_slices
    t0 = min(j.submit_time for j in jobs)
    per = [(j.submit_time, *_shortest(j)) for j in jobs]
    per.sort()
    # Area bound with release times: everything submitted at or after t needs that much time after t.
    best = 0.0
    suffix = 0.0
    for t, _dur, work in reversed(per):
        suffix += work
        best = max(best, (t - t0) + suffix / slices)
    best = max(best, max(t - t0 + d for t, d, _ in per))
    mean_jct = sum(d for _, d, _ in per) / len(per)
    return Bounds(best, mean_jct)
