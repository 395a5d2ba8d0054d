#!/usr/bin/env python3
"""Turn `slurm-mig bench --json` into the Markdown tables of docs/benchmarks.md.

    .venv/bin/slurm-mig bench --json > /tmp/bench.json
    .venv/bin/python benchmarks/report.py /tmp/bench.json
"""

from __future__ import annotations

import json
import sys

BASELINES = ("no-mig", "best-static", "greedy")


NA = "n/a"  # a figure over the jobs that ran, where none did (None in the JSON)


def fmt(v: float | None) -> str:
    if v is None:
        return NA
    if v >= 2 * 86400:
        return f"{v / 86400:.1f} d"
    if v >= 2 * 3600:
        return f"{v / 3600:.1f} h"
    if v >= 120:
        return f"{v / 60:.1f} min"
    return f"{v:.0f} s"


def _ratio(v: float | None, to: float) -> str:
    """``v / to`` to two places; n/a where ``v`` is not available, nan where ``to`` is no positive figure."""
    if v is None:
        return NA
    return f"{v / to if to and to > 0 else float('nan'):.2f}"


def main() -> int:
    doc = json.load(open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin)
    for wl in doc["workloads"]:
        res = wl["results"]
        # nan (its ratios "nan") when the run had no baseline (`bench --policies frag-aware`): min() raised
        # None: a baseline none of whose jobs ran has no mean wait to compare with
        best = min((r["mean_wait_s"] for r in res if r["policy"] in BASELINES and r["mean_wait_s"] is not None),
                   default=float("nan"))
        lb_m, lb_j = wl["lower_bound_makespan_s"], wl.get("lower_bound_mean_jct_s", 0.0)
        print(f"#### {wl['name']} ({wl.get('jobs', '?')} jobs, {wl.get('gpus', '?')} x {wl.get('gpu_model', '')})\n")
        print("| policy | mean wait | ÷ best baseline | p95 wait | mean JCT | ÷ bound | bounded slowdown "
              "| makespan | ÷ bound | slice util. | reconfigs |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in res:
            name = f"**{r['policy']}**" if r["policy"] == "frag-aware" else r["policy"]
            ratio = _ratio(r["mean_wait_s"], best)
            jct = _ratio(r["mean_jct_s"], lb_j)
            bsld = r.get("bounded_slowdown")
            print(f"| {name} | {fmt(r['mean_wait_s'])} | {ratio} | {fmt(r['p95_wait_s'])} | {fmt(r['mean_jct_s'])} "
                  f"| {jct} | {NA if bsld is None else f'{bsld:.2f}'} "
                  f"| {fmt(r['makespan_s'])} | {r['makespan_s'] / lb_m:.3f} | {r['utilization']:.1%} "
                  f"| {r['reconfigurations']} |")
        print(f"| *lower bound* | 0 s | | 0 s | {fmt(lb_j)} | 1.00 | 1.00 | {fmt(lb_m)} | 1.000 | | |")
        notes = wl.get("notes", {})
        if notes.get("best_static_plan"):
            print(f"\nBest static plan: `{notes['best_static_plan']}`.")
        if notes.get("skipped"):
            print(f"Trace rows skipped: {notes['skipped']}.")
        for pol, why in notes.get("stopped", {}).items():
            print(f"\n{pol}: simulation cut short ({why}, the safety limit); its figures are of what had happened "
                  f"by then.")
        jobs = wl.get("jobs")
        for r in res:
            if jobs is not None and r.get("finished", jobs) < jobs:
                # Its times average only the jobs that ran: fewer, so they may look better (as `bench` says).
                print(f"\n{r['policy']}: {jobs - r['finished']} of {jobs} jobs never ran; its times are over "
                      f"the {r['finished']} that did.")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
