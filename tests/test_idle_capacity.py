"""training/idle_capacity.py: the measurement behind "where the capacity goes while jobs wait"."""

from __future__ import annotations

from training.idle_capacity import idle_while_waiting


def test_idle_capacity_shares_are_consistent_and_only_reservations_leave_a_fitting_job_waiting():
    ff = idle_while_waiting("rl-mix_extreme", 300, "first-fit")
    fa = idle_while_waiting("rl-mix_extreme", 300, "frag-aware")
    for r in (ff, fa):
        assert 0.0 <= r["reserved"] <= r["fits"] <= r["idle"] < 1.0
        assert r["waiting_h"] > 1 and r["mean_wait_s"] > 0
    # first-fit never reserves, so a job that fits starts in the same decision: nothing measured
    # after a decision may be idle where a waiting job fits (a measurement taken before the
    # decision, or one that ignored busy slices, would say otherwise).
    assert ff["fits"] == 0.0
    # frag-aware's only reason to leave a fitting job waiting is a reservation.
    assert fa["fits"] == fa["reserved"] > 0.0
