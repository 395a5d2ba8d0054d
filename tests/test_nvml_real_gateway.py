"""Our NVML gateway and RealBackend, with a fake ``pynvml`` module put in its place.

These test OUR code: lazy thread-safe init, error mapping by NVML return code,
missing library/function handling, and the call sequence RealBackend makes
(placement passed by pointer, compute instances destroyed before their GPU
instance, no half-made instance left behind). The fake NVML below encodes what
nvml.h and nvidia-ml-py 13.615.71's pynvml.py say; it is not evidence about
hardware.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.profiles import get_model
from slurm_mig.nvml import (
    GpuLost,
    InsufficientResources,
    InUse,
    InvalidArgument,
    MigBackend,
    NoPermission,
    NotFound,
    NotSupported,
    NvmlError,
    NvmlUnavailable,
    ResetRequired,
)
from slurm_mig.nvml import real
from slurm_mig.nvml.apply import apply_layout
from slurm_mig.nvml.real import RealBackend, nvml_call, nvml_shutdown


class FakeNVMLError(Exception):
    """Shaped like pynvml.NVMLError: the return code is in ``.value``."""

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"fake NVML error {self.value}"


def fake_module(**functions) -> types.ModuleType:
    mod = types.ModuleType("pynvml")
    mod.NVMLError = FakeNVMLError
    mod.init_calls = 0
    mod.shutdown_calls = 0

    def nvmlInit():
        mod.init_calls += 1

    def nvmlShutdown():
        mod.shutdown_calls += 1

    mod.nvmlInit = nvmlInit
    mod.nvmlShutdown = nvmlShutdown
    for name, fn in functions.items():
        setattr(mod, name, fn)
    return mod


@pytest.fixture
def use_module(monkeypatch):
    """Install a (fake) pynvml and start the gateway from scratch."""
    monkeypatch.setattr(real, "_initialized_module", None)

    def install(mod):
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod

    yield install
    real._initialized_module = None


# -- the gateway ----------------------------------------------------------------
def test_init_is_lazy_and_happens_once(use_module):
    mod = use_module(fake_module(nvmlDeviceGetCount=lambda: 3))
    assert mod.init_calls == 0
    assert nvml_call("nvmlDeviceGetCount") == 3
    for _ in range(5):
        nvml_call("nvmlDeviceGetCount")
    assert mod.init_calls == 1


def test_init_is_thread_safe(use_module):
    mod = fake_module(nvmlDeviceGetCount=lambda: 1)

    def slow_init():
        time.sleep(0.05)
        mod.init_calls += 1

    mod.nvmlInit = slow_init
    use_module(mod)
    threads = [threading.Thread(target=nvml_call, args=("nvmlDeviceGetCount",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mod.init_calls == 1


def test_shutdown_then_the_next_call_initialises_again(use_module):
    mod = use_module(fake_module(nvmlDeviceGetCount=lambda: 1))
    nvml_call("nvmlDeviceGetCount")
    nvml_shutdown()
    assert mod.shutdown_calls == 1
    nvml_shutdown()  # not initialised: nothing to do
    assert mod.shutdown_calls == 1
    nvml_call("nvmlDeviceGetCount")
    assert mod.init_calls == 2


@pytest.mark.parametrize("code, expected", [
    (2, InvalidArgument), (3, NotSupported), (4, NoPermission), (6, NotFound), (15, GpuLost),
    (16, ResetRequired), (19, InUse), (23, InsufficientResources), (9, NvmlUnavailable),
    (13, NvmlUnavailable), (999, NvmlError),
])
def test_nvml_errors_become_typed_errors_by_code(use_module, code, expected):
    def fails(*args):
        raise FakeNVMLError(code)

    use_module(fake_module(nvmlDeviceGetHandleByIndex=fails))
    with pytest.raises(expected) as info:
        nvml_call("nvmlDeviceGetHandleByIndex", 0)
    assert type(info.value) is expected
    assert info.value.code == code
    assert "nvmlDeviceGetHandleByIndex" in str(info.value)
    assert isinstance(info.value.__cause__, FakeNVMLError)


def test_a_missing_function_names_itself(use_module):
    use_module(fake_module())
    with pytest.raises(NvmlUnavailable, match="nvmlDeviceCreateGpuInstanceWithPlacement"):
        nvml_call("nvmlDeviceCreateGpuInstanceWithPlacement", None, 9, None)


def test_no_pynvml_at_all(use_module):
    use_module(None)  # sys.modules[name] = None makes the import fail
    with pytest.raises(NvmlUnavailable, match="nvidia-ml-py"):
        nvml_call("nvmlDeviceGetCount")


def test_library_not_found_at_init_is_unavailable_and_not_remembered(use_module):
    mod = fake_module(nvmlDeviceGetCount=lambda: 2)
    state = {"fail": True}

    def init():
        if state["fail"]:
            raise FakeNVMLError(12)  # NVML_ERROR_LIBRARY_NOT_FOUND
        mod.init_calls += 1

    mod.nvmlInit = init
    use_module(mod)
    with pytest.raises(NvmlUnavailable) as info:
        nvml_call("nvmlDeviceGetCount")
    assert info.value.code == 12
    state["fail"] = False  # e.g. the driver got loaded
    assert nvml_call("nvmlDeviceGetCount") == 2


def test_oserror_at_init_is_unavailable(use_module):
    mod = fake_module()

    def init():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    mod.nvmlInit = init
    use_module(mod)
    with pytest.raises(NvmlUnavailable, match="cannot open"):
        nvml_call("nvmlDeviceGetCount")


def test_other_exceptions_are_not_disguised(use_module):
    def broken(*args):
        raise TypeError("wrong argument type")

    use_module(fake_module(nvmlDeviceGetName=broken))
    with pytest.raises(TypeError):
        nvml_call("nvmlDeviceGetName", 0)


def test_the_installed_wrapper_without_a_driver_is_unavailable():
    """The real nvidia-ml-py on a machine with no NVIDIA driver (like the CI machine)."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        pass
    else:
        pytest.skip("this machine has an NVML library")
    real._initialized_module = None
    with pytest.raises(NvmlUnavailable) as info:
        nvml_call("nvmlDeviceGetCount")
    assert info.value.code == 12  # NVML_ERROR_LIBRARY_NOT_FOUND


