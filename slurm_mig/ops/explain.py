"""`slurm-mig explain JOBID`: why a job waited, or landed where it did, from the decisions recorded about it.

:func:`explain_view` returns the job and its outcome, the spans of decisions it waited through
(:func:`_spans`), what the policy saw of each GPU for it (:func:`gpu_option`, with the CPUs it counted:
:class:`CpuView`), the reconfigurations and events that concern it, a timeline of its GPUs
(:func:`history_segments`) and a one-line verdict (:func:`explain_verdict`): plain dicts that
``json.dumps`` accepts, which ``explain --json`` prints. It reads the database through the helpers of
:mod:`slurm_mig.ops.views` (which does not import this module).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Sequence

from slurm_mig.errors import SlurmMigError, StoreError
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.profiles import GpuModel
from slurm_mig.ops.fmt import elapsed, fmt_duration, fmt_num, is_number, known
from slurm_mig.ops.views import (_model, _rows, action_of, exit_json, job_decision_rows, job_dict, journal_dict,
                                 kind_sort_key)


def _gpu_from_inputs(g: dict) -> tuple[GpuModel | None, Layout | None, set[Slot], set[Slot]]:
    from slurm_mig.mig.layout import parse_layout

    model = _model(g.get("model"))
    if model is None:
        return None, None, set(), set()
    try:
        layout = parse_layout(g.get("layout") or "", model) if g.get("layout") not in (None, "", "empty") \
            else Layout.empty(model)
    except SlurmMigError:
        return model, None, set(), set()

    def slots(items) -> set[Slot]:
        out = set()
        for s in items or ():
            prof, _, start = str(s).rpartition("@")
            try:
                out.add(Slot(int(start), model.profile(prof).name))
            except (SlurmMigError, ValueError):
                pass
        return out
    return model, layout, slots(g.get("busy")), slots(g.get("reconfiguring"))


@dataclass
class CpuView:
    """The CPUs one decision counted for one job (ClusterState.free_cpus, PendingJob.cpus), as the
    dispatch loop's CpuLedger had them when it came to that job: each counted node's free CPUs, and
    those it had promised there to the jobs it placed before this one."""

    need: int  # the CPUs the job asks for (PendingJob.cpus, 1 for an --exclusive job that gave none)
    exclusive: bool
    free: dict[str, int]  # node -> CPUs Slurm had not allocated (nodes not listed: not counted)
    promised: dict[str, int]  # node -> CPUs taken by the jobs placed there before it
    placed: dict[str, list[str]]  # node -> those jobs

    def refused(self, node: str) -> tuple[str, str] | None:
        """(verdict, why) where the policy kept the job off ``node`` for CPUs; None where it did not."""
        if node not in self.free:
            return None
        free, taken = self.free[node], self.promised.get(node, 0)
        left = free - taken
        if left >= self.need and not (self.exclusive and node in self.promised):
            return None
        if node in self.promised and free >= self.need:
            jobs = self.placed[node]
            who = f"job{'s' if len(jobs) > 1 else ''} {', '.join(jobs[:3])}" + (
                f" and {len(jobs) - 3} more" if len(jobs) > 3 else "")
            asks = "all (--exclusive)" if self.exclusive else f"{self.need}, {max(0, left)} left"
            return "cpus-promised", f"{taken} of its {free} free CPUs promised to {who} before it; it asks {asks}"
        return "few-cpus", f"{free} free CPU(s), it asks for {self.need}"


def _cpu_view(inputs: dict, pos: int | None, assignments: list[dict]) -> CpuView | None:
    """What the policy counted of CPUs for the job at ``pos`` of a decision's inputs: None where it counted
    none (no ``free_cpus``: cpu_full_nodes_wait off, the simulator; a job that gave no CPUs).
    Mirrors slurm_mig.policies._core.CpuLedger: the jobs before it in the queue that the decision placed,
    on counted nodes, took their CPUs there (every free one for an --exclusive job)."""
    pending = inputs.get("pending") or []
    free_in = inputs.get("free_cpus")
    if pos is None or not isinstance(free_in, dict):
        return None

    def counted(j: dict) -> tuple[int, bool] | None:
        cpus, whole = j.get("cpus"), bool(j.get("exclusive"))
        if not cpus and not whole:
            return None
        try:
            return max(1, int(cpus or 1)), whole
        except (TypeError, ValueError):
            return None

    me = counted(pending[pos])
    if me is None:
        return None
    free: dict[str, int] = {}
    for n, c in free_in.items():
        try:
            free[str(n)] = max(0, int(c))
        except (TypeError, ValueError):
            continue
    where = {str(a.get("job_id")): str(a.get("node")) for a in assignments}
    left = dict(free)
    promised: dict[str, int] = {}
    placed: dict[str, list[str]] = {}
    for j in pending[:pos]:
        jid = str(j.get("job_id"))
        node = where.get(jid)
        c = counted(j)
        if node is None or c is None or node not in left:
            continue
        take = max(left[node], c[0]) if c[1] else c[0]
        left[node] -= take
        promised[node] = promised.get(node, 0) + take
        placed.setdefault(node, []).append(jid)
    return CpuView(me[0], me[1], free, promised, placed)


def gpu_option(g: dict, profile: str, count: int = 1, nodes: list | None = None,
               cpus: CpuView | None = None) -> dict:
    """Could this GPU (as a policy saw it, decision inputs JSON) hold ``profile``? And if not, why not.
    ``nodes``: the only nodes Slurm may start the job on (None: any); ``cpus``: the CPUs the decision
    counted for the job (None: none)."""
    key = f"{g.get('node')}/{g.get('gpu')}"
    model, layout, busy, reconf = _gpu_from_inputs(g)
    base = {"gpu": key, "layout": g.get("layout")}
    if nodes is not None and g.get("node") not in nodes:
        return {**base, "verdict": "not-its-node",
                "why": "Slurm will not start the job on this node (its partition, --nodelist, --exclude, "
                       "--constraint, a reservation, or fewer free CPUs than the job asks for)"}
    if not g.get("available", True):
        # The controller also leaves out a node whose every CPU Slurm has allocated (Slurm starts nothing there).
        return {**base, "verdict": "unavailable", "why": "node down, drained, stale, MIG off or without a free CPU"}
    refused = cpus.refused(str(g.get("node"))) if cpus is not None else None
    if refused is not None:
        return {**base, "verdict": refused[0], "why": refused[1]}
    if model is None or layout is None:
        return {**base, "verdict": "unavailable", "why": f"unknown GPU model {g.get('model')!r}"}
    try:
        p = model.profile(profile)
    except SlurmMigError:
        return {**base, "verdict": "no-profile", "why": f"{model.name} has no {profile} profile"}
    locked = busy | reconf
    idle = sorted(s for s in layout.slots if s.profile == p.name and s not in locked)
    if idle:
        return {**base, "verdict": "idle-instance", "why": f"had an idle {p.kind} ({', '.join(map(str, idle))})",
                "slots": [str(s) for s in idle]}
    lock_lay = Layout(model, frozenset(locked))
    if layout.free_starts(p):
        return {**base, "verdict": "free-slices", "why": f"{p.kind} could be created on uncarved slices"}
    starts = lock_lay.free_starts(p)
    if starts:
        st = starts[0]
        victims = sorted(s for s in layout.slots if model.profile(s.profile).mask(s.start) & p.mask(st))
        return {**base, "verdict": "re-carve",
                "why": f"{p.kind}@{st} possible by destroying idle {', '.join(map(str, victims)) or 'nothing'}"}
    blockers = sorted(s for s in locked if any(model.profile(s.profile).mask(s.start) & p.mask(st)
                                               for st in p.starts)) or sorted(locked)
    what = []
    busy_b = [str(b) for b in blockers if b in busy]
    reconf_b = [str(b) for b in blockers if b in reconf and b not in busy]
    if busy_b:
        what.append("busy " + ", ".join(busy_b))
    if reconf_b:
        what.append("reconfiguring " + ", ".join(reconf_b))
    if not what:
        what.append(f"compute slices in use ({lock_lay.compute_used} of {model.compute_slices})")
    return {**base, "verdict": "blocked", "why": f"no room for {p.kind}: " + "; ".join(what)}


def _policy_saw(inputs: dict, job_id: str, profile: str, count: int, assignments: list[dict] | None = None) -> dict:
    """A short account of a decision's inputs from one job's point of view; ``assignments``: the
    decision's, for the CPUs it promised to the jobs it placed before this one."""
    pending = inputs.get("pending") or []
    pos = next((i for i, j in enumerate(pending) if str(j.get("job_id")) == job_id), None)
    ahead = pending[:pos] if pos is not None else []
    ahead_by: dict[str, int] = {}
    for j in ahead:
        ahead_by[j.get("profile", "?")] = ahead_by.get(j.get("profile", "?"), 0) + int(j.get("count") or 1)
    gpus = inputs.get("gpus") or []
    nodes = pending[pos].get("nodes") if pos is not None else None
    cpus = _cpu_view(inputs, pos, assignments or [])
    options = [gpu_option(g, profile, count, nodes, cpus) for g in gpus]
    verdicts: dict[str, int] = {}
    for o in options:
        verdicts[o["verdict"]] = verdicts.get(o["verdict"], 0) + 1
    return {
        "time": inputs.get("now"), "gpus": len(gpus), "available": sum(1 for g in gpus if g.get("available", True)),
        "pending": len(pending), "queue_position": None if pos is None else pos + 1,
        "ahead": len(ahead), "ahead_by_profile": dict(sorted(ahead_by.items(), key=lambda kv: kind_sort_key(kv[0]))),
        "verdicts": verdicts, "options": options,
    }


