"""Train the ``rl`` placement policy: behaviour cloning of frag-aware, then PPO on the simulator.

Read top to bottom; every knob is in ``Args``. Run from the repository root:

    .venv/bin/python -m training.train --out runs/rl                  # the full run, ~21 min (docs/rl-policy.md)
    .venv/bin/python -m training.train --out /tmp/smoke --smoke       # seconds, for CI

What is learned. At every placement the ``rl`` policy lists candidate places for
the job (slurm_mig/policies/rl.py) and a small MLP scores each candidate from its
feature row; softmax over the candidates is the policy. The same network serves
any cluster and queue size.

How (and why not sb3-contrib's MaskablePPO). The number of candidates changes at
every step, and the policy is a *shared scorer over candidates*, not a fixed-size
action head: MaskablePPO would need a padded, fixed-size action space tied to a
maximum cluster size and a custom policy class to share weights across actions.
A ~150-line PPO written for this shape is shorter than that and easier to read:

1. Behaviour cloning: play training workloads with frag-aware's choice (candidate
   0) and fit the scorer to a soft version of frag-aware's preference
   (softmax(-score gap / bc_tau)), so training starts from the heuristic.
2. PPO with counterfactual advantages: the simulator is deterministic and the
   arrivals do not depend on the policy, so instead of estimating advantages
   (GAE, a value network) we *measure* them: replay a training episode with the
   greedy policy, pick a few choices, and for each play the greedy choice and a
   few alternatives sampled from the policy for ``horizon_h`` hours from a
   snapshot of the simulator. An alternative's advantage is the waiting time it
   saves over the greedy choice. PPO's clipped update follows. (A first version
   with stochastic rollouts and an input-driven baseline drifted *worse* than
   the heuristic: one choice's effect drowns in the noise of all the others.)
3. Every ``eval_every`` iterations the greedy policy plays the validation
   workloads; the checkpoint with the lowest mean wait relative to frag-aware is
   kept and exported to ONNX with its model card.

The outcome, measured on held-out workloads (docs/rl-policy.md): on par with
frag-aware, not better; ``python -m training.probe`` shows why.
"""

from __future__ import annotations

import copyreg
import math
import os
import pickle
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from slurm_mig.mig.profiles import GpuModel, get_model
from slurm_mig.policies.rl import FEATURE_NAMES, FEATURE_SCHEMA, N_FEATURES, PLACEMENT_NETWORK, RLPolicy
from slurm_mig.sim.bench import DEFAULT_TRACE
from slurm_mig.sim.engine import SimConfig, Simulator
from training.args import parse_args as dataclass_args
from training.env import MigPlacementEnv
from training.evaluate import run_case, wait_ratio
from training.export import export_onnx
from training.model import Scorer
from training.ranges import feature_range, merge_ranges
from training.runlog import start_run
from training.splits import TRAIN_FAMILIES, Case, families_available, train_case, validation_cases


@dataclass
class Args:
    out: str = "runs/rl"  # output folder: model.pt, model.onnx, model_card.json, log.jsonl
    seed: int = 1  # seeds python, numpy and torch; training episodes are drawn from it
    smoke: bool = False  # tiny everything: a CI check that the pipeline runs (seconds)
    threads: int = 1  # torch threads (1 on a shared 2-core machine, FACTS §6)
    trace: str = ""  # Alibaba trace (default ../shared/traces/alibaba-v2023-train.csv when present)
    hidden: int = 64  # MLP width
    max_candidates: int = 32  # candidates per choice the policy sees (frag-aware's best first)
    # behaviour cloning
    bc_episodes: int = 24  # training episodes played with frag-aware's choice
    bc_epochs: int = 30  # passes over the cloned choices
    bc_tau: float = 0.05  # softness of the teacher: target = softmax(-score_gap / bc_tau)
    # PPO
    iterations: int = 100_000  # PPO iterations at most (the time budget ends the full run first)
    time_budget_min: float = 20.0  # stop PPO after this many minutes (0: no limit)
    episodes_per_iteration: int = 4  # training episodes per PPO iteration
    points_per_episode: int = 6  # choices per episode whose alternatives are played out
    alternatives: int = 3  # alternatives per choice (sampled from the policy), besides the greedy one
    episode_jobs: tuple[int, int] = (250, 500)  # jobs per synthetic training episode
    horizon_h: float = 4.0  # an alternative is judged by the waiting it causes over this many hours
    reservation_share: float = 0.25  # share of played-out choices that are reservation choices (when any)
    lr: float = 3e-4  # Adam learning rate (PPO)
    bc_lr: float = 3e-3  # Adam learning rate (behaviour cloning)
    epochs: int = 4  # PPO epochs per iteration (full batch)
    minibatch: int = 512  # choices per behaviour-cloning minibatch
    clip: float = 0.2  # PPO ratio clip
    ent_coef: float = 0.003  # entropy bonus
    temperature: float = 1.0  # softmax temperature of the policy (sampling alternatives, PPO ratios)
    max_grad_norm: float = 0.5
    # selection
    eval_every: int = 8  # validate the greedy policy every this many iterations
    families: tuple[str, ...] = TRAIN_FAMILIES  # training workload families (training/splits.py)


