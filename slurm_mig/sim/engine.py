"""The discrete-event simulator.

Model (the same contract the controller has with a policy):

* A cluster of nodes with MIG GPUs (``ClusterSpec``). Each GPU has a layout, the
  instances bound to jobs (busy), those being created (reconfiguring) and,
  for busy ones, the expected end from the job's time limit (busy_until).
* Events: job arrival, job end, end of a GPU's reconfiguration. After each
  batch of events at one instant, the policy is asked ``decide(ClusterState)``
  with the pending jobs in priority order (priority, then submit time), and the
  decision is applied:

  - a LayoutChange's destroys and creates are timed with
    :mod:`slurm_mig.mig.timing` (one after another per GPU, after any
    reconfiguration still under way on that GPU); created instances are in
    ``reconfiguring`` until then;
  - an Assignment binds the instances at once; the job starts when the last of
    them exists and runs for its run time on that profile (the workload's speed
    model), at most its time limit (Slurm ends it there), then frees them
    (instances are kept for the next job). The policy sees start + time limit
    as the instance's expected end (busy_until), as the controller does; never
    the run time.

* Deterministic: no randomness here; ties are broken by event order.

``Simulator.run()`` plays a whole workload with a policy. For training or
step-by-step use, ``reset()`` returns the first ClusterState and ``step(decision)``
applies a decision and advances to the next state that needs one (see
docs/benchmarks.md, "Simulator API").
"""

from __future__ import annotations

import bisect
import heapq
import math
import time as _time
from dataclasses import dataclass, field, replace
from typing import Callable

from slurm_mig.errors import ConfigError, SlurmMigError
from slurm_mig.mig.layout import Layout, Slot, parse_layout
from slurm_mig.mig.profiles import GpuModel, get_model
from slurm_mig.mig.timing import step_seconds
from slurm_mig.mig.transitions import plan_transition
from slurm_mig.policies.base import ClusterState, Decision, GpuState, PendingJob, Policy, check_decision
from slurm_mig.sim.workloads import Job, Workload, base_kind

INF = math.inf

# event kinds, in processing order at one instant
_END, _RECONF, _ARRIVAL = 0, 1, 2


