"""The learned rl policy as the runtime sees it (onnxruntime only, no torch): candidates, safety,
the shipped model, schema checks, lazy loading, fallback in the controller, and shadow mode."""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

import pytest

from slurm_mig.config import Config, PolicyConfig
from slurm_mig.policies import check_decision, get_policy
from slurm_mig.policies.frag_aware import FragAwarePolicy
from slurm_mig.policies.rl import (
    FEATURE_NAMES, FEATURE_SCHEMA, N_FEATURES, SHIPPED_MODEL, Choice, OnnxScorer, PolicyModelError, RLPolicy,
    frag_aware_chooser,
)
from slurm_mig.sim.engine import ClusterSpec, SimConfig, Simulator, simulate
from slurm_mig.sim.metrics import compute_metrics
from slurm_mig.sim.workloads import poisson_workload, rl_mig_workload

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("rl_isolated")  # tests/conftest.py


def small_workload(seed=3, n=300, multi=0.1):
    return poisson_workload(n, gpus=16, load=0.95, seed=seed, multi_gpu_share=multi,
                            mix={"1g": .3, "2g": .2, "3g": .2, "4g": .1, "7g": .2})


def test_with_frag_awares_choice_it_is_frag_aware():
    """Candidate 0 is frag-aware's pick: same decisions, same metrics (a tripwire for feature drift)."""
    for w in (small_workload(), rl_mig_workload("mix_extreme", 300, gpus=16, load=0.95, seed=4)):
        spec = ClusterSpec(2, 8)
        a = compute_metrics(simulate(w, FragAwarePolicy(), spec))
        b = compute_metrics(simulate(w, RLPolicy(chooser=frag_aware_chooser), spec, SimConfig(check=True)))
        assert (a.mean_wait_s, a.reconfigurations, a.makespan_s) == (b.mean_wait_s, b.reconfigurations, b.makespan_s)


def test_any_choice_is_a_safe_decision():
    """Whatever the network picks, every decision passes check_decision (random choices, multi-GPU jobs)."""
    rng = random.Random(0)
    seen = []

    def chooser(c: Choice) -> int:
        assert len(c.features) == len(c.options) >= 2
        assert all(len(row) == N_FEATURES for row in c.features)
        seen.append(len(c.options))
        return rng.randrange(len(c.options))

    r = simulate(small_workload(seed=5), RLPolicy(chooser=chooser), ClusterSpec(2, 8), SimConfig(check=True))
    assert r.unfinished == 0 and seen and max(seen) <= 32


def test_candidates_are_capped_and_best_first():
    got = []

    def chooser(c: Choice) -> int:
        gaps = [row[FEATURE_NAMES.index("score_gap")] for row in c.features]
        assert gaps[0] == 0.0 and all(g >= -1e-9 for g in gaps)
        got.append(len(c.options))
        return 0

    simulate(small_workload(seed=6, n=200), RLPolicy(chooser=chooser, max_candidates=5), ClusterSpec(4, 8))
    assert got and max(got) <= 5


def test_shipped_model_loads_matches_schema_and_decides():
    assert SHIPPED_MODEL.is_file(), "policy/default.onnx is the shipped default"
    card = json.loads((SHIPPED_MODEL.parent / "model_card.json").read_text())
    assert card["feature_schema"] == FEATURE_SCHEMA and card["features"] == list(FEATURE_NAMES)
    for key in ("training_data", "seed", "wall_time_s", "metrics", "version"):
        assert key in card
    pol = get_policy("rl")
    assert pol.name == "rl"
    for nodes in (1, 3, 6):  # one model, any cluster size
        w = small_workload(seed=nodes, n=150)
        r = simulate(w, get_policy("rl"), ClusterSpec(nodes, 8), SimConfig(check=True))
        assert r.unfinished == 0
    assert pol.load().version == str(card["version"])


def test_decide_is_pure():
    w = small_workload(seed=9, n=200)
    sim = Simulator(w, get_policy("frag-aware"), ClusterSpec(2, 8))
    state = sim.reset()
    for _ in range(40):
        state = sim.step(sim.policy.decide(state))
    a, b = get_policy("rl"), get_policy("rl")
    d1, d2 = a.decide(state), b.decide(state)
    assert d1.assignments == d2.assignments and d1.changes == d2.changes
    check_decision(state, d1)


