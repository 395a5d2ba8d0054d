"""The Epilog (root, on the node, after every job): report the job's outcome through the outbox, wait a
bounded time for its processes to leave its instances, and drop its binding (or keep it while processes
remain); hold a requeued job back until this node has forgotten its credential."""

from __future__ import annotations

import logging
import re
import time

from slurm_mig.node.context import HOOK_FLUSH_BUDGET_S, Node, _int

log = logging.getLogger("slurm_mig.hooks")


def epilog(env: dict, node: Node) -> int:
    job_id = env["SLURM_JOB_ID"]
    node.state.ensure()
    unreadable = False
    try:
        insts = node.state.read_binding(job_id) or []
    except ValueError as exc:
        # Bound, but the file is damaged: the outcome still goes out; the controller knows the instances.
        log.error("job %s: binding file unreadable (%s); reporting the outcome without it", job_id, exc)
        insts, unreadable = [], True
    # The simulated GPU's stand-in for the job's processes ends with it; a process that outlived the job
    # (another mark) stays, and keeps the binding below, as a real GPU's leftover process does.
    if unreadable:
        # Which instances: the record cannot say. Its "job <id>" marks are found by their owner, on the
        # instances no other record names (an earlier run's record set aside, which the health check releases
        # with its own marks): left, they kept the instances busy for good once this record was removed.
        node.end_marks_no_other_record_names(job_id)
    else:
        node.end_job_processes(job_id, insts)
    lingering = [i.to_json() for i in _wait_for_processes(node, job_id, insts)]
    # Slurm raises SLURM_JOB_RESTART_COUNT when it requeues a job, before this Epilog runs: a binding made
    # at a lower count belongs to an attempt that was requeued (e.g. its Prolog was killed and the wrapper
    # requeued it), whose end is not the job's outcome.
    noted = node.state.take_attempt(job_id)
    attempt, restarts = node.state.binding_attempt(job_id), _int(env.get("SLURM_JOB_RESTART_COUNT"))
    attempt = noted if attempt is None else attempt
    requeued = attempt is not None and restarts is not None and restarts > attempt
    # Whose job it was: Slurm's SLURM_JOB_UID, else the binding record's. The controller ends a run with this id
    # only if it is that user's (the id may have been given again to another user's job meanwhile).
    uid = _int(env.get("SLURM_JOB_UID"))
    uid = uid if uid is not None and uid >= 0 else node.state.binding_uid(job_id)
    payload = {"job_id": job_id, "node": node.name, "instances": [i.to_json() for i in insts],
               "exit_code": _int(env.get("SLURM_JOB_EXIT_CODE")), "derived_ec": _int(env.get("SLURM_JOB_DERIVED_EC")),
               "end_time": time.time(), "lingering": lingering, "binding_unreadable": unreadable,
               "requeued": requeued, "uid": uid}
    # The outcome goes to the outbox first (written and fsynced), then the outbox is delivered in order:
    # killed from here on, the next hook or health check still delivers it, and it never overtakes an
    # older message about the same job (a binding made while the controller was down).
    node.state.enqueue("/v1/epilog", payload)
    node.flush_outbox(HOOK_FLUSH_BUDGET_S)  # behind a long backlog, its outcome waits for the health check
    if requeued:
        _hold_back(node, job_id)
    if lingering:
        # Keep the binding so no layout change destroys an instance that still has processes;
        # the health check releases it once the processes are gone.
        log.error("job %s ended but its instance(s) still run processes: %s", job_id, lingering)
    else:
        node.state.remove_binding(job_id)
    return 0


EPILOG_WAIT_S = 5.0  # how long the Epilog waits, for all of a job's instances together, for processes to exit
EPILOG_POLL_S = 0.5


def _wait_for_processes(node: Node, job_id: str, insts: list) -> list:
    """The instances of ``insts`` that still run processes after EPILOG_WAIT_S, or whose GPU cannot be read.

    On a real GPU a job's processes may take a moment to exit after its cgroup is killed. Every instance is
    polled together against one deadline, with one listing per GPU per poll, so a job with many instances
    waits no longer than a job with one: the admin guide gives this bound against Slurm's
    PrologEpilogTimeout. A GPU that cannot be read (lost, driver gone) is not asked again: its instances
    count as busy, so their binding is kept until it can be read.
    """
    deadline = time.monotonic() + EPILOG_WAIT_S
    waiting, unreadable = list(insts), []
    while waiting:
        busy = []
        for gpu in sorted({i.gpu for i in waiting}):
            on_gpu = [i for i in waiting if i.gpu == gpu]
            try:
                in_use = {x.uuid for x in node.backend.instances(gpu) if x.in_use}
            except Exception as exc:  # noqa: BLE001 - the outcome still goes out
                for i in on_gpu:
                    log.error("job %s: cannot check %s@%d on GPU %d (%s); its binding is kept until the GPU "
                              "can be read", job_id, i.profile, i.start, i.gpu, exc)
                unreadable += on_gpu
                continue
            busy += [i for i in on_gpu if i.uuid in in_use]
        waiting = busy
        left = deadline - time.monotonic()
        if not waiting or left <= 0:
            break
        time.sleep(min(EPILOG_POLL_S, left))
    kept = {id(i) for i in waiting + unreadable}
    return [i for i in insts if id(i) in kept]  # in the binding's order, as the controller is told


def _hold_back(node: Node, job_id: str) -> None:
    """Keep a requeued job from starting again until this node has forgotten its credential.

    slurmd skips the Prolog of a job id whose credential it still caches, until cred_expire after this
    Epilog ends; Slurm holds the requeued job back for cred_expire counted from the requeue, a little
    earlier. Started on this node in between, the job would run without its Prolog, so without its MIG
    instance. Pushing its StartTime to cred_expire (+5 s) from now closes that window.
    """
    from slurm_mig.slurm.runner import SlurmClient

    # The two calls share what the Epilog's time limit leaves (they are its reserve).
    client = SlurmClient(slurm_conf=node.settings.slurm_conf, timeout=10)
    res = client.run(["scontrol", "show", "config"], timeout=node.slurm_timeout(0.0, 2))
    found = re.search(r"cred_expire=(\d+)", res.stdout) if res.ok else None
    wait = (int(found.group(1)) if found else 120) + 5  # Slurm's default cred_expire is 120 s
    res = client.run(["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{wait}"],
                     timeout=node.slurm_timeout(0.0, 1))
    if res.ok:
        log.info("job %s was requeued: held back %d s, until this node has forgotten its credential", job_id, wait)
    else:
        log.warning("could not hold back requeued job %s: %s", job_id, res.describe())
