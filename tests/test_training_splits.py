"""training/splits.py: which Alibaba jobs each split may see (no torch needed)."""

from __future__ import annotations

import pytest

import training.splits as splits
from slurm_mig.sim.workloads import Job, Workload


def _jobs(n: int) -> Workload:
    return Workload("alibaba", [Job(f"j{i:05d}", float(i), "1g", 1, 60.0, 120.0) for i in range(n)], "H100-80GB", 8, 8)


def test_alibaba_validation_scores_no_job_training_may_see(monkeypatch):
    """Validation scores jobs 55-70 % of the trace; training sees the first int(0.55 N). The share
    0.55 / 0.70 of the 70 % prefix rounded down one job early for most sizes (the trace's 2962 jobs:
    training sees 0-1628, validation scored 1628-2072)."""
    sizes = list(range(10, 400)) + [2962]
    fakes = {}
    monkeypatch.setattr(splits, "alibaba_cached", lambda seed, path=None: fakes["w"])
    monkeypatch.setattr(splits, "poisson_workload", lambda *a, **k: _jobs(2))
    monkeypatch.setattr(splits, "rl_mig_workload", lambda *a, **k: _jobs(2))
    for n in sizes:
        fakes["w"] = _jobs(n)
        trained = {j.job_id for j in fakes["w"].jobs[: int(splits.ALIBABA_TRAIN_TO * n)]}
        held = {j.job_id for j in fakes["w"].jobs[int(splits.ALIBABA_VALID_TO * n):]}
        for c in (c for c in splits.validation_cases() if "alibaba" in c.name):
            scored = c.scored_ids()
            assert not scored & trained, (n, sorted(scored & trained))
            assert not {j.job_id for j in c.workload.jobs} & held, n  # the test part never even runs
            assert len(scored) == int(splits.ALIBABA_VALID_TO * n) - int(splits.ALIBABA_TRAIN_TO * n), n


@pytest.mark.parametrize("family", ["rl-mix_extreme", "rl-wide_times"])
def test_training_refuses_a_held_out_family(family):
    """--families rl-mix_extreme trained on a held-out family without a word (train_case took any rl-*)."""
    import random

    with pytest.raises(ValueError, match="held out"):
        splits.train_case(random.Random(0), jobs=(20, 30), families=("poisson", family))
