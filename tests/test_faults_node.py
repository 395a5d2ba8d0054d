"""Fault injection on a node: the real hooks (through hooks.main, as Slurm runs them) against a real
Controller + ApiServer (HMAC) + state database in this process, with simulated MIG GPUs.

Each fault must end in (a) exit status 0, so Slurm never drains the (healthy) node, (b) a clear log
line naming the fault, (c) a safe state: the job either bound to instances that exist, or requeued
with an AdminComment reason, no busy instance destroyed, no binding left that nothing holds, the
journal entry closed as failed, and (d) for an Epilog, the job's outcome recorded or queued.

NVML faults come from the simulated GPU's fault hooks (fail_next, lose_gpu, delays); node-file
faults are damaged binding and outbox files; Slurm's own part (requeue) is recorded, not run.
"""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from slurm_mig.api.auth import HmacAuth, create_key, load_key
from slurm_mig.api.server import ApiServer
from slurm_mig.config import Config
from slurm_mig.controller.service import Controller
from slurm_mig.mig.layout import Slot
from slurm_mig.node import epilog, hooks, layoutcache, prolog, taskprolog
from slurm_mig.node.healthcheck import healthcheck
from slurm_mig.nvml.simulated import SimulatedBackend, init_state
from slurm_mig.store import open_store

LAYOUT = "3g@0,2g@4,1g@6"
_JOB_REQUEST = prolog._job_request  # the real one; the rig answers for it


class StubSlurm:
    """slurmctld as the controller sees it: the jobs we say exist; commands recorded, none run."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.queue: list = []  # SlurmJob records squeue lists
        self.details: dict = {}  # job id -> JobDetail for scontrol show job

    def jobs(self):
        return list(self.queue)

    def reservations(self):
        return []

    def nodes(self):
        return []

    def job_detail(self, job_id):
        return self.details.get(str(job_id))

    def scontrol_requeue(self, job_id, **kw):
        self.calls.append(("requeue", str(job_id)))

    def update_node_gres(self, node, counts, **kw):
        self.calls.append(("gres", node))
        return ""

    def update_node_state(self, node, state, reason=None):  # pragma: no cover - must never be called
        self.calls.append(("state", node, state))
        raise AssertionError(f"slurm-mig tried to set {node} {state}")


class Rig:
    def __init__(self, tmp_path, monkeypatch, *, delay_scale: float = 0.0, timeout_s: float = 5.0):
        self.tmp = tmp_path
        self.store = open_store(tmp_path / "state.db")
        self.slurm = StubSlurm()
        self.ctl = Controller(Config(), self.store, self.slurm)
        key = tmp_path / "hmac.key"
        create_key(str(key))
        self.errors: list[str] = []
        self.srv = ApiServer("127.0.0.1", 0, HmacAuth(load_key(str(key))), self.ctl.routes(), self.ctl.get_routes(),
                             on_error=lambda kind, msg: self.errors.append(kind)).start()
        host, port = self.srv.address
        self.sim_path = tmp_path / "gpus" / "n1.json"
        init_state(self.sim_path, [("H100-80GB", 2)], layouts={0: LAYOUT, 1: LAYOUT}, seed="n1")
        self.gpu = SimulatedBackend(self.sim_path)
        self.config = tmp_path / "slurm-mig.toml"
        self.config.write_text(f"""
[controller]
db_path = "{tmp_path}/unused.db"
[node]
controller_url = "http://{host}:{port}"
request_timeout_s = {timeout_s}
cache_dir = "{tmp_path}/node"
nvml_backend = "simulated"
sim_state_path = "{tmp_path}/gpus/{{node}}.json"
sim_delay_scale = {delay_scale}
[auth]
method = "hmac"
hmac_key_file = "{key}"
[log]
level = "INFO"
""")
        self.scontrol: list[tuple[str, ...]] = []
        monkeypatch.setenv("SLURM_MIG_CONFIG", str(self.config))
        monkeypatch.setenv("SLURMD_NODENAME", "n1")
        # The hooks' own Slurm commands (the requeue and its AdminComment) are recorded, not run.
        from slurm_mig.slurm.runner import SlurmClient, SlurmResult

        self.squeue: str | None = ""  # what `squeue -w n1 ...` prints; None: it fails (slurmctld down)

        def run(client, argv, **kw):
            self.scontrol.append(tuple(argv))
            if argv[0] == "squeue":
                if self.squeue is None:
                    return SlurmResult(tuple(argv), 1, "", "slurm_load_jobs error: Unable to contact slurm "
                                       "controller (connect failure)", 0.0)
                return SlurmResult(tuple(argv), 0, self.squeue, "", 0.0)
            if tuple(argv[:3]) == ("scontrol", "show", "config"):
                return SlurmResult(tuple(argv), 0, "AuthInfo = socket=/run/munge.sock,cred_expire=10\n", "", 0.0)
            return SlurmResult(tuple(argv), 0, "", "", 0.0)

        monkeypatch.setattr(SlurmClient, "run", run)
        # Without the controller, the Prolog reads the job's request from Slurm: answer for it.
        monkeypatch.setattr(prolog, "_job_request", lambda node, job_id: self.requests.get(job_id))
        self.requests: dict[str, dict[str, int]] = {}
        self.monkeypatch = monkeypatch
        self.report()

    def close(self):
        self.srv.stop()
        self.store.close()

    @property
    def requeues(self) -> list[tuple[str, str]]:
        """(job id, AdminComment reason) of each requeue the hooks made."""
        out, comment = [], {}
        for argv in self.scontrol:
            if argv[:2] == ("scontrol", "update") and argv[3].startswith("AdminComment=slurm-mig: "):
                comment[argv[2].split("=", 1)[1]] = argv[3][len("AdminComment=slurm-mig: "):]
            elif argv[:2] == ("scontrol", "requeue"):
                out.append((argv[2], comment.get(argv[2], "")))
        return out

    def job(self, job_id: str, kind: str, count: int = 1) -> None:
        self.store.upsert_job(job_id, profile=kind, count=count, user="alice", name="fuzz")
        self.requests[job_id] = {kind: count}

    def hook(self, kind: str, job_id: str | None = None, **env) -> int:
        for k in ("SLURM_JOB_ID", "SLURM_JOB_UID", "SLURM_JOB_EXIT_CODE", "SLURM_JOB_DERIVED_EC"):
            self.monkeypatch.delenv(k, raising=False)
        if job_id is not None:
            self.monkeypatch.setenv("SLURM_JOB_ID", job_id)
            self.monkeypatch.setenv("SLURM_JOB_UID", "0")
        for k, v in env.items():
            self.monkeypatch.setenv(k, v)
        return hooks.main([kind])

    def report(self) -> int:
        return self.hook("healthcheck")

    def binding_file(self, job_id: str):
        """The TaskProlog's copy of the job's binding."""
        return self.tmp / "node" / "n1" / "bindings" / f"{job_id}.json"

    def record_file(self, job_id: str):
        """The root-only binding record the root hooks trust."""
        return self.tmp / "node" / "n1" / "records" / f"{job_id}.json"

    def layout(self, gpu: int) -> set[str]:
        return {f"{i.slot.profile}@{i.slot.start}" for i in self.gpu.instances(gpu)}

    def live(self, job_id: str):
        return self.store.bound_instances(job_id)


@pytest.fixture
def rig(tmp_path, monkeypatch):
    r = Rig(tmp_path, monkeypatch)
    yield r
    r.close()


def _run_job(rig: Rig, job_id: str, kind: str, *, exit_code: str = "0") -> None:
    rig.job(job_id, kind)
    assert rig.hook("prolog", job_id) == 0
    assert rig.hook("epilog", job_id, SLURM_JOB_EXIT_CODE=exit_code) == 0


class FakeClock:
    """The Epilog's ``time`` module with a clock that moves only when a hook sleeps: the Epilog's wait is
    measured in the seconds it would take, however fast this machine is. ``at(t, fn)`` runs ``fn`` once the
    clock reaches ``t`` (a job's leftover processes exiting); wall-clock time (end_time) stays real."""

    def __init__(self):
        self.now = 0.0
        self.slept = 0.0
        self.events: list = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds
        due = [e for e in self.events if e[0] <= self.now]
        self.events = [e for e in self.events if e[0] > self.now]
        for _, fn in due:
            fn()

    def at(self, t: float, fn) -> None:
        self.events.append((t, fn))

    def __getattr__(self, name):
        return getattr(time, name)


# -- the baseline: no fault ---------------------------------------------------------------

def test_a_job_without_faults_binds_runs_and_records_once(rig):
    rig.job("1", "7g")
    assert rig.hook("prolog", "1") == 0
    assert rig.requeues == []
    assert rig.layout(0) == {"7g.80gb@0"} or rig.layout(1) == {"7g.80gb@0"}
    assert rig.binding_file("1").exists() and len(rig.live("1")) == 1
    assert rig.hook("epilog", "1", SLURM_JOB_EXIT_CODE="0") == 0
    assert rig.store.outcome("1").state == "COMPLETED"
    assert not rig.binding_file("1").exists() and rig.live("1") == ()
    assert rig.hook("epilog", "1", SLURM_JOB_EXIT_CODE="0") == 0  # Slurm retried the Epilog
    assert len(rig.store.outcomes()) == 1


# -- the controller plans from the layout a node has just made ---------------------------------

def _sim_layout(rig, gpu: int) -> str:
    return ",".join(f"{i.slot.profile.split('.')[0]}@{i.slot.start}"
                    for i in sorted(rig.gpu.instances(gpu), key=lambda i: i.slot.start))


def test_a_health_check_recarve_is_seen_by_the_next_tick_not_the_next_report(rig):
    """The health check applies a desired layout and says so (/v1/applied), which closes the journal
    entry. The controller used to keep the report it got before the apply for up to a health-check
    interval (30 s by default): the policy saw the old instances and planned re-carves from them that
    failed on the node ("would destroy busy instance(s)", seen 4 times in a row in a demo run)."""
    rig.store.set_desired("n1", 1, "1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6", "test")
    assert rig.report() == 0
    assert _sim_layout(rig, 1) == "1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6"  # the node did it
    assert str(rig.store.observed_layout("n1", 1)) == "1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6"
    g = next(g for g in rig.store.cluster_state().gpus if g.node == "n1" and g.index == 1)
    assert str(g.layout) == "1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6" and not g.busy


def test_a_prolog_recarve_is_stored_with_its_binding(rig):
    """A Prolog that re-carves for its job (here 4g@0 out of 3g@0, leaving the rest of the GPU as the
    controller's target has it) reports the layout it made with /v1/bound."""
    rig.job("1", "4g")
    assert rig.hook("prolog", "1") == 0 and rig.requeues == []
    (b,) = rig.live("1")
    assert str(rig.store.observed_layout("n1", b.gpu)) == _sim_layout(rig, b.gpu)
    assert "4g@0" in _sim_layout(rig, b.gpu) and "3g@0" not in _sim_layout(rig, b.gpu)


def test_an_older_gpu_report_arriving_later_does_not_undo_a_newer_one(rig):
    """A Prolog looks at the GPUs before another Prolog re-carves, and its request arrives after that
    re-carve was stored (or an outbox message is delivered late): the older view is not stored."""
    rig.store.set_desired("n1", 1, "7g@0", "test")
    assert rig.report() == 0 and str(rig.store.observed_layout("n1", 1)) == "7g@0"
    newest = rig.ctl._observed_at["n1"]
    stale = [{"index": 1, "uuid": "GPU-x", "name": "H100", "model": "H100-80GB", "mig_enabled": True,
              "instances": [{"profile": "3g.40gb", "start": 0, "uuid": "MIG-old", "in_use": False}]}]
    rig.ctl.on_report({"node": "n1", "observed": stale, "observed_at": newest - 1, "bindings": {}}, "n1")
    assert str(rig.store.observed_layout("n1", 1)) == "7g@0"
    rig.ctl.on_report({"node": "n1", "observed": stale, "observed_at": newest + 1, "bindings": {}}, "n1")
    assert str(rig.store.observed_layout("n1", 1)) == "3g@0"


def test_a_gpu_whose_mig_mode_changes_at_its_next_reset_is_left_as_it_is(rig):
    """An admin ran `nvidia-smi -i 1 -mig 0` while a job runs on GPU 1: the change waits for a GPU reset.
    The node reported the GPU as plainly MIG on, so the controller went on re-carving it and binding new
    jobs to it. Now the node reports the pending change, and the controller leaves the GPU as it is: no
    layout sent, no policy change or new job there, Slurm told only of the instance its job holds; that
    instance and its job run on."""
    for slot in ("3g@0", "2g@4", "1g@6"):
        rig.gpu.set_in_use(0, slot, "job 8")  # GPU 0 is full
    rig.gpu.set_in_use(1, "3g@0", "job 9")
    rig.gpu.set_mig_mode(1, False, pending=True)
    rig.store.set_desired("n1", 1, "3g@0,3g@4", "test")  # decided before the admin's command
    assert rig.report() == 0
    assert _sim_layout(rig, 1) == "3g@0,2g@4,1g@6"  # the node was not told to re-carve it
    gpu1 = next(g for g in rig.store.observed_gpus("n1") if g.gpu == 1)
    assert gpu1.mig_enabled and gpu1.blocked == "MIG mode changes to off at the next GPU reset"
    assert [g.available for g in rig.store.cluster_state().gpus if g.node == "n1"] == [True, False]
    assert str(rig.ctl.intended_layouts("n1")[1]) == "3g@0"  # GRES: the busy instance only
    rig.job("1", "2g")  # GPU 1's idle 2g@4 is the only 2g on the node
    assert rig.hook("prolog", "1") == 0
    assert ("requeue", "1") in rig.slurm.calls and rig.live("1") == ()
    assert _sim_layout(rig, 1) == "3g@0,2g@4,1g@6" and rig.gpu.owners(1) == {Slot(0, "3g.40gb"): "job 9"}


def test_without_the_controller_no_new_job_is_bound_on_a_gpu_whose_mig_mode_changes_at_its_reset(rig):
    """The admin ran `nvidia-smi -i 1 -mig 0` and waits for GPU 1's jobs to end before resetting it. With the
    controller down, the Prolog's own choice took GPU 1's idle 2g@4 (the only free 2g on the node) and
    started a new job there, which the reset would then take its instance from (or which holds the reset
    back): the admin guide says no new job starts on such a GPU. It is requeued instead."""
    for slot in ("3g@0", "2g@4", "1g@6"):
        rig.gpu.set_in_use(0, slot, "job 8")  # GPU 0 is full
    rig.gpu.set_in_use(1, "3g@0", "job 9")
    rig.gpu.set_mig_mode(1, False, pending=True)
    rig.job("2", "2g")
    rig.srv.stop()
    assert rig.hook("prolog", "2") == 0
    assert not rig.record_file("2").exists()
    assert rig.requeues == [("2", "controller unreachable and no free 1 x 2g instance exists on n1")]
    assert rig.gpu.owners(1) == {Slot(0, "3g.40gb"): "job 9"}


def test_a_gpu_instance_of_a_profile_not_in_our_tables_is_reported_and_never_carved_over(rig):
    """An admin made a GPU instance of a profile our tables do not list (a +gfx variant, a newer driver's)
    on GPU 1's slice 6. The node did not see it, so the controller took slice 6 for free and every carve
    there failed with INSUFFICIENT_RESOURCES, tick after tick. Now the node reports it; the controller
    leaves that GPU as it is (as for a pending MIG mode change) and the instance is never touched."""
    for slot in ("3g@0", "2g@4", "1g@6"):
        rig.gpu.set_in_use(0, slot, "job 8")  # GPU 0 is full
    rig.gpu.destroy(1, Slot(6, "1g"))
    rig.gpu.make_foreign(1, 6, 1, profile_id=47)
    assert rig.report() == 0
    gpu1 = next(g for g in rig.store.observed_gpus("n1") if g.gpu == 1)
    assert gpu1.blocked == "GPU instance(s) of a profile slurm-mig does not know: profile id 47 at 6:1"
    assert [g.available for g in rig.store.cluster_state().gpus if g.node == "n1"] == [True, False]
    rig.job("1", "1g")  # without it, 1g@6 on GPU 1 looked free
    assert rig.hook("prolog", "1") == 0
    assert ("requeue", "1") in rig.slurm.calls and rig.live("1") == ()
    assert [(f.start, f.profile_id) for f in rig.gpu.foreign_instances(1)] == [(6, 47)]
    assert _sim_layout(rig, 1) == "3g@0,2g@4"
    assert not [e for e in _journal(rig) if e[3] == "failed"]


def test_a_gpu_whose_driver_differs_from_our_mig_table_is_left_as_it_is(rig):
    """A driver upgrade that renumbers a profile or takes a placement away: slurm-mig planned from its own
    table, so every carve there failed (or made the wrong size), tick after tick. The node now compares the
    driver's profiles with our table once per GPU and driver version and reports the differences; the
    controller leaves such a GPU as it is (as for a pending MIG mode change). A later driver that agrees
    lifts it."""
    for slot in ("3g@0", "2g@4", "1g@6"):
        rig.gpu.set_in_use(0, slot, "job 8")  # GPU 0 is full
    rig.gpu.destroy(1, Slot(4, "2g"))  # GPU 1: 3g@0, 1g@6 and room for a 2g at 4
    rig.gpu.set_driver_profiles(1, {1: {"placements": [[0, 2], [2, 2]]}}, driver="590.1")  # no 2g at 4
    assert rig.report() == 0
    gpu1 = next(g for g in rig.store.observed_gpus("n1") if g.gpu == 1)
    assert gpu1.blocked == ("the driver's MIG profiles differ from slurm-mig's table (`slurm-mig nvml check-tables` "
                            "on the node): 2g.20gb: placements {0,2}:2, ours {0,2,4}:2")
    assert [g.available for g in rig.store.cluster_state().gpus if g.node == "n1"] == [True, False]
    cache = rig.tmp / "node" / "n1" / "tables.json"
    assert cache.stat().st_mode & 0o777 == 0o600
    assert json.loads(cache.read_text())[rig.gpu.gpus()[1].uuid]["driver"] == "590.1"
    rig.job("1", "2g")  # without the check, 2g@4 on GPU 1 was planned, and the driver refused it
    assert rig.hook("prolog", "1") == 0
    assert ("requeue", "1") in rig.slurm.calls and rig.live("1") == ()
    assert _sim_layout(rig, 1) == "3g@0,1g@6"
    assert not [e for e in _journal(rig) if e[3] == "failed"]

    asked = []
    real = SimulatedBackend.profile_readings
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SimulatedBackend, "profile_readings", lambda self, gpu: asked.append(gpu) or real(self, gpu))
        assert rig.report() == 0
        assert asked == []  # the same driver: read from tables.json, not NVML
        rig.gpu.set_driver_profiles(1, {}, driver="590.2")  # the next driver agrees with our table
        assert rig.report() == 0
        assert sorted(asked) == [0, 1]
    assert all(g.blocked is None for g in rig.store.observed_gpus("n1"))


def test_a_gpu_whose_driver_lists_no_profile_is_asked_once_per_driver_not_in_every_report(rig, caplog):
    """A driver that offers no GPU-instance profile on a GPU (so nothing can be compared) answers the same
    until it changes. The verdict was not kept, so every report, each Prolog's included, asked NVML for
    every profile index again and logged the warning again. It is now kept (blocking nothing); an NVML
    call that fails is still asked again next time."""
    from slurm_mig.nvml.base import NvmlError

    rig.gpu.set_driver_profiles(1, {i: None for i in range(10)}, driver="590.1")
    asked = []
    real = SimulatedBackend.profile_readings
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SimulatedBackend, "profile_readings", lambda self, gpu: asked.append(gpu) or real(self, gpu))
        with caplog.at_level(logging.WARNING):
            assert rig.report() == 0
            assert rig.report() == 0
        assert sorted(asked) == [0, 1]
        assert sum("could not be compared" in r.getMessage() for r in caplog.records) == 1
        assert all(g.blocked is None for g in rig.store.observed_gpus("n1"))

        def failing(self, gpu):
            asked.append(gpu)
            raise NvmlError("NVML_ERROR_UNKNOWN")

        rig.gpu.set_driver_profiles(1, {}, driver="590.2")
        mp.setattr(SimulatedBackend, "profile_readings", failing)
        asked.clear()
        assert rig.report() == 0
        first = sorted(asked)
        assert rig.report() == 0
        assert first and sorted(asked) == sorted(first * 2)  # failed calls: asked again in the next report
        assert all(g.blocked is None for g in rig.store.observed_gpus("n1"))


