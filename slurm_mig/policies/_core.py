"""Shared machinery of the dispatch policies: an incremental cluster index, Slurm-style
priority dispatch with backfill and a reservation for the blocked head job.

Speed without impurity: a policy object keeps a :class:`ClusterIndex` of derived
facts per :class:`GpuState` (locked slices, free instances, how many instances of
each profile could be carved), keyed on the *identity* of the GpuState objects
in the last state it saw. A new state that reuses most GpuState objects (the
simulator and the controller replace only the GPUs that changed) costs one
identity scan plus work for the changed GPUs. The result is exactly what a
fresh index would give, so ``decide`` stays a pure function of its input.

Backfill (EASY, like Slurm's): jobs are taken in priority order. The first
``reservations`` jobs that cannot start get a reservation: the GPU(s) and
memory slices where they can start earliest, judged from ``busy_until`` (the
running jobs' time limits). A later job may start only where it does not
touch a reserved region, or if its own time limit ends before the reservation
starts. So a big job is never starved by a stream of small ones.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from itertools import compress, count
from operator import attrgetter, is_not
from typing import Iterable, Iterator

from slurm_mig.errors import GeometryError
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.profiles import GpuModel
from slurm_mig.mig.transitions import CarveOption, carve_options
from slurm_mig.policies.base import (
    Assignment, ClusterState, Decision, GpuState, LayoutChange, PendingJob,
)

INF = math.inf
_job_id = attrgetter("job_id")
_SERIALS = count()  # GpuInfo.serial


# ---------------------------------------------------------------------------
# per-model tables and memoised geometry
# ---------------------------------------------------------------------------


class PInfo:
    """A profile of one GPU model with what the hot loops need, precomputed."""

    __slots__ = ("name", "kind", "compute", "mem", "max_count", "starts", "masks", "slots", "_pack")

    def __init__(self, p) -> None:
        self.name = p.name
        self.kind = p.kind
        self.compute = p.compute_slices
        self.mem = p.memory_slices
        self.max_count = p.max_count
        self.starts = tuple(p.starts)
        self.masks = tuple(p.mask(s) for s in self.starts)
        self.slots = {s: Slot(s, p.name) for s in self.starts}
        self._pack: dict[tuple[int, int, int], tuple[int, ...]] = {}

    def mask(self, start: int) -> int:
        return ((1 << self.mem) - 1) << start

    def pack(self, locked_mask: int, free_compute: int, room: int) -> tuple[int, ...]:
        """Starts of the most instances of this profile that fit beside the locked slices.

        Placements are aligned intervals of one size, so taking legal starts left
        to right is optimal; the compute-slice and per-GPU count limits cap it.
        """
        key = (locked_mask, free_compute, room)
        got = self._pack.get(key)
        if got is None:
            out = []
            used = locked_mask
            for s, m in zip(self.starts, self.masks):
                if not used & m:
                    out.append(s)
                    used |= m
            n = max(0, min(len(out), free_compute // self.compute, room))
            got = self._pack[key] = tuple(out[:n])
        return got


class ModelTable:
    """Profiles of one GPU model by every name a job may use."""

    _tables: dict[str, "ModelTable"] = {}

    def __init__(self, model: GpuModel) -> None:
        self.model = model
        self.compute = model.compute_slices
        self.by_name = {p.name: PInfo(p) for p in model.profiles}
        basic = [self.by_name[p.name] for p in model.basic_profiles]
        self.smallest = min(basic, key=lambda p: (p.compute, p.mem))
        self._resolved: dict[str, PInfo | None] = {}

    @classmethod
    def of(cls, model: GpuModel) -> "ModelTable":
        t = cls._tables.get(model.name)
        if t is None or t.model is not model:
            t = cls._tables[model.name] = cls(model)
        return t

    def resolve(self, key: str) -> PInfo | None:
        try:
            return self._resolved[key]
        except KeyError:
            try:
                pi = self.by_name[self.model.profile(key).name]
            except GeometryError:
                pi = None
            self._resolved[key] = pi
            return pi


_CARVE_MEMO: dict[tuple, list[CarveOption]] = {}


def carve_memo(layout: Layout, profile: str, locked: frozenset[Slot]) -> list[CarveOption]:
    """carve_options() memoised: layouts and locked sets repeat endlessly across GPUs."""
    key = (layout.model.name, layout.slots, profile, locked)
    got = _CARVE_MEMO.get(key)
    if got is None:
        if len(_CARVE_MEMO) > 200_000:
            _CARVE_MEMO.clear()
        got = _CARVE_MEMO[key] = carve_options(layout, profile, locked)
    return got


# ---------------------------------------------------------------------------
# derived facts about one GPU
# ---------------------------------------------------------------------------


class GpuInfo:
    """What the dispatch loop needs to know about one GPU; a clone is a working copy."""

    __slots__ = ("gs", "t", "gidx", "node", "avail", "layout", "locked", "locked_mask", "locked_compute",
                 "same", "ends", "busy_end", "free", "_cap", "_earliest", "_steps", "_sig", "serial")

    def __init__(self, gs: GpuState | None, t: ModelTable | None = None, gidx: int = 0, node: int = 0,
                 now: float = 0.0) -> None:
        if gs is None:  # clone() fills the fields
            return
        # Names this GpuInfo in the reservation heaps. Not id(): CPython hands a freed object's address
        # to the next one, so an entry for a replaced GpuInfo could pass for the new one's and order
        # GPUs by stale facts (measured: a reused policy then reserved differently from a fresh one).
        self.serial = next(_SERIALS)
        self.gs = gs
        self.t = t
        self.gidx = gidx
        self.node = node
        self.avail = gs.available
        self.layout = gs.layout
        self.locked = set(gs.busy) | set(gs.reconfiguring)
        by_name = t.by_name
        mask = comp = 0
        same: dict[str, int] = {}
        for s in self.locked:
            pi = by_name[s.profile]
            mask |= pi.mask(s.start)
            comp += pi.compute
            same[s.profile] = same.get(s.profile, 0) + 1
        self.locked_mask = mask
        self.locked_compute = comp
        self.same = same
        until = dict(gs.busy_until)
        ends = []
        for s in self.locked:
            if s in gs.busy:
                ends.append((until.get(s, INF), s.start, s.profile))
            else:  # being created or destroyed for no job: free again within a second
                ends.append((-INF, s.start, s.profile))
        ends.sort()
        self.ends = ends
        self.busy_end = max((e for e, _, _ in ends), default=-INF)
        self._refresh_free()
        self._cap: dict = {}
        self._earliest: dict = {}
        self._steps: dict = {}
        self._sig = None

    @property
    def sig(self) -> tuple:
        """What decides which instances could still be carved here: GPUs with equal sigs are alike."""
        s = self._sig
        if s is None:
            # the model's name, not id(self.t): a replaced table's address can be reused (see serial)
            s = self._sig = (self.t.model.name, self.locked_mask, self.locked_compute,
                             tuple(sorted(self.same.items())))
        return s

    def _refresh_free(self) -> None:
        free: dict[str, list[Slot]] = {}
        for s in self.layout.slots:
            if s not in self.locked:
                free.setdefault(s.profile, []).append(s)
        for v in free.values():
            v.sort()
        self.free = free

    def clone(self) -> "GpuInfo":
        c = GpuInfo(None)
        c.gs, c.t, c.gidx, c.node, c.avail = self.gs, self.t, self.gidx, self.node, self.avail
        c.layout = self.layout
        c.locked = set(self.locked)
        c.locked_mask, c.locked_compute = self.locked_mask, self.locked_compute
        c.same = dict(self.same)
        c.ends = list(self.ends)
        c.busy_end = self.busy_end
        c.free = {k: list(v) for k, v in self.free.items()}
        c._cap, c._earliest, c._steps = {}, {}, {}
        c._sig = self._sig
        c.serial = -1  # working copies never enter the heaps
        return c

    # -- queries -------------------------------------------------------------
    def carve_starts(self, pi: PInfo) -> tuple[int, ...]:
        """Starts of the most instances of ``pi`` this GPU could hold, destroying only idle ones."""
        return pi.pack(self.locked_mask, self.t.compute - self.locked_compute, pi.max_count - self.same.get(pi.name, 0))

    def cap(self, pi: PInfo | None, carve: bool) -> int:
        if pi is None or not self.avail:
            return 0
        key = (pi, carve)
        got = self._cap.get(key)
        if got is None:
            got = self._cap[key] = len(self.carve_starts(pi)) if carve else len(self.free.get(pi.name, ()))
        return got

    def any_cap(self, carve: bool) -> int:
        if not self.avail:
            return 0
        if carve:
            return self.cap(self.t.smallest, True)
        return sum(len(v) for v in self.free.values())

    def steps(self, pi: PInfo, carve: bool) -> list[tuple[float, int]]:
        """[(time, instances of pi available from then on)], from now until every job ends.

        Judged from busy_until (INF where a job has no time limit). With ``carve``
        idle slices may be re-carved; without, only existing instances count.
        """
        got = self._steps.get((pi, carve))
        if got is None:
            got = self._steps[(pi, carve)] = self._compute_steps(pi, carve)
        return got

    def _compute_steps(self, pi: PInfo, carve: bool) -> list[tuple[float, int]]:
        out: list[tuple[float, int]] = []
        mask, comp, same = self.locked_mask, self.locked_compute, dict(self.same)
        by_name = self.t.by_name
        if carve:
            n = len(pi.pack(mask, self.t.compute - comp, pi.max_count - same.get(pi.name, 0)))
        else:
            n = len(self.free.get(pi.name, ()))
        out.append((-INF, n))
        for end, start, pname in self.ends:
            q = by_name[pname]
            if carve:
                mask &= ~q.mask(start)
                comp -= q.compute
                same[pname] -= 1
                n2 = len(pi.pack(mask, self.t.compute - comp, pi.max_count - same.get(pi.name, 0)))
            else:
                n2 = n + (1 if pname == pi.name and Slot(start, pname) in self.layout.slots else 0)
            if n2 > n:
                if out[-1][0] == end:
                    out[-1] = (end, n2)
                else:
                    out.append((end, n2))
                n = n2
        return out

    def region_at(self, pi: PInfo, t: float, carve: bool, need: int = 1) -> int:
        """Memory-slice mask of ``need`` instances of pi that are free by time ``t``."""
        mask, comp, same = self.locked_mask, self.locked_compute, dict(self.same)
        by_name = self.t.by_name
        if carve:
            for end, start, pname in self.ends:
                if end > t:
                    break
                q = by_name[pname]
                mask &= ~q.mask(start)
                comp -= q.compute
                same[pname] -= 1
            starts = pi.pack(mask, self.t.compute - comp, pi.max_count - same.get(pi.name, 0))[:need]
        else:
            ending = {(s, p) for e, s, p in self.ends if e <= t}
            starts = [s.start for s in self.layout.slots
                      if s.profile == pi.name and (s not in self.locked or (s.start, s.profile) in ending)][:need]
        region = 0
        for s in starts:
            region |= pi.mask(s)
        return region

    def earliest(self, pi: PInfo, carve: bool) -> float:
        """When one instance of ``pi`` could start here (-INF: now)."""
        key = (pi, carve)
        got = self._earliest.get(key)
        if got is None:
            got = INF
            for t, n in self.steps(pi, carve):
                if n >= 1:
                    got = t
                    break
            self._earliest[key] = got
        return got

    # -- working-copy updates ---------------------------------------------------
    def _lock(self, slot: Slot, pi: PInfo, end: float) -> None:
        self.locked.add(slot)
        self.locked_mask |= pi.mask(slot.start)
        self.locked_compute += pi.compute
        self.same[pi.name] = self.same.get(pi.name, 0) + 1
        self.ends.append((end, slot.start, slot.profile))
        self.ends.sort()
        if end > self.busy_end:
            self.busy_end = end
        self._cap.clear()
        self._earliest.clear()
        self._steps.clear()
        self._sig = None

    def take(self, slot: Slot, pi: PInfo, end: float) -> None:
        """Give an existing idle instance to a job."""
        self._lock(slot, pi, end)
        self.free[slot.profile].remove(slot)

    def carve(self, opt: CarveOption, pi: PInfo, end: float) -> None:
        """Apply a carve option and give the new instance to a job."""
        self.layout = opt.target
        self._lock(opt.slot, pi, end)
        self._refresh_free()


# ---------------------------------------------------------------------------
# the index over all GPUs
# ---------------------------------------------------------------------------


def sig_groups(idx: "ClusterIndex", gpus: Iterable[int]) -> dict[tuple, list]:
    """``gpus`` grouped by sig, each group sorted latest busy_end first (then first-fit rank): the order
    the large-cluster walks score a group's GPUs in."""
    groups: dict[tuple, list] = {}
    infos, rank = idx.infos, idx.rank
    for g in gpus:
        info = infos[g]
        groups.setdefault(info.sig, []).append((-info.busy_end, rank[g], g))
    for v in groups.values():
        v.sort()
    return groups


