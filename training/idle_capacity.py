"""Where the capacity goes while jobs wait: how much a better placement could still win.

    .venv/bin/python -m training.idle_capacity [--families poisson-mix,miso-models] [--seeds 300,301]

Plays each workload under each policy in the simulator and, after every decision, looks at every
GPU: its compute slices that are neither running a job nor being reconfigured are *idle*. Over
the time during which some job is waiting, it sums

* idle: idle compute-slice-seconds, as a share of all compute-slice-seconds of the run;
* a waiting job fits: the part of that on GPUs where the free memory slices hold a legal
  placement of some waiting job's profile (with enough compute slices), which a policy could
  have used at once;
* of which reserved: the part of the latter on GPUs that hold a reservation (backfill may not
  use them).

Idle capacity where no waiting job fits is fragmentation against the queue: the free slices
are too few, or in the wrong places, for what waits (typically a GPU draining for a 7g job). Only
a placement that makes GPUs drain together, which needs to know when jobs end, wins it back.

Dev seeds only by default (300-301): never the test seeds 101-105 (training/splits.py).
"""

from __future__ import annotations

import argparse
import statistics

from slurm_mig.policies import get_policy
from slurm_mig.sim.engine import Simulator

from training.splits import _bench_like


def idle_while_waiting(family: str, seed: int, policy: str) -> dict:
    """Shares of the run's compute-slice-seconds idle while jobs wait; and the mean wait (s)."""
    w, spec = _bench_like(family, seed)
    sim = Simulator(w, get_policy(policy), spec)
    total = idle = fits = reserved = waiting_s = 0.0
    state = sim.reset()
    while state is not None:
        decision = sim.policy.decide(state)
        held = {k for r in decision.extra.get("reservations", []) for k in r[2]}
        seen: dict = {}

        def measure(sim: Simulator) -> None:
            """After the decision is applied, before time moves: idle slices, and those a waiting job fits."""
            profiles = {sim.records[p.job_id].run_profile for p in sim.pending}
            free = fit = fit_held = 0
            for g in sim.gpus:
                m = g.model
                used_mask = used_c = 0
                for s in (*g.busy, *g.reconf):
                    p = m.profile(s.profile)
                    used_mask |= p.mask(s.start)
                    used_c += p.compute_slices
                c = m.compute_slices - used_c
                free += c
                if c and any(p.compute_slices <= c and any(not p.mask(st) & used_mask for st in p.starts)
                             for p in (m.profile(k) for k in profiles)):
                    fit += c
                    fit_held += c if g.key in held else 0
            seen.update(t=sim.now, profiles=profiles, free=free, fit=fit, fit_held=fit_held)

        state = sim.step(decision, after_apply=measure)
        t, profiles, free, fit, fit_held = (seen[k] for k in ("t", "profiles", "free", "fit", "fit_held"))
        dt = sim.now - t
        total += sum(g.model.compute_slices for g in sim.gpus) * dt
        if profiles:
            idle, fits, reserved, waiting_s = idle + free * dt, fits + fit * dt, reserved + fit_held * dt, waiting_s + dt
    res = sim.result(0.0)
    waits = [r.start - r.job.submit_time for r in res.jobs if r.start != float("inf")]
    return {"family": family, "seed": seed, "policy": policy, "mean_wait_s": statistics.fmean(waits),
            "waiting_h": waiting_s / 3600, "idle": idle / total, "fits": fits / total, "reserved": reserved / total}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="poisson-mix,miso-models,rl-mix_extreme")
    ap.add_argument("--seeds", default="300,301")
    ap.add_argument("--policies", default="frag-aware,greedy,first-fit")
    a = ap.parse_args(argv)
    print("| workload | seed | policy | mean wait | some job waits | idle while waiting | a waiting job fits | of which reserved |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for fam in a.families.split(","):
        for seed in (int(s) for s in a.seeds.split(",")):
            for pol in a.policies.split(","):
                r = idle_while_waiting(fam, seed, pol)
                print(f"| {fam} | {seed} | {pol} | {r['mean_wait_s']:.0f} s | {r['waiting_h']:.1f} h | "
                      f"{r['idle']:.1%} | {r['fits']:.2%} | {r['reserved']:.2%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
