"""The periodic health check (root, on the node; also `slurm-mig node sync`): report the node's state,
keep the controller's desired layouts and apply them on idle slices, and release the bindings of jobs that
ended without their Epilog."""

from __future__ import annotations

import contextlib
import logging
import time

from slurm_mig.node.context import Node, blocked_gpus
from slurm_mig.node.layoutcache import cache_desired, cached_desired

log = logging.getLogger("slurm_mig.hooks")


def healthcheck(env: dict, node: Node) -> int:
    """Report the node's state, receive desired layouts and apply them on idle slices.

    Its steps under the layout lock wait for it [node].layout_lock_wait_s in all (a holder may hang inside
    NVML); a step that cannot have it is left to the next round, and the report goes out all the same."""
    from slurm_mig.api.client import ControllerRefused, ControllerUnavailable

    node.state.ensure()
    node.start_lock_budget()
    # The MIG table check is made once per health check: its repair, its report and the report after a
    # re-carve all read this round's verdicts (`node sync --loop` runs many rounds on one Node).
    node._table_verdicts = {}
    node.flush_outbox()
    with _unless_lock_busy("making half-made instances whole"):
        with node.apply_lock():
            node.repair_half_made()  # before observing: the report then never offers one as usable
    observed_at = time.time()
    # With when each binding was written, so the controller can tell a file an earlier run of a job id left
    # (its processes outlived it) from a binding of the run that waits now.
    report = {"node": node.name, "observed": node.observe(), "observed_at": observed_at,
              "bindings": node.bindings_json(), "binding_times": node.state.binding_times(), "time": time.time()}
    try:
        resp = node.client.call("/v1/report", report)
    except (ControllerUnavailable, ControllerRefused) as exc:
        log.warning("health check: controller unreachable: %s", exc)
        resp = cached_desired(node)
    else:
        with _unless_lock_busy("keeping the desired layouts"):
            cache_desired(node, resp, report["observed"], observed_at)
    with _unless_lock_busy("releasing the bindings of jobs that ended"):
        _release_ended_bindings(node, [str(j) for j in resp.get("release") or []])
    targets = resp.get("desired") or {}
    # A GPU this report shows blocked (a MIG mode change waiting for a reset, an instance of a profile we do not
    # know, a driver whose MIG profiles differ from our table) is left as it is, whoever asks: the layouts
    # cached while the controller is down were made before the block (a node rebooted onto a new driver
    # re-created them there), and a controller older than the block does not know to leave it out.
    blocked = blocked_gpus(report["observed"])
    left = sorted({str(k) for k in targets} & set(blocked), key=lambda g: (len(g), g))
    if left:
        log.warning("health check: GPU(s) %s not moved to their layouts: %s", ", ".join(left),
                    "; ".join(f"GPU {g}: {blocked[g]}" for g in left))
        targets = {k: v for k, v in targets.items() if str(k) not in blocked}
    if targets:
        results = []
        with _unless_lock_busy(f"moving GPU(s) {', '.join(sorted(str(k) for k in targets))} to their layouts"):
            results = node.apply_targets(targets)
        changed = [r for r in results if r.get("plan") or r.get("error")]
        if changed:
            observed_at = time.time()
            node.send_or_queue("/v1/applied", {"node": node.name, "results": changed, "observed": node.observe(),
                                               "observed_at": observed_at, "time": time.time()})
    return 0


@contextlib.contextmanager
def _unless_lock_busy(what: str):
    """Run a health check's step under the layout lock, or leave it to the next round when the lock stays
    held past the health check's wait (the report itself needs no lock)."""
    from slurm_mig.node.localstate import LayoutLockBusy

    try:
        yield
    except LayoutLockBusy as exc:
        log.warning("health check: %s left to the next round: %s", what, exc)


ORPHAN_AGE_S = 60.0


def _jobs_slurm_runs_here(node: Node) -> set[str] | None:
    """Ids of the jobs Slurm runs on this node (starting, running, ending or suspended); None when Slurm
    cannot be asked."""
    from slurm_mig.slurm.runner import SlurmClient

    res = SlurmClient(slurm_conf=node.settings.slurm_conf, timeout=10).run(
        ["squeue", "-h", "-w", node.name, "-t", "CF,R,CG,S,ST", "-o", "%A"])
    if not res.ok:
        log.warning("cannot ask Slurm which jobs run on %s: %s", node.name, res.describe())
        return None
    return set(res.stdout.split())


