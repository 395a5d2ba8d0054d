"""The jobs Slurm reports and their states, runs and suspensions (table jobs)."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from slurm_mig.errors import StoreError
from slurm_mig.store.models import Job
from slurm_mig.store.rows import _check_state, _now, _row_job
from slurm_mig.store.schema import JOB_STATES, RUNNING_STATES, TERMINAL_STATES

# Ties in the queue (no order from Slurm yet, one submit time) by job id as Slurm orders them, by number:
# ORDER BY job_id (text) put "100" before "99" and "5_10" before "5_9". The number the id starts with, then
# the rest shorter first (the task number of "5_9", "5_10"), then as text: jobids.job_id_key's order for the
# ids the controller keeps ("123", an array task "123_4"), which the simulator's queue uses.
def job_id_order(column: str = "job_id") -> str:
    """The ORDER BY terms that sort ``column`` (a job id) by number, as above."""
    return f"CAST({column} AS INTEGER), length({column}), {column}"


class JobsMixin:
    """Store methods on the jobs (table jobs)."""

    # -- jobs ------------------------------------------------------------------
    def upsert_job(self, job_id: str, *, profile: str, count: int = 1, user: str = "", name: str = "",
                   partition: str = "", time_limit_s: float | None = None, submit_time: float | None = None,
                   state: str | None = None, priority_order: int | None = None, now: float | None = None,
                   blocked: str | None = None, uid: int | None = None) -> None:
        """Insert a job as Slurm reports it, or update its request fields.

        A new job starts PENDING unless ``state`` says otherwise; for an existing
        one ``state`` (when given) goes through set_job_state(), and start/end
        times, bindings and the reason are kept. ``blocked``: why Slurm will not
        start it now (it is then left out of the policy's view and its reason says
        so); None: it may start. ``uid``: its user's uid; None (not known) keeps the
        stored one where ``user`` is the stored name, else leaves none.
        """
        job_id = str(job_id)
        if count < 1:
            raise ValueError(f"job {job_id}: count must be >= 1, got {count}")
        if state is not None:
            _check_state(state, JOB_STATES, "job state")
        t = _now(now)
        with self.transaction():
            self._x(
                # A new row for an id with outcomes (its old row was forgotten) is a later run of the id.
                "INSERT INTO jobs (job_id, user, name, partition, profile, count, time_limit_s, state, submit_time, "
                "priority_order, updated_at, blocked, uid, run) VALUES (?, ?, ?, ?, ?, ?, ?, 'PENDING', ?, ?, ?, ?, ?, "
                "(SELECT COALESCE(MAX(o.run), 0) + 1 FROM outcomes o WHERE o.job_id = ?)) "
                "ON CONFLICT(job_id) DO UPDATE SET "
                "uid = CASE WHEN excluded.uid IS NOT NULL THEN excluded.uid WHEN excluded.user = jobs.user "
                "THEN jobs.uid END, "
                "user = excluded.user, name = excluded.name, "
                "partition = excluded.partition, profile = excluded.profile, count = excluded.count, "
                "time_limit_s = excluded.time_limit_s, "
                "priority_order = COALESCE(excluded.priority_order, jobs.priority_order), "
                "updated_at = excluded.updated_at, blocked = excluded.blocked, "
                # No longer blocked: its reason said why it could not start (the policy's next word follows).
                "reason = CASE WHEN jobs.blocked IS NOT NULL AND excluded.blocked IS NULL AND jobs.state = 'PENDING' "
                "THEN '' ELSE jobs.reason END",
                (job_id, user, name, partition, profile, int(count), time_limit_s,
                 t if submit_time is None else submit_time, priority_order, t, blocked,
                 None if uid is None else int(uid), job_id),
            )
            if blocked is not None:
                # What `jobs` and `explain` show; the policy's next word replaces it once it may start.
                self._x("UPDATE jobs SET reason = ? WHERE job_id = ? AND state = 'PENDING'", (blocked, job_id))
            if state is not None:
                self.set_job_state(job_id, state, now=t)

    def set_job_order(self, job_ids: Sequence[str]) -> None:
        """Set the pending queue order (Slurm's priority order): ``job_ids[0]`` runs first."""
        with self.transaction():
            for i, job_id in enumerate(job_ids):
                self._x("UPDATE jobs SET priority_order = ? WHERE job_id = ?", (i, str(job_id)))

    def set_job_state(self, job_id: str, state: str, *, now: float | None = None, reason: str | None = None,
                      node: str | None = None, exit_code: int | None = None, end_time: float | None = None) -> None:
        """Move a job to ``state``. RUNNING stamps start_time (once); a terminal state stamps end_time (once:
        ``end_time`` where the caller knows when the job ended, an Epilog's or Slurm's, else ``now``) and releases
        the job's bindings; PENDING/REQUEUED clear start/end so a requeued job waits afresh."""
        _check_state(state, JOB_STATES, "job state")
        job_id = str(job_id)
        t = _now(now)
        with self.transaction():
            if not self._q("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)):
                raise StoreError(f"unknown job {job_id}")
            sets = ["state = ?", "updated_at = ?"]
            params: list[Any] = [state, t]
            if state in RUNNING_STATES:
                sets.append("start_time = COALESCE(start_time, ?)")
                params.append(t)
            elif state in TERMINAL_STATES:
                sets.append("end_time = COALESCE(end_time, ?)")
                params.append(t if end_time is None else float(end_time))
            elif state in ("PENDING", "REQUEUED"):
                sets.append("start_time = NULL, end_time = NULL, suspended_s = NULL, suspended_since = NULL")
            for col, val in (("reason", reason), ("node", node), ("exit_code", exit_code)):
                if val is not None:
                    sets.append(f"{col} = ?")
                    params.append(val)
            self._x(f"UPDATE jobs SET {', '.join(sets)} WHERE job_id = ?", (*params, job_id))
            if state in TERMINAL_STATES:
                self.release(job_id, now=t)

    def set_suspension(self, job_id: str, *, suspended_s: float, since: float | None, ended: bool = False,
                       ran_to_end: bool = False) -> None:
        """Note the time the current run of ``job_id`` has spent suspended, as Slurm's record says
        (SlurmJob.suspended_before_s): ``suspended_s`` seconds before its last suspend or resume, and ``since``
        when the suspension going on began (None: it runs). Only for a job that runs here (RUNNING, SUSPENDED,
        COMPLETING, or ended): a waiting one has no run yet. ``ended``: Slurm's record of the run's end (or its
        COMPLETING): the seconds only grow, and the suspension noted as going on is kept (Slurm gives a job
        killed while suspended its suspend time as end, with the same figures as before the kill), unless
        ``ran_to_end``: Slurm's record says it ran after its last resume (it ended after its suspend time), a
        resume no tick saw (within one tick interval, or while the controller was down). The run's outcome, if
        its Epilog recorded it already, gets the run time these figures give (record_outcome's)."""
        with self.transaction():
            if ended:
                if ran_to_end:
                    cur = self._x("UPDATE jobs SET suspended_s = MAX(COALESCE(suspended_s, 0.0), ?), "
                                  "suspended_since = NULL WHERE job_id = ? AND state NOT IN ('PENDING', 'REQUEUED') "
                                  "AND (suspended_since IS NOT NULL OR suspended_s IS NULL OR suspended_s < ?)",
                                  (float(suspended_s), str(job_id), float(suspended_s)))
                else:
                    cur = self._x("UPDATE jobs SET suspended_s = ? WHERE job_id = ? AND state NOT IN ('PENDING', "
                                  "'REQUEUED') AND (suspended_s IS NULL OR suspended_s < ?)",
                                  (float(suspended_s), str(job_id), float(suspended_s)))
                if cur.rowcount:
                    # Its Epilog may have come first, with the figures of a suspension no tick saw end (the
                    # run time after the resume left out) or none seen at all (the time suspended counted).
                    job = _row_job(self._q("SELECT * FROM jobs WHERE job_id = ?", (str(job_id),))[0])
                    for o in self._q("SELECT start_time, end_time FROM outcomes WHERE job_id = ? AND run = ? AND "
                                     "start_time IS NOT NULL AND end_time IS NOT NULL", (job.job_id, job.run)):
                        run_s = job.run_time(o["start_time"], o["end_time"])
                        self._x("UPDATE outcomes SET run_s = ? WHERE job_id = ? AND run = ?",
                                (run_s, job.job_id, job.run))
            else:
                self._x("UPDATE jobs SET suspended_s = ?, suspended_since = ? WHERE job_id = ? AND state IN "
                        "('RUNNING', 'SUSPENDED', 'COMPLETING') AND (suspended_s IS NOT ? OR suspended_since IS NOT ?)",
                        (float(suspended_s), since, str(job_id), float(suspended_s), since))

    def restart_job(self, job_id: str, *, now: float | None = None, reason: str,
                    submit_time: float | None = None) -> None:
        """A job that ended here runs again under the same id: PENDING afresh as its next run, without the
        ended run's node, exit code and instances (its outcome row stays, the next run gets its own).
        ``submit_time``: the new run's, as Slurm gives it (upsert_job keeps the first one it saw)."""
        with self.transaction():
            self.set_job_state(job_id, "PENDING", now=now, reason=reason)
            # run + 1 whether or not the ended run recorded an outcome: a number is never given twice.
            self._x("UPDATE jobs SET node = NULL, exit_code = NULL, instances = '[]', run = run + 1, "
                    "submit_time = COALESCE(?, submit_time) WHERE job_id = ?", (submit_time, str(job_id)))

    def note_start_if_unknown(self, job_id: str, *, start_time: float, node: str) -> None:
        """Fill in ``job_id``'s start time and node where none is recorded yet, changing nothing else: for a run
        that has ended, whose start is learnt late (a binding its node made alone, delivered after the end was
        recorded). Its state, end, reason and bindings stay as they are."""
        with self.transaction():
            self._x("UPDATE jobs SET start_time = COALESCE(start_time, ?), node = COALESCE(node, ?) WHERE job_id = ?",
                    (start_time, node, str(job_id)))

    def forget_pending_job(self, job_id: str) -> bool:
        """Delete a PENDING job that holds no binding (an array task Slurm now runs under an id of its
        own); False, and nothing done, for any other job."""
        with self.transaction():
            cur = self._x("DELETE FROM jobs WHERE job_id = ? AND state = 'PENDING' AND NOT EXISTS "
                          "(SELECT 1 FROM bindings b WHERE b.job_id = jobs.job_id)", (str(job_id),))
        return bool(cur.rowcount)

    def get_job(self, job_id: str) -> Job | None:
        with self.snapshot():
            rows = self._q("SELECT * FROM jobs WHERE job_id = ?", (str(job_id),))
        return _row_job(rows[0]) if rows else None

    def jobs(self, states: Iterable[str] | None = None, *, limit: int | None = None) -> list[Job]:
        """Jobs (optionally only in ``states``), in queue order then submit time."""
        sql, params = "SELECT * FROM jobs", []
        if states is not None:
            states = [_check_state(s, JOB_STATES, "job state") for s in states]
            sql += f" WHERE state IN ({', '.join('?' for _ in states)})"
            params += states
        sql += " ORDER BY priority_order IS NULL, priority_order, submit_time, " + job_id_order()
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        with self.snapshot():
            return [_row_job(r) for r in self._q(sql, params)]

    def job_ids(self, states: Iterable[str]) -> list[str]:
        """The ids of the jobs in ``states``, in the order of jobs(states): where a caller needs no more (a tick
        asks for every waiting job's, 10,000 on a large site, to find those Slurm no longer lists)."""
        states = [_check_state(s, JOB_STATES, "job state") for s in states]
        with self.snapshot():
            return [r[0] for r in self._x(
                f"SELECT job_id FROM jobs WHERE state IN ({', '.join('?' for _ in states)}) "
                "ORDER BY priority_order IS NULL, priority_order, submit_time, " + job_id_order(), states).fetchall()]

    def job_users(self, states: Iterable[str]) -> dict[str, tuple[str, int | None]]:
        """``{job_id: (user, uid)}`` of the jobs in ``states`` (uid None: not known): what a tick needs of the
        stored runs before it writes Slurm's records over them (one query, not a row read per job)."""
        states = [_check_state(s, JOB_STATES, "job state") for s in states]
        with self.snapshot():
            return {r[0]: (r[1], r[2]) for r in self._x(
                f"SELECT job_id, user, uid FROM jobs WHERE state IN ({', '.join('?' for _ in states)})",
                states).fetchall()}

    def pending_jobs(self, *, include_bound: bool = False, include_blocked: bool = False) -> list[Job]:
        """PENDING jobs in Slurm priority order (priority_order, then submit time).

        Jobs that already hold a live binding (assigned, waiting for Slurm to
        start them) are left out unless ``include_bound``: a policy must not place them again.
        Jobs Slurm will not start now (``blocked``) are left out unless ``include_blocked``.
        """
        sql = "SELECT * FROM jobs j WHERE j.state = 'PENDING'"
        if not include_blocked:
            sql += " AND j.blocked IS NULL"
        if not include_bound:
            sql += " AND NOT EXISTS (SELECT 1 FROM bindings b WHERE b.job_id = j.job_id AND b.released_at IS NULL)"
        sql += " ORDER BY j.priority_order IS NULL, j.priority_order, j.submit_time, " + job_id_order("j.job_id")
        with self.snapshot():
            return [_row_job(r) for r in self._q(sql)]

    def running_jobs(self) -> list[Job]:
        """Jobs Slurm runs now (RUNNING, SUSPENDED, COMPLETING), oldest start first."""
        with self.snapshot():
            rows = self._q(
                f"SELECT * FROM jobs WHERE state IN ({', '.join('?' for _ in RUNNING_STATES)}) "
                "ORDER BY start_time, job_id",
                RUNNING_STATES,
            )
        return [_row_job(r) for r in rows]
