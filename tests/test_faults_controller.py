"""Fault injection at the controller: Slurm down, slow or failing, and the state database locked, full,
damaged or half-written. A real Controller + ApiServer + Store in this process; Slurm is a stand-in
that answers like a failed slurmctld would (None for queries, SlurmCommandError for commands,
or just slowly).

Each fault must end in a clear log line and a safe state: no job dropped or cancelled because
Slurm could not be asked, nothing half-written, node requests answered 503 (the node then keeps
its messages in its outbox and uses its fallback) rather than refused, and no node ever drained.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import sqlite3
import threading
import time
from dataclasses import replace

import pytest

from slurm_mig.api.auth import HEADER, HmacAuth, Principal
from slurm_mig.api.server import ApiServer
from slurm_mig.config import Config
from slurm_mig.controller.service import Controller
from slurm_mig.errors import SlurmCommandError, StoreBusy, StoreError
from slurm_mig.slurm.parsers import JobDetail, SlurmJob, SlurmNode, mig_request
from slurm_mig.store import open_store

KEY = b"c" * 64
H100 = [{"gpu": 0, "uuid": "GPU-0", "model": "H100-80GB", "mig_enabled": True}]
OBSERVED = [{"index": 0, "uuid": "GPU-0", "name": "H100", "model": "H100-80GB", "mig_enabled": True,
             "instances": [{"profile": "3g.40gb", "start": 0, "uuid": "MIG-a", "in_use": False},
                           {"profile": "3g.40gb", "start": 4, "uuid": "MIG-b", "in_use": False}]}]


class FlakySlurm:
    """Slurm as the controller sees it, with a switch for each way it can fail."""

    def __init__(self):
        self.down = False  # slurmctld unreachable: queries answer None
        self.delay = 0.0  # slurmctld slow: every call takes this long
        self.scontrol_fails = False  # scontrol commands fail (SlurmCommandError)
        self.queue = [SlurmJob(job_id=1, name="a", user="alice", state="PENDING", mig={"3g": 1},
                               tres_per_node="gres:mig:3g:1", submit_time=1, priority=10),
                      SlurmJob(job_id=2, name="b", user="bob", state="PENDING", mig={"7g": 1},
                               tres_per_node="gres:mig:7g:1", submit_time=2, priority=5)]
        self.calls: list[tuple] = []

    def _wait(self):
        if self.delay:
            time.sleep(self.delay)

    def jobs(self):
        self._wait()
        return None if self.down else list(self.queue)

    def reservations(self):
        return []

    def nodes(self):
        self._wait()
        return None if self.down else [SlurmNode(name="n1", state="idle", gres={"3g": 2}, gres_used={})]

    def job_detail(self, job_id):
        self._wait()
        return None

    def update_node_gres(self, node, counts, **kw):
        self._wait()
        self.calls.append(("gres", node, dict(counts)))
        if self.down or self.scontrol_fails:
            raise SlurmCommandError("`scontrol update NodeName=n1 Gres=...` failed (exit 1): Unable to contact "
                                    "slurm controller (connect failure)")
        return ",".join(f"mig:{t}:{n}" for t, n in sorted(counts.items()))

    def scontrol_requeue(self, job_id, **kw):
        self._wait()
        self.calls.append(("requeue", str(job_id)))
        if self.down or self.scontrol_fails:
            raise SlurmCommandError(f"`scontrol requeue {job_id}` failed (exit 1): slurm_requeue error")

    def update_node_state(self, *a, **kw):
        raise AssertionError("slurm-mig must never change a node's state (drain, down)")

    def run(self, argv, **kw):
        if list(argv[:2]) == ["scontrol", "update"] and argv[3].startswith("AdminComment=slurm-mig: "):
            self.calls.append(("comment", argv[2]))
            return None
        raise AssertionError(f"unexpected Slurm command {argv}")


@pytest.fixture
def rig(tmp_path):
    store = open_store(tmp_path / "state.db", busy_timeout_s=0.5)
    slurm = FlakySlurm()
    ctl = Controller(Config(), store, slurm)
    errors: list[str] = []
    srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY), ctl.routes(), ctl.get_routes(),
                    on_error=lambda kind, msg: errors.append(kind)).start()
    store.replace_observed("n1", H100, [], now=time.time())
    ctl.store_path, ctl.srv, ctl.errors, ctl.fake = tmp_path / "state.db", srv, errors, slurm
    yield ctl
    srv.stop()
    store.close()


def post(ctl, path: str, payload: dict) -> tuple[int, dict]:
    body = json.dumps(payload).encode()
    host, port = ctl.srv.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={HEADER: HmacAuth(KEY).sign(body, "n1", path=path)})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def report(ctl) -> tuple[int, dict]:
    return post(ctl, "/v1/report", {"node": "n1", "observed": OBSERVED, "bindings": {}})


def _counts(store) -> dict[str, int]:
    return {t: store._q(f"SELECT COUNT(*) AS n FROM {t}")[0]["n"]
            for t in ("jobs", "bindings", "outcomes", "reconfig_journal", "decisions", "events", "desired_layouts")}


# -- Slurm ------------------------------------------------------------------------------------

def test_slurmctld_down_keeps_every_job_and_touches_nothing(rig, caplog):
    rig.tick()
    assert {j.job_id for j in rig.store.pending_jobs(include_bound=True)} == {"1", "2"}
    rig.fake.down = True
    before = len(rig.fake.calls)
    with caplog.at_level(logging.WARNING):
        summary = rig.tick()
    assert summary["slurm_ok"] is False
    assert any("Slurm query failed" in r.getMessage() for r in caplog.records)
    # Nothing cancelled because Slurm could not be asked, and no GRES update attempted.
    assert {j.job_id for j in rig.store.pending_jobs(include_bound=True)} == {"1", "2"}
    assert all(c[0] != "gres" for c in rig.fake.calls[before:])
    assert b"slurm_mig_slurm_query_failures_total 1" in rig.metrics.render()
    assert report(rig)[0] == 200  # nodes are still served
    rig.fake.down = False
    assert rig.tick()["slurm_ok"] is True


def test_slurmctld_slow_does_not_block_node_requests(rig):
    rig.fake.delay = 1.0
    t = threading.Thread(target=rig.tick)
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    status, _ = report(rig)
    took = time.monotonic() - t0
    t.join()
    assert status == 200 and took < 0.8, f"a node request waited {took:.1f} s behind a slow Slurm query"


@pytest.mark.parametrize("every_s, warnings", [(600.0, 1), (0.0, None)])
def test_ticks_that_outlast_the_interval_never_overlap_and_are_said_in_our_words(caplog, every_s, warnings):
    # The 500-job demo on 2 cores: ticks of 1-3 s against a 1 s interval gave 110 lines of
    # apscheduler's "maximum number of running instances reached" and no count anywhere.
    from apscheduler.schedulers.background import BackgroundScheduler

    from slurm_mig.controller.cli import schedule_ticks
    from slurm_mig.controller.metrics import Metrics

    metrics, runs, busy = Metrics(), [], threading.Lock()

    def slow_tick():
        assert busy.acquire(blocking=False), "two ticks ran at once"
        runs.append(time.monotonic())
        time.sleep(0.45)
        busy.release()

    with caplog.at_level(logging.WARNING):
        sched = schedule_ticks(BackgroundScheduler(), slow_tick, 0.1, metrics, logging.getLogger("test.ticks"),
                               every_s=every_s)
        sched.start()
        time.sleep(1.7)
        sched.shutdown(wait=True)
    skipped = metrics.counters.get(("slurm_mig_ticks_skipped_total", ()), 0)
    ours = [r.getMessage() for r in caplog.records if "still running when the next was due" in r.getMessage()]
    assert len(runs) >= 3 and skipped >= 3
    assert not [r for r in caplog.records if "maximum number of running instances" in r.getMessage()]
    assert len(ours) == (warnings or skipped)
    assert "tick_interval_s 0.1 s" in ours[0]
    assert not [r for r in caplog.records if "caught up" in r.getMessage()]  # still late when it stopped


def test_ticks_that_catch_up_get_a_closing_line(caplog):
    """The skipped-tick warning is said at most every every_s, so the ticks skipped after the last warning
    were said nowhere once the ticks caught up (no next warning to count them in): a closing line now says
    so, through LogLimiter.ended as the API's refusal floods, once, with the total since the first."""
    from apscheduler.schedulers.background import BackgroundScheduler

    from slurm_mig.controller.cli import schedule_ticks
    from slurm_mig.controller.metrics import Metrics

    metrics, slow = Metrics(), threading.Event()
    slow.set()

    def tick():
        if slow.is_set():
            time.sleep(0.45)

    with caplog.at_level(logging.WARNING):
        sched = schedule_ticks(BackgroundScheduler(), tick, 0.1, metrics, logging.getLogger("test.ticks"),
                               every_s=0.7)
        sched.start()
        time.sleep(1.6)
        slow.clear()
        time.sleep(2.5)  # back on time: the closing line is due 0.7 s after the last skip
        sched.shutdown(wait=True)
    skipped = metrics.counters.get(("slurm_mig_ticks_skipped_total", ()), 0)
    lines = [r.getMessage() for r in caplog.records if r.name == "test.ticks"]
    warned = [line for line in lines if "still running when the next was due" in line]
    closing = [line for line in lines if line.startswith("ticks caught up")]
    assert skipped >= 4 and 1 <= len(warned) < skipped, lines
    assert len(closing) == 1 and lines[-1] == closing[0], lines
    said = sum(int(re.search(r": (\d+) tick\(s\) skipped", w).group(1)) for w in warned)
    m = re.fullmatch(r"ticks caught up: (\d+) skipped in total since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d, (\d+) of "
                     r"them since the last warning; none skipped in the last 0.7 s", closing[0])
    assert m, closing[0]
    assert int(m.group(1)) == skipped and said + int(m.group(2)) == skipped

def test_scontrol_failing_is_logged_and_counted_never_fatal(rig, caplog):
    rig.fake.scontrol_fails = True
    rig.tick()  # plans a layout change, then fails to set GRES
    with caplog.at_level(logging.WARNING):
        rig.tick()
    assert any("GRES update of n1 failed" in r.getMessage() for r in caplog.records)
    assert b"slurm_mig_gres_update_failures_total" in rig.metrics.render()
    # A Prolog the controller must requeue (no 7g can be made: both 3g busy) still gets its answer.
    obs = json.loads(json.dumps(OBSERVED))
    for i in obs[0]["instances"]:
        i["in_use"] = True
    status, resp = post(rig, "/v1/prolog", {"job_id": "2", "node": "n1", "observed": obs, "bindings": {}})
    assert status == 200 and resp["action"] == "requeue" and resp["requeued"] is False, resp
    # The node then requeues the job itself (node/prolog.py), so the job is not lost.


# -- the state database ------------------------------------------------------------------------

def test_database_locked_gives_503_and_a_clear_log(rig, caplog):
    other = sqlite3.connect(rig.store_path, timeout=0)
    other.execute("BEGIN IMMEDIATE")
    try:
        with caplog.at_level(logging.WARNING):
            status, resp = report(rig)
            with pytest.raises(StoreBusy, match="stayed locked by another writer"):
                rig.tick()
        assert status == 503 and resp["kind"] == "StoreBusy" and "stayed locked" in resp["error"]
        assert any("stayed locked" in r.getMessage() for r in caplog.records)
    finally:
        other.rollback()
        other.close()
    assert report(rig)[0] == 200
    rig.tick()


def test_disk_full_writes_nothing_and_recovers(rig, caplog):
    rig.tick()
    status, _ = report(rig)
    assert status == 200
    before = _counts(rig.store)
    pages = rig.store._q("PRAGMA page_count")[0]["page_count"]
    rig.store._x(f"PRAGMA max_page_count = {pages}")  # SQLITE_FULL on the next page it needs
    big = "x" * 200_000
    rig.fake.queue.append(SlurmJob(job_id=3, name=big, user="carol", state="PENDING", mig={"1g": 1},
                                   tres_per_node="gres:mig:1g:1", submit_time=3, priority=1))
    with caplog.at_level(logging.WARNING):
        with pytest.raises(StoreError, match="disk or database full; nothing of this operation was written"):
            rig.tick()
        status, resp = post(rig, "/v1/epilog", {"job_id": "1", "node": "n1", "exit_code": 0,
                                                "instances": [{"gpu": 0, "profile": "3g", "start": 0, "uuid": "MIG-a"}],
                                                "lingering": [{"gpu": 0, "profile": "3g", "start": 0,
                                                               "uuid": f"MIG-{i:0120d}"} for i in range(1000)]})
    # The node is told "try later" (503), so it keeps the outcome in its outbox instead of dropping it.
    assert status == 503 and "full" in resp["error"], (status, resp)
    assert _counts(rig.store) == before  # nothing half-written
    rig.store._x("PRAGMA max_page_count = 1073741823")
    rig.tick()
    assert rig.store.get_job("3") is not None


def test_a_decision_whose_tick_rolled_back_is_recorded_by_the_next(rig):
    """The same decision tick after tick is recorded once; the 'once' was noted before the tick's
    transaction committed, so a rolled-back tick's decision was never recorded (found in review)."""
    rig.tick()
    count = lambda: rig.store._q("SELECT COUNT(*) AS n FROM decisions")[0]["n"]  # noqa: E731
    before = count()
    rig.fake.queue.append(SlurmJob(job_id=3, name="c", user="carol", state="PENDING", mig={"1g": 1},
                                   tres_per_node="gres:mig:1g:1", submit_time=3, priority=1))
    record = rig.store.record_decision

    def record_then_fail(*a, **kw):
        record(*a, **kw)
        raise StoreError("disk or database full (test)")

    rig.store.record_decision = record_then_fail
    with pytest.raises(StoreError):
        rig.tick()
    assert count() == before
    rig.store.record_decision = record
    rig.tick()
    assert count() == before + 1


