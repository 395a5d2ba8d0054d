"""slurm_mig.ops.views: the data behind status/jobs/nodes/decisions/explain/top, from a real Store."""

from __future__ import annotations

import json
import os
import time

import pytest

from slurm_mig.errors import StoreError
from slurm_mig.mig.layout import Slot, parse_layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.ops import explain as E
from slurm_mig.ops import fmt as F
from slurm_mig.ops import views as V
from slurm_mig.ops.cli import explain_lines
from slurm_mig.policies.base import Assignment, Decision, LayoutChange
from slurm_mig.store import open_store

H100 = get_model("H100-80GB")
NOW = 1_800_000_000.0


def build_state(store, now: float = NOW) -> None:
    """A small cluster in every state an operator must tell apart.

    gpu01: GPU 0 = 3g (job 101 alice) + 2g idle + 1g (job 102 bob); GPU 1 = 7g (job 103 carol)
    gpu02: GPU 0 being re-carved 3g@0,3g@4 -> 7g@0 for job 201 (3g@0 already destroyed); GPU 1 = 7 x 1g idle
    gpu03: reported 20 minutes ago (stale), GPU 0 = 4g@0,3g@4 idle
    capacity: Slurm's placeholder node, drained, no GPUs
    queue: 201 dave 7g (waited 300 s, then placed on gpu02/0), 202 erin 2 x 1g, 203 frank 4g (partition big)
    """
    gpu = lambda i: {"gpu": i, "model": "H100-80GB", "mig_enabled": True, "uuid": f"GPU-{i}"}  # noqa: E731
    store.replace_observed("gpu01", [gpu(0), gpu(1)], [
        {"gpu": 0, "profile": "3g", "start": 0, "uuid": "MIG-a"},
        {"gpu": 0, "profile": "2g", "start": 4, "uuid": "MIG-b"},
        {"gpu": 0, "profile": "1g", "start": 6, "uuid": "MIG-c", "in_use": True},
        {"gpu": 1, "profile": "7g", "start": 0, "uuid": "MIG-d", "in_use": True},
    ], now=now - 2)
    store.replace_observed("gpu02", [gpu(0), gpu(1)], [
        {"gpu": 0, "profile": "3g", "start": 4, "uuid": "MIG-e"},
        *({"gpu": 1, "profile": "1g", "start": s, "uuid": f"MIG-f{s}"} for s in range(7)),
    ], now=now - 1)
    store.replace_observed("gpu03", [gpu(0)], [
        {"gpu": 0, "profile": "4g", "start": 0}, {"gpu": 0, "profile": "3g", "start": 4}], now=now - 1200)
    store.upsert_node("capacity", state="drain")
    for job_id, user, profile, count, submit, part in (
            ("101", "alice", "3g", 1, now - 900, "gpu"), ("102", "bob", "1g", 1, now - 800, "gpu"),
            ("103", "carol", "7g", 1, now - 700, "gpu"), ("201", "dave", "7g", 1, now - 300, "gpu"),
            ("202", "erin", "1g", 2, now - 50, "gpu"), ("203", "frank", "4g", 1, now - 10, "big")):
        store.upsert_job(job_id, profile=profile, count=count, user=user, partition=part, submit_time=submit,
                         time_limit_s=3600, now=submit)
    store.bind("101", "gpu01", [(0, Slot(0, "3g.40gb"))], now=now - 890)
    store.set_job_state("101", "RUNNING", node="gpu01", reason="existing 3g.40gb@0 on GPU 0", now=now - 890)
    store.bind("102", "gpu01", [(0, Slot(6, "1g.10gb"))], now=now - 790)
    store.set_job_state("102", "RUNNING", node="gpu01", now=now - 790)
    store.bind("103", "gpu01", [(1, Slot(0, "7g.80gb"))], now=now - 690)
    store.set_job_state("103", "RUNNING", node="gpu01", now=now - 690)
    store.set_job_order(["201", "202", "203"])
    # The policy held 201 waiting twice, then placed it on gpu02/0 with a re-carve.
    state = store.cluster_state(now - 290, stale_after_s=120)
    wait = Decision(waiting=(("201", "no node can hold 1 x 7g on idle slices now"),), policy="first-fit",
                    version="2")
    store.record_decision(wait, state=state, latency_ms=0.5, now=now - 290)
    store.record_decision(wait, state=state, latency_ms=0.4, now=now - 280)
    store.record_decision(Decision(policy="first-fit", version="2"), state=state, latency_ms=0.1, now=now - 270)
    state = store.cluster_state(now - 20, stale_after_s=120)
    target = parse_layout("7g@0", H100)
    placed = Decision(
        changes=(LayoutChange("gpu02", 0, target, "carve instances for pending jobs: 3g@0,3g@4 -> 7g@0"),),
        assignments=(Assignment("201", "gpu02", ((0, Slot(0, "7g.80gb")),), "carved gpu02/0:7g.80gb@0"),),
        waiting=(("202", "behind a higher-priority job that cannot start yet"),
                 ("203", "no node can hold 1 x 4g on idle slices now")),
        policy="first-fit", version="2")
    did = store.record_decision(placed, state=state, latency_ms=0.7, now=now - 20)
    store.record_decision(Decision(policy="first-fit", version="2"), state=state, latency_ms=0.1, now=now - 1)
    store.set_desired("gpu02", 0, target, "first-fit", "carve instances for pending jobs", now=now - 20)
    e = store.journal_begin("gpu02", 0, "3g@0,3g@4", "7g@0",
                            [{"action": "destroy", "profile": "3g.40gb", "start": 0},
                             {"action": "destroy", "profile": "3g.40gb", "start": 4},
                             {"action": "create", "profile": "7g.80gb", "start": 0}],
                            decision_id=did, now=now - 19)
    store.journal_step(e, now=now - 18)
    done = store.journal_begin("gpu01", 1, "3g@0,3g@4", "7g@0",
                               [{"action": "destroy", "profile": "3g.40gb", "start": 0},
                                {"action": "destroy", "profile": "3g.40gb", "start": 4},
                                {"action": "create", "profile": "7g.80gb", "start": 0}], now=now - 698)
    store.journal_finish(done, "done", outcome="applied by the prolog of job 103", now=now - 697)
    store.set_meta("reservations", {"201": {"node": "gpu02", "instances": [[0, "7g.80gb", 0]]}}, now=now - 1)
    store.add_event("requeue", "job 150: no 1 x 3g MIG instance can be made on gpu03 now (slices in use)",
                    node="gpu03", job_id="150", now=now - 100)
    store.add_event("gres", "gpu01: Slurm had 3g:2, set 1g:1,2g:1,3g:1,7g:1", node="gpu01", now=now - 60)


