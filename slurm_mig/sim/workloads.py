"""Workloads for the simulator: jobs, speed models, trace loaders and generators.

A :class:`Job` asks for ``count`` instances of one MIG profile (a kind such as
``"3g"``) on one node, like ``sbatch --gres=mig:3g:2``. ``duration_s`` is its
run time on that profile; a :class:`SpeedModel` gives the run time on another
profile (only the no-MIG baseline runs a job on a profile other than the one it
asked for: a whole GPU, 7g). ``time_limit_s`` plays Slurm's ``--time``: an
over-estimate of the run time that policies may use.

Sources:

* :func:`load_alibaba` -- Alibaba cluster-trace-gpu-v2023 pod lists (Weng et al.,
  "Beware of Fragmentation", USENIX ATC'23). ``gpu_milli`` maps to a profile by a
  configurable :class:`MilliMap`; the trace's run time is taken as the run time
  on that profile. Pods that never ran, or have no GPU, are skipped and counted.
* :func:`poisson_workload`, :func:`rl_mig_workload`, :func:`miso_workload` --
  seeded synthetic generators (Poisson arrivals; the RL-MIG paper's scaling
  families; MISO's measured per-size speeds).
* :func:`load_outcomes_db` -- replay of the job outcomes recorded in the state DB.
"""

from __future__ import annotations

import csv
import math
import os
import random
import sqlite3
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from slurm_mig.argtypes import ascii_digits
from slurm_mig.errors import ConfigError, GeometryError
from slurm_mig.jobids import job_id_key
from slurm_mig.mig.profiles import get_model

KINDS = ("1g", "2g", "3g", "4g", "7g")
COMPUTE = {"1g": 1, "2g": 2, "3g": 3, "4g": 4, "7g": 7}


def base_kind(kind: str) -> str:
    """"1g+me", "1g.dm", "1g.10gb" -> "1g": the size that decides speed."""
    k = kind.strip().lower()
    return k.split("+")[0].split(".")[0]


# ---------------------------------------------------------------------------
# speed models
# ---------------------------------------------------------------------------

# Slowdown of each size relative to a whole GPU (7g), MISO (SoCC'22) on A100,
# FACTS §5. inf = does not fit (out of memory).
MISO_MODELS: dict[str, dict[str, float]] = {
    "resnet_train512": {"7g": 1.0, "4g": 1.34, "3g": 1.53, "2g": 2.39, "1g": 4.47},
    "mobilenet_train64": {"7g": 1.0, "4g": 1.02, "3g": 1.03, "2g": 1.11, "1g": 1.23},
    "bert_train8": {"7g": 1.0, "4g": 1.74, "3g": 1.93, "2g": math.inf, "1g": math.inf},
    "transformer_train32": {"7g": 1.0, "4g": 1.68, "3g": 1.87, "2g": 3.15, "1g": 6.10},
    "embedding_train64": {"7g": 1.0, "4g": 1.06, "3g": 1.06, "2g": 1.20, "1g": 1.59},
    "deepspeech2_train8": {"7g": 1.0, "4g": 1.25, "3g": 1.60, "2g": 2.60, "1g": 8.47},
}


def _mean_of_miso() -> dict[str, float]:
    out = {}
    for k in KINDS:
        vals = [m[k] for m in MISO_MODELS.values() if math.isfinite(m[k])]
        out[k] = round(sum(vals) / len(vals), 2)
    return out


@dataclass(frozen=True)
class SpeedModel:
    """Slowdown per size relative to 7g: run time on size k = run time on 7g x slowdown[k].

    The default, ``miso-mean``, is the mean of MISO's six measured models where
    they fit (4g 1.35, 3g 1.50, 2g 2.09, 1g 4.37): jobs speed up on bigger
    slices, far less than linearly.
    """

    name: str
    slowdown: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, name: str, table: Mapping[str, float]) -> "SpeedModel":
        return cls(name, tuple(sorted((base_kind(k), float(v)) for k, v in table.items())))

    def factor(self, kind: str) -> float:
        k = base_kind(kind)
        for name, v in self.slowdown:
            if name == k:
                return v
        return 1.0 if k == "7g" else math.inf

    def convert(self, duration_s: float, from_kind: str, to_kind: str) -> float:
        """Run time on ``to_kind`` of a job that takes ``duration_s`` on ``from_kind``."""
        if base_kind(from_kind) == base_kind(to_kind):
            return duration_s
        return duration_s * self.factor(to_kind) / self.factor(from_kind)


SPEED_MODELS: dict[str, SpeedModel] = {
    "miso-mean": SpeedModel.of("miso-mean", _mean_of_miso()),
    "linear": SpeedModel.of("linear", {"7g": 1.0, "4g": 7 / 4, "3g": 7 / 3, "2g": 3.5, "1g": 7.0}),
    "flat": SpeedModel.of("flat", {"7g": 1.0, "4g": 1.0, "3g": 1.0, "2g": 1.0, "1g": 1.0}),
    **{f"miso:{k}": SpeedModel.of(f"miso:{k}", v) for k, v in MISO_MODELS.items()},
}
DEFAULT_SPEED = SPEED_MODELS["miso-mean"]


def get_speed_model(name: str) -> SpeedModel:
    try:
        return SPEED_MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown speed model {name!r} (known: {', '.join(SPEED_MODELS)})") from None