def test_disk_full_on_a_real_small_filesystem(tmp_path):
    """ENOSPC from the kernel, not a page limit: a 1 MiB tmpfs (root only; skipped otherwise)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        store = open_store(mnt / "state.db")
        try:
            fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while True:
                    os.write(fd, b"\0" * 4096)
            except OSError:
                pass  # ENOSPC: the filesystem is full
            finally:
                os.close(fd)
            with pytest.raises(StoreError, match="full|disk I/O|nothing of this operation"):
                for i in range(2000):
                    store.add_event("fill", "y" * 4000)
            n = store._q("SELECT COUNT(*) AS n FROM events")[0]["n"]
            os.unlink(mnt / "filler")
            store.add_event("after", "space again")
            assert store._q("SELECT COUNT(*) AS n FROM events")[0]["n"] == n + 1
        finally:
            store.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "zeroed-header", "empty-wal-garbage"])
def test_damaged_or_half_written_database(tmp_path, damage):
    path = tmp_path / "state.db"
    store = open_store(path)
    for i in range(200):
        store.upsert_job(str(i), profile="3g", user="u", name="n" * 200)
    store._x("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    data = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 3])  # a copy cut short
    elif damage == "zeroed-header":
        path.write_bytes(b"\0" * 100 + data[100:])
    else:
        # A torn WAL (a crash mid-append): SQLite must ignore the bad frames and keep the committed state.
        (tmp_path / "state.db-wal").write_bytes(os.urandom(8192))
        (tmp_path / "state.db-wal").chmod(0o600)
    if damage == "empty-wal-garbage":
        store = open_store(path)
        assert len(store.jobs()) == 200
        store.close()
        return
    with pytest.raises(StoreError, match="not a usable SQLite database|malformed|not a database|state database"):
        s = open_store(path)
        try:
            s.jobs()  # a truncated file may open and fail on first read
        finally:
            s.close()


def test_unsafe_database_files_are_refused(tmp_path):
    path = tmp_path / "state.db"
    open_store(path).close()
    os.chmod(path, 0o666)
    with pytest.raises(StoreError, match="world-writable"):
        open_store(path)
    os.chmod(path, 0o644)
    open_store(path).close()
    assert os.stat(path).st_mode & 0o777 == 0o600  # repaired
    link = tmp_path / "link.db"
    link.symlink_to(path)
    with pytest.raises(StoreError, match="symbolic link"):
        open_store(link)


def test_a_policy_saying_never_does_not_fail_the_tick(rig):
    """frag-aware reserves a GPU until inf behind jobs without a time limit; JSON has no inf."""
    from slurm_mig.policies.base import Decision

    class Never:
        name = "never"

        def decide(self, state):
            return Decision(policy="never", version="1", waiting=tuple((j.job_id, "later") for j in state.pending),
                            extra={"reservations": [["2", float("inf")]], "nan": float("nan")})

    rig.policy = Never()
    rig.tick()
    d = rig.store.recent_decisions(1)[0]
    assert d.policy == "never" and d.action["extra"]["reservations"] == [["2", None]]


# -- the store's lock under contention -------------------------------------------------------------

def test_store_lock_is_first_come_first_served_and_times_out_cleanly():
    from slurm_mig.store.db import _FairRLock

    lock = _FairRLock()
    assert lock.acquire(timeout=0) and lock.acquire(timeout=0)  # reentrant
    order: list[int] = []

    def waiter(n):
        assert lock.acquire(timeout=10)
        order.append(n)
        lock.release()

    threads = []
    for n in range(5):
        t = threading.Thread(target=waiter, args=(n,))
        t.start()
        while len(lock._waiters) < n + 1:
            time.sleep(0.001)
        threads.append(t)
    late = threading.Thread(target=lambda: order.append("timeout" if not lock.acquire(timeout=0.05) else "got"))
    late.start()
    late.join()
    assert order == ["timeout"] and len(lock._waiters) == 5  # the one that gave up left the queue
    lock.release()
    lock.release()
    for t in threads:
        t.join()
    assert order == ["timeout", 0, 1, 2, 3, 4]
    assert lock.acquire(timeout=0)
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()


def test_many_concurrent_writers_all_get_through(tmp_path):
    """300 threads writing at once through one Store: every one gets through within the busy timeout.
    (benchmarks/load_api.py is the heavier check: with MUNGE and 1000 nodes, threading.RLock let 98
    requests wait past 5 s; the FIFO lock none.)"""
    store = open_store(tmp_path / "state.db", busy_timeout_s=5.0)
    failures: list[str] = []

    def writer(n):
        try:
            with store.transaction():
                store.upsert_job(str(n), profile="1g", user="u", name="n")
                store.add_event("load", f"job {n}")
                time.sleep(0.001)
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(300)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert len(store.jobs()) == 300
    store.close()


def test_a_node_slurm_drained_for_its_gres_count_is_named_with_the_fix(rig, caplog):
    rig.fake.nodes = lambda: [SlurmNode(name="n1", state="idle", flags=frozenset({"DRAIN", "INVALID_REG"}),
                                        reason="gres/mig count reported lower than configured (6 < 7)",
                                        gres={"3g": 2}, gres_used={})]
    with caplog.at_level(logging.ERROR):
        rig.tick()
        rig.tick()
    msgs = [r.getMessage() for r in caplog.records if "Slurm drained n1" in r.getMessage()]
    assert len(msgs) == 1 and "re-registered" in msgs[0] and "docs/reliability.md" in msgs[0]
    assert rig.store.node("n1").state == "drain"


def test_a_padded_node_keeps_its_mig_total_whatever_the_layout(rig, caplog):
    """slurm.conf gives n1 (one H100) mig:3g:2 plus mig:pad:5: every update the controller makes keeps the
    total at 7, so a slurmd re-registration never sees a different total (docs/reliability.md section 2)."""
    gres_now = {"3g": 2, "pad": 5}
    rig.fake.nodes = lambda: [SlurmNode(name="n1", state="idle", gres=dict(gres_now), gres_used={})]
    pads = []
    orig = rig.fake.update_node_gres

    def update(node, counts, **kw):
        pads.append(kw.get("pad_to"))
        return orig(node, counts, **kw)

    rig.fake.update_node_gres = update
    rig.store.replace_observed("n1", H100, [{"gpu": 0, "profile": "1g.10gb", "start": s, "uuid": f"M{s}",
                                              "in_use": False} for s in range(7)], now=time.time())
    with caplog.at_level(logging.WARNING):
        rig.tick()
    assert pads and pads[-1] == 7, pads
    assert rig.fake.calls[-1][:2] == ("gres", "n1") and 0 < sum(rig.fake.calls[-1][2].values()) <= 7
    assert not [r for r in caplog.records if "mig:pad" in r.getMessage()]
    # After a re-registration that reset the mix but kept a held type's count, the total read back is 8:
    # the controller still writes 7, not the inflated total.
    gres_now.clear()
    gres_now.update({"1g": 1, "3g": 2, "pad": 5})
    rig.tick()
    assert pads[-1] == 7


def test_an_unpadded_node_is_named_once_with_the_fix(rig, caplog):
    with caplog.at_level(logging.WARNING):
        rig.tick()
        rig.tick()
    msgs = [r.getMessage() for r in caplog.records if "has no mig:pad" in r.getMessage()]
    assert len(msgs) == 1 and "adding up to 7 (1 GPUs x 7)" in msgs[0], msgs
    assert any("has no mig:pad" in e.message for e in rig.store.recent_events(50, kind="gres"))


def test_a_padded_total_that_is_not_7_per_gpu_is_named(rig, caplog):
    rig.fake.nodes = lambda: [SlurmNode(name="n1", state="idle", gres={"3g": 2, "pad": 2}, gres_used={})]
    with caplog.at_level(logging.WARNING):
        rig.tick()
    msgs = [r.getMessage() for r in caplog.records if "mig total in Slurm is 4, not 7" in r.getMessage()]
    assert len(msgs) == 1, [r.getMessage() for r in caplog.records]


def test_a_mig_job_running_without_its_prolog_is_requeued(rig, caplog):
    """slurmd skips the Prolog of a job id whose credential it still caches (a requeue just before): the
    job runs with no instance. After the grace period the controller requeues it, once."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    rig.fake.queue = [SlurmJob(job_id=5, name="e", user="eve", state="RUNNING", nodes=["n1"], mig={"3g": 1},
                               tres_per_node="gres:mig:3g:1", submit_time=int(t[0]) - 100,
                               start_time=int(t[0]) - 5, priority=1)]
    rig.tick()
    assert ("requeue", "5") not in rig.fake.calls  # a Prolog may still be binding it
    t[0] += 120
    assert rig.tick()["requeued_unbound"] == 0  # n1 has not reported its binding files since
    assert report(rig)[0] == 200  # ... now it has: none for job 5
    with caplog.at_level(logging.WARNING):
        summary = rig.tick()
    assert summary["requeued_unbound"] == 1 and ("requeue", "5") in rig.fake.calls
    assert any("started without its Prolog" in r.getMessage() for r in caplog.records)
    # A job that has its instance is left alone.
    rig.store.replace_observed("n1", H100, [{"gpu": 0, "profile": "3g", "start": 0, "uuid": "MIG-a"}], now=t[0])
    rig.store.upsert_job("6", profile="3g", user="u", name="f")
    rig.store.bind("6", "n1", [{"gpu": 0, "profile": "3g", "start": 0}])
    rig.fake.queue = [SlurmJob(job_id=6, state="RUNNING", nodes=["n1"], mig={"3g": 1}, tres_per_node="gres:mig:3g:1",
                               submit_time=int(t[0]) - 300, start_time=int(t[0]) - 200, priority=1)]
    rig.fake.calls.clear()
    assert rig.tick()["requeued_unbound"] == 0 and all(c[0] != "requeue" for c in rig.fake.calls)


