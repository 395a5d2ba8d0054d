#!/usr/bin/env python3
"""How long one controller tick takes on a large site, beside [controller].tick_interval_s.

    .venv/bin/python benchmarks/tick_scale.py                         # the default sizes (~1.5 min on 2 cores)
    .venv/bin/python benchmarks/tick_scale.py --sizes 128x10000x1500 --policies frag-aware --ticks 5
    .venv/bin/python benchmarks/tick_scale.py --sizes 128x10000x1500 --policies frag-aware --profile out.prof

Each size is NODESxPENDINGxRUNNING: NODES nodes of 8 simulated H100-80GB, PENDING queue entries (a third
of them tasks of job arrays of 50, shown to squeue as one record each) and RUNNING jobs, each bound to one
instance its node reports in use. The controller is the real one (slurm_mig.controller.service.Controller)
over a fresh state database; the nodes' GPUs come in through Controller.on_report, as the health check sends
them. Slurm is a SlurmClient whose one runner (SlurmClient.run) answers squeue --json, sinfo --json, scontrol
-o show reservation, scontrol show node and scontrol update from Slurm 22.05 text generated for that site
(the record layout of tests/test_slurm_parsers.py's SQUEUE_JSON_22_05 / SINFO_JSON_22_05 captures), so the
JSON decoding and the parsers run as they do against a real slurmctld; the time the fake runner itself takes
(making the text) is left out of every figure. Gres updates change the counts the next sinfo shows.

The first tick (every job new to the store) is shown apart; the median and p90 are of the ticks after it,
a steady queue: nothing starts or ends, the decision repeats, its re-carves stay planned (no node carries
them out). The columns after them say where the median tick's time goes (each function's own time, less
what it calls that is counted in another column):

  slurm   SlurmClient queries and updates: JSON decoding and the parsers (slurm_mig/slurm/)
  sync    the store writes from Slurm's answer (Controller._sync_jobs, _sync_nodes, _lost_epilogs)
  state   Store.cluster_state (the policy's view, read from the database)
  decide  the policy's decide()
  check   policies.check_decision
  plan    the rest of Controller._plan (eligibility, plan_transition, metrics)
  commit  the second transaction (Controller._commit: decision, desired layouts, journal, reservations)
  gres    Controller._assert_gres and _withdraw_first (intended layouts per node, Gres writes)
  other   the rest of the tick (gauges, requeue check)
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from slurm_mig.config import Config
from slurm_mig.controller import service
from slurm_mig.controller.service import Controller
from slurm_mig.slurm.gres import GRES_TYPES, PAD_TYPE
from slurm_mig.slurm.runner import SlurmClient, SlurmResult
from slurm_mig.store import open_store

GPUS_PER_NODE = 8
MODEL = "H100-80GB"
ARRAY_SIZE = 50
# GPU layouts at the start, round-robin over the site's GPUs (H100-80GB profile names as NVML gives them).
LAYOUTS = (
    [("1g.10gb", s) for s in range(7)],
    [("3g.40gb", 0), ("3g.40gb", 4)],
    [("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4), ("1g.10gb", 6)],
    [("4g.40gb", 0), ("3g.40gb", 4)],
)
KIND = {"1g.10gb": "1g", "2g.20gb": "2g", "3g.40gb": "3g", "4g.40gb": "4g", "7g.80gb": "7g"}
# What the queue asks for: (GRES type, share of the pending entries).
PENDING_MIX = (("1g", 0.5), ("2g", 0.2), ("3g", 0.2), ("7g", 0.1))

# One job and one node of `squeue --json` / `sinfo --json` as Slurm 22.05.8 prints them (every field; the
# values the site changes are set per record).
JOB_22_05 = json.loads(r"""{"account":"","accrue_time":1795257118,"admin_comment":"","array_job_id":0,"array_task_id":null,"array_max_tasks":0,"array_task_string":"","association_id":0,"batch_features":"","batch_flag":true,"batch_host":"","flags":[],"burst_buffer":"","burst_buffer_state":"","cluster":"slurmmig","cluster_features":"","command":"","comment":"","container":"","contiguous":false,"core_spec":null,"thread_spec":null,"cores_per_socket":null,"billable_tres":null,"cpus_per_task":null,"cpu_frequency_minimum":null,"cpu_frequency_maximum":null,"cpu_frequency_governor":null,"cpus_per_tres":"","deadline":0,"delay_boot":0,"dependency":"","derived_exit_code":0,"eligible_time":1795257118,"end_time":0,"excluded_nodes":"","exit_code":0,"features":"","federation_origin":"","federation_siblings_active":"","federation_siblings_viable":"","gres_detail":[],"group_id":1000,"group_name":"users","job_id":22,"job_state":"PENDING","last_sched_evaluation":1795257119,"licenses":"","max_cpus":0,"max_nodes":0,"mcs_label":"","memory_per_tres":"","name":"train","nodes":"","nice":null,"tasks_per_core":null,"tasks_per_node":0,"tasks_per_socket":null,"tasks_per_board":0,"cpus":1,"node_count":1,"tasks":1,"het_job_id":0,"het_job_id_set":"","het_job_offset":0,"partition":"gpu","prefer":"","memory_per_node":null,"memory_per_cpu":null,"minimum_cpus_per_node":1,"minimum_tmp_disk_per_node":0,"preempt_time":0,"pre_sus_time":0,"priority":4294901757,"profile":null,"qos":"","reboot":false,"required_nodes":"","requeue":true,"resize_time":0,"restart_cnt":0,"resv_name":"","shared":null,"show_flags":["SHOW_ALL","SHOW_DETAIL","SHOW_LOCAL"],"sockets_per_board":0,"sockets_per_node":null,"start_time":0,"state_description":"","state_reason":"Resources","standard_error":"","standard_input":"/dev/null","standard_output":"","submit_time":1795257118,"suspend_time":0,"system_comment":"","time_limit":60,"time_minimum":0,"threads_per_core":null,"tres_bind":"","tres_freq":"","tres_per_job":"","tres_per_node":"gres:mig:2g:1","tres_per_socket":"","tres_per_task":"","tres_req_str":"cpu=1,mem=16000M,node=1,billing=1","tres_alloc_str":"","user_id":1000,"user_name":"alice","wckey":"","current_working_directory":"/home/alice"}""")
NODE_22_05 = json.loads(r"""{"architecture":"x86_64","burstbuffer_network_address":"","boards":1,"boot_time":1795256448,"comment":"","cores":64,"cpu_binding":0,"cpu_load":5,"extra":"","free_memory":23733,"cpus":128,"last_busy":1795257117,"features":"","active_features":"","gres":"","gres_drained":"N/A","gres_used":"","mcs_label":"","name":"n1","next_state_after_reboot":"invalid","address":"10.0.0.1","hostname":"n1","state":"mixed","state_flags":[],"next_state_after_reboot_flags":[],"operating_system":"Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC","owner":null,"partitions":["gpu"],"port":6818,"real_memory":1000000,"reason":"","reason_changed_at":0,"reason_set_by_user":null,"slurmd_start_time":1795257117,"sockets":2,"threads":1,"temporary_disk":0,"weight":1,"tres":"cpu=128,mem=1000000M,billing=128","slurmd_version":"22.05.8","alloc_memory":0,"alloc_cpus":0,"idle_cpus":128,"tres_used":null,"tres_weighted":0.0}""")
META = {"plugin": {"type": "openapi/v0.0.38", "name": "Slurm OpenAPI v0.0.38"},
        "Slurm": {"version": {"major": 22, "micro": 8, "minor": 5}, "release": "22.05.8"}}
SCONTROL_NODE = """NodeName={name} Arch=x86_64 CoresPerSocket=32
   CPUAlloc={alloc} CPUEfctv=128 CPUTot=128 CPULoad=0.05
   AvailableFeatures=(null)
   ActiveFeatures=(null)
   Gres={gres}
   NodeAddr=10.0.0.1 NodeHostName={name} Port=6818 Version=22.05.8
   OS=Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC
   RealMemory=1000000 AllocMem=0 FreeMem=900000 Sockets=2 Boards=1
   State={state} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=gpu
   BootTime=2026-11-21T10:20:48 SlurmdStartTime=2026-11-21T10:31:57
   LastBusyTime=2026-11-21T10:31:57
   CfgTRES=cpu=128,mem=1000000M,billing=128
   AllocTRES={alloc_tres}
   CapWatts=n/a
   CurrentWatts=0 AveWatts=0
   ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s

