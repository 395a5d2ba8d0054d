"""How a job ended: Slurm's word over the Epilog's guess.

On Slurm 22.05 (the demo cluster) the Epilog of a job cancelled with scancel, and of one killed at its
time limit, reads SLURM_JOB_EXIT_CODE=0, so both were recorded COMPLETED; squeue then listed them
CANCELLED and TIMEOUT (``"job_state": "TIMEOUT", "exit_code": 15, "state_reason": "TimeLimit"``).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from slurm_mig.config import Config
from slurm_mig.controller.service import Controller
from slurm_mig.slurm.parsers import SlurmJob, SlurmNode
from slurm_mig.store import open_store


class EndedSlurm:
    def __init__(self):
        self.queue: list[SlurmJob] = []

    def jobs(self):
        return list(self.queue)

    def reservations(self):
        return []

    def nodes(self):
        return [SlurmNode(name="n1", state="idle", gres={}, gres_used={})]

    def job_detail(self, job_id):
        return None

    def update_node_gres(self, node, counts, **kw):
        return ""


@pytest.fixture
def ctl(tmp_path):
    store = open_store(tmp_path / "state.db")
    c = Controller(Config(), store, EndedSlurm())
    yield c
    store.close()


def _ended_by_epilog(store, job_id: str, end: float) -> None:
    store.upsert_job(job_id, profile="1g", submit_time=end - 100, now=end - 100)
    store.set_job_state(job_id, "RUNNING", now=end - 90, node="n1")
    store.record_outcome(job_id, state="COMPLETED", exit_code=0, end_time=end, now=end)
    store.set_job_state(job_id, "COMPLETED", now=end, exit_code=0)


def _running_3(ctl, now: float) -> None:
    """Job 3 (1g) submitted 400 s before ``now``, running on n1 (bound to INST) since 300 s before."""
    ctl.store.upsert_job("3", profile="1g", submit_time=now - 400, now=now - 400)
    ctl.store.set_job_state("3", "RUNNING", now=now - 300, node="n1")
    ctl.store.bind("3", "n1", [INST], now=now - 300)


def _requeued_3(submit_time: int, restarts: int) -> SlurmJob:
    """Slurm's record of job 3 (1g) requeued and held back (BeginTime), with its new submit time and restart count."""
    return SlurmJob(job_id=3, state="PENDING", mig={"1g": 1}, tres_per_node="gres:mig:1g:1", submit_time=submit_time,
                    restart_cnt=restarts, priority=1, state_reason="BeginTime")


def _listed(job_id: int, state: str, end: float) -> SlurmJob:
    return SlurmJob(job_id=job_id, state=state, mig={"1g": 1}, tres_per_node="gres:mig:1g:1", submit_time=1,
                    start_time=int(end - 90), end_time=int(end), nodes=["n1"], priority=1)


@pytest.mark.parametrize("state", ["CANCELLED", "TIMEOUT"])
def test_slurms_end_state_replaces_the_epilogs_guess(ctl, state):
    end = time.time() - 5
    _ended_by_epilog(ctl.store, "3", end)
    ctl.slurm.queue = [_listed(3, state, end + 1)]
    ctl.tick()
    assert ctl.store.get_job("3").state == state
    assert [o.state for o in ctl.store.outcomes() if o.job_id == "3"] == [state]
    assert any(f"Slurm says it ended {state}" in e.message for e in ctl.store.recent_events(10))
    ctl.tick()  # said once
    assert sum(f"Slurm says it ended {state}" in e.message for e in ctl.store.recent_events(10)) == 1


def test_an_earlier_run_of_a_reused_id_does_not_rewrite_this_ones_end(ctl):
    end = time.time() - 5
    _ended_by_epilog(ctl.store, "3", end)
    ctl.slurm.queue = [_listed(3, "CANCELLED", end - 3600)]  # another run, an hour before
    ctl.tick()
    assert ctl.store.get_job("3").state == "COMPLETED"
    assert [o.state for o in ctl.store.outcomes()] == ["COMPLETED"]


def test_slurms_end_state_corrects_only_the_latest_runs_outcome(ctl):
    # Run 1 completed and its outcome was recorded. The id ran again (requeued after it ended, or reused)
    # and that run was cancelled: its own outcome is recorded (it was dropped when outcomes were one per
    # job id) and corrected to CANCELLED; run 1's outcome stays COMPLETED.
    end1 = time.time() - 3600
    _ended_by_epilog(ctl.store, "3", end1)
    ctl.store.restart_job("3", now=end1 + 10, reason="live again")
    end2 = time.time() - 5
    ctl.store.set_job_state("3", "RUNNING", now=end2 - 90, node="n1")
    assert ctl.store.record_outcome("3", state="COMPLETED", exit_code=0, end_time=end2, now=end2)
    ctl.store.set_job_state("3", "COMPLETED", now=end2, exit_code=0)
    ctl.slurm.queue = [_listed(3, "CANCELLED", end2 + 1)]
    ctl.tick()
    assert ctl.store.get_job("3").state == "CANCELLED"
    assert [(o.run, o.state, o.end_time) for o in ctl.store.outcomes()] == [(1, "COMPLETED", end1),
                                                                           (2, "CANCELLED", end2)]
    assert ctl.store.outcome("3").state == "CANCELLED"


def test_a_reused_ids_new_run_waits_from_its_own_submission(ctl):
    # The id's new run kept the first run's submit time: its wait (in `jobs`, `explain`, its outcome and
    # the retrainer's trace) was counted from a submission an hour before, by another job.
    end1 = time.time() - 3600
    _ended_by_epilog(ctl.store, "3", end1)
    submitted = int(time.time() - 60)
    ctl.slurm.queue = [SlurmJob(job_id=3, state="PENDING", mig={"1g": 1}, tres_per_node="gres:mig:1g:1",
                                submit_time=submitted, priority=1)]
    ctl.tick()
    job = ctl.store.get_job("3")
    assert (job.state, job.run, job.submit_time) == ("PENDING", 2, submitted)
    ctl.store.set_job_state("3", "RUNNING", now=submitted + 20, node="n1")
    assert ctl.store.record_outcome("3", state="COMPLETED", exit_code=0, end_time=submitted + 50)
    assert [(o.run, o.wait_s) for o in ctl.store.outcomes()] == [(1, 10.0), (2, 20.0)]


# -- slurm_mig_jobs_finished_total counts the end state Slurm gives, not the Epilog's guess ------------

def _finished(ctl) -> dict[str, float]:
    return {labels[0][1]: v for (name, labels), v in ctl.metrics.counters.items()
            if name == "slurm_mig_jobs_finished_total" and v}


def _epilog_says_completed(ctl, job_id: str) -> float:
    """Job ``job_id`` ran on n1 and its Epilog reported exit status 0, through the node API."""
    now = time.time()
    ctl.store.upsert_job(job_id, profile="1g", submit_time=now - 100, now=now - 100)
    ctl.store.set_job_state(job_id, "RUNNING", now=now - 90, node="n1")
    assert ctl.on_epilog({"job_id": job_id, "node": "n1", "exit_code": 0, "end_time": now,
                          "instances": [{"gpu": 0, "profile": "1g.10gb", "start": 0}]}, None)["recorded"]
    return now


@pytest.mark.parametrize("state", ["CANCELLED", "TIMEOUT"])
def test_jobs_finished_counts_slurms_end_state_not_the_epilogs(ctl, state):
    end = _epilog_says_completed(ctl, "3")
    ctl.slurm.queue = [_listed(3, state, end)]
    ctl.tick()
    assert _finished(ctl) == {state: 1.0}
    ctl.tick()  # counted once
    assert _finished(ctl) == {state: 1.0}


def test_jobs_finished_counts_the_epilogs_state_when_slurm_agrees(ctl):
    end = _epilog_says_completed(ctl, "3")
    ctl.slurm.queue = [_listed(3, "COMPLETED", end)]
    ctl.tick()
    ctl.tick()
    assert _finished(ctl) == {"COMPLETED": 1.0}


def test_jobs_finished_counts_the_epilogs_state_once_slurm_has_forgotten_the_job(ctl):
    t = [_epilog_says_completed(ctl, "3")]
    ctl.clock = lambda: t[0]
    ctl.tick()  # Slurm lists nothing (purged after MinJobAge): its word may still come from a late squeue
    assert _finished(ctl) == {}
    t[0] += 61
    ctl.tick()
    assert _finished(ctl) == {"COMPLETED": 1.0}


