"""`slurm-mig status | jobs | nodes | decisions | explain | top`: the operator's commands.

All of them read the controller's state database (``[controller].db_path`` of the config chosen
with ``--config`` / ``$SLURM_MIG_CONFIG``; ``--db PATH`` reads another file, e.g. a copy taken for
a post-mortem) read-only, and print text for people or, with ``--json``, the data of
:mod:`slurm_mig.ops.views` and :mod:`slurm_mig.ops.explain` for scripts.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import textwrap
import time

from slurm_mig.argtypes import at_least, seconds
from slurm_mig.terminal import stdout_can_show, stdout_is_a_terminal

JOB_STATE_GROUPS = {
    "live": ("PENDING", "REQUEUED", "RUNNING", "SUSPENDED", "COMPLETING"),
    "pending": ("PENDING", "REQUEUED"),
    "running": ("RUNNING", "SUSPENDED", "COMPLETING"),
    "done": ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
             "BOOT_FAIL", "DEADLINE"),
}


def _common(p: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    # `slurm-mig status --config PATH` as well as `slurm-mig --config PATH status`: SUPPRESS keeps the
    # top-level value when the option is not repeated here.
    p.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS,
                   help="slurm-mig TOML config (also accepted before the command)")
    p.add_argument("--db", metavar="PATH", help="read this state database instead of [controller].db_path")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print JSON (the same data, for scripts)")


def _reading(func):
    """``func`` with the state database's damage reported as what it is: the store says StoreDamaged (exit 75, "try
    again later": the controller's API answers 503 with it) when a page read midway is malformed; for these
    read-only commands it is a plain StoreError (exit 1), naming the file, as one that is not a database at all.

    Unless what was read was an immutable snapshot (views.open_readonly, for a reader who cannot make the -shm
    while no controller is up): a controller that started meanwhile and changed the file under it reads as
    "malformed" too. Then the command runs once more, opening the file anew (it reads everything before it
    prints): an ordinary WAL read now that the controller is up, a stable file if it has gone; damage in earnest
    is found again, exit 1."""
    import functools

    @functools.wraps(func)
    def run(args) -> int:
        from slurm_mig.errors import StoreError
        from slurm_mig.store.connection import StoreDamaged

        args.opened_stores = []  # _open adds each store it opens
        try:
            return func(args)
        except StoreDamaged as exc:
            if not any(s.immutable for s in args.opened_stores):
                raise StoreError(str(exc)) from None
        args.opened_stores = []
        try:
            return func(args)
        except StoreDamaged as exc:
            raise StoreError(str(exc)) from None

    return run


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="controller, nodes, GPUs, instances by profile and the queue, at a glance")
    _common(p)
    p.add_argument("--check", action="store_true",
                   help="exit 1 when the controller is not ticking, a GPU node is down, drained or stale, "
                        "or a GPU fell off the bus (lost)")
    p.add_argument("--no-probe", action="store_true", help="do not call the controller's /healthz")
    p.set_defaults(func=_reading(_status))

    p = sub.add_parser("jobs", help="MIG jobs slurm-mig knows: queue order, wait, instances and why")
    _common(p)
    p.add_argument("--state", default="live",
                   help="live (default), pending, running, done, all, or Slurm states separated by commas")
    p.add_argument("--user", help="only this user's jobs")
    p.add_argument("--partition", help="only jobs in this partition")
    p.add_argument("--profile", help="only jobs asking for this profile (3g, 1g.dm, ...)")
    p.add_argument("--limit", type=at_least(1), help="at most this many jobs")
    p.set_defaults(func=_reading(_jobs))

    p = sub.add_parser("nodes", help="every GPU's MIG layout: instances, jobs on them, reconfigurations")
    _common(p)
    p.add_argument("--node", metavar="NODES", help="hostlist or glob, e.g. gpu[01-04] or 'gpu*'")
    p.add_argument("--partition", help="only nodes of this Slurm partition (asks sinfo)")
    p.add_argument("--width", type=at_least(10), help="line width (default: the terminal's, or 100)")
    p.set_defaults(func=_reading(_nodes))

    p = sub.add_parser("decisions", help="the policy's recent decisions and their reasons")
    _common(p)
    p.add_argument("--limit", type=at_least(1), default=10, help="how many (default 10)")
    p.add_argument("--waiting", action="store_true",
                   help="also decisions that only kept jobs waiting (each recorded when it differs from the last)")
    p.add_argument("--all", action="store_true", help="every decision, including those that did nothing")
    p.add_argument("--job", metavar="JOBID", help="only decisions that placed or held this job")
    p.set_defaults(func=_reading(_decisions))

    p = sub.add_parser("explain", help="why a job waited, or landed where it did")
    _common(p)
    p.add_argument("job_id", metavar="JOBID")
    p.add_argument("--width", type=at_least(10), help="line width (default: the terminal's, or 100)")
    p.add_argument("--replay", action="store_true",
                   help="also replay the job's surroundings in the simulator with the configured policy and "
                        "draw the simulated timeline")
    p.set_defaults(func=_reading(_explain))

    p = sub.add_parser("top", help="live dashboard: GPU slices, queue, decisions, health")
    _common(p, json_flag=False)
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=seconds(0.0, more_than=True), default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--node", metavar="NODES", help="only these nodes: hostlist or glob")
    p.add_argument("--partition", help="only this partition's nodes and jobs (asks sinfo)")
    p.add_argument("--page", type=at_least(1), default=1, help="start on this page")
    p.add_argument("--view", choices=("auto", "gpus", "summary"), default="auto",
                   help="GPU bars, per-profile summary with one line per node, or auto (bars when they fit)")
    p.add_argument("--width", type=at_least(10), help="with --once: frame width (default: terminal, or 80)")
    p.add_argument("--height", type=at_least(12), help="with --once: frame height (default: terminal, or 24)")
    p.add_argument("--ascii", action="store_true", help="ASCII characters only (terminals without UTF-8)")
    p.set_defaults(func=_reading(_top))


# -- plumbing -----------------------------------------------------------------------------------

def _open(args):
    from slurm_mig.config import load_config
    from slurm_mig.ops.views import open_readonly

    cfg = load_config(args.config)
    path = args.db or cfg.controller.db_path
    store = open_readonly(path, busy_timeout_s=cfg.controller.db_busy_timeout_s)
    getattr(args, "opened_stores", []).append(store)
    return cfg, store


def _width(args, default: int = 100) -> int:
    if getattr(args, "width", None):
        return max(40, args.width)
    import shutil

    if stdout_is_a_terminal():
        return max(40, shutil.get_terminal_size((default, 24)).columns)
    return default


def _console(width: int):
    from rich.console import Console

    return Console(width=width, highlight=False, soft_wrap=False)


def _note_if_stale(cfg, store, snap=None) -> None:
    """On stderr (so --json stays valid), when the controller is not ticking: what follows is what it
    last wrote, not the live state (waits and run times are counted up to now all the same). Reads only
    the controller's last tick unless the caller has a whole snapshot already."""
    from slurm_mig.ops import views as V

    if snap is None:
        snap = V.load_tick(store, V.Snapshot(now=time.time(), stale_after_s=cfg.controller.node_stale_after_s))
    c = V.controller_health(snap, cfg.controller.tick_interval_s)
    if c["state"] != "ok":
        print(f"slurm-mig: note: controller {c['state']} ({c['detail']}): this is what it last recorded, "
              "not the live state; see `slurm-mig status`", file=sys.stderr)


