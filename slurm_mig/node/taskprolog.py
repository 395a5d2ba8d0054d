"""The TaskProlog (the job's user, before every task): print the CUDA_VISIBLE_DEVICES Slurm exports to the
task, from the TaskProlog's copy of the job's binding.

It runs for every task, so it imports only what it needs (the standard library and localstate; Slurm's
modules only for a one-task step of a job with several instances).
"""

from __future__ import annotations

import os
from pathlib import Path

from slurm_mig.node.context import _int


def taskprolog(env: dict, node_name: str, state_root: str, slurm_conf: str | None = None) -> int:
    """Print the job's CUDA_VISIBLE_DEVICES for Slurm to export (runs as the job's user)."""
    from slurm_mig.node.localstate import NodeState

    job_id = env.get("SLURM_JOB_ID", "")
    state = NodeState(Path(state_root) / node_name)
    components = _het_components(env)
    # A job submitted from inside a het job inherits its SLURM_JOB_ID_HET_GROUP_* (--export=ALL): only a
    # step of the het job itself has its own id among them.
    het_step = bool(components) and job_id in components
    if het_step:
        # A heterogeneous job's step: every task is told the leader's job id (seen on Slurm 22.05), and the
        # component that runs here was bound under its own. Slurm does not say which component a task is
        # of, so when two are bound on this node the task cannot be given either's instances.
        here = [c for c in components if _has_task_binding(state, c)]
        if len(here) > 1:
            return _show_no_gpu(env, f"components {', '.join(here)} of heterogeneous job {job_id} are both bound "
                                     f"on this node and Slurm does not say which this task belongs to: no GPU is "
                                     f"shown to it")
        if here:
            job_id = here[0]
    try:
        insts = state.read_task_binding(job_id)
    except (OSError, ValueError) as exc:
        # The job is bound but we cannot tell to what: it must see no GPU rather than every GPU.
        return _show_no_gpu(env, f"cannot read this job's MIG binding: {exc}")
    if insts is None:
        # Not bound to an instance (not a MIG job, or its Prolog requeued it): such a job must see no
        # GPU rather than every GPU. A value Slurm's own gres/gpu plugin set is left alone, but not one a
        # slurm-mig TaskProlog set in the job this one was submitted from (sbatch/srun pass the submitting
        # shell's environment on): that names another job's instance. Ours come with SLURM_MIG_INSTANCES
        # and are all MIG-<uuid>; gres/gpu sets device indexes.
        cvd = env.get("CUDA_VISIBLE_DEVICES")
        inherited = "SLURM_MIG_INSTANCES" in env
        if cvd is None or (inherited and cvd and all(u.startswith("MIG-") for u in cvd.split(","))):
            print("export CUDA_VISIBLE_DEVICES=")
        if inherited:
            print("unset SLURM_MIG_INSTANCES")
        return 0
    # Not for a het step: its tasks know only the leader's job id, and the step record Slurm shows for
    # it is the leader's part of the step, whose request need not be this component's.
    if len(insts) > 1 and not het_step:
        insts = _step_instances(env, insts, slurm_conf)
    uuids = ",".join(i.uuid for i in insts)
    print(f"export CUDA_VISIBLE_DEVICES={uuids}")
    print(f"export SLURM_MIG_INSTANCES={','.join(f'{i.profile}@{i.gpu}:{i.start}' for i in insts)}")
    return 0


def _show_no_gpu(env: dict, why: str) -> int:
    """The TaskProlog's answer for a task that must see no GPU rather than a wrong one: says why to the task."""
    print(f"print slurm-mig: {why}")
    print("export CUDA_VISIBLE_DEVICES=")
    if "SLURM_MIG_INSTANCES" in env:
        print("unset SLURM_MIG_INSTANCES")
    return 0


# Step ids from here up are Slurm's batch, extern and interactive steps: they hold the whole job.
_SPECIAL_STEPS = 0xFFFFFFF0


