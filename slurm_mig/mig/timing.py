"""How long MIG reconfiguration steps take, per GPU family.

Measured create/destroy times in seconds (artecs-group/RL_MIG_scheduler
`reconfig_time_map`, FACTS §2). The simulated GPU sleeps for these (scaled),
and the simulator and policies charge them as reconfiguration cost.
"""

from __future__ import annotations

from typing import Iterable

from slurm_mig.mig.profiles import GpuModel

# kind -> (create_s, destroy_s)
_A100 = {"1g": (0.16, 0.20), "2g": (0.17, 0.20), "3g": (0.20, 0.21), "4g": (0.21, 0.21), "7g": (0.24, 0.22)}
_H100 = {"1g": (0.16, 0.21), "2g": (0.21, 0.23), "3g": (0.33, 0.25), "4g": (0.38, 0.26), "7g": (0.42, 0.26)}


def _table(model: GpuModel) -> dict[str, tuple[float, float]]:
    # H200 and B200 were not measured; Hopper's figures are the nearest we have.
    return _A100 if model.name.startswith(("A100", "A30")) else _H100


def step_seconds(model: GpuModel, profile_name: str, action: str) -> float:
    """Seconds one create or destroy of ``profile_name`` takes on ``model``."""
    kind = model.profile(profile_name).kind
    base = kind.split("+")[0].split(".")[0]  # +me and double-memory 1g time like a 1g/2g
    create, destroy = _table(model).get(base, _table(model)["1g"])
    return create if action == "create" else destroy


def steps_seconds(model: GpuModel, steps: Iterable) -> float:
    """Total seconds for a sequence of transition Steps on one GPU (they run one after another)."""
    return sum(step_seconds(model, s.slot.profile, s.action) for s in steps)