def _spans(decisions: list[dict], job_id: str, *, recorded: Sequence[tuple[int, float]], stop: float,
           stopped_by: str) -> list[dict]:
    """Group consecutive decisions by what they said about ``job_id`` (same waiting reason from the same
    policy and version = one span).

    The controller records a decision only when it differs from the last one recorded, so a job can wait
    hours under one recorded decision: a span lasts (``until``) to what ended it, never to its last
    decision's own time (``last_time``): the next live decision recorded (``recorded``: every live
    decision's (id, time) in ascending order, ``ended_by`` "decision", ``next_decision`` its id), else
    ``stop`` (its start, its end, or now; ``stopped_by`` says which: "start", "end" or "now"), whichever
    came first. A recorded decision that leaves the job out (Slurm held it, so the policy did not see it)
    ends the span too: the same reason recorded again after it is a span of its own."""
    ids = [i for i, _t in recorded]
    spans: list[dict] = []

    def close(s: dict) -> None:
        k = bisect.bisect_right(ids, s["last"])
        nxt = recorded[k] if k < len(recorded) else None
        # (a time that is not a number, text or a blob in the DB, is compared with nothing: fmt_odd shows it)
        if nxt is not None and not (is_number(nxt[1]) and is_number(stop) and nxt[1] > stop):
            s["until"], s["ended_by"], s["next_decision"] = nxt[1], "decision", nxt[0]
        else:
            s["until"], s["ended_by"], s["next_decision"] = stop, stopped_by, None
        # A decision recorded just after its start (Slurm's queue read before it started) ends nothing earlier.
        if is_number(s["until"]) and is_number(s["last_time"]):
            s["until"] = max(s["until"], s["last_time"])
        s["duration_s"] = elapsed(s["until"], s["since"])

    for d in decisions:
        what, text, assignment = None, "", None
        for a in d["assignments"]:
            if str(a.get("job_id")) == job_id:
                what, text, assignment = "assigned", a.get("reason", ""), a
        if what is None:
            for j, why in d["waiting"]:
                if j == job_id:
                    what, text = "waiting", why
        if what is None:
            continue
        policy = f"{d['policy']} {d['version']}".strip()
        # A span is one reason from one policy: the fallback taking over with the same reason starts another.
        if spans and spans[-1]["what"] == what == "waiting" and spans[-1]["reason"] == text \
                and spans[-1]["policy"] == policy:
            s = spans[-1]
            k = bisect.bisect_right(ids, s["last"])
            if k >= len(ids) or ids[k] >= d["id"]:  # no decision that left the job out in between
                s["last"], s["last_time"], s["decisions"] = d["id"], d["time"], s["decisions"] + 1
                continue
        action = action_of(d)  # parsed here, for the decisions that start a span
        spans.append({"what": what, "reason": text, "first": d["id"], "last": d["id"], "since": d["time"],
                      "last_time": d["time"], "until": d["time"], "ended_by": None, "next_decision": None,
                      "decisions": 1, "policy": policy,
                      "assignment": assignment,
                      "changes": [c for c in action.get("changes", []) if assignment is not None
                                  and c["node"] == assignment["node"]
                                  and any(i["gpu"] == c["gpu"] for i in assignment.get("instances", []))],
                      "reservations": [r for r in (action.get("extra") or {}).get("reservations", [])
                                       if r and str(r[0]) == job_id]})
    for s in spans:
        close(s)
    return spans


