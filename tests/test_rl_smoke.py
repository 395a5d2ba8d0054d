"""Training side of the rl policy (needs the training extra: torch==2.13.0, gymnasium, onnx, onnxscript):
the gymnasium environment, exact snapshot branching, a tiny training run exported to ONNX, and
retraining from a state DB filled with outcomes. Kept under a minute in all."""

from __future__ import annotations

import json
import random
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # training/ is a folder of the checkout, not an installed package
    sys.path.insert(0, str(ROOT))

# CI must run these: a missing training extra fails them (with the fix) instead of skipping.
try:
    import torch

    from slurm_mig.policies.rl import (
        FEATURE_NAMES, FEATURE_SCHEMA, N_FEATURES, OnnxScorer, RLPolicy, frag_aware_chooser,
    )
    from slurm_mig.sim.engine import ClusterSpec, SimConfig, simulate
    from slurm_mig.sim.workloads import poisson_workload
    from training.env import MigPlacementEnv
    from training.splits import TEST_FAMILIES, Case, heldout_cases, train_case

    torch.set_num_threads(1)
    MISSING = ""
except ImportError as exc:  # pragma: no cover - only without the extra
    MISSING = f"{exc}; install the training extra: pip install torch==2.13.0 && pip install -e '.[train]'"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    if MISSING:
        pytest.fail(MISSING)
    monkeypatch.delenv("SLURM_MIG_RL_MODEL", raising=False)
    monkeypatch.setenv("SLURM_MIG_POLICY_STORE", str(tmp_path / "store"))
    monkeypatch.setattr("slurm_mig.policies.rl._config_model_path", lambda: "")


def test_env_follows_the_gymnasium_api_and_rewards_sum_to_the_total_wait():
    from gymnasium.utils.env_checker import check_env

    w = poisson_workload(200, gpus=16, load=0.95, seed=3)
    case = Case("t", w, ClusterSpec(2, 8))
    env = MigPlacementEnv([case])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unbounded Box warnings
        check_env(env, skip_render_check=True)
    obs, info = env.reset(options={"case": case})
    assert obs["features"].shape == (32, N_FEATURES) and env.action_masks().sum() == info["n"] >= 2
    with pytest.raises(ValueError, match="masked"):
        env.step(info["n"])
    total, done = info["cost_before_s"], False
    while not done:
        obs, r, done, _, info = env.step(0)
        total += -r * 3600 * 16
    sim = simulate(w, RLPolicy(chooser=frag_aware_chooser), ClusterSpec(2, 8))
    assert total == pytest.approx(sum(x.start - x.job.submit_time for x in sim.jobs), rel=1e-9)
    env.close()


def test_training_and_test_workloads_never_overlap():
    rng = random.Random(0)
    test_names = {c.name for c in heldout_cases(seeds=(101,))}
    assert set(TEST_FAMILIES) >= test_names - {"alibaba-late"}
    for _ in range(30):
        c = train_case(rng, jobs=(20, 30), families=("poisson", "rl-good_scaling", "rl-bad_scaling", "rl-mix_soft"))
        assert c.seed >= 1000 and c.name not in TEST_FAMILIES


