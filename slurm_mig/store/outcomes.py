"""How each run of each job ended (table outcomes, the retrainer's training data)."""

from __future__ import annotations

from typing import Any, Sequence

from slurm_mig.errors import StoreError
from slurm_mig.store.models import Outcome, as_bound_instance, bound_instances_from_json, dumps, loads
from slurm_mig.store.rows import _check_state, _now, _row_job
from slurm_mig.store.schema import JOB_STATES, TERMINAL_STATES


# outcomes.guessed (schema migration 10): 0 an outcome from Slurm's record or an Epilog; else the controller's guess
# (replace_guessed_outcome), GUESSED_SUSPENDED where the run was suspended at the end guessed (its run time counts
# up to the suspension only, whatever the real end), GUESSED otherwise.
GUESSED, GUESSED_SUSPENDED = 1, 2


class OutcomesMixin:
    """Store methods on the jobs' outcomes (table outcomes)."""

    # -- outcomes --------------------------------------------------------------
    def correct_end_state(self, job_id: str, state: str, *, now: float | None = None) -> bool:
        """Slurm's own word on how a job ended (CANCELLED, TIMEOUT, ...) over the one its Epilog gave: an
        Epilog sees exit status 0 for a job cancelled or timed out. Changes the job and its current run's
        outcome when they say COMPLETED or FAILED (an earlier run's keeps its end); True when it changed
        anything."""
        _check_state(state, TERMINAL_STATES, "end state")
        job_id = str(job_id)
        with self.transaction():
            a = self._x("UPDATE jobs SET state = ?, updated_at = ? WHERE job_id = ? AND state IN ('COMPLETED', "
                        "'FAILED') AND state != ?", (state, _now(now), job_id, state)).rowcount
            b = self._x("UPDATE outcomes SET state = ? WHERE job_id = ? AND state IN ('COMPLETED', 'FAILED') "
                        "AND state != ? AND run = (SELECT j.run FROM jobs j WHERE j.job_id = ?)",
                        (state, job_id, state, job_id)).rowcount
        return bool(a or b)

    def forget_guessed_end(self, job_id: str) -> bool:
        """The current run of ``job_id`` was settled as FAILED without an exit status (the controller's guess, Slurm
        having forgotten the job): forget that outcome and the job's end, for its Epilog's account to be recorded
        in their place (record_outcome, set_job_state). True when it did."""
        job_id = str(job_id)
        with self.transaction():
            cur = self._x("DELETE FROM outcomes WHERE job_id = ? AND state = 'FAILED' AND exit_code IS NULL AND "
                          "run = (SELECT j.run FROM jobs j WHERE j.job_id = ? AND j.state = 'FAILED')", (job_id, job_id))
            if not cur.rowcount:
                return False
            self._x("UPDATE jobs SET end_time = NULL, exit_code = NULL WHERE job_id = ?", (job_id,))
            return True

    def forget_guessed_cancel(self, job_id: str, reason: str) -> bool:
        """The current run of ``job_id`` was marked CANCELLED by the controller's guess (``reason``: a waiting job
        Slurm no longer listed) and its Epilog shows it ran: forget the end that guess stamped (when the tick
        looked), for the Epilog's to be recorded in its place (set_job_state stamps an end once). True when it
        did."""
        with self.transaction():
            return bool(self._x("UPDATE jobs SET end_time = NULL WHERE job_id = ? AND state = 'CANCELLED' "
                                "AND reason = ?", (str(job_id), reason)).rowcount)

    def replace_guessed_outcome(self, job_id: str, run: int, *, node: str, state: str, exit_code: int | None,
                                derived_exit_code: int | None, end_time: float) -> bool:
        """Run ``run`` of ``job_id`` was settled by the controller's guess (``guessed``: FAILED, no exit status) and
        its Epilog, from ``node``, arrives after the id ran again: the Epilog's state, exit status and end replace
        the guess, in place (the jobs row is a later run's: the rest of the outcome, taken from it when it was
        this run's, stays). Only a guess, and only from the node the run ran on: an outcome from Slurm's record
        or an earlier Epilog stays. The run time keeps leaving out the time suspended that it left out: the guess's
        span less its run time, where the run was not suspended at the end guessed (a suspension over by then is
        over by its real end too). One suspended at the end guessed (GUESSED_SUSPENDED: killed while suspended) ran
        no more after that than the guess's run time counts, which stays, cut to the Epilog's span; until
        2026-11-27 the suspension up to the guessed end (an outage's length) was taken from the Epilog's span too,
        leaving a run time of 0 where the run had run for hours. True when it replaced one."""
        _check_state(state, TERMINAL_STATES, "end state")
        with self.transaction():
            rows = self._q("SELECT node, start_time, end_time, run_s, guessed FROM outcomes WHERE job_id = ? AND "
                           "run = ? AND guessed != 0", (str(job_id), int(run)))
            if not rows or rows[0]["node"] not in (None, node):
                return False
            o = rows[0]
            end, start = float(end_time), o["start_time"]
            run_s = None
            if start is not None:
                end = max(end, float(start))
                if o["guessed"] == GUESSED_SUSPENDED and o["run_s"] is not None:
                    run_s = min(float(o["run_s"]), end - float(start))
                else:
                    suspended = 0.0
                    if o["run_s"] is not None and o["end_time"] is not None:
                        suspended = max(0.0, (float(o["end_time"]) - float(start)) - float(o["run_s"]))
                    run_s = max(0.0, end - float(start) - suspended)
            return bool(self._x("UPDATE outcomes SET state = ?, exit_code = ?, derived_exit_code = ?, end_time = ?, "
                                "run_s = ?, node = COALESCE(node, ?), guessed = 0 WHERE job_id = ? AND run = ? AND "
                                "guessed != 0", (state, exit_code, derived_exit_code, end, run_s, node, str(job_id),
                                                 int(run))).rowcount)

    def requeued_outcome(self, job_id: str, run: int) -> bool:
        """Run ``run`` of ``job_id`` was ended by a requeue, not by its exit: its outcome, recorded COMPLETED or
        FAILED from its Epilog's exit status, says REQUEUED. True when it changed."""
        with self.transaction():
            return bool(self._x("UPDATE outcomes SET state = 'REQUEUED' WHERE job_id = ? AND run = ? AND state IN "
                                "('COMPLETED', 'FAILED')", (str(job_id), int(run))).rowcount)

    def record_outcome(self, job_id: str, *, state: str, exit_code: int | None = None,
                       derived_exit_code: int | None = None, end_time: float | None = None,
                       now: float | None = None, run: int | None = None, guessed: bool = False,
                       **fields: Any) -> bool:
        """Record how the current run of ``job_id`` ended, exactly once per run: True when written, False
        if it already was. The run is the jobs row's (schema migration 4); without a jobs row there is no
        telling runs apart, and it counts as the latest run recorded.

        ``run``: an earlier run than the jobs row's (an Epilog that arrived after the id ran again). The
        jobs row is the current run's, request and all (the tick stores the new run's profile, count, user,
        partition and time limit before it tracks it as a new run; a reused id is another user's job), so
        nothing is taken from it: pass in ``fields`` what is known of that run, its profile at least;
        what is not given stays empty. ``guessed``: the controller's guess, not Slurm's record nor an Epilog's
        (replace_guessed_outcome).

        Missing fields (profile, count, node, instances, user, partition,
        time_limit_s, submit/start times) come from the jobs row; ``fields``
        overrides any of them. wait_s and run_s are derived from the times; run_s leaves out the time the
        run spent suspended (jobs.suspended_s, suspended_since), so it is end - start only for a job never
        suspended.
        """
        _check_state(state, JOB_STATES, "job state")
        allowed = {"profile", "count", "node", "gpus", "instances", "user", "partition", "time_limit_s",
                   "submit_time", "start_time"}
        unknown = set(fields) - allowed
        if unknown:
            raise TypeError(f"record_outcome() got unknown field(s): {', '.join(sorted(unknown))}")
        job_id = str(job_id)
        t = _now(now)
        with self.transaction():
            rows = self._q("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
            job = _row_job(rows[0]) if rows else None
            current = rows[0]["run"] if rows else self._q(
                "SELECT COALESCE(MAX(run), 1) AS run FROM outcomes WHERE job_id = ?", (job_id,))[0]["run"]
            if run is not None and not 1 <= int(run) <= current:
                raise StoreError(f"cannot record an outcome for run {run} of job {job_id}: its runs are 1 to {current}")
            earlier = run is not None and int(run) < current
            run = current if run is None else int(run)
            if self._q("SELECT 1 FROM outcomes WHERE job_id = ? AND run = ?", (job_id, run)):
                return False
            if (job is None or earlier) and "profile" not in fields:
                which = f"run {run} of job {job_id}, an earlier run than its jobs row's," if earlier \
                    else f"unknown job {job_id}"
                raise StoreError(f"cannot record an outcome for {which} without its profile")
            v: dict[str, Any] = {}
            if job is not None and not earlier:
                v.update(profile=job.profile, count=job.count, user=job.user, partition=job.partition,
                         time_limit_s=job.time_limit_s, node=job.node, instances=list(job.instances),
                         submit_time=job.submit_time, start_time=job.start_time)
            v.update(fields)
            instances = [as_bound_instance(i) for i in v.get("instances") or ()]
            gpus = v.get("gpus") or sorted({i.gpu for i in instances})
            end = end_time if end_time is not None else (job.end_time if job and job.end_time and not earlier else t)
            submit, start = v.get("submit_time"), v.get("start_time")
            wait_s = max(0.0, start - submit) if start is not None and submit is not None else None
            run_s = (end - start) if start is not None and end is not None else None
            if run_s is not None and job is not None and not earlier:
                # Without the time it was suspended (schema migration 9), as Slurm's RunTime counts it: the
                # retrainer's trace replays run_s, and a job suspended for an hour did not run for one more.
                run_s = job.run_time(start, end)
            # A guess of a run suspended at the end guessed (GUESSED_SUSPENDED): replace_guessed_outcome must know.
            mark = 0 if not guessed else GUESSED_SUSPENDED if (
                job is not None and not earlier and job.suspended_since is not None) else GUESSED
            cur = self._x(
                "INSERT INTO outcomes (job_id, run, profile, count, node, gpus, instances, user, partition, "
                "time_limit_s, submit_time, start_time, end_time, wait_s, run_s, exit_code, derived_exit_code, "
                "state, recorded_at, guessed) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(job_id, run) DO NOTHING",
                (job_id, int(run), v["profile"], int(v.get("count") or 1), v.get("node"), dumps(list(gpus)),
                 dumps([i.to_json() for i in instances]), v.get("user") or "", v.get("partition") or "",
                 v.get("time_limit_s"), submit, start, end, wait_s, run_s, exit_code, derived_exit_code, state, t,
                 mark),
            )
            return cur.rowcount == 1

    def outcome(self, job_id: str, *, run: int | None = None) -> Outcome | None:
        """The outcome of the latest recorded run of ``job_id``, or of its run ``run`` (None if there is none)."""
        rows = self._outcomes("WHERE job_id = ?", (str(job_id),))
        if run is not None:
            rows = [o for o in rows if o.run == int(run)]
        return max(rows, key=lambda o: o.run) if rows else None

    def outcomes(self, *, since: float | None = None, limit: int | None = None) -> list[Outcome]:
        """Recorded outcomes, every run of every job id, by end time (optionally those ending at or after
        ``since``)."""
        where, params = "", []
        if since is not None:
            where, params = "WHERE end_time >= ?", [since]
        # rowid: the order runs were recorded in, and a column a version-3 database (read unmigrated) has.
        tail = " ORDER BY end_time, job_id, rowid" + (" LIMIT ?" if limit is not None else "")
        if limit is not None:
            params.append(int(limit))
        return self._outcomes(where + tail, params)

    def _outcomes(self, tail: str, params: Sequence) -> list[Outcome]:
        with self.snapshot():
            rows = self._q("SELECT * FROM outcomes " + tail, params)
        return [Outcome(
            job_id=r["job_id"], profile=r["profile"], count=r["count"], node=r["node"],
            gpus=tuple(loads(r["gpus"], [])), instances=bound_instances_from_json(loads(r["instances"], [])),
            user=r["user"], partition=r["partition"], time_limit_s=r["time_limit_s"], submit_time=r["submit_time"],
            start_time=r["start_time"], end_time=r["end_time"], wait_s=r["wait_s"], run_s=r["run_s"],
            exit_code=r["exit_code"], derived_exit_code=r["derived_exit_code"], state=r["state"],
            recorded_at=r["recorded_at"],
            # Absent from a version-3 database that the read-only views open without migrating it.
            run=r.get("run") or 1,
            guessed=bool(r.get("guessed") or 0),  # (absent before version 10)
        ) for r in rows]
