"""A region the policy reserves for a waiting job drains for it: Slurm is not told of its idle instances
and no other job's Prolog is handed them, unless the decision assigned them (the policy's own backfill).

Found on the demo cluster: one H100 with seven busy 1g instances, a 7g job at the head of the queue and 1g
jobs behind it. The policy reserved the GPU for the 7g, but each time a 1g job ended the controller still
counted its idle instance, Slurm started the next 1g job there and the Prolog bound it: the 7g ran 52 s after
submission though the first seven 1g jobs had all ended within 27 s (with a steady stream of 1g jobs, never).
"""

from __future__ import annotations

import time

from slurm_mig.slurm.parsers import JobDetail, SlurmJob, SlurmNode

from tests.test_faults_controller import H100, post, rig  # noqa: F401  (rig: the fixture)

def ONE_G_SLOT(start):
    from slurm_mig.mig.layout import Slot

    return Slot(start, "1g.10gb")


ONE_G = [{"gpu": 0, "profile": "1g.10gb", "start": s, "uuid": f"MIG-{s}"} for s in range(7)]


def _observed(busy: set[int]) -> list[dict]:
    return [{"index": 0, "uuid": "GPU-0", "name": "H100", "model": "H100-80GB", "mig_enabled": True,
             "instances": [{"profile": "1g.10gb", "start": s, "uuid": f"MIG-{s}", "in_use": s in busy}
                           for s in range(7)]}]


def _slurm_sees_n1(rig, node: dict) -> dict:
    """Slurm's n1 is ``node`` ({"gres": counts, "used": counts held by jobs}): sinfo reads it, and the controller's
    GRES writes land in its "gres". Returns ``node``."""
    rig.fake.nodes = lambda: [SlurmNode(name="n1", state="mixed", gres=dict(node["gres"]),
                                        gres_used=dict(node["used"]))]
    orig = rig.fake.update_node_gres

    def update(n, counts, **kw):
        node["gres"] = dict(counts)
        return orig(n, counts, **kw)

    rig.fake.update_node_gres = update
    return node


def _seven_busy_1g(rig, *, backfill_limit_min=None, running_limit_min=60):
    """n1's H100 holds seven 1g instances, each bound to a running job (1-7, an hour's limit); job 8 (7g) waits
    at the head of the queue, jobs 9 and 10 (1g, ``backfill_limit_min``) behind it. Returns the clock, the
    queue's jobs by id and what Slurm says n1 has."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    rig.store.replace_observed("n1", H100, [{**i, "in_use": False} for i in ONE_G], now=t[0])

    def job(i, size, prio, **kw):
        return SlurmJob(job_id=i, name="x", user="u", mig={size: 1}, tres_per_node=f"gres:mig:{size}:1",
                        submit_time=int(t[0]) - 100 + i, priority=prio, **kw)

    jobs = {i: job(i, "1g", 1, state="RUNNING", nodes=["n1"], start_time=int(t[0]) - 50,
                   time_limit_min=running_limit_min,
                   end_time=int(t[0]) - 50 + 60 * running_limit_min if running_limit_min else None)
            for i in range(1, 8)}
    jobs[8] = job(8, "7g", 100, state="PENDING")
    for i in (9, 10):
        jobs[i] = job(i, "1g", 50 - i, state="PENDING", time_limit_min=backfill_limit_min)
    node = _slurm_sees_n1(rig, {"gres": {"1g": 7, "pad": 0}, "used": {"1g": 7}})
    rig.fake.queue = list(jobs.values())
    rig.tick()
    for i in range(1, 8):
        status, resp = post(rig, "/v1/prolog", {"job_id": str(i), "node": "n1", "observed": _observed(set()),
                                                "bindings": {}})
        assert status == 200 and resp["action"] == "bind", resp
    assert {b.start for _j, _n, b in rig.store.live_bindings("n1")} == set(range(7))
    status, _ = post(rig, "/v1/report", {"node": "n1", "observed": _observed(set(range(7))), "bindings": {}})
    assert status == 200
    rig.tick()
    return t, jobs, node


def _end(rig, t, jobs, node, i, busy):
    """Job ``i`` ends: its Epilog, the node's report, and Slurm no longer lists it nor counts its instance."""
    t[0] += 1
    status, _ = post(rig, "/v1/epilog", {"job_id": str(i), "node": "n1", "exit_code": 0, "end_time": t[0],
                                         "instances": [ONE_G[i - 1]]})
    assert status == 200
    busy.discard(i - 1)
    assert post(rig, "/v1/report", {"node": "n1", "observed": _observed(busy), "bindings": {}})[0] == 200
    jobs.pop(i)
    node["used"] = {"1g": node["used"]["1g"] - 1}
    rig.fake.queue = list(jobs.values())


