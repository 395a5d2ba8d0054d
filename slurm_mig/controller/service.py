"""The controller: one loop that syncs with Slurm, asks the policy and keeps GRES true, plus the node API.

Each tick (apscheduler, every ``[controller].tick_interval_s``):
  1. read jobs and nodes from Slurm (a failed query is stale data: that part is skipped, not a crash);
  2. in one store transaction: sync jobs, build the ClusterState, ask the policy (falling back to the
     configured heuristic on error or an unsafe decision);
  2b. where the decision lowers a node's counts, lower them in Slurm first and ask squeue again: a job
     Slurm started meanwhile under the old counts makes the tick decide again with it (_withdraw_first);
  2c. in a second transaction: record desired layouts, the decision and planned journal entries;
  3. keep each node's GRES counts equal to the instances that exist or are about to exist,
     re-asserting them after a slurmctld restart or `scontrol reconfigure`, and nudging Slurm when
     pending jobs could run but are stuck (FACTS §4: a type that came back is not reconsidered).

The node API (POST, authenticated: /v1/prolog, /v1/bound, /v1/bind-failed, /v1/epilog, /v1/report,
/v1/applied) is the Controller's other half, in node_api.py; the checks on what nodes send are in
payloads.py, the tests of which run of a job id a record is in runs.py, and /metrics in metrics.py.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from slurm_mig.api.loglimit import LogLimiter
from slurm_mig.api.origin import NodeOrigins
from slurm_mig.controller.binding import held_regions, intended_layout, node_gpus, overlaps
from slurm_mig.controller.eligibility import eligible_nodes
from slurm_mig.controller.metrics import Metrics
from slurm_mig.controller.node_api import NodeApi
from slurm_mig.controller.queue import queue_entries
from slurm_mig.controller.runs import (
    FORGOTTEN, NOT_IN_QUEUE, TERMINAL, UNCOUNTED, another_job, kind_of_gres, mig_size_request, same_run, size_hold,
    slurm_end, uncounted_key, users_differ,
)
from slurm_mig.errors import ConfigError, GeometryError, SlurmMigError
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.transitions import plan_transition
from slurm_mig.policies import check_decision, get_policy
from slurm_mig.policies.base import PendingJob
from slurm_mig.slurm.gres import (
    GRES_TYPES, PAD_TYPE, gres_type_for_kind, gres_type_for_profile, mig_total, padded_total,
)
from slurm_mig.slurm.parsers import format_exit_status
from slurm_mig.store.schema import JOB_STATES

log = logging.getLogger("slurm_mig.controller")

LIVE_STATES = tuple(s for s in JOB_STATES if s not in TERMINAL)  # the store's states of a run not over
# A planned reconfiguration that no node carried out within this time is abandoned, so the GPU is not
# locked forever by a node that went away.
JOURNAL_TIMEOUT_S = 600.0
# How often a node's GPU of a model this controller's tables do not list is said again (log and event).
UNKNOWN_MODEL_LOG_EVERY_S = 3600.0
# How often a policy (or the shadow) failing the same way tick after tick is said again (log and event): a
# model that no longer loads fails every tick, 17,280 error lines and events a day at the default interval.
POLICY_FAIL_LOG_EVERY_S = 600.0
# A job that ended in Slurm without an Epilog report for this long (at least two health-check intervals)
# gets its outcome from Slurm's own record.
EPILOG_GRACE_S = 60.0
# How long a Prolog's word that an array task started under its own id outweighs squeue answers asked before.
TAKEN_TASK_MEMORY_S = 120.0
# How often one tick decides again when Slurm keeps starting jobs on nodes whose counts it is lowering.
WITHDRAW_ROUNDS = 3
# An outcome an Epilog reported is counted in slurm_mig_jobs_finished_total once a tick has seen Slurm list
# the job as ended (so with Slurm's state where it corrected the Epilog's), or this long after it was recorded.
END_STATE_WAIT_S = 60.0
# How long Slurm's record of a run it listed as ended is kept once no squeue lists it so (Controller._listed_ended):
# its Epilog, and so the tick that finds the job live again after an admin's requeue, may come later than the next
# tick (up to an hour from its node's outbox, as _ended_since keeps its notes).
LISTED_ENDED_MEMORY_S = 3600.0


class EndedListing(NamedTuple):
    """What _revive needs of Slurm's record of a job it listed as ended. Kept an hour for every ended MIG job, so not
    the whole record: 10,000 entries took 26 MB with it and 2.5 MB with this (tracemalloc, 2026-11-27)."""

    state: str
    end_time: float | None


MB = 1024 * 1024  # [controller].keep_decisions_mb's megabyte
# Decisions are pruned as soon as those recorded since the last prune take 1/PRUNE_PART of their size budget
# ([controller].keep_decisions_mb), so they stay within the budget plus that part (and the newest decision).
PRUNE_PART = 10



def slot_type(layout: Layout, slot: Slot) -> str:
    """The GRES type of ``layout``'s instance ``slot``."""
    return gres_type_for_kind(layout.model.profile(slot.profile).kind)


def layout_counts(layout: Layout) -> dict[str, int]:
    """GRES type -> count of instances in ``layout``."""
    out: dict[str, int] = {}
    for s in layout.slots:
        t = slot_type(layout, s)
        out[t] = out.get(t, 0) + 1
    return out


def _gres_counts(layouts: dict[int, Layout]) -> dict[str, int] | None:
    """GRES type -> instances over a node's GPU layouts (every type listed); None for no GPU."""
    if not layouts:
        return None
    counts = {t: 0 for t in GRES_TYPES}
    for lay in layouts.values():
        for t, n in layout_counts(lay).items():
            counts[t] += n
    return counts


def _make_policy(cfg, name: str, key: str = "name"):
    """A policy by name; learned ones get the configured model file (they load it lazily, on first use)
    and the cap on how long their guard may hold a whole-node reservation back. ``key``: the [policy] key
    that named it, which an unknown name's error names with the config (it said only "unknown policy")."""
    try:
        if name.startswith("rl"):
            opts = {"max_hold_h": cfg.policy.rl_max_hold_h}
            # [policy].model_path of this config, below $SLURM_MIG_RL_MODEL (rl.resolve_model_path's order, the one
            # `policy install` warns by; as model_path the config's won over the variable here alone), and '' when
            # unset: left to the policy, it was looked up in the config load_config finds ($SLURM_MIG_CONFIG or
            # /etc/slurm-mig/slurm-mig.toml), another file than --config, and one not judged by check_trusted
            opts["config_model_path"] = cfg.policy.model_path or ""
            return get_policy(name, **opts)
        return get_policy(name)
    except ConfigError as exc:
        raise ConfigError(f"config {cfg.source or '<built-in defaults>'}: [policy].{key}: {exc}") from None


def _signature(decision) -> tuple:
    """Who decided (the policy and its version) and what the decision does and says: its re-carves,
    placements and waiting reasons. A decision, the live policy's or the shadow's, is recorded only when this
    differs from that of the last one recorded (the same decision tick after tick, jobs waiting for the same
    reasons, is recorded once). The policy is part of it: the fallback deciding as the policy did the tick
    before (an rl model that stopped loading, frag-aware deciding alike) is recorded, or the last decision,
    the one `status` names and `explain` attributes waits to, would say the policy that no longer decides."""
    return (decision.policy, decision.version, tuple((c.key, str(c.target)) for c in decision.changes),
            tuple((a.job_id, a.node, a.instances) for a in decision.assignments), decision.waiting)