@pytest.fixture
def state_db(tmp_path):
    path = tmp_path / "state.db"
    with open_store(path) as store:
        build_state(store)
    return path


@pytest.fixture
def ro(state_db):
    store = V.open_readonly(state_db)
    yield store
    store.close()


# -- opening --------------------------------------------------------------------------------

def test_open_readonly_names_a_missing_database(tmp_path):
    with pytest.raises(StoreError, match="no state database at .*controller running"):
        V.open_readonly(tmp_path / "nope.db")
    assert not (tmp_path / "nope.db").exists()


def test_open_readonly_refuses_world_writable_and_symlinks(state_db, tmp_path):
    link = tmp_path / "link.db"
    link.symlink_to(state_db)
    with pytest.raises(StoreError):
        V.open_readonly(link)
    os.chmod(state_db, 0o666)
    with pytest.raises(StoreError, match="world-writable"):
        V.open_readonly(state_db)


def test_open_readonly_never_writes(state_db):
    before = state_db.stat().st_mtime_ns, state_db.stat().st_mode
    store = V.open_readonly(state_db)
    with pytest.raises(StoreError, match="read-only"):
        store.add_event("x", "y")
    V.load_snapshot(store, now=NOW)
    store.close()
    assert (state_db.stat().st_mtime_ns, state_db.stat().st_mode) == before