def _job_9_started_on_job_1s_instance(rig):
    """``_seven_busy_1g``, then job 1 ends and Slurm, counting the instance it held, starts job 9 on it at once
    (before any tick); job 9's Prolog asks. Returns the clock, jobs, node, the busy starts and the answer."""
    t, jobs, node = _seven_busy_1g(rig)
    busy = set(range(7))
    _end(rig, t, jobs, node, 1, busy)
    jobs[9] = SlurmJob(**{**jobs[9].__dict__, "state": "RUNNING", "nodes": ["n1"], "start_time": int(t[0])})
    node["used"] = {"1g": 7}
    status, resp = post(rig, "/v1/prolog", {"job_id": "9", "node": "n1", "observed": _observed(busy),
                                            "bindings": {}})
    return t, jobs, node, busy, status, resp


def _gres(rig) -> dict:
    return [c[2] for c in rig.fake.calls if c[0] == "gres"][-1]


def test_a_region_reserved_for_a_7g_drains_and_later_1g_jobs_do_not_take_it(rig):
    t, jobs, node, busy, status, resp = _job_9_started_on_job_1s_instance(rig)
    # Slurm was told of no 1g at all once the 7g held the GPU: all seven are in its region and the node has no
    # idle 1g elsewhere, so a 1g freed there can start nothing (counted, Slurm started job 9 on it at once).
    assert [c[2]["1g"] for c in rig.fake.calls if c[0] == "gres"] == [0], rig.fake.calls  # set once (was twice)
    assert status == 200 and resp["action"] == "requeue", resp  # without the fix: bound to 1g@0
    assert "held for waiting job(s) 8" in resp["reason"], resp
    assert ("requeue", "9") in rig.fake.calls
    assert rig.store.get_meta("held") == {"8": [["n1", 0, 0xFF, [], []]]}  # the GPU's eight memory slices, none idle
    # Requeued: Slurm lists it pending again and counts six 1g in use. The tick tells Slurm six, not seven.
    jobs[9] = SlurmJob(**{**jobs[9].__dict__, "state": "PENDING", "nodes": [], "start_time": None})
    rig.fake.queue = list(jobs.values())
    node["used"] = {"1g": 6}
    rig.tick()
    assert _gres(rig).get("1g") == 0, rig.fake.calls  # without the fix: 7
    assert rig.store.get_meta("held") == {"8": [["n1", 0, 0xFF, [["1g.10gb", 0]], []]]}  # idle there
    assert rig.intended_layouts("n1")[0].slots == frozenset()
    # Below what Slurm says jobs hold, whatever that is (measured on the local cluster: no drain, no job started).
    node["used"] = {"1g": 7}
    rig.tick()
    assert _gres(rig).get("1g") == 0, rig.fake.calls
    # The rest end: the GPU is re-carved to 7g for job 8, its Prolog binds it.
    for i in range(2, 8):
        _end(rig, t, jobs, node, i, busy)
        if i == 2:
            # Slurm starts job 10 on the freed instance and a tick sees it running before its Prolog is served
            # (seen on the demo cluster: the Prolog waited on the store's lock while that tick ran). The tick
            # does not count the instance as job 10's (held back: the count stays at what Slurm allocated), and
            # the Prolog is refused it all the same.
            jobs[10] = SlurmJob(**{**jobs[10].__dict__, "state": "RUNNING", "nodes": ["n1"], "start_time": int(t[0])})
            rig.fake.queue = list(jobs.values())
            node["used"] = {"1g": 6}
            rig.tick()
            assert _gres(rig).get("1g") == 0, rig.fake.calls
            status, resp = post(rig, "/v1/prolog", {"job_id": "10", "node": "n1", "observed": _observed(busy),
                                                    "bindings": {}})
            assert status == 200 and resp["action"] == "requeue", resp
            jobs[10] = SlurmJob(**{**jobs[10].__dict__, "state": "PENDING", "nodes": [], "start_time": None})
            rig.fake.queue = list(jobs.values())
            node["used"] = {"1g": 5}
        rig.tick()
        assert _gres(rig).get("1g", 0) <= 7 - i, (i, rig.fake.calls)
    assert _gres(rig).get("7g") == 1 and _gres(rig).get("1g", 0) == 0, rig.fake.calls
    # The 7g is now assigned the GPU (a re-carve), and its slices stay held for it until its Prolog binds them:
    # a 1g job Slurm starts meanwhile (under the counts being changed) is not given a 1g carved out of them.
    assert [r[:3] for r in rig.store.get_meta("held")["8"]] == [["n1", 0, 0xFF]], rig.store.get_meta("held")
    jobs[9] = SlurmJob(**{**jobs[9].__dict__, "state": "RUNNING", "nodes": ["n1"], "start_time": int(t[0])})
    status, resp = post(rig, "/v1/prolog", {"job_id": "9", "node": "n1", "observed": _observed(set()),
                                            "bindings": {}})
    assert status == 200 and resp["action"] == "requeue", resp
    jobs[9] = SlurmJob(**{**jobs[9].__dict__, "state": "PENDING", "nodes": [], "start_time": None})
    jobs[8] = SlurmJob(**{**jobs[8].__dict__, "state": "RUNNING", "nodes": ["n1"], "start_time": int(t[0])})
    rig.fake.queue = list(jobs.values())
    status, resp = post(rig, "/v1/prolog", {"job_id": "8", "node": "n1", "observed": _observed(set()),
                                            "bindings": {}})
    assert status == 200 and resp["action"] == "bind", resp
    assert resp["instances"] == [{"gpu": 0, "profile": "7g.80gb", "start": 0}], resp
    # Started: its reservation holds nothing any more.
    rig.tick()
    assert "8" not in (rig.store.get_meta("held") or {})


