"""The simulator: hand-computed metrics, reconfiguration timing, determinism, step API."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_mig.mig.layout import Layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.mig.timing import step_seconds
from slurm_mig.policies import get_policy
from slurm_mig.policies.base import check_decision
from slurm_mig.sim.engine import ClusterSpec, SimConfig, Simulator, simulate
from slurm_mig.sim.metrics import BSLD_TAU, compute_metrics, lower_bounds
from slurm_mig.sim.workloads import SPEED_MODELS, Job, Workload, poisson_workload

H100 = get_model("H100-80GB")
CREATE_7G = step_seconds(H100, "7g", "create")


def one_gpu(jobs) -> Workload:
    return Workload("tiny", list(jobs), nodes=1, gpus_per_node=1)


def test_metrics_on_a_hand_computed_workload():
    w = one_gpu([Job("a", 0.0, "7g", 1, 100.0, 200.0), Job("b", 10.0, "7g", 1, 50.0, 100.0)])
    r = simulate(w, get_policy("greedy"), ClusterSpec(1, 1), SimConfig(check=True))
    a, b = sorted(r.jobs, key=lambda x: x.job.job_id)
    c = CREATE_7G  # the 7g instance is created for job a, then kept for b
    assert a.start == pytest.approx(c) and a.end == pytest.approx(100 + c)
    assert b.start == pytest.approx(100 + c) and b.end == pytest.approx(150 + c)
    m = compute_metrics(r)
    assert m.mean_wait_s == pytest.approx((c + 90 + c) / 2)
    assert m.p95_wait_s == pytest.approx(c + 0.95 * 90)
    assert m.mean_jct_s == pytest.approx((100 + c + 140 + c) / 2)
    assert m.makespan_s == pytest.approx(150 + c)
    assert m.utilization == pytest.approx(7 * 150 / (7 * (150 + c)))
    assert m.bounded_slowdown == pytest.approx((max(1, (100 + c) / 100) + (140 + c) / 50) / 2)
    assert m.reconfigurations == 1 and m.finished == 2
    lb = lower_bounds(w, 1)
    assert lb.makespan_s == pytest.approx(150.0)  # area: 7*100 + 7*50 slice-seconds on 7 slices
    assert lb.mean_jct_s == pytest.approx(75.0)
    assert lb.makespan_s <= m.makespan_s and lb.mean_jct_s <= m.mean_jct_s


def test_the_metric_definitions_docs_benchmarks_gives():
    """docs/benchmarks.md "Metrics", figure by figure, on workloads worked out by hand (one H100 already
    holding a 7g, so no reconfiguration moves a start)."""
    spec = ClusterSpec(1, 1, initial_layout="7g@0")

    def metrics(jobs):
        r = simulate(one_gpu(jobs), get_policy("greedy"), spec, SimConfig(check=True))
        return compute_metrics(r)

    # 20 x 10 s at t=0: waits 0, 10, ..., 190; p95 = 180 + 0.05 x 10 (linear), nearest-rank would be 180
    m = metrics(Job(f"j{i:02d}", 0.0, "7g", 1, 10.0, 60.0) for i in range(20))
    assert (m.mean_wait_s, m.p95_wait_s, m.max_wait_s) == (95.0, 180.5, 190.0)
    assert m.mean_jct_s == 105.0 and m.bounded_slowdown == pytest.approx(10.5)  # JCT_i / 10 = i + 1
    assert m.makespan_s == 200.0 and m.utilization == 1.0 and m.reconfigurations == 0
    # bounded slowdown's 10 s floor: 2 s runs waiting 0 and 2 s count 1 each, a 30 s one waiting 4 s 34/30
    m = metrics([Job("a", 0.0, "7g", 1, 2.0, 60.0), Job("b", 0.0, "7g", 1, 2.0, 60.0),
                 Job("c", 0.0, "7g", 1, 30.0, 60.0)])
    assert m.bounded_slowdown == pytest.approx((1 + 1 + 34 / 30) / 3)
    # a 100 s job with a 60 s limit ends at 60: JCT 60, then b runs 60..70 (JCT 70, run 10: slowdown 7)
    m = metrics([Job("a", 0.0, "7g", 1, 100.0, 60.0), Job("b", 0.0, "7g", 1, 10.0, 60.0)])
    assert (m.mean_jct_s, m.makespan_s, m.bounded_slowdown, m.utilization) == (65.0, 70.0, 4.0, 1.0)
    # utilisation over the makespan window (first submit to last end): 2 x 10 s busy in 100 s
    m = metrics([Job("a", 0.0, "7g", 1, 10.0, 60.0), Job("b", 90.0, "7g", 1, 10.0, 60.0)])
    assert (m.makespan_s, m.utilization) == (100.0, pytest.approx(0.2))
    # a job that can never start (2 GPUs on a 1-GPU node) is left out of the times, shown by finished
    m = metrics([Job("a", 0.0, "7g", 1, 100.0, 200.0), Job("b", 0.0, "7g", 2, 100.0, 200.0)])
    assert (m.jobs, m.finished, m.mean_wait_s, m.mean_jct_s, m.makespan_s) == (2, 1, 0.0, 100.0, 100.0)
    # an end and an arrival at one instant: the arrival finds the instance free (wait 0)
    m = metrics([Job("a", 0.0, "7g", 1, 100.0, 200.0), Job("b", 100.0, "7g", 1, 50.0, 200.0)])
    assert (m.mean_wait_s, m.makespan_s) == (0.0, 150.0)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    assert BSLD_TAU == 10.0 and "10 s is `metrics.BSLD_TAU`" in doc and "give 180.5 s" in doc


def test_lower_bound_uses_release_times_and_whole_gpu_speed():
    w = one_gpu([Job("a", 0.0, "1g", 1, 10.0), Job("b", 1000.0, "7g", 1, 10.0)])
    lb = lower_bounds(w, 1)
    assert lb.makespan_s == pytest.approx(1010.0)
    sp = SPEED_MODELS["miso-mean"]
    shortest_a = min(10.0, 10.0 * sp.factor("7g") / sp.factor("1g"))
    assert lb.mean_jct_s == pytest.approx((shortest_a + 10.0) / 2)


def test_reconfiguration_time_delays_the_start():
    """A 1g on a GPU holding an idle 7g: destroy 7g, create 1g, then run."""
    w = one_gpu([Job("x", 0.0, "1g", 1, 60.0, 120.0)])
    spec = ClusterSpec(1, 1, initial_layout="7g@0")
    r = simulate(w, get_policy("greedy"), spec, SimConfig(check=True, record=True))
    x = r.jobs[0]
    expect = step_seconds(H100, "7g", "destroy") + step_seconds(H100, "1g", "create")
    assert x.start == pytest.approx(expect)
    kinds = [s.kind for s in r.timeline]
    assert "destroy" in kinds and "create" in kinds and "job" in kinds
    assert r.reconfig_steps == 2 and r.reconfig_seconds == pytest.approx(expect)


def test_overhead_per_change_is_charged():
    w = one_gpu([Job("x", 0.0, "7g", 1, 60.0)])
    r = simulate(w, get_policy("greedy"), ClusterSpec(1, 1), SimConfig(reconfig_overhead_s=6.0))
    assert r.jobs[0].start == pytest.approx(CREATE_7G + 6.0)


def test_no_mig_runs_jobs_on_whole_gpus_at_7g_speed():
    w = one_gpu([Job("x", 0.0, "1g", 1, 437.0, 600.0)])
    r = simulate(w, get_policy("no-mig"), ClusterSpec(1, 1))
    x = r.jobs[0]
    assert x.instances[0][1].profile == "7g.80gb"
    assert x.duration == pytest.approx(437.0 / SPEED_MODELS["miso-mean"].factor("1g"))
    assert x.compute == 7


def _digest(result) -> str:
    rows = sorted((r.job.job_id, round(r.start, 6), round(r.end, 6), r.node, str(r.instances)) for r in result.jobs)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


@pytest.mark.parametrize("name", ["greedy", "frag-aware", "no-mig"])
def test_deterministic_for_a_seed(name):
    w1 = poisson_workload(300, gpus=8, load=1.0, seed=3, multi_gpu_share=0.1)
    w2 = poisson_workload(300, gpus=8, load=1.0, seed=3, multi_gpu_share=0.1)
    d1 = _digest(simulate(w1, get_policy(name), ClusterSpec(1, 8)))
    d2 = _digest(simulate(w2, get_policy(name), ClusterSpec(1, 8)))
    assert d1 == d2
    w3 = poisson_workload(300, gpus=8, load=1.0, seed=4, multi_gpu_share=0.1)
    assert _digest(simulate(w3, get_policy(name), ClusterSpec(1, 8))) != d1


def test_deterministic_across_processes():
    """Set iteration order of strings changes with PYTHONHASHSEED; results must not."""
    code = (
        "from slurm_mig.sim.workloads import poisson_workload\n"
        "from slurm_mig.sim.engine import simulate, ClusterSpec\n"
        "from slurm_mig.policies import get_policy\n"
        "import hashlib, json\n"
        "w = poisson_workload(200, gpus=16, load=1.0, seed=5, multi_gpu_share=0.1)\n"
        "out = []\n"
        "for p in ('greedy', 'frag-aware'):\n"
        "    r = simulate(w, get_policy(p), ClusterSpec(2, 8))\n"
        "    out.append(sorted((x.job.job_id, round(x.start, 6), x.node, str(x.instances)) for x in r.jobs))\n"
        "print(hashlib.sha256(json.dumps(out).encode()).hexdigest())\n"
    )
    digests = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_a_reconfigurations_time_is_the_same_to_the_last_bit_in_every_process():
    """The engine summed a change's create/destroy times over a set of Slots, whose order PYTHONHASHSEED
    picks: 3g + 2g + 1g created on an empty H100 took 0.7 s in some processes and 0.7000000000000001 s in
    others (seeds 5 and 7), and every start after it moved with it. The digests above round to 1e-6."""
    code = (
        "from slurm_mig.policies.static import StaticPolicy\n"
        "from slurm_mig.sim.engine import simulate, ClusterSpec\n"
        "from slurm_mig.sim.workloads import Job, Workload\n"
        "w = Workload('t', [Job('a', 0.0, '1g', 1, 100.0, 200.0)], nodes=1, gpus_per_node=1)\n"
        "r = simulate(w, StaticPolicy(['3g@0,2g@4,1g@6']), ClusterSpec(1, 1))\n"
        "print(repr(r.jobs[0].start), repr(r.reconfig_seconds))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    seen = set()
    for seed in range(1, 9):
        env = dict(os.environ, PYTHONHASHSEED=str(seed))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                             cwd=root)
        seen.add(out.stdout.strip())
    assert len(seen) == 1, seen
    start = float(seen.pop().split()[0])
    expect = sum(step_seconds(H100, p, "create") for p in ("3g", "2g", "1g"))
    assert start == pytest.approx(expect)  # 0.33 + 0.21 + 0.16


def test_the_speed_benchmarks_state_is_the_same_in_every_process():
    """`bench --speed` times a decision on big_state; its busy instances' end times were drawn while
    iterating a set, so each process (another PYTHONHASHSEED) timed a different cluster."""
    code = (
        "from slurm_mig.sim.speed import big_state\n"
        "import hashlib\n"
        "s = big_state(gpus=64, pending=20)\n"
        "print(hashlib.sha256(repr([(g.key, sorted(g.busy_until)) for g in s.gpus]).encode()).hexdigest())\n"
    )
    digests = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_step_api_drives_any_decider_and_checks_decisions():
    """reset()/step() is the loop run() uses; a training env would wrap exactly this."""
    w = poisson_workload(150, gpus=8, load=1.0, seed=9)
    pol = get_policy("frag-aware")
    sim = Simulator(w, pol, ClusterSpec(1, 8), SimConfig(check=True))
    state = sim.reset()
    steps = 0
    while state is not None:
        d = pol.decide(state)
        check_decision(state, d)
        assert all(a.job_id in {j.job_id for j in state.pending} for a in d.assignments)
        state = sim.step(d)
        steps += 1
    r = sim.result(0.0)
    assert r.unfinished == 0 and steps == r.decisions
    assert _digest(r) == _digest(simulate(w, get_policy("frag-aware"), ClusterSpec(1, 8)))


def test_jobs_that_never_fit_are_reported_not_looped():
    w = one_gpu([Job("x", 0.0, "7g", 2, 10.0)])  # needs 2 GPUs on one node, there is 1
    r = simulate(w, get_policy("greedy"), ClusterSpec(1, 1))
    assert r.unfinished == 1
    assert math.isinf(r.jobs[0].start)


def test_timeline_and_reasons_are_recorded():
    w = one_gpu([Job("a", 0.0, "7g", 1, 100.0, 200.0), Job("b", 10.0, "7g", 1, 50.0, 100.0)])
    r = simulate(w, get_policy("greedy"), ClusterSpec(1, 1), SimConfig(record=True))
    assert "b" in r.waiting_reasons and "reserved" in r.waiting_reasons["b"]
    assert any(s.kind == "job" and s.job_id == "b" for s in r.timeline)
    assert r.queue and max(n for _, n in r.queue) >= 1


def test_after_apply_sees_each_decision_in_place_before_time_moves():
    w = poisson_workload(60, gpus=2, load=0.9, seed=3)
    sim = Simulator(w, get_policy("frag-aware"), ClusterSpec(1, 2))
    seen = []

    def look(s: Simulator) -> None:
        seen.append((s.now, s.decisions, sum(len(g.busy) + len(g.reconf) for g in s.gpus)))

    state, steps = sim.reset(), 0
    while state is not None:
        decision = sim.policy.decide(state)
        t = state.now
        state = sim.step(decision, after_apply=look)
        steps += 1
        now, n, in_use = seen[-1]
        assert now == t and n == steps  # applied, counted, and the clock not yet moved
        if decision.assignments:  # the jobs it started already hold their instances
            assert in_use >= 1 and all(sim.records[a.job_id].start >= t for a in decision.assignments)
    assert len(seen) == steps and steps > 10
    assert sim.result(0.0).jobs and all(r.end < math.inf for r in sim.result(0.0).jobs)


def test_a_job_past_its_time_limit_ends_there_and_its_run_time_is_never_shown():
    """A replayed history (`simulate --db`, `policy retrain`'s replay 0) can hold a job whose recorded run
    time exceeds its --time: the simulator ran it to the end and showed every policy start + run time as
    the instance's expected end, the oracle the controller never has (it shows start + limit). Slurm
    ends such a job at its limit; so does the simulator now, and the lower bounds count that."""
    seen = []

    class Spy:
        name = "spy"

        def __init__(self):
            self.inner = get_policy("greedy")

        def decide(self, state):
            seen.extend(t for g in state.gpus for _s, t in g.busy_until)
            return self.inner.decide(state)

    w = one_gpu([Job("a", 0.0, "7g", 1, 3600.0, 600.0), Job("b", 10.0, "7g", 1, 100.0, 600.0)])
    r = simulate(w, Spy(), ClusterSpec(1, 1), SimConfig(check=True))
    a, b = sorted(r.jobs, key=lambda x: x.job.job_id)
    c = CREATE_7G
    assert seen and max(seen) == pytest.approx(c + 600.0)  # b waits behind a's limit, never its 3600 s
    assert a.end == pytest.approx(600.0 + c) and a.duration == pytest.approx(600.0)
    assert b.start == pytest.approx(600.0 + c)
    m = compute_metrics(r)
    lb = lower_bounds(w, 1)
    assert lb.mean_jct_s == pytest.approx(350.0) and lb.makespan_s == pytest.approx(700.0)
    assert lb.mean_jct_s <= m.mean_jct_s and lb.makespan_s <= m.makespan_s


@pytest.mark.parametrize("name", ["first-fit", "greedy", "frag-aware", "rl", "static"])
def test_explaining_some_jobs_makes_the_same_decisions_with_their_reasons_alone(name):
    """SimConfig.explain_jobs (`explain --replay`): the policy lists the waiting reasons of those jobs only, in
    the same words and order as when it lists every job's, and decides the same."""
    w = poisson_workload(400, gpus=8, load=1.4, seed=5, multi_gpu_share=0.1)
    only = frozenset(j.job_id for j in w.jobs[::37])

    def run(config):
        pol = get_policy(name)
        decisions = []
        real = pol.decide

        def decide(state):
            d = real(state)
            decisions.append(d)
            return d
        pol.decide = decide
        return Simulator(w, pol, ClusterSpec(1, 8), config).run(), decisions

    full, full_d = run(SimConfig(record=True))
    some, some_d = run(SimConfig(record=True, explain_jobs=only))
    assert _digest(some) == _digest(full) and len(some_d) == len(full_d)
    assert some.waiting_reasons == {j: r for j, r in full.waiting_reasons.items() if j in only}
    assert some.waiting_reasons  # some of them waited
    for a, b in zip(some_d, full_d):
        assert (a.changes, a.assignments, a.extra) == (b.changes, b.assignments, b.extra)
        assert a.waiting == tuple(x for x in b.waiting if x[0] in only)


def test_the_policy_is_asked_for_no_reasons_once_the_explained_jobs_have_started():
    """`explain --replay` asks for one job's reason, and the replay plays on to its end, thousands of decisions
    at 1,024 GPUs after the job started: in each the policy looked for it in the rest of the queue (10,000
    jobs), a tenth of the replay of a running job. Once every explained job has started it can wait no more, so
    the policy is asked for none; the replay is the same, and the policy asks again afterwards."""
    w = poisson_workload(300, gpus=8, load=1.4, seed=5, multi_gpu_share=0.1)
    want = Simulator(w, get_policy("frag-aware"), ClusterSpec(1, 8), SimConfig(record=True)).run()
    only = frozenset([j.job_id for j in w.jobs if j.job_id in want.waiting_reasons][:2])
    pol = get_policy("frag-aware")
    asked = []
    real = pol.decide

    def decide(state):
        asked.append((bool(pol.explain_waiting), {j.job_id for j in state.pending} & only))
        return real(state)
    pol.decide = decide
    sim = Simulator(w, pol, ClusterSpec(1, 8), SimConfig(record=True, explain_jobs=only))
    got = sim.run()
    last_start = max(r.start for r in got.jobs if r.job.job_id in only)
    assert not any(pending for was_asked, pending in asked if not was_asked)  # never while one could wait
    assert sum(1 for was_asked, _ in asked if not was_asked) > len(asked) // 3, len(asked)  # the rest: none
    assert last_start < max(r.start for r in got.jobs)
    assert pol.explain_waiting == only
    assert _digest(got) == _digest(want)
    assert got.waiting_reasons == {j: r for j, r in want.waiting_reasons.items() if j in only}
    assert len(got.waiting_reasons) == 2


def test_the_plots_queue_line_starts_at_the_windows_start_with_the_queue_then():
    """`simulate --plot --from T` drew the queue from the first decision inside the window: two jobs waited at
    T, and the line began only when the next one started (nothing at all for a window with no decision)."""
    from slurm_mig.sim.plot import timeline_data

    w = one_gpu([Job("a", 0.0, "7g", 1, 100.0, 200.0), Job("b", 10.0, "7g", 1, 50.0, 100.0),
                 Job("c", 20.0, "7g", 1, 50.0, 100.0)])
    r = Simulator(w, get_policy("greedy"), ClusterSpec(1, 1), SimConfig(record=True)).run()
    c = CREATE_7G
    data = timeline_data(r, t_from=50.0, t_to=200.0)
    assert data.unit == 60.0
    want = [(0.0, 2), ((100 + c - 50) / 60, 1), ((150 + c - 50) / 60, 0), (150 / 60, 0)]
    assert [n for _, n in data.queue] == [n for _, n in want]
    assert [x for x, _ in data.queue] == pytest.approx([x for x, _ in want])
    # a window no decision falls in: the queue all along it
    assert timeline_data(r, t_from=50.0, t_to=90.0).queue == [(0.0, 2), (40 / 60, 2)]
    assert timeline_data(r).queue[0] == (0.0, 0)
