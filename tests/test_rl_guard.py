"""The rl policy's reservation guard: what it changes in the dispatch loop, the features it reads, and how
the runtime checks the guard file named by a model card (onnxruntime only, no torch)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from slurm_mig.policies import check_decision
from slurm_mig.policies.frag_aware import FragAwarePolicy
from slurm_mig.policies.rl import (
    GUARD_FEATURE_NAMES, GUARD_OPTIONS_H, GUARD_SCHEMA, N_GUARD_FEATURES, SHIPPED_MODEL, OnnxScorer,
    PolicyModelError, RLPolicy, frag_aware_chooser,
)
from slurm_mig.sim.engine import ClusterSpec, SimConfig, simulate
from slurm_mig.sim.metrics import compute_metrics
from slurm_mig.sim.workloads import poisson_workload

H = 3600.0


pytestmark = pytest.mark.usefixtures("rl_isolated")  # tests/conftest.py


def multi_workload(seed: int = 3, n: int = 400):
    """Busy, with 7g jobs of which a third ask for 2, 4 or 8 GPUs of one node."""
    return poisson_workload(n, gpus=16, load=0.98, seed=seed, multi_gpu_share=0.3,
                            mix={"1g": .3, "2g": .2, "3g": .15, "4g": .1, "7g": .25})


class Recording(RLPolicy):
    """rl whose decisions are kept, to check the reservations they made."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen: list = []

    def decide(self, state):
        d = super().decide(state)
        self.seen.append((state, d))
        return d


def test_guard_of_zero_hours_is_frag_awares_rule():
    """Reserve at once (0 h) with frag-aware's placements is frag-aware, decision for decision."""
    w, spec = multi_workload(), ClusterSpec(2, 8)
    a = compute_metrics(simulate(w, FragAwarePolicy(), spec))
    b = compute_metrics(simulate(w, RLPolicy(chooser=frag_aware_chooser, guard_chooser=lambda f: 0.0), spec,
                                 SimConfig(check=True)))
    assert (a.mean_wait_s, a.reconfigurations, a.makespan_s) == (b.mean_wait_s, b.reconfigurations, b.makespan_s)


@pytest.mark.parametrize("hours", [2.0, 6.0])
def test_a_multi_gpu_reservation_holds_from_its_guard_on(hours):
    rows: list[list[float]] = []

    def guard(features: list[float]) -> float:
        rows.append(features)
        return hours

    pol = Recording(chooser=frag_aware_chooser, guard_chooser=guard)
    r = simulate(multi_workload(seed=4), pol, ClusterSpec(2, 8), SimConfig(check=True))
    assert r.unfinished == 0 and rows
    multi_reserved = 0
    for state, d in pol.seen:
        check_decision(state, d)
        jobs = {j.job_id: j for j in state.pending}
        for job_id, t, _gpus in d.extra["reservations"]:
            job = jobs[job_id]
            if job.count > 1:
                multi_reserved += 1
                assert t >= job.submit_time + hours * H, (job_id, t - job.submit_time)
    assert multi_reserved > 0
    # and the guard changes the outcome: a different schedule from frag-aware's
    fa = compute_metrics(simulate(multi_workload(seed=4), FragAwarePolicy(), ClusterSpec(2, 8)))
    assert compute_metrics(r).mean_wait_s != fa.mean_wait_s


def test_guard_features_are_one_finite_row_per_query():
    rows: list[list[float]] = []
    simulate(multi_workload(seed=5, n=250), RLPolicy(chooser=frag_aware_chooser,
                                                     guard_chooser=lambda f: rows.append(f) or 0.0),
             ClusterSpec(3, 8))
    assert rows
    for f in rows:
        assert len(f) == N_GUARD_FEATURES and all(math.isfinite(x) for x in f)
        named = dict(zip(GUARD_FEATURE_NAMES, f))
        assert 0 < named["job_node_share"] <= 1.0
        assert 0 <= named["running_left_h"] <= 6 and 0 <= named["pending_limit_h"] <= 6
        assert 0 <= named["running_no_end"] <= 1
        assert named["node_gpus"] == 1.0 and named["nodes"] == pytest.approx(math.log2(3) / 8)
    assert len({f[GUARD_FEATURE_NAMES.index("running_left_h")] for f in rows}) > 1  # it follows the cluster


# -- the guard file, as the runtime checks it --------------------------------------------------------


def _shipped_card() -> dict:
    return json.loads((SHIPPED_MODEL.parent / "model_card.json").read_text())


def _copy_model(tmp_path: Path) -> Path:
    card = _shipped_card()
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(SHIPPED_MODEL, d / "model.onnx")
    shutil.copy(SHIPPED_MODEL.parent / card["guard"]["file"], d / card["guard"]["file"])
    (d / "model_card.json").write_text(json.dumps(card))
    return d / "model.onnx"