class Controller(NodeApi):
    """The head-node controller. Thread-safe: API threads and the tick share one Store."""

    def __init__(self, cfg, store, slurm, *, policy=None, clock=time.time):
        self.cfg = cfg
        self.store = store
        self.slurm = slurm
        self.clock = clock
        self.policy = policy or _make_policy(cfg, cfg.policy.name)
        self.fallback = _make_policy(cfg, cfg.policy.fallback, "fallback") if cfg.policy.fallback else None
        self.shadow = _make_policy(cfg, cfg.policy.shadow, "shadow") if cfg.policy.shadow else None
        self._shadow_state = None  # the state the live policy decided on this tick, for the shadow
        self._detail_slots = threading.BoundedSemaphore(self.DETAIL_CONCURRENCY)
        self.metrics = Metrics()
        self._gres_set: dict[str, tuple[str, float]] = {}  # node -> (value, when) last written
        # node -> (counts, when): what Slurm last held as slurm-mig set it (written, or read back so)
        self._gres_held: dict[str, tuple[dict[str, int], float]] = {}
        self._pad_to: dict[str, int | None] = {}  # node -> the mig total its counts are padded to, as last set
        self._gres_now: dict[str, dict[str, int]] = {}  # node -> its counts as last read or written
        # Held while a node's counts are written and _gres_now updated, and while lower_held_counts (a Prolog's
        # thread) reads and writes them: else it could read the counts before a tick's withdrawal step lowered
        # them and write its higher ones after, advertising instances a re-carve is about to destroy.
        self._gres_lock = threading.RLock()
        # node -> when (node's clock) the freshest GPU report stored was observed: an older one arriving
        # later (a Prolog that looked before another re-carved, an outbox message) must not undo it.
        self._observed_at: dict[str, float] = {}
        # node -> when (our clock) its last report was stored, and the jobs its binding files named
        self._reported_at: dict[str, tuple[float, frozenset[str]]] = {}
        # (node, job) -> journal entries its Prolog's re-carve carries: closed by that job's /v1/bound or
        # /v1/bind-failed, not every open entry of the node (another Prolog's or the health check's).
        self._prolog_entries: dict[tuple[str, str], list[int]] = {}
        self._last_slurm_ok = 0.0
        self._tick_lock = threading.Lock()
        self._ticks = 0
        self._last_signature: tuple | None = None
        self._last_shadow_signature: tuple | None = None  # the same for the shadow policy's decisions
        # job -> (when Slurm was first seen to have ended it, its record then: state, exit status, end time).
        # Kept in the database too: Slurm may forget the job (MinJobAge) before the grace period ends, and
        # a controller restarted in between would otherwise record the outcome without its exit status.
        self._ended_since: dict[str, tuple[float, tuple | None]] = _load_ended(store)
        self._ended_saved = dict(self._ended_since)
        # (job, run) -> when its Epilog's outcome was recorded, not yet counted in jobs_finished_total
        # (_final_end_states). By run: a job id's next run may end before its last one is counted. Kept in the
        # database too (meta UNCOUNTED entries, written with the outcome): a controller restarted before the
        # count (a tick later; while Slurm cannot be asked, any time later) counted those jobs in neither process.
        self._unconfirmed: dict[tuple[str, int], float] = _load_uncounted(store)
        self._unconfirmed_lock = threading.Lock()
        self._gres_warned: set[str] = set()
        self._gres_checked: set[str] = set()  # nodes told once about missing or too little mig:pad
        self._invalid_reg: set[str] = set()  # nodes Slurm drained for a mig GRES count below the layout's
        self._no_free_cpu: set[str] = set()  # nodes whose every CPU Slurm has allocated, at the last sinfo
        # Slurm's advanced reservations at the last good query, and each queued job's nodes (None: any) from
        # its partitions, --nodelist, --exclude, --constraint and reservations at the last squeue.
        self._reservations: list = []
        self._job_nodes: dict[str, tuple[str, ...] | None] = {}
        self._job_cpus: dict[str, tuple[int | None, bool]] = {}  # pending entry -> (squeue's cpus, --exclusive)
        self._nodes_seen: list = []
        # Array tasks ("5_3") whose place a Prolog gave to the job Slurm started them as, and when: a tick whose
        # squeue was asked before that start must not make them queue entries again.
        self._taken_tasks: dict[str, float] = {}
        # job -> (the store's run of it then, when last listed (our clock), Slurm's record) of each MIG job Slurm
        # listed as ended, kept LISTED_ENDED_MEMORY_S after the last squeue that listed it so: a run it listed
        # COMPLETED or FAILED ended by its exit, whatever requeue follows (_revive). Until 2026-11-27 only the last
        # tick's listings were kept, and a completed job an admin requeued, whose Epilog came after a tick had seen
        # it waiting again, read as one Slurm requeued as it killed it (outcome REQUEUED).
        self._listed_ended: dict[str, tuple[int | None, float, EndedListing]] = {}
        self._unservable: set[str] = set()  # jobs whose MIG request cannot be served, said once each
        # job id -> how often it was released from Slurm's BadConstraints hold and held again while its node
        # advertised its size (_release_held_for_size); the jobs released and not yet seen held again. Kept in
        # the store (meta "size_releases"), as last saved in _size_saved: a restart must not grant a job held for
        # something else MAX_SIZE_RELEASES more releases (and carving for it) each time.
        self._size_releases, self._size_released = _load_size_releases(store)
        self._size_saved = (dict(self._size_releases), set(self._size_released))
        self._not_adopted: set[tuple[str, str, int]] = set()  # (node, job, run): an earlier run's file, said once
        # node + GPU model (or profile of a known one) our tables do not list (a newer node's): said once an hour
        self._unknown_models = LogLimiter(UNKNOWN_MODEL_LOG_EVERY_S)
        # policy (live or shadow) + kind of failure: said once every POLICY_FAIL_LOG_EVERY_S, counted always
        self._policy_failures = LogLimiter(POLICY_FAIL_LOG_EVERY_S)
        # Is a node's request encoded on its own host? Only MUNGE credentials say where they were made, so
        # under HMAC the check is off whatever [auth].node_origin says.
        self.origin_mode = cfg.auth.node_origin if cfg.auth.method == "munge" else "off"
        self.origins = NodeOrigins()
        self._origin_said: dict[str, float] = {}  # node -> when its last origin line was logged
        # Error series exist from the start, at 0, so dashboards and alerts see them before the first error.
        for kind in ("auth", "bad_request", "rejected", "internal", "busy"):
            self.metrics.inc("slurm_mig_api_errors_total", (("kind", kind),), 0)
        self.metrics.inc("slurm_mig_hook_errors_total", (("kind", "bind_failed"),), 0)
        for result in ("ok", "failed"):
            self.metrics.inc("slurm_mig_reconfigurations_total", (("result", result),), 0)
        if self.origin_mode != "off":
            for result in ("match", "mismatch", "unchecked"):
                self.metrics.inc("slurm_mig_node_origin_checks_total", (("result", result),), 0)

    # ------------------------------------------------------------------ tick
    def tick(self) -> dict:
        """One controller cycle; returns a small summary (for logs, tests and --once)."""
        with self._tick_lock:
            t0 = time.perf_counter()
            now = self.clock()
            queried_at = now
            jobs = self.slurm.jobs()
            nodes = self.slurm.nodes()
            # When Slurm's Gres counts were read: the tick began earlier when squeue was slow (slurmctld
            # restarting or frozen), and an event saying "Slurm had" must not predate Slurm's answer.
            nodes_at = self.clock()
            reservations = self.slurm.reservations()
            if reservations is not None:
                self._reservations = reservations
            else:  # stale, not empty: forgetting a maintenance window would carve on its nodes again
                log.warning("scontrol show reservation failed: using the reservations seen last")
            if nodes is not None:
                self._nodes_seen = nodes
            if jobs is None or nodes is None:
                self.metrics.inc("slurm_mig_slurm_query_failures_total")
                log.warning("Slurm query failed (jobs=%s nodes=%s): using stored state",
                            jobs is not None, nodes is not None)
            else:
                self._last_slurm_ok = now
            if nodes is not None and self.origin_mode != "off":
                self.origins.update(nodes)  # resolves NodeAddrs here, never while a request waits
            summary: dict = {"time": now, "slurm_ok": jobs is not None and nodes is not None}
            # Asked before the transaction: a slow scontrol must not hold the store lock.
            lost = self._lost_epilogs(jobs, now) if jobs is not None else {}
            ended, saved = dict(self._ended_since), self._ended_saved
            size_saved = self._size_saved
            said = None
            finished: list[str] = []  # states of the jobs settled below, counted once the transaction commits
            listed_ended: set[str] = set()
            looked: set = set()  # the Epilog outcomes waiting to be counted that _sync_jobs has seen
            try:
                with self.store.transaction():
                    # What the tick says once, noted as said with the event in this transaction: restored if it
                    # rolls back. Taken inside it, as node requests note them inside theirs (under the same lock).
                    said = (set(self._invalid_reg), set(self._unservable))
                    if jobs is not None:
                        listed_ended = self._sync_jobs(jobs, now, queried_at)
                        # An Epilog notes its outcome after its transaction committed, so those noted by now
                        # were committed before this one began: _sync_jobs saw them (and corrected them).
                        with self._unconfirmed_lock:
                            looked = set(self._unconfirmed)
                        finished = self._settle_lost_epilogs(lost, now)
                        if self._ended_since != self._ended_saved:
                            self.store.set_meta("ended_since", {j: [first, list(rec) if rec else None]
                                                                for j, (first, rec) in self._ended_since.items()},
                                                now=now)
                            self._ended_saved = dict(self._ended_since)
                        self._save_size_releases(now)  # the holds _sync_jobs counted
                    if nodes is not None:
                        self._sync_nodes(nodes)
                    self._expire_journal(now)
                    plan = self._plan(now)
            except BaseException:
                # Rolled back: the notes were not saved, and the outcomes recorded from the ones this tick
                # dropped were not either (the next tick settles those jobs again, from the same notes).
                self._ended_since = {**ended, **self._ended_since}
                self._ended_saved = saved
                self._size_saved = size_saved
                if said is not None:
                    self._invalid_reg, self._unservable = said
                raise
            if jobs is not None:
                finished += self._final_end_states(listed_ended, looked, now)
            for state in finished:
                self.metrics.inc("slurm_mig_jobs_finished_total", (("state", state),))
            # Slurm's counts as read, with its pad where it has one: _assert_gres compares the pad as well.
            gres_now = {n.name: {**{t: n.gres.get(t, 0) for t in GRES_TYPES},
                                 **({PAD_TYPE: n.gres[PAD_TYPE]} if PAD_TYPE in n.gres else {})} for n in nodes or []}
            if jobs is not None and nodes is not None:
                plan, jobs, now, held_back = self._withdraw_first(plan, jobs, nodes, gres_now, now)
            else:
                held_back = self._cannot_withdraw(plan)
            signature = self._last_signature
            self._shadow_state = None
            try:
                with self.store.transaction():
                    summary.update(self._commit(plan, now, held_back))
            except BaseException:
                # Rolled back, the decision was not recorded: the next tick's same decision must be.
                self._last_signature = signature
                raise
            if self._shadow_state is not None:
                self._run_shadow(self._shadow_state, now)
                self._shadow_state = None
            if nodes is not None:
                summary["gres_updates"] = self._assert_gres(nodes, jobs or [], now, gres_now, read_at=nodes_at)
                if jobs is not None:
                    summary["released"] = self._release_held_for_size(jobs, now)
            if jobs is not None:
                summary["requeued_unbound"] = self._requeue_unbound(jobs, now)
            self._update_gauges()
            self._ticks += 1
            c = self.cfg.controller
            budget = int(c.keep_decisions_mb * MB)
            # Every 500 ticks, and sooner when the decisions recorded since the last prune pass a tenth of
            # their size budget: at a large site a decision is 1-3 MB and one may be recorded every tick
            # (two with a shadow policy), so 500 ticks could add a gigabyte past the budget.
            if self._ticks % 500 == 1 or self.store.decision_bytes_unpruned * PRUNE_PART >= budget:
                pruned = self.store.prune(keep_decisions=c.keep_decisions, keep_decisions_bytes=budget,
                                          keep_events=c.keep_events, keep_journal_days=c.keep_journal_days,
                                          now=now)
                if any(pruned.values()):
                    log.info("pruned old history: %s", pruned)
            self.metrics.observe("slurm_mig_tick_seconds", time.perf_counter() - t0,
                                 (0.01, 0.05, 0.1, 0.5, 1, 5))
            return summary

    def _sync_jobs(self, jobs, now: float, queried_at: float) -> set[str]:
        """Bring the store's jobs in line with Slurm's answer ``jobs``; returns the ids Slurm lists as ended."""
        seen, ended = set(), set()
        order = []
        mine = [j for j in sorted(jobs, key=lambda j: (-(j.priority or 0), j.submit_time or 0, j.job_id))
                if j.wants_mig and self._manages(j.partition)]
        # Array tasks that Slurm now runs (or ran) under ids of their own, and array records shown as tasks.
        split = {f"{j.array_job_id}_{j.array_task_id}": str(j.job_id) for j in jobs
                 if j.array_job_id and j.array_task_id is not None}
        self._note_held_again(mine)
        entries = [replace(e, blocked=None) if self._held_for_size(e.job, e.job_id) else e
                   for e in queue_entries(mine)]
        self._job_nodes = self._eligible(entries, queried_at)
        self._job_cpus = {e.job_id: (e.job.cpus, e.job.exclusive) for e in entries if e.job.pending}
        # An array shown as tasks, by its record's id and the prefix of its tasks' ("5" of "5_3"): the same.
        arrays = {str(e.job.job_id) for e in entries if e.array_task} | {
            e.job_id.split("_")[0] for e in entries if e.array_task}
        for task, at in list(self._taken_tasks.items()):
            if at < queried_at - TAKEN_TASK_MEMORY_S:
                self._taken_tasks.pop(task, None)
        taken = {t for t, at in list(self._taken_tasks.items()) if at >= queried_at}
        # The stored runs' users before Slurm's records are written over them (another_job's user rule).
        users = self.store.job_users(LIVE_STATES)
        margin = self._clock_margin()
        listed_ended: dict[str, tuple[int | None, float, EndedListing]] = {}
        for entry in [e for e in entries if e.job_id not in taken]:
            j, job_id = entry.job, entry.job_id
            stored_user = users.get(job_id, ("", None))  # the stored run's (user, uid), read before this tick
            seen.add(job_id)
            if j.state in TERMINAL:
                ended.add(job_id)
                run = self.store.get_job(job_id)
                if run is not None and run.state in ("RUNNING", "SUSPENDED", "COMPLETING") \
                        and another_job(run, j.submit_time, margin, user=j.user, uid=j.user_id,
                                         requeued=bool(j.restart_cnt)):
                    # Another job with the id (another_job) that ended before a tick saw it live: its request,
                    # user and end are not those of the stored run, whose lost Epilog _lost_epilogs settles.
                    continue
                listed_ended[job_id] = (None if run is None else run.run, queried_at, EndedListing(j.state, j.end_time))
            try:
                kind, count = mig_size_request(j.mig)
            except ValueError as exc:
                # One such job must not stop the tick (it used to raise inside it, every tick).
                self._note_unservable(job_id, str(exc), now)
                stored = self.store.get_job(job_id)
                if stored is not None and stored.state == "PENDING" and stored.profile:
                    # Its request changed since it was stored (an update job_submit.lua did not check): kept
                    # with the old request, it was carved and reserved for while Slurm would start it nowhere.
                    self.store.upsert_job(job_id, profile=stored.profile, count=stored.count, user=j.user,
                                          uid=j.user_id, name=j.name, partition=j.partition,
                                          time_limit_s=None if j.time_limit_min is None else j.time_limit_min * 60.0,
                                          submit_time=j.submit_time, now=now,
                                          blocked=f"{exc}; not managed until it asks for one MIG size")
                continue
            state = j.state if j.state in ("PENDING", "RUNNING", "COMPLETING", "SUSPENDED") else None
            self.store.upsert_job(job_id, profile=kind, count=count, user=j.user, uid=j.user_id, name=j.name,
                                  partition=j.partition,
                                  time_limit_s=None if j.time_limit_min is None else j.time_limit_min * 60.0,
                                  submit_time=j.submit_time, now=now, blocked=entry.blocked)
            current = self.store.get_job(job_id)
            if current is not None and current.state in TERMINAL and j.state in ("PENDING", "RUNNING", "SUSPENDED") \
                    and self._ended_here_at(current) < queried_at - 1:
                # Ended here before we asked Slurm, live in its answer: the id was reused (slurmctld restarted
                # without its state) or the job was requeued after it ended. Left terminal, the policy never saw
                # it and every Prolog's bind failed ("it already ended").
                self._revive(job_id, now, submit_time=j.submit_time, requeued=bool(j.restart_cnt))
                self._ended_since.pop(job_id, None)
                current = self.store.get_job(job_id)
            elif current is not None and j.state in ("PENDING", "RUNNING", "SUSPENDED") \
                    and another_job(current, j.submit_time, margin, user=j.user, uid=j.user_id,
                                     requeued=bool(j.restart_cnt), job_user=stored_user):
                # Another user's, or submitted after this run started (or, waiting, after its submission) and
                # never requeued: another job with the id (slurmctld lost its state, MaxJobId wrapped), not this
                # run requeued.
                self._another_job_with_id(current, j.submit_time, now, users=(stored_user[0], j.user))
                current = self.store.get_job(job_id)
            if j.state == "PENDING":
                order.append(job_id)
                requeued = current and (current.state == "REQUEUED" or (
                    current.state in ("RUNNING", "SUSPENDED") and (current.start_time or now) < queried_at - 1))
                if requeued:
                    # Bound before we asked Slurm, pending now: it was requeued (by a hook or an admin).
                    self.store.release(job_id, now=now)
                    # Slurm holds a requeued job back for AuthInfo's cred_expire (default 120 s): slurmd
                    # skips the Prolog of a job id whose credential it still caches, so starting it
                    # sooner would run it without its MIG instance. Sites lower cred_expire instead.
                    self.store.set_job_state(job_id, "PENDING", now=now, reason="requeued; waiting again")
            elif state in ("RUNNING", "SUSPENDED") and current and current.state == "PENDING":
                # Slurm's start time: the tick may see the job long after it started (controller restarted), even
                # suspended meanwhile (then it stayed PENDING here, out of the running jobs and their instances).
                self.store.set_job_state(job_id, "RUNNING", now=min(now, j.start_time or now),
                                         node=(j.nodes or [None])[0])
                if state == "SUSPENDED":
                    self.store.set_job_state(job_id, state, now=now)
            elif state in ("RUNNING", "SUSPENDED") and current and current.state in ("RUNNING", "SUSPENDED") \
                    and current.state != state:
                # `scontrol suspend` / `resume`: the job keeps its instances (Slurm keeps its GRES); the store
                # says which, as `jobs` and `status` show it (they said RUNNING for a suspended job).
                self.store.set_job_state(job_id, state, now=now)
            elif j.state in TERMINAL and current and current.state in ("PENDING", "REQUEUED"):
                # Ended without running on a MIG instance (e.g. cancelled while pending, or while it waited
                # after a requeue before a tick saw it pending again).
                self.store.set_job_state(job_id, j.state, now=now)
            elif j.state in TERMINAL and current and current.state in ("COMPLETED", "FAILED") \
                    and j.state != current.state \
                    and same_run(current, j, self.store.outcome(job_id, run=current.run)):
                # The Epilog reads exit status 0 for a job cancelled or timed out (seen on Slurm 22.05): its
                # COMPLETED is only a guess, Slurm's state is the fact.
                if self.store.correct_end_state(job_id, j.state, now=now):
                    self.store.add_event("end", f"job {job_id}: Slurm says it ended {j.state} (its Epilog reported "
                                         f"{current.state}, exit {format_exit_status(current.exit_code)})",
                                         node=current.node, job_id=job_id, now=now)
            if j.state != "PENDING" and j.suspend_time is not None and j.suspended_before_s is not None:
                # Suspended at some point (squeue's suspend_time): Slurm does not count that time against the limit
                # and moves the job's end on resume, so the policy's end estimate and the run time recorded for
                # it leave it out (Store.set_suspension).
                # Ended: suspended at its end only where Slurm ended it at its suspend time (killed while
                # suspended); one that ran after its last resume ended after it, though no tick saw it resumed.
                over = j.state not in ("RUNNING", "SUSPENDED")
                self.store.set_suspension(job_id, suspended_s=j.suspended_before_s,
                                          since=float(j.suspend_time) if j.state == "SUSPENDED" else None,
                                          ended=over, ran_to_end=over and j.end_time is not None
                                          and j.end_time > j.suspend_time)
        self.store.set_job_order(order)
        self._listed_ended = {**{k: v for k, v in self._listed_ended.items()
                                 if v[1] >= queried_at - LISTED_ENDED_MEMORY_S}, **listed_ended}
        # Pending (or requeued) jobs Slurm no longer lists were cancelled (or purged after MinJobAge). A job a
        # Prolog requeued after our squeue (one submitted meanwhile) is not in its answer: left for the next.
        # Ids only: every waiting job is read here, and all but the few gone are skipped.
        gone = self.store.job_ids(["PENDING"]) + [
            j.job_id for j in self.store.jobs(["REQUEUED"]) if j.updated_at < queried_at]
        for job_id in gone:
            if job_id in seen:
                continue
            # An array task Slurm started under an id of its own lives on as that job; an array record
            # (stored whole before its tasks were shown) lives on as its tasks; a task of a record still
            # waiting, no longer shown (past its limit or the look-ahead), waits in it to be shown again.
            lives_on = job_id in split or job_id.split("_")[0] in arrays
            if lives_on and self.store.forget_pending_job(job_id):
                if job_id in split:
                    self._carry_reservation(job_id, split[job_id], now)
                continue
            self.store.set_job_state(job_id, "CANCELLED", now=now, reason=NOT_IN_QUEUE)
        return ended

    def _ended_here_at(self, job) -> float:
        """When the store learned that ``job`` (ended) ended: its end time, or, where the end came from a message
        (an Epilog's end_time, on its node's clock; Slurm's EndTime), when that outcome was recorded, if later.
        An Epilog handled between a tick's squeue and its sync ended the job after Slurm's answer listed it
        live, whatever time the node's clock gave its end."""
        learned = job.end_time or job.updated_at
        outcome = self.store.outcome(job.job_id, run=job.run)
        return learned if outcome is None else max(learned, outcome.recorded_at)

    def _carry_reservation(self, task: str, job_id: str, now: float) -> None:
        """Array task ``task``, which Slurm now runs as ``job_id``: the instances the last decision reserved for it
        are ``job_id``'s. The policy's view and the job's Prolog look a started job's reservation up under its own
        id (the Prolog also under its task's, from Slurm's record): the view alone missed it, held the lowest free
        instance for the job while its Prolog took the reserved one, and planned a re-carve through that."""
        reservations = self._reservations_row()
        if task in reservations and job_id not in reservations:
            reservations[job_id] = reservations.pop(task)
            self.store.set_meta("reservations", reservations, now=now)

    def _final_end_states(self, listed_ended: set[str], looked: set, now: float) -> list[str]:
        """The end states of Epilog-reported outcomes that are final now, each given once, to be counted in
        jobs_finished_total: the job is in ``listed_ended`` (Slurm lists it as ended) and its outcome in
        ``looked`` (noted before this tick's _sync_jobs, which has put Slurm's state over the Epilog's where
        they differ), or its outcome was recorded END_STATE_WAIT_S ago (Slurm forgot the job, or runs the id
        again). An Epilog handled after that look (it waited for the store lock during the tick) waits for
        the next tick: counted now, it went in with its own guess, which the next tick corrects. Call once the tick's
        transaction has committed, and only on a tick whose Slurm query succeeded."""
        with self._unconfirmed_lock:
            due = [k for k, at in self._unconfirmed.items()
                   if (k[0] in listed_ended and k in looked) or now - at >= END_STATE_WAIT_S]
        if not due:
            return []
        # A run Slurm requeued as it killed it (its outcome REQUEUED, _revive) is not a job finished.
        states = [o.state for o in (self.store.outcome(job_id, run=run) for job_id, run in due)
                  if o is not None and o.state != "REQUEUED"]
        try:
            # Forgotten in the database before they are counted: a restart in between loses a count in a
            # process that is gone anyway, where the other order would count them again in the next one.
            self.store.delete_meta(uncounted_key(*key) for key in due)
        except SlurmMigError as exc:
            log.warning("could not clear %d counted job end(s) from the database (%s): counted at the next tick",
                        len(due), exc)
            return []
        with self._unconfirmed_lock:
            for key in due:
                self._unconfirmed.pop(key, None)
        return states

    def _eligible(self, entries, now: float) -> dict[str, tuple[str, ...] | None]:
        """Each pending queue entry's nodes (None: any), worked out once per kind of request: a queue is
        mostly jobs that ask for the same partition and nothing else, and an array's tasks share a record."""
        seen: dict[tuple, tuple[str, ...] | None] = {}
        out = {}
        for e in entries:
            j = e.job
            if not j.pending:
                continue
            sig = (j.partition, tuple(j.required_nodes), tuple(j.excluded_nodes), j.features, j.reservation,
                   j.time_limit_min, j.cpus, j.exclusive)
            if sig not in seen:
                seen[sig] = eligible_nodes(j, self._nodes_seen, self._reservations, now,
                                           cpus_fit=self.cfg.controller.cpu_full_nodes_wait)
            out[e.job_id] = seen[sig]
        return out

    def _revive(self, job_id: str, now: float, *, submit_time: float | None = None, requeued: bool = False) -> None:
        """A job the store has as ended is live in Slurm again: wait afresh, as a new run submitted when
        Slurm says (a reused id is a new job; Slurm gives a requeued batch job a new submit time, so that
        its next run is an accounting record of its own), else when the ended run was.

        ``requeued``: Slurm counts a restart of it. Requeued at its Epilog's end (Slurm's new submit time is the
        requeue's), the ended run did not complete or fail: Slurm requeued it as it killed it, which a node
        set DOWN (or failing) does without raising the Epilog's SLURM_JOB_RESTART_COUNT (seen on 22.05), so
        the Epilog took it for a job that exited 0. Its outcome says REQUEUED, as sacct lists such a run.
        Unless Slurm listed that run ended in the state of its outcome (COMPLETED, FAILED) to a tick before the
        requeue: it ended by its exit, and an admin requeued it after (`scontrol requeue` of a completed job, which
        Slurm allows until MinJobAge); a run requeued as it was killed is never listed so."""
        ended = self.store.get_job(job_id)
        outcome = self.store.outcome(job_id, run=ended.run) if ended is not None and requeued else None
        # Slurm's listing of this run as ended (by a tick before the one that saw it waiting again, perhaps), not of
        # an earlier run of the id: that one was kept under the run it ended.
        kept = self._listed_ended.get(job_id)
        listed = kept[2] if kept is not None and ended is not None and kept[0] == ended.run else None
        if outcome is not None and listed is not None and listed.state == outcome.state \
                and same_run(ended, listed, outcome):
            outcome = None  # ended by its exit, as Slurm said: requeued after it
        if outcome is not None and outcome.state in ("COMPLETED", "FAILED") and submit_time is not None \
                and outcome.end_time is not None and submit_time <= outcome.end_time + self._clock_margin() \
                and self.store.requeued_outcome(job_id, outcome.run):
            self.store.add_event("requeue", f"job {job_id}: run {outcome.run} was ended by a requeue (Slurm requeued "
                                 f"it as it killed it: its node set DOWN or failing), not {outcome.state} as its "
                                 f"Epilog read it; its outcome says REQUEUED", node=outcome.node, job_id=job_id,
                                 now=now)
        self.store.restart_job(job_id, now=now, reason="live in Slurm again after it ended here "
                               "(job id reused, or requeued after it ended)", submit_time=submit_time)
        self.store.add_event("reused", f"job {job_id}: live in Slurm again after it ended here; tracked as a new run",
                             job_id=job_id, now=now)
        log.warning("job %s is live in Slurm again after it ended here (id reused or requeued): tracked as a new run",
                    job_id)

    def _another_job_with_id(self, job, submit_time: float | None, now: float,
                             users: tuple[str, str] | None = None) -> None:
        """Slurm's job ``job.job_id``, submitted at ``submit_time``, is another job than the store's live run ``job``
        (:func:`another_job`): that run is over, its Epilog lost (a node crash as slurmctld lost its state) or
        still to come. Its bindings are released (they are not the new job's) and the new job is tracked as the
        next run, waiting from its own submission (the stored one where Slurm's is unknown). The ended run's
        outcome is left to its Epilog, which, late, goes under that run (_earlier_runs_epilog): Slurm's record of
        it is gone, the id now names the new job. ``users``: (the stored run's, Slurm's job's), said when they
        differ."""
        other = bool(users) and users_differ(*users)
        job_id, was = job.job_id, f"run {job.run} ({users[0]}'s, {job.state.lower()}" if other \
            else f"run {job.run} ({job.state.lower()}"
        was += f", started {_when(job.start_time)})" if job.start_time is not None else ")"
        whose = f"{users[1]}'s job" if other else "a job"
        when = f"submitted at {_when(submit_time)}" if submit_time is not None else "submitted at a time not known"
        self.store.release(job_id, now=now)
        self.store.restart_job(job_id, now=now, submit_time=submit_time,
                               reason="another job with this id (Slurm's state lost, or its ids wrapped)")
        self._ended_since.pop(job_id, None)
        msg = (f"job {job_id}: Slurm lists {whose} with this id {when}, after {was} here: "
               f"another job (slurmctld lost its state, or its ids wrapped); tracked as run {job.run + 1}, the "
               f"old run's instances released, its outcome left to its Epilog")
        self.store.add_event("reused", msg, node=job.node, job_id=job_id, now=now)
        log.warning("%s", msg)

    def _grace(self) -> float:
        """How long a node may take to report what it did (at least two health-check intervals)."""
        return max(EPILOG_GRACE_S, 2 * self.cfg.node.health_check_interval_s)

    def _lost_epilogs(self, jobs, now: float) -> dict[str, tuple[str, int | None, float, int]]:
        """Jobs that ran on a MIG instance and ended in Slurm, but whose Epilog never reported (killed,
        node lost) for longer than the grace period: ``{job_id: (state, exit_code, end_time, run)}`` from Slurm,
        ``run`` the store's run of the job id that it ends (asked outside the tick's transaction: a Prolog may
        make the id's next run meanwhile, which this record does not end).

        Without this a lost Epilog left the job RUNNING here forever, its binding held and its outcome
        never recorded. The grace period leaves a queued Epilog message time to arrive first (the node's
        next hook or health check delivers it): it has the node's own account and takes precedence.
        Slurm's record is read when the end is first seen, as Slurm forgets ended jobs after MinJobAge
        (300 s by default, maybe less than the grace period).
        """
        grace = self._grace()
        listed = {str(j.job_id): j for j in jobs}
        out = {}
        for job in self.store.running_jobs():
            sj = listed.get(job.job_id)
            if sj is not None and sj.state not in TERMINAL:
                self._ended_since.pop(job.job_id, None)
                continue
            first, record = self._ended_since.get(job.job_id, (now, None))
            if job.start_time is not None and first < job.start_time:
                # Made before this run started: a note on an earlier run of the id (reused, or requeued after
                # it ended), whose end and exit status are not this run's. This run waits its own grace.
                first, record = now, None
            if record is None and sj is not None \
                    and another_job(job, sj.submit_time, self._clock_margin(), user=sj.user, uid=sj.user_id,
                                     requeued=bool(sj.restart_cnt)):
                # Slurm's record is another job's with the id (another user's, or submitted after this run
                # started and never requeued: slurmctld lost its state, or its ids wrapped), ended before a tick
                # saw it live: its end is not this run's, which Slurm has forgotten as below.
                sj = None
            if record is None and sj is not None:
                detail = self.slurm.job_detail(job.job_id)
                if detail is not None and detail.state not in TERMINAL:
                    continue  # requeued meanwhile: the next ticks see it
                record = slurm_end(detail, sj.state, now, self._clock_margin(), listed_end=sj.end_time)
            self._ended_since[job.job_id] = (first, record)
            if now - first < grace:
                continue
            # Unseen while Slurm still listed it (the controller was down): Slurm has forgotten the job
            # (squeue answered this tick) and with it the exit status. It ended by the time a tick first found
            # it gone (not a grace period later, when it is settled): a guess its Epilog replaces if it comes.
            out[job.job_id] = (*(record or ("FAILED", None, first)), job.run)
        for job_id in [j for j, (t, _r) in self._ended_since.items() if j not in listed and now - t > 3600]:
            del self._ended_since[job_id]
        return out

    def _held_for_size(self, job, job_id: str) -> bool:
        """A job Slurm may hold only because the nodes it named (``-w``) advertise no slice of its size now.

        Slurm checks a pending job against its nodes' configured GRES, which slurm-mig sets at run time: a
        ``-w n1 --gres=mig:2g`` job accepted while n1 had a 2g, then tried once n1 was re-carved for others
        (its dependency met, a release after ``scontrol requeuehold``, any later try), is held with
        Reason=BadConstraints and priority 0; while held it was not carved for, and a release meanwhile was
        held again, so it waited for ever beside an idle GPU (seen on the demo cluster, 2026-11-27). Such a
        job is carved for on its nodes and released once one advertises its size (_release_held_for_size),
        until it has been held again MAX_SIZE_RELEASES times with its size there: then the hold is for something
        else. Held again after its node was re-carved for others meanwhile (it waited, released, while they ran),
        the hold is its size's again and does not count."""
        return (size_hold(job) and bool(job.required_nodes) and "_" not in job_id
                and self._size_releases.get(job_id, 0) < self.MAX_SIZE_RELEASES)

    MAX_SIZE_RELEASES = 2

    def _offered(self, job) -> list[str]:
        """The nodes ``job`` named that advertise its size (the intended layouts, as Slurm is told them)."""
        return [n for n in job.required_nodes
                if all((self.expected_gres(n) or {}).get(t, 0) >= c for t, c in job.mig.items())]

    def _note_held_again(self, jobs) -> None:
        """Count a release (_release_held_for_size) as spent when the job is first seen held again with its named
        node still advertising its size (as Slurm was told it when it held the job): held for something else
        (memory, say). Held again after its node was re-carved for others meanwhile (it waited, released, while
        they ran, and Slurm held it for its size as at first) it is not: counted, two such re-carves left the
        job neither carved for nor released, for ever (its user may not release a BadConstraints hold)."""
        for j in jobs:
            job_id = str(j.job_id)
            if job_id in self._size_released and size_hold(j):
                self._size_released.discard(job_id)
                if self._offered(j):
                    self._size_releases[job_id] = self._size_releases.get(job_id, 0) + 1

    def _release_held_for_size(self, jobs, now: float) -> int:
        """``scontrol release`` each job _held_for_size whose named node now advertises its size (as this tick
        set Slurm's counts: the intended layouts); returns how many were released.

        A job is released only if Slurm still holds it as BadConstraints when asked again just before (one
        ``squeue`` for all of them): ``jobs`` is the tick's squeue, and a user's or admin's ``scontrol hold``
        since then (Slurm then says JobHeldAdmin or JobHeldUser, seen on the demo cluster, 2026-11-27) would
        otherwise be undone by the release. Until 2026-11-27 the tick's answer decided, a window as long as
        the tick (its decision, the withdraw rounds, the GRES updates)."""
        done = 0
        waiting = set()
        due = []
        for j in jobs:
            job_id = str(j.job_id)
            if not j.wants_mig or not self._manages(j.partition):
                continue
            waiting.add(job_id)
            if not self._held_for_size(j, job_id):
                continue
            offered = self._offered(j)
            if offered:
                due.append((j, job_id, offered))
        still = None
        if due:
            fresh = self.slurm.jobs()
            if fresh is None:
                log.warning("squeue failed: the %d job(s) held BadConstraints are released next tick", len(due))
                due = []
            else:
                still = {str(f.job_id) for f in fresh if size_hold(f)}
        for j, job_id, offered in due:
            if job_id not in still:
                log.info("job %s is no longer held BadConstraints (held by its user or an admin, or released): "
                         "not released", job_id)
                continue
            self._size_released.add(job_id)
            try:
                self.slurm.scontrol_release(job_id)
            except SlurmMigError as exc:
                log.warning("scontrol release %s failed: %s", job_id, exc)
                continue
            what = ",".join(f"mig:{t}:{c}" for t, c in sorted(j.mig.items()))
            self.store.add_event("release", f"job {job_id}: Slurm held it (BadConstraints) while the node it named "
                                 f"did not advertise {what}; released now that {offered[0]} does", job_id=job_id,
                                 node=offered[0], now=now)
            log.info("job %s released from Slurm's BadConstraints hold: %s now advertises %s", job_id, offered[0],
                     what)
            done += 1
        for job_id in set(self._size_releases) - waiting:
            del self._size_releases[job_id]
        self._size_released &= waiting
        self._save_size_releases(now)
        return done

    def _save_size_releases(self, now: float) -> None:
        """Keep the release counts (_size_releases) and the jobs released and not yet held again (_size_released)
        in the store, when they changed since last saved: in the tick's sync transaction for the holds counted
        there, in a transaction of their own for the releases (made outside any, scontrol being slow)."""
        state = (dict(self._size_releases), set(self._size_released))
        if state == self._size_saved:
            return
        notes = {j: [self._size_releases.get(j, 0), j in self._size_released]
                 for j in sorted(set(self._size_releases) | self._size_released)}
        if notes:
            self.store.set_meta(SIZE_RELEASES, notes, now=now)
        else:
            self.store.delete_meta([SIZE_RELEASES])
        self._size_saved = state

    def _requeue_unbound(self, jobs, now: float) -> int:
        """Requeue MIG jobs Slurm has been running for a while with no instance bound anywhere.

        Slurm skips the Prolog of a job id whose credential slurmd still caches. It holds a requeued job
        back for cred_expire after the requeue, but the cache entry lives until cred_expire after that
        attempt's Epilog ended, a little later: a job started on the same node in between runs without
        its Prolog, so without its MIG instance (the TaskProlog then shows it no GPU). Seen on the local
        cluster (slurmd: "reissued job credential for job N", no Prolog). Requeued again, it gets its
        Prolog the next time. The grace period leaves time for a binding the node made alone to arrive.

        And a job is requeued only once its node has reported since its Prolog could have bound it (a report
        received _unlisted_binding_wait after the start): the report lists the node's binding files, so one
        that does not show the job's means there is none. Until 2026-11-26 the grace alone decided, so the
        first tick of a controller back from an outage requeued, killing them, the jobs that had started
        meanwhile on instances the node bound alone, their messages still in its outbox.
        """
        grace = self._grace()
        done = 0
        bound = None
        for j in jobs:
            if j.state != "RUNNING" or not j.wants_mig or not j.start_time or now - j.start_time < grace:
                continue
            heard = [self._reported_at.get(n) for n in (j.nodes or [None])]
            if any(h is None or h[0] - j.start_time < self._unlisted_binding_wait() for h in heard):
                continue  # its node has not reported its binding files since: one may be there
            if any(str(j.job_id) in h[1] for h in heard):
                continue  # a binding file names it: one the report could not adopt (the job was not known yet)
            if bound is None:
                bound = {job_id for job_id, _node, _b in self.store.live_bindings()}
            job_id = str(j.job_id)
            if job_id in bound:
                continue
            job = self.store.get_job(job_id)
            if job is None or job.state in TERMINAL:
                continue
            reason = "started without its Prolog (no MIG instance bound); requeued to get one"
            log.warning("job %s %s", job_id, reason)
            if not self._requeue_saying(job_id, reason):
                continue
            self.store.add_event("requeue", f"job {job_id}: {reason}", node=(j.nodes or [None])[0], job_id=job_id,
                                 now=now)
            self.metrics.inc("slurm_mig_requeues_total", (("reason", "no_prolog"),))
            done += 1
        return done

    def _requeue_saying(self, job_id: str, reason: str, *, hold: bool = False) -> bool:
        """Requeue a job (and hold it, with ``hold``), the reason in its AdminComment (its Comment is the
        user's); False, logged, when Slurm refused."""
        try:
            run = getattr(self.slurm, "run", None)
            if run is not None:
                run(["scontrol", "update", f"JobId={job_id}", f"AdminComment=slurm-mig: {reason}"])
            self.slurm.scontrol_requeue(job_id, hold=hold)
        except SlurmMigError as exc:
            log.warning("requeue%s of %s failed: %s", "-hold" if hold else "", job_id, exc)
            return False
        return True

    def _settle_lost_epilogs(self, lost: dict, now: float) -> list[str]:
        """Record the outcome of jobs whose Epilog was lost; the states of those recorded, for the caller to
        count once its transaction has committed (a rolled-back tick settles them again)."""
        finished = []
        for job_id, (state, exit_code, end, run) in lost.items():
            job = self.store.get_job(job_id)
            if job is None or job.state not in ("RUNNING", "COMPLETING", "SUSPENDED"):
                continue  # the Epilog's report arrived meanwhile
            if job.run != run:
                # A Prolog made the id's next run after _lost_epilogs looked (another job with the id started:
                # on_prolog's _another_job_with_id) and bound it: Slurm's record is the run before's, whose end
                # is left to its Epilog as _another_job_with_id says. Until 2026-11-27 it ended the new run and
                # released its instances under it.
                continue
            # Without Slurm's record (it had forgotten the job): FAILED, no exit status, a guess (FORGOTTEN).
            guess = self._ended_since.get(job_id, (None, None))[1] is None
            recorded = self.store.record_outcome(job_id, state=state, exit_code=exit_code, end_time=end, now=now,
                                                 guessed=guess)
            # Ended at Slurm's EndTime, not now, a grace period (or an outage) later; releases its binding.
            self.store.set_job_state(job_id, state, now=now, exit_code=exit_code, end_time=end,
                                     reason=FORGOTTEN if guess else None)
            self._ended_since.pop(job_id, None)
            how = "from Slurm's record" if exit_code is not None else "without an exit status (Slurm had none to give)"
            self.store.add_event("end", f"job {job_id} ended ({state}) without an Epilog report; outcome {how}",
                                 node=job.node, job_id=job_id, now=now)
            log.warning("job %s ended (%s) but its Epilog never reported; outcome recorded %s", job_id, state, how)
            if recorded:
                finished.append(state)
        return finished

    def _sync_nodes(self, nodes) -> None:
        self._no_free_cpu = {n.name for n in nodes if n.cpus and n.alloc_cpus is not None and n.alloc_cpus >= n.cpus
                             } if self.cfg.controller.cpu_full_nodes_wait else set()
        for n in nodes:
            state = "up" if n.available else ("drain" if n.drained else "down")
            self.store.upsert_node(n.name, state=state)
            # slurmd re-registers now and then (every ~20 pings) with slurm.conf's Gres= counts. If their total
            # differs from the total set at run time while jobs hold mig instances (or is lower at any time),
            # Slurm marks the node DRAIN+INVALID_REG, which RESUME does not clear (docs/reliability.md, "Slurm
            # drains a node on re-registration"). Say so, once per episode.
            invalid = "INVALID_REG" in n.flags and "mig" in (n.reason or "")
            if invalid and n.name not in self._invalid_reg:
                msg = (f"Slurm drained {n.name}: {n.reason}. slurmd re-registered with slurm.conf's mig count, "
                       f"which differs from the count slurm-mig set for the node's current layouts; the node "
                       f"recovers at a registration whose count matches (set Gres= to slurm.conf's value, "
                       f"restart slurmd, resume). A constant total (mig:pad in slurm.conf) prevents it. "
                       f"See docs/reliability.md")
                log.error("%s", msg)
                self.store.add_event("gres", msg, node=n.name)
            if invalid:
                self._invalid_reg.add(n.name)
            else:
                self._invalid_reg.discard(n.name)

    def _expire_journal(self, now: float) -> None:
        for e in self.store.open_journal_entries():
            if now - e.updated_at > JOURNAL_TIMEOUT_S:
                self.store.journal_finish(e.id, "abandoned", error="no node reported carrying it out", now=now)
                self.store.add_event("journal", f"reconfiguration {e.id} of {e.node}/{e.gpu} abandoned",
                                     node=e.node, now=now)

    def _plan(self, now: float) -> "_Plan":
        """Ask the policy (or the fallback) about the stored state; nothing is written but metrics (and a
        policy failure's event)."""
        for key, held in self._policy_failures.ended(now):
            which, name, kind = (key.split("\0") + ["?", "?", "?"])[:3]
            log.warning("%s policy %s: %d more failure(s) (%s) since the last line about them, not logged, and none "
                        "in the last %.0f s", which, name, held, kind, POLICY_FAIL_LOG_EVERY_S)
        # A started job the Prolog has not bound holds, in the policy's view, the instance its Prolog will
        # choose: its reservation from the last tick when that is free (store.cluster_state, _prolog_choice).
        reservations = self._reservations_row()
        held = self._held_row()
        state = self.store.cluster_state(
            now, stale_after_s=self.cfg.controller.node_stale_after_s,
            prolog_choice=lambda *job: self._prolog_choice(*job, reservations=reservations, held=held))
        if self._no_free_cpu:
            # Slurm starts nothing on a node without a free CPU, whatever its slices: carved for there, jobs
            # waited while other nodes' GPUs sat idle (seen with 8-CPU nodes and 14 1g slices each).
            state = replace(state, gpus=tuple(replace(g, available=False) if g.node in self._no_free_cpu else g
                                              for g in state.gpus))
        gpu_nodes = {g.node for g in state.gpus}
        if self.cfg.controller.cpu_full_nodes_wait:
            # The CPU counts eligibility reads, for the policy to count those it promises within one decision:
            # two jobs placed on a node with CPUs for one, the second waited there for Slurm until the next
            # tick moved it, its carve made. Not where CPUs are oversubscribed (Slurm starts both there).
            free = tuple(sorted((n.name, max(0, n.cpus - n.alloc_cpus)) for n in self._nodes_seen
                                if n.name in gpu_nodes and n.cpus is not None and n.alloc_cpus is not None))
            if free:
                state = replace(state, free_cpus=free)
        cpus = self._job_cpus if state.free_cpus is not None else {}
        if any(self._job_nodes.get(j.job_id) is not None or j.job_id in cpus for j in state.pending):
            # Carved on a node Slurm will not start it on (another partition, --exclude, a maintenance
            # window, its CPUs), a job waited beside idle nodes it could use (controller/eligibility.py).
            mine: dict[int, tuple[str, ...] | None] = {}

            def on_gpu_nodes(nodes: tuple[str, ...] | None) -> tuple[str, ...] | None:
                """The GPU nodes of ``nodes``; None when that is all of them (the policy's fast path)."""
                if nodes is None:
                    return None
                if id(nodes) not in mine:
                    kept = tuple(n for n in nodes if n in gpu_nodes)
                    mine[id(nodes)] = None if len(kept) == len(gpu_nodes) else kept
                return mine[id(nodes)]

            def job(j: PendingJob) -> PendingJob:
                c, whole = cpus.get(j.job_id, (None, False))
                return replace(j, nodes=on_gpu_nodes(self._job_nodes.get(j.job_id)), cpus=c, exclusive=whole)

            state = replace(state, pending=tuple(map(job, state.pending)))
        self.metrics.clear_gauge("slurm_mig_queue_depth")
        depth: dict[str, int] = {kind_of_gres(t): 0 for t in GRES_TYPES}
        for j in state.pending:
            depth[j.profile] = depth.get(j.profile, 0) + 1
        for p, n in depth.items():
            self.metrics.set("slurm_mig_queue_depth", (("profile", p),), n)
        if not state.gpus:
            return _Plan(state)
        t0 = time.perf_counter()
        decision, used = None, self.policy
        try:
            decision = self.policy.decide(state)
            check_decision(state, decision)
        except Exception as exc:  # a policy bug must not stop the cluster: use the fallback
            self.metrics.inc("slurm_mig_policy_errors_total", (("policy", self.policy.name),))
            more = self._policy_failure_said("live", self.policy.name, exc, now)
            if more is not None:
                log.error("policy %s failed or was unsafe: %s; using %s%s", self.policy.name, exc,
                          self.fallback.name if self.fallback else "nothing", more)
                self.store.add_event("policy", f"policy {self.policy.name} failed: {exc}{more}", now=now)
            decision = None
            if self.fallback is not None:
                used = self.fallback
                decision = self.fallback.decide(state)
                check_decision(state, decision)
        latency = (time.perf_counter() - t0) * 1000
        self.metrics.observe("slurm_mig_policy_latency_seconds", latency / 1000, (0.001, 0.01, 0.1, 0.5, 1, 5))
        if decision is None:
            return _Plan(state)
        busy_gpus = {(e.node, e.gpu) for e in self.store.open_journal_entries()}
        changes = []
        for ch in decision.changes:
            if (ch.node, ch.gpu) in busy_gpus:
                continue  # one reconfiguration at a time per GPU
            g = state.gpu(ch.key)
            steps = plan_transition(g.layout, ch.target, g.locked)
            if steps:
                changes.append((ch, g.layout, steps))
        return _Plan(state, decision, used, latency, changes)

    def _commit(self, plan: "_Plan", now: float, held_back: set[str] = frozenset()) -> dict:
        """Record the plan's decision and its desired layouts, except on nodes in ``held_back``."""
        state, decision, used = plan.state, plan.decision, plan.used
        if decision is None or (not state.pending and not decision.changes):
            # Nothing to place (an idle queue, one whose jobs Slurm will not start, or a cluster whose nodes
            # have not reported a GPU yet). The reservations row is still the tick `status` reads.
            self.store.set_meta("reservations", {}, now=now)
            self.store.set_meta("held", {}, now=now)
            if decision is None:
                self._last_signature = None  # the next decision is recorded, whatever it says
                return {"pending": len(state.pending), "changes": 0}
            # Recorded once when the queue goes quiet (the same tick after tick is not recorded again): it ends
            # the waits before it, so a job released or requeued into the wait it had before is a new span in
            # explain, and its decision is recorded, not taken for the one from before the hold.
            signature = _signature(decision)
            if signature != self._last_signature:
                self._last_signature = signature
                self.store.record_decision(decision, state=state, latency_ms=plan.latency, now=now)
            if self.shadow is not None:
                self._shadow_state = state  # the shadow's history goes quiet too (_run_shadow: recorded once)
            return {"pending": 0, "changes": 0, "policy": used.name}
        signature = _signature(decision)
        decision_id = None
        if signature != self._last_signature:
            # The same decision tick after tick (jobs waiting for the same reason) is recorded once.
            self._last_signature = signature
            decision_id = self.store.record_decision(decision, state=state, latency_ms=plan.latency, now=now)
        applied = 0
        moved = self._moved_since_plan(plan)
        for ch, layout, steps in plan.changes:
            if ch.node in held_back:
                continue
            if (ch.node, ch.gpu) in moved:
                msg = (f"{ch.key}: {layout} -> {ch.target} not made: {moved[(ch.node, ch.gpu)]} after it was "
                       f"decided; decided again next tick")
                log.info("%s", msg)
                self.store.add_event("layout", msg, node=ch.node, details={"decision": decision_id}, now=now)
                continue
            self.store.set_desired(ch.node, ch.gpu, ch.target, used.name, ch.reason, now=now)
            self.store.journal_begin(ch.node, ch.gpu, layout, ch.target, steps, decision_id=decision_id,
                                     started=False, now=now)
            self.store.add_event("layout", f"{ch.key}: {layout} -> {ch.target} ({ch.reason})", node=ch.node,
                                 details={"decision": decision_id}, now=now)
            applied += 1
        self.store.set_meta("reservations", {a.job_id: {"node": a.node, "instances": [[gi, s.profile, s.start]
                                                                                       for gi, s in a.instances]}
                                             for a in decision.assignments}, now=now)
        self.store.set_meta("held", self._held_regions(decision, state), now=now)
        if self.shadow is not None:
            self._shadow_state = state  # decided by tick() after this transaction (_run_shadow)
        return {"pending": len(state.pending), "changes": applied, "assignments": len(decision.assignments),
                "policy": used.name}

    def _moved_since_plan(self, plan: "_Plan") -> dict[tuple[str, int], str]:
        """GPUs of the plan's changes that node requests changed between the tick's two transactions, and how.

        The plan was made on the first transaction's state; a Prolog served in between (one that waited on the
        store's lock while the policy ran, its job started before the tick's squeue) may have bound its job to an
        instance the change destroys (its policy's reservation from the last tick, an instance the plan did
        not count as promised to it) or begun a re-carve there, and a report may show an instance now in use.
        Committed, such a change was a desired layout the node refuses while the job runs, with Slurm told of its
        instances (a job waited beside an idle one for as long). Its GPU is decided again next tick."""
        out: dict[tuple[str, int], str] = {}
        targets = {(ch.node, ch.gpu): ch.target for ch, _layout, _steps in plan.changes}
        if not targets:
            return out

        def kept(key: tuple[str, int], profile: str, start: int) -> bool:
            target = targets[key]
            try:
                return Slot(start, target.model.profile(profile).name) in target.slots
            except SlurmMigError:
                return False

        for node in sorted({n for n, _gpu in targets}):
            for e in self.store.open_journal_entries(node):  # none at planning: _plan leaves such GPUs alone
                if (node, e.gpu) in targets:
                    out.setdefault((node, e.gpu), f"reconfiguration {e.id} began there")
            for jid, _node, b in self.store.live_bindings(node):
                if (node, b.gpu) in targets and not kept((node, b.gpu), b.profile, b.start):
                    out.setdefault((node, b.gpu), f"job {jid} was bound to {b.profile}@{b.start} there")
            for i in self.store.observed_instances(node):
                if i.in_use and (node, i.gpu) in targets and not kept((node, i.gpu), i.profile, i.start):
                    out.setdefault((node, i.gpu), f"{i.profile}@{i.start} was reported in use there")
        return out

    def _run_shadow(self, state, now: float) -> None:
        """What the shadow policy would have decided on ``state``, recorded and never acted on. Run after
        the tick's transaction: it changes nothing, so the node requests waiting on the store's lock must
        not wait for it too (a candidate may be slower than the live policy).

        Recorded, as the live policy's (the same _signature), only when it differs from the last shadow
        decision recorded or comes from another policy or version: recorded every tick, a shadow whose decision
        repeated filled the decisions' size budget ([controller].keep_decisions_mb) and pushed the live
        decisions, the ones explain reads, out of the history."""
        try:
            sd = self.shadow.decide(state)
            signature = _signature(sd)
            if signature == self._last_shadow_signature:
                return
            self.store.record_decision(sd, state=state, shadow=True, now=now)
            self._last_shadow_signature = signature
        except Exception as exc:
            more = self._policy_failure_said("shadow", self.shadow.name, exc, now)
            if more is not None:
                log.warning("shadow policy %s failed: %s%s", self.shadow.name, exc, more)

    def _policy_failure_said(self, which: str, name: str, exc: Exception, now: float) -> str | None:
        """Whether to say a policy's failure now: None to hold it back (each policy, live or shadow, and kind of
        failure is said once every POLICY_FAIL_LOG_EVERY_S); else what the line ends with, the number held back
        since the last line about it ("" for none)."""
        held = self._policy_failures.say(f"{which}\0{name}\0{type(exc).__name__}", now)
        if held is None:
            return None
        return f" ({held} more such failures since the last line about them, not logged)" if held else ""

    def _withdraw_first(self, plan: "_Plan", jobs, nodes, gres_now: dict, now: float):
        """Take instances a plan destroys out of Slurm's counts before the plan is committed.

        Slurm allocates jobs against the counts it has until the new ones arrive. A job it starts
        between our squeue and our Gres update holds an instance the plan is about to destroy, and
        its Prolog then finds no room (or takes another job's) and requeues it: seen on the demo
        cluster, where one backfill pass started 14 jobs 20-500 ms after the squeue. So a node
        whose counts would drop first gets the lower of old and new counts per type (nothing new
        is advertised yet), then squeue is asked again: if Slurm started a MIG job on such a node
        meanwhile, the tick decides again with it; after WITHDRAW_ROUNDS such rounds, or if a
        step fails, that node's changes wait for the next tick. Returns the plan to commit, the
        jobs and time it saw, and the nodes held back.
        """
        by_name = {n.name: n for n in nodes}
        held_back: set[str] = set()
        for rounds in range(1, WITHDRAW_ROUNDS + 1):
            # Worked out and written under the lock, as in _assert_gres: not over a Prolog's lower_held_counts.
            with self._gres_lock:
                shrinking = self._shrinking(plan, gres_now)
                if not shrinking:
                    return plan, jobs, now, held_back
                held_back = set()
                for node, low in shrinking.items():
                    pad_to = self._pad_total(by_name[node], low, self._pad_gpus(node, self.intended_layouts(node)),
                                             now)
                    if self._write_gres(node, low, pad_to, now, "; its re-carve waits"):
                        gres_now[node] = low if pad_to is None else {**low, PAD_TYPE: pad_to - sum(low.values())}
                    else:
                        held_back.add(node)
            # The clock before the query: a job bound while squeue runs is listed PENDING in its answer,
            # and only a binding older than the query may be read as "requeued" (see _sync_jobs).
            queried_at = self.clock()
            fresh = self.slurm.jobs()
            if fresh is None:
                log.warning("Slurm query failed after withdrawing instances on %s: their re-carve waits",
                            ", ".join(sorted(shrinking)))
                return plan, jobs, now, set(shrinking)
            slipped = _started_since(jobs, fresh, set(shrinking) - held_back)
            jobs, now = fresh, self.clock()
            if not slipped:
                return plan, jobs, now, held_back
            self.metrics.inc("slurm_mig_gres_races_total", by=len(slipped))
            msg = (f"Slurm started job(s) {', '.join(j for j, _n in slipped)} on "
                   f"{', '.join(sorted({n for _j, n in slipped}))} while their counts were being changed; "
                   f"deciding again with them")
            log.info("%s", msg)
            if rounds == WITHDRAW_ROUNDS:
                held_back |= set(shrinking)
                msg += f"; still changing after {rounds} rounds, so those nodes keep their layouts this tick"
            said = None
            try:
                with self.store.transaction():
                    # As in the tick's first transaction: what _sync_jobs notes as said (a job submitted since,
                    # whose request cannot be served) is forgotten with its event if this rolls back.
                    said = (set(self._invalid_reg), set(self._unservable))
                    self.store.add_event("gres", msg, node=slipped[0][1], now=now)
                    if rounds < WITHDRAW_ROUNDS:
                        self._sync_jobs(fresh, now, queried_at)
                        plan = self._plan(now)
            except BaseException:
                if said is not None:
                    self._invalid_reg, self._unservable = said
                raise
        return plan, jobs, now, held_back

    def _cannot_withdraw(self, plan: "_Plan") -> set[str]:
        """Nodes whose re-carve would lower their counts, on a tick Slurm could not be asked: held back.

        Committed, the re-carve would destroy instances Slurm still advertises and may hand out.
        """
        told = {}
        for node in {ch.node for ch, _layout, _steps in plan.changes}:
            counts = self.expected_gres(node)
            if counts is not None:
                told[node] = counts
        held = set(self._shrinking(plan, told))
        if held:
            log.warning("Slurm could not be asked this tick: re-carves that take instances away on %s wait",
                        ", ".join(sorted(held)))
        return held

    def _shrinking(self, plan: "_Plan", gres_now: dict) -> dict[str, dict[str, int]]:
        """Nodes whose Slurm counts the plan lowers: node -> per type the lower of now and after the plan.
        The plan lowers them by re-carving, or by holding instances back for a reservation (its decision's
        held regions, as _commit records them; intended_layouts).

        ``gres_now``: node -> the counts Slurm has; nodes not in it are left out."""
        targets: dict[str, dict[int, Layout]] = {}
        for ch, _layout, _steps in plan.changes:
            targets.setdefault(ch.node, {})[ch.gpu] = ch.target
        held = self._held_regions(plan.decision, plan.state) if plan.decision is not None else {}
        assigned = _assigned(plan.decision) if plan.decision is not None else {}
        for regions in held.values():
            for n, *_rest in regions:
                targets.setdefault(n, {})
        out = {}
        for node, changed in targets.items():
            if node not in gres_now:
                continue
            layouts = self.intended_layouts(node, held=held, assigned=assigned)
            layouts.update({gi: lay for gi, lay in changed.items() if gi in layouts})
            after = _gres_counts(layouts)
            if after is None:
                continue
            cur = {t: gres_now[node].get(t, 0) for t in GRES_TYPES}
            low = {t: min(cur[t], after.get(t, 0)) for t in GRES_TYPES}
            if low != cur:
                out[node] = low
        return out

    def _held_regions(self, decision, state) -> dict[str, list[list]]:
        """The decision's held regions as the meta row "held" keeps them (_held_regions_of); none with
        ``[controller] hold_reserved = false`` (Slurm is told of every instance, and another job may take one
        in a reserved region: no requeues of such jobs, but a large job may wait behind a stream of small ones)."""
        if not self.cfg.controller.hold_reserved:
            return {}
        def bound(node: str, gpu: int) -> set[Slot]:
            return {Slot(b.start, b.profile) for _jid, _n, b in self.store.live_bindings(node) if b.gpu == gpu}
        return _held_regions_of(decision, state, bound, set(self._held_row()))

    def intended_layouts(self, node: str, *, held: dict | None = None, assigned: set | None = None
                         ) -> dict[int, Layout]:
        """Each GPU's layout that exists or is about to exist: the desired one when set and reachable from
        what exists without destroying a busy instance (as a Prolog binds, binding.intended_layout), else
        observed. Told the unreachable one, Slurm started jobs on instances nobody could make. These are the
        counts Slurm is told.

        Less what the regions the policy holds for waiting jobs keep from Slurm (``held``: job id -> [[node, gpu,
        mask, the region's instances idle in the decision's view, those promised to started jobs], ...], the
        last decision's, the meta row "held" when not given), so that a region drains for its reserved job (a
        Prolog does not hand out its instances either: binding.choose_binding's keep_off):

        * an idle instance there (no live job bound to it, none reporting it in use), unless a pending re-carve of
          the GPU is still to make it (one the re-carve keeps is no exception: the re-carve may be another job's,
          outside the region), an assignment names it (``assigned``: (node, gpu, slot) of the decision's
          assignments, the meta row "reservations" when not given; the reserved job's own, or the policy's
          backfill) or it is promised to a job Slurm started whose Prolog has not bound it;
        * and a busy one there, of a type the node has no idle instance of outside such regions and that the
          one job whose region holds it does not wait for: Slurm frees a job's GRES the moment it ends and starts the next
          job of that size at once, before any tick (0.13 s after on the demo cluster), so counted, each end
          let a later job start on the freed instance, only for its Prolog to requeue it, and the next, each
          requeue freeing the count again. Left out, Slurm's count of that type is below what its jobs hold,
          and it starts none there (measured on the local 22.05 cluster: no drain, no job started, jobs running
          on; section 5b of docs/reliability.md). The cost: a job of that type ending outside the regions frees
          nothing in Slurm either, until the next tick counts its idle instance (and the busy ones with it).
          Where the node has an idle instance of that type outside, the busy ones stay counted, or Slurm would
          not start a job there either; so they do in a region held for a job of their type (Slurm starts the
          highest of its order there, the holder, whose Prolog binds it; not where the holder asks for several
          instances: one end frees one), but not in another job's region on the same node (its end started that
          holder, whose Prolog was kept off the region and requeued it)."""
        listed: dict[int, int] = {}
        promised: dict[int, set[Slot]] = {}
        owners: dict[int, list[tuple[int, str]]] = {}  # GPU -> (mask, holder) of each region held there
        for jid, gi, mask, given in held_regions(self._held_row() if held is None else held, node):
            owners.setdefault(gi, []).append((mask, jid))
            listed[gi] = listed.get(gi, 0) | mask
            promised.setdefault(gi, set()).update(given)
        if listed and assigned is None:
            rows = self._reservations_row()
            assigned = {(node, gi, s) for jid in rows for gi, s in self._reservation(jid, node, rows)}
        out: dict[int, Layout] = {}
        inside: dict[int, list[Slot]] = {}  # GPU -> busy instances in a held region, counted unless absorbed
        idle_types: set[str] = set()  # the types of the idle instances Slurm is told of
        rows = self._gpu_rows(node)
        bindable = busy_of = None
        for g in rows:
            obs = g.observed
            if obs is None or not g.mig_enabled:
                continue
            if g.blocked:
                # Left as it is, and no new job goes there: Slurm is told of the instances jobs hold, not of
                # the idle ones (it would start jobs there that could only be requeued).
                if busy_of is None:
                    busy_of = self._busy_starts(node)
                busy = busy_of.get(g.index, set())
                out[g.index] = obs.without(s for s in obs.slots if s.start not in busy)
                continue
            lay = g.desired
            if lay is not None and lay.slots != obs.slots:
                if bindable is None:  # the rows read once; the bindings only where a desired layout differs
                    bindable = {x.index: x for x in node_gpus(rows, self._held(node, {}, exclude_job=""))}
                if g.index in bindable:
                    lay = intended_layout(bindable[g.index])
            lay = lay if lay is not None else obs
            if not listed:
                out[g.index] = lay
                continue
            mask, mine = listed.get(g.index, 0), promised.get(g.index, set())
            if busy_of is None:
                busy_of = self._busy_starts(node)
            busy = busy_of.get(g.index, set())
            drop = []
            for s in lay.slots:
                taken = s.start in busy or s in mine
                if not (overlaps(lay.model, s, mask) and s in obs.slots
                        and (node, g.index, s) not in assigned):
                    if not taken:
                        idle_types.add(slot_type(lay, s))
                elif taken:
                    inside.setdefault(g.index, []).append(s)
                else:
                    drop.append(s)
            out[g.index] = lay.without(drop) if drop else lay
        sizes = self._sizes_of({jid for regions in owners.values() for _m, jid in regions}) if inside else {}
        for gi, slots in inside.items():
            lay = out[gi]
            absorbed = []
            for s in slots:
                size = slot_type(lay, s)
                # Only its holder's Prolog may bind it (binding.choose_binding's keep_off): one job's regions.
                holders = {jid for m, jid in owners[gi] if overlaps(lay.model, s, m)}
                if size not in idle_types and not (len(holders) == 1 and sizes.get(holders.pop()) == size):
                    absorbed.append(s)
            if absorbed:
                out[gi] = lay.without(absorbed)
        return out

    def _sizes_of(self, jobs) -> dict[str, str]:
        """Job id -> the GRES type the stored job asks for, for each of ``jobs`` the store holds that asks for one
        instance: Slurm cannot start one asking for several on the single instance an end frees (it starts a later
        job of that size there, whose Prolog is kept off the region). The store keeps a job's geometry kind
        (mig_size_request: "1g.dm", "1g+me", not the types "1gdm", "1gme")."""
        out = {}
        for jid in jobs:
            job = self.store.get_job(jid)
            if job is not None and job.count == 1:
                try:
                    out[jid] = gres_type_for_kind(job.profile)
                except GeometryError:
                    try:
                        out[jid] = gres_type_for_profile(job.profile)
                    except GeometryError:
                        pass
        return out

    def _busy_starts(self, node: str) -> dict[int, set[int]]:
        """GPU index -> where the instances of ``node``'s GPU that are in use or bound to a live job start (two
        reads for the node, not two per GPU)."""
        busy: dict[int, set[int]] = {}
        for i in self.store.observed_instances(node):
            if i.in_use:
                busy.setdefault(i.gpu, set()).add(i.start)
        for _jid, _node, b in self.store.live_bindings(node):
            busy.setdefault(b.gpu, set()).add(b.start)
        return busy

    def _pad_gpus(self, node: str, layouts: dict) -> int:
        """How many GPUs node ``node``'s padded mig total counts (7 each): every GPU it reports, usable or not
        (MIG off after a driver reload, fallen off the bus). slurm.conf's total is 7 per GPU; a lower total
        set at run time drains the node at slurmd's next registration. A GPU its node names no model for (no
        model, but a UUID: a display GPU, a part outside the node's tables) is left out, as slurm.conf leaves it;
        a lost one reports neither. One the node names a model for that this controller's tables do not list (a
        newer node's, during a rolling upgrade) is counted: slurm.conf counts it for the node's slurm-mig, and
        its 7 are padding until the controller knows it (intended_layouts leaves it out). So is one it names no
        model for that holds MIG instances (a part its own tables do not list, such as 'H20 HBM3e' since
        555c03e): a MIG GPU, not a display one; left out, a node of only such GPUs counted none, got no counts
        written at all, and Slurm went on advertising their idle instances (slurm.conf's mix, after any
        registration), starting jobs there that every Prolog requeued."""
        carved = {i.gpu for i in self.store.observed_instances(node)}
        return max(len(layouts), len([g for g in self.store.observed_gpus(node)
                                      if g.model or not g.uuid or g.gpu in carved]))

    def expected_gres(self, node: str) -> dict[str, int] | None:
        """GRES type -> instances the node's intended layouts hold; None when it has no MIG GPU."""
        return _gres_counts(self.intended_layouts(node))

    def _assert_gres(self, nodes, jobs, now: float, gres_now: dict | None = None, *,
                     read_at: float | None = None) -> int:
        """Make Slurm's GRES match the intended layouts; nudge nodes that pending jobs could use.

        ``gres_now``: node -> counts set since ``nodes`` was read (by the withdrawal step).
        ``read_at``: when ``nodes`` was read (``now`` when not given): the time of the event saying what
        Slurm had.
        """
        updates = 0
        pending_types = {t for j in jobs if j.pending and j.wants_mig for t in j.mig}
        held = self._held_row()
        for n in nodes:
            # Worked out and written under the lock: a Prolog's lower_held_counts between the two would be undone
            # by counts worked out before it, until the next tick.
            with self._gres_lock:
                updates += self._assert_node_gres(n, pending_types, held, now, gres_now, read_at)
        return updates

    def _assert_node_gres(self, n, pending_types: set, held: dict, now: float, gres_now: dict | None,
                          read_at: float | None) -> int:
        """_assert_gres for node ``n`` (the caller holds _gres_lock); 1 when Slurm's counts were written."""
        layouts = self.intended_layouts(n.name, held=held)
        expected = _gres_counts(layouts)
        gpus = self._pad_gpus(n.name, layouts)
        if expected is None:
            if not gpus:
                return 0  # the node never reported a GPU: nothing known to correct
            # The node reports GPUs but none holds MIG instances any more: Slurm must not keep
            # advertising the instances that were there, or it starts jobs on slices that do not exist.
            expected = {t: 0 for t in GRES_TYPES}
        told = (gres_now or {}).get(n.name, n.gres)  # as read, or as the withdrawal step set it since
        current = {t: told.get(t, 0) for t in GRES_TYPES}
        self._gres_now[n.name] = current
        pad_to = self._pad_to[n.name] = self._pad_total(n, expected, gpus, now)
        last = self._gres_set.get(n.name)
        stale = current != expected or (pad_to is not None and told.get(PAD_TYPE) != pad_to - sum(expected.values()))
        # FACTS §4: Slurm does not reconsider a pending job whose type came back until another Gres
        # update; re-issuing the same value un-sticks it. Rate-limited per node.
        could_help = any(expected.get(t, 0) > (n.gres_used or {}).get(t, 0) for t in pending_types)
        nudge = could_help and (last is None or now - last[1] > 3 * self.cfg.controller.tick_interval_s)
        if not stale and not nudge:
            self._note_gres_held(n.name, current, now if read_at is None else read_at)
            return 0
        why = self._gres_changed_by_slurm(n, current) if stale else ""
        if not self._write_gres(n.name, expected, pad_to, now):
            return 0
        if stale:
            self.metrics.inc("slurm_mig_gres_reasserted_total", (("node", n.name),))
            self.store.add_event("gres", f"{n.name}: Slurm had {_fmt(current)}, set {_fmt(expected)}{why}",
                                 node=n.name, now=now if read_at is None else read_at)
        return 1

    def lower_held_counts(self, node: str, now: float) -> bool:
        """Lower ``node``'s counts in Slurm, now, to what its layouts hold less the regions held for waiting jobs
        (intended_layouts), where they are above it; never raised (that is the tick's, after its checks). True
        when a count was lowered.

        For a Prolog refusing its job the instances such a region holds: Slurm started the job on an instance
        freed since the last tick, and once its requeue frees the count again it starts the next job of that
        size there at once, and the next (three requeues within 0.9 s for each instance freed on the demo
        cluster, until the tick set the count). Lowered first, the requeue leaves nothing free."""
        with self._gres_lock:
            known, pad_to = self._gres_now.get(node), self._pad_to.get(node, False)
            if known is None or pad_to is False:
                return False  # no tick has set or read this node's counts yet
            expected = _gres_counts(self.intended_layouts(node))
            if expected is None:
                return False
            low = {t: min(known.get(t, 0), expected.get(t, 0)) for t in GRES_TYPES}
            if low == known:
                return False
            if pad_to is not None:
                pad_to = max(pad_to, sum(low.values()))
            if not self._write_gres(node, low, pad_to, now, "; a requeue may start the next job there"):
                return False
        self.metrics.inc("slurm_mig_gres_held_lowered_total", (("node", node),))
        return True

    def _note_gres_held(self, node: str, counts: dict[str, int], at: float) -> None:
        """Remember that Slurm held ``counts`` (every type) for ``node`` at ``at``: as set, or as read back."""
        counts = {t: counts.get(t, 0) for t in GRES_TYPES}
        known = self._gres_held.get(node)
        if known is not None and known[0] == counts:
            at = max(at, known[1])
        self._gres_held[node] = (counts, at)

    def _gres_changed_by_slurm(self, n, current: dict[str, int]) -> str:
        """Why Slurm's counts for node ``n`` (``current``) are not the ones it last held as slurm-mig set
        them, for the gres event; "" when they are (the layouts changed) or none are known yet.

        Slurm itself changes them: a node registration (slurmd starting, and slurmctld's periodic
        request, every 20th ping, SlurmdTimeout/3 apart) puts slurm.conf's mix back, as do a slurmctld
        restart and ``scontrol reconfigure``; an admin may also run ``scontrol update``. slurmctld's log
        says nothing of the first three at its default level and shows only the ``gres set to`` of the
        last update, so the event says it.
        """
        known = self._gres_held.get(n.name)
        if known is None or known[0] == current:
            return ""
        held, at = known
        if n.slurmd_start_time is not None and n.slurmd_start_time >= at - 1:
            cause = (f"slurmd started at {_hms(n.slurmd_start_time)} and the node registered, which puts "
                     f"slurm.conf's counts back")
        else:
            cause = ("a node registration (slurmctld asks for one now and then), a slurmctld restart or "
                     "`scontrol reconfigure` (each puts slurm.conf's counts back) or an `scontrol update` by hand "
                     "changed them")
        return f" (it held {_fmt(held)}, as set, at {_hms(at)}; since then {cause})"

    def _write_gres(self, node: str, counts: dict[str, int], pad_to: int | None, now: float, why: str = "") -> bool:
        """Set ``node``'s mig counts in Slurm; False, logged and counted, when scontrol failed."""
        with self._gres_lock:
            try:
                value = self.slurm.update_node_gres(node, counts, pad_to=pad_to)
            except SlurmMigError as exc:
                self.metrics.inc("slurm_mig_gres_update_failures_total")
                log.warning("GRES update of %s failed: %s%s", node, exc, why)
                return False
            self._gres_set[node] = (value, now)
            self._gres_now[node] = {t: counts.get(t, 0) for t in GRES_TYPES}
            self._note_gres_held(node, counts, now)
            return True

    def _pad_total(self, n, expected: dict[str, int], gpus: int, now: float) -> int | None:
        """The constant mig total to keep on node ``n`` (7 per GPU), or None when its Gres has no ``mig:pad``.

        Not Slurm's current total: a re-registration resets the mix to slurm.conf's but keeps the count of
        a type a job holds, so the total read back can be one too high for a tick. Without padding (or
        with layouts holding more than 7 per GPU, impossible on real GPUs) Slurm drains the node when
        slurmd re-registers while a job holds a re-carved GPU; say so once per node.
        """
        target = padded_total(gpus)
        need = sum(expected.values())
        problem = None
        if PAD_TYPE not in n.gres:
            problem = (f"{n.name}'s Gres has no mig:{PAD_TYPE}, so its mig total changes with its layouts and "
                       f"Slurm will drain it (INVALID_REG) when slurmd re-registers while a job holds a re-carved "
                       f"GPU; give it a constant total in slurm.conf: the boot counts plus mig:{PAD_TYPE}:N "
                       f"adding up to {target} ({gpus} GPUs x 7), see docs/admin-guide.md")
            target = None
        elif need > target:
            problem = (f"{n.name}'s layouts hold {need} MIG instances, more than 7 per GPU ({target}); "
                       f"advertising all of them with mig:{PAD_TYPE}:0")
            target = need  # mig:pad:0; leaving pad out would keep its old count
        elif n.name not in self._gres_checked:
            self._gres_checked.add(n.name)
            used = sum((n.gres_used or {}).values())
            if used == 0 and mig_total(n.gres) != target:
                problem = (f"{n.name}'s mig total in Slurm is {mig_total(n.gres)}, not {target} ({gpus} GPUs x 7): "
                           f"if that is slurm.conf's, fix its mig:{PAD_TYPE} count, or Slurm will drain the "
                           f"node when slurmd re-registers after slurm-mig changed its layout")
        if problem is None:
            return target
        if n.name not in self._gres_warned:
            self._gres_warned.add(n.name)
            log.warning("%s", problem)
            self.store.add_event("gres", problem, node=n.name, now=now)
        return target

    def _update_gauges(self) -> None:
        with self.store.snapshot():
            nodes = self.store.nodes()
            self.metrics.clear_gauge("slurm_mig_instances")
            counts: dict[tuple, int] = {}
            for i in self.store.observed_instances():
                key = (i.node, i.profile, "busy" if i.in_use else "idle")
                counts[key] = counts.get(key, 0) + 1
            for (node, profile, st), n in counts.items():
                self.metrics.set("slurm_mig_instances", (("node", node), ("profile", profile), ("state", st)), n)
            for n in nodes:
                self.metrics.set("slurm_mig_node_up", (("node", n.name),), 1.0 if n.state == "up" else 0.0)


