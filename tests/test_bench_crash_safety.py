"""The crash-safety harness's own checks (benchmarks/crash_safety.py), without a cluster."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import load_benchmark

pytest.importorskip("slurm_mig.democluster")

crash_safety = load_benchmark("crash_safety")


class _FakeCluster:
    def __init__(self, state: Path, instances=None):
        self.state = state
        self.nodes = ["n1", "n2"]
        self.instances = instances

    def sim_instances(self, node):
        if self.instances is None:
            raise OSError("GPU state file unreadable")
        return self.instances


def test_watcher_counts_only_samples_it_could_check(tmp_path):
    """A round in which no node's GPUs could be read checked nothing: it must not count toward the
    20 samples the seed needs to pass."""
    w = crash_safety.Watcher(_FakeCluster(tmp_path))
    for _ in range(25):
        w.sample()
    assert w.samples == 0 and w.failed_reads == 50
    ok = crash_safety.Watcher(_FakeCluster(tmp_path, instances={}))
    ok.sample()
    assert ok.samples == 1 and ok.failed_reads == 0


def test_watcher_that_dies_reports_it(tmp_path, monkeypatch):
    """An exception in a sample (squeue timing out) used to end the thread silently: every later
    violation went unseen while the seed could still pass."""
    bdir = tmp_path / "node" / "n1" / "bindings"
    bdir.mkdir(parents=True)
    (bdir / "42.json").write_text(json.dumps({"instances": [{"uuid": "MIG-gone"}]}))
    w = crash_safety.Watcher(_FakeCluster(tmp_path, instances={}))

    def slow_squeue(job):
        raise subprocess.TimeoutExpired(["squeue"], 20)

    monkeypatch.setattr(w, "_running", slow_squeue)
    w.run()  # returns instead of raising
    assert any("watcher stopped: TimeoutExpired" in v for v in w.violations)


@pytest.mark.parametrize("slurm_says,violation,counted", [(None, False, False), (True, True, True),
                                                          (False, False, True)])
def test_a_binding_to_a_missing_instance_is_checked_only_when_slurm_can_say(tmp_path, monkeypatch, slurm_says,
                                                                            violation, counted):
    """A failed squeue read as "not running" skipped the check unseen; now that round is not counted."""
    bdir = tmp_path / "node" / "n1" / "bindings"
    bdir.mkdir(parents=True)
    (bdir / "42.json").write_text(json.dumps({"instances": [{"uuid": "MIG-gone"}]}))
    w = crash_safety.Watcher(_FakeCluster(tmp_path, instances={}))
    monkeypatch.setattr(w, "_running", lambda job: slurm_says)
    w.sample()
    assert bool(w.violations) is violation and (w.samples == 1) is counted


def test_a_seed_with_violations_keeps_its_evidence(tmp_path):
    """The logs, GPU states, binding records and database a failing seed leaves are copied aside: the next seed
    runs on the same cluster, and the next run writes over the logs (how a 2026-11-27 failure lost its own)."""
    import sqlite3

    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "slurm-mig.log").write_text("prolog job 44 bound 2g.20gb@0:4\n")
    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "n1.json").write_text('{"version": 1}')
    (tmp_path / "node" / "n1" / "bindings").mkdir(parents=True)
    (tmp_path / "node" / "n1" / "bindings" / "44.json").write_text("[]")
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, message TEXT)")
        db.execute("INSERT INTO events (message) VALUES ('job 44 ended')")
    dest = crash_safety.keep_evidence(_FakeCluster(tmp_path), 1048)
    assert dest == tmp_path / "evidence" / "seed-1048"
    assert (dest / "log" / "slurm-mig.log").read_text().startswith("prolog job 44")
    assert (dest / "gpus" / "n1.json").is_file() and (dest / "node" / "n1" / "bindings" / "44.json").is_file()
    with sqlite3.connect(dest / "state.db") as db:
        assert db.execute("SELECT message FROM events").fetchall() == [("job 44 ended",)]
    # Again for the same seed (a rerun): replaced, not an error
    (tmp_path / "log" / "slurm-mig.log").write_text("second run\n")
    assert (crash_safety.keep_evidence(_FakeCluster(tmp_path), 1048) / "log" / "slurm-mig.log").read_text() \
        == "second run\n"


def test_what_a_node_still_holds_names_the_records_without_a_copy_and_who_marks_an_instance(tmp_path):
    """Seed 1048 reported an instance of n1 still marked busy and no binding files: the harness looked at the
    TaskProlog copies (bindings/) only, and an earlier run's record set aside (records/<job>.earlier-1.json) has
    none; nor did it say who marked the instance. Both are said now."""
    from slurm_mig.nvml.simulated import SimulatedBackend, init_state

    init_state(tmp_path / "gpus" / "n1.json", [("H100-80GB", 1)], layouts={0: "3g@0,2g@4,1g@6"}, seed="n1")
    dc = _FakeCluster(tmp_path)
    for folder in ("bindings", "records"):
        (tmp_path / "node" / "n1" / folder).mkdir(parents=True)
    assert crash_safety.node_leftovers(dc, "n1") == []
    SimulatedBackend(tmp_path / "gpus" / "n1.json").set_in_use(0, "3g@0", "job 1234")
    (tmp_path / "node" / "n1" / "records" / "1234.earlier-1.json").write_text("{}")
    why = crash_safety.node_leftovers(dc, "n1")
    assert why[0] == "n1 binding records ['1234.earlier-1.json']" and len(why) == 2, why
    assert "job 1234 on 3g.40gb@0 of GPU 0" in why[1] and why[1].startswith("n1 instances still marked busy"), why


def test_the_evidence_keeps_slurms_logs(tmp_path):
    """slurmctld's log says which jobs were requeued, each slurmd's which Prolog or Epilog failed (was killed):
    the sequence that leaves an instance busy is read there."""
    (tmp_path / "slurm" / "log").mkdir(parents=True)
    (tmp_path / "slurm" / "log" / "slurmctld.log").write_text("Requeuing JobId=1234\n")
    dest = crash_safety.keep_evidence(_FakeCluster(tmp_path), 1048)
    assert (dest / "slurm" / "log" / "slurmctld.log").read_text() == "Requeuing JobId=1234\n"