def test_one_health_check_makes_the_mig_table_check_once(rig, monkeypatch):
    """A health check asked for the table check in its repair of half-made instances, in its report and, after
    a re-carve, in its /v1/applied report: each asked the driver version and read tables.json again (and, for a
    GPU whose check failed, asked NVML for every profile again). It is now made once per health check, with the
    same verdicts; each round of `node sync --loop` (one Node) makes it afresh."""
    from pathlib import Path

    asked, readings, reads = [], [], []
    real_version, real_readings, real_read = (SimulatedBackend.driver_version, SimulatedBackend.profile_readings,
                                              Path.read_text)
    monkeypatch.setattr(SimulatedBackend, "driver_version", lambda self: asked.append(1) or real_version(self))
    monkeypatch.setattr(SimulatedBackend, "profile_readings",
                        lambda self, gpu: readings.append(gpu) or real_readings(self, gpu))
    monkeypatch.setattr(Path, "read_text",
                        lambda self, *a, **k: (reads.append(self.name), real_read(self, *a, **k))[1])
    rig.gpu.set_driver_profiles(1, {1: {"placements": [[0, 2], [2, 2]]}}, driver="590.1")  # no 2g at 4
    # The controller asks GPU 0 to re-carve: the health check then sends /v1/applied with a report of its own.
    real_report = rig.srv.routes["/v1/report"]
    monkeypatch.setitem(rig.srv.routes, "/v1/report", lambda payload, who: {"desired": {"0": "7g@0"}, "release": []})
    node = hooks.Node("n1", hooks.NodeSettings.load())
    applied = []
    real_route = rig.srv.routes["/v1/applied"]
    monkeypatch.setitem(rig.srv.routes, "/v1/applied", lambda payload, who: applied.append(payload)
                        or real_route(payload, who))
    assert healthcheck({}, node) == 0
    assert _sim_layout(rig, 0) == "7g@0" and len(applied) == 1
    assert (len(asked), sorted(readings), reads.count("tables.json")) == (1, [0, 1], 1)
    gpu1 = [g for g in applied[0]["observed"] if g["index"] == 1][0]
    assert gpu1["table_errors"] == ["2g.20gb: placements {0,2}:2, ours {0,2,4}:2"]  # the verdict, as before
    # The next round on the same Node (node sync --loop) checks again: a new driver is seen.
    asked.clear(), readings.clear(), reads.clear()
    rig.gpu.set_driver_profiles(1, {}, driver="590.2")
    monkeypatch.setitem(rig.srv.routes, "/v1/report", real_report)
    assert healthcheck({}, node) == 0
    assert (len(asked), sorted(readings), reads.count("tables.json")) == (1, [0, 1], 1)
    assert all(g.blocked is None for g in rig.store.observed_gpus("n1"))


def test_without_the_controller_no_job_is_bound_on_a_gpu_whose_driver_differs_from_our_table(rig):
    for slot in ("3g@0", "2g@4", "1g@6"):
        rig.gpu.set_in_use(0, slot, "job 8")  # GPU 0 is full
    rig.gpu.set_driver_profiles(1, {2: {"id": 10}}, driver="590.1")  # the 3g renumbered
    rig.job("2", "2g")
    rig.srv.stop()
    assert rig.hook("prolog", "2") == 0
    assert not rig.record_file("2").exists()
    assert rig.requeues == [("2", "controller unreachable and no free 1 x 2g instance exists on n1")]


def _journal(rig) -> list[tuple[int, int, str, str, str]]:
    return [(r["id"], r["gpu"], r["to_layout"], r["state"], r["outcome"] or r["error"] or "")
            for r in rig.store._q("SELECT * FROM reconfig_journal ORDER BY id")]


def _plan_recarve(rig, gpu: int, target: str) -> None:
    """What a tick leaves for a re-carve of ``gpu`` from LAYOUT: the desired layout and a planned entry."""
    from slurm_mig.mig.layout import parse_layout
    from slurm_mig.mig.profiles import get_model
    from slurm_mig.mig.transitions import plan_transition

    h100 = get_model("H100-80GB")
    before, after = parse_layout(LAYOUT, h100), parse_layout(target, h100)
    rig.store.set_desired("n1", gpu, after, "frag-aware")
    rig.store.journal_begin("n1", gpu, before, after, plan_transition(before, after, set()), started=False)


def test_a_prolog_carrying_out_the_planned_recarve_takes_up_its_journal_entry(rig):
    """The tick planned 3g@0 -> 4g@0 on GPU 0 and the 4g job's Prolog got there before the health check:
    one journal entry, done by the Prolog. It used to be closed as "abandoned, superseded by job 1" and
    copied into a second entry (10 of 18 entries in one demo run; 17 of 48 in a crash-benchmark run)."""
    _plan_recarve(rig, 0, "4g@0,2g@4,1g@6")
    rig.job("1", "4g")
    assert rig.hook("prolog", "1") == 0 and rig.requeues == []
    assert _journal(rig) == [(1, 0, "4g@0,2g@4,1g@6", "done", "applied by the prolog of job 1")]


def test_a_prolog_that_makes_only_its_own_instance_leaves_the_rest_of_the_recarve_open(rig):
    """The 1g job's instance exists, so its Prolog changes nothing, while the GPU's planned re-carve
    (3g@0 -> 4g@0) is still to be done by the health check. Closing the entry as done at /v1/bound let
    the next tick plan another re-carve from the old layout, which the node then refused four times
    ("would destroy busy instance(s)") while two jobs Slurm sent there were requeued (a CI demo run)."""
    _plan_recarve(rig, 0, "4g@0,2g@4,1g@6")
    rig.job("1", "1g")
    assert rig.hook("prolog", "1") == 0 and rig.requeues == []
    assert rig.live("1")[0].gpu == 0 and _sim_layout(rig, 0) == "3g@0,2g@4,1g@6"
    assert [j[3] for j in _journal(rig)] == ["in_progress"]  # open: the tick plans nothing on GPU 0
    assert rig.report() == 0  # the health check makes the rest
    assert _sim_layout(rig, 0) == "4g@0,2g@4,1g@6" and [j[3] for j in _journal(rig)] == ["done"]


def test_a_prologs_report_closes_its_own_journal_entries_only(rig):
    """Two Prologs re-carve two GPUs of one node at once: the first one's /v1/bound used to close every
    in-progress entry of the node as its own (the second's too, before it had done anything), and a
    /v1/bind-failed failed them all."""
    rig.job("1", "4g")
    rig.job("2", "4g")
    a = rig.ctl.on_prolog({"job_id": "1", "node": "n1", "bindings": {}}, "n1")
    b = rig.ctl.on_prolog({"job_id": "2", "node": "n1", "bindings": {}}, "n1")
    assert a["action"] == b["action"] == "bind" and a["targets"] and b["targets"]
    (ia,), (ib,) = a["instances"], b["instances"]
    assert ia["gpu"] != ib["gpu"]
    from slurm_mig.mig.layout import parse_layout
    from slurm_mig.mig.profiles import get_model

    def gpu_report(gpu: int, layout) -> dict:
        lay = parse_layout(str(layout), get_model("H100-80GB"))
        return {"index": gpu, "uuid": f"GPU-{gpu}", "name": "H100", "model": "H100-80GB", "mig_enabled": True,
                "instances": [{"profile": sl.profile, "start": sl.start} for sl in sorted(lay.slots)]}

    # Job 1's Prolog reached its target; job 2's GPU is as it was.
    observed = [gpu_report(ia["gpu"], a["targets"][str(ia["gpu"])]),
                gpu_report(ib["gpu"], rig.store.observed_layout("n1", ib["gpu"]))]
    rig.ctl.on_bound({"job_id": "1", "node": "n1", "instances": [{**ia, "uuid": "MIG-a"}], "observed": observed,
                      "observed_at": time.time()}, "n1")
    states = {gpu: state for _id, gpu, _to, state, _why in _journal(rig)}
    assert states == {ia["gpu"]: "done", ib["gpu"]: "in_progress"}, _journal(rig)
    rig.ctl.on_bind_failed({"job_id": "2", "node": "n1", "results": [{"gpu": ib["gpu"], "ok": False,
                                                                      "error": "InsufficientResources"}]}, "n1")
    states = {gpu: state for _id, gpu, _to, state, _why in _journal(rig)}
    assert states == {ia["gpu"]: "done", ib["gpu"]: "failed"}, _journal(rig)


@pytest.mark.parametrize("error", ["instance {'gpu': 0, 'profile': '1g.10gb', 'start': 6} missing",
                                   "instances held by job(s) ['3']"])
def test_a_bind_failure_naming_no_gpu_closes_no_recarve_its_prolog_did_not_take_up(rig, error):
    """Found in review. A Prolog that chose an existing instance itself (the controller unreachable, or an older
    message about its job queued) and then found it missing or held by another job sends /v1/bind-failed naming
    no GPU. The controller, knowing no journal entry that Prolog took up, closed every re-carve in progress on
    the node as failed: the health check's (or another Prolog's), under way at that moment. It closes none."""
    _plan_recarve(rig, 1, "7g@0")
    (entry,) = [j[0] for j in _journal(rig)]
    rig.store.journal_started(entry)  # the health check carries it out now
    rig.job("9", "1g")
    rig.ctl.on_bind_failed({"job_id": "9", "node": "n1", "results": [{"error": error}]}, "n1")
    assert [j[3] for j in _journal(rig)] == ["in_progress"], _journal(rig)


def test_a_bind_failure_naming_no_gpu_after_a_controller_restart_closes_its_prologs_recarves_only(rig):
    """The same after a controller restart, which forgets which entries each Prolog took up: job 1's Prolog
    re-carved GPU 0 for it, then found its instance held by another job (naming no GPU). Its own entry is
    closed as failed, known from the layout the Prolog set for its job; the health check's on GPU 1 stays open."""
    rig.job("1", "4g")
    a = rig.ctl.on_prolog({"job_id": "1", "node": "n1", "bindings": {}}, "n1")
    assert a["action"] == "bind" and a["targets"]
    (ia,) = a["instances"]
    other = 1 - ia["gpu"]
    _plan_recarve(rig, other, "7g@0")
    rig.store.journal_started(max(j[0] for j in _journal(rig)))  # the health check's, under way
    restarted = Controller(Config(), rig.store, rig.slurm)
    restarted.on_bind_failed({"job_id": "1", "node": "n1",
                              "results": [{"error": "instances held by job(s) ['3']"}]}, "n1")
    states = {gpu: state for _id, gpu, _to, state, _why in _journal(rig)}
    assert states == {ia["gpu"]: "failed", other: "in_progress"}, _journal(rig)


# -- NVML faults during a Prolog's re-carve ---------------------------------------------------

@pytest.mark.parametrize("op,error,expect", [
    ("create", "InsufficientResources", "INSUFFICIENT_RESOURCES"),
    ("create", "NoPermission", "NO_PERMISSION"),
    ("destroy", "InUse", "IN_USE"),
    ("destroy", "NoPermission", "NO_PERMISSION"),
    ("create", "GpuLost", "GPU_IS_LOST"),
])
def test_nvml_error_while_recarving_requeues_the_job_safely(rig, caplog, op, error, expect):
    from slurm_mig.nvml import base

    rig.job("2", "1g")  # busy neighbour on GPU 0: must survive whatever happens next
    assert rig.hook("prolog", "2") == 0 and rig.live("2")
    busy = rig.live("2")[0]
    rig.job("3", "7g")
    cls = getattr(base, error)
    rig.gpu.fail_next(op, cls(f"injected {error} (NVML_ERROR_{expect})"), times=4)
    with caplog.at_level(logging.INFO):
        assert rig.hook("prolog", "3") == 0  # never non-zero: the node stays in service
    assert [j for j, _ in rig.requeues] == ["3"]
    reason = rig.requeues[0][1]
    assert "reconfiguration failed on n1" in reason and expect in reason, reason
    assert any(expect in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    # Safe state: nothing bound for job 3 anywhere, job 2's instance still there and busy.
    assert rig.live("3") == () and not rig.binding_file("3").exists()
    assert rig.store.get_job("3").state == "REQUEUED"
    held = {i.uuid for i in rig.gpu.instances(busy.gpu) if i.in_use}
    assert busy.uuid in held
    failed = [e for e in rig.store.journal_entries() if e.state == "failed"]
    assert failed and expect in (failed[0].error or ""), failed
    assert not rig.store.open_journal_entries("n1") or all(e.state == "planned"
                                                           for e in rig.store.open_journal_entries("n1"))
    rig.gpu.clear_faults()
    # Later the node settles: the next health check moves the GPU on, job 2 is untouched.
    assert rig.report() == 0
    assert busy.uuid in {i.uuid for i in rig.gpu.instances(busy.gpu) if i.in_use}


def _lock_free_when(rig, monkeypatch) -> list[tuple[str, bool]]:
    """Whether n1's layout lock is free each time a hook sends /v1/bind-failed or runs scontrol (a slow
    controller or slurmctld: up to request_timeout_s with a retry, and 10 s per scontrol call)."""
    import fcntl
    import os

    from slurm_mig.slurm.runner import SlurmClient

    seen: list[tuple[str, bool]] = []

    def free() -> bool:
        fd = os.open(rig.tmp / "node" / "n1" / "apply.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    real_run, real_route = SlurmClient.run, rig.srv.routes["/v1/bind-failed"]

    def run(client, argv, **kw):
        seen.append((" ".join(argv[:2]), free()))
        return real_run(client, argv, **kw)

    def route(payload, who):
        seen.append(("/v1/bind-failed", free()))
        return real_route(payload, who)

    monkeypatch.setattr(SlurmClient, "run", run)
    monkeypatch.setitem(rig.srv.routes, "/v1/bind-failed", route)
    return seen


def test_a_prolog_whose_recarve_failed_reports_and_requeues_without_the_layout_lock(rig, monkeypatch):
    """Found in review. A Prolog whose re-carve failed (an NVML error) sent /v1/bind-failed and ran scontrol
    to requeue its job while it still held the node's layout lock: with the controller or slurmctld slow
    (5 s per request and a retry, 10 s per scontrol call), about 30 s each, and every other Prolog on the node
    waited behind it. A burst of such jobs on one node then ran past a PrologEpilogTimeout of 120 s (the admin
    guide's least), and Slurm drains a node whose Prolog it kills for that. Both now run after the lock is
    let go; the lock still covers the GPU and the binding records."""
    from slurm_mig.nvml import base

    rig.job("47", "7g")
    rig.gpu.fail_next("create", base.InsufficientResources("injected (NVML_ERROR_INSUFFICIENT_RESOURCES)"), times=4)
    seen = _lock_free_when(rig, monkeypatch)
    assert rig.hook("prolog", "47") == 0
    assert [j for j, _ in rig.requeues] == ["47"]
    assert ("/v1/bind-failed", True) in seen and ("scontrol requeue", True) in seen
    assert all(free for _, free in seen), seen


def test_a_prolog_refusing_an_instance_another_job_holds_requeues_without_the_layout_lock(rig, monkeypatch):
    rig.job("48", "3g")
    assert rig.hook("prolog", "48") == 0
    (b,) = json.loads(rig.record_file("48").read_text())["instances"]
    named = {"gpu": b["gpu"], "profile": b["profile"], "start": b["start"]}
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog",
                        lambda payload, who: {"action": "bind", "instances": [named], "targets": {}})
    rig.job("49", "3g")
    seen = _lock_free_when(rig, monkeypatch)
    assert rig.hook("prolog", "49") == 0
    assert [j for j, _ in rig.requeues] == ["49"] and not rig.record_file("49").exists()
    assert ("scontrol requeue", True) in seen and all(free for _, free in seen), seen


def test_gpu_falls_off_the_bus_with_a_job_on_it(rig, caplog):
    rig.job("4", "3g")
    assert rig.hook("prolog", "4") == 0
    gpu = rig.live("4")[0].gpu
    rig.gpu.lose_gpu(gpu)
    with caplog.at_level(logging.WARNING):
        assert rig.report() == 0  # the health check carries on
        assert rig.hook("epilog", "4", SLURM_JOB_EXIT_CODE="0") == 0
    assert rig.store.outcome("4") is not None, "the outcome of a job on a lost GPU was lost"
    g = {x.gpu: x for x in rig.store.observed_gpus("n1")}[gpu]
    assert not g.mig_enabled  # left out of scheduling
    state = rig.store.cluster_state()
    assert all(s.index != gpu or not s.available for s in state.gpus)
    # A new job is placed on the healthy GPU (or requeued), never on the lost one.
    rig.job("5", "1g")
    assert rig.hook("prolog", "5") == 0
    assert all(b.gpu != gpu for b in rig.live("5"))
    assert any("lost" in r.getMessage().lower() or "GPU_IS_LOST" in r.getMessage() for r in caplog.records)


def test_an_epilog_that_cannot_read_the_gpu_keeps_the_binding(rig, monkeypatch):
    """The GPU cannot be read at the job's end (lost, driver gone): nothing says its processes are gone, so
    the binding stays (no layout change may destroy the instance) while the outcome still goes out."""
    monkeypatch.setattr(epilog, "time", FakeClock())  # the Epilog would wait for processes to exit
    rig.job("7", "3g")
    assert rig.hook("prolog", "7") == 0
    gpu = json.loads(rig.record_file("7").read_text())["instances"][0]["gpu"]
    rig.gpu.lose_gpu(gpu)
    assert rig.hook("epilog", "7", SLURM_JOB_EXIT_CODE="0") == 0
    assert rig.store.outcome("7") is not None
    assert rig.record_file("7").exists() and rig.binding_file("7").exists()


def test_the_health_check_never_recarves_over_a_bound_instance_with_no_process_yet(rig, monkeypatch):
    """On a real GPU an instance the Prolog just bound runs no process until the job starts one: only the
    node's binding record says it is taken. A desired layout over it (a stale or forged answer) must leave
    it alone. (The simulated GPU's own busy mark is cleared here to stand for that moment.)"""
    rig.job("8", "3g")
    assert rig.hook("prolog", "8") == 0
    (b,) = json.loads(rig.record_file("8").read_text())["instances"]
    rig.gpu.set_in_use(b["gpu"], b["uuid"], None)
    _answer_reports_with(rig, monkeypatch, desired={str(b["gpu"]): "7g@0"})
    assert rig.report() == 0
    assert b["uuid"] in {i.uuid for i in rig.gpu.instances(b["gpu"])}
    assert rig.record_file("8").exists()


def test_nvml_gone_on_the_node_requeues_with_the_reason(rig, caplog):
    rig.job("6", "2g")
    rig.gpu.fail_next("gpus", "NvmlUnavailable", times=1)
    with caplog.at_level(logging.ERROR):
        assert rig.hook("prolog", "6") == 0
    assert rig.requeues and rig.requeues[0][0] == "6" and "node hook error: NvmlUnavailable" in rig.requeues[0][1]
    assert any("prolog hook failed for job 6" in r.getMessage() for r in caplog.records)
    assert rig.live("6") == () and not rig.binding_file("6").exists()


@pytest.mark.parametrize("error", ["NvmlUnavailable", "GpuLost"])
def test_a_job_asking_for_no_mig_is_not_requeued_when_nvml_fails(rig, caplog, error):
    """A CPU job on a MIG node whose NVML cannot be read (driver reloading, library gone) needs no GPU: its
    Prolog used to fail in observe() and requeue it, again and again, like a MIG job."""
    rig.requests["62"] = {}  # Slurm: the job asks for no mig
    rig.gpu.fail_next("gpus", error, times=5)
    assert rig.hook("prolog", "62") == 0
    assert rig.requeues == [] and not rig.binding_file("62").exists()


def test_slow_nvml_still_binds(tmp_path, monkeypatch):
    rig = Rig(tmp_path, monkeypatch, delay_scale=1.0)  # H100 timings: ~0.2-0.4 s per step
    try:
        rig.job("7", "7g")
        t0 = time.monotonic()
        assert rig.hook("prolog", "7") == 0
        assert time.monotonic() - t0 > 0.5  # it did wait for the slow steps
        assert rig.requeues == [] and rig.live("7") and rig.binding_file("7").exists()
    finally:
        rig.close()


def test_one_gpu_failing_to_list_its_instances_does_not_hide_the_other(rig):
    rig.gpu.fail_next("instances", "NvmlError", gpu=1, times=3)
    assert rig.report() == 0
    assert {g.gpu for g in rig.store.observed_gpus("n1")} == {0, 1}
    assert rig.store.observed_instances("n1", 0)


# -- damaged node files -----------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"", b"null", b"[]", b'{"instances": 5}', b'{"instances": [{"gpu": "x"}]}',
                                     b"\xff\xfe garbage",
                                     json.dumps({"instances": [], "pad": "x" * 70_000}).encode()])
