"""DemoCluster's helpers for the demo and the tests, checked without starting Slurm."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurm_mig.democluster import DemoCluster


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