@dataclass(frozen=True)
class NodeGroup:
    """``nodes`` nodes of ``gpus_per_node`` GPUs of one model: the partition ``name``, its nodes named
    ``<name>-NN`` (a mixed site, :meth:`ClusterSpec.mixed`), each GPU starting with ``initial_layout``
    (e.g. "7g@0" of that model; empty: no instances)."""

    name: str
    model: str
    nodes: int
    gpus_per_node: int = 8
    initial_layout: str = ""


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` x ``gpus_per_node`` GPUs of one model, starting with ``initial_layout`` each.

    Or a mixed site (``groups``, made by :meth:`mixed`): node groups of different models, each a partition
    a job may be restricted to (Job.partition). Then ``nodes`` counts every group's nodes, ``gpus_per_node``
    is the most of any group and ``model`` names the models joined by "+" (no single model: get_model
    refuses it, so nothing can take it for one)."""

    nodes: int = 2
    gpus_per_node: int = 8
    model: str = "H100-80GB"
    initial_layout: str = ""  # e.g. "7g@0"; empty: no instances
    groups: tuple[NodeGroup, ...] = ()

    @classmethod
    def mixed(cls, groups: "tuple[NodeGroup, ...] | list[NodeGroup]") -> "ClusterSpec":
        groups = tuple(groups)
        names = [g.name for g in groups]
        if not groups or len(set(names)) != len(names) or any(g.nodes < 1 or g.gpus_per_node < 1 for g in groups):
            raise ConfigError(f"a mixed cluster needs node groups with distinct names and at least one node and "
                              f"GPU each, got {groups}")
        for g in groups:
            get_model(g.model)  # an unknown model: say so now
        return cls(sum(g.nodes for g in groups), max(g.gpus_per_node for g in groups),
                   "+".join(dict.fromkeys(g.model for g in groups)), "", groups)

    @property
    def gpus(self) -> int:
        if self.groups:
            return sum(g.nodes * g.gpus_per_node for g in self.groups)
        return self.nodes * self.gpus_per_node

    @property
    def compute_slices(self) -> int:
        """Compute slices of all GPUs together (the capacity utilisation and the area bound count)."""
        return sum(get_model(m).compute_slices * n for m, n in self.gpus_by_model().items())

    def gpus_by_model(self) -> dict[str, int]:
        """Model -> how many GPUs of it, in the order the groups name them."""
        if not self.groups:
            return {self.model: self.gpus}
        out: dict[str, int] = {}
        for g in self.groups:
            out[g.model] = out.get(g.model, 0) + g.nodes * g.gpus_per_node
        return out

    def node_list(self) -> list[tuple[str, str, int, str]]:
        """(node name, model, GPUs, partition) of every node, in the simulator's GPU order; partition
        "" on a one-model cluster."""
        if not self.groups:
            return [(self.node_name(i), self.model, self.gpus_per_node, "") for i in range(self.nodes)]
        return [(f"{g.name}-{i:02d}", g.model, g.gpus_per_node, g.name) for g in self.groups for i in range(g.nodes)]

    def partitions(self) -> dict[str, tuple[str, ...]]:
        """Partition -> its nodes (sorted); empty on a one-model cluster."""
        out: dict[str, list[str]] = {}
        for node, _m, _n, part in self.node_list():
            if part:
                out.setdefault(part, []).append(node)
        return {p: tuple(sorted(ns)) for p, ns in out.items()}

    @classmethod
    def for_workload(cls, w: Workload, nodes: int | None = None, gpus_per_node: int | None = None) -> "ClusterSpec":
        return cls(nodes or w.nodes, gpus_per_node or w.gpus_per_node, w.model)

    def node_name(self, i: int) -> str:
        if self.groups:
            return self.node_list()[i][0]
        width = max(2, len(str(self.nodes - 1)))
        return f"n{i:0{width}d}"


@dataclass
class SimConfig:
    check: bool = False  # check_decision() on every decision (tests, --check)
    record: bool = False  # keep a timeline for plots and explanations
    reconfig_overhead_s: float = 0.0  # fixed extra seconds per LayoutChange (tooling, Slurm update)
    max_decisions: int | None = None  # safety stop
    explain: bool | None = None  # ask the policy for every waiting job's reason (default: when recording)
    # With explain: only these jobs' reasons (a queue policy then lists no other; SimResult.waiting_reasons
    # holds no other). `explain --replay` asks about one job among thousands.
    explain_jobs: frozenset[str] | None = None


@dataclass
class JobRecord:
    job: Job
    pending: PendingJob  # as the policy sees it
    run_profile: str  # the profile it asks the policy for (7g for no-MIG)
    run_count: int
    start: float = INF
    end: float = INF
    node: str = ""
    instances: tuple = ()  # ((gpu index, Slot), ...)
    duration: float = 0.0  # actual run time on what it got
    compute: int = 0  # compute slices held
    key: tuple = ()  # its place in the pending order


@dataclass
class Segment:
    """One bar of the timeline: an instance's life, a job on it, or a reconfiguration."""

    gpu: str
    kind: str  # "instance" | "job" | "create" | "destroy"
    slot: Slot
    t0: float
    t1: float
    job_id: str = ""


class _Gpu:
    __slots__ = ("node", "index", "key", "model", "layout", "busy", "busy_until", "reconf", "free_at",
                 "state", "born")

    def __init__(self, node: str, index: int, model: GpuModel, layout: Layout) -> None:
        self.node, self.index, self.model, self.layout = node, index, model, layout
        self.key = f"{node}/{index}"
        self.busy: dict[Slot, str] = {}
        self.busy_until: dict[Slot, float] = {}
        self.reconf: dict[Slot, float] = {}
        self.free_at = 0.0
        self.state: GpuState | None = None
        self.born: dict[Slot, float] = {s: 0.0 for s in layout.slots}

    def snapshot(self) -> GpuState:
        if self.state is None:
            self.state = GpuState(
                self.node, self.index, self.model, self.layout,
                frozenset(self.busy), frozenset(self.reconf),
                tuple(sorted(self.busy_until.items())), True,
            )
        return self.state


@dataclass
class SimResult:
    workload: str
    policy: str
    spec: ClusterSpec
    jobs: list[JobRecord]
    unfinished: int
    reconfigurations: int  # LayoutChanges applied (one GPU each)
    reconfig_steps: int  # creates + destroys
    reconfig_seconds: float
    decisions: int
    wall_s: float
    busy_slice_s: float  # compute-slice-seconds held by jobs
    timeline: list[Segment] = field(default_factory=list)
    waiting_reasons: dict[str, str] = field(default_factory=dict)  # last reason given per job (record mode)
    queue: list[tuple[float, int]] = field(default_factory=list)  # (time, pending jobs) (record mode)
    meta: dict = field(default_factory=dict)


class Simulator:
    """Plays a workload on a cluster, asking a policy at every change."""

    def __init__(self, workload: Workload, policy: Policy, spec: ClusterSpec | None = None,
                 config: SimConfig | None = None) -> None:
        self.workload = workload
        self.policy = policy
        self.spec = spec or ClusterSpec.for_workload(workload)
        self.config = config or SimConfig()
        # The one model of a one-model cluster (None on a mixed one: each GPU has its own)
        self.model = None if self.spec.groups else get_model(self.spec.model)
        explain = self.config.explain if self.config.explain is not None else self.config.record
        if explain and self.config.explain_jobs is not None:
            explain = frozenset(self.config.explain_jobs)
        if hasattr(policy, "explain_waiting"):
            policy.explain_waiting = explain  # reasons for thousands of jobs per decision cost time
        self.reset_state()

    # -- setup ---------------------------------------------------------------------
    def reset_state(self) -> None:
        spec = self.spec
        if spec.groups and spec.initial_layout:
            raise ConfigError("a mixed cluster's GPUs start with their group's layout (NodeGroup.initial_layout), "
                              "not ClusterSpec.initial_layout (one model's)")
        whole = bool(getattr(self.policy, "whole_gpu", False))
        if whole and spec.groups:
            # A request names one profile; a whole GPU is 7g on one model, 4g on an A30: no one size to ask for.
            raise ConfigError(f"{getattr(self.policy, 'name', 'this policy')} gives jobs whole GPUs, which a "
                              f"mixed cluster ({spec.model}) has in more than one size")
        self.gpus: list[_Gpu] = []
        models: dict[str, GpuModel] = {}
        group_layout = {g.name: g.initial_layout for g in spec.groups}  # a mixed cluster's: each group its own
        inits: dict[tuple[str, str], Layout] = {}
        for node, model_name, count, part in spec.node_list():
            model = models.get(model_name)
            if model is None:
                model = models[model_name] = get_model(model_name)
            text = group_layout.get(part, "") if spec.groups else spec.initial_layout
            init = inits.get((model_name, text))
            if init is None:
                init = inits[(model_name, text)] = parse_layout(text, model) if text else Layout.empty(model)
            for i in range(count):
                self.gpus.append(_Gpu(node, i, model, init))
        partitions = spec.partitions()
        self.by_key = {g.key: g for g in self.gpus}
        self.now = 0.0
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        model = self.model
        whole_kind = max(model.basic_profiles, key=lambda p: (p.compute_slices, p.memory_slices)).kind if whole else ""
        self.records: dict[str, JobRecord] = {}
        for j in self.workload.jobs:
            if j.job_id in self.records:
                raise ConfigError(f"workload {self.workload.name} has job id {j.job_id!r} twice")
            if whole:
                prof, count = whole_kind, j.count
                tl = j.time_limit_on(whole_kind)
            else:
                prof, count, tl = j.profile, j.count, j.time_limit_s
            if j.partition:
                pj = PendingJob(j.job_id, prof, count, j.submit_time, tl, partition=j.partition,
                                nodes=self._nodes_of(j, partitions))
            else:
                pj = PendingJob(j.job_id, prof, count, j.submit_time, tl)
            self.records[j.job_id] = JobRecord(j, pj, prof, count)
            self._push(j.submit_time, _ARRIVAL, j.job_id)
        self.pending: list[PendingJob] = []  # priority order: (-priority, submit, arrival)
        self._pkeys: list[tuple] = []  # their sort keys
        self._pending_tuple: tuple[PendingJob, ...] | None = ()
        self._gpu_tuple: tuple[GpuState, ...] | None = None
        self._dirty: set[int] = set()
        self._gidx = {g.key: i for i, g in enumerate(self.gpus)}
        self.reconfigurations = 0
        self.reconfig_steps = 0
        self.reconfig_seconds = 0.0
        self.decisions = 0
        self.busy_slice_s = 0.0
        self.timeline: list[Segment] = []
        self.reasons: dict[str, str] = {}
        self.queue_trace: list[tuple[float, int]] = []
        self.finished = 0
        self.stopped = ""
        self._step_s: dict[tuple[str, str, str], float] = {}

    def _nodes_of(self, job: Job, partitions: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
        """The nodes of the partitions ``job`` names (comma-separated), sorted, as Slurm gives PendingJob.nodes."""
        nodes: set[str] = set()
        for p in job.partition.split(","):
            got = partitions.get(p.strip())
            if got is None:
                raise ConfigError(f"job {job.job_id} of workload {self.workload.name} asks for partition {p!r}, "
                                  f"which the cluster ({self.spec.model}) does not have"
                                  + (f" (partitions: {', '.join(partitions)})" if partitions else
                                     ": a one-model cluster has none"))
            nodes.update(got)
        return tuple(sorted(nodes))

    def _push(self, t: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, payload))

    # -- the state a policy sees ---------------------------------------------------------
    def state(self) -> ClusterState:
        if self._gpu_tuple is None or self._dirty:
            states = list(self._gpu_tuple) if self._gpu_tuple is not None else [g.snapshot() for g in self.gpus]
            for i in self._dirty:
                states[i] = self.gpus[i].snapshot()
            self._dirty.clear()
            self._gpu_tuple = tuple(states)
        if self._pending_tuple is None:
            self._pending_tuple = tuple(self.pending)
        return ClusterState(self.now, self._gpu_tuple, self._pending_tuple)

    def _touch(self, g: _Gpu) -> None:
        g.state = None
        self._dirty.add(self._gidx[g.key])

    # -- events -------------------------------------------------------------------------
    def _advance(self) -> bool:
        """Process every event at the next instant. False when none are left."""
        if not self.events:
            return False
        t = self.events[0][0]
        self.now = t
        ev = self.events
        while ev and ev[0][0] == t:
            _, kind, _, payload = heapq.heappop(ev)
            if kind == _ARRIVAL:
                rec = self.records[payload]
                j = rec.job
                k = rec.key = (-j.priority, j.submit_time, self.seq)
                self.seq += 1
                if not self._pkeys or k > self._pkeys[-1]:
                    self._pkeys.append(k)
                    self.pending.append(rec.pending)
                else:
                    pos = bisect.bisect(self._pkeys, k)
                    self._pkeys.insert(pos, k)
                    self.pending.insert(pos, rec.pending)
                self._pending_tuple = None
            elif kind == _END:
                self._end_job(payload)
            else:
                g = self.gpus[payload]
                done = [s for s, d in g.reconf.items() if d <= t]
                if done:
                    for s in done:
                        del g.reconf[s]
                    self._touch(g)
        return True

    def _end_job(self, job_id: str) -> None:
        rec = self.records[job_id]
        self.finished += 1
        for gi, slot in rec.instances:
            g = self.by_key[f"{rec.node}/{gi}"]
            del g.busy[slot]
            g.busy_until.pop(slot, None)
            self._touch(g)

    # -- applying a decision -----------------------------------------------------------------
    def _step_time(self, model: GpuModel, profile: str, action: str) -> float:
        key = (model.name, profile, action)
        got = self._step_s.get(key)
        if got is None:
            got = self._step_s[key] = step_seconds(model, profile, action)
        return got

    def apply(self, decision: Decision) -> None:
        now = self.now
        cfg = self.config
        if cfg.check:
            check_decision(self.state(), decision)
        for ch in decision.changes:
            g = self.by_key.get(ch.key)
            if g is None:
                raise SlurmMigError(f"policy changed unknown GPU {ch.key}")
            cur, target = g.layout, ch.target
            # sorted: a set of Slots (strings inside) iterates in an order PYTHONHASHSEED picks, and the float
            # sum of the step times below then differed in its last bit between processes (0.7 or
            # 0.7000000000000001 for 3g+2g+1g), and with it every start time after that change
            destroyed = sorted(cur.slots - target.slots)
            created = sorted(target.slots - cur.slots)
            if not destroyed and not created:
                continue
            locked = g.busy.keys() | g.reconf.keys()
            if not locked.isdisjoint(destroyed):
                raise SlurmMigError(f"policy {decision.policy} destroys a busy instance on {g.key}")
            if cfg.check:
                plan_transition(cur, target, frozenset(locked))
            secs = sum(self._step_time(g.model, s.profile, "destroy") for s in destroyed)
            secs += sum(self._step_time(g.model, s.profile, "create") for s in created)
            secs += cfg.reconfig_overhead_s
            begin = max(now, g.free_at)
            done = begin + secs
            g.free_at = done
            g.layout = target
            for s in created:
                g.reconf[s] = done
            self._push(done, _RECONF, self._gidx[g.key])
            self.reconfigurations += 1
            self.reconfig_steps += len(destroyed) + len(created)
            self.reconfig_seconds += secs
            if cfg.record:
                t = begin
                for s in destroyed:
                    d = self._step_time(g.model, s.profile, "destroy")
                    self.timeline.append(Segment(g.key, "instance", s, g.born.pop(s, 0.0), t))
                    self.timeline.append(Segment(g.key, "destroy", s, t, t + d))
                    t += d
                for s in created:
                    self.timeline.append(Segment(g.key, "create", s, t, done))
                    g.born[s] = done
            self._touch(g)
        if decision.assignments:
            assigned = set()
            for a in decision.assignments:
                rec = self.records.get(a.job_id)
                if rec is None or rec.start != INF or a.job_id in assigned:
                    raise SlurmMigError(f"policy {decision.policy} assigned job {a.job_id}, which is not pending")
                assigned.add(a.job_id)
                allowed = rec.pending.nodes
                if allowed is not None and a.node not in allowed:
                    raise SlurmMigError(f"policy {decision.policy} assigned job {a.job_id} to {a.node}, outside "
                                        f"its partition {rec.pending.partition}")
                start = now
                gs = []
                for gi, slot in a.instances:
                    g = self.by_key.get(f"{a.node}/{gi}")
                    if g is None or slot not in g.layout.slots or slot in g.busy:
                        raise SlurmMigError(f"policy {decision.policy} assigned job {a.job_id} to "
                                            f"{a.node}/{gi}:{slot}, which is not a free instance")
                    gs.append((g, slot))
                    r = g.reconf.get(slot)
                    if r is not None and r > start:
                        start = r
                kind = base_kind(gs[0][1].profile) if gs else rec.run_profile
                prof = gs[0][0].model.profile(gs[0][1].profile) if gs else None
                dur = rec.job.duration_on(kind)
                tl = rec.pending.time_limit_s
                if tl and dur > tl:
                    dur = tl  # Slurm ends a job at its time limit (TIMEOUT): a replayed history can have one
                rec.start, rec.end, rec.duration = start, start + dur, dur
                rec.node = a.node
                rec.instances = tuple(a.instances)
                rec.compute = (prof.compute_slices if prof else 7) * len(gs)
                self.busy_slice_s += rec.compute * dur
                for g, slot in gs:
                    g.busy[slot] = a.job_id
                    if tl:
                        g.busy_until[slot] = start + tl  # what the controller shows: never the run time
                    self._touch(g)
                    if cfg.record:
                        self.timeline.append(Segment(g.key, "job", slot, start, start + dur, a.job_id))
                self._push(start + dur, _END, a.job_id)
            for jid in assigned:
                pos = bisect.bisect_left(self._pkeys, self.records[jid].key)
                del self.pending[pos]
                del self._pkeys[pos]
            self._pending_tuple = None
        if cfg.record:
            only = cfg.explain_jobs
            for jid, why in decision.waiting:
                if only is None or jid in only:
                    self.reasons[jid] = why

    # -- driving --------------------------------------------------------------------------
    def reset(self) -> ClusterState | None:
        """Start over; the first state that needs a decision (None: empty workload)."""
        self.reset_state()
        return self._next_state()

    def _next_state(self) -> ClusterState | None:
        while self._advance():
            if self.pending:
                return self.state()
        return None

    def step(self, decision: Decision,
             after_apply: Callable[["Simulator"], None] | None = None) -> ClusterState | None:
        """Apply ``decision`` to the current state; the next state needing one (None: done).

        ``after_apply(sim)`` runs between the two, when the decision's starts and re-carves are in
        place and time has not moved yet (what training/idle_capacity.py measures)."""
        self.apply(decision)
        self.decisions += 1
        if after_apply is not None:
            after_apply(self)
        if self.config.record:
            self.queue_trace.append((self.now, len(self.pending)))
        limit = self.config.max_decisions or 50 * (len(self.records) + len(self.gpus)) + 10_000
        if self.decisions >= limit:
            self.stopped = f"stopped after {self.decisions} decisions"
            return None
        return self._next_state()

    def run(self, progress: Callable[[float, int], None] | None = None) -> SimResult:
        """Play the whole workload; returns the per-job records and counters."""
        t0 = _time.perf_counter()
        state = self.reset()
        decide = self.policy.decide
        # Reasons asked for a few jobs alone (SimConfig.explain_jobs: explain --replay): once every one of them
        # has started it can wait no more, so the policy is asked for none; it looked for them in the rest of
        # the queue (10,000 jobs) in each of the thousands of decisions after, to the replay's end.
        asked = getattr(self.policy, "explain_waiting", None)
        watch = None
        if isinstance(asked, frozenset) and asked and self.config.explain_jobs is not None:
            watch = [self.records[j] for j in asked if j in self.records]
        try:
            while state is not None:
                decision = decide(state)
                state = self.step(decision)
                if watch is not None and all(r.start != INF for r in watch):
                    self.policy.explain_waiting = frozenset()
                    watch = None
        finally:
            if asked is not None:
                self.policy.explain_waiting = asked
        return self.result(_time.perf_counter() - t0)

    def result(self, wall_s: float) -> SimResult:
        recs = list(self.records.values())
        unfinished = sum(1 for r in recs if r.end == INF)
        if self.config.record:
            end = max((r.end for r in recs if r.end != INF), default=self.now)
            for g in self.gpus:
                for s, t in g.born.items():
                    self.timeline.append(Segment(g.key, "instance", s, t, end))
        return SimResult(
            self.workload.name, getattr(self.policy, "name", type(self.policy).__name__), self.spec, recs,
            unfinished, self.reconfigurations, self.reconfig_steps, self.reconfig_seconds, self.decisions,
            wall_s, self.busy_slice_s, self.timeline, self.reasons, self.queue_trace,
            {"stopped": self.stopped} if self.stopped else {},
        )


def simulate(workload: Workload, policy: Policy, spec: ClusterSpec | None = None,
             config: SimConfig | None = None) -> SimResult:
    """Run ``workload`` under ``policy`` on ``spec`` (default: the workload's suggested cluster)."""
    return Simulator(workload, policy, spec, config).run()