def _copy_model(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(SHIPPED_MODEL, d / "model.onnx")
    shutil.copy(SHIPPED_MODEL.parent / "model_card.json", d / "model_card.json")
    shutil.copy(SHIPPED_MODEL.parent / "guard.onnx", d / "guard.onnx")  # the card names it
    return d / "model.onnx"


def _set_card(m: Path, **fields) -> dict:
    """Change ``fields`` of the model card beside ``m`` (a _copy_model), write it back and return it."""
    path = m.parent / "model_card.json"
    card = {**json.loads(path.read_text()), **fields}
    path.write_text(json.dumps(card))
    return card


def test_schema_mismatch_is_refused_with_the_reason(tmp_path):
    m = _copy_model(tmp_path)
    _set_card(m, feature_schema="rl-candidates/0")
    with pytest.raises(PolicyModelError, match="feature schema"):
        OnnxScorer(m)
    _set_card(m, feature_schema=FEATURE_SCHEMA, features=list(FEATURE_NAMES[:-1]) + ["something_else"])
    with pytest.raises(PolicyModelError, match="feature list"):
        OnnxScorer(m)


def test_missing_or_broken_model_fails_at_decide_not_at_construction(tmp_path):
    pol = get_policy("rl", model_path=str(tmp_path / "nope.onnx"))  # constructing never fails
    state = Simulator(small_workload(n=20), pol, ClusterSpec(1, 8)).reset()
    with pytest.raises(PolicyModelError, match="does not exist"):
        pol.decide(state)
    bad = _copy_model(tmp_path)
    bad.write_bytes(b"not an onnx file")
    with pytest.raises(PolicyModelError, match="cannot load"):
        get_policy("rl", model_path=str(bad)).decide(state)


def test_model_file_change_is_picked_up(tmp_path, monkeypatch):
    m = _copy_model(tmp_path)
    pol = get_policy("rl", model_path=str(m))
    pol.load()
    _set_card(m, feature_schema="other")
    pol._checked_at -= 10  # as if 10 s had passed
    with pytest.raises(PolicyModelError):
        pol.load()


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_change_to_only_the_guard_file_of_a_pinned_model_is_picked_up(tmp_path, keep_mtime):
    """The reload key held the model file's path, mtime and size and the card's mtime, not the guard file the
    card names: a pinned model whose guard.onnx alone was replaced (retrained with training/guard.py and copied
    over) kept running the old guard until a restart. The guard is in the key now, and each file's ctime and
    inode, so a copy that keeps the old mtime (cp -p, rsync -a) is noticed too."""
    import os

    m = _copy_model(tmp_path)
    pol = get_policy("rl", model_path=str(m))
    pol.load()
    guard = m.parent / "guard.onnx"
    st = guard.stat()
    new = m.parent / "guard.new"
    new.write_bytes(b"\x00" * st.st_size if keep_mtime else b"not an onnx file")  # same size, or not
    if keep_mtime:
        os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, guard)  # as an admin's copy into place
    pol._checked_at -= 10  # as if 10 s had passed
    with pytest.raises(PolicyModelError, match="guard"):
        pol.load()


def test_no_candidate_in_an_empty_store(tmp_path):
    pol = get_policy("rl-candidate")
    assert pol.name == "rl-candidate"
    with pytest.raises(PolicyModelError, match="no candidate"):
        pol.load()


# -- the controller ------------------------------------------------------------------------


class _Slurm:
    def __init__(self, jobs):
        self._jobs = jobs

    def jobs(self):
        return self._jobs

    def reservations(self):
        return []

    def nodes(self):
        return []

    def update_node_gres(self, *a, **k):
        return ""


def _controller(policy: PolicyConfig, tmp_path):
    from slurm_mig.controller.service import Controller
    from slurm_mig.slurm.parsers import SlurmJob
    from slurm_mig.store import open_store

    store = open_store(":memory:")
    now = time.time()
    gpus = [{"gpu": g, "uuid": f"GPU-{g}", "model": "H100-80GB", "mig_enabled": True} for g in (0, 1)]
    store.replace_observed("n1", gpus, [], now=now)
    jobs = [SlurmJob(job_id=100 + i, name=f"j{i}", user="u", state="PENDING", partition="p", mig={p: 1},
                     tres_per_node=f"gres:mig:{p}:1", submit_time=now - 10 + i, priority=1)
            for i, p in enumerate(["1g", "3g", "2g", "1g"])]
    return Controller(Config(policy=policy), store, _Slurm(jobs)), store


def test_controller_falls_back_with_the_reason_when_the_model_is_wrong(tmp_path, monkeypatch):
    m = _copy_model(tmp_path)
    _set_card(m, feature_schema="rl-candidates/0")
    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(m))
    ctl, store = _controller(PolicyConfig(name="rl", fallback="frag-aware"), tmp_path)
    summary = ctl.tick()
    assert summary.get("policy") == "frag-aware" and summary.get("assignments", 0) > 0
    events = [e.message for e in store.recent_events(50)]
    assert any("policy rl failed" in e and "feature schema" in e for e in events), events


@pytest.mark.parametrize("content", [b"", b"\n", b"\x00\x00\x00\x00", b"../../tmp/x\n", b"v1 junk\n"])
def test_controller_falls_back_with_the_reason_when_the_stores_active_names_no_version(tmp_path, content):
    """An 'active' left empty by a power cut (or zeroed, or holding anything but a version name) was read as
    'no version installed': the controller silently ran the shipped model, not the one the admin installed
    (or, for a NUL, failed with 'embedded null byte'). It is a model error now: the fallback decides and the
    log says what is wrong with which file and what to do."""
    store_root = tmp_path / "store"
    store_root.mkdir()
    shutil.copytree(SHIPPED_MODEL.parent, store_root / "v1",
                    ignore=lambda d, names: [n for n in names if not n.endswith((".onnx", ".json"))])
    (store_root / "active").write_bytes(content)
    ctl, store = _controller(PolicyConfig(name="rl", fallback="frag-aware"), tmp_path)
    summary = ctl.tick()
    assert summary.get("policy") == "frag-aware" and summary.get("assignments", 0) > 0
    events = [e.message for e in store.recent_events(50) if e.message.startswith("policy rl failed")]
    assert len(events) == 1 and str(store_root / "active") in events[0], events
    assert ("is empty" if not content.strip() else "names no version") in events[0]
    assert "slurm-mig policy install VERSION" in events[0]