@dataclass
class _Plan:
    """What the policy decided on one state, before anything is recorded."""

    state: object
    decision: object = None
    used: object = None
    latency: float = 0.0
    changes: list = field(default_factory=list)  # (LayoutChange, layout now, steps) that change something


def _held_regions_of(decision, state, bound, holders=frozenset()) -> dict[str, list[list]]:
    """The regions the decision's reservations hold: job id -> [[node, gpu index, memory-slice mask, [[profile,
    start] of each instance there idle in ``state``], [[profile, start] of each busy there but not in
    ``bound``(node, gpu)]], ...] (from ``Decision.extra["held"]``, GPU key -> mask; a GPU the state does not list
    is left out). Idle as the policy saw it: an instance it counted as held by a job Slurm started whose Prolog
    has not bound it is busy (the last list: that Prolog may bind it), and is not held back from Slurm's count.

    A job of ``holders`` (held a region at the last tick) that the decision now assigns instances still to be
    carved keeps holding their slices until its Prolog binds them: the tick the region drained, a 1g job Slurm
    started while the counts were being changed had its Prolog carve a 1g out of the 7g just planned, and the
    7g job, started on the new count, was requeued (seen on the demo cluster)."""
    out: dict[str, list[list]] = {}
    regions_of = {str(j): dict(r) for j, r in ((decision.extra or {}).get("held") or {}).items()}
    for a in decision.assignments:
        if a.job_id not in holders or a.job_id in regions_of:
            continue
        for gi, slot in a.instances:
            key = f"{a.node}/{gi}"
            try:
                g = state.gpu(key)
            except (LookupError, SlurmMigError):
                continue
            if slot not in g.layout.slots:
                mine = regions_of.setdefault(a.job_id, {})
                mine[key] = mine.get(key, 0) | g.model.profile(slot.profile).mask(slot.start)
    for jid, regions in regions_of.items():
        rows = []
        for key, mask in sorted(regions.items()):
            try:
                g = state.gpu(key)
            except (LookupError, SlurmMigError):
                continue
            if g is not None and mask:
                idle = sorted((s.profile, s.start) for s in g.idle if overlaps(g.model, s, int(mask)))
                have = bound(g.node, g.index)
                started = sorted((s.profile, s.start) for s in g.busy
                                 if s not in have and overlaps(g.model, s, int(mask)))
                rows.append([g.node, g.index, int(mask), [list(x) for x in idle], [list(x) for x in started]])
        if rows:
            out[str(jid)] = rows
    return out