def test_a_controller_back_from_an_outage_does_not_requeue_a_job_its_node_bound_alone_meanwhile(rig):
    """While the controller was down, n1's Prolog bound job 5 to a free 3g alone and queued its /v1/bound
    in the outbox. The restarted controller's first tick saw job 5 running for 5 min with no binding and
    requeued it (the grace alone decided), killing a job that had its instance. It now waits for n1's
    report, which lists the binding file: adopted, not requeued. A report without it still requeues."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    job = dict(name="e", user="eve", state="RUNNING", nodes=["n1"], mig={"3g": 1}, tres_per_node="gres:mig:3g:1",
               submit_time=int(t[0]) - 900, start_time=int(t[0]) - 300, priority=1)
    rig.fake.queue = [SlurmJob(job_id=5, **job), SlurmJob(job_id=6, **job)]
    assert rig.tick()["requeued_unbound"] == 0 and ("requeue", "5") not in rig.fake.calls
    bound = {"5": [{"gpu": 0, "profile": "3g.40gb", "start": 0, "uuid": "MIG-a"}]}
    status, _ = post(rig, "/v1/report", {"node": "n1", "observed": OBSERVED, "bindings": bound,
                                         "binding_times": {"5": t[0] - 299}})
    assert status == 200 and rig.store.bound_instances("5")
    t[0] += 5
    assert rig.tick()["requeued_unbound"] == 1
    assert ("requeue", "6") in rig.fake.calls and ("requeue", "5") not in rig.fake.calls


def test_a_binding_file_a_report_could_not_adopt_keeps_its_job_from_being_requeued(rig):
    """Found in review: the API serves reports before the first tick, and a report naming a binding file of a job
    the store does not know yet adopts nothing (it needs the job's row) but counted as the node having
    reported. The first tick then requeued the job as started without its Prolog, though the node holds its
    instance. A job a binding file names is left for the next report, which adopts it."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    bound = {"5": [{"gpu": 0, "profile": "3g.40gb", "start": 0, "uuid": "MIG-a"}]}
    status, _ = post(rig, "/v1/report", {"node": "n1", "observed": OBSERVED, "bindings": bound,
                                         "binding_times": {"5": t[0] - 299}})
    assert status == 200 and rig.store.get_job("5") is None  # nothing to adopt it for yet
    rig.fake.queue = [SlurmJob(job_id=5, name="e", user="eve", state="RUNNING", nodes=["n1"], mig={"3g": 1},
                               tres_per_node="gres:mig:3g:1", submit_time=int(t[0]) - 900,
                               start_time=int(t[0]) - 300, priority=1)]
    assert rig.tick()["requeued_unbound"] == 0 and ("requeue", "5") not in rig.fake.calls
    assert post(rig, "/v1/report", {"node": "n1", "observed": OBSERVED, "bindings": bound,
                                    "binding_times": {"5": t[0] - 299}})[0] == 200
    assert rig.store.bound_instances("5")  # adopted now that the tick knows the job


# -- Slurm starting jobs while the controller changes a node's counts -----------------------------

def _race_rig(rig, *, slip: bool):
    """n1 (one H100) holds two idle 3g instances and Slurm advertises mig:3g:2; a 7g job waits, so the
    policy re-carves the GPU to 7g@0. With ``slip``, Slurm starts a 3g job on n1 under the old counts
    at the moment the controller's first Gres update arrives: after its squeue, before the new counts."""
    now = time.time()
    rig.store.replace_observed("n1", H100, [{"gpu": 0, "profile": "3g.40gb", "start": s, "uuid": f"MIG-{s}",
                                              "in_use": False} for s in (0, 4)], now=now)
    rig.fake.queue = [SlurmJob(job_id=2, name="b", user="bob", state="PENDING", mig={"7g": 1},
                               tres_per_node="gres:mig:7g:1", submit_time=int(now) - 60, priority=5)]
    gres = {"3g": 2, "pad": 5}
    rig.fake.nodes = lambda: [SlurmNode(name="n1", state="idle", gres=dict(gres), gres_used={})]
    orig = rig.fake.update_node_gres

    def update(node, counts, **kw):
        if slip and not any(j.job_id == 3 for j in rig.fake.queue):
            rig.fake.queue.append(SlurmJob(job_id=3, name="c", user="carol", state="RUNNING", nodes=["n1"],
                                           mig={"3g": 1}, tres_per_node="gres:mig:3g:1", submit_time=int(now),
                                           start_time=int(now), priority=1))
        gres.clear()
        gres.update(counts)
        return orig(node, counts, **kw)

    rig.fake.update_node_gres = update
    return [c for c in rig.fake.calls if c[0] == "gres"]


def test_counts_drop_before_a_recarve_is_committed_and_rise_after(rig):
    """Without a race the tick withdraws the 3g instances from Slurm first (nothing new advertised yet),
    checks squeue, then commits the 7g layout and advertises it: one tick, two Gres updates in that order."""
    _race_rig(rig, slip=False)
    summary = rig.tick()
    gres = [c[2] for c in rig.fake.calls if c[0] == "gres"]
    assert gres[0].get("3g", 0) == 0 and gres[0].get("7g", 0) == 0, gres
    assert gres[-1].get("7g") == 1 and gres[-1].get("3g", 0) == 0, gres
    assert str(rig.store.desired("n1")[0].spec) == "7g@0" and summary["changes"] == 1
    assert rig.metrics.counters.get(("slurm_mig_gres_races_total", ()), 0) == 0


def test_a_job_slurm_starts_under_the_old_counts_keeps_its_instance(rig):
    """Seen on the demo cluster: Slurm's backfill started 14 jobs 20-500 ms after the controller's squeue,
    under the old counts, and the re-carve decided without them destroyed their instances: 2-5 of 24
    jobs requeued. Now the tick sees the 3g job after withdrawing, decides again with it, and the 3g it
    was given survives: no 7g@0, the job's Prolog binds an existing one. Slurm is told of no 3g: the GPU is
    held for the 7g, which waits for job 3, and no 3g is idle outside that region (intended_layouts)."""
    _race_rig(rig, slip=True)
    rig.tick()
    desired = rig.store.desired("n1").get(0)
    assert desired is None or "3g@" in desired.spec, desired
    last = [c[2] for c in rig.fake.calls if c[0] == "gres"][-1]
    assert last.get("3g", 0) == 0 and last.get("7g", 0) == 0, rig.fake.calls
    assert [r[:3] for r in rig.store.get_meta("held")["2"]] == [["n1", 0, 0xFF]], rig.store.get_meta("held")
    assert rig.metrics.counters[("slurm_mig_gres_races_total", ())] == 1
    assert any("job(s) 3 on n1" in e.message for e in rig.store.recent_events(20, kind="gres"))
    status, resp = post(rig, "/v1/prolog", {"job_id": "3", "node": "n1", "observed": OBSERVED, "bindings": {}})
    assert status == 200 and resp["action"] == "bind", resp
    assert resp["instances"][0]["profile"] == "3g.40gb" and not resp["targets"], resp


def test_a_job_bound_while_the_second_squeue_runs_keeps_its_binding(rig):
    """squeue answers with what slurmctld had when it was asked: a job whose Prolog bound it while that
    squeue ran is PENDING in the answer. Only a binding older than the query means "requeued"; timed
    from after the query (found in review), the tick released job 4's instance and put it back to
    PENDING while it ran, and the next Prolog was handed the same instance."""
    _race_rig(rig, slip=True)
    t = [time.time()]
    rig.clock = lambda: t[0]
    rig.fake.queue.append(SlurmJob(job_id=4, name="d", user="dan", state="PENDING", mig={"3g": 1},
                                   tres_per_node="gres:mig:3g:1", submit_time=int(t[0]) - 10, priority=1))
    asked = []
    plain = rig.fake.jobs

    def jobs():
        answer = plain()
        asked.append(len(answer))
        if len(asked) == 2:  # the squeue after withdrawing: job 4 starts while it runs
            t[0] += 0.3
            status, resp = post(rig, "/v1/prolog", {"job_id": "4", "node": "n1", "observed": OBSERVED,
                                                    "bindings": {}})
            assert status == 200 and resp["action"] == "bind", resp
            t[0] += 1.5
            rig.fake.queue = [replace(j, state="RUNNING", nodes=["n1"], start_time=int(t[0])) if j.job_id == 4
                              else j for j in rig.fake.queue]
        return answer

    rig.fake.jobs = jobs
    rig.tick()
    assert len(asked) >= 2 and rig.metrics.counters[("slurm_mig_gres_races_total", ())] == 1
    held = rig.store.bound_instances("4")
    assert held and rig.store.get_job("4").state == "RUNNING"
    rig.store.upsert_job("6", profile="3g", submit_time=t[0], now=t[0])
    status, resp = post(rig, "/v1/prolog", {"job_id": "6", "node": "n1", "observed": OBSERVED, "bindings": {}})
    assert status == 200 and resp["action"] == "bind"
    assert (resp["instances"][0]["gpu"], resp["instances"][0]["start"]) != (held[0].gpu, held[0].start)


def _reserved_3g_started_unbound(rig):
    """Job 3 (3g) waited while job 1 ran on 3g@0, so the policy reserved it 3g@4; job 1 ended and Slurm started
    job 3 (its Prolog not served yet) with jobs 4 and 5 (1g) pending. Returns the clock and n1's report."""
    _race_rig(rig, slip=False)
    t = [time.time()]
    rig.clock = lambda: t[0]

    def job(i, size, **kw):
        return SlurmJob(job_id=i, name="x", user="u", mig={size: 1}, tres_per_node=f"gres:mig:{size}:1",
                        submit_time=int(t[0]) - 100, priority=10 - i, **kw)

    observed = [{**OBSERVED[0], "instances": [{**i, "uuid": f"MIG-{i['start']}"} for i in OBSERVED[0]["instances"]]}]
    rig.fake.queue = [job(1, "3g", state="RUNNING", nodes=["n1"], start_time=int(t[0]) - 5),
                      job(3, "3g", state="PENDING")]
    rig.tick()
    assert post(rig, "/v1/prolog", {"job_id": "1", "node": "n1", "observed": observed, "bindings": {}})[1][
        "instances"] == [{"gpu": 0, "profile": "3g.40gb", "start": 0}]
    rig.tick()
    assert rig.store.get_meta("reservations") == {"3": {"node": "n1", "instances": [[0, "3g.40gb", 4]]}}
    t[0] += 10
    status, _ = post(rig, "/v1/epilog", {"job_id": "1", "node": "n1", "exit_code": 0, "end_time": t[0],
                                         "instances": [{"gpu": 0, "profile": "3g.40gb", "start": 0, "uuid": "MIG-0"}]})
    assert status == 200
    t[0] += 10
    rig.fake.queue = [job(3, "3g", state="RUNNING", nodes=["n1"], start_time=int(t[0]) - 1),
                      job(4, "1g", state="PENDING"), job(5, "1g", state="PENDING")]
    return t, observed


def test_a_job_bound_between_the_ticks_two_transactions_keeps_its_instance_out_of_the_recarve(rig):
    """Found in review. Job 3 (3g) waited while job 1 ran on 3g@0, so the policy reserved it 3g@4. Job 1 ended
    and Slurm started job 3 just before a tick's squeue; its Prolog waited on the store's lock while the tick
    decided, on a state where job 3, unbound yet, held the lowest free 3g (3g@0): the policy re-carved 3g@4
    into 1g's for jobs 4 and 5. Served between the tick's two transactions, the Prolog bound job 3 to its
    reservation, 3g@4, and the tick then committed the re-carve through it (the counts did not see it: job 3
    ran at both squeues): a desired layout the node refuses while job 3 runs, Slurm told of two 1g that do
    not exist and of one 3g (job 3's), so a 3g job waited beside the idle 3g@0 for job 3's whole run. The
    commit now leaves that GPU to the next tick, which decides with job 3 bound. (The policy's view now counts
    the reservation, the next test; the planner is kept blind to it here, as to any choice of a Prolog the view
    cannot foresee, a node's fresher report in it, so that the commit's own check is what is tested.)"""
    t, observed = _reserved_3g_started_unbound(rig)
    view = rig.store.cluster_state
    rig.store.cluster_state = lambda *a, prolog_choice=None, **kw: view(
        *a, prolog_choice=lambda *job: rig._prolog_choice(*job, reservations={}), **kw)
    withdraw = rig._withdraw_first

    def prolog_first(*args, **kw):  # served once the tick's first transaction let go of the store
        status, resp = post(rig, "/v1/prolog", {"job_id": "3", "node": "n1", "observed": observed, "bindings": {}})
        assert status == 200 and resp["instances"] == [{"gpu": 0, "profile": "3g.40gb", "start": 4}], resp
        return withdraw(*args, **kw)

    rig._withdraw_first = prolog_first
    rig.tick()
    rig._withdraw_first = withdraw
    held = {"3g.40gb@4"}
    desired = rig.store.desired("n1").get(0)
    assert desired is None or held <= {str(s) for s in desired.layout().slots}, desired
    assert not rig.store.open_journal_entries("n1")
    last = [c[2] for c in rig.fake.calls if c[0] == "gres"][-1]
    assert last.get("1g", 0) == 0 and last.get("3g") == 2, rig.fake.calls
    assert any("job 3 was bound to 3g.40gb@4" in e.message for e in rig.store.recent_events(20, kind="layout"))
    t[0] += 30
    rig.tick()  # decided again, with job 3 bound: the 1g are carved from 3g@0
    desired = rig.store.desired("n1")[0].layout()
    assert held <= {str(s) for s in desired.slots} and any(s.profile.startswith("1g") for s in desired.slots)


def test_a_started_unbound_job_holds_its_reservation_in_the_plan(rig):
    """Found in review. The same jobs as above, the Prolog not served during the tick. The policy's view
    counted job 3, started and unbound, as holding the lowest free 3g (3g@0), while its Prolog binds it to
    its reservation, 3g@4 (choose_binding): the plan re-carved 3g@4 into the 1g's, a re-carve the job's
    Prolog then overrode or (served between the tick's transactions) the commit left out, a tick and a plan
    lost. The view now counts the instance the Prolog will choose, so the 1g's are carved from 3g@0."""
    t, observed = _reserved_3g_started_unbound(rig)
    rig.tick()
    desired = rig.store.desired("n1")[0].layout()
    assert "3g.40gb@4" in {str(s) for s in desired.slots}, desired
    assert any(s.profile.startswith("1g") for s in desired.slots), desired
    assert not any("not made" in e.message for e in rig.store.recent_events(20, kind="layout"))
    status, resp = post(rig, "/v1/prolog", {"job_id": "3", "node": "n1", "observed": observed, "bindings": {}})
    assert status == 200 and resp["instances"] == [{"gpu": 0, "profile": "3g.40gb", "start": 4}], resp


def test_a_started_unbound_array_task_is_promised_what_its_prolog_binds(rig):
    """As above, but job 3 is an array (--array=1-2%1): the policy reserved 3g@4 for its task 3_1, and Slurm
    started that task under an id of its own, job 10, seen by the tick before its Prolog. Its Prolog asks
    Slurm for the job's record and finds 3_1's reservation (3g@4). The policy's view looked the reservation up
    under 10 only, held the lowest free 3g (3g@0) for the job and planned the 1g's through 3g@4, which the
    Prolog served between the tick's transactions took. The tick now hands the task's reservation to the job
    that runs it, so both look it up under 10, and the plan carves the 1g's from 3g@0."""
    _race_rig(rig, slip=False)
    t = [time.time()]
    rig.clock = lambda: t[0]

    def job(i, size, **kw):
        return SlurmJob(job_id=i, name="x", user="u", mig={size: 1}, tres_per_node=f"gres:mig:{size}:1",
                        submit_time=int(t[0]) - 100, priority=10 - min(i, 9), **kw)

    observed = [{**OBSERVED[0], "instances": [{**i, "uuid": f"MIG-{i['start']}"} for i in OBSERVED[0]["instances"]]}]
    rig.fake.queue = [job(1, "3g", state="RUNNING", nodes=["n1"], start_time=int(t[0]) - 5),
                      job(3, "3g", state="PENDING", array_job_id=3, array_task_string="1-2%1", array_max_tasks=1)]
    rig.tick()
    assert post(rig, "/v1/prolog", {"job_id": "1", "node": "n1", "observed": observed, "bindings": {}})[1][
        "instances"] == [{"gpu": 0, "profile": "3g.40gb", "start": 0}]
    rig.tick()
    assert rig.store.get_meta("reservations") == {"3_1": {"node": "n1", "instances": [[0, "3g.40gb", 4]]}}
    t[0] += 10
    status, _ = post(rig, "/v1/epilog", {"job_id": "1", "node": "n1", "exit_code": 0, "end_time": t[0],
                                         "instances": [{"gpu": 0, "profile": "3g.40gb", "start": 0, "uuid": "MIG-0"}]})
    assert status == 200
    t[0] += 10
    rig.fake.queue = [job(10, "3g", state="RUNNING", nodes=["n1"], start_time=int(t[0]) - 1, array_job_id=3,
                          array_task_id=1),
                      job(3, "3g", state="PENDING", array_job_id=3, array_task_string="2", array_max_tasks=1),
                      job(4, "1g", state="PENDING"), job(5, "1g", state="PENDING")]
    rig.fake.job_detail = lambda job_id: JobDetail(
        job_id=10, name="x", user="u", state="RUNNING", nodes=["n1"], tres_per_node="gres:mig:3g:1",
        mig={"3g": 1}, fields={"JobId": "10", "ArrayJobId": "3", "ArrayTaskId": "1"}) if str(job_id) == "10" else None
    withdraw = rig._withdraw_first

    def prolog_first(*args, **kw):  # served once the tick's first transaction let go of the store
        status, resp = post(rig, "/v1/prolog", {"job_id": "10", "node": "n1", "observed": observed, "bindings": {}})
        assert status == 200 and resp["instances"] == [{"gpu": 0, "profile": "3g.40gb", "start": 4}], resp
        return withdraw(*args, **kw)

    rig._withdraw_first = prolog_first
    rig.tick()
    rig._withdraw_first = withdraw
    assert not any("not made" in e.message for e in rig.store.recent_events(20, kind="layout"))
    desired = rig.store.desired("n1")[0].layout()
    assert "3g.40gb@4" in {str(s) for s in desired.slots}, desired
    assert any(s.profile.startswith("1g") for s in desired.slots), desired
    assert [(b.gpu, b.start) for b in rig.store.bound_instances("10")] == [(0, 4)]
    assert "3_1" not in (rig.store.get_meta("reservations") or {})


def test_slurm_is_not_told_of_a_desired_layout_a_busy_instance_blocks(rig):
    """Found in review. The tick re-carved n1's two idle 3g to 7g@0 for job 2 and told Slurm mig:7g:1. The
    node's next report showed 3g@0 in use (a binding file of a job whose end Slurm has not let go of), so
    7g@0 cannot be made while it is: the node refuses it, and a Prolog falls back to what exists. Slurm was
    still told mig:7g:1 (the desired layout, a slice set that does not exist) and no 3g, tick after tick until
    a decision replaced it: job 2 was started only to be requeued, and 3g@4 sat idle. A desired layout that
    cannot be reached from what exists with its busy instances is now told as what exists."""
    _race_rig(rig, slip=False)
    rig.tick()
    assert str(rig.store.desired("n1")[0].spec) == "7g@0"
    assert [c[2] for c in rig.fake.calls if c[0] == "gres"][-1].get("7g") == 1
    busy = [{**OBSERVED[0], "instances": [{**i, "uuid": f"MIG-{i['start']}", "in_use": i["start"] == 0}
                                          for i in OBSERVED[0]["instances"]]}]
    status, resp = post(rig, "/v1/report", {"node": "n1", "observed": busy, "bindings": {}})
    assert status == 200
    assert {str(s) for s in rig.intended_layouts("n1")[0].slots} == {"3g.40gb@0", "3g.40gb@4"}
    rig.tick()
    last = [c[2] for c in rig.fake.calls if c[0] == "gres"][-1]
    # No 7g. And no 3g either: job 2 waits for the busy 3g@0, so the policy holds the GPU for it, and Slurm is
    # told of neither the idle 3g@4 there nor the busy one (no 3g is idle outside: intended_layouts).
    assert last.get("7g", 0) == 0 and last.get("3g", 0) == 0, rig.fake.calls
    assert [r[:3] for r in rig.store.get_meta("held")["2"]] == [["n1", 0, 0xFF]], rig.store.get_meta("held")
    assert {str(s) for s in rig.intended_layouts("n1", held={})[0].slots} == {"3g.40gb@0", "3g.40gb@4"}
    status, resp = post(rig, "/v1/report", {"node": "n1", "observed": OBSERVED, "bindings": {}})
    assert str(rig.intended_layouts("n1")[0]) == "7g@0"  # reachable again: what is about to exist


@pytest.mark.parametrize("requeued", [False, True])
def test_an_epilog_from_a_node_the_job_is_not_on_ends_nothing(rig, requeued):
    """Job 10 runs on n2. An Epilog about it from n1 (a stale attempt's, or n1's root speaking beyond
    itself, which per-node keys otherwise stop) used to end it: outcome recorded, state COMPLETED, and
    n2's binding released, so its instance went to the next job (found in review)."""
    observed = [{"gpu": 0, "profile": "3g.40gb", "start": s, "uuid": f"MIG-{s}", "in_use": False} for s in (0, 4)]
    for node in ("n1", "n2"):
        rig.store.replace_observed(node, H100, observed, now=time.time())
    rig.store.upsert_job("10", profile="3g", submit_time=1)
    bound = rig.on_prolog({"job_id": "10", "node": "n2", "bindings": {}}, Principal(0, 0, "n2", "hmac"))
    assert bound["action"] == "bind"
    held = rig.store.live_bindings()
    answer = rig.on_epilog({"job_id": "10", "node": "n1", "exit_code": 0, "requeued": requeued,
                            "instances": [{"gpu": 0, "profile": "3g.40gb", "start": 0}]},
                           Principal(0, 0, "n1", "hmac"))
    assert answer == {"ok": True, "recorded": False}
    assert rig.store.get_job("10").state == "RUNNING" and rig.store.outcome("10") is None
    assert rig.store.live_bindings() == held
    assert any("Epilog from n1" in e.message for e in rig.store.recent_events(10, job_id="10"))
    # n2's own Epilog ends it.
    done = rig.on_epilog({"job_id": "10", "node": "n2", "exit_code": 0,
                          "instances": [{"gpu": 0, "profile": "3g.40gb", "start": held[0][2].start}]},
                         Principal(0, 0, "n2", "hmac"))
    assert done["recorded"] and rig.store.outcome("10").node == "n2" and rig.store.live_bindings() == []


UNSERVABLE = [({"3g": 0}, "count must be at least 1"), ({"5g": 1}, "mig:5g, which is not a MIG size"),
              ({"pad": 1}, "mig:pad, which is not a MIG size"), ({"1g": 1, "3g": 1}, "2 MIG sizes"),
              # past SQLite's integers: stored, it raised OverflowError in every tick
              (mig_request("gres:mig:3g:9223372036854775808"), "more than a node can hold"),
              ({"1g": 1_000_000}, "more than a node can hold")]


@pytest.mark.parametrize("mig,why", UNSERVABLE)
def test_a_request_slurm_mig_cannot_serve_does_not_stop_the_tick(rig, mig, why):
    """One such job in squeue (queued before job_submit.lua was installed) used to raise inside every
    tick, rolling all of it back (found in review). Now it is left alone, said once, and the tick runs."""
    rig.fake.queue.append(SlurmJob(job_id=9, name="odd", user="eve", state="PENDING", mig=mig,
                                   tres_per_node="x", submit_time=3, priority=1))
    for _ in range(2):
        assert rig.tick()["slurm_ok"]
    assert rig.store.get_job("1") is not None and rig.store.get_job("9") is None
    said = [e.message for e in rig.store.recent_events(20, job_id="9")]
    assert len(said) == 1 and why in said[0], said


@pytest.mark.parametrize("mig,why", UNSERVABLE)
def test_the_prolog_of_a_request_slurm_mig_cannot_serve_holds_the_job(rig, mig, why):
    """Mixed sizes would get only one size bound; such a job is requeued and held, with the reason in its
    AdminComment, rather than run without its instances or start again and again."""
    holds = []
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=int(job_id), mig=dict(mig))
    rig.fake.scontrol_requeue = lambda job_id, **kw: holds.append((str(job_id), kw))
    status, resp = post(rig, "/v1/prolog", {"job_id": "9", "node": "n1", "observed": OBSERVED, "bindings": {}})
    assert status == 200 and resp["action"] == "requeue" and resp["requeued"], resp
    assert why in resp["reason"] and holds == [("9", {"hold": True})]
    assert ("comment", "JobId=9") in rig.fake.calls
    assert rig.store.get_job("9") is None and rig.store.live_bindings() == []


def test_scontrol_for_an_unseen_job_does_not_hold_the_store_lock(rig):
    """A Prolog for a job the last tick did not see asks scontrol, which may take up to its timeout. It
    used to ask inside the store's transaction, so other nodes' requests failed with 503 after the busy
    timeout (0.5 s here) while it ran (found in review)."""
    def slow(job_id):
        time.sleep(1.5)
        return None

    rig.fake.job_detail = slow
    answers = []
    prolog = threading.Thread(target=lambda: answers.append(
        post(rig, "/v1/prolog", {"job_id": "77", "node": "n1", "observed": OBSERVED, "bindings": {}})))
    prolog.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    status, _resp = report(rig)
    assert status == 200 and time.monotonic() - t0 < 1.0
    prolog.join()
    assert answers and answers[0][0] == 503  # Slurm could not say (the test below)


def test_a_prolog_for_a_job_neither_the_store_nor_slurm_can_describe_is_answered_503(rig):
    """A job no tick has seen yet, and `scontrol show job` fails: the controller answered "skip", and the
    node started the job with no instance though it asked for one. Now 503: the node's controller-down
    path asks Slurm from the node (an existing instance, or a requeue saying the request is unreadable)."""
    status, resp = post(rig, "/v1/prolog", {"job_id": "77", "node": "n1", "observed": OBSERVED, "bindings": {}})
    assert status == 503 and resp["kind"] == "SlurmUnavailable", resp
    assert "busy" in rig.errors
    # A job Slurm describes as having no MIG request is still skipped; one the store knows is bound as the store
    # has it when Slurm cannot say.
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=int(job_id), mig={})
    assert post(rig, "/v1/prolog", {"job_id": "78", "node": "n1", "observed": OBSERVED, "bindings": {}}) == \
        (200, {"action": "skip"})
    rig.fake.job_detail = lambda job_id: None
    rig.tick()  # job 1 (3g) is now in the store
    status, resp = post(rig, "/v1/prolog", {"job_id": "1", "node": "n1", "observed": OBSERVED, "bindings": {}})
    assert status == 200 and resp["action"] == "bind", resp


@pytest.mark.parametrize("ticked,updated", [
    # mig:1g:7 lowered to mig:1g:1: Slurm counts one 1g, the job was given seven (the GPU's whole compute)
    ({"1g": 7}, {"1g": 1}),
    # mig:1g raised to mig:7g: Slurm counts a 7g taken, the job was given a 1g
    ({"1g": 1}, {"7g": 1}),
    ({"3g": 2}, {"3g": 1}),
])
def test_the_prolog_binds_what_slurm_allocated_after_an_update_since_the_tick(rig, ticked, updated):
    """`scontrol update JobId=3 Gres=...` on a pending job (job_submit.lua's slurm_job_modify accepts it) right
    after a tick recorded its request: Slurm may schedule the job at once after an update, before the next tick.
    The controller bound the store's request, not the one Slurm allocated, so a user could get more slices than
    Slurm counts (taking the instances of the jobs Slurm starts beside it) or another size (found in review).
    The Prolog now binds the request of Slurm's record of the job."""
    (gtype, count), = ticked.items()
    rig.fake.queue = [SlurmJob(job_id=3, name="c", user="carol", state="PENDING", mig=dict(ticked),
                               tres_per_node=f"gres:mig:{gtype}:{count}", submit_time=1, priority=10)]
    rig.tick()
    assert (rig.store.get_job("3").profile, rig.store.get_job("3").count) == (gtype, count)
    (new_type, new_count), = updated.items()
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=3, state="RUNNING", nodes=["n1"], partition="debug",
                                                   tres_per_node=f"gres:mig:{new_type}:{new_count}",
                                                   mig=dict(updated))
    status, resp = post(rig, "/v1/prolog", {"job_id": "3", "node": "n1", "observed": OBSERVED, "bindings": {}})
    assert status == 200 and resp["action"] == "bind", resp
    assert [i["profile"].split(".")[0] for i in resp["instances"]] == [new_type] * new_count, resp
    job = rig.store.get_job("3")
    assert (job.profile, job.count, len(rig.store.bound_instances("3"))) == (new_type, new_count, new_count)