@dataclass
class Segment:
    """One bar of a timeline: an instance's life, a job on it, or a reconfiguration.

    Same fields as the simulator's ``slurm_mig.sim.engine.Segment``, so :func:`render_timeline`
    draws a replay and the live history alike.
    """

    gpu: str
    kind: str  # "instance" | "job" | "create" | "destroy" | "reconfig"
    slot: Slot | None
    t0: float
    t1: float
    job_id: str = ""


def history_segments(store, node: str, gpus: Sequence[int], t0: float, t1: float) -> list[Segment]:
    """Timeline segments for ``node``'s GPUs between t0 and t1, from bindings and the journal."""
    out: list[Segment] = []
    marks = ",".join("?" for _ in gpus) or "NULL"
    rows = _rows(store, f"SELECT job_id, gpu, start, profile, bound_at, released_at FROM bindings WHERE node = ? "
                        f"AND gpu IN ({marks}) AND bound_at <= ? AND (released_at IS NULL OR released_at >= ?)",
                 (node, *gpus, t1, t0))
    for r in rows:
        out.append(Segment(f"{node}/{r['gpu']}", "job", Slot(r["start"], r["profile"]), r["bound_at"],
                           r["released_at"] or t1, str(r["job_id"])))
    jrows = _rows(store, f"SELECT * FROM reconfig_journal WHERE node = ? AND gpu IN ({marks}) "
                         "AND created_at <= ? AND (finished_at IS NULL OR finished_at >= ?)", (node, *gpus, t1, t0))
    from slurm_mig.store.models import loads
    for r in jrows:
        steps = loads(r["steps"], []) or []
        begin = r["started_at"] or r["created_at"]
        end = r["finished_at"] or t1
        if r["state"] == "abandoned" and not r["started_at"]:
            continue
        for s in steps:
            out.append(Segment(f"{node}/{r['gpu']}", s["action"], Slot(int(s["start"]), s["profile"]), begin, end))
    return out


