"""`slurm-mig bench` / `simulate`: JSON schema, best-static search, the timeline picture,
and the acceptance comparison on the Alibaba trace."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from slurm_mig.cli import main
from slurm_mig.policies import get_policy
from slurm_mig.sim.bench import BASELINES, POLICIES, run_workload, search_static, trace_workload
from slurm_mig.sim.engine import ClusterSpec, simulate
from slurm_mig.sim.metrics import compute_metrics
from slurm_mig.sim.workloads import load_alibaba, poisson_workload

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / ".." / "shared" / "traces" / "alibaba-v2023-train.csv"


def _run_report(bench_json: Path) -> int:
    """benchmarks/report.py run on ``bench_json`` as its command line would; its exit status."""
    import runpy
    import sys

    report = REPO / "benchmarks" / "report.py"
    argv = sys.argv
    sys.argv = [str(report), str(bench_json)]
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(report), run_name="__main__")
    finally:
        sys.argv = argv
    return e.value.code


def small_trace(tmp_path: Path, n: int = 120, seed: int = 1) -> Path:
    """A made-up pod list in the Alibaba v2023 format (busy enough that jobs queue on one node)."""
    rng = random.Random(seed)
    lines = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
             "scheduled_time"]
    t = 0
    for i in range(n):
        t += rng.randint(1, 120)
        milli, num = rng.choice([(1000, 1), (460, 1), (320, 1), (230, 1), (110, 1), (1000, 2), (810, 1)])
        dur = rng.randint(60, 3600)
        sched = "" if rng.random() < 0.05 else str(t + 5)
        lines.append(f"p{i},1000,1024,{num},{milli},,BE,Running,{t},{t + 5 + dur},{sched}")
    p = tmp_path / "pods.csv"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_bench_json_schema(tmp_path, capsys):
    trace = small_trace(tmp_path)
    assert main(["bench", "--json", "--no-synthetic", "--trace", str(trace), "--nodes", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["workloads"] and len(doc["workloads"]) == 1
    wl = doc["workloads"][0]
    assert isinstance(wl["name"], str) and wl["lower_bound_makespan_s"] > 0
    assert [r["policy"] for r in wl["results"]] == list(POLICIES)
    for r in wl["results"]:
        for k in ("mean_wait_s", "p95_wait_s", "mean_jct_s", "makespan_s", "utilization"):
            assert isinstance(r[k], float) and r[k] >= 0
        assert isinstance(r["reconfigurations"], int)
        assert r["makespan_s"] >= wl["lower_bound_makespan_s"] - 1e-6
        assert r["mean_jct_s"] >= wl["lower_bound_mean_jct_s"] - 1e-6
        assert 0 <= r["utilization"] <= 1


def test_bench_runs_the_default_trace_once_when_it_is_also_given_as_trace(tmp_path, capsys, monkeypatch):
    """The default trace is added only when no --trace is given: naming it with --trace (any spelling)
    runs it once, not once as the default and once as the --trace."""
    from slurm_mig.sim import bench

    trace = small_trace(tmp_path, n=30)
    monkeypatch.setattr(bench, "default_trace", lambda: trace.resolve())
    monkeypatch.chdir(tmp_path)
    for args in ([], ["--trace", str(trace)], ["--trace", "pods.csv"]):
        assert main(["bench", "--json", "--no-synthetic", "--nodes", "1", "--policies", "greedy", *args]) == 0
        names = [w["name"] for w in json.loads(capsys.readouterr().out)["workloads"]]
        assert names == ["alibaba:pods"], args


def test_bench_table(tmp_path, capsys):
    trace = small_trace(tmp_path, n=60)
    assert main(["bench", "--no-synthetic", "--trace", str(trace), "--nodes", "1",
                 "--policies", "no-mig,greedy,frag-aware"]) == 0
    out = capsys.readouterr().out
    assert "frag-aware" in out and "lower bound" in out and "÷best base" in out


def test_bench_table_says_when_jobs_never_ran(tmp_path, capsys):
    """A job no node can hold (16 GPUs, one node of 8) never runs; the means are over the jobs that did,
    and the table said nothing about it (noticed in review)."""
    trace = small_trace(tmp_path, n=30)
    with open(trace, "a") as f:
        f.write("big,1000,1024,16,1000,,BE,Running,100,5000,105\n")
    assert main(["bench", "--no-synthetic", "--trace", str(trace), "--nodes", "1", "--policies", "greedy"]) == 0
    out = capsys.readouterr().out
    assert "greedy: 1 of 27 jobs never ran; its times are over the 26 that did" in out
    (tmp_path / "ok").mkdir()
    small = small_trace(tmp_path / "ok", n=30)
    assert main(["bench", "--no-synthetic", "--trace", str(small), "--nodes", "1", "--policies", "greedy"]) == 0
    assert "never ran" not in capsys.readouterr().out


def test_best_static_is_the_best_of_its_candidates():
    w = poisson_workload(300, gpus=8, load=0.8, seed=2)
    spec = ClusterSpec(1, 8)
    pol, r, m = search_static(w, spec)
    assert r.unfinished == 0 and m.policy == "best-static"
    assert "x [" in pol.describe()
    from slurm_mig.policies.static import StaticPolicy
    from slurm_mig.sim.bench import static_candidates
    for plan in static_candidates(w, spec):
        other = compute_metrics(simulate(w, StaticPolicy(plan), spec))
        assert m.mean_wait_s <= other.mean_wait_s + 1e-9


def test_simulate_cli_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trace = small_trace(tmp_path)
    png = tmp_path / "t.png"
    job = load_alibaba(trace).jobs[7].job_id
    assert main(["simulate", "--trace", str(trace), "--policy", "greedy", "--nodes", "1", "--json",
                 "--plot", str(png), "--job", job]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["policy"] == "greedy" and doc["metrics"]["finished"] > 0
    assert doc["job"]["profile"] in ("1g", "2g", "3g", "4g", "7g")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_simulate_cli_synthetic_and_db_errors(tmp_path, capsys):
    assert main(["simulate", "--workload", "poisson-mix", "--jobs", "100", "--policy", "frag-aware", "--check"]) == 0
    assert "mean wait" in capsys.readouterr().out
    assert main(["simulate", "--db", str(tmp_path / "none.db")]) != 0


@pytest.mark.skipif(not TRACE.is_file(), reason="shared Alibaba trace not present")
def test_acceptance_frag_aware_waits_least_on_alibaba():
    """Alibaba v2023 train trace on 5 nodes x 8 H100-80GB: frag-aware's mean wait beats
    no-MIG, the best static partition and greedy."""
    w, spec = trace_workload(TRACE)
    assert spec.gpus == 40 and spec.model == "H100-80GB"
    rep = run_workload(w, spec, ("no-mig", "best-static", "greedy", "frag-aware"))
    waits = {m.policy: m.mean_wait_s for m in rep.results}
    assert all(m.finished == len(w.jobs) for m in rep.results)
    assert waits["greedy"] > 600, "the cluster is sized so that jobs queue"
    for base in BASELINES:
        assert waits["frag-aware"] < waits[base], waits


def test_report_markdown_says_when_jobs_never_ran(tmp_path, capsys):
    """benchmarks/report.py writes docs/benchmarks.md's tables from `bench --json`, whose mean waits are over
    the jobs that ran; `bench`'s own table says when some never did, the Markdown said nothing."""
    trace = small_trace(tmp_path, n=30)
    with open(trace, "a") as f:
        f.write("big,1000,1024,16,1000,,BE,Running,100,5000,105\n")
    assert main(["bench", "--json", "--no-synthetic", "--trace", str(trace), "--nodes", "1",
                 "--policies", "greedy"]) == 0
    out = tmp_path / "bench.json"
    out.write_text(capsys.readouterr().out)
    assert json.loads(out.read_text())["workloads"][0]["results"][0]["finished"] == 26
    assert _run_report(out) == 0
    assert "greedy: 1 of 27 jobs never ran; its times are over the 26 that did." in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--from", "--to"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_simulate_plot_window_must_be_finite_hours(tmp_path, capsys, flag, value):
    """`simulate --plot x.png --from nan` (or inf) simulated the whole workload, then printed matplotlib's
    "Axis limits cannot be NaN or Inf" traceback: refused when parsed now."""
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--workload", "poisson-mix", "--jobs", "5", "--plot", str(tmp_path / "t.png"),
              flag, value])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize("name, expected", [("no-such-folder/t.png", "no folder"), ("t.txt", "format"),
                                            ("t", "format"), (".", "a folder")])
