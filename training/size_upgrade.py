"""Giving a job a bigger instance than it asked for: a lever no policy here has, measured.

    .venv/bin/python -m training.size_upgrade [--families poisson-mix,miso-models] [--seeds 300-319]
        [--rules largest,scaling] [--json runs.json]

Every policy gives a job exactly the size it asked for (`--gres=mig:1g` gets a 1g). In the
simulator a job runs for its run time *on the instance it gets* (the workload's speed model:
MISO's measured per-size speeds, or the RL-MIG families' own curves), so a job given a bigger
instance finishes sooner, and holds more slices while it runs. Whether that pays is what this
measures, before anything is built for it (docs/rl-policy.md, "Giving a job a bigger instance
than it asked for").

Each rule wraps frag-aware's decision. An assignment of a one-instance job onto an instance the
decision creates is moved to a bigger profile on the same GPU, at a start whose memory slices no
other instance of the GPU's target layout uses (so slices frag-aware leaves idle; a free
instance that already exists is not re-carved). Rules:

* ``idle``: the largest that fits, only in a decision that leaves no job waiting;
* ``next``: the next bigger size that fits;
* ``largest``: the largest that fits;
* ``1g-to-2g``: only a 1g job, only to a 2g;
* ``efficient``: an oracle, the largest that fits among the sizes on which the job, by its own
  speed curve (which no policy sees: it sees the size asked and the time limit), needs fewer
  compute-slice-seconds than on the size it asked for;
* ``scaling``: an oracle too, the largest that fits among the sizes on which the job runs at least
  sqrt(slices given / slices asked) times faster (a job that scales at all, not only one that
  scales better than linearly).

Prints, per family and rule, mean wait, mean JCT and p95 wait as a ratio to frag-aware's (mean
and 95 % interval over the seeds, paired; how many seeds are better by more than 0.5 %), and the
upgrades per run. Dev seeds only (300 and up): never the test seeds 101-105 (training/splits.py).
No torch.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace

from slurm_mig.mig.layout import Slot
from slurm_mig.policies import get_policy
from slurm_mig.policies.base import ClusterState, Decision
from slurm_mig.sim.engine import Simulator
from slurm_mig.sim.metrics import compute_metrics
from slurm_mig.sim.workloads import Job, base_kind

from training.splits import _bench_like

RULES = ("idle", "next", "largest", "1g-to-2g", "efficient", "scaling")
FAMILIES = "poisson-mix,small-heavy,rl-mix_extreme,rl-wide_times,miso-models"


class SizeUpgrade:
    """frag-aware, with one-instance jobs moved to a bigger instance by ``rule`` (module docstring).

    ``jobs``: the workload's jobs by id, read by the ``efficient`` oracle only (their speed curves)."""

    def __init__(self, rule: str, jobs: dict[str, Job] | None = None) -> None:
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r} (known: {', '.join(RULES)})")
        self.inner = get_policy("frag-aware")
        self.rule, self.jobs = rule, jobs or {}
        self.name, self.version = f"frag-aware+{rule}", self.inner.version
        self.upgrades = 0

    def _bigger(self, job_id: str, asked, options):
        """The profile ``rule`` picks among ``options`` (bigger profiles that fit), or None."""
        if self.rule == "1g-to-2g":
            return next((p for p in options if asked.kind == "1g" and p.kind == "2g"), None)
        if self.rule == "next":
            return min(options, key=lambda p: p.compute_slices, default=None)
        if self.rule == "efficient":
            job = self.jobs[job_id]
            # Compute-slice-seconds on the size asked, and on each option, by the job's own curve.
            cost = asked.compute_slices * job.duration_on(base_kind(asked.kind))
            # (1 - 1e-9): a job that scales exactly linearly saves nothing, whatever floating point rounds to.
            options = [p for p in options if p.compute_slices * job.duration_on(p.kind) < cost * (1 - 1e-9)]
        if self.rule == "scaling":
            job = self.jobs[job_id]
            t = job.duration_on(base_kind(asked.kind))
            options = [p for p in options
                       if t / job.duration_on(p.kind) >= math.sqrt(p.compute_slices / asked.compute_slices)]
        return max(options, key=lambda p: p.compute_slices, default=None)

    def decide(self, state: ClusterState) -> Decision:
        d = self.inner.decide(state)
        if self.rule == "idle" and d.waiting:
            return d
        gpus = {(g.node, g.index): g for g in state.gpus}
        changes = {(c.node, c.gpu): c for c in d.changes}
        assignments = []
        for a in d.assignments:
            key = (a.node, a.instances[0][0]) if len(a.instances) == 1 else None
            change = changes.get(key)
            slot = a.instances[0][1]
            if change is None or slot in gpus[key].layout.slots:
                assignments.append(a)  # several instances, or a free instance that exists: left as decided
                continue
            model = gpus[key].model
            asked = model.profile(slot.profile)
            rest = change.target.without([slot])
            options = {p: starts[0] for p in model.basic_profiles
                       if p.compute_slices > asked.compute_slices and p.memory_slices >= asked.memory_slices
                       and (starts := rest.free_starts(p))}
            pick = self._bigger(a.job_id, asked, list(options))
            if pick is None:
                assignments.append(a)
                continue
            bigger = Slot(options[pick], pick.name)
            changes[key] = replace(change, target=rest.with_slot(bigger))
            assignments.append(replace(a, instances=((key[1], bigger),)))
            self.upgrades += 1
        return replace(d, changes=tuple(changes.values()), assignments=tuple(assignments))


