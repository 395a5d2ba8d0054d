"""The policy interface: the one seam the controller, the simulator and training share.

A policy is a pure function of a ClusterState snapshot (each GPU's model,
layout, busy and reconfiguring instances, plus the pending queue in Slurm
priority order) that returns a Decision: the layout changes to make and the
job-to-instance assignments, each with a reason. No I/O inside a policy: the
caller records decisions and acts on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from slurm_mig.errors import SlurmMigError
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.profiles import GpuModel
from slurm_mig.mig.transitions import plan_transition


@dataclass(frozen=True)
class GpuState:
    """One GPU as a policy sees it."""

    node: str
    index: int
    model: GpuModel
    layout: Layout  # instances that exist (or are being created) now
    busy: frozenset[Slot] = frozenset()  # bound to a running or starting job
    reconfiguring: frozenset[Slot] = frozenset()  # being created/destroyed: neither usable nor changeable
    busy_until: tuple[tuple[Slot, float], ...] = ()  # expected end (from time limits), where known
    available: bool = True  # node up and schedulable

    @property
    def key(self) -> str:
        return f"{self.node}/{self.index}"

    @property
    def locked(self) -> frozenset[Slot]:
        """Instances a policy must not destroy."""
        return self.busy | self.reconfiguring

    @property
    def idle(self) -> frozenset[Slot]:
        """Instances that exist and are free to run a job now."""
        return self.layout.slots - self.locked


@dataclass(frozen=True)
class PendingJob:
    """A job waiting for MIG instances, as Slurm queued it."""

    job_id: str
    profile: str  # kind ("3g", "1g.dm", "1g+me") or full name; resolved per GPU model
    count: int = 1  # instances, all on one node
    submit_time: float = 0.0
    time_limit_s: float | None = None  # the user's --time, a runtime estimate
    user: str = ""
    partition: str = ""
    # The nodes Slurm may start it on (its partitions, --nodelist, --exclude, --constraint, reservations),
    # sorted; None: any node.
    nodes: tuple[str, ...] | None = None
    # The CPUs it asks for on its node (squeue's cpus: -n x -c), counted against ClusterState.free_cpus;
    # None: not counted (as for every simulated job).
    cpus: int | None = None
    exclusive: bool = False  # --exclusive: with counted CPUs, a node nothing else is placed on this decision


@dataclass(frozen=True)
class ClusterState:
    """Everything a policy may look at. ``pending`` is in Slurm priority order."""

    now: float
    gpus: tuple[GpuState, ...]
    pending: tuple[PendingJob, ...]
    # (node, CPUs Slurm has not allocated there), sorted by node: the jobs a decision places on a node ask
    # for no more than these together (PendingJob.cpus). None: CPUs are not counted; a node left out: not
    # counted there.
    free_cpus: tuple[tuple[str, int], ...] | None = None

    def gpu(self, key: str) -> GpuState:
        for g in self.gpus:
            if g.key == key:
                return g
        raise KeyError(key)


@dataclass(frozen=True)
class LayoutChange:
    """Move one GPU to a new layout (only idle instances may differ)."""

    node: str
    gpu: int
    target: Layout
    reason: str

    @property
    def key(self) -> str:
        return f"{self.node}/{self.gpu}"


@dataclass(frozen=True)
class Assignment:
    """Run ``job_id`` on these instances (all on ``node``); they exist or a LayoutChange creates them."""

    job_id: str
    node: str
    instances: tuple[tuple[int, Slot], ...]  # (gpu index, slot)
    reason: str


@dataclass(frozen=True)
class Decision:
    """What a policy wants done now, and why each waiting job waits."""

    changes: tuple[LayoutChange, ...] = ()
    assignments: tuple[Assignment, ...] = ()
    waiting: tuple[tuple[str, str], ...] = ()  # (job_id, reason)
    policy: str = ""
    version: str = ""
    extra: dict = field(default_factory=dict, compare=False)  # policy-specific diagnostics


class Policy(Protocol):
    """A layout-and-dispatch policy."""

    name: str
    version: str

    def decide(self, state: ClusterState) -> Decision:
        """Pure: the same state gives the same decision."""


class DecisionError(SlurmMigError):
    """A policy returned a decision that breaks a rule (the caller must not act on it)."""


def check_decision(state: ClusterState, decision: Decision) -> None:
    """Raise DecisionError unless ``decision`` is safe to act on in ``state``.

    Rules: every target is a valid layout reachable without touching a locked
    instance; one change per GPU; every assigned instance exists after the
    changes, is neither busy nor being created or destroyed by an earlier
    change, and is given to one job only; a job's instances are on one node and
    match its profile and count, on a node Slurm may start it on; only pending
    jobs are assigned; nothing is changed or assigned on a GPU whose node is
    down or drained; where ``state.free_cpus`` counts a node's CPUs, the jobs
    assigned there ask for no more than it has free (PendingJob.cpus; an
    ``--exclusive`` job shares its node with no other counted job).
    """
    gpus = {g.key: g for g in state.gpus}
    pending = {j.job_id: j for j in state.pending}
    after: dict[str, Layout] = {k: g.layout for k, g in gpus.items()}
    changed: set[str] = set()
    for ch in decision.changes:
        g = gpus.get(ch.key)
        if g is None:
            raise DecisionError(f"layout change for unknown GPU {ch.key}")
        if ch.key in changed:
            raise DecisionError(f"two layout changes for GPU {ch.key}")
        if not g.available:
            raise DecisionError(f"layout change for GPU {ch.key}, whose node is down or drained")
        changed.add(ch.key)
        try:
            plan_transition(g.layout, ch.target, g.locked)
        except SlurmMigError as exc:
            raise DecisionError(f"change for {ch.key} is unsafe: {exc}") from exc
        after[ch.key] = ch.target
    used: set[tuple[str, Slot]] = set()
    seen_jobs: set[str] = set()
    for a in decision.assignments:
        job = pending.get(a.job_id)
        if job is None:
            raise DecisionError(f"assignment for job {a.job_id}, which is not pending")
        if a.job_id in seen_jobs:
            raise DecisionError(f"job {a.job_id} assigned twice")
        seen_jobs.add(a.job_id)
        if len(a.instances) != job.count:
            raise DecisionError(f"job {a.job_id} wants {job.count} instance(s), got {len(a.instances)}")
        if job.nodes is not None and a.node not in job.nodes:
            raise DecisionError(f"job {a.job_id} assigned to {a.node}, where Slurm will not start it")
        for gpu_index, slot in a.instances:
            key = f"{a.node}/{gpu_index}"
            g = gpus.get(key)
            if g is None:
                raise DecisionError(f"job {a.job_id} assigned to unknown GPU {key}")
            if slot not in after[key].slots:
                raise DecisionError(f"job {a.job_id} assigned to {slot} on {key}, which will not exist")
            if not g.available:
                raise DecisionError(f"job {a.job_id} assigned to {key}, whose node is down or drained")
            if slot in g.busy:
                raise DecisionError(f"job {a.job_id} assigned to busy instance {slot} on {key}")
            if slot in g.reconfiguring:
                # Being made or destroyed by an earlier change (an open journal entry): not there to use.
                raise DecisionError(f"job {a.job_id} assigned to {slot} on {key}, which is being reconfigured")
            try:
                wanted = g.model.profile(job.profile).name
            except SlurmMigError as exc:
                raise DecisionError(f"job {a.job_id} asks for {job.profile}: {exc}") from exc
            if wanted != slot.profile:
                raise DecisionError(f"job {a.job_id} wants {job.profile}, assigned {slot.profile} on {key}")
            if (key, slot) in used:
                raise DecisionError(f"instance {slot} on {key} assigned to two jobs")
            used.add((key, slot))
    if state.free_cpus is not None:
        _check_cpus(state, decision, pending)


def _check_cpus(state: ClusterState, decision: Decision, pending: dict[str, PendingJob]) -> None:
    """Raise DecisionError where the jobs a decision places on a node ask for more CPUs than it has free:
    Slurm would start the later ones nowhere near their instances."""
    free = dict(state.free_cpus or ())
    asked: dict[str, list[PendingJob]] = {}
    for a in decision.assignments:
        job = pending[a.job_id]
        if a.node in free and (job.cpus or job.exclusive):
            asked.setdefault(a.node, []).append(job)
    for node, jobs in asked.items():
        total = sum(j.cpus or 1 for j in jobs)
        if total > free[node]:
            raise DecisionError(f"jobs {', '.join(j.job_id for j in jobs)} placed on {node} ask for {total} CPU(s), "
                                f"more than its {free[node]} free")
        whole = next((j for j in jobs if j.exclusive), None)
        if whole is not None and len(jobs) > 1:
            raise DecisionError(f"job {whole.job_id} asks for all of {node} (--exclusive), where job(s) "
                                f"{', '.join(j.job_id for j in jobs if j is not whole)} are placed too")
