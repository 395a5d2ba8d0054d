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


def test_the_replay_asks_the_policy_for_the_jobs_reason_alone_and_shows_the_same(store, monkeypatch):
    """The replay shows one job's waiting reason, yet the policy listed every waiting job's in each decision
    and the simulator kept them all: at 1,024 GPUs and 10,000 pending jobs a third of `explain --replay`'s
    6 s (benchmarks/ops_scale.py). It now asks for that job's alone; what the replay shows is the same."""
    from dataclasses import replace

    from slurm_mig.sim import engine

    for k in range(6):  # a queue for the one GPU, ahead of W and behind it
        store.upsert_job(f"Q{k}", profile="7g", submit_time=T + 90 + 10 * k, time_limit_s=600, now=T + 90 + 10 * k)
    store.upsert_job("W", profile="4g", submit_time=T + 120, time_limit_s=900, now=T + 120)
    seen: list[tuple] = []
    real_apply = engine.Simulator.apply

    def apply(self, decision):
        seen.extend(decision.waiting)
        return real_apply(self, decision)

    monkeypatch.setattr(engine.Simulator, "apply", apply)
    for policy in ("first-fit", "frag-aware", "greedy"):
        seen.clear()
        got = replay_job(store, "W", policy=policy, now=T + 2000)
        assert got["sim_reason"] and {j for j, _ in seen} == {"W"}, policy
        # every waiting job's reason, as before: the same replay
        real_config = engine.SimConfig
        monkeypatch.setattr(engine, "SimConfig", lambda **kw: replace(real_config(**kw), explain_jobs=None))
        seen.clear()
        assert replay_job(store, "W", policy=policy, now=T + 2000) == got, policy
        assert len({j for j, _ in seen}) > 1
        monkeypatch.setattr(engine, "SimConfig", real_config)
