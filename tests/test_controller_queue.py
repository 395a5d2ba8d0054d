"""What the policy carves for: pending jobs Slurm may start, and each task of a job array.

The squeue samples are Slurm 22.05's own output on the demo cluster (the fields the controller reads,
copied as printed): a running 7g job, a held job, a job waiting on that one, one with a begin time an
hour away and an array ``--array=1-6%2``; then the same queue after the 7g job was cancelled.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from slurm_mig.config import Config
from slurm_mig.controller.queue import ARRAY_TASKS_AHEAD, queue_entries
from slurm_mig.controller.service import Controller
from slurm_mig.slurm.parsers import (
    JobDetail, SlurmJob, SlurmNode, array_task_ids, parse_reservations, parse_scontrol_jobs, parse_sinfo_json,
    parse_squeue_json,
)
from slurm_mig.store import open_store

from tests.test_slurm_parsers import (
    SCONTROL_JOBS_D, SCONTROL_RES, SINFO_JSON_CPUS, SINFO_JSON_WHERE, SQUEUE_JSON_22_05, SQUEUE_JSON_CPUS,
    SQUEUE_JSON_WHERE,
)

_KEYS = ("job_id", "array_job_id", "array_task_id", "array_task_string", "array_max_tasks", "job_state",
         "state_reason", "priority", "tres_per_node", "dependency", "partition", "submit_time", "time_limit",
         "name", "user_name", "nodes", "node_count")
BEFORE = [
    [1, 0, None, "", 0, "RUNNING", "None", 4294901759, "gres:mig:7g:1", "", "debug", 1795346074, 525600, "wrap", "root", "n1", 1],
    [2, 0, None, "", 0, "PENDING", "JobHeldUser", 0, "gres:mig:1g:1", "", "debug", 1795346078, None, "wrap", "root", "", 1],
    [3, 0, None, "", 0, "PENDING", "Dependency", 4294901758, "gres:mig:2g:1", "afterok:1(unfulfilled)", "debug", 1795346078, None, "wrap", "root", "", 1],
    [4, 0, None, "", 0, "PENDING", "BeginTime", 4294901757, "gres:mig:3g:1", "", "debug", 1795346078, None, "wrap", "root", "", 1],
    [5, 5, None, "1-6%2", 2, "PENDING", "ReqNodeNotAvail", 4294901756, "gres:mig:1g:1", "", "debug", 1795346078, None, "wrap", "root", "", 1],
]
AFTER = [
    [1, 0, None, "", 0, "CANCELLED", "None", 4294901759, "gres:mig:7g:1", "", "debug", 1795346074, 525600, "wrap", "root", "n1", 1],
    BEFORE[1],
    [3, 0, None, "", 0, "PENDING", "DependencyNeverSatisfied", 4294901758, "gres:mig:2g:1", "afterok:1(failed)", "debug", 1795346078, None, "wrap", "root", "", 1],
    BEFORE[3],
    [6, 5, 1, "", 2, "RUNNING", "None", 4294901756, "gres:mig:1g:1", "", "debug", 1795346078, 525600, "wrap", "root", "n1", 1],
    [7, 5, 2, "", 2, "RUNNING", "None", 4294901756, "gres:mig:1g:1", "", "debug", 1795346078, 525600, "wrap", "root", "n1", 1],
    [5, 5, None, "3-6%2", 2, "PENDING", "JobArrayTaskLimit", 4294901756, "gres:mig:1g:1", "", "debug", 1795346078, None, "wrap", "root", "", 1],
]


def squeue(rows) -> list[SlurmJob]:
    return parse_squeue_json(json.loads(json.dumps({"errors": [], "jobs": [dict(zip(_KEYS, r)) for r in rows]})))


@pytest.mark.parametrize("spec, ids", [
    ("1-12", [1, 2, 3, 4, 5]), ("3-6%2", [3, 4, 5, 6]), ("1,4,7-9", [1, 4, 7, 8, 9]), ("0-99:3", [0, 3, 6, 9, 12]),
    ("5", [5]),
    # squeue cuts a long expression at SLURM_BITSTR_LEN characters: the piece the cut split is dropped.
    ("1,3,5,7,1...", [1, 3, 5, 7]), ("1,3,...", [1, 3]), ("1-3...", []),
    ("", None), ("x", None), ("1-3,a", None), ("9-3", None), ("1-9:0", None),
])
def test_array_task_expressions(spec, ids):
    assert array_task_ids(spec, 5) == ids


def test_held_dependent_and_later_jobs_are_blocked_and_an_array_shows_its_tasks_up_to_its_limit():
    entries = {e.job_id: e.blocked for e in queue_entries(squeue(BEFORE))}
    assert entries["1"] is None  # running
    assert "held by its user" in entries["2"]
    assert "dependency" in entries["3"]
    assert "start time" in entries["4"] and "BeginTime" in entries["4"]
    # --array=1-6%2, nothing running yet: its first two tasks may start, and the array record is not a job.
    assert entries["5_1"] is None and entries["5_2"] is None
    assert not any(k in entries for k in ("5", "5_3"))


def test_an_array_at_its_limit_shows_one_blocked_task_and_its_running_tasks_are_jobs_of_their_own():
    entries = {e.job_id: e.blocked for e in queue_entries(squeue(AFTER))}
    assert entries["6"] is None and entries["7"] is None
    assert "limit" in entries["5_3"] and "5_4" not in entries
    assert "can never be satisfied" in entries["3"]
    # One task ends: Slurm's reason still says JobArrayTaskLimit, but a task may start.
    rows = [r for r in AFTER if r[0] != 7]
    entries = {e.job_id: e.blocked for e in queue_entries(squeue(rows))}
    assert entries["5_3"] is None and "5_4" not in entries


def test_an_unthrottled_array_shows_at_most_the_look_ahead():
    big = [[9, 9, None, "1-5000", 0, "PENDING", "Resources", 100, "gres:mig:1g:1", "", "gpu", 1, 60, "a", "u", "", 1]]
    entries = queue_entries(squeue(big))
    assert [e.job_id for e in entries[:3]] == ["9_1", "9_2", "9_3"]
    assert len(entries) == ARRAY_TASKS_AHEAD and all(e.blocked is None for e in entries)


def test_an_unreadable_array_expression_leaves_the_record_one_job():
    odd = [[9, 9, None, "1-3;", 0, "PENDING", "Resources", 100, "gres:mig:1g:1", "", "gpu", 1, 60, "a", "u", "", 1]]
    assert [(e.job_id, e.blocked) for e in queue_entries(squeue(odd))] == [("9", None)]


def test_a_job_slurm_holds_as_bad_constraints_says_its_tasks_must_fit_one_node():
    # sbatch -n 12 --gres=mig:1g on 8-CPU nodes, max_nodes=1 from job_submit.lua: Slurm 22.05 accepts it and
    # holds it (priority 0, Reason=BadConstraints), measured on the local cluster on 2026-11-27.
    rows = [[12, 0, None, "", 0, "PENDING", "BadConstraints", 0, "gres:mig:1g:1", "", "debug", 1, None, "wrap", "u",
             "", 2]]
    (entry,) = queue_entries(squeue(rows))
    assert "no node can satisfy" in entry.blocked and "fit one" in entry.blocked
    assert entry.blocked.endswith("(Slurm: BadConstraints)")


def test_a_qos_limit_and_a_priority_0_hold_block_but_waiting_for_resources_does_not():
    rows = [[10, 0, None, "", 0, "PENDING", "QOSMaxGRESPerUser", 5, "gres:mig:1g:1", "", "gpu", 1, 60, "a", "u", "", 1],
            [11, 0, None, "", 0, "PENDING", "None", 0, "gres:mig:1g:1", "", "gpu", 1, 60, "a", "u", "", 1],
            [12, 0, None, "", 0, "PENDING", "Resources", 5, "gres:mig:1g:1", "", "gpu", 1, 60, "a", "u", "", 1],
            [13, 0, None, "", 0, "PENDING", "ReqNodeNotAvail", 5, "gres:mig:1g:1", "", "gpu", 1, 60, "a", "u", "", 1],
            [14, 0, None, "", 0, "PENDING", "Priority", 5, "gres:mig:1g:1", "", "gpu", 1, 60, "a", "u", "", 1]]
    rows += [[15 + i, 0, None, "", 0, "PENDING", r, 5, "gres:mig:1g:1", "", "gpu", 1, 60, "a", "u", "", 1]
             for i, r in enumerate(["MaxGRESPerAccount", "AssocGrpGRES", "PartitionTimeLimit", "PartitionDown",
                                    "Licenses", "InvalidAccount"])]
    blocked = {e.job_id: e.blocked for e in queue_entries(squeue(rows))}
    assert "QOS" in blocked["10"] and "held" in blocked["11"]
    assert all(blocked[str(15 + i)] for i in range(6)), blocked
    assert blocked["12"] is None and blocked["13"] is None and blocked["14"] is None


# -- the controller ----------------------------------------------------------------------------------------

class QueueSlurm:
    """Slurm as the controller sees it: a queue the test sets, one idle node with one H100."""

    def __init__(self, queue):
        self.queue = queue
        self.details: dict[str, JobDetail] = {}
        self.gres: list = []

    def jobs(self):
        return list(self.queue)

    def reservations(self):
        return []

    def nodes(self):
        return [SlurmNode(name="n1", state="idle", gres={}, gres_used={})]

    def job_detail(self, job_id):
        return self.details.get(str(job_id))

    def update_node_gres(self, node, counts, **kw):
        self.gres.append(dict(counts))
        return ",".join(f"mig:{t}:{n}" for t, n in sorted(counts.items()))

    def scontrol_requeue(self, job_id, **kw):
        raise AssertionError(f"nothing here should be requeued ({job_id})")

    released: list

    def scontrol_release(self, job_id):
        self.__dict__.setdefault("released", []).append(str(job_id))


@pytest.fixture
def ctl(tmp_path):
    store = open_store(tmp_path / "state.db")
    store.replace_observed("n1", [{"gpu": 0, "uuid": "GPU-0", "model": "H100-80GB", "mig_enabled": True}], [],
                           now=time.time())
    c = Controller(Config(), store, QueueSlurm([]))
    yield c
    store.close()


def _desired(ctl) -> str:
    d = ctl.store.desired("n1").get(0)
    return d.spec if d else ""


def test_the_policy_does_not_carve_for_jobs_slurm_will_not_start(ctl):
    # A 7g job waiting on a dependency, and a 3g one held: nothing to carve for.
    ctl.slurm.queue = squeue([
        [3, 0, None, "", 0, "PENDING", "Dependency", 50, "gres:mig:7g:1", "afterok:1", "debug", 1, 60, "a", "u", "", 1],
        [2, 0, None, "", 0, "PENDING", "JobHeldUser", 0, "gres:mig:3g:1", "", "debug", 1, 60, "a", "u", "", 1]])
    ctl.tick()
    assert _desired(ctl) == ""
    assert [j.job_id for j in ctl.store.pending_jobs()] == []
    blocked = {j.job_id: j for j in ctl.store.pending_jobs(include_blocked=True)}
    assert "dependency" in blocked["3"].reason and "held" in blocked["2"].reason  # what `jobs` shows
    # Its dependency met, the 7g job is carved for, and its reason no longer says it is blocked.
    ctl.slurm.queue = squeue([
        [3, 0, None, "", 0, "PENDING", "Resources", 50, "gres:mig:7g:1", "", "debug", 1, 60, "a", "u", "", 1]])
    ctl.tick()
    assert "7g" in _desired(ctl)
    assert "dependency" not in ctl.store.get_job("3").reason
    assert ctl.store.get_job("3").blocked is None


def test_a_queued_job_whose_request_became_unservable_is_no_longer_carved_for(ctl):
    """Job 3 asked for a 7g and was carved for; then its request changed to one slurm-mig cannot serve (an
    `scontrol update` job_submit.lua did not check: it was installed later, or bypassed): squeue shows
    gres:mig:7g:0. The store kept the 7g request and the policy went on carving and reserving a GPU for a job
    Slurm would start on none. It is kept, blocked, with the reason, until Slurm lists a request it can serve."""
    row = [3, 0, None, "", 0, "PENDING", "Resources", 50, "gres:mig:7g:1", "", "debug", 1, 60, "a", "u", "", 1]
    ctl.slurm.queue = squeue([row])
    ctl.tick()
    assert "7g" in _desired(ctl) and [j.job_id for j in ctl.store.pending_jobs()] == ["3"]
    ctl.slurm.queue = squeue([row[:8] + ["gres:mig:7g:0"] + row[9:]])
    ctl.tick()
    assert [j.job_id for j in ctl.store.pending_jobs()] == []
    job = ctl.store.get_job("3")
    assert job.state == "PENDING" and "count must be at least 1" in job.reason, job
    ctl.slurm.queue = squeue([row])  # served again
    ctl.tick()
    assert [j.job_id for j in ctl.store.pending_jobs()] == ["3"] and ctl.store.get_job("3").blocked is None


def test_an_array_is_carved_for_task_by_task_and_a_started_task_replaces_its_row(ctl):
    array = [4, 4, None, "1-7", 0, "PENDING", "Resources", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1]
    ctl.slurm.queue = squeue([array])
    ctl.tick()
    assert [j.job_id for j in ctl.store.pending_jobs()] == [f"4_{t}" for t in range(1, 8)]
    assert _desired(ctl).count("1g") == 7  # the whole GPU as 1g slices, not one
    # Slurm starts task 1 as job 11 and task 2 as job 12; the record keeps 3-7.
    ctl.slurm.queue = squeue([
        [11, 4, 1, "", 0, "RUNNING", "None", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "n1", 1],
        [12, 4, 2, "", 0, "RUNNING", "None", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "n1", 1],
        [4, 4, None, "3-7", 0, "PENDING", "Resources", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1]])
    ctl.tick()
    assert ctl.store.get_job("4_1") is None and ctl.store.get_job("4_2") is None  # not "cancelled"
    assert ctl.store.get_job("11").state == "RUNNING"
    assert [j.job_id for j in ctl.store.pending_jobs()] == [f"4_{t}" for t in range(3, 8)]
    # The whole array cancelled: its waiting tasks were cancelled.
    ctl.slurm.queue = []
    ctl.tick()
    assert ctl.store.get_job("4_3").state == "CANCELLED"


def test_an_array_record_stored_whole_by_an_older_version_gives_way_to_its_tasks(ctl):
    ctl.store.upsert_job("4", profile="1g", submit_time=1.0)
    ctl.slurm.queue = squeue([
        [4, 4, None, "1-2", 0, "PENDING", "Resources", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1]])
    ctl.tick()
    assert ctl.store.get_job("4") is None
    assert [j.job_id for j in ctl.store.pending_jobs()] == ["4_1", "4_2"]


def test_a_prolog_for_an_array_task_takes_the_tasks_place(ctl):
    ctl.slurm.queue = squeue([
        [4, 4, None, "1-2", 0, "PENDING", "Resources", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1]])
    ctl.tick()
    # Task 2 starts first, as job 11.
    ctl.slurm.details["11"] = JobDetail(job_id=11, name="a", user="u", state="RUNNING", partition="debug",
                                        nodes=["n1"], tres_per_node="gres:mig:1g:1", mig={"1g": 1},
                                        fields={"JobId": "11", "ArrayJobId": "4", "ArrayTaskId": "2"})
    reserved = (ctl.store.get_meta("reservations") or {}).get("4_2")
    gpu = {"index": 0, "uuid": "GPU-0", "name": "H100", "model": "H100-80GB", "mig_enabled": True, "instances": []}
    reply = ctl.on_prolog({"node": "n1", "job_id": "11", "observed": [gpu], "bindings": {}}, None)
    assert reply["action"] == "bind"
    assert reserved  # frag-aware placed both tasks
    # The instance the policy meant for task 2 goes to the job task 2 became.
    assert [[i["gpu"], i["profile"], i["start"]] for i in reply["instances"]] == reserved["instances"]
    assert ctl.store.get_job("4_2") is None
    assert ctl.store.get_job("11") is not None
    assert [j.job_id for j in ctl.store.pending_jobs()] == ["4_1"]


def test_held_tasks_of_a_throttled_array_do_not_use_up_its_limit():
    # --array=1-6%2 with tasks 1 and 2 held (`scontrol hold 5_1 5_2` splits them off): Slurm's limit counts
    # the tasks it runs, so tasks 3 and 4 may start. Counted against the limit, they were never carved for.
    rows = [[6, 5, 1, "", 2, "PENDING", "JobHeldUser", 0, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1],
            [7, 5, 2, "", 2, "PENDING", "JobHeldUser", 0, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1],
            [5, 5, None, "3-6%2", 2, "PENDING", "Resources", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1]]
    entries = {e.job_id: e.blocked for e in queue_entries(squeue(rows))}
    assert "held" in entries["6"] and "held" in entries["7"]
    assert entries["5_3"] is None and entries["5_4"] is None and "5_5" not in entries


def test_a_task_the_array_no_longer_shows_is_not_called_cancelled_while_its_record_waits(ctl):
    array = [4, 4, None, "1-5%2", 2, "PENDING", "Resources", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1]
    # Task 6 was requeued: Slurm holds it back (BeginTime) a while, so it takes no place under the limit yet.
    requeued = [9, 4, 6, "", 2, "PENDING", "BeginTime", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1]
    ctl.slurm.queue = squeue([array, requeued])
    ctl.tick()
    assert [j.job_id for j in ctl.store.pending_jobs()] == ["4_1", "4_2"]
    # It may start now and takes a place: one task of the record is left to show. Task 2 still waits in
    # Slurm; it was marked CANCELLED ("no longer in Slurm's queue"), then "live again after it ended".
    requeued[6] = "Resources"
    ctl.slurm.queue = squeue([array, requeued])
    ctl.tick()
    assert ctl.store.get_job("4_2") is None or ctl.store.get_job("4_2").state == "PENDING"
    ctl.slurm.queue = squeue([array])  # task 6 cancelled: task 2 is shown again
    ctl.tick()
    assert ctl.store.get_job("4_2").state == "PENDING"
    assert not [e for e in ctl.store.recent_events(50) if e.kind == "reused"]


class CpuFullN1(QueueSlurm):
    """n1 with every CPU allocated, n2 with CPUs free; one H100 each; a 3g job waits."""

    def nodes(self):
        return [SlurmNode(name="n1", state="allocated", gres={}, gres_used={}, cpus=8, alloc_cpus=8),
                SlurmNode(name="n2", state="mixed", gres={}, gres_used={}, cpus=8, alloc_cpus=3)]


@pytest.fixture
def cpu_full(tmp_path):
    """A controller (with a Config the test may pass) over CpuFullN1, after one tick; its store is closed after."""
    stores = []

    def make(cfg: Config | None = None) -> Controller:
        store = open_store(tmp_path / "state.db")
        stores.append(store)
        for n in ("n1", "n2"):
            store.replace_observed(n, [{"gpu": 0, "uuid": f"GPU-{n}", "model": "H100-80GB", "mig_enabled": True}],
                                   [], now=time.time())
        ctl = Controller(cfg or Config(), store, CpuFullN1(squeue([
            [5, 0, None, "", 0, "PENDING", "Resources", 50, "gres:mig:3g:1", "", "debug", 1, 60, "a", "u", "", 1]])))
        ctl.tick()
        return ctl

    yield make
    for store in stores:
        store.close()


def test_a_node_without_a_free_cpu_is_not_carved_for(cpu_full):
    """Slurm starts nothing on a node whose CPUs are all allocated. Carved for there, two tasks of an
    array waited ~20 s on the demo cluster (8 CPUs, 14 1g slices a node) while another node's GPUs idled."""
    store = cpu_full().store
    assert "n1" not in {d for d in ("n1", "n2") if store.desired(d)}
    assert "3g" in store.desired("n2")[0].spec


