"""`slurm-mig nvml check-tables`: our profile tables against what a driver reports, read-only.

RealBackend.profile_readings runs over test_nvml_real_gateway's fake pynvml, which answers from our
own table unless told to differ: these tests check that each kind of difference is caught and named,
not that the table is right. Whether it is right on hardware is what the command (and the ``gpu``-
marked test here) is for.
"""

from __future__ import annotations

import json

import pytest

from slurm_mig.cli import main
from slurm_mig.mig.profiles import get_model
from slurm_mig.nvml.real import RealBackend
from slurm_mig.nvml.simulated import init_state
from slurm_mig.nvml.tables import ProfileReading, check_gpu, compare_tables
from test_nvml_real_gateway import FakeNvml

H100 = get_model("H100-80GB")


@pytest.fixture
def fake(monkeypatch):
    import sys

    from slurm_mig.nvml import real

    nvml = FakeNvml()
    monkeypatch.setattr(real, "_initialized_module", None)
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    return nvml


def _check(nvml_fake=None):
    backend = RealBackend()
    try:
        (gpu,) = backend.gpus()
        return check_gpu(backend, gpu)
    finally:
        backend.close()


def _levels(check):
    return sorted((f.level, f.profile) for f in check.findings)


def test_a_driver_that_agrees_reads_every_profile_with_name_and_placements(fake):
    check = _check()
    assert check.ok and check.findings == [] and check.unreadable is None
    by_name = {r.short_name: r for r in check.readings}
    assert sorted(by_name) == sorted(p.name for p in H100.profiles)
    assert by_name["3g.40gb"].placements == ((0, 4), (4, 4))
    assert by_name["1g.20gb"].placements == ((0, 2), (2, 2), (4, 2), (6, 2))
    assert by_name["7g.80gb"].name == "MIG 7g.80gb" and by_name["7g.80gb"].nvml_index == 4


def test_each_number_that_differs_is_an_error_naming_both_values(fake):
    fake.profile_overrides = {1: {"instanceCount": 2}, 2: {"id": 10}, 3: {"sliceCount": 3},
                              4: {"name": b"MIG 7g.94gb"}}
    fake.placement_overrides = {15: [(0, 2), (4, 2)]}  # the double-memory 1g's placements
    check = _check()
    assert not check.ok
    messages = {f.profile: f.message for f in check.errors}
    assert messages == {
        "2g.20gb": "at most 2 instances, ours 3",
        "3g.40gb": "profile id 10, ours 9",
        "4g.40gb": "3 compute slices, ours 4",
        "7g.80gb": "named '7g.94gb', ours '7g.80gb'",
        "1g.20gb": "placements {0,4}:2, ours {0,2,4,6}:2",
    }


def test_a_placement_of_another_size_is_caught(fake):
    fake.placement_overrides = {9: [(0, 3), (4, 3)]}  # go-nvml's mock geometry: 3g spanning 3 slices
    check = _check()
    assert [(f.profile, f.message) for f in check.errors] == [
        ("3g.40gb", "placements {0,4}:3, ours {0,4}:4")]


def test_a_missing_basic_profile_is_an_error_a_missing_me_variant_a_warning(fake):
    fake.profile_overrides = {7: None}  # no 1g+me on this driver
    check = _check()
    assert check.ok and _levels(check) == [("warning", "1g.10gb+me")]
    fake.profile_overrides = {3: None}  # no 4g: every layout with a 4g would be refused
    check = _check()
    assert not check.ok and _levels(check) == [("error", "4g.40gb")]


def test_a_profile_not_in_our_table_is_a_note_with_its_placements(fake):
    import types

    fake.extra_profiles = {10: types.SimpleNamespace(id=32, instanceCount=1, sliceCount=1,
                                                     name=b"MIG 1g.10gb+gfx", memorySizeMB=9856)}
    fake.placement_overrides = {32: [(0, 1), (1, 1)]}
    check = _check()
    assert check.ok
    (note,) = check.findings
    assert (note.level, note.profile) == ("note", "1g.10gb+gfx")
    assert "NVML index 10" in note.message and "{0,1}:1" in note.message


def test_an_old_driver_without_the_version_2_struct_is_compared_without_names(fake):
    fake.old_driver = True
    check = _check()
    assert check.ok and {r.name for r in check.readings} == {None}
    assert {r.memory_mib for r in check.readings} == {None}