def test_the_installed_wrapper_takes_the_placement_as_given():
    """Why RealBackend passes byref(placement): the wrapper forwards it untouched."""
    import inspect

    import pynvml

    src = inspect.getsource(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement)
    assert "fn(device, profileId, placement, byref(c_instance))" in src
    assert [f[0] for f in pynvml.c_nvmlGpuInstancePlacement_t._fields_] == ["start", "size"]


# -- RealBackend against a fake NVML ------------------------------------------------
class FakeNvml:
    """One MIG GPU behind pynvml-shaped functions. Handles are ints/tuples."""

    def __init__(self, device_name="NVIDIA H100 80GB HBM3", mig=True):
        self.model = get_model("H100-80GB")
        self.device_name = device_name
        self.mig = mig
        self.gis: dict[int, dict] = {}  # gi_id -> {profile, start, cis: {ci_id: busy}}
        self.calls: list[tuple] = []
        self.fail: dict[str, int] = {}  # function name -> NVML code to raise once
        self.process_error: int | None = None

    # ctypes types the backend asks for: opaque handles as plain integers
    c_nvmlGpuInstance_t = ctypes.c_void_p
    c_nvmlComputeInstance_t = ctypes.c_void_p

    class c_nvmlGpuInstancePlacement_t(ctypes.Structure):
        _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]

    def module(self) -> types.ModuleType:
        mod = fake_module()
        for name in dir(self):
            if name.startswith(("nvml", "c_nvml")):
                setattr(mod, name, getattr(self, name))
        return mod

    def _log(self, name, *args):
        self.calls.append((name, *args))
        code = self.fail.pop(name, None)
        if code is not None:
            raise FakeNVMLError(code)

    def _profile(self, gi_profile_id):
        return self.model.profile_by_id(gi_profile_id)

    def _layout(self) -> Layout:
        return Layout(self.model, frozenset(Slot(g["start"], g["profile"]) for g in self.gis.values()
                                            if "profile_id" not in g))

    # Profiles outside our tables this driver offers: NVML profile index -> GpuInstanceProfileInfo-like
    extra_profiles: dict = {}

    def add_foreign(self, index: int, profile_id: int, start: int, size: int, busy: bool = False) -> int:
        """A GPU instance (with its compute instance) of a profile our tables do not list, made by hand."""
        self.extra_profiles = {**self.extra_profiles,
                               index: types.SimpleNamespace(id=profile_id, instanceCount=1, sliceCount=1)}
        gi = next(n for n in range(1, 64) if n not in self.gis)
        self.gis[gi] = {"profile_id": profile_id, "start": start, "size": size, "cis": {0: busy}}
        return gi

    def _taken_by_foreign(self, start: int, size: int) -> bool:
        mask = ((1 << size) - 1) << start
        return any(((1 << g["size"]) - 1) << g["start"] & mask for g in self.gis.values() if "profile_id" in g)

    driver = "580.159.04"

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    # device
    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        if i != 0:
            raise FakeNVMLError(2)
        return "gpu0"

    def nvmlDeviceGetName(self, h):
        return self.device_name

    def nvmlDeviceGetUUID(self, h):
        if h == "gpu0":
            return "GPU-11111111-2222-4333-8444-555555555555"
        _, gi, ci = h
        return f"MIG-{gi:08d}-0000-4000-8000-{ci:012d}"

    mig_pending: int | None = None  # the mode a change waiting for a GPU reset will set (None: none waits)

    def nvmlDeviceGetMigMode(self, h):
        current = 1 if self.mig else 0
        return [current, current if self.mig_pending is None else self.mig_pending]

    old_driver = False  # no ...InfoV functions: pynvml raises FUNCTION_NOT_FOUND for version=2
    # Driver answers that differ from our table, for check-tables: NVML index -> fields to replace
    # (id, instanceCount, sliceCount, name, memorySizeMB), or None for a profile this driver lacks.
    profile_overrides: dict = {}
    placement_overrides: dict = {}  # GpuInstanceProfileInfo.id -> [(start, size), ...] the driver allows

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h, index, version=2):
        if self.old_driver and version == 2:
            raise FakeNVMLError(13)
        by_index = {p.nvml_index: p for p in self.model.profiles}
        if index in self.extra_profiles:
            return self.extra_profiles[index]
        if index not in by_index or (index in self.profile_overrides and self.profile_overrides[index] is None):
            raise FakeNVMLError(3)
        p = by_index[index]
        fields = dict(id=p.id, instanceCount=p.max_count, sliceCount=p.compute_slices)
        if version == 2:  # version 1 of the struct has neither
            fields.update(name=f"MIG {p.name}".encode(), memorySizeMB=p.memory_gb * 1000)
        fields.update(self.profile_overrides.get(index) or {})
        return types.SimpleNamespace(**fields)

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, h, profile_id, array, count_ref):
        if profile_id in self.placement_overrides:
            pairs = self.placement_overrides[profile_id]
        else:  # the profile the driver gave this id (profile_overrides may renumber one)
            p = next((p for p in self.model.profiles
                      if (self.profile_overrides.get(p.nvml_index) or {}).get("id", p.id) == profile_id), None)
            if p is None:
                raise FakeNVMLError(3)
            pairs = [(s, p.memory_slices) for s in p.starts]
        for i, (start, size) in enumerate(pairs):
            array[i].start, array[i].size = start, size
        count_ref._obj.value = len(pairs)

    def nvmlDeviceGetGpuInstances(self, h, profile_id, array, count_ref):
        found = [gi for gi, g in self.gis.items()
                 if (g["profile_id"] if "profile_id" in g else self.model.profile(g["profile"]).id) == profile_id]
        for i, gi in enumerate(found):
            array[i] = gi
        count_ref._obj.value = len(found)

    def nvmlGpuInstanceGetInfo(self, gi):
        g = self.gis[gi]
        if "profile_id" in g:
            return types.SimpleNamespace(id=gi, profileId=g["profile_id"],
                                         placement=types.SimpleNamespace(start=g["start"], size=g["size"]))
        p = self.model.profile(g["profile"])
        return types.SimpleNamespace(id=gi, profileId=p.id,
                                     placement=types.SimpleNamespace(start=g["start"], size=p.memory_slices))

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, h, profile_id, placement):
        self._log("nvmlDeviceCreateGpuInstanceWithPlacement", profile_id, placement)
        assert isinstance(placement, type(ctypes.byref(ctypes.c_int()))), "C wants a pointer to the struct"
        p = self._profile(profile_id)
        st = placement._obj
        if st.size != p.memory_slices or not self._layout().can_add(p, st.start) \
                or self._taken_by_foreign(st.start, st.size):
            raise FakeNVMLError(23)
        gi = next(n for n in range(1, 64) if n not in self.gis)
        self.gis[gi] = {"profile": p.name, "start": st.start, "cis": {}}
        return gi

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi, ci_profile, eng_profile, version=2):
        if self.old_driver and version == 2:
            raise FakeNVMLError(13)
        slices = self.model.profile(self.gis[gi]["profile"]).compute_slices
        full = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[slices]
        if ci_profile > full or ci_profile in (5, 6, 7, 8):
            raise FakeNVMLError(3)
        return types.SimpleNamespace(id=ci_profile, instanceCount=slices)

    def nvmlGpuInstanceCreateComputeInstance(self, gi, ci_profile_id):
        self._log("nvmlGpuInstanceCreateComputeInstance", gi, ci_profile_id)
        ci = len(self.gis[gi]["cis"])
        self.gis[gi]["cis"][ci] = False
        return (gi, ci)

    def nvmlGpuInstanceGetComputeInstances(self, gi, ci_profile_id, array, count_ref):
        cis = list(self.gis[gi]["cis"]) if ci_profile_id == self._full_ci(gi) else []
        for i, ci in enumerate(cis):
            array[i] = gi * 100 + ci
        count_ref._obj.value = len(cis)

    def _full_ci(self, gi):
        return {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[self.model.profile(self.gis[gi]["profile"]).compute_slices]

    def nvmlComputeInstanceDestroy(self, ci_handle):
        self._log("nvmlComputeInstanceDestroy", ci_handle)
        gi, ci = divmod(ci_handle, 100)
        if self.gis[gi]["cis"][ci]:
            raise FakeNVMLError(19)
        del self.gis[gi]["cis"][ci]

    def nvmlGpuInstanceDestroy(self, gi):
        self._log("nvmlGpuInstanceDestroy", gi)
        if self.gis[gi]["cis"]:
            raise FakeNVMLError(19)  # compute instances still there
        del self.gis[gi]

    # MIG devices: one per compute instance
    def _mig_list(self):
        return [(gi, ci) for gi in sorted(self.gis) for ci in sorted(self.gis[gi]["cis"])]

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):
        devices = self._mig_list()
        if i >= len(devices):
            raise FakeNVMLError(6)
        return ("mig", *devices[i])

    def nvmlDeviceGetGpuInstanceId(self, mig):
        return mig[1]

    def nvmlDeviceGetComputeInstanceId(self, mig):
        return mig[2]

    def nvmlDeviceGetComputeRunningProcesses(self, mig):
        if self.process_error is not None:
            raise FakeNVMLError(self.process_error)
        return [types.SimpleNamespace(pid=4242)] if self.gis[mig[1]]["cis"][mig[2]] else []


