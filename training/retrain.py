"""Retraining from the cluster's own history: outcomes -> trace -> fine-tune -> compare -> decide.

    slurm-mig policy retrain --db /var/lib/slurm-mig/state.db [--install]
    .venv/bin/python -m training.retrain --db .run/demo/state.db

1. Trace: the state DB's ``outcomes`` table replayed as a workload
   (slurm_mig.sim.workloads.load_outcomes_db), on a cluster shaped like the one
   in the DB's ``gpus`` table (the MIG GPUs the controller's policy sees: nodes x
   GPUs per node of its one model, or a node group per model on a mixed site,
   slurm_mig.sim.workloads.replay_site); none there stops it (cluster_of).
2. Split by submit time: the most recent ``holdout`` share of jobs is held out.
   Fine-tuning sees only the older jobs (windows of them, mixed with synthetic
   training episodes so the policy does not forget other workloads).
3. Fine-tune the *current* model (the store's active version, else the shipped
   policy/default.onnx; their torch weights ``model.pt`` sit beside them) with
   training/train.py's PPO; without weights, train from behaviour cloning.
4. Compare candidate, current and the heuristics on the held-out recent jobs
   (the whole history is replayed, only the recent jobs are scored), ``replays``
   times: the history as recorded, then with each job's run time moved by up to
   ``jitter`` (a rerun of the same jobs never takes exactly as long). One replay
   decides nothing: a policy that changes a single placement in two hundred moves
   a queue's mean wait by 10 % or more either way (docs/rl-policy.md, "Learning
   from the cluster"), so the comparison is paired, replay by replay.
5. Decide: the candidate is written to the policy store only if its mean wait is
   lower than the current policy's by more than ``margin``, the paired 95 %
   interval of the difference lies below zero, and its mean JCT is not higher;
   with ``install`` it also becomes active. The report says which, and why.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from slurm_mig.errors import ConfigError
from slurm_mig.policies.rl import MAX_HOLD_H, SHIPPED_MODEL, RLPolicy, model_pin, read_card, resolve_model_path
from slurm_mig.policy_registry import DEFAULT, PolicyStore
from slurm_mig.sim.workloads import Job, ReplaySite, Workload, load_outcomes_db, replay_site

from training.evaluate import ci, run_case
from training.guard import carry_guard
from training.model import load_weights
from training.splits import Case, _window, families_available, train_case, validation_cases
from training.train import Args, train

MIN_JOBS = 10

# What [policy].rl_max_hold_h would have done on the site's own history: the trade-off between mean and
# longest wait is the site's to choose (docs/rl-policy.md, "Bounding the hold"), so retrain shows it.
HOLD_CAPS_H = (0.0, 6.0, 12.0, 24.0, 48.0)


def cluster_of(db: str | Path) -> tuple[int, int, str]:
    """(nodes, GPUs per node, GPU model) of the MIG GPUs the DB's gpus table holds, as `slurm-mig simulate
    --db` replays them (site_of's cluster: on a mixed site every group's nodes, the most GPUs on one node of
    any group and the models joined by "+"); GPUs without MIG mode, of no MIG model, or that the controller's
    policy does not see (a newer node's, blocked) take no MIG job and are not counted.

    A ConfigError when there is none (slurm_mig.sim.workloads.site_cluster, simulate --db's check too): replayed
    on a made-up cluster (this used to be 1 x 8 H100-80GB, without a word), the candidate would be judged, stored
    and with --install activated on GPUs the site does not have."""
    spec = site_of(db).spec
    return spec.nodes, spec.gpus_per_node, spec.model


def site_of(db: str | Path) -> ReplaySite:
    """The cluster retrain replays the DB's outcomes on (slurm_mig.sim.workloads.replay_site): one model's
    nodes x GPUs per node, or a node group per model on a mixed site. A ConfigError as cluster_of."""
    return replay_site(db, "retrain", "judge the candidate")


# Why load_outcomes_db skipped a row (its meta["skipped"] keys), as the report says it.
SKIPPED_WHY = {
    "no_run_time": "without a run time (no start and end time nor run_s, or an end not after the start)",
    "unknown_profile": "with a profile the replay's {model} does not have (a job of another GPU model)",
    "not_a_number": "with a value that is not a number in a count or time column (text or a blob)",
}


def mixed_words(site: ReplaySite) -> str:
    """How a mixed site's jobs are placed in the replay, in words."""
    return ("jobs keep their partition" if site.partitions else
            "a job runs on any group whose model has its size") + f": {site.partitions_why}"


def skipped_text(skipped: dict, model: str) -> str:
    """'3 without a run time (...), 2 with a profile ...': load_outcomes_db's skipped rows, a count per reason."""
    return ", ".join(f"{v} {SKIPPED_WHY.get(k, k).format(model=model)}" for k, v in skipped.items() if v)


def replay_of(w: Workload, k: int, jitter: float, seed: int = 0) -> Workload:
    """Replay ``k`` of a recorded history: 0 is as recorded; k >= 1 moves each job's run time by a
    factor in [1 - jitter, 1 + jitter] (never past its time limit), deterministically for (k, seed).
    Job ids, order, submit times and limits stay, so the same jobs are scored in every replay."""
    if k == 0 or jitter <= 0:
        return w
    rng = random.Random(f"replay:{seed}:{k}")
    return Workload(w.name, [moved(j, rng, jitter) for j in w.jobs], w.model, w.nodes, w.gpus_per_node,
                    dict(w.meta))


def moved(j: Job, rng: random.Random, jitter: float) -> Job:
    """``j`` with its run time moved by a factor in [1 - jitter, 1 + jitter], never past its time limit
    (one draw from ``rng``)."""
    d = j.duration_s * (1.0 + rng.uniform(-jitter, jitter))
    if j.time_limit_s:
        d = min(d, j.time_limit_s)
    return replace(j, duration_s=max(1.0, d))


def judge(candidate: list[dict], current: list[dict], margin: float) -> tuple[bool, str, dict]:
    """Whether the candidate is better, from paired per-replay metrics; (better, why not, paired stats).

    Better = no job left unrun that the current policy runs (waits are averaged over the jobs that ran,
    so starving some would look like waiting less), mean wait lower by more than ``margin`` (a share of
    the current mean wait), the paired 95 % t-interval of (candidate - current) wait entirely below
    zero, and mean JCT not higher.
    """
    dw = [a["mean_wait_s"] - b["mean_wait_s"] for a, b in zip(candidate, current)]
    dj = [a["mean_jct_s"] - b["mean_jct_s"] for a, b in zip(candidate, current)]
    cur_w = statistics.fmean(b["mean_wait_s"] for b in current)
    mw, hw = ci(dw)
    mj, _ = ci(dj)
    interval = len(dw) >= 2 and math.isfinite(hw)  # one replay gives no interval: never enough evidence
    paired = {"replays": len(dw), "wait_diff_s": mw, "wait_diff_ci95_s": hw if interval else None,
              "jct_diff_s": mj, "wait_diffs_s": dw}
    unrun = [a.get("unfinished", 0) - b.get("unfinished", 0) for a, b in zip(candidate, current)]
    paired["unfinished_diffs"] = unrun
    if max(unrun, default=0) > 0:
        return False, f"leaves {max(unrun)} more job(s) unrun than the current policy in a replay", paired
    if not mw < -max(margin * cur_w, 1e-6):
        return False, "waits no less", paired
    if not interval or mw + hw >= 0:
        return False, "is not reliably better (the paired 95 % interval reaches zero)", paired
    if mj > 1e-6:
        return False, "has a higher mean JCT", paired
    return True, "", paired


def current_model(config_model_path: str | None = None) -> tuple[str, Path, Path | None]:
    """(version, .onnx, model.pt or None) of the model the rl policy uses now. ``config_model_path``: the
    ``[policy].model_path`` of the controller's config (`--config`); None looks it up in the config found."""
    path = resolve_model_path(config_model_path=config_model_path)
    if path == SHIPPED_MODEL:
        version = DEFAULT
    elif model_pin(config_model_path):
        # A pinned file is no version of the store: labelled by its path, not the store's active version, which the
        # report compared against and the candidate's card named as its parent (noticed by the store review)
        version = f"pinned:{path}"
    else:
        version = PolicyStore().active()
    # <name>.pt beside <name>.onnx, the store's pairing (905e08f): a pinned x.onnx fine-tuned from whatever model.pt
    # lay beside it, another model's weights (noticed by the model-trust review, 2026-11-27)
    pt = path.with_suffix(".pt")
    return version, path, (pt if pt.is_file() else None)


def holdout_cut(n: int, holdout: float) -> int:
    """Position of the first held-out job: jobs [0, cut) are trained on, [cut, n) only scored."""
    return n - max(1, int(round(holdout * n)))


def retrain(db: str | Path, *, store: str | Path | None = None, holdout: float = 0.3, minutes: float = 5.0,
            iterations: int = 60, seed: int = 0, install: bool = False, out: str | Path | None = None,
            margin: float = 0.005, replays: int = 5, jitter: float = 0.05,
            hold_caps: tuple[float, ...] | str | None = None, config_model_path: str | None = None,
            log=None) -> dict:
    torch.set_num_threads(1)
    say = log or (lambda m: None)
    # Said before the DB is read: train.py takes a budget of 0 for no limit and a negative one as already spent,
    # and NaN compares false with everything (found by the store review, 2026-11-27)
    if not (math.isfinite(minutes) and 0 < minutes <= 24 * 60):
        raise ConfigError(f"--minutes must be more than 0 and at most {24 * 60} (a day), got {minutes}")
    if iterations < 1:
        raise ConfigError(f"--iterations must be at least 1, got {iterations}")
    if store is not None:
        import os

        os.environ["SLURM_MIG_POLICY_STORE"] = str(store)
    st = PolicyStore(store)
    site = site_of(db)
    spec = site.spec
    nodes, per_node, model_name = spec.nodes, spec.gpus_per_node, spec.model
    w = load_outcomes_db(db, model=model_name, nodes=nodes, gpus_per_node=per_node, partitions=site.partitions)
    n = len(w.jobs)
    skipped = {k: v for k, v in w.meta.get("skipped", {}).items() if v}
    if n < MIN_JOBS:
        rows = w.meta.get("rows", n)
        raise ConfigError(f"{db} holds {rows} outcome row(s), {n} usable; retraining needs at least {MIN_JOBS} usable"
                          + (f"; skipped {skipped_text(skipped, model_name)}" if skipped else "")
                          + ("; the controller records one per MIG job that ends" if not rows else ""))
    if not 0.05 <= holdout <= 0.8:
        raise ConfigError(f"--holdout must be between 0.05 and 0.8, got {holdout}")
    if not 2 <= replays <= 100:
        raise ConfigError(f"--replays must be between 2 and 100 (one replay gives no interval), got {replays}")
    if not 0.0 <= jitter <= 0.5:
        raise ConfigError(f"--jitter must be between 0 and 0.5, got {jitter}")
    hold_caps = check_hold_caps(HOLD_CAPS_H if hold_caps is None else hold_caps)
    cut = holdout_cut(n, holdout)
    n_hold = n - cut
    history = _window(w, 0, cut, "replay:history")
    say(f"{n} outcomes from {db}: training on the oldest {cut}, judging on the most recent {n_hold}; "
        f"cluster {site.describe()}" + (f" ({mixed_words(site)})" if spec.groups else "")
        + (f"; skipped {sum(skipped.values())} unusable row(s): {skipped_text(skipped, model_name)}"
           if skipped else ""))

    # The model of the config given (`--config`), as the controller runs it (7ac67ef): with --config X naming A.onnx
    # and $SLURM_MIG_CONFIG naming B.onnx it fine-tuned B and warned about A (noticed by a review, 2026-11-27)
    version, cur_path, cur_pt = current_model(config_model_path)
    init = None
    if cur_pt is not None:
        init = load_weights(cur_pt)["state_dict"]
    say(f"current policy: {version} ({cur_path}); fine-tuning from "
        f"{'its weights' if init is not None else 'scratch (no model.pt beside it)'}")

    # a site has no Alibaba trace: alibaba-early episodes would raise FileNotFoundError mid-run
    families = families_available()

    def sample_case(rng: random.Random) -> Case:
        if rng.random() < 0.5 or len(history.jobs) < 2:
            return train_case(rng, jobs=(150, 300), families=families)
        size = min(len(history.jobs), rng.randint(100, 400))
        lo = rng.randrange(0, len(history.jobs) - size + 1)
        return Case("replay", _window(history, lo, lo + size, "replay"), spec, rng.randrange(10**6))

    vcases = [Case("valid:history", history, spec, seed)] + validation_cases(small=True)
    work = Path(out) if out else Path(tempfile.mkdtemp(prefix="slurm-mig-retrain-"))
    args = Args(out=str(work), seed=seed, iterations=iterations, time_budget_min=minutes, eval_every=max(1, iterations // 6),
                bc_episodes=8, bc_epochs=10, episodes_per_iteration=2, episode_jobs=(150, 300), families=families)
    t0 = time.time()
    parent_range = read_card(cur_path).get("feature_range") if init is not None else None
    _model, card = train(args, sample_case=sample_case, init=init, vcases=vcases,
                         card_extra={"source": "retrain", "source_db": str(db), "parent_version": version},
                         echo=False, init_range=parent_range and {k: parent_range[k] for k in ("lo", "hi")})
    wall = time.time() - t0
    cand_path = work / "model.onnx"
    if carry_guard(cur_path, work):
        say("the candidate keeps the current model's reservation guard (retraining fine-tunes placement only)")
    say(f"candidate trained in {wall:.0f} s ({card.get('ppo_iterations')} iterations); evaluating on the recent jobs")

    say(f"judging on {replays} replays of the history (run times moved by up to {jitter:.0%} from the second on)")
    runs: dict[str, list[dict]] = {}
    # one instance per policy for all replays: decide() is pure, and each logs a feature outside its range once
    pols = (("candidate", RLPolicy(model_path=str(cand_path)).load()),
            ("current", RLPolicy(model_path=str(cur_path)).load()),
            ("frag-aware", "frag-aware"), ("first-fit", "first-fit"))
    cases = [Case("recent", replay_of(w, k, jitter, seed), spec, seed, score_index=(cut, n)) for k in range(replays)]
    for case in cases:
        for label, pol in pols:
            runs.setdefault(label, []).append(run_case(case, pol))
    evaluation = {label: {m: statistics.fmean(r[m] for r in rs) for m in ("mean_wait_s", "mean_jct_s", "max_wait_s")}
                  for label, rs in runs.items()}
    better, why, paired = judge(runs["candidate"], runs["current"], margin)
    cw, cj = evaluation["candidate"]["mean_wait_s"], evaluation["candidate"]["mean_jct_s"]
    uw, uj = evaluation["current"]["mean_wait_s"], evaluation["current"]["mean_jct_s"]
    hw = paired["wait_diff_ci95_s"]
    diff = f"paired difference {paired['wait_diff_s']:+.1f} +- {'?' if hw is None else f'{hw:.1f}'} s, {replays} replays"
    if better:
        metrics = {"candidate_mean_wait_s": cw, "current_mean_wait_s": uw, "candidate_mean_jct_s": cj,
                   "current_mean_jct_s": uj, "frag_aware_mean_wait_s": evaluation["frag-aware"]["mean_wait_s"],
                   "wait_diff_s": paired["wait_diff_s"], "wait_diff_ci95_s": paired["wait_diff_ci95_s"],
                   "replays": replays, "heldout_jobs": n_hold, "source_db": str(db)}
        v = st.add(cand_path, extra_card={"metrics": metrics, "source": "retrain", "parent_version": version})
        decision = "installed" if install else "stored"
        if install:
            st.install(v.version)
        reason = (f"candidate waits {cw:.1f} s on the {n_hold} most recent jobs vs {uw:.1f} s for {version} "
                  f"({diff}; JCT {cj:.1f} vs {uj:.1f} s)")
        new_version = v.version
    else:
        decision = "kept current"
        reason = (f"candidate {why}: {cw:.1f} s vs {uw:.1f} s mean wait ({diff}), {cj:.1f} vs {uj:.1f} s mean JCT "
                  f"on the {n_hold} most recent jobs; nothing written")
        new_version = None
    cur_pol = pols[1][1]  # its runs above are the row of its own cap
    caps = _hold_caps_on(cases, cur_path, hold_caps, say, known={cur_pol.max_hold_h: runs["current"]})
    caution = (f"only {n_hold} held-out jobs: weak evidence either way; let more history accumulate"
               if n_hold < 50 else "")
    return {
        "caution": caution,
        "db": str(db), "outcomes": n, "history_jobs": cut, "heldout_jobs": n_hold,
        "cluster": {"nodes": nodes, "gpus_per_node": per_node, "model": model_name,
                    **({"groups": [{"name": g.name, "model": g.model, "nodes": g.nodes,
                                    "gpus_per_node": g.gpus_per_node} for g in spec.groups],
                        "partitions_kept": bool(site.partitions), "partitions_why": site.partitions_why,
                        "described": site.describe()} if spec.groups else {})},
        "current_version": version, "candidate": {"path": str(cand_path), "wall_s": round(wall, 1),
                                                  "iterations": card.get("ppo_iterations"),
                                                  "validation_wait_ratio_vs_frag_aware":
                                                      card.get("validation_wait_ratio_vs_frag_aware")},
        "evaluation": evaluation, "paired": paired, "replays": replays, "jitter": jitter,
        "decision": decision, "new_version": new_version, "reason": reason,
        "hold_caps": caps, "store": str(st.root),
    }


def check_hold_caps(caps) -> tuple[float, ...]:
    """The caps to replay, each 0..MAX_HOLD_H h like [policy].rl_max_hold_h; a string is comma-separated
    ("" for none)."""
    if isinstance(caps, str):
        try:
            caps = [float(c) for c in caps.split(",") if c.strip()]
        except ValueError:
            raise ConfigError(f"--hold-caps must be hours separated by commas (e.g. 0,12,48), got {caps!r}") from None
    out = tuple(sorted({float(c) for c in caps}))
    bad = [c for c in out if not (math.isfinite(c) and 0 <= c <= MAX_HOLD_H)]
    if bad:
        raise ConfigError(f"--hold-caps must lie between 0 and {MAX_HOLD_H:g} hours, got {bad[0]:g}")
    return out


def _hold_caps_on(cases: list[Case], cur_path: Path, caps: tuple[float, ...], say,
                  known: dict[float, list[dict]] | None = None) -> dict:
    """The current policy under each cap, over the same replays: mean and longest wait. ``known``: the
    runs already made under some cap (not replayed again)."""
    if not caps:
        return {"skipped": "no caps asked for", "rows": []}
    if not read_card(cur_path).get("guard"):
        return {"skipped": "the current model has no reservation guard, so rl_max_hold_h changes nothing",
                "rows": []}
    say(f"replaying the current policy under rl_max_hold_h = {', '.join(f'{c:g}' for c in caps)} h")
    rows = []
    for cap in caps:
        ms = (known or {}).get(cap)
        if ms is None:
            pol = RLPolicy(model_path=str(cur_path), max_hold_h=cap).load()
            ms = [run_case(case, pol) for case in cases]
        rows.append({"cap_h": cap, "mean_wait_s": statistics.fmean(m["mean_wait_s"] for m in ms),
                     "max_wait_s": statistics.fmean(m["max_wait_s"] for m in ms)})
    return {"skipped": "", "rows": rows}


def format_report(r: dict) -> str:
    lines = [f"retrain on {r['db']}: {r['outcomes']} outcomes ({r['history_jobs']} for training, "
             f"{r['heldout_jobs']} most recent held out), cluster "
             + (r['cluster']['described'] if r['cluster'].get('groups') else
                f"{r['cluster']['nodes']} x {r['cluster']['gpus_per_node']} {r['cluster']['model']}"),
             f"candidate: {r['candidate']['path']} ({r['candidate']['iterations']} iterations, "
             f"{r['candidate']['wall_s']} s)",
             f"evaluation on the held-out recent jobs (mean of {r['replays']} replays):"]
    for label, m in r["evaluation"].items():
        lines.append(f"  {label:11s} mean wait {m['mean_wait_s']:10.1f} s   mean JCT {m['mean_jct_s']:10.1f} s")
    p = r["paired"]
    if p.get("wait_diff_ci95_s") is not None:
        lines.append(f"  candidate - current, paired: {p['wait_diff_s']:+.1f} +- {p['wait_diff_ci95_s']:.1f} s "
                     f"mean wait (95 %); per replay: " + ", ".join(f"{d:+.1f}" for d in p["wait_diffs_s"]))
    lines.append(f"decision: {r['decision']}" + (f" as version {r['new_version']}" if r["new_version"] else ""))
    lines.append(f"  {r['reason']}")
    if r.get("caution"):
        lines.append(f"  note: {r['caution']}")
    caps = r.get("hold_caps") or {}
    if caps.get("rows"):
        lines.append(f"[policy].rl_max_hold_h with the current policy on the same replays (mean of {r['replays']}):")
        for row in caps["rows"]:
            what = " (frag-aware's reservations)" if row["cap_h"] == 0 else ""
            lines.append(f"  {row['cap_h']:5g} h{what:28s} mean wait {row['mean_wait_s']:10.1f} s   "
                         f"longest wait {row['max_wait_s'] / 3600:8.2f} h")
    elif caps.get("skipped"):
        lines.append(f"rl_max_hold_h: not replayed ({caps['skipped']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--store", default=None)
    ap.add_argument("--holdout", type=float, default=0.3)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--jitter", type=float, default=0.05)
    ap.add_argument("--hold-caps", default=None)
    ap.add_argument("--install", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from slurm_mig.policy_cli import check_retrain_configs

    check_retrain_configs(None)  # as root, the config naming the model to fine-tune must be root's (as the CLI's)
    r = retrain(a.db, store=a.store, holdout=a.holdout, minutes=a.minutes, iterations=a.iterations, seed=a.seed,
                replays=a.replays, jitter=a.jitter, hold_caps=a.hold_caps, install=a.install, out=a.out,
                log=None if a.json else (lambda m: print(m, file=sys.stderr)))
    print(json.dumps(r, default=str) if a.json else format_report(r))
    if a.install and r.get("decision") == "installed":
        from slurm_mig.policy_cli import pinned_by, warn_if_pinned

        warn_if_pinned(pinned_by(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
