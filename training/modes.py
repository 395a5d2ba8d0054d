"""An experiment, not shipped: learn the *reservation rule* of frag-aware, decision by decision.

    .venv/bin/python -m training.modes train --out runs/rl-modes          # ~20 min (docs/rl-policy.md)
    .venv/bin/python -m training.modes train --out /tmp/m --smoke         # seconds
    .venv/bin/python -m training.modes evaluate --model runs/rl-modes/model.pt --markdown

The shipped ``rl`` policy scores placements (slurm_mig/policies/rl.py); it is within
noise of frag-aware, and first-fit -- which makes no reservations -- waits ~35 %
less on the held-out small-heavy family. This experiment tests the other lever:
:class:`ModePolicy` is frag-aware in which, at each decision where a blocked
multi-GPU job younger than ``reserve_guard_s`` would get a reservation, a small
network picks a *mode* for the rest of the decision: ``reserve`` (frag-aware's
rule, mode 0) or ``defer`` (no reservation for young multi-GPU jobs). Single-GPU
jobs, and every job older than the guard, always get frag-aware's reservation.
Placement is frag-aware's. With mode 0 always, it *is* frag-aware.

Training: counterfactual branches of the deterministic simulator. Replay a
training episode with the greedy policy, pick decisions where a mode is chosen,
snapshot, play each mode *held* for ``hold_h`` simulated hours (then greedy)
until ``horizon_h`` hours later; a mode's advantage is the waiting it saves
against the mean of the modes, in job-hours per GPU. Both advantages are known
at every sampled state, so the network's centred scores are regressed on them
(Huber); the greedy policy plays the next episodes. Validation: the training
families' validation seeds (training/splits.py), against the better of
frag-aware and first-fit per case; the best checkpoint is kept.

Outcome (docs/rl-policy.md, "Reservation modes"): not better than the best
heuristic on the held-out families, and on one Alibaba seed it let an 8-GPU job
wait 464 h (frag-aware: 59 h). That is why it is an experiment here and not
the shipped policy. Evaluation uses numpy for the network (no ONNX export).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from slurm_mig.policies._core import INF, Ctx
from slurm_mig.policies.base import ClusterState, PendingJob
from slurm_mig.policies.frag_aware import _SIZE, FragAwarePolicy, _kind
from training.args import parse_args as dataclass_args
from training.evaluate import evaluate as evaluate_cases
from training.evaluate import HEURISTICS, markdown, run_case, summarize, wait_ratio
from training.model import Scorer, load_weights
from training.runlog import start_run
from training.splits import TEST_FAMILIES, TEST_SEEDS, TRAIN_FAMILIES, Case, heldout_cases, train_case, validation_cases
# The same argmax and decision loop as placement training; importing it also registers the GpuModel pickler.
from training.train import greedy, play_decisions

MODES: tuple[str, ...] = ("reserve", "defer")

FEATURE_NAMES: tuple[str, ...] = (
    # the job that would get the reservation
    "job_size",            # compute slices of its profile / 7
    "job_count",           # instances it asks for / 8
    "job_multi",           # 1: a multi-GPU job
    "job_waited_h",        # log1p(hours it has waited)
    "guard_left",          # share of reserve_guard_s still to go before it must be reserved
    "reserve_delay_h",     # log1p(hours until the reservation would start), capped at 6 (6: unknown)
    "reserve_gpus",        # GPUs the reservation would hold / GPUs in the cluster
    "reserve_idle",        # share of those GPUs already idle (how far the drain has come)
    # the queue (its first `lookahead` jobs, priority order)
    "queue_len",           # log1p(pending jobs) / 5
    "queue_per_gpu",       # log1p(pending jobs / GPUs)
    "queue_work_per_gpu",  # log1p(compute slices asked by the look-ahead / compute slices of the cluster)
    "demand_1g", "demand_2g", "demand_3g", "demand_4g", "demand_7g",  # frag-aware's demand weights
    "demand_multi",        # frag-aware's multi-GPU demand weight
    "pending_multi",       # share of the look-ahead's jobs that ask for several GPUs
    "oldest_age",          # oldest look-ahead job's wait / reserve_guard_s, capped at 1
    "oldest_multi_age",    # oldest multi-GPU look-ahead job's wait / reserve_guard_s, capped at 1 (0: none)
    "limits_share",        # share of the look-ahead's jobs with a time limit
    # the cluster
    "cluster_busy",        # share of compute slices locked
    "idle_gpus",           # share of GPUs with nothing locked
    # the mode this row stands for (one-hot, MODES order)
    "mode_reserve", "mode_defer",
)
N_FEATURES = len(FEATURE_NAMES)

N_CONTEXT = N_FEATURES - len(MODES)  # the rows differ only in the mode one-hot


@dataclass
class Choice:
    """One mode choice: a row of ``features`` per mode of :data:`MODES`."""

    job: PendingJob
    features: list[list[float]]
    options: list
    state_now: float


class ModePolicy(FragAwarePolicy):
    """frag-aware whose multi-GPU reservation rule is chosen per decision by ``chooser`` (see module doc)."""

    name = "rl-modes"
    version = "1"

    def __init__(self, *, chooser: Callable[[Choice], int] | None = None, reserve_guard_s: float = 16 * 3600.0,
                 explain_waiting: bool = True, **frag) -> None:
        super().__init__(explain_waiting=explain_waiting, **frag)
        self.chooser = chooser or (lambda c: 0)
        self.reserve_guard_s = reserve_guard_s
        self._locked: list[int] | None = None
        self._locked_sum = 0
        self._cap_sum = 0

    def choose(self, choice: Choice) -> int:
        k = self.chooser(choice)
        if not 0 <= k < len(choice.options):
            raise ValueError(f"chooser picked mode {k} of {len(choice.options)}")
        return k

    def begin(self, ctx: Ctx, state: ClusterState) -> None:
        super().begin(ctx, state)
        self._state = state
        self._mode: int | None = None
        self._busy_idle = self._cluster_busy(ctx.idx)  # every decision: it follows the index's diff
        reserve = ctx.reserve
        ctx.reserve = lambda job: self._reserve(ctx, job, reserve)

    def _reserve(self, ctx: Ctx, job: PendingJob, reserve: Callable) -> object:
        """Single-GPU jobs, and jobs older than the guard: frag-aware's reservation. A younger multi-GPU job:
        as the decision's mode says; the first such job of a decision asks the model for the mode."""
        if job.count == 1 or ctx.now - job.submit_time >= self.reserve_guard_s:
            return reserve(job)
        mode = self._mode
        if mode is None:
            r = reserve(job)
            if r is None:
                return None
            mode = self._mode = self.choose(Choice(job, self.features(ctx, job, r), list(MODES), ctx.now))
            if mode == 0:
                return r
            ctx.reservations.remove(r)
            return None
        return reserve(job) if mode == 0 else None

    def features(self, ctx: Ctx, job: PendingJob, r) -> list[list[float]]:
        """One row per mode: the decision context of FEATURE_NAMES plus the mode's one-hot."""
        now = ctx.now
        idx = ctx.idx
        guard = self.reserve_guard_s
        ngpus = max(len(idx.infos), 1)
        waited = max(0.0, now - job.submit_time)
        if r.t == INF:
            delay = 6.0
        else:
            delay = min(6.0, math.log1p(max(0.0, r.t - now) / 3600.0))
        pending = self._state.pending
        look = pending[: self.lookahead]
        work = 0
        multi = 0
        limits = 0
        oldest = 0.0
        oldest_multi = 0.0
        for j in look:
            work += _SIZE.get(_kind(j.profile), 7) * j.count
            age = now - j.submit_time
            if age > oldest:
                oldest = age
            if j.count > 1:
                multi += 1
                if age > oldest_multi:
                    oldest_multi = age
            if j.time_limit_s:
                limits += 1
        n = max(len(look), 1)
        busy, idle = self._busy_idle
        w = self._weights
        context = [
            _SIZE.get(_kind(job.profile), 7) / 7.0,
            job.count / 8.0,
            1.0 if job.count > 1 else 0.0,
            math.log1p(waited / 3600.0),
            max(0.0, 1.0 - waited / guard),
            delay,
            len(r.regions) / ngpus,
            sum(1 for g in r.regions if ctx.info(g).locked_mask == 0) / max(len(r.regions), 1),
            math.log1p(len(pending)) / 5.0,
            math.log1p(len(pending) / ngpus),
            math.log1p(work / max(self._cap_sum, 1)),
            w.get("1g", 0.0), w.get("2g", 0.0), w.get("3g", 0.0), w.get("4g", 0.0), w.get("7g", 0.0),
            self._multi,
            multi / n,
            min(1.0, oldest / guard),
            min(1.0, oldest_multi / guard),
            limits / n,
            busy,
            idle,
        ]
        rows = []
        for m in range(len(MODES)):
            onehot = [0.0] * len(MODES)
            onehot[m] = 1.0
            rows.append(context + onehot)
        return rows

    def _cluster_busy(self, idx) -> tuple[float, float]:
        """(share of compute slices locked, share of GPUs idle), kept up to date by the index's identity diff."""
        lc = self._locked
        if idx.rebuilt or lc is None or len(lc) != len(idx.infos):
            lc = self._locked = [i.locked_compute for i in idx.infos]
            self._locked_sum = sum(lc)
            self._cap_sum = sum(i.t.compute for i in idx.infos)
            self._idle = sum(1 for x in lc if x == 0)
        else:
            for g in idx.changed_since:
                new = idx.infos[g].locked_compute
                old = lc[g]
                self._locked_sum += new - old
                self._idle += (new == 0) - (old == 0)
                lc[g] = new
        busy = self._locked_sum / self._cap_sum if self._cap_sum else 0.0
        return busy, self._idle / max(len(lc), 1)





# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------

@dataclass
class Args:
    out: str = "runs/rl-modes"  # output folder: model.pt, log.jsonl
    seed: int = 1  # seeds python, numpy and torch; training episodes are drawn from it
    smoke: bool = False  # tiny everything: a CI check that the pipeline runs (seconds)
    threads: int = 1  # torch threads (1 on a shared 2-core machine, FACTS §6)
    trace: str = ""  # Alibaba trace (default ../shared/traces/alibaba-v2023-train.csv when present)
    hidden: int = 32  # MLP width
    reserve_guard_h: float = 16.0  # a job older than this always gets frag-aware's reservation
    norm_episodes: int = 12  # episodes played with frag-aware's mode to fit the feature normalisation
    # policy improvement on counterfactual branches
    iterations: int = 100_000  # iterations at most (the time budget ends the full run first)
    time_budget_min: float = 20.0  # stop after this many minutes (0: no limit)
    episodes_per_iteration: int = 2  # training episodes per iteration
    points_per_episode: int = 8  # mode choices per episode whose alternatives are played out
    episode_jobs: tuple[int, int] = (300, 600)  # jobs per synthetic training episode
    hold_h: float = 3.0  # a branch holds its mode for this many simulated hours ...
    horizon_h: float = 10.0  # ... and is judged by the waiting over this many hours
    lr: float = 1e-3  # Adam learning rate
    epochs: int = 2  # passes over the kept samples per iteration
    minibatch: int = 256  # samples per gradient step
    replay: int = 400  # iterations of samples kept (older ones dropped)
    adv_scale: float = 0.05  # advantages (job-hours per GPU) are regressed in units of this
    max_grad_norm: float = 0.5
    # selection
    eval_every: int = 6  # validate the greedy policy every this many iterations
    families: tuple[str, ...] = TRAIN_FAMILIES  # training workload families (training/splits.py)
    multi_shares: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2)  # multi-GPU job shares of the Poisson episodes



