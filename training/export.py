"""Export a trained scorer to ONNX with its model card, and check the export against torch.

    python -m training.export runs/rl/model.pt policy/default.onnx

The ONNX graph has one input ``features`` [N, F] (float32, N dynamic) and one
output ``logits`` [N]; its metadata and the card beside it carry the feature
schema, which slurm_mig/policies/rl.py checks before using the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from slurm_mig.policies.rl import CARD_NAME, FEATURE_NAMES, FEATURE_SCHEMA, N_FEATURES
from training.model import Scorer, load_weights


def export_onnx(model: Scorer, path: str | Path, card: dict, *, check: bool = True) -> Path:
    """Write ``path`` (one self-contained file) and ``model_card.json`` beside it; returns the card path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    save_onnx(model, path, N_FEATURES, "features", "candidates")
    import onnx

    m = onnx.load(str(path))
    meta = {"feature_schema": FEATURE_SCHEMA, "version": str(card.get("version", ""))}
    for k, v in meta.items():
        p = m.metadata_props.add()
        p.key, p.value = k, v
    onnx.save(m, str(path))
    full = {"feature_schema": FEATURE_SCHEMA, "features": list(FEATURE_NAMES), "input": "features",
            "output": "logits", **card}
    full.setdefault("created", time.time())
    cp = path.parent / CARD_NAME
    cp.write_text(json.dumps(full, indent=2, sort_keys=False) + "\n")
    if check:
        agree = check_export(model, path)
        if agree < 1.0:
            raise RuntimeError(f"ONNX and torch disagree on {1 - agree:.1%} of argmax checks")
    return cp


def save_onnx(model: torch.nn.Module, path: str | Path, n_features: int, input_name: str, rows: str) -> None:
    """``model`` (rows [N, n_features] -> logits) as one self-contained ONNX file; N is dynamic (``rows``)."""
    example = torch.randn(3, n_features)
    prog = torch.onnx.export(
        model, (example,), dynamo=True, input_names=[input_name], output_names=["logits"],
        dynamic_shapes={"features": {0: torch.export.Dim(rows, min=1, max=100_000)}},  # forward's argument
        external_data=False, verbose=False,
    )
    prog.save(str(path), external_data=False)


def check_export(model: Scorer, path: str | Path, trials: int = 200) -> float:
    """Share of random candidate tables where onnxruntime and torch pick the same candidate."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    same = 0
    with torch.no_grad():
        for _ in range(trials):
            n = int(rng.integers(1, 64))
            x = (rng.standard_normal((n, N_FEATURES)) * model.std.numpy() + model.mean.numpy()).astype(np.float32)
            a = sess.run(["logits"], {"features": x})[0].reshape(-1)
            b = model(torch.from_numpy(x)).numpy().reshape(-1)
            same += int(a.argmax() == b.argmax()) if np.abs(a - b).max() < 1e-3 else 0
    return same / trials


def load_checkpoint(path: str | Path) -> tuple[Scorer, dict]:
    ck = load_weights(path)
    model = Scorer(ck.get("n_features", N_FEATURES), ck.get("hidden", 64))
    model.load_state_dict(ck["state_dict"])
    return model, ck.get("card", {})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="model.pt written by training/train.py")
    ap.add_argument("onnx", help="where to write the .onnx (model_card.json goes beside it)")
    args = ap.parse_args(argv)
    model, card = load_checkpoint(args.checkpoint)
    cp = export_onnx(model, args.onnx, card)
    print(f"wrote {args.onnx} and {cp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