def test_a_model_failing_every_tick_is_said_once_a_window_and_counted_every_time(tmp_path, monkeypatch, caplog):
    """A model that no longer loads fails every tick: each was an error line and a 'policy' event, 17,280 a day
    at the default 5 s interval. It is said once per POLICY_FAIL_LOG_EVERY_S now, the next line with the
    count held back, a closing line once it has stopped; the metric counts every failure."""
    import logging

    from slurm_mig.controller.service import POLICY_FAIL_LOG_EVERY_S

    m = _copy_model(tmp_path)
    _set_card(m, feature_schema="rl-candidates/0")
    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(m))
    ctl, store = _controller(PolicyConfig(name="rl", fallback="frag-aware"), tmp_path)
    t = [time.time()]
    ctl.clock = lambda: t[0]

    def failures():
        return ([e.message for e in store.recent_events(500) if e.message.startswith("policy rl failed")],
                [r.getMessage() for r in caplog.records if r.getMessage().startswith("policy rl failed")])

    with caplog.at_level(logging.WARNING, logger="slurm_mig.controller"):
        for _ in range(6):
            assert ctl.tick().get("policy") == "frag-aware"
            t[0] += 5
        events, lines = failures()
        assert len(events) == 1 and len(lines) == 1 and "feature schema" in lines[0]
        assert ctl.metrics.counters[("slurm_mig_policy_errors_total", (("policy", "rl"),))] == 6
        for _ in range(2):  # still failing a window later: said again, with the count held back
            t[0] += POLICY_FAIL_LOG_EVERY_S / 2
            ctl.tick()
        events, lines = failures()
        assert len(lines) == 2 and "(6 more such failures since the last line about them, not logged)" in lines[1]
        assert len(events) == 2 and any("(6 more such failures" in e for e in events)
        ctl.tick()  # one more, held back; then the model is mended
        _set_card(m, feature_schema=FEATURE_SCHEMA)
        ctl.policy._checked_at = -math.inf
        t[0] += POLICY_FAIL_LOG_EVERY_S
        assert ctl.tick().get("policy") == "rl"
    closing = [r.getMessage() for r in caplog.records if "since the last line about them, not logged, and none" in
               r.getMessage()]
    assert closing == ["live policy rl: 1 more failure(s) (PolicyModelError) since the last line about them, not "
                       f"logged, and none in the last {POLICY_FAIL_LOG_EVERY_S:.0f} s"]


def test_a_shadow_failing_every_tick_is_said_once_a_window(tmp_path, monkeypatch, caplog):
    """The same for a shadow candidate whose model does not load: one warning a window, not one a tick."""
    import logging

    m = _copy_model(tmp_path)
    _set_card(m, feature_schema="rl-candidates/0")
    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(m))
    ctl, store = _controller(PolicyConfig(name="frag-aware", shadow="rl"), tmp_path)
    t = [time.time()]
    ctl.clock = lambda: t[0]
    with caplog.at_level(logging.WARNING, logger="slurm_mig.controller"):
        for _ in range(5):
            assert ctl.tick().get("policy") == "frag-aware"
            t[0] += 5
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("shadow policy rl failed")]
    assert len(lines) == 1 and "feature schema" in lines[0], lines
    assert store.recent_decisions(5, shadow=True) == []


def test_a_fallback_deciding_as_the_policy_did_is_recorded_as_the_fallbacks_decision(tmp_path, monkeypatch):
    """The controller records a live decision only when it differs from the last one recorded, and compared
    only re-carves, placements and reasons: when the rl model stopped loading (a card of another feature
    schema) and frag-aware, the fallback, decided as rl had, nothing was recorded, so the last decision, the
    one `status` names and `explain` attributes the waits to, said rl and its model version for as long as
    frag-aware decided. The policy and its version are part of the comparison now, as for the shadow's."""
    import math

    m = _copy_model(tmp_path)
    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(m))
    ctl, store = _controller(PolicyConfig(name="rl", fallback="frag-aware"), tmp_path)
    for _ in range(3):  # the first tick's re-carves are planned by the second (nothing carries them out here)
        ctl.tick()
    [last] = store.recent_decisions(1, shadow=False)
    assert last.policy == "rl"
    _set_card(m, feature_schema="rl-candidates/0")
    ctl.policy._checked_at = -math.inf  # the model is looked at again at most every 5 s
    assert ctl.tick().get("policy") == "frag-aware"
    ctl.tick()
    now, before = store.recent_decisions(2, shadow=False)
    assert before.id == last.id  # recorded once, not each tick
    assert (now.policy, now.version) == ("frag-aware", FragAwarePolicy().version)
    # Its waits and placements are rl's the tick before: only the policy that decided differs.
    assert (now.action["assignments"], now.reasons) == (last.action["assignments"], last.reasons)
    # explain says which policy held a job waiting when: a span of the same reason ends where the policy changed.
    from slurm_mig.ops.explain import explain_view

    [waiting] = {j for j, _why in now.reasons}
    spans = [s for s in explain_view(store, waiting)["decisions"]["spans"] if s["what"] == "waiting"]
    assert [(s["policy"], s["first"]) for s in spans] == [(f"rl {last.version}", last.id),
                                                          (f"frag-aware {now.version}", now.id)]
    assert spans[0]["until"] == now.time and spans[0]["reason"] == spans[1]["reason"]


