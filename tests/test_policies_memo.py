"""frag-aware and rl keep, for one decision, what each GPU offers a job (its places, their fragmentation
losses) and each node's stats (Ctx.gpu_memo, Ctx.node_memo) until a job is placed there. The decisions must
be those of scoring every place afresh, as the policies did before the memo: the reference below is that
code (score_terms per place, carve options and node stats recomputed each time)."""

from __future__ import annotations

import math
import random

import pytest

from slurm_mig.mig.layout import Layout, enumerate_maximal_layouts
from slurm_mig.mig.profiles import get_model
from slurm_mig.policies._core import carve_memo
from slurm_mig.policies.base import ClusterState, GpuState, PendingJob, check_decision
from slurm_mig.policies.frag_aware import FragAwarePolicy
from slurm_mig.policies.rl import FEATURE_NAMES, Choice, RLPolicy

H100 = get_model("H100-80GB")
LAYOUTS = [Layout.empty(H100)] + enumerate_maximal_layouts(H100)


def _fresh_options(self, ctx, g, info, pi, end, node, out, conflicted, memo=True):
    """frag-aware's _options before the memo: every place scored by score_terms."""
    seen = set()
    for slot in info.free.get(pi.name, ()):
        if ctx.reservations and ctx.conflicts(g, pi.mask(slot.start), end):
            conflicted[0] = True
            continue
        seen.add(slot.start)
        sc = self.score_terms(ctx, info, pi, slot.start, end, node, 0)[0]
        out.append((sc, ctx.idx.rank[g], 0, g, slot, None))
    if not ctx.idx.carve:
        return
    for opt in carve_memo(info.layout, pi.name, frozenset(info.locked)):
        st = opt.slot.start
        if st in seen:
            continue
        if ctx.reservations and ctx.conflicts(g, pi.mask(st), end):
            conflicted[0] = True
            continue
        sc = self.score_terms(ctx, info, pi, st, end, node, 1 + len(opt.destroyed))[0]
        out.append((sc, ctx.idx.rank[g], 1, g, opt.slot, opt))


def _fresh_scored_options(self, ctx, g, info, pi, end, node, out, conflicted):
    """rl's _scored_options before the memo."""
    seen = set()
    rank = ctx.idx.rank[g]
    seq = 0
    for slot in info.free.get(pi.name, ()):
        if ctx.reservations and ctx.conflicts(g, pi.mask(slot.start), end):
            conflicted[0] = True
            continue
        seen.add(slot.start)
        parts = self.score_terms(ctx, info, pi, slot.start, end, node, 0)
        out.append((parts[0], rank, 0, seq, g, slot, None, parts, node))
        seq += 1
    for opt in carve_memo(info.layout, pi.name, frozenset(info.locked)):
        st = opt.slot.start
        if st in seen:
            continue
        if ctx.reservations and ctx.conflicts(g, pi.mask(st), end):
            conflicted[0] = True
            continue
        parts = self.score_terms(ctx, info, pi, st, end, node, 1 + len(opt.destroyed))
        out.append((parts[0], rank, 1, seq, g, opt.slot, opt, parts, node))
        seq += 1


class FreshFragAware(FragAwarePolicy):
    _options = _fresh_options

    def _node(self, ctx, node, local=None):
        return self._node_stats(ctx, node, local)


class FreshRL(RLPolicy):
    _options = _fresh_options
    _scored_options = _fresh_scored_options

    def _node(self, ctx, node, local=None):
        return self._node_stats(ctx, node, local)

    def features(self, ctx, job, end, options):
        ctx.gpu_memo.clear()  # the cap_after_* features computed afresh too
        return super().features(ctx, job, end, options)


def _state(nodes: int, jobs: int, seed: int) -> ClusterState:
    """``nodes`` x 8 H100s, some busy with jobs that end at different times; ``jobs`` pending, enough to
    place several jobs on one GPU in one decision; a few ask for several instances (on one node: the
    node search scores a GPU again after giving it one of them)."""
    rng = random.Random(seed)
    now = 10_000.0
    gpus = []
    for n in range(nodes):
        for i in range(8):
            lay = rng.choice(LAYOUTS)
            busy = frozenset(s for s in lay.slots if rng.random() < 0.4)
            until = tuple((s, now + rng.choice([600.0, 3600.0, 7200.0, 86400.0])) for s in sorted(busy))
            gpus.append(GpuState(f"n{n:03d}", i, H100, lay, busy, busy_until=until))
    pending = []
    for j in range(jobs):
        multi = rng.random() < 0.05
        pending.append(PendingJob(
            str(j), rng.choice(["1g", "2g", "3g", "7g"] if multi else ["1g", "1g", "2g", "3g", "4g"]),
            rng.randint(2, 4) if multi else 1,
            submit_time=now - rng.choice([60.0, 3600.0, 6 * 3600.0]),
            time_limit_s=rng.choice([None, 900.0, 3600.0, 4 * 3600.0, 3 * 86400.0])))
    return ClusterState(now, tuple(gpus), tuple(pending))