def _mid_snapshot(f):
    """A small training case played greedily by ``f``: (case, recorded run, a middle decision, its
    snapshot, its time)."""
    from training.train import run_greedy

    c = train_case(random.Random(7), jobs=(200, 250), families=("poisson",))
    main = run_greedy(c, f, 32, record=True)
    ds = sorted({p[0] for p in main["points"]})
    d = ds[len(ds) // 2]
    snap = run_greedy(c, f, 32, snap_at={d})["snaps"][d]
    t = next(t0 for dd, t0, *_ in main["timeline"] if dd == d)
    return c, main, d, snap, t


def test_snapshot_branches_replay_exactly():
    from training.model import Scorer
    from training.train import run_greedy, window_cost

    m = Scorer()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    f = m.numpy_forward()
    c, main, d, snap, t = _mid_snapshot(f)
    branch = run_greedy(c, f, 32, start=snap, t_end=t + 3 * 3600)
    assert branch["cost"] == pytest.approx(window_cost(main["timeline"], d, t + 3 * 3600), rel=1e-12)


def test_probe_futures_hide_nothing_the_policy_sees_and_change_only_run_times():
    import pickle

    from training.probe import jittered
    from training.train import run_greedy

    fa = lambda x: -np.arange(len(x), dtype=np.float32)  # noqa: E731 - frag-aware's choice
    c, _main, _d, snap, t = _mid_snapshot(fa)
    assert jittered(snap, 0, 0.05) is snap
    same = run_greedy(c, fa, 32, start=jittered(snap, 1, 0.0), t_end=t + 3 * 3600)["cost"]
    assert same == pytest.approx(run_greedy(c, fa, 32, start=snap, t_end=t + 3 * 3600)["cost"], rel=1e-12)
    sim0, state0, _ = pickle.loads(snap)
    costs = set()
    for redraw in (False, True):
        sim, state, _ = pickle.loads(jittered(snap, 1, 0.05, redraw))
        assert state == state0  # what the policy sees at the choice is the same
        running = [r for r in sim.records.values() if r.start <= sim.now < r.end]
        assert running
        moved = 0
        for r in running:
            r0 = sim0.records[r.job.job_id]
            assert sim.now < r.end <= r.start + max(r.job.time_limit_s, r0.duration) + 1e-6
            moved += r.end != r0.end
            assert (r.end, 0) in {(e[0], e[1]) for e in sim.events if e[3] == r.job.job_id}
        assert moved  # the hidden run times did change
        costs.add(run_greedy(c, fa, 32, start=jittered(snap, 1, 0.05, redraw), t_end=t + 3 * 3600)["cost"])
    assert len(costs) == 2


def test_smoke_training_exports_a_model_the_runtime_accepts(tmp_path):
    from training.train import parse_args, train

    t0 = time.time()
    model, card = train(parse_args(["--smoke", "--out", str(tmp_path / "run")]), echo=False)
    assert time.time() - t0 < 45
    onnx = tmp_path / "run" / "model.onnx"
    written = json.loads((tmp_path / "run" / "model_card.json").read_text())
    assert written["feature_schema"] == FEATURE_SCHEMA and written["version"] == card["version"]
    assert written["placement"] == "network"  # a trained network places; the shipped card is the exception
    assert not (tmp_path / "run" / "model.onnx.data").exists()  # one self-contained file
    rng_ = written["feature_range"]  # the rows trained on: the runtime lets the network decide only inside
    assert len(rng_["lo"]) == len(rng_["hi"]) == N_FEATURES and all(a <= b for a, b in zip(rng_["lo"], rng_["hi"]))
    assert rng_["hi"][FEATURE_NAMES.index("job_no_limit")] == 0.0  # no training job lacks a time limit
    scorer = OnnxScorer(onnx)
    assert scorer.range is not None
    from slurm_mig.policy_registry import check_weights
    from training.model import load_weights

    check_weights(tmp_path / "run" / "model.pt")  # what training writes, `policy install` takes
    assert load_weights(tmp_path / "run" / "model.pt")["card"]["version"] == card["version"]
    x = np.random.default_rng(0).standard_normal((7, N_FEATURES)).astype(np.float32)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    assert np.allclose(scorer.logits(x), ref, atol=1e-4)
    w = poisson_workload(150, gpus=16, load=0.95, seed=11)
    r = simulate(w, RLPolicy(model_path=str(onnx)), ClusterSpec(2, 8), SimConfig(check=True))
    assert r.unfinished == 0


def test_guard_smoke_training_exports_a_guard_the_runtime_accepts(tmp_path):
    from slurm_mig.policies.rl import GUARD_OPTIONS_H, N_GUARD_FEATURES
    from training.guard import Args, GuardNet, carry_guard, train as train_guard

    t0 = time.time()
    r = train_guard(Args(out=str(tmp_path / "g"), smoke=True, workers=1), log=lambda m: None)
    assert time.time() - t0 < 45
    sc = OnnxScorer(r["model"])
    assert sc.guard_session is not None and sc.guard_options == GUARD_OPTIONS_H
    g_range = json.loads((tmp_path / "g" / "model_card.json").read_text())["guard"]["feature_range"]
    assert len(g_range["lo"]) == N_GUARD_FEATURES and sc.guard_range is not None
    ck = torch.load(str(tmp_path / "g" / "guard.pt"), map_location="cpu", weights_only=True)
    net = GuardNet(hidden=ck["hidden"])
    net.load_state_dict(ck["state_dict"])
    x = np.random.default_rng(1).standard_normal((5, N_GUARD_FEATURES)).astype(np.float32)
    with torch.no_grad():
        ref = net(torch.from_numpy(x)).numpy()
    for row, want in zip(x, ref):
        assert np.allclose(sc.guard_logits(row.tolist()), want, atol=1e-4)
    w = poisson_workload(150, gpus=16, load=0.98, seed=12, multi_gpu_share=0.3)
    res = simulate(w, RLPolicy(model_path=r["model"]), ClusterSpec(2, 8), SimConfig(check=True))
    assert res.unfinished == 0
    # a model folder without a guard gets this one (what retraining does for its candidate)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model_card.json").write_text(json.dumps({"feature_schema": FEATURE_SCHEMA}))
    assert carry_guard(r["model"], plain)
    assert json.loads((plain / "model_card.json").read_text())["guard"]["file"] == "guard.onnx"
    assert (plain / "guard.onnx").read_bytes() == (tmp_path / "g" / "guard.onnx").read_bytes()


def _fill_db(path: Path, n: int = 40) -> None:
    """A state DB as the demo cluster leaves it: one node, two GPUs, ``n`` finished jobs."""
    from slurm_mig.store import open_store

    store = open_store(str(path))
    gpus = [{"gpu": g, "uuid": f"GPU-{g}", "model": "H100-80GB", "mig_enabled": True} for g in (0, 1)]
    store.replace_observed("n1", gpus, [], now=1000.0)
    rng = random.Random(1)
    t = 1000.0
    for i in range(n):
        t += rng.uniform(0, 30)
        prof = rng.choice(["1g", "2g", "3g", "1g", "7g"])
        run = rng.uniform(20, 200)
        start = t + rng.uniform(0, 20)
        store.record_outcome(str(i + 1), state="COMPLETED", profile=prof, count=1, node="n1", submit_time=t,
                             start_time=start, end_time=start + run, time_limit_s=600.0, now=start + run)
    store.close()


def test_retrain_on_a_db_gives_a_candidate_an_evaluation_and_a_decision(tmp_path):
    from training.retrain import format_report, retrain

    db = tmp_path / "state.db"
    _fill_db(db)
    t0 = time.time()
    r = retrain(db, store=tmp_path / "store", minutes=0.1, iterations=1, out=tmp_path / "work")
    assert time.time() - t0 < 40
    assert r["outcomes"] == 40 and r["heldout_jobs"] == 12 and r["history_jobs"] == 28
    assert r["cluster"] == {"nodes": 1, "gpus_per_node": 2, "model": "H100-80GB"}
    assert Path(r["candidate"]["path"]).is_file()
    assert set(r["evaluation"]) == {"candidate", "current", "frag-aware", "first-fit"}
    assert r["replays"] == 5 and len(r["paired"]["wait_diffs_s"]) == 5
    assert r["paired"]["wait_diff_s"] == pytest.approx(
        r["evaluation"]["candidate"]["mean_wait_s"] - r["evaluation"]["current"]["mean_wait_s"])
    assert r["decision"] in ("stored", "kept current")
    shipped_guard = json.loads((ROOT / "policy" / "model_card.json").read_text())["guard"]
    cand_card = json.loads((Path(r["candidate"]["path"]).parent / "model_card.json").read_text())
    assert cand_card["guard"] == shipped_guard  # retraining fine-tunes placement; the guard is carried over
    assert cand_card["placement"] == "network"  # the candidate's network places: that is what the replays judge
    parent = json.loads((ROOT / "policy" / "model_card.json").read_text())["feature_range"]
    got = cand_card["feature_range"]  # the parent's range widened by the rows fine-tuned on, never narrower
    assert all(a <= b for a, b in zip(got["lo"], parent["lo"])) and all(a >= b for a, b in zip(got["hi"], parent["hi"]))
    stored = (tmp_path / "store").is_dir() and any((tmp_path / "store").iterdir())
    assert stored == (r["decision"] == "stored")
    assert "decision:" in format_report(r)
    caps = r["hold_caps"]["rows"]  # what [policy].rl_max_hold_h would have done, on the same replays
    assert [c["cap_h"] for c in caps] == [0, 6, 12, 24, 48]
    assert caps[0]["mean_wait_s"] == pytest.approx(r["evaluation"]["frag-aware"]["mean_wait_s"])  # 0 h: frag-aware
    assert caps[-1]["mean_wait_s"] == pytest.approx(r["evaluation"]["current"]["mean_wait_s"])  # 48 h: as shipped
    assert "rl_max_hold_h with the current policy" in format_report(r)


@pytest.mark.parametrize("caps, message", [("6,x", "hours separated by commas"), ("-1", "between 0 and 720"),
                                           ("800", "between 0 and 720"), ("nan", "between 0 and 720")])
def test_retrain_refuses_bad_hold_caps_before_training(tmp_path, caps, message):
    from slurm_mig.errors import ConfigError
    from training.retrain import check_hold_caps, retrain

    db = tmp_path / "state.db"
    _fill_db(db)
    with pytest.raises(ConfigError, match=message):
        retrain(db, store=tmp_path / "store", minutes=0.1, iterations=1, out=tmp_path / "work", hold_caps=caps)
    assert not (tmp_path / "work").exists()  # refused before anything was trained
    assert check_hold_caps("48, 0,12,") == (0.0, 12.0, 48.0) and check_hold_caps("") == ()


def _m(waits, jcts=None):
    return [{"mean_wait_s": w, "mean_jct_s": j} for w, j in zip(waits, jcts or [w + 1000 for w in waits])]


def test_retrain_judges_by_the_paired_interval_not_one_replay():
    from training.retrain import judge

    ok, why, p = judge(_m([100, 101, 99, 100, 98]), _m([110, 111, 109, 112, 108]), 0.005)
    assert ok and why == "" and p["wait_diff_s"] == pytest.approx(-10.4) and p["wait_diff_ci95_s"] < 10.4
    # lower on average, but the replays disagree: the interval reaches zero
    ok, why, p = judge(_m([100, 130, 80, 95, 90]), _m([110, 100, 105, 100, 104]), 0.005)
    assert not ok and "interval" in why and p["wait_diff_s"] < 0
    assert p["wait_diffs_s"][0] < 0  # the first replay alone would have said "better"
    ok, why, _ = judge(_m([100, 100]), _m([100, 100]), 0.005)  # identical decisions
    assert not ok and why == "waits no less"
    ok, why, _ = judge(_m([99.8, 99.9, 99.7]), _m([100, 100, 100]), 0.005)  # below the margin
    assert not ok and why == "waits no less"
    ok, why, _ = judge(_m([90, 91, 89], [2000, 2000, 2000]), _m([100, 100, 100], [1900, 1900, 1900]), 0.005)
    assert not ok and "JCT" in why
    ok, why, p = judge(_m([90]), _m([100]), 0.005)  # one replay: no interval, never enough
    assert not ok and p["wait_diff_ci95_s"] is None
    # Waits are averaged over the jobs that ran: a candidate that starves some must not look better.
    starving = _m([50, 51, 49])
    starving[1]["unfinished"] = 3
    ok, why, p = judge(starving, _m([100, 100, 100]), 0.005)
    assert not ok and "3 more job(s) unrun" in why and p["unfinished_diffs"] == [0, 3, 0]


def test_replays_move_run_times_within_limits_and_keep_the_jobs():
    from training.retrain import replay_of

    w = poisson_workload(200, gpus=4, seed=3)
    assert replay_of(w, 0, 0.05) is w
    r1, r1b, r2 = replay_of(w, 1, 0.05), replay_of(w, 1, 0.05), replay_of(w, 2, 0.05)
    assert [j.duration_s for j in r1.jobs] == [j.duration_s for j in r1b.jobs]  # deterministic
    assert [j.duration_s for j in r1.jobs] != [j.duration_s for j in r2.jobs]
    for a, b in zip(w.jobs, r1.jobs):
        assert (a.job_id, a.submit_time, a.profile, a.count, a.time_limit_s) == (
            b.job_id, b.submit_time, b.profile, b.count, b.time_limit_s)
        assert b.duration_s <= b.time_limit_s
        assert abs(b.duration_s - a.duration_s) <= 0.05 * a.duration_s + 1e-9 or b.duration_s == b.time_limit_s
    assert sum(a.duration_s != b.duration_s for a, b in zip(w.jobs, r1.jobs)) > 150


class _RunsCode:
    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def __reduce__(self):
        return (Path.touch, (self.mark,))


def test_retrain_loads_the_active_model_pt_as_weights_only(tmp_path, monkeypatch):
    """A model.pt that got into the store some other way than `policy install` still runs nothing."""
    from slurm_mig.errors import ConfigError
    from slurm_mig.policy_registry import check_weights
    from training.model import load_weights
    from training.retrain import retrain

    for shipped in ("default.pt", "guard.pt"):
        check_weights(ROOT / "policy" / shipped)
        assert "state_dict" in load_weights(ROOT / "policy" / shipped)
    mark = tmp_path / "ran"
    v1 = tmp_path / "store" / "v1"
    v1.mkdir(parents=True)
    for f in ("model_card.json", "guard.onnx"):
        (v1 / f).write_bytes((ROOT / "policy" / f).read_bytes())
    (v1 / "model.onnx").write_bytes((ROOT / "policy" / "default.onnx").read_bytes())
    torch.save({"state_dict": _RunsCode(mark)}, v1 / "model.pt")
    (tmp_path / "store" / "active").write_text("v1\n")
    db = tmp_path / "state.db"
    _fill_db(db)
    with pytest.raises(ConfigError, match="not a plain torch weights file"):
        retrain(db, store=tmp_path / "store", minutes=0.1, iterations=1, out=tmp_path / "work")
    assert not mark.exists()


def test_retrain_refuses_one_replay(tmp_path):
    from slurm_mig.errors import ConfigError
    from training.retrain import retrain

    db = tmp_path / "state.db"
    _fill_db(db)
    with pytest.raises(ConfigError, match="replays"):
        retrain(db, store=tmp_path / "store", minutes=0.1, iterations=1, replays=1, out=tmp_path / "work")


def test_no_job_is_both_trained_on_and_scored_at_any_db_size():
    """The held-out window starts exactly where the training history ends (the float share made
    223 sizes in 10..4999 score the newest training job, e.g. 22 jobs: trained on 0-14, scored 14-21)."""
    from slurm_mig.sim.workloads import Job, Workload
    from training.retrain import holdout_cut

    jobs = [Job(str(i), float(i), "1g", 1, 60.0) for i in range(4999)]
    for n in range(10, 5000):
        for holdout in ((0.3,) if n % 97 else (0.05, 0.1, 0.25, 0.3, 0.5, 0.8)):
            cut = holdout_cut(n, holdout)
            w = Workload("w", jobs[:n], "H100-80GB", 1, 8)
            trained = {j.job_id for j in w.jobs[:cut]}  # what _window(w, 0, cut) trains on
            scored = Case("recent", w, ClusterSpec(1, 8), score_index=(cut, n)).scored_ids()
            assert not trained & scored and len(trained) + len(scored) == n, (n, holdout, cut)
            assert len(scored) == max(1, round(holdout * n))


_SLOW_SEED: list[int] = []


def _play_first_slowly(job: tuple) -> dict:
    """guard.play_options' shape, at once; the first episode finishes last (module level: the pool pickles it)."""
    from slurm_mig.policies.rl import GUARD_OPTIONS_H, N_GUARD_FEATURES

    case = job[0]
    if case.seed in _SLOW_SEED:
        time.sleep(1.5)
    r = random.Random(case.seed)
    return {"case": case.name, "seed": case.seed, "waits": [r.uniform(100, 200) for _ in GUARD_OPTIONS_H],
            "contexts": [[r.random() for _ in range(N_GUARD_FEATURES)] for _ in range(3)]}


def test_guard_training_keeps_the_episodes_in_seed_order_with_workers(tmp_path, monkeypatch):
    """The same seed gives the same guard: with workers > 1 the episodes came back in the order they
    finished (imap_unordered), and the PPO batches index the rows by that order."""
    import training.guard as guard

    rng = random.Random(5)
    want = [guard.guard_case(rng, smoke=True).seed for _ in range(4)]
    _SLOW_SEED[:] = [want[0]]
    monkeypatch.setattr(guard, "play_options", _play_first_slowly)
    monkeypatch.setattr(guard, "validation_set", lambda smoke: [])
    guard.train(guard.Args(out=str(tmp_path / "g"), smoke=True, seed=5, workers=2), log=lambda m: None)
    played = json.loads((tmp_path / "g" / "played.json").read_text())
    assert [ep["seed"] for ep in played] == want


def test_retrain_without_the_alibaba_trace_never_draws_an_alibaba_episode(tmp_path, monkeypatch):
    """A site has no ../shared/traces: retrain's episodes drew alibaba-early from train_case's default
    families and raised FileNotFoundError mid-run (defaults, seed 0: at iteration 11)."""
    import training.retrain as retrain_mod
    import training.splits as splits

    monkeypatch.setattr(splits, "default_trace", lambda: None)
    monkeypatch.setattr(splits, "_ALIBABA_CACHE", {})
    got = {}

    class Stop(Exception):
        pass

    def fake_train(args, *, sample_case, **kw):
        got["args"], got["sample"] = args, sample_case
        raise Stop

    monkeypatch.setattr(retrain_mod, "train", fake_train)
    db = tmp_path / "state.db"
    _fill_db(db)
    with pytest.raises(Stop):
        retrain_mod.retrain(db, store=tmp_path / "store", out=tmp_path / "work")
    assert "alibaba-early" not in got["args"].families  # what the card says it trained on
    rng = random.Random(0)
    for _ in range(120):  # 60 iterations x 2 episodes, the defaults
        got["sample"](rng)


def test_retrains_trace_has_both_runs_of_a_reused_job_id(tmp_path, monkeypatch):
    """A job id that ran twice (Slurm reused it, or requeued it after it ended): its second run's outcome
    was dropped, so the trace lacked it; both are jobs of the history now, under ids of their own."""
    import training.retrain as retrain_mod
    from slurm_mig.store import open_store

    got = {}

    class Stop(Exception):
        pass

    def fake_train(args, *, vcases, **kw):
        got["history"] = vcases[0].workload
        raise Stop

    monkeypatch.setattr(retrain_mod, "train", fake_train)
    db = tmp_path / "state.db"
    _fill_db(db)
    store = open_store(str(db))
    store.upsert_job("500", profile="3g", submit_time=900.0, time_limit_s=600.0, now=900.0)
    for start, end in ((905.0, 950.0), (965.0, 995.0)):  # before the others: in the history
        if start > 905.0:
            store.restart_job("500", now=960.0, reason="live in Slurm again")
        store.set_job_state("500", "RUNNING", now=start, node="n1")
        assert store.record_outcome("500", state="COMPLETED", exit_code=0, end_time=end, now=end)
        store.set_job_state("500", "COMPLETED", now=end)
    store.close()
    said = []
    with pytest.raises(Stop):
        retrain_mod.retrain(db, store=tmp_path / "store", out=tmp_path / "work", log=said.append)
    assert said[0].startswith("42 outcomes from")
    ids = [j.job_id for j in got["history"].jobs]
    assert len(ids) == len(set(ids))
    runs = {j.job_id: j.duration_s for j in got["history"].jobs if j.job_id.startswith("500")}
    assert runs == {"500": 45.0, "500#2": 30.0}


def test_guard_training_with_no_multi_gpu_query_says_so(tmp_path, capsys):
    """A played.json where no multi-GPU job was ever blocked gave a torch error ("cannot sample
    n_sample <= 0 samples"); it is now said in words."""
    import training.guard as guard
    from slurm_mig.policies.rl import GUARD_OPTIONS_H

    played = tmp_path / "played.json"
    played.write_text(json.dumps([{"case": "c", "seed": 1, "waits": [100.0] * len(GUARD_OPTIONS_H),
                                   "contexts": []}]))
    rc = guard.main(["--out", str(tmp_path / "g"), "--smoke", "--played", str(played)])
    assert rc == 2
    assert "nothing to learn" in capsys.readouterr().err


def test_retrain_replays_on_the_mig_gpus_of_the_db_not_every_gpu(tmp_path):
    """cluster_of counted every row of the gpus table: a site with one node of 2 MIG H100s beside nodes whose
    GPUs take no MIG job (MIG mode off, or a model without MIG) was replayed on 3 x 4 H100s, six times the
    GPUs its MIG jobs had, where no policy waits and a candidate can never be judged better."""
    from slurm_mig.store import open_store
    from training.retrain import cluster_of

    db = tmp_path / "state.db"
    _fill_db(db)
    assert cluster_of(db) == (1, 2, "H100-80GB")
    store = open_store(str(db))
    store.replace_observed("n2", [{"gpu": g, "uuid": f"GPU-n2-{g}", "model": None, "name": "NVIDIA L4",
                                   "mig_enabled": False} for g in range(4)], [], now=1000.0)
    store.replace_observed("n3", [{"gpu": g, "uuid": f"GPU-n3-{g}", "model": "H100-80GB", "mig_enabled": False}
                                  for g in range(4)], [], now=1000.0)
    store.close()
    assert cluster_of(db) == (1, 2, "H100-80GB")


def test_retrain_replays_on_the_known_mig_gpus_when_a_newer_model_outnumbers_them(tmp_path):
    """During a rolling upgrade the gpus table holds GPUs of a model this slurm-mig's tables do not list, as their
    nodes named it (d1464e6: kept blocked, never given a MIG job). Where those were the most common, cluster_of took
    their model, could not read it and replayed the site's history on the default 1 x 8 H100-80GB: here four times
    the GPUs on one node that the jobs had on two nodes of two."""
    from slurm_mig.store import open_store
    from training.retrain import cluster_of

    db = tmp_path / "state.db"
    _fill_db(db)
    store = open_store(str(db))
    store.replace_observed("n1b", [{"gpu": g, "uuid": f"GPU-n1b-{g}", "model": "H100-80GB", "mig_enabled": True}
                                   for g in (0, 1)], [], now=1000.0)
    for n in ("new1", "new2", "new3"):
        store.replace_observed(n, [{"gpu": g, "uuid": f"GPU-{n}-{g}", "model": "GB300-288GB", "name": "NVIDIA GB300",
                                    "mig_enabled": True} for g in range(4)], [], now=1000.0)
    store.close()
    assert cluster_of(db) == (2, 2, "H100-80GB")


@pytest.mark.parametrize("folder", ["site #1", "what?mode=rwc", "100%41"])
def test_retrain_reads_a_db_whose_path_holds_uri_characters(tmp_path, folder):
    """retrain (and simulate --db) opened the state DB as f"file:{path}?mode=ro" unescaped: a '#' cut the path
    there (no cluster found: the default 1 x 8 replayed; the outcomes unreadable), a '?' started the query early
    (the path cut there and mode=ro lost: SQLite created an empty file at the cut), '%41' was read as 'A'. The
    path is quoted now, as the store's own connections quote it."""
    from slurm_mig.sim.workloads import load_outcomes_db
    from training.retrain import cluster_of

    (tmp_path / folder).mkdir()
    db = tmp_path / folder / "state.db"
    _fill_db(db)
    def files():  # a WAL reader's -wal and -shm beside the DB are SQLite's
        return sorted(str(p) for p in tmp_path.rglob("*") if not p.name.endswith(("-wal", "-shm")))

    before = files()
    assert cluster_of(db) == (1, 2, "H100-80GB")
    assert len(load_outcomes_db(db).jobs) == 40
    assert files() == before  # nothing made beside it


def test_too_few_outcomes_says_how_many_rows_were_skipped_and_why(tmp_path):
    """retrain said '<db> holds 5 usable outcome(s); retraining needs at least 10' and nothing about the rows it
    had skipped, so a DB of 11 outcomes looked like one of 5. It now gives the rows, the usable ones and a count
    per reason."""
    import sqlite3

    from slurm_mig.errors import ConfigError
    from training.retrain import retrain

    db = tmp_path / "state.db"
    _fill_db(db, n=5)
    con = sqlite3.connect(db)
    rows = [("nr1", "1g", None, None, None), ("nr2", "1g", 10.0, 10.0, None), ("nr3", "2g", 5.0, None, None),
            ("up1", "5g", 1.0, 2.0, None), ("up2", "9g.90gb", 1.0, 2.0, None), ("nan", "1g", "2026-11-27", 2.0, None)]
    for job, prof, start, end, run in rows:
        con.execute("INSERT INTO outcomes (job_id, profile, count, submit_time, start_time, end_time, run_s, state, "
                    "recorded_at) VALUES (?, ?, 1, 1.0, ?, ?, ?, 'COMPLETED', 1.0)", (job, prof, start, end, run))
    con.commit()
    con.close()
    with pytest.raises(ConfigError) as err:
        retrain(db, store=tmp_path / "store", minutes=0.1, iterations=1, out=tmp_path / "work")
    msg = str(err.value)
    assert "11 outcome row(s)" in msg and "5 usable" in msg and "at least 10" in msg, msg
    assert "3 without a run time" in msg and "2 with a profile" in msg and "1 with a value that is not a number" in msg


def test_retrain_refuses_a_db_that_records_no_gpu_its_policy_places_on(tmp_path, capsys):
    """Where the state DB recorded no MIG GPU the controller's policy places on (a gpus table empty or unreadable, MIG
    mode off everywhere, every GPU a newer node's and blocked), cluster_of returned the default 1 x 8 H100-80GB and
    retrain judged the candidate there without a word, storing (or with --install activating) it on the strength of
    a cluster the site does not have. It now refuses before training, saying what the gpus table holds and why."""
    import sqlite3

    from slurm_mig.cli import main
    from slurm_mig.errors import ConfigError
    from slurm_mig.store import open_store
    from training.retrain import cluster_of, retrain

    db = tmp_path / "state.db"
    _fill_db(db)
    store = open_store(str(db))
    store.replace_observed("n1", [{"gpu": g, "uuid": f"GPU-{g}", "model": "H100-80GB", "mig_enabled": False}
                                  for g in (0, 1)], [], now=2000.0)
    store.close()
    with pytest.raises(ConfigError) as err:
        retrain(db, store=tmp_path / "store", minutes=0.1, iterations=1, out=tmp_path / "work")
    msg = str(err.value)
    assert "no MIG GPU" in msg and "2 GPU(s), 0 with MIG mode on" in msg and "not the site's" in msg, msg
    assert not (tmp_path / "work").exists() and not (tmp_path / "store").exists()
    assert main(["policy", "retrain", "--db", str(db), "--store", str(tmp_path / "store")]) == 2
    assert "no MIG GPU" in capsys.readouterr().err
    con = sqlite3.connect(db)
    con.execute("DROP TABLE gpus")
    con.commit()
    con.close()
    with pytest.raises(ConfigError, match="cannot read its gpus table"):
        cluster_of(db)
    with pytest.raises(ConfigError, match="does not exist"):
        cluster_of(tmp_path / "none.db")


@pytest.mark.parametrize("kind", ["text", "damaged", "empty"])
def test_simulate_and_retrain_say_plainly_that_a_file_is_not_a_state_database(tmp_path, capsys, kind):
    """`simulate --db FILE` and `policy retrain --db FILE` on a file that is no state database said "FILE records
    no MIG GPU the controller's policy places on (cannot read its gpus table: file is not a database)", exit 2:
    the cause in brackets, the advice about nodes reporting their GPUs beside the point. They now make the
    operator commands' check (ops.views.check_state_file) and say what the file is, exit 1 as those commands."""
    import sqlite3

    from slurm_mig.cli import main

    db = tmp_path / "state.db"
    if kind == "text":
        db.write_text("db_path = '/var/lib/slurm-mig/state.db'\n" * 50)
        said = "is not an SQLite database"
    elif kind == "empty":
        db.write_bytes(b"")
        said = "is empty"
    else:  # SQLite's header, then garbage: a truncated or overwritten file
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE t (x)")
        con.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(3000)])
        con.commit()
        con.close()
        data = db.read_bytes()
        db.write_bytes(data[:100] + b"\xff" * (len(data) - 100))
        said = "is not a usable SQLite database"
    for argv in (["simulate", "--db", str(db)], ["simulate", "--db", str(db), "--model", "H100-80GB", "--nodes", "1",
                                                 "--gpus-per-node", "2"],
                 ["policy", "retrain", "--db", str(db), "--store", str(tmp_path / "store")]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert f"state database {db} {said}" in err and "records no MIG GPU" not in err, (argv, err)
    assert not (tmp_path / "store").exists()