def test_controller_runs_rl_and_shadows_a_candidate(tmp_path, monkeypatch):
    from slurm_mig.policy_registry import PolicyStore

    st = PolicyStore(tmp_path / "store")
    st.add(_copy_model(tmp_path), version="cand-1")  # stored, not active: the candidate
    ctl, store = _controller(PolicyConfig(name="rl", shadow="rl-candidate", fallback="frag-aware"), tmp_path)
    summary = ctl.tick()
    assert summary.get("policy") == "rl" and summary.get("assignments", 0) > 0
    shadow = store.recent_decisions(5, shadow=True)
    live = store.recent_decisions(5, shadow=False)
    assert shadow and shadow[0].policy == "rl-candidate" and shadow[0].version == "cand-1"
    assert live and live[0].policy == "rl"


def _card_with(tmp_path: Path, **changes) -> Path:
    m = _copy_model(tmp_path)
    card = json.loads((m.parent / "model_card.json").read_text())
    for k, v in changes.items():
        if v is None:
            card.pop(k, None)
        else:
            card[k] = v
    (m.parent / "model_card.json").write_text(json.dumps(card))
    return m


def test_the_shipped_card_leaves_placement_to_frag_aware():
    """Measured no better on dev workloads, the network does not place; on single-GPU jobs (no guard) rl is
    frag-aware decision for decision, and the network is never asked."""
    card = json.loads((SHIPPED_MODEL.parent / "model_card.json").read_text())
    assert card["placement"] == "frag-aware" and "dev" in card["placement_note"]
    w, spec = small_workload(seed=11, n=300, multi=0.0), ClusterSpec(2, 8)
    pol = RLPolicy()
    asked = []
    logits = pol.scorer().logits
    pol.scorer().logits = lambda x: (asked.append(1), logits(x))[1]
    rl = compute_metrics(simulate(w, pol, spec, SimConfig(check=True)))
    fa = compute_metrics(simulate(w, FragAwarePolicy(), spec))
    assert (rl.mean_wait_s, rl.reconfigurations, rl.makespan_s) == (fa.mean_wait_s, fa.reconfigurations, fa.makespan_s)
    assert asked == []


def test_a_card_that_lets_the_network_place_differs_from_frag_aware(tmp_path):
    """The same files with placement "network" (as a retrained candidate's card says) leave frag-aware's
    choices; so does a card from before the key existed."""
    w, spec = small_workload(seed=11, n=300, multi=0.0), ClusterSpec(2, 8)
    fa = compute_metrics(simulate(w, FragAwarePolicy(), spec))
    for i, placement in enumerate(("network", None)):
        (tmp_path / str(i)).mkdir()
        m = _card_with(tmp_path / str(i), placement=placement)
        assert OnnxScorer(m).placement == "network"
        rl = compute_metrics(simulate(w, RLPolicy(model_path=str(m)), spec, SimConfig(check=True)))
        assert (rl.mean_wait_s, rl.reconfigurations) != (fa.mean_wait_s, fa.reconfigurations)


@pytest.mark.parametrize("bad", ["Network", "first-fit", "", 1, ["network"]])
def test_an_unknown_placement_refuses_the_model(tmp_path, bad):
    with pytest.raises(PolicyModelError, match="placement must be one of network, frag-aware"):
        OnnxScorer(_card_with(tmp_path, placement=bad))