def test_simulate_plot_path_is_checked_before_simulating(tmp_path, capsys, name, expected):
    """A --plot path in a missing folder, or with a suffix matplotlib cannot write, failed with a traceback
    (FileNotFoundError, ValueError) after the whole simulation had run, which was lost; one with no suffix
    ("t") was written as t.png while the output said t. Each is an error now, before the simulation runs."""
    pytest.importorskip("matplotlib")
    path = tmp_path / name
    rc = main(["simulate", "--workload", "poisson-mix", "--jobs", "5", "--plot", str(path)])
    out = capsys.readouterr()
    assert rc == 2 and "--plot" in out.err and expected in out.err and out.out == ""
    assert list(tmp_path.iterdir()) == []



def test_report_markdown_of_a_run_without_a_baseline(tmp_path, capsys):
    """`bench --policies first-fit --json | benchmarks/report.py` ended in "min() arg is an empty sequence"."""
    assert main(["bench", "--json", "--no-synthetic", "--trace", str(small_trace(tmp_path, n=30)), "--nodes", "1",
                 "--policies", "first-fit"]) == 0
    out = tmp_path / "bench.json"
    out.write_text(capsys.readouterr().out)
    assert _run_report(out) == 0
    assert "| first-fit | " in capsys.readouterr().out


