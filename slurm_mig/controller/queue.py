"""Which of Slurm's pending MIG jobs the policy carves for: those that may start, and each array task.

Slurm lists jobs that wait for something other than GPUs: held, waiting on a dependency or a begin
time, an array at its task limit ("%N"), a user or account over a QOS or association limit. Carving
for them takes slices from jobs that could run. Seen on the demo cluster: a 2g and a 3g were made,
and kept idle, for a job whose dependency could never be met and one submitted with
``--begin=now+3600``. Such a job stays in the store, PENDING with the reason (``slurm-mig jobs``
shows it), but out of the policy's view until Slurm says it may start.

Slurm also lists the tasks of a job array it has not split off yet as one pending record
(``array_task_string`` "3-100"). Read as one job, a 100-task ``mig:1g`` array made the policy carve
for one task at a time (12 tasks on a cluster with room for 28: at most 10 ran at once). Each task
the policy should see becomes a job of its own here, named as Slurm names it ("5_3"); when Slurm
starts the task under a job id of its own, that row gives way to the task's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from slurm_mig.slurm.parsers import SlurmJob, array_task_ids

# Slurm reasons that say a pending job cannot start now, however many instances exist.
BLOCKED_REASONS = {
    "JobHeldUser": "held by its user",
    "JobHeldAdmin": "held by an admin",
    "Dependency": "waiting on a dependency",
    "DependencyNeverSatisfied": "its dependency can never be satisfied",
    # slurm-mig sets it too: a requeued job waits out Slurm's credential cache (node/epilog.py _hold_back).
    "BeginTime": "its start time has not come (its --begin, or the hold after a requeue)",
    "JobArrayTaskLimit": "its array runs as many tasks as its limit allows",
    "PartitionDown": "its partition is down",
    "PartitionInactive": "its partition is inactive",
    "PartitionTimeLimit": "its time limit is over its partition's",
    "PartitionNodeLimit": "its node count is outside its partition's limits",
    "PartitionConfig": "it asks for more than its partition allows",
    "AccountNotAllowed": "its account may not use the partition",
    "InvalidAccount": "its account is invalid",
    "InvalidQOS": "its QOS is invalid",
    "AccountingPolicy": "an accounting limit holds it",
    "Licenses": "waiting for licenses",
    # Slurm found no node that can ever satisfy the job and held it (priority 0). For a MIG job, kept to one
    # node by job_submit.lua, that is mostly tasks and CPUs (-n, -c, --mem) that fit no single node.
    "BadConstraints": "Slurm holds it: no node can satisfy its request (a MIG job runs on one node, so its "
                      "tasks and CPUs must fit one)",
}
# Reasons that hold whichever partition the job runs in. Slurm shows one reason, from the last partition
# it tried: a job submitted to "a,b" may show a's PartitionDown while b could start it.
JOB_WIDE_REASONS = ("JobHeldUser", "JobHeldAdmin", "Dependency", "DependencyNeverSatisfied", "BeginTime",
                    "JobArrayTaskLimit")
# Slurm's limit reasons come in families (https://slurm.schedmd.com/job_reason_codes.html): QOSGrp*,
# QOSMax*, AssocGrp*, AssocMax*, Max*PerAccount.
LIMIT_PREFIXES = ("QOS", "Assoc", "Max")
# Of an array's tasks, at most this many are shown to the policy at a time (more could not start in one
# tick on any cluster its look-ahead covers); the rest follow as these start.
ARRAY_TASKS_AHEAD = 128
_ACTIVE = ("RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED")


@dataclass(frozen=True)
class QueuedJob:
    """One entry of the queue as the controller keeps it: a Slurm job, or one task of an array record."""

    job_id: str
    job: SlurmJob
    blocked: str | None = None  # why Slurm will not start it now; None: it may start

    @property
    def array_task(self) -> bool:
        """A task of an array record, not (yet) a job of its own in Slurm."""
        return "_" in self.job_id


def blocked_reason(job: SlurmJob) -> str | None:
    """Why Slurm will not start this pending job now whatever the GPUs, or None.

    Held (priority 0, or a hold reason), a dependency, a begin time, an array at its limit, its partition
    down or its limits exceeded, an invalid account or QOS, licenses, a QOS or association limit. Never for
    the reasons a job waiting for GPUs shows (Resources, Priority, ReqNodeNotAvail, None), nor, for a job
    submitted to several partitions, for a reason that may be only one partition's.
    """
    if not job.pending:
        return None
    reason = job.state_reason
    if "," in (job.partition or "") and reason not in JOB_WIDE_REASONS and job.priority != 0:
        return None
    if reason in BLOCKED_REASONS:
        return f"{BLOCKED_REASONS[reason]} (Slurm: {reason})"
    if reason.startswith(LIMIT_PREFIXES):
        return f"over a QOS or association limit (Slurm: {reason})"
    if job.priority == 0:
        return f"held (priority 0; Slurm: {reason or 'no reason given'})"
    return None


def queue_entries(jobs: list[SlurmJob], ahead: int = ARRAY_TASKS_AHEAD) -> list[QueuedJob]:
    """``jobs`` (in the caller's order) as queue entries: unsplit array records become one entry per
    task (the first ``ahead``), each blocked past the array's task limit; every other job is itself."""
    # Slurm's limit counts the tasks it runs; a split-off task that is held (or otherwise blocked) does not
    # take a place, so counting it would keep the tasks that may start from the policy. Counted once, not
    # per throttled record: a tick reads every job.
    taking_places = Counter(o.array_job_id for o in jobs if o.array_job_id and o.array_task_id is not None and
                            (o.state in _ACTIVE or (o.pending and blocked_reason(o) is None)))
    out: list[QueuedJob] = []
    for j in jobs:
        ids = _pending_tasks(j, ahead)
        if ids is None:
            out.append(QueuedJob(str(j.job_id), j, blocked_reason(j)))
            continue
        array_id = j.array_job_id or j.job_id
        reason = j.state_reason
        # The array's limit is checked here from the tasks Slurm runs: its reason lags a task's end.
        blocked = None if reason == "JobArrayTaskLimit" else blocked_reason(j)
        room = len(ids)
        if j.array_max_tasks:
            room = max(0, j.array_max_tasks - taking_places[array_id])
        limit = f"{BLOCKED_REASONS['JobArrayTaskLimit']} ({j.array_max_tasks} at once)"
        for i, task in enumerate(ids[:max(room, 1)]):
            out.append(QueuedJob(f"{array_id}_{task}", j, blocked or (limit if i >= room else None)))
    return out


def _pending_tasks(job: SlurmJob, ahead: int) -> list[int] | None:
    """The first task ids of an unsplit array record; None for any other job, or an unreadable record
    (which then stays one job, under its own id)."""
    if not job.pending or not job.array_task_string or job.array_task_id is not None:
        return None
    return array_task_ids(job.array_task_string, ahead) or None