def play(family: str, seed: int, rule: str | None) -> dict:
    """One dev workload under frag-aware (``rule`` None) or a rule: its metrics and upgrades."""
    w, spec = _bench_like(family, seed)
    policy = get_policy("frag-aware") if rule is None else SizeUpgrade(rule, {j.job_id: j for j in w.jobs})
    res = Simulator(w, policy, spec).run()
    m = compute_metrics(res)
    return {"family": family, "seed": seed, "rule": rule or "frag-aware", "mean_wait_s": m.mean_wait_s,
            "mean_jct_s": m.mean_jct_s, "p95_wait_s": m.p95_wait_s, "unfinished": res.unfinished,
            "upgrades": getattr(policy, "upgrades", 0),
            "upgraded_jobs": sum(1 for r in res.jobs if r.instances and base_kind(r.instances[0][1].profile)
                                 != base_kind(r.pending.profile))}


def _ratio(rows: list[dict], base: list[dict], key: str) -> str:
    # a run where no job ran has no times (None, compute_metrics): left out, as a zero base is
    r = [a[key] / b[key] for a, b in zip(rows, base) if a[key] is not None and b[key]]
    ci = 1.96 * statistics.stdev(r) / math.sqrt(len(r)) if len(r) > 1 else float("nan")
    return f"{statistics.fmean(r):.3f} ± {ci:.3f} ({sum(x < 0.995 for x in r)})"


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi) + 1)) if hi else [int(s) for s in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=FAMILIES, help="comma-separated test-family generators")
    ap.add_argument("--seeds", default="300-319", help="dev seeds: a range lo-hi or a comma list (never 101-105)")
    ap.add_argument("--rules", default=",".join(RULES), help="comma-separated rules (module docstring)")
    ap.add_argument("--json", default=None, help="also write every run's figures to this file")
    args = ap.parse_args(argv)
    seeds, rules = _seeds(args.seeds), [r for r in args.rules.split(",") if r]
    if set(seeds) & {101, 102, 103, 104, 105}:
        ap.error("seeds 101-105 are the held-out test seeds (training/splits.py): use dev seeds")
    runs = []
    print("| family | rule | mean wait / frag-aware's | mean JCT / frag-aware's | p95 wait / frag-aware's | "
          "upgrades per run |\n|---|---|---:|---:|---:|---:|")
    for fam in args.families.split(","):
        base = [play(fam, s, None) for s in seeds]
        runs += base
        for rule in rules:
            rows = [play(fam, s, rule) for s in seeds]
            runs += rows
            print(f"| {fam} | {rule} | {_ratio(rows, base, 'mean_wait_s')} | {_ratio(rows, base, 'mean_jct_s')} | "
                  f"{_ratio(rows, base, 'p95_wait_s')} | {statistics.fmean(r['upgrades'] for r in rows):.0f} |",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