@pytest.fixture
def fake_nvml(use_module):
    nvml = FakeNvml()
    use_module(nvml.module())
    return nvml


def test_real_backend_lists_gpus_and_instances(fake_nvml):
    backend = RealBackend()
    assert isinstance(backend, MigBackend)
    (gpu,) = backend.gpus()
    assert (gpu.name, gpu.model.name, gpu.mig_enabled, gpu.lost) == ("NVIDIA H100 80GB HBM3", "H100-80GB", True, False)
    a = backend.create(0, Slot(0, "3g"))
    b = backend.create(0, Slot(4, "2g"))
    assert [m.slot for m in backend.instances(0)] == [Slot(0, "3g.40gb"), Slot(4, "2g.20gb")]
    assert (a.gi_id, a.ci_id, a.uuid) == (1, 0, "MIG-00000001-0000-4000-8000-000000000000")
    assert b.in_use is False
    fake_nvml.gis[b.gi_id]["cis"][0] = True  # a process starts on it
    assert [m.in_use for m in backend.instances(0)] == [False, True]


def test_create_passes_a_pointer_to_the_placement_and_a_full_compute_instance(fake_nvml):
    RealBackend().create(0, Slot(4, "3g"))
    name, profile_id, placement = fake_nvml.calls[0]
    assert (name, profile_id) == ("nvmlDeviceCreateGpuInstanceWithPlacement", 9)
    assert (placement._obj.start, placement._obj.size) == (4, 4)
    assert fake_nvml.calls[1] == ("nvmlGpuInstanceCreateComputeInstance", 1, 2)  # CI profile 3_SLICE


