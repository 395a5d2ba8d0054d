"""The MigBackend contract, run against every backend that is available.

The read-only part runs against the simulated GPUs, against RealBackend over
the fake pynvml of test_nvml_real_gateway (no GPU needed), and against a real
MIG GPU when one is present (``-m gpu``; skipped otherwise). It never changes
anything on a real machine. The part that creates and destroys runs against the
simulated backend and RealBackend over the fake pynvml (whose geometry check is
our own Layout.can_add: that checks our error mapping, not the hardware); the
tests that need sim-only methods run against the simulated backend only.
"""

from __future__ import annotations

import re

import pytest

from slurm_mig.errors import SlurmMigError
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.profiles import model_from_nvml_name
from slurm_mig.nvml import (
    GpuInfo,
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
    apply_layout,
    foreign_instances,
    observed_layout,
)
from slurm_mig.nvml.simulated import SimulatedBackend, init_state

UUID_BODY = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
GPU_UUID = re.compile(rf"^GPU-{UUID_BODY}$")
MIG_UUID = re.compile(rf"^MIG-{UUID_BODY}$")

SIM_GPUS = [("H100-80GB", 1), ("A100-40GB", 1), ("A30-24GB", 1)]
SIM_LAYOUTS = {0: "3g@0,2g@4,1g@6", 1: "4g@0,3g@4", 2: "2g@0,1g@2,1g@3"}


def _real_backend_or_skip():
    from slurm_mig.nvml.real import RealBackend

    backend = RealBackend()
    try:
        gpus = backend.gpus()
    except NvmlError as exc:
        pytest.skip(f"no usable NVML here: {exc}")
    if not any(g.model is not None for g in gpus):
        pytest.skip("no GPU of a known MIG model here")
    return backend


def _skip_without_mig(backend) -> None:
    """For checks of instances: a GPU with MIG off has none (its listing and mode are still checked)."""
    if not any(g.mig_enabled and g.model is not None and not g.lost for g in backend.gpus()):
        pytest.skip("MIG mode is off on every GPU of a known model here")


def _real_backend_over_fake_pynvml(monkeypatch, layout=(Slot(0, "3g"), Slot(4, "2g"), Slot(6, "1g"))):
    """RealBackend through the gateway, with test_nvml_real_gateway's fake pynvml (one H100) in place of
    nvidia-ml-py: the same assertions as the simulated backend, no GPU needed. GPU 0 gets ``layout``,
    with its 2g@4 (if any) busy, as the simulated read-only backend has it."""
    import sys

    from slurm_mig.nvml import real
    from slurm_mig.nvml.real import RealBackend
    from test_nvml_real_gateway import FakeNvml

    nvml = FakeNvml()
    monkeypatch.setattr(real, "_initialized_module", None)
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    backend = RealBackend()
    for slot in layout:
        backend.create(0, slot)
    for m in backend.instances(0):
        if m.slot == Slot(4, "2g.20gb"):
            nvml.gis[m.gi_id]["cis"][m.ci_id] = True
    nvml.calls.clear()
    return backend


@pytest.fixture(params=["simulated", "real-over-fake-pynvml", pytest.param("real", marks=pytest.mark.gpu)])
def ro_backend(request, tmp_path, monkeypatch):
    """A backend for read-only checks. The real one is never changed."""
    if request.param == "simulated":
        backend = init_state(tmp_path / "node.json", SIM_GPUS, layouts=SIM_LAYOUTS, seed="contract")
        backend.set_in_use(0, Slot(4, "2g.20gb"), "job 1")
    elif request.param == "real-over-fake-pynvml":
        backend = _real_backend_over_fake_pynvml(monkeypatch)
    else:
        backend = _real_backend_or_skip()
    yield backend
    backend.close()


@pytest.fixture
def sim(tmp_path) -> SimulatedBackend:
    """A backend the test may change: simulated only."""
    return init_state(tmp_path / "node.json", SIM_GPUS, seed="contract-rw")


