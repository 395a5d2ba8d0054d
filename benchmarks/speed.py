#!/usr/bin/env python3
"""Speed benchmark (issue item 7): prints our figures beside the targets.

    .venv/bin/python benchmarks/speed.py            # both figures
    .venv/bin/python benchmarks/speed.py --json     # one JSON object
    .venv/bin/python benchmarks/speed.py --jobs 20000 --gpus 200   # a quicker look

Same as `slurm-mig bench --speed`, with knobs. Exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import json
import sys

from slurm_mig.sim.speed import DECISION_TARGET_S, SIM_TARGET_S, big_state, decision_speed, simulate_speed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--load", type=float, default=1.0)
    ap.add_argument("--sim-policy", default="greedy")
    ap.add_argument("--decision-policies", default="greedy,frag-aware")
    ap.add_argument("--pending", type=int, default=10_000)
    ap.add_argument("--decision-gpus", type=int, default=8000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    out = []
    sim = simulate_speed(args.jobs, args.gpus, args.sim_policy, args.load)
    out.append(sim)
    if not args.json:
        wait = "n/a" if sim["mean_wait_s"] is None else f"{sim['mean_wait_s']:.0f} s"
        print(f"simulate: {sim['jobs']:,} jobs on {sim['gpus']:,} GPUs, {sim['policy']}, load {sim['load']}: "
              f"{sim['wall_s']:.1f} s (target < {SIM_TARGET_S:.0f} s) {'PASS' if sim['passed'] else 'FAIL'} "
              f"[{sim['decisions']:,} decisions, {sim['jobs_per_s']:,.0f} jobs/s, mean wait {wait}]",
              flush=True)
    state = big_state(args.decision_gpus, args.pending)
    for pol in args.decision_policies.split(","):
        d = decision_speed(pol.strip(), state=state)
        out.append(d)
        if not args.json:
            print(f"decision: {d['pending']:,} pending x {d['gpus']:,} GPUs, {d['policy']}: {d['wall_s']:.3f} s cold "
                  f"(index built inside), {d['warm_s']:.3f} s warm (target < {DECISION_TARGET_S:.0f} s) "
                  f"{'PASS' if d['passed'] else 'FAIL'} [{d['assignments']} jobs placed, {d['changes']} GPUs reshaped]",
                  flush=True)
    if args.json:
        print(json.dumps({"speed": out}))
    return 0 if all(r["passed"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
