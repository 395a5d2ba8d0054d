"""First fit with on-demand reconfiguration of idle slices: the simple baseline policy.

For each pending job in priority order: use free instances of its profile on
one node if there are enough; otherwise carve the missing ones out of idle
slices, destroying as little as possible. A job that cannot be placed waits,
and (unless ``backfill`` is on) so does everyone behind it, which is Slurm's
strict priority order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from slurm_mig.errors import GeometryError
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.transitions import carve_options
from slurm_mig.policies.base import Assignment, ClusterState, Decision, GpuState, LayoutChange, PendingJob


@dataclass
class _Gpu:
    """Mutable working copy of one GPU while a decision is being built."""

    state: GpuState
    layout: Layout
    taken: set[Slot]  # busy, reconfiguring, or assigned in this decision

    def free(self, profile: str) -> list[Slot]:
        return sorted(s for s in self.layout.slots if s.profile == profile and s not in self.taken)


class FirstFitPolicy:
    """First fit over nodes/GPUs, reconfiguring idle slices on demand."""

    name = "first-fit"
    version = "1"

    def __init__(self, backfill: bool = True):
        self.backfill = backfill

    def decide(self, state: ClusterState) -> Decision:
        gpus: dict[str, list[_Gpu]] = defaultdict(list)
        for g in state.gpus:
            if g.available:
                gpus[g.node].append(_Gpu(g, g.layout, set(g.locked)))
        changed: set[str] = set()
        assignments: list[Assignment] = []
        waiting: list[tuple[str, str]] = []
        blocked = False
        for job in state.pending:
            if blocked and not self.backfill:
                waiting.append((job.job_id, "behind a higher-priority job that cannot start yet"))
                continue
            placed = self._place(job, gpus, changed)
            if placed is None:
                blocked = True
                waiting.append((job.job_id, f"no node can hold {job.count} x {job.profile} on idle slices now"))
            else:
                assignments.append(placed)
        changes = []
        for node_gpus in gpus.values():
            for g in node_gpus:
                if g.state.key in changed:
                    changes.append(LayoutChange(g.state.node, g.state.index, g.layout,
                                                f"carve instances for pending jobs: {g.state.layout} -> {g.layout}"))
        return Decision(tuple(changes), tuple(assignments), tuple(waiting), self.name, self.version)

    def _place(self, job: PendingJob, gpus: dict[str, list[_Gpu]], changed: set[str]) -> Assignment | None:
        for node, node_gpus in sorted(gpus.items()):
            picked: list[tuple[_Gpu, Slot, bool]] = []
            # First free instances that exist, then carve new ones; tentative until the job fits.
            trial = {g.state.key: (g.layout, set(g.taken)) for g in node_gpus}
            for g in node_gpus:
                try:
                    profile = g.state.model.profile(job.profile).name
                except GeometryError:
                    continue
                for slot in g.free(profile):
                    if len(picked) < job.count:
                        picked.append((g, slot, False))
                        g.taken.add(slot)
            for g in node_gpus:
                while len(picked) < job.count:
                    try:
                        profile = g.state.model.profile(job.profile).name
                    except GeometryError:
                        break
                    options = carve_options(g.layout, profile, g.taken)
                    if not options:
                        break
                    opt = options[0]
                    g.layout = opt.target
                    g.taken.add(opt.slot)
                    picked.append((g, opt.slot, True))
            if len(picked) == job.count:
                for g, _slot, carved in picked:
                    if carved:
                        changed.add(g.state.key)
                reason = ("free instance(s) " if not any(c for *_, c in picked) else "carved ") + ", ".join(
                    f"{g.state.key}:{s}" for g, s, _ in picked)
                return Assignment(job.job_id, node, tuple((g.state.index, s) for g, s, _ in picked), reason)
            # Roll back this node's tentative picks.
            for g in node_gpus:
                g.layout, g.taken = trial[g.state.key][0], trial[g.state.key][1]
        return None
