"""Crash safety on the real local Slurm cluster: kill -9 the controller and the hooks at random points
of reconfigurations, many seeds, and check that nothing is lost, doubled or shared.

    .venv/bin/python benchmarks/crash_safety.py --seeds 20            # about 1 minute per seed
    .venv/bin/python benchmarks/crash_safety.py --seeds 5 --json out.json
    .venv/bin/python benchmarks/crash_safety.py --seeds 3 --wrapper-kills   # also kill the sh wrappers

One DemoCluster (real slurmctld, 3 slurmd, munge, the controller and node agents, 2 simulated H100s
per node with NVIDIA's create/destroy times x --delay-scale) serves every seed. Per seed:

* a burst of mixed 1g/2g/3g/4g/7g jobs (the seed picks them) that cannot all fit the layouts the
  GPUs have, so the Prologs and the node agents re-carve GPUs while other jobs run;
* an injector that SIGKILLs, at random moments the seed drives:
  - ``reconfig``: the process holding a simulated GPU's lock, i.e. a Prolog or node agent in the
    middle of creating or destroying a MIG instance (found through /proc/locks);
  - ``prolog`` / ``epilog``: the Python hook processes of this cluster (found through /proc, by
    the config path in their environment), at a random point of their run;
  - ``controller``: the controller, restarted after a random 0.5-4 s;
  - ``agent``: a node agent (the health check loop), restarted after a random 0.5-3 s;
  - ``wrapper`` (only with --wrapper-kills): the /bin/sh Prolog wrapper itself. Slurm drains a
    node whose Prolog process dies by a signal (its own rule); the harness then resumes the node
    and counts it: no software can catch SIGKILL of its own process;
* a Watcher thread sampling every node's GPUs and binding files every 0.1 s.

When the burst is over the harness waits for the cluster to settle and checks:

1. every job completed exactly once with exit 0 (requeued jobs ran again): one outcome per job,
   no outcome recorded for a run that never happened (its run time covers the job's sleep), and
   the job's last run saw MIG UUIDs of the size it asked for;
2. no binding file ever named an instance that did not exist while its job held it, and no
   instance was ever held by two jobs (Watcher); the bindings table has no two live jobs on the
   same or overlapping slices at any time;
3. every reconfiguration journal entry of the seed ended (done, failed or abandoned) with its
   steps and how it ended recorded;
4. state converged: no live binding in the database or on the nodes, no instance marked busy,
   the database's view of each GPU equals the GPU, Slurm's GRES counts equal the instances,
   no node left drained.

Figures printed (and written with --json): seeds, jobs, kills by kind, faults survived, drains
resumed, held jobs released, requeues, violations. docs/reliability.md reports a run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from slurm_mig.democluster import DemoCluster  # noqa: E402

SIZES = {"mig:1g": ("1g", 1), "mig:2g": ("2g", 1), "mig:3g": ("3g", 1), "mig:4g": ("4g", 1), "mig:7g": ("7g", 1),
         "mig:1g:2": ("1g", 2)}
KILL_KINDS = ("reconfig", "prolog", "epilog", "controller", "agent")


# -- finding this cluster's processes ---------------------------------------------------------------

def _proc(pid: int) -> tuple[list[bytes], list[bytes]]:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return [], []
    return cmd, env


def _cluster_pids(dc: DemoCluster, matches) -> list[int]:
    """Processes of this cluster (by the config in their environment) whose argv ``matches``."""
    mark = f"SLURM_MIG_CONFIG={dc.config_path}".encode()
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        cmd, env = _proc(int(p.name))
        if mark in env and matches(cmd):
            out.append(int(p.name))
    return out


def hook_pids(dc: DemoCluster, kind: str) -> list[int]:
    """Python hook processes (prolog/epilog/taskprolog) of this cluster."""
    return _cluster_pids(dc, lambda cmd: b"slurm_mig.node.hooks" in cmd and kind.encode() in cmd)


def wrapper_pids(dc: DemoCluster) -> list[int]:
    """The /bin/sh Prolog wrappers (prolog/slurm-mig-prolog) of this cluster."""
    return _cluster_pids(dc, lambda cmd: any(c.endswith(b"slurm-mig-prolog") for c in cmd))


def gpu_lock_holders(dc: DemoCluster) -> list[int]:
    """Pids holding a simulated GPU's reconfiguration lock right now (a create or destroy in progress)."""
    inodes = set()
    for f in (dc.state / "gpus").glob("*.json.gpu*.lock"):
        try:
            inodes.add(os.stat(f).st_ino)
        except OSError:
            pass
    pids = []
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            # "1: FLOCK  ADVISORY  WRITE 1234 00:2a:123456 0 EOF" (blocked waiters carry "->")
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[3] == "WRITE" and "->" not in line:
                if int(parts[5].split(":")[-1]) in inodes:
                    pids.append(int(parts[4]))
    except (OSError, ValueError):
        pass
    ours = []
    for pid in pids:
        cmd, env = _proc(pid)
        if f"SLURM_MIG_CONFIG={dc.config_path}".encode() in env and any(b"python" in c for c in cmd[:1]):
            ours.append(pid)
    return ours


