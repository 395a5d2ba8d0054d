"""Workload loaders and generators: Alibaba v2023 CSV, synthetic families, state-DB replay."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import pytest

from slurm_mig.errors import ConfigError
from slurm_mig.sim.workloads import (
    MilliMap, load_alibaba, load_outcomes_db, miso_workload, poisson_workload, rl_mig_workload,
    rl_scaling_times,
)

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / ".." / "shared" / "traces" / "alibaba-v2023-train.csv"

SAMPLE = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p-whole,12000,16384,1,1000,,LS,Running,100,1100,100
p-460,6000,12288,1,460,,BE,Failed,150,450,160
p-320,6000,12288,1,320,,BE,Succeeded,200,260,200
p-230,6000,12288,1,230,,BE,Failed,210,300,220
p-110,6000,12288,1,110,,BE,Failed,220,330,230
p-810,6000,12288,1,810,,LS,Running,230,1230,230
p-eight,96000,786432,8,1000,,LS,Running,300,900,310
p-never,6000,12288,1,460,,BE,Pending,400,500,
p-cpu,8000,8192,0,0,,BE,Running,410,900,410
p-bad,6000,12288,1,460,,BE,Failed,420,420,420
"""


def write_sample(tmp_path: Path) -> Path:
    p = tmp_path / "pods.csv"
    p.write_text(SAMPLE)
    return p


def test_alibaba_loader_on_a_literal_sample(tmp_path):
    w = load_alibaba(write_sample(tmp_path), time_limits=False)
    assert w.meta["rows"] == 10
    assert w.meta["skipped"] == {"never_ran": 1, "no_gpu": 1, "bad_row": 1}
    got = {j.job_id: (j.profile, j.count, j.submit_time, j.duration_s) for j in w.jobs}
    assert got == {
        "p-whole": ("7g", 1, 0.0, 1000.0),
        "p-460": ("4g", 1, 50.0, 290.0),  # duration = deletion - scheduled
        "p-320": ("3g", 1, 100.0, 60.0),
        "p-230": ("2g", 1, 110.0, 80.0),
        "p-110": ("1g", 1, 120.0, 100.0),
        "p-810": ("7g", 1, 130.0, 1000.0),  # more than 4/7 of a GPU: a whole one
        "p-eight": ("7g", 8, 200.0, 590.0),
    }
    assert all(j.time_limit_s is None for j in w.jobs)


def test_alibaba_time_limits_over_estimate(tmp_path):
    w = load_alibaba(write_sample(tmp_path), seed=3)
    for j in w.jobs:
        assert j.time_limit_s >= j.duration_s and j.time_limit_s % 60 == 0
    w2 = load_alibaba(write_sample(tmp_path), seed=3)
    assert [j.time_limit_s for j in w.jobs] == [j.time_limit_s for j in w2.jobs]


def test_milli_map_is_configurable(tmp_path):
    mm = MilliMap.parse("1g:200,3g:500,7g:1000")
    assert mm.kind(110) == "1g" and mm.kind(230) == "3g" and mm.kind(460) == "3g" and mm.kind(810) == "7g"
    w = load_alibaba(write_sample(tmp_path), milli_map=mm, time_limits=False)
    assert {j.job_id: j.profile for j in w.jobs}["p-460"] == "3g"
    with pytest.raises(ConfigError):
        MilliMap.parse("1g:100,2g:200")  # does not reach a whole GPU
    with pytest.raises(ConfigError):
        MilliMap.parse("1g=100")


def test_a_milli_map_to_a_size_the_gpus_lack_is_refused(tmp_path):
    """`simulate --trace T --milli-map 5g:500,7g:1000` loaded every pod as a 5g, which no H100 has: all of
    them "never ran", metrics of nothing, exit 0. The default map on A30s (no 3g, no 7g) left those pods
    unrun the same way."""
    sample = write_sample(tmp_path)
    with pytest.raises(ConfigError, match="'5g', which H100-80GB has no MIG profile"):
        load_alibaba(sample, milli_map=MilliMap.parse("5g:500,7g:1000"))
    with pytest.raises(ConfigError, match="'3g', which A30-24GB has no MIG profile"):
        load_alibaba(sample, model="A30-24GB")
    w = load_alibaba(sample, model="A30-24GB", milli_map=MilliMap.parse("1g:250,2g:500,4g:1000"), time_limits=False)
    assert {j.job_id: j.profile for j in w.jobs}["p-810"] == "4g"
    w = load_alibaba(sample, milli_map=MilliMap.parse("1g.20gb:142,7g:1000"), time_limits=False)  # a full name
    assert {j.job_id: j.profile for j in w.jobs}["p-110"] == "1g.20gb"