def _placed_twice(decision) -> bool:
    """Whether some GPU got two jobs in this decision (so it changed after it had been scored)."""
    seen = set()
    for a in decision.assignments:
        for g, _ in a.instances:
            if (a.node, g) in seen:
                return True
            seen.add((a.node, g))
    return False


# 2 nodes: every GPU scored for each job; 40 nodes (320 GPUs, above exact_limit): the large-cluster walk,
# which scores each GPU already changed in the decision again for each job.
@pytest.mark.parametrize("nodes,jobs", [(2, 60), (40, 600)])
def test_frag_aware_memo_decides_as_fresh_scoring(nodes, jobs):
    for seed in range(3):
        state = _state(nodes, jobs, seed)
        got, want = FragAwarePolicy().decide(state), FreshFragAware().decide(state)
        check_decision(state, got)
        assert _placed_twice(got)
        assert got == want
        assert got.extra["reservations"] == want.extra["reservations"]


@pytest.mark.parametrize("nodes,jobs", [(2, 60), (40, 600)])
def test_rl_memo_gives_fresh_features_and_choices(nodes, jobs):
    """The network's view (every feature row, the options' scores) is the same as computed afresh, and so
    is the decision, with a chooser that does not always take frag-aware's pick."""
    node_free = FEATURE_NAMES.index("node_free")

    def chooser(seen):
        def pick(c: Choice) -> int:
            seen.append((c.job.job_id, c.features, [o[:5] if len(o) > 2 else o[0] for o in c.options]))
            return int(sum(sum(r) for r in c.features) * 1000) % len(c.options)
        return pick

    for seed in range(3):
        state = _state(nodes, jobs, seed)
        a, b = [], []
        got, want = RLPolicy(chooser=chooser(a)).decide(state), FreshRL(chooser=chooser(b)).decide(state)
        check_decision(state, got)
        assert _placed_twice(got)
        # node stats moved within the decision (so a stale node memo would show)
        assert len({row[node_free] for _, rows, _ in a for row in rows}) > 1
        assert a == b
        assert got == want


A100 = get_model("A100-40GB")
A30 = get_model("A30-24GB")
MIXED_LAYOUTS = {m.name: [Layout.empty(m)] + enumerate_maximal_layouts(m) for m in (H100, A100, A30)}