def test_the_prolog_of_a_job_updated_to_no_mig_since_the_tick_binds_nothing(rig):
    """`scontrol update JobId=1 Gres=gpu:1` after the tick stored its mig:3g: Slurm allocated no MIG instance,
    and the job got a 3g nobody counted."""
    rig.tick()
    assert rig.store.get_job("1").profile == "3g"
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=1, state="RUNNING", nodes=["n1"], partition="debug",
                                                   tres_per_node="gres:gpu:1", mig={})
    status, resp = post(rig, "/v1/prolog", {"job_id": "1", "node": "n1", "observed": OBSERVED, "bindings": {}})
    assert (status, resp) == (200, {"action": "skip"})
    assert rig.store.get_job("1") is None and rig.store.live_bindings() == []


def test_only_the_configured_partitions_are_managed(rig):
    """[slurm].partitions was read and then ignored (found in review): every partition was managed."""
    rig.cfg = replace(rig.cfg, slurm=replace(rig.cfg.slurm, partitions=("gpu",)))
    rig.fake.queue = [replace(j, partition=p) for j, p in zip(rig.fake.queue, ("debug", "debug,gpu"))]
    rig.tick()
    assert rig.store.get_job("1") is None and rig.store.get_job("2") is not None
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=int(job_id), partition="debug", mig={"3g": 1})
    status, resp = post(rig, "/v1/prolog", {"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}})
    assert (status, resp) == (200, {"action": "skip"}) and rig.store.get_job("5") is None


@pytest.mark.parametrize("slurm_says", ["n2", None, "n1"])
def test_a_prolog_for_a_job_bound_on_another_node_asks_slurm_first(rig, slurm_says):
    """Job 10 is bound on n2; a Prolog for it comes from n1. Only if Slurm runs it on n1 (requeued and
    started there before a tick saw it) are n2's instances released; otherwise (n1 speaking beyond
    itself, or Slurm not answering) nothing is (found in review)."""
    from slurm_mig.api.server import RequestRejected

    observed = [{"gpu": 0, "profile": "3g.40gb", "start": s, "uuid": f"MIG-{s}", "in_use": False} for s in (0, 4)]
    for node in ("n1", "n2"):
        rig.store.replace_observed(node, H100, observed, now=time.time())
    rig.store.upsert_job("10", profile="3g", submit_time=1)
    assert rig.on_prolog({"job_id": "10", "node": "n2", "bindings": {}}, Principal(0, 0, "n2", "hmac"))["action"] == "bind"
    held = rig.store.live_bindings()
    rig.fake.job_detail = lambda job_id: None if slurm_says is None else JobDetail(
        job_id=int(job_id), nodes=[slurm_says], mig={"3g": 1})
    ask = lambda: rig.on_prolog({"job_id": "10", "node": "n1", "bindings": {}}, Principal(0, 0, "n1", "hmac"))  # noqa: E731
    if slurm_says == "n1":
        assert ask()["action"] == "bind"
        assert [(j, n) for j, n, _b in rig.store.live_bindings()] == [("10", "n1")]
    else:
        with pytest.raises(RequestRejected, match="bound on n2"):
            ask()
        assert rig.store.live_bindings() == held


def test_instances_a_node_still_holds_are_not_planned_through(rig):
    """A job ended (its Epilog reported) but the node keeps its binding until Slurm lets the job go (the
    crash benchmark: an Epilog killed after reporting). The node refuses to re-carve through it, so the
    controller planned the same re-carve every tick and it failed every tick (25 times in seed 909)."""
    rig.fake.queue = [j for j in rig.fake.queue if j.job_id == 2]  # a 7g job waits
    held = {"5": [{"gpu": 0, "profile": "3g.40gb", "start": 0, "uuid": "MIG-a"}]}
    status, _ = post(rig, "/v1/report", {"node": "n1", "observed": OBSERVED, "bindings": held})
    assert status == 200
    rig.tick()
    desired = rig.store.desired("n1").get(0)
    assert desired is None or "7g" not in str(desired.spec), desired
    status, _ = report(rig)  # the node let it go
    rig.tick()
    assert str(rig.store.desired("n1")[0].spec) == "7g@0"


def test_a_failed_squeue_after_withdrawing_holds_the_recarve_back(rig):
    """If squeue fails right after the counts were lowered, the controller cannot know whether Slurm
    started a job there: the re-carve waits for the next tick and Slurm gets the old counts back."""
    _race_rig(rig, slip=False)
    answers = iter([list(rig.fake.queue), None])
    rig.fake.jobs = lambda: next(answers, list(rig.fake.queue))
    summary = rig.tick()
    assert summary["changes"] == 0 and 0 not in rig.store.desired("n1")
    last = [c[2] for c in rig.fake.calls if c[0] == "gres"][-1]
    assert last.get("3g") == 2 and last.get("7g", 0) == 0, rig.fake.calls
    rig.tick()
    assert str(rig.store.desired("n1")[0].spec) == "7g@0"


def test_a_recarve_that_takes_instances_away_waits_while_slurm_cannot_be_asked(rig, caplog):
    """sinfo fails (squeue answers): the controller cannot lower n1's counts first, so the re-carve
    that would destroy the two advertised 3g instances waits; it goes ahead once Slurm answers."""
    _race_rig(rig, slip=False)
    answer = rig.fake.nodes
    rig.fake.nodes = lambda: None
    with caplog.at_level(logging.WARNING):
        summary = rig.tick()
    assert summary["changes"] == 0 and 0 not in rig.store.desired("n1")
    assert any("re-carves that take instances away on n1 wait" in r.getMessage() for r in caplog.records)
    rig.fake.nodes = answer
    rig.tick()
    assert rig.store.desired("n1")[0].spec == "7g@0"


@pytest.mark.parametrize("field, value", [("node", "n1\n"), ("job_id", "1\n"), ("node", "n1\nINFO forged line")])
def test_a_trailing_newline_is_not_a_name(rig, field, value):
    # "$" in a pattern also matches before a final newline: the checks must hold for the whole string.
    payload = {"node": "n1", "job_id": "1", "observed": OBSERVED, "bindings": {}, field: value}
    status, doc = post(rig, "/v1/prolog" if field == "job_id" else "/v1/report", payload)
    assert status == 422 and f"bad {'node name' if field == 'node' else 'job id'}" in doc["error"]


@pytest.mark.parametrize("gpu_state", ["mig_off", "lost"])
def test_a_node_whose_mig_gpus_are_gone_stops_advertising_their_instances(rig, gpu_state):
    """n1's only GPU lost MIG mode (a driver reload on Hopper) or fell off the bus: its instances are gone.
    The controller skipped nodes without a usable MIG GPU, so Slurm kept advertising mig:3g:2 there and
    started 3g jobs on slices that did not exist (found in review). Now every count goes to 0, the padded
    total kept at 7 per GPU the node reports (a lower total drains the node at re-registration)."""
    writes = []
    rig.fake.queue = []
    rig.fake.nodes = lambda: [SlurmNode(name="n1", state="idle", gres={"3g": 2, "7g": 1, "pad": 11}, gres_used={})]
    rig.fake.update_node_gres = lambda node, counts, **kw: writes.append((node, dict(counts), kw.get("pad_to"))) or ""
    gpu = dict(H100[0], mig_enabled=False) if gpu_state == "mig_off" else \
        {"gpu": 0, "uuid": "", "model": None, "mig_enabled": False}
    rig.store.replace_observed("n1", [gpu, dict(H100[0], gpu=1, uuid="GPU-1")],
                               [{"gpu": 1, "profile": "7g.80gb", "start": 0, "uuid": "MIG-c"}], now=time.time())
    rig.tick()
    assert writes and writes[-1][1].get("7g") == 1 and writes[-1][1].get("3g", 0) == 0, writes
    assert writes[-1][2] == 14, writes  # two GPUs reported: the total stays 2 x 7
    # Both GPUs gone: every count 0, the total still 14.
    writes.clear()
    rig.fake.nodes = lambda: [SlurmNode(name="n1", state="idle", gres={"7g": 1, "pad": 13}, gres_used={})]
    rig.store.replace_observed("n1", [gpu, dict(H100[0], gpu=1, uuid="GPU-1", mig_enabled=False)], [],
                               now=time.time())
    rig.tick()
    assert writes and not any(writes[-1][1].values()) and writes[-1][2] == 14, writes


def _job_5_ended_here(rig, profile: str, state: str, exit_code: int) -> list[float]:
    """Job 5 ran on n1 and ended ten minutes ago, its outcome recorded; the rig's clock is ``t[0]``, returned."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile=profile, submit_time=t[0] - 900, now=t[0] - 900)
    rig.store.set_job_state("5", "RUNNING", now=t[0] - 800, node="n1")
    rig.store.record_outcome("5", state=state, exit_code=exit_code, end_time=t[0] - 600, now=t[0] - 600)
    rig.store.set_job_state("5", state, now=t[0] - 600, exit_code=exit_code)
    return t


@pytest.mark.parametrize("seen_by", ["tick", "prolog"])
def test_a_job_id_slurm_uses_again_after_it_ended_here_is_a_new_run(rig, seen_by):
    """slurmctld restarted without its state (job ids start again) or an admin requeued a job that had
    completed: Slurm lists an id the store has as ended. The store kept it COMPLETED, so the policy never
    saw it waiting and its Prolog's bind failed ("it already ended"): answered 500, every time (found in
    review). Now it is tracked as a new run, with what Slurm says it asks for now."""
    t = _job_5_ended_here(rig, "7g", "COMPLETED", 0)
    submitted = int(t[0]) - 5
    new = SlurmJob(job_id=5, name="again", user="zoe", state="PENDING", mig={"3g": 1},
                   tres_per_node="gres:mig:3g:1", submit_time=submitted, priority=20)
    rig.fake.queue = [new]
    if seen_by == "tick":
        rig.tick()
        job = rig.store.get_job("5")
        assert job.state == "PENDING" and job.profile == "3g" and job.end_time is None, job
        assert [j.job_id for j in rig.store.pending_jobs(include_bound=True)] == ["5"]
    else:
        local = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(submitted))  # as scontrol prints it
        rig.fake.job_detail = lambda job_id: JobDetail(job_id=5, state="RUNNING", nodes=["n1"],
                                                              mig={"3g": 1}, fields={"SubmitTime": local})
    status, resp = post(rig, "/v1/prolog", {"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}})
    assert status == 200 and resp["action"] == "bind", resp
    assert resp["instances"][0]["profile"] == "3g.40gb"
    job = rig.store.get_job("5")
    assert job.state == "RUNNING" and rig.store.bound_instances("5")
    # The new run: numbered, and waiting from its own submission, not the ended run's (15 min before).
    assert (job.run, job.submit_time) == (2, submitted)
    # The old run's outcome is kept.
    assert rig.store.outcome("5").profile == "7g"


# -- a job id Slurm gives to a new job: its state wiped (ids start at 1 again), MaxJobId wrapped --------------

def _bob_5(state: str, submitted: int, **kw) -> SlurmJob:
    """The new job 5: bob's 3g, submitted at ``submitted``, nothing in common with the stored job 5 but the id."""
    return SlurmJob(job_id=5, name="bobs", user="bob", state=state, mig={"3g": 1}, tres_per_node="gres:mig:3g:1",
                    submit_time=submitted, priority=20, **kw)


def _epilog_5(instances, end: float, **kw) -> dict:
    return {"job_id": "5", "node": "n1", "exit_code": 0, "end_time": end, "instances": instances, **kw}


def test_a_new_job_with_an_ended_jobs_id_is_queued_placed_bound_and_recorded_as_its_own(rig):
    """Job 5 (a 7g) ended here ten minutes ago, its outcome recorded; slurmctld lost its state and gave id 5 to
    bob's 3g. It is queued and placed as a job of its own, its Prolog binds a 3g, its Epilog records its own
    outcome as run 2 (its user, size, and wait from its own submission); run 1's outcome is left as it was."""
    t = _job_5_ended_here(rig, "7g", "COMPLETED", 0)
    submitted = int(t[0]) - 5
    rig.fake.queue = [_bob_5("PENDING", submitted)]
    rig.tick()
    job = rig.store.get_job("5")
    assert (job.state, job.run, job.user, job.profile, job.submit_time) == ("PENDING", 2, "bob", "3g", submitted)
    assert [a["job_id"] for a in rig.store.recent_decisions(1)[0].action["assignments"]] == ["5"]  # placed
    t[0] += 10
    answer = rig.on_prolog({"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}}, N1)
    assert answer["action"] == "bind" and [i["profile"] for i in answer["instances"]] == ["3g.40gb"], answer
    assert rig.store.get_job("5").start_time == t[0]
    t[0] += 100
    assert rig.on_epilog(_epilog_5(answer["instances"], t[0]), N1)["recorded"]
    got = [(o.run, o.user, o.profile, o.state, o.wait_s) for o in rig.store.outcomes()]
    assert got == [(1, "", "7g", "COMPLETED", 100.0), (2, "bob", "3g", "COMPLETED", t[0] - 100 - submitted)]
    assert rig.store.outcome("5", run=2).run_s == 100.0


@pytest.mark.parametrize("slurm_says", ["PENDING", "RUNNING"])
def test_a_new_job_with_the_id_of_a_running_job_whose_epilog_was_lost_is_a_new_run(rig, slurm_says):
    """Job 5 (alice's 1g) ran on n1 when the node crashed and slurmctld lost its state: no Epilog reported, and
    within the grace period Slurm listed id 5 again, bob's 3g submitted after job 5 started. The tick took it
    for job 5 requeued: the same run, alice's submission (bob's wait counted from it, 2 h), and bob's outcome
    recorded as alice's run. It is a new run: run 2, its own submission, the old binding released; run 1's
    outcome waits for its Epilog, which, late, goes under run 1."""
    t = [float(int(time.time()))]  # whole seconds, as Slurm's times are
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile="1g", user="alice", name="old", submit_time=t[0] - 7300, now=t[0] - 7300)
    rig.store.set_job_state("5", "RUNNING", now=t[0] - 7200, node="n1")
    old = [{"gpu": 0, "profile": "1g.10gb", "start": 6}]
    rig.store.bind("5", "n1", old, now=t[0] - 7200)
    submitted = int(t[0]) - 30
    rig.fake.queue = [_bob_5(slurm_says, submitted, nodes=["n1"] if slurm_says == "RUNNING" else [],
                             start_time=int(t[0]) - 10 if slurm_says == "RUNNING" else None)]
    rig.tick()
    job = rig.store.get_job("5")
    assert (job.state, job.run, job.user, job.profile, job.submit_time) == (slurm_says, 2, "bob", "3g", submitted)
    assert job.start_time == (t[0] - 10 if slurm_says == "RUNNING" else None)
    assert rig.store.bound_instances("5") == ()  # alice's instance is not bob's
    assert any(e.kind == "reused" for e in rig.store.recent_events(20, job_id="5"))
    # n1, back, reports the binding file alice's run left there: not adopted as bob's.
    rig.on_report({"node": "n1", "bindings": {"5": [{**old[0], "uuid": "MIG-old"}]},
                   "binding_times": {"5": t[0] - 7200}}, N1)
    assert rig.store.bound_instances("5") == () and rig.store.get_job("5").run == 2
    t[0] += 5
    answer = rig.on_prolog({"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}}, N1)
    assert [i["profile"] for i in answer["instances"]] == ["3g.40gb"], answer
    started = t[0] if slurm_says == "PENDING" else t[0] - 15  # its Prolog, or Slurm's start time
    t[0] += 100
    assert rig.on_epilog(_epilog_5(answer["instances"], t[0]), N1)["recorded"]
    (o,) = rig.store.outcomes()
    assert (o.run, o.user, o.profile, o.submit_time, o.start_time) == (2, "bob", "3g", submitted, started)
    # Run 1's Epilog, delivered late from n1's outbox once the node is back: run 1's outcome, alice's size.
    assert rig.on_epilog(_epilog_5(old, t[0] - 7000 - 100, message_id="e5" * 16), N1)["recorded"]
    assert [(o.run, o.profile, o.state) for o in rig.store.outcomes()] == [(1, "1g", "COMPLETED"),
                                                                          (2, "3g", "COMPLETED")]


def test_a_new_jobs_prolog_is_not_given_the_instance_of_a_running_job_with_its_id(rig):
    """As above, but bob's job 5 reached its Prolog on n1 before any tick saw it. The store had job 5 (alice's
    1g) bound on n1, and took the Prolog for a retry of hers: it handed bob alice's 1g.10gb instance, where he
    asked for a 3g, and kept alice's start and submission as his. Slurm's submit time, after alice's run
    started, says it is another job: a new run, bound to what it asks for."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile="1g", user="alice", name="old", submit_time=t[0] - 7300, now=t[0] - 7300)
    rig.store.set_job_state("5", "RUNNING", now=t[0] - 7200, node="n1")
    rig.store.bind("5", "n1", [{"gpu": 0, "profile": "1g.10gb", "start": 6}], now=t[0] - 7200)
    submitted = int(t[0]) - 30
    local = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(submitted))  # as Slurm prints it
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=5, user="bob", state="RUNNING", nodes=["n1"],
                                                   mig={"3g": 1}, fields={"SubmitTime": local})
    answer = rig.on_prolog({"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}}, N1)
    assert answer["action"] == "bind" and [i["profile"] for i in answer["instances"]] == ["3g.40gb"], answer
    job = rig.store.get_job("5")
    assert (job.state, job.run, job.user, job.submit_time, job.start_time) == ("RUNNING", 2, "bob", submitted, t[0])
    assert [b.profile for b in rig.store.bound_instances("5")] == ["3g.40gb"]
    # A retried Prolog of the same job (same submission) still gets the same instances.
    again = rig.on_prolog({"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}}, N1)
    assert again["instances"] == answer["instances"] and rig.store.get_job("5").run == 2


def test_a_new_job_of_the_same_size_is_bound_as_its_users_own_before_any_tick(rig):
    """Job 5 (alice's 3g) ran on n1 when slurmctld lost its state; id 5 went to bob's 3g, whose Prolog came before
    any tick saw it. The Prolog told it for another job (submitted after alice's run started) and made it run 2,
    but Slurm's request was the stored one (3g x 1), so _job_request returned early and the run kept alice's
    user (and job name) until the next tick: an Epilog before that recorded bob's run as alice's. Slurm's user
    is stored for the run the Prolog binds whenever it differs from the stored one."""
    t = [float(int(time.time()))]
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile="3g", user="alice", name="old", submit_time=t[0] - 7300, now=t[0] - 7300)
    rig.store.set_job_state("5", "RUNNING", now=t[0] - 7200, node="n1")
    rig.store.bind("5", "n1", [{"gpu": 0, "profile": "3g.40gb", "start": 0}], now=t[0] - 7200)
    submitted = int(t[0]) - 30
    local = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(submitted))  # as Slurm prints it
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=5, user="bob", state="RUNNING", nodes=["n1"],
                                                   mig={"3g": 1}, fields={"SubmitTime": local, "Restarts": "0"})
    answer = rig.on_prolog({"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}}, N1)
    assert answer["action"] == "bind", answer
    job = rig.store.get_job("5")
    assert (job.run, job.user, job.name, job.profile) == (2, "bob", "", "3g")
    t[0] += 100
    assert rig.on_epilog(_epilog_5(answer["instances"], t[0]), N1)["recorded"]
    assert [(o.run, o.user) for o in rig.store.outcomes()] == [(2, "bob")]


@pytest.mark.parametrize("restarts", [0, 1])
@pytest.mark.parametrize("slurm_says", ["PENDING", "RUNNING"])
def test_another_users_job_with_the_id_is_another_job_even_submitted_within_the_clock_margin(rig, slurm_says,
                                                                                              restarts):
    """Job 5 (alice's 1g) started on n1 and slurmctld lost its state 20 s later; id 5 went to bob's 3g at once.
    Submitted within the 60 s clock margin of alice's start, it was taken for her run (requeued, or its Prolog a
    retry): bob's job kept alice's run, submission and instance. A requeue never changes a job's user: another
    user's job is another job whatever its times and restart count say (Slurm may have requeued bob's job before
    the controller saw it). The same user within the margin stays ambiguous, and is taken for the run."""
    t = [float(int(time.time()))]
    rig.clock = lambda: t[0]
    started = t[0] - 7200
    rig.store.upsert_job("5", profile="1g", user="alice", name="old", submit_time=started - 100, now=started - 100)
    rig.store.set_job_state("5", "RUNNING", now=started, node="n1")
    rig.store.bind("5", "n1", [{"gpu": 0, "profile": "1g.10gb", "start": 6}], now=started)
    submitted = int(started) + 20
    rig.fake.queue = [_bob_5(slurm_says, submitted, restart_cnt=restarts,
                             nodes=["n1"] if slurm_says == "RUNNING" else [],
                             start_time=int(t[0]) - 10 if slurm_says == "RUNNING" else None)]
    rig.tick()
    job = rig.store.get_job("5")
    assert (job.state, job.run, job.user, job.profile, job.submit_time) == (slurm_says, 2, "bob", "3g", submitted)
    assert rig.store.bound_instances("5") == ()  # alice's instance is not bob's
    (event,) = [e for e in rig.store.recent_events(20, job_id="5") if e.kind == "reused"]
    assert "bob's job" in event.message and "run 1 (alice's, running" in event.message, event.message
    # The next tick, the same record: the same run.
    rig.tick()
    assert rig.store.get_job("5").run == 2


def test_the_same_users_job_within_the_clock_margin_is_still_taken_for_the_run(rig):
    """The limit the user rule leaves: alice's own job, submitted within the margin of her run's start, with no
    restart: nothing Slurm prints tells it from her run, which it is taken for."""
    t = [float(int(time.time()))]
    rig.clock = lambda: t[0]
    started = t[0] - 7200
    rig.store.upsert_job("5", profile="3g", user="alice", submit_time=started - 100, now=started - 100)
    rig.store.set_job_state("5", "RUNNING", now=started, node="n1")
    rig.store.bind("5", "n1", [{"gpu": 0, "profile": "3g.40gb", "start": 0}], now=started)
    rig.fake.queue = [replace(_bob_5("RUNNING", int(started) + 20, nodes=["n1"], start_time=int(started)),
                              user="alice")]
    rig.tick()
    job = rig.store.get_job("5")
    assert (job.run, job.state) == (1, "RUNNING") and len(rig.store.bound_instances("5")) == 1


@pytest.mark.parametrize("renamed", ["alice.smith", "20231234"])
def test_a_running_jobs_user_renamed_is_not_taken_for_another_user(rig, renamed):
    """Alice (uid 1001) was renamed in the directory while her job 5 ran on n1 (or, her name a number, the head
    node's lookup failed once and squeue --json gave her uid): the next tick's squeue named the same uid
    otherwise. The user rule compared names alone and took her running job for another user's job with the
    id: her instance released (free for the next job, or a re-carve), her run restarted as run 2. A uid names
    the user; names are compared only where a record has no uid."""
    t = [float(int(time.time()))]
    rig.clock = lambda: t[0]
    started = int(t[0]) - 7200
    first = "alice" if renamed != "20231234" else "20231234"
    job = SlurmJob(job_id=5, name="train", user=first, user_id=1001, state="RUNNING", mig={"3g": 1},
                   tres_per_node="gres:mig:3g:1", submit_time=started - 100, start_time=started, nodes=["n1"],
                   priority=20)
    rig.fake.queue = [job]
    rig.tick()
    rig.store.bind("5", "n1", [{"gpu": 0, "profile": "3g.40gb", "start": 0}], now=t[0])
    t[0] += 30
    rig.fake.queue = [replace(job, user=renamed if renamed != "20231234" else "1001")]
    rig.tick()
    stored = rig.store.get_job("5")
    assert (stored.run, stored.state) == (1, "RUNNING"), stored
    assert len(rig.store.bound_instances("5")) == 1
    assert not any(e.kind == "reused" for e in rig.store.recent_events(20, job_id="5"))


def test_a_waiting_jobs_prolog_after_its_user_was_renamed_binds_it_as_its_run(rig, monkeypatch):
    """Alice's job 5 waited (a tick stored it: alice, uid 1001) and was renamed alice.smith before it started:
    squeue -j, which prints only the name, named her so at the Prolog. Taken for another user's job, her job
    was made run 2, its submission and reservation those of "another job". The name squeue -j gives is looked
    up on the head node (as squeue did): the same uid, the same run. Bob's name, another uid, is still another
    job."""
    from types import SimpleNamespace

    import slurm_mig.controller.runs as runs

    uids = {"alice.smith": 1001, "alice": 1001, "bob": 1002}
    monkeypatch.setattr(runs.pwd, "getpwnam", lambda name: SimpleNamespace(pw_uid=uids[name]))
    t = [float(int(time.time()))]
    rig.clock = lambda: t[0]
    submitted = int(t[0]) - 600
    rig.fake.queue = [SlurmJob(job_id=5, name="train", user="alice", user_id=1001, state="PENDING", mig={"3g": 1},
                               tres_per_node="gres:mig:3g:1", submit_time=submitted, priority=20)]
    rig.tick()
    local = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(submitted))
    for user, run in (("alice.smith", 1), ("bob", 2)):
        rig.fake.job_detail = lambda job_id, user=user: JobDetail(
            job_id=5, user=user, state="RUNNING", nodes=["n1"], mig={"3g": 1},
            fields={"SubmitTime": local, "Restarts": "0"})
        answer = rig.on_prolog({"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}}, N1)
        assert answer["action"] == "bind", answer
        job = rig.store.get_job("5")
        assert (job.run, job.user, job.submit_time) == (run, user, submitted), job
        reused = [e for e in rig.store.recent_events(20, job_id="5") if e.kind == "reused"]
        assert len(reused) == run - 1, reused


@pytest.mark.parametrize("stored", ["RUNNING", "PENDING"])
def test_another_users_prolog_within_the_clock_margin_is_bound_as_another_job(rig, stored):
    """As above, but bob's job 5 (a 3g, like alice's) reached its Prolog on n1 before any tick saw it. Submitted
    within the margin of alice's start (or, her job waiting, of her submission), his Prolog was taken for a
    retry of hers and handed her instance (or bound as her waiting run, with her submission): and with its
    user then Slurm's, the next tick found bob's job under a running run of another user. Another user's job
    is another job: a run of its own, bound as its own, and the next tick leaves it so."""
    t = [float(int(time.time()))]
    rig.clock = lambda: t[0]
    since = t[0] - 7200
    rig.store.upsert_job("5", profile="3g", user="alice", name="old", submit_time=since, now=since)
    if stored == "RUNNING":
        rig.store.set_job_state("5", "RUNNING", now=since, node="n1")
        rig.store.bind("5", "n1", [{"gpu": 0, "profile": "3g.40gb", "start": 0}], now=since)
    submitted = int(since) + 20
    local = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(submitted))  # as Slurm prints it
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=5, user="bob", state="RUNNING", nodes=["n1"],
                                                   mig={"3g": 1}, fields={"SubmitTime": local, "Restarts": "0"})
    answer = rig.on_prolog({"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}}, N1)
    assert answer["action"] == "bind", answer
    assert any(e.kind == "reused" for e in rig.store.recent_events(20, job_id="5"))
    job = rig.store.get_job("5")
    assert (job.run, job.user, job.submit_time, job.start_time) == (2, "bob", submitted, t[0])
    t[0] += 5
    rig.fake.queue = [_bob_5("RUNNING", submitted, nodes=["n1"], start_time=int(t[0]) - 5)]
    rig.tick()
    job = rig.store.get_job("5")
    assert (job.run, job.state, job.user) == (2, "RUNNING", "bob")
    assert [(b.profile, b.start) for b in rig.store.bound_instances("5")] == [(answer["instances"][0]["profile"],
                                                                              answer["instances"][0]["start"])]


@pytest.fixture
def berlin_time(monkeypatch):
    """The process's local time is Europe/Berlin's (restored after the test)."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_prolog_in_the_hour_a_clock_goes_back_is_not_taken_for_another_job(rig, berlin_time):
    """Job 5 was submitted at 02:30 CEST on 2026-10-25, the first of that night's two 02:30s; the tick saw it
    running at 02:30:30 and its Prolog came after. squeue prints the submit time as local time without a
    zone, and mktime read the ambiguous 02:30:00 as CET, an hour later (glibc picks either, depending on
    its previous call): submitted 59 minutes after it started, so on_prolog took the job for another job
    with its id, made it run 2 and logged a 'reused' event. An ambiguous local time is read as its
    earliest instant: a job is taken for another only when it was submitted after the run started
    whichever instant Slurm meant."""
    submitted = 1792888200  # 2026-10-25 02:30:00 CEST (00:30 UTC)
    assert time.strftime("%H:%M %Z", time.localtime(submitted)) == "02:30 CEST"
    t = [float(submitted + 35)]
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile="3g", user="bob", submit_time=submitted, now=submitted)
    rig.store.set_job_state("5", "RUNNING", now=submitted + 30, node="n1")  # Slurm's start, as the tick saw it
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=5, user="bob", state="RUNNING", nodes=["n1"],
                                                   mig={"3g": 1}, fields={"SubmitTime": "2026-10-25T02:30:00"})
    time.mktime(time.strptime("2026-12-01T12:00:00", "%Y-%m-%dT%H:%M:%S"))  # glibc's next guess: CET
    answer = rig.on_prolog({"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}}, N1)
    assert answer["action"] == "bind", answer
    job = rig.store.get_job("5")
    assert (job.run, job.submit_time, job.start_time) == (1, submitted, submitted + 30)
    assert not any(e.kind == "reused" for e in rig.store.recent_events(20, job_id="5"))


BERLIN_0230_CEST = 1792888200  # 2026-10-25 02:30:00 CEST (00:30 UTC); 02:30:00 CET is an hour later


def _guess_summer_time():
    """glibc's mktime guesses an ambiguous time's offset from its previous call: make its next guess CEST."""
    time.mktime(time.strptime("2026-07-01T12:00:00", "%Y-%m-%dT%H:%M:%S"))


@pytest.mark.parametrize("stored", ["ended", "running"])
def test_a_prolog_in_the_second_hour_records_the_submission_that_has_just_been(rig, berlin_time, stored):
    """Bob's job 5 was submitted at 02:30:00 CET on 2026-10-25, the second 02:30 of that night, and its Prolog
    came 40 s later, before any tick saw it: a run of its own (id 5 ended here, or names alice's run, started
    at midnight). squeue prints 02:30:00 without a zone: mktime read it as its guess (here CEST) and the run
    another job was made read it as the earlier instant, an hour before: bob's wait an hour too long in his
    outcome. A job no tick has seen was submitted moments ago: the later instant not after now."""
    submitted = BERLIN_0230_CEST + 3600
    assert time.strftime("%H:%M %Z", time.localtime(submitted)) == "02:30 CET"
    t = [float(submitted + 40)]
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile="1g", user="alice", submit_time=BERLIN_0230_CEST - 9100,
                         now=BERLIN_0230_CEST - 9100)
    rig.store.set_job_state("5", "RUNNING", now=BERLIN_0230_CEST - 9000, node="n1")
    if stored == "ended":
        rig.store.record_outcome("5", state="COMPLETED", exit_code=0, end_time=BERLIN_0230_CEST - 60,
                                 now=BERLIN_0230_CEST - 60)
        rig.store.set_job_state("5", "COMPLETED", now=BERLIN_0230_CEST - 60, exit_code=0)
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=5, user="bob", state="RUNNING", nodes=["n1"],
                                                   mig={"3g": 1}, fields={"SubmitTime": "2026-10-25T02:30:00",
                                                                          "Restarts": "0"})
    _guess_summer_time()
    answer = rig.on_prolog({"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}}, N1)
    assert answer["action"] == "bind", answer
    job = rig.store.get_job("5")
    assert (job.run, job.user, job.submit_time, job.start_time) == (2, "bob", submitted, t[0])


def test_an_end_slurm_records_in_the_second_hour_is_not_read_an_hour_early(rig, berlin_time):
    """Job 5 ran on n1 from 01:30 CEST; its Epilog was lost and Slurm says it ended at 02:30:00 CET, the second
    02:30 of 2026-10-25, seconds before the tick saw it. scontrol's EndTime has no zone and mktime read it as
    its guess (here CEST, an hour early): the outcome settled from Slurm's record ended the run an hour before
    it did. Read moments after the end: the later instant not after now."""
    ended = BERLIN_0230_CEST + 3600
    t = [float(ended + 5)]
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile="3g", user="bob", submit_time=BERLIN_0230_CEST - 3700,
                         now=BERLIN_0230_CEST - 3700)
    rig.store.set_job_state("5", "RUNNING", now=BERLIN_0230_CEST - 3600, node="n1")
    rig.store.bind("5", "n1", [{"gpu": 0, "profile": "3g.40gb", "start": 0}], now=BERLIN_0230_CEST - 3600)
    rig.fake.queue = [_bob_5("COMPLETED", int(BERLIN_0230_CEST - 3700), nodes=["n1"],
                             start_time=int(BERLIN_0230_CEST - 3600))]
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=5, user="bob", state="COMPLETED", nodes=["n1"],
                                                   mig={"3g": 1}, fields={"ExitCode": "0:0",
                                                                          "EndTime": "2026-10-25T02:30:00"})
    for _ in range(3):
        _guess_summer_time()
        rig.tick()
        t[0] += 61
    (o,) = rig.store.outcomes()
    assert (o.run, o.state, o.end_time) == (1, "COMPLETED", ended), o


@pytest.mark.parametrize("within_margin", [False, True])
def test_a_lost_epilog_is_not_settled_with_the_end_of_another_job_with_the_id(rig, within_margin):
    """Job 5 (alice's 1g) ran on n1 when the node crashed and slurmctld lost its state: no Epilog. Id 5 went
    to bob's 3g, submitted later; its Prolog bound it on n1 alone while the controller was unreachable,
    and it failed (exit 1) before any tick saw it live. Slurm lists id 5 ended, and once the grace was
    over the tick recorded bob's end as run 1's outcome: alice's run FAILED with his exit status and end
    time. Slurm's record is another job's (submitted after run 1 started, never requeued): run 1 is
    settled as one Slurm has forgotten, with no exit status of its own. So it is when bob's job was submitted
    within the clock margin of run 1's start (``within_margin``): it is another user's."""
    t = [float(int(time.time()))]
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile="1g", user="alice", name="old", submit_time=t[0] - 7300, now=t[0] - 7300)
    rig.store.set_job_state("5", "RUNNING", now=t[0] - 7200, node="n1")
    rig.store.bind("5", "n1", [{"gpu": 0, "profile": "1g.10gb", "start": 6}], now=t[0] - 7200)
    submitted, ended = int(t[0]) - (7180 if within_margin else 300), int(t[0]) - 20
    rig.fake.queue = [_bob_5("FAILED", submitted, nodes=["n1"], start_time=submitted + 1)]
    rig.fake.job_detail = lambda job_id: JobDetail(
        job_id=5, user="bob", state="FAILED", nodes=["n1"], mig={"3g": 1},
        fields={"ExitCode": "1:0", "EndTime": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ended))})
    for _ in range(3):
        rig.tick()
        t[0] += 61
    (o,) = rig.store.outcomes()
    assert (o.run, o.profile, o.user) == (1, "1g", "alice")
    assert o.exit_code is None and o.end_time != ended, o  # not bob's exit status and end
    assert rig.store.get_job("5").state in ("FAILED", "COMPLETED", "CANCELLED") and not rig.store.bound_instances("5")