def test_alibaba_loader_rejects_other_csvs(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="missing column"):
        load_alibaba(p)
    with pytest.raises(ConfigError):
        load_alibaba(tmp_path / "absent.csv")


@pytest.mark.parametrize("damage", ["not-text", "gzip"])
def test_alibaba_loader_rejects_a_file_that_is_not_csv_text(tmp_path, damage, capsys):
    """`simulate --trace` (and `bench --trace`) on a file that is not UTF-8 text (a .csv.gz not unpacked, a
    stray byte) printed a UnicodeDecodeError traceback. Found giving simulate a binary file."""
    import gzip

    from slurm_mig.cli import main

    p = tmp_path / "pods.csv"
    if damage == "not-text":
        p.write_bytes(SAMPLE.encode()[:80] + b"\xba\xff\xfe" + SAMPLE.encode()[80:])
    else:
        p.write_bytes(gzip.compress(SAMPLE.encode()))
    with pytest.raises(ConfigError, match=f"{p} is not an Alibaba v2023 pod list"):
        load_alibaba(p)
    assert main(["simulate", "--trace", str(p)]) == 2
    assert "is not an Alibaba v2023 pod list" in capsys.readouterr().err


@pytest.mark.skipif(not TRACE.is_file(), reason="shared Alibaba trace not present")
def test_alibaba_real_trace_counts():
    w = load_alibaba(TRACE)
    # README: 3,837 pods, 3,258 with a GPU; 319 never ran (23 of those had no GPU either).
    assert w.meta["rows"] == 3837
    assert w.meta["skipped"] == {"never_ran": 319, "no_gpu": 556, "bad_row": 0}
    assert len(w.jobs) == 2962
    mix = w.profile_mix()
    assert set(mix) == {"1g", "2g", "3g", "4g", "7g"}
    assert max(j.count for j in w.jobs) == 8


def test_synthetic_generators_are_seeded():
    a = poisson_workload(200, gpus=8, seed=1)
    b = poisson_workload(200, gpus=8, seed=1)
    c = poisson_workload(200, gpus=8, seed=2)
    key = lambda w: [(j.profile, j.count, round(j.submit_time, 6), round(j.duration_s, 6)) for j in w.jobs]  # noqa: E731
    assert key(a) == key(b) != key(c)
    assert all(j.time_limit_s >= j.duration_s for j in a.jobs)
    for w in (rl_mig_workload("mix_extreme", 100, seed=1), miso_workload(100, seed=1)):
        assert len(w) == 100 and all(j.duration_s > 0 for j in w.jobs)


def test_rl_mig_recurrence():
    perfect = rl_scaling_times(700.0, 0.0)
    assert perfect["1g"] == 700.0 and perfect["7g"] == pytest.approx(100.0) and perfect["2g"] == pytest.approx(350.0)
    none = rl_scaling_times(700.0, 1.0)
    assert all(v == pytest.approx(700.0) for v in none.values())


def test_miso_jobs_never_ask_for_a_size_they_do_not_fit():
    w = miso_workload(400, seed=2)
    for j in w.jobs:
        assert math.isfinite(j.speed.factor(j.profile))
        if j.speed.name == "miso:bert_train8":
            assert j.profile in ("3g", "4g", "7g")