def test_a_job_whose_epilog_came_just_before_a_controller_restart_is_counted_after_it(ctl):
    """The outcomes waiting to be counted were a note in memory only: a job whose Epilog the controller
    handled, and that it restarted before counting (the next tick, or a minute later; while Slurm cannot
    be asked, however long that takes), was counted by neither process. They are kept in the database."""
    end = _epilog_says_completed(ctl, "3")
    again = Controller(Config(), ctl.store, EndedSlurm())  # the controller restarted on the same database
    again.slurm.queue = [_listed(3, "CANCELLED", end)]
    again.tick()
    assert _finished(again) == {"CANCELLED": 1.0}
    # Counted, and so not again by the next process.
    third = Controller(Config(), ctl.store, EndedSlurm())
    third.slurm.queue = [_listed(3, "CANCELLED", end)]
    third.tick()
    t = time.time() + 61
    third.clock = lambda: t
    third.tick()
    assert _finished(third) == {}


def test_a_job_counted_before_a_controller_restart_is_not_counted_again(ctl):
    end = _epilog_says_completed(ctl, "3")
    ctl.slurm.queue = [_listed(3, "COMPLETED", end)]
    ctl.tick()
    assert _finished(ctl) == {"COMPLETED": 1.0}
    again = Controller(Config(), ctl.store, EndedSlurm())
    t = time.time() + 61
    again.clock = lambda: t
    again.tick()
    assert _finished(again) == {}


def test_a_job_slurm_forgot_is_counted_a_minute_after_its_epilog_across_a_restart(ctl):
    end = _epilog_says_completed(ctl, "3")
    again = Controller(Config(), ctl.store, EndedSlurm())
    again.clock = lambda: end + 30
    again.tick()  # Slurm lists nothing: a late squeue may still give its end state
    assert _finished(again) == {}
    again.clock = lambda: end + 61  # a minute after the first process recorded its outcome, not the restart
    again.tick()
    assert _finished(again) == {"COMPLETED": 1.0}


# -- an Epilog that arrives after the job id ran again ---------------------------------------------
# A run's Epilog waits in its node's outbox while the controller cannot be reached; meanwhile the id runs
# again (requeued after it ended, reused) and the store tracks that as a new run (restart_job). The old
# run's Epilog then ended the new run: its outcome recorded under the new run's number, the job COMPLETED
# while it ran, and its instance released.

INST = {"gpu": 0, "profile": "1g.10gb", "start": 0}


def _old_runs_epilog(end: float, **extra) -> dict:
    return {"job_id": "3", "node": "n1", "exit_code": 0, "end_time": end, "instances": [INST], **extra}


def test_an_epilog_of_an_earlier_run_does_not_end_the_run_after_it(ctl):
    end1 = time.time() - 600
    _ended_by_epilog(ctl.store, "3", end1)  # run 1 ended; its outcome came from Slurm's record, say
    ctl.store.restart_job("3", now=end1 + 200, reason="live again", submit_time=end1 + 190)
    ctl.store.set_job_state("3", "RUNNING", now=end1 + 300, node="n1")
    ctl.store.bind("3", "n1", [INST], now=end1 + 300)
    answer = ctl.on_epilog(_old_runs_epilog(end1 - 5), None)
    job = ctl.store.get_job("3")
    assert (job.state, job.run, job.end_time) == ("RUNNING", 2, None)
    assert ctl.store.bound_instances("3")  # run 2's instance is still its own
    assert [(o.run, o.end_time) for o in ctl.store.outcomes()] == [(1, end1)]  # a duplicate: nothing new
    assert answer == {"ok": True, "recorded": False}
    assert any(e.kind == "late" and "before the current one" in e.message for e in ctl.store.recent_events(10))
    # Run 2's own Epilog ends it.
    assert ctl.on_epilog(_old_runs_epilog(time.time()), None)["recorded"]
    assert [o.run for o in ctl.store.outcomes()] == [1, 2] and ctl.store.get_job("3").state == "COMPLETED"


def test_a_late_epilog_records_the_earlier_runs_missing_outcome_under_that_run(ctl):
    """Run 1 ended here without an outcome (the tick saw Slurm list it ended, Slurm had forgotten its exit
    status); run 2 waits. Run 1's Epilog arrives: its outcome is run 1's, and run 2 waits on."""
    end1 = time.time() - 600
    ctl.store.upsert_job("3", profile="1g", submit_time=end1 - 100, now=end1 - 100)
    ctl.store.set_job_state("3", "RUNNING", now=end1 - 90, node="n1")
    ctl.store.set_job_state("3", "CANCELLED", now=end1)
    ctl.store.restart_job("3", now=end1 + 200, reason="live again", submit_time=end1 + 190)
    answer = ctl.on_epilog(_old_runs_epilog(end1 - 2, exit_code=256), None)
    assert answer == {"ok": True, "recorded": True}
    (o,) = ctl.store.outcomes()
    assert (o.run, o.state, o.exit_code, o.end_time, o.node, o.start_time) == (1, "FAILED", 256, end1 - 2, "n1", None)
    job = ctl.store.get_job("3")
    assert (job.state, job.run, job.submit_time) == ("PENDING", 2, end1 + 190)


def test_the_current_runs_epilog_a_little_behind_the_controllers_clock_still_ends_it(ctl):
    # The node's clock runs up to [auth].max_clock_skew_s behind: an Epilog stamped before the run's start
    # as the controller recorded it, by less than the margin, is this run's.
    end1 = time.time() - 600
    _ended_by_epilog(ctl.store, "3", end1)
    ctl.store.restart_job("3", now=end1 + 200, reason="live again", submit_time=end1 + 190)
    started = time.time() - 2
    ctl.store.set_job_state("3", "RUNNING", now=started, node="n1")
    ctl.store.bind("3", "n1", [INST], now=started)
    assert ctl.on_epilog(_old_runs_epilog(started - ctl.cfg.auth.max_clock_skew_s), None)["recorded"]
    assert [o.run for o in ctl.store.outcomes()] == [1, 2] and ctl.store.bound_instances("3") == ()


def test_a_node_made_binding_of_an_earlier_run_is_not_adopted_for_the_run_after_it(ctl):
    """Found in review. The node could not reach the controller while run 1 ran: its Prolog bound the
    job alone and queued /v1/bound, and its Epilog queued /v1/epilog. Slurm's record settled run 1 here,
    and the id ran again (run 2, waiting). When the node got through, the outbox's /v1/bound made the
    waiting run 2 RUNNING on run 1's instance, and run 1's Epilog then passed for run 2's (it ended after
    that binding): it ended run 2 while Slurm had it waiting, and recorded run 1's end a second time,
    under run 2. A binding made before the current run began (by more than the clocks may differ) is an
    earlier run's, as for the Epilog: it is not adopted."""
    end1 = time.time() - 600
    _ended_by_epilog(ctl.store, "3", end1)  # run 1's outcome, from Slurm's record, say
    ctl.store.restart_job("3", now=end1 + 200, reason="live again", submit_time=end1 + 190)
    bound = {"job_id": "3", "node": "n1", "local": True, "bound_at": end1 - 90,
             "instances": [{**INST, "uuid": "MIG-1"}], "message_id": "b0" * 16}
    assert ctl.on_bound(bound, None) == {"ok": True}
    job = ctl.store.get_job("3")
    assert (job.state, job.run, job.start_time, job.node) == ("PENDING", 2, None, None)
    assert ctl.store.bound_instances("3") == ()
    assert any(e.kind == "late" and "before its current run" in e.message for e in ctl.store.recent_events(10))
    assert ctl.on_epilog(_old_runs_epilog(end1, message_id="e0" * 16), None) == {"ok": True, "recorded": False}
    assert ctl.store.get_job("3").state == "PENDING"
    assert [(o.run, o.end_time) for o in ctl.store.outcomes()] == [(1, end1)]  # one run, one outcome