class KeyIndex:
    """For one requested profile: which GPUs and nodes could offer it, and when."""

    __slots__ = ("key", "caps", "node_cap", "nodes", "gpus", "heap", "earliest", "groups")

    def __init__(self, idx: "ClusterIndex", key: str) -> None:
        self.key = key
        carve = idx.carve
        self.caps = [info.cap(info.t.resolve(key), carve) for info in idx.infos]
        self.node_cap = [0] * len(idx.node_gpus)
        for info, c in zip(idx.infos, self.caps):
            self.node_cap[info.node] += c
        self.nodes = [n for n, c in enumerate(self.node_cap) if c > 0]
        self.gpus = {i for i, c in enumerate(self.caps) if c > 0}
        self.heap: list | None = None
        self.earliest: dict[int, float] = {}
        self.groups: dict[tuple, list] | None = None

    def build_groups(self, idx: "ClusterIndex") -> dict[tuple, list]:
        """GPUs that could offer this profile, grouped by sig, each group sorted latest busy_end first."""
        self.groups = groups = sig_groups(idx, self.gpus)
        return groups

    def update(self, idx: "ClusterIndex", gidx: int, info: GpuInfo, old_info: GpuInfo | None = None) -> None:
        c = info.cap(info.t.resolve(self.key), idx.carve)
        old = self.caps[gidx]
        if self.groups is not None and old_info is not None:
            if old > 0:
                members = self.groups.get(old_info.sig)
                if members is not None:
                    item = (-old_info.busy_end, idx.rank[gidx], gidx)
                    pos = bisect.bisect_left(members, item)
                    if pos < len(members) and members[pos] == item:
                        del members[pos]
                    if not members:
                        del self.groups[old_info.sig]
            if c > 0:
                bisect.insort(self.groups.setdefault(info.sig, []), (-info.busy_end, idx.rank[gidx], gidx))
        if c != old:
            self.caps[gidx] = c
            n = info.node
            before = self.node_cap[n]
            self.node_cap[n] = after = before + c - old
            if before > 0 and after <= 0:
                del self.nodes[_bisect(self.nodes, n)]
            elif before <= 0 and after > 0:
                self.nodes.insert(_bisect(self.nodes, n), n)
            if c > 0:
                self.gpus.add(gidx)
            else:
                self.gpus.discard(gidx)
        if self.heap is not None:
            self._push(idx, gidx, info)

    def _push(self, idx: "ClusterIndex", gidx: int, info: GpuInfo) -> None:
        pi = info.t.resolve(self.key)
        if pi is None or not info.avail:
            self.earliest.pop(gidx, None)
            return
        e = info.earliest(pi, idx.carve)
        self.earliest[gidx] = e
        heapq.heappush(self.heap, (e, info.locked_compute, idx.rank[gidx], gidx, info.serial))

    def build_heap(self, idx: "ClusterIndex") -> None:
        self.heap = []
        self.earliest = {}
        for gidx, info in enumerate(idx.infos):
            self._push(idx, gidx, info)