def _nan_onnx(path: Path, input_name: str, n_in: int, n_out: int | None) -> None:
    """A network that scores every row NaN: sqrt(0 * features - 1)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    out_shape = ["N"] if n_out is None else ["N", n_out]
    w = np.zeros((n_in,) if n_out is None else (n_in, n_out), np.float32)
    b = np.full((1,) if n_out is None else (n_out,), -1.0, np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", [input_name, "W"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["d"]),
         helper.make_node("Sqrt", ["d"], ["logits"])], "nan",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, out_shape)],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))


def _nan_model(tmp_path: Path, where: str) -> Path:
    """A copy of the shipped model whose placement network (``where="model"``) or guard gives NaN."""
    from slurm_mig.policies.rl import GUARD_OPTIONS_H, N_GUARD_FEATURES

    tmp_path.mkdir(exist_ok=True)
    m = _copy_model(tmp_path)
    card = json.loads((m.parent / "model_card.json").read_text())
    card["placement"] = "network"
    if where == "model":
        _nan_onnx(m, "features", N_FEATURES, None)
        card.pop("feature_range", None)
    else:
        _nan_onnx(m.parent / "guard.onnx", "guard_features", N_GUARD_FEATURES, len(GUARD_OPTIONS_H))
        card["guard"].pop("feature_range", None)
    (m.parent / "model_card.json").write_text(json.dumps(card))
    return m


def test_nan_scores_are_a_model_error_not_a_choice(tmp_path):
    """argmax of [nan, nan, ...] is 0: without the check a broken network would be acted on silently."""
    from slurm_mig.policies.rl import N_GUARD_FEATURES

    pol = RLPolicy(model_path=str(_nan_model(tmp_path / "a", "model"))).load()
    rows = [[0.0] * N_FEATURES for _ in range(4)]
    with pytest.raises(PolicyModelError, match="scored 4 of 4 options as NaN"):
        pol.choose(Choice(None, rows, list(range(4)), 0.0))
    guard = OnnxScorer(_nan_model(tmp_path / "b", "guard"))
    with pytest.raises(PolicyModelError, match="the guard of model .* as NaN"):
        guard.guard_logits([0.0] * N_GUARD_FEATURES)


def test_controller_falls_back_with_the_reason_when_the_model_scores_nan(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(_nan_model(tmp_path, "model")))
    ctl, store = _controller(PolicyConfig(name="rl", fallback="frag-aware"), tmp_path)
    summary = ctl.tick()
    assert summary.get("policy") == "frag-aware" and summary.get("assignments", 0) > 0
    events = [e.message for e in store.recent_events(50)]
    assert any("policy rl failed" in e and "NaN or infinite" in e for e in events), events


def test_the_shadow_policy_decides_outside_the_ticks_transaction(tmp_path):
    """The shadow changes nothing, but it decided inside the tick's write transaction, so every node
    request waited for a candidate that may be slower than the live policy (a 503 past the busy
    timeout). It now decides after the commit."""
    from slurm_mig.policies.frag_aware import FragAwarePolicy

    ctl, store = _controller(PolicyConfig(name="frag-aware"), tmp_path)
    seen = []

    class Shadow:
        name, version = "probe", "1"

        def decide(self, state):
            seen.append(store._depth)  # 0: no transaction of the store is open
            return FragAwarePolicy().decide(state)

    ctl.shadow = Shadow()
    ctl.tick()
    assert seen == [0]
    assert store.recent_decisions(5, shadow=True)



def test_a_shadow_decision_is_recorded_when_it_changes_not_every_tick(tmp_path):
    """The live decision is recorded only when it differs from the last one recorded, the shadow's was
    recorded every tick: in a queue where nothing changed, 20 ticks left 1 live decision and 20 shadow ones of
    the same size (each holds the whole state), so the size budget ([controller].keep_decisions_mb) pruned
    the live decision, the one explain reads, while 20 copies of the shadow's stayed (at tick_scale's 128
    GPUs and 500 pending jobs: 13 of 14 decisions recorded were shadow ones, one a tick). The shadow's is
    now recorded as the live one is: when it changes."""
    import dataclasses

    from slurm_mig.policies.frag_aware import FragAwarePolicy

    ctl, store = _controller(PolicyConfig(name="frag-aware"), tmp_path)

    class Shadow:
        name, version = "probe", "1"

        def decide(self, state):
            return dataclasses.replace(FragAwarePolicy().decide(state), policy="probe", version="1")

    ctl.shadow = Shadow()
    ctl.tick()
    ctl.tick()  # the first tick's re-carves are planned now (nothing carries them out here): a new decision
    first = store.db.execute("SELECT MAX(id) FROM decisions").fetchone()[0]
    for _ in range(20):
        ctl.tick()
    live = [d for d in store.recent_decisions(100, shadow=False) if d.id > first - 2]
    shadow = [d for d in store.recent_decisions(100, shadow=True) if d.id > first - 2]
    assert len(live) == 1
    sizes = [r[0] for r in store.db.execute("SELECT bytes FROM decision_bytes ORDER BY id DESC")]
    store.prune(keep_decisions_bytes=4 * max(sizes))  # room for four decisions
    assert live[0].id in [d.id for d in store.recent_decisions(50, shadow=False)]
    assert len(shadow) == 1 and shadow[0].policy == "probe"
    # A change is recorded, by both.
    from slurm_mig.slurm.parsers import SlurmJob
    ctl.slurm._jobs.append(SlurmJob(job_id=200, name="new", user="u", state="PENDING", partition="p", mig={"7g": 1},
                                    tres_per_node="gres:mig:7g:1", submit_time=time.time(), priority=1))
    ctl.tick()
    ctl.tick()
    assert [d.id > first for d in store.recent_decisions(2, shadow=False)] == [True, False]
    assert [d.id > first for d in store.recent_decisions(2, shadow=True)] == [True, False]

def _wide_onnx(path: Path, input_name: str, n_in: int, scores: list[float] | None) -> None:
    """A network giving each row len(scores) outputs (0 * features + scores); scores None: features times
    their own transpose, [N, N] (a width loading cannot check)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if scores is None:
        nodes = [helper.make_node("Transpose", [input_name], ["t"]), helper.make_node("MatMul", [input_name, "t"],
                                                                                     ["logits"])]
        init, shape = [], ["N", "N"]
    else:
        nodes = [helper.make_node("MatMul", [input_name, "W"], ["mm"]), helper.make_node("Add", ["mm", "b"],
                                                                                         ["logits"])]
        init = [numpy_helper.from_array(np.zeros((n_in, len(scores)), np.float32), "W"),
                numpy_helper.from_array(np.asarray(scores, np.float32), "b")]
        shape = ["N", len(scores)]
    g = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["N", n_in])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, shape)], init)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))


