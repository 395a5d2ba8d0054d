"""Every policy counts the CPUs it promises within one decision (``PendingJob.cpus`` against
``ClusterState.free_cpus``): a job whose CPUs no longer fit beside the jobs placed before it on a node is
not placed there, as Slurm would not start it there; without the counts nothing changes."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mig.mig.layout import Layout, Slot, parse_layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.policies import get_policy
from slurm_mig.policies.base import (
    Assignment, ClusterState, Decision, DecisionError, GpuState, PendingJob, check_decision,
)
from slurm_mig.policies.rl import RLPolicy

from tests.test_policies_dispatch import states

H100 = get_model("H100-80GB")
POLICIES = ["first-fit", "greedy", "static", "frag-aware", "rl"]
CARVING = ["first-fit", "greedy", "frag-aware", "rl"]  # static holds one 1g per GPU


def _policy(name: str):
    if name == "rl-network":  # the candidate scorer's path, with random picks
        rng = random.Random(0)
        return RLPolicy(chooser=lambda c: rng.randrange(len(c.options)))
    return get_policy(name)


def _state(jobs, free, layouts=None, gpus_per_node=1) -> ClusterState:
    layouts = layouts or {}
    gpus = tuple(GpuState(n, i, H100, parse_layout(layouts[n], H100) if layouts.get(n) else Layout.empty(H100))
                 for n in sorted(free) for i in range(gpus_per_node))
    return ClusterState(1000.0, gpus, tuple(jobs), free_cpus=tuple(sorted(free.items())))


def _cpus_by_node(state: ClusterState, d: Decision) -> dict[str, int]:
    asked = {j.job_id: j.cpus or 0 for j in state.pending}
    out: dict[str, int] = {}
    for a in d.assignments:
        out[a.node] = out.get(a.node, 0) + asked[a.job_id]
    return out


@pytest.mark.parametrize("name", POLICIES + ["rl-network"])
def test_jobs_whose_cpus_a_node_cannot_hold_together_go_to_other_nodes(name):
    # Each node has room for one -c 3 job: the third waits, and says for what.
    jobs = [PendingJob(str(i), "1g", 1, float(i), 600.0, cpus=3) for i in range(3)]
    state = _state(jobs, {"n1": 4, "n2": 4})
    d = _policy(name).decide(state)
    check_decision(state, d)
    assert sorted(a.node for a in d.assignments) == ["n1", "n2"]
    assert [a.job_id for a in d.assignments] == ["0", "1"]
    why = dict(d.waiting)["2"]
    assert "with 3 CPU(s) free" in why and "the free CPUs of n1, n2 are promised to jobs placed this tick" in why, why


@pytest.mark.parametrize("name", CARVING)
def test_without_cpu_counts_the_same_jobs_share_a_node(name):
    """The simulator's case (and a site that oversubscribes CPUs): nothing is counted."""
    jobs = [PendingJob(str(i), "1g", 1, float(i), 600.0, cpus=3) for i in range(3)]
    counted = _state(jobs, {"n1": 4})
    d = _policy(name).decide(replace(counted, free_cpus=None))
    assert len(d.assignments) == 3
    plain = replace(counted, pending=tuple(replace(j, cpus=None) for j in jobs))
    assert len(_policy(name).decide(plain).assignments) == 3  # counts given, but no job asks


@pytest.mark.parametrize("name", ["first-fit", "frag-aware", "rl"])
def test_a_job_of_several_instances_goes_where_its_cpus_fit(name):
    # n1 holds two idle 3g instances: the first job takes one, the 2 x 3g job no longer fits n1's CPUs.
    jobs = [PendingJob("1", "3g", 1, 0.0, 600.0, cpus=2), PendingJob("2", "3g", 2, 1.0, 600.0, cpus=4)]
    state = _state(jobs, {"n1": 5, "n2": 8}, layouts={"n1": "3g@0,3g@4"}, gpus_per_node=2)
    d = _policy(name).decide(state)
    check_decision(state, d)
    assert {a.job_id: a.node for a in d.assignments} == {"1": "n1", "2": "n2"}


