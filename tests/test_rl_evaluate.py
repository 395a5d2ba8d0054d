"""training/evaluate.py's statistics: the intervals the held-out tables and `policy retrain` print."""

from __future__ import annotations

import math
import statistics

import pytest

from training.evaluate import ci, t95


@pytest.mark.parametrize("n, exact", [(2, 12.706), (5, 2.776), (11, 2.228), (12, 2.201), (21, 2.086),
                                      (31, 2.042), (61, 2.000), (121, 1.980), (1001, 1.962)])
def test_t_quantile_matches_the_tables_beyond_ten_degrees_of_freedom(n, exact):
    assert t95(n) == pytest.approx(exact, abs=0.003)


def test_interval_of_twenty_seeds_uses_the_t_quantile():
    values = [float(v) for v in range(20)]
    m, h = ci(values)
    assert m == 9.5
    assert h == pytest.approx(2.093 * statistics.stdev(values) / math.sqrt(20), rel=1e-3)
    assert math.isnan(ci([1.0])[1])


def test_markdown_says_when_a_policy_left_jobs_unrun():
    """Means are over the jobs that ran: a policy that leaves some unrun may look better, and the table
    said nothing (as `slurm-mig bench` did before it was fixed)."""
    from training.evaluate import markdown, summarize

    rows = [{"family": "f", "seed": s, "policy": p, "mean_wait_s": w, "mean_jct_s": w + 100.0, "max_wait_s": w,
             "unfinished": u}
            for s in (1, 2, 3) for p, w, u in (("rl", 50.0, 2 if s == 2 else 0), ("frag-aware", 100.0 + s, 0))]
    summary = summarize(rows, heuristics=("frag-aware",))
    assert summary["f"]["policies"]["rl"]["unfinished"] == 2
    assert summary["f"]["mean_wait_s"]["rl_minus_best"][0] == pytest.approx(-52.0)
    md = markdown(summary, ["rl", "frag-aware"])
    assert "f: rl left 2 job(s) unrun over the seeds" in md and "frag-aware left" not in md


def test_p95_wait_is_interpolated_as_the_bench_does():
    """run_case took waits[int(0.95 * (n - 1))], the lower rank: of two jobs the p95 was the shorter wait,
    while `slurm-mig bench` (metrics._pct) interpolates; the two now agree."""
    from slurm_mig.policies import get_policy
    from slurm_mig.sim.engine import ClusterSpec, simulate
    from slurm_mig.sim.metrics import compute_metrics
    from slurm_mig.sim.workloads import Job, Workload
    from training.evaluate import run_case
    from training.splits import Case

    w = Workload("two", [Job("a", 0.0, "7g", 1, 100.0, 120.0), Job("b", 0.0, "7g", 1, 100.0, 120.0)],
                 nodes=1, gpus_per_node=1)
    spec = ClusterSpec(1, 1)
    got = run_case(Case("two", w, spec), "greedy")
    bench = compute_metrics(simulate(w, get_policy("greedy"), spec))
    assert got["max_wait_s"] - got["p95_wait_s"] == pytest.approx(5.0, abs=0.01)  # 0.95 of the 100 s between
    assert got["p95_wait_s"] == pytest.approx(bench.p95_wait_s)


def test_a_case_where_no_scored_job_ran_has_no_times_and_the_worst_validation_score():
    """run_case divided by max(len(done), 1): a case where no scored job ran reported a mean wait of 0 s, the
    best possible, so a policy that started nothing scored best in validation (wait_ratio). It now has no
    times (NaN) and wait_ratio scores it as infinitely worse."""
    from slurm_mig.sim.engine import ClusterSpec
    from slurm_mig.sim.workloads import Job, Workload
    from training.evaluate import run_case, wait_ratio
    from training.splits import Case

    w = Workload("never", [Job("a", 0.0, "7g", 2, 100.0, 120.0)], nodes=1, gpus_per_node=1)  # 2 GPUs, 1 here
    case = Case("never", w, ClusterSpec(1, 1), seed=1)
    got = run_case(case, "greedy")
    assert got["unfinished"] == 1
    assert all(math.isnan(got[k]) for k in ("mean_wait_s", "mean_jct_s", "p95_wait_s", "max_wait_s")), got
    assert wait_ratio([case], {"never1": 100.0}, lambda: "greedy") == math.inf