def test_backfill_the_policy_assigns_in_a_reserved_region_still_binds(rig):
    """Job 9 asks for 10 minutes, so it ends well before the running jobs' hour is up: the policy backfills it
    on the idle 1g@0 inside the 7g's region. That instance stays counted and job 9's Prolog is given it;
    job 10 (no limit) is not."""
    t, jobs, node = _seven_busy_1g(rig, backfill_limit_min=10)
    busy = set(range(7))
    _end(rig, t, jobs, node, 1, busy)
    rig.tick()
    assert rig.store.get_meta("reservations").get("9") == {"node": "n1", "instances": [[0, "1g.10gb", 0]]}, \
        rig.store.get_meta("reservations")
    assert _gres(rig).get("1g") == 7, rig.fake.calls
    jobs[9] = SlurmJob(**{**jobs[9].__dict__, "state": "RUNNING", "nodes": ["n1"], "start_time": int(t[0])})
    node["used"] = {"1g": 7}
    status, resp = post(rig, "/v1/prolog", {"job_id": "9", "node": "n1", "observed": _observed(busy),
                                            "bindings": {}})
    assert status == 200 and resp["action"] == "bind", resp
    assert resp["instances"] == [{"gpu": 0, "profile": "1g.10gb", "start": 0}], resp
    assert "8" in rig.store.get_meta("held")  # the 7g's region is still held for it


def test_a_job_without_a_time_limit_is_not_backfilled_into_a_region_reserved_until_running_jobs_end(rig):
    """Seen on the demo cluster: a running job's end was not known, so the 7g's reservation started "when running
    jobs end" (INF), and a 1g job without a limit (INF too) passed the policy's backfill test (INF > INF is
    false): the policy assigned three 1g jobs into the region and the 7g waited for them."""
    t, jobs, node = _seven_busy_1g(rig, running_limit_min=None)
    busy = set(range(7))
    _end(rig, t, jobs, node, 1, busy)
    rig.tick()
    assert "9" not in (rig.store.get_meta("reservations") or {}), rig.store.get_meta("reservations")
    assert _gres(rig).get("1g") == 0, rig.fake.calls


def test_a_site_can_turn_the_hold_back_off(rig):
    """``[controller] hold_reserved = false``: Slurm is told of every idle instance and a later 1g job's Prolog
    binds the one job 1 freed, as before the hold-back (no requeues; the 7g may wait behind a stream of 1g)."""
    from dataclasses import replace

    rig.cfg = replace(rig.cfg, controller=replace(rig.cfg.controller, hold_reserved=False))
    t, jobs, node, busy, status, resp = _job_9_started_on_job_1s_instance(rig)
    assert status == 200 and resp["action"] == "bind", resp
    assert resp["instances"] == [{"gpu": 0, "profile": "1g.10gb", "start": 0}], resp
    assert (rig.store.get_meta("held") or {}) == {}