def test_explain_says_a_node_without_a_free_cpu_is_why_its_gpus_were_left_out(cpu_full):
    # Its GPUs reach the policy as unavailable; explain called the up node "down, drained, stale or MIG off".
    from slurm_mig.ops.explain import explain_view

    store = cpu_full().store
    options = {o["gpu"]: o for saw in explain_view(store, "5")["policy_saw"] for o in saw["options"]}
    assert options["n1/0"]["verdict"] == "unavailable" and "CPU" in options["n1/0"]["why"], options["n1/0"]


def test_a_site_that_oversubscribes_cpus_keeps_cpu_full_nodes_in_play(cpu_full):
    from dataclasses import replace

    cfg = Config()
    cfg = replace(cfg, controller=replace(cfg.controller, cpu_full_nodes_wait=False))
    store = cpu_full(cfg).store
    assert "3g" in store.desired("n1")[0].spec  # OverSubscribe=FORCE: Slurm may still start it there


def test_a_job_submitted_to_several_partitions_is_not_blocked_by_one_partitions_reason():
    # Slurm shows the reason of the last partition it tried: "a" down says nothing about "b".
    rows = [[20, 0, None, "", 0, "PENDING", "PartitionDown", 5, "gres:mig:1g:1", "", "a,b", 1, 60, "x", "u", "", 1],
            [21, 0, None, "", 0, "PENDING", "QOSMaxGRESPerUser", 5, "gres:mig:1g:1", "", "a,b", 1, 60, "x", "u", "", 1],
            [22, 0, None, "", 0, "PENDING", "Dependency", 5, "gres:mig:1g:1", "", "a,b", 1, 60, "x", "u", "", 1],
            [23, 0, None, "", 0, "PENDING", "PartitionDown", 5, "gres:mig:1g:1", "", "a", 1, 60, "x", "u", "", 1]]
    blocked = {e.job_id: e.blocked for e in queue_entries(squeue(rows))}
    assert blocked["20"] is None and blocked["21"] is None
    assert "dependency" in blocked["22"] and "partition is down" in blocked["23"]