def parse_args(argv: list[str] | None = None) -> Args:
    a = dataclass_args(Args, argv, __doc__.split("\n\n")[0])
    if a.smoke:
        a.bc_episodes, a.bc_epochs, a.iterations, a.episodes_per_iteration = 2, 3, 2, 1
        a.episode_jobs, a.eval_every, a.epochs, a.points_per_episode = (60, 90), 2, 1, 2
    return a


# ---------------------------------------------------------------------------
# 1. playing episodes
# ---------------------------------------------------------------------------


def play(env: MigPlacementEnv, case: Case, choose) -> dict:
    """One episode. ``choose(features [n, F]) -> (action, log-prob)``. Returns per-choice arrays."""
    obs, info = env.reset(options={"case": case})
    feats, acts, logps, times, rewards = [], [], [], [], []
    done = bool(info.get("done"))
    while not done:
        x = env.candidate_features()
        a, lp = choose(x)
        feats.append(x)
        acts.append(a)
        logps.append(lp)
        times.append(info["t"])
        obs, r, done, _trunc, info = env.step(a)
        rewards.append(r)
    return {"feats": feats, "acts": np.array(acts), "logps": np.array(logps), "t": np.array(times),
            "r": np.array(rewards)}


def teacher(x: np.ndarray) -> tuple[int, float]:
    return 0, 0.0  # candidate 0 is frag-aware's choice


def greedy(f):
    return lambda choice: int(np.argmax(f(choice.features)))


# ---------------------------------------------------------------------------
# 2. batches of variable-size candidate sets
# ---------------------------------------------------------------------------


def pad(feats: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] arrays [n_i, F] -> features [B, N, F] and mask [B, N] (N = max n_i)."""
    n = max(len(x) for x in feats)
    X = np.zeros((len(feats), n, N_FEATURES), dtype=np.float32)
    M = np.zeros((len(feats), n), dtype=bool)
    for i, x in enumerate(feats):
        X[i, : len(x)] = x
        M[i, : len(x)] = True
    return torch.from_numpy(X), torch.from_numpy(M)


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.masked_fill(~mask, -1e9), dim=-1)


def soft_teacher(x: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """frag-aware's preference as a distribution: softmax(-score_gap / tau) (feature 'score_gap')."""
    from slurm_mig.policies.rl import FEATURE_NAMES

    gap = x[..., FEATURE_NAMES.index("score_gap")]
    return torch.softmax((-gap / tau).masked_fill(~mask, -1e9), dim=-1)


# ---------------------------------------------------------------------------
# 3. counterfactual advantages: branch the (deterministic) simulator
# ---------------------------------------------------------------------------
#
# The simulator is deterministic and the arrivals do not depend on the policy, so
# the value of a choice can be measured exactly instead of estimated: replay the
# episode greedily, snapshot the simulator at the decision holding the choice,
# and for each alternative candidate play on (greedily) for ``horizon_h`` hours.
# The alternative's advantage is the waiting time it saves over those hours
# compared with the greedy choice. No value network, no noise from other
# choices, no noise from arrivals.

copyreg.pickle(GpuModel, lambda m: (get_model, (m.name,)))  # snapshots keep the shared model objects