def test_a_node_made_binding_of_the_current_run_is_still_adopted(ctl):
    # The same message for the run that waits (its own binding, made after its submission): adopted.
    end1 = time.time() - 600
    _ended_by_epilog(ctl.store, "3", end1)
    ctl.store.restart_job("3", now=end1 + 200, reason="live again", submit_time=end1 + 190)
    bound_at = end1 + 250
    assert ctl.on_bound({"job_id": "3", "node": "n1", "local": True, "bound_at": bound_at,
                         "instances": [{**INST, "uuid": "MIG-2"}]}, None) == {"ok": True}
    job = ctl.store.get_job("3")
    assert (job.state, job.run, job.start_time, job.node) == ("RUNNING", 2, bound_at, "n1")
    assert [b.uuid for b in ctl.store.bound_instances("3")] == ["MIG-2"]


# -- found in review: end-of-job counting, late Epilogs ----------------------------------------------

class _EpilogAfterTheTicksCommit(Controller):
    """An Epilog that waited on the store lock while the tick's transaction ran is handled the moment that
    transaction commits, before the tick counts the jobs it saw end (threads: one interleaving, made
    deterministic here)."""

    waiting: dict | None = None

    def _final_end_states(self, *args, **kw):
        if self.waiting is not None:
            payload, self.waiting = self.waiting, None
            assert self.on_epilog(payload, None)["recorded"]
        return super()._final_end_states(*args, **kw)


def test_an_epilog_handled_after_the_ticks_look_is_counted_with_slurms_state_by_the_next_tick(tmp_path):
    """Found in review. Slurm lists job 3 CANCELLED; its Epilog (exit 0) waited on the store lock during the
    tick and was handled right after the tick's commit. The tick counted it, as Slurm listed it ended, with
    the Epilog's COMPLETED, which its own look had not seen to correct (the next tick did, too late for the
    counter)."""
    store = open_store(tmp_path / "state.db")
    ctl = _EpilogAfterTheTicksCommit(Config(), store, EndedSlurm())
    try:
        end = time.time() - 2
        store.upsert_job("3", profile="1g", submit_time=end - 100, now=end - 100)
        store.set_job_state("3", "RUNNING", now=end - 90, node="n1")
        ctl.slurm.queue = [_listed(3, "CANCELLED", end)]
        ctl.waiting = {"job_id": "3", "node": "n1", "exit_code": 0, "end_time": end, "instances": [INST]}
        ctl.tick()
        assert ctl.waiting is None and store.outcome("3").state == "COMPLETED"  # handled after the tick looked
        assert _finished(ctl) == {}
        ctl.tick()  # sees it, corrects it, counts it
        assert store.outcome("3").state == "CANCELLED"
        assert _finished(ctl) == {"CANCELLED": 1.0}
        ctl.tick()
        assert _finished(ctl) == {"CANCELLED": 1.0}
    finally:
        store.close()


def test_jobs_finished_counts_each_run_of_a_job_id_with_its_own_end(ctl):
    """Found in review. Run 1 of job 3 failed and its Epilog was recorded; before a tick counted it (Slurm
    forgot it, or could not be asked), the id ran again and run 2's Epilog was recorded too. The note on
    run 1 was keyed by the job id alone: run 2's replaced it, and run 1 was never counted."""
    t = [time.time()]
    ctl.clock = lambda: t[0]
    ctl.store.upsert_job("3", profile="1g", submit_time=t[0] - 100, now=t[0] - 100)
    ctl.store.set_job_state("3", "RUNNING", now=t[0] - 90, node="n1")
    assert ctl.on_epilog(_old_runs_epilog(t[0], exit_code=256), None)["recorded"]
    ctl.store.restart_job("3", now=t[0] + 5, reason="live again", submit_time=t[0] + 4)
    ctl.store.set_job_state("3", "RUNNING", now=t[0] + 6, node="n1")
    t[0] += 10
    assert ctl.on_epilog(_old_runs_epilog(t[0]), None)["recorded"]
    ctl.tick()  # Slurm lists neither
    assert _finished(ctl) == {}
    t[0] += 61
    ctl.tick()
    assert _finished(ctl) == {"FAILED": 1.0, "COMPLETED": 1.0}
    assert [(o.run, o.state) for o in ctl.store.outcomes()] == [(1, "FAILED"), (2, "COMPLETED")]


def test_a_late_epilog_is_not_recorded_under_a_run_it_may_not_be(ctl):
    """Found in review. Run 1 of job 3 ended (its outcome from Slurm's record); run 2 was cancelled while it
    waited (no outcome: it never ran here); run 3 waits. Run 1's Epilog arrives from the outbox: it was
    recorded under run 2, the run before the current one, which never ran. With two or more runs before
    the current one the store cannot tell which one an Epilog ended, so it records none."""
    end1 = time.time() - 900
    _ended_by_epilog(ctl.store, "3", end1)
    ctl.store.restart_job("3", now=end1 + 200, reason="live again", submit_time=end1 + 190)
    ctl.store.set_job_state("3", "CANCELLED", now=end1 + 250)  # cancelled while pending: no outcome
    ctl.store.restart_job("3", now=end1 + 400, reason="live again", submit_time=end1 + 390)
    answer = ctl.on_epilog(_old_runs_epilog(end1), None)
    assert answer == {"ok": True, "recorded": False}
    assert [(o.run, o.end_time) for o in ctl.store.outcomes()] == [(1, end1)]
    job = ctl.store.get_job("3")
    assert (job.state, job.run) == ("PENDING", 3)
    assert any(e.kind == "late" and "runs before" in e.message for e in ctl.store.recent_events(10))
    assert _finished(ctl) == {}


def test_an_epilog_delivered_long_after_its_job_ended_is_corrected_to_slurms_end_state(ctl):
    """Found in review. The controller was down for 10 minutes; job 3 was cancelled meanwhile and its Epilog
    (exit 0) waited in the node's outbox. The job's end was stored as when the controller handled the
    Epilog, 600 s after Slurm's, so the tick took Slurm's CANCELLED for another run's and kept COMPLETED."""
    now = time.time()
    ctl.store.upsert_job("3", profile="1g", submit_time=now - 1100, now=now - 1100)
    ctl.store.set_job_state("3", "RUNNING", now=now - 1000, node="n1")
    assert ctl.on_epilog(_old_runs_epilog(now - 600), None)["recorded"]
    ctl.slurm.queue = [_listed(3, "CANCELLED", now - 600)]
    ctl.tick()
    assert ctl.store.get_job("3").state == "CANCELLED"
    assert ctl.store.outcome("3").end_time == now - 600  # the Epilog's end, not when it was handled
    assert ctl.store.outcome("3").state == "CANCELLED"
    assert _finished(ctl) == {"CANCELLED": 1.0}


@pytest.mark.parametrize("end", ["now", "future", "before_start"])
def test_an_epilogs_end_time_is_taken_only_where_it_is_sane(ctl, end):
    now = time.time()
    ctl.store.upsert_job("3", profile="1g", submit_time=now - 200, now=now - 200)
    ctl.store.set_job_state("3", "RUNNING", now=now - 100, node="n1")
    ctl.clock = lambda: now
    sent = {"now": now - 1, "future": now + 3600, "before_start": now - 110}[end]
    assert ctl.on_epilog(_old_runs_epilog(sent), None)["recorded"]
    # A clock an hour ahead: when the controller handled it; a little before the start (clocks differ by up
    # to the margin; earlier it would be another run's): the start.
    expected = {"now": now - 1, "future": now, "before_start": now - 100}[end]
    assert ctl.store.outcome("3").end_time == expected


def test_a_late_epilog_does_not_overwrite_slurms_end_state(ctl):
    """Found in review. Job 3's Epilog was late; a tick recorded its end from Slurm's record (CANCELLED).
    The Epilog then arrived (exit 0) and made the job COMPLETED, until the next tick put CANCELLED back."""
    now = time.time()
    ctl.store.upsert_job("3", profile="1g", submit_time=now - 200, now=now - 200)
    ctl.store.set_job_state("3", "RUNNING", now=now - 100, node="n1")
    ctl.store.record_outcome("3", state="CANCELLED", end_time=now - 60, now=now - 5)  # _settle_lost_epilogs
    ctl.store.set_job_state("3", "CANCELLED", now=now - 5)
    assert ctl.on_epilog(_old_runs_epilog(now - 60), None) == {"ok": True, "recorded": False}
    job = ctl.store.get_job("3")
    assert (job.state, job.end_time) == ("CANCELLED", now - 5)
    assert [o.state for o in ctl.store.outcomes()] == ["CANCELLED"]


