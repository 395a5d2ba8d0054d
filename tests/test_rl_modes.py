"""The reservation-mode experiment (training/modes.py): frag-aware with the multi-GPU reservation rule chosen
per decision. Not shipped (docs/rl-policy.md, "Reservation modes"); these keep it reproducible."""

from __future__ import annotations

import random
import time

import pytest

try:
    import torch

    torch.set_num_threads(1)
    MISSING = ""
except ImportError as exc:  # pragma: no cover - only without the extra
    MISSING = f"{exc}; install the training extra: pip install torch==2.13.0 && pip install -e '.[train]'"

from slurm_mig.policies.frag_aware import FragAwarePolicy
from slurm_mig.sim.engine import ClusterSpec, SimConfig, simulate
from slurm_mig.sim.metrics import compute_metrics
from slurm_mig.sim.workloads import poisson_workload


@pytest.fixture(autouse=True)
def _needs_training_extra():
    if MISSING:
        pytest.fail(MISSING)


def workload(seed=3, n=300):
    return poisson_workload(n, gpus=16, load=0.95, seed=seed, multi_gpu_share=0.2,
                            mix={"1g": .3, "2g": .2, "3g": .2, "4g": .1, "7g": .2})


def test_mode_zero_is_frag_aware_and_a_zero_guard_too():
    from training.modes import ModePolicy

    w, spec = workload(), ClusterSpec(2, 8)
    fa = compute_metrics(simulate(w, FragAwarePolicy(), spec))
    for pol in (ModePolicy(chooser=lambda c: 0), ModePolicy(chooser=lambda c: 1, reserve_guard_s=0.0)):
        m = compute_metrics(simulate(w, pol, spec, SimConfig(check=True)))
        assert (m.mean_wait_s, m.reconfigurations, m.makespan_s) == (fa.mean_wait_s, fa.reconfigurations, fa.makespan_s)


def test_random_modes_are_safe_and_only_young_multi_gpu_jobs_ask():
    from training.modes import MODES, N_CONTEXT, N_FEATURES, ModePolicy

    rng = random.Random(0)
    guard = 4 * 3600.0
    asked = []

    def chooser(c) -> int:
        assert c.job.count > 1 and c.state_now - c.job.submit_time < guard
        assert len(c.features) == len(MODES) and all(len(r) == N_FEATURES for r in c.features)
        assert all(r[:N_CONTEXT] == c.features[0][:N_CONTEXT] for r in c.features)
        asked.append(1)
        return rng.randrange(len(MODES))

    r = simulate(workload(seed=5), ModePolicy(chooser=chooser, reserve_guard_s=guard), ClusterSpec(2, 8),
                 SimConfig(check=True))
    assert asked and r.unfinished == 0


def test_snapshot_branches_replay_exactly():
    from training.model import Scorer
    from training.modes import N_FEATURES, run_greedy
    from training.train import window_cost
    from training.splits import Case

    m = Scorer(N_FEATURES, 16)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    f = m.numpy_forward()
    c = Case("t", workload(seed=7, n=250), ClusterSpec(2, 8))
    main = run_greedy(c, f, record=True)
    d = main["points"][len(main["points"]) // 2][0]
    snap = run_greedy(c, f, snap_at={d})["snaps"][d]
    t = next(t0 for dd, t0, *_ in main["timeline"] if dd == d)
    branch = run_greedy(c, f, start=snap, t_end=t + 3 * 3600)
    assert branch["cost"] == pytest.approx(window_cost(main["timeline"], d, t + 3 * 3600), rel=1e-12)


def test_smoke_training_writes_a_model_that_plays(tmp_path):
    from training.modes import ModePolicy, greedy, load, parse_args, train

    t0 = time.time()
    train(parse_args(["--smoke", "--out", str(tmp_path / "run")]), echo=False)
    assert time.time() - t0 < 45
    model, ck = load(tmp_path / "run" / "model.pt")
    pol = ModePolicy(chooser=greedy(model.numpy_forward()))
    assert simulate(workload(seed=11, n=150), pol, ClusterSpec(2, 8), SimConfig(check=True)).unfinished == 0