def _mixed_state(seed: int) -> ClusterState:
    """Everything else that could change what a GPU or node offers within one decision: mixed models and
    profile names resolving to other profiles, unavailable nodes, instances being reconfigured, jobs without a
    time limit or past it, jobs restricted to some nodes, counted CPUs (--exclusive too), and old jobs, so that
    blocked jobs take reservations (and rl's guard holds them)."""
    rng = random.Random(seed)
    now = 100_000.0
    names = [f"n{n:02d}" for n in range(rng.choice([3, 6, 12]))]
    gpus = []
    for name in names:
        model = rng.choice((H100, H100, A100, A30))
        avail = rng.random() > 0.1
        for i in range(rng.choice([1, 4, 8])):
            lay = rng.choice(MIXED_LAYOUTS[model.name])
            busy = frozenset(s for s in lay.slots if rng.random() < 0.4)
            reconf = frozenset(s for s in lay.slots - busy if rng.random() < 0.05)
            until = tuple((s, rng.choice([now - 50, now + 600.0, now + 3600.0, now + 86400.0, math.inf]))
                          for s in sorted(busy) if rng.random() < 0.9)
            gpus.append(GpuState(name, i, model, lay, busy, reconf, until, avail))
    pending = []
    for j in range(rng.choice([40, 120])):
        multi = rng.random() < 0.15
        cpus = rng.choice([None, 1, 16, 32]) if rng.random() < 0.5 else None
        pending.append(PendingJob(
            str(j), rng.choice(["1g", "2g", "3g", "7g"] if multi else ["1g", "1g.dm", "1g+me", "2g", "3g", "4g", "7g"]),
            rng.randint(2, 5) if multi else 1,
            submit_time=now - rng.choice([10.0, 3600.0, 6 * 3600.0, 86400.0]),
            time_limit_s=rng.choice([None, 60.0, 900.0, 3600.0, 3 * 86400.0]),
            nodes=tuple(sorted(rng.sample(names, len(names) // 3 or 1))) if rng.random() < 0.2 else None,
            cpus=cpus, exclusive=cpus is not None and rng.random() < 0.1))
    free_cpus = tuple((n, rng.choice([0, 8, 32, 64])) for n in names) if rng.random() < 0.6 else None
    return ClusterState(now, tuple(gpus), tuple(pending), free_cpus)


def test_memo_decides_as_fresh_scoring_with_reservations_cpus_restrictions_and_mixed_models():
    """The large-cluster walk on a small cluster (exact_limit 4), several reservations, rl's guard holding
    them, its network skipping some: every decision, feature row and guard row as computed afresh."""
    def chooser(seen):
        def pick(c: Choice) -> int:
            seen.append((c.job.job_id, c.features, [repr(o[:7]) if len(o) > 2 else o[0] for o in c.options]))
            return int(abs(sum(sum(r) for r in c.features)) * 1000) % len(c.options)
        return pick

    def guard(seen):
        def hours(row):
            seen.append(row)
            return (0.0, 1.0, 48.0)[int(abs(sum(row)) * 100) % 3]
        return hours

    reserved = 0
    for seed in range(24):
        state = _mixed_state(seed)
        kw = dict(exact_limit=(4, 256)[seed % 2], group_width=1 + seed % 3, reservations=3, reserve_share=1.0,
                  reserve_min_age_s=(0.0, 4 * 3600.0)[seed // 2 % 2])
        got, want = FragAwarePolicy(**kw).decide(state), FreshFragAware(**kw).decide(state)
        check_decision(state, got)
        assert got == want and got.extra == want.extra, seed
        reserved += len(got.extra["reservations"])
        a, b, ga, gb = [], [], [], []
        got = RLPolicy(chooser=chooser(a), guard_chooser=guard(ga), reserve_guard_s=3 * 3600.0, **kw).decide(state)
        want = FreshRL(chooser=chooser(b), guard_chooser=guard(gb), reserve_guard_s=3 * 3600.0, **kw).decide(state)
        check_decision(state, got)
        assert (a, ga) == (b, gb), seed
        assert got == want and got.extra == want.extra, seed
    assert reserved > 24


def _array_state(nodes: int) -> ClusterState:
    """``nodes`` x 8 H100s, some busy, and an array's tasks (one size, one time limit: one end) around a
    job of 8 x 7g no node can start now, which takes a reservation between them."""
    rng = random.Random(7)
    now = 10_000.0
    gpus = []
    for n in range(nodes):
        for i in range(8):
            lay = rng.choice(LAYOUTS)
            busy = frozenset(s for s in lay.slots if rng.random() < 0.4)
            until = tuple((s, now + rng.choice([600.0, 3600.0, 86400.0])) for s in sorted(busy))
            gpus.append(GpuState(f"n{n:03d}", i, H100, lay, busy, busy_until=until))
    tasks = [PendingJob(f"9_{k}", "1g", 1, submit_time=now - 600, time_limit_s=3600.0) for k in range(300)]
    big = PendingJob("8", "7g", 8, submit_time=now - 7200, time_limit_s=3600.0)
    return ClusterState(now, tuple(gpus), tuple(tasks[:40] + [big] + tasks[40:]))


@pytest.mark.parametrize("nodes", [2, 40])
def test_an_arrays_tasks_get_the_places_scored_for_the_task_before_and_decide_as_fresh_scoring(nodes):
    """frag-aware scored every GPU it considered afresh for each job (the end-time terms, each place's total),
    though an array's next task has the same size and end as the last: on the first decision of `explain
    --replay` at 1,024 GPUs, thousands of tasks, each scored on every GPU the decision had changed. The places
    are kept now (_options), per size and end, until the GPU or its node gets a job or a reservation is taken;
    the decision is the same as scoring afresh."""
    calls = {"end_terms": 0}

    class Counting(FragAwarePolicy):
        def _end_terms(self, *a):
            calls["end_terms"] += 1
            return super()._end_terms(*a)

    state = _array_state(nodes)
    got, want = Counting().decide(state), FreshFragAware().decide(state)
    check_decision(state, got)
    assert got == want and got.extra == want.extra
    assert got.extra["reservations"] and len(got.assignments) > 40  # tasks placed before and after it
    scored = {"end_terms": 0}

    class CountingFresh(FragAwarePolicy):
        def _options(self, ctx, g, info, pi, end, node, out, conflicted, memo=True):
            return super()._options(ctx, g, info, pi, end, node, out, conflicted, memo=False)

        def _end_terms(self, *a):
            scored["end_terms"] += 1
            return super()._end_terms(*a)

    assert CountingFresh().decide(state) == got
    assert calls["end_terms"] * (10 if nodes > 2 else 1.5) < scored["end_terms"], (calls, scored)