def explain_view(store, job_id: str, *, now: float | None = None, max_options: int = 12) -> dict:
    """Why ``job_id`` waited, or landed where it did: its decisions, what the policy saw, the
    alternatives it did not take, the reconfigurations it waited for, its events and a timeline."""
    now = time.time() if now is None else now
    job_id = str(job_id)
    job = store.get_job(job_id)
    if job is None:
        raise StoreError(f"slurm-mig has no record of job {job_id} (not a MIG job, or purged from the database)")
    outcome = store.outcome(job_id)
    info = job_dict(job, now, bound=bool(store.bound_instances(job_id)))
    t0 = known(job.submit_time or now, now) - 2.0
    t_end = known(job.start_time or job.end_time or now, now) + 2.0
    decisions = job_decision_rows(store, job_id, since=t0, until=t_end)
    # Every live decision of the window, the ones that left this job out included: each ends a span.
    recorded = [(r["id"], r["time"]) for r in _rows(
        store, "SELECT id, time FROM decisions WHERE shadow = 0 AND time >= ? AND time <= ? ORDER BY id", (t0, t_end))]
    stop, stopped_by = ((job.start_time, "start") if job.start_time is not None
                        else (job.end_time, "end") if job.end_time is not None else (now, "now"))
    spans = _spans(decisions, job_id, recorded=recorded, stop=stop, stopped_by=stopped_by)
    # A placement that did not happen: the policy assigned the job, and a later decision held it
    # waiting again (Slurm started another job on those instances first, or the plan changed).
    for k, sp in enumerate(spans[:-1]):
        if sp["what"] == "assigned" and spans[k + 1]["what"] == "waiting" and sp["assignment"]:
            node = sp["assignment"].get("node")
            binds = [e for e in store.recent_events(200, kind="bind", node=node)
                     if sp["since"] - 1 <= e.time <= spans[k + 1]["since"] + 1 and e.job_id != job_id]
            sp["fell_through"] = ("not used: " + "; ".join(e.message for e in reversed(binds[:3]))
                                  if binds else "not used: a later decision held it waiting again")
    # What the policy saw: at the first and last decision that held it waiting, and at the assignment.
    saw = []
    picks = []
    waits = [s for s in spans if s["what"] == "waiting"]
    if waits:
        picks.append(("first wait", waits[0]["first"]))
        if waits[-1]["last"] != waits[0]["first"]:
            picks.append(("last wait", waits[-1]["last"]))
    assigned = [s for s in spans if s["what"] == "assigned"]
    if assigned:
        picks.append(("assignment", assigned[-1]["first"]))
    for label, did in picks:
        rows = _rows(store, "SELECT inputs FROM decisions WHERE id = ?", (did,))
        if not rows:
            continue
        from slurm_mig.store.models import loads

        inputs = loads(rows[0]["inputs"], {}) or {}
        made = next(((action_of(d).get("assignments", []) or []) for d in decisions if d["id"] == did), [])
        s = _policy_saw(inputs, job_id, job.profile, job.count, made)
        chosen = None
        if label == "assignment":
            a = assigned[-1]["assignment"]
            chosen = {f"{a['node']}/{i['gpu']}" for i in a.get("instances", [])}
        s["options"] = _trim_options(s["options"], chosen, max_options)
        saw.append({"label": label, "decision": did, **s})
    saw.sort(key=lambda x: x["decision"])
    # Reconfigurations on the GPUs it landed on (or, still pending, was last placed on by the policy, else
    # those of its attempt before a requeue), from its submission to its start.
    node, gpus = info["node"], sorted({int(i["gpu"]) for i in info["instances"]})
    if not gpus and assigned and assigned[-1]["assignment"]:
        a = assigned[-1]["assignment"]
        node, gpus = a.get("node"), sorted({int(i["gpu"]) for i in a.get("instances", [])})
    if not gpus and info["previous_attempt"]:
        node = info["previous_attempt"]["node"]
        gpus = sorted({int(i["gpu"]) for i in info["previous_attempt"]["instances"]})
    reconfigs = []
    if node and gpus:
        rows = _rows(store, "SELECT * FROM reconfig_journal WHERE node = ? AND created_at >= ? AND created_at <= ? "
                            f"AND gpu IN ({','.join('?' for _ in gpus)}) ORDER BY id",
                     (node, t0, known(job.start_time or now, now) + 1.0, *gpus))
        from slurm_mig.store.rows import row_journal

        reconfigs = [journal_dict(row_journal(r)) for r in rows]
    events = [{"time": e.time, "kind": e.kind, "node": e.node, "message": e.message}
              for e in reversed(store.recent_events(200, job_id=job_id))]
    # Layout events on the job's node while it waited (a policy re-carving for it).
    if node:
        for e in store.recent_events(200, kind="layout", node=node):
            if (is_number(e.time) and t0 <= e.time <= t_end
                    and (not gpus or any(f"{node}/{g}:" in e.message for g in gpus))):
                events.append({"time": e.time, "kind": e.kind, "node": e.node, "message": e.message})
        events.sort(key=lambda e: e["time"])
    timeline = None
    if node and gpus:
        end = job.end_time or now
        begin = job.submit_time or (job.start_time or now)
        segs = history_segments(store, node, gpus, begin, end)
        # (a time that is not a number stays as it is: the timeline says it cannot be drawn)
        timeline = {"node": node, "gpus": gpus, "t0": begin,
                    "t1": max(end, begin + 1.0) if is_number(end) and is_number(begin) else end,
                    "segments": [{"gpu": s.gpu, "kind": s.kind, "slot": str(s.slot) if s.slot else None,
                                  "t0": s.t0, "t1": s.t1, "job_id": s.job_id} for s in segs]}
    return {
        "job": info,
        # The latest recorded run's; an earlier run's while the id runs again (a reused id, a requeue).
        "outcome": None if outcome is None else {"state": outcome.state, "exit_code": outcome.exit_code,
                                                 "exit": exit_json(outcome.exit_code),
                                                 "wait_s": outcome.wait_s, "run_s": outcome.run_s,
                                                 "end_time": outcome.end_time, "run": outcome.run,
                                                 "earlier_run": outcome.run != job.run},
        "decisions": {"count": len(decisions), "spans": spans},
        "policy_saw": saw,
        "reconfigurations": reconfigs,
        "events": events,
        "timeline": timeline,
        "verdict": explain_verdict(info, spans, reconfigs, events),
    }


