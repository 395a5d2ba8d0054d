"""Fragmentation-aware, time-aligned placement with look-ahead over the pending queue.

In the spirit of FGD (Alibaba, ATC'23), nos and MISO (FACTS §5). Jobs are taken
in Slurm priority order with EASY backfill, like the baselines; what differs is
*where* each job goes and who holds a reservation. Every place a job could start
now -- an existing free instance, or a carve of idle slices at each legal start
on each GPU -- is scored, and the lowest score wins:

* fragmentation (FGD-like): the demand-weighted capacity the placement destroys,
  sum over sizes Q of w_Q x size_Q x (instances of Q the GPU could still hold
  before - after). The weights w_Q are the compute demand of the next
  ``lookahead`` pending jobs (blocked ones included) blended with the running
  mix (``running_prior``) as a prior for what arrives next. A 1g on an empty GPU
  costs a whole 7g when big jobs wait; beside other small jobs it costs nothing;
  jobs no node they may start on could ever hold (a size their nodes' models
  lack, more instances than one node has room for) are not demand and are
  skipped. A GPU does not weigh the jobs its node can never take though its
  models have their size (outside their partition or node list, or too little
  room for all their instances); one set of weights per GPU model and set of such
  jobs; where every job may go anywhere (no partitions or node restrictions,
  nodes alike) that is the whole look-ahead's. Sizes a GPU's model lacks still
  count: they make carving that GPU cheap, which steers small jobs to the
  smaller model and keeps the bigger one for the sizes only it has (leaving
  them out cost +120 s of mean wait on the mixed site, docs/benchmarks.md).
  A 3g goes to slice 4 so a 4g still fits at 0.
* time alignment, per GPU (``w_time``): a GPU is free for big jobs only when
  its *last* job ends. A job that outlives every job already on the GPU
  postpones that moment; the postponement (log1p(seconds / ``tau``), from the
  time limits) is charged, weighted by the demand for the sizes the GPU can no
  longer offer. Small jobs go beside jobs that outlast them.
* time alignment, per node (``w_node_time``): the same for a node's last job,
  weighted by the demand for multi-GPU jobs (at least ``multi_prior``; the GPU's
  share, as its weights), which
  need whole nodes. Long jobs join nodes that are busy for long anyway, so other
  nodes drain.
* reconfiguration: a small charge per instance created or destroyed, so an
  existing instance wins a tie (one LayoutChange per GPU per decision).
* the bigger model (``w_model``), on a site of several GPU models only: a place
  on a GPU whose model has more compute slices than the smallest of the
  cluster's models that has the job's size is charged ``w_model``. A 1g on an
  H100 takes slices that are the only home of the 3g and 7g jobs; on an A30 it
  takes slices no 3g or 7g could use. Without it frag-aware put a quarter of
  the 1g jobs that could go anywhere on the H100s (measuring each GPU's loss
  in its own terms, a partly used H100 often looked cheaper than an A30), and
  its mean wait on the mixed site rose 70 s above this (docs/benchmarks.md).
  One model (or models alike in slices): never charged, the same decisions.

Reservations: the first blocked job always gets one (EASY backfill); a second
blocked job gets one too once it has waited ``reserve_min_age_s`` (like
Slurm's bf_min_age_reserve), while reserved GPUs stay at most
``reserve_share`` of the cluster. Without the second one, a second multi-GPU
job could see its only drainable node taken by a long job for weeks. A blocked
job that asks exactly what a blocked job ahead of it asked is given that job's
verdict without being looked at again (the dispatch loop's memo), so it gets
no reservation of its own in that decision; letting it try changed nothing
measurable on dev workloads (docs/benchmarks.md, "Honest notes").

Multi-instance jobs try every node that could hold them and keep the node with
the lowest total score. On a large cluster (more than ``exact_limit``
candidate GPUs) GPUs are grouped by their locked slices; groups are visited by
a lower bound of their score and only the ``group_width`` GPUs whose jobs end
last are scored in each, which keeps a decision over 10,000 jobs and 8,000
GPUs well under a second. Where nodes weigh different jobs (a partition's), a
group is split by them, so GPUs of one group still score alike but for end
times. A job restricted to a few nodes walks only the groups of their GPUs (the
same GPUs in the same order, so the same placement).
"""

