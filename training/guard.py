"""Train the ``rl`` policy's reservation guard: PPO on whole-episode counterfactuals.

Read top to bottom; every knob is in ``Args``. Run from the repository root:

    .venv/bin/python -m training.guard --out runs/guard                # the full run (docs/rl-policy.md)
    .venv/bin/python -m training.guard --out /tmp/guard --smoke        # seconds, for CI

What is learned. A job that asks for several GPUs (whole-node 7g jobs in practice)
gets a reservation under frag-aware's rule as soon as it is blocked: the node it
will run on drains, and no new job may start there unless it ends first. That
protects the big job and costs every small one. Whether it pays depends on the
workload: on the held-out small-heavy family first-fit, which never reserves,
waits a third less than frag-aware; on the Alibaba trace, where pods run for
days, reserving early is what keeps an 8-GPU job from waiting weeks. The guard
network reads the job, the workload and the cluster (slurm_mig/policies/rl.py,
GUARD_FEATURE_NAMES: how long running and queued jobs are limited to, node and
cluster size; never what the option itself changes, such as the queue's length)
and picks from when the job's
reservation holds: one of GUARD_OPTIONS_H after its submission (0 h =
frag-aware's rule). Until then jobs that end in time may still use the reserved
GPUs; jobs that would outlast that moment may not, so the node drains by then.

Why this works where one-choice credit assignment did not (docs/rl-policy.md,
"Why it does not beat frag-aware"): the guard is a *rule*, and its effect shows
over days, so each training episode is played to its end once per option, with
the option held for every multi-GPU job. The simulator is deterministic and the
arrivals do not depend on the policy, so the difference between two such runs
is exactly what the option did: every option's advantage is measured at every
recorded state (a contextual bandit with full information). The states the
network learns from are the guard queries of all those runs (the queue looks
different when big jobs are deferred, and the network must know both).

PPO on that data: sample an option from the current policy at each state, its
advantage is the measured one minus the policy's expected advantage there (an
exact baseline), and PPO's clipped surrogate with an entropy bonus updates the
network. No value network and no GAE: nothing is left to estimate. Every
``eval_every`` iterations the greedy guard plays the validation workloads (the
ones with multi-GPU jobs) through the full ``rl`` policy; the best checkpoint is
exported as ``guard.onnx`` beside a copy of the placement model.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from slurm_mig.policies.frag_aware import FragAwarePolicy
from slurm_mig.policies.rl import (
    CARD_NAME, GUARD_FEATURE_NAMES, GUARD_OPTIONS_H, GUARD_SCHEMA, N_GUARD_FEATURES, SHIPPED_MODEL, RLPolicy,
    read_card,
)
from slurm_mig.sim.engine import ClusterSpec
from slurm_mig.sim.workloads import poisson_workload
from training.args import parse_args as dataclass_args
from training.evaluate import run_case
from training.export import save_onnx
from training.model import Scorer
from training.ranges import feature_range
from training.splits import (
    ALIBABA_NODES, ALIBABA_TRAIN_TO, VALIDATION_SEEDS, Case, _prefix, _random_mix, alibaba_cached,
    validation_cases,
)

GUARD_FILE = "guard.onnx"


@dataclass
class Args:
    out: str = "runs/guard"          # folder for model.onnx (a copy of the placement model), guard.onnx, the card
    placement: str = ""              # the placement model to train under (default: policy/default.onnx)
    seed: int = 1                    # seeds the episodes and torch
    episodes: int = 160              # training episodes, each played to its end once per guard option
    alibaba_share: float = 0.25      # share of episodes that replay the Alibaba trace's first 55 % (the rest: Poisson)
    contexts_per_run: int = 12       # guard queries kept per (episode, option) run, evenly spaced
    workers: int = 2                 # processes playing episodes
    iterations: int = 400            # PPO iterations over the gathered data
    batch: int = 512                 # states per PPO iteration
    epochs: int = 4                  # gradient steps per iteration
    lr: float = 3e-3                 # Adam step size
    clip: float = 0.2                # PPO's ratio clip
    entropy: float = 0.01            # entropy bonus (keeps options alive until the data says otherwise)
    hidden: int = 32                 # MLP width (two hidden layers)
    eval_every: int = 50             # iterations between validations
    smoke: bool = False              # tiny run for CI: 4 episodes of 120 jobs, 4 iterations
    played: str = ""                 # reuse the episodes of an earlier run (its played.json) instead of playing


# ---------------------------------------------------------------------------
# 1. episodes: workloads with multi-GPU jobs, never a validation or test workload
# ---------------------------------------------------------------------------


def guard_case(rng: random.Random, alibaba_share: float = 0.25, smoke: bool = False) -> Case:
    """A training episode: a Poisson stream with multi-GPU jobs (seeds >= 1000), or the Alibaba
    trace's first 55 % with time-limit seeds 1000-1006 (scored on its later part)."""
    if not smoke and rng.random() < alibaba_share:
        seed = 1000 + rng.randrange(7)
        full = alibaba_cached(seed)
        share = rng.uniform(0.35, 1.0) * ALIBABA_TRAIN_TO
        w = _prefix(full, share, "train:alibaba-early")
        return Case(w.name, w, ClusterSpec(ALIBABA_NODES, 8, w.model), seed, 0.4, 1.0)
    seed = 1000 + rng.randrange(10**6)
    per_node = rng.choice((8, 8, 4))  # 8-GPU nodes, and the 4-GPU boxes many A100 sites have
    nodes = rng.choice((1, 2, 2, 3, 4, 6, 8)) * (8 // per_node)
    gpus = per_node * nodes
    n = 120 if smoke else min(3000, rng.randint(40, 90) * gpus)  # about the same hours whatever the size
    mix = _random_mix(rng)
    mix["7g"] = max(mix["7g"], rng.uniform(0.05, 0.3))  # enough 7g jobs that some ask for several GPUs
    w = poisson_workload(n, gpus=gpus, gpus_per_node=per_node, load=rng.uniform(0.7, 1.0), mix=mix, seed=seed,
                         mean_duration_s=rng.uniform(900, 3600), sigma=rng.uniform(0.6, 1.4),
                         multi_gpu_share=rng.choice((0.05, 0.1, 0.2, 0.3)), name="train:poisson-multi")
    return Case(w.name, w, ClusterSpec(nodes, per_node, w.model), seed)


# ---------------------------------------------------------------------------
# 2. play every option of an episode to its end (the measured advantages)
# ---------------------------------------------------------------------------


def play_options(job: tuple) -> dict:
    """Run ``case`` once per guard option held for every multi-GPU job; the waits and the guard queries."""
    case, placement, keep = job
    waits, contexts = [], []
    for hours in GUARD_OPTIONS_H:
        seen: list[list[float]] = []

        def chooser(features: list[float], hours: float = hours, seen: list = seen) -> float:
            seen.append(features)
            return hours

        m = run_case(case, RLPolicy(model_path=placement or None, guard_chooser=chooser))
        waits.append(m["mean_wait_s"])
        if seen:
            step = max(1, len(seen) // keep)
            contexts.extend(seen[::step][:keep])
    return {"case": case.name, "seed": case.seed, "waits": waits, "contexts": contexts}


def advantages(waits: list[float]) -> list[float]:
    """Waiting saved by each option against the mean of the options, as a share of that mean."""
    mean = sum(waits) / len(waits)
    return [(mean - w) / max(mean, 1.0) for w in waits]


# ---------------------------------------------------------------------------
# 3. the network: one row of guard features -> a logit per option
# ---------------------------------------------------------------------------


class GuardNet(Scorer):
    """training/model.py's MLP (normalisation baked in, so the ONNX file is self-contained) over the guard
    features, with one logit per option instead of one per row."""

    def __init__(self, n_features: int = N_GUARD_FEATURES, n_options: int = len(GUARD_OPTIONS_H),
                 hidden: int = 32) -> None:
        super().__init__(n_features, hidden, n_outputs=n_options)
        with torch.no_grad():  # start at frag-aware's rule: option 0 (reserve at once) a little ahead
            self.net[-1].bias.copy_(torch.tensor([1.0] + [0.0] * (n_options - 1)))


def greedy_chooser(model: GuardNet):
    def choose(features: list[float]) -> float:
        with torch.no_grad():
            k = int(model(torch.tensor([features], dtype=torch.float32)).argmax())
        return GUARD_OPTIONS_H[k]
    return choose


# ---------------------------------------------------------------------------
# 4. validation: the whole rl policy with the greedy guard, against frag-aware
# ---------------------------------------------------------------------------


SMALL_HEAVY_MIX = {"1g": .35, "2g": .25, "3g": .2, "4g": .1, "7g": .1}


def validation_set(smoke: bool) -> list[Case]:
    """The validation workloads with multi-GPU jobs, plus small-heavy-like streams on 4 nodes of 4 GPUs
    (validation seeds 500-501), so the checkpoint must also hold on 4-GPU nodes."""
    cases = [c for c in validation_cases(small=smoke) if "poisson" in c.name or "alibaba" in c.name]
    if smoke:
        return cases
    for seed in VALIDATION_SEEDS:
        w = poisson_workload(1200, gpus=16, gpus_per_node=4, load=0.9, mix=SMALL_HEAVY_MIX, multi_gpu_share=0.1,
                             seed=seed, name="valid:multi-4x4")
        cases.append(Case(w.name, w, ClusterSpec(4, 4, w.model), seed))
    return cases


def validate(model: GuardNet, cases: list[Case], placement: str, baseline: dict) -> tuple[float, dict]:
    """Mean over the cases of rl's mean wait / frag-aware's; and the per-case waits."""
    waits = {}
    for c in cases:
        m = run_case(c, RLPolicy(model_path=placement or None, guard_chooser=greedy_chooser(model)))
        waits[f"{c.name}:{c.seed}"] = m["mean_wait_s"]
    ratio = sum(waits[k] / max(baseline[k], 1.0) for k in waits) / max(len(waits), 1)
    return ratio, waits


# ---------------------------------------------------------------------------
# 5. export: guard.onnx beside a copy of the placement model, one card for both
# ---------------------------------------------------------------------------


def export_guard(model: GuardNet, out: Path, placement: str, card_extra: dict) -> Path:
    """Write out/model.onnx (+ model.pt) copied from the placement model, out/guard.onnx, and the merged card."""
    out.mkdir(parents=True, exist_ok=True)
    src = Path(placement) if placement else SHIPPED_MODEL
    card = read_card(src)
    if out.resolve() != src.parent.resolve():
        shutil.copy2(src, out / "model.onnx")
        pt = src.with_suffix(".pt")
        if pt.is_file():
            shutil.copy2(pt, out / "model.pt")
    model = model.eval()
    save_onnx(model, out / GUARD_FILE, N_GUARD_FEATURES, "guard_features", "rows")
    check_guard_export(model, out / GUARD_FILE)
    card["guard"] = {"file": GUARD_FILE, "feature_schema": GUARD_SCHEMA, "features": list(GUARD_FEATURE_NAMES),
                     "options_h": list(GUARD_OPTIONS_H), "input": "guard_features", "output": "logits",
                     **card_extra}
    (out / CARD_NAME).write_text(json.dumps(card, indent=2) + "\n")
    return out / "model.onnx"


def carry_guard(src_model: str | Path, dest: str | Path) -> bool:
    """Give the model in folder ``dest`` the guard of ``src_model`` (file and card entry); False if it has none."""
    src_model, dest = Path(src_model), Path(dest)
    guard = read_card(src_model).get("guard")
    if not isinstance(guard, dict) or not guard.get("file"):
        return False
    shutil.copy2(src_model.parent / guard["file"], dest / guard["file"])
    cp = dest / CARD_NAME
    card = json.loads(cp.read_text())
    card["guard"] = guard
    cp.write_text(json.dumps(card, indent=2) + "\n")
    return True


def check_guard_export(model: GuardNet, path: Path, trials: int = 200) -> None:
    """onnxruntime and torch must pick the same option on random feature rows."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((trials, N_GUARD_FEATURES)) * model.std.numpy() + model.mean.numpy()).astype(np.float32)
    a = sess.run(["logits"], {"guard_features": x})[0]
    with torch.no_grad():
        b = model(torch.from_numpy(x)).numpy()
    if np.abs(a - b).max() > 1e-3 or (a.argmax(1) != b.argmax(1)).any():
        raise RuntimeError("guard.onnx and the torch guard disagree")


# ---------------------------------------------------------------------------
# 6. the run
# ---------------------------------------------------------------------------


def train(args: Args, log=print) -> dict:
    t0 = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if args.smoke:
        args.episodes, args.iterations, args.eval_every, args.batch = 4, 4, 4, 64
    rng = random.Random(args.seed)
    out = Path(args.out)

    # (a) the data: every option of every episode, played to its end
    jobs = [(guard_case(rng, args.alibaba_share, args.smoke), args.placement, args.contexts_per_run)
            for _ in range(args.episodes)]
    if args.played:  # the data of an earlier run (its played.json): try other PPO settings without replaying
        played = json.loads(Path(args.played).read_text())
    elif args.workers > 1 and len(jobs) > 1:
        with multiprocessing.get_context("fork").Pool(args.workers) as pool:
            played = list(pool.imap(play_options, jobs))  # in order: the rows (and the batches) follow it
    else:
        played = [play_options(j) for j in jobs]
    out.mkdir(parents=True, exist_ok=True)
    (out / "played.json").write_text(json.dumps(played))
    rows, adv, weight = [], [], []
    for ep in played:
        if not ep["contexts"]:
            continue  # no multi-GPU job was ever blocked: nothing to learn from this episode
        a = advantages(ep["waits"])
        for x in ep["contexts"]:
            rows.append(x)
            adv.append(a)
            weight.append(1.0 / len(ep["contexts"]))  # each episode counts once, however many queries it had
    t_data = time.time() - t0
    log(f"played {len(played)} episodes x {len(GUARD_OPTIONS_H)} options in {t_data:.0f} s: {len(rows)} states")
    if not rows:
        raise ValueError(f"no episode of {len(played)} ever blocked a multi-GPU job, so the guard has nothing "
                         "to learn from: play more episodes (--episodes), or check --played")
    best_by_ep = [int(np.argmax(advantages(ep["waits"]))) for ep in played if ep["contexts"]]
    log("best option per episode: " + ", ".join(f"{h:g} h: {best_by_ep.count(k)}"
                                                   for k, h in enumerate(GUARD_OPTIONS_H)))
    X = torch.tensor(rows, dtype=torch.float32)
    A = torch.tensor(adv, dtype=torch.float32)
    W = torch.tensor(weight, dtype=torch.float64)

    # (b) the network, normalised on the data
    model = GuardNet(hidden=args.hidden)
    model.mean.copy_(X.mean(0))
    model.std.copy_(X.std(0).clamp_min(1e-3))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    val_cases = validation_set(args.smoke)
    baseline = {f"{c.name}:{c.seed}": run_case(c, FragAwarePolicy())["mean_wait_s"] for c in val_cases}
    best = (math.inf, None, -1, {})
    history = []

    # (c) PPO over the measured advantages
    for it in range(1, args.iterations + 1):
        idx = torch.multinomial(W, min(args.batch, len(rows)), replacement=True)
        x, a_all = X[idx], A[idx]
        with torch.no_grad():
            p_old = torch.softmax(model(x), -1)
            act = torch.multinomial(p_old, 1).squeeze(1)
            logp_old = torch.log(p_old.gather(1, act[:, None]).squeeze(1))
            gain = a_all.gather(1, act[:, None]).squeeze(1) - (p_old * a_all).sum(1)  # exact baseline
            gain = gain / (gain.std() + 1e-8)
        for _ in range(args.epochs):
            logits = model(x)
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(1, act[:, None]).squeeze(1)
            ratio = torch.exp(logp - logp_old)
            surrogate = torch.min(ratio * gain, ratio.clamp(1 - args.clip, 1 + args.clip) * gain)
            entropy = -(logp_all.exp() * logp_all).sum(1)
            loss = -(surrogate.mean() + args.entropy * entropy.mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
        if it % args.eval_every == 0 or it == args.iterations:
            with torch.no_grad():
                expected = (torch.softmax(model(X), -1) * A).sum(1)
                train_gain = float((expected.double() * W).sum() / W.sum())
            ratio_v, waits = validate(model, val_cases, args.placement, baseline)
            history.append({"iteration": it, "train_expected_gain": train_gain, "validation_ratio": ratio_v})
            log(f"iteration {it}: expected gain on the training states {train_gain:+.3f}, "
                f"validation wait {ratio_v:.3f} x frag-aware's")
            if ratio_v < best[0]:
                best = (ratio_v, {k: v.clone() for k, v in model.state_dict().items()}, it, waits)

    # (d) export the best checkpoint
    model.load_state_dict(best[1])
    wall = time.time() - t0
    card_extra = {"version": time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-g{args.seed}",
                  "algorithm": "PPO (clipped surrogate) on whole-episode counterfactual advantages",
                  "training_data": {"episodes": len(played), "states": len(rows),
                                    "families": ["poisson with 5-30 % multi-GPU 7g jobs on 1-8 nodes of 8 GPUs or "
                                                 "2-16 nodes of 4, loads 0.7-1.0, seeds >= 1000",
                                                 "alibaba trace first 55 %, time-limit seeds 1000-1006"]},
                  "seed": args.seed, "iterations": args.iterations, "wall_time_s": round(wall, 1),
                  "data_wall_time_s": round(t_data, 1), "best_iteration": best[2],
                  "validation": {"ratio_to_frag_aware": best[0], "waits_s": best[3], "frag_aware_s": baseline},
                  # the served policy lets the guard decide only inside the values it was trained on
                  "feature_range": {**feature_range(rows), "source": "every guard feature row trained on"},
                  "history": history, "args": asdict(args)}
    path = export_guard(model, out, args.placement, card_extra)
    torch.save({"state_dict": model.state_dict(), "hidden": args.hidden, "args": asdict(args)}, out / "guard.pt")
    log(f"best validation {best[0]:.3f} x frag-aware's at iteration {best[2]}; wrote {path} and "
        f"{out / GUARD_FILE} ({wall:.0f} s)")
    return {"model": str(path), "validation_ratio": best[0], "wall_time_s": wall}


def main(argv: list[str] | None = None) -> int:
    args = dataclass_args(Args, argv, __doc__.split("\n\n")[0])
    try:
        train(args, log=lambda m: print(m, flush=True))
    except ValueError as e:
        print(f"training/guard.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
