#!/usr/bin/env python3
"""The mixed-site workload (slurm-mig bench --workload mixed-site) over many seeds, with intervals.

    .venv/bin/python benchmarks/mixed_site.py --seeds 1-20 --out new.jsonl          # run, one JSON line per run
    .venv/bin/python benchmarks/mixed_site.py --report new.jsonl [old.jsonl ...]    # the table

Each run is one seed's workload (slurm_mig.sim.bench.mixed_site: 2 nodes x 8 H100-80GB, partition h100,
beside 2 nodes x 8 A30-24GB, partition a30; 2,000 jobs) under one policy. --label names the code that ran
(e.g. the commit), so runs of two checkouts can be put side by side: run this file with PYTHONPATH at each
checkout, then --report both files. The report gives each (label, policy) mean wait, p95 wait and mean JCT as
the mean over seeds +- the 95 % interval of that mean (Student t), and, for a policy run under two labels on
the same seeds, the paired difference of its mean wait, seed by seed (the same workload under both codes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict

FIELDS = ("mean_wait_s", "p95_wait_s", "mean_jct_s", "bounded_slowdown", "utilization", "reconfigurations")
# two-sided 95 % Student t quantiles by degrees of freedom (beyond 30: 2.0)
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20,
       12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11, 18: 2.10, 19: 2.09, 20: 2.09, 25: 2.06,
       30: 2.04}


def t95(df: int) -> float:
    if df in T95:
        return T95[df]
    return next((T95[k] for k in sorted(T95) if k >= df), 2.0)


def seeds_of(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def run(seeds: list[int], policies: list[str], label: str, out) -> None:
    from slurm_mig.sim.bench import mixed_site, run_workload

    for seed in seeds:
        w, spec = mixed_site(seed)
        rep = run_workload(w, spec, policies)
        for m in rep.results:
            row = {"label": label, "policy": m.policy, "seed": seed, "jobs": m.jobs, "finished": m.finished,
                   **{k: getattr(m, k) for k in FIELDS}, "wall_s": m.wall_s}
            out.write(json.dumps(row) + "\n")
            out.flush()
            wait = "n/a" if m.mean_wait_s is None else f"{m.mean_wait_s:.0f} s"
            print(f"seed {seed} {label} {m.policy}: mean wait {wait}", file=sys.stderr, flush=True)


def interval(vals: list[float | None]) -> str:
    """Mean ± 95 % interval of the seeds' figures; a seed where no job ran has none (None) and is left out."""
    vals = [v for v in vals if v is not None]
    if not vals:
        return "n/a"
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return f"{mean:.0f}"
    half = t95(len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))
    return f"{mean:.0f} ± {half:.0f}"


def _mean2(vals: list[float | None]) -> str:
    vals = [v for v in vals if v is not None]
    return f"{statistics.fmean(vals):.2f}" if vals else "n/a"


def report(paths: list[str]) -> None:
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    by: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for r in rows:
        by[(r["label"], r["policy"])][r["seed"]] = r
    seeds = sorted({r["seed"] for r in rows})
    print(f"{len(seeds)} seeds ({seeds[0]}-{seeds[-1]}); mean over seeds ± 95 % interval of the mean\n")
    print("| policy (code) | mean wait s | p95 wait s | mean JCT s | bsld | unfinished |")
    print("|---|---:|---:|---:|---:|---:|")
    for (label, pol), per in sorted(by.items(), key=lambda kv: statistics.fmean(
            [r["mean_wait_s"] for r in kv[1].values() if r["mean_wait_s"] is not None] or [math.inf])):
        rs = list(per.values())
        unfinished = sum(r["jobs"] - r["finished"] for r in rs)
        print(f"| {pol} ({label}) | {interval([r['mean_wait_s'] for r in rs])} | "
              f"{interval([r['p95_wait_s'] for r in rs])} | {interval([r['mean_jct_s'] for r in rs])} | "
              f"{_mean2([r['bounded_slowdown'] for r in rs])} | {unfinished} |")
    labels = sorted({lab for lab, _ in by})
    policies = sorted({pol for _, pol in by})
    for pol in policies:
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                pa, pb = by.get((a, pol)), by.get((b, pol))
                if not pa or not pb:
                    continue
                # seeds where both ran some job: the others have no mean wait or JCT to compare
                common = sorted(s for s in set(pa) & set(pb)
                                if pa[s]["mean_wait_s"] is not None and pb[s]["mean_wait_s"] is not None)
                d = [pa[s]["mean_wait_s"] - pb[s]["mean_wait_s"] for s in common]
                dj = [pa[s]["mean_jct_s"] - pb[s]["mean_jct_s"] for s in common]
                better = sum(x < 0 for x in d)
                same = sum(x == 0 for x in d)
                print(f"\n{pol}: {a} - {b}, paired over {len(common)} seeds: mean wait {interval(d)} s "
                      f"(lower under {a} on {better}, equal on {same}, higher on {len(d) - better - same}); "
                      f"mean JCT {interval(dj)} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1-10", help="seeds, e.g. 1-20 or 1,3,5 (default 1-10)")
    ap.add_argument("--policies", default="best-static,first-fit,greedy,frag-aware,rl")
    ap.add_argument("--label", default="here", help="names the code these runs are of (default 'here')")
    ap.add_argument("--out", default="-", help="JSON lines to this file (default stdout)")
    ap.add_argument("--report", nargs="+", metavar="JSONL", help="print the table of these runs instead")
    args = ap.parse_args()
    if args.report:
        report(args.report)
        return 0
    out = sys.stdout if args.out == "-" else open(args.out, "a")
    run(seeds_of(args.seeds), [p.strip() for p in args.policies.split(",")], args.label, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