@pytest.mark.parametrize("name", ["first-fit", "frag-aware", "rl"])
def test_an_exclusive_job_shares_its_node_with_no_job_placed_this_tick(name):
    jobs = [PendingJob("1", "1g", 1, 0.0, 600.0, cpus=1),
            PendingJob("2", "1g", 1, 1.0, 600.0, cpus=1, exclusive=True),
            PendingJob("3", "1g", 1, 2.0, 600.0, cpus=1)]
    state = _state(jobs, {"n1": 8, "n2": 8}, layouts={"n1": "1g@0,1g@1"})
    d = _policy(name).decide(state)
    check_decision(state, d)
    # job 1 takes a free instance on n1; the exclusive job cannot join it there, and nothing joins it on n2
    assert {a.job_id: a.node for a in d.assignments} == {"1": "n1", "2": "n2", "3": "n1"}


@pytest.mark.parametrize("name", ["first-fit", "frag-aware"])
def test_an_exclusive_job_behind_a_placed_one_waits_and_says_why(name):
    jobs = [PendingJob("1", "1g", 1, 0.0, 600.0, cpus=1),
            PendingJob("2", "1g", 1, 1.0, 600.0, cpus=1, exclusive=True, nodes=("n1",))]
    state = _state(jobs, {"n1": 8, "n2": 8}, layouts={"n1": "1g@0,1g@1"})
    d = _policy(name).decide(state)
    assert [a.node for a in d.assignments] == ["n1"]
    why = dict(d.waiting)["2"]
    assert why.startswith("none of the 1 node(s) Slurm may start it on") and "--exclusive" in why, why
    assert "n1 has CPUs promised to jobs placed this tick" in why, why


def test_a_node_with_too_few_free_cpus_for_the_job_is_not_its():
    # Not promised to anyone: it never had the CPUs (the controller's eligibility keeps such a node out too).
    state = _state([PendingJob("1", "1g", 1, 0.0, 600.0, cpus=6, nodes=("n1",))], {"n1": 4, "n2": 8})
    d = get_policy("frag-aware").decide(state)
    assert not d.assignments
    assert "n1 has fewer free CPUs than it asks for (6)" in dict(d.waiting)["1"]


def test_a_node_without_cpu_counts_is_not_counted():
    jobs = [PendingJob(str(i), "1g", 1, float(i), 600.0, cpus=3) for i in range(2)]
    state = ClusterState(1000.0, (GpuState("n1", 0, H100, Layout.empty(H100)),), tuple(jobs), free_cpus=())
    d = get_policy("first-fit").decide(state)
    check_decision(state, d)
    assert [a.node for a in d.assignments] == ["n1", "n1"]


def test_the_head_job_kept_off_a_node_for_cpus_reserves_elsewhere():
    # n1 is free now but its CPUs are promised to job 1; n2's 7g runs until t=1900: job 2 reserves n2.
    busy = frozenset({Slot(0, "7g.80gb")})
    state = ClusterState(1000.0, (
        GpuState("n1", 0, H100, Layout.empty(H100)),
        GpuState("n2", 0, H100, parse_layout("7g@0", H100), busy=busy, busy_until=((Slot(0, "7g.80gb"), 1900.0),)),
    ), (PendingJob("1", "1g", 1, 0.0, 600.0, cpus=4), PendingJob("2", "3g", 1, 1.0, 600.0, cpus=4)),
        free_cpus=(("n1", 4), ("n2", 8)))
    d = get_policy("frag-aware").decide(state)
    assert [(a.job_id, a.node) for a in d.assignments] == [("1", "n1")]
    assert [(j, gpus) for j, _t, gpus in d.extra["reservations"]] == [("2", ["n2/0"])]