def _bisect(a: list[int], x: int) -> int:
    lo, hi = 0, len(a)
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


class ClusterIndex:
    """Derived facts for every GPU of the last state seen, updated by identity diff."""

    def __init__(self, carve: bool = True) -> None:
        self.carve = carve
        self.gpus: tuple[GpuState, ...] | None = None
        self.infos: list[GpuInfo] = []
        self.node_names: list[str] = []
        self.node_index: dict[str, int] = {}
        self.node_gpus: list[list[int]] = []
        self.rank: list[int] = []
        self.keys: dict[str, KeyIndex] = {}
        self.any_gpus: set[int] = set()
        self.changed_since: list[int] = []  # GPUs changed by the last sync (all, after a rebuild)
        self.rebuilt = False
        # (profile, count, nodes) -> _never_holds' answer: it reads only which node holds which GPU models, which
        # change only with a rebuild
        self._never: dict[tuple, str] = {}
        # (profile, count, nodes) -> never_on's answer, the same way
        self._never_on: dict[tuple, frozenset[int]] = {}
        self._room: dict[str, list[int]] = {}  # profile -> per node, see never_on
        self._node_models: list[tuple] | None = None

    def sync(self, state: ClusterState) -> None:
        gpus = state.gpus
        old = self.gpus
        self.rebuilt = False
        if old is gpus:
            self.changed_since = []
            return
        if old is None or len(old) != len(gpus):
            self._rebuild(state)
            return
        changed = list(compress(range(len(gpus)), map(is_not, old, gpus)))
        for i in changed:
            if gpus[i].node != old[i].node or gpus[i].index != old[i].index or gpus[i].model is not old[i].model:
                self._rebuild(state)
                return
        self.gpus = gpus
        now = state.now
        for i in changed:
            old_info = self.infos[i]
            info = GpuInfo(gpus[i], ModelTable.of(gpus[i].model), i, old_info.node, now)
            self.infos[i] = info
            if info.any_cap(self.carve) > 0:
                self.any_gpus.add(i)
            else:
                self.any_gpus.discard(i)
            for ki in self.keys.values():
                ki.update(self, i, info, old_info)
        self._stale_heaps()
        self.changed_since = changed

    def _stale_heaps(self) -> None:
        n = len(self.infos)
        for ki in self.keys.values():
            if ki.heap is not None and len(ki.heap) > 4 * n + 64:
                ki.build_heap(self)

    def _rebuild(self, state: ClusterState) -> None:
        gpus = state.gpus
        self.gpus = gpus
        self.rebuilt = True
        self.node_names = sorted({g.node for g in gpus})
        node_rank = self.node_index = {n: i for i, n in enumerate(self.node_names)}
        self.node_gpus = [[] for _ in self.node_names]
        self.rank = [0] * len(gpus)
        self.infos = []
        for i, g in enumerate(gpus):
            nr = node_rank[g.node]
            self.rank[i] = nr * 4096 + len(self.node_gpus[nr])
            self.node_gpus[nr].append(i)
            self.infos.append(GpuInfo(g, ModelTable.of(g.model), i, nr, state.now))
        self.keys = {}
        self._never = {}
        self._never_on = {}
        self._room = {}
        self._node_models = None
        self.any_gpus = {i for i, info in enumerate(self.infos) if info.any_cap(self.carve) > 0}
        self.changed_since = list(range(len(gpus)))

    def never_holds(self, job: PendingJob) -> str:
        """Why no node ``job`` may start on could ever hold it (_never_holds on its ``nodes``); "" when one could.
        Such a job is no demand: the policies that carve for the queue's demand (frag-aware's weights, the rl
        policy's features) leave it out, as the dispatch loop lets it block and reserve nothing."""
        k = (job.profile, job.count, job.nodes)
        got = self._never.get(k)
        if got is None:
            allowed = None if job.nodes is None else _node_set(self, job.nodes)
            got = self._never[k] = _never_holds(self, allowed, job.profile, job.count)
        return got

    def never_on(self, job: PendingJob) -> frozenset[int]:
        """The nodes with a GPU whose model has ``job``'s profile that ``job`` can still never start on: outside
        the nodes it may start on (``nodes``: partition, --nodelist, --exclude, features), or with room for fewer
        than ``count`` of its instances even idle. Empty (the common case) when every node whose models have the
        size could hold it. A node none of whose models has the size is not listed. frag-aware leaves a job out of
        the demand each GPU of a listed node weighs. Memoised like never_holds."""
        k = (job.profile, job.count, job.nodes)
        got = self._never_on.get(k)
        if got is None:
            if len(self._never_on) > 100_000:
                self._never_on.clear()
            room = self._room.get(job.profile)
            if room is None:  # per node: instances of the profile its GPUs could hold at most; -1: no such model
                models = self._node_models
                if models is None:  # per node: (model table, its GPUs there)
                    models = self._node_models = []
                    for gidxs in self.node_gpus:
                        by: dict = {}
                        for g in gidxs:
                            t = self.infos[g].t
                            by[t] = by.get(t, 0) + 1
                        models.append(tuple(by.items()))
                room = self._room[job.profile] = []
                for pairs in models:
                    r = -1
                    for t, n in pairs:
                        pi = t.resolve(job.profile)
                        if pi is not None:
                            r = max(r, 0) + n * pi.max_count
                    room.append(r)
            allowed = None if job.nodes is None else _node_set(self, job.nodes)
            count = job.count
            got = self._never_on[k] = frozenset(
                n for n, r in enumerate(room) if r >= 0 and (r < count or (allowed is not None and n not in allowed)))
        return got

    def runnable(self, pending: Iterable[PendingJob], most: int | None = None) -> list[PendingJob]:
        """The jobs of ``pending`` some node they may start on could hold (never_holds ""), in order; the first
        ``most`` of them when given."""
        out = []
        for job in pending:
            if not self.never_holds(job):
                out.append(job)
                if most is not None and len(out) >= most:
                    break
        return out

    def key(self, key: str) -> KeyIndex:
        ki = self.keys.get(key)
        if ki is None:
            ki = self.keys[key] = KeyIndex(self, key)
        return ki