def _trim_options(options: list[dict], chosen: set[str] | None, limit: int) -> list[dict]:
    """Keep the chosen GPU(s) and a few of each verdict, so a 1000-GPU decision stays readable."""
    for o in options:
        o["chosen"] = bool(chosen and o["gpu"] in chosen)
    if len(options) <= limit:
        return options
    keep = [o for o in options if o["chosen"]]
    per: dict[str, int] = {}
    order = ["idle-instance", "free-slices", "re-carve", "blocked", "cpus-promised", "few-cpus", "unavailable",
             "not-its-node", "no-profile"]
    for o in sorted(options, key=lambda o: order.index(o["verdict"]) if o["verdict"] in order else 99):
        if o["chosen"]:
            continue
        if per.get(o["verdict"], 0) < 2 and len(keep) < limit:
            keep.append(o)
            per[o["verdict"]] = per.get(o["verdict"], 0) + 1
    return keep


def explain_verdict(job: dict, spans: list[dict], reconfigs: list[dict], events: list[dict]) -> str:
    """One sentence answering "why did my job wait / land there"."""
    wait = job.get("wait_s")
    parts = []
    waits = [s for s in spans if s["what"] == "waiting"]
    if waits:
        longest = max(waits, key=lambda s: (s["until"] - s["since"], s["decisions"]))
        parts.append(f"{'waits' if spans[-1]['what'] == 'waiting' and job.get('start_time') is None else 'waited'}"
                     f" mostly because: {longest['reason']}")
    assigned = [s for s in spans if s["what"] == "assigned"]
    if assigned and spans[-1]["what"] == "assigned":
        parts.append(f"the policy placed it: {assigned[-1]['reason']}")
        if job.get("state") in ("PENDING", "REQUEUED"):
            open_rc = [r for r in reconfigs if r["state"] in ("planned", "in_progress")]
            parts.append("now waiting for " + ("the re-carve to finish and " if open_rc or assigned[-1]["changes"]
                                               else "") + "Slurm to start it there")
    lost = [s for s in assigned if s.get("fell_through")]
    if lost:
        parts.append(f"{len(lost)} earlier placement(s) {lost[-1]['fell_through']}")
    done = [r for r in reconfigs if r["state"] == "done"]
    if done:
        secs = [r["duration_s"] or 0.0 for r in done]
        odd = next((d for d in secs if not is_number(d)), None)  # from a time that is not a number
        parts.append(f"{len(done)} reconfiguration(s) on its GPU(s) ({fmt_num(sum(secs) if odd is None else odd)}s)")
    requeues = [e for e in events if e["kind"] in ("requeue", "bind-failed")]
    if requeues:
        parts.append(f"requeued {len(requeues)} time(s): {requeues[-1]['message']}")
    if job.get("state") == "PENDING" and job.get("blocked"):
        parts.append(f"Slurm will not start it now: {job['blocked']}; the policy carves for it once Slurm may")
    elif job.get("state") in ("PENDING", "REQUEUED") and not waits:
        parts.append("no decision has considered it yet (is the controller ticking?)")
    if job.get("start_time") is not None and job.get("reason"):
        parts.append(f"bound: {job['reason']}")
    head = f"job {job['job_id']} ({job['count']} x {job['profile']}) is {job['state']}"
    if wait is not None:
        head += f" after waiting {fmt_duration(wait)}" if job.get("start_time") else f", waiting {fmt_duration(wait)}"
    return head + (": " + "; ".join(parts) if parts else "")
