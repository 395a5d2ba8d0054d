"""slurm-mig against a real Slurm 22.05 cluster on this machine (see conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from slurm_mig.errors import SlurmCommandError
from slurm_mig.slurm import gres
from slurm_mig.slurm.localcluster import LocalCluster

pytestmark = pytest.mark.slurm

BOOT = {"1g": 4, "2g": 2, "3g": 2}  # 2 GPUs x (3g+2g+1g+1g)


def _job(slurm, job_id, wait_for, states=("RUNNING", "COMPLETED")):
    return wait_for(lambda: (d := slurm.scontrol_show_job(job_id)) and d.state in states and d,
                    what=f"job {job_id} in {states}")


def _run(slurm_cluster, argv, timeout=30, **kw):
    env = dict(os.environ, **slurm_cluster.env())
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, **kw)


# -- submission and the job_submit.lua rewrite ----------------------------------------


@pytest.mark.parametrize("request_,job_gres", [
    ("mig:3g", "mig:3g:1"),
    ("mig:3g.40gb", "mig:3g:1"),
    ("mig:1g:2", "mig:1g:2"),
    ("mig:1g.10gb:2", "mig:1g:2"),
])
def test_sbatch_gres_is_rewritten_and_runs(slurm, job_dir, wait_for, request_, job_gres):
    job_id = slurm.sbatch(wrap="sleep 2", gres=request_, args=["-o", str(job_dir / "%j.out"), "-J", "t"])
    d = _job(slurm, job_id, wait_for)
    assert d.job_gres_raw == job_gres
    assert d.tres_per_node == f"gres:{job_gres}"
    (node,) = d.nodes
    assert d.node_gres == {node: gres.parse_node_gres(job_gres)}
    jobs = {j.job_id: j for j in slurm.jobs()}
    assert jobs[job_id].mig == gres.parse_node_gres(job_gres)


def test_wrap_job_completes_and_writes_output(slurm, job_dir, wait_for):
    out = job_dir / "wrap.out"
    job_id = slurm.sbatch(wrap="echo hello from $SLURM_JOB_ID", gres="mig:2g", args=["-o", str(out)])
    _job(slurm, job_id, wait_for, states=("COMPLETED",))
    assert out.read_text().strip() == f"hello from {job_id}"


def test_sbatch_script_on_stdin(slurm, job_dir, wait_for):
    script = "#!/bin/sh\n#SBATCH --gres=mig:1g\necho script $SLURM_JOB_NAME\n"
    out = job_dir / "s.out"
    job_id = slurm.sbatch(script_text=script, args=["-o", str(out), "-J", "stdin"])
    d = _job(slurm, job_id, wait_for, states=("COMPLETED",))
    assert d.tres_per_node == "gres:mig:1g:1"
    assert out.read_text().strip() == "script stdin"


def test_jobs_without_mig_pass_through(slurm, job_dir, wait_for):
    job_id = slurm.sbatch(wrap="true", args=["-o", str(job_dir / "p.out")])
    d = _job(slurm, job_id, wait_for, states=("COMPLETED",))
    assert d.tres_per_node == "" and d.job_gres == {}


def test_a_newline_in_a_jobs_own_text_forges_no_mig_request(slurm, job_dir, wait_for):
    """Slurm 22.05 takes a newline in a job's name, comment and output path, and scontrol show job prints
    it as it is: a line of the user's making (`   TresPerNode=gres:mig:7g:1`) that parse_scontrol_jobs
    reads as the job's request. job_detail, which the controller and the Prolog ask, reads squeue fields
    no user writes: the job asked for one 1g, or for nothing, and that is what it is said to ask for."""
    forged = "x\n   TresPerNode=gres:mig:7g:1\n   NodeList=n9"
    asks = slurm.sbatch(wrap="sleep 30", gres="mig:1g", args=["-H", "-J", forged, "--comment", forged])
    plain = slurm.sbatch(wrap="true", args=["-H", "-J", forged, "-o", str(job_dir / "x\n   TresPerNode=gres:mig:7g:1")])
    try:
        assert slurm.scontrol_show_job(plain).mig == {"7g": 1}  # the text form is fooled: why it is not asked
        for job_id, mig in ((asks, {"1g": 1}), (plain, {})):
            d = slurm.job_detail(job_id)
            assert d is not None and (d.job_id, d.mig, d.nodes, d.state) == (int(job_id), mig, [], "PENDING"), d
    finally:
        slurm.scancel(asks)
        slurm.scancel(plain)


@pytest.mark.parametrize("request_,message", [
    ("mig:5g", "unknown MIG size '5g'"),
    ("mig:8g", "unknown MIG size '8g'"),
    ("mig:0g", "unknown MIG size '0g'"),
    ("mig:3g:99", "holds at most 4 (2 per GPU x 2 GPUs)"),
    ("mig:abc", "unknown MIG size 'abc'"),
    ("mig:3g:0", "at least 1"),
    ("mig", "does not name a MIG size"),
    ("mig:2", "does not name a MIG size"),
    ("mig:3g,mig:1g:2", "one MIG size (got mig:3g and mig:1g)"),
])
def test_sbatch_rejects_with_readable_message(slurm, request_, message):
    with pytest.raises(SlurmCommandError) as exc:
        slurm.sbatch(wrap="true", gres=request_)
    assert "sbatch: error: slurm-mig: " in exc.value.stderr
    assert message in exc.value.stderr


@pytest.mark.parametrize("request_", ["mig:", "mig::1"])
def test_sbatch_itself_rejects_empty_fields(slurm, request_):
    """Slurm fact: sbatch refuses an empty GRES field before job_submit.lua ever sees it."""
    with pytest.raises(SlurmCommandError) as exc:
        slurm.sbatch(wrap="true", gres=request_)
    assert "Invalid generic resource (gres) specification" in exc.value.stderr


def test_srun_and_salloc_paths(slurm_cluster):
    # srun creating its own allocation, with an explicit count.
    r = _run(slurm_cluster, ["srun", "--gres=mig:1g:1", "sh", "-c", "echo srun-ok $SLURM_JOB_ID"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("srun-ok ")
    # salloc with the short form; a step inside the allocation inherits it.
    r = _run(slurm_cluster, ["salloc", "--gres=mig:3g", "srun", "echo", "salloc-ok"])
    assert r.returncode == 0, r.stderr
    assert "salloc-ok" in r.stdout and "Granted job allocation" in r.stderr
    # Rejections reach srun and salloc users too.
    r = _run(slurm_cluster, ["srun", "--gres=mig:5g", "true"])
    assert r.returncode != 0 and "srun: error: slurm-mig: unknown MIG size '5g'" in r.stderr
    r = _run(slurm_cluster, ["salloc", "--gres=mig:8g", "true"])
    assert r.returncode != 0 and "salloc: error: slurm-mig: unknown MIG size '8g'" in r.stderr


def test_srun_short_form_gets_its_step(slurm_cluster):
    """``srun --gres=mig:3g cmd`` outside an allocation: job_submit.lua rewrites the job's request, but
    srun sends the option again for the *step*, which Slurm read as 3 GiB ("gres_per_node=mig:3221225472",
    "Unable to create step"). etc/cli_filter.lua rewrites both on the client."""
    for form in ("mig:3g", "mig:3g.40gb", "mig:1g:2"):
        r = _run(slurm_cluster, ["srun", f"--gres={form}", "sh", "-c", "echo step-ok $SLURM_STEP_ID"])
        assert r.returncode == 0, (form, r.stderr)
        assert r.stdout.startswith("step-ok "), (form, r.stdout, r.stderr)


# -- node Gres at run time ---------------------------------------------------------------


def test_update_node_gres_is_seen_by_parsers_and_scheduler(slurm, slurm_cluster, job_dir, wait_for):
    try:
        value = slurm.update_node_gres("n3", {"7g": 1, "1g": 0}, pad_to=14)
        assert value == "mig:1g:0,mig:1gme:0,mig:1gdm:0,mig:2g:0,mig:2gme:0,mig:3g:0,mig:4g:0,mig:7g:1,mig:pad:13"
        (n3,) = slurm.scontrol_show_nodes("n3")
        assert n3.gres == {**{t: (1 if t == "7g" else 0) for t in gres.GRES_TYPES}, gres.PAD_TYPE: 13}
        sinfo = {n.name: n for n in slurm.nodes()}
        assert sinfo["n3"].gres["7g"] == 1 and sinfo["n3"].gres["3g"] == 0
        assert sinfo["n1"].gres == {**{t: 0 for t in gres.GRES_TYPES}, **BOOT, gres.PAD_TYPE: 14 - 8}
        # The scheduler uses the new counts at once.
        job_id = slurm.sbatch(wrap="sleep 1", gres="mig:7g", args=["-o", str(job_dir / "7g.out")])
        d = _job(slurm, job_id, wait_for)
        assert d.nodes == ["n3"] and d.job_gres == {"7g": 1}
    finally:
        # reconfigure puts slurm.conf's counts back (runtime Gres updates do not survive it).
        slurm.scontrol_reconfigure()
    wait_for(lambda: (n := slurm.scontrol_show_nodes("n3")) and n[0].gres.get("3g") == 2,
             what="n3 Gres back to slurm.conf after reconfigure")


def test_type_no_node_has_is_rejected_at_submit(slurm):
    """Slurm fact: a type no node advertises with count > 0 is refused at submit time.

    (LocalCluster's capacity_node works around it; see test_capacity_node below.)
    """
    with pytest.raises(SlurmCommandError) as exc:
        slurm.sbatch(wrap="true", gres="mig:4g")
    assert "Requested node configuration is not available" in exc.value.stderr


def test_restart_slurmctld_keeps_jobs_and_nodes_return(slurm, slurm_cluster, job_dir, wait_for):
    job_id = slurm.sbatch(wrap="sleep 30", gres="mig:2g", args=["-o", str(job_dir / "r.out")])
    _job(slurm, job_id, wait_for, states=("RUNNING",))
    old = slurm_cluster.running()["slurmctld"]
    t0 = time.monotonic()
    slurm_cluster.restart_slurmctld(timeout=30)
    elapsed = time.monotonic() - t0
    assert slurm_cluster.running()["slurmctld"] not in (None, old)
    assert slurm.ping()
    d = slurm.scontrol_show_job(job_id)
    assert d.state == "RUNNING" and d.job_gres == {"2g": 1}
    states = slurm_cluster.node_states()
    assert set(states) == {"n1", "n2", "n3"}
    assert elapsed < 20, f"restart took {elapsed:.1f}s"
    slurm.scancel(job_id)


def test_start_is_idempotent(slurm_cluster):
    before = slurm_cluster.running()
    t0 = time.monotonic()
    slurm_cluster.start(wait=True, timeout=30)
    assert slurm_cluster.running() == before
    assert time.monotonic() - t0 < 5


def test_job_update_goes_through_the_same_rules(slurm):
    job_id = slurm.sbatch(wrap="true", gres="mig:1g", args=["-H", "-o", "/dev/null"])
    try:
        # A new count of the same size, in NVIDIA's profile name, is rewritten as at submission.
        slurm.check(["scontrol", "update", f"JobId={job_id}", "Gres=mig:1g.10gb:2"])
        assert slurm.scontrol_show_job(job_id).tres_per_node == "gres:mig:1g:2"
        # Refused, but 22.05 shows no log_user text for updates: an unknown size, and another size (Slurm would
        # keep the old type beside the new one, 24b532b).
        for gres in ("Gres=mig:5g", "Gres=mig:3g.40gb:2"):
            res = slurm.run(["scontrol", "update", f"JobId={job_id}", gres])
            assert res.returncode != 0 and "Unspecified error" in res.stderr, (gres, res.stderr)
            assert slurm.scontrol_show_job(job_id).tres_per_node == "gres:mig:1g:2"
    finally:
        slurm.scancel(job_id)


def test_requeue_and_cancel(slurm, job_dir, wait_for):
    job_id = slurm.sbatch(wrap="sleep 30", gres="mig:1g", args=["-o", str(job_dir / "q.out")])
    _job(slurm, job_id, wait_for, states=("RUNNING",))
    slurm.scontrol_requeue(job_id, hold=True)
    d = wait_for(lambda: (d := slurm.scontrol_show_job(job_id)) and d.state == "PENDING" and d,
                 what="requeued job pending")
    assert d.held
    slurm.scancel(job_id)
    wait_for(lambda: slurm.scontrol_show_job(job_id).state == "CANCELLED", what="cancelled")


def test_a_requeued_job_is_held_back_for_cred_expire(slurm, job_dir, wait_for):
    """What the hooks' hold-back builds on: Slurm itself keeps a requeued job pending (BeginTime) until
    cred_expire (10 s on this cluster) after the requeue. Forcing StartTime=now instead restarted the
    job at once on the node that still cached its credential, where it failed at launch (RunTime 0):
    2 of 6 runs of this file, when this test still did that."""
    job_id = slurm.sbatch(wrap="sleep 30", gres="mig:1g", args=["-o", str(job_dir / "e.out")])
    _job(slurm, job_id, wait_for, states=("RUNNING",))
    before = slurm.job_detail(job_id)
    assert before.fields["Restarts"] == "0", before.fields
    time.sleep(1.1)  # Slurm's times are whole seconds
    requeued_at = time.time()
    slurm.scontrol_requeue(job_id)
    d = wait_for(lambda: (d := slurm.scontrol_show_job(job_id)) and d.state == "PENDING" and d,
                 what="requeued job pending")
    assert d.fields["Reason"] == "BeginTime" and d.fields["Restarts"] == "1", d.fields
    # What tells the job requeued from another job with its id in the Prolog (controller.runs.was_requeued): squeue -j's
    # restart count, where the submit time is the requeue's.
    after = slurm.job_detail(job_id)
    assert after.fields["Restarts"] == "1" and after.fields["SubmitTime"] > before.fields["SubmitTime"], \
        (before.fields, after.fields)
    eligible = time.mktime(time.strptime(d.fields["EligibleTime"], "%Y-%m-%dT%H:%M:%S"))
    assert eligible >= int(requeued_at) + 10, (d.fields["EligibleTime"], requeued_at)
    slurm.scancel(job_id)


def test_query_failure_returns_none_and_check_raises(tmp_path, slurm_installed):
    from slurm_mig.slurm.runner import SlurmClient

    # A slurm.conf pointing at a controller that is not there.
    conf = tmp_path / "slurm.conf"
    # MessageTimeout=1: clients otherwise retry the dead port for ~9 s.
    conf.write_text("ClusterName=none\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1\n"
                    "AuthType=auth/none\nMessageTimeout=1\nNodeName=x CPUs=1\nPartitionName=p Nodes=x\n")
    bad = SlurmClient(slurm_conf=str(conf), timeout=10)
    # squeue --json exits 0 here, with "errors" and an empty list: the client must say None.
    assert bad.run(["squeue", "--json"]).ok
    assert bad.jobs() is None and bad.nodes() is None and bad.scontrol_show_job(1) is None
    assert not bad.ping()
    with pytest.raises(SlurmCommandError):
        bad.scontrol_reconfigure()


# -- the CLI and the capacity node ------------------------------------------------------


def test_a_failed_start_stops_what_it_started(tmp_path_factory, monkeypatch, slurm_installed):
    """munged up, then slurmctld fails: start() used to raise and leave munged running (a failed
    `slurm-mig cluster up`, or `with LocalCluster()`, whose __exit__ does not run then)."""
    from slurm_mig.errors import SlurmMigError
    from slurm_mig.slurm.localcluster import _pid_alive

    c = LocalCluster(tmp_path_factory.mktemp("half-cluster"), nodes=1)
    started = {}
    real_munge = c._start_munge

    def start_munge():
        real_munge()
        started["munged"] = c._read_pid("munged")

    def failing_slurmctld(clear_state):
        raise SlurmMigError("injected: slurmctld did not start")

    monkeypatch.setattr(c, "_start_munge", start_munge)
    monkeypatch.setattr(c, "_start_slurmctld", failing_slurmctld)
    try:
        with pytest.raises(SlurmMigError, match="injected"):
            c.start(timeout=10)
        assert started["munged"] and not _pid_alive(started["munged"])
        assert not any(c.running().values())
        assert (c.state_dir / "log").is_dir()  # kept for the error to point at
    finally:
        c.stop(purge=True)


def test_cli_up_capacity_node_status_down(tmp_path_factory, capsys, wait_for, slurm_installed):
    from slurm_mig.cli import main

    state = tmp_path_factory.mktemp("cli-cluster")
    common = ["--state-dir", str(state), "--json"]
    try:
        assert main(["cluster", "up", "--nodes", "1", "--capacity-node", "cap", *common]) == 0
        up = json.loads(capsys.readouterr().out)
        assert up["up"] and up["nodes"]["n1"] == "idle" and up["seconds"] < 30
        assert up["nodes"]["cap"].startswith("drain")
        c = LocalCluster(state, nodes=1, capacity_node="cap")
        slurm = c.client()
        # No real node has a 4g, yet the job is accepted and waits...
        job_id = slurm.sbatch(wrap="sleep 1", gres="mig:4g", args=["-o", "/dev/null"])
        d = wait_for(lambda: (d := slurm.scontrol_show_job(job_id)) and d.reason.startswith("ReqNodeNotAvail")
                     and d, what="job waiting for the placeholder")
        assert d.state == "PENDING" and not d.held
        # ...and starts as soon as a node offers the type.
        slurm.update_node_gres("n1", {"4g": 1, "3g": 1})
        d = wait_for(lambda: (d := slurm.scontrol_show_job(job_id)) and d.state in ("RUNNING", "COMPLETED")
                     and d, timeout=10, what="job started after the Gres update")
        assert d.nodes == ["n1"]
        assert main(["cluster", "status", *common]) == 0
        st = json.loads(capsys.readouterr().out)
        assert st["up"] and set(st["daemons"]) == {"munged", "slurmctld", "slurmd-n1"}
    finally:
        assert main(["cluster", "down", *common]) == 0
    capsys.readouterr()
    pids = [p for p in up["daemons"].values() if p]
    assert pids and not any(os.path.exists(f"/proc/{p}") for p in pids)
    assert main(["cluster", "status", "--state-dir", str(state)]) == 1


def test_hooks_from_snippet_run_with_extra_env(tmp_path_factory, wait_for, slurm_installed):
    """Prolog/Epilog/TaskProlog lines of etc/slurm.conf.snippet, pointed at stand-in hooks."""
    d = tmp_path_factory.mktemp("hooks")
    os.chmod(d, 0o755)
    hooks = {}
    for key, body in {
        "prolog": 'env | sort > "$HOOK_OUT/prolog.$SLURM_JOB_ID"\n',
        "epilog": 'echo "$SLURM_JOB_EXIT_CODE" > "$HOOK_OUT/epilog.$SLURM_JOB_ID"\n',
        "taskprolog": 'echo "export FROM_TASKPROLOG=yes-$HOOK_TAG"\n',
    }.items():
        path = d / key
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        hooks[key] = path
    c = LocalCluster(tmp_path_factory.mktemp("hook-cluster"), nodes=1, hooks=hooks,
                     hook_env={"HOOK_OUT": str(d), "HOOK_TAG": "a b'c"})
    try:
        c.start(timeout=30)
        conf = (c.state_dir / "etc" / "slurm-mig.conf").read_text()
        assert "PrologFlags=Alloc" in conf and "GresTypes=mig" in conf and "JobSubmitPlugins=lua" in conf
        slurm = c.client()
        out = d / "job.out"
        job_id = slurm.sbatch(wrap="echo $FROM_TASKPROLOG", gres="mig:3g", args=["-o", str(out)])
        wait_for(lambda: (d2 := slurm.scontrol_show_job(job_id)) and d2.state == "COMPLETED",
                 what="hooked job completed")
        assert out.read_text().strip() == "yes-a b'c"
        prolog_env = (d / f"prolog.{job_id}").read_text()
        assert f"SLURM_JOB_ID={job_id}" in prolog_env and "SLURMD_NODENAME=n1" in prolog_env
        wait_for(lambda: (d / f"epilog.{job_id}").exists(), what="epilog ran")
        # PrologFlags=Alloc: salloc gets its Prolog at allocation time too.
        r = _run(c, ["salloc", "--gres=mig:1g", "sh", "-c", "echo $SLURM_JOB_ID"])
        assert r.returncode == 0, r.stderr
        assert (d / f"prolog.{r.stdout.strip()}").exists()
    finally:
        c.stop(purge=True)
