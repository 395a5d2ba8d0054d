"""The state store: schema and migrations, file safety, transactions, bindings,
exactly-once outcomes, concurrency between processes, and the policy's view."""

from __future__ import annotations

import grp
import json
import os
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from slurm_mig.errors import BindingConflict, SlurmMigError, StoreBusy, StoreError
from slurm_mig.mig import Slot, get_model, parse_layout, plan_transition
from slurm_mig.policies import ClusterState, check_decision, get_policy
from slurm_mig.store import (
    LATEST_VERSION,
    MIGRATIONS,
    ObservedGpu,
    ObservedInstance,
    Store,
    migrate,
    open_store,
    schema_version,
)

H100 = get_model("H100-80GB")
ROOT = Path(__file__).resolve().parents[1]


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def observe(store: Store, node: str, layouts: dict[int, str], *, in_use=(), now=100.0, model=H100):
    """Report ``node`` with one GPU per entry of ``layouts`` (gpu index -> layout spec)."""
    gpus = [ObservedGpu(gpu=i, uuid=f"GPU-{node}-{i}", model=model.name, mig_enabled=True) for i in layouts]
    insts = []
    for i, spec in layouts.items():
        for s in parse_layout(spec, model).sorted_slots():
            insts.append(ObservedInstance(gpu=i, profile=s.profile, start=s.start, uuid=f"MIG-{node}-{i}-{s.start}",
                                          gi_id=s.start + 1, ci_id=0, in_use=(i, s.start) in in_use))
    store.replace_observed(node, gpus, insts, now=now)


# -- schema and migrations ---------------------------------------------------------

def test_fresh_store_is_at_latest_version(db):
    assert db.schema_version == LATEST_VERSION
    tables = set(db.db.table_names())
    for t in ("nodes", "gpus", "instances", "desired_layouts", "jobs", "bindings", "decisions",
              "reconfig_journal", "outcomes", "events", "meta", "node_messages", "schema_migrations"):
        assert t in tables
    assert db.db.execute("PRAGMA user_version").fetchone()[0] == LATEST_VERSION
    assert [r[0] for r in db.db.execute("SELECT version FROM schema_migrations ORDER BY version")] == \
        [v for v, _, _ in MIGRATIONS]


def test_migrate_is_idempotent(db):
    assert migrate(db.db) == []
    assert migrate(db.db) == []
    assert db.db.execute("SELECT COUNT(*) FROM schema_migrations").fetchone()[0] == len(MIGRATIONS)