def _print_json(value) -> None:
    from slurm_mig.ops.fmt import to_json

    print(to_json(value))


def _partition_nodes(cfg, partition: str | None):
    if not partition:
        return None
    from slurm_mig.ops.top import PartitionNodes

    return PartitionNodes(cfg, partition).get_or_fail()


# -- status -------------------------------------------------------------------------------------

def _status(args) -> int:
    from slurm_mig.ops import render as R
    from slurm_mig.ops import fmt as F
    from slurm_mig.ops import views as V
    from slurm_mig.ops.top import probe_healthz

    cfg, store = _open(args)
    with store:
        snap = V.load_snapshot(store, stale_after_s=cfg.controller.node_stale_after_s)
    healthz = None if args.no_probe or args.db else probe_healthz(cfg)
    st = V.status_view(snap, tick_interval_s=cfg.controller.tick_interval_s, healthz=healthz)
    # A lost GPU (fallen off the bus) leaves its node up in Slurm: counted here, or no check would learn of it.
    trouble = (st["controller"]["state"] != "ok" or any(k != "up" for k in st["nodes"]["by_state"])
               or bool(st["gpus"].get("lost")))
    if args.json:
        _print_json(st)
        return 1 if (args.check and trouble) else 0
    st = R.safe_tree(st)
    c = st["controller"]
    last = c["last_decision"]
    line = f"controller  {c['state']} ({c['detail']}"
    if healthz:  # a /healthz that does not answer is already in the detail ("; /healthz does not answer")
        line += "; /healthz ok"
    line += ")"
    if last:
        lat = f", {F.fmt_num(last['latency_ms'])} ms" if last.get("latency_ms") is not None else ""
        line += f"  policy {last['policy']} {last['version']}".rstrip() + f" (decision #{last['id']}{lat})"
    print(line)
    n = st["nodes"]
    states = ", ".join(f"{v} {k}" for k, v in n["by_state"].items()) or "none reported"
    print(f"nodes       {n['total']} with GPUs: {states}"
          + (f"   (no GPUs: {', '.join(n['other'])})" if n["other"] else ""))
    g = st["gpus"]
    lost = f", {g['lost']} LOST (fell off the bus: `slurm-mig nodes`)" if g.get("lost") else ""
    print(f"GPUs        {g['total']} ({g['mig_enabled']} with MIG on{lost}), {g['reconfiguring']} reconfiguring; "
          f"{g['slices']} memory slices, {round(100 * g['busy_fraction'])}% busy, "
          f"{g['fragmented_slices']} idle but fragmented"
          + (f"; {g['uncounted']} GPU(s) not counted (instances this controller's tables cannot place: "
             f"`slurm-mig nodes`)" if g.get("uncounted") else ""))
    i = st["instances"]
    print(f"instances   busy {i['busy']}  idle {i['idle']}  reconfiguring {i['reconfiguring']}")
    j = st["jobs"]
    q = f"queue       {j['pending']} pending, {j['running']} running"
    if j["blocked"]:
        q += f", {j['blocked']} that Slurm will not start yet (held, dependency, ...: see `slurm-mig jobs`)"
    if j["oldest_pending"]:
        o = j["oldest_pending"]
        q += f"; oldest pending: job {o['job_id']} ({o['count']} x {o['profile']}) for {F.fmt_duration(o['wait_s'])}"
    print(q)
    print()
    for line in R.table(R.profile_table_rows(st["profiles"]),
                        ["PROFILE", "TOTAL", "BUSY", "IDLE", "RECONF", "PENDING", "OLDEST WAIT"], 100,
                        align="lrrrrrr", ascii_only=not stdout_can_show()):
        print(line)
    if st["reconfigurations"]:
        print()
        print("open reconfigurations:")
        # At most DECISION_LINES, oldest first, as `decisions` cuts its lists: a large site has a hundred
        # open at once (110 lines at 1,024 GPUs and 10,000 pending in benchmarks/ops_scale.py). --json has all.
        recs = st["reconfigurations"]
        for r in recs[:DECISION_LINES]:
            print(f"  #{r['id']} {r['node']}/{r['gpu']} {r['from']} -> {r['to']} {r['state']} "
                  f"({r['progress']}/{len(r['steps'])} steps, {F.fmt_duration(r['duration_s'])})")
        if len(recs) > DECISION_LINES:
            print(f"  ... {len(recs) - DECISION_LINES} more (`slurm-mig nodes` shows each GPU's; --json lists "
                  f"every one)")
    return 1 if (args.check and trouble) else 0