def test_replay_of_recorded_outcomes(tmp_path):
    db = tmp_path / "state.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE outcomes (job_id TEXT PRIMARY KEY, profile TEXT NOT NULL, count INTEGER NOT NULL,"
                " submit_time REAL, start_time REAL, end_time REAL, time_limit_s REAL, state TEXT)")
    con.executemany("INSERT INTO outcomes VALUES (?,?,?,?,?,?,?,?)", [
        ("10", "3g.40gb", 1, 1000.0, 1010.0, 1110.0, 600.0, "COMPLETED"),
        ("11", "1g", 2, 1005.0, 1005.0, 1065.0, None, "COMPLETED"),
        ("12", "1g", 1, 1006.0, None, None, None, "CANCELLED"),  # never ran
        ("13", "9g", 1, 1007.0, 1010.0, 1020.0, None, "COMPLETED"),  # unknown profile
        ("14", "7g", 1, None, 1100.0, 1200.0, None, "COMPLETED"),  # no submit time: start it is
    ])
    con.commit()
    con.close()
    w = load_outcomes_db(db)
    assert w.meta["skipped"] == {"no_run_time": 1, "unknown_profile": 1, "not_a_number": 0}
    got = {j.job_id: (j.profile, j.count, j.submit_time, j.duration_s, j.time_limit_s) for j in w.jobs}
    assert got == {"10": ("3g", 1, 0.0, 100.0, 600.0), "11": ("1g", 2, 5.0, 60.0, None),
                   "14": ("7g", 1, 100.0, 100.0, None)}


def test_replay_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_outcomes_db(tmp_path / "nope.db")
    db = tmp_path / "empty.db"
    sqlite3.connect(db).close()
    with pytest.raises(ConfigError, match="no 'outcomes' table"):
        load_outcomes_db(db)


def test_replay_skips_and_counts_rows_with_text_in_a_number_column(tmp_path):
    """SQLite stores whatever a column is given: a hand-edited or imported DB can hold a date as text."""
    store_mod = pytest.importorskip("slurm_mig.store")
    path = tmp_path / "slurm-mig.db"
    store = store_mod.open_store(path)
    try:
        for i in range(4):
            store.record_outcome(str(100 + i), state="COMPLETED", profile="2g", count=1, submit_time=50.0 + i,
                                 start_time=60.0 + i, end_time=360.0, now=400.0)
    finally:
        store.close()
    con = sqlite3.connect(path)
    con.execute("UPDATE outcomes SET start_time = '2026-01-01 10:00' WHERE job_id = '101'")
    con.execute("UPDATE outcomes SET end_time = 'soon' WHERE job_id = '102'")
    con.execute("UPDATE outcomes SET submit_time = x'00' WHERE job_id = '103'")
    con.commit()
    con.close()
    w = load_outcomes_db(path)
    assert [j.job_id for j in w.jobs] == ["100"]
    assert w.meta["skipped"]["not_a_number"] == 3 and w.meta["rows"] == 4


def test_synthetic_workloads_need_a_gpu(capsys):
    from slurm_mig.cli import main

    with pytest.raises(ConfigError, match="at least one GPU"):
        poisson_workload(10, gpus=0)
    for argv in (["--gpus-per-node", "0"], ["--nodes", "-1"], ["--nodes", "two"]):
        with pytest.raises(SystemExit) as exc:
            main(["simulate", "--workload", "poisson-mix", "--jobs", "20", *argv])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Traceback" not in err
        assert f"argument {argv[0]}:" in err.splitlines()[-1]


def test_replay_of_a_real_state_store(tmp_path):
    """Against the store's own schema, written through its own API."""
    store_mod = pytest.importorskip("slurm_mig.store")
    path = tmp_path / "slurm-mig.db"
    store = store_mod.open_store(path)
    try:
        store.record_outcome("101", state="COMPLETED", profile="2g", count=1, submit_time=50.0, start_time=60.0,
                             end_time=360.0, time_limit_s=900.0, now=400.0)
        store.record_outcome("102", state="FAILED", profile="7g.80gb", count=2, submit_time=70.0, start_time=80.0,
                             end_time=95.0, now=400.0)
    finally:
        store.close()
    w = load_outcomes_db(path)
    got = {j.job_id: (j.profile, j.count, j.submit_time, j.duration_s, j.time_limit_s) for j in w.jobs}
    assert got == {"101": ("2g", 1, 0.0, 300.0, 900.0), "102": ("7g", 2, 20.0, 15.0, None)}