def test_a_queue_of_held_jobs_still_shows_the_controller_ticking(ctl):
    # Its only job held, the policy has nothing to decide: the tick wrote nothing `status` reads as a tick,
    # and `status --check` called a live controller stale (it said "ok" while the held job was the queue).
    from slurm_mig.ops import views as V

    t = [time.time()]
    ctl.clock = lambda: t[0]
    ctl.slurm.queue = squeue([
        [2, 0, None, "", 0, "PENDING", "JobHeldUser", 0, "gres:mig:3g:1", "", "debug", 1, 60, "a", "u", "", 1]])
    for _ in range(4):
        t[0] += 30
        ctl.store.upsert_node("n1", last_seen=t[0])
        ctl.tick()
    health = V.controller_health(V.load_snapshot(ctl.store, now=t[0] + 1), 5.0)
    assert health["state"] == "ok", health


def test_a_controller_whose_nodes_have_not_reported_a_gpu_yet_still_shows_it_ticks(tmp_path):
    # A new install: Slurm answers, no node has reported a GPU, so there is no policy decision to record.
    from slurm_mig.ops import views as V

    store = open_store(tmp_path / "state.db")
    ctl = Controller(Config(), store, QueueSlurm(squeue([
        [5, 0, None, "", 0, "PENDING", "Resources", 50, "gres:mig:3g:1", "", "debug", 1, 60, "a", "u", "", 1]])))
    try:
        ctl.tick()
        assert V.controller_health(V.load_snapshot(store, now=time.time() + 1), 5.0)["last_tick"] is not None
    finally:
        store.close()