def test_an_epilog_of_a_job_slurm_ended_records_slurms_end_state(ctl):
    """A job the store had waiting ended in Slurm, CANCELLED (it ran, bound by its node alone, while no tick
    saw it run). Its Epilog (exit 0) is the only outcome: it is recorded with Slurm's state, not COMPLETED."""
    now = time.time()
    ctl.store.upsert_job("3", profile="1g", submit_time=now - 200, now=now - 200)
    ctl.store.set_job_state("3", "CANCELLED", now=now - 5)
    assert ctl.on_epilog(_old_runs_epilog(now - 10), None)["recorded"]
    assert ctl.store.get_job("3").state == "CANCELLED"
    (o,) = ctl.store.outcomes()
    assert (o.state, o.exit_code) == ("CANCELLED", 0)


@pytest.mark.parametrize("written", ["after_it_began", "unknown", "implausible", "not_a_time"])
def test_a_binding_file_of_the_waiting_run_is_still_adopted(ctl, written):
    # Written after the current run began, or by an older node that does not say when: adopted, as before.
    # A file time that is no plausible time (a file touched to 1969) counts as unknown: it refused the
    # whole report (400), the node's GPUs and bindings with it.
    end1 = time.time() - 600
    _ended_by_epilog(ctl.store, "3", end1)
    ctl.store.restart_job("3", now=end1 + 200, reason="live again", submit_time=end1 + 190)
    report = {"node": "n1", "bindings": {"3": [{**INST, "uuid": "MIG-2"}]}}
    if written == "after_it_began":
        report["binding_times"] = {"3": end1 + 250}
    elif written == "implausible":
        report["binding_times"] = {"3": -86400.0, "4": 1e12}
    elif written == "not_a_time":
        report["binding_times"] = {"3": "yesterday"}
    ctl.on_report(report, None)
    assert [b.uuid for b in ctl.store.bound_instances("3")] == ["MIG-2"]


@pytest.mark.parametrize("exit_code, state", [(0, "COMPLETED"), (256, "FAILED")])
def test_the_epilog_of_a_job_that_ran_while_the_controller_was_down_is_not_taken_for_cancelled(ctl, exit_code,
                                                                                                state):
    """Found in review. Job 3 waited here when the controller went down for longer than Slurm's MinJobAge; it
    ran meanwhile (its node bound it alone) and ended, and Slurm forgot it. The first tick back found it
    no longer in Slurm's queue and marked it CANCELLED (a guess: a waiting job that is gone was
    cancelled), then its node's outbox delivered its binding and its Epilog. The Epilog took that guess
    for Slurm's word (75bab11): the run was recorded CANCELLED, exit 0, and counted so."""
    t = [time.time()]
    ctl.clock = lambda: t[0]
    ctl.store.upsert_job("3", profile="1g", submit_time=t[0] - 900, now=t[0] - 900)
    ctl.tick()  # Slurm lists nothing
    assert ctl.store.get_job("3").state == "CANCELLED"
    assert ctl.on_bound({"job_id": "3", "node": "n1", "local": True, "bound_at": t[0] - 800,
                         "instances": [{**INST, "uuid": "MIG-1"}]}, None) == {"ok": True}
    assert ctl.on_epilog(_old_runs_epilog(t[0] - 400, exit_code=exit_code), None)["recorded"]
    (o,) = ctl.store.outcomes()
    assert (o.state, o.exit_code, o.start_time, o.end_time) == (state, exit_code, t[0] - 800, t[0] - 400)
    assert ctl.store.get_job("3").state == state
    t[0] += 61
    ctl.tick()
    assert _finished(ctl) == {state: 1.0}


def test_the_epilog_of_a_job_that_ran_while_the_controller_was_down_gives_the_jobs_row_its_end(ctl):
    """Found in review (4ffd7cf). As above: the tick marked job 3 CANCELLED (NOT_IN_QUEUE) when it came back,
    stamping the jobs row's end with its own time; the Epilog from the outbox, 400 s earlier, replaced the state
    but the end stayed the tick's (set_job_state stamps an end once), so `jobs` showed 800 s of run for 400 s,
    and the reason "no longer in Slurm's queue" stayed on a COMPLETED job."""
    t = [time.time()]
    ctl.clock = lambda: t[0]
    ctl.store.upsert_job("3", profile="1g", submit_time=t[0] - 900, now=t[0] - 900)
    ctl.tick()  # Slurm lists nothing
    assert ctl.store.get_job("3").end_time == t[0]
    assert ctl.on_bound({"job_id": "3", "node": "n1", "local": True, "bound_at": t[0] - 800,
                         "instances": [{**INST, "uuid": "MIG-1"}]}, None) == {"ok": True}
    assert ctl.on_epilog(_old_runs_epilog(t[0] - 400), None)["recorded"]
    job = ctl.store.get_job("3")
    assert (job.state, job.start_time, job.end_time, job.reason) == ("COMPLETED", t[0] - 800, t[0] - 400, "")


def test_a_node_made_binding_of_an_earlier_run_does_not_become_the_start_of_a_run_that_never_ran(ctl):
    """Found in review. Job 3's node could not reach the controller while run 1 ran: its Prolog bound the
    job alone and its binding and Epilog waited in the outbox. Slurm's record settled run 1 here, the id
    ran again, and run 2 was cancelled while it waited. The outbox's /v1/bound then reached the ended run
    2, which took run 1's binding time and node as its own start (c4531d8 kept only a live run from
    adopting it), so run 1's Epilog behind it passed for run 2's: run 1's end was recorded a second time,
    under run 2, a run that never ran."""
    end1 = time.time() - 900
    _ended_by_epilog(ctl.store, "3", end1)  # run 1's outcome, from Slurm's record, say
    ctl.store.restart_job("3", now=end1 + 200, reason="live again", submit_time=end1 + 190)
    ctl.store.set_job_state("3", "CANCELLED", now=end1 + 250)  # cancelled while it waited
    assert ctl.on_bound({"job_id": "3", "node": "n1", "local": True, "bound_at": end1 - 90,
                         "instances": [{**INST, "uuid": "MIG-1"}]}, None) == {"ok": True}
    job = ctl.store.get_job("3")
    assert (job.state, job.run, job.start_time, job.node) == ("CANCELLED", 2, None, None)
    assert ctl.on_epilog(_old_runs_epilog(end1), None) == {"ok": True, "recorded": False}
    assert [(o.run, o.end_time) for o in ctl.store.outcomes()] == [(1, end1)]
    assert _finished(ctl) == {}


@pytest.mark.parametrize("model, size", [("H100-80GB", "1g"), (None, "1g.10gb")])
def test_a_late_epilogs_outcome_under_run_1_takes_nothing_from_run_2s_request(ctl, model, size):
    """Found in review. Run 1 of job 3 (alice's 1g in partition gpu) ended here without an outcome; the id
    was reused by bob's 3g x 2 in partition big, which the tick stored (upsert_job) and tracks as run 2.
    Run 1's Epilog then arrived from the outbox: its outcome under run 1 took its profile, count, user,
    partition and time limit from the jobs row, which is run 2's. It takes its size from the instances
    run 1 was bound to (the Epilog's: their kind where the GPU's model is known, else their profile name),
    and leaves what it cannot know of run 1 empty."""
    end1 = time.time() - 600
    if model:
        ctl.store.replace_observed("n1", [{"gpu": 0, "model": model, "mig_enabled": True}], [], now=end1 - 200)
    ctl.store.upsert_job("3", profile="1g", user="alice", partition="gpu", time_limit_s=3600.0,
                         submit_time=end1 - 100, now=end1 - 100)
    ctl.store.set_job_state("3", "RUNNING", now=end1 - 90, node="n1")
    ctl.store.set_job_state("3", "CANCELLED", now=end1)  # Slurm's record settled it, without an exit status
    ctl.slurm.queue = [SlurmJob(job_id=3, state="PENDING", mig={"3g": 2}, tres_per_node="gres:mig:3g:2",
                                user="bob", partition="big", time_limit_min=10, submit_time=int(end1 + 190),
                                priority=1)]
    ctl.tick()
    job = ctl.store.get_job("3")
    assert (job.run, job.profile, job.count, job.user, job.partition) == (2, "3g", 2, "bob", "big")
    assert ctl.on_epilog(_old_runs_epilog(end1 - 2), None) == {"ok": True, "recorded": True}
    (o,) = ctl.store.outcomes()
    assert (o.run, o.profile, o.count, o.user, o.partition, o.time_limit_s) == (1, size, 1, "", "", None)
    assert (o.node, [(i.gpu, i.profile, i.start) for i in o.instances]) == ("n1", [(0, "1g.10gb", 0)])