def test_replay_has_each_run_of_a_reused_job_id_as_a_job_of_its_own(tmp_path):
    """The retraining trace: a job id Slurm reused (or requeued after it ended) ran twice; its second run
    was missing (one outcome per job id), and two jobs of one id would be one to the simulator."""
    store_mod = pytest.importorskip("slurm_mig.store")
    path = tmp_path / "slurm-mig.db"
    store = store_mod.open_store(path)
    try:
        for submit, start, end in ((50.0, 60.0, 360.0), (1000.0, 1030.0, 1090.0)):
            if submit > 50.0:
                store.restart_job("101", now=submit, reason="live in Slurm again", submit_time=submit)
            else:
                store.upsert_job("101", profile="2g", submit_time=submit, time_limit_s=900.0, now=submit)
            store.set_job_state("101", "RUNNING", now=start, node="n1")
            assert store.record_outcome("101", state="COMPLETED", exit_code=0, end_time=end, now=end)
            store.set_job_state("101", "COMPLETED", now=end)
        store.record_outcome("102", state="FAILED", profile="7g.80gb", count=2, submit_time=70.0, start_time=80.0,
                             end_time=95.0, now=400.0)
    finally:
        store.close()
    w = load_outcomes_db(path)
    got = {j.job_id: (j.profile, j.count, j.submit_time, j.duration_s, j.time_limit_s) for j in w.jobs}
    assert got == {"101": ("2g", 1, 0.0, 300.0, 900.0), "102": ("7g", 2, 20.0, 15.0, None),
                   "101#2": ("2g", 1, 950.0, 60.0, 900.0)}


