"""Is there anything to learn? Play out alternatives of real choices and see if features predict the gain.

    .venv/bin/python -m training.probe --kind placement --minutes 5
    .venv/bin/python -m training.probe --kind reservation --minutes 5 --horizon-h 8

Trains the behaviour-cloning policy (frag-aware with the network's tie-breaks), then
on fresh training episodes picks choices, plays the greedy choice and alternatives
for ``horizon_h`` simulated hours from a snapshot (training/train.py's machinery),
and reports how often an alternative beats the greedy choice, by how much, and
whether a linear model of the feature differences predicts it on held-out choices.
docs/rl-policy.md ("Why it does not beat frag-aware") quotes its output.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np
import torch

from slurm_mig.policies.rl import FEATURE_NAMES
from training.env import MigPlacementEnv
from training.model import Scorer
from training.splits import train_case
from training.train import RES, counterfactual_batch, masked_log_softmax, pad, play, soft_teacher, teacher


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=("placement", "reservation"), default="placement")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--horizon-h", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
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