def test_damaged_binding_file_hides_gpus_and_keeps_the_outcome(rig, capsys, caplog, content):
    rig.job("8", "3g")
    assert rig.hook("prolog", "8") == 0
    for path in (rig.binding_file("8"), rig.record_file("8")):
        path.chmod(0o600)
        path.write_bytes(content)
    capsys.readouterr()
    assert rig.hook("taskprolog", "8") == 0
    out = capsys.readouterr().out
    assert "export CUDA_VISIBLE_DEVICES=\n" in out  # sees no GPU rather than every GPU
    assert rig.report() == 0
    assert rig.hook("epilog", "8", SLURM_JOB_EXIT_CODE="0") == 0
    assert rig.store.outcome("8") is not None and rig.store.outcome("8").state == "COMPLETED"
    assert rig.live("8") == ()
    if len(content) > 65536:  # refused unread, and said so
        assert any("larger than 65536 bytes" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("content", [b"null", b"[]", b'{"path": 1}', b"{", b'{"path": "/v1/epilog"}'])
def test_damaged_outbox_message_is_kept_aside_and_the_rest_delivered(rig, content):
    outbox = rig.tmp / "node" / "n1" / "outbox"
    outbox.mkdir(parents=True, exist_ok=True)
    (outbox / "00000000000000000001-1.json").write_bytes(content)
    _run_job(rig, "9", "1g")
    assert rig.store.outcome("9") is not None
    assert [p.suffix for p in outbox.iterdir()] == [".corrupt"]


def test_controller_down_during_epilog_queues_the_outcome(rig):
    rig.job("10", "1g")
    assert rig.hook("prolog", "10") == 0
    rig.srv.stop()
    assert rig.hook("epilog", "10", SLURM_JOB_EXIT_CODE="256") == 0
    queued = list((rig.tmp / "node" / "n1" / "outbox").glob("*.json"))
    assert len(queued) == 1 and json.loads(queued[0].read_text())["path"] == "/v1/epilog"
    assert rig.store.outcome("10") is None


def test_refused_epilog_is_kept_for_an_admin_not_dropped(rig, monkeypatch):
    rig.job("11", "1g")
    assert rig.hook("prolog", "11") == 0

    def refuse(payload, principal):
        from slurm_mig.api.server import RequestRejected

        raise RequestRejected("refused for the test")

    rig.srv.routes["/v1/epilog"] = refuse
    assert rig.hook("epilog", "11", SLURM_JOB_EXIT_CODE="0") == 0
    kept = list((rig.tmp / "node" / "n1" / "outbox").glob("*.refused"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["payload"]["job_id"] == "11"
    assert not rig.binding_file("11").exists()


# -- an Epilog killed (SIGKILL: nothing of it runs) ---------------------------------------------------

def test_epilog_killed_before_it_reported_outcome_comes_from_slurm(rig, caplog):
    from slurm_mig.slurm.parsers import JobDetail, SlurmJob

    rig.job("12", "2g")
    assert rig.hook("prolog", "12") == 0
    assert rig.store.get_job("12").state == "RUNNING"
    # The job ended; its Epilog was killed before writing anything. Slurm still lists the job as ended.
    rig.slurm.queue = [SlurmJob(job_id=12, state="COMPLETED", mig={"2g": 1}, tres_per_node="gres:mig:2g:1",
                                nodes=["n1"])]
    rig.slurm.details["12"] = JobDetail(job_id=12, state="COMPLETED",
                                        fields={"ExitCode": "0:0", "EndTime": time.strftime("%Y-%m-%dT%H:%M:%S")})
    t = [time.time()]
    rig.ctl.clock = lambda: t[0]
    rig.ctl.tick()
    assert rig.store.outcome("12") is None  # the grace period: a queued Epilog message may still come
    t[0] += 61
    with caplog.at_level(logging.WARNING):
        rig.ctl.tick()
    o = rig.store.outcome("12")
    assert o is not None and o.state == "COMPLETED" and o.exit_code == 0
    assert rig.store.get_job("12").state == "COMPLETED" and rig.live("12") == ()
    assert any("never reported" in r.getMessage() for r in caplog.records)
    # The node's own binding goes at its next health check (job ended > 30 s ago): slurmd killed the
    # job's processes with it, so on the simulated GPU its "job 12" in-use mark goes once Slurm says so.
    t[0] += 31
    assert rig.report() == 0
    assert not rig.binding_file("12").exists() and not rig.record_file("12").exists()
    busy = [i for g in (0, 1) for i in rig.gpu.instances(g) if i.in_use]
    assert busy == []


@pytest.mark.parametrize("restart", [False, True])
def test_lost_epilog_outcome_survives_slurm_forgetting_the_job(rig, restart):
    """Slurm forgets ended jobs after MinJobAge (10 s on the test cluster), maybe before the grace period
    ends: the record read when the end was first seen is the one used. With ``restart`` the controller
    that read it was killed and another took over (crash benchmark, seed 503: the outcome was recorded
    FAILED without an exit status while that record lived only in the dead controller's memory)."""
    from slurm_mig.slurm.parsers import JobDetail, SlurmJob

    rig.job("25", "2g")
    assert rig.hook("prolog", "25") == 0
    rig.slurm.queue = [SlurmJob(job_id=25, state="COMPLETED", mig={"2g": 1}, tres_per_node="gres:mig:2g:1")]
    rig.slurm.details["25"] = JobDetail(job_id=25, state="COMPLETED", fields={"ExitCode": "1:0"})
    t = [time.time()]
    rig.ctl.clock = lambda: t[0]
    rig.ctl.tick()
    ctl = Controller(Config(), rig.store, rig.slurm, clock=lambda: t[0]) if restart else rig.ctl
    rig.slurm.queue, rig.slurm.details = [], {}  # purged
    t[0] += 61
    ctl.tick()
    o = rig.store.outcome("25")
    assert o is not None and o.state == "COMPLETED" and o.exit_code == 256


def test_epilog_killed_after_queueing_its_outcome_is_delivered_later(rig):
    rig.job("13", "1g")
    assert rig.hook("prolog", "13") == 0
    node = hooks.Node("n1", hooks.NodeSettings.load())
    node.state.enqueue("/v1/epilog", {"job_id": "13", "node": "n1", "exit_code": 256, "end_time": time.time(),
                                      "instances": [i.to_json() for i in node.state.read_binding("13")]})
    # ...and was killed there. The next health check delivers it, exactly once, with the node's exit code.
    assert rig.report() == 0
    o = rig.store.outcome("13")
    assert o is not None and o.state == "FAILED" and o.exit_code == 256
    assert rig.report() == 0 and len([x for x in rig.store.outcomes() if x.job_id == "13"]) == 1


def _lose_answers(rig, route: str) -> list[dict]:
    """The controller handles each ``route`` message, then its answer is lost (a 500 after the work is
    done: a dropped connection, a timeout, a restart at the wrong moment). Returns the payloads seen."""
    handle, seen = rig.srv.routes[route], []

    def lost(payload, principal):
        seen.append(payload)
        handle(payload, principal)
        raise RuntimeError("answer lost for the test")

    rig.srv.routes[route] = lost
    return seen


def _events_of(rig, job_id: str, kind: str) -> list[str]:
    return [e.message for e in rig.store.recent_events(200, job_id=job_id) if e.kind == kind]


def test_an_epilog_delivered_again_after_its_answer_was_lost_writes_its_events_once(rig):
    rig.job("32", "1g")
    assert rig.hook("prolog", "32") == 0
    seen = _lose_answers(rig, "/v1/epilog")
    assert rig.hook("epilog", "32", SLURM_JOB_EXIT_CODE="0") == 0  # the client's retry is a second delivery
    assert len(list((rig.tmp / "node" / "n1" / "outbox").glob("*.json"))) == 1
    rig.srv.routes["/v1/epilog"] = rig.ctl.on_epilog
    assert rig.report() == 0  # the outbox sends it a third time, and this answer arrives
    assert len(_events_of(rig, "32", "end")) == 1, _events_of(rig, "32", "end")
    assert len(seen) == 2 and len({p.get("message_id") for p in seen}) == 1
    assert len([o for o in rig.store.outcomes() if o.job_id == "32"]) == 1
    assert list((rig.tmp / "node" / "n1" / "outbox").glob("*.json")) == []


def test_a_bound_message_queued_after_a_lost_answer_writes_its_start_event_once(rig):
    # send_or_queue: the direct try and the queued copy are one message, with one id.
    rig.job("33", "1g")
    _lose_answers(rig, "/v1/bound")
    assert rig.hook("prolog", "33") == 0
    rig.srv.routes["/v1/bound"] = rig.ctl.on_bound
    assert rig.report() == 0
    assert len(_events_of(rig, "33", "start")) == 1, _events_of(rig, "33", "start")
    assert list((rig.tmp / "node" / "n1" / "outbox").glob("*.json")) == []


def test_a_bind_failed_delivered_again_after_the_job_was_bound_anew_leaves_that_binding(rig):
    """Job 41's first Prolog failed its re-carve and sent /v1/bind-failed; the controller released and
    requeued the job, but the answer was lost, twice, and the message stayed in the outbox. The job ran
    again on this node and was bound; the health check then delivered the old message, which released
    the new binding and marked the running job REQUEUED (its instance then looked free to the policy).

    Since 2026-11-26 the node no longer sends a job's messages before an older one about it still queued: the
    second Prolog binds a free 7g that exists, as without the controller, and queues its /v1/bound behind the
    old message, which the controller must still take as the duplicate it is."""
    from slurm_mig.mig.layout import parse_layout
    from slurm_mig.mig.profiles import get_model
    from slurm_mig.nvml import apply_layout, base

    rig.job("41", "7g")
    seen = _lose_answers(rig, "/v1/bind-failed")
    rig.gpu.fail_next("create", base.InsufficientResources("injected (NVML_ERROR_INSUFFICIENT_RESOURCES)"),
                      times=4)
    assert rig.hook("prolog", "41") == 0 and [j for j, _ in rig.requeues] == ["41"]
    rig.gpu.clear_faults()
    apply_layout(rig.gpu, 1, parse_layout("7g@0", get_model("H100-80GB")))  # a free 7g exists now
    assert rig.hook("prolog", "41") == 0  # its outbox flush loses the answer again; then the job is bound
    assert [j for j, _ in rig.requeues] == ["41"] and rig.record_file("41").exists()
    assert len(list((rig.tmp / "node" / "n1" / "outbox").glob("*.json"))) == 2  # bind-failed, then bound
    rig.srv.routes["/v1/bind-failed"] = rig.ctl.on_bind_failed
    assert rig.report() == 0  # delivered once more, and answered; then the binding
    bound = rig.live("41")
    assert bound and rig.store.get_job("41").state == "RUNNING"
    assert rig.report() == 0
    assert rig.live("41") == bound and rig.store.get_job("41").state == "RUNNING"
    assert list((rig.tmp / "node" / "n1" / "outbox").glob("*.json")) == []
    assert len(seen) >= 3 and len({p["message_id"] for p in seen}) == 1  # every delivery one message
    assert len(_events_of(rig, "41", "bind-failed")) == 1


def test_a_message_without_an_id_from_an_older_node_still_writes_its_events(rig):
    rig.job("34", "1g")
    assert rig.hook("prolog", "34") == 0
    insts = [i.to_json() for i in rig.live("34")]
    for _ in range(2):
        rig.ctl.on_epilog({"job_id": "34", "node": "n1", "exit_code": 0, "instances": insts}, None)
    assert len(_events_of(rig, "34", "end")) == 2


@pytest.mark.parametrize("mid", ["../x", "AB" * 16, "ab", 7])
def test_a_message_id_that_is_not_lowercase_hex_is_refused(rig, mid):
    from slurm_mig.api.server import RequestRejected

    with pytest.raises(RequestRejected, match="message_id"):
        rig.ctl.on_epilog({"job_id": "35", "node": "n1", "message_id": mid}, None)


def test_a_late_node_made_binding_does_not_bring_an_ended_job_back(rig):
    rig.job("14", "3g")
    rig.srv.stop()  # controller down: the Prolog binds an existing instance by itself and queues /v1/bound
    assert rig.hook("prolog", "14") == 0
    assert rig.binding_file("14").exists()
    # The job ended; its Epilog reached a controller that came back, before the queued binding did.
    host, port = rig.srv.address
    from slurm_mig.api.auth import HmacAuth, load_key

    rig.srv = ApiServer(host, port, HmacAuth(load_key(str(rig.tmp / "hmac.key"))), rig.ctl.routes()).start()
    rig.ctl.on_epilog({"job_id": "14", "node": "n1", "exit_code": 0,
                       "instances": [{"gpu": 0, "profile": "3g", "start": 0, "uuid": "x"}]}, None)
    assert rig.store.get_job("14").state == "COMPLETED"
    assert rig.report() == 0  # delivers the queued /v1/bound
    assert rig.store.get_job("14").state == "COMPLETED" and rig.live("14") == ()


def test_node_made_binding_delivered_late_keeps_the_real_start_time(rig):
    """Controller down for the whole life of a job: Slurm's record says it ended (the tick marks it so),
    then the node's outbox delivers its binding and its Epilog. The outcome's run time is the real one."""
    from slurm_mig.slurm.parsers import SlurmJob

    rig.job("19", "2g")
    rig.srv.stop()
    t0 = time.time()
    assert rig.hook("prolog", "19") == 0
    time.sleep(1.0)
    assert rig.hook("epilog", "19", SLURM_JOB_EXIT_CODE="0") == 0  # queued too
    rig.store.set_job_state("19", "PENDING")
    rig.slurm.queue = [SlurmJob(job_id=19, state="COMPLETED", mig={"2g": 1}, tres_per_node="gres:mig:2g:1")]
    rig.ctl.tick()  # the controller is back: Slurm says the job ended
    assert rig.store.get_job("19").state == "COMPLETED"
    host, port = rig.srv.address
    from slurm_mig.api.auth import HmacAuth, load_key

    rig.srv = ApiServer(host, port, HmacAuth(load_key(str(rig.tmp / "hmac.key"))), rig.ctl.routes()).start()
    time.sleep(1.0)
    assert rig.report() == 0  # the outbox: /v1/bound (local), then /v1/epilog
    o = rig.store.outcome("19")
    assert o is not None and o.start_time is not None and abs(o.start_time - t0) < 1.0
    assert 0.8 < o.run_s < 2.0, o.run_s


def test_orphaned_binding_files_are_released_only_when_slurm_says_so(rig):
    """A binding file of a job Slurm does not run here (node crash, a database rebuilt without it): the
    health check drops it once it is a minute old, squeue answered, and its instance is idle."""
    import os

    rig.job("15", "2g")
    assert rig.hook("prolog", "15") == 0
    rig.store.set_job_state("15", "PENDING")  # e.g. a rebuilt database that no longer holds it running
    rig.store.release("15")
    path = rig.record_file("15")
    uuid = json.loads(path.read_text())["instances"][0]["uuid"]
    assert rig.report() == 0 and path.exists()  # too young
    os.utime(path, (time.time() - 120, time.time() - 120))
    rig.squeue = None  # slurmctld down: cannot tell, keep it
    assert rig.report() == 0 and path.exists()
    rig.squeue = "15\n"  # Slurm runs it here: keep it
    assert rig.report() == 0 and path.exists()
    rig.squeue = "99\n"
    gpu = json.loads(path.read_text())["instances"][0]["gpu"]
    rig.gpu.set_in_use(gpu, uuid, "pid 4242, left by job 15")  # a process that outlived the job: kept
    assert rig.report() == 0 and path.exists()
    rig.gpu.set_in_use(gpu, uuid, None)
    assert rig.report() == 0 and not path.exists()
    assert uuid not in {i.uuid for g in (0, 1) for i in rig.gpu.instances(g) if i.in_use}


def test_a_stale_binding_on_a_gpu_that_cannot_be_read_is_kept(rig, monkeypatch):
    """Slurm no longer runs the job, but its GPU cannot be read (lost): nothing says its instance is idle,
    so the binding stays until the GPU can be read."""
    rig.job("34", "2g")
    assert rig.hook("prolog", "34") == 0
    gpu = json.loads(rig.record_file("34").read_text())["instances"][0]["gpu"]
    _answer_reports_with(rig, monkeypatch, release=["34"])
    rig.squeue = "99\n"
    rig.gpu.lose_gpu(gpu)
    assert rig.report() == 0 and rig.record_file("34").exists()
    rig.gpu.lose_gpu(gpu, False)
    assert rig.report() == 0 and not rig.record_file("34").exists()


def _answer_reports_with(rig, monkeypatch, **extra) -> None:
    """The controller's /v1/report answers carry ``extra`` too (a stale or forged view, signed all the same)."""
    real = rig.srv.routes["/v1/report"]
    monkeypatch.setitem(rig.srv.routes, "/v1/report", lambda payload, who: {**real(payload, who), **extra})


def test_a_release_never_frees_an_instance_still_in_use(rig, monkeypatch, caplog):
    """The controller names a job for release while its instance still runs processes, and asks for a layout
    over it: the binding is kept and the instance survives. The busy check used to come after the binding's
    instances had been marked idle, so on the simulated GPU it never kept one, and the same health check
    re-carved over the job."""
    rig.job("30", "3g")
    assert rig.hook("prolog", "30") == 0
    (b,) = json.loads(rig.record_file("30").read_text())["instances"]
    # A process that outlived the job (the simulated GPU clears the job's own "job 30" mark with the job).
    rig.gpu.set_in_use(b["gpu"], b["uuid"], "pid 4242, left by job 30")
    _answer_reports_with(rig, monkeypatch, release=["30"], desired={str(b["gpu"]): "7g@0"})
    rig.squeue = ""  # Slurm does not list it here either: only the processes left say it is in use
    with caplog.at_level(logging.WARNING):
        assert rig.report() == 0
    assert rig.record_file("30").exists() and rig.binding_file("30").exists()
    assert b["uuid"] in {i.uuid for i in rig.gpu.instances(b["gpu"]) if i.in_use}
    assert any("binding kept until it is idle" in r.getMessage() for r in caplog.records)


def test_an_epilog_keeps_the_binding_of_an_instance_that_still_runs_processes(rig, monkeypatch, caplog):
    """A process that outlives the job (on the simulated GPU: a mark other than the job's own "job N") keeps
    the binding, so no layout change destroys its instance; the outcome is recorded all the same. The Epilog
    used to clear every mark on the job's instances before its busy check, so on the simulated GPU it never
    found one still in use and dropped the binding."""
    monkeypatch.setattr(epilog, "time", FakeClock())  # the Epilog's wait for processes to exit
    rig.job("32", "3g")
    assert rig.hook("prolog", "32") == 0
    (b,) = json.loads(rig.record_file("32").read_text())["instances"]
    assert rig.gpu.owners(b["gpu"])  # the job's own mark, set by its Prolog
    rig.gpu.set_in_use(b["gpu"], b["uuid"], "pid 4242, left by job 32")
    with caplog.at_level(logging.ERROR):
        assert rig.hook("epilog", "32", SLURM_JOB_EXIT_CODE="0") == 0
    assert rig.store.outcome("32") is not None
    assert rig.record_file("32").exists() and rig.binding_file("32").exists()
    assert b["uuid"] in {i.uuid for i in rig.gpu.instances(b["gpu"]) if i.in_use}
    assert any("still run processes" in r.getMessage() for r in caplog.records)
    _answer_reports_with(rig, monkeypatch, desired={str(b["gpu"]): "7g@0"})
    assert rig.report() == 0
    assert b["uuid"] in {i.uuid for i in rig.gpu.instances(b["gpu"])}
    # Its own mark alone (no process left over) is cleared with the job: the binding goes.
    rig.job("33", "1g")
    assert rig.hook("prolog", "33") == 0
    assert rig.hook("epilog", "33", SLURM_JOB_EXIT_CODE="0") == 0
    assert not rig.record_file("33").exists()


def _job_with_leftover_processes(rig, job_id: str, kind: str, count: int) -> list[dict]:
    """Run the Prolog of a ``count`` x ``kind`` job and leave a process on each of its instances (a mark
    other than the job's own, which the Epilog clears with the job)."""
    rig.job(job_id, kind, count)
    assert rig.hook("prolog", job_id) == 0
    bound = json.loads(rig.record_file(job_id).read_text())["instances"]
    assert len(bound) == count
    for b in bound:
        rig.gpu.set_in_use(b["gpu"], b["uuid"], f"pid 4242, left by job {job_id}")
    return bound


def _count_listings(monkeypatch) -> list:
    """Every NVML instance listing a hook makes, by GPU (the simulated backend's own, counted)."""
    calls: list[int] = []
    real = SimulatedBackend.instances

    def counted(self, gpu):
        calls.append(gpu)
        return real(self, gpu)

    monkeypatch.setattr(SimulatedBackend, "instances", counted)
    return calls


@pytest.mark.parametrize("kind,count", [("1g", 7), ("7g", 2)])
def test_an_epilog_waits_one_bound_for_all_of_a_jobs_lingering_instances(rig, monkeypatch, caplog, kind, count):
    """A job whose processes outlive it on every one of its instances: the Epilog waits at most 5 s in all (the
    admin guide's figure against PrologEpilogTimeout), polling every instance together with one listing per
    GPU per poll, then keeps the binding as for one lingering instance, and no layout change destroys any of
    them. It used to wait 5 s for each in turn: 35 s for a mig:1g:7 job, 10 s for 2 x 7g, with one listing
    per instance per poll."""
    bound = _job_with_leftover_processes(rig, "40", kind, count)
    gpus = {b["gpu"] for b in bound}
    clock = FakeClock()
    monkeypatch.setattr(epilog, "time", clock)
    listings = _count_listings(monkeypatch)
    with caplog.at_level(logging.ERROR):
        assert rig.hook("epilog", "40", SLURM_JOB_EXIT_CODE="0") == 0
    assert clock.slept <= 5.0, f"the Epilog waited {clock.slept:.1f} s for {count} lingering instance(s)"
    assert clock.slept >= 4.5, "the Epilog gave up before the processes had their time to exit"
    polls = round(clock.slept / 0.5) + 1
    assert len([g for g in listings if g in gpus]) <= polls * len(gpus)
    assert rig.store.outcome("40") is not None
    assert rig.record_file("40").exists() and rig.binding_file("40").exists()
    lingering = [r.getMessage() for r in caplog.records if "still run processes" in r.getMessage()]
    assert len(lingering) == 1 and all(b["uuid"] in lingering[0] for b in bound)
    monkeypatch.setattr(epilog, "time", time)  # the real clock again for the health check
    _answer_reports_with(rig, monkeypatch, desired={str(g): "7g@0" if kind != "7g" else "1g@0" for g in gpus})
    assert rig.report() == 0
    for b in bound:
        assert b["uuid"] in {i.uuid for i in rig.gpu.instances(b["gpu"]) if i.in_use}


def test_an_epilog_releases_instances_whose_processes_exit_within_the_bound(rig, monkeypatch):
    """Leftover processes on seven instances exit one after another, the last 3.5 s after the job: the Epilog
    waits for the last (never releasing a busy instance), no longer, and drops the binding."""
    bound = _job_with_leftover_processes(rig, "41", "1g", 7)
    clock = FakeClock()
    for k, b in enumerate(bound):
        clock.at(0.5 * (k + 1), lambda b=b: rig.gpu.set_in_use(b["gpu"], b["uuid"], None))
    monkeypatch.setattr(epilog, "time", clock)
    assert rig.hook("epilog", "41", SLURM_JOB_EXIT_CODE="0") == 0
    assert 3.5 <= clock.slept <= 4.0
    assert not rig.record_file("41").exists() and not rig.binding_file("41").exists()
    assert rig.store.outcome("41") is not None


def test_a_release_the_controller_asks_for_is_confirmed_with_slurm(rig, monkeypatch, caplog):
    """Before dropping a binding the controller names, the node asks Slurm: kept while Slurm runs the job
    here or cannot be asked, dropped once Slurm does not list it (and its instance is idle)."""
    rig.job("31", "2g")
    assert rig.hook("prolog", "31") == 0
    (b,) = json.loads(rig.record_file("31").read_text())["instances"]
    rig.gpu.set_in_use(b["gpu"], b["uuid"], None)  # no process on it: only Slurm can say the job runs
    _answer_reports_with(rig, monkeypatch, release=["31"])
    rig.squeue = "31\n"
    with caplog.at_level(logging.WARNING):
        assert rig.report() == 0 and rig.record_file("31").exists()
    assert any("Slurm runs it on n1; binding kept" in r.getMessage() for r in caplog.records)
    rig.squeue = None  # slurmctld down: stale data is no reason to destroy
    assert rig.report() == 0 and rig.record_file("31").exists()
    rig.squeue = "99\n"
    assert rig.report() == 0 and not rig.record_file("31").exists() and not rig.binding_file("31").exists()


def test_a_binding_file_an_earlier_run_left_is_not_adopted_for_the_run_after_it(rig, monkeypatch):
    """Found in review. Run 1 of job 42 left a process on its instance: its Epilog kept the binding file so no
    re-carve destroys it. The id ran again (requeued after it ended): run 2 waits. The next health check's
    report listed that file, and the controller adopted it for run 2: the waiting run held run 1's instance
    in the controller's view (the policy no longer placed it; a Prolog of run 2 on n1 was handed that same
    instance, its processes still on it). A binding file written before the current run began is an earlier
    run's: not adopted."""
    from slurm_mig.slurm.parsers import SlurmJob

    _job_with_leftover_processes(rig, "42", "3g", 1)
    monkeypatch.setattr(epilog, "time", FakeClock())
    assert rig.hook("epilog", "42", SLURM_JOB_EXIT_CODE="0") == 0
    assert rig.record_file("42").exists() and rig.live("42") == ()
    later = time.time() + 300
    rig.ctl.clock = lambda: later
    rig.slurm.queue = [SlurmJob(job_id=42, state="PENDING", mig={"3g": 1}, tres_per_node="gres:mig:3g:1",
                                submit_time=int(later - 100), priority=1)]
    rig.ctl.tick()
    job = rig.store.get_job("42")
    assert (job.state, job.run) == ("PENDING", 2)
    assert rig.report() == 0
    assert rig.live("42") == ()
    assert "42" in {j.job_id for j in rig.store.pending_jobs()}  # the policy still places it
    assert rig.record_file("42").exists()  # run 1's processes are still protected on the node
    assert any("before its current run" in e.message for e in rig.store.recent_events(20) if e.kind == "late")
    rig.report()  # said once
    assert sum("before its current run" in e.message for e in rig.store.recent_events(20)) == 1


def _records(rig) -> dict[str, set[str]]:
    """Every binding record on n1 (the name it is kept under -> the instance UUIDs it holds)."""
    return {p.stem: {i["uuid"] for i in json.loads(p.read_text())["instances"]}
            for p in sorted((rig.tmp / "node" / "n1" / "records").glob("*.json"))}


def _run_one_left_processes(rig, monkeypatch, job_id: str) -> dict:
    """Run 1 of ``job_id`` (a 3g) ends with a process left on its instance: its Epilog keeps the record."""
    (old,) = _job_with_leftover_processes(rig, job_id, "3g", 1)
    monkeypatch.setattr(epilog, "time", FakeClock())
    assert rig.hook("epilog", job_id, SLURM_JOB_EXIT_CODE="0") == 0
    monkeypatch.setattr(epilog, "time", time)
    assert rig.record_file(job_id).exists()
    return old


def _run_two_waits(rig, job_id: str) -> None:
    """Slurm lists the id again (requeued after it ended): the controller tracks run 2, waiting."""
    from slurm_mig.slurm.parsers import SlurmJob

    rig.ctl.clock = lambda: time.time() + 5  # asked Slurm after run 1 had ended (within the clock margin)
    rig.slurm.queue = [SlurmJob(job_id=int(job_id), state="PENDING", mig={"3g": 1}, tres_per_node="gres:mig:3g:1",
                                submit_time=int(time.time()) + 3, priority=1)]
    rig.ctl.tick()
    assert rig.store.get_job(job_id).run == 2


def test_the_next_run_of_a_job_id_keeps_the_binding_record_an_earlier_run_left(rig, monkeypatch, capsys):
    """Found in review. Run 1 of job 43 left a process on its instance, so its Epilog kept the binding record:
    the node's only word that the instance is still held. Run 2 of the id then started on n1 and its Prolog
    wrote its own binding over that record: run 1's instance was held by no record any more (the controller,
    the health check and `nvml apply` could hand it out or re-carve it once NVML saw it idle for a moment). The
    earlier run's record is now set aside under a name of its own, which every reader counts as busy, and
    dropped by the health check once its instance is idle."""
    from slurm_mig.cli import main

    old = _run_one_left_processes(rig, monkeypatch, "43")
    _run_two_waits(rig, "43")
    assert rig.hook("prolog", "43", SLURM_JOB_RESTART_COUNT="1") == 0
    assert rig.requeues == []
    records = _records(rig)
    new = records.pop("43")
    assert old["uuid"] not in new and len(new) == 1
    assert list(records.values()) == [{old["uuid"]}], records  # run 1's, under a name of its own
    (aside,) = records
    assert json.loads(rig.binding_file("43").read_text())["instances"][0]["uuid"] in new
    # Every reader counts it: the report the controller plans from, the hooks' layout changes, `nvml apply`.
    node = hooks.Node("n1", hooks.NodeSettings.load())
    assert (old["profile"], old["start"]) in node.state.bound_slots()[old["gpu"]]
    assert node.bindings_json()[aside][0]["uuid"] == old["uuid"]
    # Run 2 ends: its own binding goes, run 1's stays while its process lasts, then the health check drops it.
    assert rig.hook("epilog", "43", SLURM_JOB_EXIT_CODE="0") == 0
    assert set(_records(rig)) == {aside}
    assert rig.report() == 0 and set(_records(rig)) == {aside}
    capsys.readouterr()
    rig.gpu.set_in_use(old["gpu"], old["uuid"], None)  # NVML sees it idle; only the record says otherwise
    assert main(["nvml", "apply", "--gpu", str(old["gpu"]), "--layout", "7g@0"]) == 3
    assert f"bound to job {aside}" in capsys.readouterr().err
    assert rig.report() == 0 and _records(rig) == {}
    # That report still named it (it was dropped after), and the controller counted its instance in use.
    held = {i.start for i in rig.store.observed_instances("n1", old["gpu"]) if i.in_use}
    assert old["start"] in held and rig.errors == []
    assert rig.report() == 0
    assert old["start"] not in {i.start for i in rig.store.observed_instances("n1", old["gpu"]) if i.in_use}


def test_the_next_run_of_a_job_id_is_never_bound_to_the_instance_an_earlier_run_still_holds(rig, monkeypatch):
    """Found in review. Whatever the controller answers (stale, or forged), run 2 of job 44 may not be bound to
    the instance run 1's processes still run on: the check for instances other jobs hold skipped the records of
    the job's own id, run 1's among them, so such an answer bound run 2 to it."""
    old = _run_one_left_processes(rig, monkeypatch, "44")
    _run_two_waits(rig, "44")
    named = {"gpu": old["gpu"], "profile": old["profile"], "start": old["start"]}
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog",
                        lambda payload, who: {"action": "bind", "instances": [named], "targets": {}})
    assert rig.hook("prolog", "44", SLURM_JOB_RESTART_COUNT="1") == 0
    assert [j for j, _ in rig.requeues] == ["44"]
    assert list(_records(rig).values()) == [{old["uuid"]}]  # run 1's record, still there
    assert not rig.binding_file("44").exists()


def test_the_task_of_a_next_run_that_asks_for_no_mig_does_not_see_an_earlier_runs_instance(rig, monkeypatch, capsys):
    """Run 2 of job 45 asks for no MIG instance (its Prolog binds nothing): its TaskProlog read the copy of the
    binding run 1 left and gave run 2 run 1's instance, processes and all."""
    old = _run_one_left_processes(rig, monkeypatch, "45")
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog", lambda payload, who: {"action": "skip"})
    assert rig.hook("prolog", "45", SLURM_JOB_RESTART_COUNT="1") == 0
    capsys.readouterr()
    assert rig.hook("taskprolog", "45") == 0
    lines = capsys.readouterr().out.splitlines()
    assert "export CUDA_VISIBLE_DEVICES=" in lines and not any(old["uuid"] in line for line in lines), lines
    assert list(_records(rig).values()) == [{old["uuid"]}]


def _marks(rig) -> dict[str, str]:
    """Every instance of n1 marked busy on the simulated GPU (its UUID -> who runs on it)."""
    return {i.uuid: rig.gpu.owners(g)[i.slot] for g in (0, 1) for i in rig.gpu.instances(g) if i.in_use}


def test_an_earlier_runs_mark_left_by_a_killed_epilog_goes_with_its_set_aside_record(rig):
    """Crash benchmark, seed 1048 (commit ea6fd44): after every job had ended an instance of n1 stayed marked
    busy ("job N", the simulated GPU's stand-in for the job's processes) for good, with no binding in the
    database nor a TaskProlog copy on the node. Run 0's Prolog marked its instance and was killed (its wrapper
    requeued the job); that attempt's Epilog was killed before it cleared the mark; the next Prolog of the id
    on n1 set the record aside (records/<job>.earlier-1.json, which has no copy) and the health check, which
    drops such a record once its instances are idle, skipped clearing the earlier run's own marks: the mark
    kept the record, and the record the instance, until someone cleared the mark by hand. That run has ended
    (Slurm started the next one): its marks go with its record. The mark of the run that runs now stays."""
    rig.job("51", "3g")
    assert rig.hook("prolog", "51", SLURM_JOB_RESTART_COUNT="0") == 0
    (x,) = _records(rig)["51"]
    assert _marks(rig) == {x: "job 51"}
    # Killed after its mark (the wrapper requeued the job); the attempt's Epilog killed before it did anything.
    rig.store.set_job_state("51", "PENDING")
    assert rig.hook("prolog", "51", SLURM_JOB_RESTART_COUNT="1") == 0  # the controller named x again: requeued
    assert _records(rig) == {"51.earlier-1": {x}} and not rig.binding_file("51").exists()
    assert rig.hook("epilog", "51", SLURM_JOB_EXIT_CODE="0", SLURM_JOB_RESTART_COUNT="2") == 0
    rig.store.set_job_state("51", "PENDING")
    assert rig.hook("prolog", "51", SLURM_JOB_RESTART_COUNT="2") == 0
    (y,) = _records(rig)["51"]
    assert y != x and _marks(rig) == {x: "job 51", y: "job 51"}
    rig.squeue = "51\n"  # the run bound to y runs
    assert rig.report() == 0
    assert _records(rig) == {"51": {y}} and _marks(rig) == {y: "job 51"}
    # Never the mark of an instance another record names, whatever the records say (a state no hook makes).
    node = rig.tmp / "node" / "n1" / "records"
    (node / "51.earlier-2.json").write_bytes((node / "51.json").read_bytes())
    assert rig.report() == 0
    assert _records(rig) == {"51": {y}, "51.earlier-2": {y}} and _marks(rig) == {y: "job 51"}
    (node / "51.earlier-2.json").unlink()
    assert rig.hook("epilog", "51", SLURM_JOB_EXIT_CODE="0", SLURM_JOB_RESTART_COUNT="2") == 0
    assert _records(rig) == {} and _marks(rig) == {}
    assert rig.store.outcome("51").state == "COMPLETED" and rig.store.live_bindings() == []


def test_an_earlier_runs_record_naming_the_running_runs_slot_under_an_old_uuid_leaves_its_mark(rig):
    """The health check clears an earlier run's "job N" marks on the instances no other record names, told apart
    by UUID; the simulated GPU keeps its marks by slot (GPU, profile, start). A set-aside record naming the slot
    the running run of the same id is bound to, under the UUID an instance there had before it was made again
    (the simulated GPUs made again, `nvml sim-init`, with the node's records kept), was not the running run's by
    UUID: its mark, "job N" too, was cleared while the job ran, and the instance read idle. A state no hook makes
    alone, like the copied record of the test above; kept out by slot now as well."""
    rig.job("53", "3g")
    assert rig.hook("prolog", "53", SLURM_JOB_RESTART_COUNT="0") == 0
    (y,) = _records(rig)["53"]
    rig.squeue = "53\n"  # the run bound to y runs
    records = rig.tmp / "node" / "n1" / "records"
    doc = json.loads((records / "53.json").read_text())
    doc["instances"][0]["uuid"] = "MIG-00000000-0000-4000-8000-000000000053"  # the same slot, an older instance
    (records / "53.earlier-1.json").write_text(json.dumps(doc))
    assert _marks(rig) == {y: "job 53"}
    assert rig.report() == 0
    assert _marks(rig) == {y: "job 53"}  # the running run's mark stays
    assert _records(rig)["53"] == {y}


def test_a_binding_another_users_job_left_under_the_id_is_not_taken_for_this_runs(rig, monkeypatch, capsys):
    """Job 47 (uid 1001) was bound on n1 and its Epilog never ran (the node crashed; or it was killed before it
    took the attempt its Prolog noted) as slurmctld lost its state, and id 47 went to another user's job (uid
    65534), at the same restart count, 0. Its Prolog took the record for one of its own run's, a Prolog run
    again, and left it: asking for no MIG instance, the new job ran with the earlier job's TaskProlog copy,
    whose instance its tasks were shown where its user could read the copy. The record keeps the job's uid: one
    of another user's job is an earlier job's, set aside (its copy removed) until its instance is idle. The same
    user's retried Prolog, and a record without a uid (an older version's), are left as they were."""
    rig.job("47", "3g")
    assert rig.hook("prolog", "47", SLURM_JOB_UID="1001", SLURM_JOB_RESTART_COUNT="0") == 0
    (old,) = _records(rig)["47"]
    assert json.loads(rig.record_file("47").read_text())["uid"] == 1001
    # Run again for the same job (slurmd retried it): its own record, kept.
    assert rig.hook("prolog", "47", SLURM_JOB_UID="1001", SLURM_JOB_RESTART_COUNT="0") == 0
    assert _records(rig) == {"47": {old}}
    # Id 47 is another user's job now, asking for no MIG instance.
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog", lambda payload, who: {"action": "skip"})
    assert rig.hook("prolog", "47", SLURM_JOB_UID="65534", SLURM_JOB_RESTART_COUNT="0") == 0
    capsys.readouterr()
    assert rig.hook("taskprolog", "47") == 0
    lines = capsys.readouterr().out.splitlines()
    assert "export CUDA_VISIBLE_DEVICES=" in lines and not any(old in line for line in lines), lines
    assert list(_records(rig).values()) == [{old}] and "47" not in _records(rig)  # set aside, under its own name


def test_a_binding_record_without_a_uid_is_read_as_before(rig):
    """A record an older version wrote has no uid: it says nothing of the user, and a Prolog at the same
    restart count takes it for its own run's, as before."""
    rig.job("48", "2g")
    assert rig.hook("prolog", "48", SLURM_JOB_UID="1001", SLURM_JOB_RESTART_COUNT="0") == 0
    doc = json.loads(rig.record_file("48").read_text())
    del doc["uid"]
    rig.record_file("48").write_text(json.dumps(doc))
    first = _records(rig)
    assert rig.hook("prolog", "48", SLURM_JOB_UID="65534", SLURM_JOB_RESTART_COUNT="0") == 0
    assert _records(rig) == first and set(first) == {"48"}


def test_a_prolog_run_again_for_the_same_run_keeps_its_own_binding(rig):
    """The Prolog of one run run twice (no Epilog between, the same restart count): its record is this run's,
    not an earlier run's. It is not set aside, and the second Prolog binds the same instance."""
    rig.job("46", "2g")
    assert rig.hook("prolog", "46", SLURM_JOB_RESTART_COUNT="0") == 0
    first = _records(rig)
    assert rig.hook("prolog", "46", SLURM_JOB_RESTART_COUNT="0") == 0
    assert _records(rig) == first and set(first) == {"46"} and rig.requeues == []


def test_a_prolog_run_again_binding_another_instance_leaves_no_mark_on_the_first(rig, monkeypatch):
    """The Prolog of one run run twice (the same restart count, no Epilog between: its record is this run's, kept
    as it is), the second answered with another instance (the controller moved the job's binding meanwhile):
    the second binding was written over the first, and the "job N" mark the first Prolog set on its instance
    stayed on the simulated GPU with no record naming it, so neither the Epilog nor the health check ever
    cleared it and the instance stayed busy for good (found hunting crash benchmark seed 1048)."""
    rig.job("52", "3g")
    assert rig.hook("prolog", "52", SLURM_JOB_RESTART_COUNT="0") == 0
    (first,) = json.loads(rig.record_file("52").read_text())["instances"]
    other = next(i for g in (0, 1) for i in rig.gpu.instances(g)
                 if i.slot.profile == first["profile"] and i.uuid != first["uuid"])
    named = {"gpu": other.gpu_index, "profile": other.slot.profile, "start": other.slot.start}
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog",
                        lambda payload, who: {"action": "bind", "instances": [named], "targets": {}})
    assert rig.hook("prolog", "52", SLURM_JOB_RESTART_COUNT="0") == 0
    assert _records(rig) == {"52": {other.uuid}} and _marks(rig) == {other.uuid: "job 52"}
    assert rig.hook("epilog", "52", SLURM_JOB_EXIT_CODE="0", SLURM_JOB_RESTART_COUNT="0") == 0
    rig.squeue = ""
    assert rig.report() == 0
    assert _records(rig) == {} and _marks(rig) == {}


def _answer_with_another_instance(rig, monkeypatch, record: dict) -> object:
    """The controller answers the next Prolog with another instance of the profile ``record`` names (as when it
    moved the job's binding meanwhile); returns that instance."""
    other = next(i for g in (0, 1) for i in rig.gpu.instances(g)
                 if i.slot.profile == record["profile"] and i.uuid != record["uuid"])
    named = {"gpu": other.gpu_index, "profile": other.slot.profile, "start": other.slot.start}
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog",
                        lambda payload, who: {"action": "bind", "instances": [named], "targets": {}})
    return other