def test_a_tick_that_asked_squeue_before_a_task_started_does_not_queue_the_task_again(ctl):
    # The Prolog gives task 2's place to job 11 after this tick's squeue, which still lists 2 as waiting:
    # written again, the entry made the policy carve one slice too many until the next tick.
    t = [time.time()]
    ctl.clock = lambda: t[0]
    record = [4, 4, None, "1-2", 0, "PENDING", "Resources", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1]
    ctl.slurm.queue = squeue([record])
    ctl.tick()
    ctl.slurm.details["11"] = JobDetail(job_id=11, name="a", user="u", state="RUNNING", partition="debug",
                                        nodes=["n1"], tres_per_node="gres:mig:1g:1", mig={"1g": 1},
                                        fields={"JobId": "11", "ArrayJobId": "4", "ArrayTaskId": "2"})
    gpu = {"index": 0, "uuid": "GPU-0", "name": "H100", "model": "H100-80GB", "mig_enabled": True, "instances": []}
    t[0] += 10
    assert ctl.on_prolog({"node": "n1", "job_id": "11", "observed": [gpu], "bindings": {}}, None)["action"] == "bind"
    t[0] -= 1  # this tick's squeue was asked a second before the Prolog
    ctl.tick()
    assert ctl.store.get_job("4_2") is None
    assert [j.job_id for j in ctl.store.pending_jobs()] == ["4_1"]


class WhereSlurm(QueueSlurm):
    """The demo cluster's answers (tests/test_slurm_parsers.py): n1-n3, one H100 each; n3 in partition
    "other" with feature "fast"; reservation r1 active on n2, a maintenance window on n1 within the hour."""

    def __init__(self, queue):
        super().__init__(queue)
        self.res: list | None = parse_reservations(SCONTROL_RES)

    def nodes(self):
        return [replace(n, gres={}, gres_used={}) for n in parse_sinfo_json(json.loads(SINFO_JSON_WHERE))]

    def reservations(self):
        return self.res


def test_jobs_are_carved_for_only_where_slurm_may_start_them(tmp_path):
    """On the demo cluster a --exclude=n1,n2 job, a -p debug,other job (n1 under a maintenance window
    within its time limit, n2 reserved) and a -C fast job were carved for on n1, and waited
    (ReqNodeNotAvail) beside an idle n3; a --reservation=r1 job belongs on r1's n2."""
    store = open_store(tmp_path / "state.db")
    try:
        for n in ("n1", "n2", "n3"):
            store.replace_observed(n, [{"gpu": 0, "uuid": f"GPU-{n}", "model": "H100-80GB", "mig_enabled": True}],
                                   [], now=time.time())
        slurm = WhereSlurm(parse_squeue_json(json.loads(SQUEUE_JSON_WHERE)))
        ctl = Controller(Config(), store, slurm, clock=lambda: parse_reservations(SCONTROL_RES)[0].start + 60)
        ctl.tick()
        where = {j: r["node"] for j, r in (store.get_meta("reservations") or {}).items()}
        assert where == {"1": "n3", "3": "n3", "4": "n2", "5": "n3"}, where
        assert store.desired("n3")[0].spec.count("2g") == 3 and "1g" in store.desired("n2")[0].spec
        assert not store.desired("n1")
        # explain shows why n1 and n2 were not its options
        from slurm_mig.ops.explain import explain_view

        options = {o["gpu"]: o for saw in explain_view(store, "1")["policy_saw"] for o in saw["options"]}
        assert options["n1/0"]["verdict"] == options["n2/0"]["verdict"] == "not-its-node", options
        assert options["n3/0"]["verdict"] != "not-its-node"
        # scontrol show reservation fails: the maintenance window is still kept clear, not forgotten.
        slurm.res = None
        slurm.queue = squeue([[8, 0, None, "", 0, "PENDING", "Resources", 5, "gres:mig:7g:1", "", "debug",
                               1795355438, None, "x", "u", "", 1]])
        ctl.tick()
        assert not store.desired("n1") and "8" not in (store.get_meta("reservations") or {})
        assert "none of the 1 node(s) Slurm may start it on" in store.get_job("8").reason  # n3, being carved
        # Slurm lists no reservation now: n1 is the 7g job's.
        slurm.res = []
        ctl.tick()
        assert (store.get_meta("reservations") or {})["8"]["node"] == "n1"
    finally:
        store.close()


class CpuSlurm(QueueSlurm):
    """The demo cluster's answers with a -c 6 job running on n1 (2 of 8 CPUs free) and three jobs that ask
    for more CPUs than that, or a whole node (tests/test_slurm_parsers.py)."""

    def nodes(self):
        return [replace(n, gres={}, gres_used={}) for n in parse_sinfo_json(json.loads(SINFO_JSON_CPUS))]


@pytest.fixture
def cpu_ticked(tmp_path):
    """A store with n1 and n2 (one H100 each) after one tick over CpuSlurm; closed after the test."""
    store = open_store(tmp_path / "state.db")
    for n in ("n1", "n2"):
        store.replace_observed(n, [{"gpu": 0, "uuid": f"GPU-{n}", "model": "H100-80GB", "mig_enabled": True}],
                               [], now=time.time())
    Controller(Config(), store, CpuSlurm(parse_squeue_json(json.loads(SQUEUE_JSON_CPUS)))).tick()
    yield store
    store.close()


def test_jobs_are_not_carved_for_on_a_node_without_the_cpus_they_ask_for(cpu_ticked):
    where = {j: r["node"] for j, r in (cpu_ticked.get_meta("reservations") or {}).items()}
    # n2's 8 CPUs: job 2 (-c 4) is placed there; job 3 (-n 2 -c 3) no longer fits beside it, nor does the
    # --exclusive job 4. They were carved for on n2 too, and waited there for Slurm.
    assert where == {"2": "n2"}, where
    assert "n2's free CPUs are promised to jobs placed this tick" in cpu_ticked.get_job("3").reason
    assert "n2 has CPUs promised to jobs placed this tick" in cpu_ticked.get_job("4").reason
    assert "--exclusive" in cpu_ticked.get_job("4").reason