def test_a_network_giving_other_than_one_score_per_option_is_a_model_error(tmp_path):
    """Only the input width was checked (and the guard's output width where the file states it): a placement
    network giving 3 scores per row had them flattened, and argmax took candidate 2 of 4 by a score of
    row 0 (past the options: an error naming no cause); a guard giving one score for its 6 options always
    took the first (0 h). Both are now a PolicyModelError saying so, which the controller falls back on."""
    from slurm_mig.policies.rl import N_GUARD_FEATURES

    m = _copy_model(tmp_path)
    card = json.loads((m.parent / "model_card.json").read_text())
    card["placement"] = "network"
    card.pop("feature_range", None)
    card["guard"].pop("feature_range", None)
    (m.parent / "model_card.json").write_text(json.dumps(card))
    _wide_onnx(m, "features", N_FEATURES, [0.0, 0.0, 5.0])
    _wide_onnx(m.parent / "guard.onnx", "guard_features", N_GUARD_FEATURES, None)
    pol = RLPolicy(model_path=str(m)).load()
    rows = [[0.0] * N_FEATURES for _ in range(4)]
    with pytest.raises(PolicyModelError, match="gave 12 scores for 4 options"):
        pol.choose(Choice(None, rows, list(range(4)), 0.0))
    with pytest.raises(PolicyModelError, match="the guard of model .* gave 1 scores for 6 options"):
        pol.scorer().guard_logits([0.0] * N_GUARD_FEATURES)


def test_a_card_of_the_wrong_shape_is_a_model_error_and_the_old_model_is_not_kept(tmp_path):
    """A card that is JSON but not an object, or whose feature lists are not lists, raised AttributeError or
    TypeError out of the model check; the rl policy kept the model it had loaded before and, for 5 s after
    each such failure, decided with it again instead of falling back."""
    m = _copy_model(tmp_path)
    good = json.loads((m.parent / "model_card.json").read_text())
    guard_features = {**good, "guard": {**good["guard"], "features": 7}}
    for card in ([1, 2], {**good, "features": 46}, guard_features):
        pol = RLPolicy(model_path=str(m))
        (m.parent / "model_card.json").write_text(json.dumps(good))
        pol.load()
        (m.parent / "model_card.json").write_text(json.dumps(card))
        pol._checked_at -= 10  # as if 10 s had passed
        with pytest.raises(PolicyModelError, match="JSON object|feature list"):
            pol.load()
        with pytest.raises(PolicyModelError, match="JSON object|feature list"):  # not the old model
            pol.load()


@pytest.mark.parametrize("fallback", ["rl", "rl-candidate"])
def test_a_learned_fallback_is_refused_by_the_config(fallback):
    """[policy].fallback = "rl" (or "rl-candidate") was accepted: with a model that does not load, the fallback
    failed the same way inside the live policy's except, the tick raised, nothing was placed, and the loop
    logged a traceback every tick. Found by a Controller with PolicyConfig(name="rl", fallback="rl") and a
    model of another feature schema: tick() raised PolicyModelError. The config now refuses it, naming the
    heuristic to use."""
    from slurm_mig.config import parse_config_text
    from slurm_mig.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\[policy\]\.fallback.*frag-aware"):
        parse_config_text(f'[policy]\nname = "rl"\nfallback = "{fallback}"\n')
    assert parse_config_text('[policy]\nname = "rl"\nfallback = "frag-aware"\n').policy.fallback == "frag-aware"


def test_the_controller_takes_the_model_pins_in_the_documented_order(tmp_path, monkeypatch):
    """$SLURM_MIG_RL_MODEL wins over [policy].model_path (docs/rl-policy.md, "Serving"; `policy install` names it
    as the pin), but the controller passed [policy].model_path as the policy's model_path option, which wins over
    both: with both set it ran the config's model while install's warning and retrain (fine-tuning and judging
    the env's) spoke of the other. Found by a Controller with model_path and the variable naming two models."""
    from slurm_mig.config import PolicyConfig

    (tmp_path / "env").mkdir(), (tmp_path / "cfg").mkdir()
    env_model, cfg_model = _copy_model(tmp_path / "env"), _copy_model(tmp_path / "cfg")
    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(env_model))
    ctl, _store = _controller(PolicyConfig(name="rl", fallback="frag-aware", model_path=str(cfg_model)), tmp_path)
    assert ctl.policy.scorer().path == env_model
    monkeypatch.delenv("SLURM_MIG_RL_MODEL")
    ctl, _store = _controller(PolicyConfig(name="rl", fallback="frag-aware", model_path=str(cfg_model)), tmp_path)
    assert ctl.policy.scorer().path == cfg_model


