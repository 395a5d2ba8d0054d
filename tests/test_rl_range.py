"""The rl policy's training range: a choice whose features lie outside the values a network was trained
on is decided by frag-aware's rule, counted and logged; the card's range is checked like the rest of it."""

from __future__ import annotations

import json
import logging
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_mig.policies.frag_aware import FragAwarePolicy
from slurm_mig.policies.rl import (
    FEATURE_NAMES, GUARD_FEATURE_NAMES, SHIPPED_MODEL, OnnxScorer, PolicyModelError, RLPolicy,
)
from slurm_mig.sim.engine import ClusterSpec, SimConfig, simulate
from slurm_mig.sim.metrics import compute_metrics
from slurm_mig.sim.workloads import Workload, poisson_workload

pytestmark = pytest.mark.usefixtures("rl_isolated")  # tests/conftest.py


def _copy_model(tmp_path: Path, edit=None) -> Path:
    """The shipped model and guard in a folder of their own; ``edit(card)`` changes the card copy."""
    card = json.loads((SHIPPED_MODEL.parent / "model_card.json").read_text())
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(SHIPPED_MODEL, d / "model.onnx")
    shutil.copy(SHIPPED_MODEL.parent / card["guard"]["file"], d / card["guard"]["file"])
    if edit is not None:
        edit(card)
    (d / "model_card.json").write_text(json.dumps(card))
    return d / "model.onnx"


def _without_limits(w: Workload, share: float, seed: int = 0) -> Workload:
    """``w`` with the time limit taken off ``share`` of its jobs (a site without DefaultTime)."""
    rng = random.Random(seed)
    jobs = [replace(j, time_limit_s=None) if rng.random() < share else j for j in w.jobs]
    return Workload(w.name, jobs, w.model, w.nodes, w.gpus_per_node, dict(w.meta))


def _small_heavy(n: int = 500, seed: int = 31) -> Workload:
    return poisson_workload(n, gpus=16, load=0.95, seed=seed, multi_gpu_share=0.2,
                            mix={"1g": .35, "2g": .25, "3g": .2, "4g": .1, "7g": .1})


def test_the_shipped_card_gives_both_networks_a_range():
    sc = OnnxScorer(SHIPPED_MODEL)
    assert sc.range is not None and len(sc.range[0]) == len(FEATURE_NAMES)
    assert sc.guard_range is not None and len(sc.guard_range[0]) == len(GUARD_FEATURE_NAMES)
    assert (sc.range[0] <= sc.range[1]).all() and (sc.guard_range[0] <= sc.guard_range[1]).all()


@pytest.mark.parametrize("where", ["model", "guard"])
@pytest.mark.parametrize("bad, match", [
    ({"lo": [0.0], "hi": [1.0]}, "feature_range"),                       # one number, not one per feature
    ("0..1", "feature_range"),
    (lambda n: {"lo": [1.0] * n, "hi": [0.0] * n}, "lo <= hi"),
    (lambda n: {"lo": ["0"] * n, "hi": [1.0] * n}, "finite numbers"),
    (lambda n: {"lo": [float("nan")] * n, "hi": [1.0] * n}, "finite numbers"),
])
def test_a_broken_range_refuses_the_model(tmp_path, where, bad, match):
    n = len(FEATURE_NAMES) if where == "model" else len(GUARD_FEATURE_NAMES)
    value = bad(n) if callable(bad) else bad

    def edit(card: dict) -> None:
        (card if where == "model" else card["guard"])["feature_range"] = value

    with pytest.raises(PolicyModelError, match=match):
        OnnxScorer(_copy_model(tmp_path, edit))


def _network_places(card: dict) -> None:
    card["placement"] = "network"  # as a retrained candidate's card says; the shipped card leaves it to frag-aware


