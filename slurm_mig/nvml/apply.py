"""Move a GPU to a layout, mig-parted style, but without touching busy instances.

``apply_layout`` reads what the GPU has, plans with
``slurm_mig.mig.transitions.plan_transition`` (keeping every instance the
target shares, refusing with TransitionBlocked when a busy one would have to
go), and performs only the differing steps, one at a time, calling hooks
around each (for the reconfiguration journal). On a failed step it stops and
reports what was done and what failed; the GPU is read again at the end.
``assert_layout`` is mig-parted's assert mode: the differences, nothing changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from slurm_mig.errors import InvalidLayout
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.profiles import GpuModel
from slurm_mig.mig.transitions import Step, plan_transition
from slurm_mig.nvml.base import (
    InsufficientResources,
    InvalidArgument,
    MigBackend,
    MigInstance,
    MigModePending,
    NotSupported,
    NvmlError,
    foreign_instances,
)

BeforeStep = Callable[[Step], None]
AfterStep = Callable[[Step, "BaseException | None"], None]


@dataclass
class ApplyResult:
    """What apply_layout planned, did, and found afterwards."""

    gpu: int
    before: Layout
    target: Layout
    plan: list[Step]
    done: list[Step] = field(default_factory=list)
    failed: Step | None = None  # the step that raised
    error: NvmlError | None = None  # what it raised
    after: Layout | None = None  # observed at the end (None for a dry run, or if reading failed)
    after_error: NvmlError | None = None  # why reading the GPU at the end failed
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        """Every planned step succeeded (a dry run is ok: nothing was tried)."""
        return self.error is None

    @property
    def reached(self) -> bool:
        """The GPU was observed in the target layout at the end."""
        return self.after is not None and self.after.slots == self.target.slots

    @property
    def pending(self) -> list[Step]:
        """Planned steps not performed (the failed one included)."""
        return self.plan[len(self.done):]

    def raise_for_error(self) -> "ApplyResult":
        if self.error is not None:
            raise self.error
        return self

    def summary(self) -> str:
        if self.dry_run:
            return (f"GPU {self.gpu}: {self.before} -> {self.target}: would run {len(self.plan)} step(s)"
                    + (": " + "; ".join(map(str, self.plan)) if self.plan else " (already there)"))
        if self.error is None:
            return (f"GPU {self.gpu}: {self.before} -> {self.target}: {len(self.done)} step(s) done"
                    + ("" if self.reached else f", but the GPU now shows {self.after}"))
        return (f"GPU {self.gpu}: {self.before} -> {self.target}: stopped at step "
                f"{len(self.done) + 1}/{len(self.plan)} ({self.failed}): {self.error}; "
                f"done: {'; '.join(map(str, self.done)) or 'nothing'}; GPU now: {self.after}")

    def to_json(self) -> dict:
        return {
            "gpu": self.gpu,
            "model": self.target.model.name,
            "before": str(self.before),
            "target": str(self.target),
            "after": None if self.after is None else str(self.after),
            "plan": [str(s) for s in self.plan],
            "done": [str(s) for s in self.done],
            "failed": None if self.failed is None else str(self.failed),
            "error": None if self.error is None else str(self.error),
            "error_type": None if self.error is None else type(self.error).__name__,
            "dry_run": self.dry_run,
            "ok": self.ok,
            "reached": self.reached,
        }


@dataclass(frozen=True)
class LayoutDiff:
    """How an observed layout differs from a target: empty (falsy) when they match."""

    gpu: int
    observed: Layout
    target: Layout

    @property
    def missing(self) -> frozenset[Slot]:
        return self.target.slots - self.observed.slots

    @property
    def extra(self) -> frozenset[Slot]:
        return self.observed.slots - self.target.slots

    def __bool__(self) -> bool:
        return bool(self.missing or self.extra)

    def __str__(self) -> str:
        if not self:
            return f"GPU {self.gpu} matches {self.target}"
        parts = []
        if self.missing:
            parts.append("missing " + ", ".join(map(str, sorted(self.missing))))
        if self.extra:
            parts.append("unexpected " + ", ".join(map(str, sorted(self.extra))))
        return f"GPU {self.gpu} has {self.observed}, not {self.target}: " + "; ".join(parts)


def _gpu_model(backend: MigBackend, gpu: int, *, to_change: bool = True) -> GpuModel:
    """GPU ``gpu``'s model, or a typed error saying why its layout cannot be read (or, ``to_change``, changed)."""
    gpus = backend.gpus()
    if not 0 <= gpu < len(gpus):
        raise InvalidArgument(f"no GPU {gpu} (this node has {len(gpus)})")
    info = gpus[gpu]
    if info.model is None:
        raise NotSupported(f"GPU {gpu} ({info.name}) is not a MIG model slurm-mig knows")
    if not info.mig_enabled:
        raise NotSupported(f"GPU {gpu} ({info.name}) does not have MIG mode enabled; "
                           "slurm-mig never changes MIG mode itself")
    if to_change and info.mig_pending is not None:
        # The admin is switching MIG mode (it takes effect at the GPU's reset): carving new instances there
        # would only be lost at the reset, and destroying them is the admin's call. Busy instances run on.
        raise MigModePending(f"GPU {gpu} ({info.name}) has a MIG mode change pending a GPU reset (MIG "
                             f"{info.mig_mode}); slurm-mig creates and destroys nothing on it until the reset")
    return info.model


