"""The Prolog (root, on the node, before every job): bind the job to the MIG instances the controller
names (making them if asked), or to free ones that already exist when the controller cannot be asked;
requeue the job (exit 0) when it cannot be bound here."""

from __future__ import annotations

import logging
import time

from slurm_mig.node.context import (HOOK_FLUSH_BUDGET_S, RECARVE_S_PER_GPU, _T0, Node, _int, blocked_gpus,
                                    closed_to_new_jobs)
from slurm_mig.node.layoutcache import remember_targets

log = logging.getLogger("slurm_mig.hooks")


def prolog(env: dict, node: Node) -> int:
    from slurm_mig.api.client import ControllerRefused, ControllerUnavailable
    from slurm_mig.node.localstate import LayoutLockBusy

    try:
        started = int(env["SLURM_MIG_T0_NS"]) / 1e9
    except (KeyError, ValueError):
        started = _T0
    job_id = env["SLURM_JOB_ID"]
    uid = int(env.get("SLURM_JOB_UID", "-1"))
    node.state.ensure()
    # Every wait for the layout lock below comes out of one bound ([node].layout_lock_wait_s), so a holder hung
    # inside NVML costs this job a requeue, not the node a drain at PrologEpilogTimeout.
    node.start_lock_budget()
    try:
        _keep_earlier_runs_binding(node, job_id, _int(env.get("SLURM_JOB_RESTART_COUNT")), uid)
    except LayoutLockBusy as exc:
        # The record an earlier run left cannot be set aside, so this run cannot be bound (nor shown no GPU)
        # without taking it over. The controller was not asked yet: it bound nothing for this run to release.
        return _requeue_lock_busy(node, job_id, exc, tell=False)
    node.state.note_attempt(job_id, _int(env.get("SLURM_JOB_RESTART_COUNT")))
    # A bounded share of the outbox (after a long controller outage it may hold hundreds of messages); the
    # health check and later hooks deliver the rest, in order.
    node.flush_outbox(HOOK_FLUSH_BUDGET_S)
    # An older message about this job still queued (its earlier run's Epilog or binding, left behind the
    # budget or by another hook's flush under way) must reach the controller before anything this Prolog
    # says about the job: it then decides as without the controller, and its own messages queue behind.
    behind = node.state.queued_about(job_id)
    observed_at = time.time()  # before looking: a re-carve made while we look has a later time
    try:
        observed = node.observe()
    except Exception:
        # NVML cannot be read (driver gone or reloading, no GPU at all): a job that asks for no MIG instance
        # needs none of it and runs; a MIG job (or one Slurm cannot describe) is requeued by main() (hooks.py).
        if _job_request(node, job_id) == {}:
            log.warning("job %s asks for no MIG instance; started although this node's GPUs cannot be read",
                        job_id, exc_info=True)
            return 0
        raise
    payload = {"job_id": job_id, "node": node.name, "observed": observed, "observed_at": observed_at,
               "bindings": node.bindings_json()}
    if behind:
        log.warning("job %s: an older message about it waits in the outbox and must reach the controller first; "
                    "trying instances that already exist, as without the controller", job_id)
        resp = _local_choice(node, job_id, payload["observed"],
                             "an older message about this job waits in the node's outbox")
    else:
        try:
            resp = node.client.call("/v1/prolog", payload)
        except ControllerRefused as exc:
            return node.requeue(job_id, f"the controller refused the job: {exc}")
        except ControllerUnavailable as exc:
            log.warning("controller unreachable for job %s: %s; trying instances that already exist", job_id, exc)
            resp = _local_choice(node, job_id, payload["observed"])
    action = resp.get("action")
    if action == "skip":
        return 0
    if action != "bind":
        if resp.get("requeued"):
            return 0
        return node.requeue(job_id, resp.get("reason", "no MIG instance could be made for this job"))
    gid = _job_gid(env, uid)
    # What the controller is told and why the job goes back when this Prolog cannot bind: said after the lock
    # is let go. Those are network and scontrol calls (up to ~30 s with a slow controller or slurmctld), and
    # every other Prolog on this node waits for the lock: held across them, a burst of failing Prologs ran
    # the last one past PrologEpilogTimeout, and Slurm drains a node whose Prolog it kills.
    failure: tuple[list[dict], str] | None = None
    try:
        with node.apply_lock():
            clash = node.held_by_others(job_id, resp["instances"])
            if clash:
                # Never two jobs on one instance, whatever the answer said (a bug, a forged or stale answer).
                log.error("job %s: the controller named %s, held here by job(s) %s", job_id, resp["instances"],
                          clash)
                failure = ([{"error": f"instances held by job(s) {clash}"}],
                           f"the instance chosen on {node.name} is held by another job")
            else:
                blocked = blocked_gpus(payload["observed"])
                failure, bound, results, message = _bind_here(node, env, job_id, resp, uid, gid, blocked,
                                                              closed_to_new_jobs(blocked, payload["observed"]))
    except LayoutLockBusy as exc:
        # Nothing was touched: the lock was never held. The controller releases the binding it made; one that
        # was not asked (a choice made here, as without it) made none.
        return _requeue_lock_busy(node, job_id, exc, tell=not resp.get("local"))
    if failure is not None:
        node.send_or_queue("/v1/bind-failed", {"job_id": job_id, "node": node.name, "results": failure[0]})
        return node.requeue(job_id, failure[1])
    node.send_or_queue("/v1/bound", message)
    # One line per bound job: `slurm-mig demo` and benchmarks/prolog_latency.py read these.
    log.info("prolog job %s bound %s in %.1f ms (reconfigured=%s)", job_id,
             ",".join(f"{b.profile}@{b.gpu}:{b.start}" for b in bound), (time.time() - started) * 1000,
             bool(results))
    return 0