# -- jobs ---------------------------------------------------------------------------------------

def _jobs(args) -> int:
    from slurm_mig.ops import render as R
    from slurm_mig.ops import fmt as F
    from slurm_mig.ops import views as V
    from slurm_mig.store import JOB_STATES

    spec = args.state.lower()
    if spec == "all":
        states = None
    elif spec in JOB_STATE_GROUPS:
        states = JOB_STATE_GROUPS[spec]
    else:
        states = tuple(s.strip().upper() for s in args.state.split(",") if s.strip())
        bad = [s for s in states if s not in JOB_STATES]
        # none at all ("" or ","): it matched no job and said "no jobs"
        if bad or not states:
            what = f"unknown state {', '.join(bad)}" if bad else f"no state given in --state {args.state!r}"
            print(f"slurm-mig jobs: {what} (use live, pending, running, done, all, or {', '.join(JOB_STATES)})",
                  file=sys.stderr)
            return 2
    for flag, value in (("--user", args.user), ("--partition", args.partition), ("--profile", args.profile)):
        # blank (a shell variable left empty): it was read as no filter and listed every job, while a blank
        # --state is refused; a filter that names nothing is an error for each
        if value is not None and not value.strip():
            print(f"slurm-mig jobs: no value given in {flag} {value!r} (leave the flag out for every job)",
                  file=sys.stderr)
            return 2
    cfg, store = _open(args)
    with store:
        jobs = V.jobs_view(store, states=states, user=args.user, partition=args.partition, profile=args.profile,
                           limit=args.limit)
        _note_if_stale(cfg, store)
    if args.json:
        _print_json(jobs)
        return 0
    if not jobs:
        print("no jobs")
        return 0
    jobs = R.safe_tree(jobs)
    rows = []
    for j in jobs:
        where = ""
        if j["node"] and j["instances"]:
            where = j["node"] + ":" + ",".join(f"{i['profile'].split('.')[0]}@{i['gpu']}/{i['start']}"
                                               for i in j["instances"])
        elif j.get("reserved"):
            where = "(" + str(j["reserved"].get("node")) + ")"
        rows.append([j["job_id"], j["user"] or "-", j["partition"] or "-",
                     f"{j['count']}x{j['profile']}" if j["count"] != 1 else j["profile"], j["state"],
                     F.fmt_duration(j["wait_s"]), F.fmt_duration(j["run_s"]) if j["run_s"] is not None else "-",
                     where or "-", j["reason"] or "-"])
    for line in R.table(rows, ["JOB", "USER", "PARTITION", "WANTS", "STATE", "WAIT", "RUN", "WHERE", "WHY"],
                        _width(args, 120), align="lllllrrll", ascii_only=not stdout_can_show()):
        print(line)
    return 0


