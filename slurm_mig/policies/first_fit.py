"""First fit with on-demand reconfiguration of idle slices: the simple baseline policies.

For each pending job in priority order: use free instances of its profile on
one node if there are enough; otherwise carve the missing ones out of idle
slices, destroying as little as possible (``carve_options()[0]``). Nodes are
tried in name order, GPUs in the order the state lists them.

* ``first-fit``: a job that cannot be placed waits and later jobs still start
  where they fit (or, with ``backfill=False``, everyone behind it waits: strict
  priority order). No reservation, so a stream of small jobs can starve a big one.
* ``greedy``: the same placement with Slurm's EASY backfill: the first blocked
  job gets a reservation where it can start earliest, and later jobs start only
  where they do not delay it. This is the "greedy on-demand reconfiguration"
  baseline of the benchmarks.

Both run on the incremental index of :mod:`slurm_mig.policies._core`, so a
decision costs work proportional to what changed and to the jobs placed, not to
the cluster size.
"""

from __future__ import annotations

from slurm_mig.policies._core import Ctx, DispatchPolicy, place_first_fit
from slurm_mig.policies.base import PendingJob


class FirstFitPolicy(DispatchPolicy):
    """First fit over nodes/GPUs, reconfiguring idle slices on demand."""

    name = "first-fit"
    version = "2"

    def __init__(self, backfill: bool = True, *, reservations: int = 0, explain_waiting: bool = True):
        super().__init__(backfill=backfill, reservations=reservations, explain_waiting=explain_waiting)

    def place(self, ctx: Ctx, job: PendingJob, end: float):
        return place_first_fit(ctx, job, end)


class GreedyPolicy(FirstFitPolicy):
    """Greedy on-demand reconfiguration, first fit, EASY backfill with one reservation."""

    name = "greedy"
    version = "1"

    def __init__(self, *, reservations: int = 1, explain_waiting: bool = True):
        super().__init__(True, reservations=reservations, explain_waiting=explain_waiting)
