"""The policy's view of the cluster, built from the database (Store.cluster_state)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from slurm_mig.errors import SlurmMigError
from slurm_mig.mig.layout import Layout, Slot, parse_layout
from slurm_mig.store.models import JournalEntry, known_model, readable_model
from slurm_mig.store.rows import _now, row_journal

log = logging.getLogger("slurm_mig.store.db")  # the name the store's messages have always had

#: How long after Slurm starts a job its unbound instance still counts as promised in cluster_state
#: (a Prolog binds within seconds; past this the controller's no-Prolog check takes over).
UNBOUND_START_WINDOW_S = 120.0


class ClusterStateMixin:
    """Store.cluster_state: the policy's view, read from every table."""

    # -- the policy's view ------------------------------------------------------
    def cluster_state(self, now: float | None = None, *, stale_after_s: float | None = None,
                      prolog_choice: Callable[[str, str, str, int, list[dict]], Iterable[tuple[int, Slot]]]
                      | None = None) -> Any:
        """A policies.base.ClusterState built from the database, so a policy can run straight from it.

        Per GPU with a known model: ``layout`` = the observed instances, with the
        finished steps of open journal entries applied and instances those
        entries are still creating added (when they fit). ``reconfiguring`` =
        every instance an open journal entry names. ``busy`` = instances bound
        to a live job, plus any the node reports in use. ``busy_until`` = start
        + time limit (+ the time it was suspended) of running bound jobs; none for a job suspended now. ``available`` = node up, MIG on, the
        GPU not blocked, and (with ``stale_after_s``) seen recently. ``pending`` = pending_jobs().
        GPUs whose model slurm-mig does not know are left out. ``prolog_choice(job_id, node, profile, count,
        gpus)``: the ``(gpu, slot)`` instances the Prolog of a job Slurm started on ``node`` would bind now, on
        ``gpus`` (the node's GPUs as this view holds them: dicts of index, observed, mig_enabled, blocked,
        desired and bound); the controller's (Controller._prolog_choice), so the store needs none of its
        rules (see "promised" below). Without it such a job holds the lowest free instances of its size.
        """
        from slurm_mig.policies.base import ClusterState, GpuState, PendingJob

        t = _now(now)
        with self.snapshot():
            nodes = {r["name"]: r for r in self._q("SELECT * FROM nodes")}
            gpu_rows = self._q("SELECT * FROM gpus ORDER BY node, gpu")
            inst_rows = self._q("SELECT * FROM instances ORDER BY node, gpu, start")
            bind_rows = self._q(
                "SELECT b.node, b.gpu, b.start, b.profile, b.job_id, j.start_time, j.time_limit_s, j.state, j.suspended_s "
                "FROM bindings b JOIN jobs j ON j.job_id = b.job_id WHERE b.released_at IS NULL"
            )
            journal = [row_journal(r) for r in self._q(
                "SELECT * FROM reconfig_journal WHERE state IN ('planned', 'in_progress') ORDER BY id")]
            pending = self.pending_jobs()
            # Jobs Slurm has started whose Prolog has not bound them yet: Slurm gave each an instance of
            # its size on its node, which the Prolog is about to take (see "promised" below).
            unbound = self._q(
                "SELECT job_id, node, profile, count, start_time FROM jobs WHERE state IN ('RUNNING', 'CONFIGURING') "
                "AND node IS NOT NULL AND (start_time IS NULL OR start_time >= ?) AND job_id NOT IN "
                "(SELECT job_id FROM bindings WHERE released_at IS NULL) ORDER BY start_time, job_id",
                (t - UNBOUND_START_WINDOW_S,))
            desired_rows = self._q("SELECT node, gpu, layout FROM desired_layouts") if unbound else []
        observed: dict[tuple[str, int], list[dict]] = {}
        for r in inst_rows:
            observed.setdefault((r["node"], r["gpu"]), []).append(r)
        bound: dict[tuple[str, int], list[dict]] = {}
        for r in bind_rows:
            bound.setdefault((r["node"], r["gpu"]), []).append(r)
        open_entries: dict[tuple[str, int], list[JournalEntry]] = {}
        for e in journal:
            open_entries.setdefault((e.node, e.gpu), []).append(e)

        gpus = []
        flags: dict[tuple[str, int], tuple[bool, bool]] = {}  # (MIG on, blocked), for prolog_choice
        for g in gpu_rows:
            key = (g["node"], g["gpu"])
            model = known_model(g["model"])
            if model is not None and g.get("blocked"):
                # Only a blocked GPU may hold instances its table does not allow (replace_observed blocks every
                # one): the check is not made for the others, every tick.
                model = readable_model(model, observed.get(key, ()))
            if model is None:
                # No model, one our tables do not list (a newer node's), or instances its table does not allow (a
                # newer node's profile or placement): left out of the policy's view. Not logged here, every tick:
                # the controller warns when the report comes (Controller._store_observed).
                continue
            layout = Layout(model, frozenset(Slot(r["start"], r["profile"]) for r in observed.get(key, ())))
            in_use = {Slot(r["start"], r["profile"]) for r in observed.get(key, ()) if r["in_use"]}
            touched: set[Slot] = set()

            def fits(lay: Layout, slot: Slot) -> bool:
                try:
                    return lay.with_slot(slot).is_valid()
                except SlurmMigError:
                    return False

            for e in open_entries.get(key, ()):
                for i, step in enumerate(e.steps):
                    slot = step.slot
                    touched.add(slot)
                    if step.action == "destroy" and i < e.progress:
                        layout = layout.without([slot])
                    elif step.action == "create" and slot not in layout.slots and fits(layout, slot):
                        layout = layout.with_slot(slot)
            bound_slots = set()
            until = []
            held = {Slot(b["start"], b["profile"]) for b in bound.get(key, ())}
            for b in bound.get(key, ()):
                slot = Slot(b["start"], b["profile"])
                if slot not in layout.slots and not fits(layout, slot):
                    # A Prolog is creating this bound instance right now: the binding is the truth, the
                    # idle instances in its way are on their way out.
                    try:
                        mask = model.profile(slot.profile).mask(slot.start)
                        layout = layout.without(s for s in layout.slots if s not in held
                                                and model.profile(s.profile).mask(s.start) & mask)
                    except SlurmMigError:
                        pass
                if slot not in layout.slots and fits(layout, slot):
                    layout = layout.with_slot(slot)
                if slot not in layout.slots:
                    log.warning("job %s is bound to %s on %s/%s, which overlaps the GPU's layout %s",
                                b["job_id"], slot, key[0], key[1], layout)
                    continue
                bound_slots.add(slot)
                if b["start_time"] is not None and b["time_limit_s"] is not None and b["state"] != "SUSPENDED":
                    # Slurm does not count suspended time against the limit (it moves the end on resume): a
                    # job once suspended ends that much later. One suspended now has no bounded end until it
                    # is resumed (left out: INF, as a job without a limit), so no reservation counts on its
                    # instance; start + limit there freed it while it may stay suspended for hours.
                    until.append((slot, float(b["start_time"]) + float(b["time_limit_s"])
                                  + float(b.get("suspended_s") or 0.0)))
            node = nodes.get(g["node"])
            # A blocked GPU (a MIG mode change pending a reset, an unknown profile's instance) keeps its layout
            # and busy instances in view, but no policy may change it or start a job on it, as on a drained node.
            available = bool(g["mig_enabled"]) and not g.get("blocked") and node is not None and node["state"] == "up"
            if available and stale_after_s is not None:
                available = node["last_seen"] is not None and t - node["last_seen"] <= stale_after_s
            flags[key] = (bool(g["mig_enabled"]), bool(g.get("blocked")))
            gpus.append(dict(
                node=g["node"], index=g["gpu"], model=model, layout=layout,
                busy=set((bound_slots | in_use) & layout.slots),
                reconfiguring=frozenset(touched & layout.slots),
                busy_until=tuple(sorted(until)), available=available,
            ))
        # Promised instances: a job Slurm started minutes ago, not bound yet, holds an idle instance of its
        # size on its node in the policy's view, so no plan destroys the instance its Prolog is about to
        # take. Without this a burst at start-up had Slurm hand out a node's boot instances while the same
        # tick planned them away, and the Prologs of bigger jobs sent there found the slices taken. The
        # instance is the one its Prolog would choose now (choose_binding, its reservation first): counted as
        # the lowest free one, a job reserved 3g@4 held 3g@0 in the plan, which re-carved 3g@4 under it. Where
        # the Prolog would create one, the lowest free existing one is held (a plan cannot promise the rest).
        desired = {(r["node"], r["gpu"]): r["layout"] for r in desired_rows}
        for j in unbound:
            count = max(1, int(j["count"] or 1))
            on_node = [g for g in gpus if g["node"] == j["node"]]
            picks = self._prolog_choice(j, on_node, count, desired, flags, prolog_choice)
            if picks is None:
                continue  # its Prolog will be refused (kept out of slices held for another job): holds nothing
            for gi, slot in picks:
                next(g for g in on_node if g["index"] == gi)["busy"].add(slot)
                count -= 1
            for _ in range(count):
                for g in on_node:
                    try:
                        want = g["model"].profile(j["profile"]).name
                    except SlurmMigError:
                        continue
                    free = sorted((sl for sl in g["layout"].slots if sl.profile == want and sl not in g["busy"]
                                   and sl not in g["reconfiguring"]), key=lambda sl: sl.start)
                    if free:
                        g["busy"].add(free[0])
                        break
        gpus = [GpuState(**{**g, "busy": frozenset(g["busy"])}) for g in gpus]
        jobs = tuple(PendingJob(job_id=j.job_id, profile=j.profile, count=j.count, submit_time=j.submit_time,
                                time_limit_s=j.time_limit_s, user=j.user, partition=j.partition) for j in pending)
        return ClusterState(now=t, gpus=tuple(gpus), pending=jobs)

    @staticmethod
    def _prolog_choice(job: dict, on_node: list[dict], count: int, desired: dict, flags: dict,
                       prolog_choice: Callable[[str, str, str, int, list[dict]], Iterable[tuple[int, Slot]]] | None
                       ) -> list[tuple[int, Slot]] | None:
        """The idle existing instances the Prolog of started, unbound ``job`` would bind now (``prolog_choice``
        on its node's GPUs as the policy sees them). Picks it would create are left out. None where
        ``prolog_choice`` says None: the Prolog will refuse the job."""
        if prolog_choice is None or not on_node:
            return []
        gpus = []
        for g in on_node:
            key = (g["node"], g["index"])
            want = None
            if key in desired:
                try:
                    want = parse_layout(desired[key], g["model"])
                except (ValueError, SlurmMigError):
                    pass
            mig_enabled, blocked = flags[key]
            gpus.append(dict(index=g["index"], observed=g["layout"], mig_enabled=mig_enabled, blocked=blocked,
                             desired=want, bound=frozenset(g["busy"])))
        try:
            plan = prolog_choice(str(job["job_id"]), job["node"], job["profile"], count, gpus)
            if plan is None:
                return None
            plan = list(plan)
        except (ValueError, KeyError, TypeError, SlurmMigError) as exc:
            log.warning("could not tell which instance job %s's Prolog will take: %s", job["job_id"], exc)
            return []
        by = {g["index"]: g for g in on_node}
        return [(gi, s) for gi, s in plan if gi in by and s in by[gi]["layout"].slots and s not in by[gi]["busy"]]