# -- nodes --------------------------------------------------------------------------------------

def _nodes(args) -> int:
    from rich.text import Text

    from slurm_mig.ops import render as R
    from slurm_mig.ops import fmt as F
    from slurm_mig.ops import views as V

    cfg, store = _open(args)
    with store:
        snap = V.load_snapshot(store, stale_after_s=cfg.controller.node_stale_after_s)
    _note_if_stale(cfg, store, snap)
    nodes = V.node_views(snap, nodes=args.node, only=_partition_nodes(cfg, args.partition))
    if args.json:
        _print_json(nodes)
        return 0
    if not nodes:
        print("no nodes match" if (args.node or args.partition) else "no nodes reported yet")
        return 0
    nodes = R.safe_tree(nodes)
    width = _width(args)
    con = _console(width)
    g = R.Glyphs(ascii_only=not stdout_can_show())
    for n in nodes:
        head = Text()
        head.append(n["name"], style="bold")
        head.append("  ")
        head.append_text(R.node_state_text(n))
        seen = F.fmt_duration(n["seen_ago_s"]) + " ago" if n["seen_ago_s"] is not None else "never"
        head.append(f"  seen {seen}  health {n['health']}", style=R.STYLE["dim"])
        if n["agent_version"]:
            head.append(f"  agent {n['agent_version']}", style=R.STYLE["dim"])
        if not n["gpus"]:
            head.append("  (no GPUs reported)", style=R.STYLE["dim"])
        con.print(head, no_wrap=True, crop=True)
        for gpu in n["gpus"]:
            t = Text(f"  GPU {gpu['gpu']} {gpu['model'] or gpu['name'] or '?'}  layout {gpu['layout'] or '-'}")
            if gpu["desired"] and gpu["desired"] != gpu["layout"]:
                t.append(f"  desired {gpu['desired']}", style=R.STYLE["warn"])
            rc = gpu["reconfiguration"]
            if rc:
                t.append(f"  reconfiguration #{rc['id']} {rc['state']} {rc['progress']}/{rc['steps']} steps "
                         f"-> {rc['to']}", style=R.STYLE["warn"])
            if gpu.get("held_for"):
                t.append(f"  held for job {', '.join(gpu['held_for'])}", style=R.STYLE["warn"])
            if gpu["mig_enabled"] and not gpu["geometry_known"]:
                t.append("  slices not counted", style=R.STYLE["dim"])
            else:
                t.append(f"  free: up to {gpu['largest_free_kind'] or 'nothing'}", style=R.STYLE["dim"])
            con.print(R.crop(t, width, g), no_wrap=True, crop=True)
            bar_w = min(8 * 12, width - 4)
            bar_w -= bar_w % max(1, gpu["slices"] or 1)
            line = Text("    ")
            line.append_text(R.gpu_bar(gpu, bar_w, g))
            con.print(line, no_wrap=True, crop=True)
            if gpu.get("blocked"):  # whole, on lines of its own: the header line is cut at the width
                for part in textwrap.wrap(f"blocked: {gpu['blocked']}", max(20, width - 4)):
                    con.print(Text("    " + part, style=R.STYLE["warn"]), no_wrap=True, crop=True)
    return 0