def test_a_late_epilog_without_run_1s_instances_records_no_outcome_for_it(ctl):
    # Its binding file unreadable, the Epilog names no instance: run 1's size is not known (the jobs row's
    # is run 2's), so no outcome is recorded for run 1, and a late event says why.
    end1 = time.time() - 600
    ctl.store.upsert_job("3", profile="1g", submit_time=end1 - 100, now=end1 - 100)
    ctl.store.set_job_state("3", "RUNNING", now=end1 - 90, node="n1")
    ctl.store.set_job_state("3", "CANCELLED", now=end1)
    ctl.store.upsert_job("3", profile="3g", count=2, user="bob", submit_time=end1 + 190, now=end1 + 200)
    ctl.store.restart_job("3", now=end1 + 200, reason="live again", submit_time=end1 + 190)
    answer = ctl.on_epilog(_old_runs_epilog(end1 - 2, instances=[], binding_unreadable=True), None)
    assert answer == {"ok": True, "recorded": False} and ctl.store.outcomes() == []
    assert any(e.kind == "late" and "size cannot be told" in e.message for e in ctl.store.recent_events(10))


def _bind_failed(at: float, **extra) -> dict:
    return {"job_id": "3", "node": "n1", "results": [{"gpu": 0, "ok": False, "error": "In use by another client"}],
            "message_id": "f0" * 16, "message_at": at, **extra}


def test_a_late_bind_failure_of_an_earlier_run_leaves_the_current_run_alone(ctl):
    """Found in review. Run 1's Prolog on n1 failed to make its instance and queued /v1/bind-failed (the
    controller unreachable); the id ran again and run 2 runs on n1, bound to the same slice. The outbox
    then delivered run 1's bind failure: unlike the Epilog's and the node-made binding's, it had no
    earlier-run check, released run 2's binding on n1 and made it REQUEUED while Slurm ran it (with no
    binding, _requeue_unbound would then requeue it in Slurm as started without its Prolog). A bind
    failure made (message_at) before the current run began by more than the clock margin is an earlier
    run's (or attempt's): it changes nothing but a late event."""
    end1 = time.time() - 600
    _ended_by_epilog(ctl.store, "3", end1)
    ctl.store.restart_job("3", now=end1 + 200, reason="live again", submit_time=end1 + 190)
    started = end1 + 300
    ctl.store.set_job_state("3", "RUNNING", now=started, node="n1")
    ctl.store.bind("3", "n1", [INST], now=started)
    assert ctl.on_bind_failed(_bind_failed(end1 - 89), None) == {"ok": True}
    job = ctl.store.get_job("3")
    assert (job.state, job.run, job.node) == ("RUNNING", 2, "n1")
    assert [(b.gpu, b.start) for b in ctl.store.bound_instances("3")] == [(0, 0)]
    assert any(e.kind == "late" and "before its current run" in e.message for e in ctl.store.recent_events(10))
    # This run's own failure, stamped a little behind the controller's clock, still releases and requeues it.
    failed_at = started - ctl.cfg.auth.max_clock_skew_s
    assert ctl.on_bind_failed(_bind_failed(failed_at, message_id="f1" * 16), None) == {"ok": True}
    assert (ctl.store.get_job("3").state, ctl.store.bound_instances("3")) == ("REQUEUED", ())


def test_a_late_bind_failure_of_an_earlier_run_does_not_requeue_a_waiting_run(ctl):
    end1 = time.time() - 600
    _ended_by_epilog(ctl.store, "3", end1)
    ctl.store.restart_job("3", now=end1 + 200, reason="live again", submit_time=end1 + 190)
    assert ctl.on_bind_failed(_bind_failed(end1 - 89), None) == {"ok": True}
    job = ctl.store.get_job("3")
    assert (job.state, job.run, job.reason) == ("PENDING", 2, "live again")
    # From an older node (no message_at): handled as before.
    assert ctl.on_bind_failed(_bind_failed(None, message_id=None), None) == {"ok": True}
    assert ctl.store.get_job("3").state == "REQUEUED"


@pytest.mark.parametrize("skew", [30.0, 90.0])
def test_a_node_made_binding_is_not_released_by_a_report_made_before_it_when_the_nodes_clock_is_behind(tmp_path,
                                                                                                     skew):
    """Found in review (the clock margin against the controller's fixed windows). A health report lists the
    node's binding files; one that reaches the controller without a binding the store holds makes it
    release that binding once the job is past its start by 60 s: a report read before the Prolog wrote
    its file must not release it. A binding the node made alone takes its bound_at, on the node's clock,
    as the job's start; with [auth].max_clock_skew_s = 90 that clock may be 80 s behind, and such a report,
    arriving a second after the binding, released it at once. The window now grows with the clock margin
    (60 s at the default 30 s)."""
    store = open_store(tmp_path / "state.db")
    cfg = Config()
    ctl = Controller(replace(cfg, auth=replace(cfg.auth, max_clock_skew_s=skew)), store, EndedSlurm())
    try:
        now = time.time()
        behind = skew - 10  # the node's clock, as far behind as the auth lets it be (less a little)
        store.upsert_job("3", profile="1g", submit_time=now - 300, now=now - 300)
        assert ctl.on_bound({"job_id": "3", "node": "n1", "local": True, "bound_at": now - behind,
                             "instances": [{**INST, "uuid": "MIG-1"}]}, None) == {"ok": True}
        assert store.get_job("3").state == "RUNNING" and store.bound_instances("3")
        # The health check read the binding files just before the Prolog wrote this one.
        ctl.on_report({"node": "n1", "bindings": {}, "binding_times": {}}, None)
        assert [b.uuid for b in store.bound_instances("3")] == ["MIG-1"]
    finally:
        store.close()


# -- a run Slurm requeued as it killed it ------------------------------------------------------------
# Seen on the demo cluster (Slurm 22.05): `scontrol update NodeName=n1 State=DOWN` while a --requeue MIG job
# ran there. Slurm ended it NODE_FAIL and requeued it (SubmitTime = the requeue, Restarts=1), but its Epilog
# read SLURM_JOB_RESTART_COUNT=0 and SLURM_JOB_EXIT_CODE=0: the run was recorded COMPLETED, exit 0, its run
# time the minute it had run before the node went down.

@pytest.mark.parametrize("requeued_after_s, restarts, expect", [
    (0, 1, "REQUEUED"),          # requeued as it ended (the Epilog's end, its node's clock)
    (1, 1, "REQUEUED"),
    (3600, 1, "COMPLETED"),      # `scontrol requeue` of a job that completed an hour before: a run of its own
    (0, 0, "COMPLETED"),         # never requeued: another job with the id
])
def test_a_run_slurm_requeued_as_it_killed_it_is_not_recorded_completed(ctl, requeued_after_s, restarts, expect):
    end = time.time() - 5 - requeued_after_s
    _ended_by_epilog(ctl.store, "3", end)
    ctl.slurm.queue = [_requeued_3(int(end + requeued_after_s), restarts)]
    ctl.tick()
    job = ctl.store.get_job("3")
    assert (job.state, job.run) == ("PENDING", 2)
    assert [(o.run, o.state) for o in ctl.store.outcomes()] == [(1, expect)]
    said = [e for e in ctl.store.recent_events(20) if "ended by a requeue" in e.message]
    assert len(said) == (expect == "REQUEUED")


