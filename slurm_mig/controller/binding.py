"""Choosing the MIG instances a starting job is bound to (pure; called under the store's lock).

Slurm picked the node from GRES counts; this picks the instances on that node.
Preference order, so that reconfiguration happens only when needed:
  1. the policy's reservation for this job, if it is still free;
  2. an instance that exists and is part of the GPU's intended layout;
  3. an instance of the intended layout that is still to be created;
  4. a new instance carved out of idle slices (fewest compute slices destroyed).
A GPU's intended layout is the controller's desired layout when it can be
reached without destroying a bound instance, else what the GPU has now.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from slurm_mig.errors import GeometryError, SlurmMigError
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.transitions import carve_options, plan_transition


@dataclass
class NodeGpu:
    """One GPU of the node the job landed on."""

    index: int
    observed: Layout  # what exists, plus instances held by jobs whose Prolog is still creating them
    desired: Layout | None = None
    bound: set[Slot] = field(default_factory=set)  # held by live jobs (all within ``observed``)


@dataclass(frozen=True)
class GpuRow:
    """What the controller knows of one GPU of a node, as :func:`node_gpus` reads it."""

    index: int
    observed: Layout | None  # what the node reported; None: the GPU's model is not known
    mig_enabled: bool
    blocked: bool  # a MIG mode change waits for a reset, an instance of an unknown profile, ...
    desired: Layout | None = None
    in_use: frozenset[Slot] = frozenset()  # instances the node reports in use


def node_gpus(rows: Iterable[GpuRow], held: Mapping[int, Iterable[Slot]]) -> list[NodeGpu]:
    """The GPUs of a node a Prolog may bind on, as choose_binding takes them: MIG on and a known model, not
    blocked (nothing new is carved or bound there; its jobs run on). ``held``: GPU index -> instances bound
    to other jobs; with the ones in use they are the GPU's bound set. A held instance not created yet (another
    Prolog is creating it) counts as present, the idle instances it will replace as gone, so nobody else is
    given those slices. The one builder of both the Prolog's choice (Controller._node_gpus) and the policy's
    guess at it for a job Slurm started whose Prolog has not bound it (Store.cluster_state's prolog_choice)."""
    out = []
    for r in rows:
        if r.observed is None or not r.mig_enabled or r.blocked:
            continue
        bound = set(held.get(r.index, ())) | set(r.in_use)
        out.append(NodeGpu(r.index, with_inflight(r.observed, bound), r.desired, bound))
    return out


def with_inflight(observed: Layout, held: set[Slot]) -> Layout:
    """``observed`` plus held instances not created yet, minus the idle instances they overlap."""
    model = observed.model
    pending = {s for s in held if s not in observed.slots}
    if not pending:
        return observed
    mask = 0
    for s in pending:
        mask |= model.profile(s.profile).mask(s.start)
    keep = {s for s in observed.slots if not (model.profile(s.profile).mask(s.start) & mask)}
    return Layout(model, frozenset(keep | pending))


@dataclass(frozen=True)
class BindPlan:
    """The instances to bind, and the layouts the node must reach first (only GPUs that change)."""

    instances: tuple[tuple[int, Slot], ...]
    targets: dict[int, Layout]
    reason: str


def intended_layout(g: NodeGpu) -> Layout:
    """The GPU's desired layout when it can be reached without destroying a bound instance, else what it has
    now (also what the controller tells Slurm the GPU holds: service.intended_layouts)."""
    if g.desired is None or g.desired.slots == g.observed.slots:
        return g.observed
    try:
        plan_transition(g.observed, g.desired, g.bound)
    except SlurmMigError:
        return g.observed  # the desired change is blocked by a job for now
    return g.desired


def overlaps(model, slot: Slot, mask: int) -> bool:
    """Whether ``slot`` uses a memory slice of ``mask``."""
    return bool(mask and model.profile(slot.profile).mask(slot.start) & mask)


def held_region_rows(held: Mapping | None) -> Iterator[tuple[str, object, int, int, set[Slot]]]:
    """(waiting job id, node, GPU index, memory-slice mask, the instances there promised to jobs Slurm started whose
    Prologs had not bound them) of each region the meta row "held" (``held``: job id -> [[node, gpu, mask, idle
    instances, promised instances], ...], as the controller's tick writes it) holds, in job id order; regions of
    no slice left out, and those the row does not hold in that shape (a damaged row, one of another version: the
    tick reads the row before it writes it again, so failing on one failed every tick). The controller
    (held_regions) and the operators' views read the row through this one parser."""
    if not isinstance(held, Mapping):
        return
    for jid, regions in sorted(held.items()):
        if not isinstance(regions, list):
            continue
        for r in regions:
            try:
                if not (isinstance(r, list) and len(r) > 2 and r[2]):
                    continue
                gi, mask = int(r[1]), int(r[2])
                promised = {Slot(int(st), str(p)) for p, st in r[4]} if len(r) > 4 else set()
            except (TypeError, ValueError, OverflowError):
                continue
            yield str(jid), r[0], gi, mask, promised


def held_regions(held: Mapping | None, node: str) -> Iterator[tuple[str, int, int, set[Slot]]]:
    """(waiting job id, GPU index, memory-slice mask, promised instances) of each region on ``node`` that the meta
    row "held" holds (held_region_rows)."""
    for jid, n, gi, mask, promised in held_region_rows(held):
        if n == node:
            yield jid, gi, mask, promised


def choose_binding_held(gpus: list[NodeGpu], profile: str, count: int, reserved: tuple[tuple[int, Slot], ...],
                        keep_off: Mapping[int, int], started: Mapping[int, Iterable[Slot]]
                        ) -> tuple[BindPlan | None, bool]:
    """choose_binding kept out of the ``keep_off`` slices (regions held for other waiting jobs), and whether
    only those slices kept it from an instance (the Prolog then says so, and the tick counts it holding none)."""
    plan = choose_binding(gpus, profile, count, reserved, keep_off, started)
    return plan, plan is None and bool(keep_off) and choose_binding(gpus, profile, count, reserved) is not None


def choose_binding(gpus: list[NodeGpu], profile: str, count: int,
                   reserved: tuple[tuple[int, Slot], ...] = (),
                   keep_off: Mapping[int, int] | None = None,
                   started: Mapping[int, Iterable[Slot]] | None = None) -> BindPlan | None:
    """Pick ``count`` instances of ``profile`` (kind or full name) on one node, or None if impossible now.

    ``keep_off``: GPU index -> memory-slice mask the policy reserved for another waiting job: no instance
    there is taken or carved, except one in ``reserved`` (the policy assigned it to this job: its backfill) or
    in ``started`` (GPU index -> instances the decision counted as held by jobs Slurm had started whose Prologs
    had not bound them: one of those jobs is binding now)."""
    keep_off = keep_off or {}
    started = {gi: set(v) for gi, v in (started or {}).items()}
    plans = {g.index: intended_layout(g) for g in gpus}
    taken = {g.index: set(g.bound) for g in gpus}
    by_index = {g.index: g for g in gpus}
    picked: list[tuple[int, Slot]] = []
    how: list[str] = []

    def resolve(g: NodeGpu) -> str | None:
        try:
            return g.observed.model.profile(profile).name
        except GeometryError:
            return None

    def take(gi: int, slot: Slot, why: str) -> None:
        picked.append((gi, slot))
        taken[gi].add(slot)
        how.append(f"{why} {slot} on GPU {gi}")

    for gi, slot in reserved:
        g = by_index.get(gi)
        if g is not None and len(picked) < count and slot in plans[gi].slots and slot not in taken[gi] \
                and resolve(g) == slot.profile:
            take(gi, slot, "reserved")
    for stage in ("exists", "planned"):
        for g in gpus:
            name = resolve(g)
            if name is None:
                continue
            for slot in sorted(plans[g.index].slots):
                if len(picked) >= count:
                    break
                if slot.profile != name or slot in taken[g.index] or (
                        overlaps(g.observed.model, slot, keep_off.get(g.index, 0))
                        and slot not in started.get(g.index, ())):
                    continue
                exists = slot in g.observed.slots
                if (stage == "exists") == exists:
                    take(g.index, slot, "existing" if exists else "planned")
    # Carve first around instances other pending jobs were promised (planned, not built yet); only if
    # that fails, take their slices too.
    promised = {g.index: plans[g.index].slots - g.observed.slots for g in gpus}
    while len(picked) < count:
        best = None
        for spare_promised in (True, False):
            best = _best_carve(gpus, plans, taken, promised if spare_promised else {}, resolve, keep_off)
            if best is not None:
                break
        if best is None:
            return None
        _, gi, opt = best
        plans[gi] = opt.target
        take(gi, opt.slot, "carved")
    targets = {gi: plans[gi] for gi in plans
               if plans[gi].slots != by_index[gi].observed.slots and any(p[0] == gi for p in picked)}
    return BindPlan(tuple(picked), targets, "; ".join(how))


def _best_carve(gpus, plans, taken, promised, resolve, keep_off):
    """The cheapest carve over the node's GPUs that keeps ``taken`` and ``promised`` instances and stays out of
    the ``keep_off`` slices."""
    best = None
    for g in gpus:
        name = resolve(g)
        if name is None:
            continue
        opts = carve_options(plans[g.index], name, taken[g.index] | promised.get(g.index, set()))
        # Carving must also be reachable from what physically exists now.
        for opt in opts:
            if overlaps(g.observed.model, opt.slot, keep_off.get(g.index, 0)):
                continue
            try:
                plan_transition(g.observed, opt.target, g.bound)
            except SlurmMigError:
                continue
            key = (opt.destroyed_compute, len(opt.destroyed), g.index, opt.slot.start)
            if best is None or key < best[0]:
                best = (key, g.index, opt)
            break
    return best
