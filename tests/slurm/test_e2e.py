"""End to end on a real local Slurm cluster: sbatch --gres=mig:... through hooks, controller and (simulated) NVML.

What is checked, as the issue asks:
 (a) a burst of mixed 1g/2g/3g/4g/7g jobs that cannot all fit the starting layouts: every job
     completes, saw a MIG UUID of the profile it asked for, no two concurrent jobs shared an
     instance, layouts changed only on idle slices (and at least once next to a running job),
     every outcome recorded;
 (b) slurmctld restarted mid-run: GRES re-asserted, all jobs complete;
 (c) the controller killed (SIGKILL) mid-run and restarted: it reconciles, all jobs complete;
 (d) a bad request is rejected at submit time with its message.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from slurm_mig.democluster import DemoCluster
from slurm_mig.slurm.gres import PAD_TYPE

pytestmark = pytest.mark.slurm

KIND = {"mig:1g": "1g", "mig:2g": "2g", "mig:3g": "3g", "mig:4g": "4g", "mig:7g": "7g", "mig:1g:2": "1g",
        "mig:3g.40gb": "3g"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory, slurm_installed):
    dc = DemoCluster(tmp_path_factory.mktemp("e2e"), nodes=3, gpus_per_node=2, tick_s=1.0, agent_s=1.0,
                     delay_scale=0.25)
    try:
        dc.start()
        yield dc
    finally:
        dc.stop()


class Watcher(threading.Thread):
    """Samples every node's simulated GPUs and the node-local binding files while jobs run.

    Invariants checked on every sample: every instance a job holds (per the node's binding files,
    written only after the instance exists) exists, is marked in use, and is held by one job only.
    Also records a witness when a GPU's layout changed while another instance on it stayed busy.
    """

    def __init__(self, dc: DemoCluster):
        super().__init__(daemon=True)
        self.dc = dc
        self.stop_flag = threading.Event()
        self.violations: list[str] = []
        self.witness: list[str] = []
        self.samples = 0
        self._last: dict = {}

    def run(self):
        while not self.stop_flag.is_set():
            self.sample()
            time.sleep(0.1)

    def sample(self):
        for node in self.dc.nodes:
            try:
                insts = self.dc.sim_instances(node)
                bdir = self.dc.state / "node" / node / "bindings"
                bindings = {}
                for p in bdir.glob("*.json"):
                    try:
                        bindings[p.stem] = json.loads(p.read_text())["instances"]
                    except (OSError, ValueError):
                        continue  # being replaced right now
                # Re-read the GPUs after the bindings: a binding seen must match GPUs seen later.
                insts = self.dc.sim_instances(node)
            except Exception:
                continue
            holders: dict[str, str] = {}
            for job, held in bindings.items():
                for h in held:
                    if h["uuid"] in holders:
                        self.violations.append(f"{node}: {h['uuid']} held by jobs {holders[h['uuid']]} and {job}")
                    holders[h["uuid"]] = job
                    if h["uuid"] not in insts:
                        # The Epilog may have just released it and the GPU been re-carved: re-check the file.
                        if (self.dc.state / "node" / node / "bindings" / f"{job}.json").exists():
                            self.violations.append(f"{node}: job {job} holds {h['uuid']} which does not exist")
            busy = {u for u in holders if u in insts}
            for gpu in range(self.dc.gpus_per_node):
                layout = frozenset((i["profile"], i["start"]) for u, i in insts.items() if i["gpu"] == gpu)
                kept = {u for u in busy if insts[u]["gpu"] == gpu}
                prev = self._last.get((node, gpu))
                if prev and prev[0] != layout and prev[1] & kept:
                    self.witness.append(f"{node}/{gpu}: {sorted(prev[0])} -> {sorted(layout)} while "
                                        f"{sorted(prev[1] & kept)} stayed busy")
                self._last[(node, gpu)] = (layout, kept)
        self.samples += 1


def _run_burst(dc: DemoCluster, gres_list, seconds: float = 4.0, during=None):
    ids = {}
    for i, gres in enumerate(gres_list):
        ids[dc.sbatch(gres, seconds + (i % 3), name=f"burst{i}")] = gres
    w = Watcher(dc)
    w.start()
    try:
        if during:
            during()
        ok = dc.wait_jobs(list(ids), timeout=240)
    finally:
        w.stop_flag.set()
        w.join()
    time.sleep(2.0)  # the last Epilogs reach the controller
    return ids, ok, w


def _check_jobs(dc: DemoCluster, ids: dict):
    store = dc.store()
    outcomes = {o.job_id: o for o in store.outcomes()}
    for job_id, gres in ids.items():
        out = dc.job_output(job_id)
        cvd = next((l[4:] for l in out.splitlines() if l.startswith("CVD=")), "")
        mig = next((l[4:] for l in out.splitlines() if l.startswith("MIG=")), "")
        want = 2 if gres.endswith(":2") else 1
        uuids = [u for u in cvd.split(",") if u]
        assert len(uuids) == want and all(u.startswith("MIG-") for u in uuids), (job_id, gres, out)
        profiles = [m.split("@")[0] for m in mig.split(",") if m]
        assert len(profiles) == want and all(p.split(".")[0] == KIND[gres] for p in profiles), (job_id, gres, mig)
        assert job_id in outcomes, f"no outcome recorded for job {job_id}"
        o = outcomes[job_id]
        assert o.state == "COMPLETED" and o.exit_code == 0, o
        assert o.profile.split(".")[0] == KIND[gres]
    # Exactly once: one outcome row per job (the table's key), none for jobs never submitted.
    assert len([j for j in outcomes if j in ids]) == len(ids)
    return outcomes


def _no_shared_instances(dc: DemoCluster, ids):
    """No two jobs held the same instance (node, gpu, start) at overlapping times (bindings table)."""
    rows = dc.store()._q("SELECT job_id, node, gpu, start, uuid, bound_at, released_at FROM bindings "
                         "WHERE job_id IN (%s)" % ",".join("?" * len(ids)), list(ids))
    assert rows, "no bindings recorded"
    by_slot: dict = {}
    for r in rows:
        by_slot.setdefault((r["node"], r["gpu"], r["start"]), []).append(r)
    for slot, rs in by_slot.items():
        rs.sort(key=lambda r: r["bound_at"])
        for a, b in zip(rs, rs[1:]):
            assert a["released_at"] is not None and a["released_at"] <= b["bound_at"] + 1e-6, (slot, a, b)


def test_burst_of_mixed_jobs(demo):
    # 2 GPUs x 3 nodes start as 3g+2g+1g: three 7g and three 4g jobs cannot fit without re-carving.
    burst = (["mig:1g"] * 6 + ["mig:2g"] * 4 + ["mig:3g"] * 4 + ["mig:4g"] * 3 + ["mig:7g"] * 3
             + ["mig:1g:2"] * 2 + ["mig:3g.40gb"])
    ids, ok, w = _run_burst(demo, burst)
    assert ok, "jobs still queued after 240 s"
    assert w.samples > 20
    assert not w.violations, w.violations[:5]
    _check_jobs(demo, ids)
    _no_shared_instances(demo, ids)
    # Every reconfiguration the controller planned ended, and the journal says how.
    journal = demo.store().journal_entries(limit=1000)
    assert any(e.state == "done" and e.steps for e in journal)
    assert all(e.state in ("done", "failed", "abandoned", "planned", "in_progress") for e in journal)


def _wait_running(dc: DemoCluster, ids, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = {str(j.job_id): j.state for j in dc.cluster.client().jobs() or [] if str(j.job_id) in ids}
        if len(states) == len(ids) and all(v == "RUNNING" for v in states.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"jobs not all running after {timeout:.0f} s: {states}")


def _wait_bound(dc: DemoCluster, ids, timeout: float = 120.0) -> None:
    """Until every job's binding file is on its node and names instances that exist there and are in use."""
    deadline = time.time() + timeout
    left = set(ids)
    while time.time() < deadline:
        for node in dc.nodes:
            insts = dc.sim_instances(node)
            for job in list(left):
                try:
                    held = json.loads((dc.state / "node" / node / "bindings" / f"{job}.json").read_text())["instances"]
                except (OSError, ValueError, KeyError):
                    continue
                if held and all(insts.get(h["uuid"], {}).get("in_use") for h in held):
                    left.discard(job)
        if not left:
            return
        time.sleep(0.2)
    raise AssertionError(f"jobs not all bound after {timeout:.0f} s: {sorted(left)}")


