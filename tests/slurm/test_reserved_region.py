"""A 7g behind busy 1g jobs on the real local cluster, with more 1g jobs queued behind it (the CI-sized run of
benchmarks/reserved_region.py): the region the policy reserves for the 7g drains for it, and no later 1g job is
started there only to be requeued.

Before 2026-11-27 each freed 1g went to the next 1g job and the 7g waited until they ran out (for ever under a
steady stream). The first hold-back (b51a272) left the idle instances out of Slurm's counts, but Slurm frees a
job's GRES the moment it ends and started a later 1g job there within 0.13 s, before any tick: 14 requeues of
seven later 1g jobs in the benchmark's scenario. Now the busy instances there are left out too (Slurm's count
below what its jobs hold, which Slurm 22.05 takes without draining the node or starting anything)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import reserved_region  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, slurm_installed):
    dc = reserved_region.make_cluster(tmp_path_factory.mktemp("region"), hold_reserved=True)
    try:
        dc.start()
        yield dc
    finally:
        dc.stop()


def test_a_7g_behind_busy_1g_jobs_runs_first_and_no_later_1g_job_is_requeued(cluster):
    # step 3 s, not 1.5: the hold starts at the first tick after the 7g's submission (1 s ticks), and a first 1g
    # job ending before it, after the later jobs' submission, is Slurm's to give to them (1 run in 6 at 1.5 s).
    r = reserved_region.run_scenario(cluster, step=3.0, later=3, later_s=3.0, timeout=180)
    assert r["finished"], r
    assert r["requeues"] == 0, r  # 14 in the benchmark's scenario with the first hold-back alone
    assert r["later_before_big"] == 0, r  # without the hold-back: all of them
    assert r["big_wait_s"] is not None and r["big_wait_s"] <= r["bound_s"] + 8, r
    nodes = cluster.cluster.client().scontrol_show_nodes() or []
    assert nodes and not any(n.drained for n in nodes if n.name == "n1"), nodes