def test_an_occupied_placement_is_insufficient_resources(fake_nvml):
    backend = RealBackend()
    backend.create(0, Slot(0, "4g"))
    with pytest.raises(InsufficientResources):
        backend.create(0, Slot(0, "3g"))


def test_a_failed_compute_instance_leaves_no_half_instance(fake_nvml):
    fake_nvml.fail["nvmlGpuInstanceCreateComputeInstance"] = 23
    backend = RealBackend()
    with pytest.raises(InsufficientResources):
        backend.create(0, Slot(0, "7g"))
    assert fake_nvml.gis == {}
    assert [c[0] for c in fake_nvml.calls][-1] == "nvmlGpuInstanceDestroy"


def test_destroy_removes_compute_instances_first_and_refuses_when_busy(fake_nvml):
    backend = RealBackend()
    inst = backend.create(0, Slot(0, "7g"))
    fake_nvml.gis[inst.gi_id]["cis"][0] = True
    with pytest.raises(InUse):
        backend.destroy(0, Slot(0, "7g"))
    assert len(backend.instances(0)) == 1
    fake_nvml.gis[inst.gi_id]["cis"][0] = False
    fake_nvml.calls.clear()
    backend.destroy(0, Slot(0, "7g"))
    assert [c[0] for c in fake_nvml.calls] == ["nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy"]
    assert backend.instances(0) == []
    with pytest.raises(NotFound):
        backend.destroy(0, Slot(0, "7g"))