from __future__ import annotations

import math

from slurm_mig.mig.layout import Slot
from slurm_mig.policies._core import (
    CONFLICT, INF, NO_ROOM, PLACED, Ctx, DispatchPolicy, GpuInfo, PInfo, carve_memo, sig_groups,
)
from slurm_mig.policies.base import ClusterState, PendingJob

SIZES = ("1g", "2g", "3g", "4g", "7g")
# Tags _options' entries in ctx.gpu_memo[g], (pi, end, _PLACES): apart from _offers' (pi) and the rl policy's
# (pi, start), whatever the numbers.
_PLACES = "places"


class FragAwarePolicy(DispatchPolicy):
    """Fragmentation-aware, time-aligned placement with look-ahead (see module doc)."""

    name = "frag-aware"
    version = "1"
    # On a large cluster, walk only a restricted job's own GPUs when its nodes hold at most this share of
    # the cluster's (see _walk_groups); above it the full groups, kept by the index, cost less than a copy.
    restrict_share = 0.5

    def __init__(self, *, lookahead: int = 64, running_prior: float = 0.5, w_time: float = 0.3,
                 w_node_time: float = 1.0, w_node: float = 0.0, w_pack: float = 0.0, multi_prior: float = 0.05,
                 tau: float = 3600.0, w_reconf: float = 0.01, w_model: float = 1.0, reservations: int = 2,
                 exact_limit: int = 256, group_width: int = 4, reserve_share: float = 0.5,
                 reserve_min_age_s: float = 4 * 3600.0,
                 explain_waiting: bool = True) -> None:
        super().__init__(reservations=reservations, explain_waiting=explain_waiting, reserve_share=reserve_share,
                         reserve_min_age_s=reserve_min_age_s)
        self.lookahead = lookahead
        self.running_prior = running_prior
        self.w_time = w_time
        self.w_node = w_node
        self.w_reconf = w_reconf
        self.w_model = w_model
        self.w_pack = w_pack
        self.multi_prior = multi_prior
        self.w_node_time = w_node_time
        self.exact_limit = exact_limit
        self.group_width = group_width
        self.tau = tau
        self._ext_max = math.log1p(30 * 86400 / tau)
        self._ext_day = math.log1p(86400 / tau)
        self._weights: dict[str, float] = {}
        self._multi = 0.0
        self._contrib: list[tuple[int, ...]] | None = None
        self._running: list[int] = []
        self._tables: tuple | None = None  # the cluster's model tables, one each (kept until the index rebuilds)
        self._spare: dict | None = None  # (id(model table), profile) -> _model_cost; None: one model

    # -- demand -------------------------------------------------------------------
    def begin(self, ctx: Ctx, state: ClusterState) -> None:
        # Jobs no node they may start on could ever hold (ClusterIndex.never_holds: 7g jobs allowed only on A30s)
        # are no demand: counted, a queue of them kept GPUs whole for sizes nothing would ever start on.
        look = self._look = ctx.idx.runnable(state.pending, self.lookahead)
        running = dict(zip(SIZES, self._running_mix(ctx.idx)))
        if ctx.idx.rebuilt or self._tables is None:
            self._tables = tuple({id(i.t): i.t for i in ctx.idx.infos}.values())
            self._spare = {} if len(self._tables) > 1 else None
        self._rshare = (running, sum(running.values()))
        # The whole look-ahead's weights (the rl policy's demand features; each GPU's, where its node may take
        # every job of the look-ahead).
        self._weights, self._multi = self._blend(look)
        # A GPU does not weigh the jobs of the look-ahead its node can never take though its models have the size
        # (_wgroup): outside the nodes the job may start on, or too little room for all of its instances. Counted
        # everywhere, 7g jobs of one partition kept a GPU of another whole. Sizes the GPU's model lacks do count
        # (f94c52b left them out too: on the mixed site small jobs then drifted onto the H100s and mean wait rose
        # by 120 s, rl's by 170 s; docs/benchmarks.md). The jobs some nodes whose models have the size can never
        # take (ClusterIndex.never_on), by position in the look-ahead; none on a cluster without partitions or
        # node restrictions whose nodes are alike.
        never_on = ctx.idx.never_on
        self._restricted = [(i, e) for i, e in enumerate(map(never_on, look)) if e]
        # node -> positions of the look-ahead's jobs it can never take (None: no such job, every node's ())
        self._node_sig: dict[int, tuple[int, ...]] | None = {} if self._restricted else None
        self._wq: dict = {}  # (id(model table), _nsig) -> _wgroup's answer
        self._wg_gpu: dict[int, tuple] = {}  # GPU index -> _wgroup's answer
        self._loss_cache: dict = {}
        self._group_order: dict = {}

    def _blend(self, jobs) -> tuple[dict[str, float], float]:
        """The weights per size and the multi-GPU share for the demand of ``jobs`` blended with the running
        mix (``running_prior``)."""
        demand = {k: 0.0 for k in SIZES}
        multi = 0.0
        total = 0.0
        for job in jobs:
            k = _kind(job.profile)
            c = _SIZE.get(k, 7) * job.count
            demand[k] = demand.get(k, 0.0) + c
            total += c
            if job.count > 1:
                multi += c
        running, rtotal = self._rshare
        w = {}
        for k in SIZES:
            a = demand[k] / total if total else 0.0
            b = running[k] / rtotal if rtotal else 0.0
            w[k] = (a + self.running_prior * b) / (1.0 + self.running_prior) if (total or rtotal) else 0.2
        return w, max(self.multi_prior, multi / total if total else 0.0)

    def _running_mix(self, idx) -> list[int]:
        """Compute slices held per size over the whole cluster, kept up to date by identity diff."""
        if idx.rebuilt or self._contrib is None or len(self._contrib) != len(idx.infos):
            self._contrib = [_mix_of(info) for info in idx.infos]
            self._running = [sum(v[i] for v in self._contrib) for i in range(len(SIZES))]
        else:
            run = self._running
            for g in idx.changed_since:
                old = self._contrib[g]
                new = self._contrib[g] = _mix_of(idx.infos[g])
                for i in range(len(SIZES)):
                    run[i] += new[i] - old[i]
        return self._running

    def _nsig(self, node: int) -> tuple[int, ...]:
        """Positions in the look-ahead of the jobs ``node`` can never take though its models have their size;
        () without such jobs."""
        ns = self._node_sig
        if ns is None:
            return ()
        got = ns.get(node)
        if got is None:
            got = ns[node] = tuple(i for i, e in self._restricted if node in e)
        return got

    def _wgroup(self, info: GpuInfo) -> tuple[list[tuple[PInfo, float]], float, tuple[int, ...]]:
        """(the weights of this GPU's profiles, the multi-GPU share, _nsig) from the jobs of the look-ahead less
        those its node can never take (_nsig); one entry per model and _nsig (the "(model, allowed set) group"),
        found through the GPU's index after the first time."""
        t = info.t
        if self._node_sig is None:
            sig = ()
            key = id(t)
        else:
            got = self._wg_gpu.get(info.gidx)
            if got is not None:
                return got
            sig = self._nsig(info.node)
            key = (id(t), sig)
        got = self._wq.get(key)
        if got is None:
            if sig:
                skip = set(sig)
                w, multi = self._blend([j for i, j in enumerate(self._look) if i not in skip])
            else:  # no job left out here: the whole look-ahead's weights, the same floats
                w, multi = self._weights, self._multi
            wl = []
            for k, wk in w.items():
                if wk > 0:
                    pi = t.resolve(k)
                    if pi is not None:
                        wl.append((pi, wk))
            got = self._wq[key] = (wl, multi, sig)
        if self._node_sig is not None:
            self._wg_gpu[info.gidx] = got
        return got

    def _wlist(self, info: GpuInfo) -> list[tuple[PInfo, float]]:
        # inline, for every place scored: by model without node restrictions (as before them), else by GPU
        got = self._wq.get(id(info.t)) if self._node_sig is None else self._wg_gpu.get(info.gidx)
        return (got or self._wgroup(info))[0]

    # -- scoring ------------------------------------------------------------------
    def _frag_loss(self, info: GpuInfo, new_mask: int, new_compute: int, pi: PInfo) -> float:
        # GPUs alike (sig) weigh alike unless their nodes' look-ahead differs (_nsig)
        key = (info.sig, pi, new_mask) if self._node_sig is None else (
            info.sig, (self._wg_gpu.get(info.gidx) or self._wgroup(info))[2], pi, new_mask)  # (sig, _nsig)
        got = self._loss_cache.get(key)
        if got is None:
            got = self._loss_cache[key] = self._frag_loss_raw(info, new_mask, new_compute, pi)
        return got

    def _frag_loss_raw(self, info: GpuInfo, new_mask: int, new_compute: int, pi: PInfo) -> float:
        loss = 0.0
        C = info.t.compute
        lm, lc, same = info.locked_mask, info.locked_compute, info.same
        for q, wq in self._wlist(info):
            room = q.max_count - same.get(q.name, 0)
            before = len(q.pack(lm, C - lc, room))
            if not before:
                continue
            room2 = room - (1 if q is pi else 0)
            after = len(q.pack(lm | new_mask, C - lc - new_compute, room2))
            loss += wq * q.compute * (before - after)
        return loss

    def _model_cost(self, t, pi: PInfo) -> float:
        """``w_model`` where model ``t`` has more compute slices than the smallest of the cluster's models that
        has ``pi``'s size, else 0 (always 0 on a cluster of one model)."""
        spare = self._spare
        if spare is None:
            return 0.0
        key = (id(t), pi.name)
        got = spare.get(key)
        if got is None:
            k = _kind(pi.name)
            least = min(u.compute for u in self._tables if u.resolve(k) is not None)
            got = spare[key] = self.w_model if t.compute > least else 0.0
        return got

    def _ext(self, end: float, busy_end: float, now: float) -> float:
        """How much later than now a unit (GPU, node) frees wholly because of this job, squashed.

        log1p(seconds / tau): a minute costs next to nothing, an hour 0.7, a day 3.2.
        """
        if end == INF:
            return 0.0 if busy_end == INF else self._ext_max
        base = busy_end if busy_end > now else now
        if end <= base:
            return 0.0
        return math.log1p((end - base) / self.tau)

    def _score(self, ctx: Ctx, info: GpuInfo, pi: PInfo, start: int, end: float,
               node: tuple[int, int, float, float], steps: int) -> float:
        return self.score_terms(ctx, info, pi, start, end, node, steps)[0]

    def score_terms(self, ctx: Ctx, info: GpuInfo, pi: PInfo, start: int, end: float,
                    node: tuple[int, int, float, float], steps: int) -> tuple:
        """A candidate's score (lower is better) and its parts: (total, fragmentation loss,
        end-time term, node term, postponement of the GPU's last end, of the node's last end,
        create/destroy steps). The rl policy's features are these parts. On a site of several models the total
        also holds the bigger model's charge (_model_cost)."""
        loss = self._frag_loss(info, pi.mask(start), pi.compute, pi)
        t_cost, n_cost, ext, node_ext = self._end_terms(ctx, info, self._big(info, pi), end, node)
        # the bigger model's charge (several models only) is in the total, not in a part
        gpu_cost = n_cost + self._model_cost(info.t, pi) if self._spare is not None else n_cost
        total = loss + t_cost + gpu_cost + self.w_reconf * steps
        return (total, loss, t_cost, n_cost, ext, node_ext, steps)

    def _big(self, info: GpuInfo, pi: PInfo) -> float:
        """Demand for what the rest of this GPU can no longer offer (big profiles) once ``pi`` is placed."""
        free_after = info.t.compute - info.locked_compute - pi.compute
        big = 0.0
        for q, wq in self._wlist(info):
            if q.compute > free_after:
                big += wq
        return big

    def _end_terms(self, ctx: Ctx, info: GpuInfo, big: float, end: float,
                   node: tuple[int, int, float, float]) -> tuple[float, float, float, float]:
        """The parts of a score that depend on the job's end time: (end-time term, node term, postponement
        of the GPU's last end, of the node's last end). The same for every place on one GPU."""
        node_idle, node_size, node_free, node_end = node
        C = info.t.compute
        now = ctx.now
        # The demand for big profiles (``big``) is held back until this GPU's last job ends: align end times.
        ext = self._ext(end, info.busy_end, now)
        t_cost = self.w_time * big * C * ext
        # Multi-GPU jobs need a whole node: align end times per node, and keep idle nodes idle.
        # every GPU's multi-GPU share is the whole look-ahead's where no node is restricted
        multi = self._multi if self._node_sig is None else self._wgroup(info)[1]
        n_cost = 0.0
        node_ext = self._ext(end, node_end, now)
        if multi > 0:
            n_cost = self.w_node_time * multi * C * node_size * node_ext / self._ext_day
            if info.locked_mask == 0:
                n_cost += self.w_node * multi * C * node_idle / max(node_size, 1)
        # Node best fit: fill busy nodes first.
        n_cost += self.w_pack * C * node_free
        return t_cost, n_cost, ext, node_ext

    def _offers(self, ctx: Ctx, g: int, info: GpuInfo, pi: PInfo, memo: bool) -> tuple[float, list]:
        """Every place GPU g (as ``info``) offers one ``pi``, with what its score owes to that place alone:
        (demand for big profiles, [(memory-slice mask, 0 free / 1 carve, slot, CarveOption | None,
        fragmentation loss, create/destroy steps)]), the existing free instances first, then the carves at
        the other starts. A carve at a free instance's start is left out: the free instance is the same
        place for fewer steps, and where the reservations rule that instance out they rule out the carve.

        With ``memo`` (``info`` is ``ctx.info(g)``, not a node search's working copy) it is kept in
        ``ctx.gpu_memo`` until a job is placed on g: the large-cluster walk scores every GPU this decision
        changed again for each job, and the carve options and fragmentation losses were most of that.
        """
        if memo:
            per_gpu = ctx.gpu_memo.get(g)
            if per_gpu is None:
                per_gpu = ctx.gpu_memo[g] = {}
            got = per_gpu.get(pi)
            if got is not None:
                return got
        offers = []
        seen = set()
        for slot in info.free.get(pi.name, ()):
            m = pi.mask(slot.start)
            offers.append((m, 0, slot, None, self._frag_loss(info, m, pi.compute, pi), 0))
            seen.add(slot.start)
        if ctx.idx.carve:
            for opt in carve_memo(info.layout, pi.name, frozenset(info.locked)):
                st = opt.slot.start
                if st in seen:
                    continue
                m = pi.mask(st)
                offers.append((m, 1, opt.slot, opt, self._frag_loss(info, m, pi.compute, pi), 1 + len(opt.destroyed)))
        got = (self._big(info, pi), offers)
        if memo:
            per_gpu[pi] = got
        return got

    def _options(self, ctx: Ctx, g: int, info: GpuInfo, pi: PInfo, end: float,
                 node: tuple[int, int, float, float], out: list, conflicted: list, memo: bool = True) -> None:
        """Append (score, GPU rank, 0 free / 1 carve, g, slot, CarveOption | None) for each place on g that
        breaks no reservation; ``memo``: see _offers.

        With ``memo`` the places are also kept, in ``ctx.gpu_memo[g]`` by (pi, end, _PLACES), with the node's stats they
        were scored with (the very tuple ctx.node_memo holds until a job is placed on that node) and the number
        of reservations they were checked against (a decision only adds some): the next job of that size and
        end, an array's next task, gets them back as long as neither changed. Nothing else they depend on changes
        within a decision. The first decision of `explain --replay` on a large site places thousands of jobs,
        each scored on every GPU the decision changed."""
        per_gpu = memo_key = None
        if memo:
            per_gpu = ctx.gpu_memo.get(g)
            memo_key = (pi, end, _PLACES)
            if per_gpu is not None:
                got = per_gpu.get(memo_key)
                if got is not None and got[0] is node and got[1] == len(ctx.reservations):
                    if got[3]:
                        conflicted[0] = True
                    out.extend(got[2])
                    return
        big, offers = self._offers(ctx, g, info, pi, memo)
        kept = []
        hit = False
        if offers:
            t_cost, n_cost, _, _ = self._end_terms(ctx, info, big, end, node)
            if self._spare is not None:  # several models: the bigger model's charge, with the other GPU-wide terms
                n_cost += self._model_cost(info.t, pi)
            w_reconf = self.w_reconf
            rank = ctx.idx.rank[g]
            check = bool(ctx.reservations)
            for mask, kind, slot, opt, loss, steps in offers:
                if check and ctx.conflicts(g, mask, end):
                    hit = True
                    continue
                # score_terms' total, term for term (and the bigger model's charge)
                kept.append((loss + t_cost + n_cost + w_reconf * steps, rank, kind, g, slot, opt))
        if hit:
            conflicted[0] = True
        out.extend(kept)
        if memo:
            ctx.gpu_memo[g][memo_key] = (node, len(ctx.reservations), kept, hit)

    def _order_groups(self, idx, key: str, groups: dict) -> list[tuple[float, tuple]]:
        """(lower bound of any score in the group, sig), ascending: the fragmentation part alone."""
        out = []
        for sig, members in groups.items():
            info = idx.infos[members[0][2]]
            pi = info.t.resolve(key)
            if pi is None:
                continue
            lm, free_c = info.locked_mask, info.t.compute - info.locked_compute
            room = pi.max_count - info.same.get(pi.name, 0)
            lb = None
            if room > 0 and free_c >= pi.compute:
                for st, m in zip(pi.starts, pi.masks):
                    if not lm & m:
                        v = self._frag_loss(info, m, pi.compute, pi)
                        if lb is None or v < lb:
                            lb = v
            if lb is not None:
                out.append((lb, sig))
        # Equal bounds in signature order, not in the order the signatures entered the groups: that differs
        # between a fresh index and one updated from an earlier state, and decide must be a pure function.
        out.sort()
        return out

    def _walk_groups(self, ctx: Ctx, ki, key: str) -> tuple[dict, list[tuple[float, tuple]]]:
        """The signature groups the large-cluster walk visits for a job of ``key``, and their order.

        For a job restricted to a small share of the cluster (``ctx.allowed``), the groups hold only the
        GPUs of its nodes, in the same order as in the full groups, and the order only the signatures
        that have any: the full walk skips every other GPU one by one (``ctx.allows``), which made a job
        allowed on a few nodes of a large cluster dearer than one free to go anywhere. The same GPUs are
        scored in the same order, so the placement is the same.
        """
        idx = ctx.idx
        allowed = ctx.allowed
        if allowed is not None:
            got = self._group_order.get((key, allowed))
            if got is None:
                got = self._group_order[(key, allowed)] = self._allowed_groups(idx, ki, key, allowed)
            if got is not False:
                return got
        got = self._group_order.get(key)
        if got is None:
            groups = ki.groups if ki.groups is not None else ki.build_groups(idx)
            groups = self._split(idx, groups)
            got = self._group_order[key] = (groups, self._order_groups(idx, key, groups))
        return got

    def _split(self, idx, groups: dict) -> dict:
        """``groups`` as they are, or, where nodes' look-ahead differs (_nsig), each signature group split by
        it, keyed (sig, _nsig), members in the same order: GPUs alike whose demand differs score apart."""
        if self._node_sig is None:
            return groups
        infos = idx.infos
        out: dict = {}
        for sig, members in groups.items():
            for m in members:
                out.setdefault((sig, self._nsig(infos[m[2]].node)), []).append(m)
        return out

    def _allowed_groups(self, idx, ki, key: str, allowed: frozenset[int]):
        """ki's groups over the GPUs of ``allowed`` nodes and their order, or False when those nodes hold
        more than ``restrict_share`` of the cluster's GPUs."""
        node_gpus = idx.node_gpus
        if sum(len(node_gpus[n]) for n in allowed) > self.restrict_share * len(idx.infos):
            return False
        gpus = ki.gpus
        # the full groups' order (KeyIndex.build_groups), less the GPUs of other nodes
        groups = self._split(idx, sig_groups(idx, (g for n in allowed for g in node_gpus[n] if g in gpus)))
        # A signature's bound depends on the signature alone, so these are the full order's entries for
        # the signatures kept, in the same order.
        return groups, self._order_groups(idx, key, groups)

    @staticmethod
    def _touched(ctx: Ctx, key: str) -> list[int]:
        """GPUs this decision changed that could hold one ``key``, ascending; for a job restricted to
        fewer nodes than that, only those on its nodes (the others would be skipped one by one)."""
        got = ctx.touched_with(key)
        allowed = ctx.allowed
        if allowed is None or len(allowed) >= len(got):
            return sorted(got)
        node_gpus = ctx.idx.node_gpus
        return sorted(g for n in allowed & ctx.touched_nodes for g in node_gpus[n] if g in got)

    def _node(self, ctx: Ctx, node: int, local: dict | None = None) -> tuple[int, int, float, float]:
        """(idle GPUs, GPUs, share of compute slices not locked, when its last job ends) of a node; kept in
        ctx.node_memo until a job is placed there (not with ``local``, a node search's working copies)."""
        if not local:
            got = ctx.node_memo.get(node)
            if got is None:
                got = ctx.node_memo[node] = self._node_stats(ctx, node, None)
            return got
        return self._node_stats(ctx, node, local)

    @staticmethod
    def _node_stats(ctx: Ctx, node: int, local: dict | None) -> tuple[int, int, float, float]:
        idle = 0
        free = cap = 0
        last = -INF
        gidxs = ctx.idx.node_gpus[node]
        for g in gidxs:
            info = (local.get(g) if local else None) or ctx.info(g)
            if info.locked_mask == 0:
                idle += 1
            cap += info.t.compute
            free += info.t.compute - info.locked_compute
            if info.busy_end > last:
                last = info.busy_end
        return idle, len(gidxs), free / cap if cap else 0.0, last

    # -- placement ----------------------------------------------------------------
    def place(self, ctx: Ctx, job: PendingJob, end: float):
        idx = ctx.idx
        key = job.profile
        conflicted = [False]
        if job.count == 1:
            best = None
            best0 = best12 = None  # best[0], best[1:3]
            # _options' memo, looked up here first (one call fewer per GPU where it holds the places): the
            # large-cluster walk and the exact one score tens to thousands of GPUs per job, mostly unchanged
            gpu_memo, node_memo = ctx.gpu_memo, ctx.node_memo
            memo_key = nres = None

            def consider(g: int, info: GpuInfo) -> bool:
                """Score g's options; whether it had any (a GPU held by a reservation has none)."""
                nonlocal best, best0, best12, memo_key, nres
                pi = info.t.resolve(key)
                if pi is None or not info.avail or not ctx.allows(g):
                    return False
                node = node_memo.get(info.node)
                if node is None:
                    node = self._node(ctx, info.node)
                per_gpu = gpu_memo.get(g)
                got = None
                if per_gpu is not None:
                    if memo_key is None or memo_key[0] is not pi:
                        memo_key, nres = (pi, end, _PLACES), len(ctx.reservations)
                    got = per_gpu.get(memo_key)
                if got is not None and got[0] is node and got[1] == nres:
                    if got[3]:
                        conflicted[0] = True
                    opts = got[2]
                else:
                    opts = []
                    self._options(ctx, g, info, pi, end, node, opts, conflicted)
                # best: the least (score, rank, kind), the first of equals, as best[:3] compared
                for o in opts:
                    s = o[0]
                    if best is None or s < best0 or (s == best0 and o[1:3] < best12):
                        best, best0, best12 = o, s, o[1:3]
                return bool(opts)

            ki = idx.key(key)
            if len(ki.gpus) <= self.exact_limit:
                for g in ctx.candidate_gpus(key):
                    consider(g, ctx.info(g))
            else:
                # Large cluster: GPUs with the same locked slices score the same but for
                # their end times; visit signature groups best lower bound first, and in
                # each only the few GPUs whose jobs end last (they align best).
                for g in self._touched(ctx, key):
                    consider(g, ctx.work[g])
                groups, order = self._walk_groups(ctx, ki, key)
                for lb, sig in order:
                    if best is not None and lb >= best[0]:
                        break
                    seen = 0
                    for _, _, g in groups.get(sig, ()):
                        if g in ctx.work:
                            continue
                        # Only GPUs that offer a place count: the first ones are often the node a
                        # reservation holds, and stopping there left the job waiting beside idle GPUs.
                        if consider(g, idx.infos[g]):
                            seen += 1
                            if seen >= self.group_width:
                                break
            if best is None:
                return (CONFLICT if conflicted[0] else NO_ROOM), None
            _, _, _, g, slot, opt = best
            w = ctx.info(g).clone()
            pi = w.t.resolve(key)
            if opt is None:
                w.take(slot, pi, end)
            else:
                w.carve(opt, pi, end)
            ctx.commit({g: w})
            return PLACED, self.assignment(job, ctx, [(g, slot)], "carved" if opt else "free instance")
        # Several instances on one node: build a placement on each candidate node, keep the cheapest.
        best_node = None
        for node in ctx.candidate_nodes(key, job.count):
            local: dict[int, GpuInfo] = {}
            picked: list[tuple[int, Slot]] = []
            total = 0.0
            while len(picked) < job.count:
                best = None
                ns = self._node(ctx, node, local)
                for g in idx.node_gpus[node]:
                    info = local.get(g) or ctx.info(g)
                    pi = info.t.resolve(key)
                    if pi is None or not info.avail or info.cap(pi, idx.carve) == 0:
                        continue
                    opts: list = []
                    self._options(ctx, g, info, pi, end, ns, opts, conflicted, memo=g not in local)
                    for o in opts:
                        if best is None or o[:3] < best[:3]:
                            best = o
                if best is None:
                    break
                sc, _, _, g, slot, opt = best
                w = local.get(g)
                if w is None:
                    w = local[g] = ctx.info(g).clone()
                pi = w.t.resolve(key)
                if opt is None:
                    w.take(slot, pi, end)
                else:
                    w.carve(opt, pi, end)
                picked.append((g, slot))
                total += sc
            if len(picked) == job.count and (best_node is None or (total, node) < best_node[:2]):
                best_node = (total, node, local, picked)
        if best_node is None:
            return (CONFLICT if conflicted[0] else NO_ROOM), None
        _, _, local, picked = best_node
        ctx.commit(local)
        return PLACED, self.assignment(job, ctx, picked, "placed")


_SIZE = {"1g": 1, "2g": 2, "3g": 3, "4g": 4, "7g": 7}


_KIND: dict[str, str] = {}


def _kind(profile: str) -> str:
    k = _KIND.get(profile)
    if k is None:
        k = profile.strip().lower().split("+")[0].split(".")[0]
        k = _KIND[profile] = k if k in _SIZE else "7g"
    return k


def _mix_of(info: GpuInfo) -> tuple[int, ...]:
    """Compute slices this GPU has locked, per size (1g, 2g, 3g, 4g, 7g)."""
    if not info.locked:
        return (0, 0, 0, 0, 0)
    out = [0, 0, 0, 0, 0]
    for s in info.locked:
        k = _kind(s.profile)
        out[_POS[k]] += _SIZE[k]
    return tuple(out)


_POS = {k: i for i, k in enumerate(SIZES)}