def _assigned(decision) -> set:
    """(node, gpu, slot) of every instance the decision's assignments name."""
    return {(a.node, gi, s) for a in decision.assignments for gi, s in a.instances}


def _load_ended(store) -> dict[str, tuple[float, tuple | None]]:
    """The controller's notes on jobs that ended without an Epilog report, as the last run left them."""
    try:
        saved = store.get_meta("ended_since") or {}
        return {str(j): (float(first), tuple(rec) if rec else None) for j, (first, rec) in saved.items()}
    except Exception as exc:  # a damaged note costs at most some exit statuses, never the start
        log.warning("ignoring the saved notes on ended jobs: %s", exc)
        return {}


SIZE_RELEASES = "size_releases"  # meta key: job id -> [releases spent, released and not yet seen held again]


def _load_size_releases(store) -> tuple[dict[str, int], set[str]]:
    """The release counts and marks (Controller._size_releases, _size_released) as the last run saved them."""
    counts: dict[str, int] = {}
    released: set[str] = set()
    try:
        saved = store.get_meta(SIZE_RELEASES) or {}
        for job_id, (count, was_released) in saved.items():
            if int(count) > 0:
                counts[str(job_id)] = int(count)
            if was_released:
                released.add(str(job_id))
    except Exception as exc:  # a damaged note costs at most a few more releases, never the start
        log.warning("ignoring the saved notes on jobs released from Slurm's BadConstraints hold: %s", exc)
        return {}, set()
    return counts, released


