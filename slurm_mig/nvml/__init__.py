"""MIG through NVML: one small interface (base.MigBackend) and two implementations.

``open_backend("real")`` talks to the GPUs through nvidia-ml-py;
``open_backend("simulated", state_path=...)`` gives simulated MIG GPUs whose
state is shared through a locked file. ``apply_layout`` moves a GPU to a layout
through the transition planner. Nothing here imports pynvml, numpy or rich at
import time.
"""

from __future__ import annotations

from typing import Any

from slurm_mig.errors import ConfigError

from slurm_mig.nvml.apply import ApplyResult, LayoutDiff, apply_layout, assert_layout
from slurm_mig.nvml.base import (
    ForeignInstance,
    GpuInfo,
    GpuLost,
    InsufficientResources,
    InUse,
    InvalidArgument,
    MigBackend,
    MigInstance,
    MigModePending,
    NoPermission,
    NotFound,
    NotSupported,
    NvmlError,
    NvmlUnavailable,
    ResetRequired,
    foreign_instances,
    observed_layout,
)

BACKEND_KINDS = ("real", "simulated")


def open_backend(kind: str = "simulated", **opts: Any) -> MigBackend:
    """Open a MigBackend: ``"real"`` (NVML; no options) or ``"simulated"``.

    Simulated options are SimulatedBackend's: ``state_path`` (required), ``gpus``,
    ``delay_scale``, ``allow_config``, ``require_root``, ``seed``.
    """
    kind = kind.strip().lower()
    if kind == "real":
        from slurm_mig.nvml.real import RealBackend

        return RealBackend(**opts)
    if kind in ("simulated", "sim"):
        from slurm_mig.nvml.simulated import SimulatedBackend

        if "state_path" not in opts:
            raise NvmlUnavailable("the simulated backend needs state_path (the simulated node's state file)")
        return SimulatedBackend(opts.pop("state_path"), **opts)
    raise ConfigError(f"unknown MIG backend {kind!r} (known: {', '.join(BACKEND_KINDS)})")


__all__ = [
    "ApplyResult", "LayoutDiff", "apply_layout", "assert_layout",
    "ForeignInstance", "GpuInfo", "GpuLost", "InsufficientResources", "InUse", "InvalidArgument", "MigBackend",
    "MigInstance", "MigModePending", "NoPermission", "NotFound", "NotSupported", "NvmlError", "NvmlUnavailable",
    "ResetRequired",
    "foreign_instances", "observed_layout", "open_backend", "BACKEND_KINDS",
]