def _observe(backend: MigBackend, gpu: int, model: GpuModel) -> tuple[Layout, list[MigInstance]]:
    insts = backend.instances(gpu)
    return Layout(model, frozenset(i.slot for i in insts)), insts


def _normalise(model: GpuModel, slots: Iterable[Slot]) -> frozenset[Slot]:
    return frozenset(Slot(s.start, model.profile(s.profile).name) for s in slots)


def _check_foreign(backend: MigBackend, gpu: int, target: Layout) -> None:
    """Raise InsufficientResources, before anything is done, if ``target`` needs slices (memory or compute)
    that a GPU instance of a profile our tables do not list holds: it is never ours to destroy."""
    foreign = foreign_instances(backend, gpu)
    if not foreign:
        return
    in_way = [f for f in foreign if f.mask & target.used_mask]
    left = target.model.compute_slices - sum(f.compute_slices or 0 for f in foreign)
    if in_way:
        why = f"its slices are held by GPU instance(s) slurm-mig does not manage: {', '.join(map(str, in_way))}"
    elif target.compute_used > left:
        why = (f"it needs {target.compute_used} compute slices and the GPU instance(s) slurm-mig does not manage "
               f"({', '.join(map(str, foreign))}) leave {left}")
    else:
        return
    raise InsufficientResources(f"GPU {gpu} cannot hold {target}: {why}; nothing was changed")


def apply_layout(backend: MigBackend, gpu: int, target: Layout, *, extra_busy: Iterable[Slot] = (),
                 dry_run: bool = False, before_step: BeforeStep | None = None,
                 after_step: AfterStep | None = None) -> ApplyResult:
    """Move GPU ``gpu`` to ``target`` with the fewest creates/destroys, never destroying a busy instance.

    Busy = instances NVML reports in use, plus ``extra_busy`` (instances bound
    to jobs that have not started a process yet; they must be on the GPU, or
    InvalidLayout is raised). An idle half-made instance (no compute instance)
    the target keeps is destroyed and created again. Raises TransitionBlocked (with ``.blocking``)
    before doing anything if a busy instance would have to go, InvalidLayout
    for a bad target or a model mismatch, MigModePending (changing nothing, dry run
    included) on a GPU whose MIG mode is set to change at its next reset, and
    InsufficientResources (the same way) for a target that needs slices a GPU
    instance of a profile our tables do not list holds (``foreign_instances``). ``before_step(step)`` runs before
    each step and ``after_step(step, error_or_None)`` after it. A step that
    raises an NvmlError ends the run: the result carries the step and error
    (nothing is swallowed: see ``result.error``/``raise_for_error()``); any
    other exception propagates after ``after_step`` saw it.
    """
    model = _gpu_model(backend, gpu)
    if model.name != target.model.name:
        raise InvalidLayout(f"GPU {gpu} is a {model.name}; the target layout is for a {target.model.name}")
    current, insts = _observe(backend, gpu, model)
    _check_foreign(backend, gpu, target)
    busy = {i.slot for i in insts if i.in_use} | _normalise(model, extra_busy)
    # A half-made instance the target keeps would count as present and be bound to a job that then sees
    # no GPU: destroyed and made again, whole (one the target drops goes in the plan's own destroys).
    repair = frozenset(i.slot for i in insts if i.half_made and i.slot in target.slots) - busy
    plan = [Step("destroy", s) for s in sorted(repair)] + plan_transition(current.without(repair), target, busy)
    result = ApplyResult(gpu, current, target, plan, dry_run=dry_run)
    if dry_run:
        return result
    for step in plan:
        if before_step is not None:
            before_step(step)
        try:
            if step.action == "destroy":
                backend.destroy(gpu, step.slot)
            elif step.action == "create":
                backend.create(gpu, step.slot)
            else:  # pragma: no cover - plan_transition makes only these two
                raise ValueError(f"unknown step action {step.action!r}")
        except NvmlError as exc:
            if after_step is not None:
                after_step(step, exc)
            result.failed, result.error = step, exc
            break
        except BaseException as exc:
            if after_step is not None:
                after_step(step, exc)
            raise
        result.done.append(step)
        if after_step is not None:
            after_step(step, None)
    try:
        result.after = _observe(backend, gpu, model)[0]
    except NvmlError as exc:
        result.after_error = exc
    return result


def assert_layout(backend: MigBackend, gpu: int, target: Layout) -> LayoutDiff:
    """How GPU ``gpu`` differs from ``target`` (falsy when it matches). Changes nothing."""
    model = _gpu_model(backend, gpu, to_change=False)
    if model.name != target.model.name:
        raise InvalidLayout(f"GPU {gpu} is a {model.name}; the target layout is for a {target.model.name}")
    return LayoutDiff(gpu, _observe(backend, gpu, model)[0], target)