def test_check_decision_refuses_a_node_promised_more_cpus_than_it_has_free():
    jobs = [PendingJob("1", "1g", 1, 0.0, 600.0, cpus=3), PendingJob("2", "1g", 1, 1.0, 600.0, cpus=3)]
    state = _state(jobs, {"n1": 4, "n2": 8}, layouts={"n1": "1g@0,1g@1"})
    both = Decision((), (Assignment("1", "n1", ((0, Slot(0, "1g.10gb")),), "t"),
                         Assignment("2", "n1", ((0, Slot(1, "1g.10gb")),), "t")), (), "t", "1")
    with pytest.raises(DecisionError, match=r"jobs 1, 2 placed on n1 ask for 6 CPU\(s\), more than its 4 free"):
        check_decision(state, both)
    check_decision(replace(state, free_cpus=None), both)  # not counted: as before
    check_decision(replace(state, free_cpus=(("n1", 6),)), both)
    whole = replace(state, pending=(jobs[0], replace(jobs[1], cpus=1, exclusive=True)))
    with pytest.raises(DecisionError, match=r"job 2 asks for all of n1 \(--exclusive\), where job\(s\) 1"):
        check_decision(whole, both)


@pytest.mark.parametrize("name", ["first-fit", "greedy", "static", "frag-aware"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=states(), data=st.data())
def test_every_decision_keeps_within_the_free_cpus(name, state, data):
    """Random CPUs asked and free: check_decision (which counts them) passes, every job is assigned or
    told why, and with CPUs to spare the decision is the one made without counting."""
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    nodes = sorted({g.node for g in state.gpus})
    jobs = tuple(replace(j, cpus=rng.choice([None, 1, 2, 4, 8]), exclusive=rng.random() < 0.1)
                 for j in state.pending)
    tight = replace(state, pending=jobs, free_cpus=tuple((n, rng.choice([0, 2, 4, 8, 16])) for n in nodes))
    d = get_policy(name).decide(tight)
    check_decision(tight, d)
    assert {a.job_id for a in d.assignments} | {j for j, _ in d.waiting} == {j.job_id for j in jobs}
    for node, used in _cpus_by_node(tight, d).items():
        assert used <= dict(tight.free_cpus)[node]
    roomy = replace(tight, pending=tuple(replace(j, exclusive=False) for j in jobs),
                    free_cpus=tuple((n, 10_000) for n in nodes))
    plain = replace(roomy, free_cpus=None)
    a, b = get_policy(name).decide(roomy), get_policy(name).decide(plain)
    assert (a.changes, a.assignments, a.waiting) == (b.changes, b.assignments, b.waiting)


def _gpu(node: str, index: int, model, layout: str, busy: dict[str, float | None], reconf: tuple[str, ...] = ()):
    """A GPU of ``layout`` ("1g@0,3g@4"); ``busy`` maps its busy slots ("1g@0") to their end (None: no limit)."""
    lay = parse_layout(layout, model)
    slot = {f"{model.profile(s.profile).kind}@{s.start}": s for s in lay.slots}
    return GpuState(node, index, model, lay, busy=frozenset(slot[s] for s in busy),
                    reconfiguring=frozenset(slot[s] for s in reconf),
                    busy_until=tuple(sorted((slot[s], t) for s, t in busy.items() if t is not None)))


def test_a_job_its_cpus_keep_off_no_node_shares_the_verdict_of_its_request():
    """The falsifying example of test_every_decision_keeps_within_the_free_cpus[frag-aware] (hypothesis,
    rng seed 0), CPUs to spare. j2 and j6 ask for the same 2 x 3g; j2 conflicts with j0's reservation.
    Without CPU counts j6 shares j2's verdict ("would delay job j0"); with them, j6 was keyed apart by its
    CPUs (2, j2's 8), judged again after j3 and j4 were placed, and said "no node can hold 2 x 3g"."""
    a30, h100 = get_model("A30-24GB"), H100
    gpus = (
        _gpu("n0", 0, a30, "4g@0", {}),
        _gpu("n0", 1, a30, "1g@0,1g@1,1g@2,1g@3", {"1g@0": 1756.1454504561473, "1g@3": 2952.2399492480695},
             reconf=("1g@1",)),
        _gpu("n1", 0, h100, "2g@0,1g@2,1g@3,1g@4,1g@5,1g@6", {"2g@0": 2493.7168882015003}, reconf=("1g@3",)),
        _gpu("n1", 1, h100, "2g@0,2g@2,1g@4,1g@5,1g@6", {"2g@2": None, "1g@4": 4770.330267589014},
             reconf=("1g@6",)),
        _gpu("n1", 2, h100, "1g@0,1g@1,1g@2,1g@3,2g@4,1g@6", {"1g@2": 4400.117535241547}),
    )
    asks = [("7g", 2, None, 4), ("1g", 1, None, 4), ("3g", 2, None, 8), ("1g.dm", 3, 3848.8718037606523, 2),
            ("3g", 1, 1980.149257569961, 2), ("1g", 1, None, 1), ("3g", 2, None, 2)]
    jobs = tuple(PendingJob(f"j{i}", p, n, float(i), tl, cpus=c) for i, (p, n, tl, c) in enumerate(asks))
    roomy = ClusterState(100.0, gpus, jobs, free_cpus=(("n0", 10_000), ("n1", 10_000)))
    a = get_policy("frag-aware").decide(roomy)
    b = get_policy("frag-aware").decide(replace(roomy, free_cpus=None))
    assert [x.job_id for x in a.assignments] == ["j1", "j3", "j4", "j5"]
    assert dict(a.waiting)["j6"] == "would delay job j0, which holds a reservation (backfill)"
    assert (a.changes, a.assignments, a.waiting, a.extra) == (b.changes, b.assignments, b.waiting, b.extra)


def test_cpus_to_spare_give_no_job_a_reservation_its_request_would_not_get():
    """The decision itself differed, not only its words: with CPU counts, b (the same 7g as a, which
    reserved n1) was judged on its own for its CPUs and, having waited over reserve_min_age_s, took the
    second reservation, n2 from t=103000 s; c, which ends after that, could then not start on n2's idle
    slices now, as it does without counts (and with them, now)."""
    now = 100_000.0
    gpus = (_gpu("n1", 0, H100, "7g@0", {"7g@0": now + 1000}),
            _gpu("n2", 0, H100, "3g@0", {"3g@0": now + 3000}),
            _gpu("n3", 0, H100, "7g@0", {"7g@0": None}),
            _gpu("n3", 1, H100, "7g@0", {"7g@0": None}))
    jobs = (PendingJob("a", "7g", 1, now - 100, None),
            PendingJob("b", "7g", 1, now - 5 * 3600, None, cpus=4),
            PendingJob("c", "3g", 1, now - 50, 5000.0, cpus=2))
    roomy = ClusterState(now, gpus, jobs, free_cpus=(("n1", 10_000), ("n2", 10_000), ("n3", 10_000)))
    for name in ("frag-aware", "rl"):
        a = _policy(name).decide(roomy)
        b = _policy(name).decide(replace(roomy, free_cpus=None))
        check_decision(roomy, a)
        assert [(x.job_id, x.node) for x in a.assignments] == [("c", "n2")], name
        assert [r[0] for r in a.extra["reservations"]] == ["a"], name
        assert (a.changes, a.assignments, a.waiting) == (b.changes, b.assignments, b.waiting), name


def test_a_reservations_start_on_the_controllers_clock_reads_as_a_date_and_time(monkeypatch):
    """On the controller's clock (epoch seconds) a reservation's reason read "reserved n1/0 from t=1827299963s";
    it now names the local date and time. The simulator's clock, counting from 0, keeps t=<seconds>s."""
    import time

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        for now, want in ((1_827_290_000.0, "from 2027-11-27 07:13:20"), (100_000.0, "from t=109600s")):
            gpus = (_gpu("n1", 0, H100, "7g@0", {"7g@0": now + 9600}),
                    _gpu("n2", 0, H100, "7g@0", {"7g@0": now + 20000}))
            jobs = (PendingJob("a", "7g", 1, now - 100, None), PendingJob("b", "1g", 1, now - 50, None))
            decision = get_policy("frag-aware").decide(ClusterState(now, gpus, jobs))
            assert dict(decision.waiting)["a"].endswith(f"reserved n1/0 {want}"), decision.waiting
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