def test_old_drivers_get_version_1_profile_info(fake_nvml):
    fake_nvml.old_driver = True
    backend = RealBackend()
    backend.create(0, Slot(0, "3g"))
    assert [m.slot for m in backend.instances(0)] == [Slot(0, "3g.40gb")]
    backend.destroy(0, Slot(0, "3g"))
    assert backend.instances(0) == []


def test_processes_that_cannot_be_seen_count_as_busy(fake_nvml):
    backend = RealBackend()
    backend.create(0, Slot(0, "7g"))
    fake_nvml.process_error = 4  # NO_PERMISSION
    assert [m.in_use for m in backend.instances(0)] == [True]


def test_mig_off_or_unknown_model_has_no_instances(use_module):
    nvml = FakeNvml(mig=False)
    use_module(nvml.module())
    assert RealBackend().instances(0) == []
    assert RealBackend().gpus()[0].mig_enabled is False
    nvml.device_name = "NVIDIA GeForce RTX 4090"
    assert RealBackend().gpus()[0].model is None
    with pytest.raises(NotSupported):
        RealBackend().create(0, Slot(0, "7g"))


def test_a_lost_gpu_is_listed_as_lost(fake_nvml):
    def lost(h):
        raise FakeNVMLError(15)

    sys.modules["pynvml"].nvmlDeviceGetName = lost
    (gpu,) = RealBackend().gpus()
    assert gpu.lost is True and gpu.index == 0


def test_close_shuts_nvml_down(fake_nvml):
    backend = RealBackend()
    backend.gpus()
    backend.close()
    assert sys.modules["pynvml"].shutdown_calls == 1


def test_real_module_does_not_import_pynvml_at_import():
    src = Path(real.__file__).read_text()
    assert "\nimport pynvml" not in src and "\nfrom pynvml" not in src


class FakeLibraryMismatch(Exception):
    """Shaped like pynvml.NVMLLibraryMismatchError: NOT an NVMLError subclass."""


