"""Discrete-event simulator of MIG GPUs under Slurm-like dispatch.

It drives the same :class:`~slurm_mig.policies.base.Policy` objects the
controller calls, through ``decide(ClusterState) -> Decision``, and charges
reconfigurations with :mod:`slurm_mig.mig.timing`, so a policy behaves the same
in simulation and on a real cluster. See docs/benchmarks.md.
"""

from slurm_mig.sim.workloads import Job, SpeedModel, Workload

__all__ = ["Job", "SpeedModel", "Workload"]
