"""Which run of a job id a Slurm record or a node's message is: job-record predicates shared by the tick and
the node API (a job id may be requeued, or given again to another job after slurmctld lost its state)."""

from __future__ import annotations

import pwd
import re

from slurm_mig.slurm.gres import GRES_TO_KIND, GRES_TYPES
from slurm_mig.slurm.parsers import local_epoch, wait_status

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE")
JOB_ID = re.compile(r"[0-9]{1,12}(_[0-9]{1,9})?")  # use with fullmatch: "$" would let "12\n" through
# The reason a waiting job Slurm no longer lists is marked CANCELLED with: the tick's guess, not Slurm's word (a
# job that ran while the controller was down, then was forgotten after MinJobAge, is gone too).
NOT_IN_QUEUE = "no longer in Slurm's queue"
# The reason of a job the tick settled as FAILED without Slurm's record of its end (Slurm had forgotten it) or an
# Epilog: a guess, which the job's Epilog, arriving later, replaces (_epilog).
FORGOTTEN = "ended unseen: neither Slurm's record nor its Epilog said how"


def same_run(job, listed, outcome=None) -> bool:
    """Is Slurm's ended ``listed`` job the run the store ended as ``job`` (not an earlier run of a reused id)?
    Slurm's end time agrees to within a few minutes with the run's: its ``outcome``'s (the Epilog's own
    end_time, taken on the node after Slurm's) or the job's (when the controller recorded the end). The
    job's alone missed an Epilog delivered long after its job ended (from the node's outbox, the controller
    down meanwhile), which then kept its guess (COMPLETED for a job cancelled) for good."""
    if listed.end_time is None:
        return False
    ends = [float(e) for e in (outcome.end_time if outcome is not None else None, job.end_time) if e is not None]
    return any(abs(float(listed.end_time) - e) < 300.0 for e in ends)


def another_job(job, submit_time: float | None, margin: float, *, user: str = "", uid: int | None = None,
                 requeued: bool = False, job_user: tuple[str, int | None] | None = None) -> bool:
    """Is a job Slurm lists under ``job``'s id, ``user``'s (uid ``uid``, None: not known) and submitted at
    ``submit_time``, another job than the store's live (not ended) run ``job``? ``requeued``: Slurm says it
    requeued that job (squeue's restart count). ``job_user``: the stored run's (user, uid) where ``job``'s are
    no longer it (the tick has written Slurm's over them).

    A requeue never changes a job's user: one of another user (both known, :func:`users_differ`) is another job,
    whatever its times and restart count say. Otherwise: a job is submitted before it starts, and Slurm keeps
    a job's submit time until it requeues it: one submitted after this run started (a waiting run: after it
    was submitted), by more than the clocks may differ, is another job with the id (slurmctld lost its state
    and counts from FirstJobId again, or its ids wrapped at MaxJobId), unless Slurm requeued it. The store
    knew only the id: it took such a job for the run it had, handing it that run's instances in its Prolog,
    and counting its wait from the other job's submission. Left ambiguous, and taken for the stored run: a job
    of the same user (or a user either record cannot name) submitted within ``margin`` of that run's start
    (waiting: of its submission); nothing Slurm prints tells the two apart."""
    if job is None or job.state in TERMINAL:
        return False
    stored, stored_uid = (job.user, getattr(job, "uid", None)) if job_user is None else job_user
    if users_differ(stored, user, stored_uid, uid):
        return True
    if requeued or submit_time is None:
        return False
    since = job.start_time if job.start_time is not None else job.submit_time
    return since is not None and float(submit_time) > since + margin


def users_differ(stored: str | None, listed: str | None, stored_uid: int | None = None,
                listed_uid: int | None = None) -> bool:
    """Do two records of a job id name different users? By their uids where both have one: a name is not the
    user's for good (renamed in the directory while a job ran; the uid printed where the head node's lookup
    failed, against a name all digits), and until 2026-11-27 a running job whose user's name squeue read
    otherwise was taken for another user's job, its instances released. Else by name, only when both name one
    (:func:`known_user`) the same way: squeue --json gives the uid where it cannot look the name up, and a uid
    against a name says nothing."""
    if stored_uid is not None and listed_uid is not None:
        return stored_uid != listed_uid
    if not (known_user(stored) and known_user(listed)):
        return False
    a, b = stored.strip(), listed.strip()
    return a.isdigit() == b.isdigit() and a != b


def uid_of(user: str | None) -> int | None:
    """The uid this host's name service gives ``user`` (None: no such name, or the lookup failed). Only asked where
    squeue's name for a job is not the stored one: squeue -j, unlike --json, prints no uid."""
    if not known_user(user):
        return None
    try:
        return pwd.getpwnam(user.strip()).pw_uid
    except (KeyError, OSError, ValueError):
        return None


