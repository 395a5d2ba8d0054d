"""`slurm-mig explain JOBID --replay`: the job's surroundings replayed in the simulator.

The jobs that were in the system while JOBID waited (from the state database: submit time,
profile, count, the run time they really had or their time limit) are played by the discrete-event
simulator with the configured policy, on a cluster of the same size, model and (most common)
starting layout; on a site of several GPU models, a node group per model, each starting with its own
most common layout, as `simulate --db` replays it (slurm_mig.sim.workloads.replay_site). The answer
is the simulated wait and placement next to the real ones, the policy's waiting reason, and the
simulator's timeline of the GPU the job ran on: a picture of what the policy does with that queue,
without Slurm, hooks or NVML in the way.

It is an approximation (one starting layout for every GPU of a model, node names n00, n01, ... or
<group>-00, ... mapped onto the real ones of that model in name order), stated as such in the output.
"""

from __future__ import annotations

import math
import time
from collections import Counter

from slurm_mig.errors import SlurmMigError


# The longest wait a replay plays, and the longest any job runs in it: times beyond (1e300, a huge
# integer: a row a person or a bug wrote) would leave the simulator's clock where adding a second to it
# changes nothing, and it would never finish.
REPLAY_MAX_S = 366 * 86400.0


def _usable(*times) -> bool:
    """Every one of ``times`` (None: not known) a finite number within the replay's reach of the others (not
    text or a blob, which SQLite keeps in a time column as given)."""
    from slurm_mig.ops.fmt import is_number

    known = [t for t in times if t is not None]
    return all(is_number(t) and math.isfinite(t) for t in known) and (
        not known or max(known) - min(known) <= 10 * REPLAY_MAX_S)


def _limit(job) -> float | None:
    """The job's time limit where a replay can use it: a number of seconds under 7 days."""
    t = job.time_limit_s
    return float(t) if t and _usable(t) and t < 7 * 86400 else None


def _duration(job, now: float) -> float:
    if job.start_time is not None:
        end = job.end_time if job.end_time is not None else now
        return max(0.1, job.run_time(job.start_time, end))  # not the time it was suspended
    limit = _limit(job)
    return limit if limit is not None else 60.0


def _mixed_site(store):
    """The site's node groups (slurm_mig.sim.workloads.replay_site: a group per GPU model, the partitions
    they are where the outcomes show it) when the state DB records MIG GPUs of more than one model the
    policy places on; None on a site of one model (replayed on it as before) or where the DB cannot say."""
    from slurm_mig.errors import ConfigError
    from slurm_mig.sim.workloads import replay_site

    try:
        site = replay_site(store.path, "explain --replay", "replay the job's window")
    except (ConfigError, OSError, TypeError):
        return None
    return site if site.spec.groups else None


def _canonical(name) -> str:
    """A recorded model name as get_model names it; the name itself where no model has it."""
    from slurm_mig.errors import GeometryError
    from slurm_mig.mig.profiles import get_model

    try:
        return get_model(str(name)).name
    except GeometryError:
        return name


def _initial_layout(store, gpus, seen, same_model) -> str:
    """The most common layout of the GPUs whose model ``same_model`` accepts: in ``seen`` (the GPUs of the
    first decision in the window, as the policy saw them) if it lists any GPU, else as observed now; "" for
    none or empty."""
    layouts = Counter(str(store.observed_layout(g.node, g.gpu)) for g in gpus if same_model(g.model) and g.mig_enabled)
    if seen:
        layouts = Counter(g.get("layout") or "" for g in seen if same_model(g.get("model")))
    initial = layouts.most_common(1)[0][0] if layouts else ""
    return "" if initial == "empty" else initial


