"""Replaying a state DB's outcomes on the site's own GPUs when the site holds more than one GPU model
(slurm_mig.sim.workloads.replay_site): a node group per model, jobs kept to the partitions the outcomes
show to be those groups, else to any group whose model has their size."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from slurm_mig.mig.profiles import get_model
from slurm_mig.policies import get_policy
from slurm_mig.sim.engine import ClusterSpec, NodeGroup, SimConfig, simulate
from slurm_mig.sim.workloads import (
    base_kind, load_outcomes_db, outcomes_db_cluster, outcomes_db_groups, replay_site, site_cluster)

store_mod = pytest.importorskip("slurm_mig.store")

H100_KINDS = ["1g", "2g", "3g", "4g", "7g", "3g"]
A30_PROFILES = ["1g.6gb", "2g.12gb", "4g.24gb", "1g.6gb"]  # as an A30 node records them: no H100 has these names


def mixed_db(path: Path, n: int = 60, partitions: str = "one-each", a30_gpus: int = 2) -> Path:
    """A site of one node of 2 H100-80GB (h1) and one of ``a30_gpus`` A30-24GB (a1), ``n`` finished jobs on
    both. ``partitions``: "one-each" (h100 on h1, a30 on a1), "spanning" (gpu on both), "none" ("")."""
    store = store_mod.open_store(str(path))
    store.replace_observed("h1", [{"gpu": g, "uuid": f"GPU-h{g}", "model": "H100-80GB", "mig_enabled": True}
                                  for g in (0, 1)], [], now=1000.0)
    store.replace_observed("a1", [{"gpu": g, "uuid": f"GPU-a{g}", "model": "A30-24GB", "mig_enabled": True}
                                  for g in range(a30_gpus)], [], now=1000.0)
    rng = random.Random(7)
    t = 1000.0
    for i in range(n):
        t += rng.uniform(0, 15)
        on_a30 = i % 2 == 1
        prof = rng.choice(A30_PROFILES if on_a30 else H100_KINDS)
        part = {"one-each": "a30" if on_a30 else "h100", "spanning": "gpu", "none": ""}[partitions]
        run = rng.uniform(60, 400)
        start = t + rng.uniform(0, 20)
        store.record_outcome(str(i + 1), state="COMPLETED", profile=prof, count=1, node="a1" if on_a30 else "h1",
                             partition=part, submit_time=t, start_time=start, end_time=start + run,
                             time_limit_s=900.0, now=start + run)
    store.close()
    return path


def single_db(path: Path, n: int = 40) -> Path:
    store = store_mod.open_store(str(path))
    store.replace_observed("n1", [{"gpu": g, "uuid": f"GPU-{g}", "model": "H100-80GB", "mig_enabled": True}
                                  for g in (0, 1)], [], now=1000.0)
    rng = random.Random(1)
    t = 1000.0
    for i in range(n):
        t += rng.uniform(0, 30)
        run = rng.uniform(20, 200)
        start = t + rng.uniform(0, 20)
        store.record_outcome(str(i + 1), state="COMPLETED", profile=rng.choice(["1g", "2g", "3g", "7g"]), count=1,
                             node="n1", partition="gpu", submit_time=t, start_time=start, end_time=start + run,
                             time_limit_s=600.0, now=start + run)
    store.close()
    return path


def site(db):
    return replay_site(db, "simulate", "time its queue")


def kinds_of(model: str) -> set[str]:
    return {p.kind for p in get_model(model).basic_profiles}


def test_a_mixed_db_replays_on_a_node_group_per_model_not_on_the_most_common_one(tmp_path):
    """The replay took the most common model, the nodes holding it and the most on one node: this site of
    2 H100s beside 4 A30s replayed on 1 x 4 A30s, where the H100 jobs' 3g and 7g do not exist (skipped), or,
    with the H100s the more common, the A30 jobs on H100s. Each model is a node group of its own now."""
    db = mixed_db(tmp_path / "state.db", a30_gpus=4)
    assert outcomes_db_cluster(db) == ("A30-24GB", 1, 4)  # the most common model, as before
    assert outcomes_db_groups(db) == [("A30-24GB", 1, 4), ("H100-80GB", 1, 2)]
    s = site(db)
    assert [(g.model, g.nodes, g.gpus_per_node) for g in s.spec.groups] == [("A30-24GB", 1, 4), ("H100-80GB", 1, 2)]
    assert s.spec.gpus == 6 and s.spec.gpus_by_model() == {"A30-24GB": 4, "H100-80GB": 2}
    assert "A30-24GB" in s.describe() and "H100-80GB" in s.describe()
    w = load_outcomes_db(db, model=s.spec.model, nodes=s.spec.nodes, gpus_per_node=s.spec.gpus_per_node,
                         partitions=s.partitions)
    # every job loads: the A30 profiles by the A30's names, the H100's 3g and 7g by the H100's
    assert len(w.jobs) == 60 and not any(w.meta["skipped"].values())
    assert {base_kind(j.profile) for j in w.jobs} >= {"3g", "7g", "4g"}


def test_jobs_keep_their_partition_when_the_outcomes_show_one_partition_per_model(tmp_path):
    db = mixed_db(tmp_path / "state.db")
    s = site(db)
    assert s.partitions == {"a30": "A30-24GB", "h100": "H100-80GB"}
    assert {g.name: g.model for g in s.spec.groups} == {"a30": "A30-24GB", "h100": "H100-80GB"}
    w = load_outcomes_db(db, model=s.spec.model, partitions=s.partitions)
    assert {j.partition for j in w.jobs} == {"a30", "h100"} and w.meta["partitioned"] == 60
    r = simulate(w, get_policy("first-fit"), s.spec, SimConfig(check=True))
    assert r.unfinished == 0
    for rec in r.jobs:
        assert rec.node.startswith(rec.job.partition + "-"), (rec.job.job_id, rec.job.partition, rec.node)


@pytest.mark.parametrize("how,why", [("spanning", "partition gpu ran jobs on more than one model"),
                                     ("none", "no partition")])
def test_jobs_go_to_any_group_with_their_size_when_partitions_do_not_map_onto_models(tmp_path, how, why):
    db = mixed_db(tmp_path / "state.db", partitions=how)
    s = site(db)
    assert s.partitions == {} and why in s.partitions_why
    assert {g.name for g in s.spec.groups} == {"H100-80GB", "A30-24GB"}
    w = load_outcomes_db(db, model=s.spec.model, partitions=s.partitions)
    assert {j.partition for j in w.jobs} == {""}


def test_a_group_whose_nodes_ran_two_partitions_keeps_no_partition(tmp_path):
    db = mixed_db(tmp_path / "state.db")
    store = store_mod.open_store(str(db))
    store.record_outcome("x1", state="COMPLETED", profile="1g.6gb", count=1, node="a1", partition="debug",
                         submit_time=5000.0, start_time=5000.0, end_time=5100.0, now=5100.0)
    store.close()
    s = site(db)
    assert s.partitions == {} and "2 partitions (a30, debug)" in s.partitions_why


@pytest.mark.parametrize("policy", ["first-fit", "greedy", "frag-aware", "rl"])
@pytest.mark.parametrize("how", ["one-each", "spanning"])
def test_no_replayed_job_runs_on_a_model_lacking_its_size(tmp_path, policy, how):
    db = mixed_db(tmp_path / "state.db", n=80, partitions=how)
    s = site(db)
    w = load_outcomes_db(db, model=s.spec.model, partitions=s.partitions)
    r = simulate(w, get_policy(policy), s.spec, SimConfig(check=True))
    assert r.unfinished == 0
    model_of = {node: model for node, model, _n, _p in s.spec.node_list()}
    used = set()
    for rec in r.jobs:
        m = model_of[rec.node]
        used.add(m)
        assert base_kind(rec.job.profile) in kinds_of(m), (rec.job.job_id, rec.job.profile, rec.node)
    assert used == {"H100-80GB", "A30-24GB"}


def test_a_single_model_db_replays_exactly_as_before(tmp_path):
    """One readable model: the same cluster tuple and one-model spec as site_cluster's, no groups, no
    partition on any job (the recorded 'gpu' stays out of the replay), the same workload."""
    db = single_db(tmp_path / "state.db")
    assert site_cluster(db, "x", "y") == ("H100-80GB", 1, 2)
    s = site(db)
    assert s.spec == ClusterSpec(1, 2, "H100-80GB") and not s.spec.groups and s.partitions == {}
    assert s.describe() == "1 x 2 H100-80GB"
    a = load_outcomes_db(db, model="H100-80GB", nodes=1, gpus_per_node=2)
    b = load_outcomes_db(db, model=s.spec.model, nodes=s.spec.nodes, gpus_per_node=s.spec.gpus_per_node,
                         partitions=s.partitions)
    assert a.jobs == b.jobs and a.meta == b.meta and (a.model, a.nodes, a.gpus_per_node) == (b.model, b.nodes,
                                                                                            b.gpus_per_node)
    assert all(j.partition == "" for j in b.jobs)


def test_simulate_db_replays_a_mixed_site_on_both_models_and_says_so(tmp_path, capsys):
    import json

    from slurm_mig.cli import main

    db = mixed_db(tmp_path / "state.db")
    assert main(["simulate", "--db", str(db), "--policy", "frag-aware", "--json", "--check"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpus"] == 4 and doc["unfinished"] == 0
    assert [(g["name"], g["model"], g["nodes"], g["gpus_per_node"]) for g in doc["groups"]] == [
        ("a30", "A30-24GB", 1, 2), ("h100", "H100-80GB", 1, 2)]
    assert doc["partitions_kept"] is True and doc["metrics"]["finished"] == 60
    assert main(["simulate", "--db", str(db), "--policy", "greedy"]) == 0
    out = capsys.readouterr().out
    assert "1 x 2 A30-24GB (partition a30) + 1 x 2 H100-80GB (partition h100)" in out, out
    assert "jobs keep their partition" in out
    # told the cluster (any of --model, --nodes, --gpus-per-node), it replays on one model as before
    assert main(["simulate", "--db", str(db), "--policy", "greedy", "--json", "--model", "H100-80GB"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "H100-80GB" and "groups" not in doc


def test_simulate_db_on_a_single_model_db_prints_what_it_printed(tmp_path, capsys):
    import json

    from slurm_mig.cli import main

    db = single_db(tmp_path / "state.db")
    assert main(["simulate", "--db", str(db), "--policy", "greedy", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["model"], doc["nodes"], doc["gpus"]) == ("H100-80GB", 1, 2) and "groups" not in doc
    assert main(["simulate", "--db", str(db), "--policy", "greedy"]) == 0
    assert capsys.readouterr().out.startswith("replay:state.db: 40 jobs, 1 nodes x 2 H100-80GB, policy greedy")


def test_retrain_judges_the_candidate_on_a_mixed_sites_own_gpus(tmp_path):
    pytest.importorskip("torch")
    from training.retrain import cluster_of, format_report, retrain

    db = mixed_db(tmp_path / "state.db", partitions="spanning")
    assert cluster_of(db) == (2, 2, "A30-24GB+H100-80GB")
    r = retrain(db, store=tmp_path / "store", minutes=0.1, iterations=1, out=tmp_path / "work", replays=2,
                hold_caps="")
    c = r["cluster"]
    assert [(g["model"], g["nodes"], g["gpus_per_node"]) for g in c["groups"]] == [("A30-24GB", 1, 2),
                                                                                   ("H100-80GB", 1, 2)]
    assert c["partitions_kept"] is False and r["outcomes"] == 60
    assert set(r["evaluation"]) == {"candidate", "current", "frag-aware", "first-fit"}
    assert all(m["mean_wait_s"] >= 0 for m in r["evaluation"].values())
    first = format_report(r).splitlines()[0]
    assert "cluster 1 x 2 A30-24GB + 1 x 2 H100-80GB" in first, first