def test_busy_instances_in_a_held_region_are_counted_only_where_slurm_could_start_a_job_of_their_size(rig):
    """intended_layouts, the counts Slurm is told: a busy instance in a region held for a waiting job is left out
    where the node has no idle instance of its size outside such regions (its end can then start nothing in
    Slurm), and counted where it has one (left out, Slurm would not start a job there either) or where its size
    is the one the holder waits for (Slurm starts the holder there first)."""
    t, jobs, node = _seven_busy_1g(rig)
    busy = set(range(7))
    _end(rig, t, jobs, node, 5, busy)  # 1g@4 is idle now
    whole = {"8": [["n1", 0, 0xFF, [], []]]}
    four = {"8": [["n1", 0, 0x0F, [], []]]}  # 4g@0's slices: 1g@4 is outside, and idle
    assert rig.intended_layouts("n1", held=whole, assigned=set())[0].slots == frozenset()
    assert {s.start for s in rig.intended_layouts("n1", held=four, assigned=set())[0].slots} == set(range(7))
    _end(rig, t, jobs, node, 7, busy)  # 1g@6 too; 1g@4 and 1g@6 idle outside
    assert {s.start for s in rig.intended_layouts("n1", held=four, assigned=set())[0].slots} == set(range(7))
    # The holder waits for a 1g (its regions drawn around 1g@0): the busy 1g instances stay counted, the idle
    # one in its region does not.
    one = {"9": [["n1", 0, 0x01 | 0x02, [], []]]}
    rig.store.db["meta"].delete_where("key = ?", ["held"])
    assert {s.start for s in rig.intended_layouts("n1", held=one, assigned=set())[0].slots} == set(range(7))
    _end(rig, t, jobs, node, 1, busy)  # 1g@0 idle, in the region
    assert {s.start for s in rig.intended_layouts("n1", held=one, assigned=set())[0].slots} == set(range(1, 7))
    # An instance the decision assigned (the policy's backfill) is counted, and is an idle 1g Slurm is told of:
    # the busy ones are counted with it; the idle 1g@4 and 1g@6 are not.
    got = rig.intended_layouts("n1", held=whole, assigned={("n1", 0, ONE_G_SLOT(0))})[0].slots
    assert {s.start for s in got} == {0, 1, 2, 3, 5}, got


def test_a_prolog_refused_a_held_instance_lowers_the_counts_before_its_requeue(rig):
    """A tick could not set the counts (scontrol failed) after a registration put slurm.conf's seven 1g back, and
    Slurm started job 9 on the instance job 1 freed in the 7g's region. Its Prolog is refused the instance, and the
    counts are lowered before the requeue: else the requeue frees the count again and Slurm starts the next 1g
    job there at once, and the next (three requeues in 0.9 s for each instance freed, on the demo cluster)."""
    from slurm_mig.errors import SlurmCommandError

    t, jobs, node = _seven_busy_1g(rig)
    busy = set(range(7))
    node["gres"] = {"1g": 7, "pad": 0}  # a registration: slurm.conf's counts
    good = rig.fake.update_node_gres

    def failing(n, counts, **kw):
        raise SlurmCommandError("scontrol: slurmctld busy")

    rig.fake.update_node_gres = failing
    rig.tick()
    assert node["gres"]["1g"] == 7
    rig.fake.update_node_gres = good
    _end(rig, t, jobs, node, 1, busy)
    jobs[9] = SlurmJob(**{**jobs[9].__dict__, "state": "RUNNING", "nodes": ["n1"], "start_time": int(t[0])})
    node["used"] = {"1g": 7}
    rig.fake.calls.clear()
    status, resp = post(rig, "/v1/prolog", {"job_id": "9", "node": "n1", "observed": _observed(busy),
                                            "bindings": {}})
    assert status == 200 and resp["action"] == "requeue", resp
    kinds = [c[0] for c in rig.fake.calls]
    assert kinds.index("gres") < kinds.index("requeue"), rig.fake.calls  # without the fix: no gres call
    assert node["gres"]["1g"] == 0, node


def test_a_holder_waiting_for_a_variant_size_keeps_the_busy_instances_of_that_size_counted(rig):
    """The store keeps a job's geometry kind ("1g.dm", "1g+me", "2g+me"), not its GRES type: read as a profile
    name, a holder waiting for a 1g.dm was taken to wait for no size, and the busy 1g.20gb in its region were
    left out of Slurm's counts, so when one ended Slurm could not start the holder there until the next tick."""
    now = time.time()
    insts = [{"gpu": 0, "profile": "1g.20gb", "start": s, "uuid": f"MIG-{s}", "in_use": True} for s in (0, 2, 4)]
    insts.append({"gpu": 0, "profile": "1g.10gb", "start": 6, "uuid": "MIG-6", "in_use": True})
    rig.store.replace_observed("n1", H100, insts, now=now)
    held = {"8": [["n1", 0, 0x03, [], []]]}  # 1g.20gb@0's two memory slices, held for job 8
    rig.store.upsert_job("8", profile="1g.dm", count=1, submit_time=now, now=now)
    got = {(s.profile, s.start) for s in rig.intended_layouts("n1", held=held, assigned=set())[0].slots}
    assert got == {("1g.20gb", 0), ("1g.20gb", 2), ("1g.20gb", 4), ("1g.10gb", 6)}, got  # without the fix: no @0
    rig.store.upsert_job("8", profile="7g", count=1, submit_time=now, now=now)  # a size the region is not of
    got = {(s.profile, s.start) for s in rig.intended_layouts("n1", held=held, assigned=set())[0].slots}
    assert ("1g.20gb", 0) not in got, got