def test_a_prolog_run_again_leaves_the_mark_of_a_slot_another_record_names_under_an_old_uuid(rig, monkeypatch):
    """The Prolog run again for the same run clears the marks of the instances its first binding named and the
    new one does not, on those no other record names. Told apart by UUID only (4cd077e), while the simulated
    GPU keeps its marks by slot: a set-aside record naming the first instance's slot under the UUID of an
    instance made there before (the simulated GPUs made again with the records kept) did not keep the mark,
    "job N" too, of the run that record stands for. By UUID and by slot now, one guard with the health check's
    (8954a27, NodeState.named_by_others). A state no hook makes alone, like that commit's test."""
    rig.job("55", "3g")
    assert rig.hook("prolog", "55", SLURM_JOB_RESTART_COUNT="0") == 0
    (first,) = json.loads(rig.record_file("55").read_text())["instances"]
    x = first["uuid"]
    records = rig.tmp / "node" / "n1" / "records"
    doc = json.loads(rig.record_file("55").read_text())
    doc["instances"][0]["uuid"] = old = "MIG-00000000-0000-4000-8000-000000000055"  # x's slot, an older instance
    (records / "55.earlier-1.json").write_text(json.dumps(doc))
    y = _answer_with_another_instance(rig, monkeypatch, first).uuid
    assert rig.hook("prolog", "55", SLURM_JOB_RESTART_COUNT="0") == 0
    assert _records(rig) == {"55": {y}, "55.earlier-1": {old}}
    assert _marks(rig) == {x: "job 55", y: "job 55"}  # x's slot is the set-aside record's: its mark stays
    rig.squeue = "55\n"
    assert rig.report() == 0  # the set-aside record goes, and its mark with it (5123325)
    assert _records(rig) == {"55": {y}} and _marks(rig) == {y: "job 55"}


