"""The simulator on a mixed site: node groups of different GPU models, a partition each, jobs restricted
to some of them (Job.partition -> PendingJob.nodes); bench's opt-in ``mixed-site`` workload."""

from __future__ import annotations

import json

import pytest

from slurm_mig.cli import main
from slurm_mig.errors import ConfigError, GeometryError, SlurmMigError
from slurm_mig.mig.layout import Slot, parse_layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.policies import get_policy
from slurm_mig.policies.base import Assignment, Decision
from slurm_mig.sim.bench import mixed_site, run_workload, search_static
from slurm_mig.sim.engine import ClusterSpec, NodeGroup, SimConfig, Simulator, simulate
from slurm_mig.sim.metrics import compute_metrics
from slurm_mig.sim.workloads import Job, Workload, base_kind

TINY = (NodeGroup("h100", "H100-80GB", 1, 8), NodeGroup("a30", "A30-24GB", 2, 2))


def tiny(seed: int = 3, n: int = 160):
    return mixed_site(seed, n, TINY, restricted=0.4)


def test_the_mixed_cluster_has_each_groups_nodes_models_and_partitions():
    spec = ClusterSpec.mixed(TINY)
    assert spec.gpus == 12 and spec.nodes == 3 and spec.gpus_per_node == 8
    assert spec.compute_slices == 8 * 7 + 4 * 4
    assert spec.partitions() == {"h100": ("h100-00",), "a30": ("a30-00", "a30-01")}
    sim = Simulator(Workload("empty", []), get_policy("greedy"), spec)
    assert [(g.key, g.model.name) for g in sim.gpus] == (
        [(f"h100-00/{i}", "H100-80GB") for i in range(8)]
        + [(f"a30-0{n}/{i}", "A30-24GB") for n in range(2) for i in range(2)])
    with pytest.raises(GeometryError):  # get_model refuses the joined name: nothing takes it for one model
        get_model(spec.model)


def test_each_node_group_starts_with_its_own_layout():
    """NodeGroup.initial_layout (`explain --replay` starts each model's GPUs as the site's were): each group's
    GPUs hold it; a group without one starts empty; ClusterSpec.initial_layout, one model's, is still refused."""
    spec = ClusterSpec.mixed([NodeGroup("h100", "H100-80GB", 1, 2, "3g@0,3g@4"),
                              NodeGroup("a30", "A30-24GB", 1, 2, "4g@0"),
                              NodeGroup("more", "A30-24GB", 1, 1)])
    sim = Simulator(Workload("empty", []), get_policy("greedy"), spec)
    assert [(g.key, str(g.layout)) for g in sim.gpus] == [
        ("h100-00/0", "3g@0,3g@4"), ("h100-00/1", "3g@0,3g@4"), ("a30-00/0", "4g@0"), ("a30-00/1", "4g@0"),
        ("more-00/0", "empty")]
    from dataclasses import replace
    with pytest.raises(ConfigError, match="NodeGroup.initial_layout"):
        Simulator(Workload("empty", []), get_policy("greedy"), replace(spec, initial_layout="7g@0"))


@pytest.mark.parametrize("policy", ["first-fit", "greedy", "frag-aware", "rl"])
def test_mixed_site_jobs_run_only_where_their_partition_and_size_allow(policy):
    w, spec = tiny()
    parts = spec.partitions()
    model_of = {node: m for node, m, _n, _p in spec.node_list()}
    restricted = [j for j in w.jobs if j.partition]
    big_only = [j for j in w.jobs if base_kind(j.profile) in ("3g", "7g")]
    assert {j.partition for j in restricted} == {"h100", "a30"} and big_only  # the test tests something
    r = simulate(w, get_policy(policy), spec, SimConfig(check=True))
    assert r.unfinished == 0
    on_a30 = 0
    for rec in r.jobs:
        j = rec.job
        if j.partition:
            assert rec.node in parts[j.partition], (j, rec.node)
        model = model_of[rec.node]
        for _gi, slot in rec.instances:
            assert base_kind(slot.profile) == base_kind(j.profile)
        if base_kind(j.profile) in ("3g", "7g"):
            assert model == "H100-80GB", (j, rec.node)
        on_a30 += model == "A30-24GB"
    assert on_a30 > 10  # the small model is used, not left idle
    m = compute_metrics(r)
    assert 0 < m.utilization <= 1


def test_best_static_on_a_mixed_site_partitions_the_small_model_to_its_own_sizes():
    w, spec = tiny()
    pol, r, _m = search_static(w, spec)
    assert r.unfinished == 0
    plan = list(pol.plan)
    assert len(plan) == spec.gpus
    assert all("3g" not in p and "7g" not in p for p in plan[8:])  # the A30s: sizes an A30 has
    assert all(p for p in plan[8:])
    assert "7g@0" in plan[:8]  # some H100 left whole for the 7g jobs


def test_the_simulator_refuses_a_placement_outside_the_jobs_partition():
    spec = ClusterSpec.mixed(TINY)
    w = Workload("one", [Job("a", 0.0, "1g", 1, 60.0, partition="a30")])

    class Rogue:
        name, version = "rogue", "1"

        def decide(self, state):
            return Decision(assignments=(Assignment("a", "h100-00", ((0, Slot(0, "1g.10gb")),), "x"),),
                            policy="rogue")

    sim = Simulator(w, Rogue(), spec)
    sim.reset()
    # the 1g.10gb exists only after carving it; carve first so the only thing wrong is the node
    g = sim.by_key["h100-00/0"]
    g.layout = parse_layout("1g@0", g.model)
    with pytest.raises(SlurmMigError, match="outside its partition a30"):
        sim.apply(Rogue().decide(sim.state()))


