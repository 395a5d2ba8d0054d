"""The controller's choice of instances for a starting job."""

from slurm_mig.controller.binding import NodeGpu, choose_binding
from slurm_mig.mig import Slot, get_model, parse_layout
from slurm_mig.mig.transitions import plan_transition

H100 = get_model("H100-80GB")


def L(text):
    return parse_layout(text, H100)


def test_existing_free_instance_needs_no_change():
    gpus = [NodeGpu(0, L("3g@0,3g@4"), bound={Slot(0, "3g.40gb")})]
    plan = choose_binding(gpus, "3g", 1)
    assert plan.instances == ((0, Slot(4, "3g.40gb")),)
    assert plan.targets == {}


def test_planned_instance_is_created_by_desired_layout():
    gpus = [NodeGpu(0, L("7g@0"), desired=L("3g@0,2g@4,1g@6"))]
    plan = choose_binding(gpus, "2g", 1)
    assert plan.instances == ((0, Slot(4, "2g.20gb")),)
    assert plan.targets[0] == L("3g@0,2g@4,1g@6")


def test_desired_change_blocked_by_bound_instance_falls_back_to_carving_idle_slices():
    # The desired layout would destroy the busy 4g; the 1g must come from idle slices only.
    gpus = [NodeGpu(0, L("4g@0,3g@4"), desired=L("7g@0"), bound={Slot(0, "4g.40gb")})]
    plan = choose_binding(gpus, "1g", 2)
    assert [s for _, s in plan.instances] == [Slot(4, "1g.10gb"), Slot(5, "1g.10gb")]
    target = plan.targets[0]
    assert Slot(0, "4g.40gb") in target.slots
    plan_transition(gpus[0].observed, target, {Slot(0, "4g.40gb")})  # reachable without touching the job


def test_impossible_returns_none():
    gpus = [NodeGpu(0, L("3g@0,3g@4"), bound={Slot(0, "3g.40gb"), Slot(4, "3g.40gb")})]
    assert choose_binding(gpus, "1g", 1) is None
    assert choose_binding([NodeGpu(0, L("7g@0"))], "5g", 1) is None


def test_count_spans_gpus_and_prefers_existing():
    gpus = [NodeGpu(0, L("3g@0,3g@4"), bound={Slot(0, "3g.40gb")}), NodeGpu(1, L("3g@0,3g@4"))]
    plan = choose_binding(gpus, "3g", 3)
    assert sorted(plan.instances) == [(0, Slot(4, "3g.40gb")), (1, Slot(0, "3g.40gb")), (1, Slot(4, "3g.40gb"))]
    assert plan.targets == {}


def test_reservation_honoured():
    gpus = [NodeGpu(0, L("3g@0,3g@4")), NodeGpu(1, L("3g@0,3g@4"))]
    plan = choose_binding(gpus, "3g", 1, reserved=((1, Slot(4, "3g.40gb")),))
    assert plan.instances == ((1, Slot(4, "3g.40gb")),)