@pytest.fixture(params=["simulated", "real-over-fake-pynvml"])
def rw_backend(request, tmp_path, monkeypatch):
    """A backend the test may change, for checks that need no sim-only method: the simulated one and
    RealBackend over a fake pynvml (GPU 0 is an H100 in both)."""
    if request.param == "simulated":
        return init_state(tmp_path / "node.json", SIM_GPUS, seed="contract-rw")
    return _real_backend_over_fake_pynvml(monkeypatch, layout=())


# -- read-only contract -------------------------------------------------------
def test_is_a_mig_backend(ro_backend):
    assert isinstance(ro_backend, MigBackend)


def test_gpus_are_listed_in_index_order_with_nvidia_uuids(ro_backend):
    gpus = ro_backend.gpus()
    assert gpus, "a backend with no GPU at all is not useful for this contract"
    assert [g.index for g in gpus] == list(range(len(gpus)))
    for g in gpus:
        assert isinstance(g, GpuInfo)
        if g.lost:
            continue
        assert GPU_UUID.match(g.uuid), g.uuid
        assert g.name
        known = model_from_nvml_name(g.name)
        assert (g.model.name if g.model else None) == (known.name if known else None)
    assert len({g.uuid for g in gpus if not g.lost}) == len([g for g in gpus if not g.lost])


def test_instances_are_well_formed_and_their_layout_is_valid(ro_backend):
    _skip_without_mig(ro_backend)
    all_uuids = []
    for g in ro_backend.gpus():
        if g.lost or g.model is None or not g.mig_enabled:
            continue
        insts = ro_backend.instances(g.index)
        assert insts == sorted(insts, key=lambda m: m.slot)
        for m in insts:
            assert isinstance(m, MigInstance)
            assert m.gpu_index == g.index
            assert isinstance(m.in_use, bool)
            assert g.model.profile(m.profile).name == m.profile  # full profile names
            if m.ci_id >= 0:  # a GPU instance without compute instance has no MIG device
                assert MIG_UUID.match(m.uuid), m.uuid
                all_uuids.append(m.uuid)
        assert len({m.gi_id for m in insts}) == len(insts)
        layout = observed_layout(ro_backend, g.index)
        assert layout.slots == frozenset(m.slot for m in insts)
        assert layout.problems() == []
    assert len(set(all_uuids)) == len(all_uuids)


def test_reading_twice_gives_the_same_instances(ro_backend):
    _skip_without_mig(ro_backend)
    for g in ro_backend.gpus():
        if g.mig_enabled and not g.lost:
            first = {(m.slot, m.uuid, m.gi_id) for m in ro_backend.instances(g.index)}
            second = {(m.slot, m.uuid, m.gi_id) for m in ro_backend.instances(g.index)}
            assert first == second


def test_asking_for_a_gpu_that_does_not_exist_is_a_typed_error(ro_backend):
    n = len(ro_backend.gpus())
    with pytest.raises(InvalidArgument):
        ro_backend.instances(n + 7)


def test_the_busy_instance_is_reported_busy(ro_backend, request):
    if request.node.callspec.params["ro_backend"] == "real":
        pytest.skip("which instance of a real GPU is busy is not known here")
    busy = [m.slot for m in ro_backend.instances(0) if m.in_use]
    assert busy == [Slot(4, "2g.20gb")]


def test_the_mig_mode_is_read_with_its_pending_half(ro_backend):
    """Read-only on a real GPU too: nvmlDeviceGetMigMode's pending value is read, and a pending change is
    one that differs from the current mode."""
    for g in ro_backend.gpus():
        assert g.mig_pending is None or isinstance(g.mig_pending, bool)
        assert g.mig_pending != g.mig_enabled
        assert g.mig_mode.startswith("on" if g.mig_enabled else "off")


