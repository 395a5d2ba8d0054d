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

The node API (POST, authenticated): /v1/prolog, /v1/bound, /v1/bind-failed, /v1/epilog, /v1/report,
/v1/applied. Open GET: /healthz, /metrics.
"""

from __future__ import annotations

import logging
import pwd
import re
import threading
import time
from dataclasses import dataclass, field, replace

from slurm_mig.api.auth import NODE_NAME
from slurm_mig.api.loglimit import LogLimiter
from slurm_mig.api.origin import NodeOrigins
from slurm_mig.controller.binding import GpuRow, NodeGpu, choose_binding, intended_layout, node_gpus
from slurm_mig.controller.eligibility import eligible_nodes
from slurm_mig.controller.queue import queue_entries
from slurm_mig.errors import GeometryError, SlurmMigError, SlurmUnavailable
from slurm_mig.mig.layout import Layout, Slot, parse_layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.mig.transitions import plan_transition
from slurm_mig.policies import check_decision, get_policy
from slurm_mig.policies.base import PendingJob
from slurm_mig.slurm.gres import GRES_TO_KIND, GRES_TYPES, PAD_TYPE, gres_type_for_kind, mig_total, padded_total
from slurm_mig.slurm.parsers import format_exit_status, local_epoch, wait_status
from slurm_mig.store.models import LOST_REASON, known_model, off_table, readable_model, unknown_model_reason
from slurm_mig.store.schema import JOB_STATES

log = logging.getLogger("slurm_mig.controller")

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE")
LIVE_STATES = tuple(s for s in JOB_STATES if s not in TERMINAL)  # the store's states of a run not over
JOB_ID = re.compile(r"[0-9]{1,12}(_[0-9]{1,9})?")  # use with fullmatch: "$" would let "12\n" through
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
MB = 1024 * 1024  # [controller].keep_decisions_mb's megabyte
# Decisions are pruned as soon as those recorded since the last prune take 1/PRUNE_PART of their size budget
# ([controller].keep_decisions_mb), so they stay within the budget plus that part (and the newest decision).
PRUNE_PART = 10
# The reason a waiting job Slurm no longer lists is marked CANCELLED with: the tick's guess, not Slurm's word (a
# job that ran while the controller was down, then was forgotten after MinJobAge, is gone too).
NOT_IN_QUEUE = "no longer in Slurm's queue"
# The reason of a job the tick settled as FAILED without Slurm's record of its end (Slurm had forgotten it) or an
# Epilog: a guess, which the job's Epilog, arriving later, replaces (_epilog).
FORGOTTEN = "ended unseen: neither Slurm's record nor its Epilog said how"


@dataclass
class Metrics:
    """Counters and gauges for /metrics (Prometheus text format); updated under a lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    counters: dict = field(default_factory=dict)
    gauges: dict = field(default_factory=dict)
    histograms: dict = field(default_factory=dict)

    def inc(self, name: str, labels: tuple = (), by: float = 1.0) -> None:
        with self.lock:
            self.counters[(name, labels)] = self.counters.get((name, labels), 0.0) + by

    def set(self, name: str, labels: tuple, value: float) -> None:
        with self.lock:
            self.gauges[(name, labels)] = value

    def clear_gauge(self, name: str) -> None:
        with self.lock:
            for key in [k for k in self.gauges if k[0] == name]:
                del self.gauges[key]

    def observe(self, name: str, value: float, buckets: tuple[float, ...]) -> None:
        with self.lock:
            h = self.histograms.setdefault(name, {"buckets": buckets, "counts": [0] * len(buckets), "sum": 0.0, "n": 0})
            for i, b in enumerate(h["buckets"]):
                if value <= b:
                    h["counts"][i] += 1
            h["sum"] += value
            h["n"] += 1

    def render(self) -> bytes:
        def lab(labels: tuple) -> str:
            if not labels:
                return ""
            return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in labels) + "}"

        lines = []
        typed: set[str] = set()

        def declare(name: str, kind: str) -> None:
            if name not in typed:
                typed.add(name)
                lines.append(f"# TYPE {name} {kind}")

        with self.lock:
            for (name, labels), v in sorted(self.counters.items()):
                declare(name, "counter")
                lines.append(f"{name}{lab(labels)} {v:g}")
            for (name, labels), v in sorted(self.gauges.items()):
                declare(name, "gauge")
                lines.append(f"{name}{lab(labels)} {v:g}")
            for name, h in sorted(self.histograms.items()):
                declare(name, "histogram")
                for b, c in zip(h["buckets"], h["counts"]):
                    lines.append(f'{name}_bucket{{le="{b:g}"}} {c}')
                lines.append(f'{name}_bucket{{le="+Inf"}} {h["n"]}')
                lines.append(f"{name}_sum {h['sum']:g}")
                lines.append(f"{name}_count {h['n']}")
        return ("\n".join(lines) + "\n").encode()


def _esc(v) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


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


def layout_counts(layout: Layout) -> dict[str, int]:
    """GRES type -> count of instances in ``layout``."""
    out: dict[str, int] = {}
    for s in layout.slots:
        t = gres_type_for_kind(layout.model.profile(s.profile).kind)
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