def replay_job(store, job_id: str, *, policy: str = "first-fit", now: float | None = None) -> dict:
    """Replay JOBID's window in the simulator; a dict for replay_lines() (``{"error": ...}`` if impossible)."""
    now = time.time() if now is None else now
    try:
        from slurm_mig.policies import get_policy
        from slurm_mig.sim.engine import ClusterSpec, SimConfig, Simulator
        from slurm_mig.sim.workloads import SPEED_MODELS, Job, Workload, _kind_on, replay_partition
    except Exception as exc:  # the simulator is optional at run time
        return {"error": f"the simulator is not available here: {exc}"}
    job = store.get_job(str(job_id))
    if job is None:
        return {"error": f"no record of job {job_id}"}
    t_lo = job.submit_time
    t_hi = job.start_time if job.start_time is not None else now
    if not _usable(t_lo, t_hi) or t_hi - t_lo > REPLAY_MAX_S:
        from slurm_mig.ops.fmt import fmt_when

        started = f"started {fmt_when(t_hi, now)}" if job.start_time is not None else "not started"
        return {"error": f"job {job_id} (submitted {fmt_when(t_lo, now)}, {started}): not times a replay can use "
                         f"(it plays waits of at most {REPLAY_MAX_S / 86400:.0f} days)"}
    # A job whose times are not real ones (1e300, infinity, text) is left out: it cannot be played.
    others = [j for j in store.jobs() if _usable(j.submit_time, j.start_time, j.end_time)
              and j.submit_time is not None and j.submit_time <= t_hi
              and (j.end_time is None or j.end_time >= t_lo)
              # Cancelled while pending, it held nothing; cancelled while running (Slurm's end state now
              # replaces the Epilog's COMPLETED), it held its instances like any other run.
              and not (j.state == "CANCELLED" and j.start_time is None)
              # Held, waiting on a dependency, ...: not demand (the policy does not see it either).
              and not (j.state == "PENDING" and j.blocked and j.job_id != job.job_id)]
    gpus = store.observed_gpus()
    from slurm_mig.ops.views import _rows

    first = _rows(store, "SELECT inputs FROM decisions WHERE time >= ? AND shadow = 0 ORDER BY id LIMIT 1",
                  (t_lo - 1,))
    seen = []
    if first:
        from slurm_mig.store.models import loads

        seen = (loads(first[0]["inputs"], {}) or {}).get("gpus") or []
    site = _mixed_site(store)
    if site is None:
        models = Counter(g.model for g in gpus if g.model and g.mig_enabled)
        if not models:
            return {"error": "no MIG GPUs are recorded, so there is no cluster to replay on"}
        model = models.most_common(1)[0][0]
        by_node: dict[str, int] = {}
        for g in gpus:
            if g.model == model and g.mig_enabled:
                by_node[g.node] = by_node.get(g.node, 0) + 1
        real_nodes = sorted(by_node)
        initial = _initial_layout(store, gpus, seen, lambda m: m == model)
        spec = ClusterSpec(nodes=len(real_nodes), gpus_per_node=max(by_node.values()), model=model,
                           initial_layout=initial)
        site_models = None
    else:
        # A site of several GPU models: a node group per model, as `simulate --db` replays it (replay_site),
        # each group starting with its own most common layout.
        from dataclasses import replace

        from slurm_mig.mig.profiles import get_model

        spec = ClusterSpec.mixed([replace(g, initial_layout=_initial_layout(
            store, gpus, seen, lambda m, model=g.model: _canonical(m) == model)) for g in site.spec.groups])
        model = spec.model
        real_nodes = [n for group in site.nodes for n in group]
        initial = " + ".join(g.initial_layout or "empty" for g in spec.groups)
        site_models = [get_model(g.model) for g in spec.groups]
    sim_jobs = []
    for j in others:
        running_before = j.start_time is not None and j.start_time < t_lo
        dur = _duration(j, now)
        if running_before:
            dur = max(0.1, dur - (t_lo - j.start_time))
        dur = min(dur, REPLAY_MAX_S)
        sub = 0.0 if running_before else max(0.0, j.submit_time - t_lo)
        profile, part = j.profile, ""
        if site_models is not None:
            # Its size on the first model that has the profile (a size none has stays as recorded: the
            # replay's reason then says no node can hold it); its partition where the groups are partitions.
            kind = _kind_on(site_models, j.profile)
            if kind is not None:
                profile, part = kind, replay_partition(site.partitions, j.partition, kind)
        sim_jobs.append(Job(j.job_id, sub, profile, j.count, dur,
                            time_limit_s=_limit(j),
                            speed=SPEED_MODELS["flat"], priority=1 if running_before else 0, partition=part))
    wl = Workload(f"replay of job {job_id}", sim_jobs, model=model)
    try:
        pol = get_policy(policy)
        if site_models is not None and getattr(pol, "whole_gpu", False):
            # The simulator turns each request into whole GPUs of one size, which a site of several models has
            # in more than one (simulate --db refuses it too, and bench leaves it out of a mixed site).
            from slurm_mig.policies.static import whole_profile

            sizes = ", ".join(f"a {whole_profile(m).kind} on {m.name}" for m in site_models)
            return {"error": f"policy {pol.name} is not replayed on a site of several GPU models: it gives every job "
                             f"whole GPUs ({sizes}), so no one size for a job to ask for"}
        # Only this job's waiting reason is shown: the policy is asked for no other.
        result = Simulator(wl, pol, spec, SimConfig(record=True, explain_jobs=frozenset({str(job_id)}))).run()
    except (SlurmMigError, Exception) as exc:  # noqa: BLE001 - report, do not crash explain
        return {"error": f"the replay failed: {type(exc).__name__}: {exc}"}
    if site is None:
        names = {spec.node_name(i): real for i, real in enumerate(real_nodes)}
    else:
        names = {node: real for (node, *_rest), real in zip(spec.node_list(), real_nodes)}
    rec = next((r for r in result.jobs if r.job.job_id == str(job_id)), None)
    out = {
        "job_id": str(job_id), "policy": result.policy, "jobs": len(sim_jobs), "model": model, "nodes": len(real_nodes),
        "gpus_per_node": spec.gpus_per_node, "initial_layout": initial or "empty", "t0": t_lo,
        "node_names": names, "real_wait_s": None if job.start_time is None else job.start_time - job.submit_time,
        "sim_wait_s": None, "sim_node": None, "sim_instances": [], "sim_reason": result.waiting_reasons.get(str(job_id)),
        "reconfigurations": result.reconfigurations, "timeline": None,
    }
    if site is not None:
        out["groups"] = [{"name": g.name, "model": g.model, "nodes": g.nodes, "gpus_per_node": g.gpus_per_node,
                          "initial_layout": g.initial_layout or "empty"} for g in spec.groups]
        out["partitions_kept"] = bool(site.partitions)
        out["partitions_why"] = site.partitions_why
    if rec is not None and rec.start != float("inf"):
        out["sim_wait_s"] = rec.start - rec.job.submit_time
        out["sim_node"] = rec.node
        out["sim_instances"] = [[gi, str(s)] for gi, s in rec.instances]
        keys = {f"{rec.node}/{gi}" for gi, _ in rec.instances}
        segs = [s for s in result.timeline if s.gpu in keys]
        t1 = max([s.t1 for s in segs if s.t1 != float("inf")] + [rec.end if rec.end != float("inf") else rec.start])
        out["timeline"] = {"t0": 0.0, "t1": max(t1, rec.start + 1.0), "submit": rec.job.submit_time,
                           "start": rec.start,
                           "segments": [{"gpu": s.gpu, "kind": s.kind, "slot": str(s.slot), "t0": s.t0,
                                         "t1": min(s.t1, t1), "job_id": s.job_id} for s in segs]}
    return out