def test_the_views_read_through_the_stores_public_select_rows(ro):
    """ops/views.py called the store's private _q: it reads through select_rows now, which runs a SELECT only."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(V.__file__).read_text())
    private = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id == "store" and n.attr.startswith("_")})
    assert private == []
    sql = "SELECT job_id, state FROM jobs WHERE state != ? ORDER BY job_id"
    with ro.snapshot():
        rows = ro.select_rows(sql, ("NONE",))
        assert rows and rows == ro._q(sql, ("NONE",))  # what _q gave the views
    assert ro.select_rows("  select 1 AS one") == [{"one": 1}]
    for sql in ("DELETE FROM jobs", "PRAGMA writable_schema = 1", "WITH x AS (SELECT 1) DELETE FROM jobs"):
        with pytest.raises(ValueError, match="SELECT only"):
            ro.select_rows(sql)


def test_open_readonly_refuses_an_empty_file(tmp_path):
    p = tmp_path / "empty.db"
    p.write_bytes(b"")
    os.chmod(p, 0o600)
    with pytest.raises(StoreError, match="empty"):
        V.open_readonly(p)


def test_open_readonly_reads_jobs_from_a_database_the_controller_has_not_migrated_yet(tmp_path):
    # slurm-mig upgraded on the host, the controller not restarted yet: its database is still at version 2
    # (no jobs.blocked), and the views, which never migrate, failed with KeyError: 'blocked'.
    from slurm_mig.store.schema import migrate

    path = tmp_path / "state.db"
    old = open_store(path, migrate=False)
    migrate(old.db, target=2)
    old.db.execute("INSERT INTO jobs (job_id, profile, submit_time, updated_at) VALUES ('41', '3g', 5.0, 5.0)")
    old.close()
    os.chmod(path, 0o600)
    store = V.open_readonly(path)
    assert [(j["job_id"], j["blocked"]) for j in V.jobs_view(store, now=NOW)] == [("41", None)]
    store.close()


# -- nodes and GPUs ------------------------------------------------------------------------------

def test_a_blocked_gpu_is_shown_with_why_and_nothing_creatable(tmp_path):
    with open_store(tmp_path / "b.db") as store:
        store.replace_observed("n1", [{"gpu": 0, "model": "H100-80GB", "mig_enabled": True, "mig_pending": False}],
                               [{"gpu": 0, "profile": "3g", "start": 0, "in_use": True}], now=NOW)
        g = V.node_views(V.load_snapshot(store, now=NOW))[0]["gpus"][0]
    assert (g["status"], g["blocked"]) == ("blocked", "MIG mode changes to off at the next GPU reset")
    assert g["largest_free_kind"] is None and g["layout"] == "3g@0"


def test_node_views_read_gpus_from_a_database_the_controller_has_not_migrated_yet(tmp_path):
    from slurm_mig.store.schema import migrate

    path = tmp_path / "state.db"
    old = open_store(path, migrate=False)
    migrate(old.db, target=4)  # no gpus.blocked
    old.db.execute("INSERT INTO nodes (name, state) VALUES ('n1', 'up')")
    old.db.execute("INSERT INTO gpus (node, gpu, model, mig_enabled, last_observed) VALUES ('n1', 0, 'H100-80GB', 1, 5.0)")
    old.close()
    os.chmod(path, 0o600)
    store = V.open_readonly(path)
    (g,) = V.node_views(V.load_snapshot(store, now=NOW))[0]["gpus"]
    assert (g["status"], g["blocked"]) == ("ok", None)
    store.close()


def _gpu(nodes, name, index):
    node = next(n for n in nodes if n["name"] == name)
    return next(g for g in node["gpus"] if g["gpu"] == index)


def test_node_views_instances_jobs_users_and_states(ro):
    snap = V.load_snapshot(ro, now=NOW, stale_after_s=120)
    nodes = V.node_views(snap)
    assert [n["name"] for n in nodes] == ["capacity", "gpu01", "gpu02", "gpu03"]
    g = _gpu(nodes, "gpu01", 0)
    assert g["layout"] == "3g@0,2g@4,1g@6"
    by_start = {i["start"]: i for i in g["instances"]}
    assert (by_start[0]["kind"], by_start[0]["state"], by_start[0]["job_id"], by_start[0]["user"]) == \
        ("3g", "busy", "101", "alice")
    assert (by_start[4]["state"], by_start[4]["job_id"]) == ("idle", None)
    assert (by_start[6]["state"], by_start[6]["job_id"], by_start[6]["user"]) == ("busy", "102", "bob")
    assert g["busy_slices"] == 5 and g["idle_slices"] == 2 and g["largest_free_kind"] == "2g"
    # gpu02/0: the open reconfiguration shows: 3g@4 about to go, 7g@0 being created.
    r = _gpu(nodes, "gpu02", 0)
    assert r["status"] == "reconfiguring" and r["reconfiguration"]["to"] == "7g@0"
    assert r["reconfiguration"]["progress"] == 1 and r["reconfiguration"]["steps"] == 3
    assert [(i["kind"], i["state"], i["pending_action"]) for i in r["instances"]] == [("3g", "reconfiguring",
                                                                                       "destroy")]
    assert [(c["kind"], c["start"]) for c in r["creating"]] == [("7g", 0)]
    assert r["desired"] == "7g@0"
    idle = _gpu(nodes, "gpu02", 1)
    assert idle["idle_slices"] == 7 and idle["largest_free_kind"] == "7g" and idle["fragmented_slices"] == 0
    stale = next(n for n in nodes if n["name"] == "gpu03")
    assert stale["stale"] and stale["seen_ago_s"] == pytest.approx(1200)
    cap = next(n for n in nodes if n["name"] == "capacity")
    assert cap["gpus"] == [] and cap["state"] == "drain" and not cap["stale"]
    json.dumps(nodes)  # JSON-ready


def test_fragmentation_counts_idle_slices_outside_the_biggest_creatable_instance(tmp_path):
    with open_store(tmp_path / "f.db") as store:
        # A 1g busy in the middle of the GPU: 7 slices idle, but only a 3g (4 slices) can be made.
        store.replace_observed("n1", [{"gpu": 0, "model": "H100-80GB", "mig_enabled": True}],
                               [{"gpu": 0, "profile": "1g", "start": 2, "in_use": True}], now=NOW)
        g = V.node_views(V.load_snapshot(store, now=NOW))[0]["gpus"][0]
    assert g["free_slices"] == 7 and g["largest_free_kind"] == "3g" and g["largest_free_slices"] == 4
    assert g["fragmented_slices"] == 3


def test_match_nodes_hostlists_globs_and_names():
    names = ["gpu01", "gpu02", "gpu03", "cpu1"]
    assert V.match_nodes(names, "gpu[01-02]") == ["gpu01", "gpu02"]
    assert V.match_nodes(names, "gpu*") == ["gpu01", "gpu02", "gpu03"]
    assert V.match_nodes(names, "cpu1,gpu03") == ["gpu03", "cpu1"]
    assert V.match_nodes(names, ["gpu0[2-3]"]) == ["gpu02", "gpu03"]
    assert V.match_nodes(names, None) == names


def test_node_filters(ro):
    snap = V.load_snapshot(ro, now=NOW)
    assert [n["name"] for n in V.node_views(snap, nodes="gpu0[1-2]")] == ["gpu01", "gpu02"]
    assert [n["name"] for n in V.node_views(snap, only={"gpu03"})] == ["gpu03"]
    assert [n["name"] for n in V.node_views(snap, include_empty=False)] == ["gpu01", "gpu02", "gpu03"]


def test_hot_nodes_puts_reconfiguring_and_troubled_first(ro):
    nodes = V.node_views(V.load_snapshot(ro, now=NOW))
    assert [n["name"] for n in V.hot_nodes(nodes)] == ["gpu02", "gpu03", "gpu01"]


# -- status, jobs, decisions -----------------------------------------------------------------------

def test_status_view(ro):
    snap = V.load_snapshot(ro, now=NOW, stale_after_s=120)
    st = V.status_view(snap, tick_interval_s=5)
    assert st["controller"]["state"] == "ok" and st["controller"]["tick_age_s"] == pytest.approx(1)
    assert st["controller"]["open_reconfigurations"] == 1
    assert st["nodes"] == {"total": 3, "by_state": {"stale": 1, "up": 2}, "other": ["capacity"]}
    assert st["gpus"]["total"] == 5 and st["gpus"]["reconfiguring"] == 1
    assert st["instances"] == {"busy": 3, "idle": 10, "reconfiguring": 2}
    prof = {p["profile"]: p for p in st["profiles"]}
    assert (prof["7g"]["total"], prof["7g"]["busy"], prof["7g"]["reconfiguring"], prof["7g"]["pending_jobs"]) == \
        (1, 1, 1, 1)
    assert prof["7g"]["oldest_wait_s"] == pytest.approx(300)
    assert (prof["1g"]["total"], prof["1g"]["idle"], prof["1g"]["pending_instances"]) == (8, 7, 2)
    assert st["jobs"]["pending"] == 3 and st["jobs"]["running"] == 3
    assert st["jobs"]["oldest_pending"]["job_id"] == "201"
    assert [r["to"] for r in st["reconfigurations"]] == ["7g@0"]
    json.dumps(st)


def test_controller_health_states(ro):
    snap = V.load_snapshot(ro, now=NOW + 600)
    h = V.controller_health(snap, tick_interval_s=5)
    assert h["state"] == "stale" and "10m" in h["detail"]
    assert V.controller_health(snap, 5, healthz=False)["state"] == "down"
    snap = V.load_snapshot(ro, now=NOW)
    assert V.controller_health(snap, 5, healthz=False)["state"] == "api-down"


def test_jobs_view_order_filters_and_waits(ro):
    jobs = V.jobs_view(ro, now=NOW)
    assert [j["job_id"] for j in jobs] == ["201", "202", "203", "101", "102", "103"]
    j201 = jobs[0]
    assert j201["wait_s"] == pytest.approx(300) and j201["reserved"]["node"] == "gpu02"
    assert j201["reason"] == "carved gpu02/0:7g.80gb@0"
    run = next(j for j in jobs if j["job_id"] == "101")
    assert run["wait_s"] == pytest.approx(10) and run["run_s"] == pytest.approx(890)
    assert run["instances"][0]["profile"] == "3g.40gb"
    assert [j["job_id"] for j in V.jobs_view(ro, now=NOW, partition="big")] == ["203"]
    assert [j["job_id"] for j in V.jobs_view(ro, now=NOW, user="bob")] == ["102"]
    assert [j["job_id"] for j in V.jobs_view(ro, now=NOW, states=["PENDING"], limit=2)] == ["201", "202"]
    assert [j["job_id"] for j in V.jobs_view(ro, now=NOW, profile="7g")] == ["201", "103"]


def test_pending_by_profile():
    pend = [{"profile": "7g", "count": 1, "wait_s": 30.0}, {"profile": "1g", "count": 2, "wait_s": 5.0},
            {"profile": "7g", "count": 1, "wait_s": 10.0}]
    out = V.pending_by_profile(pend)
    assert [(p["profile"], p["jobs"], p["instances"], p["oldest_wait_s"]) for p in out] == \
        [("1g", 1, 2, 5.0), ("7g", 2, 2, 30.0)]


def test_decisions_view_kinds(ro):
    acted = V.decisions_view(ro)
    assert len(acted) == 1 and acted[0]["changes"][0]["target"] == "7g@0"
    assert "re-carve gpu02/0 -> 7g@0" in acted[0]["summary"] and "job 201 -> gpu02" in acted[0]["summary"]
    assert len(V.decisions_view(ro, include_waiting=True)) == 3
    assert len(V.decisions_view(ro, include_noop=True)) == 5
    mine = V.decisions_view(ro, job_id="201")
    assert [len(d["assignments"]) for d in mine] == [1, 0, 0]
    assert V.decisions_view(ro, job_id="999") == []
    assert V.decisions_view(ro, job_id="20") == []  # no prefix matches


def test_recent_activity_has_reasons(ro):
    snap = V.load_snapshot(ro, now=NOW)
    items = V.recent_activity(snap)
    kinds = [i["kind"] for i in items]
    assert "decision" in kinds and "reconfig" in kinds and "requeue" in kinds and "gres" in kinds
    rc = next(i for i in items if i["kind"] == "reconfig" and "gpu02/0" in i["text"])
    assert "in progress" in rc["text"] and rc["reason"].startswith("carve instances for pending jobs")
    assert items == sorted(items, key=lambda i: -i["time"])


# -- explain -------------------------------------------------------------------------------------

def test_explain_a_job_that_waited_then_was_placed_with_a_recarve(ro):
    ex = E.explain_view(ro, "201", now=NOW)
    assert ex["job"]["profile"] == "7g" and ex["job"]["state"] == "PENDING"
    spans = ex["decisions"]["spans"]
    assert [(s["what"], s["decisions"]) for s in spans] == [("waiting", 2), ("assigned", 1)]
    assert spans[0]["reason"] == "no node can hold 1 x 7g on idle slices now"
    assert spans[1]["changes"][0]["target"] == "7g@0"
    labels = [s["label"] for s in ex["policy_saw"]]
    assert labels == ["first wait", "last wait", "assignment"]
    first = ex["policy_saw"][0]
    assert first["queue_position"] == 1 and first["gpus"] == 5
    opts = {o["gpu"]: o for o in first["options"]}
    assert opts["gpu01/1"]["verdict"] == "blocked" and "busy 7g.80gb@0" in opts["gpu01/1"]["why"]
    assert opts["gpu02/1"]["verdict"] == "re-carve"
    assert opts["gpu03/0"]["verdict"] == "unavailable"  # stale node
    last = ex["policy_saw"][-1]
    assert [o["gpu"] for o in last["options"] if o["chosen"]] == ["gpu02/0"]
    assert "waited mostly because: no node can hold 1 x 7g" in ex["verdict"]
    assert "now waiting for the re-carve to finish and Slurm to start it there" in ex["verdict"]
    assert "the policy placed it: carved gpu02/0:7g.80gb@0" in ex["verdict"]
    json.dumps(ex)


def test_explain_a_running_job_has_its_reconfiguration_and_timeline(ro):
    ex = E.explain_view(ro, "103", now=NOW)
    assert ex["job"]["node"] == "gpu01" and ex["job"]["state"] == "RUNNING"
    assert [r["to"] for r in ex["reconfigurations"]] == ["7g@0"]
    assert ex["reconfigurations"][0]["duration_s"] == pytest.approx(1.0)
    tl = ex["timeline"]
    assert tl["node"] == "gpu01" and tl["gpus"] == [1]
    kinds = {s["kind"] for s in tl["segments"]}
    assert {"job", "destroy", "create"} <= kinds
    assert "no decision" not in ex["verdict"]


def test_explain_unknown_job(ro):
    with pytest.raises(StoreError, match="no record of job 4242"):
        E.explain_view(ro, "4242")


def test_status_counts_jobs_slurm_will_not_start_apart_from_the_queue(state_db):
    with open_store(state_db) as store:
        store.upsert_job("900", profile="2g", submit_time=NOW - 7 * 86400, now=NOW,
                         blocked="held by its user (Slurm: JobHeldUser)")
    ro = V.open_readonly(state_db)
    try:
        before = V.status_view(V.load_snapshot(ro, now=NOW, stale_after_s=120), tick_interval_s=5)
    finally:
        ro.close()
    # A job held for a week is neither demand nor the queue's oldest wait.
    assert before["jobs"]["blocked"] == 1
    assert before["jobs"]["oldest_pending"]["job_id"] != "900"
    assert {p["profile"]: p["pending_jobs"] for p in before["profiles"]}.get("2g", 0) == 0


def test_explain_a_job_slurm_will_not_start_says_why_not_that_the_controller_is_idle(tmp_path):
    with open_store(tmp_path / "state.db") as store:
        store.upsert_job("7", profile="2g", submit_time=100.0, now=100.0,
                         blocked="waiting on a dependency (Slurm: Dependency)")
    ro = V.open_readonly(tmp_path / "state.db")
    try:
        out = E.explain_view(ro, "7", now=130.0)
    finally:
        ro.close()
    assert "Slurm will not start it now: waiting on a dependency" in out["verdict"]
    assert "is the controller ticking" not in out["verdict"]
    assert out["job"]["blocked"] == "waiting on a dependency (Slurm: Dependency)"


@pytest.mark.parametrize("status, shown", [(0, "0:0"), (768, "3:0"), (9, "0:9"), (15, "0:15"), (None, "unknown")])
def test_an_exit_status_is_shown_as_slurm_prints_it(status, shown):
    # The store keeps the wait status (SLURM_JOB_EXIT_CODE): 768 is `exit 3`, which sacct prints 3:0.
    assert F.fmt_exit(status) == shown


def test_gpu_option_verdicts():
    base = {"node": "n1", "gpu": 0, "model": "H100-80GB", "available": True}
    assert E.gpu_option({**base, "layout": "3g@0,3g@4", "busy": []}, "3g")["verdict"] == "idle-instance"
    assert E.gpu_option({**base, "layout": "3g@0", "busy": ["3g.40gb@0"]}, "3g")["verdict"] == "free-slices"
    o = E.gpu_option({**base, "layout": "1g@0,1g@1,1g@2,1g@3,3g@4", "busy": ["3g.40gb@4"]}, "4g")
    assert o["verdict"] == "re-carve" and "1g.10gb@0" in o["why"]
    o = E.gpu_option({**base, "layout": "3g@0,3g@4", "busy": ["3g.40gb@0"], "reconfiguring": ["3g.40gb@4"]}, "7g")
    assert o["verdict"] == "blocked" and "busy 3g.40gb@0" in o["why"] and "reconfiguring 3g.40gb@4" in o["why"]
    assert E.gpu_option({**base, "available": False, "layout": ""}, "1g")["verdict"] == "unavailable"
    assert E.gpu_option({**base, "layout": "empty"}, "5g")["verdict"] == "no-profile"


def test_gpu_option_says_where_the_cpus_the_decision_counted_kept_a_job_off():
    # What the dispatch loop's CpuLedger had when it came to job c: a (-c 3) placed on n1, b (-c 1) on n2.
    inputs = {"free_cpus": {"n1": 4, "n2": 2, "n3": 1},
              "pending": [{"job_id": "a", "cpus": 3}, {"job_id": "b", "cpus": 1}, {"job_id": "c", "cpus": 2},
                          {"job_id": "x", "cpus": 1, "exclusive": True}, {"job_id": "u"}]}
    made = [{"job_id": "a", "node": "n1"}, {"job_id": "b", "node": "n2"}]
    base = {"gpu": 0, "model": "H100-80GB", "available": True, "layout": "empty"}
    c = E._cpu_view(inputs, 2, made)
    got = {n: E.gpu_option({**base, "node": n}, "1g", cpus=c) for n in ("n1", "n2", "n3", "n4")}
    assert got["n1"]["verdict"] == "cpus-promised" and "3 of its 4 free CPUs promised to job a" in got["n1"]["why"]
    assert got["n2"]["verdict"] == "cpus-promised", got["n2"]
    assert got["n3"]["verdict"] == "few-cpus" and "1 free CPU(s), it asks for 2" in got["n3"]["why"]
    assert got["n4"]["verdict"] == "free-slices"  # not counted there
    # --exclusive: no node with a job placed on it, whatever is left there
    x = E._cpu_view({**inputs, "free_cpus": {"n1": 64, "n2": 2, "n3": 1}}, 3, made)
    assert E.gpu_option({**base, "node": "n1"}, "1g", cpus=x)["verdict"] == "cpus-promised"
    assert E.gpu_option({**base, "node": "n3"}, "1g", cpus=x)["verdict"] == "free-slices"
    # a job that gave no CPUs, or a decision that counted none: nothing to say
    assert E._cpu_view(inputs, 4, made) is None
    assert E._cpu_view({"pending": inputs["pending"]}, 2, made) is None


def test_history_segments_window(ro):
    segs = E.history_segments(ro, "gpu01", [0, 1], NOW - 1000, NOW)
    jobs = sorted(s.job_id for s in segs if s.kind == "job")
    assert jobs == ["101", "102", "103"]
    assert all(s.t1 == NOW for s in segs if s.kind == "job")  # still running


def test_formatting():
    assert F.fmt_duration(None) == "-"
    assert F.fmt_duration(5.4) == "5s"
    assert F.fmt_duration(185) == "3m05s"
    assert F.fmt_duration(3720) == "1h02m"
    assert F.fmt_duration(2 * 86400 + 3 * 3600) == "2d03h"
    assert V.kind_sort_key("1g") < V.kind_sort_key("1g.dm") < V.kind_sort_key("2g") < V.kind_sort_key("7g")
    t = time.time()
    assert F.fmt_when(t, t) == F.fmt_clock(t)
    assert "-" in F.fmt_when(t - 3 * 86400, t)


def test_a_time_of_another_year_is_shown_with_its_year():
    """A time not of today was shown as month-day and clock alone: in a post-mortem on last year's copy of the
    database (or with a clock set a year ahead) `explain` said "submitted 11-27 10:00:00" of a job of a year
    earlier, as if of this year. A time of another year now says its year."""
    now = time.mktime((2026, 11, 27, 12, 0, 0, 0, 0, -1))
    year_ago = time.mktime((2025, 11, 27, 10, 0, 0, 0, 0, -1))
    assert F.fmt_when(year_ago, now) == "2025-11-27 10:00:00"
    assert F.fmt_when(time.mktime((2027, 1, 2, 3, 4, 5, 0, 0, -1)), now) == "2027-01-02 03:04:05"
    assert F.fmt_when(time.mktime((2026, 3, 1, 8, 0, 0, 0, 0, -1)), now) == "03-01 08:00:00"  # this year: no year
    assert F.fmt_when(now, now) == "12:00:00"


def test_explain_a_pending_job_shows_the_reconfiguration_it_waits_for(ro):
    ex = E.explain_view(ro, "201", now=NOW)
    assert [(r["node"], r["gpu"], r["to"], r["state"]) for r in ex["reconfigurations"]] == \
        [("gpu02", 0, "7g@0", "in_progress")]
    assert ex["timeline"]["node"] == "gpu02"


# -- explain: how long a reason held -------------------------------------------------------------

def _waits_store(path, submit: float, decisions, *, started: float | None = None, cancelled: float | None = None):
    """A store with job 301 (1 x 1g) submitted at ``submit`` and the live decisions ``decisions``:
    (time, {job: reason}) each, recorded as the controller does (only when they differ)."""
    with open_store(path) as store:
        store.replace_observed("gpu01", [{"gpu": 0, "model": "H100-80GB", "mig_enabled": True, "uuid": "GPU-0"}],
                               [{"gpu": 0, "profile": "7g", "start": 0, "uuid": "MIG-a", "in_use": True}],
                               now=submit)
        for job in ("300", "301", "302"):
            store.upsert_job(job, profile="1g", count=1, user="u", partition="gpu", submit_time=submit, now=submit)
        state = store.cluster_state(submit, stale_after_s=10 ** 9)
        for t, reasons in decisions:
            store.record_decision(Decision(waiting=tuple(reasons.items()), policy="frag-aware", version="1"),
                                  state=state, now=t)
        if started is not None:
            store.bind("301", "gpu01", [(0, Slot(0, "1g.10gb"))], now=started)
            store.set_job_state("301", "RUNNING", node="gpu01", now=started)
        if cancelled is not None:
            store.set_job_state("301", "CANCELLED", now=cancelled)


def _explain(path, now):
    ro = V.open_readonly(path)
    try:
        return E.explain_view(ro, "301", now=now)
    finally:
        ro.close()


H = 3600.0
BEHIND = "behind a higher-priority job that cannot start yet"
NO_ROOM = "no node can hold 1 x 1g on idle slices now"


def test_explain_a_wait_under_one_unchanged_reason_lasts_until_the_job_started(tmp_path):
    """The controller records a decision only when it differs from the last one recorded, so a job waiting
    5 hours for one unchanged reason has one decision. Its span ended at that decision's own time: explain
    showed a wait of 0 s where the job waited 5 hours. It lasts until what ended it: here the job's start."""
    t0 = NOW - 6 * H
    _waits_store(tmp_path / "s.db", t0, [(t0 + 5, {"301": BEHIND})], started=t0 + 5 * H)
    ex = _explain(tmp_path / "s.db", NOW)
    [span] = ex["decisions"]["spans"]
    assert (span["since"], span["until"]) == (t0 + 5, t0 + 5 * H)  # was t0 + 5: a wait of 0 s
    assert span["ended_by"] == "start"
    assert span["last_time"] == t0 + 5 and span["decisions"] == 1
    text = "\n".join(explain_lines(ex, 200, now=NOW))
    assert f"..{F.fmt_clock(t0 + 5 * H)} (4h59m, until it started)  #1 (1 decision, frag-aware 1) waiting: " \
           + BEHIND in text
    json.dumps(ex)


