"""The controller's node API: the handlers of the node hooks' messages (/v1/prolog, /v1/bound,
/v1/bind-failed, /v1/epilog, /v1/report, /v1/applied), a part of the Controller class (NodeApi is one of
its bases), and the once-only handling of a message delivered again (NodeMessage)."""

from __future__ import annotations

import logging
import threading
import time

from slurm_mig.api.auth import NODE_NAME
from slurm_mig.controller.binding import GpuRow, NodeGpu, choose_binding_held, held_regions, node_gpus
from slurm_mig.controller.payloads import (
    rejected, v_binding_times, v_bindings, v_bool, v_instances, v_message, v_observed, v_opt_int, v_results, v_time,
)
from slurm_mig.controller.runs import (
    FORGOTTEN, JOB_ID, NOT_IN_QUEUE, TERMINAL, another_job, array_task_of, known_user, live_request,
    mig_size_request, uid_of, uncounted_key, users_differ, was_requeued,
)
from slurm_mig.errors import GeometryError, SlurmMigError, SlurmUnavailable
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.profiles import get_model
from slurm_mig.mig.transitions import plan_transition
from slurm_mig.slurm.parsers import format_exit_status, local_epoch
from slurm_mig.store.models import LOST_REASON, known_model, off_table, readable_model, unknown_model_reason

log = logging.getLogger("slurm_mig.controller")