# ---------------------------------------------------------------------------
# jobs and workloads
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """One batch job: ``count`` x ``profile`` on one node for ``duration_s`` (on that profile)."""

    job_id: str
    submit_time: float
    profile: str  # kind: "1g", "2g", "3g", "4g", "7g" (or a full profile name)
    count: int
    duration_s: float
    time_limit_s: float | None = None
    speed: SpeedModel = DEFAULT_SPEED
    priority: int = 0  # higher runs first; ties by submit time (Slurm's FIFO default)
    # The partitions it was submitted to (comma-separated, a mixed cluster's node groups: ClusterSpec.mixed);
    # "": any node. The simulator gives the policy their nodes (PendingJob.nodes).
    partition: str = ""

    def duration_on(self, kind: str) -> float:
        return self.speed.convert(self.duration_s, self.profile, kind)

    def time_limit_on(self, kind: str) -> float | None:
        if self.time_limit_s is None:
            return None
        return self.speed.convert(self.time_limit_s, self.profile, kind)

    @property
    def compute(self) -> int:
        """Compute slices it holds while running (count x size)."""
        return self.count * COMPUTE.get(base_kind(self.profile), 7)


@dataclass
class Workload:
    """Jobs sorted by submit time, plus where they came from."""

    name: str
    jobs: list[Job]
    model: str = "H100-80GB"
    nodes: int = 2  # suggested cluster: nodes x gpus_per_node
    gpus_per_node: int = 8
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # ties (one submit time) by job id as Slurm orders them, by number: as text "100" came before "99"
        self.jobs.sort(key=lambda j: (j.submit_time, job_id_key(j.job_id)))

    def __len__(self) -> int:
        return len(self.jobs)

    def profile_mix(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for j in self.jobs:
            out[j.profile] = out.get(j.profile, 0) + j.count
        return dict(sorted(out.items()))


def _limit(duration: float, rng: random.Random, lo: float = 1.0, hi: float = 4.0) -> float:
    """A user's --time for a job that really takes ``duration``: an over-estimate.

    Factor log-uniform in [lo, hi] (median 2x with the defaults), rounded up to
    whole minutes as Slurm does.
    """
    factor = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return max(60.0, math.ceil(duration * factor / 60.0) * 60.0)


def with_time_limits(jobs: Iterable[Job], seed: int = 0, lo: float = 1.0, hi: float = 4.0) -> list[Job]:
    """Give each job a synthetic --time (see _limit); deterministic for a seed."""
    rng = random.Random(seed)
    return [replace(j, time_limit_s=_limit(j.duration_s, rng, lo, hi)) for j in jobs]


# ---------------------------------------------------------------------------
# Alibaba cluster-trace-gpu-v2023
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MilliMap:
    """gpu_milli (thousandths of a GPU) -> MIG profile kind.

    ``table`` is a list of (upper bound in milli, kind), ascending: a pod gets
    the first kind whose bound is >= its gpu_milli. The default gives a pod the
    smallest profile whose compute share covers its GPU share: up to 1/7 of a
    GPU (142) -> 1g, 2/7 (285) -> 2g, 3/7 (428) -> 3g, 4/7 (571) -> 4g, more ->
    7g. Pods with num_gpu > 1 ask for num_gpu instances of the mapped profile
    (in this trace they all ask for whole GPUs: num_gpu x 7g).
    """

    table: tuple[tuple[int, str], ...] = ((142, "1g"), (285, "2g"), (428, "3g"), (571, "4g"), (1000, "7g"))

    def kind(self, milli: int) -> str:
        for bound, kind in self.table:
            if milli <= bound:
                return kind
        return self.table[-1][1]

    @classmethod
    def parse(cls, text: str) -> "MilliMap":
        """``"1g:142,2g:285,3g:428,4g:571,7g:1000"``."""
        items = []
        for part in text.split(","):
            kind, sep, bound = part.strip().partition(":")
            if not sep or not ascii_digits(bound.strip()):
                raise ConfigError(f"bad gpu_milli map item {part!r}: expected KIND:MAX_MILLI, e.g. 2g:285")
            items.append((int(bound), kind.strip()))
        items.sort()
        if not items or items[-1][0] < 1000:
            raise ConfigError("the gpu_milli map must cover 1000 (a whole GPU)")
        return cls(tuple(items))

    def __str__(self) -> str:
        return ",".join(f"{k}:{b}" for b, k in self.table)


ALIBABA_COLUMNS = ("name", "num_gpu", "gpu_milli", "creation_time", "deletion_time", "scheduled_time")


def load_alibaba(
    path: str | Path,
    *,
    milli_map: MilliMap = MilliMap(),
    speed: SpeedModel = DEFAULT_SPEED,
    time_limits: bool = True,
    seed: int = 0,
    model: str = "H100-80GB",
    nodes: int = 4,
    gpus_per_node: int = 8,
    name: str | None = None,
) -> Workload:
    """Load an Alibaba cluster-trace-gpu-v2023 pod list (e.g. openb_pod_list_default.csv).

    Submit time = creation_time; run time = deletion_time - scheduled_time, taken
    as the run time on the mapped profile. Skipped and counted in
    ``meta["skipped"]``: pods with no scheduled_time (never ran), then pods with
    num_gpu = 0 (no GPU), then rows with a non-positive run time or unparsable
    numbers. Submit times are shifted so the first pod arrives at 0. With
    ``time_limits`` each job gets a synthetic --time (the trace has none).
    """
    path = Path(path)
    gpu = get_model(model)
    for _bound, kind in milli_map.table:  # a size the GPUs lack: every pod mapped to it "never ran", exit 0
        try:
            gpu.profile(kind)
        except GeometryError:
            sizes = ", ".join(dict.fromkeys(p.kind for p in gpu.basic_profiles))
            raise ConfigError(f"the gpu_milli map {milli_map} maps pods to {kind!r}, which {gpu.name} has no MIG "
                              f"profile of (its sizes: {sizes}): those pods could never run; give a --milli-map "
                              f"of its sizes") from None
    try:
        fh = path.open(newline="")
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    skipped = {"never_ran": 0, "no_gpu": 0, "bad_row": 0}
    rows = 0
    raw: list[tuple[str, float, str, int, float]] = []
    try:
        with fh:
            reader = csv.DictReader(fh)
            missing = [c for c in ALIBABA_COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise ConfigError(f"{path} is not an Alibaba v2023 pod list: missing column(s) {', '.join(missing)}")
            for row in reader:
                rows += 1
                sched = (row.get("scheduled_time") or "").strip()
                if not sched:
                    skipped["never_ran"] += 1
                    continue
                try:
                    num_gpu = int(float(row["num_gpu"] or 0))
                    if num_gpu <= 0:
                        skipped["no_gpu"] += 1
                        continue
                    milli = int(float(row["gpu_milli"] or 0))
                    created = float(row["creation_time"])
                    duration = float(row["deletion_time"]) - float(sched)
                except (TypeError, ValueError):
                    skipped["bad_row"] += 1
                    continue
                if duration <= 0 or milli <= 0:
                    skipped["bad_row"] += 1
                    continue
                raw.append((row["name"], created, milli_map.kind(milli), num_gpu, duration))
    except UnicodeDecodeError as exc:  # a .csv.gz not unpacked, a stray byte: was a traceback naming no file
        raise ConfigError(f"{path} is not an Alibaba v2023 pod list: not {exc.encoding} text") from None
    t0 = min((r[1] for r in raw), default=0.0)
    jobs = [Job(n, c - t0, k, g, d, None, speed) for n, c, k, g, d in raw]
    if time_limits:
        jobs = with_time_limits(jobs, seed)
    meta = {
        "source": str(path), "rows": rows, "loaded": len(jobs), "skipped": skipped,
        "milli_map": str(milli_map), "speed_model": speed.name, "time_limits": time_limits,
    }
    return Workload(name or f"alibaba:{path.stem}", jobs, model, nodes, gpus_per_node, meta)


# ---------------------------------------------------------------------------
# synthetic generators
# ---------------------------------------------------------------------------

DEFAULT_MIX = {"1g": 0.3, "2g": 0.25, "3g": 0.2, "4g": 0.1, "7g": 0.15}


def _pick(rng: random.Random, weights: Mapping[str, float]) -> str:
    r = rng.random() * sum(weights.values())
    for k, w in weights.items():
        r -= w
        if r <= 0:
            return k
    return next(reversed(list(weights)))


def _arrivals(rng: random.Random, jobs_compute_s: Sequence[float], gpus: int, load: float,
              slices_per_gpu: int = 7) -> list[float]:
    """Poisson arrival times giving offered ``load`` (compute-slice-seconds per capacity) on ``gpus``."""
    n = len(jobs_compute_s)
    if n == 0:
        return []
    if gpus < 1:
        raise ConfigError(f"a workload needs at least one GPU to arrive on, got {gpus}")
    mean_work = sum(jobs_compute_s) / n
    rate = load * gpus * slices_per_gpu / mean_work  # jobs per second
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _draw_job(rng: random.Random, mix: Mapping[str, float], multi_gpu_share: float, counts: Sequence[int],
              mu: float, sigma: float) -> tuple[str, int, float]:
    """(kind, count, run time) of one job of a Poisson workload: a kind from ``mix``; ``multi_gpu_share`` of the
    7g jobs ask for one of ``counts`` GPUs; a log-normal run time (``mu``, ``sigma``), at least 5 s. The draws
    are made in this order, which the seeded workloads' numbers depend on."""
    kind = _pick(rng, mix)
    count = 1
    if kind == "7g" and multi_gpu_share and rng.random() < multi_gpu_share:
        count = rng.choice(counts)
    return kind, count, max(5.0, rng.lognormvariate(mu, sigma))


def poisson_workload(
    n_jobs: int = 2000,
    *,
    gpus: int = 16,
    gpus_per_node: int = 8,
    load: float = 0.95,
    mix: Mapping[str, float] = DEFAULT_MIX,
    mean_duration_s: float = 1800.0,
    sigma: float = 1.0,
    multi_gpu_share: float = 0.0,
    speed: SpeedModel = DEFAULT_SPEED,
    seed: int = 0,
    model: str = "H100-80GB",
    name: str | None = None,
) -> Workload:
    """Poisson arrivals, profiles drawn from ``mix``, log-normal run times (on the profile asked for).

    ``load`` is the offered compute load on ``gpus`` GPUs (1.0 = every compute
    slice busy on average); above ~0.8 jobs queue. ``multi_gpu_share`` of the
    7g jobs ask for 2-8 GPUs on one node.
    """
    rng = random.Random(seed)
    mu = math.log(mean_duration_s) - sigma * sigma / 2
    specs = []
    for _ in range(n_jobs):
        kind, count, dur = _draw_job(rng, mix, multi_gpu_share, (2, 4, 8), mu, sigma)
        specs.append((kind, min(count, gpus_per_node), dur))
    arr = _arrivals(rng, [COMPUTE[k] * c * d for k, c, d in specs], gpus, load)
    jobs = [Job(f"p{i}", arr[i], k, c, d, None, speed) for i, (k, c, d) in enumerate(specs)]
    jobs = with_time_limits(jobs, seed + 1)
    return Workload(name or f"poisson-{n_jobs}", jobs, model, max(1, gpus // gpus_per_node), gpus_per_node,
                    {"generator": "poisson", "load": load, "seed": seed, "mix": dict(mix)})


# The RL-MIG paper's families (Villarrubia et al., FGCS 2025, FACTS §5): a job
# takes t1 ~ U(range) on one slice and t_s = (s-1+d)/s * t_(s-1) on s slices
# (d = 0: perfect scaling, d = 1: none). Parameters below are ours, in its spirit.
RL_FAMILIES: dict[str, dict] = {
    "good_scaling": {"d": (0.0, 0.2), "t1": (600.0, 3600.0)},
    "bad_scaling": {"d": (0.7, 1.0), "t1": (600.0, 3600.0)},
    "mix_extreme": {"d": "extreme", "t1": (600.0, 3600.0)},
    "mix_soft": {"d": (0.2, 0.8), "t1": (600.0, 3600.0)},
    "wide_times": {"d": (0.0, 1.0), "t1": (60.0, 14400.0)},
}


def rl_scaling_times(t1: float, d: float) -> dict[str, float]:
    """t_s for s = 1..7 by the RL-MIG recurrence; returned for 1g/2g/3g/4g/7g."""
    t = {1: t1}
    for s in range(2, 8):
        t[s] = (s - 1 + d) / s * t[s - 1]
    return {"1g": t[1], "2g": t[2], "3g": t[3], "4g": t[4], "7g": t[7]}


def rl_mig_workload(
    family: str = "mix_extreme",
    n_jobs: int = 1500,
    *,
    gpus: int = 16,
    gpus_per_node: int = 8,
    load: float = 0.95,
    mix: Mapping[str, float] = DEFAULT_MIX,
    seed: int = 0,
    model: str = "H100-80GB",
) -> Workload:
    """A job stream from one RL-MIG family: each job's speed curve follows the recurrence.

    Each job asks for a profile drawn from ``mix``; its run time is t_s for that
    size and its own speed model is the curve t_s / t_7.
    """
    if family not in RL_FAMILIES:
        raise ConfigError(f"unknown RL-MIG family {family!r} (known: {', '.join(RL_FAMILIES)})")
    spec = RL_FAMILIES[family]
    rng = random.Random(seed)
    specs = []
    for i in range(n_jobs):
        if spec["d"] == "extreme":
            d = rng.uniform(0.0, 0.1) if rng.random() < 0.5 else rng.uniform(0.9, 1.0)
        else:
            d = rng.uniform(*spec["d"])
        times = rl_scaling_times(rng.uniform(*spec["t1"]), d)
        sp = SpeedModel.of(f"rl:d={d:.2f}", {k: times[k] / times["7g"] for k in KINDS})
        kind = _pick(rng, mix)
        specs.append((kind, times[kind], sp))
    arr = _arrivals(rng, [COMPUTE[k] * dur for k, dur, _ in specs], gpus, load)
    jobs = [Job(f"r{i}", arr[i], k, 1, dur, None, sp) for i, (k, dur, sp) in enumerate(specs)]
    jobs = with_time_limits(jobs, seed + 1)
    return Workload(f"rl-{family}", jobs, model, max(1, gpus // gpus_per_node), gpus_per_node,
                    {"generator": "rl-mig", "family": family, "load": load, "seed": seed})


def miso_workload(
    n_jobs: int = 1500,
    *,
    gpus: int = 16,
    gpus_per_node: int = 8,
    load: float = 0.95,
    mix: Mapping[str, float] = DEFAULT_MIX,
    mean_duration_7g_s: float = 1200.0,
    seed: int = 0,
    model: str = "H100-80GB",
) -> Workload:
    """Jobs of MISO's six measured models, each with that model's per-size speed.

    A job's run time on 7g is log-normal; it asks for a profile from ``mix`` among
    those it fits in (bert does not fit 1g/2g and asks for 3g or bigger).
    """
    rng = random.Random(seed)
    names = sorted(MISO_MODELS)
    mu = math.log(mean_duration_7g_s) - 0.5
    specs = []
    for _ in range(n_jobs):
        m = rng.choice(names)
        sp = SPEED_MODELS[f"miso:{m}"]
        fits = {k: w for k, w in mix.items() if math.isfinite(MISO_MODELS[m][k])}
        kind = _pick(rng, fits)
        d7 = max(5.0, rng.lognormvariate(mu, 1.0))
        specs.append((kind, d7 * sp.factor(kind), sp))
    arr = _arrivals(rng, [COMPUTE[k] * dur for k, dur, _ in specs], gpus, load)
    jobs = [Job(f"m{i}", arr[i], k, 1, dur, None, sp) for i, (k, dur, sp) in enumerate(specs)]
    jobs = with_time_limits(jobs, seed + 1)
    return Workload("miso-models", jobs, model, max(1, gpus // gpus_per_node), gpus_per_node,
                    {"generator": "miso", "load": load, "seed": seed})


MIXED_SITE_MIX = {"1g": 0.3, "2g": 0.25, "3g": 0.15, "4g": 0.15, "7g": 0.15}


def mixed_site_workload(
    n_jobs: int = 2000,
    *,
    partitions: Mapping[str, tuple[str, int]] | Sequence[tuple[str, tuple[str, int]]] = (
        ("h100", ("H100-80GB", 16)), ("a30", ("A30-24GB", 16))),
    load: float = 0.9,
    mix: Mapping[str, float] = MIXED_SITE_MIX,
    restricted: float = 0.2,
    multi_gpu_share: float = 0.1,
    mean_duration_s: float = 1800.0,
    sigma: float = 1.0,
    speed: SpeedModel = DEFAULT_SPEED,
    seed: int = 0,
    name: str = "mixed-site",
) -> Workload:
    """A site of several GPU models, each its own partition (``partitions``: name -> (model, GPUs)).

    Poisson arrivals and log-normal run times as :func:`poisson_workload`, profiles from ``mix``; a size
    some model lacks (3g and 7g on an A30) can run only on the others. ``restricted`` of the jobs are
    submitted to one partition only (Job.partition), drawn among those whose model has their size, in
    proportion to the partitions' GPUs; the rest to all of them (any node). ``multi_gpu_share`` of the 7g
    jobs ask for 2 or 4 GPUs on one node. ``load`` is the offered compute load on all the partitions'
    compute slices together. A job's run time depends on its size only, not on the model it runs on
    (an A30's 4g, its whole GPU, runs as fast as an H100's 4g): the models differ in which sizes they have.
    """
    parts = dict(partitions)
    if not parts:
        raise ConfigError("a mixed site needs at least one partition")
    kinds_of = {p: {pr.kind for pr in get_model(m).basic_profiles} for p, (m, _g) in parts.items()}
    slices = sum(get_model(m).compute_slices * g for m, g in parts.values())
    rng = random.Random(seed)
    mu = math.log(mean_duration_s) - sigma * sigma / 2
    specs = []
    for _ in range(n_jobs):
        kind, count, dur = _draw_job(rng, mix, multi_gpu_share, (2, 4), mu, sigma)
        part = ""
        if rng.random() < restricted:
            able = {p: parts[p][1] for p in parts if kind in kinds_of[p]}
            if able:
                part = _pick(rng, able)
        specs.append((kind, count, dur, part))
    arr = _arrivals(rng, [COMPUTE[k] * c * d for k, c, d, _ in specs], 1, load, slices)
    jobs = [Job(f"x{i}", arr[i], k, c, d, None, speed, partition=p) for i, (k, c, d, p) in enumerate(specs)]
    jobs = with_time_limits(jobs, seed + 1)
    return Workload(name, jobs, "+".join(dict.fromkeys(m for m, _g in parts.values())), len(parts), 8,
                    {"generator": "mixed-site", "load": load, "seed": seed, "mix": dict(mix),
                     "partitions": {p: {"model": m, "gpus": g} for p, (m, g) in parts.items()},
                     "restricted": restricted})


# ---------------------------------------------------------------------------
# replay of recorded outcomes
# ---------------------------------------------------------------------------


def _number(v):
    """A column value as a finite float, None for NULL; ValueError for text, blobs, NaN or infinity."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(v)
    return float(v)


def outcomes_db_cluster(path: str | Path) -> tuple[str, int, int] | None:
    """(GPU model, nodes, GPUs per node) of the MIG GPUs a state DB last saw, for replaying its outcomes
    on the site's own cluster: the most common model, the nodes holding one of those and the most such
    GPUs on one node. Only the GPUs the controller's policy sees count (Store.cluster_state): a newer node's
    GPU, of a model this slurm-mig's tables do not list or of a known model holding instances its table does
    not allow (a newer node's profile or placement, store.models.readable_model), is kept blocked and takes no
    MIG job, so it is no GPU of the replay; counted, an unlisted model could be the most common and leave no
    cluster at all. None when the DB records no such GPU (or no ``gpus`` table, or cannot be read).
    A site of several models: outcomes_db_groups gives each its own group."""
    groups = outcomes_db_groups(path)
    return groups[0] if groups else None


def outcomes_db_groups(path: str | Path) -> list[tuple[str, int, int]]:
    """(GPU model, nodes, GPUs per node) of each model among the MIG GPUs a state DB last saw (the GPUs
    outcomes_db_cluster counts), the most common model first (ties by name): the nodes holding one and
    the most of it on one node. [] when there is none or the DB cannot be read."""
    return _groups_of(_site_gpus(path) or [])


def _groups_of(known: Sequence[tuple[str, str]]) -> list[tuple[str, int, int]]:
    """outcomes_db_groups of the (node, model) pairs ``known`` (_site_gpus)."""
    if not known:
        return []
    models: dict[str, int] = {}
    for _node, m in known:
        models[m] = models.get(m, 0) + 1
    out = []
    for model in sorted(sorted(models), key=lambda m: -models[m]):
        per_node: dict[str, int] = {}
        for node, m in known:
            if m == model:
                per_node[node] = per_node.get(node, 0) + 1
        out.append((model, len(per_node), max(per_node.values())))
    return out


def _site_gpus(path: str | Path) -> list[tuple[str, str]] | None:
    """(node, model) of every MIG GPU of the DB's gpus table the controller's policy sees (outcomes_db_cluster);
    None when the DB cannot be read."""
    from slurm_mig.store.db import sqlite_uri  # here: a simulation without a DB never imports the store
    from slurm_mig.store.models import readable_model

    try:
        con = sqlite3.connect(sqlite_uri(path, "ro"), uri=True)
    except sqlite3.Error:
        return None
    known: list[tuple[str, str]] = []
    try:
        cols = {r[1] for r in con.execute("PRAGMA table_info(gpus)")}
        blocked = "blocked" if "blocked" in cols else "NULL"  # (no column before schema 5)
        rows = con.execute(f"SELECT node, gpu, model, {blocked} FROM gpus "
                           "WHERE mig_enabled = 1 AND model IS NOT NULL").fetchall()
        for node, gpu, m, why in rows:
            try:
                name = get_model(str(m)).name
            except GeometryError:
                continue
            if why:
                # As cluster_state: only a blocked GPU may hold instances its table does not allow
                # (replace_observed blocks every one), and such a GPU is out of the policy's view.
                insts = [{"profile": p, "start": st} for p, st in con.execute(
                    "SELECT profile, start FROM instances WHERE node = ? AND gpu = ?", (node, gpu))]
                try:
                    if readable_model(name, insts) is None:
                        continue
                except (TypeError, ValueError, GeometryError):  # a hand-edited row: not readable either
                    continue
            known.append((str(node), name))
    except sqlite3.Error:
        return None
    finally:
        con.close()
    return known


def site_cluster(db: str | Path, command: str, harm: str, way_on: str = "") -> tuple[str, int, int]:
    """(GPU model, nodes, GPUs per node) of the site a state DB records (outcomes_db_cluster), for `policy
    retrain` and `simulate --db`: the one check both make before replaying its outcomes.

    A ConfigError when the DB does not exist or records no MIG GPU the controller's policy places on:
    replayed on a made-up cluster (this used to be 1 x 8 H100-80GB, without a word), the waits would say
    nothing about the site, since the waits of a queue depend on the GPUs it runs on. ``command`` names the
    one that stops, ``harm`` what it would do on such a cluster ("judge the candidate"), ``way_on`` any other
    way on it offers (simulate's --model, --nodes, --gpus-per-node)."""
    return _site_groups(db, command, harm, way_on)[0][0]


def check_state_db(db: str | Path) -> None:
    """`simulate --db`'s and `policy retrain`'s check of the file before they read it, the operator commands' one
    (ops.views.check_state_file): a StoreError (exit 1) saying plainly that it is not a state database (not
    SQLite at all, empty, world-writable, ...) or a damaged one, where these commands said "records no MIG
    GPU ..." with the cause in brackets. A ConfigError (exit 2) when it does not exist, as before."""
    from slurm_mig.errors import StoreError
    from slurm_mig.ops.views import check_state_file
    from slurm_mig.store.db import sqlite_uri

    if not os.path.exists(db):  # (not is_file(): a FIFO or a folder is "not a regular file", below)
        raise ConfigError(f"state DB {db} does not exist")
    check_state_file(db)
    try:
        con = sqlite3.connect(sqlite_uri(db, "ro"), uri=True)
        try:
            con.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:  # SQLite's header, then damage: a truncated or overwritten file
        if "malformed" in str(exc).lower() or "not a database" in str(exc).lower():
            raise StoreError(f"state database {db} is not a usable SQLite database ({exc})") from None
        raise


def _site_groups(db: str | Path, command: str, harm: str,
                 way_on: str) -> tuple[list[tuple[str, int, int]], list[tuple[str, str]]]:
    """(outcomes_db_groups of ``db``, the most common model first; the (node, model) pairs they count):
    site_cluster's and replay_site's one reading of the DB, with site_cluster's refusal where there is none."""
    check_state_db(db)
    known = _site_gpus(db) or []
    groups = _groups_of(known)
    if not groups:
        raise ConfigError(f"{db} records no MIG GPU the controller's policy places on ({gpus_held(db)}), so "
                          f"{command} has no cluster to replay its outcomes on; one that is not the site's would "
                          f"{harm} on GPUs the site does not have, and {command} stops instead. Run it on the "
                          "controller's state DB once the nodes have reported their MIG GPUs (`slurm-mig nodes`); "
                          "a newer node's GPU, blocked during a rolling upgrade, counts once the controller is "
                          "upgraded too" + (f"; {way_on}" if way_on else ""))
    return groups, known


@dataclass(frozen=True)
class ReplaySite:
    """The cluster a state DB's outcomes replay on (replay_site): ``spec`` is a one-model ClusterSpec for a
    site of one model, else ClusterSpec.mixed with a node group per model. ``partitions`` maps a site
    partition to its group's model where the site's partitions are the model groups (``partitions_why``
    says whether and why): a recorded job keeps such a partition (Job.partition); otherwise it may run on
    any group whose model has its size. ``nodes``: the site's nodes of each group (one tuple on a site of one
    model), in name order, so the simulator's n-th node of a group (<group>-NN, nNN) stands for the n-th."""

    spec: object  # slurm_mig.sim.engine.ClusterSpec (engine imports this module)
    partitions: dict = field(default_factory=dict)
    partitions_why: str = ""
    nodes: tuple = ()

    def describe(self) -> str:
        """'1 x 2 H100-80GB' or '2 x 8 H100-80GB (partition h100) + 1 x 4 A30-24GB (partition a30)'."""
        spec = self.spec
        if not spec.groups:
            return f"{spec.nodes} x {spec.gpus_per_node} {spec.model}"
        return " + ".join(f"{g.nodes} x {g.gpus_per_node} {g.model}"
                          + (f" (partition {g.name})" if self.partitions else "") for g in spec.groups)


def replay_site(db: str | Path, command: str, harm: str, way_on: str = "") -> ReplaySite:
    """The site a state DB records, to replay its outcomes on (`policy retrain`, `simulate --db`), after
    site_cluster's check (a ConfigError when there is no MIG GPU the policy places on).

    One readable model: exactly site_cluster's cluster, ClusterSpec(nodes, GPUs per node, model). Several:
    a node group per model (its nodes, the most of it on one node), so a job that ran on an A30 is not
    replayed as if the site were all H100s. The DB does not record which nodes a Slurm partition holds
    (sinfo's answer is not kept), only each outcome's partition and node; where those show the partitions
    to be the model groups, one to one (every group's nodes ran jobs of one partition only, seen on no
    other group), each group is that partition and jobs keep theirs; otherwise the groups are named by
    model and a job may run on any group whose model has its size (a partition spanning models, a group
    with no recorded job, or none recorded: which nodes a partition holds cannot be told)."""
    from slurm_mig.sim.engine import ClusterSpec, NodeGroup

    groups, known = _site_groups(db, command, harm, way_on)
    nodes = tuple(tuple(sorted({n for n, m in known if m == model})) for model, _n, _g in groups)
    if len(groups) < 2:
        model, n_nodes, per_node = groups[0]
        return ReplaySite(ClusterSpec(n_nodes, per_node, model), nodes=nodes)
    parts, why = _partitions_of_groups(db, [m for m, _n, _g in groups], dict(known))
    if parts:
        by_model = {m: p for p, m in parts.items()}
        spec = ClusterSpec.mixed([NodeGroup(by_model[m], m, n, g) for m, n, g in groups])
    else:
        spec = ClusterSpec.mixed([NodeGroup(m, m, n, g) for m, n, g in groups])
    return ReplaySite(spec, parts, why, nodes)


def replay_partition(partitions: Mapping[str, str], recorded: str, kind: str) -> str:
    """The partition(s) a replayed job keeps on a mixed site (Job.partition): of those it was recorded in
    (``recorded``, comma-separated), the ones whose model (``partitions``: ReplaySite.partitions) has its size
    ``kind``, when every one of them is such a partition; else "" (any group whose model has its size)."""
    names = [p.strip() for p in str(recorded or "").split(",") if p.strip()]
    if not (partitions and names and all(p in partitions for p in names)):
        return ""
    return ",".join(p for p in names if _kind_on([get_model(partitions[p])], kind))


def _partitions_of_groups(db: str | Path, models: Sequence[str],
                          node_model: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """({partition: model}, why) when the outcomes show the site's partitions to be its model groups one to
    one (replay_site), else ({}, why not). Only outcomes of one partition on a node of the site count: a job
    submitted to several ("a,b") ran in one the DB does not say. ``node_model``: node -> its model (_site_gpus)."""
    from slurm_mig.store.db import sqlite_uri

    seen: dict[str, set[str]] = {}  # partition -> models its jobs ran on
    try:
        con = sqlite3.connect(sqlite_uri(db, "ro"), uri=True)
        try:
            cols = {r[1] for r in con.execute("PRAGMA table_info(outcomes)")}
            rows = (con.execute("SELECT DISTINCT node, partition FROM outcomes").fetchall()
                    if {"node", "partition"} <= cols else [])
        finally:
            con.close()
    except sqlite3.Error:
        rows = []
    for node, part in rows:
        m = node_model.get(str(node)) if node is not None else None
        part = str(part or "").strip()
        if m is None or not part or "," in part:
            continue
        seen.setdefault(part, set()).add(m)
    if not seen:
        return {}, "the outcomes record no partition on the site's nodes"
    spanning = sorted(p for p, ms in seen.items() if len(ms) > 1)
    if spanning:
        return {}, f"partition {spanning[0]} ran jobs on more than one model"
    per_model: dict[str, list[str]] = {}
    for p, ms in seen.items():
        per_model.setdefault(next(iter(ms)), []).append(p)
    for m in models:
        got = sorted(per_model.get(m, []))
        if len(got) != 1:
            return {}, (f"the {m} nodes ran jobs of " + (f"{len(got)} partitions ({', '.join(got)})" if got
                                                         else "no recorded partition"))
    return {ps[0]: m for m, ps in per_model.items()}, "each model's nodes ran the jobs of one partition"


def gpus_held(db: str | Path) -> str:
    """What the DB's gpus table holds, in words, for a refusal: how many GPUs, how many with MIG mode on."""
    from slurm_mig.store.db import sqlite_uri

    try:
        con = sqlite3.connect(sqlite_uri(db, "ro"), uri=True)
        try:
            n, on = con.execute("SELECT COUNT(*), COALESCE(SUM(mig_enabled = 1), 0) FROM gpus").fetchone()
        finally:
            con.close()
    except sqlite3.Error as exc:
        return f"cannot read its gpus table: {exc}"
    if not n:
        return "its gpus table is empty: no node has reported to the controller that wrote it"
    return (f"its gpus table holds {n} GPU(s), {on} with MIG mode on"
            + (", none of them of a model this slurm-mig's tables list with instances its table allows (a newer "
               "node's, kept blocked)" if on else ""))


def load_outcomes_db(
    path: str | Path,
    *,
    model: str = "H100-80GB",
    speed: SpeedModel = DEFAULT_SPEED,
    nodes: int = 1,
    gpus_per_node: int = 8,
    table: str = "outcomes",
    partitions: Mapping[str, str] | None = None,
) -> Workload:
    """Replay the jobs recorded in the state DB's ``outcomes`` table.

    Reads job_id, profile, count, submit_time, start_time, end_time (and
    time_limit_s, run_s, run when present) with a plain sqlite3 query. Each
    run of a reused job id is a job of its own: the first keeps the id, a
    later one is named ``<id>#<run>`` (the simulator keys jobs by id). Run time =
    run_s (or, without it, end_time - start_time: run_s leaves out the time a job
    spent suspended); submit_time falls back to start_time.
    Rows without a usable run time, with an unknown profile, or with a value
    that is not a number (text in a time column) are skipped and counted in
    ``meta["skipped"]``.

    ``model`` may name several models joined by "+" (a mixed site, ReplaySite.spec.model): a profile is
    read as the first that has it, and a size none has is skipped. ``partitions`` (site partition -> its
    model, ReplaySite.partitions): a job recorded in such partitions keeps those whose model has its size
    (Job.partition); any other job may run anywhere.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"state DB {path} does not exist")
    from slurm_mig.store.db import sqlite_uri

    try:
        con = sqlite3.connect(sqlite_uri(path, "ro"), uri=True)
    except sqlite3.Error as exc:
        raise ConfigError(f"cannot open state DB {path}: {exc}") from exc
    gpu_models = [get_model(m) for m in model.split("+")]
    partitions = dict(partitions or {})
    kept = 0
    skipped = {"no_run_time": 0, "unknown_profile": 0, "not_a_number": 0}
    jobs: list[Job] = []
    try:
        cols = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
        if not cols:
            raise ConfigError(f"{path} has no {table!r} table (is it a slurm-mig state DB?)")
        want = [c for c in ("job_id", "profile", "count", "submit_time", "start_time", "end_time",
                            "time_limit_s", "run_s", "run") if c in cols]
        if partitions and "partition" in cols:
            want.append("partition")
        if "job_id" not in want or "profile" not in want:
            raise ConfigError(f"{path}:{table} lacks job_id/profile columns")
        for row in con.execute(f"SELECT {', '.join(want)} FROM {table}"):
            r = dict(zip(want, row))
            try:  # SQLite keeps whatever a column was given: a text time must not end the whole replay
                r.update({k: _number(r.get(k)) for k in ("count", "submit_time", "start_time", "end_time",
                                                          "time_limit_s", "run_s", "run")})
            except ValueError:
                skipped["not_a_number"] += 1
                continue
            start, end = r.get("start_time"), r.get("end_time")
            # run_s first: it leaves out the time the job was suspended (end - start holds it), and is end - start
            # for every other row the controller wrote.
            run = r.get("run_s")
            if run is None and start is not None and end is not None:
                run = end - start
            if run is None or run <= 0:
                skipped["no_run_time"] += 1
                continue
            kind = _kind_on(gpu_models, str(r["profile"]))
            if kind is None:
                skipped["unknown_profile"] += 1
                continue
            part = replay_partition(partitions, r.get("partition") or "", kind) if partitions else ""
            kept += bool(part)
            submit = r.get("submit_time")
            if submit is None:
                submit = start if start is not None else 0.0
            nth = int(r.get("run") or 1)
            name = str(r["job_id"]) if nth <= 1 else f"{r['job_id']}#{nth}"
            jobs.append(Job(name, float(submit), kind, int(r.get("count") or 1), float(run),
                            r.get("time_limit_s"), speed, partition=part))
    except sqlite3.Error as exc:
        raise ConfigError(f"cannot read {table} from {path}: {exc}") from exc
    finally:
        con.close()
    t0 = min((j.submit_time for j in jobs), default=0.0)
    jobs = [replace(j, submit_time=j.submit_time - t0) for j in jobs]
    return Workload(f"replay:{path.name}", jobs, model, nodes, gpus_per_node,
                    {"source": str(path), "loaded": len(jobs), "rows": len(jobs) + sum(skipped.values()),
                     "skipped": skipped,
                     **({"partitioned": kept} if partitions else {})})


def _kind_on(models, profile: str) -> str | None:
    """The size (kind) of ``profile`` on the first of ``models`` that has it; None if none has."""
    for m in models:
        try:
            return m.profile(profile).kind
        except GeometryError:
            continue
    return None