def test_a_gpu_is_reconfigured_next_to_a_running_job(demo):
    """The point of slurm-mig: a layout changes on idle slices while a job runs beside them. Made certain
    rather than left to a burst's timing (the burst asserted it and, once in a while, had re-carved only
    idle GPUs): every GPU becomes 7g, then holds a running 4g@0 on slices 0-3, and a 1g job comes, which
    only a change of slices 4-6 beside a running 4g can serve."""
    # Six 7g jobs held running at once take one GPU each, so every GPU is 7g when they end. (A burst of
    # 1 s jobs did not make sure of it: under load a GPU could keep the last test's 1g slices beside its
    # 4g, and the 1g job ran there without any change.)
    sevens = [demo.sbatch("mig:7g", 300, name=f"seven{i}") for i in range(6)]
    _wait_bound(demo, sevens)
    subprocess.run(["scancel", *sevens], env=demo.env(), capture_output=True, timeout=30)
    assert demo.wait_jobs(sevens, timeout=60)
    long_jobs = [demo.sbatch("mig:4g", 40, name=f"beside{i}") for i in range(6)]
    # Bound, not just RUNNING: Slurm says RUNNING while the Prolog still carves, and a 4g whose binding file
    # the watcher had not yet seen when the 1g appeared beside it was no witness.
    _wait_bound(demo, long_jobs)
    w = Watcher(demo)
    w.start()
    try:
        small = demo.sbatch("mig:1g", 1, name="small")
        assert demo.wait_jobs([small], timeout=30), "the 1g job did not run beside the 4g jobs"
    finally:
        w.stop_flag.set()
        w.join()
    assert not w.violations, w.violations[:5]
    assert w.witness, "no GPU was reconfigured next to a running job"
    running = {str(j.job_id) for j in demo.cluster.client().jobs() or [] if j.state == "RUNNING"}
    assert set(long_jobs) <= running  # the 1g job ran while every 4g job did
    _check_jobs(demo, {small: "mig:1g"})
    subprocess.run(["scancel", *long_jobs], env=demo.env(), capture_output=True, timeout=30)
    assert demo.wait_jobs(long_jobs, timeout=60)


