"""Speed benchmarks (issue item 7), each printing our figure beside its target.

1. ``simulate_speed``: 100,000 jobs on 1,000 GPUs (125 nodes x 8 H100) with the
   greedy policy, Poisson arrivals at offered load 1.0 (jobs queue at times),
   one core. Target: under 60 s.
2. ``decision_speed``: one controller decision over 10,000 pending jobs and
   8,000 GPUs (1,000 nodes x 8) whose slices are mostly busy, from a cold
   policy object (its index is built inside the timed call). Target: under 1 s.
"""

from __future__ import annotations

import random
import time

from slurm_mig.mig.layout import Layout, Slot, enumerate_maximal_layouts
from slurm_mig.mig.profiles import get_model
from slurm_mig.policies import get_policy
from slurm_mig.policies.base import ClusterState, GpuState, PendingJob, check_decision
from slurm_mig.sim.engine import ClusterSpec, simulate
from slurm_mig.sim.metrics import compute_metrics
from slurm_mig.sim.workloads import poisson_workload

SIM_TARGET_S = 60.0
DECISION_TARGET_S = 1.0


def simulate_speed(n_jobs: int = 100_000, gpus: int = 1000, policy: str = "greedy", load: float = 1.0,
                   seed: int = 7) -> dict:
    """Time one simulation of ``n_jobs`` Poisson jobs on ``gpus`` GPUs."""
    w = poisson_workload(n_jobs, gpus=gpus, load=load, seed=seed, mean_duration_s=3600.0)
    spec = ClusterSpec(gpus // 8, 8, w.model)
    t0 = time.perf_counter()
    r = simulate(w, get_policy(policy), spec)
    wall = time.perf_counter() - t0
    m = compute_metrics(r)
    return {"benchmark": "simulate", "policy": policy, "jobs": n_jobs, "gpus": gpus, "load": load,
            "wall_s": wall, "target_s": SIM_TARGET_S, "decisions": r.decisions,
            "jobs_per_s": n_jobs / wall if wall else 0.0, "mean_wait_s": m.mean_wait_s,
            "utilization": m.utilization, "unfinished": r.unfinished, "passed": wall < SIM_TARGET_S}


def big_state(gpus: int = 8000, pending: int = 10_000, busy_share: float = 0.85, seed: int = 11,
              model: str = "H100-80GB", now: float = 1_000_000.0) -> ClusterState:
    """A large, realistic-looking state: random maximal layouts, most instances busy."""
    rng = random.Random(seed)
    m = get_model(model)
    layouts = enumerate_maximal_layouts(m)
    states = []
    for i in range(gpus):
        lay: Layout = rng.choice(layouts)
        busy = frozenset(s for s in sorted(lay.slots) if rng.random() < busy_share)
        until = tuple(sorted((s, now + rng.uniform(60, 86400)) for s in sorted(busy)))
        states.append(GpuState(f"n{i // 8:04d}", i % 8, m, lay, busy, frozenset(), until))
    kinds = ["1g", "2g", "3g", "4g", "7g"]
    weights = [0.3, 0.25, 0.2, 0.1, 0.15]
    jobs = []
    for j in range(pending):
        k = rng.choices(kinds, weights)[0]
        count = rng.choice([2, 4, 8]) if k == "7g" and rng.random() < 0.05 else 1
        jobs.append(PendingJob(f"j{j}", k, count, now - pending + j, rng.uniform(600, 86400)))
    return ClusterState(now, tuple(states), tuple(jobs))


def decision_speed(policy: str = "greedy", gpus: int = 8000, pending: int = 10_000, check: bool = True,
                   state: ClusterState | None = None) -> dict:
    """Time one decide() of a fresh policy on :func:`big_state`; also a warm second call."""
    state = state or big_state(gpus, pending)
    pol = get_policy(policy)
    t0 = time.perf_counter()
    d = pol.decide(state)
    cold = time.perf_counter() - t0
    # Warm: the same policy object, a state where one GPU changed (what a controller tick looks like).
    g = state.gpus[0]
    changed = GpuState(g.node, g.index, g.model, g.layout, frozenset(), frozenset(), ())
    state2 = ClusterState(state.now + 1, (changed,) + state.gpus[1:], state.pending)
    t0 = time.perf_counter()
    pol.decide(state2)
    warm = time.perf_counter() - t0
    if check:
        check_decision(state, d)
    return {"benchmark": "decision", "policy": policy, "gpus": len(state.gpus), "pending": len(state.pending),
            "wall_s": cold, "warm_s": warm, "target_s": DECISION_TARGET_S, "assignments": len(d.assignments),
            "changes": len(d.changes), "passed": cold < DECISION_TARGET_S}


__all__ = ["simulate_speed", "decision_speed", "big_state", "SIM_TARGET_S", "DECISION_TARGET_S", "Slot"]