def _load_uncounted(store) -> dict[tuple[str, int], float]:
    """The Epilog outcomes the last run of the controller recorded and had not counted yet: (job, run) -> when."""
    try:
        saved = store.meta_with_prefix(UNCOUNTED)
    except Exception as exc:  # a damaged note costs at most some counts, never the start
        log.warning("ignoring the saved notes on job ends not yet counted: %s", exc)
        return {}
    out = {}
    for key, note in saved.items():
        try:
            job_id, run, at = note
            out[(str(job_id), int(run))] = float(at)
        except (TypeError, ValueError) as exc:
            log.warning("ignoring the saved note %s on a job end not yet counted: %s", key, exc)
    return out


def _started_since(before, after, nodes: set[str]) -> list[tuple[str, str]]:
    """(job, node) of MIG jobs running on ``nodes`` in ``after`` that ``before`` did not have running there."""
    def running(jobs):
        return {(str(j.job_id), n) for j in jobs if j.wants_mig and not j.pending and j.state not in TERMINAL
                for n in j.nodes if n in nodes}
    return sorted(running(after) - running(before))


def _fmt(counts: dict) -> str:
    return ",".join(f"{t}:{n}" for t, n in sorted(counts.items()) if n) or "none"


def _hms(t: float) -> str:
    """Local ``HH:MM:SS`` of epoch seconds ``t`` (the clock Slurm's and slurm-mig's logs print); ``?t`` for a
    time no clock can show (a slurmd start time from a node whose clock is far off must not fail the tick)."""
    return _when(t, "%H:%M:%S")


def _when(t: float, fmt: str = "%Y-%m-%dT%H:%M:%S") -> str:
    """Local time ``fmt`` of epoch seconds ``t`` (by default as scontrol prints times); ``?t`` for a time no clock
    can show."""
    try:
        return time.strftime(fmt, time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return f"?{t!r}"