# -- the injector -------------------------------------------------------------------------------------

@dataclass
class KillRecord:
    at: float
    kind: str
    target: str


class Injector(threading.Thread):
    def __init__(self, dc: DemoCluster, rng: random.Random, *, budget: dict[str, int], wrapper_kills: bool):
        super().__init__(daemon=True)
        self.dc, self.rng, self.budget = dc, rng, dict(budget)
        self.wrapper_kills = wrapper_kills
        self.stop_flag = threading.Event()
        self.kills: list[KillRecord] = []
        self.errors: list[str] = []
        self.t0 = time.monotonic()
        # Controller and agent kills at moments the seed picks; hook kills when one is seen at work.
        self.plan = sorted((rng.uniform(1.0, 14.0), k) for k in ("controller", "agent")
                           for _ in range(budget.get(k, 0)))
        self.p = {"reconfig": rng.uniform(0.3, 0.7), "prolog": rng.uniform(0.1, 0.3),
                  "epilog": rng.uniform(0.1, 0.3), "wrapper": 0.3}
        self._seen: set[int] = set()

    def _kill(self, pid: int, kind: str, what: str) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.budget[kind] -= 1
        self.kills.append(KillRecord(round(time.monotonic() - self.t0, 2), kind, what))

    def run(self):
        try:
            self._run()
        except Exception as exc:  # the harness must report, not die
            self.errors.append(f"injector: {type(exc).__name__}: {exc}")

    def _run(self):
        restarts: list[tuple[float, str]] = []
        while not self.stop_flag.is_set():
            now = time.monotonic() - self.t0
            for when, name in list(restarts):
                if now >= when:
                    restarts.remove((when, name))
                    if name == "controller":
                        self.dc.start_controller()
                    else:
                        self.dc.start_agent(name)
            while self.plan and now >= self.plan[0][0]:
                _, kind = self.plan.pop(0)
                if kind == "controller" and "controller" in self.dc.procs:
                    self.dc.kill_controller(signal.SIGKILL)
                    self.budget[kind] -= 1
                    self.kills.append(KillRecord(round(now, 2), kind, "controller"))
                    restarts.append((now + self.rng.uniform(0.5, 4.0), "controller"))
                elif kind == "agent":
                    node = self.rng.choice(self.dc.nodes)
                    if f"agent-{node}" in self.dc.procs:
                        self.dc._kill(f"agent-{node}", signal.SIGKILL)
                        self.budget[kind] -= 1
                        self.kills.append(KillRecord(round(now, 2), kind, f"agent {node}"))
                        restarts.append((now + self.rng.uniform(0.5, 3.0), node))
            # A process caught in the middle of a create/destroy.
            if self.budget.get("reconfig", 0) > 0:
                for pid in gpu_lock_holders(self.dc):
                    if ("r", pid) not in self._seen:
                        self._seen.add(("r", pid))
                        if self.rng.random() < self.p["reconfig"]:
                            time.sleep(self.rng.uniform(0.0, 0.15))
                            cmd, _ = _proc(pid)
                            what = "prolog" if b"prolog" in cmd else ("agent" if b"sync" in cmd else "hook")
                            if what == "agent":
                                node = cmd[cmd.index(b"--node") + 1].decode() if b"--node" in cmd else "?"
                                if f"agent-{node}" in self.dc.procs:
                                    self.dc.procs.pop(f"agent-{node}")
                                    restarts.append((now + self.rng.uniform(0.5, 3.0), node))
                            self._kill(pid, "reconfig", f"{what} {pid} mid-reconfiguration")
                            break
            for kind in ("prolog", "epilog"):
                if self.budget.get(kind, 0) <= 0:
                    continue
                for pid in hook_pids(self.dc, kind):
                    if (kind, pid) in self._seen:
                        continue
                    self._seen.add((kind, pid))
                    if self.rng.random() < self.p[kind]:
                        time.sleep(self.rng.uniform(0.0, 0.4))
                        self._kill(pid, kind, f"{kind} {pid}")
                        break
            if self.wrapper_kills and self.budget.get("wrapper", 0) > 0:
                for pid in wrapper_pids(self.dc):
                    if ("w", pid) not in self._seen:
                        self._seen.add(("w", pid))
                        if self.rng.random() < self.p["wrapper"]:
                            self._kill(pid, "wrapper", f"prolog wrapper {pid}")
                            break
            time.sleep(0.02)
        # Whatever was killed last comes back before the checks.
        for when, name in restarts:
            if name == "controller":
                self.dc.start_controller()
            else:
                self.dc.start_agent(name)