def known_user(user: str | None) -> bool:
    """Does a job record's ``user`` name someone? Not when empty, nor Slurm's words for a user it could not look up
    ("nobody": uid_to_string's answer; "(null)")."""
    return bool(user) and user.strip() not in ("", "nobody", "(null)", "N/A")


def size_hold(job) -> bool:
    """Is Slurm holding this pending job (priority 0) as BadConstraints, the hold it puts on a job no node it may
    use can take as configured, a `-w` MIG job among them when its node advertises no slice of its size now?"""
    return job.held and job.state_reason == "BadConstraints"


def was_requeued(detail) -> bool:
    """Has Slurm requeued the job of this record (job_detail) at least once? Its restart count (squeue's
    RestartCnt, scontrol's Restarts); a record without one says no."""
    count = ((getattr(detail, "fields", None) or {}).get("Restarts") or "").strip()
    return count.isdigit() and int(count) > 0


def array_task_of(detail) -> str | None:
    """``"<array job id>_<task id>"`` of an array task from its Slurm record (job_detail), else None."""
    fields = getattr(detail, "fields", None) or {}
    array_id, task = fields.get("ArrayJobId", ""), fields.get("ArrayTaskId", "")
    job_id = f"{array_id}_{task}"
    return job_id if JOB_ID.fullmatch(job_id) and "_" in job_id else None


def slurm_end(detail, state: str, now: float, margin: float = 0.0, *,
              listed_end: float | None = None) -> tuple[str, int | None, float]:
    """(state, exit status as the Epilog reports it, end time) of an ended job from its Slurm record (job_detail);
    squeue's state and end (``listed_end``, its epoch end_time) and an unknown exit status when scontrol could not
    answer. The record is read when a tick first sees the job ended, moments after its end (or after the
    controller's outage): in the hour the clock goes back, its local EndTime is the later of its two instants
    that is not after ``now`` (+ ``margin``, the clocks' difference); mktime's guess could put the end an hour
    early, taking the hour off the run's time. Neither record saying when (or squeue's end after ``now`` +
    ``margin``): ``now``, which is later than the end by as long as the controller was down."""
    fallback = now if listed_end is None or listed_end > now + margin else float(listed_end)
    if detail is None:
        return state, None, fallback
    end = local_epoch(detail.fields.get("EndTime", ""), not_after=now + margin)
    return detail.state, wait_status(detail.fields.get("ExitCode")), fallback if end is None else end


def kind_of_gres(gtype: str) -> str:
    """GRES type ("1gdm") -> geometry kind ("1g.dm")."""
    return GRES_TO_KIND.get(gtype, gtype)


#: The most instances one job may ask for per node: job_submit.lua refuses a count of more than six digits.
MAX_REQUEST_COUNT = 999_999


def mig_size_request(mig: dict[str, int]) -> tuple[str, int]:
    """A job's MIG request as (geometry kind, count).

    ValueError, saying why, for a request slurm-mig cannot serve: two sizes (a job is planned, bound
    and recorded as one size times a count), padding or an unknown type, a count below 1 or above
    MAX_REQUEST_COUNT.
    job_submit.lua refuses these at submission; a job queued before it was installed still comes here.
    """
    if len(mig) != 1:
        raise ValueError(f"asks for {len(mig)} MIG sizes ({', '.join(f'mig:{t}' for t in sorted(mig))}); "
                         f"slurm-mig serves one size per job")
    (gtype, count), = mig.items()
    if gtype not in GRES_TYPES:
        raise ValueError(f"asks for mig:{gtype}, which is not a MIG size")
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"asks for mig:{gtype}:{count}; the count must be at least 1")
    if count > MAX_REQUEST_COUNT:
        # Stored, a count past SQLite's 64-bit integers raised OverflowError in every tick while the job was queued.
        raise ValueError(f"asks for {count} mig:{gtype} instances per node, more than a node can hold")
    return kind_of_gres(gtype), count


def live_request(job) -> bool:
    """Is ``job`` (a store row or None) one whose MIG request the store knows? Not one that ended here: started
    again (id reused, requeued after it ended), it may ask for another size."""
    return job is not None and bool(job.profile) and job.state not in TERMINAL


UNCOUNTED = "uncounted/"  # meta key prefix: an Epilog's outcome not yet counted in jobs_finished_total


def uncounted_key(job_id: str, run: int) -> str:
    return f"{UNCOUNTED}{job_id}/{run}"