"""


class Site:
    """The site's Slurm side: its jobs, its nodes' counts, and the text Slurm 22.05 prints for them."""

    def __init__(self, nodes: int, pending: int, running: int, now: float):
        self.names = [f"gpu{i + 1:03d}" for i in range(nodes)]
        self.now = now
        # Each GPU's instances, and which running job holds which: (node, gpu) -> [(profile, start, job_id)]
        self.gpus: dict[tuple[str, int], list] = {}
        slots = []
        for ni, name in enumerate(self.names):
            for gi in range(GPUS_PER_NODE):
                lay = LAYOUTS[(ni * GPUS_PER_NODE + gi) % len(LAYOUTS)]
                self.gpus[(name, gi)] = [[p, s, None] for p, s in lay]
                slots += [(name, gi, k) for k in range(len(lay))]
        if running > len(slots):
            raise SystemExit(f"{running} running jobs do not fit on {len(slots)} instances")
        # Spread the running jobs over the site: every k-th instance.
        step = len(slots) / running if running else 0
        self.jobs: list[dict] = []
        self._cores: dict[str, int] = {}
        job_id = 1000
        for r in range(running):
            name, gi, k = slots[int(r * step)]
            inst = self.gpus[(name, gi)][k]
            job_id += 1
            inst[2] = str(job_id)
            self.jobs.append(self._job(job_id, "RUNNING", KIND[inst[0]], node=name, priority=10**6))
        # The queue: singles and arrays of ARRAY_SIZE tasks, in descending priority.
        left, prio, n = pending, 10**6 - 1, 0
        while left > 0:
            kind = _pick(n)
            job_id += 1
            if n % 3 == 2 and left >= ARRAY_SIZE:  # every third record an array
                self.jobs.append(self._job(job_id, "PENDING", kind, priority=prio, array=ARRAY_SIZE))
                left -= ARRAY_SIZE
            else:
                self.jobs.append(self._job(job_id, "PENDING", kind, priority=prio))
                left -= 1
            prio -= 1
            n += 1
        self.running = running
        self.pending = pending
        # slurm.conf: each node's boot counts plus mig:pad up to 7 per GPU; the counts now: its layouts'.
        self.gres: dict[str, dict[str, int]] = {}
        for name in self.names:
            counts = {t: 0 for t in GRES_TYPES}
            for gi in range(GPUS_PER_NODE):
                for p, _s, _j in self.gpus[(name, gi)]:
                    counts[KIND[p]] += 1
            counts[PAD_TYPE] = 7 * GPUS_PER_NODE - sum(counts.values())
            self.gres[name] = counts
        self.gres_writes = 0
        self._squeue: str | None = None
        self._sinfo: str | None = None

    def _job(self, job_id: int, state: str, kind: str, *, node: str = "", priority: int, array: int = 0) -> dict:
        j = copy.deepcopy(JOB_22_05)
        j.update(job_id=job_id, job_state=state, tres_per_node=f"gres:mig:{kind}:1", priority=priority,
                 name=f"job{job_id}", submit_time=int(self.now) - 3600 + job_id % 3000,
                 user_name=f"user{job_id % 40}", user_id=1000 + job_id % 40)
        if state == "RUNNING":
            # the core: the node's running jobs in turn (each asks for one CPU)
            core = self._cores[node] = self._cores.get(node, -1) + 1
            j.update(nodes=node, batch_host=node, start_time=int(self.now) - 600, state_reason="None",
                     flags=["JOB_WAS_RUNNING"], time_limit=600, end_time=int(self.now) - 600 + 36000,
                     gres_detail=[f"mig:{kind}(CNT:1)"], tres_alloc_str="cpu=1,node=1,billing=1",
                     billable_tres=1.0, job_resources={
                         "nodes": node, "allocated_cores": 1, "allocated_hosts": 1, "allocated_nodes": [{
                             "sockets": {str(core // 32): {"cores": {str(core % 32): "allocated"}}},
                             "nodename": node, "cpus_used": 0, "memory_used": 0, "memory_allocated": 0}]})
        else:
            j.update(state_reason="Resources" if priority % 4 == 0 else "Priority")
        if array:
            j.update(array_job_id=job_id, array_task_string=f"1-{array}")
        return j

    def squeue(self) -> str:
        if self._squeue is None:
            self._squeue = json.dumps({"meta": META, "errors": [], "jobs": self.jobs}, indent=2)
        return self._squeue

    def sinfo(self) -> str:
        if self._sinfo is None:
            nodes = []
            for name in self.names:
                n = copy.deepcopy(NODE_22_05)
                used = {t: 0 for t in GRES_TYPES}
                for gi in range(GPUS_PER_NODE):
                    for p, _s, j in self.gpus[(name, gi)]:
                        if j is not None:
                            used[KIND[p]] += 1
                alloc = sum(used.values())
                used[PAD_TYPE] = 0  # listed as configured, as 22.05 prints it (tests/test_controller_gres_events.py)
                n.update(name=name, hostname=name, gres=self._gres_text(name),
                         gres_used=",".join(f"mig:{t}:{c}" for t, c in used.items()),
                         state="mixed" if alloc else "idle", alloc_cpus=alloc, idle_cpus=128 - alloc,
                         tres_used=f"cpu={alloc}" if alloc else None, tres_weighted=float(alloc))
                nodes.append(n)
            self._sinfo = json.dumps({"meta": META, "errors": [], "nodes": nodes}, indent=2)
        return self._sinfo

    def _gres_text(self, name: str) -> str:
        return ",".join(f"mig:{t}:{c}" for t, c in self.gres[name].items())

    def scontrol_node(self, name: str) -> str:
        alloc = sum(1 for gi in range(GPUS_PER_NODE) for _p, _s, j in self.gpus[(name, gi)] if j is not None)
        return SCONTROL_NODE.format(name=name, gres=self._gres_text(name), alloc=alloc,
                                    alloc_tres=f"cpu={alloc}" if alloc else "", state="MIXED" if alloc else "IDLE")

    def set_gres(self, name: str, value: str) -> None:
        counts = {}
        for item in value.split(","):
            parts = item.split(":")
            if parts[0] == "mig" and len(parts) == 3:
                counts[parts[1]] = int(parts[2])
        self.gres[name] = {t: counts.get(t, 0) for t in (*GRES_TYPES, PAD_TYPE)}
        self.gres_writes += 1
        self._sinfo = None

    def reports(self, now: float) -> list[dict]:
        """Each node's /v1/report, as its health check sends it."""
        out = []
        for name in self.names:
            observed, bindings = [], {}
            for gi in range(GPUS_PER_NODE):
                insts = []
                for p, s, j in self.gpus[(name, gi)]:
                    uuid = f"MIG-{name}-{gi}-{s}"
                    insts.append({"profile": p, "start": s, "uuid": uuid, "in_use": j is not None})
                    if j is not None:
                        bindings[j] = [{"gpu": gi, "profile": p, "start": s, "uuid": uuid}]
                observed.append({"index": gi, "uuid": f"GPU-{name}-{gi}", "name": "NVIDIA H100 80GB HBM3",
                                 "model": MODEL, "mig_enabled": True, "instances": insts})
            out.append({"node": name, "observed": observed, "bindings": bindings,
                        "binding_times": {j: now - 590 for j in bindings}, "observed_at": now})
        return out