def test_unknown_partitions_and_whole_gpu_policies_are_refused_on_a_mixed_site():
    spec = ClusterSpec.mixed(TINY)
    with pytest.raises(ConfigError, match="partition 'v100'"):
        Simulator(Workload("w", [Job("a", 0.0, "1g", 1, 60.0, partition="v100")]), get_policy("greedy"), spec)
    with pytest.raises(ConfigError, match="one-model cluster has none"):
        Simulator(Workload("w", [Job("a", 0.0, "1g", 1, 60.0, partition="a30")]), get_policy("greedy"),
                  ClusterSpec(1, 8))
    with pytest.raises(ConfigError, match="whole GPUs"):
        Simulator(Workload("w", []), get_policy("no-mig"), spec)
    w, spec = tiny(n=40)
    rep = run_workload(w, spec, ("no-mig", "greedy"))
    assert [m.policy for m in rep.results] == ["greedy"] and "no-mig" in rep.notes["not_run"]


def test_mixed_site_is_seeded():
    a, _ = tiny(seed=5)
    b, _ = tiny(seed=5)
    c, _ = tiny(seed=6)
    assert a.jobs == b.jobs and a.jobs != c.jobs


def test_bench_runs_mixed_site_only_when_named(capsys, monkeypatch):
    from slurm_mig.sim import bench

    monkeypatch.setattr(bench, "default_trace", lambda: None)
    assert main(["bench", "--json", "--no-synthetic", "--policies", "greedy"]) == 0
    assert json.loads(capsys.readouterr().out) == {"workloads": []}
    assert main(["bench", "--json", "--no-synthetic", "--workload", "mixed-site", "--policies", "greedy"]) == 0
    doc = json.loads(capsys.readouterr().out)
    wl = next(w for w in doc["workloads"] if w["name"] == "mixed-site")
    assert wl["gpus"] == 32 and wl["gpu_model"] == "H100-80GB+A30-24GB"
    assert [p["name"] for p in wl["partitions"]] == ["h100", "a30"]
    assert wl["results"][0]["finished"] == wl["jobs"] == 2000
    assert main(["bench", "--json", "--no-synthetic", "--workload", "nope"]) != 0
    assert "unknown bench workload 'nope'" in capsys.readouterr().err


def test_simulate_runs_the_mixed_site_and_names_both_models(capsys):
    """`simulate --workload` offered only one-model workloads: bench's mixed-site was not among its choices, and
    simulate built a one-model cluster of --model whatever the workload. It now runs mixed-site on its own
    cluster (--jobs, --seed as the other synthetic workloads; --seed 6 is bench's) and names both models and
    their partitions."""
    assert main(["simulate", "--workload", "mixed-site", "--jobs", "60", "--policy", "greedy", "--check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mixed-site: 60 jobs, 2 nodes x 8 H100-80GB (partition h100) + "
                          "2 nodes x 8 A30-24GB (partition a30), policy greedy"), out
    assert "mean wait" in out and "never ran" not in out
    assert main(["simulate", "--workload", "mixed-site", "--jobs", "60", "--seed", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpus"] == 32 and doc["model"] == "H100-80GB+A30-24GB"
    assert [(p["name"], p["model"]) for p in doc["groups"]] == [("h100", "H100-80GB"), ("a30", "A30-24GB")]
    assert doc["partitions_kept"] is True
    w, spec = mixed_site(2, 60)
    assert doc["metrics"] == {**compute_metrics(simulate(w, get_policy("frag-aware"), spec)).to_json(),
                              "wall_s": doc["metrics"]["wall_s"]}
    # its cluster is fixed: one named is refused, not ignored
    assert main(["simulate", "--workload", "mixed-site", "--jobs", "20", "--model", "A30-24GB"]) == 2
    assert "--model does not apply to --workload mixed-site" in capsys.readouterr().err


def test_the_timeline_of_a_mixed_site_sizes_each_gpu_row_by_its_own_model(tmp_path, capsys):
    """`simulate --plot` read one GPU model (get_model(spec.model), which a mixed site's joined name is not) and
    sized every row 8 slices; each row is now its own model's memory slices tall (H100 8, A30 4), labelled with
    it, and every bar lies inside its GPU's row."""
    from slurm_mig.sim.plot import timeline_data

    w, spec = tiny(n=80)
    result = Simulator(w, get_policy("frag-aware"), spec, SimConfig(record=True)).run()
    data = timeline_data(result)
    assert [(r.gpu, r.model, r.slices) for r in data.rows] == (
        [(f"h100-00/{i}", "H100-80GB", 8) for i in range(8)]
        + [(f"a30-0{n}/{i}", "A30-24GB", 4) for n in range(2) for i in range(2)])
    assert [r.y0 for r in data.rows] == [i * 9.5 for i in range(8)] + [76 + i * 5.5 for i in range(4)]
    assert data.height == 76 + 4 * 5.5 and data.hidden == 0
    rows = sorted((r.y0, r.y0 + r.slices) for r in data.rows)
    seen = set()
    for items in data.bars.values():
        for _x, _w, y, h in items:
            top, bottom = next((a, b) for a, b in rows if a <= y < b)
            assert y + h <= bottom, (y, h, top, bottom)
            seen.add(top)
    assert seen == {a for a, _b in rows}, "every GPU drew something"
    assert {r.gpu for r in timeline_data(result, max_gpus=9).rows} == {f"h100-00/{i}" for i in range(8)} | {"a30-00/0"}
    pytest.importorskip("matplotlib")
    png = tmp_path / "mixed.png"
    assert main(["simulate", "--workload", "mixed-site", "--jobs", "60", "--plot", str(png), "--job", "x3"]) == 0
    assert f"timeline written to {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