def test_a_library_mismatch_error_is_typed_as_a_missing_function(use_module):
    def unversioned(*args):  # pynvml's @throwOnVersionMismatch wrapper when the _v3 symbol is missing
        raise FakeLibraryMismatch("Unversioned function called and the pyNVML version does not match")

    mod = use_module(fake_module(nvmlDeviceGetComputeRunningProcesses=unversioned))
    mod.NVMLLibraryMismatchError = FakeLibraryMismatch
    with pytest.raises(NvmlUnavailable) as info:
        nvml_call("nvmlDeviceGetComputeRunningProcesses", "mig")
    assert info.value.code == 13 and isinstance(info.value.__cause__, FakeLibraryMismatch)


def test_the_installed_wrapper_raises_a_non_nvml_error_for_a_missing_v3_process_call():
    """Why the gateway knows NVMLLibraryMismatchError, and why the backend falls back to _v2."""
    import inspect

    import pynvml

    assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)
    assert "nvmlDeviceGetComputeRunningProcesses_v3(handle)" in inspect.getsource(
        pynvml.nvmlDeviceGetComputeRunningProcesses)
    assert callable(pynvml.nvmlDeviceGetComputeRunningProcesses_v2)


def test_drivers_without_the_v3_process_call_use_v2_and_still_see_busy_instances(fake_nvml):
    """R470/R495 (and 535.98) have no nvmlDeviceGetComputeRunningProcesses_v3: pynvml then raises
    NVMLLibraryMismatchError from the unversioned wrapper; the _v2 call works."""
    backend = RealBackend()
    a = backend.create(0, Slot(0, "3g"))
    backend.create(0, Slot(4, "3g"))
    fake_nvml.gis[a.gi_id]["cis"][0] = True
    mod = sys.modules["pynvml"]
    mod.NVMLLibraryMismatchError = FakeLibraryMismatch
    mod.nvmlDeviceGetComputeRunningProcesses_v2 = fake_nvml.nvmlDeviceGetComputeRunningProcesses

    def no_v3(mig):
        raise FakeLibraryMismatch("Unversioned function called and the pyNVML version does not match")

    mod.nvmlDeviceGetComputeRunningProcesses = no_v3
    assert [m.in_use for m in backend.instances(0)] == [True, False]
    del mod.nvmlDeviceGetComputeRunningProcesses_v2  # neither: cannot see processes, so busy
    assert [m.in_use for m in backend.instances(0)] == [True, True]


def test_a_mig_device_that_cannot_be_looked_up_does_not_make_its_instance_look_idle(fake_nvml):
    """nvmlDeviceGetMigDeviceHandleByIndex errors other than 'not there' are skipped per index; the GPU
    instance behind it still has a (busy) compute instance and must not be reported as idle."""
    backend = RealBackend()
    a = backend.create(0, Slot(0, "3g"))
    backend.create(0, Slot(4, "3g"))
    fake_nvml.gis[a.gi_id]["cis"][0] = True  # a job runs on 3g@0
    by_index = fake_nvml.nvmlDeviceGetMigDeviceHandleByIndex

    def flaky(h, i):
        if i == 0:
            raise FakeNVMLError(2)  # INVALID_ARGUMENT for the busy one's index
        return by_index(h, i)

    sys.modules["pynvml"].nvmlDeviceGetMigDeviceHandleByIndex = flaky
    busy = [m for m in backend.instances(0) if m.slot == Slot(0, "3g.40gb")]
    assert len(busy) == 1 and busy[0].in_use is True and busy[0].uuid == ""  # never bound, never destroyed


def test_a_gpu_instance_without_compute_instance_is_idle_and_half_made(fake_nvml):
    backend = RealBackend()
    backend.create(0, Slot(0, "7g"))
    fake_nvml.gis[1]["cis"].clear()  # the creator died between the two NVML create calls
    (inst,) = backend.instances(0)
    assert (inst.half_made, inst.in_use, inst.ci_id) == (True, False, -1)


def test_mig_mode_enabled_but_pending_a_reset_is_not_enabled(fake_nvml):
    """nvmlDeviceGetMigMode -> [current, pending]: an A100 whose enable waits for a GPU reset reads [0, 1];
    no instance can be made on it until then."""
    fake_nvml.nvmlDeviceGetMigMode = lambda h: [0, 1]
    sys.modules["pynvml"].nvmlDeviceGetMigMode = fake_nvml.nvmlDeviceGetMigMode
    assert RealBackend().gpus()[0].mig_enabled is False
    assert RealBackend().instances(0) == []