def test_explain_a_job_still_waiting_under_one_reason_waits_until_now(tmp_path):
    t0 = NOW - 6 * H
    _waits_store(tmp_path / "s.db", t0, [(t0 + 5, {"301": BEHIND, "302": BEHIND})])
    ex = _explain(tmp_path / "s.db", NOW)
    [span] = ex["decisions"]["spans"]
    assert span["until"] == NOW and span["ended_by"] == "now"
    assert "..now (5h59m, still waiting)" in "\n".join(explain_lines(ex, 200, now=NOW))


def test_explain_a_job_cancelled_while_waiting_waits_until_its_end(tmp_path):
    t0 = NOW - 6 * H
    _waits_store(tmp_path / "s.db", t0, [(t0 + 5, {"301": BEHIND})], cancelled=t0 + 2 * H)
    [span] = _explain(tmp_path / "s.db", NOW)["decisions"]["spans"]
    assert span["until"] == t0 + 2 * H and span["ended_by"] == "end"


def test_explain_a_reason_lasts_until_the_next_decision_recorded_and_the_longest_is_the_one_named(tmp_path):
    """Job 301 waited 4 hours behind another job, then a minute for room (two decisions, recorded because job
    302's reason changed). The spans ended at their last decision's time, 0 s and 10 s, so 'In short' named
    the one-minute reason as the one it waited for mostly."""
    t0 = NOW - 6 * H
    _waits_store(tmp_path / "s.db", t0, [(t0 + 5, {"301": BEHIND, "302": BEHIND}),
                                         (t0 + 4 * H, {"301": NO_ROOM, "302": BEHIND}),
                                         (t0 + 4 * H + 10, {"301": NO_ROOM, "302": NO_ROOM})],
                 started=t0 + 4 * H + 60)
    ex = _explain(tmp_path / "s.db", NOW)
    assert f"waited mostly because: {BEHIND}" in ex["verdict"]
    spans = ex["decisions"]["spans"]
    assert [(s["reason"], s["since"], s["until"]) for s in spans] == [
        (BEHIND, t0 + 5, t0 + 4 * H), (NO_ROOM, t0 + 4 * H, t0 + 4 * H + 60)]
    assert [(s["ended_by"], s["next_decision"]) for s in spans] == [("decision", 2), ("start", None)]