def _make_policy(cfg, name: str):
    """A policy by name; learned ones get the configured model file (they load it lazily, on first use)
    and the cap on how long their guard may hold a whole-node reservation back."""
    if name.startswith("rl"):
        opts = {"max_hold_h": cfg.policy.rl_max_hold_h}
        if cfg.policy.model_path:
            opts["model_path"] = cfg.policy.model_path
        return get_policy(name, **opts)
    return get_policy(name)


def _signature(decision) -> tuple:
    """Who decided (the policy and its version) and what the decision does and says: its re-carves,
    placements and waiting reasons. A decision, the live policy's or the shadow's, is recorded only when this
    differs from that of the last one recorded (the same decision tick after tick, jobs waiting for the same
    reasons, is recorded once). The policy is part of it: the fallback deciding as the policy did the tick
    before (an rl model that stopped loading, frag-aware deciding alike) is recorded, or the last decision,
    the one `status` names and `explain` attributes waits to, would say the policy that no longer decides."""
    return (decision.policy, decision.version, tuple((c.key, str(c.target)) for c in decision.changes),
            tuple((a.job_id, a.node, a.instances) for a in decision.assignments), decision.waiting)


def _live_request(job) -> bool:
    """Is ``job`` (a store row or None) one whose MIG request the store knows? Not one that ended here: started
    again (id reused, requeued after it ended), it may ask for another size."""
    return job is not None and bool(job.profile) and job.state not in TERMINAL