# ---------------------------------------------------------------------------
# one decision's working state
# ---------------------------------------------------------------------------


class Reservation:
    """Where and from when a blocked job will start: GPU index -> memory-slice mask."""

    __slots__ = ("job_id", "t", "regions", "node")

    def __init__(self, job_id: str, t: float, regions: dict[int, int], node: int) -> None:
        self.job_id, self.t, self.regions, self.node = job_id, t, regions, node

    def conflicts(self, gidx: int, mask: int, end: float) -> bool:
        """Whether a job ending at ``end`` on ``mask`` of GPU ``gidx`` would delay this reservation. A job with
        no known end (no time limit) always would: with the reservation's start unknown too ("when running
        jobs end", INF), INF > INF let every such job backfill into the region, so a stream of them kept the
        reserved job waiting (seen on the demo cluster)."""
        r = self.regions.get(gidx)
        return bool(r is not None and r & mask and (end > self.t or end == INF))


class Ctx:
    """The working state of one decision: copies of the GPUs it touched, its reservations."""

    def __init__(self, idx: ClusterIndex, now: float) -> None:
        self.idx = idx
        self.now = now
        self.work: dict[int, GpuInfo] = {}
        self.touched_nodes: set[int] = set()
        self.reservations: list[Reservation] = []
        self.assigned: list[Assignment] = []
        # Nodes (indices) the job being placed may start on; None: any. Set by the dispatch loop per job.
        self.allowed: frozenset[int] | None = None
        # Nodes it may not start on for want of CPUs (CpuLedger.short): None when none are; set per job too.
        self.denied: set[int] | None = None
        self._touched_ok: dict[tuple[str, int], list[int]] = {}  # touched nodes that could hold (key, count)
        self._touched_cap: dict[str, set[int]] = {}  # touched GPUs that could hold one x key
        # What a policy derived in this decision from GPU g as info(g) has it (gpu_memo[g]), or from node n's
        # GPUs (node_memo[n]): a job placed on g changes both, so commit() drops the entries of the GPUs and
        # nodes it changes. The frag-aware walk re-scores every GPU this decision changed for each job it
        # places; the memo spares it re-deriving what only a change to that GPU or node can alter.
        self.gpu_memo: dict[int, dict] = {}
        self.node_memo: dict[int, object] = {}

    def allows(self, gidx: int) -> bool:
        """May the job being placed start on GPU ``gidx``'s node?"""
        n = self.idx.infos[gidx].node
        return (self.allowed is None or n in self.allowed) and (self.denied is None or n not in self.denied)

    def allows_node(self, n: int) -> bool:
        """May the job being placed start on node ``n``?"""
        return (self.allowed is None or n in self.allowed) and (self.denied is None or n not in self.denied)

    def touched_with(self, key: str) -> set[int]:
        """GPUs this decision changed that could still hold one instance of ``key``."""
        got = self._touched_cap.get(key)
        if got is None:
            carve = self.idx.carve
            got = self._touched_cap[key] = {g for g, w in self.work.items() if w.cap(w.t.resolve(key), carve) > 0}
        return got

    def info(self, gidx: int) -> GpuInfo:
        w = self.work.get(gidx)
        return w if w is not None else self.idx.infos[gidx]

    def conflicts(self, gidx: int, mask: int, end: float) -> bool:
        for r in self.reservations:
            if r.conflicts(gidx, mask, end):
                return True
        return False

    def exhausted(self) -> bool:
        """True when no GPU has a single free slice: nothing more can start in this decision."""
        any_gpus = self.idx.any_gpus
        if len(any_gpus) > len(self.work) or any_gpus - self.work.keys():
            return False
        carve = self.idx.carve
        return not any(w.any_cap(carve) > 0 for w in self.work.values())

    def commit(self, local: dict[int, GpuInfo]) -> None:
        nodes = set()
        gpu_memo = self.gpu_memo
        for g, w in local.items():
            self.work[g] = w
            nodes.add(w.node)
            gpu_memo.pop(g, None)
        for n in nodes:
            self.node_memo.pop(n, None)
        self.touched_nodes |= nodes
        carve = self.idx.carve
        for key, have in self._touched_cap.items():
            for g, w in local.items():
                if w.cap(w.t.resolve(key), carve) > 0:
                    have.add(g)
                else:
                    have.discard(g)
        for (key, count), lst in self._touched_ok.items():
            for n in nodes:
                pos = bisect.bisect_left(lst, n)
                if pos < len(lst) and lst[pos] == n:
                    del lst[pos]
                if self._node_cap(n, key) >= count:
                    bisect.insort(lst, n)

    def _node_cap(self, n: int, key: str) -> int:
        carve = self.idx.carve
        total = 0
        for g in self.idx.node_gpus[n]:
            w = self.info(g)
            total += w.cap(w.t.resolve(key), carve)
        return total

    def candidate_nodes(self, key: str, count: int) -> Iterator[int]:
        """Nodes in name order whose GPUs could hold ``count`` x ``key`` (necessary, not sufficient)."""
        idx = self.idx
        ki = idx.key(key)
        touched = self.touched_nodes
        extra = self._touched_ok.get((key, count))
        if extra is None:
            extra = self._touched_ok[(key, count)] = sorted(n for n in touched if self._node_cap(n, key) >= count)
        ncap = ki.node_cap
        allowed = self.allowed
        denied = self.denied

        def untouched() -> Iterator[int]:
            for n in ki.nodes:
                if n not in touched and ncap[n] >= count and (allowed is None or n in allowed) and (
                        denied is None or n not in denied):
                    yield n

        if allowed is not None or denied is not None:
            extra = [n for n in extra if self.allows_node(n)]
        if not extra:
            yield from untouched()
        else:
            yield from heapq.merge(untouched(), list(extra))

    def candidate_gpus(self, key: str) -> Iterable[int]:
        """GPUs that could hold one instance of ``key`` now (ignoring reservations), unordered."""
        idx = self.idx
        ki = idx.key(key)
        if not self.work and self.allowed is None and self.denied is None:
            return ki.gpus
        carve = idx.carve
        out = set(ki.gpus)
        for g, w in self.work.items():
            if w.cap(w.t.resolve(key), carve) > 0:
                out.add(g)
            else:
                out.discard(g)
        if self.allowed is not None or self.denied is not None:
            out = {g for g in out if self.allows(g)}
        return out

    # -- reservations -------------------------------------------------------------
    def reserve(self, job: PendingJob) -> Reservation | None:
        """Reserve the place where ``job`` can start earliest (see module doc)."""
        idx = self.idx
        carve = idx.carve
        key, count = job.profile, job.count
        taken = {g for r in self.reservations for g in r.regions}
        if count == 1:
            ki = idx.key(key)
            if ki.heap is None:
                ki.build_heap(idx)
            best = None
            heap = ki.heap
            # Lazy deletion: entries for replaced GpuInfos are dropped as they surface.
            skipped = []
            while heap:
                e, lc, rank, g, ident = heap[0]
                info = idx.infos[g]
                if info.serial != ident or ki.earliest.get(g) != e:
                    heapq.heappop(heap)
                    continue
                if g in self.work or g in taken or not self.allows(g):
                    skipped.append(heapq.heappop(heap))
                    continue
                best = (e, lc, rank, g)
                break
            for item in skipped:
                heapq.heappush(heap, item)
            for g, w in self.work.items():
                if g in taken or not self.allows(g):
                    continue
                pi = w.t.resolve(key)
                if pi is None or not w.avail:
                    continue
                cand = (w.earliest(pi, carve), w.locked_compute, idx.rank[g], g)
                if best is None or cand < best:
                    best = cand
            if best is None:
                return None
            e, _, _, g = best
            info = self.info(g)
            pi = info.t.resolve(key)
            region = info.region_at(pi, e, carve) or pi.mask(pi.starts[0])
            r = Reservation(job.job_id, max(e, self.now), {g: region}, info.node)
            self.reservations.append(r)
            return r
        # Several instances on one node: sweep each node's step functions.
        best_node = None
        for n, gidxs in enumerate(idx.node_gpus):
            if any(g in taken for g in gidxs) or not self.allows_node(n):
                continue
            events: list[tuple[float, int, int]] = []
            for g in gidxs:
                w = self.info(g)
                pi = w.t.resolve(key)
                if pi is None or not w.avail:
                    continue
                prev = 0
                for t, k in w.steps(pi, carve):
                    events.append((t, g, k - prev))
                    prev = k
            events.sort()
            total = 0
            when = None
            for t, g, dk in events:
                total += dk
                if total >= count:
                    when = t
                    break
            if when is None:
                continue
            cand = (when, n)
            if best_node is None or cand < best_node:
                best_node = cand
        if best_node is None:
            return None
        when, n = best_node
        regions = {}
        for g in idx.node_gpus[n]:
            w = self.info(g)
            pi = w.t.resolve(key)
            if pi is None or not w.avail:
                continue
            m = w.region_at(pi, when, carve, need=count)
            if m:
                regions[g] = m
        r = Reservation(job.job_id, max(when, self.now), regions, n)
        self.reservations.append(r)
        return r

    # -- output -------------------------------------------------------------------
    def changes(self, reason: str) -> list[LayoutChange]:
        out = []
        for g in sorted(self.work):
            w = self.work[g]
            if w.layout is not w.gs.layout and w.layout.slots != w.gs.layout.slots:
                out.append(LayoutChange(w.gs.node, w.gs.index, w.layout,
                                        f"{reason}: {w.gs.layout} -> {w.layout}"))
        return out


