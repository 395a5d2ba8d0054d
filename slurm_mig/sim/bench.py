"""`slurm-mig bench`: every policy on a fixed set of workloads (plus traces), against
the best baseline and the lower bounds.

Workloads (seeded, so every run gives the same numbers):

* ``poisson-mix``: Poisson arrivals, 30/25/20/10/15 % of 1g/2g/3g/4g/7g, log-normal
  run times (mean 30 min), offered load 0.9 on 16 GPUs.
* ``small-heavy``: mostly small profiles plus 10 % of 7g jobs asking for 2-8 GPUs.
* ``rl-mix_extreme`` / ``rl-wide_times``: the RL-MIG paper's job families.
* ``miso-models``: MISO's six models with their measured per-size speeds.
* ``mixed-site`` (opt-in: ``--workload mixed-site``): a site of two models, 2 nodes x 8 H100-80GB
  (partition h100) beside 2 nodes x 8 A30-24GB (partition a30); 3g and 7g exist only on the H100s,
  20 % of the jobs are submitted to one partition only. no-mig is not run there (a whole GPU is a 7g on
  one model and a 4g on the other: no one size for a job to ask for).
* ``alibaba-v2023-train`` (when ../shared/traces/alibaba-v2023-train.csv exists, or
  any ``--trace``): the trace on 5 nodes x 8 H100-80GB (40 GPUs).

Policies: no-mig, best-static (the static plan found best for the workload by
simulation, see :func:`search_static`), first-fit, greedy, frag-aware, rl (the
learned policy: policy/default.onnx or the active policy-store version).
Baselines for the ratios: no-mig, best-static, greedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from slurm_mig.errors import ConfigError
from slurm_mig.mig.layout import Layout, enumerate_maximal_layouts
from slurm_mig.mig.profiles import get_model
from slurm_mig.policies import get_policy
from slurm_mig.policies.static import StaticPolicy
from slurm_mig.sim.engine import ClusterSpec, NodeGroup, SimConfig, SimResult, simulate
from slurm_mig.sim.metrics import Bounds, Metrics, compute_metrics, lower_bounds
from slurm_mig.sim.workloads import (
    COMPUTE, Workload, base_kind, load_alibaba, miso_workload, mixed_site_workload, poisson_workload,
    rl_mig_workload,
)

POLICIES = ("no-mig", "best-static", "first-fit", "greedy", "frag-aware", "rl")
BASELINES = ("no-mig", "best-static", "greedy")
ALIBABA_NODES = 5
DEFAULT_TRACE = Path("..") / "shared" / "traces" / "alibaba-v2023-train.csv"


def default_trace() -> Path | None:
    """../shared/traces/alibaba-v2023-train.csv beside the working directory or the checkout, if present."""
    here = Path(__file__).resolve().parents[2]
    for base in (Path.cwd(), here):
        p = (base / DEFAULT_TRACE).resolve()
        if p.is_file():
            return p
    return None


def standard_workloads() -> list[tuple[Workload, ClusterSpec]]:
    """The fixed synthetic set (seeded)."""
    two = ClusterSpec(2, 8)
    return [
        (poisson_workload(2000, gpus=16, load=0.9, seed=1, name="poisson-mix"), two),
        (poisson_workload(2000, gpus=16, load=0.9, seed=2, mix={"1g": .35, "2g": .25, "3g": .2, "4g": .1, "7g": .1},
                          multi_gpu_share=0.1, name="small-heavy"), two),
        (rl_mig_workload("mix_extreme", 1500, gpus=16, load=0.9, seed=3), two),
        (rl_mig_workload("wide_times", 1500, gpus=16, load=0.9, seed=4), two),
        (miso_workload(1500, gpus=16, load=0.9, seed=5), two),
    ]


MIXED_SITE_GROUPS = (NodeGroup("h100", "H100-80GB", 2, 8), NodeGroup("a30", "A30-24GB", 2, 8))
MIXED_SITE_SEED = 6


def mixed_site(seed: int = MIXED_SITE_SEED, n_jobs: int = 2000,
               groups: tuple[NodeGroup, ...] = MIXED_SITE_GROUPS, **kw) -> tuple[Workload, ClusterSpec]:
    """The ``mixed-site`` workload (seeded) and its cluster: one partition per node group."""
    w = mixed_site_workload(n_jobs, partitions=[(g.name, (g.model, g.nodes * g.gpus_per_node)) for g in groups],
                            seed=seed, **kw)
    return w, ClusterSpec.mixed(groups)


# Workloads bench runs only when named (--workload NAME): name -> maker of (workload, cluster).
EXTRA_WORKLOADS: dict[str, Callable[[], tuple[Workload, ClusterSpec]]] = {"mixed-site": mixed_site}
# Policies that cannot run on a mixed cluster, and why (bench skips them there and says so).
NOT_ON_MIXED = {"no-mig": "a whole GPU is a 7g on one model and a 4g on another: no one size for a job to ask for"}


def trace_workload(path: str | Path, nodes: int = ALIBABA_NODES, **kw) -> tuple[Workload, ClusterSpec]:
    w = load_alibaba(path, nodes=nodes, **kw)
    name = Path(path).stem
    w.name = name if name.startswith("alibaba") else f"alibaba:{name}"
    return w, ClusterSpec(nodes, 8, w.model)


# ---------------------------------------------------------------------------
# best static partition
# ---------------------------------------------------------------------------


def _small_demand(w: Workload) -> dict[str, float]:
    d: dict[str, float] = {}
    for j in w.jobs:
        k = base_kind(j.profile)
        if k != "7g":
            d[k] = d.get(k, 0.0) + COMPUTE.get(k, 7) * j.count * j.duration_s
    return d


def _mixed_layouts(n: int, demand: dict[str, float], model: str) -> list[str]:
    """``n`` layouts whose instance mix follows ``demand`` (compute-slice-seconds per kind).

    Greedy: each GPU takes the maximal layout that best covers what is still
    missing; every kind with demand gets at least one instance.
    """
    m = get_model(model)
    cands = [l for l in enumerate_maximal_layouts(m) if "7g" not in l.counts()]
    total = sum(demand.values()) or 1.0
    need = {k: n * m.compute_slices * v / total / COMPUTE[k] for k, v in demand.items()}  # instances wanted
    have = {k: 0 for k in need}
    out: list[str] = []
    for _ in range(n):
        def gain(l: Layout) -> float:
            c = l.counts()
            g = 0.0
            for k, want in need.items():
                missing = max(0.0, want - have[k])
                g += min(c.get(k, 0), missing) * COMPUTE[k]
                if have[k] == 0 and c.get(k, 0):
                    g += 100.0  # cover every kind first
            return g
        best = max(cands, key=lambda l: (gain(l), -len(l.slots), str(l)))
        for k, c in best.counts().items():
            if k in have:
                have[k] += c
        out.append(str(best))
    return out


def _big_gpus(spec: ClusterSpec) -> int:
    """GPUs of models with a whole 7g instance: those a static plan may leave whole (on a one-model
    cluster of such a model, every GPU)."""
    return sum(n for m, n in spec.gpus_by_model().items() if "7g" in {p.kind for p in get_model(m).basic_profiles})


def _static_range(w: Workload, spec: ClusterSpec) -> tuple[list[int], int, int]:
    """First guesses for how many GPUs to partition, and the allowed range."""
    G = _big_gpus(spec) if spec.groups else spec.gpus
    small = _small_demand(w)
    big = sum(COMPUTE["7g"] * j.count * j.duration_s for j in w.jobs if base_kind(j.profile) == "7g")
    max_big = max((j.count for j in w.jobs if base_kind(j.profile) == "7g"), default=0)
    share = sum(small.values()) / ((sum(small.values()) + big) or 1.0)
    lo = 1 if small else 0
    hi = G - max_big if big else G
    hi = max(hi, lo)
    ks = sorted({min(max(round(G * share * f), lo), hi) for f in (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)})
    return ks, lo, hi


def static_plan(w: Workload, spec: ClusterSpec, k: int) -> list[str]:
    """``k`` GPUs partitioned to the workload's small-profile mix, the others whole (7g).

    Whole GPUs fill nodes from the first one, so jobs asking for several GPUs find
    whole nodes; partitioned GPUs come last.
    """
    if spec.groups:
        return _mixed_site_plan(w, spec, k)
    G = spec.gpus
    return ["7g@0"] * (G - k) + _mixed_layouts(k, _small_demand(w), spec.model) if k else ["7g@0"] * G


def _mixed_site_plan(w: Workload, spec: ClusterSpec, k: int) -> list[str]:
    """A mixed cluster's plan, one layout per GPU in the simulator's order: of the GPUs of models with a
    7g, ``k`` are partitioned (the last ones: the last group's first), the others whole; a model without
    a 7g (an A30) has every GPU partitioned, to the mix of the sizes it has among the jobs that may run
    on its partition."""
    plan: list[str] = []
    big_left = k
    per_group: list[list[str]] = []
    for g in reversed(spec.groups):
        m = get_model(g.model)
        kinds = {p.kind for p in m.basic_profiles}
        n = g.nodes * g.gpus_per_node
        if "7g" in kinds:
            part = min(big_left, n)
            big_left -= part
            per_group.append(["7g@0"] * (n - part) + (_mixed_layouts(part, _small_demand(w), g.model) if part else []))
        else:
            able = Workload(w.name, [j for j in w.jobs if base_kind(j.profile) in kinds
                                     and (not j.partition or g.name in j.partition.split(","))])
            per_group.append(_mixed_layouts(n, _small_demand(able), g.model))
    for layouts in reversed(per_group):
        plan.extend(layouts)
    return plan


def static_candidates(w: Workload, spec: ClusterSpec) -> list[list[str]]:
    """The first round of static plans :func:`search_static` tries."""
    ks, _, _ = _static_range(w, spec)
    return [static_plan(w, spec, k) for k in ks]


def search_static(w: Workload, spec: ClusterSpec, objective: str = "mean_wait_s",
                  log: Callable[[str], None] | None = None) -> tuple[StaticPolicy, SimResult, Metrics]:
    """The best static plan by simulation: a coarse sweep of how many GPUs to partition,
    then every count within 2 of the best; lowest ``objective`` wins (all jobs finished first)."""
    ks, lo, hi = _static_range(w, spec)
    tried: dict[int, tuple] = {}

    def run(k: int) -> None:
        pol = StaticPolicy(static_plan(w, spec, k))
        r = simulate(w, pol, spec)
        m = compute_metrics(r)
        value = getattr(m, objective)
        tried[k] = ((r.unfinished, math.inf if value is None else value), pol, r, m)
        if log:
            log(f"  static {pol.describe()}: {objective}={'n/a' if value is None else f'{value:.0f}'} "
                f"unfinished={r.unfinished}")

    for k in ks:
        run(k)
    best_k = min(tried, key=lambda k: tried[k][0])
    for k in range(max(lo, best_k - 2), min(hi, best_k + 2) + 1):
        if k not in tried:
            run(k)
    best_k = min(tried, key=lambda k: tried[k][0])
    _, pol, r, m = tried[best_k]
    pol.name = "best-static"
    m.policy = "best-static"
    r.policy = "best-static"
    return pol, r, m


# ---------------------------------------------------------------------------
# running the bench
# ---------------------------------------------------------------------------


@dataclass
class WorkloadReport:
    name: str
    spec: ClusterSpec
    jobs: int
    bounds: Bounds
    results: list[Metrics]
    notes: dict = field(default_factory=dict)

    def by_policy(self) -> dict[str, Metrics]:
        return {m.policy: m for m in self.results}

    def best_baseline(self, metric: str) -> float:
        vals = [v for m in self.results if m.policy in BASELINES and (v := getattr(m, metric)) is not None]
        return min(vals) if vals else math.nan

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "gpus": self.spec.gpus,
            "nodes": self.spec.nodes,
            "gpu_model": self.spec.model,
            "jobs": self.jobs,
            **({"partitions": [{"name": g.name, "model": g.model, "nodes": g.nodes, "gpus_per_node": g.gpus_per_node}
                               for g in self.spec.groups]} if self.spec.groups else {}),
            "lower_bound_makespan_s": self.bounds.makespan_s,
            "lower_bound_mean_jct_s": self.bounds.mean_jct_s,
            "lower_bound_mean_wait_s": self.bounds.mean_wait_s,
            "results": [
                {"policy": m.policy, "mean_wait_s": m.mean_wait_s, "p95_wait_s": m.p95_wait_s,
                 "mean_jct_s": m.mean_jct_s, "makespan_s": m.makespan_s, "utilization": m.utilization,
                 "reconfigurations": m.reconfigurations, "bounded_slowdown": m.bounded_slowdown,
                 "finished": m.finished, "wall_s": m.wall_s}
                for m in self.results
            ],
            **({"notes": self.notes} if self.notes else {}),
        }


def run_workload(w: Workload, spec: ClusterSpec, policies: Iterable[str] = POLICIES,
                 log: Callable[[str], None] | None = None, check: bool = False) -> WorkloadReport:
    results: list[Metrics] = []
    notes: dict = {}
    for name in policies:
        if spec.groups and name in NOT_ON_MIXED:
            notes.setdefault("not_run", {})[name] = NOT_ON_MIXED[name]
            continue
        if name == "best-static":
            pol, r, m = search_static(w, spec, log=log)
            notes["best_static_plan"] = pol.describe()
        else:
            r = simulate(w, get_policy(name), spec, SimConfig(check=check))
            m = compute_metrics(r)
        if r.meta.get("stopped"):  # the safety stop: its figures are of a simulation cut short
            notes.setdefault("stopped", {})[name] = r.meta["stopped"]
        if log:
            log(f"  {w.name}: {name} mean wait {'n/a' if m.mean_wait_s is None else f'{m.mean_wait_s:.0f} s'} "
                f"({m.wall_s:.1f} s)")
        results.append(m)
    if w.meta.get("skipped"):
        notes["skipped"] = w.meta["skipped"]
    return WorkloadReport(w.name, spec, len(w.jobs),
                          lower_bounds(w, spec.gpus, spec.model, compute_slices=spec.compute_slices), results, notes)


def run_bench(traces: Iterable[str | Path] = (), *, include_default_trace: bool = True, synthetic: bool = True,
              policies: Iterable[str] = POLICIES, nodes: int = ALIBABA_NODES,
              log: Callable[[str], None] | None = None, workloads: Iterable[str] = ()) -> list[WorkloadReport]:
    """The standard synthetic workloads (``synthetic``), then each of ``workloads`` (EXTRA_WORKLOADS' names),
    then the traces."""
    items: list[tuple[Workload, ClusterSpec]] = standard_workloads() if synthetic else []
    for name in workloads:
        make = EXTRA_WORKLOADS.get(name)
        if make is None:
            raise ConfigError(f"unknown bench workload {name!r} (known: {', '.join(EXTRA_WORKLOADS)})")
        items.append(make())
    paths = [Path(t) for t in traces]
    if include_default_trace and not paths:
        d = default_trace()
        if d is not None:
            paths.append(d)
    for p in paths:
        items.append(trace_workload(p, nodes=nodes))
    return [run_workload(w, spec, policies, log) for w, spec in items]


def bench_json(reports: list[WorkloadReport]) -> dict:
    return {"workloads": [r.to_json() for r in reports]}
