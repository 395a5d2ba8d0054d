"""Every policy places a job only on the nodes Slurm may start it on (``PendingJob.nodes``: its
partitions, --nodelist, --exclude, --constraint, reservations), reserves only there, and a job kept
off every node does not hold back the jobs that may run."""

from __future__ import annotations

import random

import pytest

from slurm_mig.mig.layout import Layout, Slot, parse_layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.policies import get_policy
from slurm_mig.policies.base import (
    Assignment, ClusterState, Decision, DecisionError, GpuState, PendingJob, check_decision,
)
from slurm_mig.policies.rl import RLPolicy
from slurm_mig.sim.engine import ClusterSpec, SimConfig, simulate
from slurm_mig.sim.workloads import poisson_workload

H100 = get_model("H100-80GB")
POLICIES = ["first-fit", "greedy", "static", "frag-aware", "rl"]


def _policy(name: str):
    if name == "rl-network":  # the candidate scorer's path, with random picks
        rng = random.Random(0)
        return RLPolicy(chooser=lambda c: rng.randrange(len(c.options)))
    return get_policy(name)


def _state(layouts: dict[str, str], pending: list[PendingJob], busy: dict[str, str] | None = None,
           gpus_per_node: int = 1, now: float = 1000.0) -> ClusterState:
    gpus = []
    for node, text in layouts.items():
        for i in range(gpus_per_node):
            layout = parse_layout(text, H100) if text else Layout.empty(H100)
            b = frozenset(parse_layout((busy or {}).get(node, ""), H100).slots) if (busy or {}).get(node) else \
                frozenset()
            gpus.append(GpuState(node, i, H100, layout, busy=b,
                                 busy_until=tuple((s, now + 3600.0) for s in sorted(b))))
    return ClusterState(now=now, gpus=tuple(gpus), pending=tuple(pending))


@pytest.mark.parametrize("name", POLICIES + ["rl-network"])
def test_a_job_goes_only_where_slurm_may_start_it(name):
    jobs = [PendingJob("1", "2g", 1, 0.0, 600.0, nodes=("n3",)),
            PendingJob("2", "1g", 1, 1.0, 600.0, nodes=("n2", "n3")),
            PendingJob("3", "3g", 1, 2.0, 600.0)]
    state = _state({"n1": "", "n2": "", "n3": ""}, jobs)
    d = _policy(name).decide(state)
    check_decision(state, d)
    where = {a.job_id: a.node for a in d.assignments}
    assert where["1"] == "n3"
    assert where["2"] in ("n2", "n3")
    assert "3" in where


@pytest.mark.parametrize("name", POLICIES)
def test_a_job_kept_off_every_node_with_room_waits_and_says_why(name):
    # n1 and n2 are empty; the job may run on n3 only, whose GPU is busy with a 7g job.
    jobs = [PendingJob("1", "2g", 1, 0.0, 600.0, nodes=("n3",)),
            PendingJob("2", "2g", 1, 1.0, 600.0)]
    state = _state({"n1": "", "n2": "", "n3": "7g@0"}, jobs, busy={"n3": "7g@0"})
    d = _policy(name).decide(state)
    check_decision(state, d)
    assert [a.job_id for a in d.assignments] == ["2"]  # the same size, unrestricted: placed
    assert d.assignments[0].node in ("n1", "n2")
    why = dict(d.waiting)["1"]
    assert "1 node(s) Slurm may start it on" in why or "reserv" in why, why


@pytest.mark.parametrize("name", ["first-fit", "frag-aware", "rl"])
def test_a_job_allowed_on_no_gpu_node_says_so(name):
    state = _state({"n1": "", "n2": ""}, [PendingJob("1", "1g", 1, 0.0, 600.0, nodes=())])
    d = _policy(name).decide(state)
    assert not d.assignments and "Slurm may start it on none of the GPU nodes" in dict(d.waiting)["1"]


@pytest.mark.parametrize("name", ["frag-aware", "rl"])  # first-fit does not reserve
def test_the_reservation_of_a_blocked_job_is_on_its_nodes(name):
    # Every GPU busy; the head job may run on n2 only, where the jobs end last: it is reserved there.
    state = ClusterState(now=0.0, gpus=tuple(
        GpuState(n, 0, H100, parse_layout("7g@0", H100), busy=frozenset({Slot(0, "7g.80gb")}),
                 busy_until=((Slot(0, "7g.80gb"), end),))
        for n, end in (("n1", 100.0), ("n2", 900.0), ("n3", 200.0))), pending=(
        PendingJob("1", "7g", 1, 0.0, 600.0, nodes=("n2",)),))
    d = _policy(name).decide(state)
    assert not d.assignments
    (job, t, gpus), = d.extra["reservations"]
    assert (job, gpus) == ("1", ["n2/0"]) and t == 900.0


@pytest.mark.parametrize("name", ["first-fit", "frag-aware", "rl"])
def test_several_instances_on_an_allowed_node(name):
    jobs = [PendingJob("1", "3g", 4, 0.0, 600.0, nodes=("n2",))]
    state = _state({"n1": "", "n2": ""}, jobs, gpus_per_node=2)
    d = _policy(name).decide(state)
    check_decision(state, d)
    assert [(a.job_id, a.node, len(a.instances)) for a in d.assignments] == [("1", "n2", 4)]


def test_check_decision_refuses_a_node_slurm_will_not_start_the_job_on():
    job = PendingJob("1", "7g", 1, 0.0, 600.0, nodes=("n2",))
    state = _state({"n1": "7g@0", "n2": "7g@0"}, [job])
    bad = Decision((), (Assignment("1", "n1", ((0, Slot(0, "7g.80gb")),), "test"),), (), "t", "1")
    with pytest.raises(DecisionError, match="where Slurm will not start it"):
        check_decision(state, bad)


def test_unrestricted_jobs_decide_as_before():
    """nodes=None everywhere is the simulator's case: naming every node must not change a decision."""
    w = poisson_workload(150, gpus=8, load=0.95, seed=3, multi_gpu_share=0.1)
    spec = ClusterSpec(2, 4)
    for name in ("first-fit", "frag-aware"):
        a = simulate(w, get_policy(name), spec)

        class AllNodes(type(get_policy(name))):
            def decide(self, state):
                every = tuple(sorted({g.node for g in state.gpus}))
                return super().decide(ClusterState(state.now, state.gpus, tuple(
                    PendingJob(j.job_id, j.profile, j.count, j.submit_time, j.time_limit_s, nodes=every)
                    for j in state.pending)))

        b = simulate(w, AllNodes(), spec, SimConfig(check=True))
        assert [(x.job.job_id, x.start) for x in a.jobs] == [(x.job.job_id, x.start) for x in b.jobs]