class CpuLedger:
    """Each node's free CPUs (ClusterState.free_cpus) less those promised to the jobs one decision has
    placed there. Slurm starts a job only where its CPUs fit: two jobs placed on a node with room for one
    left the second carved for and waiting there until a later decision moved it (and its carve) elsewhere.
    """

    __slots__ = ("left", "promised", "_short")

    def __init__(self, idx: ClusterIndex, free_cpus: Iterable[tuple[str, int]]) -> None:
        at = idx.node_index
        self.left = {at[n]: max(0, c) for n, c in free_cpus if n in at}  # nodes not listed: not counted
        self.promised: dict[int, int] = {}
        self._short: dict[tuple[int, bool], set[int]] = {}

    def short(self, need: int, whole: bool) -> set[int]:
        """The nodes where ``need`` CPUs (all of a node's, with ``whole``) are not free now; kept up to date
        as the decision promises CPUs, so one set serves every job that asks the same."""
        key = (need, whole)
        got = self._short.get(key)
        if got is None:
            promised = self.promised
            got = self._short[key] = {n for n, c in self.left.items() if c < need or (whole and n in promised)}
        return got

    def promise(self, node: int, need: int, whole: bool) -> None:
        """Count ``need`` CPUs of ``node`` (every free one, with ``whole``) as taken by a job placed there."""
        c = self.left.get(node)
        if c is None:
            return
        take = max(c, need) if whole else need
        self.left[node] = c = c - take
        self.promised[node] = self.promised.get(node, 0) + take
        for (n, w), nodes in self._short.items():
            if c < n or w:
                nodes.add(node)


