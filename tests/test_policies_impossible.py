"""A job no node it may run on could ever hold (its size missing from every GPU model there, or more instances
than one of those nodes has room for at all) is told so, not that it waits for idle slices: it would wait
forever, while its reason read as if the next job to end could start it."""

from __future__ import annotations

import pytest

from slurm_mig.mig.layout import Layout, parse_layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.policies import get_policy
from slurm_mig.policies.base import ClusterState, GpuState, PendingJob

A30 = get_model("A30-24GB")
H100 = get_model("H100-80GB")
POLICIES = ["first-fit", "greedy", "frag-aware", "static"]


def _state(pending, *, h100_node=False):
    gpus = [GpuState("a1", i, A30, Layout.empty(A30)) for i in range(2)]
    if h100_node:
        gpus += [GpuState("h1", i, H100, Layout.empty(H100)) for i in range(2)]
    return ClusterState(0.0, tuple(gpus), tuple(pending))


@pytest.mark.parametrize("name", POLICIES)
def test_a_size_no_gpu_model_has_is_said_never_to_fit(name):
    d = get_policy(name).decide(_state([PendingJob("1", "3g", 1, 0.0), PendingJob("2", "1g", 1, 1.0)]))
    why = dict(d.waiting)["1"]
    assert "can ever hold 1 x 3g" in why and "A30-24GB" in why and "idle slices now" not in why, why
    # it holds up nobody: the 1g behind it is placed (or, static, waits for its own reasons)
    assert name == "static" or [a.job_id for a in d.assignments] == ["2"]


@pytest.mark.parametrize("name", POLICIES)
def test_more_instances_than_a_node_has_room_for_is_said_never_to_fit(name):
    d = get_policy(name).decide(_state([PendingJob("1", "4g", 3, 0.0)]))
    why = dict(d.waiting)["1"]
    assert "can ever hold 3 x 4g" in why and "at most 2" in why, why


@pytest.mark.parametrize("name", POLICIES)
def test_only_the_nodes_it_may_run_on_count(name):
    # an H100 node exists, but the job may run only on the A30 node
    d = get_policy(name).decide(_state([PendingJob("1", "3g", 1, 0.0, nodes=("a1",))], h100_node=True))
    why = dict(d.waiting)["1"]
    assert "none of the 1 node(s) Slurm may start it on can ever hold 1 x 3g" in why, why


def test_a_job_that_fits_somewhere_busy_still_waits_for_idle_slices():
    full = parse_layout("7g@0", H100)
    gpus = (GpuState("h1", 0, H100, full, busy=frozenset(full.slots)),)
    d = get_policy("greedy").decide(ClusterState(0.0, gpus, (PendingJob("1", "3g", 1, 0.0),)))
    assert dict(d.waiting)["1"].startswith("no node can hold 1 x 3g on idle slices now"), d.waiting
