"""frag-aware's carving weights (the demand of the next 64 pending jobs) are per GPU: a GPU does not weigh the
jobs its node can never take though its models have their size -- outside the nodes they may start on
(partition, --nodelist, --exclude, features: PendingJob.nodes) or too little room for all their instances.
Counted there, a partition's demand changed how the GPUs of other nodes were carved. Sizes a GPU's model lacks
still weigh on it (test_sizes_a_gpu_model_lacks_still_weigh_on_it)."""

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


def test_sizes_a_gpu_model_lacks_still_weigh_on_it(monkeypatch):
    """An A30 (1g/2g/4g) beside a busy H100; a 1g and a 2g that may start only on the A30, 62 7g jobs that only
    the H100 can take. The A30 still weighs the 7g demand: f94c52b left sizes a GPU's model lacks out of its
    weights, and on the mixed site (H100s beside A30s, docs/benchmarks.md) small jobs then drifted onto the
    H100s, raising frag-aware's mean wait by 120 +- 37 s and rl's by 170 +- 39 s over 20 seeds; counted, they
    make an A30 cheap to carve, which keeps the H100s for the sizes only they have. The H100 leaves out the 1g
    and the 2g, which may never start on its node."""
    from slurm_mig.policies.frag_aware import FragAwarePolicy

    lay = parse_layout("1g@0,1g@3", A30)
    run = next(s for s in lay.slots if s.start == 3)
    h = parse_layout("7g@0", H100)
    gpus = (GpuState("a1", 0, A30, lay, busy=frozenset({run}), busy_until=((run, 7200.0),)),
            GpuState("h1", 0, H100, h, busy=frozenset(h.slots)))
    mine = [PendingJob("s", "1g", 1, 0.0, time_limit_s=3600.0, nodes=("a1",)),
            PendingJob("t", "2g", 1, 1.0, time_limit_s=3600.0, nodes=("a1",))]
    big = [PendingJob(f"b{i}", "7g", 1, 2.0 + i, time_limit_s=3600.0) for i in range(62)]
    state = ClusterState(0.0, gpus, tuple(mine + big))
    p = FragAwarePolicy()
    d = p.decide(state)
    check_decision(state, d)
    assert p._weights["7g"] > 0.5  # the whole look-ahead's: 62 of its 64 jobs are 7g
    scored = list(p._wg_gpu.values())  # per GPU scored (the H100, wholly busy, is not): (weights, multi, left out)
    assert scored
    for wl, _multi, left_out in scored:
        assert left_out == ()  # the A30's node may take every job whose size its model has
        # its 1g and 2g weights are the whole look-ahead's, the 7g jobs counted
        a30_sizes = {q.kind for q in A30.profiles}
        assert {pi.name.split(".")[0]: w for pi, w in wl} == {
            k: w for k, w in p._weights.items() if w > 0 and k in a30_sizes}


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


def _busy(gpu_node, model, text, until=7200.0):
    lay = parse_layout(text, model)
    return GpuState(gpu_node, 0, model, lay, busy=frozenset(lay.slots), busy_until=tuple((s, until) for s in lay.slots))


@pytest.mark.parametrize("exact_limit", [256, 0])  # 0: the large-cluster walk over groups of alike GPUs
def test_a_size_both_models_have_goes_to_the_smaller_model(exact_limit):
    """An H100 running a 4g beside an A30 running a 2g, both for 2 h; a 1g that may go anywhere. In each GPU's
    own terms the H100 is cheaper (a 1g at slice 6 keeps its 2g@4; on the A30 it ends the last 2g), so the 1g
    took the H100's slices, the only home of the 3g and 7g jobs. The bigger model's charge (w_model) sends it
    to the A30: on the mixed site (H100s beside A30s) frag-aware put a quarter of such 1g jobs on the H100s and
    waited 70 +- 21 s longer on average over 20 seeds (docs/benchmarks.md)."""
    from slurm_mig.policies.frag_aware import FragAwarePolicy

    gpus = (_busy("h1", H100, "4g@0"), _busy("x1", A30, "2g@0"))
    state = ClusterState(0.0, gpus, (PendingJob("s", "1g", 1, 0.0, time_limit_s=3600.0),))
    d = FragAwarePolicy(exact_limit=exact_limit).decide(state)
    check_decision(state, d)
    assert [(j, n) for j, n, _ in _placed(d)] == [("s", "x1")], _placed(d)
    # the H100 is what the fragmentation and time terms alone choose
    d0 = FragAwarePolicy(exact_limit=exact_limit, w_model=0.0).decide(state)
    assert [(j, n) for j, n, _ in _placed(d0)] == [("s", "h1")], _placed(d0)


def test_several_instances_go_to_the_node_of_the_smaller_model():
    """2 x 1g on one node: an H100 node and an A30 node, each running as above; the A30 node."""
    from slurm_mig.policies.frag_aware import FragAwarePolicy

    gpus = (_busy("h1", H100, "4g@0"), _busy("x1", A30, "2g@0"))
    state = ClusterState(0.0, gpus, (PendingJob("s", "1g", 2, 0.0, time_limit_s=3600.0),))
    d = FragAwarePolicy().decide(state)
    check_decision(state, d)
    assert [n for _, n, _ in _placed(d)] == ["x1"], _placed(d)


@pytest.mark.parametrize("models", [(H100,), (A30,), (H100, get_model("H200-141GB"), get_model("A100-40GB"))])
def test_models_alike_in_slices_are_never_charged_for_the_bigger_model(models):
    """One model, or models alike in compute slices (an H100 beside an H200 and an A100): w_model changes no
    decision, so every single-model workload (bench, the rl policy's training) decides as before it."""
    from slurm_mig.policies.frag_aware import FragAwarePolicy

    rng = random.Random(11)
    for _ in range(25):
        gpus = []
        for n in range(3):
            for i in range(2):
                m = rng.choice(models)
                lay = Layout.empty(m)
                busy: frozenset = frozenset()
                until: tuple = ()
                if rng.random() < 0.6:
                    lay = parse_layout(rng.choice(["1g@0", "2g@0", "4g@0"] if m is A30 else
                                                  ["1g@0", "3g@4", "4g@0", "2g@2,1g@6", "7g@0"]), m)
                    busy = frozenset(lay.slots)
                    until = tuple((s, rng.uniform(600, 20000)) for s in lay.slots)
                gpus.append(GpuState(f"n{n}", i, m, lay, busy=busy, busy_until=until))
        kinds = ["1g", "2g", "4g"] if models == (A30,) else ["1g", "2g", "3g", "4g", "7g"]
        pending = tuple(PendingJob(str(j), rng.choice(kinds), rng.choice([1, 1, 2]), float(j),
                                   time_limit_s=rng.choice([None, 1800.0, 7200.0])) for j in range(rng.randint(1, 30)))
        state = ClusterState(0.0, tuple(gpus), pending)
        a, b = FragAwarePolicy().decide(state), FragAwarePolicy(w_model=50.0).decide(state)
        assert (a.assignments, a.changes) == (b.assignments, b.changes)