def _moment(t: float) -> str:
    """A reservation's start for its reason: the local date and time where ``t`` is a clock time (the
    controller's; `jobs` and `explain` showed "from t=1827299963s"), ``t=<seconds>s`` on the simulator's clock,
    which counts from 0. A fixed text either way: the controller records a decision only when it differs from
    the last."""
    if t >= 1e9:  # 2001 onwards: a clock time; no simulated workload runs for 30 years
        try:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
        except (OverflowError, OSError, ValueError):
            pass
    return f"t={t:.0f}s"


def _names(idx: ClusterIndex, nodes: list[int], most: int = 3) -> str:
    """Node names for a message: the first few, then how many more."""
    names = [idx.node_names[n] for n in sorted(nodes)]
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[:most])} and {len(names) - most} more"


def _cpu_note(ctx: Ctx, ledger: CpuLedger, job: PendingJob) -> str:
    """Why nodes the job could otherwise use were not its for CPUs; "" when none were."""
    allowed = ctx.allowed
    need = job.cpus or 1
    taken, few = [], []
    for n in ctx.denied or ():
        if allowed is not None and n not in allowed:
            continue
        # Whether it would have fitted but for the jobs this decision placed there.
        (taken if n in ledger.promised and ledger.left[n] + ledger.promised[n] >= need else few).append(n)
    idx = ctx.idx
    parts = []
    if taken:
        if job.exclusive:
            parts.append(f"{_names(idx, taken)} {'has' if len(taken) == 1 else 'have'} CPUs promised to jobs placed "
                         f"this tick")
        elif len(taken) == 1:
            parts.append(f"{_names(idx, taken)}'s free CPUs are promised to jobs placed this tick")
        else:
            parts.append(f"the free CPUs of {_names(idx, taken)} are promised to jobs placed this tick")
    if few:
        parts.append(f"{_names(idx, few)} {'has' if len(few) == 1 else 'have'} fewer free CPUs than it asks for "
                     f"({need})")
    return "; ".join(parts)


# ---------------------------------------------------------------------------
# the dispatch loop
# ---------------------------------------------------------------------------

PLACED, NO_ROOM, CONFLICT = "placed", "no-room", "conflict"


def _never_holds(idx: ClusterIndex, allowed: frozenset[int] | None, key: str, count: int) -> str:
    """Why none of the nodes a job may start on (``allowed``; None: every node) could hold ``count`` x ``key``
    even with every GPU idle and carved for it ("their GPUs (A30-24GB) have no 3g", "at most 2 on one node"),
    whatever their state (down nodes count: they may come back); "" when one could, or no GPU node is allowed.
    job_submit.lua bounds a count by the cluster's largest node (MAX_GPUS_PER_NODE), and the capacity placeholder lets
    Slurm queue a size no real node's model offers, so such a job is queued and would wait for ever."""
    most = 0
    models: set[str] = set()
    for n, gidxs in enumerate(idx.node_gpus):
        if allowed is not None and n not in allowed:
            continue
        room = 0
        for g in gidxs:
            t = idx.infos[g].t
            models.add(t.model.name)
            pi = t.resolve(key)
            if pi is not None:
                room += pi.max_count
        if room >= count:
            return ""
        most = max(most, room)
    if not models:
        return ""
    if most == 0:
        return f"their GPUs ({', '.join(sorted(models))}) have no {key}"
    return f"at most {most} on one node"