# -- watching and checking ----------------------------------------------------------------------------

class Watcher(threading.Thread):
    """Samples GPUs and binding files every 0.1 s: a held instance must exist, and be held by one job."""

    def __init__(self, dc: DemoCluster):
        super().__init__(daemon=True)
        self.dc = dc
        self.stop_flag = threading.Event()
        self.violations: list[str] = []
        self.samples = 0  # rounds in which every node's bindings and GPUs were read and checked
        self.failed_reads = 0

    def run(self):
        # A watcher that dies (squeue timing out, say) would check nothing more while the seed still
        # passes: its end is a violation, as the injector's is.
        try:
            while not self.stop_flag.is_set():
                self.sample()
                time.sleep(0.1)
        except Exception as exc:
            self.violations.append(f"watcher stopped: {type(exc).__name__}: {exc}")

    def sample(self):
        checked = 0
        for node in self.dc.nodes:
            bdir = self.dc.state / "node" / node / "bindings"
            try:
                bindings = {}
                for p in bdir.glob("*.json"):
                    try:
                        bindings[p.stem] = json.loads(p.read_text())["instances"]
                    except (OSError, ValueError, KeyError, TypeError):
                        continue
                insts = self.dc.sim_instances(node)  # read after the bindings: a binding seen must exist now
            except Exception:
                self.failed_reads += 1
                continue
            whole = True
            holders: dict[str, str] = {}
            for job, held in bindings.items():
                for h in held:
                    if h["uuid"] in holders and holders[h["uuid"]] != job:
                        self.violations.append(f"{node}: {h['uuid']} held by jobs {holders[h['uuid']]} and {job}")
                    holders[h["uuid"]] = job
                    if h["uuid"] not in insts and (bdir / f"{job}.json").exists():
                        running = self._running(job)
                        if running is None:  # Slurm could not say: this round did not check the node
                            self.failed_reads += 1
                            whole = False
                        elif running:
                            self.violations.append(f"{node}: running job {job} holds {h['uuid']}, which does not exist")
            checked += whole
        if checked == len(self.dc.nodes):
            self.samples += 1

    def _running(self, job: str) -> bool | None:
        # A stale binding of a job that is not running (requeued, ended without its Epilog) is not a job
        # bound to a destroyed instance: the node's health check releases it. Ask Slurm; None when it
        # cannot say (a failed squeue is not "not running": that would skip the check unseen).
        try:
            res = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=self.dc.env(), capture_output=True,
                                 text=True, timeout=20)
        except subprocess.TimeoutExpired:
            return None
        if res.returncode != 0:
            # squeue -j of a job slurmctld has already purged fails with "Invalid job id": not running.
            return False if "Invalid job id" in res.stderr else None
        return res.stdout.strip() in ("RUNNING", "COMPLETING", "CONFIGURING")