# -- decisions ----------------------------------------------------------------------------------

# Re-carves and placements `decisions` prints of one decision (waiting jobs: 5); --json has them all.
DECISION_LINES = 20

def _decisions(args) -> int:
    from slurm_mig.ops import render as R
    from slurm_mig.ops import fmt as F
    from slurm_mig.ops import views as V

    cfg, store = _open(args)
    with store:
        ds = V.decisions_view(store, limit=args.limit, include_noop=args.all, include_waiting=args.waiting,
                              job_id=args.job)
    if args.json:
        _print_json(ds)
        return 0
    if not ds:
        print("no decisions recorded" + ("" if args.all else
                                         " that re-carved or placed anything (--waiting, --all show more)"))
        return 0
    width = _width(args)
    now = time.time()
    for d in R.safe_tree(ds):
        lat = f" {F.fmt_num(d['latency_ms'])} ms" if d["latency_ms"] is not None else ""
        # the date too when not today's (a quiet site's last ten decisions span days)
        print(f"#{d['id']} {F.fmt_when(d['time'], now)} {d['policy']} {d['version']}{lat}: {d['summary']}"[:width])
        # At most DECISION_LINES of each list a decision: one at a large site placed hundreds of jobs, and
        # `decisions` (10 of them by default) printed thousands of lines. --json lists every one.
        changes = d["changes"]
        for c in changes[:DECISION_LINES]:
            print(f"    re-carve {c['node']}/{c['gpu']} -> {c['target']}: {c.get('reason', '')}"[:width])
        if len(changes) > DECISION_LINES:
            print(f"    ... {len(changes) - DECISION_LINES} more re-carves (--json lists every one)")
        placed = d["assignments"] if args.job is None else [a for a in d["assignments"]
                                                             if str(a.get("job_id")) == args.job]
        for a in placed[:DECISION_LINES]:
            inst = ", ".join(f"{i['profile']}@{i['start']} GPU {i['gpu']}" for i in a.get("instances", []))
            print(f"    job {a['job_id']} -> {a['node']} ({inst}): {a.get('reason', '')}"[:width])
        if len(placed) > DECISION_LINES:
            print(f"    ... {len(placed) - DECISION_LINES} more placed (--json lists every one)")
        shown = d["waiting"] if args.job is None else [w for w in d["waiting"] if w[0] == args.job]
        for job, why in shown[:5]:
            print(f"    job {job} waits: {why}"[:width])
        if len(shown) > 5:
            print(f"    ... {len(shown) - 5} more waiting")
    return 0


# -- explain ------------------------------------------------------------------------------------

