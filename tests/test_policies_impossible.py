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


@pytest.mark.parametrize("name", POLICIES + ["no-mig"])
def test_jobs_that_can_never_run_use_none_of_the_backfill_depth(name):
    """The walk of the queue stops 500 jobs (backfill_depth) after the first one that cannot start; a job no
    node could ever hold counted as one of them, so 500 of those at the head of the queue, or behind a job that
    waits for running ones to end, left a job that could start at once 'not considered: beyond the backfill
    depth' on an idle GPU, tick after tick, for as long as they stayed queued. They use none of the depth now,
    and still get their reason; the real jobs behind them are considered as if they were not there."""
    full = parse_layout("4g@0", A30)
    gpus = (GpuState("a1", 0, A30, full, busy=frozenset(full.slots)), GpuState("a1", 1, A30, Layout.empty(A30)))
    never = [PendingJob(f"n{i}", "3g", 1, 1.0 + i) if i % 2 else PendingJob(f"n{i}", "4g", 3, 1.0 + i)
             for i in range(501)]
    start = PendingJob("s", "1g", 1, 1000.0, time_limit_s=60.0)
    for head in ([], [PendingJob("b", "4g", 2, 0.0, time_limit_s=60.0)]):  # b waits for the busy 4g to end
        pending = head + never + [start]
        d = get_policy(name).decide(ClusterState(0.0, gpus, tuple(pending)))
        why = dict(d.waiting)
        assert not why.get("s", "").startswith("not considered"), (head, why["s"])
        # (static and no-mig carve nothing: the empty GPU holds no 1g for them)
        assert name in ("static", "no-mig") or [a.job_id for a in d.assignments] == ["s"], (head, why.get("s"))
        assert why["n0"] == "no node can ever hold 3 x 4g: at most 2 on one node", why["n0"]
        assert why["n500"] == "no node can ever hold 3 x 4g: at most 2 on one node", why["n500"]
        assert why["n499"] == "no node can ever hold 1 x 3g: their GPUs (A30-24GB) have no 3g", why["n499"]
        # Without them, the same decision.
        alone = get_policy(name).decide(ClusterState(0.0, gpus, tuple(head + [start])))
        assert d.assignments == alone.assignments and d.changes == alone.changes
        assert d.extra["reservations"] == alone.extra["reservations"]
        assert [w for w in d.waiting if not w[0].startswith("n")] == list(alone.waiting)


def test_strict_priority_order_is_not_held_up_by_a_job_that_can_never_run():
    """With backfill off (strict priority order) everyone behind the first job that cannot start waits; a job no
    node could ever hold was that job, so the whole queue waited for ever behind it. It holds up no one now."""
    from slurm_mig.policies.first_fit import FirstFitPolicy

    d = FirstFitPolicy(backfill=False).decide(_state([PendingJob("1", "3g", 1, 0.0), PendingJob("2", "1g", 1, 1.0),
                                                      PendingJob("3", "4g", 2, 2.0), PendingJob("4", "1g", 1, 3.0)]))
    assert [a.job_id for a in d.assignments] == ["2"], d.waiting
    assert dict(d.waiting)["4"] == "not considered: behind a higher-priority job that cannot start yet", d.waiting


def _skewed_state(pending):
    """h1/1 runs a 1g for a day, h1/0, h2/0 are empty, h2/1 runs a 4g for a day; two idle A30s on a1."""
    one = parse_layout("1g@6", H100)
    four = parse_layout("4g@0", H100)
    gpus = (GpuState("h1", 0, H100, Layout.empty(H100)),
            GpuState("h1", 1, H100, one, busy=frozenset(one.slots), busy_until=((next(iter(one.slots)), 86400.0),)),
            GpuState("h2", 0, H100, Layout.empty(H100)),
            GpuState("h2", 1, H100, four, busy=frozenset(four.slots), busy_until=((next(iter(four.slots)), 86400.0),)),
            GpuState("a1", 0, A30, Layout.empty(A30)), GpuState("a1", 1, A30, Layout.empty(A30)))
    return ClusterState(0.0, gpus, tuple(pending))


@pytest.mark.parametrize("name", ["frag-aware", "rl"])
def test_jobs_that_can_never_run_are_no_demand_to_carve_for(name):
    """100 jobs of 7g that may run only on the A30 node (an A30 has no 7g) get their 'can ever hold' reason,
    but frag-aware's carving weights (the demand of the next 64 jobs) counted them: 7g demand kept h1/0 whole,
    and a day-long 2g went beside h1/1's 1g instead of where it goes without them (h1/0, its end aligned with
    nothing running there). The rl policy read the same weights, and the queue's length, as features. Jobs no node
    they may run on could ever hold are left out of both now: the same decision, and for rl the same features,
    as without them."""
    from slurm_mig.policies.rl import RLPolicy, frag_aware_chooser

    never = [PendingJob(f"n{i}", "7g", 1, float(i), nodes=("a1",)) for i in range(100)]
    job = PendingJob("s", "2g", 1, 1000.0, time_limit_s=86400.0, nodes=("h1", "h2"))

    def decide(pending):
        seen = []
        if name == "rl":
            def chooser(choice):
                seen.append(choice.features)
                return frag_aware_chooser(choice)
            policy = RLPolicy(chooser=chooser)
        else:
            policy = get_policy(name)
        d = policy.decide(_skewed_state(pending))
        return d, seen

    with_never, seen_with = decide(never + [job])
    alone, seen_alone = decide([job])
    assert dict(with_never.waiting)["n0"].startswith("none of the 1 node(s) Slurm may start it on can ever hold 1 x 7g")
    assert [(a.job_id, a.node, a.instances) for a in with_never.assignments] == \
        [(a.job_id, a.node, a.instances) for a in alone.assignments], (with_never.assignments, alone.assignments)
    assert [(c.node, c.gpu, str(c.target)) for c in with_never.changes] == \
        [(c.node, c.gpu, str(c.target)) for c in alone.changes]
    assert seen_with == seen_alone  # rl: the network's inputs too (queue length, demand)
    if name == "frag-aware":
        assert alone.assignments[0].instances[0][0] == 0 and alone.assignments[0].node == "h1", alone.assignments