def test_a_prolog_run_again_over_a_damaged_record_clears_the_mark_its_first_binding_set(rig, monkeypatch):
    """The Prolog run again for the same run over its own record, damaged since (it names nothing readable):
    the mark the first Prolog set stayed on an instance no record named once the record was written over, busy
    for good. The instances marked "job N" that no other record names stand for the damaged record now."""
    rig.job("60", "3g")
    assert rig.hook("prolog", "60", SLURM_JOB_RESTART_COUNT="0") == 0
    (first,) = json.loads(rig.record_file("60").read_text())["instances"]
    rig.record_file("60").write_bytes(b"\xff garbage")
    y = _answer_with_another_instance(rig, monkeypatch, first).uuid
    assert rig.hook("prolog", "60", SLURM_JOB_RESTART_COUNT="0") == 0
    assert _records(rig) == {"60": {y}} and _marks(rig) == {y: "job 60"}


def _damaged_with_a_set_aside_record_and_another_job(rig) -> tuple[str, str, str]:
    """Job 56 bound to x, its record damaged since; a set-aside record of 56 (an earlier run's) naming z,
    marked "job 56" (its Epilog was killed); job 57 bound to w. Returns (x, z, w)."""
    rig.job("56", "3g")
    assert rig.hook("prolog", "56", SLURM_JOB_RESTART_COUNT="0") == 0
    (x,) = _records(rig)["56"]
    rig.job("57", "2g")
    assert rig.hook("prolog", "57", SLURM_JOB_RESTART_COUNT="0") == 0
    (w,) = _records(rig)["57"]
    z = next(i for g in (0, 1) for i in rig.gpu.instances(g) if i.slot.profile.startswith("1g") and not i.in_use)
    rig.gpu.set_in_use(z.gpu_index, z.slot, "job 56")
    earlier = {"job_id": "56", "bound_at": 1.0, "attempt": None, "uid": 0, "instances": [
        {"gpu": z.gpu_index, "profile": z.slot.profile, "start": z.slot.start, "uuid": z.uuid}]}
    (rig.tmp / "node" / "n1" / "records" / "56.earlier-1.json").write_text(json.dumps(earlier))
    for path in (rig.binding_file("56"), rig.record_file("56")):
        path.chmod(0o600)
        path.write_bytes(b"\xff garbage")
    assert _marks(rig) == {x: "job 56", z.uuid: "job 56", w: "job 57"}
    return x, z.uuid, w


def test_an_epilog_finding_its_record_damaged_clears_its_marks_no_other_record_names(rig):
    """The Epilog of a job whose record is damaged cannot say which instances the job held: it cleared no
    "job N" mark and removed the record, and the simulated GPU showed the job's instance busy for good (no
    record left for the health check to release it with). Its marks are found by their owner now and cleared,
    on the instances no other record names: a set-aside record's (an earlier run of the id) stays for the
    health check, which releases that record with its mark; another job's mark is never touched."""
    x, z, w = _damaged_with_a_set_aside_record_and_another_job(rig)
    assert rig.hook("epilog", "56", SLURM_JOB_EXIT_CODE="0", SLURM_JOB_RESTART_COUNT="0") == 0
    assert rig.store.outcome("56").state == "COMPLETED"
    assert _marks(rig) == {z: "job 56", w: "job 57"}
    assert set(_records(rig)) == {"56.earlier-1", "57"}
    rig.squeue = "57\n"
    assert rig.report() == 0
    assert _records(rig) == {"57": {w}} and _marks(rig) == {w: "job 57"}


def test_a_damaged_record_of_the_same_id_keeps_the_marks_it_may_name(rig):
    """A damaged record is no proof about the marks another damaged record of the same id may name: while one
    cannot be read, no "job N" mark is cleared from a damaged record's side (a stuck mark, not a cleared one)."""
    x, z, w = _damaged_with_a_set_aside_record_and_another_job(rig)
    (rig.tmp / "node" / "n1" / "records" / "56.earlier-2.json").write_bytes(b"{")
    assert rig.hook("epilog", "56", SLURM_JOB_EXIT_CODE="0", SLURM_JOB_RESTART_COUNT="0") == 0
    assert _marks(rig) == {x: "job 56", z: "job 56", w: "job 57"}


@pytest.mark.parametrize("earlier", [False, True])
def test_the_health_check_releasing_a_damaged_record_clears_its_marks_no_other_record_names(rig, monkeypatch,
                                                                                           earlier):
    """The health check releasing a damaged record (a job Slurm no longer runs here, or an earlier run's record
    set aside) cleared no "job N" mark: the record gone, the instance stayed busy for good. Found by their owner
    now, on the instances no other record names: the running run's, bound under the same id, stays."""
    rig.job("58", "3g")
    assert rig.hook("prolog", "58", SLURM_JOB_RESTART_COUNT="0") == 0
    (first,) = json.loads(rig.record_file("58").read_text())["instances"]
    x = first["uuid"]
    records = rig.tmp / "node" / "n1" / "records"
    if earlier:  # run 0's record set aside (as run 1's Prolog does), damaged since; run 1 bound to another
        rig.record_file("58").rename(records / "58.earlier-1.json")
        rig.binding_file("58").unlink()
        (records / "58.earlier-1.json").write_bytes(b"\xff garbage")
        y = _answer_with_another_instance(rig, monkeypatch, first).uuid
        assert rig.hook("prolog", "58", SLURM_JOB_RESTART_COUNT="1") == 0
        assert _marks(rig) == {x: "job 58", y: "job 58"}
        rig.squeue = "58\n"  # run 1 runs
    else:  # Slurm no longer runs job 58 here; its record, damaged, is older than ORPHAN_AGE_S
        rig.record_file("58").write_bytes(b"\xff garbage")
        old = time.time() - 3600
        os.utime(rig.record_file("58"), (old, old))
    assert rig.report() == 0
    if earlier:
        assert _records(rig) == {"58": {y}} and _marks(rig) == {y: "job 58"}
    else:
        assert _records(rig) == {} and _marks(rig) == {}


def test_epilog_of_a_requeued_attempt_records_no_outcome(rig):
    """Prolog killed after binding, the wrapper requeued the job: Slurm still runs the Epilog of that
    attempt (exit code 0, SLURM_JOB_RESTART_COUNT already raised). Its end is not the job's outcome."""
    rig.job("16", "1g")
    assert rig.hook("prolog", "16", SLURM_JOB_RESTART_COUNT="0") == 0
    first = rig.live("16")
    assert first and json.loads(rig.binding_file("16").read_text())["attempt"] == 0
    assert rig.hook("epilog", "16", SLURM_JOB_EXIT_CODE="0", SLURM_JOB_RESTART_COUNT="1") == 0
    assert rig.store.outcome("16") is None and rig.live("16") == () and not rig.binding_file("16").exists()
    assert any("ended by a requeue" in e.message for e in rig.store.recent_events(20, job_id="16"))
    # The attempt that runs: its outcome is the one recorded, once.
    rig.store.set_job_state("16", "PENDING")
    assert rig.hook("prolog", "16", SLURM_JOB_RESTART_COUNT="1") == 0
    assert rig.hook("epilog", "16", SLURM_JOB_EXIT_CODE="256", SLURM_JOB_RESTART_COUNT="1") == 0
    o = rig.store.outcome("16")
    assert o is not None and o.state == "FAILED" and o.exit_code == 256


def test_a_late_epilog_from_another_node_frees_only_its_own_instances(rig):
    rig.job("17", "3g")
    assert rig.hook("prolog", "17") == 0
    live = rig.live("17")
    assert live
    # An earlier attempt's messages from another node, arriving now: nothing of this run is released.
    rig.store.replace_observed("n2", [{"gpu": 0, "uuid": "G", "model": "H100-80GB", "mig_enabled": True}], [])
    rig.ctl.on_bind_failed({"job_id": "17", "node": "n2", "results": []}, None)
    rig.ctl.on_epilog({"job_id": "17", "node": "n2", "exit_code": 0, "requeued": True,
                       "instances": [{"gpu": 0, "profile": "3g", "start": 4, "uuid": "old"}]}, None)
    assert rig.live("17") == live
    assert rig.store.get_job("17").state == "RUNNING"


def test_a_requeued_attempt_is_held_back_until_the_node_forgets_its_credential(rig):
    """The Prolog found no instance and requeued the job (or died, and its wrapper requeued it): the
    attempt's Epilog pushes the job's StartTime past cred_expire from now, so the job cannot start again
    on this node while slurmd would still skip its Prolog."""
    rig.job("18", "7g")
    for g in (0, 1):  # every GPU busy: no 7g can be made
        for i in rig.gpu.instances(g):
            rig.gpu.set_in_use(g, i.slot, "someone")
    assert rig.hook("prolog", "18", SLURM_JOB_RESTART_COUNT="0") == 0
    assert ("requeue", "18") in rig.slurm.calls  # the controller requeued it (no instance can be made)
    assert rig.hook("epilog", "18", SLURM_JOB_EXIT_CODE="0", SLURM_JOB_RESTART_COUNT="1") == 0
    assert ("scontrol", "update", "JobId=18", "StartTime=now+15") in rig.scontrol
    assert rig.store.outcome("18") is None
    # A run that completes is not held back.
    rig.scontrol.clear()
    for g in (0, 1):
        for i in rig.gpu.instances(g):
            rig.gpu.set_in_use(g, i.slot, None)
    assert rig.hook("prolog", "18", SLURM_JOB_RESTART_COUNT="1") == 0
    assert rig.hook("epilog", "18", SLURM_JOB_EXIT_CODE="0", SLURM_JOB_RESTART_COUNT="1") == 0
    assert not any("StartTime" in " ".join(a) for a in rig.scontrol)
    assert rig.store.outcome("18").state == "COMPLETED"


# -- defence in depth --------------------------------------------------------------------------------

def test_prolog_refuses_an_instance_another_job_holds_here(rig, monkeypatch):
    """Whatever the answer says (a bug, a forged or stale answer), the node never binds a second job to an
    instance a binding file here already gives to another job."""
    rig.job("20", "3g")
    assert rig.hook("prolog", "20") == 0
    held = json.loads(rig.binding_file("20").read_text())["instances"][0]
    rig.job("21", "3g")
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog", lambda payload, who: {
        "action": "bind", "targets": {}, "instances": [{"gpu": held["gpu"], "profile": held["profile"],
                                                         "start": held["start"]}]})
    assert rig.hook("prolog", "21") == 0
    assert rig.requeues and rig.requeues[-1][0] == "21" and "held by another job" in rig.requeues[-1][1]
    assert not rig.binding_file("21").exists()
    assert json.loads(rig.binding_file("20").read_text())["instances"][0] == held


def test_prolog_refuses_an_instance_overlapping_one_another_job_holds_here(rig, monkeypatch):
    """Not only the very instance: one at another start whose slices overlap a bound one (3g@4 over a job's
    1g@6) is refused as held, before any layout change is tried."""
    rig.job("25", "1g")
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog", lambda payload, who: {
        "action": "bind", "targets": {}, "instances": [{"gpu": 0, "profile": "1g.10gb", "start": 6}]})
    assert rig.hook("prolog", "25") == 0
    held = json.loads(rig.record_file("25").read_text())["instances"]
    rig.job("26", "3g")
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog", lambda payload, who: {
        "action": "bind", "targets": {"0": "3g@0,3g@4"}, "instances": [{"gpu": 0, "profile": "3g.40gb", "start": 4}]})
    assert rig.hook("prolog", "26") == 0
    assert rig.requeues and rig.requeues[-1][0] == "26" and "held by another job" in rig.requeues[-1][1]
    assert not rig.record_file("26").exists()
    assert json.loads(rig.record_file("25").read_text())["instances"] == held
    assert "1g.10gb@6" in rig.layout(0)


@pytest.mark.parametrize("request_", [{"1g": 1, "3g": 1}, {"1g": 2, "3g": 1}, {"1g": 1, "3g": 3}])
def test_without_the_controller_a_mixed_request_gets_all_of_it_or_is_requeued(rig, monkeypatch, request_):
    """job_submit.lua accepts mixes like mig:4g:1,mig:3g:1; the local fallback used to bind only the first
    size and start the job (rc 0) with part of its request. Each GPU has 3g@0,2g@4,1g@6: two 3g, two 1g.
    The request comes from Slurm's job record (scontrol show job), as the real Prolog reads it."""
    from slurm_mig.slurm.parsers import JobDetail
    from slurm_mig.slurm.runner import SlurmClient

    monkeypatch.setattr(prolog, "_job_request", _JOB_REQUEST)
    monkeypatch.setattr(SlurmClient, "job_detail", lambda self, job_id: JobDetail(job_id=50, mig=request_))
    rig.srv.stop()
    assert rig.hook("prolog", "50") == 0
    if request_["3g"] > 2:
        assert not rig.record_file("50").exists()
        assert rig.requeues == [("50", "controller unreachable and no free 3 x 3g instance exists on n1")]
        return
    insts = json.loads(rig.record_file("50").read_text())["instances"]
    assert rig.requeues == [] and all(i["uuid"].startswith("MIG-") for i in insts)
    got = {}
    for i in insts:
        got[i["profile"].split(".")[0]] = got.get(i["profile"].split(".")[0], 0) + 1
    assert got == request_


def test_prolog_never_binds_an_instance_that_does_not_exist(rig, monkeypatch):
    """The answer names an instance the GPU does not have, and no layout change to make it: the job is
    requeued, not bound to nothing (its TaskProlog would export no real device)."""
    rig.job("27", "2g")
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog", lambda payload, who: {
        "action": "bind", "targets": {}, "instances": [{"gpu": 0, "profile": "3g.40gb", "start": 4}]})
    assert rig.hook("prolog", "27") == 0
    assert rig.requeues and rig.requeues[-1][0] == "27" and "missing on n1" in rig.requeues[-1][1]
    assert not rig.record_file("27").exists() and not rig.binding_file("27").exists()


def _half_make(rig, gpu: int, slot: str) -> None:
    """The instance at ``slot`` loses its compute instance, as a Prolog killed between NVML's two create
    calls leaves it."""
    from slurm_mig.mig.layout import Slot

    profile, start = slot.split("@")
    rig.gpu.destroy(gpu, Slot(int(start), profile))
    rig.gpu.half_make(gpu, Slot(int(start), profile))


def test_a_half_made_instance_is_made_whole_before_it_is_bound(rig, monkeypatch, capsys):
    """The controller names an instance that has no compute instance (so no UUID): the Prolog re-creates
    it before binding, and the job's TaskProlog exports a real UUID, not an empty CUDA_VISIBLE_DEVICES."""
    rig.job("40", "3g")
    _half_make(rig, 0, "3g@0")
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog", lambda payload, who: {
        "action": "bind", "targets": {}, "instances": [{"gpu": 0, "profile": "3g.40gb", "start": 0}]})
    assert rig.hook("prolog", "40") == 0 and rig.requeues == []
    (b,) = json.loads(rig.record_file("40").read_text())["instances"]
    assert b["uuid"].startswith("MIG-") and not any(i.half_made for i in rig.gpu.instances(0))
    capsys.readouterr()
    assert rig.hook("taskprolog", "40") == 0
    assert f"export CUDA_VISIBLE_DEVICES={b['uuid']}\n" in capsys.readouterr().out


def test_without_the_controller_a_half_made_instance_is_not_taken_for_a_free_one(rig):
    rig.job("41", "3g")
    for gpu in (0, 1):
        _half_make(rig, gpu, "3g@0")
    rig.srv.stop()
    assert rig.hook("prolog", "41") == 0
    assert not rig.record_file("41").exists()
    assert rig.requeues == [("41", "controller unreachable and no free 1 x 3g instance exists on n1")]