def test_explain_a_reason_ends_at_a_decision_that_left_the_job_out(tmp_path):
    """A recorded decision that does not hold the job waiting (Slurm held it meanwhile, so the policy did not
    see it) ends its span; the same reason recorded again later is a span of its own, not one that ran on
    through the gap."""
    t0 = NOW - 6 * H
    _waits_store(tmp_path / "s.db", t0, [(t0 + 5, {"301": BEHIND, "302": BEHIND}), (t0 + 1 * H, {"302": BEHIND}),
                                         (t0 + 2 * H, {"301": BEHIND, "302": BEHIND})])
    spans = _explain(tmp_path / "s.db", NOW)["decisions"]["spans"]
    assert [(s["first"], s["since"], s["until"]) for s in spans] == [(1, t0 + 5, t0 + 1 * H), (3, t0 + 2 * H, NOW)]
    assert [s["ended_by"] for s in spans] == ["decision", "now"]


def test_explain_reads_only_the_jobs_own_entries_of_a_long_decision_history(tmp_path, monkeypatch):
    """A decision at a large site lists thousands of waiting jobs, and explain parsed every one of them in each
    decision of the job's wait: 5.7 s for a job that waited through 374 decisions of 1,024 GPUs and 10,000
    pending (benchmarks/ops_scale.py --churn). It now finds the job's own entries in each decision's text and
    parses an action only where a span starts or the job was placed; what it says is the same as from every
    decision parsed whole (_decision_rows), lookalike ids ('301_1' is a LIKE pattern that '30101' matches,
    '3010' starts like '301') included."""
    path = tmp_path / "s.db"
    others = [(str(4000 + k), f"reason {k} of many") for k in range(300)]
    with open_store(path) as store:
        store.replace_observed("gpu01", [{"gpu": 0, "model": "H100-80GB", "mig_enabled": True, "uuid": "GPU-0"}],
                               [{"gpu": 0, "profile": "7g", "start": 0, "uuid": "MIG-a"}], now=NOW - H)
        for job in ("301", "3010", "301_1", "30101"):
            store.upsert_job(job, profile="1g", count=1, user="u", partition="gpu", submit_time=NOW - H, now=NOW - H)
        state = store.cluster_state(NOW - H, stale_after_s=10 ** 9)
        placed = Assignment("301", "gpu01", ((0, Slot(0, "1g.10gb")),), "carved gpu01/0:1g.10gb@0")
        change = LayoutChange("gpu01", 0, parse_layout("1g@0", H100), "carve instances for pending jobs")
        for k in range(40):
            waiting = [("3010", "not it"), ("30101" if k % 2 else "301_1", f"lookalike {k % 3}"), *others]
            if k < 30:
                waiting.insert(150, ("301", NO_ROOM if k < 10 else BEHIND))
            d = Decision(changes=(change,) if k >= 30 else (), assignments=(placed,) if k >= 30 else (),
                         waiting=tuple(waiting), policy="frag-aware", version="1",
                         extra={"reservations": [["301", "gpu01", 0]] if k == 10 else []})
            store.record_decision(d, state=state, now=NOW - H + 10 * (k + 1))
    parsed: list[int] = []
    import slurm_mig.store.models as models
    real_loads = models.loads
    monkeypatch.setattr(models, "loads", lambda text, default=None: parsed.append(len(text or "")) or
                        real_loads(text, default))
    ro = V.open_readonly(path)
    try:
        for job in ("301", "301_1", "3010"):
            parsed.clear()
            ex = E.explain_view(ro, job, now=NOW)
            during = list(parsed)
            old = V._decision_rows(ro, limit=100_000, include_noop=False, job_id=job, since=NOW - H - 2,
                                   until=NOW + 2, newest_first=False)
            recorded = [(d["id"], d["time"]) for d in V._decision_rows(ro, limit=100, include_noop=True)][::-1]
            assert ex["decisions"]["count"] == len(old)
            assert ex["decisions"]["spans"] == E._spans(old, job, recorded=recorded, stop=NOW, stopped_by="now")
            if job == "301":
                assert max(during) < 20 * len(others) < 9000  # was each of the 40 reasons columns, 9,000 characters
                assert [(s["what"], s["decisions"]) for s in ex["decisions"]["spans"]] == \
                    [("waiting", 10), ("waiting", 20)] + [("assigned", 1)] * 10
                assert ex["decisions"]["spans"][1]["reservations"] == [["301", "gpu01", 0]]
                assert ex["decisions"]["spans"][-1]["changes"][0]["target"] == "1g@0"
            if job == "301_1":
                assert ex["decisions"]["count"] == 20  # not the 20 that list 30101
    finally:
        ro.close()