def test_foreign_instances_are_well_formed_and_beside_ours(ro_backend):
    """Read-only on a real GPU too: GPU instances of profiles our tables do not list (none, usually) have a
    placement on the GPU that none of ours overlaps."""
    _skip_without_mig(ro_backend)
    for g in ro_backend.gpus():
        if g.lost or g.model is None or not g.mig_enabled:
            continue
        ours = observed_layout(ro_backend, g.index).used_mask
        for f in foreign_instances(ro_backend, g.index):
            assert 0 <= f.start and f.start + f.size <= g.model.memory_slices and not f.mask & ours
            assert all(f.profile_id != p.id for p in g.model.profiles)


def test_simulated_reports_the_busy_instance(tmp_path):
    backend = init_state(tmp_path / "n.json", SIM_GPUS, layouts=SIM_LAYOUTS)
    backend.set_in_use(0, "2g@4", "job 1")
    busy = [m.slot for m in backend.instances(0) if m.in_use]
    assert busy == [Slot(4, "2g.20gb")]


# -- changing contract (simulated only) -----------------------------------------
def test_errors_are_project_errors():
    for cls in (InUse, InsufficientResources, NoPermission, NotSupported, NotFound, InvalidArgument):
        assert issubclass(cls, NvmlError) and issubclass(cls, SlurmMigError)
    assert (InUse.code, InsufficientResources.code, NoPermission.code, NotSupported.code) == (19, 23, 4, 3)


def test_create_at_a_placement_then_destroy(rw_backend):
    inst = rw_backend.create(0, Slot(4, "3g"))
    assert inst.slot == Slot(4, "3g.40gb")  # kinds are resolved to full names
    assert MIG_UUID.match(inst.uuid)
    assert inst.in_use is False
    assert rw_backend.instances(0) == [inst]
    rw_backend.destroy(0, Slot(4, "3g.40gb"))
    assert rw_backend.instances(0) == []


def test_each_create_gets_a_new_uuid(sim):
    seen = set()
    for _ in range(5):
        seen.add(sim.create(0, Slot(0, "7g")).uuid)
        sim.destroy(0, Slot(0, "7g"))
    assert len(seen) == 5


@pytest.mark.parametrize("existing, new", [
    (["3g@0"], Slot(0, "3g")),  # the same place again
    (["3g@0"], Slot(2, "2g")),  # overlaps slices 2-3 of the 3g
    ([], Slot(2, "3g")),  # 3g may only start at 0 or 4
    ([], Slot(6, "2g")),  # 2g may start at 0, 2, 4
    (["4g@0"], Slot(4, "4g")),  # one 4g per GPU, and at 0 only
    (["4g@0", "1g@4", "1g@5", "1g@6"], Slot(7, "1g")),  # 1g has no start 7 (and compute is full)
    (["1g+me@0"], Slot(1, "1g+me")),  # one +me per GPU
    (["7g@0"], Slot(6, "1g")),
])
def test_illegal_or_occupied_placement_is_insufficient_resources(rw_backend, existing, new):
    model = rw_backend.gpus()[0].model
    for item in existing:
        name, _, start = item.partition("@")
        rw_backend.create(0, Slot(int(start), model.profile(name).name))
    before = rw_backend.instances(0)
    with pytest.raises(InsufficientResources):
        rw_backend.create(0, new)
    assert rw_backend.instances(0) == before


def test_destroying_a_busy_instance_is_in_use_and_keeps_it(sim):
    inst = sim.create(0, Slot(0, "3g"))
    sim.set_in_use(0, inst.uuid, "job 7")
    with pytest.raises(InUse):
        sim.destroy(0, inst.slot)
    assert [m.uuid for m in sim.instances(0)] == [inst.uuid]
    sim.set_in_use(0, inst.uuid, None)
    sim.destroy(0, inst.slot)
    assert sim.instances(0) == []


def test_destroying_what_is_not_there_is_not_found(rw_backend):
    with pytest.raises(NotFound):
        rw_backend.destroy(0, Slot(0, "3g"))