def _stored(tmp_path: Path) -> Path:
    """The store of rl_isolated ($SLURM_MIG_POLICY_STORE), with the shipped model as version v1, active."""
    store = tmp_path / "store"
    store.mkdir()
    _copy_model(store)
    (store / "m").rename(store / "v1")
    (store / "active").write_text("v1\n")
    return store / "v1" / "model.onnx"


# (what is made writable by others, how the model is named) -> (the path the message names, the chmod that fixes it)
_OPEN_TO_OTHERS = {
    "the store": ("store", lambda s, m: (s, 0o777)),
    "the store's active": ("store", lambda s, m: (s / "active", 0o666)),
    "the version's folder": ("store", lambda s, m: (m.parent, 0o777)),
    "the version's model.onnx": ("store", lambda s, m: (m, 0o666)),
    "a folder above the store": ("store", lambda s, m: (s.parent, 0o777)),
    "the pinned model": ("env", lambda s, m: (m, 0o666)),
    "the pinned model's card": ("env", lambda s, m: (m.parent / "model_card.json", 0o666)),
    "the pinned model's guard": ("config", lambda s, m: (m.parent / "guard.onnx", 0o666)),
    "the pinned model's sticky folder": ("config", lambda s, m: (m.parent, 0o1777)),
    "the shipped model": ("shipped", lambda s, m: (m, 0o666)),
}


def _model_placed(how: str, tmp_path, monkeypatch):
    """(the policy config, the model file) with a copy of the shipped model where ``how`` says the controller finds
    it: a store version ("store"), $SLURM_MIG_RL_MODEL ("env"), [policy].model_path ("config") or the shipped
    model's place ("shipped")."""
    pol = PolicyConfig(name="rl", fallback="frag-aware")
    if how == "store":
        return pol, _stored(tmp_path)
    (tmp_path / "p").mkdir()
    m = _copy_model(tmp_path / "p")
    if how == "env":
        monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(m))
    elif how == "config":
        pol = PolicyConfig(name="rl", fallback="frag-aware", model_path=str(m))
    else:
        monkeypatch.setattr("slurm_mig.policies.rl.SHIPPED_MODEL", m)
    return pol, m