class HalfFreeN1(QueueSlurm):
    """n1 with 4 of its 8 CPUs free, n2 idle (one H100 each), and two 1g jobs of -c 3 each."""

    def nodes(self):
        return [SlurmNode(name="n1", state="mixed", gres={}, gres_used={}, cpus=8, alloc_cpus=4),
                SlurmNode(name="n2", state="idle", gres={}, gres_used={}, cpus=8, alloc_cpus=0)]


def _observe_two_1g_on_n1(store) -> None:
    for n in ("n1", "n2"):
        store.replace_observed(n, [{"gpu": 0, "uuid": f"GPU-{n}", "model": "H100-80GB", "mig_enabled": True}],
                               [{"gpu": 0, "profile": "1g.10gb", "start": s} for s in (0, 1)] if n == "n1" else [],
                               now=time.time())


def _cpus_queue(*rows):
    return parse_squeue_json({"jobs": [{**dict(zip(_KEYS, r)), "cpus": 3, "shared": None} for r in rows]})


def _two_cpu_jobs_ticked(tmp_path, cfg: Config) -> tuple[dict, dict]:
    """One tick over two -c 3 mig:1g jobs while n1 has 4 of 8 CPUs free and two free 1g instances, n2
    idle: where each job's slice was carved, and the recorded inputs of the decision."""
    store = open_store(tmp_path / "state.db")
    try:
        # n1 holds two free 1g instances, so that each policy would put both jobs there
        _observe_two_1g_on_n1(store)
        Controller(cfg, store, HalfFreeN1(_cpus_queue(
            [31, 0, None, "", 0, "PENDING", "Resources", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1],
            [32, 0, None, "", 0, "PENDING", "Resources", 49, "gres:mig:1g:1", "", "debug", 2, 60, "b", "u", "", 1],
        ))).tick()
        where = {j: r["node"] for j, r in (store.get_meta("reservations") or {}).items()}
        return where, store.recent_decisions(1)[0].inputs
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["first-fit", "frag-aware"])
def test_two_jobs_whose_cpus_one_node_cannot_hold_together_go_to_two_nodes_in_one_tick(tmp_path, policy):
    """Each job's CPUs fit n1's 4 free, not both: the second was carved for on n1 and waited there for
    Slurm until the next tick re-placed it, after the carve and maybe another job's slices were taken."""
    cfg = Config()
    where, inputs = _two_cpu_jobs_ticked(tmp_path, replace(cfg, policy=replace(cfg.policy, name=policy)))
    assert where == {"31": "n1", "32": "n2"}, where
    # the decision's recorded inputs carry the counts it went by (to replay it, or train from it)
    assert inputs["free_cpus"] == {"n1": 4, "n2": 8}
    assert [j.get("cpus") for j in inputs["pending"]] == [3, 3]


def test_a_site_that_oversubscribes_cpus_places_both_jobs_on_one_node(tmp_path):
    cfg = Config()
    where, inputs = _two_cpu_jobs_ticked(
        tmp_path, replace(cfg, controller=replace(cfg.controller, cpu_full_nodes_wait=False)))
    assert where == {"31": "n1", "32": "n1"}, where  # OverSubscribe: Slurm starts both there
    assert "free_cpus" not in inputs and not any("cpus" in j for j in inputs["pending"])


def test_explain_says_cpus_can_be_why_a_node_is_not_the_jobs(cpu_ticked):
    # The -c 4 job (2) is kept off n1 for its CPUs (2 of 8 free): explain called n1 not its node for "its
    # partition, --nodelist, --exclude, --constraint or a reservation", none of which the job has.
    from slurm_mig.ops.explain import explain_view

    options = {o["gpu"]: o for saw in explain_view(cpu_ticked, "2")["policy_saw"] for o in saw["options"]}
    assert options["n1/0"]["verdict"] == "not-its-node" and "CPU" in options["n1/0"]["why"], options["n1/0"]


def test_explain_shows_a_node_whose_free_cpus_this_decision_promised_to_jobs_before_it(cpu_ticked):
    # Job 3 (-n 2 -c 3) and the --exclusive job 4 waited because job 2 (-c 4), placed before them, took
    # n2's CPUs in the decision; explain showed n2/0 as "free-slices", a GPU they could have gone to.
    from slurm_mig.ops.explain import explain_view

    for job in ("3", "4"):
        saw = explain_view(cpu_ticked, job)["policy_saw"]
        options = {o["gpu"]: o for s in saw for o in s["options"]}
        assert options["n2/0"]["verdict"] == "cpus-promised", options["n2/0"]
        assert "job 2" in options["n2/0"]["why"] and "CPU" in options["n2/0"]["why"], options["n2/0"]
        assert saw[0]["verdicts"] == {"cpus-promised": 1, "not-its-node": 1}, saw[0]["verdicts"]
    assert "4 of its 8 free CPUs" in explain_view(cpu_ticked, "3")["policy_saw"][0]["options"][1]["why"]
    # job 2, placed first, was promised nothing before it: its view is as before
    options = {o["gpu"]: o for s in explain_view(cpu_ticked, "2")["policy_saw"] for o in s["options"]}
    assert options["n2/0"]["verdict"] == "free-slices" and options["n2/0"]["chosen"], options["n2/0"]


def test_explain_shows_cpus_promised_on_a_node_slurm_may_start_the_job_on(tmp_path):
    # Both -c 3 jobs may start on n1 (4 CPUs free) or n2; job 31 took n1's CPUs, so job 32 went to n2,
    # and explain showed n1/0's idle 1g instance as its own for the taking.
    from slurm_mig.ops.explain import explain_view

    store = open_store(tmp_path / "state.db")
    try:
        _observe_two_1g_on_n1(store)
        Controller(Config(), store, HalfFreeN1(_cpus_queue(
            [31, 0, None, "", 0, "PENDING", "Resources", 50, "gres:mig:1g:1", "", "debug", 1, 60, "a", "u", "", 1],
            [32, 0, None, "", 0, "PENDING", "Resources", 49, "gres:mig:1g:1", "", "debug", 2, 60, "b", "u", "", 1],
        ))).tick()
        options = {o["gpu"]: o for s in explain_view(store, "32")["policy_saw"] for o in s["options"]}
        assert options["n2/0"]["chosen"], options
        assert options["n1/0"]["verdict"] == "cpus-promised" and "job 31" in options["n1/0"]["why"], options
        options = {o["gpu"]: o for s in explain_view(store, "31")["policy_saw"] for o in s["options"]}
        assert options["n1/0"]["verdict"] == "idle-instance" and options["n1/0"]["chosen"], options
    finally:
        store.close()


def test_a_job_named_like_a_mig_request_is_not_given_one(ctl):
    """`sbatch -J 'x TresPerNode=gres:mig:7g:1'` with no --gres: at its Prolog (no tick has seen it, so the
    controller reads `scontrol show job`) it was bound a whole 7g, carved for it, that Slurm never counted."""
    ctl.tick()
    text = (SCONTROL_JOBS_D.split("\n\n")[0].replace("JobId=19", "JobId=31")
            .replace("JobName=train", "JobName=x TresPerNode=gres:mig:7g:1")
            .replace("   TresPerNode=gres:mig:3g:1\n", ""))
    ctl.slurm.details["31"] = parse_scontrol_jobs(text)[0]
    gpu = {"index": 0, "uuid": "GPU-0", "name": "H100", "model": "H100-80GB", "mig_enabled": True, "instances": []}
    assert ctl.on_prolog({"node": "n1", "job_id": "31", "observed": [gpu], "bindings": {}}, None) == {"action": "skip"}
    assert _desired(ctl) == ""