class Controller:
    """The head-node controller. Thread-safe: API threads and the tick share one Store."""

    def __init__(self, cfg, store, slurm, *, policy=None, clock=time.time):
        self.cfg = cfg
        self.store = store
        self.slurm = slurm
        self.clock = clock
        self.policy = policy or _make_policy(cfg, cfg.policy.name)
        self.fallback = _make_policy(cfg, cfg.policy.fallback) if cfg.policy.fallback else None
        self.shadow = _make_policy(cfg, cfg.policy.shadow) if cfg.policy.shadow else None
        self._shadow_state = None  # the state the live policy decided on this tick, for the shadow
        self._detail_slots = threading.BoundedSemaphore(self.DETAIL_CONCURRENCY)
        self.metrics = Metrics()
        self._gres_set: dict[str, tuple[str, float]] = {}  # node -> (value, when) last written
        # node -> (counts, when): what Slurm last held as slurm-mig set it (written, or read back so)
        self._gres_held: dict[str, tuple[dict[str, int], float]] = {}
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
        # Slurm's record of each MIG job it lists as ended (this tick's squeue; refreshed each tick): a run it
        # listed COMPLETED or FAILED ended by its exit, whatever requeue follows (_revive).
        self._listed_ended: dict[str, object] = {}
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
            gres_now = {n.name: {t: n.gres.get(t, 0) for t in GRES_TYPES} for n in nodes or []}
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
        # The stored runs' users before Slurm's records are written over them (_another_job's user rule).
        users = self.store.job_users(LIVE_STATES)
        margin = self._clock_margin()
        listed_ended = {}
        for entry in [e for e in entries if e.job_id not in taken]:
            j, job_id = entry.job, entry.job_id
            stored_user = users.get(job_id, ("", None))  # the stored run's (user, uid), read before this tick
            seen.add(job_id)
            if j.state in TERMINAL:
                ended.add(job_id)
                run = self.store.get_job(job_id)
                if run is not None and run.state in ("RUNNING", "SUSPENDED", "COMPLETING") \
                        and _another_job(run, j.submit_time, margin, user=j.user, uid=j.user_id,
                                         requeued=bool(j.restart_cnt)):
                    # Another job with the id (_another_job) that ended before a tick saw it live: its request,
                    # user and end are not those of the stored run, whose lost Epilog _lost_epilogs settles.
                    continue
                listed_ended[job_id] = j
            try:
                kind, count = mig_size_request(j.mig)
            except ValueError as exc:
                # One such job must not stop the tick (it used to raise inside it, every tick).
                self._note_unservable(job_id, str(exc), now)
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
                    and _another_job(current, j.submit_time, margin, user=j.user, uid=j.user_id,
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
                    and _same_run(current, j, self.store.outcome(job_id, run=current.run)):
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
        self._listed_ended = listed_ended
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
        reservations = self.store.get_meta("reservations") or {}
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
            self.store.delete_meta(_uncounted_key(*key) for key in due)
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
        listed = self._listed_ended.get(job_id)
        if outcome is not None and listed is not None and listed.state == outcome.state \
                and _same_run(ended, listed, outcome):
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
        (:func:`_another_job`): that run is over, its Epilog lost (a node crash as slurmctld lost its state) or
        still to come. Its bindings are released (they are not the new job's) and the new job is tracked as the
        next run, waiting from its own submission (the stored one where Slurm's is unknown). The ended run's
        outcome is left to its Epilog, which, late, goes under that run (_earlier_runs_epilog): Slurm's record of
        it is gone, the id now names the new job. ``users``: (the stored run's, Slurm's job's), said when they
        differ."""
        other = bool(users) and _other_user(*users)
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

    def _lost_epilogs(self, jobs, now: float) -> dict[str, tuple[str, int | None, float]]:
        """Jobs that ran on a MIG instance and ended in Slurm, but whose Epilog never reported (killed,
        node lost) for longer than the grace period: ``{job_id: (state, exit_code, end_time)}`` from Slurm.

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
                    and _another_job(job, sj.submit_time, self._clock_margin(), user=sj.user, uid=sj.user_id,
                                     requeued=bool(sj.restart_cnt)):
                # Slurm's record is another job's with the id (another user's, or submitted after this run
                # started and never requeued: slurmctld lost its state, or its ids wrapped), ended before a tick
                # saw it live: its end is not this run's, which Slurm has forgotten as below.
                sj = None
            if record is None and sj is not None:
                detail = self.slurm.job_detail(job.job_id)
                if detail is not None and detail.state not in TERMINAL:
                    continue  # requeued meanwhile: the next ticks see it
                record = _slurm_end(detail, sj.state, now, self._clock_margin())
            self._ended_since[job.job_id] = (first, record)
            if now - first < grace:
                continue
            # Unseen while Slurm still listed it (the controller was down): Slurm has forgotten the job
            # (squeue answered this tick) and with it the exit status. It ended by the time a tick first found
            # it gone (not a grace period later, when it is settled): a guess its Epilog replaces if it comes.
            out[job.job_id] = record or ("FAILED", None, first)
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
        return (_size_hold(job) and bool(job.required_nodes) and "_" not in job_id
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
            if job_id in self._size_released and _size_hold(j):
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
                still = {str(f.job_id) for f in fresh if _size_hold(f)}
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
        for job_id, (state, exit_code, end) in lost.items():
            job = self.store.get_job(job_id)
            if job is None or job.state not in ("RUNNING", "COMPLETING", "SUSPENDED"):
                continue  # the Epilog's report arrived meanwhile
            # Without Slurm's record (it had forgotten the job): FAILED, no exit status, a guess (FORGOTTEN).
            guess = self._ended_since.get(job_id, (None, None))[1] is None
            recorded = self.store.record_outcome(job_id, state=state, exit_code=exit_code, end_time=end, now=now)
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
        reservations = self.store.get_meta("reservations") or {}
        state = self.store.cluster_state(
            now, stale_after_s=self.cfg.controller.node_stale_after_s,
            prolog_choice=lambda *job: self._prolog_choice(*job, reservations=reservations))
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
            shrinking = self._shrinking(plan, gres_now)
            if not shrinking:
                return plan, jobs, now, held_back
            held_back = set()
            for node, low in shrinking.items():
                pad_to = self._pad_total(by_name[node], low, self._pad_gpus(node, self.intended_layouts(node)), now)
                if self._write_gres(node, low, pad_to, now, "; its re-carve waits"):
                    gres_now[node] = low
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

        ``gres_now``: node -> the counts Slurm has; nodes not in it are left out."""
        targets: dict[str, dict[int, Layout]] = {}
        for ch, _layout, _steps in plan.changes:
            targets.setdefault(ch.node, {})[ch.gpu] = ch.target
        out = {}
        for node, changed in targets.items():
            if node not in gres_now:
                continue
            layouts = self.intended_layouts(node)
            layouts.update({gi: lay for gi, lay in changed.items() if gi in layouts})
            after = _gres_counts(layouts)
            if after is None:
                continue
            cur = {t: gres_now[node].get(t, 0) for t in GRES_TYPES}
            low = {t: min(cur[t], after.get(t, 0)) for t in GRES_TYPES}
            if low != cur:
                out[node] = low
        return out

    def intended_layouts(self, node: str) -> dict[int, Layout]:
        """Each GPU's layout that exists or is about to exist: the desired one when set and reachable from
        what exists without destroying a busy instance (as a Prolog binds, binding.intended_layout), else
        observed. Told the unreachable one, Slurm started jobs on instances nobody could make."""
        out = {}
        rows = self._gpu_rows(node)
        bindable = None
        for g in rows:
            obs = g.observed
            if obs is None or not g.mig_enabled:
                continue
            if g.blocked:
                # Left as it is, and no new job goes there: Slurm is told of the instances jobs hold, not of
                # the idle ones (it would start jobs there that could only be requeued).
                busy = self._busy_starts(node, g.index)
                out[g.index] = obs.without(s for s in obs.slots if s.start not in busy)
                continue
            lay = g.desired
            if lay is not None and lay.slots != obs.slots:
                if bindable is None:  # the rows read once; the bindings only where a desired layout differs
                    bindable = {x.index: x for x in node_gpus(rows, self._held(node, {}, exclude_job=""))}
                if g.index in bindable:
                    lay = intended_layout(bindable[g.index])
            out[g.index] = lay if lay is not None else obs
        return out

    def _busy_starts(self, node: str, gpu: int) -> set[int]:
        """Where the instances of ``node``'s GPU ``gpu`` that are in use or bound to a live job start."""
        busy = {i.start for i in self.store.observed_instances(node, gpu) if i.in_use}
        return busy | {b.start for _jid, _node, b in self.store.live_bindings(node) if b.gpu == gpu}

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
        for n in nodes:
            layouts = self.intended_layouts(n.name)
            expected = _gres_counts(layouts)
            gpus = self._pad_gpus(n.name, layouts)
            if expected is None:
                if not gpus:
                    continue  # the node never reported a GPU: nothing known to correct
                # The node reports GPUs but none holds MIG instances any more: Slurm must not keep
                # advertising the instances that were there, or it starts jobs on slices that do not exist.
                expected = {t: 0 for t in GRES_TYPES}
            current = {t: (gres_now or {}).get(n.name, n.gres).get(t, 0) for t in GRES_TYPES}
            pad_to = self._pad_total(n, expected, gpus, now)
            last = self._gres_set.get(n.name)
            stale = current != expected or (pad_to is not None and n.gres.get(PAD_TYPE) != pad_to - sum(expected.values()))
            # FACTS §4: Slurm does not reconsider a pending job whose type came back until another Gres
            # update; re-issuing the same value un-sticks it. Rate-limited per node.
            could_help = any(expected.get(t, 0) > (n.gres_used or {}).get(t, 0) for t in pending_types)
            nudge = could_help and (last is None or now - last[1] > 3 * self.cfg.controller.tick_interval_s)
            if not stale and not nudge:
                self._note_gres_held(n.name, current, now if read_at is None else read_at)
                continue
            why = self._gres_changed_by_slurm(n, current) if stale else ""
            if not self._write_gres(n.name, expected, pad_to, now):
                continue
            updates += 1
            if stale:
                self.metrics.inc("slurm_mig_gres_reasserted_total", (("node", n.name),))
                self.store.add_event("gres", f"{n.name}: Slurm had {_fmt(current)}, set {_fmt(expected)}{why}",
                                     node=n.name, now=now if read_at is None else read_at)
        return updates

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
        try:
            value = self.slurm.update_node_gres(node, counts, pad_to=pad_to)
        except SlurmMigError as exc:
            self.metrics.inc("slurm_mig_gres_update_failures_total")
            log.warning("GRES update of %s failed: %s%s", node, exc, why)
            return False
        self._gres_set[node] = (value, now)
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

    def _message(self, node: str, route: str, message_id: str | None, now: float) -> "_NodeMessage":
        """A node message (``_v_message``), handled once: create it inside the handler's transaction."""
        return _NodeMessage(self.store, node, route, message_id, now)

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
        return {"/healthz": lambda: ("text/plain", b"ok\n"),
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
        return _live_request(self.store.get_job(job_id))

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
        live = _live_request(job)
        if live and detail is None:
            return job.profile, job.count
        req = self._request_of(detail)
        if live:
            if req == (job.profile, job.count):
                if _known_user(detail.user) and detail.user != job.user:
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
        observed, node_bindings = _v_observed(payload.get("observed")), _v_bindings(payload.get("bindings"))
        observed_at = _v_time(payload.get("observed_at"), "observed_at")
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
        listed_uid = _uid_of(detail.user) if detail is not None and stored is not None \
            and _other_user(stored.user, detail.user) else None
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
                self._revive(job_id, now, submit_time=submit_time, requeued=_requeued(detail))
                self.store.upsert_job(job_id, profile=again[0], count=again[1], user=detail.user,
                                      name=detail.name, partition=detail.partition, now=now)
            elif ended is not None and ended.state not in TERMINAL and detail is not None \
                    and detail.state not in TERMINAL \
                    and _another_job(ended, local_epoch(submit_text, earliest=True), self._clock_margin(),
                                     user=detail.user, uid=listed_uid, requeued=_requeued(detail)):
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
            task = _array_task_of(detail)
            if task is not None and task != job_id:
                # The tick saw this job as a task of an array record: the task's row gives way to the job.
                self.store.forget_pending_job(task)
                self._taken_tasks[task] = now
            gpus = self._node_gpus(node, node_bindings, exclude_job=job_id)
            reserved = self._reservation(job_id, node) or (self._reservation(task, node) if task else ())
            plan = choose_binding(gpus, kind, count, reserved) if gpus else None
            if plan is None:
                requeue_reason = f"no {count} x {kind} MIG instance can be made on {node} now (slices in use)"
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
                       reservations: dict) -> tuple[tuple[int, Slot], ...]:
        """The instances the Prolog of ``job_id``, which Slurm started on ``node`` and which is not bound yet,
        would bind now on ``gpus`` (Store.cluster_state's view of the node's GPUs): as on_prolog chooses, with
        the same builder (binding.node_gpus) and its reservation in ``reservations`` (the meta row)."""
        rows = [GpuRow(g["index"], g["observed"], g["mig_enabled"], g["blocked"], g["desired"]) for g in gpus]
        choice = node_gpus(rows, {g["index"]: g["bound"] for g in gpus})
        plan = choose_binding(choice, profile, count, self._reservation(job_id, node, reservations)) if choice else None
        return plan.instances if plan is not None else ()

    def _reservation(self, job_id: str, node: str, reservations: dict | None = None) -> tuple:
        """The policy's last-tick reservation for ``job_id`` on ``node`` (from ``reservations``, the meta row,
        when the caller read it already), as the Prolog's choose_binding takes it."""
        res = ((self.store.get_meta("reservations") if reservations is None else reservations) or {}).get(job_id)
        if not res or res.get("node") != node:
            return ()
        return tuple((int(gi), Slot(int(start), profile)) for gi, profile, start in res["instances"])

    def on_bound(self, payload: dict, principal) -> dict:
        node = self._check_node(payload, principal)
        job_id = self._check_job(payload)
        insts = _v_instances(payload.get("instances"), "instances")
        local = _v_bool(payload.get("local"), "local")
        observed = _v_observed(payload.get("observed"))
        observed_at = _v_time(payload.get("observed_at"), "observed_at")
        if local and not insts:
            raise _rejected("instances: a binding made by the node alone must list its instances")
        message_id = _v_message(payload)
        now = self.clock()
        # When the node bound it: a binding it made alone may be delivered long after, from its outbox.
        bound_at = min(_v_time(payload.get("bound_at"), "bound_at") or now, now)
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
                    self.store._x("UPDATE jobs SET start_time = COALESCE(start_time, ?), node = COALESCE(node, ?) "
                                  "WHERE job_id = ?", (bound_at, node, job_id))
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
                self.store._x("UPDATE bindings SET uuid = ? WHERE job_id = ? AND node = ? AND gpu = ? AND start = ? "
                              "AND released_at IS NULL", (i.get("uuid"), job_id, node, int(i["gpu"]), int(i["start"])))
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
        results = _v_results(payload.get("results"), need_gpu=False)
        message_id = _v_message(payload)
        # When the node made the message (its Prolog saw the failure): it may be delivered long after, from
        # the node's outbox. An older node sends no time.
        failed_at = _v_time(payload.get("message_at"), "message_at")
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
        ended_at = _v_time(payload.get("end_time"), "end_time")
        exit_code = _v_opt_int(payload.get("exit_code"), "exit_code")
        derived_ec = _v_opt_int(payload.get("derived_ec"), "derived_ec")
        insts = _v_instances(payload.get("instances"), "instances")
        lingering = _v_instances(payload.get("lingering"), "lingering")
        unreadable = _v_bool(payload.get("binding_unreadable"), "binding_unreadable")
        requeued = _v_bool(payload.get("requeued"), "requeued")
        # The uid of the job it ran for (SLURM_JOB_UID, or its binding record's); nodes before 2026-11-27 send none.
        uid = _v_opt_int(payload.get("uid"), "uid")
        uid = uid if uid is not None and uid >= 0 else None
        message_id = _v_message(payload)
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
                recorded = self._earlier_runs_epilog(job, node, events, insts=insts, unreadable=unreadable,
                                                     requeued=requeued, state=state, exit_code=exit_code,
                                                     derived_ec=derived_ec, end=self._epilog_end(None, ended_at, now),
                                                     now=now, uid=uid if other_user else None)
                answer = events.reply({"ok": True, "recorded": recorded})
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
                    self.store.set_meta(_uncounted_key(job_id, job.run), [job_id, job.run, now], now=now)
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

    def _epilog(self, job, job_id: str, node: str, events: "_NodeMessage", *, insts: list, lingering: list,
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
        guessed = job.state == "CANCELLED" and job.reason == NOT_IN_QUEUE
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
                                     reason="" if replaced else None)
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

    def _earlier_runs_epilog(self, job, node: str, events: "_NodeMessage", *, insts: list, unreadable: bool,
                             requeued: bool, state: str, exit_code: int | None, derived_ec: int | None,
                             end: float, now: float, uid: int | None = None) -> bool:
        """An Epilog of a run of the job id before its current one (_before_this_run): it neither ends
        nor releases the current run. When the current run is the second, the Epilog is the first run's:
        its outcome goes under run 1, unless that run has one (then it is a duplicate: the outcome came from
        Slurm's record, _lost_epilogs). With more runs before the current one, nothing is recorded: the
        store cannot tell which of them it ended. A run without an outcome keeps no times (the jobs row is
        the current run's), and may still have run here (bound by its node alone while no tick saw it run,
        then ended while the store had it waiting), so neither "the run without an outcome" nor the
        outcomes' times pick the right one; recorded under the wrong run, the end would stand for a run
        that never ran (and could not be replaced by its own). ``uid``: the Epilog's job is another user's than
        the current run's (it may have ended after that run began). True when it recorded an outcome."""
        if not (insts or unreadable):
            return False  # a run that never got its instances (requeued in its Prolog): nothing to say
        recorded = False
        size = self._size_bound(node, insts)
        if job.run == 2 and not requeued and size is not None:  # (an attempt ended by a requeue is no outcome)
            # Nothing of the jobs row: it is run 2's, request and all (another user's job, for a reused id).
            recorded = self.store.record_outcome(job.job_id, run=1, state=state, exit_code=exit_code,
                                                 derived_exit_code=derived_ec, end_time=end, now=now, node=node,
                                                 instances=insts, profile=size[0], count=size[1])
        if job.run > 2:
            which = f"one of the {job.run - 1} runs before the current one"
            what = "which one cannot be told, so nothing is recorded"
        else:
            which = "a run before the current one"
            what = "its outcome is recorded under run 1" if recorded else (
                "run 1's size cannot be told (its binding file was unreadable), so nothing is recorded"
                if size is None and not requeued and self.store.outcome(job.job_id, run=1) is None
                else "nothing is changed")
        after = f"uid {job.uid}'s, not uid {uid}'s as it is" if uid is not None else "which began after it ended"
        events.add("late", f"job {job.job_id}: an Epilog from {node} of {which} (run {job.run}, {after}); {what}",
                   node=node, job_id=job.job_id, now=now)
        log.warning("job %s: an Epilog from %s %s; %s", job.job_id, node, f"for uid {uid}, not the current run's"
                    if uid is not None else "ended before the current run began", what)
        return recorded

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
        observed, node_bindings = _v_observed(payload.get("observed")), _v_bindings(payload.get("bindings"))
        binding_times = _v_binding_times(payload.get("binding_times"))
        observed_at = _v_time(payload.get("observed_at"), "observed_at")
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
        results = _v_results(payload.get("results"), need_gpu=True)
        observed = _v_observed(payload.get("observed"))
        observed_at = _v_time(payload.get("observed_at"), "observed_at")
        message_id = _v_message(payload)
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


@dataclass
class _Plan:
    """What the policy decided on one state, before anything is recorded."""

    state: object
    decision: object = None
    used: object = None
    latency: float = 0.0
    changes: list = field(default_factory=list)  # (LayoutChange, layout now, steps) that change something


class _NodeMessage:
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


UNCOUNTED = "uncounted/"  # meta key prefix: an Epilog's outcome not yet counted in jobs_finished_total


def _uncounted_key(job_id: str, run: int) -> str:
    return f"{UNCOUNTED}{job_id}/{run}"


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


def _same_run(job, listed, outcome=None) -> bool:
    """Is Slurm's ended ``listed`` job the run the store ended as ``job`` (not an earlier run of a reused id)?
    Slurm's end time agrees to within a few minutes with the run's: its ``outcome``'s (the Epilog's own
    end_time, taken on the node after Slurm's) or the job's (when the controller recorded the end). The
    job's alone missed an Epilog delivered long after its job ended (from the node's outbox, the controller
    down meanwhile), which then kept its guess (COMPLETED for a job cancelled) for good."""
    if listed.end_time is None:
        return False
    ends = [float(e) for e in (outcome.end_time if outcome is not None else None, job.end_time) if e is not None]
    return any(abs(float(listed.end_time) - e) < 300.0 for e in ends)


def _another_job(job, submit_time: float | None, margin: float, *, user: str = "", uid: int | None = None,
                 requeued: bool = False, job_user: tuple[str, int | None] | None = None) -> bool:
    """Is a job Slurm lists under ``job``'s id, ``user``'s (uid ``uid``, None: not known) and submitted at
    ``submit_time``, another job than the store's live (not ended) run ``job``? ``requeued``: Slurm says it
    requeued that job (squeue's restart count). ``job_user``: the stored run's (user, uid) where ``job``'s are
    no longer it (the tick has written Slurm's over them).

    A requeue never changes a job's user: one of another user (both known, :func:`_other_user`) is another job,
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
    if _other_user(stored, user, stored_uid, uid):
        return True
    if requeued or submit_time is None:
        return False
    since = job.start_time if job.start_time is not None else job.submit_time
    return since is not None and float(submit_time) > since + margin


def _other_user(stored: str | None, listed: str | None, stored_uid: int | None = None,
                listed_uid: int | None = None) -> bool:
    """Do two records of a job id name different users? By their uids where both have one: a name is not the
    user's for good (renamed in the directory while a job ran; the uid printed where the head node's lookup
    failed, against a name all digits), and until 2026-11-27 a running job whose user's name squeue read
    otherwise was taken for another user's job, its instances released. Else by name, only when both name one
    (:func:`_known_user`) the same way: squeue --json gives the uid where it cannot look the name up, and a uid
    against a name says nothing."""
    if stored_uid is not None and listed_uid is not None:
        return stored_uid != listed_uid
    if not (_known_user(stored) and _known_user(listed)):
        return False
    a, b = stored.strip(), listed.strip()
    return a.isdigit() == b.isdigit() and a != b


def _uid_of(user: str | None) -> int | None:
    """The uid this host's name service gives ``user`` (None: no such name, or the lookup failed). Only asked where
    squeue's name for a job is not the stored one: squeue -j, unlike --json, prints no uid."""
    if not _known_user(user):
        return None
    try:
        return pwd.getpwnam(user.strip()).pw_uid
    except (KeyError, OSError, ValueError):
        return None


def _known_user(user: str | None) -> bool:
    """Does a job record's ``user`` name someone? Not when empty, nor Slurm's words for a user it could not look up
    ("nobody": uid_to_string's answer; "(null)")."""
    return bool(user) and user.strip() not in ("", "nobody", "(null)", "N/A")


def _size_hold(job) -> bool:
    """Is Slurm holding this pending job (priority 0) as BadConstraints, the hold it puts on a job no node it may
    use can take as configured, a `-w` MIG job among them when its node advertises no slice of its size now?"""
    return job.held and job.state_reason == "BadConstraints"


def _requeued(detail) -> bool:
    """Has Slurm requeued the job of this record (job_detail) at least once? Its restart count (squeue's
    RestartCnt, scontrol's Restarts); a record without one says no."""
    count = ((getattr(detail, "fields", None) or {}).get("Restarts") or "").strip()
    return count.isdigit() and int(count) > 0


def _array_task_of(detail) -> str | None:
    """``"<array job id>_<task id>"`` of an array task from its Slurm record (job_detail), else None."""
    fields = getattr(detail, "fields", None) or {}
    array_id, task = fields.get("ArrayJobId", ""), fields.get("ArrayTaskId", "")
    job_id = f"{array_id}_{task}"
    return job_id if JOB_ID.fullmatch(job_id) and "_" in job_id else None


def _slurm_end(detail, state: str, now: float, margin: float = 0.0) -> tuple[str, int | None, float]:
    """(state, exit status as the Epilog reports it, end time) of an ended job from its Slurm record (job_detail);
    squeue's state and an unknown exit status when scontrol could not answer. The record is read when a tick
    first sees the job ended, moments after its end (or after the controller's outage): in the hour the clock
    goes back, its local EndTime is the later of its two instants that is not after ``now`` (+ ``margin``, the
    clocks' difference); mktime's guess could put the end an hour early, taking the hour off the run's time."""
    if detail is None:
        return state, None, now
    end = local_epoch(detail.fields.get("EndTime", ""), not_after=now + margin)
    return detail.state, wait_status(detail.fields.get("ExitCode")), now if end is None else end


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


# -- request validation ------------------------------------------------------------------------
# Every field a node sends is checked here before it reaches the store, so a malformed or hostile
# request (a bug, a compromised node) is refused with 422 naming the field, never a 500 half-way
# through a handler. Requests come from root on a node; these checks keep bad data out, they are
# not the authentication (see api/auth.py).

MAX_GPUS = 64  # GPU indexes 0..63 (more than any node has)
MAX_ITEMS = 1024  # list lengths; a node reports a few dozen items at most
MAX_TEXT = 256
MAX_TABLE_ERROR = 300  # characters of one table difference kept (a node cuts them so since 1083d1e)
MAX_BODY = 1 << 20  # the API server's request limit: no string in a request is longer


def _rejected(message: str) -> Exception:
    from slurm_mig.api.server import RequestRejected

    return RequestRejected(message)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _v_int(value, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _rejected(f"{what}: expected an integer from {lo} to {hi}, got {_show(value)}")
    return value


def _v_opt_int(value, what: str) -> int | None:
    return None if value is None else _v_int(value, what, -(2 ** 31), 2 ** 32)


def _is_time(value) -> bool:
    """Is ``value`` a plausible time in seconds since the epoch (a number, not before 1970 nor absurdly far)?"""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < 1e11


def _v_time(value, what: str) -> float | None:
    if value is None:
        return None
    if not _is_time(value):
        raise _rejected(f"{what}: expected a time in seconds since the epoch, got {_show(value)}")
    return float(value)


_MESSAGE_ID = re.compile(r"[0-9a-f]{16,64}")


def _v_message(payload: dict) -> str | None:
    """The message_id of a node message (see _NodeMessage); None from an older node. Its message_at (the
    node's clock when it made the message) is checked too, though nothing here reads it."""
    message_id = payload.get("message_id")
    if message_id is not None and (not isinstance(message_id, str) or not _MESSAGE_ID.fullmatch(message_id)):
        raise _rejected(f"message_id: expected 16 to 64 lowercase hex digits, got {_show(message_id)}")
    _v_time(payload.get("message_at"), "message_at")
    return message_id


def _v_text(value, what: str, *, optional: bool = True, max_len: int = MAX_TEXT) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > max_len or "\x00" in value:
        raise _rejected(f"{what}: expected a string of at most {max_len} characters, got {_show(value)}")
    return value


def _v_cut(value, what: str, max_len: int) -> str:
    """A string, cut to ``max_len`` characters (its end shown as "...") where it is longer, as a node cuts it
    since 1083d1e: nodes of c64fe4c up to it sent a table difference whole (~380 characters from a driver
    reading garbage placements), and refusing it refused the node's every report and Prolog request."""
    text = _v_text(value, what, optional=False, max_len=MAX_BODY)
    return text if len(text) <= max_len else text[:max_len - 3] + "..."


def _v_bool(value, what: str, default: bool = False) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _rejected(f"{what}: expected true or false, got {_show(value)}")
    return value


def _v_list(value, what: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        raise _rejected(f"{what}: expected a list of at most {MAX_ITEMS} items, got {_show(value)}")
    return value


def _v_instance(value, what: str, *, gpu: int | None = None) -> dict:
    """One MIG instance: {gpu, profile, start, uuid?, in_use?} (gpu implied inside a GPU report)."""
    if not isinstance(value, dict):
        raise _rejected(f"{what}: expected an object with gpu, profile and start, got {_show(value)}")
    return {
        "gpu": gpu if gpu is not None else _v_int(value.get("gpu"), f"{what}.gpu", 0, MAX_GPUS - 1),
        "profile": _v_text(value.get("profile"), f"{what}.profile", optional=False, max_len=32),
        "start": _v_int(value.get("start"), f"{what}.start", 0, 7),
        "uuid": _v_text(value.get("uuid"), f"{what}.uuid", max_len=128),
        "in_use": _v_bool(value.get("in_use"), f"{what}.in_use"),
    }


def _v_foreign(value, what: str) -> dict:
    """A GPU instance of a profile the node's tables do not list: {start, size, profile_id, in_use?}."""
    if not isinstance(value, dict):
        raise _rejected(f"{what}: expected an object with start, size and profile_id, got {_show(value)}")
    start = _v_int(value.get("start"), f"{what}.start", 0, 7)
    return {"start": start, "size": _v_int(value.get("size"), f"{what}.size", 1, 8 - start),
            "profile_id": _v_int(value.get("profile_id"), f"{what}.profile_id", 0, 2 ** 32),
            "in_use": _v_bool(value.get("in_use"), f"{what}.in_use")}


def _v_instances(value, what: str) -> list[dict]:
    return [_v_instance(v, f"{what}[{i}]") for i, v in enumerate(_v_list(value, what))]


def _v_observed(value) -> list[dict] | None:
    """A node's GPU report (hooks.Node.observe()); None when the request carries none."""
    if value is None:
        return None
    out, seen = [], set()
    for n, g in enumerate(_v_list(value, "observed")):
        what = f"observed[{n}]"
        if not isinstance(g, dict):
            raise _rejected(f"{what}: expected an object describing a GPU, got {_show(g)}")
        index = _v_int(g.get("index"), f"{what}.index", 0, MAX_GPUS - 1)
        if index in seen:
            raise _rejected(f"{what}.index: GPU {index} is reported twice")
        seen.add(index)
        model = _v_text(g.get("model"), f"{what}.model", max_len=64)
        entry = {"index": index, "uuid": _v_text(g.get("uuid"), f"{what}.uuid", max_len=128),
                 "name": _v_text(g.get("name"), f"{what}.name"), "model": model,
                 "mig_enabled": _v_bool(g.get("mig_enabled"), f"{what}.mig_enabled"),
                 "lost": _v_bool(g.get("lost"), f"{what}.lost"),
                 # the MIG mode a change waiting for a GPU reset will set; absent (None): none waits
                 "mig_pending": None if g.get("mig_pending") is None else _v_bool(g.get("mig_pending"),
                                                                                   f"{what}.mig_pending"),
                 "instances": [_v_instance(i, f"{what}.instances[{k}]", gpu=index)
                               for k, i in enumerate(_v_list(g.get("instances"), f"{what}.instances"))],
                 "foreign": [_v_foreign(f, f"{what}.foreign[{k}]")
                             for k, f in enumerate(_v_list(g.get("foreign"), f"{what}.foreign"))],
                 # where the node's driver disagrees with our MIG table for this GPU (Node.table_errors)
                 "table_errors": [_v_cut(e, f"{what}.table_errors[{k}]", MAX_TABLE_ERROR)
                                  for k, e in enumerate(_v_list(g.get("table_errors"), f"{what}.table_errors"))]}
        if len(entry["table_errors"]) > 16:
            raise _rejected(f"{what}.table_errors: at most 16, got {len(entry['table_errors'])}")
        if len({(i["start"]) for i in entry["instances"]}) != len(entry["instances"]):
            raise _rejected(f"{what}: two instances at one start")
        # A model our tables do not list (a node newer than this controller, during a rolling upgrade), none
        # named with instances on the GPU, or instances a known model's table does not allow (a newer node's
        # profile, placement or count: store.models.off_table): the rest of the report is taken, and this GPU is
        # kept as it is (store: ObservedGpu.blocked, readable_model None: left out of the policy's view, of the
        # GRES and of every binding chosen here). Refusing the whole report refused every report and Prolog of
        # the node for the whole upgrade (a profile or placement our table lacks: until 2026-11-27).
        out.append(entry)
    return out


def _v_bindings(value) -> dict[str, list[dict]]:
    """The node's binding files: job id -> instances (keys that are not job ids are kept: they still hold slices)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_ITEMS:
        raise _rejected(f"bindings: expected an object of job id -> instances, got {_show(value)}")
    out = {}
    for job_id, insts in value.items():
        _v_text(job_id, "bindings key", optional=False, max_len=64)
        out[job_id] = _v_instances(insts, f"bindings[{job_id!r}]")
    return out


def _v_binding_times(value) -> dict[str, float]:
    """When the node wrote each binding file (its clock): job id -> time; {} from an older node."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_ITEMS:
        raise _rejected(f"binding_times: expected an object of job id -> time, got {_show(value)}")
    out = {}
    for job_id, at in value.items():
        _v_text(job_id, "binding_times key", optional=False, max_len=64)
        # A file time is advice (whether a binding file predates the job's current run): one that is not a
        # plausible time (a file touched to 1969, a clock far off) counts as unknown, as from an older node,
        # rather than refusing the whole report, which holds the node's GPUs and bindings.
        if _is_time(at):
            out[job_id] = float(at)
    return out


def _v_results(value, *, need_gpu: bool) -> list[dict]:
    """Layout-change results from a node (nvml.apply.ApplyResult.to_json(), or a failure), as plain text fields."""
    def text(v) -> str | None:
        return None if v is None else str(v)[:2000]

    out = []
    for n, r in enumerate(_v_list(value, "results")):
        if not isinstance(r, dict):
            raise _rejected(f"results[{n}]: expected an object, got {_show(r)}")
        gpu = r.get("gpu")
        out.append({"gpu": _v_int(gpu, f"results[{n}].gpu", 0, MAX_GPUS - 1) if need_gpu or gpu is not None else None,
                    "ok": bool(r.get("ok")), "reached": bool(r.get("reached", True)),
                    "before": text(r.get("before")), "after": text(r.get("after")), "done": text(r.get("done")),
                    "error": text(r.get("error"))})
    return out
