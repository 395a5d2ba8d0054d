"""Which workloads the RL policy trains on, selects checkpoints on, and is tested on.

The rule: **training never sees an evaluation workload.**

=============  ===========================================================  ==========================
split          workloads                                                    seeds
=============  ===========================================================  ==========================
train          Poisson streams with random profile mixes, loads, sizes      1000 and up
               (8-32 GPUs); RL-MIG families good_scaling, bad_scaling,
               mix_soft; windows of the Alibaba trace's first 55 % of jobs
validation     the same families, other seeds; Alibaba jobs 55-70 % (the     500-599
               run starts at the trace's beginning, only those jobs count)
test           unseen families: rl-mix_extreme, rl-wide_times,              101-105 (and the bench's
(held out)     miso-models; unseen seeds of poisson-mix and small-heavy      own 1-5)
               (the bench's generators); the Alibaba trace's last 30 % of
               jobs (by submit time; time-limit seeds 0-4)
=============  ===========================================================  ==========================

``slurm-mig bench`` runs its fixed workloads (generator seeds 1-5, none of them
used in training) and the whole Alibaba file: there only the last 30 % of jobs
are held out, which docs/rl-policy.md says beside the numbers.

A :class:`Case` is one workload on one cluster plus which jobs count for the
metrics (all, those whose submit rank is in ``score_from``..``score_to``, or
exactly the jobs ``score_index`` names by position).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from slurm_mig.sim.bench import ALIBABA_NODES, default_trace
from slurm_mig.sim.engine import ClusterSpec
from slurm_mig.sim.workloads import (
    KINDS, Workload, load_alibaba, miso_workload, poisson_workload, rl_mig_workload,
)

TRAIN_FAMILIES = ("poisson", "rl-good_scaling", "rl-bad_scaling", "rl-mix_soft", "alibaba-early")
TEST_FAMILIES = ("poisson-mix", "small-heavy", "rl-mix_extreme", "rl-wide_times", "miso-models", "alibaba-late")
TEST_SEEDS = (101, 102, 103, 104, 105)
VALIDATION_SEEDS = (500, 501)
ALIBABA_TRAIN_TO = 0.55  # share of the trace's jobs (by submit time) training may see
ALIBABA_VALID_TO = 0.70  # validation: jobs 55-70 %; test: 70-100 %


@dataclass
class Case:
    """One workload on one cluster; metrics count jobs ranked [score_from, score_to) by submit time."""

    name: str
    workload: Workload
    spec: ClusterSpec
    seed: int = 0
    score_from: float = 0.0
    score_to: float = 1.0
    meta: dict = field(default_factory=dict)
    # [lo, hi) job positions, overriding the shares: a split made at an index must be scored at that
    # index (15 / 22 * 22 is 14.999..., which int() made 14: a training job was scored too)
    score_index: tuple[int, int] | None = None

    def scored_ids(self) -> set[str] | None:
        jobs = self.workload.jobs
        if self.score_index is not None:
            lo, hi = self.score_index
            return {j.job_id for j in jobs[lo:hi]}
        if self.score_from <= 0.0 and self.score_to >= 1.0:
            return None
        lo, hi = int(self.score_from * len(jobs)), int(math.ceil(self.score_to * len(jobs)))
        return {j.job_id for j in jobs[lo:hi]}


def _random_mix(rng: random.Random) -> dict[str, float]:
    w = [rng.gammavariate(1.0, 1.0) for _ in KINDS]
    s = sum(w)
    return {k: max(0.02, v / s) for k, v in zip(KINDS, w)}


def _alibaba(seed: int, path: Path | None = None) -> Workload:
    p = path or default_trace()
    if p is None:
        raise FileNotFoundError("no Alibaba trace (../shared/traces/alibaba-v2023-train.csv); pass --trace")
    return load_alibaba(p, seed=seed, nodes=ALIBABA_NODES)


def _prefix(w: Workload, share: float, name: str) -> Workload:
    n = max(1, int(share * len(w.jobs)))
    return Workload(name, list(w.jobs[:n]), w.model, w.nodes, w.gpus_per_node, dict(w.meta))


def _window(w: Workload, lo: int, hi: int, name: str) -> Workload:
    """Jobs lo..hi-1 (by submit time), shifted to arrive from 0 on an empty cluster."""
    jobs = w.jobs[lo:hi]
    t0 = jobs[0].submit_time if jobs else 0.0
    return Workload(name, [replace(j, submit_time=j.submit_time - t0) for j in jobs], w.model, w.nodes,
                    w.gpus_per_node, dict(w.meta))


_ALIBABA_CACHE: dict[tuple, Workload] = {}


def families_available(families: tuple[str, ...] = TRAIN_FAMILIES, trace: Path | None = None) -> tuple[str, ...]:
    """``families`` less alibaba-early when there is no Alibaba trace to cut it from (a site's own machine)."""
    if trace is not None or default_trace() is not None:
        return tuple(families)
    return tuple(f for f in families if f != "alibaba-early")


def alibaba_cached(seed: int, path: Path | None = None) -> Workload:
    key = (seed, str(path))
    w = _ALIBABA_CACHE.get(key)
    if w is None:
        w = _ALIBABA_CACHE[key] = _alibaba(seed, path)
    return w


def train_case(rng: random.Random, *, jobs: tuple[int, int] = (300, 700), trace: Path | None = None,
               families: tuple[str, ...] = TRAIN_FAMILIES,
               multi_shares: tuple[float, ...] = (0.0, 0.0, 0.05, 0.1)) -> Case:
    """A random training episode (seeds >= 1000, never a validation or test workload)."""
    held = sorted(set(families) & set(TEST_FAMILIES))
    if held:  # any rl-* family would generate: a held-out one must not (training never sees a test family)
        raise ValueError(f"{', '.join(held)}: held out for testing (training/splits.py), not a training family")
    family = rng.choice(families)
    seed = 1000 + rng.randrange(10**6)
    n = rng.randint(*jobs)
    nodes = rng.choice((1, 2, 2, 3, 4))
    gpus = 8 * nodes
    load = rng.uniform(0.8, 1.0)
    if family == "poisson":
        w = poisson_workload(n, gpus=gpus, load=load, mix=_random_mix(rng), seed=seed,
                             mean_duration_s=rng.uniform(900, 3600), sigma=rng.uniform(0.6, 1.4),
                             multi_gpu_share=rng.choice(multi_shares), name="train:poisson")
    elif family.startswith("rl-"):
        w = rl_mig_workload(family[3:], n, gpus=gpus, load=load, mix=_random_mix(rng), seed=seed)
    elif family == "alibaba-early":
        full = alibaba_cached(seed % 7 + 1000, trace)  # time-limit seeds 1000-1006
        last = int(ALIBABA_TRAIN_TO * len(full.jobs))
        start = rng.randrange(0, max(1, last - n))
        w = _window(full, start, min(last, start + n), "train:alibaba-early")
        return Case(w.name, w, ClusterSpec(ALIBABA_NODES, 8, w.model), seed)
    else:
        raise ValueError(f"unknown training family {family}")
    return Case(w.name, w, ClusterSpec(max(1, gpus // 8), 8, w.model), seed)


def _bench_like(family: str, seed: int) -> tuple[Workload, ClusterSpec]:
    two = ClusterSpec(2, 8)
    if family == "poisson-mix":
        return poisson_workload(2000, gpus=16, load=0.9, seed=seed, name="poisson-mix"), two
    if family == "small-heavy":
        return poisson_workload(2000, gpus=16, load=0.9, seed=seed,
                                mix={"1g": .35, "2g": .25, "3g": .2, "4g": .1, "7g": .1},
                                multi_gpu_share=0.1, name="small-heavy"), two
    if family in ("rl-mix_extreme", "rl-wide_times"):
        return rl_mig_workload(family[3:], 1500, gpus=16, load=0.9, seed=seed), two
    if family == "miso-models":
        return miso_workload(1500, gpus=16, load=0.9, seed=seed), two
    raise ValueError(family)


def heldout_cases(seeds: tuple[int, ...] = TEST_SEEDS, families: tuple[str, ...] = TEST_FAMILIES,
               trace: Path | None = None) -> list[Case]:
    """The held-out cases: each test family x each seed."""
    out = []
    for fam in families:
        for i, seed in enumerate(seeds):
            if fam == "alibaba-late":
                try:
                    w = alibaba_cached(i, trace)  # time-limit seeds 0..4
                except FileNotFoundError:
                    continue
                out.append(Case(fam, w, ClusterSpec(ALIBABA_NODES, 8, w.model), i, ALIBABA_VALID_TO, 1.0))
            else:
                w, spec = _bench_like(fam, seed)
                out.append(Case(fam, w, spec, seed))
    return out


def validation_cases(trace: Path | None = None, small: bool = False) -> list[Case]:
    """Checkpoint selection: training families with validation seeds, Alibaba jobs 55-70 %."""
    out = []
    for i, seed in enumerate(VALIDATION_SEEDS[: 1 if small else None]):
        rng = random.Random(seed)
        n = 400 if small else 1200
        out.append(Case("valid:poisson", poisson_workload(n, gpus=16, load=0.92, mix=_random_mix(rng), seed=seed,
                                                          multi_gpu_share=0.05, name="valid:poisson"),
                        ClusterSpec(2, 8), seed))
        for fam in ("good_scaling", "bad_scaling", "mix_soft"):
            if small and fam != "mix_soft":
                continue
            w = rl_mig_workload(fam, n, gpus=24, load=0.92, seed=seed)
            w.name = f"valid:rl-{fam}"
            out.append(Case(w.name, w, ClusterSpec(3, 8), seed))
        if not small:
            try:
                full = alibaba_cached(500 + i, trace)
            except FileNotFoundError:
                continue
            w = _prefix(full, ALIBABA_VALID_TO, "valid:alibaba")
            # scored from the first job training may not see, by index: the share 0.55 / 0.70 of the
            # prefix rounds down one job early for most trace sizes (2962 jobs: job 1628, a training job)
            out.append(Case(w.name, w, ClusterSpec(ALIBABA_NODES, 8, w.model), 500 + i,
                            score_index=(int(ALIBABA_TRAIN_TO * len(full.jobs)), len(w.jobs))))
    return out