def test_a_job_held_because_the_node_it_named_offered_no_slice_of_its_size_is_carved_for_and_released(ctl):
    """Seen on the demo cluster (2026-11-27): ``sbatch -w n1 --gres=mig:2g`` accepted while n1 had a 2g, whose
    dependency was met after n1 was re-carved to 4g@0 for another job: Slurm held it (priority 0, Reason=
    BadConstraints: n1 advertised no 2g), slurm-mig did not carve for a held job, and a release was held again,
    so it waited for ever beside an idle GPU. Released by hand once n1 advertised a 2g, it ran at once."""
    named = [12, 0, None, "", 0, "PENDING", "BadConstraints", 0, "gres:mig:2g:1", "", "debug", 1, 60, "a", "u", "", 1]
    # -n 12 on 8-CPU nodes: held for its CPUs, named no node; not carved for, not released.
    cpus = [13, 0, None, "", 0, "PENDING", "BadConstraints", 0, "gres:mig:3g:1", "", "debug", 1, 60, "a", "u", "", 1]
    (job12,) = squeue([named])
    ctl.slurm.queue = [replace(job12, required_nodes=["n1"]), *squeue([cpus])]
    ctl.tick()
    assert "2g" in _desired(ctl) and "3g" not in _desired(ctl)
    assert ctl.slurm.gres[-1]["2g"] >= 1  # Slurm is told of the 2g before the release
    assert ctl.slurm.released == ["12"]
    assert any(e.kind == "release" and "12" in e.message for e in ctl.store.recent_events(50))
    assert "13" not in [j.job_id for j in ctl.store.pending_jobs()]
    # Held again with its 2g advertised: the hold is for something else (memory, say); tried once more, then
    # the job is left to Slurm's verdict and no longer carved for.
    ctl.tick()
    ctl.tick()
    assert ctl.slurm.released == ["12", "12"]
    assert [j.job_id for j in ctl.store.pending_jobs()] == []
    assert "BadConstraints" in ctl.store.get_job("12").reason


def test_a_job_its_user_or_an_admin_held_after_the_ticks_squeue_is_not_released(ctl):
    """Measured on the demo cluster (2026-11-27): `scontrol hold` of a job Slurm held BadConstraints makes it
    JobHeldAdmin (an admin's, and its user's own too), `scontrol uhold` JobHeldUser, so squeue tells them apart;
    but the release came a whole tick after the squeue that saw BadConstraints, and `scontrol release` undoes any
    hold. Asked again just before, a job held by someone meanwhile is left held; one still BadConstraints is
    released."""
    row = [12, 0, None, "", 0, "PENDING", "BadConstraints", 0, "gres:mig:2g:1", "", "debug", 1, 60, "a", "u", "", 1]
    (job,) = squeue([row])
    held = replace(job, required_nodes=["n1"])
    answers = []

    def jobs():
        return answers.pop(0) if answers else [held]

    ctl.slurm.jobs = jobs
    answers[:] = [[held], [replace(held, state_reason="JobHeldUser")]]  # the tick's squeue, then the one after
    ctl.tick()
    assert "2g" in _desired(ctl)
    assert ctl.slurm.__dict__.get("released", []) == []
    for reason in ("JobHeldAdmin", "JobHeldUser"):
        answers[:] = [[replace(held, state_reason=reason)]] * 2
        ctl.tick()
        assert ctl.slurm.__dict__.get("released", []) == []
    answers[:] = [[held], [held]]  # the hold released by its owner, Slurm's own BadConstraints again
    ctl.tick()
    assert ctl.slurm.released == ["12"]

def test_the_release_limit_holds_across_controller_restarts(ctl):
    """The releases spent (MAX_SIZE_RELEASES) and the release not yet seen held again lived in memory only: a
    job Slurm holds BadConstraints for something else (its --mem, say), its node offering its size, was carved for
    and released MAX_SIZE_RELEASES more times after each restart of the controller. Restarted after every tick
    here, it is released twice in all, as without restarts."""
    row = [12, 0, None, "", 0, "PENDING", "BadConstraints", 0, "gres:mig:2g:1", "", "debug", 1, 60, "a", "u", "", 1]
    (job,) = squeue([row])
    ctl.slurm.queue = [replace(job, required_nodes=["n1"])]
    c = ctl
    for _ in range(6):
        c.tick()
        c = Controller(Config(), ctl.store, ctl.slurm)
    assert ctl.slurm.released == ["12", "12"]
    assert [j.job_id for j in ctl.store.pending_jobs()] == []  # no longer carved for
    # Gone from Slurm's queue, its notes go with it.
    ctl.slurm.queue = []
    c.tick()
    assert ctl.store.get_meta("size_releases") is None
    ctl.store.set_meta("size_releases", {"12": "damaged"})
    assert Controller(Config(), ctl.store, ctl.slurm)._size_releases == {}  # a damaged note never stops a start

def test_a_suspended_job_is_stored_suspended_keeps_its_instance_and_a_requeue_of_it_releases_it(ctl):
    """Seen on the demo cluster (2026-11-27): `slurm-mig jobs` said RUNNING for a job `scontrol suspend` had
    suspended (the store never took the state, though its views list SUSPENDED)."""
    from slurm_mig.mig.layout import Slot

    row = [3, 0, None, "", 0, "PENDING", "Resources", 50, "gres:mig:3g:1", "", "debug", 1, 60, "a", "u", "", 1]
    ctl.slurm.queue = squeue([row])
    ctl.tick()
    started = time.time() - 30
    ctl.slurm.queue = [replace(j, state="RUNNING", start_time=int(started), nodes=["n1"]) for j in squeue([row])]
    ctl.tick()
    ctl.store.bind("3", "n1", [(0, Slot(0, "3g.40gb"))], now=started)
    for state in ("SUSPENDED", "RUNNING", "SUSPENDED"):
        ctl.slurm.queue = [replace(j, state=state) for j in ctl.slurm.queue]
        ctl.tick()
        assert ctl.store.get_job("3").state == state
        assert [b.start for _j, _n, b in ctl.store.live_bindings("n1")] == [0]
    # `scontrol requeue` of the suspended job: pending again, its instance released.
    ctl.slurm.queue = [replace(j, state="PENDING", state_reason="BeginTime", restart_cnt=1, nodes=[])
                       for j in ctl.slurm.queue]
    ctl.tick()
    assert ctl.store.get_job("3").state == "PENDING"
    assert ctl.store.live_bindings("n1") == []


def test_a_job_first_seen_suspended_is_stored_as_started_and_suspended(ctl):
    """A job that started and was suspended while the controller was down (no Prolog report reached it either)
    was seen SUSPENDED by the next tick, which moved only PENDING -> RUNNING: the job stayed PENDING in the store,
    a waiting job to the policy, with no start time."""
    row = [4, 0, None, "", 0, "PENDING", "Resources", 50, "gres:mig:3g:1", "", "debug", 1, 60, "a", "u", "", 1]
    ctl.slurm.queue = squeue([row])
    ctl.tick()
    started = int(time.time()) - 600
    ctl.slurm.queue = [replace(j, state="SUSPENDED", start_time=started, nodes=["n1"]) for j in squeue([row])]
    ctl.tick()
    job = ctl.store.get_job("4")
    assert (job.state, job.start_time, job.node) == ("SUSPENDED", started, "n1")
    assert "4" not in [j.job_id for j in ctl.store.pending_jobs(include_bound=True, include_blocked=True)]


