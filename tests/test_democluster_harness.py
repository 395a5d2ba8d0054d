"""DemoCluster's helpers for the demo and the tests, checked without starting Slurm."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurm_mig.democluster import DemoCluster


@pytest.fixture
def ctrl_c_raises():
    """SIGINT as an interactive run has it (KeyboardInterrupt). A process started in the background by a
    non-interactive shell (`make test &`, nohup) inherits SIGINT ignored, and an ignored signal stays ignored
    (signals_deferred leaves it): the tests of what a Ctrl-C does then saw none."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def short_dir():
    """A short directory: slurmd's socket paths under the demo's state dir must fit in 107 bytes."""
    d = Path(tempfile.mkdtemp(prefix="smh", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class _FakeClient:
    def __init__(self, answers):
        self.answers = list(answers)

    def jobs(self):
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_wait_jobs_does_not_take_a_failed_squeue_for_an_empty_queue(short_dir, monkeypatch):
    dc = DemoCluster(short_dir / "demo")
    monkeypatch.setattr("slurm_mig.democluster.time.sleep", lambda s: None)
    client = _FakeClient([None])  # slurmctld unreachable the whole time
    monkeypatch.setattr(dc.cluster, "client", lambda *a, **k: client)
    assert dc.wait_jobs(["5"], timeout=0.2) is False

    running = SimpleNamespace(job_id=5, state="RUNNING")
    client = _FakeClient([None, [running], None, []])  # down, running, down, gone
    seen = []
    assert dc.wait_jobs(["5"], timeout=30, progress=seen.append) is True
    assert seen == [[], [running], [], []]


def _spawn_like_the_demo(argv):
    import subprocess

    return subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_start_stops_what_a_killed_demo_left_running(short_dir, monkeypatch):
    """A demo killed before its stop() leaves its controller and agents talking to the same Slurm and GPU state."""
    import sys
    import time

    dc = DemoCluster(short_dir / "demo")
    dc.claim_state_dir()
    (dc.state / "log").mkdir(exist_ok=True)  # claim_state_dir makes it (since 2026-11-27)
    sleeper = "import time; time.sleep(120)"
    leftover = _spawn_like_the_demo([sys.executable, "-c", sleeper, "--config", str(dc.config_path), "controller"])
    stranger = _spawn_like_the_demo([sys.executable, "-c", sleeper, "--config", "/elsewhere.toml"])
    try:
        (dc.state / "log" / "controller.pid").write_text(str(leftover.pid))
        (dc.state / "log" / "agent-n1.pid").write_text(str(stranger.pid))  # a recycled pid: not ours
        (dc.state / "log" / "agent-n2.pid").write_text("garbage")
        stopped = []
        monkeypatch.setattr(dc.cluster, "running", lambda: {"slurmctld": 4242, "munged": None})
        monkeypatch.setattr(dc.cluster, "stop", lambda **k: stopped.append(k))

        class Installed(Exception):
            pass

        def ensure_installed():
            raise Installed  # stop start() before it starts anything real

        monkeypatch.setattr(dc.cluster, "ensure_installed", ensure_installed)
        t0 = time.monotonic()
        with pytest.raises(Installed):
            dc.start()
        assert leftover.wait(timeout=5) is not None
        assert stranger.poll() is None
        assert stopped == [{}]  # the old Slurm cluster (and its old jobs) went too
        assert time.monotonic() - t0 < 8
    finally:
        dc._release_lock()
        for p in (leftover, stranger):
            p.kill()
            p.wait()


def test_a_second_demo_in_the_same_state_dir_is_refused_and_stops_nothing(short_dir, monkeypatch):
    from slurm_mig.errors import ConfigError

    first = DemoCluster(short_dir / "demo")
    first.claim_state_dir()
    first._acquire_lock()
    try:
        second = DemoCluster(short_dir / "demo")
        stopped = []
        monkeypatch.setattr(second.cluster, "stop", lambda **k: stopped.append(k))
        monkeypatch.setattr(second, "stop_leftovers", lambda: pytest.fail("the second demo killed the first's processes"))
        with pytest.raises(ConfigError, match="another slurm-mig demo"):
            second.start()
        second.stop()  # what `slurm-mig demo` does in its finally
        assert stopped == []
    finally:
        first._release_lock()
    # Once the first is done, the dir is free again.
    again = DemoCluster(short_dir / "demo")
    again._acquire_lock()
    again._release_lock()



_FAKE_DEMO = """
import sys, time
import slurm_mig.democluster
from slurm_mig.cli import main

log = open(sys.argv[1], "a", buffering=1)

class FakeDemo:
    def __init__(self, *a, **k):
        pass
    def start(self):
        log.write("start\\n")
        time.sleep(60)
    def stop(self):
        log.write("stop\\n")

slurm_mig.democluster.DemoCluster = FakeDemo
sys.exit(main(["demo", "--json"]))
"""


def test_demo_killed_with_sigterm_still_stops_everything(tmp_path):
    """`kill PID` or a CI timeout: the cluster, controller and agents must not outlive the demo."""
    import signal
    import subprocess
    import sys
    import time

    log = tmp_path / "calls"
    log.touch()
    proc = subprocess.Popen([sys.executable, "-c", _FAKE_DEMO, str(log)])
    try:
        deadline = time.monotonic() + 30
        while "start" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert log.read_text() == "start\n"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert log.read_text().split() == ["start", "stop"]
    assert rc == 128 + signal.SIGTERM


def test_make_clean_stops_the_demo_before_deleting_its_state_dir():
    """`make clean` deletes .run: a demo cluster, controller or agent still running from .run/demo would be
    orphaned (no pid files left to find it), holding its ports for ever."""
    import subprocess

    from slurm_mig.slurm.localcluster import REPO_ROOT

    if shutil.which("make") is None:
        pytest.skip("no make")
    plan = subprocess.run(["make", "-n", "clean"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    lines = plan.splitlines()
    rm = next(i for i, line in enumerate(lines) if line.startswith("rm -rf .run"))
    assert any("DemoCluster().stop_leftovers()" in line for line in lines[:rm]), plan
    assert any("cluster down" in line for line in lines[:rm]), plan


def test_sim_instances_lists_every_half_made_instance(short_dir):
    """With delays the simulated GPU makes and destroys an instance in NVML's two calls, so a reader meets
    GPU instances without their compute instance (no UUID) mid-way on several GPUs at once; keyed by UUID
    alone they hid each other, and the demo's view, the crash watcher's layouts and its final check that the
    database sees what the GPUs have lost all but one."""
    from slurm_mig.mig.layout import Slot
    from slurm_mig.nvml.simulated import SimulatedBackend, init_state

    dc = DemoCluster(short_dir / "demo", gpus_per_node=2)
    path = dc.state / "gpus" / "n1.json"
    init_state(path, [("H100-80GB", 2)], layouts={0: "3g@0", 1: "3g@0"}, seed="n1")
    gpu = SimulatedBackend(path)
    gpu.half_make(0, Slot(4, "1g.10gb"))
    gpu.half_make(1, Slot(4, "1g.10gb"))
    insts = dc.sim_instances("n1")
    assert sorted((i["gpu"], i["profile"], i["start"]) for i in insts.values()) == [
        (0, "1g.10gb", 4), (0, "3g.40gb", 0), (1, "1g.10gb", 4), (1, "3g.40gb", 0)]
    assert sum(1 for u in insts if u.startswith("MIG-")) == 2


def _fake_daemon(state_dir):
    """A stand-in for munged or slurmd that LocalCluster finds by its pid file (its argv names the state dir)."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(state_dir)],
                            start_new_session=True)


def test_a_ctrl_c_during_a_cluster_stop_does_not_cut_it_short(short_dir, monkeypatch, ctrl_c_raises):
    """A second Ctrl-C (or a CI timeout's SIGTERM) while stop() waited for the slurmds ended it there: munged
    kept running and its pid file stayed, so it was found again only by luck. The interrupt now comes after."""
    import signal

    from slurm_mig.slurm.localcluster import LocalCluster, _pid_alive

    c = LocalCluster(short_dir / "c", nodes=1)
    (c.state_dir / "pids").mkdir(parents=True)
    slurmd, munged = _fake_daemon(c.state_dir), _fake_daemon(c.state_dir)
    try:
        c._pidfile("slurmd-n1").write_text(str(slurmd.pid))
        c._pidfile("munged").write_text(str(munged.pid))
        assert c.running() == {"munged": munged.pid, "slurmctld": None, "slurmd-n1": slurmd.pid}
        real_terminate = c._terminate

        def interrupted_terminate(pids, timeout):
            if slurmd.pid in pids:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C while the slurmds go down
            real_terminate(pids, timeout)

        monkeypatch.setattr(c, "_terminate", interrupted_terminate)
        with pytest.raises(KeyboardInterrupt):
            c.stop()
        assert not _pid_alive(slurmd.pid) and not _pid_alive(munged.pid)
        assert not any(c.running().values()) and not c._pidfile("munged").exists()
    finally:
        for p in (slurmd, munged):
            p.kill()
            p.wait()


def test_a_ctrl_c_while_the_demo_stops_its_controller_still_stops_its_cluster(short_dir, monkeypatch, ctrl_c_raises):
    import signal

    dc = DemoCluster(short_dir / "demo")
    dc.claim_state_dir()
    dc._acquire_lock()
    stopped = []
    monkeypatch.setattr(dc.cluster, "stop", lambda **k: stopped.append(k))
    dc.procs = {"controller": None}
    monkeypatch.setattr(dc, "_kill", lambda name: signal.raise_signal(signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        dc.stop()
    assert stopped == [{}] and dc._lock_fd is None


def test_stopping_daemons_leaves_other_children_exit_status_to_their_own_popen():
    """LocalCluster collected its exited daemons with waitpid(-1), which also took any other child of the
    process that had exited (the demo's controller, a test's subprocess): its Popen then read exit status 0."""
    import subprocess
    import sys
    import time

    from slurm_mig.slurm.localcluster import LocalCluster

    other = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    # A daemon slow to stop (it ignores SIGTERM), so the stop waits, collecting as it goes, then kills it.
    daemon = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                               "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE)
    daemon.stdout.readline()  # its handler is set
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until `other` is a zombie: exited, not yet collected
            with open(f"/proc/{other.pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.02)
        LocalCluster._terminate(LocalCluster.__new__(LocalCluster), [daemon.pid], 0.5)
        assert daemon.poll() is not None  # the daemon was stopped and collected
        assert other.wait(timeout=5) == 3
    finally:
        for p in (other, daemon):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_signal_while_signals_deferred_restores_its_handlers_leaves_none_held(monkeypatch):
    """signals_deferred restored SIGINT's handler, then SIGTERM's and SIGHUP's, one call each: a Ctrl-C that
    came between them ran SIGINT's own handler at once (KeyboardInterrupt) and left the deferring handler on
    SIGTERM and SIGHUP for good, so every later SIGTERM was swallowed (a CI's stop, `kill`: the process could
    no longer be stopped but by SIGKILL). Blocking the signals while restoring did not do either where another
    thread takes the signal (Python runs the main thread's handler all the same): a handler still in place
    once the block is over now passes each signal on to the one it stood in for."""
    import os
    import signal
    import threading

    from slurm_mig.slurm import localcluster

    seen = []
    before = {signal.SIGINT: signal.default_int_handler,
              signal.SIGTERM: lambda signum, frame: seen.append(signum),
              signal.SIGHUP: lambda signum, frame: seen.append(signum)}
    saved = {s: signal.signal(s, h) for s, h in before.items()}
    real = signal.signal
    sent = []

    def restoring(sig, handler):
        old = real(sig, handler)
        if sig == signal.SIGINT and handler is before[signal.SIGINT] and not sent:
            sent.append(sig)
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C just as SIGINT's own handler is back
        return old

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)  # a thread that may take a process's signal
    other.start()
    monkeypatch.setattr(localcluster.signal, "signal", restoring)
    try:
        with pytest.raises(KeyboardInterrupt):
            with localcluster.signals_deferred():
                pass
        monkeypatch.undo()
        assert sent
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.raise_signal(sig)
        assert seen == [signal.SIGTERM, signal.SIGHUP]  # each reached its own handler, none was held
    finally:
        monkeypatch.undo()
        stop.set()
        for s, h in saved.items():
            signal.signal(s, h)