def _step_instances(env: dict, insts: list, slurm_conf: str | None) -> list:
    """The instances a one-task step that asked for fewer than its job holds is shown.

    Slurm tells the task nothing of its step's GRES (22.05: no variable), so two concurrent
    ``srun --gres=mig:1g`` steps of a ``mig:1g:2`` job both saw both instances and CUDA put both on the
    first. Slurm's own record of the step says how many it asked for; the step gets that many, taken
    round-robin by step id, so steps started together get different instances, and the instances the job's
    other running steps were shown are taken last (``_instances_of_other_steps``). Steps with several tasks
    keep every instance (their tasks split them by SLURM_LOCALID), and so does any step Slurm cannot be
    asked about.
    """
    from slurm_mig.slurm.parsers import parse_step_mig_request
    from slurm_mig.slurm.runner import run_slurm

    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")
    if not (job.isascii() and job.isdigit() and step.isascii() and step.isdigit()) or int(step) >= _SPECIAL_STEPS:
        return insts
    if _int(env.get("SLURM_STEP_NUM_TASKS")) != 1:
        return insts
    res = run_slurm(["scontrol", "-d", "show", "step", f"{job}.{step}"], timeout=5, slurm_conf=slurm_conf)
    asked = parse_step_mig_request(res.stdout) if res.ok else None
    want = sum(asked.values()) if asked else 0
    if not 0 < want < len(insts):
        return insts
    first = int(step) * want % len(insts)
    order = [insts[(first + i) % len(insts)] for i in range(len(insts))]
    # Round-robin alone gave a step the instance of one still running whenever the steps had not started
    # together: a long step 0 (the first instance) and a short step 1 (the second), then step 2, whose turn is
    # the first again, ran beside step 0 on one instance while the other idled. The job's other steps that run
    # here now are asked first: the least used instances are taken, round-robin among equals.
    used = _instances_of_other_steps(job, step)
    return sorted(order, key=lambda i: len(used.get(i.uuid, ())))[:want]


#: Where the TaskProlog reads the job's other tasks from (a test points it elsewhere).
PROC_ROOT = "/proc"


def _instances_of_other_steps(job: str, step: str) -> dict[str, set[str]]:
    """MIG UUID -> the other steps of ``job`` running on this node that were shown it, read from their tasks'
    environments (CUDA_VISIBLE_DEVICES, which this TaskProlog exported to them). Only this user's processes are
    read (the TaskProlog runs as the job's user; Slurm's special steps, the batch shell and srun itself, which
    see every instance, are left out). A process that cannot be read is skipped: this only orders instances."""
    want_job = f"SLURM_JOB_ID={job}".encode()
    uid = os.getuid()
    used: dict[str, set[str]] = {}
    try:
        pids = [p for p in os.listdir(PROC_ROOT) if p.isdigit()]
    except OSError:
        return used
    for pid in pids:
        try:
            if os.stat(os.path.join(PROC_ROOT, pid)).st_uid != uid:
                continue
            with open(os.path.join(PROC_ROOT, pid, "environ"), "rb") as f:
                data = f.read(1 << 20)
        except OSError:
            continue
        if want_job not in data:
            continue
        env = dict(v.split(b"=", 1) for v in data.split(b"\0") if b"=" in v)
        other = env.get(b"SLURM_STEP_ID", b"").decode("ascii", "replace")
        if env.get(b"SLURM_JOB_ID") != job.encode() or not other.isdigit() or other == step \
                or int(other) >= _SPECIAL_STEPS:
            continue
        for uuid in env.get(b"CUDA_VISIBLE_DEVICES", b"").decode("ascii", "replace").split(","):
            if uuid.startswith("MIG-"):
                used.setdefault(uuid, set()).add(other)
    return used


def _het_components(env: dict) -> list[str]:
    """The job ids of a heterogeneous job's components (SLURM_JOB_ID_HET_GROUP_<k>), [] for any other job."""
    size = _int(env.get("SLURM_HET_SIZE"))
    if not size or size < 2:
        return []
    ids = [env.get(f"SLURM_JOB_ID_HET_GROUP_{k}", "") for k in range(min(size, 128))]
    return [j for j in ids if j.isascii() and j.isdigit()]


def _has_task_binding(state, job_id: str) -> bool:
    try:
        return state.read_task_binding(job_id) is not None
    except (OSError, ValueError):
        return True  # there, if unreadable: the caller must not guess past it