# One 22.05 job (`sbatch --gres=mig:3g:1 -t 60`) through `scontrol suspend` and `scontrol resume`, as squeue --json
# shows it: the fields the controller reads, in the real record's shape (SQUEUE_JSON_22_05's job 19, which printed
# "suspend_time":0 and "pre_sus_time":0 for a job never suspended). The suspended and resumed values are not
# captured from a cluster (no Slurm here): they follow slurmctld's suspend/resume code. On suspend, pre_sus_time
# gains the time run since the start (or the last resume) and suspend_time is now; end_time stays as it was. On
# resume suspend_time is now again and end_time = now + time_limit - pre_sus_time (the limit does not count
# suspended time). Started at S = 1795257119, ran 20 minutes, suspended 90 minutes, resumed at S + 6600.
SUSPEND_SEQUENCE = {
    "running": """{"errors":[],"jobs":[{"job_id":19,"job_state":"RUNNING","state_reason":"None","priority":4294901759,
        "tres_per_node":"gres:mig:3g:1","partition":"debug","submit_time":1795257118,"start_time":1795257119,
        "end_time":1795260719,"suspend_time":0,"pre_sus_time":0,"time_limit":60,"name":"train","user_name":"root",
        "user_id":0,"nodes":"n1","node_count":1}]}""",
    "suspended": """{"errors":[],"jobs":[{"job_id":19,"job_state":"SUSPENDED","state_reason":"None","priority":0,
        "tres_per_node":"gres:mig:3g:1","partition":"debug","submit_time":1795257118,"start_time":1795257119,
        "end_time":1795260719,"suspend_time":1795258319,"pre_sus_time":1200,"time_limit":60,"name":"train",
        "user_name":"root","user_id":0,"nodes":"n1","node_count":1}]}""",
    "resumed": """{"errors":[],"jobs":[{"job_id":19,"job_state":"RUNNING","state_reason":"None","priority":4294901759,
        "tres_per_node":"gres:mig:3g:1","partition":"debug","submit_time":1795257118,"start_time":1795257119,
        "end_time":1795266119,"suspend_time":1795263719,"pre_sus_time":1200,"time_limit":60,"name":"train",
        "user_name":"root","user_id":0,"nodes":"n1","node_count":1}]}""",
}
_S = 1795257119


def test_squeue_gives_the_time_a_job_spent_suspended():
    (running,), (suspended,), (resumed,) = (parse_squeue_json(json.loads(SUSPEND_SEQUENCE[k]))
                                            for k in ("running", "suspended", "resumed"))
    assert (running.suspend_time, running.pre_sus_time, running.suspended_before_s) == (None, 0, 0.0)
    # Suspended: ran 1200 s, none of it suspended before this suspension (which began at suspend_time).
    assert (suspended.suspend_time, suspended.pre_sus_time, suspended.suspended_before_s) == (_S + 1200, 1200, 0.0)
    # Resumed: the 90 minutes suspended; start + limit + them is the end Slurm gives (and enforces).
    assert resumed.suspended_before_s == 5400.0
    assert resumed.start_time + resumed.time_limit_min * 60 + resumed.suspended_before_s == resumed.end_time
    # The real 22.05 record of a job never suspended.
    assert [j.suspended_before_s for j in parse_squeue_json(json.loads(SQUEUE_JSON_22_05))][:2] == [0.0, 0.0]


def test_a_suspended_job_has_no_bounded_end_and_once_resumed_ends_later_by_the_time_it_was_suspended(ctl):
    """The policy's view estimated a running job's end as start + time limit. Slurm does not count suspended
    time against the limit: resumed after 90 minutes suspended, the job's instance looked free 90 minutes early
    (here already free, 33 minutes before Slurm ends the job), and while it was suspended it looked free at
    start + limit, though it may stay suspended for hours. EASY backfill's reservations and frag-aware's end alignment plan on
    these ends."""
    from slurm_mig.mig.layout import Slot

    slot = Slot(0, "3g.40gb")

    def until(at: float):
        return ctl.store.cluster_state(now=at).gpu("n1/0").busy_until

    for name, at in (("running", _S + 600), ("suspended", _S + 3000), ("resumed", _S + 7000)):
        ctl.clock = lambda at=at: float(at)
        ctl.slurm.queue = parse_squeue_json(json.loads(SUSPEND_SEQUENCE[name]))
        ctl.tick()
        if name == "running":
            ctl.store.bind("19", "n1", [(0, slot)], now=_S)
            assert until(at) == ((slot, _S + 3600.0),)
        elif name == "suspended":
            assert ctl.store.get_job("19").state == "SUSPENDED"
            gpu = ctl.store.cluster_state(now=at).gpu("n1/0")
            assert slot in gpu.busy and gpu.busy_until == ()  # busy, with no end a reservation could count on
        else:
            assert ctl.store.get_job("19").state == "RUNNING"
            assert until(at) == ((slot, 1795266119.0),)  # Slurm's end_time: start + limit + 5400 s suspended


@pytest.mark.parametrize("ends", ["after its resume", "while suspended"])
def test_the_run_time_recorded_leaves_out_the_time_a_job_was_suspended(ctl, tmp_path, ends):
    """The outcome's run_s was end - start, the 90 minutes the job spent suspended included: `jobs` and `explain`
    said it ran 90 minutes longer than Slurm's RunTime, and the retrainer's trace (load_outcomes_db) replayed it
    as a job that long."""
    from slurm_mig.ops.views import job_dict
    from slurm_mig.sim.workloads import load_outcomes_db

    steps = [("running", _S + 600), ("suspended", _S + 3000)]
    if ends == "after its resume":
        steps.append(("resumed", _S + 7000))
    for name, at in steps:
        ctl.clock = lambda at=at: float(at)
        ctl.slurm.queue = parse_squeue_json(json.loads(SUSPEND_SEQUENCE[name]))
        ctl.tick()
    # Run so far, as squeue's TIME column says: at S + 7000, 1200 s before the suspension and 400 s since the
    # resume; while suspended, the 1200 s before it (pre_sus_time).
    at = steps[-1][1]
    assert job_dict(ctl.store.get_job("19"), at)["run_s"] == (1600.0 if ends == "after its resume" else 1200.0)
    # It ends (scancel of the suspended job) 1000 s after the last tick: its Epilog reports.
    end = at + 1000
    ctl.clock = lambda: float(end)
    assert ctl.on_epilog({"job_id": "19", "node": "n1", "exit_code": 0, "end_time": end,
                          "instances": [{"gpu": 0, "profile": "3g.40gb", "start": 0}]}, None)["recorded"]
    # Ran 1200 s before the suspension and 1400 s after the resume at S + 6600; suspended at the end: 1200 s.
    want = 2600.0 if ends == "after its resume" else 1200.0
    outcome = ctl.store.outcome("19")
    assert outcome.end_time - outcome.start_time == end - _S  # the span stays the span
    assert outcome.run_s == want
    assert ctl.store.get_job("19").end_time == end and job_dict(ctl.store.get_job("19"), end + 50)["run_s"] == want
    trace = load_outcomes_db(tmp_path / "state.db")
    assert [j.duration_s for j in trace.jobs] == [want]