def _overlaps(model, a, b) -> bool:
    try:
        return bool(model.profile(a["profile"]).mask(a["start"]) & model.profile(b["profile"]).mask(b["start"]))
    except Exception:
        return a["start"] == b["start"]


@dataclass
class SeedResult:
    seed: int
    jobs: int = 0
    kills: Counter = field(default_factory=Counter)
    kill_log: list = field(default_factory=list)
    drains_resumed: int = 0
    registration_drains: int = 0
    held_released: int = 0
    requeues: int = 0
    reconfigurations: int = 0
    journal: Counter = field(default_factory=Counter)
    violations: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations


def _slurm(dc: DemoCluster, *argv: str) -> str:
    res = subprocess.run(list(argv), env=dc.env(), capture_output=True, text=True, timeout=30)
    return res.stdout


def _resume_drained(dc: DemoCluster, result: SeedResult) -> None:
    for line in _slurm(dc, "sinfo", "-h", "-N", "-o", "%N|%T|%E").splitlines():
        name, state, reason = (line.split("|") + ["", ""])[:3]
        if name in dc.nodes and ("drain" in state or state.startswith("down")) and "inval" not in state:
            subprocess.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], env=dc.env(),
                           capture_output=True, timeout=30)
            result.drains_resumed += 1
            result.kill_log.append(f"resumed {name} ({state}: {reason})")


def _release_held(dc: DemoCluster, ids: set[str], result: SeedResult) -> None:
    for line in _slurm(dc, "squeue", "-h", "-o", "%i|%T|%r|%p").splitlines():
        job, state, reason, prio = (line.split("|") + ["", "", ""])[:4]
        if job in ids and state == "PENDING" and ("Held" in reason or "held" in reason or prio.strip() == "0.00000000"):
            subprocess.run(["scontrol", "release", job], env=dc.env(), capture_output=True, timeout=30)
            result.held_released += 1


def run_seed(dc: DemoCluster, seed: int, *, n_jobs: int = 8, budget: dict[str, int] | None = None,
             wrapper_kills: bool = False, timeout: float = 300.0, log=print) -> SeedResult:
    rng = random.Random(seed)
    result = SeedResult(seed)
    t_start = time.monotonic()
    store = dc.store()
    first_journal = (store._q("SELECT MAX(id) AS m FROM reconfig_journal")[0]["m"] or 0)
    first_event = (store._q("SELECT MAX(id) AS m FROM events")[0]["m"] or 0)
    store.close()
    budget = dict(budget or {"reconfig": 3, "prolog": 2, "epilog": 2, "controller": 2, "agent": 1})
    if wrapper_kills:
        budget.setdefault("wrapper", 1)
    # Sizes that cannot all fit the boot layouts (3g+2g+1g per GPU): re-carving is needed.
    gres_list = [rng.choice(list(SIZES)) for _ in range(n_jobs)]
    if "mig:7g" not in gres_list:
        gres_list[0] = "mig:7g"
    if "mig:4g" not in gres_list:
        gres_list[-1] = "mig:4g"
    durations = {}
    ids: dict[str, str] = {}
    watcher = Watcher(dc)
    watcher.start()
    injector = Injector(dc, rng, budget=budget, wrapper_kills=wrapper_kills)
    injector.start()
    for i, gres in enumerate(gres_list):
        seconds = round(rng.uniform(2.0, 5.0), 1)
        job = dc.sbatch(gres, seconds, name=f"crash{seed}-{i}")
        ids[job] = gres
        durations[job] = seconds
        time.sleep(rng.uniform(0.0, 0.4))
    result.jobs = len(ids)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            _restore_registration_drains(dc, result)
            _resume_drained(dc, result)
            _release_held(dc, set(ids), result)
            jobs = dc.cluster.client().jobs()  # None: squeue failed, which says nothing about the jobs
            live = [j for j in jobs or [] if str(j.job_id) in ids]
            if jobs is not None and not live and time.monotonic() - t_start > 16:  # the kill plan has had its time
                break
            time.sleep(1.0)
        else:
            result.violations.append(f"jobs still queued after {timeout:.0f} s: "
                                     f"{[(j.job_id, j.state) for j in dc.squeue() if str(j.job_id) in ids]}")
    finally:
        injector.stop_flag.set()
        injector.join()
    result.violations += injector.errors
    result.kills = Counter(k.kind for k in injector.kills)
    result.kill_log += [f"{k.at:6.2f}s {k.kind}: {k.target}" for k in injector.kills]
    _converge(dc, result, first_journal, ids)
    watcher.stop_flag.set()
    watcher.join()
    result.violations += [f"watcher: {v}" for v in dict.fromkeys(watcher.violations)]
    if watcher.samples < 20:
        result.violations.append(f"watcher took only {watcher.samples} samples in which every node could be read "
                                 f"({watcher.failed_reads} failed reads)")
    _check(dc, result, ids, durations, first_journal, first_event)
    result.seconds = round(time.monotonic() - t_start, 1)
    return result


