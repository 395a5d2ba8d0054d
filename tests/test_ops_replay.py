"""`explain --replay`: which of the store's jobs the replayed window holds."""

from __future__ import annotations

import pytest

from slurm_mig.store import open_store

pytest.importorskip("slurm_mig.sim.engine")

from slurm_mig.ops.replay import replay_job  # noqa: E402

T = 1_000_000.0


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "state.db")
    s.replace_observed("n1", [{"gpu": 0, "uuid": "GPU-0", "model": "H100-80GB", "mig_enabled": True}], [], now=T)
    # X waited 300 s for the GPU's one 7g.
    s.upsert_job("X", profile="7g", submit_time=T + 100, time_limit_s=3600, now=T + 100)
    s.set_job_state("X", "RUNNING", now=T + 400, node="n1")
    yield s
    s.close()


def test_a_job_cancelled_while_running_held_its_gpu_in_the_replay(store):
    # Ran 0-400 and was scancelled: the tick corrects the Epilog's COMPLETED to Slurm's CANCELLED.
    store.upsert_job("C", profile="7g", submit_time=T, time_limit_s=3600, now=T)
    store.set_job_state("C", "RUNNING", now=T, node="n1")
    store.set_job_state("C", "COMPLETED", now=T + 400)
    assert store.correct_end_state("C", "CANCELLED", now=T + 401)
    r = replay_job(store, "X", now=T + 500)
    assert r["jobs"] == 2 and r["sim_wait_s"] == pytest.approx(300, abs=5)


def test_a_job_cancelled_while_pending_is_left_out_of_the_replay(store):
    store.upsert_job("P", profile="7g", submit_time=T, time_limit_s=3600, now=T)
    store.set_job_state("P", "CANCELLED", now=T + 50)
    r = replay_job(store, "X", now=T + 500)
    assert r["jobs"] == 1 and r["sim_wait_s"] < 5


def test_a_job_slurm_will_not_start_is_no_competition_in_the_replay(store):
    # Held since before X was submitted: it took no GPU, the policy never saw it, yet replayed it ran
    # first, for its whole time limit.
    store.upsert_job("H", profile="7g", submit_time=T + 50, time_limit_s=3600, now=T + 50,
                     blocked="held by its user (Slurm: JobHeldUser)")
    r = replay_job(store, "X", now=T + 500)
    assert r["jobs"] == 1 and r["sim_wait_s"] < 5
