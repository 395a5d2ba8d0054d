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
_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    """Make a policy available to get_policy() under ``name``."""
    _REGISTRY[name] = factory


def _builtin() -> None:
    from slurm_mig.policies.first_fit import FirstFitPolicy, GreedyPolicy
    from slurm_mig.policies.frag_aware import FragAwarePolicy
    from slurm_mig.policies.rl import make_rl, make_rl_candidate
    from slurm_mig.policies.static import NoMigPolicy, StaticPolicy

    for name, factory in (
        ("first-fit", FirstFitPolicy),
        ("greedy", GreedyPolicy),
        ("no-mig", NoMigPolicy),
        ("static", StaticPolicy),
        ("frag-aware", FragAwarePolicy),
        ("rl", make_rl),
        ("rl-candidate", make_rl_candidate),
    ):
        _REGISTRY.setdefault(name, factory)


def get_policy(name: str, **options) -> Policy:
    """A new instance of the policy called ``name``; ``options`` go to its constructor
    (e.g. ``get_policy("static", plan="4g@0,3g@4")``)."""
    if not _REGISTRY or "first-fit" not in _REGISTRY:
        _builtin()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None
    try:
        return factory(**options)
    except TypeError as exc:
        raise ConfigError(f"bad options for policy {name!r}: {exc}") from None


def policy_names() -> list[str]:
    if not _REGISTRY or "first-fit" not in _REGISTRY:
        _builtin()
    return sorted(_REGISTRY)


__all__ = [
    "Assignment", "ClusterState", "Decision", "DecisionError", "GpuState", "LayoutChange", "PendingJob",
    "Policy", "check_decision", "get_policy", "policy_names", "register_policy",
]
