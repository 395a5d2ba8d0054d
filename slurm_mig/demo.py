"""`slurm-mig demo`: the whole system on localhost, end to end, in about a minute.

Brings up a real Slurm cluster (3 nodes x 2 simulated H100-80GB by default) with slurm-mig's hooks,
starts the controller and node agents, submits a mixed burst of `--gres=mig:...` jobs that cannot all
fit the starting layouts, shows live progress, prints a summary and leaves nothing running.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import time

from slurm_mig.argtypes import at_least, seconds
from slurm_mig.terminal import stdout_is_a_terminal


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the local demo cluster end to end (real Slurm, simulated MIG GPUs)")
    p.add_argument("--jobs", type=at_least(1), default=24, help="how many jobs to submit (default 24)")
    p.add_argument("--nodes", type=at_least(1), default=3, help="nodes (default 3)")
    p.add_argument("--gpus", type=at_least(1), default=2, help="simulated H100-80GB GPUs per node (default 2)")
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument("--policy", default="frag-aware", help="controller policy (default frag-aware)")
    p.add_argument("--state-dir", help="where the demo keeps its files (default .run/demo); it deletes the state DB "
                                       "there on every start, so it refuses a directory holding one it did not create")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (no live view)")
    p.add_argument("--timeout", type=seconds(0.0, more_than=True), default=600, help="give up after this many seconds")
    p.set_defaults(func=_run)


MIX = [("mig:1g", 6), ("mig:2g", 4), ("mig:3g", 4), ("mig:4g", 2), ("mig:7g", 3), ("mig:1g:2", 2),
       ("mig:3g.40gb", 1), ("mig:1g.20gb", 1)]


def workload(n: int, seed: int) -> list[tuple[str, float]]:
    """A mixed burst: (gres, seconds) pairs, weighted so that big and small slices compete."""
    rng = random.Random(seed)
    choices = [g for g, w in MIX for _ in range(w)]
    return [(rng.choice(choices), round(rng.uniform(3, 9), 1)) for _ in range(n)]


def summarize(dc, ids: list[str], t0: float, t_end: float) -> dict:
    """What happened, from the controller's own records."""
    store = dc.store()
    outcomes = {o.job_id: o for o in store.outcomes()}
    waits = [outcomes[j].wait_s for j in ids if j in outcomes and outcomes[j].wait_s is not None]
    journal = store.journal_entries(limit=10_000)
    events = store.recent_events(10_000)
    done = [e for e in journal if e.state == "done" and e.steps]
    jobs_out = []
    for j in ids:
        o = outcomes.get(j)
        out = dc.job_output(j)
        cvd = next((line[4:] for line in out.splitlines() if line.startswith("CVD=")), "")
        jobs_out.append({"job_id": j, "profile": o.profile if o else None, "node": o.node if o else None,
                         "state": o.state if o else "MISSING", "wait_s": None if not o else o.wait_s,
                         "cuda_visible_devices": cvd})
    lat = prolog_latencies(dc.state / "log" / "slurm-mig.log")
    plain = sorted(ms for ms, reconf in lat if not reconf)
    carved = sorted(ms for ms, reconf in lat if reconf)
    return {
        "prolog_median_ms": round(plain[len(plain) // 2], 1) if plain else None,
        "prolog_median_ms_with_reconfiguration": round(carved[len(carved) // 2], 1) if carved else None,
        "prolog_samples": len(lat),
        "jobs": len(ids),
        "completed": sum(1 for j in jobs_out if j["state"] == "COMPLETED"),
        "all_saw_mig_uuid": all(j["cuda_visible_devices"].startswith("MIG-") for j in jobs_out),
        "mean_wait_s": round(sum(waits) / len(waits), 2) if waits else None,
        "max_wait_s": round(max(waits), 2) if waits else None,
        "reconfigurations": len(done),
        "reconfiguration_steps": sum(len(e.steps) for e in done),
        "requeues": sum(1 for e in events if e.kind == "requeue"),
        "wall_s": round(t_end - t0, 1),
        "job_list": jobs_out,
    }


def prolog_latencies(log_path) -> list[tuple[float, bool]]:
    """(milliseconds, reconfigured) for every Prolog that bound a job, from the hooks' log lines."""
    import re

    pat = re.compile(r"prolog job \S+ bound \S+ in ([0-9.]+) ms \(reconfigured=(True|False)\)")
    out = []
    try:
        with open(log_path, errors="replace") as fh:
            for line in fh:
                m = pat.search(line)
                if m:
                    out.append((float(m.group(1)), m.group(2) == "True"))
    except OSError:
        pass
    return out


def _live_view(dc, ids, t0):
    from rich.table import Table

    def render(jobs):
        states: dict[str, int] = {}
        mine = {str(j.job_id): j for j in (jobs or [])}
        for j in ids:
            s = mine[j].state if j in mine else "DONE"
            states[s] = states.get(s, 0) + 1
        t = Table(title=f"slurm-mig demo: {len(ids)} jobs, {time.time() - t0:.0f}s", expand=False)
        t.add_column("node/gpu")
        t.add_column("MIG layout (busy instances marked *)")
        for n in dc.nodes:
            insts = dc.sim_instances(n)
            by_gpu: dict[int, list] = {}
            for i in insts.values():
                by_gpu.setdefault(i["gpu"], []).append(i)
            for g in range(dc.gpus_per_node):
                parts = [f"{i['profile'].split('.')[0]}@{i['start']}{'*' if i['in_use'] else ''}"
                         for i in sorted(by_gpu.get(g, []), key=lambda x: x["start"])]
                t.add_row(f"{n}/{g}", " ".join(parts) or "(empty)")
        t.caption = "  ".join(f"{k}: {v}" for k, v in sorted(states.items()))
        return t

    return render


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _run(args: argparse.Namespace) -> int:
    from slurm_mig.democluster import DemoCluster

    dc = DemoCluster(args.state_dir, nodes=args.nodes, gpus_per_node=args.gpus, policy=args.policy)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    t0 = time.time()
    # `kill`, a CI timeout or a closed terminal must stop the cluster, controller and agents as Ctrl-C does:
    # Python's default handlers would end the process without running the finally below.
    old_handlers = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        say("starting a local Slurm cluster with simulated MIG GPUs ...")
        dc.start()
        say(f"cluster up in {time.time() - t0:.1f}s; controller on port {dc.port}; submitting {args.jobs} jobs")
        ids = [dc.sbatch(g, s, name=f"demo-{g.split(':', 1)[1]}") for g, s in workload(args.jobs, args.seed)]
        if args.json or not stdout_is_a_terminal():
            ok = dc.wait_jobs(ids, timeout=args.timeout)
        else:
            from rich.live import Live

            render = _live_view(dc, ids, t0)
            with Live(render([]), refresh_per_second=2, transient=False) as live:
                ok = dc.wait_jobs(ids, timeout=args.timeout, progress=lambda jobs: live.update(render(jobs)))
        time.sleep(1.5)  # let the last epilogs reach the controller
        summary = summarize(dc, ids, t0, time.time())
        summary["finished_in_time"] = ok
    finally:
        for sig in old_handlers:
            signal.signal(sig, signal.SIG_IGN)  # a second `kill` must not cut the clean-up short
        try:
            dc.stop()
        finally:
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
    if args.json:
        print(json.dumps(summary))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="slurm-mig demo summary")
        t.add_column("job")
        t.add_column("asked")
        t.add_column("node")
        t.add_column("state")
        t.add_column("wait s", justify="right")
        t.add_column("CUDA_VISIBLE_DEVICES")
        for j in summary["job_list"]:
            t.add_row(j["job_id"], j["profile"] or "?", j["node"] or "-", j["state"],
                      "-" if j["wait_s"] is None else f"{j['wait_s']:.1f}", j["cuda_visible_devices"][:40])
        Console().print(t)
        print(f"{summary['completed']}/{summary['jobs']} jobs completed, every one on its own MIG instance: "
              f"{summary['all_saw_mig_uuid']}; mean wait {summary['mean_wait_s']}s, max {summary['max_wait_s']}s; "
              f"{summary['reconfigurations']} reconfigurations ({summary['reconfiguration_steps']} NVML steps), "
              f"{summary['requeues']} requeues; {summary['wall_s']}s in all. Nothing left running.")
        print(f"Prolog wall time, median over {summary['prolog_samples']} jobs: {summary['prolog_median_ms']} ms "
              f"without a reconfiguration, {summary['prolog_median_ms_with_reconfiguration']} ms with one.")
    return 0 if summary["completed"] == summary["jobs"] and ok else 1