def _two_gpus_of_busy_1g(rig, idle=()):
    """n1's two H100s, seven 1g each, in use but ``idle`` ((gpu, start)); job 8 (7g) holds GPU 0, job 9 (1g) the
    slice of 1g@0 on GPU 1 (the meta rows "held" and "reservations" as a tick leaves them)."""
    now = time.time()
    two = [{"gpu": i, "uuid": f"GPU-{i}", "model": "H100-80GB", "mig_enabled": True} for i in (0, 1)]
    rig.store.replace_observed("n1", two, [{"gpu": g, "profile": "1g.10gb", "start": s, "uuid": f"MIG-{g}-{s}",
                                            "in_use": (g, s) not in idle} for g in (0, 1) for s in range(7)], now=now)
    rig.store.upsert_job("8", profile="7g", count=1, submit_time=now, now=now)
    rig.store.upsert_job("9", profile="1g", count=1, submit_time=now + 1, now=now)
    rig.store.set_meta("held", {"8": [["n1", 0, 0xFF, [], []]], "9": [["n1", 1, 0x01, [], []]]}, now=now)
    rig.store.set_meta("reservations", {}, now=now)
    return [{"index": g, "uuid": f"GPU-{g}", "name": "H100", "model": "H100-80GB", "mig_enabled": True,
             "instances": [{"profile": "1g.10gb", "start": s, "uuid": f"MIG-{g}-{s}", "in_use": (g, s) not in idle}
                           for s in range(7)]} for g in (0, 1)]


def test_busy_instances_in_one_holders_region_are_not_kept_counted_for_another_holders_size(rig):
    """Two jobs hold regions on one node: job 8 (7g) all of GPU 0, job 9 (1g) 1g@0's slice on GPU 1, every 1g in
    use. The busy 1g on GPU 0 were counted because job 9 waits for a 1g: when one ended, Slurm started job 9
    there (the highest 1g), and its Prolog, kept off job 8's region, requeued the reserved job itself (and its
    node held it back). Only the holder of the region an instance is in keeps it counted now."""
    _two_gpus_of_busy_1g(rig)
    got = {gi: {s.start for s in lay.slots} for gi, lay in rig.intended_layouts("n1").items()}
    assert got == {0: set(), 1: set(range(7))}, got  # without the fix: GPU 0's seven 1g counted too
    # Job 1g@0 of GPU 0 ends: Slurm's count has room for a 1g only if it counted GPU 0's; job 9's Prolog there
    # is refused.
    observed = _two_gpus_of_busy_1g(rig, idle={(0, 0)})
    assert rig.expected_gres("n1")["1g"] == 7
    status, resp = post(rig, "/v1/prolog", {"job_id": "9", "node": "n1", "observed": observed, "bindings": {}})
    assert status == 200 and resp["action"] == "requeue" and "held for waiting job(s) 8" in resp["reason"], resp


def test_lowering_the_counts_from_a_prolog_waits_for_a_gres_write_under_way(rig):
    """lower_held_counts runs in a Prolog's thread beside the tick. Reading the counts while the tick's withdrawal
    step was writing lower ones, it could write its own higher ones after them, advertising instances a re-carve
    was about to destroy (found in review). It now reads and writes under the lock every count write holds."""
    import threading

    from slurm_mig.errors import SlurmCommandError

    t, jobs, node = _seven_busy_1g(rig)
    busy = set(range(7))
    node["gres"] = {"1g": 7, "pad": 0}
    good = rig.fake.update_node_gres
    rig.fake.update_node_gres = lambda n, counts, **kw: (_ for _ in ()).throw(SlurmCommandError("busy"))
    rig.tick()  # reads Slurm's seven, cannot write
    rig.fake.update_node_gres = good
    _end(rig, t, jobs, node, 1, busy)
    with rig._gres_lock:  # a count write under way
        worker = threading.Thread(target=rig.lower_held_counts, args=("n1", t[0]))
        worker.start()
        worker.join(0.3)
        assert worker.is_alive() and node["gres"]["1g"] == 7  # without the lock: written already
    worker.join(5)
    assert not worker.is_alive() and node["gres"]["1g"] == 0, node


def test_the_tick_works_out_each_nodes_counts_under_the_lock_it_writes_them_under(rig):
    """A Prolog's lower_held_counts (its own thread) takes the lock every count write holds. The tick's _assert_gres
    and its withdrawal step worked the counts out before taking it, so a lowering between the two was undone by
    counts worked out before it, until the next tick (found in review). Each node's counts are now worked out
    under the lock too: every intended_layouts those steps ask is asked holding it."""
    import sys

    t, jobs, node = _seven_busy_1g(rig)
    asked = []
    orig = rig.intended_layouts

    def watched(name, **kw):
        caller = sys._getframe(1).f_code.co_name
        if caller in ("_assert_node_gres", "_assert_gres", "_shrinking", "_withdraw_first"):
            asked.append((caller, rig._gres_lock._is_owned()))
        return orig(name, **kw)

    rig.intended_layouts = watched
    busy = set(range(7))
    _end(rig, t, jobs, node, 1, busy)  # a tick with the held region's counts to set
    rig.tick()
    callers = {c for c, _owned in asked}
    assert {"_shrinking"} <= callers and callers & {"_assert_node_gres", "_assert_gres"}, asked
    assert all(owned for _c, owned in asked), asked  # without the fix: computed outside the lock