def test_unreadable_placements_are_a_warning_not_a_pass_of_that_check(fake, monkeypatch):
    def not_supported(*_args):
        from test_nvml_real_gateway import FakeNVMLError

        raise FakeNVMLError(3)

    fake.nvmlDeviceGetGpuInstancePossiblePlacements = not_supported
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    check = _check()
    assert check.ok
    assert {f.level for f in check.findings} == {"warning"} and len(check.findings) == len(H100.profiles)


def test_mig_off_is_still_compared_an_unknown_model_is_unreadable(fake):
    fake.mig = False  # NVML lists profiles and placements with MIG off (an H200 on driver 580 did)
    check = _check()
    assert check.ok and check.mig_mode == "off" and len(check.readings) == len(H100.profiles)
    fake.device_name = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    check = _check()
    assert not check.ok and "not a GPU model slurm-mig has a table for" in check.unreadable
    assert check.readings  # still read and shown: what an admin needs to add the model
    fake.device_name, fake.profile_overrides = "NVIDIA H100 80GB HBM3", {i: None for i in range(10)}
    check = _check()
    assert not check.ok and check.unreadable == "the driver offers no GPU-instance profile on this GPU"


# Read from an NVIDIA H200 (driver 580.159.04, nvidia-ml-py 13.610.43, MIG mode off) on 2026-11-26 with
# nvmlDeviceGetGpuInstanceProfileInfo (version 2) and nvmlDeviceGetGpuInstancePossiblePlacements: indexes
# 5, 6, 8 and 10-16 answered NOT_SUPPORTED, 17 and up INVALID_ARGUMENT.
H200_580 = [
    ProfileReading(0, 19, 1, 7, 16384, "MIG 1g.18gb", tuple((s, 1) for s in range(7))),
    ProfileReading(1, 14, 2, 3, 33280, "MIG 2g.35gb", ((0, 2), (2, 2), (4, 2))),
    ProfileReading(2, 9, 3, 2, 71424, "MIG 3g.71gb", ((0, 4), (4, 4))),
    ProfileReading(3, 5, 4, 1, 71424, "MIG 4g.71gb", ((0, 4),)),
    ProfileReading(4, 0, 7, 1, 143360, "MIG 7g.141gb", ((0, 8),)),
    ProfileReading(7, 20, 1, 1, 16384, "MIG 1g.18gb+me", tuple((s, 1) for s in range(7))),
    ProfileReading(9, 15, 1, 4, 33280, "MIG 1g.35gb", ((0, 2), (2, 2), (4, 2), (6, 2))),
]


# The same, from an NVIDIA H100 80GB HBM3 (same driver and nvidia-ml-py, MIG mode off), 2026-11-26.
H100_580 = [
    ProfileReading(0, 19, 1, 7, 9984, "MIG 1g.10gb", tuple((s, 1) for s in range(7))),
    ProfileReading(1, 14, 2, 3, 20096, "MIG 2g.20gb", ((0, 2), (2, 2), (4, 2))),
    ProfileReading(2, 9, 3, 2, 40448, "MIG 3g.40gb", ((0, 4), (4, 4))),
    ProfileReading(3, 5, 4, 1, 40448, "MIG 4g.40gb", ((0, 4),)),
    ProfileReading(4, 0, 7, 1, 81152, "MIG 7g.80gb", ((0, 8),)),
    ProfileReading(7, 20, 1, 1, 9984, "MIG 1g.10gb+me", tuple((s, 1) for s in range(7))),
    ProfileReading(9, 15, 1, 4, 20096, "MIG 1g.20gb", ((0, 2), (2, 2), (4, 2), (6, 2))),
]


@pytest.mark.parametrize("model, readings", [("H200-141GB", H200_580), ("H100-80GB", H100_580)])
def test_our_tables_agree_with_what_an_h200_and_an_h100_reported(model, readings):
    assert compare_tables(get_model(model), readings) == []


def test_one_models_readings_are_not_taken_for_anothers_table():
    # only the names differ between the two: each profile is an error, named by the size it carries
    errors = [f for f in compare_tables(H100, H200_580) if f.level == "error"]
    assert sorted(f.profile for f in errors) == sorted(p.name for p in H100.profiles)
    assert all(f.message.startswith("named ") for f in errors)