class _Flipper:
    """Re-carves its one GPU at every decision and starts nothing: the simulator's safety stop ends it."""

    name = "flipper"

    def decide(self, state):
        from slurm_mig.mig.layout import parse_layout
        from slurm_mig.policies.base import Decision, LayoutChange

        g = state.gpus[0]
        if g.reconfiguring:
            return Decision(policy=self.name)
        target = parse_layout("1g@0" if "7g" in str(g.layout) else "7g@0", g.model)
        return Decision(changes=(LayoutChange(g.node, g.index, target, "flip"),), policy=self.name)


def test_a_simulation_cut_short_by_the_safety_stop_says_so(tmp_path, capsys):
    """After 50 x (jobs + GPUs) + 10,000 decisions the simulator stops (SimResult.meta["stopped"]); bench,
    its Markdown and simulate printed the cut-short run's figures as a finished one's, the stop nowhere."""

    from slurm_mig.policies import _REGISTRY, register_policy

    register_policy("flipper", _Flipper)
    try:
        w = poisson_workload(1, gpus=1, gpus_per_node=1, seed=1)
        rep = run_workload(w, ClusterSpec(1, 1), ["flipper"])
        assert rep.notes["stopped"] == {"flipper": "stopped after 10100 decisions"}
        assert main(["simulate", "--workload", "poisson-mix", "--jobs", "1", "--nodes", "1", "--gpus-per-node", "1",
                     "--policy", "flipper", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["stopped"] == "stopped after 10100 decisions"
        assert main(["simulate", "--workload", "poisson-mix", "--jobs", "1", "--nodes", "1", "--gpus-per-node", "1",
                     "--policy", "flipper"]) == 0
        assert "simulation cut short: stopped after 10100 decisions" in capsys.readouterr().out
    finally:
        _REGISTRY.pop("flipper", None)
    from slurm_mig.sim.bench import bench_json

    out = tmp_path / "bench.json"
    out.write_text(json.dumps(bench_json([rep])))
    assert _run_report(out) == 0
    assert "flipper: simulation cut short (stopped after 10100 decisions" in capsys.readouterr().out


def test_a_run_where_no_job_ran_says_its_times_are_not_available(tmp_path, capsys):
    """With no job run, mean wait, JCT and bounded slowdown were reported as 0 (a bounded slowdown of 0.00 is
    impossible: its floor is 1). They are None in JSON and "n/a" in bench's table, report.py's Markdown and
    simulate's lines."""
    trace = tmp_path / "pods.csv"
    trace.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
                     "deletion_time,scheduled_time\n"
                     + "".join(f"big{i},1000,1024,16,1000,,BE,Running,{100 * i},{100 * i + 5000},{100 * i + 5}\n"
                               for i in range(3)))
    fields = ("mean_wait_s", "p95_wait_s", "max_wait_s", "mean_jct_s", "bounded_slowdown")
    m = compute_metrics(simulate(load_alibaba(trace, time_limits=False), get_policy("greedy"), ClusterSpec(1, 8)))
    assert m.finished == 0 and [getattr(m, f) for f in fields] == [None] * 5
    policies = "no-mig,best-static,greedy,frag-aware"
    assert main(["bench", "--json", "--no-synthetic", "--trace", str(trace), "--nodes", "1",
                 "--policies", policies]) == 0
    out = tmp_path / "bench.json"
    out.write_text(capsys.readouterr().out)
    results = json.loads(out.read_text())["workloads"][0]["results"]
    assert len(results) == 4
    for r in results:
        assert r["finished"] == 0 and [r[f] for f in fields if f in r] == [None] * 4, r
    code = _run_report(out)
    md = capsys.readouterr().out
    assert code == 0
    rows = [line for line in md.splitlines() if line.startswith("| greedy |")]
    assert len(rows) == 1 and rows[0].split(" | ")[1:7] == ["n/a"] * 6, rows
    assert main(["bench", "--no-synthetic", "--trace", str(trace), "--nodes", "1", "--policies", policies]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if "greedy" in line and "│" in line)
    assert [c.strip() for c in row.split("│")[2:8]] == ["n/a"] * 6, row
    assert main(["simulate", "--trace", str(trace), "--nodes", "1", "--policy", "greedy", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [doc["metrics"][f] for f in fields] == [None] * 5
    assert main(["simulate", "--trace", str(trace), "--nodes", "1", "--policy", "greedy"]) == 0
    text = capsys.readouterr().out
    assert "mean wait n/a (bound 0 s), p95 wait n/a, max wait n/a" in text
    assert "mean JCT n/a" in text and "bounded slowdown n/a" in text