def _node_set(idx: ClusterIndex, names: tuple[str, ...]) -> frozenset[int] | None:
    """The node indices of ``names`` (a job's nodes); None when they cover every node."""
    got = frozenset(idx.node_index[n] for n in names if n in idx.node_index)
    return None if len(got) == len(idx.node_names) else got


class DispatchPolicy:
    """Priority order with EASY backfill; subclasses choose where each job goes (``place``)."""

    name = "dispatch"
    version = "1"
    carve = True  # may destroy idle instances and create new ones
    whole_gpu = False  # the simulator turns each request into whole GPUs (no-MIG)
    change_reason = "carve instances for pending jobs"

    def __init__(self, *, backfill: bool = True, reservations: int = 1,
                 explain_waiting: bool | frozenset[str] = True,
                 backfill_depth: int | None = 500, reserve_share: float = 1.0,
                 reserve_min_age_s: float = 0.0) -> None:
        self.backfill = backfill
        self.reserve_min_age_s = reserve_min_age_s
        self.reserve_share = reserve_share
        self.reservations = reservations
        self.backfill_depth = backfill_depth
        # True: every waiting job's reason in Decision.waiting; False: none; a frozenset of job ids: only
        # theirs (`explain --replay` asks about one job, and listing 10,000 reasons in each of a replay's
        # thousand decisions took a third of its time).
        self.explain_waiting = explain_waiting
        self._index = ClusterIndex(carve=self.carve)

    # subclasses --------------------------------------------------------------------
    def begin(self, ctx: Ctx, state: ClusterState) -> None:
        """Hook run before the queue is walked (e.g. demand weights, layout upkeep)."""

    def place(self, ctx: Ctx, job: PendingJob, end: float) -> tuple[str, Assignment | None]:
        raise NotImplementedError

    def finish(self, ctx: Ctx, state: ClusterState) -> list[LayoutChange]:
        """Hook after the queue walk: extra layout changes (default: those the placements made)."""
        return ctx.changes(self.change_reason)

    # the loop ----------------------------------------------------------------------
    def decide(self, state: ClusterState) -> Decision:
        idx = self._index
        idx.sync(state)
        now = state.now
        ctx = Ctx(idx, now)
        self.begin(ctx, state)
        assignments: list[Assignment] = []
        waiting: list[tuple[str, str]] = []
        explain = self.explain_waiting
        only = explain if isinstance(explain, frozenset) else None
        dead: set[tuple[str, int]] = set()
        conflict_end: dict[tuple[str, int], float] = {}
        reasons: dict[tuple[str, int], str] = {}
        reserved_reason = ""
        blocked_at = -1
        depth = self.backfill_depth
        # Jobs no node could ever hold (_never_holds): each gets its reason, but none of them blocks, reserves or
        # uses up the depth; counted, a few hundred of them queued ahead left a job that could start at once
        # 'not considered' behind them for as long as they stayed.
        never_keys: set = set()
        never_seen = 0  # such jobs walked past after the first blocked one
        pending = state.pending
        n = len(pending)
        i = 0
        stopped = ""
        allowed_of: dict[tuple[str, ...], frozenset[int] | None] = {}
        ledger = CpuLedger(idx, state.free_cpus) if state.free_cpus is not None else None
        while i < n:
            job = pending[i]
            i += 1
            if blocked_at >= 0:
                if not self.backfill:
                    i -= 1
                    stopped = "behind a higher-priority job that cannot start yet"
                    break
                if depth is not None and i - blocked_at - never_seen > depth:
                    i -= 1
                    stopped = f"beyond the backfill depth ({depth} jobs after the first blocked one)"
                    break
            key = (job.profile, job.count, job.nodes)
            counted = ledger is not None and (job.cpus or job.exclusive)
            if counted:
                need = job.cpus or 1
                ctx.denied = ledger.short(need, job.exclusive) or None
                if ctx.denied is not None:
                    # CPUs promised to jobs placed before it only shrink a job's nodes, so a request that found
                    # no room stays without room for this decision: the same CPUs and nodes, the same verdict.
                    key = (job.profile, job.count, job.nodes, need, job.exclusive)
                # Where its CPUs keep it off no node, it is judged on the nodes of a job that asks for none, and
                # shares that request's verdict: keyed apart, it was judged again after the jobs placed since
                # (a conflict with a reservation read "no node can hold ..." and could take a reservation that
                # the same decision without CPU counts, which skips it, did not make).
            else:
                ctx.denied = None
            if job.nodes is None:
                ctx.allowed = None
            else:
                ctx.allowed = allowed_of.get(job.nodes, False)
                if ctx.allowed is False:
                    ctx.allowed = allowed_of[job.nodes] = _node_set(idx, job.nodes)
            if key in dead:
                if blocked_at >= 0 and key in never_keys:
                    never_seen += 1
                if explain and (only is None or job.job_id in only):
                    waiting.append((job.job_id, reasons[key]))
                continue
            tl = job.time_limit_s
            end = now + tl if tl else INF
            ce = conflict_end.get(key)
            if ce is not None and end >= ce:
                if explain and (only is None or job.job_id in only):
                    waiting.append((job.job_id, reserved_reason))
                continue
            status, assignment = self.place(ctx, job, end)
            if status == PLACED:
                assignments.append(assignment)
                if counted:
                    ledger.promise(idx.node_index[assignment.node], need, job.exclusive)
                if ctx.exhausted():
                    stopped = "every slice is in use"
                    break
                continue
            if status == NO_ROOM:
                dead.add(key)
                where = "no node" if ctx.allowed is None else (
                    f"none of the {len(ctx.allowed)} node(s) Slurm may start it on" if ctx.allowed else
                    "no node: Slurm may start it on none of the GPU nodes now (its partition, --nodelist, --exclude, "
                    "--constraint, a reservation, or their free CPUs)")
                note = _cpu_note(ctx, ledger, job) if ctx.denied is not None else ""
                never = _never_holds(idx, ctx.allowed, job.profile, job.count)
                if never:
                    # Not "on idle slices now": it would wait for ever, whatever ends; it holds up no one.
                    reasons[key] = reason = f"{where} can ever hold {job.count} x {job.profile}: {never}"
                    never_keys.add(key)
                    if blocked_at >= 0:
                        never_seen += 1
                    if explain and (only is None or job.job_id in only):
                        waiting.append((job.job_id, reason))
                    continue
                if not note:
                    reason = f"{where} can hold {job.count} x {job.profile} on idle slices now"
                elif job.exclusive:
                    reason = (f"{where} can hold {job.count} x {job.profile} on idle slices now on a node of its own "
                              f"(--exclusive; {note})")
                else:
                    reason = (f"{where} can hold {job.count} x {job.profile} on idle slices now with {need} CPU(s) "
                              f"free ({note})")
                reasons[key] = reason
            else:
                conflict_end[key] = end if ce is None else min(end, ce)
                if not reserved_reason:
                    reserved_reason = self._reserved_reason(ctx)
                reason = reserved_reason
            if blocked_at < 0:
                blocked_at = i
            if len(ctx.reservations) < self.reservations and (
                    not ctx.reservations or now - job.submit_time >= self.reserve_min_age_s):
                r = ctx.reserve(job)
                if r is not None and len(ctx.reservations) > 1 and self.reserve_share < 1.0:
                    # Later reservations only while the reserved GPUs stay a small share of the cluster.
                    held = sum(len(x.regions) for x in ctx.reservations)
                    if held > self.reserve_share * len(idx.infos):
                        ctx.reservations.pop()
                        r = None
                if r is not None:
                    # A reservation that starts now says so, not the time: the decision carries it, and a
                    # reason that named the tick's time changed every tick, so the controller recorded the
                    # same decision again each tick (it records one only when it differs from the last).
                    when = ("when running jobs end" if r.t == INF else "from now" if r.t <= now
                            else f"from {_moment(r.t)}")
                    gp = ", ".join(f"{idx.gpus[g].key}" for g in sorted(r.regions))
                    reason += f"; reserved {gp} {when}"
                    if not reserved_reason or len(ctx.reservations) == 1:
                        reserved_reason = self._reserved_reason(ctx)
            if explain and (only is None or job.job_id in only):
                waiting.append((job.job_id, reason))
        if i < n and explain:
            why = f"not considered: {stopped}" if stopped else "not considered"
            if only is None:
                waiting.extend([(j.job_id, why) for j in pending[i:]])
            elif not only.isdisjoint(map(_job_id, pending[i:])):  # the scan in C; the rest only on a hit
                waiting.extend([(j.job_id, why) for j in pending[i:] if j.job_id in only])
        ctx.allowed = ctx.denied = None
        changes = self.finish(ctx, state)
        extra = {"reservations": [(r.job_id, r.t, sorted(idx.gpus[g].key for g in r.regions))
                                  for r in ctx.reservations],
                 # What each reservation holds: job id -> GPU key -> memory-slice mask. The controller keeps
                 # the idle instances there away from Slurm and from other jobs' Prologs, unless an assignment
                 # of this decision names them (its backfill), so the region drains for the job.
                 "held": {r.job_id: {idx.gpus[g].key: m for g, m in sorted(r.regions.items())}
                          for r in ctx.reservations},
                 "examined": i}
        return Decision(tuple(changes), tuple(assignments), tuple(waiting), self.name, self.version, extra)

    def _reserved_reason(self, ctx: Ctx) -> str:
        if ctx.reservations:
            r = ctx.reservations[0]
            return f"would delay job {r.job_id}, which holds a reservation (backfill)"
        return "held back by a reservation"

    # helpers for subclasses -------------------------------------------------------------
    @staticmethod
    def assignment(job: PendingJob, ctx: Ctx, picked: list[tuple[int, Slot]], how: str) -> Assignment:
        idx = ctx.idx
        node = idx.gpus[picked[0][0]].node
        where = ", ".join(f"{idx.gpus[g].key}:{s}" for g, s in picked)
        return Assignment(job.job_id, node, tuple((idx.gpus[g].index, s) for g, s in picked), f"{how} {where}")