def parse_args(argv: list[str] | None = None) -> Args:
    a = dataclass_args(Args, argv, "train the reservation-mode experiment (training/modes.py)")
    if a.smoke:
        a.norm_episodes, a.iterations, a.episodes_per_iteration = 2, 2, 1
        a.episode_jobs, a.eval_every, a.epochs, a.points_per_episode = (80, 120), 2, 1, 2
    return a


def run_greedy(case: Case, f, *, guard_s: float = 16 * 3600.0, snap_at=frozenset(), start: bytes | None = None,
               force: tuple[int, float] | None = None, t_end: float = math.inf, record: bool = False) -> dict:
    """Play ``case`` (or continue a snapshot) with argmax modes; ``force = (mode, until)`` holds a mode
    for every choice before simulated time ``until``.

    Returns the waiting cost accrued before ``t_end`` (job-seconds: jobs pending x time, plus the delay
    of jobs whose instances are still being created), the per-decision timeline (decision, t0, t1,
    n_left, delays) and, with ``record``, every choice (decision, t, features, logits); ``snaps``
    maps decision index -> pickled simulator.
    """
    points = []
    where = [0]  # the decision

    def chooser(ch) -> int:
        if force is not None and ch.state_now < force[1]:
            return force[0]
        z = f(ch.features)
        if record:
            points.append((where[0], ch.state_now, np.asarray(ch.features, dtype=np.float32), z))
        return int(np.argmax(z))

    def begin(d: int) -> None:
        where[0] = d

    r = play_decisions(case, lambda: ModePolicy(explain_waiting=False, reserve_guard_s=guard_s), chooser, begin,
                       snap_at=snap_at, start=start, t_end=t_end)
    return {"cost": r["cost"], "timeline": r["timeline"], "points": points, "snaps": r["snaps"]}


