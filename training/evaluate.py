"""Held-out evaluation: the RL policy against every heuristic, means with 95 % CIs over seeds.

    python -m training.evaluate --model policy/default.onnx --json runs/eval.json --markdown

For each test family (training/splits.py) and seed, every policy plays the same
workload; the metrics count the case's scored jobs (for alibaba-late: the last
30 % of the trace's jobs, the run starting at the trace's beginning). Reported
per family: mean over seeds with a 95 % t-interval, and the paired difference
RL - best heuristic (the heuristic with the lowest mean over seeds) with its
interval: below zero means RL waits less.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from slurm_mig.policies import get_policy
from slurm_mig.sim.engine import SimConfig, simulate
from slurm_mig.sim.metrics import _pct

from training.splits import TEST_FAMILIES, TEST_SEEDS, Case, heldout_cases

HEURISTICS = ("no-mig", "best-static", "first-fit", "greedy", "frag-aware")
# Two-sided 95 % Student t quantiles by degrees of freedom.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t95(n: int) -> float:
    """The two-sided 95 % Student t quantile for ``n`` values (n - 1 degrees of freedom)."""
    df = n - 1
    if df in _T95:
        return _T95[df]
    # Beyond the table, the Cornish-Fisher expansion around the normal quantile: within 0.002 of
    # the exact quantile from 11 degrees of freedom on (1.96 alone understates 20 seeds' interval by 7 %).
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % t-interval)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan
    return m, t95(len(values)) * statistics.stdev(values) / math.sqrt(len(values))


def run_case(case: Case, policy, *, check: bool = False) -> dict:
    """Simulate ``case`` under ``policy``; metrics over the case's scored jobs."""
    t0 = time.perf_counter()
    if policy == "best-static":
        from slurm_mig.sim.bench import search_static

        _pol, r, _m = search_static(case.workload, case.spec)
    else:
        pol = get_policy(policy) if isinstance(policy, str) else policy
        r = simulate(case.workload, pol, case.spec, SimConfig(check=check))
    ids = case.scored_ids()
    recs = [x for x in r.jobs if ids is None or x.job.job_id in ids]
    done = [x for x in recs if x.end != math.inf]
    waits = sorted(x.start - x.job.submit_time for x in done)
    # No scored job ran: no times to give (NaN, as `slurm-mig bench` gives none), not 0 s, which read as the
    # best possible wait and would have made a policy that starts nothing look best.
    n = len(done) or math.nan
    return {
        "mean_wait_s": sum(waits) / n,
        "mean_jct_s": sum(x.end - x.job.submit_time for x in done) / n,
        "p95_wait_s": _pct(waits, 0.95) if waits else math.nan,  # interpolated, as `slurm-mig bench`'s
        "max_wait_s": waits[-1] if waits else math.nan,
        "jobs": len(recs), "unfinished": len(recs) - len(done),
        "reconfigurations": r.reconfigurations, "wall_s": time.perf_counter() - t0,
    }


def wait_ratio(cases: list[Case], reference: dict[str, float], new_policy) -> float:
    """Mean over ``cases`` of (``new_policy()``'s mean wait + 60 s) / (the reference's + 60 s), the reference
    keyed by case name and seed: the validation score of training/train.py and training/modes.py."""
    ratios = []
    for c in cases:
        m = run_case(c, new_policy())
        wait = m["mean_wait_s"] if math.isfinite(m["mean_wait_s"]) else math.inf  # none ran: the worst score
        ratios.append((wait + 60.0) / (reference[c.name + str(c.seed)] + 60.0))
    return float(np.mean(ratios))


def evaluate(cases: list[Case], policies: dict[str, object], log=None) -> list[dict]:
    rows = []
    for c in cases:
        for label, pol in policies.items():
            m = run_case(c, pol() if callable(pol) and not isinstance(pol, str) else pol)
            rows.append({"family": c.name, "seed": c.seed, "policy": label, **m})
            if log:
                log(f"{c.name} seed {c.seed} {label}: wait {m['mean_wait_s']:.0f} s jct {m['mean_jct_s']:.0f} s "
                    f"({m['wall_s']:.1f} s)")
    return rows


def summarize(rows: list[dict], rl: str = "rl", heuristics=HEURISTICS) -> dict:
    """Per family: each policy's mean +- CI, the best heuristic, and RL - best heuristic (paired)."""
    out = {}
    fams = list(dict.fromkeys(r["family"] for r in rows))
    for fam in fams:
        fr = [r for r in rows if r["family"] == fam]
        by: dict[str, dict[int, dict]] = {}
        for r in fr:
            by.setdefault(r["policy"], {})[r["seed"]] = r
        fam_out: dict = {"policies": {}}
        for pol, seeds in by.items():
            # jobs left unrun over the seeds: the means are over the jobs that ran, so fewer may look better
            fam_out["policies"][pol] = {"unfinished": sum(s.get("unfinished", 0) for s in seeds.values())}
            for metric in ("mean_wait_s", "mean_jct_s", "max_wait_s"):
                m, h = ci([s[metric] for s in seeds.values()])
                fam_out["policies"][pol][metric] = [m, h]
        heur = [h for h in heuristics if h in by]
        if rl in by and heur:
            for metric in ("mean_wait_s", "mean_jct_s"):
                best = min(heur, key=lambda h: fam_out["policies"][h][metric][0])
                seeds = sorted(set(by[rl]) & set(by[best]))
                diffs = [by[rl][s][metric] - by[best][s][metric] for s in seeds]
                d, h = ci(diffs)
                fa = [by[rl][s][metric] - by["frag-aware"][s][metric] for s in seeds] if "frag-aware" in by else []
                dfa, hfa = ci(fa) if fa else (math.nan, math.nan)
                fam_out[metric] = {"best_heuristic": best, "rl_minus_best": [d, h],
                                   "rl_over_best": fam_out["policies"][rl][metric][0] /
                                   max(fam_out["policies"][best][metric][0], 1e-9),
                                   "rl_minus_frag_aware": [dfa, hfa], "seeds": len(seeds)}
        out[fam] = fam_out
    return out


