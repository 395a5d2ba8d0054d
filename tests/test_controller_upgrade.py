"""A rolling upgrade: nodes that know a GPU model the controller's tables do not (or the other way round).

New GPU tables are added often (H100 NVL, GH200, GB200 in one session). Until 2026-11-26 a node report
naming a model this controller could not look up was refused whole (400), and so was every Prolog request
of that node: the node's bindings, its other GPUs and its results were lost with it, its Prologs took the
controller-down path, and the node ran unmanaged for the whole upgrade window. Now such a GPU is kept as
"unknown model": the rest of the report is taken, the GPU is left as it is (never re-carved, no GRES for
its slices, never chosen for a binding), the instances on it are kept as held, and a job the node bound
there alone is adopted, not requeued.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest

from slurm_mig.config import Config
from slurm_mig.controller.service import Controller
from slurm_mig.slurm.parsers import SlurmJob, SlurmNode
from slurm_mig.store import open_store

NEW_MODEL = "GX900-512GB"  # a model a newer node's tables name and this controller's do not

KNOWN = {"index": 0, "uuid": "GPU-0", "name": "NVIDIA H100 80GB HBM3", "model": "H100-80GB", "mig_enabled": True,
         "instances": [{"profile": "3g.40gb", "start": 0, "uuid": "MIG-0a", "in_use": False},
                       {"profile": "3g.40gb", "start": 4, "uuid": "MIG-0b", "in_use": False}]}
NEWER = {"index": 1, "uuid": "GPU-1", "name": "NVIDIA GX900", "model": NEW_MODEL, "mig_enabled": True,
         "instances": [{"profile": "3g.256gb", "start": 0, "uuid": "MIG-1a", "in_use": True},
                       {"profile": "3g.256gb", "start": 4, "uuid": "MIG-1b", "in_use": False}]}
# Job 5 started while the controller refused this node: its Prolog bound it alone, on the newer GPU.
NODE_BINDINGS = {"5": [{"gpu": 1, "profile": "3g.256gb", "start": 0, "uuid": "MIG-1a"}]}


class Slurm:
    def __init__(self, started: float):
        self.queue = [SlurmJob(job_id=5, name="old", user="alice", state="RUNNING", mig={"3g": 1},
                               tres_per_node="gres:mig:3g:1", submit_time=int(started) - 10,
                               start_time=int(started), nodes=["n1"], priority=1),
                      SlurmJob(job_id=7, name="new", user="bob", state="PENDING", mig={"3g": 1},
                               tres_per_node="gres:mig:3g:1", submit_time=int(started), priority=2)]
        self.gres_writes: list[tuple[str, dict, int | None]] = []
        self.requeued: list[str] = []
        self.run_calls: list = []

    def jobs(self):
        return list(self.queue)

    def reservations(self):
        return []

    def nodes(self):
        # slurm.conf's constant total: 7 per MIG GPU, both GPUs (the node's newer slurm-mig knows the second)
        return [SlurmNode(name="n1", state="mixed", gres={"3g": 4, "pad": 10}, gres_used={"3g": 1})]

    def job_detail(self, job_id):
        return None

    def update_node_gres(self, node, counts, *, pad_to=None, **kw):
        self.gres_writes.append((node, dict(counts), pad_to))
        return ",".join(f"mig:{t}:{n}" for t, n in sorted(counts.items()))

    def scontrol_requeue(self, job_id, **kw):
        self.requeued.append(str(job_id))

    def run(self, argv, **kw):
        self.run_calls.append(argv)


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def rig(tmp_path):
    clock = Clock(time.time())
    store = open_store(tmp_path / "state.db")
    slurm = Slurm(started=clock.t - 600)
    ctl = Controller(Config(), store, slurm, clock=clock)
    yield ctl
    store.close()


def _report(ctl, gpus=(KNOWN, NEWER), bindings=NODE_BINDINGS) -> dict:
    return ctl.on_report({"node": "n1", "observed": [dict(g) for g in gpus], "bindings": bindings,
                          "binding_times": {j: ctl.clock() - 590 for j in bindings},
                          "observed_at": ctl.clock()}, None)


def test_a_report_naming_a_model_this_controller_does_not_know_is_taken_for_everything_else(rig):
    rig.tick()  # the controller knows job 5 from squeue
    answer = _report(rig)  # refused whole (400) before
    assert "1" not in answer["desired"]
    gpus = {g.gpu: g for g in rig.store.observed_gpus("n1")}
    assert gpus[0].model == "H100-80GB" and not gpus[0].blocked
    assert gpus[1].model == NEW_MODEL  # kept as reported, for the operator to see
    assert "not in this controller's tables" in gpus[1].blocked
    # The newer GPU's instances are kept as they are: held, never destroyed.
    assert [(i.gpu, i.profile, i.start, i.in_use) for i in rig.store.observed_instances("n1", 1)] == [
        (1, "3g.256gb", 0, True), (1, "3g.256gb", 4, False)]
    # The job the node bound there alone is adopted from its binding file.
    assert [(b.gpu, b.profile, b.start) for b in rig.store.bound_instances("5")] == [(1, "3g.256gb", 0)]


def test_the_unknown_models_gpu_is_not_carved_advertised_or_bound_and_its_node_made_job_is_not_requeued(rig):
    _report(rig)
    rig.clock.t += 5
    rig.tick()
    _report(rig)
    rig.clock.t += 5
    rig.tick()
    slurm = rig.slurm
    assert slurm.requeued == [] and not any("requeue" in " ".join(map(str, a)) for a in slurm.run_calls)
    assert rig.store.get_job("5").state == "RUNNING"
    assert [(b.gpu, b.start) for b in rig.store.bound_instances("5")] == [(1, 0)]
    # Never a target of the policy: no desired layout, no journal entry on GPU 1.
    assert 1 not in rig.store.desired("n1")
    assert all(e.gpu != 1 for e in rig.store.journal_entries())
    assert [g.index for g in rig.store.cluster_state().gpus] == [0]
    # Slurm is told of GPU 0's instances only; the pad keeps the node's total at 7 per GPU (14).
    assert rig.intended_layouts("n1").keys() == {0}
    node, counts, pad_to = slurm.gres_writes[-1]
    assert counts["3g"] <= 2 and sum(counts.values()) <= 7 and pad_to == 14
    # The instances on it stay.
    assert {i.start for i in rig.store.observed_instances("n1", 1)} == {0, 4}


def test_a_prolog_on_the_node_is_served_and_never_binds_on_the_unknown_models_gpu(rig):
    _report(rig)
    rig.tick()
    # GPU 0's two 3g are taken by jobs the node knows of; only the newer GPU has an idle 3g-sized instance.
    held = {**NODE_BINDINGS, "8": [{"gpu": 0, "profile": "3g.40gb", "start": 0}],
            "9": [{"gpu": 0, "profile": "3g.40gb", "start": 4}]}
    answer = rig.on_prolog({"job_id": "7", "node": "n1", "bindings": held,
                            "observed": [KNOWN, NEWER], "observed_at": rig.clock()}, None)
    assert answer["action"] == "requeue", answer  # not bound on GPU 1 (refused whole before)
    answer = rig.on_prolog({"job_id": "7", "node": "n1", "bindings": NODE_BINDINGS,
                            "observed": [KNOWN, NEWER], "observed_at": rig.clock()}, None)
    assert answer["action"] == "bind" and {i["gpu"] for i in answer["instances"]} == {0}
    assert not answer["targets"].get("1")


def test_one_warning_per_node_and_model_not_one_per_report(rig, caplog):
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            _report(rig)
            rig.clock.t += 10
            rig.tick()
    said = [r.getMessage() for r in caplog.records if NEW_MODEL in r.getMessage()]
    assert len(said) == 1, said
    assert "upgrade" in said[0]
    assert sum(NEW_MODEL in e.message for e in rig.store.recent_events(100)) == 1


def test_a_gpu_the_node_names_no_model_for_with_instances_on_it_is_kept_as_held(rig):
    # An older node's tables, or a part its tables cannot name: refused whole ("MIG instances reported on a
    # GPU of unknown model") before, with the other GPU's report and every binding in it.
    nameless = {**NEWER, "model": None}
    rig.tick()
    _report(rig, gpus=(KNOWN, nameless))
    gpus = {g.gpu: g for g in rig.store.observed_gpus("n1")}
    assert gpus[1].model is None and gpus[1].blocked
    assert {i.start for i in rig.store.observed_instances("n1", 1)} == {0, 4}
    assert [(b.gpu, b.start) for b in rig.store.bound_instances("5")] == [(1, 0)]
    rig.tick()
    assert 1 not in rig.store.desired("n1") and rig.intended_layouts("n1").keys() == {0}


def test_operators_see_the_gpu_as_unknown_model(rig):
    from slurm_mig.ops.views import load_snapshot, node_views

    _report(rig)
    rig.tick()
    views = node_views(load_snapshot(rig.store))
    gpu = next(g for n in views for g in n["gpus"] if g["gpu"] == 1)
    assert gpu["status"] == "unknown-model" and gpu["model"] == NEW_MODEL
    assert "3g.256gb@0" in gpu["layout"]


def test_a_binding_the_node_made_alone_on_the_unknown_models_gpu_is_adopted_from_its_outbox(rig):
    # /v1/bound of a Prolog that bound alone (the controller refused the node meanwhile), with its report.
    rig.tick()
    assert rig.on_bound({"job_id": "5", "node": "n1", "local": True, "bound_at": rig.clock() - 590,
                         "instances": NODE_BINDINGS["5"], "observed": [KNOWN, NEWER],
                         "observed_at": rig.clock()}, None) == {"ok": True}
    assert [(b.gpu, b.profile, b.start, b.uuid) for b in rig.store.bound_instances("5")] == [
        (1, "3g.256gb", 0, "MIG-1a")]
    assert not any(e.kind == "conflict" for e in rig.store.recent_events(20))
    assert rig.store.get_job("5").state == "RUNNING"


def test_a_node_whose_gpus_it_names_no_model_for_is_not_left_advertising_their_idle_instances(rig):
    """'NVIDIA H20 HBM3e' (a 141 GB H20) got the 96 GB H20's table until 555c03e: its node reported it as that
    model, blocked (the driver's profiles differ from the table), and the controller told Slurm of the instances
    jobs held there and no idle one. An upgraded node names no model for it (reports it with its instances,
    taken since d1464e6). Such a GPU was left out of the node's GPU count (_pad_gpus: 'a display GPU'), so on a
    node of only such GPUs the controller wrote no counts at all: slurm.conf's mix, put back by any slurmd
    registration or slurmctld restart, advertised every idle instance, Slurm started jobs there, and each
    Prolog found nothing it may bind and requeued the job, again and again (found in review). A GPU its node
    names no model for but that holds MIG instances is a MIG GPU slurm.conf counts: now its slices are padding,
    as for a named model this controller does not know."""
    nameless = {**NEWER, "index": 0, "uuid": "GPU-0", "model": None, "name": "NVIDIA H20 HBM3e",
                "instances": [{"profile": "1g.18gb", "start": s, "uuid": f"MIG-{s}", "in_use": s == 0}
                              for s in range(7)]}
    rig.slurm.queue = [replace(rig.slurm.queue[0], mig={"1g": 1}, tres_per_node="gres:mig:1g:1")]
    rig.slurm.nodes = lambda: [SlurmNode(name="n1", state="mixed", gres={"1g": 7, "pad": 0}, gres_used={"1g": 1})]
    bindings = {"5": [{"gpu": 0, "profile": "1g.18gb", "start": 0, "uuid": "MIG-0"}]}
    rig.tick()
    _report(rig, gpus=(nameless,), bindings=bindings)
    rig.clock.t += 5
    rig.tick()
    assert rig.slurm.gres_writes, "Slurm was left advertising the blocked GPU's 6 idle 1g"
    node, counts, pad_to = rig.slurm.gres_writes[-1]
    assert counts.get("1g", 0) <= 1 and pad_to == 7, rig.slurm.gres_writes[-1]
    assert {i.start for i in rig.store.observed_instances("n1", 0)} == set(range(7))  # nothing destroyed


# -- a known model, but a profile or placement its table here does not list -----------------------------------
# A node running a newer slurm-mig may report, on a GPU of a model this controller knows, an instance its table
# here lacks: a new driver's profile (a "+gfx" variant), a profile the newer table names otherwise (its memory
# size corrected), or one at a start the table here does not allow. Until 2026-11-27 v_observed refused such a
# report whole (400: "H100-80GB has no MIG profile '3g.40gb+gfx'", "the instances do not form a valid H100-80GB
# layout: 2g.20gb cannot start at memory slice 6"), and with it every report, Prolog, /v1/bound, Epilog and
# /v1/applied of the node: it ran unmanaged for the whole upgrade window. Now that GPU is kept as the unknown-model
# case keeps one (blocked, out of the policy's view, never re-carved or bound, its 7 GRES padding, its instances
# kept, a job the node bound there alone adopted), and the rest of the report is taken.

OFF_TABLE = {
    # a new driver's profile the node's newer table lists
    "profile": ([("3g.40gb+gfx", 0, True), ("3g.40gb", 4, False)], "unknown profile '3g.40gb+gfx'"),
    # the same slices, named otherwise by the newer table (its memory size)
    "memory": ([("3g.48gb", 0, True), ("3g.48gb", 4, False)], "unknown profile '3g.48gb'"),
    # a placement the newer table allows and this one does not
    "placement": ([("2g.20gb", 6, True), ("3g.40gb", 0, False)], "2g.20gb cannot start at memory slice 6"),
}


def _off_table(case: str) -> tuple[dict, dict]:
    """GPU 1, an H100-80GB holding ``case``'s instances, and the binding file of job 5, which the node bound alone
    on the first of them."""
    insts, _ = OFF_TABLE[case]
    gpu = {"index": 1, "uuid": "GPU-1", "name": "NVIDIA H100 80GB HBM3", "model": "H100-80GB", "mig_enabled": True,
           "instances": [{"profile": p, "start": s, "uuid": f"MIG-1{s}", "in_use": u} for p, s, u in insts]}
    p, s, _ = insts[0]
    return gpu, {"5": [{"gpu": 1, "profile": p, "start": s, "uuid": f"MIG-1{s}"}]}


@pytest.mark.parametrize("case", sorted(OFF_TABLE))
def test_a_profile_or_placement_the_known_models_table_lacks_keeps_that_gpu_blocked_and_takes_the_rest(rig, case):
    gpu, bindings = _off_table(case)
    rig.tick()  # the controller knows job 5 from squeue
    answer = _report(rig, gpus=(KNOWN, gpu), bindings=bindings)  # RequestRejected before
    assert "1" not in answer["desired"]
    gpus = {g.gpu: g for g in rig.store.observed_gpus("n1")}
    assert gpus[0].model == "H100-80GB" and not gpus[0].blocked
    assert gpus[1].model == "H100-80GB"  # kept as reported: a model we know, instances we cannot read
    assert OFF_TABLE[case][1] in gpus[1].blocked and "upgrade the controller" in gpus[1].blocked
    # The instances are kept as the node named them, and the job the node bound there alone is adopted.
    assert sorted((i.profile, i.start, i.in_use) for i in rig.store.observed_instances("n1", 1)) == sorted(
        OFF_TABLE[case][0])
    b = bindings["5"][0]
    assert [(x.gpu, x.profile, x.start) for x in rig.store.bound_instances("5")] == [(1, b["profile"], b["start"])]
    # Every other message that carries the report is taken too.
    assert rig.on_bound({"job_id": "5", "node": "n1", "local": True, "bound_at": rig.clock() - 590,
                         "instances": bindings["5"], "observed": [KNOWN, gpu], "observed_at": rig.clock()},
                        None) == {"ok": True}
    answer = rig.on_prolog({"job_id": "7", "node": "n1", "bindings": bindings, "observed": [KNOWN, gpu],
                            "observed_at": rig.clock()}, None)
    assert answer["action"] == "bind" and {i["gpu"] for i in answer["instances"]} == {0}, answer
    assert not any(e.kind == "conflict" for e in rig.store.recent_events(50))
    assert rig.on_epilog({"job_id": "5", "node": "n1", "instances": bindings["5"], "observed": [KNOWN, gpu],
                          "observed_at": rig.clock()}, None)["ok"]
    assert not rig.store.bound_instances("5")  # its Epilog released it


@pytest.mark.parametrize("case", sorted(OFF_TABLE))
def test_the_off_table_gpu_is_not_carved_advertised_or_bound_and_its_node_made_job_runs_on(rig, case):
    gpu, bindings = _off_table(case)
    for _ in range(3):
        _report(rig, gpus=(KNOWN, gpu), bindings=bindings)
        rig.clock.t += 5
        rig.tick()
    slurm = rig.slurm
    assert slurm.requeued == [] and not any("requeue" in " ".join(map(str, a)) for a in slurm.run_calls)
    assert rig.store.get_job("5").state == "RUNNING"
    assert [(x.gpu, x.start) for x in rig.store.bound_instances("5")] == [(1, bindings["5"][0]["start"])]
    # Out of the policy's view: no desired layout, no journal entry on GPU 1.
    assert 1 not in rig.store.desired("n1")
    assert all(e.gpu != 1 for e in rig.store.journal_entries())
    assert [g.index for g in rig.store.cluster_state().gpus] == [0]
    # GRES as for a model this controller does not know: GPU 0's instances only, the pad keeping 7 per GPU.
    assert rig.intended_layouts("n1").keys() == {0} and rig.store.observed_layout("n1", 1) is None
    node, counts, pad_to = slurm.gres_writes[-1]
    assert counts.get("3g", 0) <= 2 and not counts.get("2g") and sum(counts.values()) <= 7 and pad_to == 14
    assert sorted((i.profile, i.start) for i in rig.store.observed_instances("n1", 1)) == sorted(
        (p, s) for p, s, _ in OFF_TABLE[case][0])


def test_a_prolog_never_binds_on_the_off_table_gpus_idle_instance(rig):
    # GPU 1 holds an idle 3g.40gb@4 of a profile we know, beside a '+gfx' one: nothing may be bound there.
    gpu, bindings = _off_table("profile")
    _report(rig, gpus=(KNOWN, gpu), bindings=bindings)
    rig.tick()
    held = {**bindings, "8": [{"gpu": 0, "profile": "3g.40gb", "start": 0}],
            "9": [{"gpu": 0, "profile": "3g.40gb", "start": 4}]}
    answer = rig.on_prolog({"job_id": "7", "node": "n1", "bindings": held, "observed": [KNOWN, gpu],
                            "observed_at": rig.clock()}, None)
    assert answer["action"] == "requeue", answer
    assert not rig.store.bound_instances("7")


def test_a_reconfiguration_planned_before_the_node_was_upgraded_is_not_sent_to_it(rig):
    # The policy planned GPU 1 as 7g while the node's report could still be read; the node, upgraded, now names
    # a profile this controller's table lacks, on an instance a job uses. The plan must not reach it.
    gpu, bindings = _off_table("profile")
    rig.store.set_desired("n1", 1, "7g.80gb@0", "test", "before the upgrade", now=rig.clock())
    entry = rig.store.journal_begin("n1", 1, "3g.40gb@0,3g.40gb@4", "7g.80gb@0",
                                    [{"action": "destroy", "profile": "3g.40gb", "start": 0},
                                     {"action": "destroy", "profile": "3g.40gb", "start": 4},
                                     {"action": "create", "profile": "7g.80gb", "start": 0}],
                                    started=False, now=rig.clock())
    rig.tick()
    answer = _report(rig, gpus=(KNOWN, gpu), bindings=bindings)
    assert "1" not in answer["desired"], answer
    assert rig.store.journal_entry(entry).state != "in_progress"
    rig.clock.t += 5
    rig.tick()
    assert "1" not in _report(rig, gpus=(KNOWN, gpu), bindings=bindings)["desired"]
    assert rig.store.get_job("5").state == "RUNNING" and rig.slurm.requeued == []


def test_one_warning_per_node_and_profile_an_hour(rig, caplog):
    gpu, bindings = _off_table("profile")
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            _report(rig, gpus=(KNOWN, gpu), bindings=bindings)
            rig.clock.t += 10
            rig.tick()
        said = [r.getMessage() for r in caplog.records if "3g.40gb+gfx" in r.getMessage()]
        assert len(said) == 1, said
        assert "upgrade the controller" in said[0] and "n1 GPU 1" in said[0]
        assert sum("3g.40gb+gfx" in e.message for e in rig.store.recent_events(100, kind="model")) == 1
        # Another profile the table lacks is said too, once; the first again only an hour later.
        other = {**gpu, "instances": gpu["instances"] + [{"profile": "1g.10gb+me.all", "start": 7, "uuid": "MIG-17"}]}
        for _ in range(3):
            _report(rig, gpus=(KNOWN, other), bindings=bindings)
            rig.clock.t += 10
        rig.clock.t += 3600
        _report(rig, gpus=(KNOWN, gpu), bindings=bindings)
    said = [r.getMessage() for r in caplog.records if "+gfx" in r.getMessage() or "+me.all" in r.getMessage()]
    assert len(said) == 3, said
    assert "1g.10gb+me.all" in said[1] and "[2 more reports since]" not in said[1]
    assert "3g.40gb+gfx" in said[2] and "[4 more reports since]" in said[2]


def test_operators_see_the_off_table_gpu_blocked_with_its_reason(rig):
    from slurm_mig.ops.render import Glyphs, gpu_bar
    from slurm_mig.ops.views import load_snapshot, node_views

    gpu, bindings = _off_table("profile")
    _report(rig, gpus=(KNOWN, gpu), bindings=bindings)
    rig.tick()
    view = next(g for n in node_views(load_snapshot(rig.store)) for g in n["gpus"] if g["gpu"] == 1)
    assert view["status"] == "blocked" and view["model"] == "H100-80GB"
    assert "unknown profile '3g.40gb+gfx'" in view["blocked"]
    assert {i["profile"] for i in view["instances"]} == {"3g.40gb+gfx", "3g.40gb"}
    assert "3g" in gpu_bar(view, 40, Glyphs()).plain  # drawn, not an error


def test_a_known_model_under_another_alias_or_device_name_was_already_taken(rig):
    """Pins what was already safe: the model is looked up by canonical name or alias (case-insensitively), the
    device name is only shown, and a profile given by kind is stored under its full name."""
    variant = {**KNOWN, "index": 1, "uuid": "GPU-1", "model": "h100", "name": "NVIDIA H100 80GB HBM3e (new driver)",
               "instances": [{"profile": "3g", "start": 0, "uuid": "MIG-10", "in_use": True}]}
    rig.tick()
    _report(rig, gpus=(KNOWN, variant), bindings={"5": [{"gpu": 1, "profile": "3g", "start": 0}]})
    g = {g.gpu: g for g in rig.store.observed_gpus("n1")}[1]
    assert g.model == "H100-80GB" and not g.blocked
    assert [(i.profile, i.start) for i in rig.store.observed_instances("n1", 1)] == [("3g.40gb", 0)]
    assert [(b.profile, b.start) for b in rig.store.bound_instances("5")] == [("3g.40gb", 0)]


@pytest.mark.parametrize("case", [*sorted(OFF_TABLE), "unknown-model"])
def test_operators_see_a_gpu_of_unreadable_geometry_by_its_instances_not_as_slices(rig, case, tmp_path, capsys,
                                                                                   monkeypatch):
    """`nodes`, `status` and `top` drew a GPU whose instances this controller's table cannot place (blocked since
    5e1847c: '3g.40gb+gfx' on an H100-80GB) as if each instance of an unknown profile took 1 memory slice: the
    busy 3g.40gb+gfx@0 covered slice 0, slices 1-3 showed free ('7 free, 7 fragmented'), and the node's busy share
    was 1 slice of 16; a model the tables lack (d1464e6) counted 1 busy slice of none. Such a GPU's slices are
    now not counted (slices, busy, idle, free 0; geometry_known false), its instances are listed by name, start
    and job, never drawn on slices, and the blocked reason shown."""
    from slurm_mig.cli import main
    from slurm_mig.ops.render import Glyphs, gpu_bar, gpu_lines, mini_bar
    from slurm_mig.ops.views import load_snapshot, node_views, status_view

    if case == "unknown-model":
        gpu, bindings = NEWER, NODE_BINDINGS
    else:
        gpu, bindings = _off_table(case)
    named = sorted(((i["profile"], i["start"]) for i in gpu["instances"]), key=lambda n: n[1])
    rig.tick()
    _report(rig, gpus=(KNOWN, gpu), bindings=bindings)
    rig.tick()
    snap = load_snapshot(rig.store)
    node = node_views(snap)[0]
    view = next(g for g in node["gpus"] if g["gpu"] == 1)
    assert view["blocked"]
    assert (view["slices"], view["busy_slices"], view["idle_slices"], view["free_slices"],
            view["fragmented_slices"], view["largest_free_kind"]) == (0, 0, 0, 0, 0, None)
    assert view["geometry_known"] is False
    assert [(i["profile"], i["start"], i["size"]) for i in view["instances"]] == [(p, s, None) for p, s in named]
    assert [i["kind"] for i in view["instances"]] == [p for p, _ in named]  # by name: not a '3g' anyone can use
    assert view["layout"] == ",".join(f"{p}@{s}" for p, s in named)
    bound = {(b["profile"], b["start"]) for b in bindings["5"]}
    assert [i["job_id"] for i in view["instances"]] == ["5" if n in bound else None for n in named]
    # the node counts its readable GPU only: 8 slices, none busy
    assert (node["slices"], node["busy_slices"], node["busy_fraction"], node["uncounted_gpus"]) == (8, 0, 0.0, 1)
    status = status_view(snap, nodes=[node])
    assert (status["gpus"]["slices"], status["gpus"]["busy_slices"], status["gpus"]["uncounted"]) == (8, 0, 1)
    assert not any(r["profile"] == "3g" and r["busy"] for r in status["profiles"])

    bar = gpu_bar(view, 64, Glyphs(ascii_only=True)).plain
    assert bar.startswith("unknown model" if case == "unknown-model" else "blocked (off-table)")
    assert f"{named[0][0]}@{named[0][1]}" in bar and "job5" in bar and "." * 3 not in bar
    assert mini_bar(view, Glyphs(ascii_only=True)).plain == "???"
    line = gpu_lines([node], 120, Glyphs(ascii_only=True))[1].plain
    idle = next(n for n in named if n not in bound)
    assert f"{idle[0]}@{idle[1]} idle" in line and "job5" in line

    monkeypatch.delenv("SLURM_MIG_CONFIG", raising=False)
    capsys.readouterr()
    db = str(tmp_path / "state.db")
    assert main(["nodes", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "slices not counted" in out and "free: up to" not in out.split("GPU 1", 1)[1]
    assert "upgrade the controller" in " ".join(out.split())  # the whole blocked reason, wrapped
    assert f"{named[0][0]}@{named[0][1]}" in out
    assert main(["status", "--db", db, "--no-probe"]) == 0
    assert "8 memory slices, 0% busy" in capsys.readouterr().out