def test_without_the_controller_an_instance_in_use_is_not_taken_for_a_free_one(rig):
    """Processes run on both 3g instances though no binding here names them (left over, or started outside
    Slurm): the fallback requeues the job rather than share an instance with them."""
    from slurm_mig.mig.layout import Slot

    rig.job("42", "3g")
    for gpu in (0, 1):
        rig.gpu.set_in_use(gpu, Slot(0, "3g.40gb"), "pid 77, not a job's")
    rig.srv.stop()
    assert rig.hook("prolog", "42") == 0
    assert not rig.record_file("42").exists()
    assert rig.requeues == [("42", "controller unreachable and no free 1 x 3g instance exists on n1")]


def test_the_health_check_makes_half_made_instances_whole(rig):
    _half_make(rig, 1, "2g@4")
    assert rig.report() == 0
    assert _sim_layout(rig, 1) == "3g@0,2g@4,1g@6" and not any(i.half_made for i in rig.gpu.instances(1))


def test_a_node_rebooted_while_the_controller_is_down_recreates_its_layout(rig):
    """failure-modes.md: after a reboot the health check re-creates the layouts it cached at its last successful
    report. The controller sends only layouts that differ from the node's, so a converged node used to cache
    ``{}`` and came back from a reboot with no instance at all until the controller returned."""
    rig.store.set_desired("n1", 0, "7g@0", "test")
    assert rig.report() == 0 and _sim_layout(rig, 0) == "7g@0"
    assert rig.report() == 0  # converged: the controller sends nothing for either GPU
    rig.gpu.reset(mig_mode=True)  # reboot: every instance is gone
    rig.srv.stop()
    assert rig.report() == 0
    assert _sim_layout(rig, 0) == "7g@0" and _sim_layout(rig, 1) == "3g@0,2g@4,1g@6"


def test_without_the_controller_the_health_check_keeps_a_prologs_newer_target(rig, monkeypatch):
    """A Prolog re-carves toward the controller's target (only its own instance); the controller then goes
    down. The health check finishes that target from its cache, never takes the GPU back to the layout it
    cached before the re-carve."""
    assert rig.report() == 0
    rig.job("60", "1g")
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog", lambda payload, who: {
        "action": "bind", "targets": {"0": "3g@0,1g@4,1g@5,1g@6"},
        "instances": [{"gpu": 0, "profile": "1g.10gb", "start": 4}]})
    assert rig.hook("prolog", "60") == 0 and rig.requeues == []
    assert rig.hook("epilog", "60", SLURM_JOB_EXIT_CODE="0") == 0
    rig.srv.stop()
    assert rig.report() == 0
    assert _sim_layout(rig, 0) == "3g@0,1g@4,1g@5,1g@6" and _sim_layout(rig, 1) == "3g@0,2g@4,1g@6"


def test_a_health_check_report_older_than_a_prologs_recarve_keeps_the_prologs_target(rig, monkeypatch):
    """A Prolog re-carves GPU 0 and caches the controller's target while a health check's report (observed
    before the re-carve) is on its way; the controller, told of the re-carve, leaves GPU 0 out of its answer.
    The health check must not cache its older observed layout over the Prolog's target: after a reboot with
    the controller down it would re-create the layout from before the re-carve."""
    from types import SimpleNamespace

    from slurm_mig.mig.profiles import get_model
    from slurm_mig.nvml import apply_layout
    from slurm_mig.mig.layout import parse_layout

    assert rig.report() == 0
    newer = "3g@0,1g@4,1g@5,1g@6"
    real = rig.srv.routes["/v1/report"]

    def report_while_a_prolog_recarves(payload, who):
        if not getattr(report_while_a_prolog_recarves, "done", False):
            report_while_a_prolog_recarves.done = True
            apply_layout(rig.gpu, 0, parse_layout(newer, get_model("H100-80GB")))
            layoutcache.remember_targets(SimpleNamespace(state=SimpleNamespace(root=rig.tmp / "node" / "n1")),
                                    {"0": newer})
        return real(payload, who)

    monkeypatch.setitem(rig.srv.routes, "/v1/report", report_while_a_prolog_recarves)
    assert rig.report() == 0
    assert _sim_layout(rig, 0) == newer
    rig.gpu.reset(mig_mode=True)  # reboot: every instance is gone
    rig.srv.stop()
    assert rig.report() == 0
    assert _sim_layout(rig, 0) == newer and _sim_layout(rig, 1) == "3g@0,2g@4,1g@6"


@pytest.mark.parametrize("mode", [0o666, 0o644])
def test_root_hooks_refuse_a_config_others_can_write(rig, mode):
    import os

    if os.geteuid() != 0:
        pytest.skip("the check applies to hooks running as root")
    rig.job("22", "1g")
    rig.config.chmod(mode)
    if mode == 0o666:
        os.chown(rig.config, 0, 0)
    assert rig.hook("prolog", "22") == 0  # never drains the node ...
    if mode == 0o666:
        assert rig.requeues and rig.requeues[-1][0] == "22" and "chmod go-w" in rig.requeues[-1][1]
        assert not rig.binding_file("22").exists()
    else:
        assert rig.requeues == [] and rig.binding_file("22").exists()


def test_root_hooks_refuse_a_config_in_a_folder_another_user_may_rename(rig, tmp_path, monkeypatch):
    """The hooks judged the config file and the folder holding it, not the folders above: a root-owned 0644
    config in a root-owned 0755 folder inside one uid 65534 owns (a home, a shared project folder) was
    trusted, though that user may rename the folder away and put their own config in its place. Found by
    moving the rig's config so and running a Prolog: it bound the job. Refused now (config.check_trusted, the
    controller's and the policy store's rule): the job is requeued, naming the folder."""
    import os

    if os.geteuid() != 0:
        pytest.skip("the check applies to hooks running as root")
    home = tmp_path / "home"
    (home / "etc").mkdir(parents=True)
    moved = home / "etc" / "slurm-mig.toml"
    rig.config.rename(moved)
    monkeypatch.setenv("SLURM_MIG_CONFIG", str(moved))
    os.chown(home, 65534, 65534)
    rig.job("22", "1g")
    assert rig.hook("prolog", "22") == 0  # never drains the node ...
    assert rig.requeues and rig.requeues[-1][0] == "22" and f"chown root {home}" in rig.requeues[-1][1]
    assert not rig.binding_file("22").exists()


def test_hook_wrappers_do_not_import_code_from_the_current_folder(rig, tmp_path):
    """slurmd runs the Prolog/Epilog in its own working folder: a module planted there (or on PYTHONPATH)
    must not shadow the hook's code (the wrappers run Python with -I)."""
    import subprocess
    import sys
    from pathlib import Path

    evil = tmp_path / "cwd"
    (evil / "slurm_mig" / "node").mkdir(parents=True)
    for init in ("slurm_mig/__init__.py", "slurm_mig/node/__init__.py", "slurm_mig/node/hooks.py",
                 "slurm_mig/node/context.py", "slurm_mig/node/taskprolog.py"):
        (evil / init).write_text("print('export PLANTED=1')\n")
    repo = Path(__file__).resolve().parents[1]
    env = {"SLURM_MIG_PYTHON": sys.executable, "SLURM_MIG_CONFIG": str(rig.config), "SLURM_JOB_ID": "23",
           "SLURMD_NODENAME": "n1", "PYTHONPATH": str(evil), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["/bin/sh", str(repo / "prolog" / "slurm-mig-taskprolog")], cwd=evil, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "PLANTED" not in out.stdout and "export CUDA_VISIBLE_DEVICES=" in out.stdout, out.stdout


def _run_wrapper(path: str, tmp_path, **env) -> "subprocess.CompletedProcess":
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    base = {"SLURM_JOB_ID": "60", "SLURMD_NODENAME": "n1", "PATH": str(tmp_path)}  # no scontrol: not run
    return subprocess.run(["/bin/sh", str(repo / path)], cwd=tmp_path, env={**base, **env},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("wrapper", ["prolog/slurm-mig-prolog", "prolog/slurm-mig-taskprolog",
                                     "epilog/slurm-mig-epilog", "epilog/slurm-mig-healthcheck"])
def test_hook_wrappers_exit_0_when_python_cannot_start(tmp_path, wrapper):
    """A broken install must not drain the node or fail the task: the TaskProlog and health check wrappers
    used to exec Python and so exited 127; the TaskProlog now also hides every GPU from the task."""
    out = _run_wrapper(wrapper, tmp_path, SLURM_MIG_PYTHON="/nonexistent/python",
                       CUDA_VISIBLE_DEVICES="MIG-of-another-job")
    assert out.returncode == 0, (out.returncode, out.stderr)
    assert "could not run (status 127)" in out.stderr
    if wrapper.endswith("taskprolog"):
        assert out.stdout.splitlines() == ["export CUDA_VISIBLE_DEVICES="]


@pytest.mark.parametrize("wrapper", ["prolog/slurm-mig-prolog", "epilog/slurm-mig-epilog"])
def test_hook_wrappers_give_the_hook_their_start_time(tmp_path, wrapper):
    """[node].hook_time_limit_s counts from the wrapper's start (SLURM_MIG_T0_NS; docs/failure-modes.md), the
    interpreter's start-up included: the Epilog's wrapper did not set it, so its limit counted from Python's."""
    import time

    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "T0=$SLURM_MIG_T0_NS"\n')
    fake.chmod(0o755)
    before = time.time_ns()
    out = _run_wrapper(wrapper, tmp_path, SLURM_MIG_PYTHON=str(fake), PATH="/usr/bin:/bin")
    assert out.returncode == 0, out.stderr
    t0 = out.stdout.strip().removeprefix("T0=")
    assert t0.isdigit() and before - 10**9 <= int(t0) <= time.time_ns(), out.stdout


@pytest.mark.parametrize("config", ["missing", "broken"])
def test_taskprolog_with_a_broken_config_hides_every_gpu(tmp_path, config):
    import sys

    path = tmp_path / "slurm-mig.toml"
    if config == "broken":
        path.write_text("[node\ncache_dir = \n")
    out = _run_wrapper("prolog/slurm-mig-taskprolog", tmp_path, SLURM_MIG_PYTHON=sys.executable,
                       SLURM_MIG_CONFIG=str(path), CUDA_VISIBLE_DEVICES="MIG-of-another-job")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1:] == ["export CUDA_VISIBLE_DEVICES="], (out.stdout, out.stderr)
    assert "taskprolog hook failed" in out.stderr


def test_file_modes_and_owners(rig):
    """What docs/security.md promises about the node's files and the database."""
    import os
    import stat

    def mode(p):
        return stat.S_IMODE(os.stat(p).st_mode)

    rig.job("24", "1g")
    assert rig.hook("prolog", "24", SLURM_JOB_UID="65534") == 0  # the job of user 'nobody'
    root = rig.tmp / "node" / "n1"
    assert mode(root) == 0o711 and mode(root / "bindings") == 0o711
    assert mode(root / "outbox") == 0o700 and mode(root / "attempts") == 0o700
    assert mode(root / "desired.json") == 0o600 and mode(root / "apply.lock") == 0o600
    assert mode(root / "records") == 0o700 and mode(rig.record_file("24")) == 0o600
    f = rig.binding_file("24")
    if os.geteuid() == 0:
        # Readable by the job's group (its TaskProlog), owned by root: the user cannot chmod or rewrite it.
        import pwd

        assert os.stat(rig.record_file("24"))[4:6] == (0, 0)
        assert os.stat(f)[4:6] == (0, pwd.getpwuid(65534).pw_gid)
    assert mode(f) == 0o440
    assert mode(rig.sim_path) == 0o600
    assert mode(rig.tmp / "state.db") == 0o600
    rig.srv.stop()
    assert rig.hook("epilog", "24", SLURM_JOB_EXIT_CODE="0") == 0
    assert all(mode(m) == 0o600 for m in (root / "outbox").glob("*.json"))


@pytest.mark.parametrize("inherited", [
    # sbatch/srun run from inside a MIG job (its batch script, an interactive step) pass that job's values on
    # (--export=ALL): the new job is not bound here, so the old job's instance must not reach it.
    {"CUDA_VISIBLE_DEVICES": "MIG-5b2f7c8e-0000-4000-8000-000000000001", "SLURM_MIG_INSTANCES": "3g.40gb@0:0"},
    {"CUDA_VISIBLE_DEVICES": "MIG-aaaaaaaa-0000-4000-8000-000000000001,MIG-aaaaaaaa-0000-4000-8000-000000000002",
     "SLURM_MIG_INSTANCES": "1g.10gb@0:0,1g.10gb@0:1"},
])
def test_an_unbound_job_does_not_keep_the_mig_instance_of_the_job_it_was_submitted_from(rig, capsys, inherited):
    capsys.readouterr()
    assert rig.hook("taskprolog", "70", **inherited) == 0  # job 70 asked for no mig: no binding here
    lines = capsys.readouterr().out.splitlines()
    assert "export CUDA_VISIBLE_DEVICES=" in lines and "unset SLURM_MIG_INSTANCES" in lines, lines
    assert not any(line.startswith("export CUDA_VISIBLE_DEVICES=MIG-") for line in lines), lines


def test_an_unbound_job_keeps_the_gpus_slurms_gres_gpu_gave_it(rig, capsys):
    """gres/gpu sets CUDA_VISIBLE_DEVICES (device indexes) before the TaskProlog runs: left alone, even when the job
    was submitted from a MIG job (whose SLURM_MIG_INSTANCES came along)."""
    capsys.readouterr()
    assert rig.hook("taskprolog", "71", CUDA_VISIBLE_DEVICES="0,1", SLURM_MIG_INSTANCES="3g.40gb@0:0") == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("export CUDA_VISIBLE_DEVICES") for line in lines), lines
    assert "unset SLURM_MIG_INSTANCES" in lines, lines


def _bind_here(rig, job_id: str, uuid: str) -> None:
    from slurm_mig.node.localstate import NodeState
    from slurm_mig.store.models import BoundInstance

    NodeState(rig.tmp / "node" / "n1").write_binding(job_id, [BoundInstance(0, "1g.10gb", 0, uuid)])


HET = {"SLURM_HET_SIZE": "2", "SLURM_JOB_ID_HET_GROUP_0": "81", "SLURM_JOB_ID_HET_GROUP_1": "82"}


def test_a_heterogeneous_jobs_component_gets_its_own_instance(rig, capsys):
    """In a het job's step every task is told the leader's job id (Slurm 22.05: SLURM_JOB_ID=1 on the node
    running component 1, job 2), so component 1's tasks saw no GPU. The component bound here is used."""
    _bind_here(rig, "82", "MIG-82")
    capsys.readouterr()
    assert rig.hook("taskprolog", "81", **HET) == 0
    assert "export CUDA_VISIBLE_DEVICES=MIG-82" in capsys.readouterr().out.splitlines()


def test_two_components_bound_on_one_node_show_their_tasks_no_gpu(rig, capsys):
    # Slurm does not tell the TaskProlog which component a task is of: the leader's instance would be shared.
    _bind_here(rig, "81", "MIG-81")
    _bind_here(rig, "82", "MIG-82")
    capsys.readouterr()
    assert rig.hook("taskprolog", "81", **HET) == 0
    out = capsys.readouterr().out.splitlines()
    assert "export CUDA_VISIBLE_DEVICES=" in out and not any("MIG-8" in line for line in out), out


def test_a_job_submitted_from_a_het_job_does_not_take_its_components_instance(rig, capsys):
    # sbatch inside the het job passes its SLURM_JOB_ID_HET_GROUP_* on: job 90 is not one of its components.
    _bind_here(rig, "82", "MIG-82")
    capsys.readouterr()
    assert rig.hook("taskprolog", "90", **HET) == 0
    out = capsys.readouterr().out.splitlines()
    assert not any("MIG-82" in line for line in out), out


def test_the_end_event_shows_the_exit_status_as_explain_does(rig):
    # explain prints the outcome as exit:signal ("3:0") and then the job's events: the raw wait status
    # there ("exit 768") contradicted it on the same screen.
    _run_job(rig, "31", "1g", exit_code="768")
    ends = [e.message for e in rig.store.recent_events(50, job_id="31") if e.kind == "end"]
    assert ends and "exit 3:0" in ends[0] and "768" not in ends[0], ends


def _bind_two(rig, job_id: str) -> None:
    from slurm_mig.node.localstate import NodeState
    from slurm_mig.store.models import BoundInstance

    NodeState(rig.tmp / "node" / "n1").write_binding(job_id, [BoundInstance(0, "1g.10gb", 0, f"MIG-{job_id}a"),
                                                              BoundInstance(0, "1g.10gb", 1, f"MIG-{job_id}b")])


def _scontrol_steps(monkeypatch, steps: dict[str, str]) -> list[str]:
    """``scontrol -d show step J.S`` answers TresPerNode=<steps[J.S]> (fails for any other step)."""
    from slurm_mig.slurm import runner

    asked: list[str] = []

    def run_slurm(argv, **kw):
        asked.append(argv[-1])
        if argv[-1] in steps:
            return runner.SlurmResult(tuple(argv), 0, f"StepId={argv[-1]} UserId=0\n   TresPerNode={steps[argv[-1]]}\n",
                                      "", 0.0)
        return runner.SlurmResult(tuple(argv), 1, "", "Invalid job id specified", 0.0)

    monkeypatch.setattr(runner, "run_slurm", run_slurm)
    return asked


def _cvd(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("export CUDA_VISIBLE_DEVICES="))


def test_one_task_steps_asking_one_instance_each_see_different_ones(rig, capsys, monkeypatch):
    _bind_two(rig, "70")
    _scontrol_steps(monkeypatch, {"70.0": "gres:mig:1g:1", "70.1": "gres:mig:1g:1", "70.2": "gres:mig:1g:2"})
    seen = []
    for step in ("0", "1", "2"):
        capsys.readouterr()
        assert rig.hook("taskprolog", "70", SLURM_STEP_ID=step, SLURM_STEP_NUM_TASKS="1") == 0
        seen.append(_cvd(capsys.readouterr().out))
    assert seen == ["export CUDA_VISIBLE_DEVICES=MIG-70a", "export CUDA_VISIBLE_DEVICES=MIG-70b",
                    "export CUDA_VISIBLE_DEVICES=MIG-70a,MIG-70b"]


def _fake_proc(root, tasks: dict[int, dict[str, str]]) -> None:
    """A /proc holding one process per entry, with that environment (owned by this test's user)."""
    for pid, env in tasks.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    (root / "self").mkdir()


def test_a_step_is_not_shown_the_instance_a_running_step_of_its_job_was_shown(rig, capsys, monkeypatch, tmp_path):
    """Found on the demo cluster (2026-11-27): in a ``mig:1g:2`` job, a long ``srun --gres=mig:1g`` (step 0, the
    first instance), a short one (step 1, the second), then a third (step 2): round-robin by step id gave step 2
    the first instance again, beside step 0, while the second idled. The job's running steps are read from their
    tasks' environments; the batch shell and srun (no step id, every instance), another job's tasks and special
    steps do not count."""
    _bind_two(rig, "73")
    _scontrol_steps(monkeypatch, {f"73.{s}": "gres:mig:1g:1" for s in range(6)})
    both = "MIG-73a,MIG-73b"
    _fake_proc(tmp_path / "proc", {
        10: {"SLURM_JOB_ID": "73", "CUDA_VISIBLE_DEVICES": both},  # the batch shell, srun
        11: {"SLURM_JOB_ID": "73", "SLURM_STEP_ID": "0", "CUDA_VISIBLE_DEVICES": "MIG-73a"},  # step 0, runs on
        12: {"SLURM_JOB_ID": "73", "SLURM_STEP_ID": "0", "CUDA_VISIBLE_DEVICES": "MIG-73a"},  # its child
        13: {"SLURM_JOB_ID": "730", "SLURM_STEP_ID": "5", "CUDA_VISIBLE_DEVICES": "MIG-73b"},  # another job
        14: {"SLURM_JOB_ID": "73", "SLURM_STEP_ID": "4294967294", "CUDA_VISIBLE_DEVICES": "MIG-73b"},  # batch step
    })
    monkeypatch.setattr(taskprolog, "PROC_ROOT", str(tmp_path / "proc"))
    seen = {}
    for step in ("2", "3", "0"):
        capsys.readouterr()
        assert rig.hook("taskprolog", "73", SLURM_STEP_ID=step, SLURM_STEP_NUM_TASKS="1") == 0
        seen[step] = _cvd(capsys.readouterr().out)
    assert seen["2"] == "export CUDA_VISIBLE_DEVICES=MIG-73b", seen  # round-robin alone: MIG-73a, step 0's
    assert seen["3"] == "export CUDA_VISIBLE_DEVICES=MIG-73b", seen  # its own turn anyway
    assert seen["0"] == "export CUDA_VISIBLE_DEVICES=MIG-73a", seen  # a step's own tasks do not count


