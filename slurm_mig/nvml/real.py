"""The MigBackend over NVIDIA's NVML, through nvidia-ml-py (import name ``pynvml``).

Every NVML call goes through one gateway, :func:`nvml_call` (the nvitop way):
it imports pynvml and runs ``nvmlInit`` lazily, once, under a lock; it turns a
missing library or a missing function into :class:`NvmlUnavailable`, and each
``NVMLError`` into the project's typed error by NVML return code. Nothing here
imports pynvml at module import time, so node hooks start fast and a machine
without the driver can still import slurm-mig.

Placements: nvidia-ml-py's ``nvmlDeviceCreateGpuInstanceWithPlacement(device,
profileId, placement)`` forwards ``placement`` untouched to a ctypes function
that has no ``argtypes``; the C prototype takes ``const
nvmlGpuInstancePlacement_t *``. So the caller must pass a *pointer*
(``ctypes.byref(c_nvmlGpuInstancePlacement_t(start, size))``): a bare struct
would be pushed by value and NVML would read garbage. (Read in nvidia-ml-py
13.615.71's pynvml.py; not yet tried on hardware.)
"""

from __future__ import annotations

import ctypes
import importlib
import threading
from typing import Any

from slurm_mig.mig.layout import Slot
from slurm_mig.mig.profiles import GpuModel, model_from_nvml_name
from slurm_mig.nvml.base import (
    ForeignInstance,
    GpuInfo,
    GpuLost,
    InsufficientResources,
    InUse,
    InvalidArgument,
    MigInstance,
    NoPermission,
    NotFound,
    NotSupported,
    NvmlError,
    NvmlUnavailable,
    ResetRequired,
)
from slurm_mig.nvml.tables import ProfileReading

# NVML return code -> typed error (nvml.h; FACTS §3).
_ERROR_BY_CODE: dict[int, type[NvmlError]] = {
    1: NvmlUnavailable,  # UNINITIALIZED
    2: InvalidArgument,
    3: NotSupported,
    4: NoPermission,
    6: NotFound,
    9: NvmlUnavailable,  # DRIVER_NOT_LOADED
    12: NvmlUnavailable,  # LIBRARY_NOT_FOUND
    13: NvmlUnavailable,  # FUNCTION_NOT_FOUND
    15: GpuLost,
    16: ResetRequired,
    18: NvmlUnavailable,  # LIB_RM_VERSION_MISMATCH
    19: InUse,
    23: InsufficientResources,
}

_MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE
_CI_ENGINE_PROFILE_SHARED = 0  # NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
_CI_PROFILE_COUNT = 9  # NVML_COMPUTE_INSTANCE_PROFILE_COUNT in nvml.h 13.x
_GI_PROFILE_COUNT = 0x12  # NVML_GPU_INSTANCE_PROFILE_COUNT in nvidia-ml-py 13.x (12.535 has 0xA)
# Compute slices of a GPU instance -> NVML_COMPUTE_INSTANCE_PROFILE_* for a CI that uses all of them.
_FULL_CI_PROFILE = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}
# Lookups that mean "not here" rather than "broken".
_ABSENT = (NotSupported, NotFound, InvalidArgument)

_lock = threading.Lock()
_initialized_module: Any = None  # the pynvml module object nvmlInit succeeded on


def _module() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise NvmlUnavailable(
            f"NVML is unavailable: cannot import pynvml ({exc}); install nvidia-ml-py") from exc


def _typed(fn_name: str, exc: BaseException) -> NvmlError:
    code = getattr(exc, "value", None)
    code = code if isinstance(code, int) else None
    cls = _ERROR_BY_CODE.get(code, NvmlError) if code is not None else NvmlError
    return cls(f"{fn_name}: {exc} (NVML error {code})", code=code)


