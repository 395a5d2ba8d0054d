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


# -- a site of several GPU models ---------------------------------------------------------------------------

def mixed_store(path, partitions: str = "one-each"):
    """Two nodes of 2 H100-80GB (h1, h2; each GPU a 7g) beside one of 2 A30-24GB (a2; each a 4g), each model a
    partition ("one-each": h100 and a30; "spanning": gpu on both), and finished jobs that ran on both."""
    s = open_store(path)
    for node in ("h1", "h2"):
        s.replace_observed(node, [{"gpu": g, "uuid": f"GPU-{node}{g}", "model": "H100-80GB", "mig_enabled": True}
                                  for g in (0, 1)],
                           [{"gpu": g, "profile": "7g", "start": 0, "uuid": f"MIG-{node}{g}"} for g in (0, 1)], now=T)
    s.replace_observed("a2", [{"gpu": g, "uuid": f"GPU-a{g}", "model": "A30-24GB", "mig_enabled": True}
                              for g in (0, 1)],
                       [{"gpu": g, "profile": "4g", "start": 0, "uuid": f"MIG-a{g}"} for g in (0, 1)], now=T)
    for k in range(6):  # earlier jobs on both models, recorded with their partition (as the controller does)
        on_a30 = k % 2 == 1
        jid = f"{'a' if on_a30 else 'h'}{k}"
        part = ("a30" if on_a30 else "h100") if partitions == "one-each" else "gpu"
        s.upsert_job(jid, profile="2g.12gb" if on_a30 else "7g", partition=part, submit_time=T + 10 * k,
                     time_limit_s=3600, now=T + 10 * k)
        s.set_job_state(jid, "RUNNING", now=T + 10 * k + 5, node="a2" if on_a30 else "h1")
        s.set_job_state(jid, "COMPLETED", now=T + 10 * k + 300)
        s.record_outcome(jid, state="COMPLETED", now=T + 10 * k + 300)
    return s


@pytest.fixture
def mixed(tmp_path):
    s = mixed_store(tmp_path / "state.db")
    yield s
    s.close()


def test_a_mixed_site_replays_on_a_node_group_per_model_not_on_the_most_common_one(mixed):
    """The replay took the most common model (4 H100s) and its nodes only: an A30 job's 1g.6gb, which no H100
    has, never started there, and the A30 jobs of the window crowded the H100s. Each model is a node group now,
    as `simulate --db` replays the site, the A30's nodes standing for a2."""
    from slurm_mig.ops.replay import replay_lines

    mixed.upsert_job("A", profile="1g.6gb", partition="a30", submit_time=T + 100, time_limit_s=3600, now=T + 100)
    mixed.set_job_state("A", "RUNNING", now=T + 160, node="a2")
    r = replay_job(mixed, "A", now=T + 500)
    assert r["sim_node"] == "a30-00" and r["sim_instances"][0][1].startswith("1g.6gb@"), r
    assert [(g["name"], g["model"], g["nodes"], g["gpus_per_node"]) for g in r["groups"]] == [
        ("h100", "H100-80GB", 2, 2), ("a30", "A30-24GB", 1, 2)]
    assert r["nodes"] == 3 and r["partitions_kept"] and r["jobs"] == 7
    assert r["node_names"] == {"h100-00": "h1", "h100-01": "h2", "a30-00": "a2"}
    lines = replay_lines(r)
    assert "2 x 2 H100-80GB (partition h100) starting as 7g@0 + 1 x 2 A30-24GB (partition a30) starting as " \
           "4g@0" in lines[0], lines[0]
    assert "a node group each; jobs keep their partition" in lines[1]
    assert "placed on a30-00 (= a2)" in lines[2]


def test_a_job_of_a_size_both_models_have_stays_in_its_partition(mixed):
    """A 1g recorded in the a30 partition was replayed on an H100 (the only model the replay had)."""
    mixed.upsert_job("B", profile="1g", partition="a30", submit_time=T + 100, time_limit_s=3600, now=T + 100)
    r = replay_job(mixed, "B", now=T + 500)
    assert r["sim_node"] == "a30-00", r