def test_a_new_job_with_the_id_of_a_job_waiting_here_waits_from_its_own_submission(rig):
    """Job 5 (alice's) waited here when slurmctld lost its state; the controller was down meanwhile and, back,
    found id 5 waiting again: bob's, submitted later. It kept alice's submission (bob's wait counted from it)."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile="1g", user="alice", submit_time=t[0] - 7300, now=t[0] - 7300)
    submitted = int(t[0]) - 30
    rig.fake.queue = [_bob_5("PENDING", submitted)]
    rig.tick()
    job = rig.store.get_job("5")
    assert (job.state, job.user, job.submit_time) == ("PENDING", "bob", submitted)


@pytest.mark.parametrize("stored", ["RUNNING", "REQUEUED"])
def test_a_requeued_job_is_still_the_same_run(rig, stored):
    """Slurm gives a requeued batch job a new submit time (batch_requeue_fini) and counts the restart: the job
    waits again as the same run, with its own submission; only a record of no restart is another job."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile="3g", user="bob", submit_time=t[0] - 7300, now=t[0] - 7300)
    rig.store.set_job_state("5", "RUNNING", now=t[0] - 7200, node="n1")
    rig.store.bind("5", "n1", [{"gpu": 0, "profile": "3g.40gb", "start": 0}], now=t[0] - 7200)
    if stored == "REQUEUED":  # requeued by a hook (its bind failed)
        rig.store.release("5", now=t[0] - 60)
        rig.store.set_job_state("5", "REQUEUED", now=t[0] - 60, reason="reconfiguration failed on the node")
    rig.fake.queue = [_bob_5("PENDING", int(t[0]) - 30, restart_cnt=1)]
    rig.tick()
    job = rig.store.get_job("5")
    assert (job.state, job.run, job.submit_time) == ("PENDING", 1, t[0] - 7300)
    assert rig.store.bound_instances("5") == ()
    assert not any(e.kind == "reused" for e in rig.store.recent_events(20, job_id="5"))