def branch_samples(case: Case, f, points_per_episode: int, hold_s: float, horizon_s: float,
                   rng: np.random.Generator, guard_s: float) -> list[tuple]:
    """Samples (features [modes, F], advantage per mode in job-hours) from one episode."""
    main = run_greedy(case, f, guard_s=guard_s, record=True)
    pts = main["points"]
    if not pts:
        return []
    # One choice per decision at most; spread over the episode.
    chosen = [pts[i] for i in sorted(rng.choice(len(pts), size=min(points_per_episode, len(pts)), replace=False))]
    snaps = run_greedy(case, f, guard_s=guard_s, snap_at={p[0] for p in chosen})["snaps"]
    out = []
    for d, t, x, z in chosen:
        costs = []
        for m in range(len(MODES)):
            r = run_greedy(case, f, guard_s=guard_s, start=snaps[d], force=(m, t + hold_s), t_end=t + horizon_s)
            costs.append(r["cost"])
        costs = np.array(costs)
        # Job-hours saved per GPU: clusters of any size on one scale.
        out.append((x, (costs.mean() - costs) / 3600.0 / case.spec.gpus))
    return out


# ---------------------------------------------------------------------------
# 2. validation
# ---------------------------------------------------------------------------


def validate(model: Scorer, cases: list[Case], reference: dict[str, float], guard_s: float) -> float:
    """Mean over validation cases of (greedy policy's mean wait + 60 s) / (reference's + 60 s)."""
    f = model.numpy_forward()
    return wait_ratio(cases, reference, lambda: ModePolicy(chooser=greedy(f), explain_waiting=False,
                                                           reserve_guard_s=guard_s))



