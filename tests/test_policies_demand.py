"""frag-aware's carving weights (the demand of the next 64 pending jobs) are per GPU: each GPU weighs only the
jobs that could be placed on it -- its model has their size, its node is one they may start on (partition,
--nodelist, --exclude, features: PendingJob.nodes) and has room for all their instances. Counted on every GPU,
the demand of jobs that can never use a GPU changed how that GPU was carved, against the jobs that can."""

from __future__ import annotations

import random

import pytest

from slurm_mig.mig.layout import Layout, parse_layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.policies import get_policy
from slurm_mig.policies.base import ClusterState, GpuState, PendingJob, check_decision

A30 = get_model("A30-24GB")
H100 = get_model("H100-80GB")


def _policy(name, **kw):
    if name == "rl":
        from slurm_mig.policies.rl import RLPolicy, frag_aware_chooser

        # frag-aware's pick among rl's candidates: the candidates' order and score features follow its weights
        return RLPolicy(chooser=frag_aware_chooser, guard_chooser=lambda row: None, **kw)
    from slurm_mig.policies.frag_aware import FragAwarePolicy

    return FragAwarePolicy(**kw)


def _placed(d):
    return [(a.job_id, a.node, a.instances) for a in d.assignments]


@pytest.mark.parametrize("exact_limit", [256, 0])  # 0: the large-cluster walk over groups of alike GPUs
@pytest.mark.parametrize("name", ["frag-aware", "rl"])
def test_a_partitions_demand_does_not_weigh_on_the_gpus_of_other_nodes(name, exact_limit):
    """Two idle H100s; a 1g that may go anywhere, then 7g jobs that may start only on h1 (their partition).
    The 7g demand weighed on h2 as on h1, so both scored alike and the 1g took h1/0 (first in order): the 7g
    waited an hour for it with h2 idle. h2 weighs only the 1g now: the 1g goes there and a 7g starts on h1."""
    gpus = (GpuState("h1", 0, H100, Layout.empty(H100)), GpuState("h2", 0, H100, Layout.empty(H100)))
    pending = [PendingJob("s", "1g", 1, 0.0, time_limit_s=3600.0)] + [
        PendingJob(f"b{i}", "7g", 1, 1.0 + i, time_limit_s=3600.0, nodes=("h1",)) for i in range(3)]
    state = ClusterState(0.0, gpus, tuple(pending))
    d = _policy(name, exact_limit=exact_limit).decide(state)
    check_decision(state, d)
    assert [(j, n) for j, n, _ in _placed(d)] == [("s", "h2"), ("b0", "h1")], (_placed(d), d.waiting)


@pytest.mark.parametrize("name", ["frag-aware", "rl"])
def test_sizes_a_gpu_model_lacks_do_not_shrink_its_weights(name):
    """An A30 (1g/2g/4g) with a free 1g instance at slice 0 and a 1g running at 3; a 1g and then a 2g that may
    start only there; 62 7g jobs wait for the busy H100. The 7g demand, which no A30 can hold, made the A30's
    1g and 2g weights so small that the 1g took the free instance at 0 (no carve to pay for) and left no room
    for the 2g, which waited an hour; without the 7g jobs the 1g was carved at 2 and both started. The A30
    weighs only the 1g and 2g now: the same decision as without the 7g jobs."""
    lay = parse_layout("1g@0,1g@3", A30)
    run = next(s for s in lay.slots if s.start == 3)
    h = parse_layout("7g@0", H100)
    gpus = (GpuState("a1", 0, A30, lay, busy=frozenset({run}), busy_until=((run, 7200.0),)),
            GpuState("h1", 0, H100, h, busy=frozenset(h.slots)))
    mine = [PendingJob("s", "1g", 1, 0.0, time_limit_s=3600.0, nodes=("a1",)),
            PendingJob("t", "2g", 1, 1.0, time_limit_s=3600.0, nodes=("a1",))]
    big = [PendingJob(f"b{i}", "7g", 1, 2.0 + i, time_limit_s=3600.0) for i in range(62)]
    state = ClusterState(0.0, gpus, tuple(mine + big))
    d = _policy(name).decide(state)
    check_decision(state, d)
    alone = _policy(name).decide(ClusterState(0.0, gpus, tuple(mine)))
    assert _placed(d) == _placed(alone), (_placed(d), _placed(alone))
    assert [j for j, _, _ in _placed(d)] == ["s", "t"], d.waiting


def test_where_every_job_could_go_anywhere_every_gpu_weighs_the_whole_look_ahead():
    """One model, nodes alike, no job restricted (the simulator's clusters, those the rl models are trained
    in): every GPU's weights are the whole look-ahead's, the very floats (the rl policy's demand features), so
    every score and every rl input is what it was before the weights became per GPU."""
    from slurm_mig.policies._core import Ctx
    from slurm_mig.policies.frag_aware import FragAwarePolicy

    rng = random.Random(5)
    for _ in range(20):
        gpus = tuple(GpuState(f"n{n}", i, H100, Layout.empty(H100)) for n in range(3) for i in range(2))
        pending = tuple(PendingJob(str(j), rng.choice(["1g", "2g", "3g", "4g", "7g"]), rng.choice([1, 1, 2]),
                                   float(j)) for j in range(rng.randint(1, 80)))
        pol = FragAwarePolicy()
        state = ClusterState(0.0, gpus, pending)
        pol._index.sync(state)
        ctx = Ctx(pol._index, 0.0)
        pol.begin(ctx, state)
        assert pol._node_sig is None
        for info in pol._index.infos:
            wl, multi, _ = pol._wgroup(info)
            assert multi is pol._multi or multi == pol._multi
            assert {pi.kind: w for pi, w in wl} == {k: w for k, w in pol._weights.items() if w > 0}


def test_a_node_too_small_for_a_job_weighs_none_of_it():
    """2 x 7g fits h1 (2 GPUs), never h2 (1 GPU): h2 weighs none of it, h1 all of it."""
    from slurm_mig.policies._core import Ctx
    from slurm_mig.policies.frag_aware import FragAwarePolicy

    gpus = (GpuState("h1", 0, H100, Layout.empty(H100)), GpuState("h1", 1, H100, Layout.empty(H100)),
            GpuState("h2", 0, H100, Layout.empty(H100)))
    state = ClusterState(0.0, gpus, (PendingJob("1", "1g", 1, 0.0), PendingJob("2", "7g", 2, 1.0)))
    pol = FragAwarePolicy()
    pol._index.sync(state)
    pol.begin(Ctx(pol._index, 0.0), state)
    w = {i.gs.node: {pi.kind: x for pi, x in pol._wgroup(i)[0]} for i in pol._index.infos}
    assert w["h1"]["7g"] > 0.5 and "7g" not in w["h2"], w