def test_an_admins_requeue_of_a_completed_job_whose_epilog_came_after_a_tick_saw_it_waiting_stays_completed(ctl):
    """Job 3 completed; a tick saw Slurm list it COMPLETED, then an admin requeued it (`scontrol requeue 3`, within
    the clock margin of its end) and the next tick saw it waiting again before its Epilog came. The Epilog then
    ended the run COMPLETED, and the tick after it revived the id as run 2. Slurm's COMPLETED listing was kept for
    the last tick only (_listed_ended), which had listed the job waiting: the run read as one Slurm requeued as it
    killed it (a node set DOWN), and its outcome said REQUEUED. Slurm's listings of an ended run are kept until
    the run is revived (or an hour), so the run stays COMPLETED, as Slurm listed it."""
    now = time.time()
    _running_3(ctl, now)
    t = [now]
    ctl.clock = lambda: t[0]
    ctl.slurm.queue = [replace(_listed(3, "COMPLETED", now - 5), submit_time=int(now - 400))]
    ctl.tick()  # Slurm lists it ended; its Epilog has not come yet
    t[0] += 5
    waiting = _requeued_3(int(now), 1)
    ctl.slurm.queue = [waiting]  # requeued by an admin at `now`, 5 s after it ended
    ctl.tick()
    assert ctl.store.get_job("3").state == "PENDING"
    assert ctl.on_epilog(_old_runs_epilog(now - 5), None)["recorded"]
    t[0] += 5
    ctl.tick()
    job = ctl.store.get_job("3")
    assert (job.state, job.run) == ("PENDING", 2)
    assert [(o.run, o.state, o.exit_code) for o in ctl.store.outcomes()] == [(1, "COMPLETED", 0)]
    assert not [e for e in ctl.store.recent_events(20) if "ended by a requeue" in e.message]


def test_a_listing_of_an_earlier_run_does_not_make_a_run_killed_by_a_requeue_read_as_completed(ctl):
    """The listings kept are of the run Slurm listed ended: once the id is revived as run 2, run 1's COMPLETED
    listing says nothing of run 2, which Slurm requeued as it killed it (its node set DOWN) moments later."""
    now = time.time()
    _running_3(ctl, now)
    t = [now]
    ctl.clock = lambda: t[0]
    ctl.slurm.queue = [replace(_listed(3, "COMPLETED", now - 5), submit_time=int(now - 400))]
    assert ctl.on_epilog(_old_runs_epilog(now - 5), None)["recorded"]
    ctl.tick()
    t[0] += 5
    ctl.slurm.queue = [_requeued_3(int(now), 1)]
    ctl.tick()  # revived: run 2
    assert [(o.run, o.state) for o in ctl.store.outcomes()] == [(1, "COMPLETED")]
    # Run 2 starts at once (a site with a short cred_expire), its node goes DOWN: Slurm requeues it as it kills it,
    # and its Epilog reads exit 0. Slurm never lists run 2 ended.
    t[0] += 5
    ctl.store.set_job_state("3", "RUNNING", now=t[0], node="n1")
    ctl.store.bind("3", "n1", [INST], now=t[0])
    t[0] += 20
    assert ctl.on_epilog(_old_runs_epilog(t[0]), None)["recorded"]
    ctl.slurm.queue = [_requeued_3(int(t[0]), 2)]
    t[0] += 5
    ctl.tick()
    assert [(o.run, o.state) for o in ctl.store.outcomes()] == [(1, "COMPLETED"), (2, "REQUEUED")]


def test_slurms_ended_listings_are_kept_an_hour_after_the_last_squeue_that_listed_them(ctl):
    """_listed_ended keeps every MIG job Slurm listed ended for LISTED_ENDED_MEMORY_S after the last squeue that
    listed it (refreshed while Slurm lists it, until MinJobAge), and no longer: on a busy site it holds the ends
    of about the last hour (EndedListing: 2.5 MB at 10,000), not every end since the controller began."""
    from slurm_mig.controller.service import LISTED_ENDED_MEMORY_S

    now = time.time()
    t = [now]
    ctl.clock = lambda: t[0]
    ctl.slurm.queue = [_listed(i, "COMPLETED", now - 5) for i in range(100, 150)]
    ctl.tick()
    assert len(ctl._listed_ended) == 50
    t[0] += 300  # Slurm still lists half of them (MinJobAge), and 50 newer ends
    ctl.slurm.queue = [_listed(i, "COMPLETED", now - 5) for i in range(125, 200)]
    ctl.tick()
    assert len(ctl._listed_ended) == 100 and ctl._listed_ended["125"][1] == t[0]
    t[0] = now + LISTED_ENDED_MEMORY_S + 1  # an hour after the first squeue: the first 25 are gone
    ctl.slurm.queue = []
    ctl.tick()
    assert sorted(ctl._listed_ended, key=int) == [str(i) for i in range(125, 200)]
    t[0] = now + 300 + LISTED_ENDED_MEMORY_S + 1
    ctl.tick()
    assert ctl._listed_ended == {}


def test_a_run_slurm_requeued_as_it_killed_it_is_not_counted_as_a_finished_job(ctl):
    """The run's Epilog said exit 0 (node set DOWN, Slurm 22.05.8): its outcome is REQUEUED once the tick sees
    the job waiting again, restarted. The job has not finished: jobs_finished_total counted it REQUEUED."""
    t = [_epilog_says_completed(ctl, "3")]
    ctl.clock = lambda: t[0]
    ctl.slurm.queue = [_requeued_3(int(t[0]), 1)]
    t[0] += 2
    ctl.tick()
    assert ctl.store.outcome("3", run=1).state == "REQUEUED"
    t[0] += 61
    ctl.tick()
    assert _finished(ctl) == {}


# -- an Epilog of another user's job with the id ------------------------------------------------------
# slurmctld lost its state (or its ids wrapped): user 1000's job 3 still ran on n1 when user 2000's new job 3
# was submitted; the tick tracked the new one as run 2 and released run 1's instances. Run 1's Epilog (it was
# killed when n1 registered again) ended after run 2's submission, so its end time cannot tell it from run 2's.

@pytest.mark.parametrize("run2", ["waiting", "running_here"])
def test_an_epilog_of_another_users_job_with_the_id_does_not_end_the_current_run(ctl, run2):
    now = time.time()
    ctl.store.upsert_job("3", profile="1g", user="alice", uid=1000, submit_time=now - 600, now=now - 600)
    ctl.store.set_job_state("3", "RUNNING", now=now - 590, node="n1")
    ctl.store.bind("3", "n1", [INST], now=now - 590)
    ctl.store.release("3", now=now - 100)  # _another_job_with_id
    ctl.store.restart_job("3", now=now - 100, reason="another job with this id", submit_time=now - 110)
    ctl.store.upsert_job("3", profile="1g", user="bob", uid=2000, now=now - 100)
    if run2 == "running_here":
        ctl.store.set_job_state("3", "RUNNING", now=now - 50, node="n1")
        ctl.store.bind("3", "n1", [INST], now=now - 50)
    answer = ctl.on_epilog(_old_runs_epilog(now - 40, uid=1000), None)
    job = ctl.store.get_job("3")
    assert (job.state, job.run, job.uid) == ("RUNNING" if run2 == "running_here" else "PENDING", 2, 2000)
    assert bool(ctl.store.bound_instances("3")) == (run2 == "running_here")  # bob's instance stays his
    assert [(o.run, o.end_time) for o in ctl.store.outcomes()] == [(1, now - 40)]  # alice's run's end, as run 1's
    assert answer == {"ok": True, "recorded": True}
    assert any("uid 1000" in e.message for e in ctl.store.recent_events(10))
    # Bob's own Epilog ends his run; an older node's (no uid) as well.
    assert ctl.on_epilog(_old_runs_epilog(time.time(), uid=2000 if run2 == "running_here" else None), None) \
        == {"ok": True, "recorded": True}
    assert [o.run for o in ctl.store.outcomes()] == [1, 2]


def test_an_epilog_of_another_users_job_leaves_a_first_run_alone(ctl):
    """The store's run 1 is bob's; an Epilog of job 3 for uid 1000 is of a job with the id the store never saw
    (it started and ended between two ticks): it neither ends bob's run nor releases its instance."""
    now = time.time()
    ctl.store.upsert_job("3", profile="1g", user="bob", uid=2000, submit_time=now - 600, now=now - 600)
    ctl.store.set_job_state("3", "RUNNING", now=now - 590, node="n1")
    ctl.store.bind("3", "n1", [INST], now=now - 590)
    assert ctl.on_epilog(_old_runs_epilog(now - 5, uid=1000), None) == {"ok": True, "recorded": False}
    assert ctl.store.get_job("3").state == "RUNNING" and ctl.store.bound_instances("3")
    assert list(ctl.store.outcomes()) == []
    assert any(e.kind == "conflict" and "uid 1000" in e.message for e in ctl.store.recent_events(10))
    # The uid of a job the store knows no uid for says nothing: ended as before.
    ctl.store._x("UPDATE jobs SET uid = NULL WHERE job_id = '3'")
    assert ctl.on_epilog(_old_runs_epilog(now - 4, uid=1000), None)["recorded"]