def test_idle_instances_in_a_held_region_stay_out_of_the_counts_while_another_re_carve_of_the_gpu_waits(rig):
    """n1's H100 holds seven 1g, job 1 runs on 1g@0; job 8 (4g) waits for slices 0-3 and job 9 (3g) is placed on
    3g@4, carved out of the idle 1g@4-6. Until the node reports that re-carve done the GPU's desired layout
    differs from what exists, and every instance it keeps counted as part of the re-carve: the idle 1g@1-3 in
    job 8's region were told to Slurm (1g:4), which started 1g jobs there that no Prolog may bind (and
    lower_held_counts could not lower a count intended_layouts still gave). Only the instances the re-carve makes
    are exempt now: 1g:0 (job 1's busy 1g is absorbed, as the node has no idle 1g outside the region)."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    rig.store.replace_observed("n1", H100, [{**i, "in_use": False} for i in ONE_G], now=t[0])

    def job(i, size, prio, **kw):
        return SlurmJob(job_id=i, name="x", user="u", mig={size: 1}, tres_per_node=f"gres:mig:{size}:1",
                        submit_time=int(t[0]) - 100 + i, priority=prio, **kw)

    jobs = [job(1, "1g", 1, state="RUNNING", nodes=["n1"], start_time=int(t[0]) - 50, time_limit_min=60,
                end_time=int(t[0]) + 3550),
            job(8, "4g", 100, state="PENDING"), job(9, "3g", 50, state="PENDING", time_limit_min=10)]
    node = _slurm_sees_n1(rig, {"gres": {"1g": 7, "pad": 0}, "used": {"1g": 1}})
    rig.fake.queue = jobs
    rig.tick()
    status, resp = post(rig, "/v1/prolog", {"job_id": "1", "node": "n1", "observed": _observed(set()),
                                            "bindings": {}})
    assert status == 200 and resp["action"] == "bind", resp
    assert post(rig, "/v1/report", {"node": "n1", "observed": _observed({0}), "bindings": {}})[0] == 200
    rig.tick()
    assert [r[:3] for r in rig.store.get_meta("held")["8"]] == [["n1", 0, 0x0F]], rig.store.get_meta("held")
    assert rig.store.desired("n1")[0].spec == "1g@0,1g@1,1g@2,1g@3,3g@4"  # not carried out yet
    assert (node["gres"]["1g"], node["gres"]["3g"]) == (0, 1), node  # without the fix: 1g:4
    got = {(s.profile, s.start) for s in rig.intended_layouts("n1")[0].slots}
    assert got == {("3g.40gb", 4)}, got


def test_busy_instances_in_a_region_held_for_several_of_their_size_are_not_kept_counted(rig):
    """Job 8 asks for two 1g (mig:1g:2) and waits; seven 1g run (job i ends 10 i minutes after its start), job 1
    ended, so the policy holds 1g@0 (idle) and 1g@1 (job 2's, the next to end) for it. The busy 1g@1 was kept
    counted as its holder's size: when job 2 ended Slurm had one 1g free on n1, could not start job 8 (two) on it
    and started job 9, whose Prolog was refused the region (one requeue per such end). A busy instance stays
    counted for its holder's size only where the holder asks for one instance: job 2's end frees nothing in
    Slurm, and the next tick assigns job 8 both, told to Slurm, and its Prolog binds them."""
    t = [time.time()]
    rig.clock = lambda: t[0]
    rig.store.replace_observed("n1", H100, [{**i, "in_use": False} for i in ONE_G], now=t[0])

    def job(i, size, prio, n=1, **kw):
        return SlurmJob(job_id=i, name="x", user="u", mig={size: n}, tres_per_node=f"gres:mig:{size}:{n}",
                        submit_time=int(t[0]) - 100 + i, priority=prio, **kw)

    jobs = {i: job(i, "1g", 1, state="RUNNING", nodes=["n1"], start_time=int(t[0]) - 50, time_limit_min=10 * i,
                   end_time=int(t[0]) - 50 + 600 * i) for i in range(1, 8)}
    jobs[8] = job(8, "1g", 100, 2, state="PENDING")
    jobs[9] = job(9, "1g", 10, state="PENDING")
    node = _slurm_sees_n1(rig, {"gres": {"1g": 7, "pad": 0}, "used": {"1g": 7}})
    rig.fake.queue = list(jobs.values())
    rig.tick()
    for i in range(1, 8):
        status, resp = post(rig, "/v1/prolog", {"job_id": str(i), "node": "n1", "observed": _observed(set()),
                                                "bindings": {}})
        assert status == 200 and resp["instances"] == [{"gpu": 0, "profile": "1g.10gb", "start": i - 1}], resp
    assert post(rig, "/v1/report", {"node": "n1", "observed": _observed(set(range(7))), "bindings": {}})[0] == 200
    rig.tick()
    busy = set(range(7))
    _end(rig, t, jobs, node, 1, busy)
    rig.tick()
    assert rig.store.get_meta("held") == {"8": [["n1", 0, 0x03, [["1g.10gb", 0]], []]]}, rig.store.get_meta("held")
    assert node["gres"]["1g"] == 5, node  # 1g@2-6; without the fix 6 (1g@1 too)
    _end(rig, t, jobs, node, 2, busy)
    assert node["gres"]["1g"] <= node["used"]["1g"], node  # Slurm can start no 1g on n1 (job 9 was)
    rig.tick()
    assert rig.store.get_meta("reservations").get("8") == {"node": "n1", "instances": [[0, "1g.10gb", 0],
                                                                                       [0, "1g.10gb", 1]]}
    assert node["gres"]["1g"] == 7, node
    jobs[8] = SlurmJob(**{**jobs[8].__dict__, "state": "RUNNING", "nodes": ["n1"], "start_time": int(t[0])})
    status, resp = post(rig, "/v1/prolog", {"job_id": "8", "node": "n1", "observed": _observed(busy),
                                            "bindings": {}})
    assert status == 200 and resp["action"] == "bind", resp
    assert {i["start"] for i in resp["instances"]} == {0, 1}, resp


def test_with_the_hold_back_off_a_held_row_left_by_an_earlier_run_holds_nothing(rig):
    """A site turns ``hold_reserved`` off and restarts the controller. The API is served before the first tick
    rewrites the meta row "held" (and between its two transactions), so a Prolog in that window read the row
    the last run left: it was kept off job 8's region and requeued, though no region is held any more, and the
    counts Slurm was told still left the region's idle instances out. With the hold-back off the row is not read."""
    from dataclasses import replace

    rig.cfg = replace(rig.cfg, controller=replace(rig.cfg.controller, hold_reserved=False))
    now = time.time()
    rig.store.replace_observed("n1", H100, [{**i, "in_use": i["start"] != 0} for i in ONE_G], now=now)
    rig.store.upsert_job("8", profile="7g", count=1, submit_time=now, now=now)
    rig.store.set_meta("held", {"8": [["n1", 0, 0xFF, [["1g.10gb", 0]], []]]}, now=now)  # the last run's
    assert len(rig.intended_layouts("n1")[0].slots) == 7  # without the fix: 0
    rig.fake.job_detail = lambda job_id: JobDetail(job_id=int(job_id), user="u", state="RUNNING", nodes=["n1"],
                                                   mig={"1g": 1})
    status, resp = post(rig, "/v1/prolog", {"job_id": "9", "node": "n1", "observed": _observed(set(range(1, 7))),
                                            "bindings": {}})
    assert status == 200 and resp["action"] == "bind", resp  # without the fix: requeued, "held for job(s) 8"
    assert resp["instances"] == [{"gpu": 0, "profile": "1g.10gb", "start": 0}], resp


def test_a_damaged_held_or_reservations_row_does_not_stop_the_ticks(rig):
    """The tick reads the meta rows "held" and "reservations" (for the policy's view of started, unbound jobs)
    before it writes them again, so a row not of the shape it writes (a damaged database, a row of another
    version) failed every tick for ever: AttributeError, ValueError, never rewritten. Such a row, or entry, now
    holds nothing, and the tick writes the rows afresh."""
    now = time.time()
    rig.store.replace_observed("n1", H100, [{**i, "in_use": False} for i in ONE_G], now=now)
    rig.fake.queue = [SlurmJob(job_id=9, name="x", user="u", mig={"1g": 1}, tres_per_node="gres:mig:1g:1",
                               submit_time=1, priority=1, state="RUNNING", nodes=["n1"], start_time=int(now))]
    whole = [["n1", 0, 255, [], []]]
    for held, reservations, counted in [("junk", {}, 7), ([1, 2], {}, 7), ({"8": [["n1", "x", 255, [], []]]}, {}, 7),
                                        ({"8": [["n1", 0, 255, [], [["1g.10gb"]]]]}, {}, 7),
                                        ({"8": [["n1", 0, "ff", [], []]]}, {}, 7), ({"8": "x"}, {}, 7),
                                        ({}, "junk", 7), ({}, {"9": {"node": "n1", "instances": [[0, "1g.10gb"]]}}, 7),
                                        ({"8": whole}, {"9": {"node": "n1", "instances": "x"}}, 0),
                                        ({"8": whole}, {"9": {"node": "n1", "instances": [[0, "1g.10gb", 0]]}}, 1)]:
        rig.store.set_meta("held", held, now=now)
        rig.store.set_meta("reservations", reservations, now=now)
        rig.tick()  # without the fix: all but ({"8": "x"}, {}) and the last three raise
        assert isinstance(rig.store.get_meta("held"), dict) and isinstance(rig.store.get_meta("reservations"), dict)
        rig.store.set_meta("held", held, now=now)
        rig.store.set_meta("reservations", reservations, now=now)
        assert len(rig.intended_layouts("n1")[0].slots) == counted, (held, reservations)


def test_a_holder_that_leaves_the_queue_holds_nothing_from_the_next_tick(rig):
    """Pinned (review of the hold-back; not a fault): job 8, the 7g whose region holds n1's GPU, is cancelled. The
    next tick writes the meta row "held" without it and tells Slurm of every 1g again."""
    t, jobs, node = _seven_busy_1g(rig)
    busy = set(range(7))
    _end(rig, t, jobs, node, 1, busy)
    rig.tick()
    assert "8" in rig.store.get_meta("held") and _gres(rig).get("1g") == 0, rig.fake.calls
    jobs.pop(8)
    rig.fake.queue = list(jobs.values())
    rig.tick()
    assert rig.store.get_meta("held") == {} and _gres(rig).get("1g") == 7, rig.fake.calls


def test_an_a30_region_is_held_by_its_own_geometry(rig):
    """Pinned (review of the hold-back; not a fault): an A30 has four memory slices, no 3g or 7g, and its 4g is the
    whole GPU. A 4g holder's region (0x0F) leaves out its idle 1g and, with no idle 1g elsewhere, its busy ones; a
    2g holder's (0x03) keeps the busy 1g counted where an idle 1g is outside it."""
    now = time.time()
    a30 = [{"gpu": 0, "uuid": "GPU-0", "model": "A30-24GB", "mig_enabled": True}]
    rig.store.replace_observed("n1", a30, [{"gpu": 0, "profile": "1g.6gb", "start": s, "uuid": f"MIG-{s}",
                                            "in_use": s != 3} for s in range(4)], now=now)
    rig.store.upsert_job("8", profile="4g", count=1, submit_time=now, now=now)
    assert rig.intended_layouts("n1", held={"8": [["n1", 0, 0x0F, [], []]]}, assigned=set())[0].slots == frozenset()
    rig.store.upsert_job("8", profile="2g", count=1, submit_time=now, now=now)
    got = rig.intended_layouts("n1", held={"8": [["n1", 0, 0x03, [], []]]}, assigned=set())[0].slots
    assert {s.start for s in got} == {0, 1, 2, 3}, got


def test_the_count_lock_is_never_taken_holding_the_store_lock(rig):
    """The tick works each node's counts out under _gres_lock, asking the store (its lock) while it holds it, and a
    Prolog's lower_held_counts does the same in its own thread: lock, then store. A thread taking the count lock
    while it held the store's (a count write inside a store transaction) would deadlock against them. Pinned over
    ticks that set the counts, a withdrawal and a refused Prolog that lowers them (review, 2026-11-27: none does)."""
    import sys
    import threading

    class Watched:
        def __init__(self, lock):
            self.lock, self.taken = lock, []

        def __enter__(self):
            self.lock.acquire()
            self.taken.append((sys._getframe(1).f_code.co_name, rig.store._lock._owner == threading.get_ident()))
            return self

        def __exit__(self, *exc):
            self.lock.release()

        def _is_owned(self):
            return self.lock._is_owned()

    rig._gres_lock = watched = Watched(rig._gres_lock)
    t, jobs, node = _seven_busy_1g(rig)
    busy = set(range(7))
    _end(rig, t, jobs, node, 1, busy)
    rig.tick()
    node["gres"] = {"1g": 7, "pad": 0}  # a registration; the tick's write fails, a Prolog is refused
    good = rig.fake.update_node_gres
    from slurm_mig.errors import SlurmCommandError

    def failing(n, counts, **kw):
        raise SlurmCommandError("scontrol: slurmctld busy")

    rig.fake.update_node_gres = failing
    rig.tick()
    rig.fake.update_node_gres = good
    _end(rig, t, jobs, node, 2, busy)
    jobs[9] = SlurmJob(**{**jobs[9].__dict__, "state": "RUNNING", "nodes": ["n1"], "start_time": int(t[0])})
    node["used"] = {"1g": 7}
    status, resp = post(rig, "/v1/prolog", {"job_id": "9", "node": "n1", "observed": _observed(busy),
                                            "bindings": {}})
    assert status == 200 and resp["action"] == "requeue", resp
    rig.tick()
    where = {c for c, _held in watched.taken}
    assert {"_write_gres", "_assert_gres", "_withdraw_first", "lower_held_counts"} <= where, watched.taken
    assert not [c for c, held in watched.taken if held], watched.taken