def train(args: Args, *, vcases: list[Case] | None = None, echo: bool = True) -> tuple[Scorer, dict]:
    """The whole run; writes model.pt and log.jsonl to args.out; returns the best model and a summary."""
    rng, nprng, out, log = start_run(args, echo=echo)
    trace = Path(args.trace) if args.trace else None

    def new_case() -> Case:
        return train_case(rng, jobs=args.episode_jobs, trace=trace, families=args.families,
                          multi_shares=args.multi_shares)

    guard_s = args.reserve_guard_h * 3600.0
    model = Scorer(N_FEATURES, args.hidden)

    # -- 0. feature normalisation from episodes played as frag-aware ------------------------
    norm_feats: list[np.ndarray] = []
    zero = lambda x: np.zeros(len(x))  # noqa: E731  (argmax of ties: mode 0, frag-aware)
    for _ in range(args.norm_episodes):
        norm_feats += [p[2] for p in run_greedy(new_case(), zero, guard_s=guard_s, record=True)["points"]]
    if norm_feats:
        model.set_normalisation(np.concatenate(norm_feats))
    log(phase="norm", choices=len(norm_feats))

    # -- validation reference: the better of frag-aware and first-fit per case ---------------
    if vcases is None:
        vcases = validation_cases(trace, small=args.smoke)
    reference = {c.name + str(c.seed): min(run_case(c, "frag-aware")["mean_wait_s"],
                                           run_case(c, "first-fit")["mean_wait_s"]) for c in vcases}
    best_score = validate(model, vcases, reference, guard_s)
    best_state = {k: v.clone() for k, v in model.state_dict().items()}
    best_iter = 0
    log(phase="valid", iteration=0, score=best_score)

    # -- 1. policy improvement on measured advantages ------------------------------------------
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    hold_s, horizon_s = args.hold_h * 3600.0, args.horizon_h * 3600.0
    steps = 0
    it = 0
    memory: list[list[tuple]] = []
    loop_start = time.time()
    for it in range(1, args.iterations + 1):
        if args.time_budget_min and time.time() - loop_start > args.time_budget_min * 60:
            log(phase="train", stopped="time budget", iteration=it)
            it -= 1
            break
        f = model.numpy_forward()
        fresh = []
        for _ in range(args.episodes_per_iteration):
            fresh += branch_samples(new_case(), f, args.points_per_episode, hold_s, horizon_s, nprng, guard_s)
        steps += len(fresh)
        memory = (memory + [fresh])[-args.replay:]
        batch = [b for chunk in memory for b in chunk]
        if not fresh:  # no mode choice in these episodes (no young multi-GPU job was blocked): nothing new
            continue
        X = torch.as_tensor(np.stack([b[0] for b in batch]), dtype=torch.float32)
        raw = np.stack([b[1] for b in batch])
        A = torch.as_tensor(raw / args.adv_scale, dtype=torch.float32)
        for _ in range(args.epochs):
            perm = torch.randperm(len(X))
            for s0 in range(0, len(X), args.minibatch):
                ix = perm[s0: s0 + args.minibatch]
                q = model(X[ix])
                # Regress each mode's score on its measured advantage (the mean over modes is 0 by construction).
                loss = torch.nn.functional.huber_loss(q - q.mean(-1, keepdim=True), A[ix], delta=1.0)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                opt.step()
        with torch.no_grad():
            pick = model(X).argmax(-1).numpy()
        log(phase="train", iteration=it, samples=len(fresh), batch=len(batch), steps=steps,
            mean_abs_adv_h=float(np.abs(raw).mean()), greedy_gain_h=float(raw[np.arange(len(raw)), pick].mean()),
            best_gain_h=float(raw.max(-1).mean()), modes=np.bincount(pick, minlength=len(MODES)).tolist(),
            loss=float(loss.detach()))
        if it % args.eval_every == 0 or it == args.iterations:
            score = validate(model, vcases, reference, guard_s)
            if score < best_score:
                best_score, best_iter = score, it
                best_state = {k: v.clone() for k, v in model.state_dict().items()}
            log(phase="valid", iteration=it, score=score, best=best_score, best_iteration=best_iter)


    model.load_state_dict(best_state)
    wall = time.time() - log.t_start
    summary = {"wall_time_s": round(wall, 1), "iterations": it, "choices_trained": steps, "best_iteration": best_iter,
               "validation_wait_ratio_vs_best_of_frag_aware_first_fit": best_score, "seed": args.seed,
               "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(args).items()}}
    torch.save({"state_dict": model.state_dict(), "n_features": N_FEATURES, "hidden": args.hidden,
                "modes": list(MODES), "features": list(FEATURE_NAMES), "summary": summary}, out / "model.pt")
    log(phase="done", wall_s=wall, best_iteration=best_iter, validation_score=best_score, model=str(out / "model.pt"))
    log.close()
    return model, summary


def load(path: str | Path) -> tuple[Scorer, dict]:
    ck = load_weights(path)
    if ck.get("features") != list(FEATURE_NAMES):
        raise ValueError(f"{path} was trained on other features")
    model = Scorer(ck["n_features"], ck["hidden"])
    model.load_state_dict(ck["state_dict"])
    return model, ck


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("train", "evaluate"):
        print("usage: python -m training.modes train|evaluate ...", file=sys.stderr)
        return 2
    if argv[0] == "train":
        train(parse_args(argv[1:]))
        return 0
    ap = argparse.ArgumentParser(description="the reservation-mode experiment on the held-out workloads")
    ap.add_argument("--model", required=True, help="model.pt written by `training.modes train`")
    ap.add_argument("--families", default=",".join(TEST_FAMILIES))
    ap.add_argument("--seeds", default=",".join(map(str, TEST_SEEDS)))
    ap.add_argument("--heuristics", default=",".join(HEURISTICS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv[1:])
    torch.set_num_threads(1)
    model, ck = load(a.model)
    f = model.numpy_forward()
    guard = ck["summary"]["args"]["reserve_guard_h"] * 3600.0
    cases = heldout_cases(tuple(int(s) for s in a.seeds.split(",")), tuple(a.families.split(",")))
    heur = [h for h in a.heuristics.split(",") if h]
    pols: dict[str, object] = {"rl": lambda: ModePolicy(chooser=greedy(f), reserve_guard_s=guard)}
    pols.update({h: h for h in heur})
    rows = evaluate_cases(cases, pols, lambda m: print(m, file=sys.stderr, flush=True))
    summary = summarize(rows, heuristics=tuple(heur))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    print(markdown(summary, ["rl", *heur]) if a.markdown else json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