def test_no_permission_to_configure(tmp_path):
    init_state(tmp_path / "n.json", SIM_GPUS, layouts={0: "7g@0"})
    user = SimulatedBackend(tmp_path / "n.json", allow_config=False)
    assert [m.slot.profile for m in user.instances(0)] == ["7g.80gb"]  # reading is allowed
    with pytest.raises(NoPermission):
        user.destroy(0, Slot(0, "7g"))
    with pytest.raises(NoPermission):
        user.create(1, Slot(0, "7g"))
    assert len(user.instances(0)) == 1 and user.instances(1) == []


def test_mig_mode_off_means_no_instances_and_no_create(sim):
    sim.set_mig_mode(1, False)
    assert sim.gpus()[1].mig_enabled is False
    assert sim.instances(1) == []
    with pytest.raises(NotSupported):
        sim.create(1, Slot(0, "7g"))


def test_a_freed_place_can_be_used_by_another_profile(rw_backend):
    rw_backend.create(0, Slot(0, "4g"))
    rw_backend.create(0, Slot(4, "3g"))
    rw_backend.destroy(0, Slot(0, "4g.40gb"))
    for start in (0, 2):
        rw_backend.create(0, Slot(start, "2g"))
    assert observed_layout(rw_backend, 0) == Layout.of(rw_backend.gpus()[0].model, [("2g", 0), ("2g", 2), ("3g", 4)])


def _set_pending(backend, gpu: int, enabled: bool) -> None:
    """An admin's `nvidia-smi -i GPU -mig 0|1` that waits for a GPU reset."""
    if isinstance(backend, SimulatedBackend):
        backend.set_mig_mode(gpu, enabled, pending=True)
    else:
        import sys

        sys.modules["pynvml"].nvmlDeviceGetCount.__self__.mig_pending = int(enabled)  # the fake pynvml's FakeNvml


def test_a_mig_disable_pending_a_reset_is_reported_and_nothing_is_carved_there(rw_backend):
    rw_backend.create(0, Slot(0, "3g"))
    _set_pending(rw_backend, 0, False)
    (gpu, *_) = rw_backend.gpus()
    assert (gpu.mig_enabled, gpu.mig_pending, gpu.mig_mode) == (True, False, "on, disable pending")
    before = rw_backend.instances(0)
    assert [m.slot for m in before] == [Slot(0, "3g.40gb")]  # still there until the reset
    target = Layout.of(gpu.model, [("3g", 0), ("3g", 4)])
    for dry_run in (True, False):
        with pytest.raises(MigModePending, match="MIG mode change pending a GPU reset"):
            apply_layout(rw_backend, 0, target, dry_run=dry_run)
    with pytest.raises(MigModePending):
        apply_layout(rw_backend, 0, Layout.of(gpu.model, []))  # nor does it destroy
    assert rw_backend.instances(0) == before


def _make_foreign(backend, gpu: int, start: int, size: int, profile_id: int) -> None:
    """A GPU instance of a profile our tables do not list, made by hand (NVML profile index 0xA)."""
    if isinstance(backend, SimulatedBackend):
        backend.make_foreign(gpu, start, size, profile_id=profile_id)
    else:
        import sys

        sys.modules["pynvml"].nvmlDeviceGetCount.__self__.add_foreign(0xA, profile_id, start, size)


def test_an_instance_of_a_profile_not_in_our_tables_holds_its_slices(rw_backend):
    _make_foreign(rw_backend, 0, 0, 2, 47)
    model = rw_backend.gpus()[0].model
    assert rw_backend.instances(0) == []  # not one of ours: never bound, never destroyed
    assert [(f.start, f.size, f.profile_id) for f in foreign_instances(rw_backend, 0)] == [(0, 2, 47)]
    with pytest.raises(InsufficientResources):
        rw_backend.create(0, Slot(0, "1g"))
    with pytest.raises(InsufficientResources, match="profile id 47 at 0:2"):
        apply_layout(rw_backend, 0, Layout.of(model, [("4g", 0)]), dry_run=True)
    assert apply_layout(rw_backend, 0, Layout.of(model, [("2g", 2), ("3g", 4)])).reached
    assert len(foreign_instances(rw_backend, 0)) == 1