def test_a_named_node_job_held_again_each_time_its_node_was_re_carved_is_released_each_time_its_size_is_back(ctl):
    """The release limit (MAX_SIZE_RELEASES) is for a job Slurm holds for something else: held again while its
    node advertised its size. A released -w job that waited (Resources) while its node was re-carved for others is
    held again by Slurm for its size, as at first: that spent the limit too, so after two such re-carves it was no
    longer carved for nor released, and waited for ever (a user may not release a BadConstraints hold)."""
    gpu = [{"gpu": 0, "uuid": "GPU-0", "model": "H100-80GB", "mig_enabled": True}]
    seven = [{"gpu": 0, "profile": "7g", "start": 0, "uuid": "MIG-7", "gi_id": 0, "ci_id": 0, "in_use": True}]
    held = [12, 0, None, "", 0, "PENDING", "BadConstraints", 0, "gres:mig:2g:1", "", "debug", 1, 60, "a", "u", "", 1]
    waits = [12, 0, None, "", 0, "PENDING", "Resources", 5, "gres:mig:2g:1", "", "debug", 1, 60, "a", "u", "", 1]
    for attempt in range(1, 4):
        # n1 busy with another job's 7g: Slurm holds job 12 (n1 advertises no 2g); nothing to release.
        ctl.store.replace_observed("n1", gpu, seven, now=time.time())
        (job,) = squeue([held])
        ctl.slurm.queue = [replace(job, required_nodes=["n1"])]
        ctl.tick()
        assert ctl.slurm.__dict__.get("released", []) == ["12"] * (attempt - 1)
        # The 7g ends: a 2g is carved for job 12, which is released.
        ctl.store.replace_observed("n1", gpu, [], now=time.time())
        ctl.tick()
        assert "2g" in _desired(ctl)
        assert ctl.slurm.released == ["12"] * attempt, attempt
        # Released, it waits (Resources) while another job takes n1 again (the next round).
        (job,) = squeue([waits])
        ctl.slurm.queue = [replace(job, required_nodes=["n1"])]
        ctl.tick()


def _ended_record(state: str, end: int, suspend_time: int) -> list:
    rec = json.loads(SUSPEND_SEQUENCE["suspended"])
    rec["jobs"][0].update(job_state=state, end_time=end, suspend_time=suspend_time, priority=0)
    return parse_squeue_json(rec)


@pytest.mark.parametrize("order", ["epilog first", "tick first"])
@pytest.mark.parametrize("ends", ["resumed and completed unseen", "cancelled while suspended"])
def test_a_job_resumed_and_ended_between_two_ticks_is_not_counted_suspended_to_its_end(ctl, tmp_path, order, ends):
    """A tick saw the job suspended (at S + 1200); it was resumed at S + 6600 and completed an hour later, before
    the next tick saw it run (the controller was down meanwhile; the same within one tick interval). The
    suspension noted as going on was kept to the end: the outcome said it ran 1200 s (its pre_sus_time) instead
    of 4800 s (1200 + 3600), and where the tick came first, with the 5400 s suspended counted twice, 0 s (then
    load_outcomes_db left it out of the trace). Slurm's ended record says which it was: a job killed while
    suspended ends at its suspend time; one that ran after its resume ends after it."""
    from slurm_mig.ops.views import job_dict
    from slurm_mig.sim.workloads import load_outcomes_db

    for name, at in (("running", _S + 600), ("suspended", _S + 3000)):
        ctl.clock = lambda at=at: float(at)
        ctl.slurm.queue = parse_squeue_json(json.loads(SUSPEND_SEQUENCE[name]))
        ctl.tick()
    if ends == "resumed and completed unseen":
        end, record, want = _S + 10200, _ended_record("COMPLETED", _S + 10200, _S + 6600), 4800.0
    else:  # Slurm gives a job killed while suspended its suspend time as end, and the same figures as before
        end, record, want = _S + 10200, _ended_record("CANCELLED", _S + 1200, _S + 1200), 1200.0
    now = end + 800
    ctl.clock = lambda: float(now)
    ctl.slurm.queue = record

    def epilog():
        assert ctl.on_epilog({"job_id": "19", "node": "n1", "exit_code": 0, "end_time": end,
                              "instances": [{"gpu": 0, "profile": "3g.40gb", "start": 0}]}, None)["recorded"]

    for step in ((epilog, ctl.tick) if order == "epilog first" else (ctl.tick, epilog)):
        step()
    ctl.tick()
    assert ctl.store.outcome("19").run_s == want
    # Not suspended at its end where it was resumed; suspended since S + 1200 where it was cancelled so.
    job = ctl.store.get_job("19")
    assert job.suspended_since == (None if ends.startswith("resumed") else _S + 1200)
    assert job_dict(job, now + 50)["run_s"] == job.end_time - job.start_time - job.suspended_for(job.end_time)
    assert [j.duration_s for j in load_outcomes_db(tmp_path / "state.db").jobs] == [want]


@pytest.mark.parametrize("order", ["epilog first", "tick first"])
@pytest.mark.parametrize("forgotten", [False, True])
def test_a_suspension_no_tick_saw_is_learned_from_slurms_ended_record_while_slurm_lists_it(ctl, order, forgotten):
    """The ticks saw job 19 only running; it was suspended (S + 1200), resumed (S + 6600) and completed (S + 10200)
    between two ticks. Neither its Epilog (no suspend figures in its environment) nor a tick that saw it live
    knew of the suspension, but Slurm's ended record does (squeue --json's suspend_time and pre_sus_time, until
    MinJobAge): the run time recorded leaves out the 5400 s suspended. Once Slurm has forgotten the job (the
    controller down for longer than MinJobAge after its end), nothing without sacct says it: the span is
    recorded (the limit docs/architecture.md states)."""
    ctl.clock = lambda: float(_S + 600)
    ctl.slurm.queue = parse_squeue_json(json.loads(SUSPEND_SEQUENCE["running"]))
    ctl.tick()
    end = _S + 10200
    ctl.clock = lambda: float(end + 100)
    ctl.slurm.queue = [] if forgotten else _ended_record("COMPLETED", end, _S + 6600)

    def epilog():
        assert ctl.on_epilog({"job_id": "19", "node": "n1", "exit_code": 0, "end_time": end,
                              "instances": [{"gpu": 0, "profile": "3g.40gb", "start": 0}]}, None)["recorded"]

    for step in ((epilog, ctl.tick) if order == "epilog first" else (ctl.tick, epilog)):
        step()
    ctl.tick()
    assert ctl.store.outcome("19").run_s == (10200.0 if forgotten else 4800.0)


def test_jobs_of_one_priority_and_submit_time_queue_by_job_id_as_numbers_in_the_controller_and_the_simulator(ctl):
    """Ties (one priority, one submit time) go by job id as Slurm orders them, by number: the simulator put
    "100" before "99" and "5_10" before "5_9" (text), where the controller, reading Slurm's numbers, did not.
    The two queues agree."""
    from slurm_mig.policies import get_policy
    from slurm_mig.sim.engine import ClusterSpec, Simulator
    from slurm_mig.sim.workloads import Job, Workload

    row = [0, "PENDING", "Resources", 50, "gres:mig:1g:1", "", "debug", 1795346078, 60, "a", "u", "", 1]
    ctl.slurm.queue = squeue([[100, 0, None, "", *row], [5, 5, None, "9-10", *row], [99, 0, None, "", *row]])
    ctl.tick()
    want = ["5_9", "5_10", "99", "100"]
    assert [j.job_id for j in ctl.store.pending_jobs(include_bound=True)] == want
    w = Workload("ties", [Job(i, 0.0, "1g", 1, 60.0, 60.0) for i in ("100", "5_10", "99", "5_9")], nodes=1,
                 gpus_per_node=1)
    state = Simulator(w, get_policy("frag-aware"), ClusterSpec(1, 1)).reset()
    assert [j.job_id for j in state.pending] == want