# -- the end a job is stored with ------------------------------------------------------------------------
# outcomes.end_time took the Epilog's end_time (or Slurm's EndTime), but the jobs row was stamped with when the
# controller handled the message (or settled the lost Epilog, a grace period after it saw the job end): the jobs
# view's run time and explain --replay's durations (they read jobs.end_time) counted the time the Epilog waited
# in the node's outbox.

def test_a_late_epilogs_job_ends_when_it_ended_not_when_the_message_arrived(ctl):
    from slurm_mig.ops import views as V
    from slurm_mig.ops.replay import _duration

    now = time.time()
    ctl.store.upsert_job("3", profile="1g", submit_time=now - 4000, now=now - 4000)
    ctl.store.set_job_state("3", "RUNNING", now=now - 3900, node="n1")
    ctl.store.bind("3", "n1", [INST], now=now - 3900)
    ctl.clock = lambda: now
    assert ctl.on_epilog(_old_runs_epilog(now - 3600), None)["recorded"]  # an hour in the outbox
    job = ctl.store.get_job("3")
    assert (job.state, job.end_time, ctl.store.outcome("3").end_time) == ("COMPLETED", now - 3600, now - 3600)
    assert V.job_dict(job, now)["run_s"] == pytest.approx(300)
    assert _duration(job, now) == pytest.approx(300)


def test_a_lost_epilogs_job_ends_at_slurms_end_time(ctl):
    from slurm_mig.slurm.parsers import JobDetail

    now = time.time()
    _running_3(ctl, now)
    end = int(now - 100)
    ctl.slurm.queue = [replace(_listed(3, "COMPLETED", end), start_time=int(now - 300))]
    ctl.slurm.job_detail = lambda job_id: JobDetail(job_id=3, state="COMPLETED", fields={
        "ExitCode": "0:0", "EndTime": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(end))})
    t = [now]
    ctl.clock = lambda: t[0]
    ctl.tick()
    t[0] += 3600  # the grace period, and more: the controller was stopped meanwhile
    ctl.tick()
    job = ctl.store.get_job("3")
    assert (job.state, job.end_time, ctl.store.outcome("3").end_time) == ("COMPLETED", end, end)


def test_a_lost_epilogs_job_ends_at_squeues_end_time_when_scontrol_cannot_say(ctl):
    """scontrol show job failed (timed out, slurmctld busy) when the tick first saw job 3 ended: squeue's record,
    listed in the same answer, still says when it ended. The end was the tick's clock (``now``), as late as the
    controller's outage was long."""
    now = time.time()
    ctl.store.upsert_job("3", profile="1g", submit_time=now - 4000, now=now - 4000)
    ctl.store.set_job_state("3", "RUNNING", now=now - 3900, node="n1")
    ctl.store.bind("3", "n1", [INST], now=now - 3900)
    end = int(now - 3000)  # it ended while the controller was down
    ctl.slurm.queue = [replace(_listed(3, "COMPLETED", end), start_time=int(now - 3900))]
    t = [now]
    ctl.clock = lambda: t[0]
    ctl.tick()
    t[0] += 3600
    ctl.tick()
    job = ctl.store.get_job("3")
    assert (job.state, job.end_time, ctl.store.outcome("3").end_time) == ("COMPLETED", end, end)
    assert ctl.store.outcome("3").exit_code is None  # scontrol's ExitCode is the only word on it


def test_squeues_end_time_from_the_future_is_not_taken():
    from slurm_mig.controller.runs import slurm_end

    assert slurm_end(None, "COMPLETED", 1000.0, 30.0, listed_end=900.0) == ("COMPLETED", None, 900.0)
    assert slurm_end(None, "COMPLETED", 1000.0, 30.0, listed_end=5000.0) == ("COMPLETED", None, 1000.0)
    assert slurm_end(None, "COMPLETED", 1000.0, 30.0) == ("COMPLETED", None, 1000.0)


def test_an_epilog_handled_between_the_ticks_squeue_and_its_sync_does_not_make_a_new_run(ctl):
    """Job 3 runs; the tick's squeue lists it RUNNING; its Epilog (the node's clock 30 s behind, within the
    clock margin) is handled before the tick syncs. The job ended after Slurm's answer, which is no sign that it
    runs again: the end time now stored is the Epilog's, before the query, but the controller learned it after."""
    now = time.time()
    _running_3(ctl, now)
    listed = SlurmJob(job_id=3, state="RUNNING", mig={"1g": 1}, tres_per_node="gres:mig:1g:1",
                      submit_time=int(now - 400), start_time=int(now - 300), nodes=["n1"], priority=1)
    t = [now]
    ctl.clock = lambda: t[0]

    def jobs():
        t[0] += 2
        assert ctl.on_epilog(_old_runs_epilog(now - 30), None)["recorded"]
        return [listed]

    ctl.slurm.jobs = jobs
    ctl.tick()
    job = ctl.store.get_job("3")
    assert (job.state, job.run, job.end_time) == ("COMPLETED", 1, now - 30)


@pytest.mark.parametrize("listed", ["COMPLETED", "FAILED", None])
def test_a_completed_job_an_admin_requeued_at_once_keeps_its_outcome(ctl, listed):
    """`scontrol requeue` of a job that completed (allowed until MinJobAge), seconds after its end: Slurm listed
    the run COMPLETED (or FAILED, exit status 256) to a tick before it listed it waiting again, restarted, with
    the requeue's submit time. The run ended by its exit, as its Epilog said, not by a requeue: a node set DOWN
    requeues the job as it kills it, and Slurm never lists that run as ended by its exit. Unseen by a tick (the
    requeue within one tick interval of the end), the two cannot be told apart: REQUEUED, as before."""
    end = time.time() - 5
    _ended_by_epilog(ctl.store, "3", end)
    if listed == "FAILED":
        ctl.store.correct_end_state("3", "FAILED", now=end)
    if listed is not None:
        ctl.slurm.queue = [replace(_listed(3, listed, end), submit_time=int(end - 100))]
        ctl.tick()
    ctl.slurm.queue = [_requeued_3(int(end + 1), 1)]
    ctl.tick()
    assert (ctl.store.get_job("3").state, ctl.store.get_job("3").run) == ("PENDING", 2)
    assert [(o.run, o.state) for o in ctl.store.outcomes()] == [(1, listed or "REQUEUED")]


def test_a_late_epilog_replaces_the_guess_made_for_a_job_slurm_had_forgotten(ctl):
    """The controller was down for an hour; job 3 completed meanwhile (exit 0) and Slurm forgot it (MinJobAge);
    its node was down too, its Epilog kept in its outbox. Back, the controller waited the grace period for the
    Epilog and then settled the job as Slurm's record could not: FAILED, no exit status, ended when it settled
    it. The Epilog, delivered when the node came back, has the node's own account (exit 0, its end); it was
    dropped (an outcome was recorded), so the run kept FAILED and a run time that ran to the controller's
    return. It now replaces that guess; the job is counted once, as settled (a counter cannot take one back)."""
    now = time.time()
    ctl.store.upsert_job("3", profile="1g", submit_time=now - 4000, now=now - 4000)
    ctl.store.set_job_state("3", "RUNNING", now=now - 3900, node="n1")
    ctl.store.bind("3", "n1", [INST], now=now - 3900)
    t = [now]
    ctl.clock = lambda: t[0]
    ctl.tick()  # back: Slurm does not list job 3
    t[0] += 61
    ctl.tick()
    job, o = ctl.store.get_job("3"), ctl.store.outcome("3")
    assert (job.state, job.end_time, o.state, o.exit_code, o.end_time) == ("FAILED", now, "FAILED", None, now)
    t[0] += 600
    assert ctl.on_epilog(_old_runs_epilog(now - 3600), None) == {"ok": True, "recorded": True}
    job, o = ctl.store.get_job("3"), ctl.store.outcome("3")
    assert (job.state, job.exit_code, job.end_time) == ("COMPLETED", 0, now - 3600)
    assert (o.state, o.exit_code, o.end_time, o.run_s) == ("COMPLETED", 0, now - 3600, pytest.approx(300))
    assert len(ctl.store.outcomes()) == 1
    t[0] += 61
    ctl.tick()
    assert _finished(ctl) == {"FAILED": 1.0}
    # Delivered again (its answer lost): handled once.
    assert ctl.on_epilog(_old_runs_epilog(now - 3600), None)["recorded"] is False