def explain_lines(ex: dict, width: int = 100, now: float | None = None) -> list[str]:
    """The text of `slurm-mig explain` from explain_view()'s data."""
    import time

    from slurm_mig.ops import render as R
    from slurm_mig.ops import fmt as F

    now = time.time() if now is None else now
    j = ex["job"]
    out: list[str] = []
    add = out.append
    wants = f"{j['count']} x {j['profile']}"
    head = f"Job {j['job_id']}"
    if j["name"]:
        head += f" ({j['name']})"
    head += f", user {j['user'] or '?'}, partition {j['partition'] or '?'}, asks for {wants}: {j['state']}"
    if j["node"] and j["instances"]:
        head += " on " + j["node"] + " " + ", ".join(f"GPU {i['gpu']} {i['profile']}@{i['start']}"
                                                     for i in j["instances"])
    add(head)
    prev = j.get("previous_attempt")
    if prev:  # a waiting job requeued while it ran: no longer there
        where = ", ".join(f"GPU {i['gpu']} {i['profile']}@{i['start']}" for i in prev.get("instances") or [])
        add(f"  its earlier attempt (before its requeue) ran on {prev.get('node') or '?'}" + (f" {where}" if where else ""))
    times = f"  submitted {F.fmt_when(j['submit_time'], now)}"
    if j["start_time"] is not None:
        times += f", started {F.fmt_when(j['start_time'], now)} after waiting {F.fmt_duration(j['wait_s'])}"
    elif j["state"] in ("PENDING", "REQUEUED"):
        times += f", waiting for {F.fmt_duration(j['wait_s'])}"
    if j["end_time"] is not None:
        times += f", ended {F.fmt_when(j['end_time'], now)} (ran {F.fmt_duration(j['run_s'])})"
    elif j["run_s"] is not None:
        times += f", running for {F.fmt_duration(j['run_s'])}"
    add(times)
    if ex["outcome"]:
        o = ex["outcome"]
        which = (f" of an earlier run of this id (run {o['run']})" if o.get("earlier_run")
                 else f" (run {o['run']} of this id)" if o.get("run", 1) > 1 else "")
        add(f"  outcome{which}: {o['state']}, exit code {F.fmt_exit(o['exit_code'])} "
            "(exit:signal, as sacct prints it)")
    add("")
    add("In short: " + ex["verdict"])
    add("")
    spans = ex["decisions"]["spans"]
    add(f"Decisions that touched it ({ex['decisions']['count']}):")
    if not spans:
        add("  none recorded (a job placed by the Prolog alone, or one the controller never saw pending)")
    for s in spans:
        # From its first decision to what ended it: the next decision recorded, the job's start or end, or now.
        ended = {"decision": f"until #{s['next_decision']}", "start": "until it started", "end": "until it ended",
                 "now": "still waiting" if s["what"] == "waiting" else "not started yet"}.get(s["ended_by"], "")
        when = (f"{F.fmt_when(s['since'], now)}..{'now' if s['ended_by'] == 'now' else F.fmt_clock(s['until'])}"
                f" ({F.fmt_duration(s['duration_s'])}, {ended})")
        ids = f"#{s['first']}" + (f"..#{s['last']}" if s["last"] != s["first"] else "")
        if s["what"] == "waiting":
            n = f"{s['decisions']} decision{'s' if s['decisions'] != 1 else ''}"
            add(f"  {when}  {ids} ({n}, {s['policy']}) waiting: {s['reason']}")
        else:
            a = s["assignment"] or {}
            inst = ", ".join(f"GPU {i['gpu']} {i['profile']}@{i['start']}" for i in a.get("instances", []))
            add(f"  {when}  {ids} ({s['policy']}) placed on {a.get('node')} {inst}: {s['reason']}")
            for c in s["changes"]:
                add(f"        with re-carve {c['node']}/{c['gpu']} -> {c['target']} ({c.get('reason', '')})")
            if s.get("fell_through"):
                add(f"        {s['fell_through']}")
        for r in s.get("reservations") or []:
            add(f"        reserved for it: {', '.join(r[2]) if len(r) > 2 else r}")
    for saw in ex["policy_saw"]:
        add("")
        add(f"What the policy saw at decision #{saw['decision']} ({saw['label']}, {F.fmt_when(saw['time'], now)}):")
        pos = saw["queue_position"]
        ahead = ", ".join(f"{v} x {k}" for k, v in saw["ahead_by_profile"].items())
        add(f"  {saw['gpus']} GPUs ({saw['available']} available), {saw['pending']} pending jobs; this job was "
            + (f"number {pos} in the queue" if pos else "not in its queue")
            + (f", behind {ahead}" if ahead else ""))
        verdicts = ", ".join(f"{v} {k}" for k, v in sorted(saw["verdicts"].items()))
        add(f"  GPUs for {wants}: {verdicts}")
        gw = max([len(o["gpu"]) for o in saw["options"]] + [3])
        lw = min(36, max([len(str(o["layout"])) for o in saw["options"]] + [6]))
        for o in saw["options"]:
            mark = "chosen " if o.get("chosen") else ("       " if saw["label"] == "assignment" else "")
            add(f"    {mark}{o['gpu']:<{gw}}  {str(o['layout']):<{lw}}  {o['verdict']:<13} {o['why']}"[:width])
        hidden = saw["gpus"] - len(saw["options"])
        if hidden > 0:
            add(f"    ... {hidden} more GPUs (counted above)")
    add("")
    if ex["reconfigurations"]:
        add("Reconfigurations on its GPU(s) while it waited:")
        for r in ex["reconfigurations"]:
            dur = f" in {F.fmt_num(r['duration_s'], 2)}s" if r["duration_s"] is not None else ""
            how = r["error"] or ("" if str(r["outcome"] or "").startswith("[") else r["outcome"]) or ""
            src = f"decision #{r['decision_id']}" if r["decision_id"] else "the Prolog's binding"
            add(f"  #{r['id']} {F.fmt_when(r['created_at'], now)} {r['node']}/{r['gpu']} {r['from']} -> {r['to']}: "
                f"{r['state']}{dur} (from {src}{'; ' + how if how else ''})")
            add(f"      steps: {', '.join(r['steps'])}"[:width])
    else:
        add("Reconfigurations on its GPU(s) while it waited: none")
    if ex["events"]:
        add("")
        add("Events:")
        for e in ex["events"]:
            add(f"  {F.fmt_when(e['time'], now)} {e['kind']:<8} {e['message']}"[:width])
    tl = ex.get("timeline")
    if tl and tl["segments"]:
        add("")
        add(f"Timeline of {tl['node']} GPU {','.join(str(g) for g in tl['gpus'])}:")
        for line in R.render_timeline(tl["segments"], tl["t0"], tl["t1"], width - 2, job_id=j["job_id"],
                                      submit=j["submit_time"], start=j["start_time"]):
            add("  " + line)
    return out