def _node_gres(dc: DemoCluster) -> dict:
    return {n.name: {t: c for t, c in n.gres.items() if c and t != PAD_TYPE} for n in dc.cluster.client().scontrol_show_nodes() or []
            if n.name in dc.nodes}


def test_slurmctld_restart_mid_run(demo):
    burst = ["mig:7g", "mig:7g", "mig:1g", "mig:2g", "mig:4g", "mig:3g", "mig:1g", "mig:1g"]

    def restart():
        time.sleep(3)
        demo.cluster.restart_slurmctld()

    ids, ok, w = _run_burst(demo, burst, seconds=5, during=restart)
    assert ok
    assert not w.violations, w.violations[:5]
    _check_jobs(demo, ids)
    # After the restart slurm.conf's counts came back; the controller must have set its own again.
    deadline = time.time() + 20
    while time.time() < deadline:
        store = demo.store()
        events = [e for e in store.recent_events(500, kind="gres")]
        if any(e.time > min(o.start_time or 0 for o in store.outcomes() if o.job_id in ids) for e in events):
            break
        time.sleep(1)
    assert events, "GRES never re-asserted"
    from slurm_mig.controller.service import layout_counts  # noqa: F401  (the same rule the controller uses)

    # Slurm's counts now equal what the GPUs carry (or are about to).
    time.sleep(3)
    gres = _node_gres(demo)
    for node in demo.nodes:
        total: dict = {}
        for i in demo.sim_instances(node).values():
            from slurm_mig.slurm.gres import gres_type_for_profile

            t = gres_type_for_profile(i["profile"])
            total[t] = total.get(t, 0) + 1
        assert gres[node] == total, (node, gres[node], total)


def test_controller_killed_and_restarted(demo):
    burst = ["mig:3g", "mig:3g", "mig:7g", "mig:1g", "mig:1g", "mig:2g", "mig:4g", "mig:1g:2"]

    def crash():
        time.sleep(2.5)
        demo.kill_controller()
        time.sleep(4)
        demo.start_controller()

    ids, ok, w = _run_burst(demo, burst, seconds=5, during=crash)
    assert ok
    assert not w.violations, w.violations[:5]
    _check_jobs(demo, ids)
    _no_shared_instances(demo, ids)


