"""The candidate scorer: one small MLP shared by every candidate, so any cluster size works.

logits[i] = MLP((features[i] - mean) / std); the policy is softmax(logits) over the
real candidates of one choice. The normalisation constants are buffers, so the
exported ONNX graph takes raw features.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from slurm_mig.errors import ConfigError
from slurm_mig.policies.rl import N_FEATURES


def load_weights(path) -> dict:
    """A checkpoint (model.pt, guard.pt) as plain tensors, dicts, lists and numbers.

    weights_only: a model.pt comes from the policy store, which copies it from
    any folder given to ``policy install``; a full unpickle would run whatever
    code it names, as root, during ``policy retrain``."""
    try:
        ck = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError... for a bad file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{path} is not a plain torch weights file ({first}); refusing to load it") from None
    if not isinstance(ck, dict) or "state_dict" not in ck:
        raise ConfigError(f"{path} holds no state_dict: not a checkpoint written by training/")
    return ck


class Scorer(nn.Module):
    """The MLP with its feature normalisation; ``n_outputs`` > 1 gives a row of logits per input row
    (the reservation guard's options, training/guard.py)."""

    def __init__(self, n_features: int = N_FEATURES, hidden: int = 64, n_outputs: int = 1) -> None:
        super().__init__()
        self.n_outputs = n_outputs
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("std", torch.ones(n_features))
        self.net = nn.Sequential(
            nn.Linear(n_features, hidden), nn.Tanh(),
            nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, n_outputs),
        )
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., N, F] -> logits [..., N] (one output) or [..., N, n_outputs]."""
        out = self.net((features - self.mean) / self.std)
        return out.squeeze(-1) if self.n_outputs == 1 else out

    def set_normalisation(self, feats: np.ndarray) -> None:
        m = feats.mean(axis=0)
        s = feats.std(axis=0)
        s[s < 1e-3] = 1.0  # constant features (e.g. unused profiles) pass through
        self.mean.copy_(torch.as_tensor(m, dtype=torch.float32))
        self.std.copy_(torch.as_tensor(s, dtype=torch.float32))

    def numpy_forward(self):
        """A torch-free copy for fast rollouts: f(features [N, F]) -> logits [N] (numpy, float64)."""
        sd = {k: v.detach().double().numpy().copy() for k, v in self.state_dict().items()}
        mean, std = sd["mean"], sd["std"]
        w1, b1 = sd["net.0.weight"].T, sd["net.0.bias"]
        w2, b2 = sd["net.2.weight"].T, sd["net.2.bias"]
        w3, b3 = sd["net.4.weight"].T, sd["net.4.bias"]

        def f(x) -> np.ndarray:
            h = np.tanh(((np.asarray(x, dtype=np.float64) - mean) / std) @ w1 + b1)
            h = np.tanh(h @ w2 + b2)
            return (h @ w3 + b3).reshape(-1)

        return f