def test_shipped_model_has_a_guard_the_runtime_loads():
    card = _shipped_card()
    g = card["guard"]
    assert g["feature_schema"] == GUARD_SCHEMA and g["features"] == list(GUARD_FEATURE_NAMES)
    assert g["options_h"] == list(GUARD_OPTIONS_H) and 0.0 in g["options_h"]
    for key in ("training_data", "seed", "wall_time_s", "validation", "iterations"):
        assert key in g
    sc = OnnxScorer(SHIPPED_MODEL)
    assert sc.guard_session is not None and sc.guard_options == GUARD_OPTIONS_H
    assert len(sc.guard_logits([0.5] * N_GUARD_FEATURES)) == len(GUARD_OPTIONS_H)


@pytest.mark.parametrize("change, match", [
    (lambda g: g.update(feature_schema="rl-guard/0"), "schema"),
    (lambda g: g.update(features=list(GUARD_FEATURE_NAMES[:-1]) + ["other"]), "feature list"),
    (lambda g: g.update(file="../guard.onnx"), "plain file name"),
    (lambda g: g.update(file="nope.onnx"), "does not exist"),
    (lambda g: g.update(options_h=[0, 6]), "options"),
    (lambda g: g.update(options_h="0,6"), "options_h"),
])
def test_a_wrong_guard_refuses_the_whole_model(tmp_path, change, match):
    m = _copy_model(tmp_path)
    card = json.loads((m.parent / "model_card.json").read_text())
    change(card["guard"])
    (m.parent / "model_card.json").write_text(json.dumps(card))
    with pytest.raises(PolicyModelError, match=match):
        OnnxScorer(m)


def test_a_model_without_a_guard_keeps_frag_awares_reservations(tmp_path):
    """Older models (no "guard" in the card) still load; multi-GPU jobs then get frag-aware's rule."""
    m = _copy_model(tmp_path)
    card = json.loads((m.parent / "model_card.json").read_text())
    del card["guard"]
    (m.parent / "model_card.json").write_text(json.dumps(card))
    assert OnnxScorer(m).guard_session is None
    w, spec = multi_workload(seed=6, n=400), ClusterSpec(2, 8)
    plain = compute_metrics(simulate(w, RLPolicy(model_path=str(m)), spec, SimConfig(check=True)))
    no_guard = compute_metrics(simulate(w, RLPolicy(guard_chooser=lambda f: None), spec))
    guarded = compute_metrics(simulate(w, RLPolicy(), spec))  # the shipped model, with its guard
    assert plain.mean_wait_s == no_guard.mean_wait_s
    assert guarded.mean_wait_s != plain.mean_wait_s


def test_store_copies_the_guard(tmp_path):
    from slurm_mig.policy_registry import PolicyStore

    m = _copy_model(tmp_path)
    st = PolicyStore(tmp_path / "store")
    v = st.add(m.parent, version="v1")
    assert (v.path.parent / _shipped_card()["guard"]["file"]).is_file()
    st.install("v1")
    assert OnnxScorer(v.path).guard_session is not None


def _run(w, spec, **kw):
    r = simulate(w, RLPolicy(**kw), spec, SimConfig(check=True))
    return [(x.job.job_id, x.start) for x in r.jobs]


def test_the_admins_cap_bounds_the_guards_hold():
    """[policy].rl_max_hold_h: a guard asking for 48 h under a 6 h cap holds exactly as a 6 h guard does;
    a 0 h cap is frag-aware's rule; the default (48 h) changes nothing."""
    w, spec = multi_workload(seed=8, n=400), ClusterSpec(2, 8)
    held48 = _run(w, spec, chooser=frag_aware_chooser, guard_chooser=lambda f: 48.0)
    assert _run(w, spec, chooser=frag_aware_chooser, guard_chooser=lambda f: 48.0, max_hold_h=48.0) == held48
    capped = _run(w, spec, chooser=frag_aware_chooser, guard_chooser=lambda f: 48.0, max_hold_h=6.0)
    assert capped == _run(w, spec, chooser=frag_aware_chooser, guard_chooser=lambda f: 6.0)
    assert capped != held48
    fa = simulate(w, FragAwarePolicy(), spec)
    zero = _run(w, spec, chooser=frag_aware_chooser, guard_chooser=lambda f: 48.0, max_hold_h=0.0)
    assert zero == [(x.job.job_id, x.start) for x in fa.jobs]


@pytest.mark.parametrize("bad", [-1, 721, "12", True, math.nan])
def test_a_bad_cap_is_a_config_error(bad):
    from slurm_mig.errors import ConfigError

    with pytest.raises(ConfigError, match="max_hold_h"):
        RLPolicy(max_hold_h=bad)


def test_the_controller_gives_rl_the_configured_cap(tmp_path):
    from dataclasses import replace

    from slurm_mig.config import Config, PolicyConfig
    from slurm_mig.controller.service import _make_policy

    cfg = replace(Config(), policy=PolicyConfig(name="rl", rl_max_hold_h=12.0))
    assert _make_policy(cfg, "rl").max_hold_h == 12.0
    assert _make_policy(cfg, "rl-candidate").max_hold_h == 12.0
    assert _make_policy(Config(), "rl").max_hold_h == 48.0
    assert not hasattr(_make_policy(cfg, "frag-aware"), "max_hold_h")
