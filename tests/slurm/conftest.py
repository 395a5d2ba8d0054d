"""The real local Slurm cluster for the slurm-marked tests.

One cluster per test session (3 nodes, 2 simulated H100s each, booted as
3g+2g+1g+1g per GPU), in its own state directory so it never disturbs a demo
cluster in <repo>/.run/cluster. Slurm and munge are installed with apt-get
when missing, so a fresh CI machine works; the only skip is "not root".
"""

from __future__ import annotations

import os
import time

import pytest

from slurm_mig.slurm.localcluster import LocalCluster, ensure_installed
from slurm_mig.slurm.runner import SlurmClient


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (slurmd runs jobs as their users)")


@pytest.fixture(scope="session")
def slurm_installed() -> None:
    """Slurm and munge are installed (apt-get on first use); skips when not root."""
    _need_root()
    ensure_installed()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory, slurm_installed, request) -> LocalCluster:
    """A running 3-node LocalCluster; stopped after the session, and its state removed unless it failed
    to start or a test failed (its logs are the only account of why; pytest prunes old temp dirs)."""
    # pytest's base temp path is short enough for munge's unix socket.
    cluster = LocalCluster(tmp_path_factory.mktemp("slurm-cluster"), nodes=3, gpus_per_node=2,
                           min_job_age=60)
    started = False
    try:
        cluster.start(wait=True, timeout=60)
        started = True
        yield cluster
    finally:
        cluster.stop(purge=started and not request.session.testsfailed)


@pytest.fixture(scope="session")
def slurm(slurm_cluster) -> SlurmClient:
    """A SlurmClient bound to the session cluster."""
    return slurm_cluster.client(timeout=20)


@pytest.fixture
def job_dir(tmp_path):
    """A folder for job output files (jobs run as root, on this machine)."""
    return tmp_path


def _wait_for(predicate, timeout: float = 15.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def wait_for():
    """``wait_for(predicate, timeout=15, what=...)``: poll until truthy, fail the test on timeout."""
    return _wait_for