def test_a_forged_step_record_only_narrows_the_step_to_its_own_jobs_instances(rig, capsys, monkeypatch):
    """``scontrol -d show step`` prints the step's name (srun -J, the job's own user's text) as given, newlines
    and ``Key=Value`` included, before its TresPerNode line, so a step may spell another request. Checked
    (2026-11-27): whatever the record says, the TaskProlog shows the step a subset of its own job's binding,
    never another instance; and the user can set CUDA_VISIBLE_DEVICES in their own task anyway (security.md
    §6). So the step is still read with scontrol."""
    from slurm_mig.slurm import runner

    _bind_two(rig, "71")
    _bind_two(rig, "72")  # another job's instances on the node
    forged = ("StepId=71.{s} UserId=0\n   Nodes=1 CPUs=1 Tasks=1 Name=x\n   TresPerNode=gres:mig:1g:{n}\n"
              "   TresPerNode=gres:mig:1g:{n},gres:mig:3g:1 Network=(null)\n   TresPerNode=gres:mig:1g:2\n")
    for step, n in (("0", 1), ("1", 1), ("2", 7), ("3", 0)):
        monkeypatch.setattr(runner, "run_slurm", lambda argv, **kw: runner.SlurmResult(
            tuple(argv), 0, forged.format(s=step, n=n), "", 0.0))
        capsys.readouterr()
        assert rig.hook("taskprolog", "71", SLURM_STEP_ID=step, SLURM_STEP_NUM_TASKS="1") == 0
        shown = _cvd(capsys.readouterr().out).split("=", 1)[1].split(",")
        assert shown and set(shown) <= {"MIG-71a", "MIG-71b"}, (step, shown)


def test_a_het_step_is_not_cut_down_by_another_components_step_record(rig, capsys, monkeypatch):
    """A het step's tasks are told the leader's job id, so ``scontrol show step <leader>.<step>`` describes
    the leader's part of the step (here 3g:1), not the component bound on this node (1g:2)."""
    _bind_two(rig, "82")
    _scontrol_steps(monkeypatch, {"81.0": "gres:mig:3g:1"})
    capsys.readouterr()
    assert rig.hook("taskprolog", "81", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="1", **HET) == 0
    assert _cvd(capsys.readouterr().out) == "export CUDA_VISIBLE_DEVICES=MIG-82a,MIG-82b"


def test_a_node_rebooted_onto_a_driver_that_differs_from_our_table_does_not_recreate_its_layout_there(rig):
    """Found in review. failure-modes.md says that with the controller down the health check does not re-create
    a layout on a GPU whose driver's MIG profiles differ from our table. But it re-created whatever it had
    cached at its last report, made under the old driver: a node rebooted onto a driver that renumbered the
    3g carved GPU 1 from our table (the wrong size, or refused) before any controller could block it. The other
    GPU, whose driver agrees, is re-created as before."""
    assert rig.report() == 0  # caches both GPUs' layouts
    rig.gpu.reset(mig_mode=True)  # reboot onto a new driver: every instance is gone
    rig.gpu.set_driver_profiles(1, {2: {"id": 10}}, driver="590.1")  # the 3g renumbered on GPU 1
    rig.srv.stop()
    assert rig.report() == 0
    assert _sim_layout(rig, 0) == "3g@0,2g@4,1g@6"
    assert _sim_layout(rig, 1) == ""


def test_a_controller_older_than_table_errors_does_not_get_a_gpu_that_differs_carved(rig, monkeypatch):
    """A node upgraded before its controller: the older controller ignores table_errors and sends GPU 1 a
    layout. The node leaves that GPU as it is all the same."""
    rig.gpu.set_driver_profiles(1, {2: {"id": 10}}, driver="590.1")  # the 3g renumbered on GPU 1
    monkeypatch.setitem(rig.srv.routes, "/v1/report", lambda payload, who: {"desired": {"1": "7g@0"}, "release": []})
    assert rig.report() == 0
    assert _sim_layout(rig, 1) == "3g@0,2g@4,1g@6"


def test_a_table_verdict_kept_in_tables_json_is_made_again_when_slurm_mig_s_table_changes(rig, monkeypatch):
    """Found in review. The node kept its verdict per GPU and driver version only, while the verdict is as much
    about our table as about the driver: after an upgrade of slurm-mig whose table now agrees with the driver,
    the GPU stayed blocked (and after one whose table no longer agrees, it stayed open) until the driver
    changed or someone removed tables.json. The verdict is now kept with a fingerprint of our table."""
    import dataclasses

    from slurm_mig.mig import profiles

    rig.gpu.set_driver_profiles(1, {1: {"max_count": 2}}, driver="590.1")  # the driver caps the 2g at 2
    assert rig.report() == 0
    assert next(g for g in rig.store.observed_gpus("n1") if g.gpu == 1).blocked
    old = profiles.GPU_MODELS["H100-80GB"]
    fixed = dataclasses.replace(old, profiles=tuple(dataclasses.replace(p, max_count=2) if p.kind == "2g" else p
                                                    for p in old.profiles))
    monkeypatch.setitem(profiles.GPU_MODELS, "H100-80GB", fixed)  # the next slurm-mig's table says 2 as well
    assert rig.report() == 0
    assert all(g.blocked is None for g in rig.store.observed_gpus("n1"))


def test_a_prolog_with_no_earlier_runs_record_does_not_wait_for_the_layout_lock(rig, monkeypatch):
    """Found in review. The look for an earlier run's binding record took the node's layout lock in every
    Prolog whose job id had no attempt noted, which is every job's first Prolog on the node, record or not: a
    job asking for no MIG instance (or one the controller requeues) waited for whatever held the lock (a health
    check's re-carve, other Prologs' NVML steps), which it never did before. The lock is taken only when there
    is a record to set aside."""
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog", lambda payload, who: {"action": "skip"})
    lock = _HeldLock(rig, hold_s=3.0)
    asked = _lock_spy(monkeypatch)  # told by who asks for the lock, not by a clock
    try:
        assert rig.hook("prolog", "47", SLURM_JOB_RESTART_COUNT="0") == 0
    finally:
        lock.release()
    assert asked == []
    assert rig.requeues == []


def test_a_driver_reading_garbage_placements_still_gets_its_report_taken(rig):
    """Found in review. The controller refused a report whose table_errors hold a string over 300 characters
    (until 2026-11-27: an older controller still does), and the node capped their number but not their length:
    a driver (or a wrapper whose placement struct does not match it) reading garbage placements, the very
    mismatch the check is for, made differences longer than that. Every report and every Prolog's request from
    the node was then refused, so every job Slurm sent there was requeued, on its other GPUs too. Each
    difference is now cut to what the controller takes."""
    garbage = [[4_000_000_000 + k, 4_000_000_000 + k] for k in range(16)]
    rig.gpu.set_driver_profiles(1, {1: {"placements": garbage}}, driver="590.1")
    assert rig.report() == 0
    gpu1 = next(g for g in rig.store.observed_gpus("n1") if g.gpu == 1)
    assert gpu1.blocked and "2g.20gb: placements" in gpu1.blocked
    rig.job("1", "1g")  # GPU 0's 1g@6 is free
    assert rig.hook("prolog", "1") == 0
    assert rig.requeues == [] and rig.live("1")[0].gpu == 0


# -- a layout lock held too long (a hook hung inside NVML, a long chain of re-carves) ------------

def _lock_wait(rig, seconds: float) -> None:
    """Set [node].layout_lock_wait_s in the rig's config."""
    rig.config.write_text(rig.config.read_text().replace("[node]\n", f"[node]\nlayout_lock_wait_s = {seconds}\n", 1))


def _lock_spy(monkeypatch) -> list:
    """From now on, each NodeState.layout_lock asked for (its timeout) is noted in the list returned; the lock
    is still taken."""
    from slurm_mig.node.localstate import NodeState

    asked, real = [], NodeState.layout_lock
    monkeypatch.setattr(NodeState, "layout_lock", lambda self, *a, **k: asked.append(a or k) or real(self, *a, **k))
    return asked


class _HeldLock:
    """n1's layout lock held by another 'hook' (a thread: flock locks conflict between open files) until
    release() or ``hold_s``."""

    def __init__(self, rig, hold_s: float = 8.0):
        import threading

        state = hooks.Node("n1", hooks.NodeSettings.load()).state
        state.ensure()
        self.held, self.done = threading.Event(), threading.Event()

        def hold():
            with state.layout_lock():
                self.held.set()
                self.done.wait(hold_s)

        self.thread = threading.Thread(target=hold)
        self.thread.start()
        assert self.held.wait(5.0)

    def release(self):
        self.done.set()
        self.thread.join()


def test_a_prolog_waits_for_the_layout_lock_only_so_long_then_requeues_its_job(rig):
    """Found in review. The Prolog waited for the node's layout lock with no time limit: a hook or health check
    hung inside NVML while holding it (or a slow chain of re-carves) kept every Prolog on the node waiting until
    Slurm killed them at PrologEpilogTimeout, and Slurm drains a node whose Prolog it kills. The Prolog now
    waits [node].layout_lock_wait_s in all, then tells the controller (which releases the binding it made)
    and requeues its job with the reason, exit 0."""
    _lock_wait(rig, 0.5)
    rig.job("61", "3g")
    lock = _HeldLock(rig)
    try:
        t0 = time.monotonic()
        assert rig.hook("prolog", "61") == 0
        waited = time.monotonic() - t0
    finally:
        lock.release()
    assert waited < 4.0, waited
    ((job, reason),) = rig.requeues
    assert job == "61" and "n1 was busy changing its MIG layout for over 0.5 s" in reason, reason
    assert not rig.record_file("61").exists() and rig.live("61") == ()
    assert _events_of(rig, "61", "bind-failed")


def test_a_prolog_setting_an_earlier_runs_record_aside_waits_only_so_long(rig, monkeypatch):
    """The same bound for the Prolog's first look, an earlier run's binding record to set aside under the lock:
    without the lock it can neither set it aside nor bind this run over it, so the job is requeued."""
    _lock_wait(rig, 0.5)
    _run_one_left_processes(rig, monkeypatch, "62")
    _run_two_waits(rig, "62")
    lock = _HeldLock(rig)
    try:
        t0 = time.monotonic()
        assert rig.hook("prolog", "62", SLURM_JOB_RESTART_COUNT="1") == 0
        waited = time.monotonic() - t0
    finally:
        lock.release()
    assert waited < 4.0, waited
    assert [j for j, _ in rig.requeues] == ["62"] and "layout" in rig.requeues[0][1]
    assert set(_records(rig)) == {"62"}  # run 1's record kept as it was, for the next try to set aside


def test_a_health_check_waits_for_the_layout_lock_only_so_long_and_still_reports(rig, monkeypatch):
    """A health check whose lock is held past [node].layout_lock_wait_s leaves its layout steps (making
    half-made instances whole, the desired layouts it keeps, releases, the re-carve) to its next round; its
    report still goes out. Before, it waited as long as the holder, and the next rounds piled up behind it."""
    _lock_wait(rig, 0.5)
    monkeypatch.setitem(rig.srv.routes, "/v1/report", lambda payload, who: {"desired": {"0": "7g@0"}, "release": []})
    lock = _HeldLock(rig)
    try:
        t0 = time.monotonic()
        assert rig.report() == 0
        waited = time.monotonic() - t0
    finally:
        lock.release()
    assert waited < 4.0, waited  # 0.5 s in all, not 0.5 s per step
    assert _sim_layout(rig, 0) == "3g@0,2g@4,1g@6"  # left to the next round
    assert rig.report() == 0
    assert _sim_layout(rig, 0) == "7g@0"


def test_an_epilog_never_waits_for_the_layout_lock(rig, monkeypatch):
    """The Epilog takes no layout lock: it reads and removes its own job's binding record (copy first), which
    only ever frees an instance, and a lock holder that read the record before counts it busy. So it is not
    held up by a hung holder either (this passed before the bound too). Told by who asks for the lock, not
    by a clock: a loaded machine can take longer than the wait for an Epilog's own work."""
    _lock_wait(rig, 0.5)
    rig.job("63", "3g")
    assert rig.hook("prolog", "63") == 0
    lock = _HeldLock(rig)
    asked = _lock_spy(monkeypatch)
    try:
        assert rig.hook("epilog", "63", SLURM_JOB_EXIT_CODE="0") == 0
    finally:
        lock.release()
    assert asked == []
    assert not rig.record_file("63").exists() and rig.store.outcome("63").state == "COMPLETED"


# -- a long outbox after a controller outage ---------------------------------------------------

def _backlog(rig, monkeypatch, count: int, *, per_message_s: float, about: str | None = None) -> list[tuple]:
    """``count`` Epilogs of other jobs queued in n1's outbox (a long controller outage), then, with ``about``,
    one of an earlier run of that job id; the controller takes ``per_message_s`` for each /v1/epilog. Returns
    the (route, job id) of each message the controller is given, in order (its answers are not checked)."""
    state = hooks.Node("n1", hooks.NodeSettings.load()).state.ensure()
    for k in range(count):
        state.enqueue("/v1/epilog", {"job_id": str(900 + k), "node": "n1", "instances": [], "exit_code": 0})
    if about is not None:
        state.enqueue("/v1/epilog", {"job_id": about, "node": "n1", "instances": [], "exit_code": 0,
                                     "end_time": time.time() - 5})
    seen: list[tuple] = []

    def wrap(route):
        real = rig.srv.routes[route]

        def handler(payload, who):
            seen.append((route, str(payload.get("job_id"))))
            if route == "/v1/epilog" and int(payload["job_id"]) >= 900:
                time.sleep(per_message_s)
                return {"ok": True}
            return real(payload, who)
        return handler

    for route in ("/v1/epilog", "/v1/prolog", "/v1/bound", "/v1/bind-failed"):
        monkeypatch.setitem(rig.srv.routes, route, wrap(route))
    return seen


def _queued(rig) -> list[tuple[str, str]]:
    out = []
    for p in sorted((rig.tmp / "node" / "n1" / "outbox").glob("*.json")):
        doc = json.loads(p.read_text())
        out.append((doc["path"], str(doc["payload"].get("job_id"))))
    return out


def test_the_first_prolog_after_a_long_outage_delivers_a_bounded_share_of_the_outbox(rig, monkeypatch):
    """Found in review. A Prolog delivered the node's whole outbox before its own work: the first one after a
    long controller outage, with hundreds of messages queued and a slow controller, could run past
    PrologEpilogTimeout on that alone, and Slurm drains a node whose Prolog it kills. It now starts no queued
    message after HOOK_FLUSH_BUDGET_S (the Epilog likewise); the health check delivers the rest, in order."""
    for module in (prolog, epilog):
        monkeypatch.setattr(module, "HOOK_FLUSH_BUDGET_S", 0.5)
    seen = _backlog(rig, monkeypatch, 20, per_message_s=0.2)  # 4 s to deliver it all
    rig.job("71", "3g")
    t0 = time.monotonic()
    assert rig.hook("prolog", "71") == 0
    took = time.monotonic() - t0
    assert took < 2.0, took
    assert rig.requeues == [] and rig.record_file("71").exists() and len(rig.live("71")) == 1
    delivered = [j for r, j in seen if r == "/v1/epilog"]
    left = [j for _r, j in _queued(rig)]
    assert 1 <= len(delivered) <= 4 and delivered + left == [str(900 + k) for k in range(20)], (delivered, left)
    # The Epilog too, its own outcome queued behind the rest.
    t0 = time.monotonic()
    assert rig.hook("epilog", "71", SLURM_JOB_EXIT_CODE="0") == 0
    assert time.monotonic() - t0 < 2.0
    assert _queued(rig)[-1] == ("/v1/epilog", "71")
    assert rig.report() == 0  # the health check delivers the rest, in order
    assert _queued(rig) == []
    assert [j for r, j in seen if r == "/v1/epilog"] == [str(900 + k) for k in range(20)] + ["71"]
    assert rig.store.outcome("71").state == "COMPLETED"


def test_a_prolog_never_overtakes_an_older_message_about_its_job_left_in_the_outbox(rig, monkeypatch):
    """With the outbox delivered only in part, an Epilog of an earlier run of the same job id may still be
    queued: the controller takes an Epilog within its clock margin of a run's start for that run's, so delivered
    after this run's Prolog it would end this run. The Prolog then asks the controller nothing: it binds a free
    instance that exists, as without the controller, and queues its /v1/bound behind that Epilog."""
    monkeypatch.setattr(prolog, "HOOK_FLUSH_BUDGET_S", 0.3)
    seen = _backlog(rig, monkeypatch, 10, per_message_s=0.2, about="72")
    rig.job("72", "3g")
    assert rig.hook("prolog", "72") == 0
    assert rig.requeues == [] and rig.record_file("72").exists()
    assert ("/v1/prolog", "72") not in seen and ("/v1/bound", "72") not in seen
    assert _queued(rig)[-2:] == [("/v1/epilog", "72"), ("/v1/bound", "72")]
    assert rig.report() == 0
    mine = [s for s in seen if s[1] == "72"]
    assert mine == [("/v1/epilog", "72"), ("/v1/bound", "72")], mine