def _requeue_lock_busy(node: Node, job_id: str, exc: Exception, *, tell: bool) -> int:
    """The Prolog could not take the node's layout lock within [node].layout_lock_wait_s (another hook holds
    it: hung inside NVML, or a long chain of re-carves): with ``tell`` (the controller answered this Prolog
    with a binding), tell the controller, which releases that binding, and requeue the job with the reason,
    exit 0. Waiting on, Slurm would kill this Prolog at PrologEpilogTimeout and drain the node.

    Not ``tell`` (the controller was not asked: the wait ran out at the first look, or the choice was made
    here as without it): nothing is sent. The controller bound nothing for this run (a /v1/bind-failed of a
    Prolog whose journal entries it did not know used to close every re-carve in progress on the node as
    failed, which here are the lock holder's own, carried out at that moment)."""
    log.error("job %s: %s; the job is requeued", job_id, exc)
    if tell:
        node.send_or_queue("/v1/bind-failed", {"job_id": job_id, "node": node.name,
                                               "results": [{"error": f"layout lock busy: {exc}"}]})
    if getattr(node, "lock_wait_cut", False):
        # The Prolog's time limit, not layout_lock_wait_s, ended the wait (a slow controller took the rest).
        return node.requeue(job_id, f"{node.name} was busy changing its MIG layout (the node's layout lock stayed "
                                    f"held) past what this Prolog's time limit ([node].hook_time_limit_s) left")
    wait = node.settings.lock_wait_s
    return node.requeue(job_id, f"{node.name} was busy changing its MIG layout for over "
                                f"{wait if wait is not None else 0:g} s (the node's layout lock stayed held)")