def _pick(n: int) -> str:
    """The n-th record's size, spread as PENDING_MIX says."""
    x = (n * 0.618033988749895) % 1.0
    for kind, share in PENDING_MIX:
        if x < share:
            return kind
        x -= share
    return PENDING_MIX[-1][0]


class FakeSlurm(SlurmClient):
    """SlurmClient whose one runner answers from the Site; its own time is kept apart (``fake_s``)."""

    def __init__(self, site: Site):
        super().__init__()
        self.site = site
        self.fake_s = 0.0
        self.calls: dict[str, int] = {}

    def run(self, argv, *, timeout=None, input=None, env=None) -> SlurmResult:
        t0 = time.perf_counter()
        argv = [str(a) for a in argv]
        key = " ".join(argv[:3])
        self.calls[key] = self.calls.get(key, 0) + 1
        out, rc = "", 0
        if argv[:2] == ["squeue", "--json"]:
            out = self.site.squeue()
        elif argv[:2] == ["sinfo", "--json"]:
            out = self.site.sinfo()
        elif argv[:4] == ["scontrol", "-o", "show", "reservation"]:
            out = "No reservations in the system\n"
        elif argv[:3] == ["scontrol", "show", "node"] and len(argv) == 4:
            out = self.site.scontrol_node(argv[3])
        elif argv[:2] == ["scontrol", "update"] and argv[2].startswith("NodeName=") and argv[3].startswith("Gres="):
            self.site.set_gres(argv[2].split("=", 1)[1], argv[3].split("=", 1)[1])
        elif argv[:1] == ["squeue"]:  # job_detail of one job: Slurm forgot it
            out = ""
        else:
            out, rc = "", 1
        self.fake_s += time.perf_counter() - t0
        return SlurmResult(tuple(argv), rc, out, "" if rc == 0 else "not simulated", 0.0)


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Timer:
    """Each wrapped function's own time (less that of wrapped functions it calls), per column."""

    def __init__(self):
        self.own: dict[str, float] = {}
        self._stack: list[list] = []

    def wrap(self, column: str, fn):
        def timed(*args, **kwargs):
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[0]
                self.own[column] = self.own.get(column, 0.0) + spent - frame[1]
                if self._stack:
                    self._stack[-1][1] += spent
        return timed

    def take(self) -> dict[str, float]:
        out, self.own = self.own, {}
        return out