def test_a_prolog_never_overtakes_an_older_message_about_its_job_another_hook_is_delivering(rig, monkeypatch):
    """Found in review, with the above: a Prolog finding the outbox being delivered by another hook (its flush
    lock held: the health check) left it to that flush and asked the controller at once, so its /v1/prolog and
    /v1/bound could reach the controller before an Epilog of an earlier run of its job id still queued there.
    The Prolog now sees the older message and queues its own behind it."""
    import fcntl
    import os

    seen = _backlog(rig, monkeypatch, 0, per_message_s=0.0, about="73")
    rig.job("73", "3g")
    fd = os.open(rig.tmp / "node" / "n1" / "outbox.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another hook is delivering the outbox
        assert rig.hook("prolog", "73") == 0
    finally:
        os.close(fd)
    assert rig.requeues == [] and rig.record_file("73").exists()
    assert rig.report() == 0
    mine = [s for s in seen if s[1] == "73"]
    assert mine == [("/v1/epilog", "73"), ("/v1/bound", "73")], mine


# -- an older controller asking to carve on a GPU the node reports blocked ---------------------

def _block_gpu1(rig, how: str) -> None:
    """GPU 1 left with 3g@0 and room at 4-5, blocked ``how``; GPU 0 full (busy)."""
    for slot in ("3g@0", "2g@4", "1g@6"):
        rig.gpu.set_in_use(0, slot, "job 8")
    rig.gpu.destroy(1, Slot(4, "2g"))
    if how == "mig_pending":
        rig.gpu.set_mig_mode(1, False, pending=True)
    elif how == "foreign":
        rig.gpu.destroy(1, Slot(6, "1g"))
        rig.gpu.make_foreign(1, 6, 1, profile_id=47)
    else:  # the driver renumbered the 1g: our table's 1g.10gb is not the driver's
        rig.gpu.set_driver_profiles(1, {0: {"id": 30}}, driver="590.1")


@pytest.mark.parametrize("how,why", [
    ("mig_pending", "its MIG mode changes at the next GPU reset"),
    ("foreign", "it holds GPU instance(s) of a profile slurm-mig does not know"),
    ("table_errors", "the driver's MIG profiles differ from slurm-mig's table"),
])
def test_a_prolog_refuses_a_controller_answer_that_carves_on_a_gpu_the_node_reports_blocked(rig, monkeypatch,
                                                                                          how, why):
    """Found in review. The controller plans nothing on a GPU the node reports blocked, but one older than the
    block (a rolling upgrade) does not know it, and the Prolog carved whatever its answer named: beside an
    instance of a profile we do not know, or from our table where the driver's differs (the wrong size). The
    Prolog now refuses such an answer as a failed re-carve: the job is requeued with the reason, the
    controller told, the GPU left as it is."""
    _block_gpu1(rig, how)
    before = _sim_layout(rig, 1)
    answer = {"action": "bind", "instances": [{"gpu": 1, "profile": "2g.20gb", "start": 4}],
              "targets": {"1": "3g@0,2g@4" + (",1g@6" if how != "foreign" else "")}}
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog", lambda payload, who: answer)
    rig.job("81", "2g")
    assert rig.hook("prolog", "81") == 0
    ((job, reason),) = rig.requeues
    assert job == "81" and f"GPU 1: {why}" in reason and "blocked" in reason, reason
    assert _sim_layout(rig, 1) == before and not rig.record_file("81").exists()
    assert any("not carved: GPU 1 is blocked on n1" in m for m in _events_of(rig, "81", "bind-failed"))


def test_a_health_check_leaves_a_gpu_with_an_instance_of_an_unknown_profile_as_it_is_whoever_asks(rig, monkeypatch):
    """With 7138b9b the health check left out GPUs whose driver differs from our table, whoever asked; a GPU
    holding an instance of a profile we do not know (or with a MIG mode change pending) is blocked as well, and
    an older controller, or the layouts cached before it appeared, had the free slices beside it carved. It is
    now left as it is too."""
    _block_gpu1(rig, "foreign")
    monkeypatch.setitem(rig.srv.routes, "/v1/report",
                        lambda payload, who: {"desired": {"1": "3g@0,2g@4"}, "release": []})
    assert rig.report() == 0
    assert _sim_layout(rig, 1) == "3g@0"


# -- review of the lock bound, the bounded outbox and the blocked-GPU refusal (2026-11-26) -----------------

def test_a_prolog_that_never_asked_the_controller_leaves_the_lock_holders_journal_entries_open(rig, monkeypatch):
    """Found in review. A Prolog whose wait for the layout lock ran out before it asked the controller (here its
    first look, at the record an earlier run left) sent /v1/bind-failed naming no GPU; the controller, holding no
    journal entry that Prolog took up, closed every re-carve in progress on the node as failed: those the lock's
    holder (the health check re-carving GPU 1) was carrying out at that very moment. Nothing was touched and the
    controller bound nothing for this run, so the Prolog now only requeues its job."""
    from slurm_mig.mig.layout import parse_layout
    from slurm_mig.mig.profiles import get_model
    from slurm_mig.mig.transitions import plan_transition

    _lock_wait(rig, 0.3)
    _run_one_left_processes(rig, monkeypatch, "64")
    _run_two_waits(rig, "64")
    model = get_model("H100-80GB")
    steps = plan_transition(parse_layout(LAYOUT, model), parse_layout("7g@0", model), set())
    entry = rig.store.journal_begin("n1", 1, LAYOUT, "7g@0", steps, started=True)  # the health check's, under way
    lock = _HeldLock(rig)
    try:
        assert rig.hook("prolog", "64", SLURM_JOB_RESTART_COUNT="1") == 0
    finally:
        lock.release()
    assert [j for j, _ in rig.requeues] == ["64"] and "layout lock" in rig.requeues[0][1]
    assert rig.store.journal_entry(entry).state == "in_progress", rig.store.journal_entry(entry)


def test_a_prolog_choosing_as_without_the_controller_sends_no_bind_failure_when_the_lock_stays_held(rig, monkeypatch):
    """The same for a Prolog that chose an existing instance itself (here: an older message about its job waits in
    the outbox, so it asks the controller nothing) and then could not take the lock: the controller made no
    binding to release, and the queued /v1/bind-failed, delivered later, would close the node's re-carves in
    progress then as failed. Only the requeue."""
    import fcntl
    import os

    _lock_wait(rig, 0.3)
    _backlog(rig, monkeypatch, 0, per_message_s=0.0, about="65")
    rig.job("65", "3g")
    fd = os.open(rig.tmp / "node" / "n1" / "outbox.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another hook is delivering the outbox
        lock = _HeldLock(rig)
        try:
            assert rig.hook("prolog", "65") == 0
        finally:
            lock.release()
    finally:
        os.close(fd)
    assert [j for j, _ in rig.requeues] == ["65"] and "layout lock" in rig.requeues[0][1]
    assert _queued(rig) == [("/v1/epilog", "65")]


@pytest.mark.parametrize("how,why", [
    ("mig_pending", "its MIG mode changes at the next GPU reset"),
    ("table_errors", "the driver's MIG profiles differ from slurm-mig's table"),
])
def test_a_prolog_refuses_a_controller_answer_that_starts_its_job_on_a_gpu_where_it_would_start_none(rig, monkeypatch,
                                                                                                  how, why):
    """Found in review, with 02afa68. An older controller's answer that carves on a blocked GPU is refused, but one
    that only names an instance already there was bound: a job started on a GPU whose MIG mode changes at its
    next reset, or whose driver's MIG profiles differ from our table (the instance may not be the size its name
    says), where the node's own choice without the controller (and the controller that knows the block) starts
    none. Refused the same way now."""
    _block_gpu1(rig, how)
    before = _sim_layout(rig, 1)
    answer = {"action": "bind", "instances": [{"gpu": 1, "profile": "3g.40gb", "start": 0}], "targets": {}}
    monkeypatch.setitem(rig.srv.routes, "/v1/prolog", lambda payload, who: answer)
    rig.job("82", "3g")
    assert rig.hook("prolog", "82") == 0
    ((job, reason),) = rig.requeues
    assert job == "82" and f"GPU 1: {why}" in reason, reason
    assert _sim_layout(rig, 1) == before and not rig.record_file("82").exists()


@pytest.mark.parametrize("env_uid, sent", [("1001", 1001), ("", 1001), ("-1", 1001)])
def test_the_epilog_says_whose_job_it_ended(rig, monkeypatch, env_uid, sent):
    """The Epilog carries the job's uid (SLURM_JOB_UID, else the one its binding record keeps), so the controller
    can tell it from another user's job given the id meanwhile (slurmctld lost its state, its ids wrapped)."""
    rig.job("49", "1g")
    assert rig.hook("prolog", "49", SLURM_JOB_UID="1001") == 0
    got = []
    epilog = rig.srv.routes["/v1/epilog"]
    monkeypatch.setitem(rig.srv.routes, "/v1/epilog", lambda payload, who: got.append(payload) or epilog(payload, who))
    assert rig.hook("epilog", "49", SLURM_JOB_UID=env_uid, SLURM_JOB_EXIT_CODE="0") == 0
    assert [p["uid"] for p in got] == [sent]
    assert rig.store.get_job("49").state == "COMPLETED"


@pytest.mark.parametrize("case", ["log in a 0777 folder", "cache_dir below a 0777 folder",
                                  "cache_dir is a 1777 folder", "sim state in a folder uid 65534 owns"])
def test_a_hook_refuses_a_config_that_has_root_write_in_a_folder_others_may_change(rig, case):
    """The hooks judged the config (context._check_trusted), not the folders it names: [log].file, [node].cache_dir
    (the node's records, bindings and layout lock) or the simulated GPUs' state in a folder others may write (or
    own) had root write there, where a user could put a symbolic link in a file's place or rename the folder
    away. Found by pointing cache_dir below a 0777 folder: the Prolog made the node's records there and bound the
    job. Refused now (config.check_written_folders, folders.writable_by_others on the folder holding each): the
    job is requeued, naming the key and the folder, and nothing is written there."""
    import os

    if os.geteuid() != 0:
        pytest.skip("the check applies to hooks running as root")
    shared = rig.tmp / "shared"
    shared.mkdir(mode=0o755)
    text = rig.config.read_text()
    if case.startswith("log"):
        key, folder, text = "[log].file", shared, text + f'file = "{shared}/hooks.log"\n'
        shared.chmod(0o777)
    elif case.startswith("cache_dir"):
        key = "[node].cache_dir"
        folder = shared if "below" in case else shared / "node"
        text = text.replace(f'cache_dir = "{rig.tmp}/node"', f'cache_dir = "{shared}/node"')
        if "below" in case:
            shared.chmod(0o777)
        else:
            (shared / "node").mkdir(mode=0o755)
            (shared / "node").chmod(0o1777)
    else:
        key, folder = "[node].sim_state_path", shared
        text = text.replace(f'sim_state_path = "{rig.tmp}/gpus/{{node}}.json"', f'sim_state_path = "{shared}/{{node}}.json"')
        os.chown(shared, 65534, 65534)
    assert text != rig.config.read_text()
    rig.config.write_text(text)
    rig.job("23", "1g")
    assert rig.hook("prolog", "23") == 0  # never drains the node ...
    assert rig.requeues and rig.requeues[-1][0] == "23", rig.requeues
    said = rig.requeues[-1][1]
    assert key in said and str(folder) in said and ("chown root" if "65534" in case else "chmod") in said, said
    assert [p.name for p in shared.rglob("*") if p.is_file() or p.name == "n1"] == []


def test_a_hook_makes_its_log_0644_whatever_the_umask(rig):
    """[log].file was opened by logging.FileHandler, which made it 0666 less the umask: under umask 0 (slurmd's
    hooks get slurmd's) the log root's hooks append to was writable by anyone. It is made 0644 now
    (folders.log_file_handler)."""
    import os
    import stat

    log = rig.tmp / "logs" / "hooks.log"
    log.parent.mkdir(mode=0o755)
    rig.config.write_text(rig.config.read_text() + f'file = "{log}"\n')
    old = os.umask(0)
    try:
        assert rig.hook("healthcheck") == 0
    finally:
        os.umask(old)
        for h in list(logging.root.handlers):  # the hook's own, if basicConfig added it (pytest's may be first)
            if getattr(h, "baseFilename", None) == str(log):
                logging.root.removeHandler(h)
                h.close()
    assert stat.S_IMODE(log.stat().st_mode) == 0o644


@pytest.mark.parametrize("case", ["node folder uid 65534 owns", "records folder 0777", "{node} folder uid 65534 owns"])
def test_a_hook_refuses_a_node_folder_of_its_own_that_others_may_change(rig, case):
    """check_written_folders judged [node].cache_dir and the folder above sim_state_path's "{node}" as written,
    not the node's own folders that exist: <cache_dir>/<node> (or its records/) owned by another user, or
    writable by anyone, or the simulated GPUs' "{node}" folder another user owns, and the Prolog bound the job
    there (ensure chmod-ed a records/ 0777 back to 0700 without a word, whatever had been put in it). Found by
    chown 65534 of <cache_dir>/n1: the Prolog wrote the job's record in it. Judged now at the start, by the one
    rule, for the node the hook runs for: the job is requeued naming the key and the folder, nothing is bound."""
    import os

    if os.geteuid() != 0:
        pytest.skip("the check applies to hooks running as root")
    node_dir = rig.tmp / "node" / "n1"
    assert node_dir.is_dir()  # made by the rig's first health check
    if case.startswith("node folder"):
        key, folder, fix = "[node].cache_dir", node_dir, "chown root"
        os.chown(node_dir, 65534, 65534)
    elif case.startswith("records"):
        key, folder, fix = "[node].cache_dir", node_dir / "records", "chmod o-w"
        (node_dir / "records").chmod(0o777)
    else:
        key, fix = "[node].sim_state_path", "chown root"
        folder = rig.tmp / "sim" / "n1"
        init_state(folder / "gpus.json", [("H100-80GB", 2)], layouts={0: LAYOUT, 1: LAYOUT}, seed="n1")
        (rig.tmp / "sim").chmod(0o755)
        folder.chmod(0o755)
        text = rig.config.read_text().replace(f'sim_state_path = "{rig.tmp}/gpus/{{node}}.json"',
                                              f'sim_state_path = "{rig.tmp}/sim/{{node}}/gpus.json"')
        assert text != rig.config.read_text()
        rig.config.write_text(text)
        os.chown(folder, 65534, 65534)
    rig.job("23", "1g")
    assert rig.hook("prolog", "23") == 0  # never drains the node ...
    assert rig.requeues and rig.requeues[-1][0] == "23", rig.requeues
    said = rig.requeues[-1][1]
    assert key in said and f"{fix} {folder}" in said, said
    assert not rig.record_file("23").exists() and not rig.live("23")


# -- the hooks' time limit: every wait together stays under PrologEpilogTimeout ----------------------------------

def _stalling_controller(drip: bool = False):
    """A controller on 127.0.0.1 that takes each connection and reads the request, then never answers (hung, or
    its port taken by a process that never answers) or, ``drip``, answers a header byte every 0.1 s (a machine in
    the middle stretching the answer: each call then lasts 3 x request_timeout_s, its retry as long).
    Returns (url, close)."""
    from tests.helpers import tcp_server_per_connection

    def one(conn, stop):
        with conn:
            try:
                conn.settimeout(5)
                conn.recv(65536)
                if drip:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Pad: ")
                while not stop.wait(0.1):
                    if drip:
                        conn.sendall(b"a")
            except OSError:
                return

    port, close = tcp_server_per_connection(one, backlog=64)
    return f"http://127.0.0.1:{port}", close


def _node_setting(rig, **values) -> None:
    """Set [node] keys in the rig's config (replacing one already there)."""
    text = rig.config.read_text()
    for key, value in values.items():
        text = "\n".join(line for line in text.splitlines() if not line.startswith(f"{key} ="))
        text = text.replace("[node]\n", f"[node]\n{key} = {value}\n", 1)
    rig.config.write_text(text + "\n")


def test_a_prolog_with_a_dripping_controller_and_a_held_lock_ends_within_its_time_limit(rig):
    """Found by adding up a Prolog's waits (docs/failure-modes.md, "How long a hook runs"). Each wait had a
    bound of its own: the outbox message under way and every controller call up to 2 x 3 x request_timeout_s
    + 0.2 s with an answer sent a byte at a time (2 x 2 x timeout + 0.2 once connected at once), Slurm's squeue
    10 s, the layout lock layout_lock_wait_s, two scontrol calls 10 s each. Together, with the defaults, a
    Prolog whose controller answered its request slowly with a re-carve took up to 2 + 30.2 + 30.2 + 30 +
    re-carve + 30.2 (/v1/bind-failed) + 20 s = 142.6 s + re-carve: past the 120 s PrologEpilogTimeout the admin
    guide tells admins to set, so Slurm killed it and drained a healthy node. Now every wait comes out of one
    time limit ([node].hook_time_limit_s), 20 s of it kept for the requeue: here (scaled down: timeout 0.5 s,
    lock wait 20 s, limit 23 s) the old sum was 2.2 + 2.2 + 20 s, measured 24.4 s, over the limit; the Prolog
    now ends after about 3 s, exit 0, its job requeued with a reason that names the limit."""
    url, close = _stalling_controller(drip=True)
    try:
        _node_setting(rig, controller_url=f'"{url}"', request_timeout_s=0.5, layout_lock_wait_s=20,
                      hook_time_limit_s=23)
        node = hooks.Node("n1", hooks.NodeSettings.load())
        node.state.enqueue("/v1/epilog", {"job_id": "70", "node": "n1", "instances": []})  # an outbox to deliver
        rig.job("71", "3g")  # a 3g exists and is free: without the controller, the Prolog binds it locally
        lock = _HeldLock(rig, hold_s=60.0)
        try:
            t0 = time.monotonic()
            assert rig.hook("prolog", "71", SLURM_MIG_T0_NS=str(time.time_ns())) == 0
            took = time.monotonic() - t0
        finally:
            lock.release()
    finally:
        close()
    assert took < 23 - 20 + 1.5, f"the Prolog took {took:.1f} s; its calls and waits had 3 s (limit 23 s - 20 s)"
    ((job, reason),) = rig.requeues
    assert job == "71" and "hook_time_limit_s" in reason and "layout lock" in reason, reason
    assert not rig.record_file("71").exists()


def test_a_prolog_with_a_silent_controller_binds_an_existing_instance_within_its_time_limit(rig):
    """The fallback docs/failure-modes.md promises without the controller, within the time limit: the outbox
    message and /v1/prolog share what the limit leaves, then the Prolog binds an instance that exists, exit 0,
    and its /v1/bound waits in the outbox (sent at once: no time was left to try it)."""
    url, close = _stalling_controller()
    try:
        _node_setting(rig, controller_url=f'"{url}"', request_timeout_s=1.0, hook_time_limit_s=22.5)
        node = hooks.Node("n1", hooks.NodeSettings.load())
        node.state.enqueue("/v1/epilog", {"job_id": "72", "node": "n1", "instances": []})
        rig.job("73", "1g")
        t0 = time.monotonic()
        assert rig.hook("prolog", "73", SLURM_MIG_T0_NS=str(time.time_ns())) == 0
        took = time.monotonic() - t0
    finally:
        close()
    assert took < 22.5 - 20 + 1.5, took
    assert rig.requeues == [] and rig.record_file("73").exists()
    queued = [route for _, route, _ in node.state.pending_messages()]
    assert queued.count("/v1/bound") == 1 and "/v1/epilog" in queued, queued


def test_an_epilog_with_a_dripping_controller_ends_within_its_time_limit_and_keeps_the_outcome(rig):
    url, close = _stalling_controller(drip=True)
    try:
        rig.job("74", "1g")
        assert rig.hook("prolog", "74") == 0
        _node_setting(rig, controller_url=f'"{url}"', request_timeout_s=2.0, hook_time_limit_s=21.5)
        t0 = time.monotonic()
        assert rig.hook("epilog", "74", SLURM_MIG_T0_NS=str(time.time_ns())) == 0
        took = time.monotonic() - t0
    finally:
        close()
    assert took < 21.5 - 20 + 1.5, f"the Epilog took {took:.1f} s (without the limit: 2 x 2 x 2 + 0.2 = 8.2 s, measured)"
    node = hooks.Node("n1", hooks.NodeSettings.load())
    assert [route for _, route, _ in node.state.pending_messages()] == ["/v1/epilog"]
    assert not rig.record_file("74").exists()


def test_a_prolog_starts_no_recarve_it_has_no_time_left_for(rig, monkeypatch):
    """NVML cannot be interrupted: a re-carve (RECARVE_S_PER_GPU a GPU) that would run past what the time limit
    leaves before the requeue's reserve is not started; the job is requeued, the GPU untouched."""
    from slurm_mig.node import context

    rig.job("75", "7g")  # needs a re-carve of GPU 0 or 1
    before = (rig.layout(0), rig.layout(1))
    monkeypatch.setattr(context, "RECARVE_S_PER_GPU", 1e6)
    monkeypatch.setattr(prolog, "RECARVE_S_PER_GPU", 1e6)
    assert rig.hook("prolog", "75") == 0
    ((job, reason),) = rig.requeues
    assert job == "75" and "no time left to make the job's MIG instance" in reason, reason
    assert (rig.layout(0), rig.layout(1)) == before and not rig.record_file("75").exists()


@pytest.mark.parametrize("values, expect", [
    ({}, []),
    ({"layout_lock_wait_s": 80}, ["layout_lock_wait_s = 80 is never reached"]),
    ({"request_timeout_s": 30}, ["request_timeout_s = 30: one controller call may take 90 s"]),
    ({"hook_time_limit_s": 25}, ["hook_time_limit_s = 25 leaves 5 s", "layout_lock_wait_s = 30 is never reached",
                                 "request_timeout_s = 5"]),
])
def test_time_settings_a_hook_cannot_keep_are_said_at_each_hook(rig, caplog, values, expect):
    """An admin may set request_timeout_s, its retry and layout_lock_wait_s so large that they add up past the
    hook's time limit (and so PrologEpilogTimeout): the limit still ends the hook in time, but the waits they
    asked for are cut short; each Prolog and Epilog logs why, as `slurm-mig install-hooks` says it."""
    _node_setting(rig, **values)
    rig.job("76", "1g")
    with caplog.at_level(logging.WARNING, logger="slurm_mig.hooks"):
        assert rig.hook("prolog", "76") == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config: ")]
    assert len(said) == len(expect), said
    for words in expect:
        assert any(words in s for s in said), (words, said)