def test_old_version_database_upgrades_and_keeps_its_data(tmp_path):
    path = tmp_path / "state.db"
    old = open_store(path, migrate=False)
    assert migrate(old.db, target=1) == [1]
    assert schema_version(old.db) == 1
    assert "meta" not in old.db.table_names()
    # Written as version 1's code wrote it (today's upsert_job names later columns).
    old.db.execute("INSERT INTO jobs (job_id, profile, submit_time, updated_at) VALUES ('41', '3g', 5.0, 5.0)")
    old.add_event("test", "written by version 1")
    old.close()

    new = open_store(path)  # migrates on open
    assert new.schema_version == LATEST_VERSION
    assert "meta" in new.db.table_names()
    assert new.get_job("41").profile == "3g"
    assert new.get_job("41").blocked is None  # version 3's column, on a job written before it
    assert new.recent_events(1)[0].message == "written by version 1"
    new.set_meta("k", {"a": 1})
    assert new.get_meta("k") == {"a": 1}
    idx = {r["name"] for r in new.db.query("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "jobs_state_order" in idx
    new.close()


def test_an_error_that_only_mentions_a_lock_is_not_called_a_busy_database(tmp_path):
    """An SQLite error whose text merely contains "locked" (met as "no column named blocked") was reported
    as "stayed locked by another writer", which sends an admin after a lock that does not exist."""
    s = open_store(tmp_path / "state.db")
    with pytest.raises(StoreError, match="no column named unlocked_at") as info:
        with s.transaction():
            s._x("INSERT INTO jobs (job_id, unlocked_at) VALUES ('1', 'x')")
    assert not isinstance(info.value, StoreBusy)
    s.close()


def test_database_from_a_newer_version_is_refused(tmp_path):
    path = tmp_path / "state.db"
    s = open_store(path)
    s.db.execute("INSERT INTO schema_migrations (version, name, applied_at) VALUES (99, 'future', 0)")
    s.close()
    with pytest.raises(StoreError, match="newer than this slurm-mig"):
        open_store(path)


def test_failed_migration_rolls_back(tmp_path, monkeypatch):
    from slurm_mig.store import schema

    broken = schema.MIGRATIONS + ((LATEST_VERSION + 1, "broken", "CREATE TABLE half (x INTEGER);\nSELECT nope FROM missing_table;\n"),)
    monkeypatch.setattr(schema, "MIGRATIONS", broken)
    monkeypatch.setattr(schema, "LATEST_VERSION", LATEST_VERSION + 1)
    with pytest.raises(StoreError, match="no such table"):
        open_store(tmp_path / "s.db")
    monkeypatch.undo()
    s = open_store(tmp_path / "s.db")
    assert s.schema_version == LATEST_VERSION
    assert "half" not in s.db.table_names()


# -- the file: mode, symlinks, WAL -------------------------------------------------

def test_new_file_is_0600_even_with_a_permissive_umask(tmp_path):
    path = tmp_path / "sub" / "state.db"
    old = os.umask(0)
    try:
        s = open_store(path)
        s.add_event("x", "y")  # makes SQLite create -wal and -shm
    finally:
        os.umask(old)
    assert mode_of(path) == 0o600
    for suffix in ("-wal", "-shm"):
        p = Path(str(path) + suffix)
        if p.exists():
            assert mode_of(p) == 0o600
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert s.db.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    s.close()


def test_folders_made_for_the_database_have_their_modes_whatever_the_umask(tmp_path):
    """The folders above the database's that open_store made were 0777 less the umask: world-writable
    under umask 0 (anyone could move the database's folder aside and plant their own); and the group's
    folder was 0750 less the umask, 0700 under umask 0077, where db_group's readers cannot enter it."""
    group = grp.getgrgid(os.getegid()).gr_name
    old = os.umask(0)
    try:
        open_store(tmp_path / "a" / "b" / "state.db").close()
    finally:
        os.umask(old)
    assert (mode_of(tmp_path / "a"), mode_of(tmp_path / "a" / "b")) == (0o755, 0o700)
    old = os.umask(0o077)
    try:
        open_store(tmp_path / "g" / "h" / "state.db", group=group).close()
    finally:
        os.umask(old)
    assert (mode_of(tmp_path / "g"), mode_of(tmp_path / "g" / "h")) == (0o755, 0o750)
    os.chmod(tmp_path / "a", 0o711)  # a folder that exists is left as it is
    open_store(tmp_path / "a" / "c" / "state.db").close()
    assert (mode_of(tmp_path / "a"), mode_of(tmp_path / "a" / "c")) == (0o711, 0o700)


def test_group_readable_when_a_group_is_configured(tmp_path):
    group = grp.getgrgid(os.getegid()).gr_name
    path = tmp_path / "state.db"
    open_store(path, group=group).close()
    assert mode_of(path) == 0o640
    assert os.stat(path).st_gid == os.getegid()


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the file to another group: needs root")
@pytest.mark.parametrize("old_mode", [0o660, 0o600, 0o644])
def test_a_group_change_never_gives_the_new_group_more_than_the_final_mode(tmp_path, monkeypatch, old_mode):
    """An existing database of another group had its group changed before its mode: with 0660 the new group
    could write it, for a moment, where 0640 is meant. Each state the file passes through (read after every
    chown and chmod) gives no one more than both the old and the final mode, and the new group no more
    than the final one."""
    from slurm_mig.store import prepare_db_file

    path = tmp_path / "state.db"
    path.write_bytes(b"")
    os.chmod(path, old_mode)
    os.chown(path, -1, 0)
    new_gid = 65534 if os.getegid() != 65534 else 65533
    seen = []
    real_chown, real_chmod = os.fchown, os.fchmod

    def chown(fd, uid, gid):
        real_chown(fd, uid, gid)
        st = os.fstat(fd)
        seen.append((stat.S_IMODE(st.st_mode), st.st_gid))

    def chmod(fd, mode):
        real_chmod(fd, mode)
        st = os.fstat(fd)
        seen.append((stat.S_IMODE(st.st_mode), st.st_gid))

    monkeypatch.setattr(os, "fchown", chown)
    monkeypatch.setattr(os, "fchmod", chmod)
    prepare_db_file(path, group=str(new_gid))
    assert seen[-1] == (0o640, new_gid) and (mode_of(path), os.stat(path).st_gid) == (0o640, new_gid)
    for mode, gid in seen:
        assert mode & ~(old_mode | 0o640) == 0, seen
        if gid == new_gid:
            assert mode & ~0o640 == 0, seen


def test_too_open_mode_is_repaired(tmp_path):
    path = tmp_path / "state.db"
    open_store(path).close()
    os.chmod(path, 0o644)
    open_store(path).close()
    assert mode_of(path) == 0o600


def test_world_writable_database_is_refused(tmp_path):
    path = tmp_path / "state.db"
    open_store(path).close()
    os.chmod(path, 0o666)
    with pytest.raises(StoreError, match="world-writable"):
        open_store(path)
    assert mode_of(path) == 0o666  # refused, not silently "fixed"


def test_world_writable_wal_is_refused(tmp_path):
    path = tmp_path / "state.db"
    s = open_store(path)
    s.add_event("x", "y")
    wal = Path(str(path) + "-wal")
    assert wal.exists()
    os.chmod(wal, 0o666)
    with pytest.raises(StoreError, match="world-writable"):
        open_store(path)
    s.close()


@pytest.mark.parametrize("suffix", ["", "-wal"])
def test_a_database_file_another_user_owns_is_refused(tmp_path, monkeypatch, suffix):
    """A 0600 state.db (or -wal) owned by another user passed the checks: its owner, who can rewrite it
    whatever its mode (one planted in a folder others can write), decided what the controller binds."""
    path = tmp_path / "state.db"
    s = open_store(path)
    s.add_event("x", "y")  # makes SQLite create -wal
    target = Path(str(path) + suffix)
    if os.geteuid() == 0:
        os.chown(target, 4242, -1)
    else:  # a file of ours, seen by a process of another (non-root) user
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    with pytest.raises(StoreError, match="owned by uid"):
        open_store(path)
    s.close()


def test_symlinked_database_is_refused(tmp_path):
    real = tmp_path / "real.db"
    open_store(real).close()
    link = tmp_path / "state.db"
    link.symlink_to(real)
    with pytest.raises(StoreError, match="symbolic link"):
        open_store(link)
    dangling = tmp_path / "dangling.db"
    dangling.symlink_to(tmp_path / "nowhere.db")
    with pytest.raises(StoreError, match="symbolic link"):
        open_store(dangling)
    assert not (tmp_path / "nowhere.db").exists()


def test_a_file_that_is_not_a_database_is_a_store_error(tmp_path):
    path = tmp_path / "state.db"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"this is not sqlite" * 100)
    os.close(fd)
    with pytest.raises(StoreError, match="not a usable SQLite database"):
        open_store(path)


# -- transactions ------------------------------------------------------------------

def test_transaction_rolls_back_everything_on_error(db):
    db.upsert_job("1", profile="1g", submit_time=1.0)
    with pytest.raises(RuntimeError):
        with db.transaction():
            db.upsert_job("2", profile="3g", submit_time=2.0)
            db.set_job_state("1", "RUNNING", now=3.0)
            db.add_event("tick", "half a tick")
            raise RuntimeError("controller crashed mid-tick")
    assert db.get_job("2") is None
    assert db.get_job("1").state == "PENDING"
    assert db.recent_events() == []
    assert not db.in_transaction
    db.upsert_job("3", profile="2g", submit_time=4.0)  # the store is usable afterwards
    assert db.get_job("3") is not None


def test_nested_transaction_failure_undoes_only_the_inner_block(db):
    with db.transaction():
        db.add_event("outer", "kept")
        with pytest.raises(ValueError):
            with db.transaction():
                db.add_event("inner", "undone")
                raise ValueError("inner failure")
        db.add_event("outer", "also kept")
    assert [e.kind for e in db.recent_events()] == ["outer", "outer"]


def test_disk_full_is_a_store_error_and_rolls_back_the_tick(db):
    db.add_event("before", "committed earlier")
    pages = db.db.execute("PRAGMA page_count").fetchone()[0]
    db.db.execute(f"PRAGMA max_page_count = {pages + 2}")
    with pytest.raises(StoreError, match="full"):
        with db.transaction():
            db.upsert_job("9", profile="1g", submit_time=1.0)
            for i in range(200):
                db.add_event("filler", "x" * 4000, {"i": i})
    assert not db.in_transaction
    assert db.get_job("9") is None
    assert [e.kind for e in db.recent_events()] == ["before"]


def test_invalid_observation_leaves_the_previous_one_intact(db):
    observe(db, "n1", {0: "3g@0,3g@4"})
    # (A profile the model's table lacks, "5g", was the invalid one here until 2026-11-27: now it is a newer
    # node's, and its GPU is kept blocked: test_controller_upgrade.py.)
    with pytest.raises(ValueError):
        db.replace_observed("n1", [ObservedGpu(0, "GPU-x", "H100-80GB", True)],
                            [ObservedInstance(0, "3g", 0), ObservedInstance(1, "3g", 0)], now=200.0)
    assert str(db.observed_layout("n1", 0)) == "3g@0,3g@4"
    assert db.node("n1").last_seen == 100.0


def test_threads_share_one_store_safely(tmp_path):
    s = open_store(tmp_path / "s.db")
    s.set_meta("n", 0)

    def work():
        for _ in range(50):
            with s.transaction():
                s.set_meta("n", s.get_meta("n") + 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.get_meta("n") == 200


# -- concurrency between processes -------------------------------------------------

WORKER = textwrap.dedent("""
    import json, sys
    from slurm_mig.errors import StoreBusy
    from slurm_mig.store import open_store
    path, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    s = open_store(path, busy_timeout_s=30)
    recorded = 0
    for i in range(n):
        with s.transaction():                      # read-modify-write: must not lose updates
            s.set_meta("counter", s.get_meta("counter", 0) + 1)
            s.upsert_job(f"{name}-{i}", profile="1g", submit_time=float(i))
        # both workers race to record the same outcomes: each must land exactly once
        recorded += s.record_outcome(f"shared-{i}", state="COMPLETED", profile="1g", count=1, exit_code=0)
    print(json.dumps({"recorded": recorded}))
""")


def test_two_processes_writing_lose_no_updates(tmp_path):
    path = tmp_path / "state.db"
    open_store(path).close()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    n = 60
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(path), name, str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    s = open_store(path)
    assert s.get_meta("counter") == 2 * n
    assert len(s.jobs()) == 2 * n
    assert sum(r["recorded"] for r in results) == n
    assert len(s.outcomes()) == n


def test_store_busy_only_after_the_busy_timeout(tmp_path):
    path = tmp_path / "state.db"
    holder = open_store(path)
    impatient = open_store(path, busy_timeout_s=0.3)
    with holder.transaction():
        holder.add_event("tick", "holding the write lock")
        t0 = time.monotonic()
        with pytest.raises(StoreBusy, match="busy timeout") as info:
            impatient.add_event("other", "cannot get in")
        waited = time.monotonic() - t0
    assert isinstance(info.value, StoreError) and isinstance(info.value, SlurmMigError)
    assert 0.25 <= waited < 3.0
    assert not impatient.in_transaction
    impatient.add_event("other", "gets in once the lock is free")
    assert [e.kind for e in holder.recent_events()] == ["other", "tick"]


def test_a_patient_writer_waits_for_the_lock_instead_of_failing(tmp_path):
    path = tmp_path / "state.db"
    holder = open_store(path)
    patient = open_store(path, busy_timeout_s=5)
    ready = threading.Event()

    def hold():
        with holder.transaction():
            holder.add_event("tick", "slow tick")
            ready.set()
            time.sleep(0.5)

    t = threading.Thread(target=hold)
    t.start()
    ready.wait(5)
    t0 = time.monotonic()
    patient.add_event("api", "waited")
    assert time.monotonic() - t0 >= 0.3
    t.join()
    assert len(holder.recent_events()) == 2


def test_readers_are_not_blocked_by_a_writer(tmp_path):
    path = tmp_path / "state.db"
    writer = open_store(path)
    reader = open_store(path, busy_timeout_s=0)
    writer.add_event("a", "committed")
    with writer.transaction():
        writer.add_event("b", "not yet committed")
        assert [e.kind for e in reader.recent_events()] == ["a"]  # WAL: old snapshot, no wait


# -- jobs --------------------------------------------------------------------------

def test_jobs_of_one_submit_time_without_a_queue_order_go_by_job_id_as_numbers(db):
    """Jobs the tick has not ordered yet (a Prolog stored them first) and submitted at one time were ordered
    by job id as text: "100" before "99", "5_10" before "5_9". Slurm orders them by number, as the simulator
    does (jobids.job_id_key)."""
    from slurm_mig.jobids import job_id_key

    ids = ["100", "5_10", "99", "5_9", "101", "100_2", "100_10", "5"]
    for job_id in ids:
        db.upsert_job(job_id, profile="1g", submit_time=7.0)
    want = ["5", "5_9", "5_10", "99", "100", "100_2", "100_10", "101"]
    assert sorted(ids, key=job_id_key) == want
    assert [j.job_id for j in db.pending_jobs()] == want
    assert [j.job_id for j in db.jobs(["PENDING"])] == want
    assert db.job_ids(["PENDING"]) == want


def test_pending_jobs_in_priority_order_and_states(db):
    db.upsert_job("10", profile="3g", submit_time=1.0, user="ann", partition="gpu", time_limit_s=600)
    db.upsert_job("11", profile="1g", count=2, submit_time=2.0)
    db.upsert_job("12", profile="2g", submit_time=0.5)
    assert [j.job_id for j in db.pending_jobs()] == ["12", "10", "11"]  # submit time without an order
    db.set_job_order(["11", "10", "12"])
    assert [j.job_id for j in db.pending_jobs()] == ["11", "10", "12"]
    db.set_job_state("10", "RUNNING", now=50.0, node="n1")
    j = db.get_job("10")
    assert (j.state, j.start_time, j.node) == ("RUNNING", 50.0, "n1")
    assert [j.job_id for j in db.running_jobs()] == ["10"]
    db.set_job_state("10", "COMPLETED", now=80.0, exit_code=0)
    j = db.get_job("10")
    assert (j.state, j.start_time, j.end_time, j.exit_code) == ("COMPLETED", 50.0, 80.0, 0)
    # an update from Slurm keeps what the store learnt
    db.upsert_job("11", profile="1g", count=2, submit_time=2.0, user="bob")
    assert db.get_job("11").priority_order == 0 and db.get_job("11").user == "bob"
    with pytest.raises(ValueError, match="unknown job state"):
        db.set_job_state("11", "EXPLODED")
    with pytest.raises(StoreError, match="unknown job"):
        db.set_job_state("nope", "RUNNING")


def test_requeued_job_waits_afresh(db):
    db.upsert_job("5", profile="1g", submit_time=1.0)
    db.set_job_state("5", "RUNNING", now=10.0)
    db.set_job_state("5", "REQUEUED", now=20.0)
    assert db.pending_jobs() == []
    db.set_job_state("5", "PENDING", now=21.0)
    j = db.get_job("5")
    assert j.start_time is None and [p.job_id for p in db.pending_jobs()] == ["5"]


# -- bindings ----------------------------------------------------------------------

def test_bind_fills_uuids_and_hides_the_job_from_the_pending_queue(db):
    observe(db, "n1", {0: "3g@0,3g@4"})
    db.upsert_job("1", profile="3g", submit_time=1.0)
    bound = db.bind("1", "n1", [(0, Slot(4, "3g"))], now=5.0)
    assert bound[0].profile == "3g.40gb" and bound[0].uuid == "MIG-n1-0-4"
    assert db.bound_instances("1") == bound
    assert db.get_job("1").instances == bound and db.get_job("1").node == "n1"
    assert db.pending_jobs() == [] and len(db.pending_jobs(include_bound=True)) == 1
    assert db.job_on_instance("n1", 0, 4) == "1"
    # the same binding again is a no-op
    assert db.bind("1", "n1", [(0, Slot(4, "3g.40gb"))]) == bound


def test_set_binding_uuid_and_note_start_if_unknown_change_only_what_they_say(db):
    """The two writes the node API made with the store's private _x (what a node reports with /v1/bound)."""
    observe(db, "n1", {0: "3g@0,3g@4"})
    db.upsert_job("1", profile="3g", submit_time=1.0)
    db.bind("1", "n1", [(0, Slot(4, "3g"))], now=5.0)
    db.set_binding_uuid("1", "n1", 0, 4, "MIG-new")
    db.set_binding_uuid("1", "n1", 0, 0, "MIG-other")  # no such binding: nothing
    assert [b.uuid for b in db.bound_instances("1")] == ["MIG-new"]
    db.release("1", now=9.0)
    db.set_binding_uuid("1", "n1", 0, 4, "MIG-late")  # released: kept as it was
    assert db.db.execute("SELECT uuid FROM bindings WHERE job_id = '1'").fetchall() == [("MIG-new",)]
    db.upsert_job("2", profile="3g", submit_time=1.0)
    db.set_job_state("2", "CANCELLED", now=20.0)
    db.note_start_if_unknown("2", start_time=12.0, node="n1")
    db.note_start_if_unknown("2", start_time=15.0, node="n2")  # known now: kept
    j = db.get_job("2")
    assert (j.start_time, j.node, j.state, j.end_time) == (12.0, "n1", "CANCELLED", 20.0)


def test_binding_conflict(db):
    observe(db, "n1", {0: "3g@0,3g@4"})
    for j in ("1", "2"):
        db.upsert_job(j, profile="3g", submit_time=1.0)
    db.bind("1", "n1", [{"gpu": 0, "profile": "3g", "start": 0}])
    with pytest.raises(BindingConflict, match="held by live job 1") as info:
        db.bind("2", "n1", [(0, Slot(0, "3g.40gb"))])
    assert info.value.conflicts == (("n1", 0, 0, "1"),)
    with pytest.raises(BindingConflict):  # an overlapping instance is the same hardware
        db.bind("2", "n1", [(0, Slot(2, "1g"))])
    with pytest.raises(BindingConflict, match="already bound"):  # one job, one set of instances
        db.bind("1", "n1", [(0, Slot(4, "3g"))])
    assert db.bound_instances("2") == ()
    # released instances can be bound again
    assert db.release("1") == 1
    assert db.release("1") == 0
    db.bind("2", "n1", [(0, Slot(0, "3g"))])
    assert db.job_on_instance("n1", 0, 0) == "2"


def test_conflicting_bind_inside_a_tick_rolls_back_only_if_uncaught(db):
    observe(db, "n1", {0: "7g@0"})
    for j in ("1", "2"):
        db.upsert_job(j, profile="7g", submit_time=1.0)
    with pytest.raises(BindingConflict):
        with db.transaction():
            db.bind("1", "n1", [(0, Slot(0, "7g"))])
            db.bind("2", "n1", [(0, Slot(0, "7g"))])
    assert db.live_bindings() == []


def test_the_database_itself_forbids_double_binding(db):
    db.upsert_job("1", profile="1g", submit_time=1.0)
    db.upsert_job("2", profile="1g", submit_time=1.0)
    sql = "INSERT INTO bindings (job_id, node, gpu, start, profile, bound_at) VALUES (?, 'n1', 0, 3, '1g.10gb', 0)"
    db.db.execute(sql, ("1",))
    with pytest.raises(sqlite3.IntegrityError):
        db.db.execute(sql, ("2",))
    db.db.execute("UPDATE bindings SET released_at = 1")
    db.db.execute(sql, ("2",))  # fine once the first is released


def test_terminal_state_releases_bindings(db):
    observe(db, "n1", {0: "7g@0"})
    db.upsert_job("1", profile="7g", submit_time=1.0)
    db.bind("1", "n1", [(0, Slot(0, "7g"))])
    db.set_job_state("1", "RUNNING", now=2.0)
    db.set_job_state("1", "CANCELLED", now=3.0)
    assert db.live_bindings() == []
    with pytest.raises(StoreError, match="already ended"):
        db.bind("1", "n1", [(0, Slot(0, "7g"))])
    with pytest.raises(StoreError, match="unknown job"):
        db.bind("404", "n1", [(0, Slot(0, "7g"))])


# -- outcomes ----------------------------------------------------------------------

def test_outcome_recorded_exactly_once(db):
    observe(db, "n1", {0: "4g@0,3g@4"})
    db.upsert_job("7", profile="3g", submit_time=10.0, user="ann", partition="gpu", time_limit_s=3600)
    db.bind("7", "n1", [(0, Slot(4, "3g"))])
    db.set_job_state("7", "RUNNING", now=40.0)
    assert db.record_outcome("7", state="COMPLETED", exit_code=0, derived_exit_code=0, end_time=100.0) is True
    assert db.record_outcome("7", state="FAILED", exit_code=1, end_time=999.0) is False  # no duplicate, no overwrite
    o = db.outcome("7")
    assert (o.state, o.exit_code, o.wait_s, o.run_s) == ("COMPLETED", 0, 30.0, 60.0)
    assert (o.profile, o.count, o.node, o.gpus, o.user, o.partition) == ("3g", 1, "n1", (0,), "ann", "gpu")
    assert o.instances[0].uuid == "MIG-n1-0-4"
    assert db.db.execute("SELECT COUNT(*) FROM outcomes").fetchone()[0] == 1


def test_outcome_in_a_rolled_back_tick_is_not_lost(db):
    db.upsert_job("8", profile="1g", submit_time=1.0)
    with pytest.raises(RuntimeError):
        with db.transaction():
            assert db.record_outcome("8", state="COMPLETED", exit_code=0)
            raise RuntimeError("crash before commit")
    assert db.outcome("8") is None
    assert db.record_outcome("8", state="COMPLETED", exit_code=0) is True  # the retry records it
    assert db.record_outcome("8", state="COMPLETED", exit_code=0) is False


def test_outcome_for_a_job_the_store_never_saw(db):
    with pytest.raises(StoreError, match="without its profile"):
        db.record_outcome("99", state="FAILED")
    assert db.record_outcome("99", state="FAILED", profile="2g", count=1, exit_code=2, start_time=5.0, end_time=6.0)
    assert db.outcome("99").run_s == 1.0
    with pytest.raises(TypeError, match="unknown field"):
        db.record_outcome("100", state="FAILED", profile="1g", colour="red")


def _one_run(db, job_id: str, start: float, end: float, state: str = "COMPLETED") -> bool:
    """The job runs from ``start`` and its Epilog reports at ``end``: record_outcome's result."""
    db.set_job_state(job_id, "RUNNING", now=start, node="n1")
    recorded = db.record_outcome(job_id, state=state, exit_code=0 if state == "COMPLETED" else 1, end_time=end,
                                 now=end)
    db.set_job_state(job_id, state, now=end)
    return recorded


def test_each_run_of_a_reused_job_id_has_its_own_outcome(db):
    """Slurm reuses job ids (a fresh StateSaveLocation, MaxJobId wrapping, a requeue after the end): the
    second run's outcome was dropped, as outcomes were recorded once per job id."""
    db.upsert_job("7", profile="3g", submit_time=10.0, user="ann")
    assert _one_run(db, "7", 40.0, 100.0)
    db.restart_job("7", now=500.0, reason="live in Slurm again")
    assert _one_run(db, "7", 600.0, 900.0, state="FAILED")
    assert db.get_job("7").run == 2
    got = [(o.job_id, o.run, o.state, o.start_time, o.end_time, o.run_s) for o in db.outcomes()]
    assert got == [("7", 1, "COMPLETED", 40.0, 100.0, 60.0), ("7", 2, "FAILED", 600.0, 900.0, 300.0)]
    assert (db.outcome("7").run, db.outcome("7").state) == (2, "FAILED")  # the latest run's
    assert db.db.execute("SELECT COUNT(*) FROM outcomes").fetchone()[0] == 2


def test_the_same_run_reported_twice_is_still_one_outcome(db):
    # Slurm's record settled the run (lost Epilog), then the Epilog's own report arrived from the outbox;
    # and an Epilog re-sent. Each run once, the first word kept.
    db.upsert_job("7", profile="1g", submit_time=10.0)
    assert _one_run(db, "7", 40.0, 100.0, state="FAILED")
    assert db.record_outcome("7", state="COMPLETED", exit_code=0, end_time=101.0, now=120.0) is False
    db.restart_job("7", now=500.0, reason="live in Slurm again")
    assert _one_run(db, "7", 600.0, 900.0)
    assert db.record_outcome("7", state="COMPLETED", exit_code=0, end_time=900.0, now=950.0) is False
    assert [(o.run, o.state, o.end_time) for o in db.outcomes()] == [(1, "FAILED", 100.0), (2, "COMPLETED", 900.0)]


def test_a_job_row_made_again_for_an_id_with_outcomes_is_a_later_run(db):
    # A revived job's row, forgotten while pending (an array task Slurm runs under an id of its own), then
    # listed again: numbered after the runs recorded, so its outcome is not taken for theirs.
    db.upsert_job("7", profile="1g", submit_time=10.0)
    assert _one_run(db, "7", 40.0, 100.0)
    db.restart_job("7", now=500.0, reason="live in Slurm again")
    assert db.forget_pending_job("7")
    db.upsert_job("7", profile="1g", submit_time=600.0)
    assert _one_run(db, "7", 700.0, 800.0)
    assert db.get_job("7").run == 2
    assert [o.run for o in db.outcomes()] == [1, 2]


def test_correct_end_state_corrects_only_the_current_runs_outcome(db):
    db.upsert_job("7", profile="1g", submit_time=10.0)
    assert _one_run(db, "7", 40.0, 100.0)
    db.restart_job("7", now=500.0, reason="live in Slurm again")
    assert _one_run(db, "7", 600.0, 900.0)
    assert db.correct_end_state("7", "TIMEOUT", now=901.0)
    assert [(o.run, o.state) for o in db.outcomes()] == [(1, "COMPLETED"), (2, "TIMEOUT")]
    assert db.get_job("7").state == "TIMEOUT"
    assert not db.correct_end_state("7", "CANCELLED", now=902.0)  # not COMPLETED or FAILED any more
    assert [o.state for o in db.outcomes()] == ["COMPLETED", "TIMEOUT"]


def _version_3_store(path):
    """A version-3 database with outcomes written as version 3's code wrote them (one per job id)."""
    old = open_store(path, migrate=False)
    assert migrate(old.db, target=3) == [1, 2, 3]
    jobs = [  # job_id, state, start_time: 41 ended; 42 runs again; 43 ran again and ended, its outcome lost
        ("41", "COMPLETED", 20.0), ("42", "PENDING", None), ("43", "CANCELLED", 300.0), ("44", "RUNNING", 30.0)]
    for job_id, state, start in jobs:
        old.db.execute("INSERT INTO jobs (job_id, profile, state, submit_time, start_time, updated_at) "
                       "VALUES (?, '3g', ?, 5.0, ?, 5.0)", (job_id, state, start))
    for job_id, start, end in (("41", 20.0, 80.0), ("42", 25.0, 90.0), ("43", 30.0, 70.0), ("99", 1.0, 2.0)):
        old.db.execute("INSERT INTO outcomes (job_id, profile, count, gpus, instances, user, submit_time, "
                       "start_time, end_time, wait_s, run_s, exit_code, state, recorded_at) VALUES "
                       "(?, '3g', 1, '[0]', '[]', 'ann', 5.0, ?, ?, ?, ?, 0, 'COMPLETED', ?)",
                       (job_id, start, end, start - 5.0, end - start, end))
    old.close()


def test_version_3_outcomes_migrate_to_one_per_run(tmp_path):
    path = tmp_path / "state.db"
    _version_3_store(path)
    new = open_store(path)  # migrates on open
    assert new.schema_version == LATEST_VERSION
    got = [(o.job_id, o.run, o.state, o.start_time, o.end_time, o.run_s) for o in new.outcomes()]
    assert got == [("99", 1, "COMPLETED", 1.0, 2.0, 1.0), ("43", 1, "COMPLETED", 30.0, 70.0, 40.0),
                   ("41", 1, "COMPLETED", 20.0, 80.0, 60.0), ("42", 1, "COMPLETED", 25.0, 90.0, 65.0)]
    assert {(o.user, o.gpus, o.wait_s) for o in new.outcomes() if o.job_id == "41"} == {("ann", (0,), 15.0)}
    # The recorded outcome is run 1; a job already running again is on run 2, one that never did on run 1.
    assert {j: new.get_job(j).run for j in ("41", "42", "43", "44")} == {"41": 1, "42": 2, "43": 2, "44": 1}
    assert "outcomes_end" in {r["name"] for r in new.db.query("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert not new.record_outcome("41", state="FAILED", exit_code=1)  # its run's outcome is in
    assert _one_run(new, "42", 200.0, 260.0)  # the run that went on
    assert [(o.run, o.end_time) for o in new.outcomes() if o.job_id == "42"] == [(1, 90.0), (2, 260.0)]
    with pytest.raises(StoreError, match="UNIQUE"):
        with new.transaction():
            new._x("INSERT INTO outcomes (job_id, run, profile, count, state, recorded_at) "
                   "VALUES ('41', 1, '3g', 1, 'FAILED', 0)")
    new.close()


def test_outcomes_of_a_version_3_database_read_without_migrating_it(tmp_path):
    # The read-only views (`slurm-mig explain`) open the database without migrating it: before the
    # controller is restarted on the new version it has no run column.
    from slurm_mig.ops import views as V
    from slurm_mig.ops.explain import explain_view

    path = tmp_path / "state.db"
    _version_3_store(path)
    os.chmod(path, 0o600)
    ro = V.open_readonly(path)
    assert ro.schema_version == 3
    assert (ro.outcome("42").run, ro.outcome("42").end_time) == (1, 90.0)
    assert [o.job_id for o in ro.outcomes()] == ["99", "43", "41", "42"]
    assert explain_view(ro, "42", now=100.0)["outcome"]["run"] == 1
    ro.close()


# -- journal, desired layouts, events, decisions ------------------------------------

def test_reconfiguration_journal(db):
    cur = parse_layout("7g@0", H100)
    target = parse_layout("3g@0,3g@4", H100)
    steps = plan_transition(cur, target)
    jid = db.journal_begin("n1", 0, cur, target, steps, now=1.0)
    e = db.journal_entry(jid)
    assert (e.state, e.progress, e.from_layout, e.to_layout) == ("in_progress", 0, "7g@0", "3g@0,3g@4")
    assert [s.action for s in e.steps] == ["destroy", "create", "create"]
    assert [x.id for x in db.open_journal_entries()] == [jid]
    db.journal_step(jid, 0, now=2.0)
    e = db.journal_step(jid, now=3.0)
    assert e.progress == 2 and e.remaining == (e.steps[2],)
    with pytest.raises(StoreError, match="not the next step"):
        db.journal_step(jid, 0)
    e = db.journal_step(jid, ok=False, error="NVML_ERROR_INSUFFICIENT_RESOURCES", now=4.0)
    assert e.progress == 2 and e.error == "NVML_ERROR_INSUFFICIENT_RESOURCES" and len(e.step_log) == 3
    e = db.journal_finish(jid, "failed", outcome="stopped after 2 of 3 steps", now=5.0)
    assert (e.state, e.finished_at) == ("failed", 5.0)
    assert db.open_journal_entries() == []
    with pytest.raises(StoreError, match="already failed"):
        db.journal_finish(jid)
    planned = db.journal_begin("n1", 1, "empty", "7g@0", [{"action": "create", "profile": "7g.80gb", "start": 0}],
                               started=False)
    assert db.journal_entry(planned).state == "planned"
    assert [x.id for x in db.open_journal_entries("n1")] == [planned]


def test_journal_started_takes_the_store_lock_like_every_other_call(tmp_path):
    """journal_started ran its UPDATE on the shared connection without the store's lock or a transaction of
    its own: called from a thread while another held a transaction, it went into that thread's transaction
    at once and was undone with it (and committed with it, had it not rolled back)."""
    s = open_store(tmp_path / "state.db", busy_timeout_s=5.0)
    eid = s.journal_begin("n1", 0, "", "7g@0", [], started=False, now=1.0)
    other = threading.Thread(target=s.journal_started, args=(eid,), kwargs={"now": 2.0})
    with pytest.raises(RuntimeError):
        with s.transaction():
            other.start()
            other.join(0.3)
            assert other.is_alive()  # it waits for this transaction, as every other call does
            raise RuntimeError("this transaction rolls back")
    other.join(5)
    entry = s.journal_entry(eid)
    assert (entry.state, entry.started_at) == ("in_progress", 2.0)
    s.close()


def test_desired_layouts(db):
    observe(db, "n1", {0: "7g@0", 1: "7g@0"})
    db.set_desired("n1", 0, parse_layout("3g@0,2g@4,1g@6", H100), "first-fit", "carve for job 3", now=1.0)
    db.set_desired("n1", 1, "7g@0", "first-fit", now=1.0)
    db.set_desired("n1", 0, "4g@0,3g@4", "first-fit", "carve for job 4", now=2.0)
    d = db.desired("n1")
    assert set(d) == {0, 1}
    assert (d[0].spec, d[0].reason, d[0].decided_at) == ("4g@0,3g@4", "carve for job 4", 2.0)
    assert d[0].layout() == parse_layout("4g@0,3g@4", H100)
    db.clear_desired("n1", 1)
    assert set(db.desired("n1")) == {0}
    assert db.desired("other") == {}


def test_events(db):
    for i in range(5):
        db.add_event("bind" if i % 2 else "reconfig", f"event {i}", {"i": i}, node="n1", job_id=str(i), now=float(i))
    ev = db.recent_events(3)
    assert [e.message for e in ev] == ["event 4", "event 3", "event 2"]
    assert ev[0].details == {"i": 4}
    assert [e.message for e in db.recent_events(kind="bind")] == ["event 3", "event 1"]
    assert [e.message for e in db.recent_events(job_id="2")] == ["event 2"]


def test_an_earlier_runs_outcome_takes_nothing_from_the_jobs_row(db):
    db.upsert_job("3", profile="1g", user="alice", partition="gpu", time_limit_s=3600.0, submit_time=100.0,
                  now=100.0)
    db.set_job_state("3", "CANCELLED", now=150.0)
    # The id reused by another job: the tick stores its request, then tracks it as the next run.
    db.upsert_job("3", profile="3g", count=2, user="bob", partition="big", time_limit_s=600.0, now=200.0)
    db.restart_job("3", now=200.0, reason="again", submit_time=190.0)
    db.set_job_state("3", "RUNNING", now=210.0, node="n2")
    with pytest.raises(StoreError, match="runs are 1 to 2"):
        db.record_outcome("3", run=3, state="COMPLETED")
    with pytest.raises(StoreError, match="without its profile"):  # the jobs row's is run 2's
        db.record_outcome("3", run=1, state="COMPLETED", end_time=140.0)
    assert db.record_outcome("3", run=1, state="COMPLETED", exit_code=0, end_time=140.0, now=300.0, node="n1",
                             profile="1g")
    assert not db.record_outcome("3", run=1, state="FAILED", end_time=141.0)  # once per run
    (o,) = db.outcomes()
    assert (o.run, o.profile, o.count, o.user, o.partition, o.time_limit_s, o.node, o.submit_time, o.start_time,
            o.end_time) == (1, "1g", 1, "", "", None, "n1", None, None, 140.0)  # nothing of run 2's


def test_a_handled_node_message_keeps_its_answer_until_pruned(db):
    mid = "ab" * 16
    assert db.message_answer("n1", "/v1/epilog", mid) is None
    db.record_message("n1", "/v1/epilog", mid, {"ok": True, "recorded": True}, now=100.0)
    db.record_message("n1", "/v1/epilog", mid, {"ok": True, "recorded": False}, now=150.0)  # the first stays
    assert db.message_answer("n1", "/v1/epilog", mid) == {"ok": True, "recorded": True}
    # Another node, or another route, with the same id is another message.
    assert db.message_answer("n2", "/v1/epilog", mid) is None
    assert db.message_answer("n1", "/v1/bound", mid) is None
    assert db.prune(keep_journal_days=1, now=100.0 + 86400)["messages"] == 0
    assert db.prune(keep_journal_days=1, now=101.0 + 86400)["messages"] == 1
    assert db.message_answer("n1", "/v1/epilog", mid) is None


def test_node_state(db):
    db.upsert_node("n1", state="drain", health="ECC errors", health_detail={"xid": 48})
    n = db.node("n1")
    assert (n.state, n.health, n.health_detail) == ("drain", "ECC errors", {"xid": 48})
    db.upsert_node("n1", agent_version="0.1.0")
    assert db.node("n1").state == "drain"
    with pytest.raises(ValueError):
        db.upsert_node("n1", state="sleepy")


def test_one_node_is_a_keyed_lookup_not_a_scan(db, monkeypatch):
    """Every node report asks for its node's row (b7d110c). node() read every node and searched them,
    inside the report's transaction: with 1,000 nodes reporting at once, Prologs waited past the busy
    timeout (benchmarks/load_api.py --nodes 1000: 439 of 4000 requests answered 503)."""
    for i in range(3):
        db.upsert_node(f"n{i}", state="drain")
    monkeypatch.setattr(type(db), "nodes", lambda self: pytest.fail("node() read every node"))
    assert db.node("n1").state == "drain" and db.node("nope") is None


# -- the policy's view --------------------------------------------------------------

def test_cluster_state_round_trip_into_a_policy(db):
    # n1: GPU 0 split 3g+3g, job A runs on 3g@0; GPU 1 whole (7g), being reconfigured.
    # n2: one GPU with a 1g grid, one 1g in use by a process slurm-mig did not place; node stale.
    observe(db, "n1", {0: "3g@0,3g@4", 1: "7g@0"}, now=100.0)
    observe(db, "n2", {0: "1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6"}, in_use={(0, 6)}, now=10.0)
    db.upsert_job("A", profile="3g", submit_time=1.0, time_limit_s=600)
    db.bind("A", "n1", [(0, Slot(0, "3g"))])
    db.set_job_state("A", "RUNNING", now=50.0)
    db.upsert_job("P1", profile="3g", submit_time=20.0, time_limit_s=60, user="ann", partition="gpu")
    db.upsert_job("P2", profile="1g", count=2, submit_time=10.0)
    db.upsert_job("P3", profile="4g", submit_time=5.0)
    db.set_job_order(["P1", "P2", "P3"])
    seven, split = parse_layout("7g@0", H100), parse_layout("4g@0,3g@4", H100)
    jid = db.journal_begin("n1", 1, seven, split, plan_transition(seven, split))
    db.journal_step(jid)  # 7g destroyed; creates pending

    state = db.cluster_state(now=120.0, stale_after_s=60)
    assert isinstance(state, ClusterState) and state.now == 120.0
    assert [g.key for g in state.gpus] == ["n1/0", "n1/1", "n2/0"]
    g0 = state.gpu("n1/0")
    assert g0.model is H100 and str(g0.layout) == "3g@0,3g@4"
    assert g0.busy == {Slot(0, "3g.40gb")} and g0.reconfiguring == frozenset()
    assert g0.busy_until == ((Slot(0, "3g.40gb"), 650.0),)
    assert g0.idle == {Slot(4, "3g.40gb")} and g0.available
    g1 = state.gpu("n1/1")
    assert str(g1.layout) == "4g@0,3g@4"  # 7g gone, both instances being created
    assert g1.reconfiguring == g1.layout.slots and g1.idle == frozenset()
    g2 = state.gpu("n2/0")
    assert g2.busy == {Slot(6, "1g.10gb")} and not g2.available  # stale node
    assert [(j.job_id, j.profile, j.count) for j in state.pending] == [("P1", "3g", 1), ("P2", "1g", 2), ("P3", "4g", 1)]
    assert state.pending[0].time_limit_s == 60 and state.pending[0].user == "ann"

    policy = get_policy("first-fit")
    decision = policy.decide(state)
    check_decision(state, decision)
    placed = {a.job_id: a for a in decision.assignments}
    assert placed["P1"].node == "n1" and placed["P1"].instances == ((0, Slot(4, "3g.40gb")),)
    assert "P2" not in placed  # n2 is stale and n1 has no room for two 1g without touching locked slices

    did = db.record_decision(decision, state=state, latency_ms=1.5)
    rec = db.recent_decisions(1)[0]
    assert rec.id == did and rec.policy == "first-fit" and not rec.shadow
    assert rec.inputs["gpus"][0]["layout"] == "3g@0,3g@4"
    assert rec.action["assignments"][0]["job_id"] == "P1"
    assert dict(map(tuple, rec.reasons)).keys() == {j for j, _ in decision.waiting}
    assert db.get_job("P2").reason  # why it waits, for `explain`

    # acting on the decision: the next state sees the instance busy and P1 no longer pending
    for a in decision.assignments:
        db.bind(a.job_id, a.node, a.instances)
    for ch in decision.changes:
        db.set_desired(ch.node, ch.gpu, ch.target, decision.policy, ch.reason)
    state2 = db.cluster_state(now=121.0, stale_after_s=60)
    assert Slot(4, "3g.40gb") in state2.gpu("n1/0").busy
    assert "P1" not in [j.job_id for j in state2.pending]
    check_decision(state2, policy.decide(state2))


def test_a_started_job_not_yet_bound_holds_an_instance_of_its_size(db):
    """Slurm started U (3g) and V (1g x 2) on n1; their Prologs have not bound yet. The policy must see
    an idle instance of each size taken, or it plans away the instances the Prologs are about to take
    (measured: requeues in a start-up burst of the demo)."""
    observe(db, "n1", {0: "3g@0,2g@4,1g@6", 1: "3g@0,2g@4,1g@6"}, now=100.0)
    observe(db, "n2", {0: "3g@0,3g@4"}, now=100.0)
    for job, prof, count in (("U", "3g", 1), ("V", "1g", 2), ("W", "3g", 1), ("OLD", "2g", 1)):
        db.upsert_job(job, profile=prof, count=count, submit_time=1.0)
    db.set_job_state("U", "RUNNING", now=110.0, node="n1")
    db.set_job_state("V", "RUNNING", now=110.0, node="n1")
    db.set_job_state("OLD", "RUNNING", now=110.0 - 500, node="n1")  # past the window: no Prolog ran, not ours
    db.set_job_state("W", "RUNNING", now=110.0, node="n2")
    db.bind("W", "n2", [(0, Slot(4, "3g"))])  # bound: counted once, by its binding
    state = db.cluster_state(now=120.0)
    busy = {g.key: set(g.busy) for g in state.gpus}
    assert busy["n1/0"] == {Slot(0, "3g.40gb"), Slot(6, "1g.10gb")}
    assert busy["n1/1"] == {Slot(6, "1g.10gb")}  # V's second 1g; no 2g held for OLD
    assert busy["n2/0"] == {Slot(4, "3g.40gb")}
    # Once U binds (to the other GPU's 3g, say), its promise is the binding: still one 3g busy in all.
    db.bind("U", "n1", [(1, Slot(0, "3g"))])
    busy = {g.key: set(g.busy) for g in db.cluster_state(now=120.0).gpus}
    assert busy["n1/0"] == {Slot(6, "1g.10gb")} and busy["n1/1"] == {Slot(0, "3g.40gb"), Slot(6, "1g.10gb")}


def test_cluster_state_skips_unknown_models_and_marks_down_nodes(db):
    db.replace_observed("n1", [{"index": 0, "uuid": "GPU-a", "model": None, "mig_enabled": False},
                               {"index": 1, "uuid": "GPU-b", "model": "A100-40GB", "mig_enabled": True}],
                        [{"gpu": 1, "profile": "7g", "start": 0, "uuid": "MIG-b"}], now=1.0)
    db.set_node_state("n1", "drain")
    state = db.cluster_state(now=2.0)
    assert [g.key for g in state.gpus] == ["n1/1"]
    assert str(state.gpus[0].layout) == "7g@0" and not state.gpus[0].available
    assert get_policy("first-fit").decide(state).assignments == ()


def test_replace_observed_replaces_the_whole_node(db):
    observe(db, "n1", {0: "7g@0", 1: "7g@0"}, now=1.0)
    observe(db, "n2", {0: "7g@0"}, now=1.0)
    observe(db, "n1", {0: "3g@0,3g@4"}, now=2.0)
    assert [(g.node, g.gpu) for g in db.observed_gpus()] == [("n1", 0), ("n2", 0)]
    assert [str(i.slot) for i in db.observed_instances("n1")] == ["3g.40gb@0", "3g.40gb@4"]
    assert db.observed_layout("n2", 0) == parse_layout("7g@0", H100)
    assert db.node("n1").last_seen == 2.0
    with pytest.raises(ValueError, match="did not list"):
        db.replace_observed("n1", [], [ObservedInstance(0, "7g", 0)])


def test_writing_inside_a_read_snapshot_is_refused(db):
    with db.snapshot():
        db.recent_events()
        with pytest.raises(StoreError, match="read-only"):
            db.add_event("x", "y")
    db.add_event("x", "y")
    assert len(db.recent_events()) == 1


def test_an_inner_failure_that_sqlite_rolled_back_whole_does_not_commit_the_rest(db):
    # SQLite rolls a whole transaction back on SQLITE_FULL (and I/O errors), not just the failing savepoint.
    # A caller that catches the inner StoreError and goes on must not have its later writes committed one by
    # one outside any transaction (half a tick, or half a node request, written).
    db.add_event("before", "committed earlier")
    pages = db.db.execute("PRAGMA page_count").fetchone()[0]
    with pytest.raises(StoreError):
        with db.transaction():
            db.upsert_job("9", profile="1g", submit_time=1.0)
            db.db.execute(f"PRAGMA max_page_count = {pages + 2}")
            with pytest.raises(StoreError, match="full"):
                with db.transaction():
                    for i in range(200):
                        db.add_event("filler", "x" * 4000, {"i": i})
            db.db.execute("PRAGMA max_page_count = 1073741823")  # space is back
            db.add_event("after", "written after the inner failure")
            db.set_job_state("9", "RUNNING", now=2.0)
    assert not db.in_transaction
    assert db.get_job("9") is None
    assert [e.kind for e in db.recent_events()] == ["before"]
    db.add_event("later", "the store is usable afterwards")
    assert [e.kind for e in db.recent_events()] == ["later", "before"]


def test_a_decision_with_infinite_or_nan_values_is_stored_with_null_and_every_jobs_reason_set_in_order(db):
    from dataclasses import replace

    from slurm_mig.policies import Assignment, Decision

    observe(db, "n1", {0: "7g@0"})
    for j in ("W1", "W2", "AB"):
        db.upsert_job(j, profile="7g", submit_time=1.0)
    state = db.cluster_state(now=120.0)
    # A GPU held "until never" (frag-aware reserves behind jobs without a time limit), and a NaN a policy gave.
    state = replace(state, gpus=tuple(replace(g, busy_until=((Slot(0, "7g.80gb"), float("inf")),)) for g in state.gpus))
    decision = Decision(assignments=(Assignment("AB", "n1", ((0, Slot(0, "7g.80gb")),), "placed"),),
                        waiting=(("W1", "waits one"), ("AB", "waits first"), ("W2", "waits two")),
                        policy="p", extra={"hold_until": float("inf"), "score": float("nan"), "ok": 1.5})
    did = db.record_decision(decision, state=state)
    rec = db.recent_decisions(1)[0]
    assert rec.id == did
    assert rec.inputs["gpus"][0]["busy_until"] == [["7g.80gb@0", None]]
    assert rec.action["extra"] == {"hold_until": None, "score": None, "ok": 1.5}
    # A job both waiting and assigned ends with the assignment's reason, as when each was its own statement.
    assert [db.get_job(j).reason for j in ("W1", "W2", "AB")] == ["waits one", "waits two", "placed"]


def test_job_ids_lists_the_jobs_of_the_states_asked_in_the_order_of_jobs(db):
    for j, submit in (("b", 3.0), ("a", 2.0), ("c", 1.0), ("r", 0.5)):
        db.upsert_job(j, profile="1g", submit_time=submit)
    db.set_job_order(["a", "b"])
    db.set_job_state("r", "RUNNING")
    assert db.job_ids(["PENDING"]) == [j.job_id for j in db.jobs(["PENDING"])] == ["a", "b", "c"]
    assert db.job_ids(["PENDING"]) == [j.job_id for j in db.pending_jobs(include_bound=True, include_blocked=True)]
    assert db.job_ids(["RUNNING", "PENDING"]) == [j.job_id for j in db.jobs(["RUNNING", "PENDING"])]
    with pytest.raises(ValueError):
        db.job_ids(["WAITING"])


def test_job_users_maps_the_jobs_of_the_states_asked_to_their_users(db):
    for j, user, uid in (("a", "alice", 1001), ("b", "bob", None), ("r", "", None)):
        db.upsert_job(j, profile="1g", user=user, uid=uid)
    db.set_job_state("r", "RUNNING")
    assert db.job_users(["PENDING"]) == {"a": ("alice", 1001), "b": ("bob", None)}
    assert db.job_users(["PENDING", "RUNNING"]) == {"a": ("alice", 1001), "b": ("bob", None), "r": ("", None)}


def test_a_jobs_uid_is_kept_for_its_name_and_dropped_with_it(db):
    """jobs.uid (version 8): written where the writer knows it (a tick); a write without one (a Prolog, which has
    only squeue's name) keeps it for the same name and leaves none for another."""
    db.upsert_job("a", profile="1g", user="alice", uid=1001)
    assert db.get_job("a").uid == 1001
    db.upsert_job("a", profile="1g", user="alice")
    assert db.get_job("a").uid == 1001
    db.upsert_job("a", profile="1g", user="alice.smith", uid=1001)
    assert (db.get_job("a").user, db.get_job("a").uid) == ("alice.smith", 1001)
    db.upsert_job("a", profile="1g", user="bob")
    assert db.get_job("a").uid is None
    with pytest.raises(ValueError):
        db.job_users(["WAITING"])


# -- the size of the decision history ([controller].keep_decisions_mb) ---------------

def _stored_sizes(store) -> dict[int, int]:
    """Each decision's inputs, action and reasons as SQLite stores them, in bytes (what decision_bytes holds)."""
    return {r[0]: r[1] for r in store.db.execute(
        "SELECT id, length(CAST(inputs AS BLOB)) + length(CAST(action AS BLOB)) + length(CAST(reasons AS BLOB)) "
        "FROM decisions ORDER BY id")}


def _sizes(store) -> dict[int, int]:
    return {r[0]: r[1] for r in store.db.execute("SELECT id, bytes FROM decision_bytes ORDER BY id")}


def test_decisions_are_pruned_to_a_size_budget_keeping_the_newest(db):
    """keep_decisions bounds the history by count only: at 1,024 GPUs and 10,000 pending jobs a decision is some
    3 MB, and 50,000 of them 140 GB. The newest decisions that fit the size budget are kept, the newest always,
    their sizes read from decision_bytes (written with each decision), not from the stored JSON."""
    from slurm_mig.policies import Decision

    ids = [db.record_decision(Decision(policy="p", waiting=(("J", "why"),)), inputs={"pad": "x" * (1000 * k)},
                              now=float(k)) for k in range(1, 11)]
    sizes = _stored_sizes(db)
    assert _sizes(db) == sizes and list(sizes) == ids
    assert db.decision_bytes_unpruned == sum(sizes.values())
    newest3 = sum(sizes[i] for i in ids[-3:])
    # The count still binds on its own; a budget the history fits in prunes nothing.
    assert db.prune(keep_decisions=9, keep_decisions_bytes=sum(sizes.values()))["decisions"] == 1
    assert db.decision_bytes_unpruned == 0
    assert db.prune(keep_decisions_bytes=newest3)["decisions"] == 6
    assert [d.id for d in db.recent_decisions(20)] == ids[:-4:-1] and list(_sizes(db)) == ids[-3:]
    assert db.prune(keep_decisions_bytes=newest3 - 1)["decisions"] == 1  # the third newest no longer fits
    assert list(_sizes(db)) == ids[-2:]
    assert db.prune(keep_decisions_bytes=1)["decisions"] == 1  # the newest alone is over it: it stays
    assert [d.id for d in db.recent_decisions(20)] == ids[-1:] and list(_sizes(db)) == ids[-1:]
    assert db.prune(keep_decisions_bytes=1)["decisions"] == 0
    assert db.prune(keep_decisions_bytes=2 ** 63 - 1)["decisions"] == 0  # past SQLite's 64 bits: keeps all
    nxt = db.record_decision(Decision(policy="p"), inputs={}, now=20.0)
    assert nxt > ids[-1] and _sizes(db) == _stored_sizes(db)
    # The readers take what is left: explain's decision spans and the decisions view.
    from slurm_mig.ops import views as V
    assert [d["id"] for d in V.decisions_view(db, include_noop=True)] == [nxt, ids[-1]]


def test_version_6_decisions_get_their_sizes_when_migrated(tmp_path):
    path = tmp_path / "state.db"
    old = open_store(path, migrate=False)
    assert migrate(old.db, target=6) == [1, 2, 3, 4, 5, 6]
    for k, inputs in enumerate(['{"gpus": []}', '{"note": "d\u00e9j\u00e0 vu"}', "{" + '"p": "' + "y" * 5000 + '"}']):
        old.db.execute("INSERT INTO decisions (time, policy, inputs, action, reasons) VALUES (?, 'p', ?, '{}', ?)",
                       (float(k), inputs, '[["7", "waits"]]'))
    old.close()

    new = open_store(path)  # migrates on open
    assert new.schema_version == LATEST_VERSION
    sizes = _sizes(new)
    assert sizes == _stored_sizes(new) and list(sizes) == [1, 2, 3]
    assert sizes[2] == len('{"note": "d\u00e9j\u00e0 vu"}'.encode()) + 2 + len('[["7", "waits"]]')  # bytes, not chars
    assert new.prune(keep_decisions_bytes=sizes[3] + sizes[2])["decisions"] == 1
    assert list(_sizes(new)) == [2, 3] and [d.id for d in new.recent_decisions()] == [3, 2]
    from slurm_mig.policies import Decision
    did = new.record_decision(Decision(policy="p"), inputs={"gpus": []})
    assert did == 4 and _sizes(new) == _stored_sizes(new)
    new.close()


def test_a_long_decision_history_is_pruned_in_steps_and_the_rest_left_for_the_next_prune(db, monkeypatch):
    """Freeing a decision reads its pages (some 7 ms a MB): tens of GB (a database upgraded after it grew) pruned
    in one transaction held the write lock, and the node requests waiting on it, for minutes. The oldest go a
    step per transaction, at most PRUNE_MAX_BYTES per prune; the controller prunes the rest next tick."""
    from slurm_mig.policies import Decision
    from slurm_mig.store import history  # where prune reads them

    ids = [db.record_decision(Decision(policy="p"), inputs={"pad": "x" * 1000}) for _ in range(10)]
    size = _sizes(db)[ids[0]]
    assert set(_sizes(db).values()) == {size}
    monkeypatch.setattr(history, "PRUNE_STEP_BYTES", 2 * size)
    monkeypatch.setattr(history, "PRUNE_MAX_BYTES", 5 * size)
    deletes = []
    db.db.conn.set_trace_callback(lambda sql: deletes.append(sql) if sql.startswith("DELETE FROM decisions ") else None)
    try:
        assert db.prune(keep_decisions_bytes=1)["decisions"] == 5
        assert len(deletes) == 3  # 2 + 2 + 1, each in its own transaction
        assert list(_sizes(db)) == ids[5:] and db.decision_bytes_unpruned == 4 * size  # to go, the newest stays
        assert db.prune(keep_decisions_bytes=1)["decisions"] == 4
        assert list(_sizes(db)) == ids[-1:] and db.decision_bytes_unpruned == 0
    finally:
        db.db.conn.set_trace_callback(None)


def test_version_9_outcomes_settled_by_a_guess_are_marked_guessed_when_migrated(tmp_path):
    """A run settled without Slurm's record or its Epilog (controller/runs.py FORGOTTEN: FAILED, no exit status) is
    the controller's guess, which the run's Epilog replaces even after the id ran again (outcomes.guessed). Rows
    of version 9 are marked where the jobs row still says so; an outcome from Slurm's record or an Epilog is not,
    nor one of a run the id has moved on from (the jobs row no longer says how that one ended)."""
    from slurm_mig.controller.runs import FORGOTTEN

    path = tmp_path / "state.db"
    old = open_store(path, migrate=False)
    assert migrate(old.db, target=9)[-1] == 9
    for job_id, run, state, reason, since in (("51", 1, "FAILED", FORGOTTEN, None), ("52", 1, "FAILED", "", None),
                                              ("53", 1, "COMPLETED", FORGOTTEN, None),
                                              ("54", 2, "PENDING", "live again", None),
                                              ("55", 1, "FAILED", FORGOTTEN, 3000.0)):
        old.db.execute("INSERT INTO jobs (job_id, profile, state, reason, run, submit_time, updated_at, "
                       "suspended_since) VALUES (?, '1g', ?, ?, ?, 1, 1, ?)",
                       (job_id, state, reason, run, since))
    for job_id, exit_code, state in (("51", None, "FAILED"), ("52", None, "FAILED"), ("53", 0, "COMPLETED"),
                                     ("54", None, "FAILED"), ("55", None, "FAILED")):
        old.db.execute("INSERT INTO outcomes (job_id, run, profile, count, exit_code, state, recorded_at) VALUES "
                       "(?, 1, '1g', 1, ?, ?, 1)", (job_id, exit_code, state))
    old.close()
    new = open_store(path)
    assert new.schema_version == LATEST_VERSION
    assert {o.job_id: o.guessed for o in new.outcomes()} == {"51": True, "52": False, "53": False, "54": False,
                                                             "55": True}
    # 55 was suspended at the end guessed (killed while suspended): marked so, as record_outcome marks such a guess,
    # so that its Epilog's replacement keeps the guess's run time (outcomes.GUESSED_SUSPENDED)
    marks = {r[0]: r[1] for r in new.db.execute("SELECT job_id, guessed FROM outcomes").fetchall()}
    assert marks == {"51": 1, "52": 0, "53": 0, "54": 0, "55": 2}, marks
    new.close()


def _guessed_run_1(db, job_id: str, *, start: float | None, suspended: tuple[float, float | None] | None = None,
                   guessed_end: float = 4000.0) -> None:
    """Run 1 of ``job_id`` settled by the controller's guess at ``guessed_end`` (FAILED, no exit status: Slurm had
    forgotten it), ``suspended`` (seconds before, the suspension going on since) as the tick last noted, and the id
    run again since (run 2 waits)."""
    db.upsert_job(job_id, profile="1g", submit_time=0.0, now=0.0)
    db.set_job_state(job_id, "RUNNING", now=100.0 if start is None else start, node="n1")
    if suspended is not None:
        db.set_suspension(job_id, suspended_s=suspended[0], since=suspended[1])
    known = {} if start is not None else {"start_time": None}  # (an outcome without a start time)
    assert db.record_outcome(job_id, state="FAILED", end_time=guessed_end, now=guessed_end + 60, guessed=True,
                             **known)
    db.set_job_state(job_id, "FAILED", now=guessed_end + 60, end_time=guessed_end)
    db.restart_job(job_id, now=guessed_end + 100, reason="another job with this id", submit_time=guessed_end + 90)


def test_a_guess_replaced_by_run_1s_epilog_keeps_its_run_time_to_its_suspension(db):
    """Run 1 ran 300 s (from 100), was suspended at 400 and killed while suspended at 500; the controller was down,
    Slurm forgot it, its Epilog was late: the tick guessed its end at 4000, its run time 300 s (the suspension
    going on counted up to that end, as record_outcome counts it). Run 1's Epilog (end 500) replaced the guess
    after the id ran again, and worked the time suspended out as the guess's span less its run time (3600 s) and
    took it from the Epilog's span (400 s): run time 0, where it ran 300 s. A suspension going on at the guessed
    end is the run's up to its real end only; the run time stays the 300 s it ran before it."""
    _guessed_run_1(db, "61", start=100.0, suspended=(0.0, 400.0))
    assert db.outcome("61", run=1).run_s == 300.0
    assert db.replace_guessed_outcome("61", 1, node="n1", state="COMPLETED", exit_code=0, derived_exit_code=0,
                                      end_time=500.0)
    o = db.outcome("61", run=1)
    assert (o.state, o.exit_code, o.end_time, o.run_s, o.guessed) == ("COMPLETED", 0, 500.0, 300.0, False)
    # Killed while suspended with an end the node's clock puts before the suspension the tick noted: no more than
    # its span.
    _guessed_run_1(db, "62", start=100.0, suspended=(0.0, 400.0))
    assert db.replace_guessed_outcome("62", 1, node="n1", state="FAILED", exit_code=256, derived_exit_code=0,
                                      end_time=350.0)
    assert db.outcome("62", run=1).run_s == 250.0


def test_a_guess_replaced_by_run_1s_epilog_leaves_out_a_suspension_over_before_its_end(db):
    """A suspension that ended (resumed) before the run did is left out of the Epilog's span as it was of the
    guess's; a run never seen started keeps no run time; an end before the start ends it at its start."""
    _guessed_run_1(db, "63", start=100.0, suspended=(50.0, None))  # suspended 50 s, resumed, ran to its end
    assert db.outcome("63", run=1).run_s == 3850.0
    assert db.replace_guessed_outcome("63", 1, node="n1", state="COMPLETED", exit_code=0, derived_exit_code=0,
                                      end_time=500.0)
    assert db.outcome("63", run=1).run_s == 350.0
    _guessed_run_1(db, "64", start=None)
    assert db.replace_guessed_outcome("64", 1, node="n1", state="COMPLETED", exit_code=0, derived_exit_code=0,
                                      end_time=500.0)
    o = db.outcome("64", run=1)
    assert (o.start_time, o.end_time, o.run_s) == (None, 500.0, None)
    _guessed_run_1(db, "65", start=100.0)
    assert db.replace_guessed_outcome("65", 1, node="n1", state="COMPLETED", exit_code=0, derived_exit_code=0,
                                      end_time=90.0)
    o = db.outcome("65", run=1)
    assert (o.end_time, o.run_s) == (100.0, 0.0)
    # Only a guess, only once, and only from the node run 1 ran on.
    assert not db.replace_guessed_outcome("65", 1, node="n1", state="FAILED", exit_code=1, derived_exit_code=0,
                                          end_time=200.0)
    _guessed_run_1(db, "66", start=100.0)
    assert not db.replace_guessed_outcome("66", 1, node="n2", state="COMPLETED", exit_code=0, derived_exit_code=0,
                                          end_time=500.0)
    assert db.outcome("66", run=1).guessed
