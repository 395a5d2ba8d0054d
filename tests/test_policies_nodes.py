"""Every policy places a job only on the nodes Slurm may start it on (``PendingJob.nodes``: its
partitions, --nodelist, --exclude, --constraint, reservations), reserves only there, and a job kept
off every node does not hold back the jobs that may run."""

from __future__ import annotations

import random

import pytest

from slurm_mig.mig.layout import Layout, Slot, enumerate_maximal_layouts, parse_layout
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


def _full_walk(cls):
    """``cls`` walking every GPU's group for a restricted job too, as frag-aware did before it walked only
    the job's own nodes: the reference the restricted walk must decide exactly like."""

    class FullWalk(cls):
        def _walk_groups(self, ctx, ki, key):
            got = self._group_order.get(key)
            if got is None:
                groups = ki.groups if ki.groups is not None else ki.build_groups(ctx.idx)
                groups = self._split(ctx.idx, groups)  # by the demand each GPU weighs, as the real walk does
                got = self._group_order[key] = (groups, self._order_groups(ctx.idx, key, groups))
            return got

        @staticmethod
        def _touched(ctx, key):
            return sorted(ctx.touched_with(key))

    return FullWalk


def _random_restricted_state(rng: random.Random, names: list[str], shape: list[int], now: float) -> ClusterState:
    # few layouts, so that groups of alike GPUs often hold more than group_width of a job's GPUs
    layouts = rng.sample(enumerate_maximal_layouts(H100), 3)
    gpus = []
    for n, k in zip(names, shape):
        for i in range(k):
            lay = rng.choice(layouts)
            busy = frozenset(x for x in sorted(lay.slots) if rng.random() < 0.5)
            until = tuple((x, now + rng.uniform(0, 5000)) for x in sorted(busy) if rng.random() < 0.8)
            gpus.append(GpuState(n, i, H100, lay, busy, frozenset(), until))

    def nodes():
        r = rng.random()
        if r < 0.3:
            return None
        if r < 0.4:
            return ("elsewhere",)  # a node with no GPUs: allowed on none
        k = rng.randint(1, len(names)) if r < 0.55 else rng.randint(1, 2)
        return tuple(sorted(rng.sample(names, k)))

    jobs = [PendingJob(f"j{j}", rng.choice(["1g", "2g", "3g", "4g", "7g"]), rng.choice([1, 1, 1, 2]),
                       now - 20000 * rng.random(), rng.choice([None, rng.uniform(10, 10000)]), nodes=nodes(),
                       cpus=rng.choice([None, 1, 4]), exclusive=rng.random() < 0.1)
            for j in range(rng.randint(1, 16))]
    free = tuple(sorted((n, rng.randint(0, 8)) for n in names)) if rng.random() < 0.5 else None
    return ClusterState(now, tuple(gpus), tuple(jobs), free_cpus=free)


def _whole(d: Decision):
    return d.changes, d.assignments, d.waiting, d.extra["reservations"]


@pytest.mark.parametrize("name", ["frag-aware", "rl-network"])
def test_a_restricted_job_decides_as_when_every_gpu_was_walked(name):
    """On the large-cluster path (forced with exact_limit=0), a job restricted to a few nodes walks only
    their GPUs; every placement, reservation and reason must be what the walk over every GPU gave, for a
    fresh policy and for one that decided an earlier state (then the index is updated, not rebuilt)."""
    from slurm_mig.policies.frag_aware import FragAwarePolicy

    def make(cls, seed):
        width = (1, 2, 4)[seed % 3]
        if name == "frag-aware":
            return cls(exact_limit=0, group_width=width, reserve_min_age_s=0, reservations=3)
        pick = random.Random(seed)
        return cls(exact_limit=0, group_width=width, reserve_min_age_s=0, reservations=3,
                   chooser=lambda c: pick.randrange(len(c.options)), guard_chooser=lambda row: None)

    base = FragAwarePolicy if name == "frag-aware" else RLPolicy
    ref = _full_walk(base)
    differ, walked = [], 0
    for seed in range(250):
        rng = random.Random(seed)
        names = [f"n{i:02d}" for i in range(rng.randint(3, 12))]
        shape = [rng.randint(1, 3) for _ in names]
        first = _random_restricted_state(rng, names, shape, 100.0)
        second = _random_restricted_state(rng, names, shape, 200.0)
        # half the GPUs as in the first state, so a used policy's index is updated, not rebuilt
        second = ClusterState(second.now, tuple(b if i % 2 else a for i, (a, b) in enumerate(zip(first.gpus,
                                                                                                   second.gpus))),
                              second.pending, second.free_cpus)
        used, used_ref = make(base, seed), make(ref, seed)
        a1, r1 = used.decide(first), used_ref.decide(first)
        a2, r2 = used.decide(second), used_ref.decide(second)
        fresh, fresh_ref = make(base, seed).decide(second), make(ref, seed).decide(second)
        same = _whole(a1) == _whole(r1) and _whole(a2) == _whole(r2) and _whole(fresh) == _whole(fresh_ref)
        if name == "frag-aware":  # a used policy decides as a fresh one (the rl chooser here has a memory)
            same = same and _whole(a2) == _whole(fresh)
        if not same:
            differ.append(seed)
        walked += any(isinstance(k, tuple) and v is not False for k, v in used._group_order.items())
    assert differ == []
    assert walked > 50  # the restricted walk was taken, not only the full one


@pytest.mark.parametrize("name", ["frag-aware", "rl-network"])
def test_a_restricted_job_on_a_large_cluster_looks_only_at_its_own_nodes(name, monkeypatch):
    """On the large-cluster path the walk went through the groups of every GPU and turned away those of
    other nodes one at a time: on 8,000 GPUs a job allowed on 10 nodes cost more than one free to go
    anywhere. Now it asks only about GPUs of its nodes (40 idle nodes here, the job on the last 2)."""
    from slurm_mig.policies._core import Ctx
    from slurm_mig.policies.frag_aware import FragAwarePolicy

    names = [f"n{i:02d}" for i in range(40)]
    mine = ("n38", "n39")
    jobs = [PendingJob(str(i), kind, 1, float(i), 600.0, nodes=mine)
            for i, kind in enumerate(["1g", "2g", "1g", "3g", "1g", "1g"])]
    state = _state({n: "" for n in names}, jobs, gpus_per_node=2)
    asked = []
    allows = Ctx.allows

    def spy(self, gidx):
        asked.append(self.idx.gpus[gidx].node)
        return allows(self, gidx)

    monkeypatch.setattr(Ctx, "allows", spy)
    pol = FragAwarePolicy(exact_limit=0) if name == "frag-aware" else \
        RLPolicy(chooser=lambda c: 0, exact_limit=0, guard_chooser=lambda row: None)
    d = pol.decide(state)
    check_decision(state, d)
    assert len(d.assignments) == len(jobs) and {a.node for a in d.assignments} <= set(mine)
    assert asked and set(asked) <= set(mine)