def _release_ended_bindings(node: Node, asked: list[str]) -> None:
    """Drop the bindings of jobs that ended without their Epilog: those the controller names, and files
    older than ORPHAN_AGE_S (a node crash or reboot, a Prolog killed after writing one, a controller that
    lost its database and cannot name them).

    Slurm has the last word, not the controller (whose view may be stale, or forged): a binding goes only
    if squeue answered and does not list its job here, and only once its instances are idle. Done under
    the apply lock, so no Prolog binds meanwhile; a binding written after squeue was asked is kept.
    """
    from slurm_mig.node.localstate import is_earlier_run

    times = node.state.binding_times()
    earlier = sorted(key for key in times if is_earlier_run(key))
    if earlier:
        # An earlier run's record set aside when its job id ran again here: that run has ended (Slurm started
        # the next one), so only its instances being idle keep it.
        with node.apply_lock():
            for key in earlier:
                _release_stale_binding(node, key, earlier_run=True)
    asked = {job for job in asked if job in times}
    old = {job for job, mtime in times.items()
           if time.time() - mtime > ORPHAN_AGE_S and job.replace("_", "").isascii() and job.replace("_", "").isdigit()}
    if not asked and not old:
        return
    asked_at = time.time()
    running = _jobs_slurm_runs_here(node)
    if running is None:
        log.warning("binding(s) of job(s) %s kept until Slurm can say whether they run here",
                    ", ".join(sorted(asked | old)))
        return
    with node.apply_lock():
        for job_id in sorted(asked | old):
            if job_id in running:
                if job_id in asked:
                    log.warning("the controller asked to release job %s, but Slurm runs it on %s; binding kept",
                                job_id, node.name)
                continue
            if node.state.binding_times().get(job_id, asked_at) >= asked_at:
                continue  # gone, or bound again after Slurm was asked: its answer says nothing about this one
            log.warning("job %s holds a binding on %s but Slurm does not run it here", job_id, node.name)
            _release_stale_binding(node, job_id)


def _release_stale_binding(node: Node, job_id: str, *, earlier_run: bool = False) -> None:
    """Drop the binding of a job Slurm no longer runs here, unless its instances are still in use
    (processes that outlived the job: the binding keeps them from being destroyed until they are gone).
    ``earlier_run``: ``job_id`` names an earlier run's record set aside (``<job>.earlier-<n>``): that run has
    ended (Slurm started the next one), so its own "job <job>" marks on the simulated GPU go as well, on the
    instances no other record names (the next run is never bound to one this record holds; it is kept out all
    the same). Its Epilog clears them, but one killed before that step, or that never ran (the node crashed), left
    them; skipped here, such a mark kept the instance busy and this record with it for good (crash benchmark,
    seed 1048: a Prolog killed after its mark, its attempt's Epilog killed before clearing it, the requeued run
    bound on the same node). Call with apply_lock() held."""
    try:
        insts = node.state.read_record(job_id) or []
    except ValueError:
        # Damaged: it names nothing we could check or protect. Its run's "job <job>" marks are found by their
        # owner, on the instances no other record names: kept, they held the instances busy for good.
        node.end_marks_no_other_record_names(job_id)
        insts = []
    else:
        if earlier_run:
            # By UUID and by slot (NodeState.named_by_others): a record may name an instance made again since
            # (another UUID) at the slot another record's run holds, "job <job>" too for a run of this id
            node.end_marks_no_other_record_names(job_id, insts)
        else:
            node.end_job_processes(job_id, insts)
    try:
        busy = [i for i in insts for x in node.backend.instances(i.gpu) if x.uuid == i.uuid and x.in_use]
    except Exception as exc:  # the GPU cannot be read (lost): keep the binding until it can
        log.warning("job %s ended but its GPU cannot be read (%s); binding kept", job_id, exc)
        return
    if busy:
        log.warning("job %s ended but %s still in use; binding kept until it is idle",
                    job_id, ", ".join(f"{i.profile}@{i.start} on GPU {i.gpu}" for i in busy))
        return
    node.state.remove_record(job_id)
    if earlier_run:
        log.info("released %s, the binding an earlier run left: its instances are idle", job_id)
    else:
        log.info("released the stale binding of job %s (it ended without its Epilog)", job_id)