@pytest.mark.parametrize("restarts", ["1", "0"])
def test_a_requeued_jobs_prolog_before_any_tick_saw_it_is_the_same_runs(rig, restarts):
    """Job 5 (bob's 3g) ran on n1; Slurm requeued it while the controller was down (its Epilog lost), gave it a
    new submit time (04:28:18 to 04:28:20 on Slurm 22.05.8, test_slurm_parsers' job 7) and started it again
    once its hold was over, before any tick saw it waiting. Its Prolog took it for another job with the id,
    submitted after the run started: a 'reused' event, and the job's next attempt counted as run 2 with that
    submission. squeue -j's restart count (RestartCnt, 1) says it was requeued: the same run, its own
    instances. With a restart count of 0 it is another job with the id, as before."""
    t = [float(int(time.time()))]
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile="3g", user="bob", submit_time=t[0] - 7300, now=t[0] - 7300)
    rig.store.set_job_state("5", "RUNNING", now=t[0] - 7200, node="n1")
    rig.store.bind("5", "n1", [{"gpu": 0, "profile": "3g.40gb", "start": 0}], now=t[0] - 7200)
    submitted = int(t[0]) - 30
    local = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(submitted))  # as Slurm prints it
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=5, user="bob", state="RUNNING", nodes=["n1"],
                                                   mig={"3g": 1}, fields={"SubmitTime": local, "Restarts": restarts})
    answer = rig.on_prolog({"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}}, N1)
    assert answer["action"] == "bind" and [i["profile"] for i in answer["instances"]] == ["3g.40gb"], answer
    job = rig.store.get_job("5")
    reused = any(e.kind == "reused" for e in rig.store.recent_events(20, job_id="5"))
    if restarts != "0":
        assert (job.run, job.state, job.submit_time, reused) == (1, "RUNNING", t[0] - 7300, False)
    else:
        assert (job.run, job.submit_time, job.start_time, reused) == (2, submitted, t[0], True)


@pytest.mark.parametrize("slurm_lists", [True, False])
def test_a_requeued_job_cancelled_before_a_tick_saw_it_pending_ends_here_too(rig, slurm_lists):
    """A Prolog found no room and requeued job 1 (REQUEUED here). It was cancelled before a tick saw it
    pending again (the controller was down, or the user was quick): Slurm lists it CANCELLED, then forgets
    it. Only PENDING jobs were ended by the tick, so it stayed REQUEUED forever (found in review)."""
    rig.tick()
    rig.store.set_job_state("1", "REQUEUED", now=time.time(), reason="no room")
    rig.fake.queue = [replace(j, state="CANCELLED") for j in rig.fake.queue if j.job_id == 1] if slurm_lists else []
    rig.tick()
    assert rig.store.get_job("1").state == "CANCELLED", rig.store.get_job("1")


def test_a_report_from_a_drained_node_does_not_make_it_up(rig):
    """slurmd runs the health check on a drained node too. Every report stored the node as "up", so until
    the next tick (or for as long as sinfo failed) the policy planned re-carves and placements on a node
    Slurm will not use (found in review). The node's state is now the tick's, from sinfo."""
    rig.fake.nodes = lambda: [SlurmNode(name="n1", state="idle", flags=frozenset({"DRAIN"}), gres={"3g": 2},
                                        gres_used={})]
    rig.tick()
    assert rig.store.node("n1").state == "drain"
    assert report(rig)[0] == 200
    assert rig.store.node("n1").state == "drain" and rig.store.node("n1").last_seen is not None
    rig.fake.nodes = lambda: None  # sinfo fails: the stored state is all the tick has
    rig.tick()
    assert not any(g.available for g in rig.store.cluster_state(time.time()).gpus)
    assert 0 not in rig.store.desired("n1")


def test_history_retention_comes_from_the_config(rig, monkeypatch):
    """Decisions hold the state the policy saw: on a big cluster 50,000 of them are gigabytes, so how
    much history is kept is the admin's ([controller] keep_decisions, keep_events, keep_journal_days)."""
    rig.cfg = replace(rig.cfg, controller=replace(rig.cfg.controller, keep_decisions=7, keep_decisions_mb=3,
                                                  keep_events=9, keep_journal_days=1.5))
    asked = []
    monkeypatch.setattr(rig.store, "prune", lambda **kw: asked.append(kw) or {"decisions": 0})
    rig.tick()
    keys = ("keep_decisions", "keep_decisions_bytes", "keep_events", "keep_journal_days")
    assert asked and {k: asked[0][k] for k in keys} == \
        {"keep_decisions": 7, "keep_decisions_bytes": 3 * 1024 * 1024, "keep_events": 9, "keep_journal_days": 1.5}


def test_the_decision_history_stays_within_its_size_budget_between_the_500_tick_prunes(rig):
    """Pruned every 500 ticks only, a site recording a 3 MB decision each tick (1,024 GPUs, 10,000 pending
    jobs; two with a shadow policy) went 1.5-3 GB past any budget before each prune. A tick now also prunes
    once the decisions recorded since the last prune take a tenth of [controller].keep_decisions_mb."""
    from slurm_mig.policies import Decision

    budget = 1024 * 1024
    rig.cfg = replace(rig.cfg, controller=replace(rig.cfg.controller, keep_decisions_mb=1))
    big = 30_000
    for k in range(100):  # 3 MB recorded in all, over ticks 1-100
        rig.store.record_decision(Decision(policy="big"), inputs={"pad": "x" * big})
        rig.tick()
        total = rig.store.db.execute("SELECT SUM(bytes) FROM decision_bytes").fetchone()[0]
        assert total <= budget + budget // 10 + big, (k, total)
    kept = rig.store.db.execute("SELECT COUNT(*) FROM decisions WHERE policy = 'big'").fetchone()[0]
    assert 25 <= kept <= 40  # some 35 of ~30 KB in 1 MB, plus up to a tenth before the next prune


def _job_1_ended_in_slurm(rig, *, started: float) -> None:
    """After a first tick: job 1 runs on n1 since ``started`` in the store, and Slurm now lists it COMPLETED."""
    rig.tick()
    rig.store.upsert_job("1", profile="3g", submit_time=1.0)
    rig.store.set_job_state("1", "RUNNING", now=started, node="n1")
    rig.fake.queue = [replace(rig.fake.queue[0], state="COMPLETED"), rig.fake.queue[1]]


def _roll_back_a_tick(rig) -> None:
    """One tick whose transaction fails at the policy step (as on a full disk) and is rolled back."""
    plan = rig._plan

    def plan_then_fail(now):
        raise StoreError("disk or database full (test)")

    rig._plan = plan_then_fail
    try:
        with pytest.raises(StoreError):
            rig.tick()
    finally:
        rig._plan = plan


def test_notes_on_ended_jobs_written_by_a_rolled_back_tick_are_written_by_the_next(rig):
    """The tick noted "saved" for its notes on ended jobs (the meta row a restarted controller reads) before its
    transaction committed: after a rolled-back tick the next one, with the same notes, did not write them, and a
    controller restarted then lost the Slurm record (exit status, end time) of a job whose Epilog never came."""
    _job_1_ended_in_slurm(rig, started=time.time())
    _roll_back_a_tick(rig)
    assert "1" not in (rig.store.get_meta("ended_since") or {})
    rig.tick()
    assert "1" in (rig.store.get_meta("ended_since") or {})
    assert "1" in Controller(Config(), rig.store, rig.fake)._ended_since


def test_a_rolled_back_prolog_leaves_no_journal_ids_behind(rig):
    """The Prolog noted which journal entries its re-carve carries before its transaction committed. Rolled
    back, those entries were never written and SQLite hands their ids to the next ones: the job's
    /v1/bind-failed then closed as failed another GPU's reconfiguration that happened to get the same id."""
    rig.tick()
    add_event = rig.store.add_event

    def fail_on_bind(kind, *a, **kw):
        if kind == "bind":
            from slurm_mig.store.db import StoreUnavailable

            raise StoreUnavailable("disk or database full (test)")
        return add_event(kind, *a, **kw)

    rig.store.add_event = fail_on_bind
    status, resp = post(rig, "/v1/prolog", {"job_id": "2", "node": "n1", "observed": OBSERVED, "bindings": {}})
    rig.store.add_event = add_event
    assert status == 503, (status, resp)
    assert rig.store.bound_instances("2") == ()
    other = rig.store.journal_begin("n1", 1, "7g@0", "3g@0,3g@4", [], started=True)  # GPU 1's re-carve
    status, _ = post(rig, "/v1/bind-failed", {"job_id": "2", "node": "n1",
                                             "results": [{"gpu": 0, "ok": False, "error": "gave up"}]})
    assert status == 200
    assert rig.store.journal_entry(other).state == "in_progress"


def test_a_rolled_back_tick_does_not_count_a_lost_epilogs_job_twice(rig):
    """A tick that settled a job whose Epilog never came counted it in jobs_finished_total inside its
    transaction; rolled back, its notes are restored (so the next tick settles the job again at once) and
    the next tick counted it a second time. It is counted once, by the tick that commits."""
    _job_1_ended_in_slurm(rig, started=time.time() - 2000)
    rig._ended_since["1"] = (time.time() - 1000, ("COMPLETED", 0, time.time() - 1005))
    key = ("slurm_mig_jobs_finished_total", (("state", "COMPLETED"),))
    _roll_back_a_tick(rig)
    assert rig.store.get_job("1").state == "RUNNING"  # rolled back
    rig.tick()
    assert rig.store.get_job("1").state == "COMPLETED"
    assert rig.metrics.counters.get(key) == 1.0


def test_a_note_on_an_earlier_runs_end_does_not_settle_a_new_run(rig):
    """Job 5 ended while the tick had a note on it (Slurm said COMPLETED before its Epilog came). The id
    starts again and its Prolog comes before any tick saw it live (982ab68: a new run). The old note stayed:
    when the new run ended before the next tick, that tick took the earlier run's note as over the Epilog
    grace and recorded the new run's end at once, with the old run's exit status and end time. A note
    older than the run's start belongs to an earlier run: the new run waits for its Epilog as any other."""
    t = _job_5_ended_here(rig, "3g", "FAILED", 256)
    rig._ended_since["5"] = (t[0] - 610, ("FAILED", 256, t[0] - 615))  # the earlier run's note
    rig.fake.queue = []
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=5, state="RUNNING", nodes=["n1"], mig={"3g": 1})
    status, resp = post(rig, "/v1/prolog", {"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}})
    assert status == 200 and resp["action"] == "bind", resp
    t[0] += 3  # a short job: it ended before the next tick, its Epilog not reported yet
    rig.fake.queue = [SlurmJob(job_id=5, name="again", user="zoe", state="COMPLETED", mig={"3g": 1},
                               tres_per_node="gres:mig:3g:1", submit_time=int(t[0]) - 5, priority=20)]
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=5, state="COMPLETED", nodes=["n1"], mig={"3g": 1},
                                                          fields={"ExitCode": "0:0"})
    rig.tick()
    job = rig.store.get_job("5")
    assert job.state == "RUNNING" and rig.store.bound_instances("5"), job  # waits for its Epilog


def test_a_gpu_of_a_model_slurm_mig_does_not_know_is_not_padded(rig):
    """n1 has one H100 in MIG mode and a GPU slurm-mig does not know (a display GPU, an 'NVIDIA GH200'):
    that GPU is left out, and slurm.conf's mig total is 7 (one MIG GPU). 7c010d6 counted every GPU the node
    reports in the padded total, so the controller set 14, above slurm.conf's 7, and slurmd's next
    registration (7 < 14) drains the node. A GPU that fell off the bus (no model, no UUID) still counts."""
    writes = []
    rig.fake.queue = []
    rig.fake.nodes = lambda: [SlurmNode(name="n1", state="idle", gres={"3g": 1, "pad": 6}, gres_used={})]
    rig.fake.update_node_gres = lambda node, counts, **kw: writes.append((node, dict(counts), kw.get("pad_to"))) or ""
    other = {"gpu": 1, "uuid": "GPU-other", "model": None, "mig_enabled": False, "name": "NVIDIA T400"}
    rig.store.replace_observed("n1", [H100[0], other],
                               [{"gpu": 0, "profile": "7g.80gb", "start": 0, "uuid": "MIG-c"}], now=time.time())
    rig.tick()
    assert writes and writes[-1][2] == 7, writes


def test_node_requests_run_at_most_detail_concurrency_scontrol_calls(rig):
    """Each Prolog of a job no tick has seen asks scontrol from its own request thread. A burst must not
    take every Slurm command slot of the process (the tick's squeue, sinfo and Gres updates share them):
    at most DETAIL_CONCURRENCY run at once, the rest wait."""
    from tests.helpers import MostAtOnce

    probe = MostAtOnce()
    rig.fake.job_detail = probe.wrap(lambda job_id: JobDetail(job_id=int(job_id), mig={}))
    threads = [threading.Thread(target=rig._slurm_detail, args=(str(100 + i),)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert probe.most == rig.DETAIL_CONCURRENCY
    from slurm_mig.slurm import runner

    assert rig.DETAIL_CONCURRENCY < runner.MAX_CONCURRENT  # the tick's commands always find a slot


def test_a_second_controller_on_the_same_database_is_refused(tmp_path):
    """Nothing refused a second controller on one state database: both ticked, set GRES and requeued jobs
    from in-memory state that disagreed. The first holds a lock beside the database until it ends."""
    import subprocess
    import sys

    from slurm_mig.controller.cli import claim_database
    from slurm_mig.errors import AlreadyRunning

    db = str(tmp_path / "state.db")
    held = claim_database(db)
    code = ("import sys; from slurm_mig.controller.cli import claim_database\n"
            "from slurm_mig.errors import AlreadyRunning\n"
            "try:\n    claim_database(sys.argv[1])\nexcept AlreadyRunning as e:\n    print(e); sys.exit(e.exit_code)\n")
    other = subprocess.run([sys.executable, "-c", code, db], capture_output=True, text=True, timeout=30)
    assert other.returncode == 75 and "another slurm-mig controller" in other.stdout, (other.stdout, other.stderr)
    held.close()  # the first ended (the kernel drops the lock however it ends)
    again = subprocess.run([sys.executable, "-c", code, db], capture_output=True, text=True, timeout=30)
    assert again.returncode == 0, again.stdout
    assert claim_database(":memory:") is None
    with pytest.raises(AlreadyRunning):
        held2 = claim_database(db)
        claim_database(db)  # flock is per open file: the same process's second claim is refused too
    held2.close()


def test_the_controllers_lock_makes_the_database_folders_as_the_store_does(tmp_path):
    """claim_database runs before the store opens, and made the database's folders with os.makedirs: 0700
    for the database's own whatever [controller].db_group says (its readers, `slurm-mig status`, could not
    enter it: the store leaves a folder that exists as it is) and 0777 less the umask above it (world-writable
    under umask 0, what the store's own folder making was written to prevent). Found comparing the folders of
    a controller's first start with the store's."""
    import grp

    from slurm_mig.controller.cli import claim_database

    group = grp.getgrgid(os.getgid()).gr_name
    old = os.umask(0)
    try:
        held = claim_database(str(tmp_path / "a" / "b" / "state.db"), group)
    finally:
        os.umask(old)
    held.close()
    assert os.stat(tmp_path / "a").st_mode & 0o777 == 0o755
    assert os.stat(tmp_path / "a" / "b").st_mode & 0o777 == 0o750
    assert os.stat(tmp_path / "a" / "b").st_gid == os.getgid()


def controller_once(tmp_path, toml: str):
    """`slurm-mig controller --once --no-api` in a child with no Slurm commands on its PATH (its tick finds
    none and answers from the store): the start, as an admin runs it, without touching any Slurm."""
    import subprocess
    import sys
    from pathlib import Path

    nobin = tmp_path / "nobin"
    nobin.mkdir(exist_ok=True)
    cfg = tmp_path / "controller.toml"
    cfg.write_text(toml + '\n[slurm]\ncommand_timeout_s = 5\n')
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PATH": str(nobin), "PYTHONPATH": root, "SLURM_CONF": str(tmp_path / "no-slurm.conf")}
    return subprocess.run([sys.executable, "-m", "slurm_mig.cli", "--config", str(cfg), "controller", "--once",
                           "--no-api"], env=env, capture_output=True, text=True, timeout=120, cwd=root)


def test_the_controllers_first_start_makes_its_folder_for_db_group(tmp_path):
    """The same through `slurm-mig controller`: its lock came first, so the database's folder was 0700 and
    the db_group's readers could not run `slurm-mig status`."""
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    db = tmp_path / "lib" / "state.db"
    r = controller_once(tmp_path, f'[controller]\ndb_path = "{db}"\ndb_group = "{group}"\n'
                                  f'slurm_conf = "{tmp_path / "no-slurm.conf"}"\n')
    assert r.returncode == 0, r.stderr
    assert os.stat(db.parent).st_mode & 0o777 == 0o750 and os.stat(db.parent).st_gid == os.getgid()


@pytest.mark.parametrize("log_file", ["no-such-folder/controller.log", "."])
def test_a_log_file_the_controller_cannot_open_names_the_key(tmp_path, log_file):
    """[log].file in a missing folder, or naming a folder: the controller's start printed logging's
    FileNotFoundError / IsADirectoryError traceback, naming no setting."""
    r = controller_once(tmp_path, f'[controller]\ndb_path = "{tmp_path / "state.db"}"\n'
                                  f'[log]\nfile = "{tmp_path / log_file}"\n')
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "[log].file: cannot open" in r.stderr.splitlines()[-1] and str(tmp_path) in r.stderr


@pytest.mark.parametrize("key", ["name", "fallback", "shadow"])
def test_an_unknown_policy_names_its_key_and_the_config(tmp_path, key):
    """[policy].name = "nope" (or fallback, shadow): the controller's start said only "unknown policy 'nope'",
    not which key or file, where every other bad setting names both. Found starting it with such configs."""
    cfg = tmp_path / "controller.toml"
    r = controller_once(tmp_path, f'[controller]\ndb_path = "{tmp_path / "state.db"}"\n[policy]\n{key} = "nope"\n')
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1].startswith(f"slurm-mig: error: config {cfg}: [policy].{key}: unknown policy 'nope'")


@pytest.mark.parametrize("under", ["a-file", "a-file/deeper"])
def test_a_database_path_under_a_file_is_a_store_error(tmp_path, under):
    """db_path = "<a regular file>/state.db": the controller's start printed os.makedirs' FileExistsError
    (or the lock file's NotADirectoryError) traceback, naming no setting."""
    from slurm_mig.controller.cli import claim_database

    (tmp_path / "a-file").write_text("")
    with pytest.raises(StoreError, match="state database .*a-file"):
        claim_database(str(tmp_path / under / "state.db"))


# -- a node message delivered again changes nothing ----------------------------------------------
# The node re-sends a message whose answer it did not get (its client's retry, its outbox at the next hook
# or health check), with the same message_id. 2277c58 wrote the message's events once, but did the rest
# again: by then the job may have been requeued and bound anew, and the message is not about that binding.

N1 = Principal(0, 0, "n1", "hmac")
MID = "5e" * 16


def test_a_bound_message_delivered_again_after_a_requeue_does_not_bind_the_job_again(rig):
    """Job 1's Prolog bound it alone (the controller was down) and queued /v1/bound; the controller
    adopted it, but the answer was lost. The job was requeued (a tick saw it pending: binding released).
    The outbox's copy then bound the pending job again and made it RUNNING: its instance held for a job
    that does not run, and the tick taking it for requeued once more."""
    rig.tick()
    message = {"job_id": "1", "node": "n1", "local": True, "bound_at": time.time() - 30, "message_id": MID,
               "instances": [{"gpu": 0, "profile": "3g.40gb", "start": 0, "uuid": "MIG-a"}]}
    assert rig.on_bound(message, N1) == {"ok": True}
    assert rig.store.get_job("1").state == "RUNNING" and rig.store.bound_instances("1")
    rig.tick()  # Slurm lists job 1 pending again: requeued
    assert rig.store.get_job("1").state == "PENDING" and rig.store.bound_instances("1") == ()
    answer = rig.on_bound(message, N1)
    assert rig.store.get_job("1").state == "PENDING" and rig.store.bound_instances("1") == ()
    assert len([e for e in rig.store.recent_events(50, job_id="1") if e.kind == "start"]) == 1
    assert answer == {"ok": True, "duplicate": True}  # what the first delivery got, and that it was one


def test_a_requeue_epilog_delivered_again_does_not_free_the_next_attempts_instance(rig):
    """Job 1's first attempt was requeued; its Epilog (requeued: true) released its instance, but the
    answer was lost. The next attempt was bound to the same instance on the same node, and the outbox's
    copy of the Epilog then released that binding: the instance looked free while the job ran on it."""
    rig.tick()
    first = rig.on_prolog({"job_id": "1", "node": "n1", "bindings": {}}, N1)
    assert first["action"] == "bind", first
    epilog = {"job_id": "1", "node": "n1", "exit_code": 0, "requeued": True, "end_time": time.time(),
              "instances": first["instances"], "message_id": MID}
    assert rig.on_epilog(epilog, N1) == {"ok": True, "recorded": False}
    assert rig.store.bound_instances("1") == ()
    again = rig.on_prolog({"job_id": "1", "node": "n1", "bindings": {}}, N1)
    assert again["instances"] == first["instances"]  # the same instance: what made the copy dangerous
    held = rig.store.live_bindings()
    answer = rig.on_epilog(epilog, N1)
    assert rig.store.live_bindings() == held and rig.store.get_job("1").state == "RUNNING"
    assert answer == {"ok": True, "recorded": False, "duplicate": True}


def test_an_applied_message_delivered_again_does_not_close_a_later_reconfiguration(rig):
    """/v1/applied closed GPU 0's journal entry as done; its answer was lost. The next re-carve of GPU 0
    began, and the outbox's copy closed that one as done too, before the node had done anything: the tick
    then planned from a layout the GPU did not have."""
    first = rig.store.journal_begin("n1", 0, "3g@0,3g@4", "7g@0", [], started=True)
    applied = {"node": "n1", "message_id": MID, "results": [
        {"gpu": 0, "ok": True, "reached": True, "before": "3g@0,3g@4", "after": "7g@0", "done": "made 7g@0"}]}
    assert rig.on_applied(applied, N1) == {"ok": True}
    assert rig.store.journal_entry(first).state == "done"
    later = rig.store.journal_begin("n1", 0, "7g@0", "3g@0,3g@4", [], started=True)
    answer = rig.on_applied(applied, N1)
    assert rig.store.journal_entry(later).state == "in_progress"
    assert rig.metrics.counters[("slurm_mig_reconfigurations_total", (("result", "ok"),))] == 1
    assert answer == {"ok": True, "duplicate": True}


def test_a_message_without_an_id_is_handled_at_each_delivery_as_before(rig):
    rig.tick()
    first = rig.on_prolog({"job_id": "1", "node": "n1", "bindings": {}}, N1)
    failed = {"job_id": "1", "node": "n1", "results": [{"gpu": 0, "ok": False, "error": "gave up"}]}
    assert rig.on_bind_failed(failed, N1) == {"ok": True}
    rig.on_prolog({"job_id": "1", "node": "n1", "bindings": {}}, N1)
    assert rig.store.bound_instances("1") and first["action"] == "bind"
    assert rig.on_bind_failed(failed, N1) == {"ok": True}  # an older node's: no id, so no telling
    assert rig.store.bound_instances("1") == () and rig.store.get_job("1").state == "REQUEUED"


def test_what_a_rolled_back_tick_said_once_is_said_by_the_next(rig, caplog):
    """A tick says some things once per episode, noting in memory that it has: n1 drained by Slurm for its
    gres count (INVALID_REG), a job whose MIG request cannot be served. The note was made inside the tick's
    transaction, the event with it: rolled back, the event was gone and the note stayed, so no later tick
    stored it and `top`, `explain` and the events never showed it."""
    rig.fake.nodes = lambda: [SlurmNode(name="n1", state="idle", flags=frozenset({"DRAIN", "INVALID_REG"}),
                                        reason="gres/mig count reported lower than configured (6 < 7)",
                                        gres={"3g": 2}, gres_used={})]
    rig.fake.queue = [SlurmJob(job_id=9, name="two", user="zoe", state="PENDING", mig={"1g": 1, "3g": 1},
                               tres_per_node="gres:mig:1g:1,gres:mig:3g:1", submit_time=1, priority=5)]
    _roll_back_a_tick(rig)
    assert not [e for e in rig.store.recent_events(50) if e.kind in ("gres", "conflict")]  # rolled back
    rig.tick()
    events = rig.store.recent_events(50)
    assert [e.node for e in events if e.kind == "gres" and "Slurm drained n1" in e.message] == ["n1"]
    assert [e.job_id for e in events if e.kind == "conflict" and "not managed" in e.message] == ["9"]
    rig.tick()  # and still once each
    events = rig.store.recent_events(50)
    assert len([e for e in events if e.kind == "gres" and "Slurm drained n1" in e.message]) == 1
    assert len([e for e in events if e.kind == "conflict" and "not managed" in e.message]) == 1


def test_what_a_rolled_back_decision_after_withdrawing_said_once_is_said_by_the_next_tick(rig):
    """The tick's second look at Slurm (after withdrawing counts, _withdraw_first) syncs the jobs again in a
    transaction of its own: a job submitted meanwhile whose MIG request cannot be served was noted as said
    there, its 'not managed' event with it. That transaction rolled back (a full disk), the note stayed and
    the event went: no later tick stored it (the same fault as a rolled-back first transaction's)."""
    _race_rig(rig, slip=True)
    update = rig.fake.update_node_gres

    def update_and_submit(node, counts, **kw):
        if not any(j.job_id == 9 for j in rig.fake.queue):
            rig.fake.queue.append(SlurmJob(job_id=9, name="two", user="zoe", state="PENDING",
                                           mig={"1g": 1, "3g": 1}, tres_per_node="gres:mig:1g:1,gres:mig:3g:1",
                                           submit_time=1, priority=5))
        return update(node, counts, **kw)

    rig.fake.update_node_gres = update_and_submit
    plan, calls = rig._plan, []

    def fail_the_second(now):
        calls.append(now)
        if len(calls) == 2:  # the decision taken again after withdrawing
            raise StoreError("disk or database full (test)")
        return plan(now)

    rig._plan = fail_the_second
    with pytest.raises(StoreError):
        rig.tick()
    rig._plan = plan
    assert not [e for e in rig.store.recent_events(50) if e.kind == "conflict"]  # rolled back
    rig.tick()
    assert [e.job_id for e in rig.store.recent_events(50) if e.kind == "conflict" and "not managed" in e.message
            ] == ["9"]


def test_a_prolog_for_a_known_job_is_answered_within_the_nodes_request_timeout_when_slurm_is_slow(rig):
    """Since 588cf26 the Prolog asks `squeue -j` for a job the store knows too, and waited for its answer as long
    as squeue took: with slurmctld down, squeue gives up after some 18 s (measured with Slurm 22.05's squeue and
    no slurmctld listening), with slurmctld swamped by a burst of job starts up to [slurm].command_timeout_s
    (30 s). The node waits [node].request_timeout_s (5 s), retries once, and then takes its controller-down
    path, while the controller, on its own, later bound the job from the store: a binding (and a re-carve) the
    node never used. The stored request was quick before. Now Slurm's answer is awaited only for part of the
    node's timeout; past it, the stored request is bound, as when no query slot is free (found in review)."""
    rig.tick()  # job 1 (mig:3g:1) is in the store
    rig.cfg = replace(rig.cfg, node=replace(rig.cfg.node, request_timeout_s=1.0))
    rig.fake.delay = 3.0  # squeue -j takes this long (slurmctld not answering)
    t0 = time.monotonic()
    status, resp = post(rig, "/v1/prolog", {"job_id": "1", "node": "n1", "observed": OBSERVED, "bindings": {}})
    took = time.monotonic() - t0
    assert status == 200 and resp["action"] == "bind", resp
    assert [i["profile"] for i in resp["instances"]] == ["3g.40gb"]
    assert took < 1.0, f"answered after {took:.1f} s, past the node's 1 s request timeout"
    assert rig.store.get_job("1").state == "RUNNING"


def test_a_job_back_in_an_emptied_queue_is_recorded_again(rig):
    """A tick with nothing to place (every pending job held) recorded no decision and kept the last one's
    signature: a job released with the reason it had before the hold was not recorded, so explain attributed its
    new wait to the decision from before the hold. Then (a8f5238) the next decision was recorded, but explain
    still ran one span across the hold. The quiet tick's decision is now recorded, once: it ends the span."""
    from dataclasses import replace

    from slurm_mig.ops.explain import explain_view

    count = lambda: rig.store._q("SELECT COUNT(*) AS n FROM decisions")[0]["n"]  # noqa: E731
    # (more than the node holds: its reason stays the same, with no re-carve or reservation to change it)
    job = SlurmJob(job_id=3, name="c", user="carol", state="PENDING", mig={"7g": 9}, tres_per_node="gres:mig:7g:9",
                   submit_time=3, priority=1)
    t = [time.time()]
    rig.clock = lambda: t[0]
    rig.fake.queue[:] = [job]
    for _ in range(2):
        rig.tick()
        t[0] += 5
    first = count()
    rig.fake.queue[:] = [replace(job, state_reason="JobHeldUser", priority=0)]  # scontrol hold: nothing to place
    for _ in range(3):
        summary = rig.tick()
        assert summary["pending"] == 0 and summary["changes"] == 0
        t[0] += 1000
    assert count() == first + 1  # the quiet decision, once
    rig.fake.queue[:] = [job]  # scontrol release: back, waiting as before
    rig.tick()
    t[0] += 5
    rig.tick()
    assert count() == first + 2
    spans = [s for s in explain_view(rig.store, "3", now=t[0])["decisions"]["spans"] if s["what"] == "waiting"]
    assert len(spans) == 2 and spans[0]["reason"] == spans[1]["reason"], spans
    assert spans[0]["ended_by"] == "decision" and spans[0]["duration_s"] < 100  # not the 3000 s held too
    assert spans[1]["ended_by"] == "now"


@pytest.mark.parametrize("backend", ["simulated", "nvml"])
def test_a_lost_gpu_keeps_no_desired_layout_and_the_tools_say_it_is_lost(rig, backend, capsys):
    """GPU 0 was planned a re-carve, then fell off the bus (NVML GPU_IS_LOST). The policy already left it alone
    (unavailable) and Slurm's counts dropped it, but the desired layout decided before the loss stayed: every
    /v1/report answer kept sending it, `nodes` showed it, and once the GPU came back (its instances gone with
    the reset) the node carried out a re-carve planned for the queue of long ago. `status` and `nodes` said
    "MIG off", sending the admin after the MIG mode instead of a GPU reset. Now a lost GPU is blocked with a
    reason that says so, its desired layout dropped and its open reconfiguration abandoned; the tools say
    "lost"."""
    from slurm_mig.ops import views as V

    writes = []
    rig.fake.nodes = lambda: [SlurmNode(name="n1", state="idle", gres={"3g": 2, "pad": 12}, gres_used={})]
    rig.fake.update_node_gres = lambda node, counts, **kw: writes.append(dict(counts)) or ""

    def gpu(i, lost=False, in_use=False):
        if lost and backend == "nvml":  # nvml.real: a lost GPU answers nothing, not even its name or model
            return {"index": i, "uuid": "", "name": "", "model": None, "mig_enabled": False, "lost": True,
                    "instances": []}
        return {"index": i, "uuid": f"GPU-{i}", "name": "H100", "model": "H100-80GB", "mig_enabled": not lost,
                "lost": lost, "instances": [] if lost else [
                    {"profile": "1g.10gb", "start": s, "uuid": f"MIG-{i}{s}", "in_use": in_use} for s in range(7)]}

    observed = [gpu(0), gpu(1, in_use=True)]
    assert post(rig, "/v1/report", {"node": "n1", "observed": observed, "bindings": {}})[0] == 200
    rig.tick()
    assert 0 in rig.store.desired("n1")  # a 3g carved on GPU 0 for job 1
    observed[0] = gpu(0, lost=True)
    status, answer = post(rig, "/v1/report", {"node": "n1", "observed": observed, "bindings": {}})
    assert status == 200 and "0" not in answer["desired"], answer
    rig.tick()
    assert 0 not in rig.store.desired("n1"), rig.store.desired("n1")
    assert not [e for e in rig.store.open_journal_entries("n1") if e.gpu == 0]
    # The policy's view: GPU 0 may be neither re-carved nor placed on; Slurm is told of GPU 1's 1g's alone (those
    # outside the region the policy now holds there for job 1, as no 1g is idle: intended_layouts).
    assert not any(g.available for g in rig.store.cluster_state(time.time()).gpus if g.index == 0)
    assert rig.intended_layouts("n1", held={}).keys() == {1} and len(rig.intended_layouts("n1", held={})[1].slots) == 7
    assert writes[-1]["1g"] == len(rig.intended_layouts("n1")[1].slots) and not writes[-1]["3g"], writes[-1]
    assert post(rig, "/v1/report", {"node": "n1", "observed": observed, "bindings": {}})[1]["desired"] == {}
    snap = V.load_snapshot(rig.store)
    (g0,) = [g for n in V.node_views(snap) for g in n["gpus"] if g["gpu"] == 0]
    assert g0["status"] == "lost" and "GPU_IS_LOST" in g0["blocked"], g0
    assert V.status_view(snap)["gpus"]["lost"] == 1
    # The commands an operator runs say it too.
    from slurm_mig.cli import main

    capsys.readouterr()
    assert main(["status", "--db", str(rig.store_path)]) == 0
    assert "1 LOST (fell off the bus" in capsys.readouterr().out
    assert main(["nodes", "--db", str(rig.store_path), "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert "lost: fell off the bus" in out and "GPU_IS_LOST" in out and "MIG off" not in out, out


@pytest.mark.parametrize("stored, listed, other", [
    ("alice", "bob", True), ("1001", "1002", True), ("alice", "alice", False),
    ("alice", "1002", False),  # squeue --json gives the uid where it cannot look the name up: says nothing
    ("", "bob", False), ("alice", "nobody", False), ("alice", "(null)", False)])
def test_users_are_compared_only_where_both_records_name_one_the_same_way(stored, listed, other):
    from slurm_mig.controller.runs import users_differ

    assert users_differ(stored, listed) is other


@pytest.mark.parametrize("restarts, expect", [("1", "REQUEUED"), ("0", "COMPLETED")])
def test_a_run_slurm_requeued_as_it_killed_it_is_not_completed_when_its_next_prolog_comes_first(rig, restarts,
                                                                                               expect):
    """Job 5 ran on n1, which an admin set DOWN: Slurm ended it and requeued it, and its Epilog (restart count
    0 there, exit 0: Slurm 22.05.8) reported an end, recorded COMPLETED. Its next Prolog comes before any tick
    saw it waiting: with squeue -j's restart count 1 and a submit time at that end, run 1 was ended by the
    requeue, not completed. With no restart it is another job with the id: run 1 keeps its COMPLETED."""
    t = [float(int(time.time()))]
    rig.clock = lambda: t[0]
    rig.store.upsert_job("5", profile="3g", user="bob", submit_time=t[0] - 7300, now=t[0] - 7300)
    rig.store.set_job_state("5", "RUNNING", now=t[0] - 7200, node="n1")
    rig.store.bind("5", "n1", [{"gpu": 0, "profile": "3g.40gb", "start": 0}], now=t[0] - 7200)
    rig.on_epilog(_epilog_5([{"gpu": 0, "profile": "3g.40gb", "start": 0}], t[0] - 30), N1)
    assert rig.store.outcome("5").state == "COMPLETED"
    local = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(int(t[0]) - 30))  # the requeue's, as Slurm prints it
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=5, user="bob", state="RUNNING", nodes=["n1"],
                                                   mig={"3g": 1}, fields={"SubmitTime": local, "Restarts": restarts})
    answer = rig.on_prolog({"job_id": "5", "node": "n1", "observed": OBSERVED, "bindings": {}}, N1)
    assert answer["action"] == "bind", answer
    assert rig.store.get_job("5").run == 2
    assert [(o.run, o.state) for o in rig.store.outcomes()] == [(1, expect)]


def test_a_job_first_seen_suspended_and_resumed_is_requeued_only_if_its_node_holds_no_binding(rig):
    """Checked, not a fault: job 5 started while the controller was down, n1 bound it alone (its /v1/bound
    still in the outbox) and Slurm suspended it, all before the controller came back. Its time suspended
    counts toward the grace (the start is Slurm's StartTime), but the grace is not what decides: a job is
    requeued only once its node has reported, since the start, binding files that do not name it, and a
    suspended job's file stays (the node keeps the files of jobs squeue lists as S). Resumed, job 5 is
    left alone whether or not a report came while it was suspended; job 6, alike but with no file, is
    requeued once n1 has reported."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    job = dict(name="e", user="eve", nodes=["n1"], mig={"3g": 1}, tres_per_node="gres:mig:3g:1",
               submit_time=int(t[0]) - 900, start_time=int(t[0]) - 600, priority=1)
    rig.fake.queue = [SlurmJob(job_id=5, state="SUSPENDED", **job), SlurmJob(job_id=6, state="SUSPENDED", **job)]
    assert rig.tick()["requeued_unbound"] == 0
    bound = {"5": [{"gpu": 0, "profile": "3g.40gb", "start": 0, "uuid": "MIG-a"}]}
    t[0] += 5
    rig.fake.queue = [SlurmJob(job_id=5, state="RUNNING", **job), SlurmJob(job_id=6, state="RUNNING", **job)]
    assert rig.tick()["requeued_unbound"] == 0  # resumed; n1 has not reported since the controller started
    assert ("requeue", "5") not in rig.fake.calls and ("requeue", "6") not in rig.fake.calls
    assert post(rig, "/v1/report", {"node": "n1", "observed": OBSERVED, "bindings": bound,
                                    "binding_times": {"5": t[0] - 599}})[0] == 200
    t[0] += 5
    assert rig.tick()["requeued_unbound"] == 1
    assert ("requeue", "6") in rig.fake.calls and ("requeue", "5") not in rig.fake.calls
    assert rig.store.bound_instances("5")


def test_a_report_while_a_job_was_suspended_keeps_it_from_being_requeued_once_resumed(rig):
    """As above, n1's report arriving while job 5 was still suspended (the controller up by then): it
    adopts the binding, and the resumed job is not requeued, however long it was suspended."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    job = dict(name="e", user="eve", nodes=["n1"], mig={"3g": 1}, tres_per_node="gres:mig:3g:1",
               submit_time=int(t[0]) - 900, start_time=int(t[0]) - 600, priority=1)
    rig.fake.queue = [SlurmJob(job_id=5, state="SUSPENDED", **job)]
    rig.tick()
    bound = {"5": [{"gpu": 0, "profile": "3g.40gb", "start": 0, "uuid": "MIG-a"}]}
    assert post(rig, "/v1/report", {"node": "n1", "observed": OBSERVED, "bindings": bound,
                                    "binding_times": {"5": t[0] - 599}})[0] == 200
    t[0] += 3600
    rig.fake.queue = [SlurmJob(job_id=5, state="RUNNING", **job)]
    assert rig.tick()["requeued_unbound"] == 0 and ("requeue", "5") not in rig.fake.calls
    assert rig.store.bound_instances("5")


def _controller_once_starter(tmp_path, cfg, umask: int = -1):
    """A function that runs `slurm-mig --config CFG controller --once --no-api` in a fresh interpreter, with no
    Slurm command on its PATH (and ``umask`` when given); returns its CompletedProcess."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    nobin = tmp_path / "nobin"
    nobin.mkdir()
    env = {**os.environ, "PATH": str(nobin), "PYTHONPATH": root, "SLURM_CONF": str(tmp_path / "no-slurm.conf")}

    def start():
        return subprocess.run([sys.executable, "-m", "slurm_mig.cli", "--config", str(cfg), "controller", "--once",
                               "--no-api"], env=env, capture_output=True, text=True, timeout=120, cwd=root,
                              umask=umask)

    return start


def test_the_controller_makes_its_log_0644_whatever_the_umask(tmp_path):
    """[log].file was opened by logging.FileHandler, which made it 0666 less the umask: under umask 0 the log
    root's controller appends to was writable by anyone (any line could be added or rewritten). It is made 0644
    now (folders.log_file_handler); one that exists keeps its mode."""
    import stat

    folder = tmp_path / "etc"
    folder.mkdir(mode=0o755)
    cfg = folder / "controller.toml"
    log, db = tmp_path / "log" / "controller.log", tmp_path / "lib" / "state.db"
    log.parent.mkdir(mode=0o755)
    cfg.write_text(f'[controller]\ndb_path = "{db}"\nslurm_conf = "{tmp_path / "no-slurm.conf"}"\n'
                   f'[log]\nfile = "{log}"\n[slurm]\ncommand_timeout_s = 5\n')
    cfg.chmod(0o644)
    r = _controller_once_starter(tmp_path, cfg, umask=0)()
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(log.stat().st_mode) == 0o644 and log.stat().st_size > 0


@pytest.mark.parametrize("case", ["mode 0666", "group-writable", "owned by uid 65534", "in a 0777 folder",
                                  "in a folder uid 65534 owns"])
def test_the_controller_refuses_to_start_on_a_config_others_may_change(tmp_path, case):
    """The hooks refused a config others could change (context._check_trusted), the controller never looked: a
    config anyone may write (or owned by another user, or in a folder anyone may write) set [log].file (root
    appended to any file), db_path, the key paths and the rl model root's controller runs. Found by chmod 0666 on
    the config of `slurm-mig controller --once`: it started, made its database and appended to the log file named
    there. Refused now before anything is read from it: one line naming the file and the fix, exit 2, no log
    file, no database. The same rule as the hooks' and the policy store's (folders.writable_by_others)."""
    import subprocess
    import sys
    from pathlib import Path

    if os.geteuid() != 0 and "65534" in case:
        pytest.skip("chown to another user needs root")
    folder = tmp_path / "etc"
    folder.mkdir()
    cfg = folder / "controller.toml"
    log, db = tmp_path / "controller.log", tmp_path / "lib" / "state.db"
    cfg.write_text(f'[controller]\ndb_path = "{db}"\nslurm_conf = "{tmp_path / "no-slurm.conf"}"\n'
                   f'[log]\nfile = "{log}"\n[slurm]\ncommand_timeout_s = 5\n')
    cfg.chmod(0o644)
    target = {"mode 0666": cfg, "group-writable": cfg, "owned by uid 65534": cfg}.get(case, folder)
    if case == "mode 0666":
        cfg.chmod(0o666)
    elif case == "group-writable":
        cfg.chmod(0o664)
    elif case == "in a 0777 folder":
        folder.chmod(0o777)
    else:
        os.chown(target, 65534, 65534)
    start = _controller_once_starter(tmp_path, cfg)
    r = start()
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    fix = "chown" if "65534" in case else "chmod"
    assert r.stderr.startswith(f"slurm-mig: error: config {cfg}") and f"`{fix} " in r.stderr and str(target) in r.stderr
    assert not log.exists() and not db.parent.exists()
    os.chown(target, 0, 0) if os.geteuid() == 0 else None
    cfg.chmod(0o644)
    folder.chmod(0o755)
    r = start()
    assert r.returncode == 0, r.stderr
    assert log.exists() and db.exists()


def test_the_config_check_judges_the_file_a_path_with_dotdot_after_a_link_opens(tmp_path):
    """writable_by_others made the path absolute with os.path.abspath, which drops 'link/..' by the letters, and
    resolved that: `--config /etc-like/L/../controller.toml`, L a link into a folder uid 65534 owns, was judged as
    /etc-like/controller.toml (missing: judged by its root-owned folders, trusted), while open() follows L and
    reads the file in uid 65534's folder, who may put any config there. Found so: the controller started on it.
    The resolved path is now taken from the path as given, as the kernel resolves it."""
    import subprocess
    import sys
    from pathlib import Path

    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    theirs, ours = tmp_path / "theirs", tmp_path / "etc"
    (theirs / "sub").mkdir(parents=True)
    ours.mkdir()
    (ours / "L").symlink_to(theirs / "sub")
    cfg = theirs / "controller.toml"
    log, db = tmp_path / "controller.log", tmp_path / "lib" / "state.db"
    cfg.write_text(f'[controller]\ndb_path = "{db}"\nslurm_conf = "{tmp_path / "no-slurm.conf"}"\n'
                   f'[log]\nfile = "{log}"\n[slurm]\ncommand_timeout_s = 5\n')
    cfg.chmod(0o644)
    os.chown(theirs, 65534, 65534)
    given = f"{ours}/L/../controller.toml"
    assert Path(given).read_text() == cfg.read_text()  # what open() reads: their folder's file
    nobin = tmp_path / "nobin"
    nobin.mkdir()
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PATH": str(nobin), "PYTHONPATH": root, "SLURM_CONF": str(tmp_path / "no-slurm.conf")}
    r = subprocess.run([sys.executable, "-m", "slurm_mig.cli", "--config", given, "controller", "--once", "--no-api"],
                       env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 2 and f"`chown root {theirs}`" in r.stderr, r.stderr
    assert not log.exists() and not db.parent.exists()


@pytest.mark.parametrize("case", ["log in a 0777 folder", "log in a sticky 1777 folder", "db in a 0770 folder",
                                  "db below a 0777 folder", "log in a folder uid 65534 owns",
                                  "db in a folder uid 65534 owns"])
def test_the_controller_refuses_to_write_in_a_folder_others_may_change(tmp_path, case):
    """The config is judged (check_trusted above), the folders it names were not: a trusted config with [log].file
    or db_path in a folder others may write (or own) had root append its log, make its database, its -wal and its
    lock there, where a user could put a symbolic link in their place (root's log appended to any file) or rename
    the folder away. Found by a [log].file in a 0777 folder: `controller --once` started and wrote it. Refused now
    at the start, by the one rule (folders.writable_by_others) on the folder holding each: one line naming the
    key, the path and the fix, exit 2, nothing written; started once the folder is fixed."""
    import subprocess
    import sys
    from pathlib import Path

    if os.geteuid() != 0 and "65534" in case:
        pytest.skip("chown to another user needs root")
    etc, logs, lib = tmp_path / "etc", tmp_path / "logs", tmp_path / "lib"
    for d in (etc, logs, lib):
        d.mkdir(mode=0o755)
    key = "[log].file" if case.startswith("log") else "[controller].db_path"
    folder = logs if key == "[log].file" else lib
    log, db = logs / "controller.log", (lib / "sub" / "state.db" if "below" in case else lib / "state.db")
    cfg = etc / "controller.toml"
    cfg.write_text(f'[controller]\ndb_path = "{db}"\nslurm_conf = "{tmp_path / "no-slurm.conf"}"\n'
                   f'[log]\nfile = "{log}"\n[slurm]\ncommand_timeout_s = 5\n')
    cfg.chmod(0o644)
    mode = {"log in a 0777 folder": 0o777, "log in a sticky 1777 folder": 0o1777, "db in a 0770 folder": 0o770,
            "db below a 0777 folder": 0o777}.get(case)
    if mode is not None:
        folder.chmod(mode)
    else:
        os.chown(folder, 65534, 65534)
    start = _controller_once_starter(tmp_path, cfg)
    r = start()
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    fix = "chown" if "65534" in case else "chmod"
    path = log if key == "[log].file" else db
    assert r.stderr.startswith(f"slurm-mig: error: config {cfg}: {key} = {path}: ") and f"`{fix} " in r.stderr \
        and str(folder) in r.stderr, r.stderr
    assert not log.exists() and not db.exists() and not os.path.exists(f"{db}.controller.lock")
    os.chown(folder, 0, 0) if os.geteuid() == 0 else None
    folder.chmod(0o755)
    r = start()
    assert r.returncode == 0, r.stderr
    assert log.exists() and db.exists()