def _converge(dc: DemoCluster, result: SeedResult, first_journal: int, ids: dict) -> None:
    """Wait until the cluster settles (at most 90 s), resuming drained nodes; record what never did."""
    deadline = time.monotonic() + 90
    why: list[str] = []
    while time.monotonic() < deadline:
        _restore_registration_drains(dc, result)
        _resume_drained(dc, result)
        why = _unsettled(dc, first_journal, set(ids))
        if not why:
            return
        time.sleep(1.0)
    result.violations += [f"did not converge in 90 s: {w}" for w in why]


def _unsettled(dc: DemoCluster, first_journal: int, ids: set[str]) -> list[str]:
    from slurm_mig.slurm.gres import gres_type_for_profile

    why = []
    if hook_pids(dc, "prolog") or hook_pids(dc, "epilog"):
        why.append("hooks still running")
    store = dc.store()
    try:
        running = [j.job_id for j in store.running_jobs() if j.job_id in ids]
        if running:
            why.append(f"jobs Slurm ended still running in the database {running}")
        open_entries = store._q("SELECT id, node, gpu, state FROM reconfig_journal WHERE id > ? AND state IN "
                                "('planned', 'in_progress')", (first_journal,))
        if open_entries:
            why.append(f"open journal entries {open_entries}")
        live = store.live_bindings()
        if live:
            why.append(f"live bindings in the database {[(j, n, b.gpu, b.start) for j, n, b in live]}")
        for node in dc.nodes:
            why += node_leftovers(dc, node)
            sim = dc.sim_instances(node)
            db = {(i.gpu, i.profile, i.start) for i in store.observed_instances(node)}
            real = {(i["gpu"], i["profile"], i["start"]) for i in sim.values()}
            if db != real:
                why.append(f"{node}: database sees {sorted(db)}, GPUs have {sorted(real)}")
    finally:
        store.close()
    nodes = dc.cluster.client().scontrol_show_nodes() or []
    for n in nodes:
        if n.name not in dc.nodes:
            continue
        want: dict[str, int] = {}
        for i in dc.sim_instances(n.name).values():
            t = gres_type_for_profile(i["profile"])
            want[t] = want.get(t, 0) + 1
        have = {t: c for t, c in n.gres.items() if c and t != "pad"}
        if have != want:
            why.append(f"{n.name}: Slurm GRES {have}, GPUs {want}")
        if n.drained or not n.available:
            why.append(f"{n.name} not available ({n.state} {sorted(n.flags)})")
    return why


def node_leftovers(dc, node: str) -> list[str]:
    """What a node still holds once every job has ended: the TaskProlog copies (bindings/), the root-only binding
    records (records/: an earlier run's record set aside as ``<job>.earlier-<n>`` has no copy, so a look at the
    copies alone missed it) and the instances marked busy on the simulated GPU, each with who marks it ("job N":
    a job's processes as its Prolog set them) and where it is."""
    from slurm_mig.nvml.simulated import SimulatedBackend

    why = []
    root = dc.state / "node" / node
    for folder, what in (("bindings", "binding files"), ("records", "binding records")):
        files = sorted(p.name for p in (root / folder).glob("*.json"))
        if files:
            why.append(f"{node} {what} {files}")
    gpu = SimulatedBackend(dc.state / "gpus" / f"{node}.json")
    busy = {}
    for g in gpu.gpus():
        owners = gpu.owners(g.index)
        for i in gpu.instances(g.index):
            if i.in_use:
                busy[i.uuid or f"half-made {g.index}:{i.slot}"] = f"{owners.get(i.slot)} on {i.slot} of GPU {g.index}"
    if busy:
        why.append(f"{node} instances still marked busy {busy}")
    return why