def _explain(args) -> int:
    from slurm_mig.ops import render as R
    from slurm_mig.ops import views as V
    from slurm_mig.ops.explain import explain_view

    cfg, store = _open(args)
    with store:
        ex = explain_view(store, args.job_id)
        if ex["job"]["state"] in V.LIVE_JOB_STATES:
            _note_if_stale(cfg, store)
        per_node: dict[str, int] = {}
        mig_models = set()
        for g in store.observed_gpus():
            per_node[g.node] = per_node.get(g.node, 0) + 1
            if g.mig_enabled and g.model:
                mig_models.add(g.model)
        replay = None
        if args.replay:
            from slurm_mig.ops.replay import replay_job

            replay = replay_job(store, args.job_id, policy=cfg.policy.name)
    if args.json:
        if replay is not None:
            ex["replay"] = replay
        _print_json(ex)
        return 0
    width = _width(args)
    for line in explain_lines(R.safe_tree(ex), width):
        print(line)
    if replay is not None:
        from slurm_mig.ops.replay import replay_lines

        print()
        for line in replay_lines(R.safe_tree(replay), width):
            print(line)
    if ex["outcome"] is not None and per_node:
        db = args.db or cfg.controller.db_path
        print()
        # Several GPU models: simulate --db replays the site's own node groups when told no cluster; --nodes
        # would put every job on the most common model.
        cluster = ("" if len(mig_models) > 1 else
                   f"--nodes {len(per_node)} --gpus-per-node {max(per_node.values())} ")
        # Quoted: a command to paste into a shell, and a path may hold a space (or a job id a character) it splits on
        q = shlex.quote
        print(f"Timeline picture of a replay of the finished jobs: slurm-mig simulate --db {q(str(db))} "
              f"--policy {q(cfg.policy.name)} {cluster}--job {q(args.job_id)} --plot {q(f'job{args.job_id}.png')}")
    return 0


# -- top ----------------------------------------------------------------------------------------

def _top(args) -> int:
    import shutil

    from slurm_mig.ops.top import PartitionNodes, TopOptions, run
    from slurm_mig.ops.views import open_readonly

    cfg, store = _open(args)
    # Asked through the config's Slurm even with --db (as `nodes --partition` does); a first lookup that
    # fails is an error rather than an empty screen saying no GPUs were reported.
    parts = PartitionNodes(cfg, args.partition)
    if args.partition:
        try:
            parts.get_or_fail()
        except BaseException:
            store.close()
            raise
    size = shutil.get_terminal_size((80, 24))
    opts = TopOptions(
        width=args.width or (size.columns if stdout_is_a_terminal() else 80),
        height=args.height or (size.lines if stdout_is_a_terminal() else 24),
        page=max(1, args.page), view=args.view, nodes=args.node, partition=args.partition,
        ascii=args.ascii or not stdout_can_show(),
        tick_interval_s=cfg.controller.tick_interval_s, stale_after_s=cfg.controller.node_stale_after_s)
    path = args.db or cfg.controller.db_path
    with store:
        return run(store, opts, cfg=None if args.db else cfg, interval=max(0.2, args.interval), once=args.once,
                   parts=parts, reopen=lambda: open_readonly(path, busy_timeout_s=cfg.controller.db_busy_timeout_s))