def _run_array(dc: DemoCluster, spec: str, tag: str, during=None) -> tuple[str, dict[str, str], "Watcher"]:
    """Submit ``--array=spec`` of mig:1g tasks that print their instance and sleep 4 s; wait for the end.
    Returns the array id, {task id: the job id Slurm ran it as} and the watcher's findings."""
    out = dc.state / "jobs"
    out.mkdir(exist_ok=True)
    res = subprocess.run(["sbatch", "--parsable", f"--array={spec}", "--gres=mig:1g", "--requeue",
                          f"--output={out}/{tag}_%a.out", "--wrap",
                          'echo "CVD=$CUDA_VISIBLE_DEVICES"; echo "MIG=$SLURM_MIG_INSTANCES"; sleep 4'],
                         env=dc.env(), capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    array = res.stdout.strip().split(";")[0]
    w = Watcher(dc)
    w.start()
    try:
        if during:
            during()
        deadline = time.time() + 180
        tasks: dict[str, str] = {}
        while time.time() < deadline:
            jobs = [j for j in dc.cluster.client().jobs() or [] if str(j.array_job_id) == array]
            tasks.update({str(j.array_task_id): str(j.job_id) for j in jobs if j.array_task_id is not None})
            if jobs and all(j.state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") for j in jobs):
                break
            time.sleep(1.0)
        else:
            raise AssertionError("array tasks still queued after 180 s")
    finally:
        w.stop_flag.set()
        w.join()
    time.sleep(2.0)  # the last Epilogs reach the controller
    return array, tasks, w


def _check_array(dc: DemoCluster, array: str, tasks: dict[str, str], n: int, tag: str) -> None:
    store = dc.store()
    for task in range(1, n + 1):
        text = (dc.state / "jobs" / f"{tag}_{task}.out").read_text()
        cvd = next(line[4:] for line in text.splitlines() if line.startswith("CVD="))
        assert cvd.startswith("MIG-") and "1g." in text, text
    # No task's row was left waiting, and none was recorded as cancelled: each became its own job.
    assert not [j.job_id for j in store.jobs() if j.job_id.startswith(f"{array}_")]
    assert sorted(tasks, key=int) == [str(t) for t in range(1, n + 1)]
    outcomes = {o.job_id: o for o in store.outcomes()}
    assert all(outcomes[j].state == "COMPLETED" and outcomes[j].exit_code == 0 for j in tasks.values()), outcomes
    _no_shared_instances(dc, list(tasks.values()))


def test_a_job_array_is_carved_for_task_by_task(demo):
    """squeue lists an array's unsplit tasks as one record: read as one job, the policy carved for one
    task per tick. Each task is a queue entry now, and each ran on an instance of its own."""
    array, tasks, w = _run_array(demo, "1-16", "arr")
    assert not w.violations, w.violations[:5]
    # A decision saw the tasks Slurm could not start on the instances there were (the demo's layouts hold
    # six 1g) as jobs of their own, named as Slurm names them; before, it saw one job, the array record.
    seen = [{p["job_id"] for p in d.inputs.get("pending", [])} for d in demo.store().recent_decisions(200)]
    assert any(len({j for j in s if j.startswith(f"{array}_")}) >= 2 for s in seen), seen[:3]
    _check_array(demo, array, tasks, 16, "arr")


def test_a_throttled_array_survives_a_controller_kill(demo):
    def crash():
        time.sleep(2.5)
        demo.kill_controller()
        time.sleep(4)
        demo.start_controller()

    array, tasks, w = _run_array(demo, "1-12%5", "thr", during=crash)
    assert not w.violations, w.violations[:5]
    _check_array(demo, array, tasks, 12, "thr")
    # Never carved for more tasks than the limit lets run.
    seen = [{p["job_id"] for p in d.inputs.get("pending", [])} for d in demo.store().recent_decisions(500)]
    assert max(len({j for j in s if j.startswith(f"{array}_")}) for s in seen) <= 5


def test_concurrent_steps_asking_one_instance_each_get_different_ones(demo):
    """Slurm tells a task nothing of its step's GRES: two `srun --gres=mig:1g` steps of a mig:1g:2 job both
    saw both instances, and CUDA put both on the first."""
    out = demo.state / "jobs"
    out.mkdir(exist_ok=True)
    script = ("#!/bin/bash\n"
              "show='echo \"S=$SLURM_STEP_ID CVD=$CUDA_VISIBLE_DEVICES\"; sleep 2'\n"
              'srun --gres=mig:1g:1 -n1 --exact bash -c "$show" &\n'
              'srun --gres=mig:1g:1 -n1 --exact bash -c "$show" &\n'
              "wait\n"
              'srun -n1 bash -c "$show"\n')
    (out / "steps.sh").write_text(script)
    res = subprocess.run(["sbatch", "--parsable", "--gres=mig:1g:2", "--ntasks=2", f"--output={out}/steps_%j.out",
                          str(out / "steps.sh")], env=demo.env(), capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    assert demo.wait_jobs([job], timeout=120)
    lines = dict(line.split(" ", 1) for line in (out / f"steps_{job}.out").read_text().splitlines()
                 if line.startswith("S="))
    one, two, both = lines["S=0"], lines["S=1"], lines["S=2"]
    assert one.startswith("CVD=MIG-") and "," not in one and two.startswith("CVD=MIG-") and "," not in two
    assert one != two
    # A step run without --gres holds the job's instances, as Slurm gives it the job's request.
    assert sorted(both[4:].split(",")) == sorted([one[4:], two[4:]])


def test_bad_request_rejected_at_submit(demo):
    for gres, msg, extra in [("mig:5g", "5g", []), ("mig:3g:99", "99", []), ("mig:abc", "abc", []),
                             ("mig:1g", "one node", ["--nodes=2"])]:
        res = subprocess.run(["sbatch", f"--gres={gres}", *extra, "--wrap", "true"], env=demo.env(),
                             capture_output=True, text=True, timeout=30)
        assert res.returncode != 0
        assert "slurm-mig" in res.stderr and msg in res.stderr, res.stderr


def test_a_job_is_carved_for_only_on_nodes_slurm_may_start_it_on(demo):
    """Carved on a node Slurm would not start it on, a job waited (ReqNodeNotAvail) beside idle nodes it
    could use: a `--exclude` job, and a job without a time limit on a node under a maintenance window."""
    env = demo.env()

    def scontrol(*args):
        res = subprocess.run(["scontrol", *args], env=env, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr

    def submit(*args):
        res = subprocess.run(["sbatch", "--parsable", "--gres=mig:4g", *args, "--wrap", "sleep 3"], env=env,
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip().split(";")[0]

    scontrol("create", "reservation", "ReservationName=e2e_maint", "Users=root", "Nodes=n1", "StartTime=now+3600",
             "Duration=60", "Flags=MAINT")
    try:
        # No 4g exists yet: the policy carves. n1 is under the window (the job has no limit), n2 excluded.
        unlimited = submit("--exclude=n2")
        # Ends long before the window: n1 is one of its nodes.
        short = submit("--exclude=n2,n3", "--time=10")
        assert demo.wait_jobs([unlimited, short], timeout=90), demo.squeue()
    finally:
        scontrol("delete", "ReservationName=e2e_maint")
    store = demo.store()
    try:
        assert store.get_job(unlimited).node == "n3" and store.get_job(short).node == "n1"
        assert all(store.get_job(j).state == "COMPLETED" for j in (unlimited, short))
    finally:
        store.close()


def test_a_request_updated_while_pending_is_bound_as_slurm_allocated_it(demo):
    """`scontrol update JobId=N Gres=...` on a pending job, then its start before a tick saw the update: the
    Prolog bound the request the last tick had stored (two 1g for a job Slurm counted one), taking a slice
    Slurm gives to the next job. Held jobs are updated and released together, so that some start within the
    tick (1 s here) that follows; each must see exactly the instances Slurm allocated."""
    env = demo.env()
    out = demo.state / "jobs"
    out.mkdir(exist_ok=True)
    script = 'echo "CVD=$CUDA_VISIBLE_DEVICES"; echo "MIG=$SLURM_MIG_INSTANCES"; sleep 2'
    ids = []
    for i in range(3):
        res = subprocess.run(["sbatch", "--parsable", "-H", "--gres=mig:1g:2", f"--job-name=upd{i}",
                              f"--output={out}/%j.out", "--wrap", script], env=env, capture_output=True,
                             text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        ids.append(res.stdout.strip().split(";")[0])
    store = demo.store()
    deadline = time.monotonic() + 20
    while not all(store.get_job(j) is not None and store.get_job(j).count == 2 for j in ids):
        assert time.monotonic() < deadline, "the controller never stored the held jobs"
        time.sleep(0.2)
    for j in ids:
        res = subprocess.run(["scontrol", "update", f"JobId={j}", "Gres=mig:1g:1"], env=env, capture_output=True,
                             text=True, timeout=30)
        assert res.returncode == 0, res.stderr
    res = subprocess.run(["scontrol", "release", *ids], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert demo.wait_jobs(ids, timeout=120)
    for j in ids:
        text = demo.job_output(j)
        cvd = next((l[4:] for l in text.splitlines() if l.startswith("CVD=")), "")
        assert len([u for u in cvd.split(",") if u]) == 1, (j, text)
        assert [(b.profile.split(".")[0]) for b in demo.store().bound_instances(j)] in ([], ["1g"]), j
        outcome = next(o for o in demo.store().outcomes() if o.job_id == j)
        assert outcome.count == 1 and outcome.state == "COMPLETED", outcome