def _check(dc: DemoCluster, result: SeedResult, ids: dict[str, str], durations: dict[str, float],
           first_journal: int, first_event: int) -> None:
    from slurm_mig.mig.profiles import get_model

    store = dc.store()
    try:
        outcomes = {o.job_id: o for o in store.outcomes() if o.job_id in ids}
        rows = store._q("SELECT job_id, COUNT(*) AS n FROM outcomes WHERE job_id IN (%s) GROUP BY job_id"
                        % ",".join("?" * len(ids)), list(ids))
        for r in rows:
            if r["n"] != 1:
                result.violations.append(f"job {r['job_id']}: {r['n']} outcomes")
        for job, gres in ids.items():
            kind, want = SIZES[gres]
            o = outcomes.get(job)
            if o is None:
                result.violations.append(f"job {job} ({gres}): no outcome recorded")
                continue
            if o.state != "COMPLETED" or o.exit_code != 0:
                result.violations.append(f"job {job}: outcome {o.state} exit {o.exit_code}")
            # Slurm's EndTime (the lost-Epilog path) has whole seconds: up to 1 s short.
            if o.run_s is None or o.run_s < durations[job] - 1.2:
                result.violations.append(f"job {job}: outcome of a run of {o.run_s} s, the job sleeps "
                                         f"{durations[job]} s (an outcome for a run that never happened?)")
            if o.profile.split(".")[0] != kind or o.count != want:
                result.violations.append(f"job {job}: outcome for {o.count} x {o.profile}, asked {gres}")
            out = dc.job_output(job)
            cvd = [ln[4:] for ln in out.splitlines() if ln.startswith("CVD=")]
            mig = [ln[4:] for ln in out.splitlines() if ln.startswith("MIG=")]
            uuids = [u for u in (cvd[-1] if cvd else "").split(",") if u]
            profiles = [m.split("@")[0] for m in (mig[-1] if mig else "").split(",") if m]
            if len(uuids) != want or not all(u.startswith("MIG-") for u in uuids):
                result.violations.append(f"job {job} ({gres}) ran with CUDA_VISIBLE_DEVICES={cvd[-1] if cvd else None}")
            elif len(profiles) != want or any(p.split(".")[0] != kind for p in profiles):
                result.violations.append(f"job {job} ({gres}) ran on {profiles}")
        # No two live jobs on the same or overlapping slices at any moment (the bindings table's history).
        brows = store._q("SELECT b.job_id, b.node, b.gpu, b.start, b.profile, b.bound_at, b.released_at, g.model "
                         "FROM bindings b LEFT JOIN gpus g ON g.node = b.node AND g.gpu = b.gpu "
                         "WHERE b.job_id IN (%s)" % ",".join("?" * len(ids)), list(ids))
        by_gpu: dict = {}
        for r in brows:
            by_gpu.setdefault((r["node"], r["gpu"]), []).append(r)
        for key, rs in by_gpu.items():
            model = get_model(rs[0]["model"] or "H100-80GB")
            for i, a in enumerate(rs):
                for b in rs[i + 1:]:
                    if a["job_id"] == b["job_id"] or not _overlaps(model, a, b):
                        continue
                    a_end = a["released_at"] or float("inf")
                    b_end = b["released_at"] or float("inf")
                    if a["bound_at"] < b_end - 1e-6 and b["bound_at"] < a_end - 1e-6:
                        result.violations.append(f"{key}: jobs {a['job_id']} ({a['profile']}@{a['start']}) and "
                                                 f"{b['job_id']} ({b['profile']}@{b['start']}) held overlapping "
                                                 f"slices at the same time")
        # The journal explains every step.
        for e in store._q("SELECT * FROM reconfig_journal WHERE id > ?", (first_journal,)):
            result.journal[e["state"]] += 1
            if e["state"] not in ("done", "failed", "abandoned"):
                result.violations.append(f"journal {e['id']} left {e['state']}")
            elif not json.loads(e["steps"] or "[]") and e["from_layout"] != e["to_layout"]:
                result.violations.append(f"journal {e['id']} ({e['from_layout']} -> {e['to_layout']}) has no steps")
            elif not (e["outcome"] or e["error"]):
                result.violations.append(f"journal {e['id']} {e['state']} without an outcome or error")
        result.reconfigurations = sum(result.journal.values())
        result.requeues = store._q("SELECT COUNT(*) AS n FROM events WHERE id > ? AND kind = 'requeue'",
                                   (first_event,))[0]["n"]
    finally:
        store.close()
    # Every requeue, whoever made it (a hook, the wrapper, the controller): slurmctld logs each one.
    try:
        ctld_log = (dc.cluster.state_dir / "log" / "slurmctld.log").read_text(errors="replace")
    except OSError:
        ctld_log = ""
    requeued = re.findall(r"Requeuing JobId=(\d+)", ctld_log)
    result.requeues = max(result.requeues, sum(1 for j in requeued if j in ids))


