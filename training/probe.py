"""Is there anything to learn? Play out alternatives of real choices and see if features predict the gain.

    .venv/bin/python -m training.probe --kind placement --minutes 5
    .venv/bin/python -m training.probe --kind reservation --minutes 5 --horizon-h 8
    .venv/bin/python -m training.probe --futures 5 --redraw --minutes 15   # is a choice's gain a property of the state?

Trains the behaviour-cloning policy (frag-aware with the network's tie-breaks), then
on fresh training episodes picks choices, plays the greedy choice and alternatives
for ``horizon_h`` simulated hours from a snapshot (training/train.py's machinery),
and reports how often an alternative beats the greedy choice, by how much, and
whether a linear model of the feature differences predicts it on held-out choices.
docs/rl-policy.md ("Why placement alone did not beat frag-aware") quotes its output.

With ``--futures N`` it asks a sharper question: the greedy choice is frag-aware's
own (candidate 0), and each choice and its alternatives are played in N futures that
the policy cannot tell apart: the one recorded, and N - 1 in which the run time of
every job not yet finished is moved by up to ``--jitter``, or with ``--redraw``
drawn afresh from its limit as the synthetic workloads drew the limit (the policy
sees limits, never run times, so the state at the choice is the same). If an
alternative's gain were a property of the state, it would be the same in every
future. The report gives the correlation of the gains between futures, and what a
learner of each alternative's *expected* gain (estimated as the mean over futures
1..N-1) would save by following it, scored on future 0, which it did not see.
"""

from __future__ import annotations

import argparse
import heapq
import math
import pickle
import random
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from slurm_mig.policies.rl import FEATURE_NAMES
from slurm_mig.sim.engine import _END, INF, base_kind
from training.env import MigPlacementEnv
from training.model import Scorer
from training.retrain import moved
from training.splits import train_case
from training.train import (RES, counterfactual_batch, distinct, masked_log_softmax, pad, play, run_greedy,
                            soft_teacher, teacher)