def test_simulate_db_replays_on_the_sites_gpus(tmp_path, capsys):
    """`simulate --db` (and the command `explain` prints) used to replay any site on 1 node x 8 H100-80GB:
    an A30 site's 4g jobs (a whole A30) became half an H100, and 3 nodes' history queued on one."""
    from slurm_mig.cli import main

    store_mod = pytest.importorskip("slurm_mig.store")
    path = tmp_path / "slurm-mig.db"
    store = store_mod.open_store(path)
    try:
        for n in ("gpu01", "gpu02", "gpu03"):
            store.replace_observed(n, [{"gpu": g, "model": "A30-24GB", "mig_enabled": True} for g in range(4)], [],
                                   now=10.0)
        store.replace_observed("login", [{"gpu": 0, "model": None, "mig_enabled": False}], [], now=10.0)
        for i in range(12):
            store.record_outcome(str(100 + i), state="COMPLETED", profile="4g", count=1, submit_time=50.0,
                                 start_time=60.0, end_time=360.0, now=400.0)
    finally:
        store.close()
    assert main(["simulate", "--db", str(path), "--policy", "greedy", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["model"], doc["nodes"], doc["gpus"]) == ("A30-24GB", 3, 12)
    assert doc["metrics"]["finished"] == 12
    # 12 whole-GPU jobs on 12 GPUs all start at once: no one waits for another.
    assert doc["metrics"]["max_wait_s"] < 10
    # Told otherwise, it does as told.
    assert main(["simulate", "--db", str(path), "--policy", "greedy", "--json", "--model", "H100-80GB",
                 "--nodes", "1", "--gpus-per-node", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["model"], doc["nodes"], doc["gpus"]) == ("H100-80GB", 1, 2)


def test_the_replay_cluster_leaves_out_the_gpus_the_controller_leaves_out_of_the_policys_view(tmp_path):
    """Since 5e1847c a GPU of a known model whose instances its table does not allow (a newer node's profile, such
    as a driver's '+gfx' variant) is blocked and left out of the policy's view (Store.cluster_state), never given a
    MIG job; outcomes_db_cluster (retrain's and simulate --db's cluster) still counted it, so a site of one readable
    node beside two such nodes was replayed on 3 x 2 GPUs, three times those its policy places on. It counts the
    GPUs cluster_state holds now; a GPU blocked for another reason (a MIG mode change pending) is in both."""
    from slurm_mig.sim.workloads import outcomes_db_cluster

    store_mod = pytest.importorskip("slurm_mig.store")
    path = tmp_path / "state.db"
    store = store_mod.open_store(path)
    try:
        store.replace_observed("n1", [{"gpu": g, "uuid": f"GPU-n1-{g}", "model": "H100-80GB", "mig_enabled": True}
                                      for g in (0, 1)], [], now=10.0)
        for n in ("n2", "n3"):
            store.replace_observed(
                n, [{"gpu": g, "uuid": f"GPU-{n}-{g}", "model": "H100-80GB", "mig_enabled": True} for g in (0, 1)],
                [{"gpu": g, "profile": "3g.40gb+gfx", "start": 0, "uuid": f"MIG-{n}-{g}"} for g in (0, 1)], now=10.0)
        view = {(g.node, g.index) for g in store.cluster_state(now=20.0).gpus}
        assert view == {("n1", 0), ("n1", 1)}
        assert outcomes_db_cluster(path) == ("H100-80GB", 1, 2)
        store.replace_observed("n4", [{"gpu": 0, "uuid": "GPU-n4-0", "model": "H100-80GB", "mig_enabled": True,
                                       "mig_pending": False}], [], now=10.0)
        assert ("n4", 0) in {(g.node, g.index) for g in store.cluster_state(now=20.0).gpus}
    finally:
        store.close()
    assert outcomes_db_cluster(path) == ("H100-80GB", 2, 2)


def test_simulate_db_refuses_a_db_that_records_no_gpu_its_policy_places_on(tmp_path, capsys):
    """`simulate --db` on a state DB that records no MIG GPU the controller's policy places on (MIG mode off
    everywhere, an empty or unreadable gpus table, only a newer node's blocked GPUs) replayed its history on a
    default 1 x 8 H100-80GB without a word, while `policy retrain` refuses such a DB since 32c994f. It refuses with
    retrain's words (one check, training.retrain.cluster_of's) unless --model, --nodes and --gpus-per-node name
    the cluster to replay on."""
    from slurm_mig.cli import main

    store_mod = pytest.importorskip("slurm_mig.store")
    path = tmp_path / "state.db"
    store = store_mod.open_store(path)
    try:
        store.replace_observed("n1", [{"gpu": g, "uuid": f"GPU-{g}", "model": "H100-80GB", "mig_enabled": False}
                                      for g in (0, 1)], [], now=10.0)
        for i in range(12):
            store.record_outcome(str(100 + i), state="COMPLETED", profile="1g", count=1, submit_time=50.0,
                                 start_time=60.0, end_time=360.0, now=400.0)
    finally:
        store.close()
    for extra in ([], ["--model", "A100-40GB"], ["--nodes", "2", "--gpus-per-node", "4"]):
        assert main(["simulate", "--db", str(path), "--policy", "greedy", "--json", *extra]) == 2, extra
        out = capsys.readouterr()
        assert out.out == "", extra
        assert "no MIG GPU the controller's policy places on" in out.err, out.err
        assert "2 GPU(s), 0 with MIG mode on" in out.err and "not the site's" in out.err, out.err
        assert "simulate stops instead" in out.err and "--model, --nodes and --gpus-per-node" in out.err, out.err
    # Named, it replays there.
    assert main(["simulate", "--db", str(path), "--policy", "greedy", "--json", "--model", "H100-80GB",
                 "--nodes", "1", "--gpus-per-node", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["model"], doc["nodes"], doc["gpus"]) == ("H100-80GB", 1, 2) and doc["metrics"]["finished"] == 12
    # A DB path that does not exist says so, as retrain's does.
    assert main(["simulate", "--db", str(tmp_path / "none.db")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_jobs_submitted_at_one_time_arrive_in_job_id_order_by_number():
    """Workload sorted ties by job id as text: "100" before "99", "p10" before "p9", a replayed job's second run
    "9#2" after "10". Slurm's order is by number (jobids.job_id_key)."""
    from slurm_mig.sim.workloads import Job, Workload

    ids = ["100", "p10", "9#2", "10", "p9", "99", "9", "123_10", "123_4"]
    w = Workload("ties", [Job(i, 5.0, "1g", 1, 60.0) for i in ids])
    assert [j.job_id for j in w.jobs] == ["9", "9#2", "10", "99", "100", "123_4", "123_10", "p9", "p10"]