def test_jobs_without_time_limits_are_frag_awares_to_place(caplog, tmp_path):
    """No training workload had a job without a time limit; on a queue of only such jobs every choice
    is outside the range, so rl is frag-aware, decision for decision, and says so."""
    w, spec = _without_limits(_small_heavy(), 1.0), ClusterSpec(2, 8)
    fa = compute_metrics(simulate(w, FragAwarePolicy(), spec))
    pol = RLPolicy(model_path=str(_copy_model(tmp_path, _network_places)))
    extras: list[int] = []
    decide = pol.decide
    pol.decide = lambda st: (d := decide(st), extras.append(d.extra.get("rl_outside_training_range", 0)))[0]
    with caplog.at_level(logging.WARNING, logger="slurm_mig.policies.rl"):
        rl = compute_metrics(simulate(w, pol, spec, SimConfig(check=True)))
    assert (rl.mean_wait_s, rl.reconfigurations, rl.makespan_s) == (fa.mean_wait_s, fa.reconfigurations,
                                                                    fa.makespan_s)
    assert pol.out_of_range.get("job_no_limit", 0) > 0 and sum(extras) > 0
    warned = [r.getMessage() for r in caplog.records if "job_no_limit" in r.getMessage()]
    assert len(warned) == 1  # once per feature, not once per choice


def test_without_a_range_the_network_decides_everything(tmp_path):
    """The check is what makes the difference: a card without ranges (older models) lets the networks
    decide on the same queue, and they leave frag-aware's choices."""
    def drop(card: dict) -> None:
        _network_places(card)
        card.pop("feature_range")
        card["guard"].pop("feature_range")

    m = _copy_model(tmp_path, drop)
    assert OnnxScorer(m).range is None
    w, spec = _without_limits(_small_heavy(), 1.0), ClusterSpec(2, 8)
    fa = compute_metrics(simulate(w, FragAwarePolicy(), spec))
    pol = RLPolicy(model_path=str(m))
    rl = compute_metrics(simulate(w, pol, spec, SimConfig(check=True)))
    assert pol.out_of_range == {}
    assert (rl.mean_wait_s, rl.reconfigurations) != (fa.mean_wait_s, fa.reconfigurations)


def test_inside_the_range_nothing_changes(tmp_path):
    """With time limits on every job the shipped ranges hold: same decisions as with no range at all."""
    def drop(card: dict) -> None:
        _network_places(card)
        card.pop("feature_range")
        card["guard"].pop("feature_range")

    m = _copy_model(tmp_path, drop)
    w, spec = poisson_workload(400, gpus=16, load=0.95, seed=32), ClusterSpec(2, 8)
    (tmp_path / "r").mkdir()
    ranged = RLPolicy(model_path=str(_copy_model(tmp_path / "r", _network_places)))
    a = compute_metrics(simulate(w, ranged, spec))
    b = compute_metrics(simulate(w, RLPolicy(model_path=str(m)), spec))
    assert (a.mean_wait_s, a.reconfigurations) == (b.mean_wait_s, b.reconfigurations)
    assert ranged.out_of_range == {}


def test_a_guard_row_outside_its_range_gets_frag_awares_rule(tmp_path):
    """A guard whose range excludes every row never delays a reservation: frag-aware's 0 h."""
    def narrow(card: dict) -> None:
        n = len(GUARD_FEATURE_NAMES)
        card["guard"]["feature_range"] = {"lo": [100.0] * n, "hi": [100.0] * n}

    m = _copy_model(tmp_path, narrow)
    pol = RLPolicy(model_path=str(m))
    seen: list[float | None] = []
    hours = pol._guard_hours
    pol._guard_hours = lambda ctx, job: (h := hours(ctx, job), seen.append(h))[0]
    simulate(_small_heavy(300, seed=33), pol, ClusterSpec(2, 8), SimConfig(check=True))
    assert seen and set(seen) == {None}
    assert pol.out_of_range.get("job_node_share", 0) == len(seen)


def test_ranges_cover_and_merge():
    from training.ranges import feature_range, merge_ranges

    r = feature_range([[0.0, 5.0], [2.0, -1.0], [1.0, 3.0]])
    assert r == {"lo": [0.0, -1.0], "hi": [2.0, 5.0]}
    m = merge_ranges(r, {"lo": [-3.0, 0.0], "hi": [1.0, 9.0]})
    assert m == {"lo": [-3.0, -1.0], "hi": [2.0, 9.0]}
    assert merge_ranges(None, r) == r and merge_ranges(r, None) == r