def summarise(results: list[SeedResult]) -> dict:
    kills = Counter()
    for r in results:
        kills.update(r.kills)
    failed = [r for r in results if not r.ok]
    return {
        "seeds": len(results), "seeds_passed": len(results) - len(failed), "jobs": sum(r.jobs for r in results),
        "kills": dict(sorted(kills.items())), "kills_total": sum(kills.values()),
        "faults_survived": sum(sum(r.kills.values()) for r in results if r.ok),
        "drains_resumed": sum(r.drains_resumed for r in results),
        "registration_drains": sum(r.registration_drains for r in results),
        "held_jobs_released": sum(r.held_released for r in results),
        "requeues": sum(r.requeues for r in results),
        "reconfigurations": sum(r.reconfigurations for r in results),
        "journal": dict(sum((r.journal for r in results), Counter())),
        "violations": [f"seed {r.seed}: {v}" for r in results for v in r.violations],
        "seconds": round(sum(r.seconds for r in results), 1),
    }


def keep_evidence(dc, seed: int) -> Path:
    """Copy what a seed with violations leaves (the hooks' and controller's logs, Slurm's, the simulated GPUs, the
    nodes' binding records and outboxes, the state database) to ``<state>/evidence/seed-<seed>``, before the next seed
    runs on the same cluster and a later run of the harness writes over the logs: on 2026-11-27 one seed left an
    instance marked busy on a fresh machine, and what would have said why was gone by the time it was looked at.
    Later seeds of the run share the cluster, so a leftover of this one may show as theirs. Returns the folder."""
    import shutil
    import sqlite3

    dest = Path(dc.state) / "evidence" / f"seed-{seed}"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True, mode=0o700)
    # slurm/log: slurmctld's and each slurmd's log (requeues, a Prolog or Epilog that failed or was killed)
    for name in ("log", "gpus", "node", "slurm/log"):
        src = Path(dc.state) / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore_dangling_symlinks=True)
    db = Path(dc.state) / "state.db"
    if db.is_file():
        # SQLite's backup, not a file copy: the controller may be writing it (WAL), and a copy of the file alone
        # would miss what the WAL holds
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as src, sqlite3.connect(dest / "state.db") as out:
            src.backup(out)
    return dest


def fresh_node_state(dc: DemoCluster) -> None:
    """Remove the nodes' binding files and outboxes a previous run left (DemoCluster keeps them)."""
    import shutil

    shutil.rmtree(dc.state / "node", ignore_errors=True)


def make_cluster(state_dir: str | os.PathLike, delay_scale: float = 1.0) -> DemoCluster:
    """The demo cluster as `slurm-mig demo` runs it: 3 nodes, 2 simulated H100s each (3g+2g+1g at boot)."""
    return DemoCluster(state_dir, nodes=3, gpus_per_node=2, tick_s=1.0, agent_s=1.0, delay_scale=delay_scale)