class NodeApi:
    """The Controller's handlers of node messages (see slurm_mig.controller.service.Controller for its state)."""

    def _entries_of(self, node: str, job_id: str, gpus: set[int]) -> list:
        """The open journal entries job ``job_id``'s Prolog took up on ``node``.

        Known from its /v1/prolog; after a controller restart, the in-progress ones on the GPUs the
        message names. A message naming no GPU (a Prolog's local failure: its instance missing, or held by
        another job) gets those on the GPUs whose desired layout this job's Prolog set (policy "bind", its
        reason "job <id>: ...") and that lead to it; none when there are none (a Prolog that chose an
        existing instance itself took none up). It used to get every entry in progress on the node: the
        health check's and other Prologs' re-carves, under way at that moment, were closed as failed.
        """
        ids = self._prolog_entries.pop((node, job_id), None)
        open_entries = [e for e in self.store.open_journal_entries(node) if e.state == "in_progress"]
        if ids is not None:
            return [e for e in open_entries if e.id in ids]
        if gpus:
            return [e for e in open_entries if e.gpu in gpus]
        desired, mine = self.store.desired(node), f"job {job_id}: "
        return [e for e in open_entries if (d := desired.get(e.gpu)) is not None and d.policy == "bind"
                and d.reason.startswith(mine) and d.spec == e.to_layout]

    def _message(self, node: str, route: str, message_id: str | None, now: float) -> "NodeMessage":
        """A node message (``v_message``), handled once: create it inside the handler's transaction."""
        return NodeMessage(self.store, node, route, message_id, now)

    def _clock_margin(self) -> float:
        """How far apart two clocks may be whose times the controller compares: a node's and its own, or
        two nodes'. Each request's timestamp must be within [auth].max_clock_skew_s of the controller's
        clock (MUNGE's credential lifetime, never under 10 s, with munge auth), so any node's clock is
        that close to the controller's and two nodes' clocks twice that; Slurm's times (a start time
        from squeue) are slurmctld's clock, taken to be kept as close (the same NTP)."""
        return 2 * max(10.0, float(self.cfg.auth.max_clock_skew_s))

    def _finish_reconfig(self, entry_id: int, state: str, **kw):
        """journal_finish(), and the reconfiguration's duration (start -> finish) into
        slurm_mig_reconfiguration_seconds (done and failed ones; abandoned ones never ran)."""
        e = self.store.journal_finish(entry_id, state, **kw)
        start = e.started_at or e.created_at
        if e.finished_at is not None and start is not None:
            self.metrics.observe("slurm_mig_reconfiguration_seconds", max(0.0, e.finished_at - start),
                                 (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300))
        return e

    # ------------------------------------------------------------------ API
    def routes(self) -> dict:
        return {"/v1/prolog": self.on_prolog, "/v1/bound": self.on_bound, "/v1/bind-failed": self.on_bind_failed,
                "/v1/epilog": self.on_epilog, "/v1/report": self.on_report, "/v1/applied": self.on_applied}

    def get_routes(self) -> dict:
        from slurm_mig.api import HEALTHZ_BODY

        return {"/healthz": lambda: ("text/plain", HEALTHZ_BODY),
                "/metrics": lambda: ("text/plain; version=0.0.4", self.metrics.render())}

    def _check_node(self, payload: dict, principal) -> str:
        from slurm_mig.api.server import RequestRejected

        node = payload.get("node")
        if not isinstance(node, str) or not NODE_NAME.fullmatch(node):
            raise RequestRejected(f"bad node name {node!r}")
        scheme = getattr(principal, "scheme", "")
        if scheme == "hmac" and principal.host != node:
            # The credential names the node whose key signed it: with a key per node that is who sent it.
            from slurm_mig.api.server import RequestForbidden

            self.metrics.inc("slurm_mig_node_origin_mismatches_total", (("node", node),))
            raise RequestForbidden(f"a request signed for node {principal.host} cannot speak for node {node}")
        if self.origin_mode != "off" and scheme == "munge":
            self._check_origin(node, principal.host, self.origin_mode)
        return node

    def _check_origin(self, node: str, encode_host: str, mode: str) -> None:
        """A request for ``node`` encoded on another host: counted and logged ("warn"), or refused with
        403 ("enforce"). One line per node per 10 minutes, however many requests."""
        from slurm_mig.api.server import RequestForbidden

        verdict = self.origins.check(node, encode_host)
        result = "unchecked" if not verdict.checked else "match" if verdict.ok else "mismatch"
        self.metrics.inc("slurm_mig_node_origin_checks_total", (("result", result),))
        if result == "match":
            return
        now = self.clock()
        say = now - self._origin_said.get(node, float("-inf")) >= 600.0
        if not verdict.checked:
            if say and not verdict.quiet:
                self._origin_said[node] = now
                log.info("cannot check where requests for node %s come from: %s", node, verdict.why)
            return
        self.metrics.inc("slurm_mig_node_origin_mismatches_total", (("node", node),))
        if say:
            self._origin_said[node] = now
            log.warning("request for node %s from another host: %s (%s)", node, verdict.why,
                        "refused: [auth] node_origin = \"enforce\"" if mode == "enforce" else
                        "served: [auth] node_origin = \"warn\"; see docs/security.md §7")
        if mode == "enforce":
            raise RequestForbidden(f"requests for node {node} must come from its own host: {verdict.why}")

    def _check_job(self, payload: dict) -> str:
        from slurm_mig.api.server import RequestRejected

        job_id = str(payload.get("job_id", ""))
        if not JOB_ID.fullmatch(job_id):
            raise RequestRejected(f"bad job id {job_id!r}")
        return job_id

    def _store_observed(self, node: str, observed, observed_at: float | None = None,
                        node_bindings: dict | None = None) -> None:
        """Store a node's GPU report, unless the node had already sent one it observed later.

        Instances the node still holds a binding for (``node_bindings``: a job that ended while its
        binding waits for Slurm to let it go) are stored as in use: the node will not re-carve them, so
        planning through them only fails, tick after tick."""
        if not isinstance(observed, list):
            return
        if observed_at is not None:
            if observed_at < self._observed_at.get(node, float("-inf")):
                return
            self._observed_at[node] = observed_at
        held = {(int(b["gpu"]), int(b["start"])) for insts in (node_bindings or {}).values() for b in insts}
        gpus, insts = [], []
        for g in observed:
            self._say_unknown_model(node, g)
            gpus.append({"gpu": g["index"], "uuid": g.get("uuid"), "model": g.get("model"),
                         "mig_enabled": bool(g.get("mig_enabled")) and not g.get("lost"), "name": g.get("name"),
                         "mig_pending": None if g.get("lost") else g.get("mig_pending"),
                         "foreign": [] if g.get("lost") else g.get("foreign") or [],
                         "table_errors": [] if g.get("lost") else g.get("table_errors") or [],
                         # blocked, so that every reader (the report's answer, the Prologs, the operator tools)
                         # leaves it alone and says why: not "MIG off", which sent admins after the MIG mode
                         "blocked": LOST_REASON if g.get("lost") else None})
            for i in g.get("instances", []):
                insts.append({"gpu": g["index"], "profile": i["profile"], "start": i["start"], "uuid": i.get("uuid"),
                              "in_use": bool(i.get("in_use")) or (g["index"], i["start"]) in held})
        # The node's Slurm state (drained, down) is the tick's to set from sinfo: a report from a drained node
        # (its health check still runs) must not make it "up" for the policy and the Prologs until the next tick,
        # or for as long as sinfo fails. A node no tick has seen yet is taken as up, as before.
        known = self.store.node(node)
        self.store.replace_observed(node, gpus, insts, now=self.clock(),
                                    state="up" if known is None or known.state == "unknown" else None)
        self._forget_plans_of_lost(node, [g["index"] for g in observed if g.get("lost")])

    def _forget_plans_of_lost(self, node: str, lost: list[int]) -> None:
        """Drop the desired layouts of ``node``'s lost GPUs and abandon their open reconfigurations. Kept, the
        desired layout went out in every report's answer and, once a reset brought the GPU back (its instances
        gone with the reset), the node carried out a re-carve planned for the queue of before the loss; the
        policy decides the GPU afresh once it is back. Its jobs' bindings are left as they are."""
        if not lost:
            return
        now = self.clock()
        desired = self.store.desired(node)
        for gi in lost:
            if gi in desired:
                self.store.clear_desired(node, gi)
        for e in self.store.open_journal_entries(node):
            if e.gpu in lost:
                self.store.journal_finish(e.id, "abandoned", error="the GPU was lost (NVML GPU_IS_LOST)", now=now)
                self.store.add_event("journal", f"reconfiguration {e.id} of {e.node}/{e.gpu} abandoned: the GPU "
                                     "was lost", node=node, now=now)

    def _say_unknown_model(self, node: str, g: dict) -> None:
        """Warn (log and a ``model`` event) that ``node`` reports a GPU whose model this controller cannot look
        up, or instances its table for a known model does not allow (a profile it lacks, a placement), once
        per node and model (and those profiles) an hour (LogLimiter), not once per report: health checks,
        Prologs and results all carry the report."""
        insts = g.get("instances") or []
        why = unknown_model_reason(g.get("model"), insts)
        if why is None:
            return
        model = known_model(g.get("model"))
        # per node and model; for a known model, per node, model and the profiles its table does not allow
        profiles = off_table(model, insts)[0] if model is not None else ()
        held = self._unknown_models.say("\0".join((node, str(g.get("model")), *profiles)), self.clock())
        if held is None:
            return
        fix = (f"upgrade the controller to a slurm-mig whose {model.name} table allows these instances"
               if model is not None else
               f"upgrade the controller to a slurm-mig whose tables list {g['model']!r}" if g.get("model") else
               "upgrade the node (and the controller) to a slurm-mig whose tables list this GPU")
        message = (f"{node} GPU {g['index']} ({g.get('name') or '?'}): {why}. It is kept out of the policy's view, "
                   f"no GRES is advertised for its slices and no job is bound there by the controller; its "
                   f"instances stay. To manage it, {fix} (docs/admin-guide.md, Upgrading)"
                   + (f" [{held} more reports since]" if held else ""))
        log.warning("%s", message)
        self.store.add_event("model", message, node=node, now=self.clock())

    #: Slurm queries about one job (SlurmClient.job_detail) node requests make at once. Each Prolog of a job no tick has seen asks
    #: one from its own request thread: a burst of job starts (or one node sending many) would fork as many
    #: on the head node. Below runner.MAX_CONCURRENT, so the tick's own Slurm commands always find a slot.
    DETAIL_CONCURRENCY = 8

    #: How long a Prolog for a job the store knows waits for Slurm's record of it, a free query slot and the
    #: answer together, before it goes by the store's record of the request; at most 2/5 of [node].
    #: request_timeout_s, so the node has its answer before it gives up on the controller. (A job it does not
    #: know waits up to 10 s for a slot, then for squeue: it has nothing else.)
    KNOWN_DETAIL_WAIT_S = 2.0

    def _slurm_detail(self, job_id: str, *, known_too: bool = False):
        """Slurm's record (SlurmClient.job_detail) of a job the store does not know yet (None if it does, unless
        ``known_too``, or if Slurm cannot be asked, within 10 s, for a free one of DETAIL_CONCURRENCY slots).
        Asked before the store's transaction: squeue may take up to its timeout, and other nodes' requests
        wait on the lock. For a job the store knows, None too when Slurm has not answered within
        KNOWN_DETAIL_WAIT_S (:meth:`_known_detail`)."""
        known = self._known_request(job_id)
        if known and not known_too:
            return None
        if known:
            return self._known_detail(job_id)
        if not self._detail_slots.acquire(timeout=10.0):
            log.warning("job %s: %d Slurm job queries already running for node requests; not asked",
                        job_id, self.DETAIL_CONCURRENCY)
            return None
        try:
            return self.slurm.job_detail(job_id)
        finally:
            self._detail_slots.release()

    def _known_detail(self, job_id: str):
        """Slurm's record of ``job_id``, whose request the store knows, or None when it is not had within
        KNOWN_DETAIL_WAIT_S (and 2/5 of [node].request_timeout_s): the Prolog then binds the stored request.
        squeue runs in a thread of its own that keeps its query slot until squeue ends (within [slurm].
        command_timeout_s); waited for without a bound, a slurmctld that was down (squeue gives up after
        some 18 s) or swamped made every Prolog outlast the node's request timeout: the node took its
        controller-down path while the controller bound the job anyway, from the store, later."""
        deadline = time.monotonic() + min(self.KNOWN_DETAIL_WAIT_S, 0.4 * self.cfg.node.request_timeout_s)
        if not self._detail_slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            log.warning("job %s: %d Slurm job queries already running for node requests; not asked, its stored "
                        "request is bound", job_id, self.DETAIL_CONCURRENCY)
            return None
        answer: list = []
        done = threading.Event()

        def ask() -> None:
            try:
                answer.append(self.slurm.job_detail(job_id))
            except Exception:  # a query answers None when Slurm cannot say; anything else is logged here
                log.exception("job %s: asking Slurm for its record failed", job_id)
            finally:
                self._detail_slots.release()
                done.set()

        threading.Thread(target=ask, name=f"squeue-{job_id}", daemon=True).start()
        if not done.wait(max(0.0, deadline - time.monotonic())):
            log.warning("job %s: Slurm did not describe it within %.1f s; its stored request is bound", job_id,
                        min(self.KNOWN_DETAIL_WAIT_S, 0.4 * self.cfg.node.request_timeout_s))
            return None
        return answer[0] if answer else None

    def _known_request(self, job_id: str) -> bool:
        """Does the store know what ``job_id`` asks for (a MIG request a tick or a Prolog recorded)?"""
        return live_request(self.store.get_job(job_id))

    def _request_of(self, detail) -> tuple[str, int] | None:
        """(kind, count) a Slurm job record (:meth:`_slurm_detail`) asks for; None when it is no job of
        ours (none, no MIG request, a partition not managed). ValueError for one that cannot be served."""
        if detail is None or not detail.mig or not self._manages(detail.partition):
            return None
        return mig_size_request(detail.mig)

    def _job_request(self, job_id: str, detail):
        """(kind, count) from ``detail`` (:meth:`_slurm_detail`) where Slurm answered, else from the store;
        None for a job without a MIG request. ValueError for one that cannot be served.

        Slurm's record wins over the store's: a pending job's request may be changed (``scontrol update
        JobId=N Gres=...``) after the tick that stored it, and Slurm, which may start it before the next tick,
        allocates the new one; bound from the store, a job lowered from mig:1g:7 to mig:1g:1 got seven slices
        where Slurm counts one. Slurm's user too: where it differs from the stored run's, the row is Slurm's job's
        (another job with the id, which on_prolog has just made the next run): kept from the store because it
        asked for the same size, that run went on as the old run's user (and job name) until the next tick, and an
        Epilog before it recorded it so."""
        job = self.store.get_job(job_id)
        live = live_request(job)
        if live and detail is None:
            return job.profile, job.count
        req = self._request_of(detail)
        if live:
            if req == (job.profile, job.count):
                if known_user(detail.user) and detail.user != job.user:
                    # The same request, another user: the row is Slurm's job's (its name unknown: squeue -j does not
                    # print it, and the stored one is the other job's).
                    self.store.upsert_job(job_id, profile=req[0], count=req[1], user=detail.user,
                                          name=detail.name, partition=detail.partition, now=self.clock())
                return req
            was = f"{job.count} x {job.profile}"
            now = self.clock()
            if req is None:
                # Slurm allocated it no MIG instance (of ours): nothing to bind, nor to wait for.
                self.store.forget_pending_job(job_id)
                self.store.add_event("request", f"job {job_id}: asked for {was} when the tick saw it; Slurm's "
                                     f"record now asks for no MIG instance", job_id=job_id, now=now)
                return None
            self.store.add_event("request", f"job {job_id}: asked for {was} when the tick saw it; bound as "
                                 f"Slurm allocated it, {req[1]} x {req[0]} (its request was updated)",
                                 job_id=job_id, now=now)
        if req is not None:
            self.store.upsert_job(job_id, profile=req[0], count=req[1], user=detail.user,
                                  name=detail.name, partition=detail.partition, now=self.clock())
        return req

    def _manages(self, partition: str) -> bool:
        """Is a job in ``partition`` slurm-mig's ([slurm].partitions; empty: every partition)? A pending job
        submitted to several partitions ("gpu,debug") is when any of them is."""
        wanted = self.cfg.slurm.partitions
        return not wanted or any(p.strip() in wanted for p in (partition or "").split(","))

    def _note_unservable(self, job_id: str, why: str, now: float) -> None:
        """Log and record, once per job, a MIG request slurm-mig leaves alone."""
        if job_id in self._unservable:
            return
        if len(self._unservable) > 10_000:
            self._unservable.clear()
        self._unservable.add(job_id)
        log.warning("job %s %s: slurm-mig does not manage it (job_submit.lua refuses such requests)", job_id, why)
        self.store.add_event("conflict", f"job {job_id} {why}; not managed", job_id=job_id, now=now)

    def _hold_unservable(self, job_id: str, why: str, now: float) -> dict:
        """A job that cannot be served reached its Prolog: requeued and held, with the reason in its
        AdminComment, so that it neither runs without its instances nor starts again and again."""
        with self.store.transaction():
            self._note_unservable(job_id, why, now)
        reason = f"{why}; held (resubmit it with one size)"
        self.metrics.inc("slurm_mig_requeues_total", (("reason", "unservable"),))
        return {"action": "requeue", "reason": reason, "requeued": self._requeue_saying(job_id, reason, hold=True)}

    def on_prolog(self, payload: dict, principal) -> dict:
        node = self._check_node(payload, principal)
        job_id = self._check_job(payload)
        observed, node_bindings = v_observed(payload.get("observed")), v_bindings(payload.get("bindings"))
        observed_at = v_time(payload.get("observed_at"), "observed_at")
        now = self.clock()
        requeue_reason = None
        # Asked even for a job the store knows: its request may have been updated since the tick (_job_request).
        detail = self._slurm_detail(job_id, known_too=True)
        if detail is None and not self._known_request(job_id):
            # Neither the store nor Slurm can say what the job asks for: answering "skip" would start a MIG
            # job with no instance. 503: the node asks Slurm itself (bind an existing instance, or requeue).
            raise SlurmUnavailable(f"job {job_id}: not seen by a tick yet, and Slurm's record of it (squeue -j) could not be read")
        try:
            self._request_of(detail)  # said here, outside the transaction: holding it runs scontrol
        except ValueError as exc:
            return self._hold_unservable(job_id, str(exc), now)
        elsewhere = self.store.bound_nodes(job_id) - {node}
        if elsewhere:
            # Bound on another node: the job was requeued and started here before a tick saw it, or this
            # node speaks beyond itself. Only Slurm can tell; its bindings there are not released unasked.
            where = detail or self.slurm.job_detail(job_id)
            if where is None or node not in where.nodes:
                from slurm_mig.api.server import RequestRejected

                raise RequestRejected(f"job {job_id} is bound on {', '.join(sorted(elsewhere))}, and Slurm "
                                      f"{'cannot be asked' if where is None else 'does not run it on ' + node}")
        carried = None  # the journal entries this Prolog's re-carve carries, noted once they are committed
        # The uid of Slurm's user where its name is not the stored run's (renamed, or another user's job with the
        # id): squeue -j prints only the name, looked up here as squeue did, outside the transaction.
        stored = self.store.get_job(job_id)
        listed_uid = uid_of(detail.user) if detail is not None and stored is not None \
            and users_differ(stored.user, detail.user) else None
        with self.store.transaction():
            self._store_observed(node, observed, observed_at, node_bindings)
            ended = self.store.get_job(job_id)
            # Slurm's submit time of a job no tick has seen live, so submitted moments ago (or while the controller
            # was down): in the hour the clock goes back, the later of the two instants squeue's local time may
            # name that is not after now (mktime's guess counted an hour more or less of wait).
            submit_text = (getattr(detail, "fields", None) or {}).get("SubmitTime", "")
            submit_time = local_epoch(submit_text, not_after=now + self._clock_margin())
            if ended is not None and ended.state in TERMINAL and detail is not None and detail.state not in TERMINAL:
                # Starting again before a tick saw it live: binding it would fail. Its request is Slurm's now.
                again = self._request_of(detail)
                if again is None:
                    return {"action": "skip"}  # this run asks for no MIG instance (of ours)
                self._revive(job_id, now, submit_time=submit_time, requeued=was_requeued(detail))
                self.store.upsert_job(job_id, profile=again[0], count=again[1], user=detail.user,
                                      name=detail.name, partition=detail.partition, now=now)
            elif ended is not None and ended.state not in TERMINAL and detail is not None \
                    and detail.state not in TERMINAL \
                    and another_job(ended, local_epoch(submit_text, earliest=True), self._clock_margin(),
                                     user=detail.user, uid=listed_uid, requeued=was_requeued(detail)):
                # Slurm's job is another user's, or was submitted after the stored run started (waiting: after its
                # submission): not a retried Prolog of that run (whose instances it was handed, whatever it asked
                # for) but another job with the id, started before a tick saw it. A requeue gives the job a new
                # submit time too, but Slurm counts it (Restarts): a requeued job is that run's next attempt, as
                # in the tick. A waiting run is checked too (until 2026-11-27 only a running one was): bound as
                # that run, the other job kept its submission, and with the user rule the next tick took the
                # running job for another job with the id again, releasing its instances.
                # squeue prints local time without a zone: in the hour the clock goes back, the earlier instant
                # decides (the later one took a job submitted just before its start for another job, an hour on);
                # the run's submission is the reading above.
                self._another_job_with_id(ended, submit_time, now, users=(ended.user, detail.user))
            req = self._job_request(job_id, detail)
            if req is None:
                return {"action": "skip"}
            kind, count = req
            existing = self.store.bound_instances(job_id)
            job = self.store.get_job(job_id)
            if existing and job and job.node == node:
                # The Prolog ran again (slurmd retry): hand out the same instances.
                return {"action": "bind", "instances": [{"gpu": b.gpu, "profile": b.profile, "start": b.start}
                                                        for b in existing], "targets": {}}
            if existing:
                self.store.release(job_id, now=now)
            task = array_task_of(detail)
            if task is not None and task != job_id:
                # The tick saw this job as a task of an array record: the task's row gives way to the job.
                self.store.forget_pending_job(task)
                self._taken_tasks[task] = now
            gpus = self._node_gpus(node, node_bindings, exclude_job=job_id)
            reserved = self._reservation(job_id, node) or (self._reservation(task, node) if task else ())
            # Kept out of regions the policy holds for other waiting jobs, but for the instances it assigned this
            # job and those the decision counted as held by jobs Slurm had started before it (the regions were
            # drawn around those: binding.choose_binding's keep_off and started).
            keep_off, started, holders = self._keep_off(node, {job_id, task} - {None})
            plan, held_off = choose_binding_held(gpus, kind, count, reserved, keep_off, started) if gpus \
                else (None, False)
            if plan is None:
                requeue_reason = f"no {count} x {kind} MIG instance can be made on {node} now (slices in use)"
                if held_off:
                    requeue_reason = (f"no {count} x {kind} MIG instance on {node} now outside the slices held "
                                      f"for waiting job(s) {', '.join(holders)} (the policy's reservation)")
                self.store.set_job_state(job_id, "REQUEUED", now=now, reason=requeue_reason)
                self.store.add_event("requeue", f"job {job_id}: {requeue_reason}", node=node, job_id=job_id, now=now)
            else:
                entries = []
                for gi, target in plan.targets.items():
                    g = next(x for x in gpus if x.index == gi)
                    steps = plan_transition(g.observed, target, g.bound)
                    self.store.set_desired(node, gi, target, "bind", f"job {job_id}: {plan.reason}", now=now)
                    taken = None
                    for e in self.store.open_journal_entries(node):
                        if e.gpu != gi:
                            continue
                        if taken is None and e.to_layout == str(target) and e.from_layout == str(g.observed):
                            # The tick planned this very change: the Prolog carries it out (one entry, not
                            # an "abandoned" one plus a copy).
                            taken = e.id
                            self.store.journal_started(e.id, now=now)
                        else:
                            self.store.journal_finish(e.id, "abandoned", error=f"superseded by job {job_id}", now=now)
                    if taken is None:
                        taken = self.store.journal_begin(node, gi, g.observed, target, steps, started=True, now=now)
                    entries.append(taken)
                carried = entries
                try:
                    self.store.bind(job_id, node, plan.instances, now=now)
                except SlurmMigError as exc:  # BindingConflict: a safety net that must never fire
                    log.error("binding job %s on %s refused by the store: %s", job_id, node, exc)
                    raise
                self.store.set_job_state(job_id, "RUNNING", now=now, node=node, reason=plan.reason)
                self.store.add_event("bind", f"job {job_id} -> {node}: {plan.reason}", node=node, job_id=job_id,
                                     now=now)
        if carried is not None:
            # Only now: a rolled-back Prolog wrote no entries, and SQLite gives their ids to the next ones made.
            if len(self._prolog_entries) > 1000:  # Prologs killed before they reported: forget them
                still = {e.id for e in self.store.open_journal_entries()}
                self._prolog_entries = {k: v for k, v in self._prolog_entries.items() if still & set(v)}
            self._prolog_entries[(node, job_id)] = carried
        if requeue_reason is not None:
            self.metrics.inc("slurm_mig_requeues_total", (("reason", "no_instance"),))
            if held_off:
                self.lower_held_counts(node, now)
            try:
                self.slurm.scontrol_requeue(job_id)
                requeued = True
            except SlurmMigError as exc:
                log.warning("requeue of %s failed: %s", job_id, exc)
                requeued = False
            return {"action": "requeue", "reason": requeue_reason, "requeued": requeued}
        return {"action": "bind",
                "instances": [{"gpu": gi, "profile": s.profile, "start": s.start} for gi, s in plan.instances],
                "targets": {str(gi): str(t) for gi, t in plan.targets.items()}}

    def _node_gpus(self, node: str, node_bindings: dict, exclude_job: str) -> list[NodeGpu]:
        """The GPUs of ``node`` a Prolog of ``exclude_job`` may bind on (binding.node_gpus), from the store and
        the node's own binding files ``node_bindings``: they may know of jobs the store lost."""
        return node_gpus(self._gpu_rows(node), self._held(node, node_bindings, exclude_job))

    def _gpu_rows(self, node: str) -> list[GpuRow]:
        """``node``'s GPUs as the store holds them (binding.node_gpus' rows). The desired layout is read only
        of a GPU a Prolog may bind on: a blocked one keeps what it has."""
        desired = self.store.desired(node)
        insts: dict[int, list] = {}
        for i in self.store.observed_instances(node):
            insts.setdefault(i.gpu, []).append(i)
        rows = []
        for g in self.store.observed_gpus(node):
            mine = insts.get(g.gpu, [])
            # (as store.observed_layout reads it: None without a model, with one our tables do not list, or with
            # instances its table does not allow)
            model = readable_model(g.model, mine)
            obs = Layout(model, frozenset(Slot(i.start, i.profile) for i in mine)) if model is not None else None
            in_use = frozenset(Slot(i.start, i.profile) for i in mine if i.in_use)
            want = _desired_layout(desired.get(g.gpu)) if obs is not None and g.mig_enabled and not g.blocked \
                else None
            rows.append(GpuRow(g.gpu, obs, g.mig_enabled, bool(g.blocked), want, in_use))
        return rows

    def _held(self, node: str, node_bindings: dict, exclude_job: str) -> dict[int, set[Slot]]:
        """GPU -> the instances of ``node`` bound to jobs other than ``exclude_job``: live bindings in the store,
        and the node's binding files ``node_bindings``."""
        held: dict[int, set[Slot]] = {}
        for jid, _node, b in self.store.live_bindings(node):
            if str(jid) != exclude_job:
                held.setdefault(b.gpu, set()).add(Slot(b.start, b.profile))
        for jid, insts in node_bindings.items():
            if str(jid) != exclude_job:
                for i in insts:
                    held.setdefault(int(i["gpu"]), set()).add(Slot(int(i["start"]), str(i["profile"])))
        return held

    def _prolog_choice(self, job_id: str, node: str, profile: str, count: int, gpus: list[dict], *,
                       reservations: dict, held: dict | None = None) -> tuple[tuple[int, Slot], ...] | None:
        """The instances the Prolog of ``job_id``, which Slurm started on ``node`` and which is not bound yet,
        would bind now on ``gpus`` (Store.cluster_state's view of the node's GPUs): as on_prolog chooses, with
        the same builder (binding.node_gpus), its reservation in ``reservations`` and the regions held for other
        waiting jobs in ``held`` (the meta rows). None where only those regions keep it from an instance: its
        Prolog will requeue it, so it holds none (counted as holding one there, the region's count stayed up)."""
        rows = [GpuRow(g["index"], g["observed"], g["mig_enabled"], g["blocked"], g["desired"]) for g in gpus]
        choice = node_gpus(rows, {g["index"]: g["bound"] for g in gpus})
        if not choice:
            return ()
        keep_off, started, _holders = self._keep_off(node, {job_id}, held or {})
        plan, held_off = choose_binding_held(choice, profile, count, self._reservation(job_id, node, reservations),
                                             keep_off, started)
        return None if held_off else plan.instances if plan is not None else ()

    def _held_row(self) -> dict:
        """The meta row "held" (job id -> regions, as the last tick wrote it); empty with ``[controller]
        hold_reserved = false``, whatever a run with it on left there (the API is served before the first tick
        rewrites the row, and between its two transactions)."""
        row = self.store.get_meta("held") if self.cfg.controller.hold_reserved else None
        return row if isinstance(row, dict) else {}

    def _reservations_row(self) -> dict:
        """The meta row "reservations" (job id -> {"node", "instances": [[gpu, profile, start], ...]}, the last
        tick's assignments); empty where it is not a JSON object (a damaged row: read by the tick before it is
        written again, it must not fail every tick)."""
        row = self.store.get_meta("reservations")
        return row if isinstance(row, dict) else {}

    def _keep_off(self, node: str, jobs: set, held: dict | None = None
                  ) -> tuple[dict[int, int], dict[int, set[Slot]], list[str]]:
        """GPU index -> the memory slices of ``node`` the policy's last tick reserved for waiting jobs other than
        ``jobs`` (the meta row "held", or ``held`` when the caller read it); GPU index -> the instances there the
        decision counted as held by jobs Slurm had started whose Prologs had not bound them; and the waiting
        jobs. A Prolog of another job takes and carves nothing in those slices but those instances and what
        the decision assigned to it (its backfill)."""
        out: dict[int, int] = {}
        started: dict[int, set[Slot]] = {}
        holders = []
        for jid, gi, mask, promised in held_regions(self._held_row() if held is None else held, node):
            if jid in jobs:
                continue
            out[gi] = out.get(gi, 0) | mask
            started.setdefault(gi, set()).update(promised)
            if jid not in holders:
                holders.append(jid)
        return out, started, holders

    def _reservation(self, job_id: str, node: str, reservations: dict | None = None) -> tuple:
        """The policy's last-tick reservation for ``job_id`` on ``node`` (from ``reservations``, the meta row,
        when the caller read it already), as the Prolog's choose_binding takes it."""
        res = (self._reservations_row() if reservations is None else reservations).get(job_id)
        if not isinstance(res, dict) or res.get("node") != node:
            return ()
        try:
            return tuple((int(gi), Slot(int(start), str(profile))) for gi, profile, start in res["instances"])
        except (KeyError, TypeError, ValueError, OverflowError):
            return ()  # a damaged entry: no reservation

    def on_bound(self, payload: dict, principal) -> dict:
        node = self._check_node(payload, principal)
        job_id = self._check_job(payload)
        insts = v_instances(payload.get("instances"), "instances")
        local = v_bool(payload.get("local"), "local")
        observed = v_observed(payload.get("observed"))
        observed_at = v_time(payload.get("observed_at"), "observed_at")
        if local and not insts:
            raise rejected("instances: a binding made by the node alone must list its instances")
        message_id = v_message(payload)
        now = self.clock()
        # When the node bound it: a binding it made alone may be delivered long after, from its outbox.
        bound_at = min(v_time(payload.get("bound_at"), "bound_at") or now, now)
        detail = self._slurm_detail(job_id) if local else None
        with self.store.transaction():
            events = self._message(node, "/v1/bound", message_id, now)
            if events.handled:
                # Delivered again (its answer was lost): by now the job may have ended, been requeued or
                # bound anew, and this binding must not be adopted, nor the job made RUNNING, again.
                return events.answer
            current = self.store.get_job(job_id)
            if current is not None and self._before_this_run(current, bound_at):
                # Made for an earlier run (or attempt) of the id, delivered from the node's outbox after the id
                # ran again: adopted, it made a waiting run RUNNING on the old run's instance, and the old
                # run's Epilog behind it then passed for this run's (it ended after that binding). Nor is its
                # time a start for a current run that has ended (cancelled while it waited, say): as that
                # run's start it made the old run's Epilog pass for that run's too.
                events.add("late", f"job {job_id}: a binding on {node} made before its current run (run "
                           f"{current.run}) began; not adopted", node=node, job_id=job_id, now=now)
                log.warning("job %s: a binding from %s made before the current run began; not adopted", job_id, node)
                return events.reply({"ok": True})
            if local:
                # Bound by the node alone while we were down: adopt it.
                if not self.store.get_job(job_id):
                    try:
                        self._job_request(job_id, detail)
                    except ValueError as exc:
                        self._note_unservable(job_id, str(exc), now)
                job = self.store.get_job(job_id)
                if job is not None and job.state in TERMINAL:
                    # Delivered late from the node's outbox, after the job's end was recorded (or after Slurm
                    # said it ended, while we never saw it run): history only, but its start time is known now.
                    self.store.note_start_if_unknown(job_id, start_time=bound_at, node=node)
                    events.add("late", f"job {job_id}: node-made binding on {node} reported after the "
                               f"job ended", node=node, job_id=job_id, now=now)
                    return events.reply({"ok": True})
                try:
                    self.store.bind(job_id, node, insts, now=now)
                except SlurmMigError as exc:
                    events.add("conflict", f"job {job_id} bound locally on {node}: {exc}", node=node,
                               job_id=job_id, now=now)
                self.store.set_job_state(job_id, "RUNNING", now=bound_at, node=node, reason="bound by the node alone")
            for i in insts:
                self.store.set_binding_uuid(job_id, node, i["gpu"], i["start"], i.get("uuid"))
            # What the Prolog's re-carve made: without it the policy saw the GPU as it was before until the
            # next health check, and planned from there (re-carves failing with "would destroy busy").
            self._store_observed(node, observed, observed_at)
            for e in self._entries_of(node, job_id, {int(i["gpu"]) for i in insts}):
                # The Prolog makes only its job's instances; the rest of the target is the health check's.
                # Until the GPU shows the whole target the entry stays open, so no tick plans from the old
                # layout meanwhile (seen: "would destroy busy instance(s)" four times, and two requeues).
                now_layout = self.store.observed_layout(node, e.gpu)
                if now_layout is not None and str(now_layout) == e.to_layout:
                    self._finish_reconfig(e.id, "done", outcome=f"applied by the prolog of job {job_id}", now=now)
            events.add("start", f"job {job_id} started on {node} with "
                       + ", ".join(f"{i['profile']}@{i['gpu']}:{i['start']}" for i in insts),
                       node=node, job_id=job_id, now=now)
            return events.reply({"ok": True})

    def on_bind_failed(self, payload: dict, principal) -> dict:
        node = self._check_node(payload, principal)
        job_id = self._check_job(payload)
        results = v_results(payload.get("results"), need_gpu=False)
        message_id = v_message(payload)
        # When the node made the message (its Prolog saw the failure): it may be delivered long after, from
        # the node's outbox. An older node sends no time.
        failed_at = v_time(payload.get("message_at"), "message_at")
        now = self.clock()
        with self.store.transaction():
            events = self._message(node, "/v1/bind-failed", message_id, now)
            if events.handled:
                # Delivered again (its answer was lost): meanwhile the job may have been requeued and bound
                # anew on this node, a binding this message is not about; nothing is released or requeued.
                return events.answer
            job = self.store.get_job(job_id)
            if job is not None and failed_at is not None and self._before_this_run(job, min(failed_at, now)):
                # An earlier run's (or attempt's) failure, delivered from the node's outbox after the id ran
                # again: handled, it released the current run's binding on this node and made it REQUEUED (a
                # waiting run too), while Slurm ran or queued it. No journal entry is closed either: those
                # open on the node now may be the current run's Prolog's or the health check's, and its own
                # Prolog's, left open, are abandoned by the tick (JOURNAL_TIMEOUT_S).
                events.add("late", f"job {job_id}: a bind failure on {node} made before its current run (run "
                           f"{job.run}) began; nothing released or requeued: {results}"[:2000], node=node,
                           job_id=job_id, now=now)
                log.warning("job %s: a bind failure from %s made before the current run began; ignored", job_id, node)
            else:
                # Only this node's binding: a late message about an earlier attempt must not free a later one.
                self.store.release(job_id, node=node, now=now)
                if job is not None and job.node in (None, node) and job.state not in TERMINAL:
                    self.store.set_job_state(job_id, "REQUEUED", now=now,
                                             reason="reconfiguration failed on the node")
                gpus = {r["gpu"] for r in results if r["gpu"] is not None}
                for e in self._entries_of(node, job_id, gpus):
                    self._finish_reconfig(e.id, "failed", error=str(results)[:2000], now=now)
                events.add("bind-failed", f"job {job_id} on {node}: {results}"[:2000],
                           node=node, job_id=job_id, now=now)
            answer = events.reply({"ok": True})
        self.metrics.inc("slurm_mig_hook_errors_total", (("kind", "bind_failed"),))  # once per failure, late too
        return answer

    def on_epilog(self, payload: dict, principal) -> dict:
        node = self._check_node(payload, principal)
        job_id = self._check_job(payload)
        now = self.clock()
        ended_at = v_time(payload.get("end_time"), "end_time")
        exit_code = v_opt_int(payload.get("exit_code"), "exit_code")
        derived_ec = v_opt_int(payload.get("derived_ec"), "derived_ec")
        insts = v_instances(payload.get("instances"), "instances")
        lingering = v_instances(payload.get("lingering"), "lingering")
        unreadable = v_bool(payload.get("binding_unreadable"), "binding_unreadable")
        requeued = v_bool(payload.get("requeued"), "requeued")
        # The uid of the job it ran for (SLURM_JOB_UID, or its binding record's); nodes before 2026-11-27 send none.
        uid = v_opt_int(payload.get("uid"), "uid")
        uid = uid if uid is not None and uid >= 0 else None
        message_id = v_message(payload)
        state = "COMPLETED" if exit_code == 0 else "FAILED"
        earlier = False  # the Epilog of an earlier run than the job id's current one
        with self.store.transaction():
            events = self._message(node, "/v1/epilog", message_id, now)
            if events.handled:
                # Delivered again (its answer was lost): its outcome is recorded, and the job may run again by
                # now (requeued, its id reused), bound anew, perhaps to the same instances on this node.
                return events.answer
            job = self.store.get_job(job_id)
            # Another user's job than the store's run of the id (a requeue never changes a job's user; the id was
            # given again after slurmctld lost its state, or its ids wrapped): not this run's end, whenever it ended.
            other_user = job is not None and uid is not None and job.uid is not None and uid != job.uid
            if other_user and job.run == 1:
                # A job with the id that no tick saw (it started and ended between two): it may neither end the
                # store's run nor free its instances, and it has no run here to record an outcome under.
                events.add("conflict", f"job {job_id}: an Epilog from {node} of uid {uid}'s job with this id, not "
                           f"of the run tracked here (uid {job.uid}'s, {job.state.lower()}); ignored", node=node,
                           job_id=job_id, now=now)
                log.warning("job %s: Epilog from %s for uid %s ignored: the run tracked is uid %s's", job_id, node,
                            uid, job.uid)
                answer, recorded = events.reply({"ok": True, "recorded": False}), False
            elif job is not None and (other_user or ended_at is not None and self._before_this_run(job, ended_at)):
                earlier = True
                recorded, replaced = self._earlier_runs_epilog(
                    job, node, events, insts=insts, unreadable=unreadable, requeued=requeued, state=state,
                    exit_code=exit_code, derived_ec=derived_ec, end=self._epilog_end(None, ended_at, now), now=now,
                    uid=uid if other_user else None)
                answer = events.reply({"ok": True, "recorded": recorded or replaced})
            else:
                if unreadable and not insts:
                    insts = [b.to_json() for b in self.store.bound_instances(job_id)]  # the node's file was damaged
                result = self._epilog(job, job_id, node, events, insts=insts, lingering=lingering,
                                      requeued=requeued, state=state, exit_code=exit_code, derived_ec=derived_ec,
                                      end=self._epilog_end(job, ended_at, now), now=now)
                counted = result.pop("_counted", False)
                answer = events.reply(result)
                recorded = answer["recorded"] and not counted
                if recorded:  # to be counted (below), by this process or, restarted, the next
                    self.store.set_meta(uncounted_key(job_id, job.run), [job_id, job.run, now], now=now)
        if recorded and earlier:
            # An earlier run's end: Slurm lists the current run, so the Epilog's state is the only word on it.
            self.metrics.inc("slurm_mig_jobs_finished_total", (("state", state),))
        elif recorded:
            # Counted in jobs_finished_total once its end state is final (_final_end_states): the Epilog reads
            # exit status 0 for a job cancelled or timed out, and a counter cannot take a job back.
            with self._unconfirmed_lock:
                self._unconfirmed[(job_id, job.run)] = now
            if job.start_time and job.submit_time:
                self.metrics.observe("slurm_mig_wait_seconds", max(0.0, job.start_time - job.submit_time),
                                     (1, 5, 15, 30, 60, 300, 900, 3600))
        return answer

    def _epilog(self, job, job_id: str, node: str, events: "NodeMessage", *, insts: list, lingering: list,
                requeued: bool, state: str, exit_code: int | None, derived_ec: int | None, end: float,
                now: float) -> dict:
        """The effects of an Epilog of the job id's current run (on_epilog's transaction); its answer."""
        if job is None or not insts:
            # Not a MIG job, or a run that never got its instances (requeued in its Prolog).
            return {"ok": True, "recorded": False}
        bound_on = self.store.bound_nodes(job_id)
        if node not in bound_on and (bound_on or job.node not in (None, node)):
            # The job runs (or ran) on another node: this is a stale attempt's Epilog, or a node speaking
            # beyond itself. It may not end the job there, record its outcome or free its instances.
            where = ", ".join(sorted(bound_on)) or job.node
            events.add("conflict", f"job {job_id}: an Epilog from {node}, where it is not bound "
                       f"(it is on {where}); ignored", node=node, job_id=job_id, now=now)
            log.warning("job %s: Epilog from %s ignored: the job is bound on %s", job_id, node, where)
            return {"ok": True, "recorded": False}
        if requeued:
            # This attempt was requeued (by its Prolog's wrapper after a crash, an admin, a node failure):
            # it is not how the job ended. Its instances are free; the outcome waits for the final run.
            self.store.release(job_id, node=node, starts=[(i["gpu"], i["start"]) for i in insts], now=now)
            events.add("requeue", f"job {job_id}: an attempt on {node} ended by a requeue; its "
                       f"instances are released, the outcome waits for the run that completes",
                       node=node, job_id=job_id, now=now)
            return {"ok": True, "recorded": False}
        # Ended here already with a state of Slurm's (a tick recorded its end from Slurm's record, or saw it
        # end while the store had it waiting): the Epilog's COMPLETED or FAILED is a guess from the exit
        # status, which reads 0 for a job cancelled or timed out. It does not replace Slurm's word. The
        # tick's own CANCELLED for a waiting job Slurm no longer listed is no such word: this Epilog shows the
        # job ran (while the controller was down, then forgotten by Slurm), and its state is the better guess.
        # Its end, stamped when the tick looked (perhaps hours after the run ended), gives way to the Epilog's too:
        # until 2026-11-27 the jobs row kept it, and the reason, on a job that completed.
        guessed = job.state == "CANCELLED" and job.reason == NOT_IN_QUEUE and \
            self.store.forget_guessed_cancel(job_id, NOT_IN_QUEUE)
        # Settled by the tick as FAILED without Slurm's record or this Epilog, which has the node's account (its
        # exit status and end): the tick's guess gives way, outcome and all. Until 2026-11-27 the Epilog was
        # dropped, the run left FAILED with no exit status and an end as late as the controller's return.
        replaced = job.state == "FAILED" and job.reason == FORGOTTEN and self.store.forget_guessed_end(job_id)
        guessed = guessed or replaced
        slurms = job.state in TERMINAL and job.state not in ("COMPLETED", "FAILED") and not guessed
        recorded = self.store.record_outcome(job_id, state=job.state if slurms else state, exit_code=exit_code,
                                             derived_exit_code=derived_ec, end_time=end, now=now)
        if job.state not in TERMINAL or guessed:
            # Ended when the Epilog ran, not when its message arrived (it may have waited in the outbox for hours).
            self.store.set_job_state(job_id, state, now=now, exit_code=exit_code, end_time=end,
                                     reason="" if guessed else None)
        self.store.release(job_id, node=node, starts=[(i["gpu"], i["start"]) for i in insts], now=now)
        if lingering:
            events.add("lingering", f"job {job_id} ended with processes left on {lingering}",
                       node=node, job_id=job_id, now=now)
        events.add("end", f"job {job_id} ended on {node} (exit {format_exit_status(exit_code)})" + (
            "; its Epilog replaces the outcome settled without it (FAILED, no exit status)" if replaced else ""),
            node=node, job_id=job_id, now=now)
        # A replaced outcome was counted in jobs_finished_total when the tick settled it: not counted again.
        return {"ok": True, "recorded": recorded, **({"_counted": True} if replaced else {})}

    def _epilog_end(self, job, ended_at: float | None, now: float) -> float:
        """When the current run of ``job`` ended, from its Epilog's ``end_time`` (the node's clock) where that is
        sane: not after the controller heard of it (one ahead by more than the clocks may differ is not
        taken at all: ``now``), and not before the run started (one before it by less than that margin is
        this run's, _before_this_run, and ended at its start). Without one: ``now``."""
        if ended_at is None or ended_at > now + self._clock_margin():
            return now
        if job is not None and job.start_time is not None and ended_at < job.start_time:
            return job.start_time
        return min(ended_at, now)

    def _before_this_run(self, job, at: float) -> bool:
        """Was ``at`` (a time on a node's clock: an Epilog's end time, a node-made binding's bound_at or binding
        file's time, a bind failure's message_at) before
        the job's current run began? Then the message is an earlier run's (or an earlier attempt's of this
        run, requeued), arriving late from its node's outbox after the id ran again.

        The current run began at its start time, or, not started yet, at its submission when it is a
        later run (Slurm's submit time for it, restart_job). A run's own Epilog ends, and its Prolog binds,
        after its start was recorded (the Prolog's request, a tick that saw it running, or Slurm's start
        time, all while or before it ran), but the times come from different clocks: only a time earlier
        than the start by more than the clocks may differ (_clock_margin: 2 x [auth].max_clock_skew_s, 60 s
        by default) counts. An earlier run's Epilog that ended within that margin of the next run's start
        is taken as the current run's, as before; ending a run wrongly would be worse than missing one.
        """
        began = job.start_time if job.start_time is not None else (job.submit_time if job.run > 1 else None)
        return began is not None and at < began - self._clock_margin()

    def _earlier_runs_epilog(self, job, node: str, events: "NodeMessage", *, insts: list, unreadable: bool,
                             requeued: bool, state: str, exit_code: int | None, derived_ec: int | None,
                             end: float, now: float, uid: int | None = None) -> tuple[bool, bool]:
        """An Epilog of a run of the job id before its current one (_before_this_run): it neither ends
        nor releases the current run. When the current run is the second, the Epilog is the first run's:
        its outcome goes under run 1, unless that run has one: then it is a duplicate (the outcome came from
        Slurm's record, _lost_epilogs, or an earlier Epilog), unless that outcome is the controller's guess (a run
        settled after Slurm had forgotten it: FAILED, no exit status; Outcome.guessed) and the Epilog comes from the
        node run 1 ran on: its state, exit status and end replace the guess (until 2026-11-27 the guess stayed
        for good once the id ran again). With more runs before the current one, nothing is recorded: the
        store cannot tell which of them it ended. A run without an outcome keeps no times (the jobs row is
        the current run's), and may still have run here (bound by its node alone while no tick saw it run,
        then ended while the store had it waiting), so neither "the run without an outcome" nor the
        outcomes' times pick the right one; recorded under the wrong run, the end would stand for a run
        that never ran (and could not be replaced by its own). ``uid``: the Epilog's job is another user's than
        the current run's (it may have ended after that run began). (recorded, replaced): True when it recorded an
        outcome, or replaced run 1's guessed one (already counted in jobs_finished_total when it was settled)."""
        if not (insts or unreadable):
            return False, False  # a run that never got its instances (requeued in its Prolog): nothing to say
        recorded = replaced = False
        size = self._size_bound(node, insts)
        if job.run == 2 and not requeued and size is not None:  # (an attempt ended by a requeue is no outcome)
            # Nothing of the jobs row: it is run 2's, request and all (another user's job, for a reused id).
            recorded = self.store.record_outcome(job.job_id, run=1, state=state, exit_code=exit_code,
                                                 derived_exit_code=derived_ec, end_time=end, now=now, node=node,
                                                 instances=insts, profile=size[0], count=size[1])
        first = self.store.outcome(job.job_id, run=1) if job.run == 2 and not requeued and not recorded else None
        if first is not None and first.guessed and not (
                first.start_time is not None and end < first.start_time - self._clock_margin()):
            # (one that ended before run 1 began is not run 1's either)
            replaced = self.store.replace_guessed_outcome(job.job_id, 1, node=node, state=state, exit_code=exit_code,
                                                          derived_exit_code=derived_ec, end_time=end)
        if job.run > 2:
            which = f"one of the {job.run - 1} runs before the current one"
            what = "which one cannot be told, so nothing is recorded"
        else:
            which = "a run before the current one"
            what = "its outcome is recorded under run 1" if recorded else (
                "it replaces the outcome settled without it (FAILED, no exit status) under run 1" if replaced else
                "run 1's size cannot be told (its binding file was unreadable), so nothing is recorded"
                if size is None and not requeued and self.store.outcome(job.job_id, run=1) is None
                else "nothing is changed")
        after = f"uid {job.uid}'s, not uid {uid}'s as it is" if uid is not None else "which began after it ended"
        events.add("late", f"job {job.job_id}: an Epilog from {node} of {which} (run {job.run}, {after}); {what}",
                   node=node, job_id=job.job_id, now=now)
        log.warning("job %s: an Epilog from %s %s; %s", job.job_id, node, f"for uid {uid}, not the current run's"
                    if uid is not None else "ended before the current run began", what)
        return recorded, replaced

    def _size_bound(self, node: str, insts: list) -> tuple[str, int] | None:
        """(profile, count) of a run bound to ``insts`` on ``node``, as an outcome records what a job asked
        for: the instances' kind where the store knows the GPU's model ("1g"), else their profile name
        ("1g.10gb", which names the size as well). None without instances, or with instances of more than
        one size (a job asks for one size, mig_size_request)."""
        models = {g.gpu: g.model for g in self.store.observed_gpus(node)}
        sizes = set()
        for i in insts:
            name = str(i["profile"])
            try:
                sizes.add(get_model(models[i["gpu"]]).profile(name).kind if models.get(i["gpu"]) else name)
            except GeometryError:  # a profile the GPU's model (as last reported) does not have
                sizes.add(name)
        return (sizes.pop(), len(insts)) if len(sizes) == 1 else None

    def on_report(self, payload: dict, principal) -> dict:
        node = self._check_node(payload, principal)
        observed, node_bindings = v_observed(payload.get("observed")), v_bindings(payload.get("bindings"))
        binding_times = v_binding_times(payload.get("binding_times"))
        observed_at = v_time(payload.get("observed_at"), "observed_at")
        now = self.clock()
        with self.store.transaction():
            self._store_observed(node, observed, observed_at, node_bindings)
            self._reconcile_bindings(node, node_bindings, now, binding_times)
            # Binding files of jobs that ended long ago (their Epilog was lost: node crash, reboot):
            # the node drops them once it has checked their instances are idle.
            release = []
            for job_id in node_bindings:
                job = self.store.get_job(str(job_id)) if JOB_ID.fullmatch(str(job_id)) else None
                if job is not None and job.state in TERMINAL and now - (job.end_time or job.updated_at) > 30:
                    release.append(str(job_id))
            desired = {}
            blocked = {g.gpu for g in self.store.observed_gpus(node) if g.blocked}
            for gi, d in self.store.desired(node).items():
                if gi in blocked:
                    continue  # the node would refuse it (MigModePending): the GPU stays as it is
                obs = self.store.observed_layout(node, gi)
                lay = _desired_layout(d)
                if lay is None:
                    continue  # the GPU is gone or changed model: its old desired layout no longer applies
                if obs is None or obs.slots != lay.slots:
                    desired[str(gi)] = str(lay)
                else:
                    for e in self.store.open_journal_entries(node):
                        if e.gpu == gi:
                            self._finish_reconfig(e.id, "done", outcome="observed in place", now=now)
            for e in self.store.open_journal_entries(node):
                if e.state == "planned" and str(e.gpu) in desired:
                    self.store.journal_started(e.id, now=now)
        self._reported_at[node] = (now, frozenset(str(j) for j in node_bindings))  # stored: its files as of now
        return {"desired": desired, "release": release}

    def _reconcile_bindings(self, node: str, node_bindings: dict, now: float,
                            binding_times: dict[str, float] | None = None) -> None:
        """Line the store's live bindings on ``node`` up with the node's binding files: release those the
        node no longer holds (their Epilog was lost), adopt those the store lost. ``binding_times``: when
        the node wrote each file (its clock; absent from an older node)."""
        live = {}
        for jid, _node, b in self.store.live_bindings(node):
            live.setdefault(str(jid), []).append(b)
        for job_id, binds in live.items():
            job = self.store.get_job(job_id)
            # Bound in the store, unknown to the node, and past its start: the epilog was lost.
            if job_id not in node_bindings and job and job.state not in ("PENDING",) and \
                    now - (job.start_time or now) > self._unlisted_binding_wait():
                self.store.release(job_id, now=now)
                self.store.add_event("reconcile", f"job {job_id}: binding on {node} released (node holds none)",
                                     node=node, job_id=job_id, now=now)
        for job_id, insts in node_bindings.items():
            # An empty list is a binding file the node could not read: nothing to adopt.
            if insts and str(job_id) not in live and JOB_ID.fullmatch(str(job_id)):
                job = self.store.get_job(str(job_id))
                written = (binding_times or {}).get(str(job_id))
                if job is not None and job.state not in TERMINAL and written is not None \
                        and self._before_this_run(job, written):
                    # A file an earlier run of the id left (processes outlived it, so the node keeps it until
                    # they are gone), the id running again: adopted, the run that waits held the old run's
                    # instance here, and a Prolog of it on this node was handed that instance, still in use.
                    self._say_not_adopted(node, job, now)
                    continue
                if job is not None and job.state not in ("COMPLETED", "FAILED", "CANCELLED"):
                    try:
                        self.store.bind(str(job_id), node, insts, now=now)
                        self.store.add_event("reconcile", f"job {job_id}: adopted the node's binding", node=node,
                                             job_id=str(job_id), now=now)
                    except (SlurmMigError, ValueError) as exc:  # conflict, or an instance listed twice
                        log.warning("cannot adopt binding of job %s on %s: %s", job_id, node, exc)

    def _unlisted_binding_wait(self) -> float:
        """How long past a job's start a health report may still not list the job's binding file (it read the
        files before the Prolog wrote it) without the store's binding being released: 60 s, and never less
        than the clock margin. The start may be on a node's clock (a binding the node made alone takes its
        bound_at), up to [auth].max_clock_skew_s behind the controller's; with a fixed 60 s, a skew of 60 s
        or more left no time at all. At the default skew (30 s) the margin is 60 s: unchanged."""
        return max(60.0, self._clock_margin())

    def _say_not_adopted(self, node: str, job, now: float) -> None:
        """A ``late`` event, once per node and run, for a binding file of an earlier run not adopted (the
        node reports it every health check while the old run's processes last)."""
        key = (node, job.job_id, job.run)
        if key in self._not_adopted:
            return
        if len(self._not_adopted) > 1000:
            self._not_adopted.clear()
        self._not_adopted.add(key)
        self.store.add_event("late", f"job {job.job_id}: the binding file on {node} was written before its current "
                             f"run (run {job.run}) began; an earlier run's, not adopted", node=node,
                             job_id=job.job_id, now=now)
        log.warning("job %s: the binding file on %s is an earlier run's; not adopted for run %s", job.job_id, node,
                    job.run)

    def on_applied(self, payload: dict, principal) -> dict:
        node = self._check_node(payload, principal)
        results = v_results(payload.get("results"), need_gpu=True)
        observed = v_observed(payload.get("observed"))
        observed_at = v_time(payload.get("observed_at"), "observed_at")
        message_id = v_message(payload)
        now = self.clock()
        with self.store.transaction():
            events = self._message(node, "/v1/applied", message_id, now)
            if events.handled:
                # Delivered again (its answer was lost): its layouts may be older than a later report's, and
                # the journal entries it closed may have been followed by others for the same GPUs.
                return events.answer
            # The GPUs as the apply left them: the journal entries close below, and without this the policy
            # would see the layout from before the change until the next health check (30 s by default).
            self._store_observed(node, observed, observed_at)
            counted = []  # once the transaction has committed: a rolled-back one is handled again
            for r in results:
                gi = r["gpu"]
                ok = r["ok"] and r["reached"]
                for e in self.store.open_journal_entries(node):
                    if e.gpu == gi:
                        self._finish_reconfig(e.id, "done" if ok else "failed",
                                              outcome=r["done"], error=r["error"], now=now)
                counted.append("ok" if ok else "failed")
                events.add("applied", f"{node}/{gi}: {r['before']} -> {r['after']}"
                           + ("" if ok else f" FAILED: {r['error']}"), node=node, now=now)
            answer = events.reply({"ok": True})
        for result in counted:
            self.metrics.inc("slurm_mig_reconfigurations_total", (("result", result),))
        return answer