def play_decisions(case: Case, new_policy, chooser, begin, *, snap_at=frozenset(), start: bytes | None = None,
                   t_end: float = math.inf) -> dict:
    """Play ``case`` (or continue a snapshot) decision by decision with ``new_policy()``, whose choices
    ``chooser`` makes; ``begin(d)`` is called before decision ``d``. The loop of run_greedy here and in
    training/modes.py.

    Returns the waiting cost accrued before ``t_end`` (job-seconds: jobs pending x time, plus the delay
    of jobs whose instances are still being created; see training/env.py), the per-decision timeline
    (decision, t0, t1, n_left, delays) and ``snaps``, decision index -> pickled simulator for each
    decision of ``snap_at``.
    """
    if start is None:
        pol = new_policy()
        sim = Simulator(case.workload, pol, case.spec, SimConfig(explain=False))
        state, d = sim.reset(), 0
    else:
        sim, state, d = pickle.loads(start)
        # A fresh policy: its index is keyed on object identities, which a copy does not keep;
        # decide() is a pure function of the state, so a fresh one decides the same.
        pol = sim.policy = new_policy()
    cost, timeline, snaps = 0.0, [], {}
    while state is not None and state.now < t_end:
        if d in snap_at:
            sim.policy = None  # see above; and closures do not pickle
            snaps[d] = pickle.dumps((sim, state, d), protocol=pickle.HIGHEST_PROTOCOL)
            sim.policy = pol
        pol.chooser = chooser
        begin(d)
        decision = pol.decide(state)
        t0 = state.now
        n_left = len(state.pending) - len(decision.assignments)
        state = sim.step(decision)
        delays = sum(max(0.0, sim.records[a.job_id].start - t0) for a in decision.assignments)
        t1 = min(sim.now, t_end) if state is not None else t0
        cost += delays + n_left * (t1 - t0)
        timeline.append((d, t0, t1, n_left, delays))
        d += 1
    return {"cost": cost, "timeline": timeline, "snaps": snaps}


def run_greedy(case: Case, f, K: int, *, snap_at=frozenset(), start: bytes | None = None,
               forced: dict | None = None, t_end: float = math.inf, record: bool = False) -> dict:
    """Play ``case`` (or continue a snapshot) with argmax choices, except ``forced[(decision, position)]``.

    Returns the waiting cost accrued before ``t_end`` (job-seconds; see training/env.py), the
    per-decision timeline (decision, t0, t1, n_left, delays) and, with ``record``, every choice
    point (decision, position, t, features, logits); ``snaps`` maps decision index -> pickled simulator.
    """
    points = []
    where = [0, 0]  # (decision, position of the choice within it)

    def chooser(ch) -> int:
        z = f(ch.features)
        key = (where[0], where[1])
        a = forced[key] if forced and key in forced else int(np.argmax(z))
        if record:
            points.append((key[0], key[1], ch.state_now, np.asarray(ch.features, dtype=np.float32), z))
        where[1] += 1
        return a

    def begin(d: int) -> None:
        where[0], where[1] = d, 0

    r = play_decisions(case, lambda: RLPolicy(max_candidates=K, explain_waiting=False), chooser, begin,
                       snap_at=snap_at, start=start, t_end=t_end)
    return {"cost": r["cost"], "timeline": r["timeline"], "points": points, "snaps": r["snaps"]}


def window_cost(timeline: list, d0: int, t_end: float) -> float:
    """Cost accrued from decision ``d0`` until ``t_end`` in a recorded timeline."""
    c = 0.0
    for d, t0, t1, n_left, delays in timeline:
        if d < d0 or t0 >= t_end:
            continue
        c += delays + n_left * (min(t1, t_end) - t0)
    return c


def distinct(feats: np.ndarray) -> list[int]:
    """One candidate per group of identical rows (ignoring the GPU's position): alike GPUs give alike futures."""
    keep, seen = [], set()
    rank_col = FEATURE_NAMES.index("gpu_rank")
    for i, row in enumerate(feats):
        key = tuple(np.round(np.delete(row, rank_col), 5))
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return keep


RES = FEATURE_NAMES.index("is_reservation")


def counterfactual_batch(case: Case, f, K: int, points_per_episode: int, alternatives: int, horizon_s: float,
                         temperature: float, rng: np.random.Generator, reservation_share: float = 0.5) -> list[tuple]:
    """Samples (features, action, old log-prob, advantage in job-hours) from one episode.

    About ``reservation_share`` of the choices played out are reservation choices (when the
    episode has any): they are rarer than placements and matter more."""
    main = run_greedy(case, f, K, record=True)
    place, res = [], []
    for d, pos, t, x, z in main["points"]:
        keep = distinct(x)
        if len(keep) >= 2:
            (res if x[0, RES] > 0 else place).append((d, pos, t, x, z, keep))
    if not place and not res:
        return []
    n_res = min(len(res), int(round(points_per_episode * reservation_share)))
    n_place = min(len(place), points_per_episode - n_res)
    chosen = [res[i] for i in rng.choice(len(res), size=n_res, replace=False)] if n_res else []
    chosen += [place[i] for i in rng.choice(len(place), size=n_place, replace=False)] if n_place else []
    chosen.sort(key=lambda p: (p[0], p[1]))
    snaps = run_greedy(case, f, K, snap_at={p[0] for p in chosen})["snaps"]
    out = []
    for d, pos, t, x, z, keep in chosen:
        zz = z / temperature
        p = np.exp(zz - zz.max())
        p /= p.sum()
        g = int(np.argmax(z))
        others = [i for i in keep if i != g]
        if not others:
            continue
        q = p[others] / p[others].sum()
        alts = rng.choice(others, size=min(alternatives, len(others)), replace=False, p=q)
        # Earlier choices of the same decision replay as in the greedy run (same state, same argmax).
        base = window_cost(main["timeline"], d, t + horizon_s)
        qs = {g: -base}
        for a in alts:
            r = run_greedy(case, f, K, start=snaps[d], forced={(d, pos): int(a)}, t_end=t + horizon_s)
            qs[int(a)] = -r["cost"]
        mean_q = np.mean(list(qs.values()))
        for a, qa in qs.items():
            out.append((x, a, float(np.log(p[a] + 1e-12)), (qa - mean_q) / 3600.0))
    return out


