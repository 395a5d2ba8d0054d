"""Layout-and-dispatch policies behind one interface (see base.py)."""

from __future__ import annotations

from typing import Callable

from slurm_mig.errors import ConfigError
from slurm_mig.policies.base import (
    Assignment,
    ClusterState,
    Decision,
    DecisionError,
    GpuState,
    LayoutChange,
    PendingJob,
    Policy,
    check_decision,
)

# name -> factory; other modules add theirs with register_policy().
_REGISTRY: dict[str, Callable[[], Policy]] = {}


def register_policy(name: str, factory: Callable[[], Policy]) -> None:
    """Make a policy available to get_policy() under ``name``."""
    _REGISTRY[name] = factory


def _builtin() -> None:
    from slurm_mig.policies.first_fit import FirstFitPolicy

    register_policy("first-fit", FirstFitPolicy)


def get_policy(name: str) -> Policy:
    """A new instance of the policy called ``name``."""
    if not _REGISTRY:
        _builtin()
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ConfigError(f"unknown policy {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def policy_names() -> list[str]:
    if not _REGISTRY:
        _builtin()
    return sorted(_REGISTRY)


__all__ = [
    "Assignment", "ClusterState", "Decision", "DecisionError", "GpuState", "LayoutChange", "PendingJob",
    "Policy", "check_decision", "get_policy", "policy_names", "register_policy",
]