@pytest.mark.parametrize("mode, enabled, pending, words", [
    ([1, 1], True, None, "on"),
    ([0, 0], False, None, "off"),
    ([1, 0], True, False, "on, disable pending"),  # `nvidia-smi -mig 0` waiting for a GPU reset
    ([0, 1], False, True, "off, enable pending"),  # `nvidia-smi -mig 1` on an A100 waiting for a reset
])
def test_both_halves_of_the_mig_mode_are_read(fake_nvml, mode, enabled, pending, words):
    """nvmlDeviceGetMigMode -> [current, pending]. The pending half was dropped, so a GPU whose admin had
    run `nvidia-smi -mig 0` read as plainly on and the controller kept carving there."""
    backend = RealBackend()
    if enabled:
        backend.create(0, Slot(0, "3g"))
    fake_nvml.mig = bool(mode[0])
    fake_nvml.mig_pending = mode[1]
    (gpu,) = backend.gpus()
    assert (gpu.mig_enabled, gpu.mig_pending, gpu.mig_mode) == (enabled, pending, words)
    # Until the reset the instances are there and listed as they are.
    assert [m.slot for m in backend.instances(0)] == ([Slot(0, "3g.40gb")] if enabled else [])


def test_a_gpu_instance_of_a_profile_not_in_our_tables_is_seen_and_left_alone(fake_nvml):
    """A GPU instance of a profile our tables do not list (here a 1g+gfx, NVML index 0xA, made by hand)
    was invisible: instances are listed by the table's profiles, so its slices looked free and every
    carve there failed with INSUFFICIENT_RESOURCES. It is now listed apart, with NVML's placement."""
    backend = RealBackend()
    backend.create(0, Slot(4, "3g"))
    gi = fake_nvml.add_foreign(0xA, 47, start=0, size=2, busy=True)
    assert [m.slot for m in backend.instances(0)] == [Slot(4, "3g.40gb")]  # never bound, never destroyed
    (f,) = backend.foreign_instances(0)
    assert (f.start, f.size, f.profile_id, f.gi_id, f.compute_slices, f.in_use) == (0, 2, 47, gi, 1, True)
    fake_nvml.calls.clear()
    with pytest.raises(InsufficientResources, match="profile id 47 at 0:2"):
        apply_layout(backend, 0, Layout.of(fake_nvml.model, [("4g", 0), ("3g", 4)]))
    assert fake_nvml.calls == []  # refused before any NVML change
    apply_layout(backend, 0, Layout.of(fake_nvml.model, [("2g", 2), ("3g", 4)])).raise_for_error()
    assert gi in fake_nvml.gis and len(backend.foreign_instances(0)) == 1


def test_an_older_nvidia_ml_py_does_not_hide_a_newer_drivers_gpu_instance_profiles(fake_nvml):
    """nvidia-ml-py 12.535 (pyproject allows >=12.535) has NVML_GPU_INSTANCE_PROFILE_COUNT = 0xA: the
    profile indexes a newer driver offers beyond it (+gfx 0xA-0xC, -me 0xD-0xE, +me all 0xF-0x10, 3g+gfx
    0x11) were never asked about, so a GPU instance of one of them was invisible again and every carve
    over its slices failed with INSUFFICIENT_RESOURCES. The index is only passed to the driver, which
    answers INVALID_ARGUMENT for one it does not know, so every index up to the newest count is asked."""
    sys.modules["pynvml"].NVML_GPU_INSTANCE_PROFILE_COUNT = 0xA
    gi = fake_nvml.add_foreign(0xD, 52, start=6, size=1)  # a 1g -me (NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME)
    (f,) = RealBackend().foreign_instances(0)
    assert (f.start, f.size, f.profile_id, f.gi_id) == (6, 1, 52, gi)
    with pytest.raises(InsufficientResources, match="profile id 52 at 6:1"):
        apply_layout(RealBackend(), 0, Layout.of(fake_nvml.model, [("3g", 0), ("2g", 4), ("1g", 6)]))