# ---------------------------------------------------------------------------
# 4. validation
# ---------------------------------------------------------------------------


def validate(model: Scorer, cases: list[Case], reference: dict[str, float], K: int) -> float:
    """Mean over validation cases of (greedy policy's mean wait + 60 s) / (frag-aware's + 60 s)."""
    f = model.numpy_forward()
    return wait_ratio(cases, reference, lambda: RLPolicy(chooser=greedy(f), max_candidates=K, explain_waiting=False))


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trace = Path(args.trace) if args.trace else None
    if trace is None and set(args.families) - set(families_available(args.families)):
        # Said before training starts: the episode sampler would otherwise fail minutes in, at its first
        # alibaba-early draw.
        print(f"training/train.py: family alibaba-early needs the Alibaba trace, and {DEFAULT_TRACE} is not "
              "here: pass --trace PATH, or --families without alibaba-early", file=sys.stderr)
        return 2
    train(args)
    return 0


def train(args: Args, *, sample_case=None, init: dict | None = None, vcases: list[Case] | None = None,
          card_extra: dict | None = None, echo: bool = True, init_range: dict | None = None) -> tuple[Scorer, dict]:
    """The whole run; returns the best model and its card. training/retrain.py passes its own episode
    sampler (``sample_case(rng) -> Case``), the current model's weights (``init``: BC is skipped), its
    training range (``init_range``) and validation cases."""
    rng, nprng, out, log = start_run(args, echo=echo)
    trace = Path(args.trace) if args.trace else None

    def new_case() -> Case:
        if sample_case is not None:
            return sample_case(rng)
        return train_case(rng, jobs=args.episode_jobs, trace=trace, families=args.families)

    env = MigPlacementEnv(max_candidates=args.max_candidates)
    model = Scorer(N_FEATURES, args.hidden)
    if init is not None:
        model.load_state_dict(init)

    # -- 1. behaviour cloning ---------------------------------------------------------
    bc_feats: list[np.ndarray] = []
    for _ in range(args.bc_episodes if init is None else 0):
        bc_feats += play(env, new_case(), teacher)["feats"]
    # the feature values trained on: the served policy lets the network decide only inside them
    seen = init_range
    if bc_feats:
        rows = np.concatenate(bc_feats)
        model.set_normalisation(rows)
        seen = merge_ranges(seen, feature_range(rows))
    opt = torch.optim.Adam(model.parameters(), lr=args.bc_lr)
    for epoch in range(args.bc_epochs if bc_feats else 0):
        perm = np.random.permutation(len(bc_feats))
        total, agree = 0.0, 0
        for s in range(0, len(perm), args.minibatch):
            X, M = pad([bc_feats[i] for i in perm[s: s + args.minibatch]])
            target = soft_teacher(X, M, args.bc_tau)
            logp = masked_log_softmax(model(X), M)
            loss = -(target * logp).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(X)
            agree += int((logp.argmax(-1) == 0).sum())
        log(phase="bc", epoch=epoch, loss=total / len(perm), agree=agree / len(perm), choices=len(perm))

    # -- validation reference: frag-aware on the validation cases ------------------------
    if vcases is None:
        vcases = validation_cases(trace, small=args.smoke)
    reference = {c.name + str(c.seed): run_case(c, "frag-aware")["mean_wait_s"] for c in vcases}
    best_score = validate(model, vcases, reference, args.max_candidates)
    best_state = {k: v.clone() for k, v in model.state_dict().items()}
    best_iter = 0
    log(phase="valid", iteration=0, score=best_score)

    # -- 2. PPO with counterfactual advantages -------------------------------------------
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    horizon_s = args.horizon_h * 3600.0
    steps = 0
    it = 0
    ppo_start = time.time()
    for it in range(1, args.iterations + 1):
        if args.time_budget_min and time.time() - ppo_start > args.time_budget_min * 60:
            log(phase="ppo", stopped="time budget", iteration=it)
            it -= 1
            break
        f = model.numpy_forward()
        batch = []
        for _ in range(args.episodes_per_iteration):
            batch += counterfactual_batch(new_case(), f, args.max_candidates, args.points_per_episode,
                                          args.alternatives, horizon_s, args.temperature, nprng,
                                          args.reservation_share)
        if not batch:
            continue
        steps += len(batch)
        feats = [b[0] for b in batch]
        seen = merge_ranges(seen, feature_range(np.concatenate(feats)))
        acts = torch.as_tensor([b[1] for b in batch], dtype=torch.long)
        old_logp = torch.as_tensor([b[2] for b in batch], dtype=torch.float32)
        raw = np.array([b[3] for b in batch])
        adv = torch.as_tensor(raw / (raw.std() + 1e-8), dtype=torch.float32)
        X_all, M_all = pad(feats)
        for _ in range(args.epochs):
            logits = model(X_all) / args.temperature
            logp_all = masked_log_softmax(logits, M_all)
            logp = logp_all.gather(1, acts.unsqueeze(1)).squeeze(1)
            ratio = torch.exp(logp - old_logp)
            pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - args.clip, 1 + args.clip) * adv).mean()
            p = logp_all.exp()
            ent = -(p * logp_all.masked_fill(~M_all, 0.0)).sum(-1).mean()
            loss = pg - args.ent_coef * ent
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
        clipfrac = float(((ratio - 1).abs() > args.clip).float().mean())
        log(phase="ppo", iteration=it, samples=len(batch), steps=steps, mean_abs_adv_h=float(np.abs(raw).mean()),
            best_alt_gain_h=float(raw.max()), pg_loss=float(pg.detach()), entropy=float(ent.detach()), clipfrac=clipfrac)
        if it % args.eval_every == 0 or it == args.iterations:
            score = validate(model, vcases, reference, args.max_candidates)
            if score < best_score:
                best_score, best_iter = score, it
                best_state = {k: v.clone() for k, v in model.state_dict().items()}
            log(phase="valid", iteration=it, score=score, best=best_score, best_iteration=best_iter)

    # -- 3. keep the best checkpoint, export -------------------------------------------
    model.load_state_dict(best_state)
    wall = time.time() - log.t_start
    card = {
        "version": time.strftime("%Y%m%d-%H%M%S") + f"-s{args.seed}",
        "algorithm": "behaviour cloning of frag-aware + PPO with counterfactual advantages, training/train.py",
        "network": f"shared MLP {N_FEATURES}-{args.hidden}-{args.hidden}-1 (tanh) per candidate, softmax over candidates",
        "placement": PLACEMENT_NETWORK,  # a freshly trained network places; the shipped card may say frag-aware
        "policy_options": {"max_candidates": args.max_candidates, "reservations": "frag-aware's",
                           "learn_reservations": True, "reserve_guard_s": RLPolicy().reserve_guard_s},
        "training_data": {"families": list(args.families), "seeds": ">= 1000 (python random, training/splits.py)",
                          "alibaba": "windows of the first 55 % of the trace's jobs",
                          "never_seen": "test families/seeds of training/splits.py; Alibaba jobs after 55 %"},
        "seed": args.seed, "ppo_iterations": it if args.iterations else 0, "choices_trained": steps,
        "bc_choices": len(bc_feats), "best_iteration": best_iter,
        "validation_wait_ratio_vs_frag_aware": best_score, "wall_time_s": round(wall, 1),
        "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} thread(s)",
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(args).items()},
        "metrics": {},
        **(card_extra or {}),
    }
    if seen is not None:
        card["feature_range"] = {**seen, "source": "every feature row trained on"
                                 + (" and the parent model's range" if init_range else "")}
    torch.save({"state_dict": model.state_dict(), "n_features": N_FEATURES, "hidden": args.hidden,
                "feature_schema": FEATURE_SCHEMA, "card": card}, out / "model.pt")
    export_onnx(model, out / "model.onnx", card)
    log(phase="done", wall_s=wall, best_iteration=best_iter, validation_score=best_score,
        onnx=str(out / "model.onnx"))
    log.close()
    return model, card


if __name__ == "__main__":
    sys.exit(main())