COLUMNS = ("slurm", "sync", "state", "decide", "check", "plan", "commit", "gres")


def instrument(ctl: Controller, slurm: FakeSlurm, timer: Timer) -> None:
    """Wrap the tick's parts (on the instances, so nothing outside this process changes)."""
    for m in ("jobs", "nodes", "reservations", "job_detail", "update_node_gres", "scontrol_requeue"):
        setattr(slurm, m, timer.wrap("slurm", getattr(slurm, m)))
    real_run = slurm.run

    def run(*a, **kw):  # the fake's own time: taken out of the column that called it
        t0 = time.perf_counter()
        try:
            return real_run(*a, **kw)
        finally:
            if timer._stack:
                timer._stack[-1][1] += time.perf_counter() - t0
    slurm.run = run
    for m in ("_sync_jobs", "_sync_nodes", "_lost_epilogs"):
        setattr(ctl, m, timer.wrap("sync", getattr(ctl, m)))
    ctl._plan = timer.wrap("plan", ctl._plan)
    ctl._commit = timer.wrap("commit", ctl._commit)
    ctl._assert_gres = timer.wrap("gres", ctl._assert_gres)
    ctl._withdraw_first = timer.wrap("gres", ctl._withdraw_first)
    ctl.store.cluster_state = timer.wrap("state", ctl.store.cluster_state)
    for p in (ctl.policy, ctl.fallback):
        if p is not None:
            p.decide = timer.wrap("decide", p.decide)
    return None