def _bind_here(node: Node, env: dict, job_id: str, resp: dict, uid: int, gid: int | None,
               blocked: dict[str, str] | None = None, closed: dict[str, str] | None = None):
    """The Prolog's part under the layout lock: make the instances the answer names (if it asks), and write
    the binding. Returns (failure, bound, results, message): failure is (results for /v1/bind-failed, the
    requeue's reason) when the job cannot be bound here, for the caller to say once the lock is let go.
    ``blocked``: the GPUs this Prolog's report showed blocked (blocked_gpus); an answer that would carve on
    one is refused. ``closed``: those of them no job may start on (closed_to_new_jobs); an answer that names
    an instance on one is refused too."""
    from slurm_mig.node.localstate import BoundInstance

    # A named instance without its compute instance is made whole here rather than bound useless.
    remake = resp.get("targets") or node.half_made_among(resp["instances"])
    carving = {str(k) for k in resp.get("targets") or {}}
    if remake:
        carving |= {str(i["gpu"]) for i in resp["instances"]}
    # Nor does a job start on an instance already there on a GPU closed to new jobs (the node's own choice
    # without the controller starts none there either).
    starting = {str(i["gpu"]) for i in resp["instances"]} & set(closed or {})
    refused = sorted((carving & set(blocked or {})) | starting, key=lambda g: (len(g), g))
    if refused:
        # The controller stores such a GPU as blocked and plans nothing there; one that does not know the block
        # (older than this node, in a rolling upgrade) would have it carved, the wrong size where the driver
        # differs from our table. Refused as a failed re-carve: the job goes back to the queue, nothing touched.
        blocked = {**(blocked or {}), **(closed or {})}
        why = "; ".join(f"GPU {g}: {blocked[g]}" for g in refused)
        verb = "carve on" if carving & set(refused) else "start the job on"
        log.error("job %s: the controller asked to %s GPU(s) %s of %s, which this node reports as blocked "
                  "(%s); nothing was changed", job_id, verb, ", ".join(refused), node.name, why)
        return (([{"gpu": int(g), "ok": False,
                   "error": f"not {'carved' if g in carving else 'started'}: GPU {g} is blocked on {node.name}: "
                            f"{blocked[g]}"} for g in refused],
                 f"the controller asked to {verb} {node.name}'s GPU(s) blocked there ({why})"), [], [], None)
    if remake:
        # NVML cannot be interrupted: a re-carve is started only when it fits in what the Prolog's time limit
        # leaves before its fallback's reserve, at RECARVE_S_PER_GPU a GPU (a whole re-carve each).
        # (make_instances changes only the GPUs of the job's instances; the rest of the targets is the health
        # check's.)
        gpus = {str(i["gpu"]) for i in resp["instances"]}
        left, need = node.time_left(), RECARVE_S_PER_GPU * len(gpus)
        if left is not None and left < need:
            log.error("job %s: %.1f s of this Prolog's time limit left, under the %.0f s a re-carve of GPU(s) %s "
                      "may take; nothing was changed", job_id, max(0.0, left), need,
                      ", ".join(sorted(gpus, key=lambda g: (len(g), g))))
            return (([{"error": f"no time left to re-carve ({max(0.0, left):.1f} s of the Prolog's time limit, "
                                f"{need:.0f} s needed)"}],
                     f"{node.name}'s Prolog had no time left to make the job's MIG instance(s) within its time "
                     f"limit ([node].hook_time_limit_s)"), [], [], None)
    results = node.make_instances(resp["instances"]) if remake else []
    failed = [r for r in results if not r.get("ok", False) or r.get("reached") is False]
    if failed:
        reason = "; ".join(str(r.get("error") or f"GPU {r['gpu']} shows {r.get('after')}") for r in failed)
        return (results, f"reconfiguration failed on {node.name}: {reason}"), [], results, None
    bound = []
    for inst in resp["instances"]:
        uuid = node.uuid_of(int(inst["gpu"]), inst["profile"], int(inst["start"]))
        if uuid is None:
            return (([{"error": f"instance {inst} missing"}],
                     f"MIG instance {inst['profile']}@{inst['start']} missing on {node.name}"), [], results, None)
        bound.append(BoundInstance(int(inst["gpu"]), inst["profile"], int(inst["start"]), uuid))
    _end_marks_of_a_replaced_binding(node, job_id, bound)
    # Written before the lock is released: from here on every layout change on this node sees them busy.
    node.state.write_binding(job_id, bound, uid if uid >= 0 else None, gid,
                             attempt=_int(env.get("SLURM_JOB_RESTART_COUNT")))
    for b in bound:
        node.mark_in_use(b.gpu, b.profile, b.start, f"job {job_id}")
    message = {"job_id": job_id, "node": node.name, "instances": [b.to_json() for b in bound],
               "bound_at": time.time(), "local": bool(resp.get("local"))}
    if results:
        # The controller's layouts for the GPUs this Prolog re-carved are the newest it gave this node.
        remember_targets(node, resp.get("targets") or {})
        # The layout this Prolog made, seen under the lock, so the controller plans from it at once.
        message["observed_at"] = time.time()
        message["observed"] = node.observe()
    return None, bound, results, message


def _end_marks_of_a_replaced_binding(node: Node, job_id: str, bound: list) -> None:
    """This run's record already here (its Prolog run again: _keep_earlier_runs_binding leaves it) naming an
    instance the binding about to be written does not: the simulated GPU's "job <id>" mark the first Prolog set
    there goes, on an instance no other record names (by UUID or by slot: NodeState.named_by_others). Written
    over, the record no longer names it, so neither the Epilog nor the health check would ever clear that mark,
    and the instance stayed busy for good. No task of the run can be on it: tasks start after the Prolog that
    binds them. A damaged record names nothing we can read: the instances marked "job <id>" stand for it.
    Call with apply_lock() held."""
    try:
        before = node.state.read_binding(job_id) or []
    except ValueError:
        before = node.marked_by(f"job {job_id}")
    dropped = [i for i in before if i.uuid not in {b.uuid for b in bound}]
    if not dropped:  # no record (a run's first Prolog, almost always), or one of the same instances
        return
    dropped = node.end_marks_no_other_record_names(job_id, dropped)
    if dropped:
        log.warning("job %s: its Prolog ran again and binds %s, no longer %s, which its first binding named", job_id,
                    ",".join(f"{b.profile}@{b.gpu}:{b.start}" for b in bound),
                    ",".join(f"{i.profile}@{i.gpu}:{i.start}" for i in dropped))