class NodeMessage:
    """One node message, handled once however often it is delivered.

    A node re-sends a message whose answer it did not get (its client retries once; the outbox sends it
    again at the next hook or health check), each time with a fresh credential, so the channel's replay
    check cannot tell it from a new request. The node gives each message an id (``message_id``). The
    handler notes the message and its answer (``reply``, table node_messages) in the transaction of its
    effects; a later delivery finds the note (``handled``) and gets the same answer, with ``"duplicate":
    true``, changing nothing: by then the job may have been requeued and bound anew, and doing the message
    again would act on that. Its events carry the id in their details. A message without an id (from an
    older node) is handled at each delivery, as before.
    """

    def __init__(self, store, node: str, route: str, message_id: str | None, now: float):
        self.store, self.node, self.route, self.id, self.now = store, node, route, message_id, now
        first = None if message_id is None else store.message_answer(node, route, message_id)
        self.answer = None if first is None else {**first, "duplicate": True}

    @property
    def handled(self) -> bool:
        """An earlier delivery of this message was handled; ``answer`` is what to answer now."""
        return self.answer is not None

    def add(self, kind: str, message: str, *, node: str | None = None, job_id: str | None = None,
            now: float | None = None) -> None:
        """Store.add_event(), the message's id in the event's details."""
        self.store.add_event(kind, message, {"message": self.id} if self.id else None, node=node,
                             job_id=job_id, now=now)

    def reply(self, answer: dict) -> dict:
        """``answer``, noted as this message's (when it has an id) in the handler's transaction."""
        if self.id is not None:
            self.store.record_message(self.node, self.route, self.id, answer, now=self.now)
        return answer


def _desired_layout(d) -> Layout | None:
    """A desired_layouts row as a Layout for the GPU's current model; None if there is no row, or the GPU
    is no longer reported (or changed model), so one odd GPU never fails a tick or every report of its node."""
    if d is None:
        return None
    try:
        return d.layout()
    except (ValueError, SlurmMigError) as exc:
        log.warning("desired layout %r of %s/%s does not apply to the GPU now: %s", d.spec, d.node, d.gpu, exc)
        return None