@pytest.mark.parametrize("policy", ["first-fit", "frag-aware", "greedy"])
def test_without_partitions_per_model_a_job_runs_on_any_group_that_has_its_size(tmp_path, policy):
    """The partition gpu spans both models: a job may run on any group whose model has its size (as
    `simulate --db`), so a 7g waits for an H100 while the A30s stand idle, and a 2g takes an A30 beside it."""
    from slurm_mig.ops.replay import replay_lines

    with mixed_store(tmp_path / "state.db", partitions="spanning") as s:
        for k in range(4):  # every H100 busy until T + 1000
            s.upsert_job(f"R{k}", profile="7g", partition="gpu", submit_time=T + 90, time_limit_s=3600, now=T + 90)
            s.set_job_state(f"R{k}", "RUNNING", now=T + 95, node=f"h{1 + k // 2}")
            s.set_job_state(f"R{k}", "COMPLETED", now=T + 1000)
        s.upsert_job("D", profile="7g", partition="gpu", submit_time=T + 100, time_limit_s=3600, now=T + 100)
        s.upsert_job("E", profile="2g", partition="gpu", submit_time=T + 100, time_limit_s=3600, now=T + 100)
        d = replay_job(s, "D", policy=policy, now=T + 1500)
        e = replay_job(s, "E", policy=policy, now=T + 1500)
    assert not d["partitions_kept"] and "more than one model" in d["partitions_why"]
    assert {g["name"] for g in d["groups"]} == {"H100-80GB", "A30-24GB"}
    assert d["sim_node"].startswith("H100-80GB-") and d["sim_wait_s"] >= 895, d
    assert e["sim_node"] == "A30-24GB-00" and e["sim_wait_s"] < 5, e
    assert "a job runs on any group whose model has its size (partition gpu ran jobs on more than one model)" \
        in replay_lines(d)[1]


def test_a_single_model_site_replays_as_before(store):
    """One model: the one-model cluster, named nNN, and no word of node groups."""
    from slurm_mig.ops.replay import replay_lines

    r = replay_job(store, "X", now=T + 500)
    assert "groups" not in r and r["model"] == "H100-80GB" and r["node_names"] == {"n00": "n1"}
    assert replay_lines(r)[0].startswith("Replay in the simulator (approximate: 1 jobs of that window, 1 x 1 "
                                         "H100-80GB all starting as empty, policy first-fit):")


def test_explain_on_a_mixed_site_prints_the_groups_and_a_simulate_command_that_replays_them(tmp_path, capsys):
    """The command explain prints for a picture named --nodes and --gpus-per-node, so `simulate --db`
    replayed every job on the most common model; without them it replays the site's node groups."""
    from slurm_mig.cli import main

    db = tmp_path / "state.db"
    mixed_store(db).close()
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[controller]\ndb_path = "{db}"\nlisten_port = 1\n')
    assert main(["--config", str(cfg), "explain", "a1", "--replay", "--width", "120"]) == 0
    out = capsys.readouterr().out
    assert "(partition h100) starting as 7g@0 + 1 x 2 A30-24GB (partition a30)" in out
    assert "placed on a30-00 (= a2)" in out
    hint = next(line for line in out.splitlines() if line.startswith("Timeline picture"))
    assert "--nodes" not in hint and "--gpus-per-node" not in hint and "--job a1 --plot joba1.png" in hint


def test_explains_simulate_command_is_quoted_for_the_shell(tmp_path, capsys):
    """The simulate command explain prints was pasted together unquoted: a state DB under a folder with a space
    in its name gave a command whose --db was the first half of the path."""
    import shlex

    from slurm_mig.cli import main

    db = tmp_path / "post mortem" / "state.db"
    db.parent.mkdir()
    mixed_store(db).close()
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[controller]\ndb_path = "{db}"\nlisten_port = 1\n')
    assert main(["--config", str(cfg), "explain", "a1"]) == 0
    hint = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Timeline picture"))
    argv = shlex.split(hint.split(": ", 1)[1])
    assert argv[:4] == ["slurm-mig", "simulate", "--db", str(db)] and argv[-4:] == ["--job", "a1", "--plot", "joba1.png"]


def test_a_whole_gpu_policy_is_refused_on_a_mixed_site_with_why_not_reported_as_a_failure(mixed):
    """no-mig gives every job whole GPUs, a 7g on an H100 and a 4g on an A30: the simulator has no one size for a
    job to ask for (simulate --db refuses it as well, bench leaves it out). The replay said "the replay failed:
    ConfigError: ..." as if it had crashed; it now says why it is not replayed."""
    from slurm_mig.ops.replay import replay_lines

    r = replay_job(mixed, "a1", policy="no-mig", now=T + 500)
    assert r == {"error": "policy no-mig is not replayed on a site of several GPU models: it gives every job whole "
                          "GPUs (a 7g on H100-80GB, a 4g on A30-24GB), so no one size for a job to ask for"}, r
    assert replay_lines(r) == [f"Replay: {r['error']}"]
    assert "groups" in replay_job(mixed, "a1", policy="first-fit", now=T + 500)