def build(nodes: int, pending: int, running: int, policy: str, folder: Path, now: float = 1795257118.0):
    site = Site(nodes, pending, running, now)
    base = Config()
    cfg = replace(base, policy=replace(base.policy, name=policy))
    clock = Clock(now)
    store = open_store(folder / f"state-{nodes}-{pending}-{running}-{policy}.db")
    slurm = FakeSlurm(site)
    ctl = Controller(cfg, store, slurm, clock=clock)
    # The running jobs become known (squeue), then every node reports its GPUs and binding files.
    ctl.tick()
    for rep in site.reports(clock.t):
        ctl.on_report(rep, None)
    return ctl, site, slurm, clock


def measure(nodes: int, pending: int, running: int, policy: str, ticks: int, folder: Path,
            profile: str | None = None) -> dict:
    ctl, site, slurm, clock = build(nodes, pending, running, policy, folder)
    interval = ctl.cfg.controller.tick_interval_s
    timer = Timer()
    real_check = service.check_decision
    service.check_decision = timer.wrap("check", real_check)
    try:
        instrument(ctl, slurm, timer)
        times, parts = [], []
        prof = None
        for i in range(ticks + 1):
            clock.t += interval
            if profile and i == ticks:
                prof = cProfile.Profile()
                prof.enable()
            slurm.fake_s = 0.0
            t0 = time.perf_counter()
            summary = ctl.tick()
            wall = time.perf_counter() - t0 - slurm.fake_s
            if prof is not None:
                prof.disable()
            times.append(wall)
            parts.append(timer.take())
    finally:
        service.check_decision = real_check
    if prof is not None:
        prof.dump_stats(profile)
    steady = times[1:] or times
    median_i = sorted(range(len(steady)), key=lambda k: steady[k])[len(steady) // 2]
    cols = {c: parts[1 + median_i].get(c, 0.0) if len(times) > 1 else parts[0].get(c, 0.0) for c in COLUMNS}
    cols["other"] = steady[median_i] - sum(cols.values())
    pend = ctl.store.pending_jobs()
    out = {"nodes": nodes, "gpus": nodes * GPUS_PER_NODE, "pending": len(pend), "running": running,
           "policy": policy, "first_ms": times[0] * 1000, "median_ms": statistics.median(steady) * 1000,
           "p90_ms": _p90(steady) * 1000, "budget_ms": interval * 1000,
           "parts_ms": {c: v * 1000 for c, v in cols.items()}, "gres_writes": site.gres_writes,
           "changes": summary.get("changes"), "assignments": summary.get("assignments")}
    ctl.store.close()
    return out


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = 0.9 * (len(s) - 1)
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _size(text: str) -> tuple[int, int, int]:
    try:
        n, q, r = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NODESxPENDINGxRUNNING, got {text!r}") from None
    return n, q, r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=lambda s: [_size(x) for x in s.split(",")],
                    default=[(16, 500, 200), (64, 2000, 800), (128, 5000, 1500), (128, 10000, 1500)],
                    help="NODESxPENDINGxRUNNING,... (default: 16x500x200,64x2000x800,128x5000x1500,128x10000x1500)")
    ap.add_argument("--policies", default="first-fit,frag-aware,rl")
    ap.add_argument("--ticks", type=int, default=5, help="steady ticks timed after the first (default 5)")
    ap.add_argument("--profile", metavar="FILE", help="cProfile the last tick of the last case into FILE and "
                                                     "print its top functions")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    cases = [(n, q, r, p.strip()) for n, q, r in args.sizes for p in args.policies.split(",")]
    with tempfile.TemporaryDirectory(prefix="tick-scale-") as d:
        if not args.json:
            print(f"{'nodes':>5} {'GPUs':>5} {'pending':>7} {'running':>7} {'policy':<10} {'first':>7} "
                  f"{'median':>7} {'p90':>7} | " + " ".join(f"{c:>6}" for c in (*COLUMNS, "other"))
                  + " | budget (ms)", flush=True)
        for k, (n, q, r, p) in enumerate(cases):
            prof = args.profile if args.profile and k == len(cases) - 1 else None
            row = measure(n, q, r, p, args.ticks, Path(d), profile=prof)
            rows.append(row)
            if not args.json:
                print(f"{row['nodes']:>5} {row['gpus']:>5} {row['pending']:>7} {row['running']:>7} "
                      f"{row['policy']:<10} {row['first_ms']:>7.0f} {row['median_ms']:>7.0f} {row['p90_ms']:>7.0f} | "
                      + " ".join(f"{row['parts_ms'][c]:>6.0f}" for c in (*COLUMNS, "other"))
                      + f" | {row['budget_ms']:.0f}", flush=True)
    if args.json:
        print(json.dumps({"tick_scale": rows}))
    if args.profile:
        pstats.Stats(args.profile).sort_stats("cumulative").print_stats(40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