def bc_policy(rng: random.Random, episodes: int = 16) -> Scorer:
    env = MigPlacementEnv()
    feats: list = []
    for _ in range(episodes):
        feats += play(env, train_case(rng), teacher)["feats"]
    env.close()
    m = Scorer()
    m.set_normalisation(np.concatenate(feats))
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    for _ in range(20):
        perm = np.random.permutation(len(feats))
        for s in range(0, len(perm), 512):
            X, M = pad([feats[i] for i in perm[s: s + 512]])
            loss = -(soft_teacher(X, M, 0.05) * masked_log_softmax(m(X), M)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return m


def jittered(snap: bytes, k: int, jitter: float, redraw: bool = False) -> bytes:
    """Future ``k`` of a snapshot: every job not yet finished runs up to ``jitter`` longer or shorter
    (never past its limit, never ending before now). k = 0 is the snapshot itself.

    With ``redraw``, a job with a limit gets a run time drawn the way the synthetic workloads drew
    its limit (limit / a factor log-uniform in [1, 4]; a running job's is redrawn until it ends
    after now): what the policy knows about it, no more."""
    if k == 0:
        return snap
    sim, state, d = pickle.loads(snap)
    rng = random.Random(f"future:{d}:{k}")
    now, ends = sim.now, {}
    for jid, rec in sim.records.items():
        if rec.start != INF and rec.end <= now:
            continue
        j = rec.job
        run_kind = base_kind(rec.instances[0][1].profile) if rec.instances else rec.run_profile
        for _ in range(50):
            if redraw and j.time_limit_s:
                new = replace(j, duration_s=max(1.0, j.time_limit_s / math.exp(rng.uniform(0.0, math.log(4.0)))))
            else:
                new = moved(j, rng, jitter)  # as retrain's replays move run times
            if rec.start == INF or rec.start + new.duration_on(run_kind) > now:
                break
        else:
            new = j  # nothing drawn ends after now: keep the recorded run time
        rec.job = new
        if rec.start != INF:  # running: move its end event
            rec.duration = new.duration_on(run_kind)
            rec.end = ends[jid] = max(now + 1.0, rec.start + rec.duration)
    if ends:
        sim.events = [(ends[p] if kind == _END and p in ends else t, kind, s, p) for t, kind, s, p in sim.events]
        heapq.heapify(sim.events)
    return pickle.dumps((sim, state, d), protocol=pickle.HIGHEST_PROTOCOL)


def futures_probe(a) -> int:
    """``--futures``: the gain of each alternative to frag-aware's choice, in N indistinguishable futures."""
    rng, nprng = random.Random(a.seed), np.random.default_rng(a.seed)
    fa = lambda x: -np.arange(len(x), dtype=np.float32)  # noqa: E731 - candidate 0, frag-aware's choice
    K, horizon = 32, a.horizon_h * 3600
    gains = []  # per choice: array [alternatives, futures] of job-hours saved against the greedy choice
    rows, greedy_rows = [], []  # per choice: the alternatives' feature rows, and the greedy choice's (repeated)
    t0, episodes = time.time(), 0
    while time.time() - t0 < a.minutes * 60:
        case = train_case(rng)
        episodes += 1
        main = run_greedy(case, fa, K, record=True)
        pts = [p for p in main["points"] if (p[3][0, RES] > 0) == (a.kind == "reservation") and len(distinct(p[3])) >= 2]
        if not pts:
            continue
        pick = [pts[i] for i in sorted(nprng.choice(len(pts), size=min(len(pts), a.points), replace=False))]
        snaps = run_greedy(case, fa, K, snap_at={p[0] for p in pick})["snaps"]
        for d, pos, t, x, _z in pick:
            others = [i for i in distinct(x)[:8] if i != 0]
            alts = [int(i) for i in nprng.choice(others, size=min(a.alternatives, len(others)), replace=False)]
            g = np.zeros((len(alts), a.futures))
            for k in range(a.futures):
                start = jittered(snaps[d], k, a.jitter, a.redraw)
                base = run_greedy(case, fa, K, start=start, t_end=t + horizon)["cost"]
                for i, alt in enumerate(alts):
                    r = run_greedy(case, fa, K, start=start, forced={(d, pos): alt}, t_end=t + horizon)
                    g[i, k] = (base - r["cost"]) / 3600.0
            gains.append(g)
            rows.append(x[alts])
            greedy_rows.append(np.repeat(x[:1], len(alts), axis=0))
            if time.time() - t0 >= a.minutes * 60:
                break
    if len(gains) < 10:
        print(f"only {len(gains)} choices; run longer")
        return 1
    if a.save:  # for a learner's look at the same data (docs/rl-policy.md, "Is a placement's gain ...")
        np.savez(a.save, gains=np.concatenate(gains), rows=np.concatenate(rows), base=np.concatenate(greedy_rows),
                 choice=np.concatenate([np.full(len(g), i) for i, g in enumerate(gains)]))
    G = np.concatenate(gains)  # [alternatives over all choices, futures]
    n = len(G)
    print(f"{a.kind}: {len(gains)} choices, {n} alternatives to frag-aware's choice, {episodes} episodes, "
          f"{a.futures} futures ({'run times redrawn from limits' if a.redraw else f'run times +-{a.jitter:.0%}'}), "
          f"horizon {a.horizon_h} h")
    r = [np.corrcoef(G[:, 0], G[:, k])[0, 1] for k in range(1, a.futures)]
    print(f"  gain in the recorded future vs in another: correlation {np.mean(r):.3f} "
          f"({', '.join(f'{v:.2f}' for v in r)})")
    within = G.var(axis=1, ddof=1).mean()
    print(f"  gain, job-h: mean {G.mean():+.3f}; spread between alternatives {G.mean(axis=1).std():.3f}, "
          f"within one alternative across futures {math.sqrt(within):.3f}")
    # A perfect learner of the expected gain: follow the best alternative by futures 1..N-1
    # (or frag-aware when none is expected to gain), scored on future 0.
    saved, followed = [], 0
    for g in gains:
        exp = g[:, 1:].mean(axis=1)
        i = int(np.argmax(exp))
        if exp[i] > 0:
            followed += 1
            saved.append(g[i, 0])
        else:
            saved.append(0.0)
    s = np.array(saved)
    hw = 1.96 * s.std(ddof=1) / math.sqrt(len(s))
    print(f"  knowing the expected gain: follows an alternative at {followed / len(gains):.0%} of choices, "
          f"saves {s.mean():+.3f} +- {hw:.3f} job-h per choice in the unseen future "
          f"(the same choice's best gain in hindsight: {np.mean([max(0.0, g[:, 0].max()) for g in gains]):+.3f})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=("placement", "reservation"), default="placement")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--horizon-h", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--futures", type=int, default=0, help="play each choice in N futures (>= 3); see above")
    ap.add_argument("--jitter", type=float, default=0.05, help="run-time jitter of the futures 1..N-1")
    ap.add_argument("--redraw", action="store_true",
                    help="futures 1..N-1 redraw run times from the limits (what the policy knows), not a jitter")
    ap.add_argument("--save", default="", help="with --futures: write the gains and feature rows to this .npz")
    ap.add_argument("--points", type=int, default=4, help="choices per episode with --futures")
    ap.add_argument("--alternatives", type=int, default=3, help="alternatives per choice with --futures")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.futures:
        if a.futures < 3:
            ap.error("--futures needs at least 3 (one to score, two to learn from)")
        return futures_probe(a)
    rng, nprng = random.Random(a.seed), np.random.default_rng(a.seed)
    f = bc_policy(rng).numpy_forward()
    share = 1.0 if a.kind == "reservation" else 0.0
    alts = 1 if a.kind == "reservation" else 3
    diffs, X = [], []
    t0, episodes = time.time(), 0
    while time.time() - t0 < a.minutes * 60:
        batch = counterfactual_batch(train_case(rng), f, 32, 8, alts, a.horizon_h * 3600, 1.0, nprng, share)
        episodes += 1
        groups: list[list] = []
        for x, act, _lp, adv in batch:  # samples of one choice are consecutive, greedy first
            if not groups or groups[-1][0][0] is not x:
                groups.append([])
            groups[-1].append((x, act, adv))
        for g in groups:
            x, g_act, g_adv = g[0]
            if (x[0, RES] > 0) != (a.kind == "reservation"):
                continue
            for _, act, adv in g[1:]:
                diffs.append(adv - g_adv)  # > 0: the alternative saved waiting (job-hours)
                X.append(x[act] - x[g_act])
    d, X = np.array(diffs), np.array(X)
    if len(d) < 20:
        print(f"only {len(d)} samples; run longer")
        return 1
    print(f"{a.kind}: {len(d)} alternatives from {episodes} episodes, horizon {a.horizon_h} h")
    print(f"  alternative better than greedy by > 0.1 job-h: {(d > 0.1).mean():.1%}; worse: {(d < -0.1).mean():.1%}; "
          f"|diff| < 0.1: {(np.abs(d) <= 0.1).mean():.1%}; mean {d.mean():+.3f} job-h")
    idx = np.random.default_rng(0).permutation(len(d))
    tr, te = idx[: int(0.7 * len(d))], idx[int(0.7 * len(d)):]
    Xa = np.c_[X, np.ones(len(d))]
    w, *_ = np.linalg.lstsq(Xa[tr], d[tr], rcond=1e-6)
    pred = Xa[te] @ w
    big = np.abs(d[te]) > 0.1
    r2 = 1 - ((pred - d[te]) ** 2).mean() / max(d[te].var(), 1e-12)
    acc = (np.sign(pred[big]) == np.sign(d[te][big])).mean() if big.any() else float("nan")
    print(f"  linear model of the gain on feature differences, held-out 30 %: R2 {r2:.3f}, sign right {acc:.1%}")
    top = np.argsort(-np.abs(w[:-1]))[:5]
    print("  largest weights: " + ", ".join(f"{FEATURE_NAMES[i]} {w[i]:+.2g}" for i in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
