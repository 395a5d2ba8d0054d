"""Shared pytest fixtures (keep this small: area-specific fixtures live in their test modules)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading

import pytest


def _interrupt_on_signal(signum, frame):
    # Later ones are ignored: they must not cut the fixtures' clean-up short (SIGKILL still ends it).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(f"pytest got {signal.Signals(signum).name}")


def pytest_configure(config):
    """SIGTERM or SIGHUP (a CI timeout, `kill`, a closed terminal) end the session as Ctrl-C does.

    By default either signal ends Python without running a fixture's teardown, and the daemons the
    fixtures start in their own sessions (slurmctld, slurmd, munged of tests/slurm; the controller and
    agents of the demo cluster; the private munged of the MUNGE tests) outlive the run. As a
    KeyboardInterrupt, pytest stops the session and still tears down every fixture set up."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:  # not one a caller chose (nohup's SIG_IGN)
            signal.signal(sig, _interrupt_on_signal)


@pytest.fixture
def db():
    """A fresh, migrated in-memory state store (slurm_mig.store.Store), closed after the test."""
    from slurm_mig.store import open_store

    store = open_store(":memory:")
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def rl_isolated(monkeypatch, tmp_path):
    """No host config, env model or policy store leaks into a test of the rl policy."""
    monkeypatch.delenv("SLURM_MIG_RL_MODEL", raising=False)
    monkeypatch.setenv("SLURM_MIG_POLICY_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("SLURM_MIG_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setattr("slurm_mig.policies.rl._config_model_path", lambda: "")


@pytest.fixture(scope="session")
def lua51() -> str:
    """Path of a Lua 5.1 interpreter (the Lua slurmctld embeds on Debian 12), installed with apt-get
    when missing and possible; the test is skipped otherwise."""
    exe = shutil.which("lua5.1")
    if exe is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "lua5.1"]
        if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
            subprocess.run(cmd, env=env, capture_output=True)
        exe = shutil.which("lua5.1")
    if exe is None:
        pytest.skip("no lua5.1 interpreter (apt-get install lua5.1) to run the Slurm Lua scripts")
    return exe