def _keep_earlier_runs_binding(node: Node, job_id: str, restarts: int | None, uid: int | None = None) -> None:
    """The Prolog's first look: a binding record of ``job_id`` that an earlier run left (its processes outlived
    it, so its Epilog kept the record; or that Epilog was killed before removing it) is set aside under a name
    of its own (NodeState.set_aside_earlier_run) before this run binds. Written over, it lost the only word
    that the instance is still held, and as the job's own it hid that instance from the check for instances
    other jobs hold. A record is an earlier run's when an Epilog ran after the Prolog that wrote it (it took
    the attempt that Prolog noted), when it was made at a lower restart count (a requeue), or for another user
    (``uid``, SLURM_JOB_UID, against the uid the record keeps: a job id slurmctld gave again after it lost its
    state, while the earlier job's Epilog never ran here, node crashed or Epilog killed; a requeue never changes
    the user). A record of this very run (a Prolog run again) is left as it is; so is one of the same user at the
    same restart count, which only the controller can tell apart, and one written before records kept the uid.
    Until 2026-11-27 the uid was not kept, and such a record of another user's job was taken for this run's: a
    job that asks for no MIG instance then ran with the earlier job's TaskProlog copy, its instances shown to
    the new job's tasks where its user could read the copy (the same group)."""
    if not node.state.has_record(job_id):
        # Nothing to set aside (a job's first run here, almost always): no lock to wait for. The lock is what
        # a health check's re-carve and other Prologs' NVML steps hold, and a job that binds nothing (no MIG,
        # or requeued) never waited on it. A record written meanwhile is a Prolog's of this very run.
        return
    if node.state.attempt_noted(job_id):
        made_at, owner = node.state.binding_attempt(job_id), node.state.binding_uid(job_id)
        another_user = owner is not None and uid is not None and uid >= 0 and owner != uid
        if not another_user and (made_at is None or restarts is None or restarts <= made_at):
            return
    with node.apply_lock():
        key = node.state.set_aside_earlier_run(job_id)
    if key is not None:
        log.warning("job %s: the binding an earlier run of it left here (its processes outlived it) is kept as %s "
                    "until its instances are idle; this run is not bound to them", job_id, key)


def _local_choice(node: Node, job_id: str, observed: list[dict], why: str | None = None) -> dict:
    """Without the controller: bind instances that already exist and are free, every size the job asks
    for with its count, or requeue it (never start it with part of its request). ``why`` the controller
    is not asked (the requeue's reason): unreachable unless said."""
    why = why or "controller unreachable"
    req = _job_request(node, job_id)
    if req is None:
        return {"action": "requeue", "reason": f"{why} and the job's MIG request unreadable"}
    if not req:
        return {"action": "skip"}
    from slurm_mig.mig.profiles import get_model

    held = node.state.bound_slots()
    # A GPU whose MIG mode changes at its next reset, or whose driver's MIG profiles differ from our table:
    # no new job starts there (as the controller would decide).
    closed = closed_to_new_jobs(blocked_gpus(observed), observed)
    chosen, short = [], []
    for kind, count in req.items():
        found = []
        for g in observed:
            if str(g.get("index")) in closed:
                continue
            try:
                name = get_model(g["model"]).profile(kind).name
            except Exception:  # no model, or one without this size
                continue
            for i in g["instances"]:
                if len(found) < count and i["profile"] == name and not i["in_use"] and i["uuid"] \
                        and (i["profile"], i["start"]) not in held.get(g["index"], set()):
                    found.append({"gpu": g["index"], "profile": i["profile"], "start": i["start"]})
        chosen += found
        if len(found) < count:
            short.append(f"{count} x {kind}")
    if short:
        return {"action": "requeue",
                "reason": f"{why} and no free {', '.join(short)} instance exists on {node.name}"}
    return {"action": "bind", "instances": chosen, "targets": {}, "local": True}


def _job_gid(env: dict, uid: int) -> int | None:
    """The job owner's group, which may read the TaskProlog's copy of the binding: Slurm's SLURM_JOB_GID
    (set by slurmd, not the user), else the user's primary group; None when neither is known."""
    gid = _int(env.get("SLURM_JOB_GID"))
    if gid is not None and gid >= 0:
        return gid
    if uid < 0:
        return None
    import pwd

    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return None


def _job_request(node: Node, job_id: str) -> dict[str, int] | None:
    """The job's per-node MIG request from Slurm itself, every type with its count ({"1g": 1, "3g": 1};
    empty for a job without one), for when the controller cannot be asked; None if Slurm cannot say."""
    from slurm_mig.slurm.runner import SlurmClient

    timeout = node.slurm_timeout() if hasattr(node, "slurm_timeout") else 10
    detail = SlurmClient(slurm_conf=node.settings.slurm_conf, timeout=timeout).job_detail(job_id)
    if detail is None:
        return None
    from slurm_mig.slurm.gres import GRES_TO_KIND

    return {GRES_TO_KIND.get(gtype, gtype): int(count) for gtype, count in sorted(detail.mig.items()) if count > 0}
