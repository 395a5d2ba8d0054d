"""A test run ended by SIGTERM or SIGHUP still tears its fixtures down (tests/conftest.py).

The slurm fixtures start slurmctld, slurmd and munged in their own sessions: a CI timeout or `kill`
that ended pytest with Python's default handler left all of them running (reproduced on the
session cluster of tests/slurm/conftest.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_mig.slurm.localcluster import _pid_alive as _alive  # a zombie counts as gone

CHILD_TEST = """
import os, subprocess, time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def daemon():
    # Like LocalCluster's daemons: its own session, so a signal to pytest's group does not reach it.
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    (HERE / "daemon.pid").write_text(str(proc.pid))
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        (HERE / "torn-down").write_text("yes")


def test_waits(daemon):
    (HERE / "ready").write_text("yes")
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_run_tears_its_fixtures_down(tmp_path, sig):
    # The repository's own conftest, as the only conftest of a tiny session.
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_child.py"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            # Python keeps an inherited SIG_IGN; the test wants pytest's default start.
                            preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM,
                                                                                          signal.SIGHUP)])
    daemon_pid = None
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.02)
        daemon_pid = int((tmp_path / "daemon.pid").read_text())
        proc.send_signal(sig)
        out = proc.communicate(timeout=30)[0].decode()
        assert (tmp_path / "torn-down").exists(), f"the fixture was not torn down:\n{out}"
        assert not _alive(daemon_pid)
        assert proc.returncode == 2, out  # pytest's "interrupted"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if daemon_pid and _alive(daemon_pid):
            os.kill(daemon_pid, signal.SIGKILL)
