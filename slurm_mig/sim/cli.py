"""`slurm-mig bench` and `slurm-mig simulate`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from slurm_mig.argtypes import at_least, number
from slurm_mig.errors import ConfigError
from slurm_mig.terminal import stdout_is_a_terminal

#: --from / --to of a --plot: simulated hours from the start, finite (nan or inf failed in matplotlib after the
#: whole simulation had run); a million hours is past any trace's span.
PLOT_HOURS = number(0.0, 1e6, unit="hours")

SYNTHETIC = ("poisson-mix", "small-heavy", "rl-good_scaling", "rl-bad_scaling", "rl-mix_extreme", "rl-mix_soft",
             "rl-wide_times", "miso-models", "mixed-site")


def register(subparsers) -> None:
    b = subparsers.add_parser(
        "bench", help="every policy on a fixed set of workloads (and traces) vs baselines and lower bounds",
        description="Run every policy on the fixed synthetic workloads plus each --trace (without --trace: "
                    "../shared/traces/alibaba-v2023-train.csv when it exists) and print a table with ratios "
                    "to the best baseline and to the lower bounds. --speed runs the speed benchmarks instead.")
    b.add_argument("--trace", action="append", default=[], metavar="PATH",
                   help="an Alibaba cluster-trace-gpu-v2023 pod list (CSV); repeatable")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    b.add_argument("--speed", action="store_true",
                   help="run the speed benchmarks (100k jobs on 1,000 GPUs; a decision over 10k jobs x 8k GPUs)")
    b.add_argument("--nodes", type=at_least(1), default=None, help="nodes of 8 GPUs for trace workloads (default 5)")
    b.add_argument("--no-synthetic", action="store_true", help="only the traces (and any --workload)")
    b.add_argument("--workload", action="append", default=[], metavar="NAME",
                   help="also run this workload, which bench leaves out unless named: mixed-site (H100-80GB and "
                        "A30-24GB nodes, a partition each); repeatable")
    b.add_argument("--policies", default=None, help="comma-separated subset of policies")
    b.add_argument("--verbose", "-v", action="store_true", help="log each simulation to stderr")
    b.set_defaults(func=cmd_bench)

    s = subparsers.add_parser(
        "simulate", help="replay a trace or workload under one policy; optional timeline picture",
        description="Simulate one workload under one policy and print its metrics beside the lower bounds. "
                    "--plot draws each GPU's instances, jobs and reconfigurations over time.")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="PATH", help="an Alibaba cluster-trace-gpu-v2023 pod list (CSV)")
    src.add_argument("--db", metavar="PATH", help="replay the outcomes recorded in a slurm-mig state DB")
    src.add_argument("--workload", choices=SYNTHETIC,
                     help="a synthetic workload; mixed-site is bench's two-model site (2 x 8 H100-80GB, partition "
                          "h100, beside 2 x 8 A30-24GB, partition a30; --seed 6 is bench's), on its own cluster: "
                          "--nodes, --gpus-per-node and --model do not apply to it")
    s.add_argument("--policy", default="frag-aware", help="policy name (see `slurm-mig bench`); best-static "
                                                          "searches a static plan first")
    s.add_argument("--nodes", type=at_least(1), default=None,
                   help="nodes (default: 5 for traces, 2 for synthetic, the DB's MIG nodes for --db; a DB that "
                        "records no MIG GPU is refused unless --model, --nodes and --gpus-per-node are given)")
    s.add_argument("--gpus-per-node", type=at_least(1), default=None,
                   help="GPUs per node (default 8; for --db the most MIG GPUs the DB saw on one node)")
    s.add_argument("--model", default=None,
                   help="GPU model (default H100-80GB; for --db the model of most MIG GPUs the DB saw)")
    s.add_argument("--speed-model", default="miso-mean",
                   help="per-size slowdown vs 7g: miso-mean (default), flat, linear, miso:<model>")
    s.add_argument("--milli-map", default=None, help="gpu_milli -> profile, e.g. 1g:142,2g:285,3g:428,4g:571,7g:1000")
    s.add_argument("--no-time-limits", action="store_true", help="jobs carry no --time estimate")
    s.add_argument("--seed", type=int, default=0, help="seed for synthetic time limits / workloads")
    s.add_argument("--jobs", type=at_least(1), default=2000, help="jobs in a synthetic workload")
    s.add_argument("--check", action="store_true", help="check every decision with check_decision()")
    s.add_argument("--json", action="store_true", help="print metrics as JSON")
    s.add_argument("--plot", metavar="PNG", help="write a timeline picture (needs matplotlib: pip install slurm-mig[plot])")
    s.add_argument("--from", dest="t_from", type=PLOT_HOURS, default=None, metavar="HOURS", help="plot from this time")
    s.add_argument("--to", dest="t_to", type=PLOT_HOURS, default=None, metavar="HOURS", help="plot up to this time")
    s.add_argument("--max-gpus", type=at_least(1), default=48, help="GPUs drawn at most (default 48)")
    s.add_argument("--job", metavar="JOB_ID", help="explain this job: when it came, waited, ran, and why it waited")
    s.set_defaults(func=cmd_simulate)


# ---------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------


NA = "n/a"  # a figure over the jobs that ran, where none did (Metrics: None)


def _fmt_s(v: float | None) -> str:
    if v is None:
        return NA
    if isinstance(v, float) and math.isnan(v):
        return "-"
    if v >= 86400 * 2:
        return f"{v / 86400:.1f} d"
    if v >= 3600 * 2:
        return f"{v / 3600:.1f} h"
    if v >= 120:
        return f"{v / 60:.1f} m"
    return f"{v:.0f} s"


def _ratio(a: float | None, b: float) -> str:
    if a is None:
        return NA
    if b and b > 0 and not math.isnan(b):
        return f"{a / b:.2f}"
    return "-" if a else "1.00"


def cmd_bench(args: argparse.Namespace) -> int:
    from slurm_mig.sim import bench

    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.verbose else None
    if args.speed:
        return _speed(args)
    policies = tuple(p.strip() for p in args.policies.split(",")) if args.policies else bench.POLICIES
    for t in args.trace:
        if not Path(t).is_file():
            raise ConfigError(f"trace {t} does not exist")
    for name in args.workload:
        if name not in bench.EXTRA_WORKLOADS:
            raise ConfigError(f"unknown bench workload {name!r} (known: {', '.join(bench.EXTRA_WORKLOADS)})")
    reports = bench.run_bench(args.trace, synthetic=not args.no_synthetic, policies=policies,
                              nodes=args.nodes or bench.ALIBABA_NODES, log=log, workloads=args.workload)
    if args.json:
        print(json.dumps(bench.bench_json(reports), indent=None if not stdout_is_a_terminal() else 2))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if stdout_is_a_terminal() else 150)
    for rep in reports:
        t = Table(title=f"{rep.name}: {rep.jobs} jobs on {rep.spec.gpus} x {rep.spec.model} "
                        f"({rep.spec.nodes} nodes)", title_justify="left")
        for col in ("policy", "mean wait", "÷best base", "p95 wait", "mean JCT", "÷bound", "bsld",
                    "makespan", "÷bound", "util", "reconf"):
            t.add_column(col, justify="left" if col == "policy" else "right")
        best_wait = rep.best_baseline("mean_wait_s")
        best_wait_policy = min((m for m in rep.results if m.policy in bench.BASELINES and m.mean_wait_s is not None),
                               key=lambda m: m.mean_wait_s, default=None)
        for m in rep.results:
            style = "bold green" if m.policy == "frag-aware" else None
            t.add_row(m.policy, _fmt_s(m.mean_wait_s), _ratio(m.mean_wait_s, best_wait), _fmt_s(m.p95_wait_s),
                      _fmt_s(m.mean_jct_s), _ratio(m.mean_jct_s, rep.bounds.mean_jct_s), _fmt_bsld(m.bounded_slowdown),
                      _fmt_s(m.makespan_s), _ratio(m.makespan_s, rep.bounds.makespan_s), f"{m.utilization:.1%}",
                      str(m.reconfigurations), style=style)
        t.add_row("lower bound", "0 s", "", "0 s", _fmt_s(rep.bounds.mean_jct_s), "1.00", "1.00",
                  _fmt_s(rep.bounds.makespan_s), "1.00", "", "", style="dim")
        con.print(t)
        if best_wait_policy is not None:
            con.print(f"  best baseline by mean wait: {best_wait_policy.policy}; "
                      f"static plan: {rep.notes.get('best_static_plan', '-')}", style="dim")
        if rep.notes.get("skipped"):
            con.print(f"  trace rows skipped: {rep.notes['skipped']}", style="dim")
        for pol, why in rep.notes.get("not_run", {}).items():
            con.print(f"  {pol} not run: {why}", style="dim")
        if rep.spec.groups:
            con.print("  partitions: " + ", ".join(f"{g.name} = {g.nodes} x {g.gpus_per_node} {g.model}"
                                                   for g in rep.spec.groups), style="dim")
        for pol, why in rep.notes.get("stopped", {}).items():
            con.print(f"  {pol}: simulation cut short ({why}, the safety limit): its figures are of what had "
                      f"happened by then", style="yellow")
        for m in rep.results:
            if m.finished < rep.jobs:
                # Its times average only the jobs that ran: fewer, so they may look better than they are.
                con.print(f"  {m.policy}: {rep.jobs - m.finished} of {rep.jobs} jobs never ran; its times are over "
                          f"the {m.finished} that did", style="yellow")
        con.print()
    return 0


def _speed(args: argparse.Namespace) -> int:
    from slurm_mig.sim import speed

    results = []
    print("speed: 100,000 jobs on 1,000 GPUs, greedy (target < 60 s) ...", file=sys.stderr, flush=True)
    results.append(speed.simulate_speed())
    st = speed.big_state()
    for pol in ("greedy", "frag-aware"):
        print(f"speed: one decision, 10,000 pending x 8,000 GPUs, {pol} (target < 1 s) ...", file=sys.stderr,
              flush=True)
        results.append(speed.decision_speed(pol, state=st))
    if args.json:
        print(json.dumps({"speed": results}))
    else:
        for r in results:
            if r["benchmark"] == "simulate":
                print(f"simulate  {r['jobs']:,} jobs on {r['gpus']:,} GPUs ({r['policy']}): {r['wall_s']:.1f} s "
                      f"(target < {r['target_s']:.0f} s) {'PASS' if r['passed'] else 'FAIL'}; "
                      f"{r['decisions']:,} decisions, {r['jobs_per_s']:,.0f} jobs/s, mean wait {_fmt_s(r['mean_wait_s'])}")
            else:
                print(f"decision  {r['pending']:,} pending x {r['gpus']:,} GPUs ({r['policy']}): {r['wall_s']:.3f} s "
                      f"cold, {r['warm_s']:.3f} s warm (target < {r['target_s']:.0f} s) "
                      f"{'PASS' if r['passed'] else 'FAIL'}; {r['assignments']} jobs placed")
    return 0 if all(r["passed"] for r in results) else 1


# ---------------------------------------------------------------------------
# simulate
# ---------------------------------------------------------------------------


def _load(args: argparse.Namespace):
    from slurm_mig.sim import bench, workloads as wl

    speed = wl.get_speed_model(args.speed_model)
    if args.db:
        wl.check_state_db(args.db)  # not a state database (or a damaged one): said so, exit 1
        # Replay on the site's own cluster, as far as the DB knows it, unless told otherwise. A DB that records
        # no MIG GPU the policy places on is refused as retrain refuses it (one check), unless all three are told:
        # a default cluster (1 x 8 H100-80GB, as it used to be, without a word) would time nothing the site has.
        # Told none of them, a site of several GPU models replays on all of them (a node group per model,
        # replay_site); told any, on one model as before: the most common, unless --model names another.
        if args.model is None and args.nodes is None and args.gpus_per_node is None:
            site = wl.replay_site(args.db, "simulate", "time its queue",
                                  "or name the cluster to replay on with --model, --nodes and --gpus-per-node")
            if site.spec.groups:
                args.replay_site = site
            args.model, args.nodes, args.gpus_per_node = site.spec.model, site.spec.nodes, site.spec.gpus_per_node
        elif args.model is None or args.nodes is None or args.gpus_per_node is None:
            site = wl.site_cluster(args.db, "simulate", "time its queue",
                                   "or name the cluster to replay on with --model, --nodes and --gpus-per-node")
            args.model = args.model or site[0]
            args.nodes = args.nodes or site[1]
            args.gpus_per_node = args.gpus_per_node or site[2]
    args.model = args.model or "H100-80GB"
    args.gpus_per_node = args.gpus_per_node or 8
    if args.trace:
        mm = wl.MilliMap.parse(args.milli_map) if args.milli_map else wl.MilliMap()
        w = wl.load_alibaba(args.trace, milli_map=mm, speed=speed, time_limits=not args.no_time_limits,
                            seed=args.seed, model=args.model, nodes=args.nodes or bench.ALIBABA_NODES,
                            gpus_per_node=args.gpus_per_node)
    elif args.db:
        site = getattr(args, "replay_site", None)
        w = wl.load_outcomes_db(args.db, model=args.model, speed=speed, nodes=args.nodes or 1,
                                gpus_per_node=args.gpus_per_node, partitions=site.partitions if site else None)
    else:
        nodes = args.nodes or 2
        gpus = nodes * args.gpus_per_node
        name = args.workload
        if name == "poisson-mix":
            w = wl.poisson_workload(args.jobs, gpus=gpus, load=0.9, seed=args.seed, speed=speed, name=name,
                                    model=args.model)
        elif name == "small-heavy":
            w = wl.poisson_workload(args.jobs, gpus=gpus, load=0.9, seed=args.seed, speed=speed, name=name,
                                    mix={"1g": .35, "2g": .25, "3g": .2, "4g": .1, "7g": .1}, multi_gpu_share=0.1,
                                    model=args.model)
        elif name.startswith("rl-"):
            w = wl.rl_mig_workload(name[3:], args.jobs, gpus=gpus, load=0.9, seed=args.seed, model=args.model)
        else:
            w = wl.miso_workload(args.jobs, gpus=gpus, load=0.9, seed=args.seed, model=args.model)
        w.nodes, w.gpus_per_node = nodes, args.gpus_per_node
        if args.no_time_limits:
            from dataclasses import replace
            w.jobs = [replace(j, time_limit_s=None) for j in w.jobs]
    return w


def _load_mixed_site(args: argparse.Namespace):
    """bench's mixed-site workload (--jobs, --seed as the other synthetic workloads) and its cluster, which is
    fixed: a cluster named with --nodes/--gpus-per-node/--model is refused rather than ignored."""
    from dataclasses import replace

    from slurm_mig.sim import bench, workloads as wl

    told = [f for f, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node),
                           ("--model", args.model)) if v is not None]
    if told:
        site = " + ".join(f"{g.nodes} x {g.gpus_per_node} {g.model}" for g in bench.MIXED_SITE_GROUPS)
        raise ConfigError(f"{', '.join(told)} {'does' if len(told) == 1 else 'do'} not apply to --workload "
                          f"mixed-site: it runs on its own cluster ({site})")
    w, spec = bench.mixed_site(seed=args.seed, n_jobs=args.jobs, speed=wl.get_speed_model(args.speed_model))
    if args.no_time_limits:
        w.jobs = [replace(j, time_limit_s=None) for j in w.jobs]
    return w, spec


def _fmt_bsld(v: float | None) -> str:
    return NA if v is None else f"{v:.2f}"


def cmd_simulate(args: argparse.Namespace) -> int:
    from slurm_mig.policies import get_policy
    from slurm_mig.sim.bench import search_static
    from slurm_mig.sim.engine import ClusterSpec, SimConfig, Simulator
    from slurm_mig.sim.metrics import compute_metrics, lower_bounds

    if args.plot:
        from slurm_mig.sim.plot import check_plot_path, require_matplotlib
        require_matplotlib()
        check_plot_path(args.plot)
    if args.workload == "mixed-site":
        w, spec = _load_mixed_site(args)
        site = None
    else:
        w = _load(args)
        site = getattr(args, "replay_site", None)  # a mixed site's DB: its node groups
        spec = site.spec if site else ClusterSpec(w.nodes, w.gpus_per_node, args.model)
    record = bool(args.plot or args.job)
    if args.policy == "best-static":
        pol, _, _ = search_static(w, spec)
    else:
        pol = get_policy(args.policy)
    sim = Simulator(w, pol, spec, SimConfig(check=args.check, record=record))
    result = sim.run()
    m = compute_metrics(result)
    lb = lower_bounds(w, spec.gpus, spec.model, compute_slices=spec.compute_slices)
    out = {"workload": w.name, "policy": m.policy, "gpus": spec.gpus, "nodes": spec.nodes, "model": spec.model,
           "metrics": m.to_json(), "lower_bound_makespan_s": lb.makespan_s, "lower_bound_mean_jct_s": lb.mean_jct_s,
           "unfinished": result.unfinished, "workload_meta": w.meta}
    if result.meta.get("stopped"):
        out["stopped"] = result.meta["stopped"]
    if spec.groups:
        out["groups"] = [{"name": g.name, "model": g.model, "nodes": g.nodes, "gpus_per_node": g.gpus_per_node}
                         for g in spec.groups]
        # the mixed-site workload's jobs always keep theirs; a DB's where its outcomes show them (ReplaySite)
        out["partitions_kept"] = bool(site.partitions) if site else True
    if args.policy == "best-static":
        out["static_plan"] = pol.describe()
    if args.job:
        out["job"] = _explain(result, args.job)
    if args.plot:
        from slurm_mig.sim.plot import plot_timeline
        lo = args.t_from * 3600 if args.t_from is not None else None
        hi = args.t_to * 3600 if args.t_to is not None else None
        plot_timeline(result, args.plot, t_from=lo, t_to=hi, max_gpus=args.max_gpus, highlight=args.job)
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out, default=str))
        return 0
    if site:
        print(f"{w.name}: {len(w.jobs)} jobs, {site.describe()}, policy {m.policy}")
        print(f"  the site's GPU models, a node group each; "
              + ("jobs keep their partition" if site.partitions else "a job runs on any group whose model has its size")
              + f" ({site.partitions_why})")
    else:
        if spec.groups:
            cluster = " + ".join(f"{g.nodes} nodes x {g.gpus_per_node} {g.model} (partition {g.name})"
                                 for g in spec.groups)
        else:
            cluster = f"{spec.nodes} nodes x {spec.gpus_per_node} {spec.model}"
        print(f"{w.name}: {len(w.jobs)} jobs, {cluster}, policy {m.policy}")
    if w.meta.get("skipped"):
        print(f"  loaded {w.meta.get('loaded')} of {w.meta.get('rows', '?')} rows; skipped {w.meta['skipped']}")
    if "static_plan" in out:
        print(f"  static plan: {out['static_plan']}")
    print(f"  mean wait {_fmt_s(m.mean_wait_s)} (bound 0 s), p95 wait {_fmt_s(m.p95_wait_s)}, "
          f"max wait {_fmt_s(m.max_wait_s)}")
    print(f"  mean JCT {_fmt_s(m.mean_jct_s)} (bound {_fmt_s(lb.mean_jct_s)}), bounded slowdown "
          f"{_fmt_bsld(m.bounded_slowdown)}")
    print(f"  makespan {_fmt_s(m.makespan_s)} (bound {_fmt_s(lb.makespan_s)}), slice utilisation "
          f"{m.utilization:.1%}, {m.reconfigurations} reconfigurations, {m.decisions} decisions, "
          f"{m.wall_s:.1f} s")
    if result.meta.get("stopped"):
        print(f"  simulation cut short: {result.meta['stopped']} (the safety limit; the policy kept changing layouts "
              f"without the queue draining): the figures above are of what had happened by then")
    if result.unfinished:
        print(f"  {result.unfinished} job(s) never ran")
    if args.job:
        j = out["job"]
        print(f"  job {args.job}: " + ", ".join(f"{k}={v}" for k, v in j.items()))
    if args.plot:
        print(f"  timeline written to {args.plot}")
    return 0


def _explain(result, job_id: str) -> dict:
    rec = next((r for r in result.jobs if r.job.job_id == job_id), None)
    if rec is None:
        raise ConfigError(f"no job {job_id!r} in this workload")
    j = rec.job
    out = {"profile": j.profile, "count": j.count, "submit_s": round(j.submit_time, 1),
           "start_s": round(rec.start, 1) if rec.start != math.inf else None,
           "wait_s": round(rec.start - j.submit_time, 1) if rec.start != math.inf else None,
           "run_s": round(rec.duration, 1), "where": f"{rec.node}:" + ",".join(f"{g}/{s}" for g, s in rec.instances)}
    if job_id in result.waiting_reasons:
        out["last_reason_waiting"] = result.waiting_reasons[job_id]
    return out
