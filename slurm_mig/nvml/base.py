"""The one small interface every MIG backend implements, and its typed errors.

Two implementations exist: `slurm_mig.nvml.real` over nvidia-ml-py, and
`slurm_mig.nvml.simulated`, a simulated MIG GPU with the same geometry, errors
and timings (used by the demo, the local test cluster and dry runs).
Physical GPUs (GpuInfo) and MIG devices (MigInstance) are separate types, as in nvitop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from slurm_mig.errors import SlurmMigError
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.profiles import GpuModel


class NvmlError(SlurmMigError):
    """An NVML call failed. ``code`` is NVML's return code where there is one."""

    code: int | None = None

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class NvmlUnavailable(NvmlError):
    """The NVML library (or one of its functions) is missing or failed to initialise."""


class NotSupported(NvmlError):
    code = 3


class NoPermission(NvmlError):
    code = 4


class InvalidArgument(NvmlError):
    code = 2


class NotFound(NvmlError):
    code = 6


class GpuLost(NvmlError):
    code = 15


class ResetRequired(NvmlError):
    code = 16


class MigModePending(ResetRequired):
    """The GPU's MIG mode is set to change at its next reset (``nvidia-smi -mig 0`` or ``-mig 1`` not yet
    in effect). slurm-mig creates and destroys nothing on such a GPU: it is the admin's until the reset."""


class InUse(NvmlError):
    code = 19


class InsufficientResources(NvmlError):
    code = 23


@dataclass(frozen=True)
class GpuInfo:
    """A physical GPU."""

    index: int
    uuid: str  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
    name: str  # what nvmlDeviceGetName says
    model: GpuModel | None  # None when we do not know this part's MIG geometry
    mig_enabled: bool  # the current MIG mode (nvmlDeviceGetMigMode's first value)
    lost: bool = False  # NVML says GPU_IS_LOST: listed so the others stay usable; its calls raise GpuLost
    # The MIG mode a change waiting for a GPU reset will set (nvmlDeviceGetMigMode's second value, where it
    # differs from the first); None when no change is pending. Instances stay as they are until the reset.
    mig_pending: bool | None = None

    @property
    def mig_mode(self) -> str:
        """The MIG mode in words: "on", "off", "on, disable pending" or "off, enable pending"."""
        now = "on" if self.mig_enabled else "off"
        if self.mig_pending is None:
            return now
        return f"{now}, {'enable' if self.mig_pending else 'disable'} pending"


@dataclass(frozen=True)
class MigInstance:
    """A MIG device: one GPU instance and its (single, full-size) compute instance.

    A GPU instance without a compute instance (half-made: the creator was killed between NVML's two
    create calls, or a cleanup failed) is listed too, with uuid "" and ci_id -1: it holds its slices
    but nothing can run on it. See ``half_made``.
    """

    gpu_index: int
    slot: Slot
    uuid: str  # "MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"; "" for a half-made instance
    gi_id: int
    ci_id: int  # -1 for a half-made instance
    in_use: bool  # compute processes are running on it

    @property
    def profile(self) -> str:
        return self.slot.profile

    @property
    def half_made(self) -> bool:
        """No compute instance, so no MIG device UUID: never bind it; apply_layout re-creates it when idle."""
        return not self.uuid


@dataclass(frozen=True)
class ForeignInstance:
    """A GPU instance of a profile our tables do not list (a newer driver's profile, a ``+gfx`` or ``-me``
    variant, one an admin made by hand). It holds memory slices ``start`` .. ``start + size - 1`` (and
    ``compute_slices``, where NVML says), so nothing of ours may be placed there; slurm-mig never
    destroys it, binds it to a job or plans with its slices."""

    gpu_index: int
    start: int  # nvmlGpuInstanceGetInfo's placement, in memory slices
    size: int
    profile_id: int  # GpuInstanceProfileInfo.id
    gi_id: int
    compute_slices: int | None = None  # the profile's sliceCount; None when not known
    in_use: bool = False  # compute processes run on it

    @property
    def mask(self) -> int:
        """Bit mask of the memory slices it holds."""
        return ((1 << self.size) - 1) << self.start

    def __str__(self) -> str:
        return f"profile id {self.profile_id} at {self.start}:{self.size}"


@runtime_checkable
class MigBackend(Protocol):
    """What slurm-mig needs from NVML, and nothing more."""

    def gpus(self) -> list[GpuInfo]:
        """Every GPU on this node, in NVML index order."""

    def instances(self, gpu: int) -> list[MigInstance]:
        """The MIG instances on GPU ``gpu``, sorted by placement start."""

    def create(self, gpu: int, slot: Slot) -> MigInstance:
        """Create a GPU instance at ``slot``'s placement plus its full compute instance.

        Raises InsufficientResources for an illegal or occupied placement,
        NoPermission without the MIG config capability.
        """

    def destroy(self, gpu: int, slot: Slot) -> None:
        """Destroy the instance at ``slot`` (compute instance first). Raises InUse if busy."""

    def close(self) -> None:
        """Release the library/handles."""


def observed_layout(backend: MigBackend, gpu: int) -> Layout:
    """The layout GPU ``gpu`` has now, as the same type a policy's desired layout is."""
    info = backend.gpus()[gpu]
    if info.model is None:
        raise NotSupported(f"GPU {gpu} ({info.name}) is not a MIG model slurm-mig knows")
    return Layout(info.model, frozenset(i.slot for i in backend.instances(gpu)))


def foreign_instances(backend: MigBackend, gpu: int) -> list[ForeignInstance]:
    """The GPU instances on GPU ``gpu`` of profiles our tables do not list, sorted by start; [] for a
    backend that cannot see them (it has no ``foreign_instances`` method)."""
    lister = getattr(backend, "foreign_instances", None)
    return [] if lister is None else sorted(lister(gpu), key=lambda f: f.start)