def test_compare_tables_on_literal_readings():
    """A driver that lists the 2g at starts 0,2,4,6 (as the 1g.20gb) would let us plan 2g@6: an error."""
    readings = [ProfileReading(p.nvml_index, p.id, p.compute_slices, p.max_count, None, f"MIG {p.name}",
                               tuple((s, p.memory_slices) for s in p.starts)) for p in H100.profiles]
    assert compare_tables(H100, readings) == []
    readings[3] = ProfileReading(1, 14, 2, 3, None, "MIG 2g.20gb", ((0, 2), (2, 2), (4, 2), (6, 2)))
    (finding,) = compare_tables(H100, readings)
    assert (finding.level, finding.profile) == ("error", "2g.20gb")
    readings.append(ProfileReading(12, 40, 1, 1, None, "MIG 1g.10gb+x", ((6, 3),)))
    assert ("error", "1g.10gb+x") in [(f.level, f.profile) for f in compare_tables(H100, readings)]


def test_the_command_exits_by_what_it_found(fake, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_MIG_SIM_STATE", raising=False)
    monkeypatch.setenv("SLURM_MIG_CONFIG", str(tmp_path / "none.toml"))
    assert main(["nvml", "check-tables", "--backend", "real"]) == 0
    assert "agrees with the driver (7 profiles read)" in capsys.readouterr().out
    fake.profile_overrides = {1: {"instanceCount": 2}}
    assert main(["nvml", "check-tables", "--backend", "real", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["gpus"][0]["findings"][0]["profile"] == "2g.20gb"
    fake.profile_overrides = {i: None for i in range(10)}  # a GPU whose driver offers no profile
    assert main(["nvml", "check-tables", "--backend", "real"]) == 2
    assert "not compared" in capsys.readouterr().out
    assert main(["nvml", "check-tables", "--backend", "real", "--gpu", "3"]) != 0


def test_the_simulated_backend_lists_its_own_table_with_mig_on_or_off(tmp_path):
    backend = init_state(tmp_path / "n.json", [("H200-141GB", 1), ("A30-24GB", 1)])
    backend.set_mig_mode(1, False)
    for gpu in backend.gpus():
        check = check_gpu(backend, gpu)
        assert check.ok and len(check.readings) == len(gpu.model.profiles)
    assert [r.nvml_index for r in check_gpu(backend, backend.gpus()[0]).readings] == [r.nvml_index for r in H200_580]


@pytest.mark.gpu
def test_our_table_agrees_with_a_real_mig_gpu():
    """Read-only: on a machine with a GPU of a known model (MIG mode on or off: NVML lists the profiles
    either way), the driver agrees with our table."""
    from slurm_mig.nvml.base import NvmlError

    backend = RealBackend()
    try:
        gpus = backend.gpus()
    except NvmlError as exc:
        pytest.skip(f"no usable NVML here: {exc}")
    known = [g for g in gpus if g.model is not None and not g.lost]
    if not known:
        pytest.skip("no GPU of a known MIG model here")
    for gpu in known:
        check = check_gpu(backend, gpu)
        assert check.ok, [f"{f.profile}: {f.message}" for f in check.errors]


def test_a_simulated_driver_that_differs_is_read_as_such_and_refuses_what_it_lacks(tmp_path):
    from slurm_mig.mig.layout import Slot
    from slurm_mig.nvml import InsufficientResources, NotSupported

    backend = init_state(tmp_path / "n.json", [("H100-80GB", 1)])
    assert backend.driver_version() == "simulated"
    backend.set_driver_profiles(0, {1: {"placements": [[0, 2], [2, 2]]}, 3: None}, driver="590.1")
    assert backend.driver_version() == "590.1"
    check = check_gpu(backend, backend.gpus()[0])
    assert sorted((f.level, f.profile) for f in check.findings) == [("error", "2g.20gb"), ("error", "4g.40gb")]
    with pytest.raises(InsufficientResources, match="no placement 4:2"):
        backend.create(0, Slot(4, "2g"))
    with pytest.raises(NotSupported, match="no profile 4g.40gb"):
        backend.create(0, Slot(0, "4g"))
    backend.create(0, Slot(2, "2g"))  # what the driver lists is made as before


def test_real_backend_reads_the_driver_version(fake):
    assert RealBackend().driver_version() == "580.159.04"


def test_a_table_check_that_fails_blocks_nothing_and_the_report_goes_on(tmp_path, caplog):
    from slurm_mig.node.hooks import Node

    class Broken:
        """A backend whose profile listing breaks: not a reason to stop jobs on the GPU."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def profile_readings(self, gpu):
            raise RuntimeError("driver hiccup")

    node = Node.__new__(Node)
    from slurm_mig.node.localstate import NodeState

    node.name, node.state = "n1", NodeState(tmp_path / "n1")
    node._backend = Broken(init_state(tmp_path / "g.json", [("H100-80GB", 1)], layouts={0: "7g@0"}))
    (entry,) = node.observe()
    assert "table_errors" not in entry and [i["profile"] for i in entry["instances"]] == ["7g.80gb"]
    assert "the MIG table check failed: RuntimeError: driver hiccup" in caplog.text
    assert not (tmp_path / "n1" / "tables.json").exists()  # asked again next time


@pytest.mark.parametrize("bad, words", [
    ([7], "table_errors[0]"),
    (["x"] * 17, "at most 16"),
    ("2g.20gb: wrong", "table_errors"),
])
def test_a_report_with_malformed_table_errors_is_refused(bad, words):
    from slurm_mig.api.server import RequestRejected
    from slurm_mig.controller.payloads import v_observed

    gpu = {"index": 0, "uuid": "GPU-1", "name": "NVIDIA H100 80GB HBM3", "model": "H100-80GB",
           "mig_enabled": True, "lost": False, "instances": []}
    assert v_observed([{**gpu, "table_errors": ["2g.20gb: at most 2 instances, ours 3"]}])[0]["table_errors"] == [
        "2g.20gb: at most 2 instances, ours 3"]
    with pytest.raises(RequestRejected, match=words.replace("[", r"\[").replace("]", r"\]")):
        v_observed([{**gpu, "table_errors": bad}])


def test_a_report_asks_the_driver_version_and_reads_the_kept_verdicts_once(tmp_path, monkeypatch):
    """The check runs for every GPU of a report: its inputs (the driver version, tables.json) are read once per
    report, not once per GPU (a Prolog's report is on the job's start path)."""
    from pathlib import Path

    from slurm_mig.node.hooks import Node
    from slurm_mig.node.localstate import NodeState

    node = Node.__new__(Node)
    node.name, node.state = "n1", NodeState(tmp_path / "n1")
    node._backend = init_state(tmp_path / "g.json", [("H100-80GB", 4)])
    asked, reads = [], []
    real_version, real_read = type(node._backend).driver_version, Path.read_text
    monkeypatch.setattr(type(node._backend), "driver_version", lambda self: asked.append(1) or real_version(self))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (reads.append(self.name), real_read(self, *a, **k))[1])
    for _ in range(2):  # the first report makes the verdicts, the second reads them
        asked.clear(), reads.clear()
        assert all("table_errors" not in g for g in node.observe())
        assert asked == [1] and reads.count("tables.json") == 1


def test_a_kept_no_profile_answer_is_asked_again_once_mig_mode_changes(tmp_path, monkeypatch):
    """nvml.h: nvmlDeviceGetGpuInstanceProfileInfo answers NOT_SUPPORTED on a GPU without MIG mode, so a driver
    that does so lists no profile while MIG is off (profile_readings skips each). That answer was kept in
    tables.json for the driver version alone, so once MIG mode was turned on (no reset on Hopper, no new driver)
    the driver's profiles were never compared: a table of ours that differs (one never read from a driver here)
    was carved by. It is now kept for the MIG mode it was made in, and asked again when that changes."""
    from slurm_mig.node.hooks import Node
    from slurm_mig.node.localstate import NodeState
    from slurm_mig.nvml.simulated import SimulatedBackend

    node = Node.__new__(Node)
    node.name, node.state = "n1", NodeState(tmp_path / "n1")
    node._backend = backend = init_state(tmp_path / "g.json", [("H100-80GB", 1)])
    real = SimulatedBackend.profile_readings
    monkeypatch.setattr(SimulatedBackend, "profile_readings",
                        lambda self, gpu: real(self, gpu) if self.gpus()[gpu].mig_enabled else [])
    backend.set_driver_profiles(0, {1: {"placements": [[0, 2], [2, 2]]}}, driver="590.1")  # no 2g at 4
    backend.set_mig_mode(0, False)
    assert node.table_errors(backend.gpus()) == {0: []}  # nothing to compare with MIG off
    assert node.table_errors(backend.gpus()) == {0: []}
    backend.set_mig_mode(0, True)
    assert node.table_errors(backend.gpus()) == {0: ["2g.20gb: placements {0,2}:2, ours {0,2,4}:2"]}