@pytest.mark.parametrize("case", list(_OPEN_TO_OTHERS))
def test_the_controller_refuses_a_model_others_may_write_and_its_fallback_places(tmp_path, monkeypatch, caplog, case):
    """`policy install` refused a store others may write, but the controller ran whatever the store's active
    version, a [policy].model_path or a $SLURM_MIG_RL_MODEL file was, whoever could write it (or its card, its
    guard, the folder holding them, the store or its 'active'): they chose where root's controller put every
    job. Found by chmod 0777/0666 on each in turn and a tick: decided by rl every time. Refused now by the
    store's rule (folders.writable_by_others): one error line naming the file and the chmod, the fallback places the
    jobs, and the model runs again once the mode is fixed."""
    import logging
    import os

    how, which = _OPEN_TO_OTHERS[case]
    pol, m = _model_placed(how, tmp_path, monkeypatch)
    path, mode = which(tmp_path / "store", m)
    old = os.stat(path).st_mode & 0o7777
    os.chmod(path, mode)
    try:
        ctl, store = _controller(pol, tmp_path)
        with caplog.at_level(logging.WARNING, logger="slurm_mig.controller"):
            summary = ctl.tick()
        assert summary.get("policy") == "frag-aware" and summary.get("assignments", 0) > 0
        lines = [r for r in caplog.records if "refusing to run the rl model" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno >= logging.WARNING, caplog.records
        assert f"`chmod o-w {path}`" in lines[0].getMessage() and str(m) in lines[0].getMessage()
        events = [e.message for e in store.recent_events(50) if e.message.startswith("policy rl failed")]
        assert len(events) == 1 and f"`chmod o-w {path}`" in events[0], events
    finally:
        os.chmod(path, old)
    ctl.policy._checked_at -= 10  # as if 10 s had passed
    assert ctl.policy.load().scorer().path == m


def test_a_model_in_a_sticky_folder_above_its_own_is_run(tmp_path, monkeypatch):
    """A folder anyone may write that is sticky (as /tmp), above the model's own folder: others cannot rename
    what is not theirs there, so the model runs, as `policy install` writes such a store."""
    tmp_path.chmod(0o1777)
    try:
        m = _stored(tmp_path)
        assert get_policy("rl").load().scorer().path == m
    finally:
        tmp_path.chmod(0o700)


def test_the_shadow_candidate_is_refused_when_others_may_write_it(tmp_path):
    """rl-candidate (the shadow) runs the newest non-active version of the store in the same process: the same
    rule holds for it."""
    m = _stored(tmp_path)
    (m.parent.parent / "active").write_text("default\n")
    m.parent.chmod(0o777)
    try:
        with pytest.raises(PolicyModelError, match=f"chmod o-w {m.parent}"):
            get_policy("rl-candidate").load()
    finally:
        m.parent.chmod(0o755)
    pol = get_policy("rl-candidate")
    assert pol.load().scorer().path == m


# (what another user owns, or its group may write, how the model is named) -> (the path, the change)
_OWNED_BY_ANOTHER = {
    "the pinned model": ("env", lambda s, m: (m, "chown")),
    "the pinned model's card": ("config", lambda s, m: (m.parent / "model_card.json", "chown")),
    "the pinned model's guard": ("config", lambda s, m: (m.parent / "guard.onnx", "chown")),
    "the pinned model's folder": ("env", lambda s, m: (m.parent, "chown")),
    "a folder above the pinned model": ("env", lambda s, m: (m.parent.parent, "chown")),
    "the store": ("store", lambda s, m: (s, "chown")),
    "the store's active": ("store", lambda s, m: (s / "active", "chown")),
    "the version's model.onnx": ("store", lambda s, m: (m, "chown")),
    "the shipped model": ("shipped", lambda s, m: (m, "chown")),
    "the pinned model, group-writable": ("env", lambda s, m: (m, "g+w")),
    "the pinned model's folder, group-writable": ("config", lambda s, m: (m.parent, "g+w")),
}


@pytest.mark.parametrize("case", list(_OWNED_BY_ANOTHER))
def test_the_controller_refuses_a_model_another_user_owns(tmp_path, monkeypatch, caplog, case):
    """writable_by_others judged modes only: a pinned model ($SLURM_MIG_RL_MODEL, [policy].model_path), a store
    version, the shipped model, their card, guard or folder owned by another user (uid 65534; file 0644, folder
    0755) was run by root's controller, whose owner may rewrite or rename it at will (and one its group may write,
    every member). Found by chown 65534 on a pinned model.onnx and a Controller tick: rl decided. Refused now as
    the config and the state database are (owned by root or by the process's user, writable by the owner only):
    the fallback places the jobs, the error names the file and the fix."""
    import logging
    import os

    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    how, which = _OWNED_BY_ANOTHER[case]
    pol, m = _model_placed(how, tmp_path, monkeypatch)
    path, change = which(tmp_path / "store", m)
    st = os.stat(path)
    if change == "chown":
        os.chown(path, 65534, 65534)
        fix = f"`chown root {path}`"
    else:
        os.chmod(path, st.st_mode & 0o7777 | 0o020)
        fix = f"`chmod g-w {path}`"
    try:
        ctl, store = _controller(pol, tmp_path)
        with caplog.at_level(logging.WARNING, logger="slurm_mig.controller"):
            summary = ctl.tick()
        assert summary.get("policy") == "frag-aware" and summary.get("assignments", 0) > 0
        lines = [r.getMessage() for r in caplog.records if "refusing to run the rl model" in r.getMessage()]
        assert len(lines) == 1 and fix in lines[0] and str(m) in lines[0], lines
    finally:
        os.chown(path, st.st_uid, st.st_gid)
        os.chmod(path, st.st_mode & 0o7777)
    ctl.policy._checked_at -= 10  # as if 10 s had passed
    assert ctl.policy.load().scorer().path == m


def test_the_controller_takes_model_path_from_its_own_config_only(tmp_path, monkeypatch):
    """Without [policy].model_path in the controller's config, the rl policy looked the setting up in the config
    load_config finds ($SLURM_MIG_CONFIG, else /etc/slurm-mig/slurm-mig.toml) on every re-resolution: another file
    than `slurm-mig --config A controller` started on, and one nobody had judged (the controller refuses an
    untrusted config of its own). Found by a Controller on a config without model_path and $SLURM_MIG_CONFIG
    naming another, mode 0666, with model_path: the controller ran that model. It takes the setting from its own
    config now; $SLURM_MIG_RL_MODEL still wins over it, as documented."""
    from slurm_mig.config import PolicyConfig

    monkeypatch.undo()  # not rl_isolated's stand-in for the config lookup: the real one
    monkeypatch.delenv("SLURM_MIG_RL_MODEL", raising=False)
    monkeypatch.setenv("SLURM_MIG_POLICY_STORE", str(tmp_path / "store"))
    (tmp_path / "other").mkdir()
    other_model = _copy_model(tmp_path / "other")
    other = tmp_path / "other.toml"
    other.write_text(f'[policy]\nmodel_path = "{other_model}"\n')
    other.chmod(0o666)
    monkeypatch.setenv("SLURM_MIG_CONFIG", str(other))
    ctl, _store = _controller(PolicyConfig(name="rl", fallback="frag-aware"), tmp_path)
    assert ctl.policy.scorer().path == SHIPPED_MODEL
    (tmp_path / "env").mkdir()
    env_model = _copy_model(tmp_path / "env")
    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(env_model))
    ctl, _store = _controller(PolicyConfig(name="rl", fallback="frag-aware"), tmp_path)
    assert ctl.policy.scorer().path == env_model
