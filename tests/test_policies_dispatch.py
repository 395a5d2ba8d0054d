"""Policies: every decision is safe (check_decision) on random states, never destroys a busy
instance, respects priority (no starvation), and the indexed first-fit matches the original."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mig.errors import GeometryError
from slurm_mig.mig.layout import Layout, Slot, enumerate_maximal_layouts, parse_layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.mig.transitions import carve_options
from slurm_mig.policies import get_policy, policy_names
from slurm_mig.policies.base import (
    Assignment, ClusterState, Decision, GpuState, LayoutChange, PendingJob, check_decision,
)
from slurm_mig.sim.engine import ClusterSpec, SimConfig, simulate
from slurm_mig.sim.workloads import Job, Workload

H100 = get_model("H100-80GB")
A30 = get_model("A30-24GB")
LAYOUTS = {m.name: [Layout.empty(m)] + enumerate_maximal_layouts(m) for m in (H100, A30)}
ALL_POLICIES = ["first-fit", "greedy", "no-mig", "static", "frag-aware"]


# -- the original first-fit (commit 93ed86e), kept as the reference for the indexed rewrite --------
@dataclass
class _Gpu:
    """Mutable working copy of one GPU while a decision is being built."""

    state: GpuState
    layout: Layout
    taken: set[Slot]  # busy, reconfiguring, or assigned in this decision

    def free(self, profile: str) -> list[Slot]:
        return sorted(s for s in self.layout.slots if s.profile == profile and s not in self.taken)


class ReferenceFirstFit:
    """First fit over nodes/GPUs, reconfiguring idle slices on demand."""

    name = "first-fit"
    version = "1"

    def __init__(self, backfill: bool = True):
        self.backfill = backfill

    def decide(self, state: ClusterState) -> Decision:
        gpus: dict[str, list[_Gpu]] = defaultdict(list)
        for g in state.gpus:
            if g.available:
                gpus[g.node].append(_Gpu(g, g.layout, set(g.locked)))
        changed: set[str] = set()
        assignments: list[Assignment] = []
        waiting: list[tuple[str, str]] = []
        blocked = False
        for job in state.pending:
            if blocked and not self.backfill:
                waiting.append((job.job_id, "behind a higher-priority job that cannot start yet"))
                continue
            placed = self._place(job, gpus, changed)
            if placed is None:
                blocked = True
                waiting.append((job.job_id, f"no node can hold {job.count} x {job.profile} on idle slices now"))
            else:
                assignments.append(placed)
        changes = []
        for node_gpus in gpus.values():
            for g in node_gpus:
                if g.state.key in changed:
                    changes.append(LayoutChange(g.state.node, g.state.index, g.layout,
                                                f"carve instances for pending jobs: {g.state.layout} -> {g.layout}"))
        return Decision(tuple(changes), tuple(assignments), tuple(waiting), self.name, self.version)

    def _place(self, job: PendingJob, gpus: dict[str, list[_Gpu]], changed: set[str]) -> Assignment | None:
        for node, node_gpus in sorted(gpus.items()):
            picked: list[tuple[_Gpu, Slot, bool]] = []
            # First free instances that exist, then carve new ones; tentative until the job fits.
            trial = {g.state.key: (g.layout, set(g.taken)) for g in node_gpus}
            for g in node_gpus:
                try:
                    profile = g.state.model.profile(job.profile).name
                except GeometryError:
                    continue
                for slot in g.free(profile):
                    if len(picked) < job.count:
                        picked.append((g, slot, False))
                        g.taken.add(slot)
            for g in node_gpus:
                while len(picked) < job.count:
                    try:
                        profile = g.state.model.profile(job.profile).name
                    except GeometryError:
                        break
                    options = carve_options(g.layout, profile, g.taken)
                    if not options:
                        break
                    opt = options[0]
                    g.layout = opt.target
                    g.taken.add(opt.slot)
                    picked.append((g, opt.slot, True))
            if len(picked) == job.count:
                for g, _slot, carved in picked:
                    if carved:
                        changed.add(g.state.key)
                reason = ("free instance(s) " if not any(c for *_, c in picked) else "carved ") + ", ".join(
                    f"{g.state.key}:{s}" for g, s, _ in picked)
                return Assignment(job.job_id, node, tuple((g.state.index, s) for g, s, _ in picked), reason)
            # Roll back this node's tentative picks.
            for g in node_gpus:
                g.layout, g.taken = trial[g.state.key][0], trial[g.state.key][1]
        return None


# -- random states ---------------------------------------------------------------------------------


@st.composite
def states(draw, max_nodes: int = 3, max_gpus: int = 3, max_jobs: int = 12, mixed_models: bool = True):
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    nodes = draw(st.integers(1, max_nodes))
    gpus = []
    for n in range(nodes):
        model = A30 if mixed_models and rng.random() < 0.2 else H100
        for i in range(draw(st.integers(1, max_gpus))):
            lay = rng.choice(LAYOUTS[model.name])
            slots = sorted(lay.slots)
            busy = frozenset(s for s in slots if rng.random() < 0.4)
            rest = [s for s in slots if s not in busy]
            reconf = frozenset(s for s in rest if rng.random() < 0.1)
            until = tuple(sorted((s, 100.0 + rng.uniform(0, 5000)) for s in busy if rng.random() < 0.8))
            gpus.append(GpuState(f"n{n}", i, model, lay, busy, reconf, until, rng.random() > 0.05))
    kinds = ["1g", "2g", "3g", "4g", "7g", "1g.dm", "1g+me"]
    jobs = []
    for j in range(draw(st.integers(0, max_jobs))):
        k = rng.choice(kinds)
        count = rng.choice([1, 1, 1, 2, 3])
        tl = rng.choice([None, rng.uniform(10, 10000)])
        jobs.append(PendingJob(f"j{j}", k, count, float(j), tl))
    return ClusterState(100.0, tuple(gpus), tuple(jobs))


@pytest.mark.parametrize("name", ALL_POLICIES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=states())
def test_every_decision_is_safe(name, state):
    """check_decision passes: valid targets reachable without touching locked instances, etc."""
    pol = get_policy(name)
    d = pol.decide(state)
    check_decision(state, d)
    gpus = {g.key: g for g in state.gpus}
    for ch in d.changes:
        g = gpus[ch.key]
        assert not (g.layout.slots - ch.target.slots) & g.locked, "destroyed a busy/reconfiguring instance"
    # Every pending job is either assigned or has a reason.
    told = {a.job_id for a in d.assignments} | {j for j, _ in d.waiting}
    assert told == {j.job_id for j in state.pending}


@pytest.mark.parametrize("name", ["greedy", "frag-aware"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=states(mixed_models=False), second=states(mixed_models=False))
def test_index_is_pure(name, first, second):
    """A policy that saw another state first decides exactly like a fresh one (its index is a cache)."""
    used = get_policy(name)
    used.decide(first)
    # Reuse most GpuState objects of `first` so the incremental path is taken.
    if len(first.gpus) == len(second.gpus):
        mixed = tuple(b if i % 2 else a for i, (a, b) in enumerate(zip(first.gpus, second.gpus))
                      if (a.node, a.index) == (b.node, b.index))
        if len(mixed) == len(first.gpus):
            second = ClusterState(second.now, mixed, second.pending)
    assert _plain(used.decide(second)) == _plain(get_policy(name).decide(second))


def test_the_large_cluster_path_is_pure_too():
    """The same on frag-aware's path for clusters of more than exact_limit GPUs (forced here with 0):
    groups of GPUs with equal lower bounds were visited in the order their signatures first appeared,
    which differs between a fresh index and one updated from an earlier state, so the two placed
    differently (45 of these 800 random pairs of states)."""
    from slurm_mig.policies.frag_aware import FragAwarePolicy

    layouts = LAYOUTS[H100.name]

    def gpus_and_jobs(rng, names, shape):
        gpus = []
        for n, k in zip(names, shape):
            for i in range(k):
                lay = rng.choice(layouts)
                busy = frozenset(x for x in sorted(lay.slots) if rng.random() < 0.5)
                until = tuple(sorted((x, 100.0 + rng.uniform(0, 5000)) for x in busy if rng.random() < 0.8))
                gpus.append(GpuState(n, i, H100, lay, busy, frozenset(), until))
        jobs = [PendingJob(f"j{j}", rng.choice(["1g", "2g", "3g", "4g", "7g"]), rng.choice([1, 1, 2]),
                           float(j) - 20000 * rng.random(), rng.choice([None, rng.uniform(10, 10000)]))
                for j in range(rng.randint(1, 14))]
        return gpus, jobs

    def fresh():
        return FragAwarePolicy(exact_limit=0, reserve_min_age_s=0, reservations=3)

    impure = []
    for seed in range(800):
        rng = random.Random(seed)
        names = [f"n{i}" for i in range(rng.randint(2, 5))]
        shape = [rng.randint(1, 3) for _ in names]
        g1, j1 = gpus_and_jobs(rng, names, shape)
        g2, j2 = gpus_and_jobs(rng, names, shape)
        first = ClusterState(100.0, tuple(g1), tuple(j1))
        second = ClusterState(200.0, tuple(b if i % 2 else a for i, (a, b) in enumerate(zip(g1, g2))), tuple(j2))
        used = fresh()
        used.decide(first)
        a, b = used.decide(second), fresh().decide(second)
        if (a.changes, a.assignments, a.extra["reservations"]) != (b.changes, b.assignments, b.extra["reservations"]):
            impure.append(seed)
    assert impure == []


def test_reservation_heaps_name_gpu_infos_by_a_serial_that_never_repeats():
    """The heaps' lazy deletion must tell a replaced GpuInfo from its successor. CPython gives a freed
    object's address to the next one, so id() repeats at once (a reused policy then reserved by stale
    facts, unlike a fresh one); the serial must not repeat."""
    from slurm_mig.policies._core import ClusterIndex, GpuInfo, ModelTable

    gs = GpuState("n0", 0, H100, parse_layout("3g@0,3g@4", H100))
    t = ModelTable.of(H100)
    addresses, serials = set(), set()
    for _ in range(200):
        info = GpuInfo(gs, t)
        addresses.add(id(info))
        serials.add(info.serial)
        del info
    assert len(serials) == 200
    assert len(addresses) < 200  # what made id() unsafe here
    idx = ClusterIndex()
    idx.sync(ClusterState(0.0, (gs,), ()))
    ki = idx.key("3g")
    ki.build_heap(idx)
    assert [e[-1] for e in ki.heap] == [idx.infos[0].serial]
    assert idx.infos[0].clone().serial == -1  # working copies never enter a heap


def _plain(d: Decision):
    return (tuple((c.key, c.target.slots) for c in d.changes), tuple((a.job_id, a.node, a.instances) for a in d.assignments))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=states())
def test_first_fit_rewrite_matches_original(state):
    """The indexed first-fit places exactly like the original implementation."""
    ref = ReferenceFirstFit().decide(state)
    new = get_policy("first-fit").decide(state)
    assert _plain(new)[1] == _plain(ref)[1]
    assert {c.key: c.target.slots for c in new.changes} == {c.key: c.target.slots for c in ref.changes}


def test_registry_names():
    assert set(ALL_POLICIES) <= set(policy_names())
    assert get_policy("static", plan="4g@0,3g@4").plan == "4g@0,3g@4"


# -- priority and starvation ---------------------------------------------------------------------


def _stream_workload() -> Workload:
    """A 7g job behind a never-ending stream of 1g jobs on one GPU."""
    jobs = [Job(f"s{i}", i * 30.0, "1g", 1, 200.0, 300.0) for i in range(400)]
    jobs.append(Job("big", 45.0, "7g", 1, 100.0, 200.0))
    return Workload("stream", jobs, nodes=1, gpus_per_node=1)


@pytest.mark.parametrize("name", ["greedy", "frag-aware", "no-mig"])
def test_big_job_is_not_starved(name):
    w = _stream_workload()
    r = simulate(w, get_policy(name), ClusterSpec(1, 1), SimConfig(check=True))
    big = next(x for x in r.jobs if x.job.job_id == "big")
    assert big.start < float("inf")
    # It waits for the 1g jobs already running (<= their 300 s limit), not for the whole stream.
    assert big.start - big.job.submit_time <= 300.0 + 5.0
    assert r.unfinished == 0


def test_first_fit_without_reservation_starves_it():
    """The reason reservations exist: plain first-fit keeps packing 1g jobs."""
    w = _stream_workload()
    r = simulate(w, get_policy("first-fit"), ClusterSpec(1, 1))
    big = next(x for x in r.jobs if x.job.job_id == "big")
    assert big.start - big.job.submit_time > 5000


def test_backfill_respects_reservation_in_one_decision():
    """Head 7g job blocked by a 1g ending at t=500: a 1g ending after 500 may not take the GPU,
    one ending before may (backfill), and slices of other GPUs stay usable."""
    lay = parse_layout("1g@0", H100)
    busy = frozenset(lay.slots)
    g0 = GpuState("n0", 0, H100, lay, busy, frozenset(), tuple((s, 500.0) for s in busy))
    g1 = GpuState("n0", 1, H100, parse_layout("4g@0", H100), frozenset(parse_layout("4g@0", H100).slots),
                  frozenset(), tuple((s, 5000.0) for s in parse_layout("4g@0", H100).slots))
    pending = (PendingJob("head", "7g", 1, 0.0, 1000.0), PendingJob("long", "1g", 1, 1.0, 4000.0),
               PendingJob("short", "1g", 1, 2.0, 300.0))
    state = ClusterState(100.0, (g0, g1), pending)
    for name in ("greedy", "frag-aware"):
        d = get_policy(name).decide(state)
        check_decision(state, d)
        placed = {a.job_id: a for a in d.assignments}
        assert "head" not in placed
        assert "short" in placed
        if "long" in placed:  # only beside the 4g, never on the reserved GPU
            assert all(gi == 1 for gi, _ in placed["long"].instances)


def test_priority_order_is_kept_without_backfill():
    lay = parse_layout("3g@0", H100)
    g = GpuState("n0", 0, H100, lay, frozenset(lay.slots), frozenset(), ())
    pending = (PendingJob("a", "7g", 1, 0.0), PendingJob("b", "1g", 1, 1.0))
    d = get_policy("first-fit", backfill=False).decide(ClusterState(0.0, (g,), pending))
    assert not d.assignments
    d = get_policy("first-fit").decide(ClusterState(0.0, (g,), pending))
    assert [a.job_id for a in d.assignments] == ["b"]


# -- frag-aware chooses well -------------------------------------------------------------------------


def test_frag_aware_keeps_whole_gpus_for_big_jobs():
    """A 1g goes beside a running 4g, not onto an empty GPU, when 7g jobs are in the queue."""
    four = parse_layout("4g@0", H100)
    busy_gpu = GpuState("n0", 0, H100, four, frozenset(four.slots), frozenset(),
                        tuple((s, 10_000.0) for s in four.slots))
    empty = GpuState("n0", 1, H100, Layout.empty(H100))
    pending = (PendingJob("small", "1g", 1, 0.0, 600.0),) + tuple(
        PendingJob(f"big{i}", "7g", 1, 1.0 + i, 600.0) for i in range(3))
    state = ClusterState(0.0, (empty, busy_gpu), pending)
    d = get_policy("frag-aware").decide(state)
    check_decision(state, d)
    placed = {a.job_id: a for a in d.assignments}
    assert placed["small"].instances[0][0] == 0 and placed["small"].instances[0][1].start >= 4
    assert "big0" in placed and placed["big0"].instances[0][0] == 1


def test_frag_aware_pairs_4g_and_3g():
    """A 3g is carved at slice 4 (beside room for a 4g), not at 0."""
    empty = GpuState("n0", 0, H100, Layout.empty(H100))
    state = ClusterState(0.0, (empty,), (PendingJob("c", "3g", 1, 0.0, 600.0), PendingJob("d", "4g", 1, 1.0, 600.0)))
    d = get_policy("frag-aware").decide(state)
    check_decision(state, d)
    assert {a.job_id: a.instances[0][1].start for a in d.assignments} == {"c": 4, "d": 0}


def test_check_decision_refuses_reconfiguring_instances_unavailable_nodes_and_unknown_sizes():
    """The safety gate let these through (found in review): an instance an open reconfiguration is making
    or destroying, a GPU whose node is down or drained, and a size no profile has (GeometryError instead
    of DecisionError, which the controller's fallback did not expect)."""
    from slurm_mig.policies.base import DecisionError

    s3 = Slot(0, "3g.40gb")
    lay = Layout(H100, frozenset({s3}))
    take = Decision(assignments=(Assignment("j1", "n1", ((0, s3),), "test"),))
    cases = [
        (GpuState("n1", 0, H100, lay, reconfiguring=frozenset({s3})), "3g", take, "being reconfigured"),
        (GpuState("n1", 0, H100, lay, available=False), "3g", take, "down or drained"),
        (GpuState("n1", 0, H100, lay, available=False), "3g",
         Decision(changes=(LayoutChange("n1", 0, parse_layout("7g@0", H100), "test"),)), "down or drained"),
        (GpuState("n1", 0, H100, lay), "5g", take, "asks for 5g"),
    ]
    for gpu, size, decision, said in cases:
        with pytest.raises(DecisionError, match=said):
            check_decision(ClusterState(0.0, (gpu,), (PendingJob("j1", size),)), decision)
    check_decision(ClusterState(0.0, (GpuState("n1", 0, H100, lay),), (PendingJob("j1", "3g"),)), take)


def test_check_decision_refuses_two_changes_for_one_gpu_and_a_change_over_a_reconfiguring_instance():
    """Each change is checked against the GPU as it is: a second change for the same GPU would be planned
    from a layout the first one replaces; and an instance an open reconfiguration is making (not busy yet)
    is as untouchable as a busy one."""
    from slurm_mig.policies.base import DecisionError

    s3 = Slot(0, "3g.40gb")
    lay = Layout(H100, frozenset({s3}))
    to = lambda spec: LayoutChange("n1", 0, parse_layout(spec, H100), "test")  # noqa: E731
    state = ClusterState(0.0, (GpuState("n1", 0, H100, lay),), ())
    check_decision(state, Decision(changes=(to("3g@0,3g@4"),)))
    with pytest.raises(DecisionError, match="two layout changes"):
        check_decision(state, Decision(changes=(to("3g@0,3g@4"), to("7g@0"))))
    state = ClusterState(0.0, (GpuState("n1", 0, H100, lay, reconfiguring=frozenset({s3})),), ())
    with pytest.raises(DecisionError, match="unsafe"):
        check_decision(state, Decision(changes=(to("7g@0"),)))


def test_check_decision_refuses_busy_shared_miscounted_repeated_and_wrong_size_assignments():
    """The assignment rules, one at a time: a busy instance, one instance for two jobs, the wrong number of
    instances, one job assigned twice, and an instance of another size are each refused."""
    from slurm_mig.policies.base import DecisionError

    a, b = Slot(0, "3g.40gb"), Slot(4, "3g.40gb")
    one = Slot(0, "1g.10gb")
    lay = Layout(H100, frozenset({a, b}))
    idle = GpuState("n1", 0, H100, lay)
    jobs = (PendingJob("j1", "3g"), PendingJob("j2", "3g"), PendingJob("j3", "3g", 2), PendingJob("j4", "1g"))
    take = lambda job, *slots: Assignment(job, "n1", tuple((0, s) for s in slots), "test")  # noqa: E731
    check_decision(ClusterState(0.0, (idle,), jobs), Decision(assignments=(take("j1", a), take("j2", b))))
    check_decision(ClusterState(0.0, (idle,), jobs), Decision(assignments=(take("j3", a, b),)))
    cases = [
        (GpuState("n1", 0, H100, lay, busy=frozenset({a})), (take("j1", a),), "busy instance"),
        (idle, (take("j1", a), take("j2", a)), "two jobs"),
        (idle, (take("j3", a),), "wants 2 instance"),
        (idle, (take("j1", a, b),), "wants 1 instance"),
        (idle, (take("j1", a), take("j1", b)), "assigned twice"),
        (idle, (take("j4", a),), "wants 1g"),
        (GpuState("n1", 0, H100, Layout(H100, frozenset({one}))), (take("j4", a),), "will not exist"),
    ]
    for gpu, assignments, said in cases:
        with pytest.raises(DecisionError, match=said):
            check_decision(ClusterState(0.0, (gpu,), jobs), Decision(assignments=assignments))


@pytest.mark.parametrize("policy", ["frag-aware", "rl-network"])
@pytest.mark.parametrize("exact_limit", [4, 10**9])
def test_a_reserved_node_does_not_hide_the_idle_gpus_beyond_it(exact_limit, policy):
    """Large-cluster mode visits a few GPUs per group; it counted GPUs that a reservation holds, so when
    those came first (here: node n00, reserved for the 8-GPU job X), the 1-GPU job Y waited while 280
    GPUs sat idle (found in review). Small ``exact_limit`` forces that mode on a small state. The RL
    policy's candidate list (what its network scores) had the same fault, found in a later review."""
    from slurm_mig.policies.frag_aware import FragAwarePolicy
    from slurm_mig.policies.rl import RLPolicy, frag_aware_chooser

    one = Slot(0, "1g.10gb")
    gpus = []
    for n in range(6):
        end = 1000.0 if n == 0 else 5000.0
        gpus.append(GpuState(f"n{n:02d}", 0, H100, Layout(H100, frozenset({one})), frozenset({one}), frozenset(),
                             ((one, end),)))
        gpus += [GpuState(f"n{n:02d}", i, H100, Layout.empty(H100)) for i in range(1, 8)]
    state = ClusterState(10.0, tuple(gpus), (PendingJob("X", "7g", 8, 1.0, 100.0), PendingJob("Y", "7g", 1, 2.0, 2000.0)))
    pol = FragAwarePolicy(exact_limit=exact_limit) if policy == "frag-aware" else \
        RLPolicy(chooser=frag_aware_chooser, exact_limit=exact_limit, guard_chooser=lambda row: None)
    d = pol.decide(state)
    check_decision(state, d)
    assert [(a.job_id, a.node != "n00") for a in d.assignments] == [("Y", True)], d.waiting
