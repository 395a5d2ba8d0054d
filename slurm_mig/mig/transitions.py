"""Transitions between layouts that never touch a busy instance.

Unlike NVIDIA's mig-parted, which clears the whole GPU, a transition keeps
every instance the target also has, destroys only what the target lacks, and
refuses (TransitionBlocked) if anything it must destroy is in use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from slurm_mig.errors import InvalidLayout, TransitionBlocked
from slurm_mig.mig.layout import Layout, Slot


@dataclass(frozen=True)
class Step:
    """One NVML action: destroy or create one GPU instance (with its compute instance)."""

    action: str  # "destroy" | "create"
    slot: Slot

    def __str__(self) -> str:
        return f"{self.action} {self.slot}"


def plan_transition(current: Layout, target: Layout, busy: Iterable[Slot] = ()) -> list[Step]:
    """The minimal ordered steps from ``current`` to ``target``.

    Instances present in both are kept. Destroys come first (largest first) so
    that every create lands on free slices; each intermediate layout is a
    subset of either ``current`` or ``target`` and therefore valid.

    Raises InvalidLayout if the target breaks a MIG rule, and TransitionBlocked
    naming the busy instance(s) that would have to be destroyed.
    """
    if current.model.name != target.model.name:
        raise InvalidLayout(f"cannot move a {current.model.name} to a {target.model.name} layout")
    target.validate()
    busy = frozenset(busy)
    unknown = busy - current.slots
    if unknown:
        raise InvalidLayout("busy instance(s) not in the current layout: " + ", ".join(map(str, sorted(unknown))))
    to_destroy = current.slots - target.slots
    blocking = tuple(sorted(to_destroy & busy))
    if blocking:
        names = ", ".join(str(s) for s in blocking)
        raise TransitionBlocked(
            f"{current.model.name} layout {current} -> {target} would destroy busy instance(s) {names}",
            blocking,
        )
    size = lambda s: current.model.profile(s.profile).memory_slices  # noqa: E731
    destroys = sorted(to_destroy, key=lambda s: (-size(s), s))
    creates = sorted(target.slots - current.slots, key=lambda s: (-size(s), s))
    return [Step("destroy", s) for s in destroys] + [Step("create", s) for s in creates]


def apply_steps(layout: Layout, steps: Iterable[Step]) -> Layout:
    """The layout after ``steps``, checking each intermediate state is valid (for planners and tests)."""
    for step in steps:
        if step.action == "destroy":
            if step.slot not in layout.slots:
                raise InvalidLayout(f"cannot destroy {step.slot}: not in layout {layout}")
            layout = layout.without([step.slot])
        elif step.action == "create":
            profile = layout.model.profile(step.slot.profile)
            if not layout.can_add(profile, step.slot.start):
                raise InvalidLayout(f"cannot create {step.slot} beside {layout}")
            layout = layout.with_slot(step.slot)
        else:
            raise ValueError(f"unknown step action {step.action!r}")
    return layout


@dataclass(frozen=True)
class CarveOption:
    """One way to make room for a new instance on a GPU by destroying only unlocked instances."""

    slot: Slot  # the instance to create
    destroyed: frozenset[Slot]  # idle instances that must go first
    target: Layout  # the GPU's layout afterwards

    @property
    def destroyed_compute(self) -> int:
        return sum(self.target.model.profile(s.profile).compute_slices for s in self.destroyed)


def carve_options(layout: Layout, profile_name: str, locked: Iterable[Slot] = ()) -> list[CarveOption]:
    """Every placement where ``profile_name`` could be created, destroying only unlocked instances.

    ``locked`` holds the instances that must survive (busy, reserved, being
    reconfigured). For each legal start, the overlapping instances are
    destroyed; if the compute-slice or max-count limit still bites, the
    smallest further unlocked instances go too. Options that destroy nothing
    come first, then by fewest compute slices destroyed.
    """
    model = layout.model
    profile = model.profile(profile_name)
    locked = frozenset(locked)
    options: list[CarveOption] = []
    for start in profile.starts:
        new = Slot(start, profile.name)
        if new in layout.slots:
            continue  # it exists already: using it is a dispatch, not a carve
        mask = profile.mask(start)
        overlapping = {s for s in layout.slots if model.profile(s.profile).mask(s.start) & mask}
        if overlapping & locked:
            continue
        remaining = layout.without(overlapping)
        extra: set[Slot] = set()
        # Free compute slices / a max-count place by dropping the smallest idle instances.
        spare = sorted((s for s in remaining.slots if s not in locked),
                       key=lambda s: (model.profile(s.profile).compute_slices, -s.start))
        while not remaining.can_add(profile, start) and spare:
            victim = spare.pop(0)
            extra.add(victim)
            remaining = remaining.without([victim])
        if not remaining.can_add(profile, start):
            continue
        options.append(CarveOption(new, frozenset(overlapping | extra), remaining.with_slot(new)))
    options.sort(key=lambda o: (o.destroyed_compute, len(o.destroyed), o.slot.start))
    return options