def replay_lines(rep: dict, width: int = 100) -> list[str]:
    from slurm_mig.ops import render as R
    from slurm_mig.ops.fmt import fmt_duration

    if rep.get("error"):
        return [f"Replay: {rep['error']}"]
    if rep.get("groups"):  # a site of several GPU models: a node group each
        kept = rep.get("partitions_kept")
        groups = " + ".join(f"{g['nodes']} x {g['gpus_per_node']} {g['model']}"
                            + (f" (partition {g['name']})" if kept else "") + f" starting as {g['initial_layout']}"
                            for g in rep["groups"])
        out = [f"Replay in the simulator (approximate: {rep['jobs']} jobs of that window, {groups}, "
               f"policy {rep['policy']}):",
               "  the site's GPU models, a node group each; "
               + ("jobs keep their partition" if kept else "a job runs on any group whose model has its size")
               + (f" ({rep['partitions_why']})" if rep.get("partitions_why") else "")]
    else:
        out = [f"Replay in the simulator (approximate: {rep['jobs']} jobs of that window, {rep['nodes']} x "
               f"{rep['gpus_per_node']} {rep['model']} all starting as {rep['initial_layout']}, "
               f"policy {rep['policy']}):"]
    real = fmt_duration(rep["real_wait_s"]) if rep["real_wait_s"] is not None else "not started yet"
    if rep["sim_wait_s"] is None:
        out.append(f"  in the replay the job never started (real wait: {real})")
    else:
        node = rep["sim_node"]
        real_name = rep["node_names"].get(node, "?")
        inst = ", ".join(f"GPU {gi} {s}" for gi, s in rep["sim_instances"])
        out.append(f"  simulated wait {fmt_duration(rep['sim_wait_s'])} (real wait: {real}); placed on {node} "
                   f"(= {real_name}) {inst}; {rep['reconfigurations']} reconfigurations in the replay")
    if rep.get("sim_reason"):
        out.append(f"  last waiting reason in the replay: {rep['sim_reason']}")
    tl = rep.get("timeline")
    if tl and tl["segments"]:
        out.append("  Simulated timeline (seconds from the job's submission):")
        t0 = rep["t0"]
        segs = [{**s, "t0": s["t0"] + t0, "t1": s["t1"] + t0} for s in tl["segments"]]
        for line in R.render_timeline(segs, tl["t0"] + t0, tl["t1"] + t0, width - 4, job_id=rep.get("job_id"),
                                      submit=tl["submit"] + t0, start=tl["start"] + t0):
            out.append("    " + line)
    return out
