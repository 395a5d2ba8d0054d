"""training/size_upgrade.py: the measurement behind "Giving a job a bigger instance than it asked for"."""

from __future__ import annotations

import pytest

from slurm_mig.mig.layout import Layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.policies import get_policy
from slurm_mig.policies.base import ClusterState, GpuState, PendingJob
from slurm_mig.sim.workloads import KINDS, Job, SpeedModel, base_kind, rl_scaling_times
from training.size_upgrade import SizeUpgrade, main, play

H100 = get_model("H100-80GB")


def _state(*jobs: PendingJob, gpus: int = 1) -> ClusterState:
    return ClusterState(now=0.0, gpus=tuple(GpuState("n1", i, H100, Layout.empty(H100)) for i in range(gpus)),
                        pending=jobs)


def _given(rule: str, state: ClusterState) -> dict[str, str]:
    d = SizeUpgrade(rule).decide(state)
    targets = {(c.node, c.gpu): c.target for c in d.changes}
    for a in d.assignments:
        gi, slot = a.instances[0]
        assert slot in targets[(a.node, gi)].slots and targets[(a.node, gi)].is_valid()
    return {a.job_id: H100.profile(a.instances[0][1].profile).kind for a in d.assignments}


def test_each_rule_picks_its_size_on_an_empty_gpu():
    one = _state(PendingJob("j1", "1g", time_limit_s=3600))
    assert _given("largest", one) == {"j1": "7g"}
    assert _given("next", one) == {"j1": "2g"}
    assert _given("1g-to-2g", one) == {"j1": "2g"}
    assert _given("idle", one) == {"j1": "7g"}  # nothing left waiting
    assert _given("1g-to-2g", _state(PendingJob("j3", "3g", time_limit_s=3600))) == {"j3": "3g"}
    # Upgrades take only slices no other instance of the target uses: of two 3g jobs frag-aware carves at
    # 0 and 4 on one GPU, the first may become the 4g at 0 (4g + 3g is a layout), the second no 4g (a 4g
    # starts only at 0) and no 7g.
    two = _state(PendingJob("a", "3g", time_limit_s=3600), PendingJob("b", "3g", time_limit_s=3600))
    assert [str(a.instances[0][1]) for a in get_policy("frag-aware").decide(two).assignments] == \
        ["3g.40gb@0", "3g.40gb@4"]
    assert _given("largest", two) == {"a": "4g", "b": "3g"}


def test_idle_rule_upgrades_nothing_in_a_decision_that_leaves_a_job_waiting():
    busy = _state(PendingJob("big", "7g", time_limit_s=3600), PendingJob("small", "1g", time_limit_s=3600),
                  PendingJob("big2", "7g", time_limit_s=3600), gpus=2)
    assert [j for j, _ in SizeUpgrade("idle").decide(busy).waiting] == ["big2"]  # no GPU left for it
    assert _given("idle", busy) == {"big": "7g", "small": "1g"}
    assert _given("largest", busy) == {"big": "7g", "small": "7g"}


def test_upgraded_jobs_run_for_their_time_on_the_size_they_got():
    fa, up = play("poisson-mix", 300, None), play("poisson-mix", 300, "largest")
    assert fa["upgrades"] == fa["upgraded_jobs"] == 0
    assert up["upgraded_jobs"] == up["upgrades"] > 100 and up["unfinished"] == 0
    assert up["mean_jct_s"] < fa["mean_jct_s"]  # the bench's speed model: every job is faster on a bigger slice


def test_the_efficiency_oracle_never_upgrades_an_rl_mig_job():
    # t_s = (s-1+d)/s t_(s-1) with d > 0: s x t_s > (s-1) x t_(s-1), no size saves slice-seconds, so the
    # oracle is frag-aware decision for decision.
    fa, eff = play("rl-mix_extreme", 300, None), play("rl-mix_extreme", 300, "efficient")
    assert eff["upgrades"] == 0
    assert (eff["mean_wait_s"], eff["mean_jct_s"]) == (fa["mean_wait_s"], fa["mean_jct_s"])


def test_it_refuses_the_held_out_seeds_and_unknown_rules(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--seeds", "100-102"])
    assert e.value.code == 2 and "held-out" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown rule"):
        SizeUpgrade("huge")
    assert base_kind("2g.20gb") == "2g"


def _rl_job(job_id: str, d: float) -> Job:
    times = rl_scaling_times(600.0, d)
    return Job(job_id, 0.0, "1g", 1, times["1g"], 3600.0, SpeedModel.of(f"rl:d={d}", {k: times[k] / times["7g"]
                                                                                    for k in KINDS}))


def test_the_oracles_read_each_jobs_own_speed_curve():
    linear, flat = _rl_job("linear", 0.0), _rl_job("flat", 1.0)  # t_s = t_1 / s, and t_s = t_1
    for job, scaling, efficient in ((linear, "7g", "1g"), (flat, "1g", "1g")):
        state = _state(PendingJob(job.job_id, "1g", time_limit_s=3600))
        assert SizeUpgrade("scaling", {job.job_id: job}).decide(state).assignments[0].instances[0][1].profile \
            .startswith(scaling)
        # Linear scaling saves no slice-seconds: the efficiency oracle leaves it.
        assert SizeUpgrade("efficient", {job.job_id: job}).decide(state).assignments[0].instances[0][1].profile \
            .startswith(efficient)


def test_ratio_leaves_out_runs_without_times():
    """compute_metrics gives None for the times of a run where no job ran (0ea14b5): _ratio compared None with
    0 (TypeError) and would have ended the whole table; such a pair is left out, as a zero base is."""
    from training.size_upgrade import _ratio

    rows = [{"w": 1.0}, {"w": None}, {"w": 2.0}, {"w": 3.0}]
    base = [{"w": 2.0}, {"w": 3.0}, {"w": None}, {"w": 3.0}]
    assert _ratio(rows, base, "w").startswith("0.750 ± ")
