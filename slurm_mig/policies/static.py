"""Static partitioning baselines: a fixed layout per GPU, never changed while jobs run.

* ``static``: each GPU gets the layout of a plan (one layout for all, a list
  applied to the GPUs in state order, or a mapping of ``node/gpu`` keys with
  ``"*"`` as the default). A GPU whose layout differs is moved to its planned
  layout once nothing busy stands in the way (at start-up: at once). Jobs go to
  existing free instances of their profile, first fit, with EASY backfill.
  ``best-static`` in the benchmarks is this policy with the plan found best for
  the workload by simulation (slurm_mig.sim.bench.search_static).
* ``no-mig``: the site without MIG. Every GPU is one 7g instance and every job
  gets whole GPUs: the simulator turns a request for ``count`` instances into
  ``count`` whole GPUs and runs it at its 7g speed.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from slurm_mig.errors import GeometryError
from slurm_mig.mig.layout import Layout, Slot, parse_layout
from slurm_mig.policies._core import Ctx, DispatchPolicy, place_first_fit
from slurm_mig.policies.base import ClusterState, PendingJob

Plan = str | Sequence[str] | Mapping[str, str]


class StaticPolicy(DispatchPolicy):
    """A fixed layout per GPU; dispatch to free instances only."""

    name = "static"
    version = "1"
    carve = False
    change_reason = "set up the static layout"

    def __init__(self, plan: Plan = "3g@0,2g@4,1g@6", *, reservations: int = 1, explain_waiting: bool = True):
        super().__init__(reservations=reservations, explain_waiting=explain_waiting)
        self.plan = plan
        self._targets: list[Layout] | None = None
        self._targets_for: tuple | None = None
        self._mismatch: set[int] = set()

    def describe(self) -> str:
        p = self.plan
        if isinstance(p, str):
            return p
        if isinstance(p, Mapping):
            return "; ".join(f"{k}={v}" for k, v in p.items())
        counts: dict[str, int] = {}
        for x in p:
            counts[x] = counts.get(x, 0) + 1
        return " + ".join(f"{n} x [{x}]" for x, n in counts.items())

    def _target_for(self, i: int, gs) -> Layout:
        """The planned layout; a GPU whose model cannot take it is left as it is."""
        p = self.plan
        if isinstance(p, str):
            text = p
        elif isinstance(p, Mapping):
            text = p.get(gs.key, p.get("*", ""))
        else:
            text = p[i % len(p)] if p else ""
        try:
            return parse_layout(text, gs.model)
        except GeometryError:
            return gs.layout

    def begin(self, ctx: Ctx, state: ClusterState) -> None:
        idx = ctx.idx
        shape = tuple((g.key, g.model.name) for g in state.gpus) if idx.rebuilt or self._targets is None else None
        if shape is not None and shape != self._targets_for:
            self._targets = [self._target_for(i, g) for i, g in enumerate(state.gpus)]
            self._targets_for = shape
            self._mismatch = set(range(len(state.gpus)))
        elif idx.rebuilt:
            self._mismatch = set(range(len(state.gpus)))
        else:
            self._mismatch.update(idx.changed_since)
        targets = self._targets
        for i in sorted(self._mismatch):
            info = idx.infos[i]
            target = targets[i]
            cur = info.layout
            if cur.slots == target.slots:
                self._mismatch.discard(i)
                continue
            if not info.avail or (cur.slots - target.slots) & info.locked:
                continue  # wait until the jobs on the instances to remove end
            w = info.clone()
            w.layout = target
            w._refresh_free()
            w._cap.clear()
            ctx.commit({i: w})

    def place(self, ctx: Ctx, job: PendingJob, end: float):
        return place_first_fit(ctx, job, end)


class NoMigPolicy(StaticPolicy):
    """Whole GPUs only: every GPU is one instance of its biggest profile (7g; 4g on an A30)
    and every job gets whole GPUs."""

    name = "no-mig"
    version = "1"
    whole_gpu = True
    change_reason = "one whole-GPU instance"

    def __init__(self, *, reservations: int = 1, explain_waiting: bool = True):
        super().__init__("7g@0", reservations=reservations, explain_waiting=explain_waiting)

    def _target_for(self, i: int, gs) -> Layout:
        return Layout(gs.model, frozenset({Slot(0, whole_profile(gs.model).name)}))


def whole_profile(model):
    """The profile that is the whole GPU (7g; 4g on an A30)."""
    return max(model.basic_profiles, key=lambda p: (p.compute_slices, p.memory_slices))