@pytest.mark.parametrize("slurm_said", [None, "FAILED"])
def test_a_late_epilog_replaces_the_guess_for_run_1_after_the_id_ran_again(ctl, slurm_said):
    """As above, but the id runs again before run 1's Epilog comes (Slurm had forgotten job 3: a reused id, bob's
    job 3 now waits as run 2). The Epilog, ended before run 2 began, is run 1's (_earlier_runs_epilog): it was
    taken for a duplicate, since run 1 had an outcome, and the guess (FAILED, no exit status, an end at the
    controller's return) stayed for good. It now replaces the guess, and only a guess: an outcome from Slurm's
    record (listed FAILED; scontrol could not give the exit status) stays as Slurm said."""
    now = time.time()
    ctl.store.upsert_job("3", profile="1g", user="alice", uid=1000, submit_time=now - 4000, now=now - 4000)
    ctl.store.set_job_state("3", "RUNNING", now=now - 3900, node="n1")
    ctl.store.bind("3", "n1", [INST], now=now - 3900)
    if slurm_said:
        ctl.slurm.queue = [replace(_listed(3, slurm_said, now - 3600), user="alice", user_id=1000,
                                   submit_time=int(now - 4000), start_time=int(now - 3900))]
    t = [now]
    ctl.clock = lambda: t[0]
    ctl.tick()
    t[0] += 61
    ctl.tick()
    o = ctl.store.outcome("3")
    assert (o.run, o.state, o.exit_code) == (1, "FAILED", None)
    # Bob's job 3 (slurmctld lost its state): run 2, waiting.
    t[0] += 30
    ctl.slurm.queue = [SlurmJob(job_id=3, state="PENDING", mig={"1g": 1}, tres_per_node="gres:mig:1g:1", user="bob",
                                user_id=2000, submit_time=int(t[0] - 5), priority=1)]
    ctl.tick()
    assert (ctl.store.get_job("3").run, ctl.store.get_job("3").state) == (2, "PENDING")
    t[0] += 600
    answer = ctl.on_epilog(_old_runs_epilog(now - 3600, uid=1000), None)
    o1 = ctl.store.outcome("3", run=1)
    job = ctl.store.get_job("3")
    assert (job.run, job.state, job.end_time, job.exit_code) == (2, "PENDING", None, None)  # bob's run untouched
    assert len(ctl.store.outcomes()) == 1
    if slurm_said:
        assert answer == {"ok": True, "recorded": False}
        assert (o1.state, o1.exit_code) == ("FAILED", None)  # Slurm's word: not replaced by an exit status 0
    else:
        assert answer == {"ok": True, "recorded": True}
        assert (o1.state, o1.exit_code, o1.end_time, o1.run_s, o1.node) == (
            "COMPLETED", 0, now - 3600, pytest.approx(300), "n1")
        assert any("replaces the outcome settled without it" in e.message for e in ctl.store.recent_events(10))
    assert _finished(ctl) == {"FAILED": 1.0}  # counted once, when settled
    # Another Epilog of run 1 (delivered again, or a second one with another exit status) changes nothing.
    assert ctl.on_epilog(_old_runs_epilog(now - 3600, uid=1000), None)["recorded"] is False
    assert ctl.on_epilog(_old_runs_epilog(now - 3500, uid=1000, exit_code=256), None)["recorded"] is False
    assert ctl.store.outcome("3", run=1) == o1


def test_run_1s_late_epilog_keeps_the_run_time_of_a_run_killed_while_suspended(ctl):
    """Alice's job 3 ran 300 s, was suspended and ended while suspended, the controller down; Slurm forgot it and
    the tick settled it by its guess (run time 300 s: the suspension counted up to the guessed end). Bob's job 3
    waits as run 2 when run 1's Epilog comes: its end replaces the guess's, and the run time stays 300 s (until
    2026-11-27 the suspension up to the guessed end was taken from the Epilog's span too: 0 s)."""
    now = time.time()
    ctl.store.upsert_job("3", profile="1g", user="alice", uid=1000, submit_time=now - 4000, now=now - 4000)
    ctl.store.set_job_state("3", "RUNNING", now=now - 3900, node="n1")
    ctl.store.bind("3", "n1", [INST], now=now - 3900)
    ctl.store.set_job_state("3", "SUSPENDED", now=now - 3600)
    ctl.store.set_suspension("3", suspended_s=0.0, since=now - 3600)
    t = [now]
    ctl.clock = lambda: t[0]
    ctl.tick()
    t[0] += 61
    ctl.tick()
    o = ctl.store.outcome("3")
    assert (o.run, o.state, o.exit_code, o.run_s, o.guessed) == (1, "FAILED", None, 300.0, True)
    t[0] += 30
    ctl.slurm.queue = [SlurmJob(job_id=3, state="PENDING", mig={"1g": 1}, tres_per_node="gres:mig:1g:1", user="bob",
                                user_id=2000, submit_time=int(t[0] - 5), priority=1)]
    ctl.tick()
    assert ctl.store.get_job("3").run == 2
    assert ctl.on_epilog(_old_runs_epilog(now - 3500, uid=1000), None)["recorded"]
    o = ctl.store.outcome("3", run=1)
    assert (o.state, o.exit_code, o.end_time, o.run_s, o.guessed) == ("COMPLETED", 0, now - 3500, 300.0, False)


# -- a run that began while the tick settled the lost Epilog of the one before ------------------------

def test_a_lost_epilogs_settlement_does_not_end_a_run_that_began_after_the_tick_looked(ctl, monkeypatch):
    """Found in review. Alice's job 3 ran on n1 and its Epilog was lost (the node crashed); Slurm listed it
    COMPLETED and the grace period passed. The tick read that (_lost_epilogs, before its transaction: it may run
    scontrol), and meanwhile bob's new job 3 (slurmctld lost its state) started: its Prolog made it run 2 and
    bound it (on_prolog, _another_job_with_id). The tick's settlement then found job 3 RUNNING and ended it
    with alice's record: bob's run was recorded COMPLETED and its instance released, free to be re-carved
    under his job."""
    t = [time.time()]
    ctl.clock = lambda: t[0]
    ctl.store.upsert_job("3", profile="1g", user="alice", uid=1000, submit_time=t[0] - 900, now=t[0] - 900)
    ctl.store.set_job_state("3", "RUNNING", now=t[0] - 890, node="n1")
    ctl.store.bind("3", "n1", [INST], now=t[0] - 890)
    ctl.slurm.queue = [replace(_listed(3, "COMPLETED", t[0] - 10), user="alice", user_id=1000,
                               submit_time=int(t[0] - 900))]
    ctl.tick()  # sees it ended: the grace period begins
    t[0] += ctl._grace() + 1
    looked = ctl._lost_epilogs

    def then_bobs_prolog(jobs, now):
        lost = looked(jobs, now)
        assert "3" in lost
        ctl.store.release("3", now=now)  # on_prolog's _another_job_with_id, then its binding
        ctl.store.restart_job("3", now=now, reason="another job with this id", submit_time=now - 5)
        ctl.store.upsert_job("3", profile="1g", user="bob", uid=2000, now=now)
        ctl.store.set_job_state("3", "RUNNING", now=now, node="n1")
        ctl.store.bind("3", "n1", [INST], now=now)
        return lost

    monkeypatch.setattr(ctl, "_lost_epilogs", then_bobs_prolog)
    ctl.tick()
    job = ctl.store.get_job("3")
    assert (job.run, job.state, job.uid) == (2, "RUNNING", 2000)
    assert ctl.store.bound_instances("3")  # bob's instance stays his
    assert [o.run for o in ctl.store.outcomes()] == []  # alice's run's end is left to its Epilog