def card_metrics(summary: dict, seeds, heuristics) -> dict:
    """The model card's "metrics": per held-out family, RL against frag-aware and the best heuristic."""
    held = {}
    for fam, s in summary.items():
        pol = s["policies"]
        if "rl" not in pol:
            continue
        e = {"rl_mean_wait_s": pol["rl"]["mean_wait_s"], "rl_mean_jct_s": pol["rl"]["mean_jct_s"]}
        if "frag-aware" in pol:
            e["frag_aware_mean_wait_s"] = pol["frag-aware"]["mean_wait_s"]
            e["frag_aware_mean_jct_s"] = pol["frag-aware"]["mean_jct_s"]
        for metric, short in (("mean_wait_s", "wait"), ("mean_jct_s", "jct")):
            c = s.get(metric)
            if c:
                e[f"best_{short}_heuristic"] = c["best_heuristic"]
                e[f"best_{short}_s"] = pol[c["best_heuristic"]][metric]
                e[f"rl_over_best_{short}"] = c["rl_over_best"]
                e[f"rl_minus_best_{short}_s"] = c["rl_minus_best"]
                e[f"rl_minus_frag_aware_{short}_s"] = c["rl_minus_frag_aware"]
        held[fam] = e
    return {"heldout": held, "seeds": list(seeds), "heuristics": list(heuristics),
            "ci": "mean over seeds +- 95 % t-interval half-width; differences are paired by seed",
            "evaluated": time.time()}


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "-"
    if abs(v) >= 36000:
        return f"{v / 3600:.1f} h"
    return f"{v:.0f} s"


def markdown(summary: dict, policies: list[str]) -> str:
    lines = []
    for metric, title in (("mean_wait_s", "Mean wait"), ("mean_jct_s", "Mean JCT")):
        lines.append(f"**{title}** (mean over seeds ± 95 % CI)\n")
        lines.append("| family | " + " | ".join(policies) + " | best heuristic | RL − best (paired) |")
        lines.append("|---|" + "---|" * (len(policies) + 2))
        for fam, s in summary.items():
            cells = []
            for p in policies:
                v = s["policies"].get(p, {}).get(metric)
                cells.append(f"{_fmt(v[0])} ± {_fmt(v[1])}" if v else "-")
            cmp_ = s.get(metric)
            best = cmp_["best_heuristic"] if cmp_ else "-"
            diff = f"{_fmt(cmp_['rl_minus_best'][0])} ± {_fmt(cmp_['rl_minus_best'][1])}" if cmp_ else "-"
            lines.append(f"| {fam} | " + " | ".join(cells) + f" | {best} | {diff} |")
        lines.append("")
        for fam, s in summary.items():
            for p in policies:
                n = s["policies"].get(p, {}).get("unfinished", 0)
                if n:
                    lines.append(f"{fam}: {p} left {n} job(s) unrun over the seeds; its times are over the jobs that ran\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="RL policy vs heuristics on the held-out workloads")
    ap.add_argument("--model", default=None, help="ONNX model (default: what the rl policy resolves)")
    ap.add_argument("--families", default=",".join(TEST_FAMILIES))
    ap.add_argument("--seeds", default=",".join(map(str, TEST_SEEDS)))
    ap.add_argument("--heuristics", default=",".join(HEURISTICS))
    ap.add_argument("--trace", default=None, help="Alibaba trace (default ../shared/traces/alibaba-v2023-train.csv)")
    ap.add_argument("--json", default=None, help="write rows and summary here")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    ap.add_argument("--card", default=None, help="write the summary into this model card's metrics")
    args = ap.parse_args(argv)
    import torch  # noqa: F401  (not needed; keeps thread settings consistent when present)

    torch.set_num_threads(1)
    from slurm_mig.policies.rl import RLPolicy

    cases = heldout_cases(tuple(int(s) for s in args.seeds.split(",")), tuple(args.families.split(",")),
                       Path(args.trace) if args.trace else None)
    heur = [h for h in args.heuristics.split(",") if h]
    policies: dict[str, object] = {"rl": lambda: RLPolicy(model_path=args.model).load()}
    policies.update({h: h for h in heur})
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows = evaluate(cases, policies, log)
    summary = summarize(rows, heuristics=tuple(heur))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    if args.card:
        card_path = Path(args.card)
        card = json.loads(card_path.read_text())
        card["metrics"] = card_metrics(summary, tuple(int(x) for x in args.seeds.split(",")), heur)
        card_path.write_text(json.dumps(card, indent=2) + "\n")
    if args.markdown:
        print(markdown(summary, ["rl", *heur]))
    else:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