def _ensure_init(mod: Any) -> None:
    global _initialized_module
    if _initialized_module is mod:
        return
    with _lock:
        if _initialized_module is mod:
            return
        init = getattr(mod, "nvmlInit", None)
        if init is None:
            raise NvmlUnavailable("NVML is unavailable: pynvml has no nvmlInit")
        nvml_error = getattr(mod, "NVMLError", None)
        try:
            init()
        except Exception as exc:
            if nvml_error is not None and isinstance(exc, nvml_error):
                typed = _typed("nvmlInit", exc)
                raise NvmlUnavailable(f"NVML is unavailable: {typed}", code=typed.code) from exc
            if isinstance(exc, OSError):
                raise NvmlUnavailable(f"NVML is unavailable: nvmlInit: {exc}") from exc
            raise
        _initialized_module = mod


def nvml_call(fn_name: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``pynvml.<fn_name>(*args, **kwargs)``: the one way this project talks to NVML.

    Initialises NVML on first use (thread-safe, once per process, again after
    :func:`nvml_shutdown`). Raises NvmlUnavailable when pynvml, the library or
    the function is missing, and the typed NvmlError subclass for an NVML
    return code (InUse, InsufficientResources, NoPermission, GpuLost, ...).
    """
    mod = _module()
    _ensure_init(mod)
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise NvmlUnavailable(f"NVML is unavailable: this nvidia-ml-py has no {fn_name}")
    nvml_error = getattr(mod, "NVMLError", None)
    mismatch = getattr(mod, "NVMLLibraryMismatchError", None)
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        if nvml_error is not None and isinstance(exc, nvml_error):
            raise _typed(fn_name, exc) from exc
        if mismatch is not None and isinstance(exc, mismatch):
            # pynvml's unversioned wrappers (@throwOnVersionMismatch) turn FUNCTION_NOT_FOUND into this
            # class, which is not an NVMLError: same meaning, so the same typed error (code 13).
            raise NvmlUnavailable(f"{fn_name}: {exc} (NVML error 13)", code=13) from exc
        raise


def nvml_attr(name: str) -> Any:
    """A constant or ctypes type from pynvml (``c_nvmlGpuInstance_t``...), NvmlUnavailable if missing."""
    value = getattr(_module(), name, None)
    if value is None:
        raise NvmlUnavailable(f"NVML is unavailable: this nvidia-ml-py has no {name}")
    return value


def nvml_shutdown() -> None:
    """Shut NVML down if this gateway initialised it; the next call initialises it again."""
    global _initialized_module
    with _lock:
        mod, _initialized_module = _initialized_module, None
    if mod is not None and hasattr(mod, "nvmlShutdown"):
        try:
            mod.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001 - a failed shutdown changes nothing for us
            nvml_error = getattr(mod, "NVMLError", None)
            if nvml_error is None or not isinstance(exc, nvml_error):
                raise


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _versioned(call, fn_name: str, *args: Any) -> Any:
    """``fn_name(*args)`` with pynvml's default version=2 struct, falling back to version=1.

    Drivers older than R470 lack the ``...V`` functions that version 2 needs;
    pynvml then raises FUNCTION_NOT_FOUND, which the gateway maps to NvmlUnavailable.
    """
    try:
        return call(fn_name, *args)
    except NvmlUnavailable as exc:
        if exc.code != 13:
            raise
        return call(fn_name, *args, version=1)


class RealBackend:
    """MigBackend over NVML. Needs root (or the MIG config capability) to create/destroy."""

    def __init__(self, *, call=nvml_call):
        self._call = call  # injectable for tests of the call sequence

    # -- reading -----------------------------------------------------------
    def _handle(self, gpu: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", gpu)

    def _model(self, handle: Any) -> GpuModel | None:
        return model_from_nvml_name(_text(self._call("nvmlDeviceGetName", handle)))

    def _mig_mode(self, handle: Any) -> tuple[bool, bool | None]:
        """(MIG on now, the mode a change waiting for a GPU reset will set, or None when none waits)."""
        try:
            current, pending = self._call("nvmlDeviceGetMigMode", handle)
        except NotSupported:
            return False, None
        on, will_be = int(current) == _MIG_ENABLED, int(pending) == _MIG_ENABLED
        return on, (None if will_be == on else will_be)

    def _mig_enabled(self, handle: Any) -> bool:
        return self._mig_mode(handle)[0]

    def gpus(self) -> list[GpuInfo]:
        out = []
        for i in range(int(self._call("nvmlDeviceGetCount"))):
            try:
                h = self._handle(i)
                name = _text(self._call("nvmlDeviceGetName", h))
                uuid = _text(self._call("nvmlDeviceGetUUID", h))
                on, pending = self._mig_mode(h)
                out.append(GpuInfo(i, uuid, name, model_from_nvml_name(name), on, mig_pending=pending))
            except GpuLost:
                out.append(GpuInfo(i, "", "", None, False, lost=True))
        return out

    def _gpu_instances(self, handle: Any, profile_info: Any) -> list[Any]:
        capacity = max(int(profile_info.instanceCount), 1)
        array = (nvml_attr("c_nvmlGpuInstance_t") * capacity)()
        count = ctypes.c_uint(0)
        self._call("nvmlDeviceGetGpuInstances", handle, profile_info.id, array, ctypes.byref(count))
        return [array[i] for i in range(count.value)]

    def _compute_instances(self, gi: Any) -> list[Any]:
        """Every compute instance of a GPU instance, whatever its profile."""
        found = []
        for ci_profile in range(_CI_PROFILE_COUNT):
            try:
                info = _versioned(self._call, "nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, ci_profile,
                                  _CI_ENGINE_PROFILE_SHARED)
            except _ABSENT:
                continue
            capacity = max(int(info.instanceCount), 1)
            array = (nvml_attr("c_nvmlComputeInstance_t") * capacity)()
            count = ctypes.c_uint(0)
            self._call("nvmlGpuInstanceGetComputeInstances", gi, info.id, array, ctypes.byref(count))
            found.extend(array[i] for i in range(count.value))
        return found

    def _running_processes(self, mig: Any) -> list[Any]:
        """The compute processes on a MIG device.

        nvidia-ml-py's ``nvmlDeviceGetComputeRunningProcesses`` calls only the C function ``..._v3``, which
        drivers before R510 lack (and some R535 releases, e.g. 535.98: nvitop issue #88, PR #89); it then
        raises NVMLLibraryMismatchError, which the gateway types as NvmlUnavailable code 13. ``..._v2`` is in
        every MIG-capable driver (R450+): use it then, as nvitop does. Only emptiness matters here.
        """
        try:
            return self._call("nvmlDeviceGetComputeRunningProcesses", mig)
        except NvmlUnavailable as exc:
            if exc.code != 13:
                raise
            return self._call("nvmlDeviceGetComputeRunningProcesses_v2", mig)

    def _mig_devices(self, handle: Any) -> dict[int, list[tuple[int, str, bool]]]:
        """gi_id -> [(ci_id, MIG uuid, in_use)] from the MIG device handles (one per compute instance)."""
        out: dict[int, list[tuple[int, str, bool]]] = {}
        for i in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", handle))):
            try:
                mig = self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, i)
            except _ABSENT:
                continue
            gi_id = int(self._call("nvmlDeviceGetGpuInstanceId", mig))
            ci_id = int(self._call("nvmlDeviceGetComputeInstanceId", mig))
            uuid = _text(self._call("nvmlDeviceGetUUID", mig))
            try:
                busy = bool(self._running_processes(mig))
            except (NoPermission, NotSupported, NvmlUnavailable):
                busy = True  # cannot see its processes: never treat it as free to destroy
            out.setdefault(gi_id, []).append((ci_id, uuid, busy))
        return out

    def _placed(self, handle: Any, model: GpuModel) -> list[tuple[Slot, Any, Any]]:
        """(slot, GPU instance handle, GpuInstanceInfo) for every GPU instance on the GPU."""
        placed = []
        for prof in model.profiles:
            try:
                info = _versioned(self._call, "nvmlDeviceGetGpuInstanceProfileInfo", handle, prof.nvml_index)
            except _ABSENT:
                continue  # this driver/GPU does not offer that profile
            for gi in self._gpu_instances(handle, info):
                gi_info = self._call("nvmlGpuInstanceGetInfo", gi)
                placed.append((Slot(int(gi_info.placement.start), prof.name), gi, gi_info))
        return placed

    def _device_of(self, devices: dict, gi: Any, gi_info: Any) -> tuple[int, str, bool]:
        """(ci_id, MIG uuid, busy) of a GPU instance; (-1, "", busy) when it has no MIG device."""
        cis = sorted(devices.get(int(gi_info.id), []))
        if cis:
            ci_id, uuid, _ = cis[0]
            return ci_id, uuid, any(b for _, _, b in cis)
        # No MIG device seen: a GPU instance without a compute instance (made by hand, or half-made),
        # or one whose MIG device lookup was skipped (NVML would not hand out that index). Ask the GPU
        # instance: compute instances whose processes cannot be seen count as busy.
        return -1, "", bool(self._compute_instances(gi))

    def instances(self, gpu: int) -> list[MigInstance]:
        h = self._handle(gpu)
        model = self._model(h)
        if model is None or not self._mig_enabled(h):
            return []
        devices = self._mig_devices(h)
        out = []
        for slot, gi, gi_info in self._placed(h, model):
            ci_id, uuid, busy = self._device_of(devices, gi, gi_info)
            out.append(MigInstance(gpu, slot, uuid, int(gi_info.id), ci_id, busy))
        return sorted(out, key=lambda m: m.slot)

    def foreign_instances(self, gpu: int) -> list[ForeignInstance]:
        """GPU instances of profiles the model's table does not list, found by asking NVML for every GPU
        instance profile index (nvidia-ml-py's NVML_GPU_INSTANCE_PROFILE_COUNT, or 13.x's where that is
        fewer) outside the table."""
        h = self._handle(gpu)
        model = self._model(h)
        if model is None or not self._mig_enabled(h):
            return []
        ours = {p.nvml_index for p in model.profiles}
        known_ids = {p.id for p in model.profiles}
        # At least the newest count we know: an older nvidia-ml-py's (0xA in 12.535) stops before the +gfx and
        # -me profiles newer drivers offer, and the index is only passed on (a driver that lacks one says
        # INVALID_ARGUMENT).
        try:
            count = max(int(nvml_attr("NVML_GPU_INSTANCE_PROFILE_COUNT")), _GI_PROFILE_COUNT)
        except NvmlUnavailable:
            count = _GI_PROFILE_COUNT
        devices = None
        out, seen = [], set()
        for index in range(count):
            if index in ours:
                continue
            try:
                info = _versioned(self._call, "nvmlDeviceGetGpuInstanceProfileInfo", h, index)
            except _ABSENT:
                continue  # not on this GPU or driver
            if int(info.id) in known_ids or int(info.id) in seen:
                continue
            seen.add(int(info.id))
            for gi in self._gpu_instances(h, info):
                gi_info = self._call("nvmlGpuInstanceGetInfo", gi)
                if devices is None:
                    devices = self._mig_devices(h)
                _ci, _uuid, busy = self._device_of(devices, gi, gi_info)
                out.append(ForeignInstance(gpu, int(gi_info.placement.start), int(gi_info.placement.size),
                                           int(info.id), int(gi_info.id), int(info.sliceCount), busy))
        return sorted(out, key=lambda f: f.start)

    def driver_version(self) -> str:
        """nvmlSystemGetDriverVersion: "580.159.04"."""
        return _text(self._call("nvmlSystemGetDriverVersion"))

    def profile_readings(self, gpu: int) -> list[ProfileReading]:
        """Every GPU-instance profile the driver offers on GPU ``gpu`` and its possible placements, asked
        for each NVML profile index (see foreign_instances for the count). Read-only: for
        ``nvml check-tables``, which compares them with our tables."""
        h = self._handle(gpu)
        try:
            count = max(int(nvml_attr("NVML_GPU_INSTANCE_PROFILE_COUNT")), _GI_PROFILE_COUNT)
        except NvmlUnavailable:
            count = _GI_PROFILE_COUNT
        out = []
        for index in range(count):
            try:
                info = _versioned(self._call, "nvmlDeviceGetGpuInstanceProfileInfo", h, index)
            except _ABSENT:
                continue  # not on this GPU or driver (or MIG mode is off)
            name = getattr(info, "name", None)
            memory = getattr(info, "memorySizeMB", None)
            out.append(ProfileReading(index, int(info.id), int(info.sliceCount), int(info.instanceCount),
                                      None if memory is None else int(memory),
                                      None if name is None else _text(name).strip("\x00 ") or None,
                                      self._possible_placements(h, int(info.id))))
        return out

    def _possible_placements(self, handle: Any, profile_id: int) -> tuple[tuple[int, int], ...] | None:
        """nvmlDeviceGetGpuInstancePossiblePlacements (_v2) as (start, size) pairs; None where unreadable."""
        capacity = 16  # more than any GPU's memory slices, so more than its placements of one profile
        array = (nvml_attr("c_nvmlGpuInstancePlacement_t") * capacity)()
        count = ctypes.c_uint(capacity)
        try:
            self._call("nvmlDeviceGetGpuInstancePossiblePlacements", handle, profile_id, array, ctypes.byref(count))
        except (NotSupported, InvalidArgument, NvmlUnavailable):
            return None
        if count.value > capacity:
            return None
        return tuple((int(array[i].start), int(array[i].size)) for i in range(count.value))

    # -- changing ----------------------------------------------------------
    def create(self, gpu: int, slot: Slot) -> MigInstance:
        h = self._handle(gpu)
        model = self._model(h)
        if model is None:
            raise NotSupported(f"GPU {gpu} is not a MIG model slurm-mig knows")
        prof = model.profile(slot.profile)
        info = _versioned(self._call, "nvmlDeviceGetGpuInstanceProfileInfo", h, prof.nvml_index)
        placement = nvml_attr("c_nvmlGpuInstancePlacement_t")()
        placement.start = slot.start
        placement.size = prof.memory_slices
        gi = self._call("nvmlDeviceCreateGpuInstanceWithPlacement", h, info.id, ctypes.byref(placement))
        try:
            ci_info = _versioned(self._call, "nvmlGpuInstanceGetComputeInstanceProfileInfo", gi,
                                 _FULL_CI_PROFILE[prof.compute_slices], _CI_ENGINE_PROFILE_SHARED)
            self._call("nvmlGpuInstanceCreateComputeInstance", gi, ci_info.id)
        except BaseException as exc:
            try:  # no half instance left behind
                self._call("nvmlGpuInstanceDestroy", gi)
            except NvmlError as cleanup:
                exc.add_note(f"and destroying the half-made GPU instance at {slot} failed too: {cleanup}")
            raise
        for inst in self.instances(gpu):
            if inst.slot == Slot(slot.start, prof.name):
                return inst
        raise NvmlError(f"created {slot} on GPU {gpu} but NVML does not list it")

    def destroy(self, gpu: int, slot: Slot) -> None:
        h = self._handle(gpu)
        model = self._model(h)
        if model is None:
            raise NotSupported(f"GPU {gpu} is not a MIG model slurm-mig knows")
        wanted = Slot(slot.start, model.profile(slot.profile).name)
        for placed, gi, _info in self._placed(h, model):
            if placed == wanted:
                for ci in self._compute_instances(gi):
                    self._call("nvmlComputeInstanceDestroy", ci)  # InUse while processes run
                self._call("nvmlGpuInstanceDestroy", gi)
                return
        raise NotFound(f"GPU {gpu} has no MIG instance {wanted}")

    def close(self) -> None:
        nvml_shutdown()