def _restore_registration_drains(dc: DemoCluster, result: SeedResult) -> None:
    """Bring back a node Slurm drained when its slurmd re-registered with slurm.conf's mig count.

    Not a crash-safety matter: slurmd re-registers every ~20 pings, and Slurm drains the node
    (DRAIN+INVALID_REG, which RESUME does not clear) when the count it reports differs from the one set
    at run time while jobs hold mig instances (docs/reliability.md). The harness counts these apart and
    recovers the node the way an admin would: Gres= back to slurm.conf's value, slurmd restarted (a
    registration that matches), RESUME; the controller then re-asserts its counts.
    """
    for n in dc.cluster.client().scontrol_show_nodes() or []:
        if n.name not in dc.nodes or "INVALID_REG" not in n.flags:
            continue
        result.registration_drains += 1
        result.kill_log.append(f"registration drain of {n.name}: {n.reason}")
        # The controller would set its own counts again within a tick, before slurmd has registered.
        ctl = dc.procs.get("controller")
        if ctl is not None and ctl.poll() is None:
            os.kill(ctl.pid, signal.SIGSTOP)
        try:
            value = dc.cluster.conf_gres(n.name)
            subprocess.run(["scontrol", "update", f"NodeName={n.name}", f"Gres={value}"], env=dc.env(),
                           capture_output=True, timeout=30)
            pid = dc.cluster._read_pid(f"slurmd-{n.name}")
            if pid:
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    if dc.cluster._read_pid(f"slurmd-{n.name}") is None:
                        break
                    time.sleep(0.1)
            dc.cluster._start_slurmd(n.name)
            time.sleep(3)
            subprocess.run(["scontrol", "update", f"NodeName={n.name}", "State=RESUME"], env=dc.env(),
                           capture_output=True, timeout=30)
        finally:
            if ctl is not None and ctl.poll() is None:
                os.kill(ctl.pid, signal.SIGCONT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=8, help="jobs per seed")
    p.add_argument("--delay-scale", type=float, default=1.0,
                   help="x NVIDIA's measured create/destroy times on the simulated GPUs")
    p.add_argument("--wrapper-kills", action="store_true", help="also SIGKILL the /bin/sh Prolog wrapper "
                   "(Slurm drains such a node; the harness resumes it and counts it)")
    p.add_argument("--state", default="/tmp/slurm-mig-crash", help="cluster state folder (short: munge socket)")
    p.add_argument("--json", help="write the summary and per-seed results here")
    p.add_argument("-v", "--verbose", action="store_true", help="print every kill")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the cluster on the way out
    dc = make_cluster(args.state, args.delay_scale)
    results = []
    fresh_node_state(dc)
    dc.start()
    try:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            r = run_seed(dc, seed, n_jobs=args.jobs, wrapper_kills=args.wrapper_kills)
            results.append(r)
            print(f"seed {seed}: {r.jobs} jobs, kills {dict(r.kills)}, {r.reconfigurations} reconfigurations, "
                  f"{r.requeues} requeues, {r.drains_resumed} drains resumed, {r.registration_drains} "
                  f"registration drains, {r.seconds} s: "
                  f"{'ok' if r.ok else 'VIOLATIONS'}", flush=True)
            if args.verbose or not r.ok:
                for line in r.kill_log:
                    print("   ", line)
            for v in r.violations:
                print("    !", v, flush=True)
            if not r.ok:
                print(f"    evidence kept in {keep_evidence(dc, seed)} (later seeds share this cluster: a leftover of "
                      f"this one may show as theirs)", flush=True)
    finally:
        dc.stop()
    summary = summarise(results)
    print(json.dumps({k: v for k, v in summary.items() if k != "violations"}, indent=1))
    print(f"{summary['seeds_passed']}/{summary['seeds']} seeds passed, {summary['kills_total']} kills, "
          f"{summary['faults_survived']} survived, {len(summary['violations'])} violations")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "seeds": [
            {"seed": r.seed, "jobs": r.jobs, "kills": dict(r.kills), "kill_log": r.kill_log,
             "drains_resumed": r.drains_resumed, "registration_drains": r.registration_drains,
             "held_released": r.held_released, "requeues": r.requeues,
             "journal": dict(r.journal), "violations": r.violations, "seconds": r.seconds} for r in results]},
            indent=1))
    return 0 if not summary["violations"] else 1


if __name__ == "__main__":
    sys.exit(main())
