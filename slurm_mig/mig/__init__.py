"""MIG geometry: GPU models, profiles, placements, layouts and transitions.

Pure data and pure functions; nothing here touches NVML, Slurm or the disk, so
the controller, the node hooks, the simulator and training all share it.
"""

from slurm_mig.mig.profiles import GPU_MODELS, GpuModel, Profile, get_model
from slurm_mig.mig.layout import Layout, Slot, enumerate_maximal_layouts, parse_layout
from slurm_mig.mig.transitions import Step, plan_transition

__all__ = [
    "GPU_MODELS",
    "GpuModel",
    "Profile",
    "get_model",
    "Layout",
    "Slot",
    "enumerate_maximal_layouts",
    "parse_layout",
    "Step",
    "plan_transition",
]
