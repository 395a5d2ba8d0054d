"""Write a model's training range into its card: the feature values its networks were trained on.

    .venv/bin/python -m training.ranges policy/default.onnx

The rl policy lets a network decide only choices whose feature rows lie inside the
card's ``feature_range`` (slurm_mig/policies/rl.py, ``RANGE_SLACK``); outside it,
frag-aware's rule decides. training/train.py and training/guard.py record the range
of the rows they train on. This command gives a model trained before that its
range: it plays training episodes (training/splits.py's ``train_case``, the guard's
``guard_case``; never a validation or test workload), half with the model's own
choices and half with frag-aware's, as training did, and takes each feature's
minimum and maximum over every row seen.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from slurm_mig.policies.rl import OnnxScorer, RLPolicy, card_path
from training.evaluate import run_case
from training.splits import train_case


def feature_range(rows) -> dict:
    """{"lo": [...], "hi": [...]}: each feature's minimum and maximum over ``rows`` [N, F]."""
    x = np.asarray(rows, dtype=np.float64)
    return {"lo": [float(v) for v in x.min(axis=0)], "hi": [float(v) for v in x.max(axis=0)]}


def merge_ranges(a: dict | None, b: dict | None) -> dict | None:
    """The range covering both (a fine-tuned model has seen its parent's rows and its own)."""
    if a is None or b is None:
        return a or b
    return {"lo": [min(x, y) for x, y in zip(a["lo"], b["lo"])], "hi": [max(x, y) for x, y in zip(a["hi"], b["hi"])]}


def placement_rows(model: Path, episodes: int, seed: int) -> list:
    """Feature rows of every placement choice in ``episodes`` training episodes."""
    sc = OnnxScorer(model, guard=False)
    rng = random.Random(seed)
    rows: list = []
    for i in range(episodes):
        own = i % 2 == 0

        def chooser(choice, own: bool = own) -> int:
            rows.extend(choice.features)
            return sc.pick(choice.features) if own else 0

        run_case(train_case(rng, jobs=(250, 500)), RLPolicy(model_path=str(model), chooser=chooser,
                                                            guard_chooser=lambda f: 0.0))
    return rows


def guard_rows(model: Path, episodes: int, seed: int) -> list:
    """Guard feature rows of ``episodes`` guard training episodes, each holding one option in turn."""
    from training.guard import GUARD_OPTIONS_H, guard_case

    sc = OnnxScorer(model)
    rng = random.Random(seed)
    rows: list = []
    for i in range(episodes):
        fixed = GUARD_OPTIONS_H[i % len(GUARD_OPTIONS_H)]

        def choose(features: list[float], fixed: float = fixed) -> float:
            rows.append(features)
            return fixed

        run_case(guard_case(rng), RLPolicy(model_path=str(model), chooser=lambda c: sc.pick(c.features),
                                           guard_chooser=choose))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="model.onnx whose card gets the range")
    ap.add_argument("--episodes", type=int, default=200, help="training episodes for the placement range")
    ap.add_argument("--guard-episodes", type=int, default=48, help="training episodes for the guard's range")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args(argv)
    model = Path(a.model)
    t0 = time.time()
    cp = card_path(model)
    card = json.loads(cp.read_text())
    rows = placement_rows(model, a.episodes, a.seed)
    card["feature_range"] = {**feature_range(rows), "rows": len(rows),
                             "source": f"{a.episodes} training episodes (train_case, seed {a.seed}), half with "
                                       "the model's choices, half with frag-aware's"}
    print(f"placement: {len(rows)} rows from {a.episodes} episodes")
    if isinstance(card.get("guard"), dict):
        g = guard_rows(model, a.guard_episodes, a.seed)
        card["guard"]["feature_range"] = {**feature_range(g), "rows": len(g), "source": (
            f"{a.guard_episodes} guard training episodes (guard_case, seed {a.seed}), each option in turn")}
        print(f"guard: {len(g)} rows")
    cp.write_text(json.dumps(card, indent=2) + "\n")
    print(f"wrote the ranges into {cp} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