def place_first_fit(ctx: Ctx, job: PendingJob, end: float, reserve_aware: bool = True) -> tuple[str, Assignment | None]:
    """The first node (by name) that can hold the job: its free instances first, then carves.

    Within a node: existing free instances in GPU order, then carve_options()[0]
    on each GPU in order (the first option that does not touch a reservation).
    """
    idx = ctx.idx
    carve = idx.carve
    key, count = job.profile, job.count
    conflicted = False
    for node in ctx.candidate_nodes(key, count):
        local: dict[int, GpuInfo] = {}
        picked: list[tuple[int, Slot]] = []
        carved = False
        gidxs = idx.node_gpus[node]
        for g in gidxs:
            w = ctx.info(g)
            pi = w.t.resolve(key)
            if pi is None or not w.avail:
                continue
            for slot in list(w.free.get(pi.name, ())):
                if len(picked) >= count:
                    break
                if reserve_aware and ctx.reservations and ctx.conflicts(g, pi.mask(slot.start), end):
                    conflicted = True
                    continue
                if g not in local:
                    local[g] = w = w.clone()
                w.take(slot, pi, end)
                picked.append((g, slot))
        if carve:
            for g in gidxs:
                if len(picked) >= count:
                    break
                w = local.get(g) or ctx.info(g)
                pi = w.t.resolve(key)
                if pi is None or not w.avail:
                    continue
                while len(picked) < count:
                    opts = carve_memo(w.layout, pi.name, frozenset(w.locked))
                    opt = None
                    for o in opts:
                        if reserve_aware and ctx.reservations and ctx.conflicts(g, pi.mask(o.slot.start), end):
                            conflicted = True
                            continue
                        opt = o
                        break
                    if opt is None:
                        break
                    if g not in local:
                        local[g] = w = w.clone()
                    w.carve(opt, pi, end)
                    picked.append((g, opt.slot))
                    carved = True
        if len(picked) == count:
            ctx.commit(local)
            how = "carved" if carved else "free instance(s)"
            return PLACED, DispatchPolicy.assignment(job, ctx, picked, how)
    return (CONFLICT if conflicted else NO_ROOM), None
