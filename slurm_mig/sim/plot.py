"""Timeline pictures of a simulation: each GPU's MIG instances, jobs and reconfigurations.

One horizontal band per GPU, its model's memory slices tall (8 on an H100, 4 on an A30; a mixed site's
rows are labelled with their model), slice 0 on top, first GPU on top. Grey:
an instance exists and is idle; coloured by size: a job runs on it; red: the
instance is being created or destroyed. A lower panel shows how many jobs wait.
``highlight`` outlines one job and marks when it was submitted, which answers
"why did my job wait?" at a glance. Needs matplotlib (``pip install slurm-mig[plot]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slurm_mig.errors import ConfigError
from slurm_mig.mig.profiles import get_model

COLORS = {"1g": "#4e79a7", "2g": "#59a14f", "3g": "#edc948", "4g": "#f28e2b", "7g": "#b07aa1"}


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'slurm-mig[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    return matplotlib


def check_plot_path(path: str) -> None:
    """Refuse a picture path matplotlib cannot write, before a simulation runs rather than after (its work
    lost to a traceback): a folder, a missing folder, a suffix that is no format it writes (none at all
    made it write ``path``.png while slurm-mig said ``path``)."""
    import os

    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if os.path.isdir(path):
        raise ConfigError(f"--plot {path}: is a folder, not a file name (e.g. {os.path.join(path, 'timeline.png')})")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ConfigError(f"--plot {path}: no folder {folder}")
    suffix = os.path.splitext(path)[1][1:].lower()
    if suffix not in formats:
        raise ConfigError(f"--plot {path}: expected a file name ending in a picture format matplotlib writes "
                          f"({', '.join('.' + f for f in sorted(formats))})")


@dataclass(frozen=True)
class Row:
    """One GPU's band: its model's memory slices tall (8 on an H100, 4 on an A30), from ``y0`` down."""

    gpu: str  # "node/index"
    model: str
    slices: int
    y0: float


@dataclass
class TimelineData:
    """What :func:`plot_timeline` draws: the GPUs' rows and each bar (x, width, y, height) in plot units."""

    rows: list[Row]
    hidden: int  # GPUs not drawn (max_gpus)
    lo: float
    hi: float
    unit: float
    unit_name: str
    bars: dict[tuple[str, str], list] = field(default_factory=dict)  # (kind, colour) -> [(x, w, y, h)]
    highlighted: list = field(default_factory=list)  # the highlighted job's bars
    queue: list = field(default_factory=list)  # [(x, jobs waiting)]: a step line from the window's start to its end

    @property
    def height(self) -> float:
        """The rows' extent: each GPU's slices plus a gap of 1.5."""
        return self.rows[-1].y0 + self.rows[-1].slices + 1.5 if self.rows else 0.0


def _gpu_models(result) -> dict[str, str]:
    """Node -> GPU model (each node group's own on a mixed site)."""
    return {node: model for node, model, _n, _p in result.spec.node_list()}


def timeline_data(result, *, t_from: float | None = None, t_to: float | None = None, max_gpus: int = 48,
                  highlight: str | None = None) -> TimelineData:
    """The rows and bars of ``result``'s timeline (a SimResult recorded with SimConfig(record=True)): one
    row per GPU, its own model's memory slices tall (a mixed site's A30 4, its H100 8), in the simulator's
    GPU order."""
    if not result.timeline:
        raise ConfigError("the simulation kept no timeline: run it with SimConfig(record=True)")
    node_model = _gpu_models(result)
    models = {name: get_model(name) for name in dict.fromkeys(node_model.values())}
    mem = {name: {p.name: p.memory_slices for p in m.profiles} for name, m in models.items()}
    kind = {name: {p.name: p.kind.split("+")[0].split(".")[0] for p in m.profiles} for name, m in models.items()}
    ends = [s.t1 for s in result.timeline if math.isfinite(s.t1)]
    lo = t_from if t_from is not None else 0.0
    hi = t_to if t_to is not None else (max(ends) if ends else 1.0)
    if hi <= lo:
        raise ConfigError(f"empty time window: from {lo} s to {hi} s")
    span = hi - lo
    unit, unit_name = (86400.0, "days") if span > 4 * 86400 else (3600.0, "hours") if span > 4 * 3600 else (60.0, "minutes")
    rank = {node: i for i, node in enumerate(node_model)}
    gpus = []
    for s in result.timeline:
        if s.gpu not in gpus:
            gpus.append(s.gpu)
    gpus.sort(key=lambda k: (rank.get(k.split("/")[0], len(rank)), k.split("/")[0], int(k.split("/")[1])))
    rows: list[Row] = []
    y0 = 0.0
    for g in gpus[:max_gpus]:
        model = node_model[g.split("/")[0]]
        rows.append(Row(g, model, models[model].memory_slices, y0))
        y0 += models[model].memory_slices + 1.5
    data = TimelineData(rows, len(gpus) - len(rows), lo, hi, unit, unit_name)
    row = {r.gpu: r for r in rows}
    for s in result.timeline:
        if s.gpu not in row:
            continue
        t0, t1 = max(s.t0, lo), min(s.t1, hi)
        if t1 <= t0 and not (s.kind in ("create", "destroy") and lo <= s.t0 <= hi):
            continue
        r = row[s.gpu]
        y = r.y0 + s.slot.start
        h = mem[r.model].get(s.slot.profile, 1) - 0.15
        color = {"instance": "#d9d9d9", "create": "#e15759", "destroy": "#e15759"}.get(
            s.kind, COLORS.get(kind[r.model].get(s.slot.profile, "7g"), "#888888"))
        w = max(t1 - t0, span / 1500) / unit if s.kind in ("create", "destroy") else (t1 - t0) / unit
        data.bars.setdefault((s.kind, color), []).append(((t0 - lo) / unit, w, y, h))
        if highlight and s.job_id == highlight:
            data.highlighted.append(((t0 - lo) / unit, w, y, h))
    data.queue = queue_steps(result.queue, lo, hi, unit)
    return data


def queue_steps(trace, lo: float, hi: float, unit: float) -> list[tuple[float, int]]:
    """The queue line of the window [lo, hi] from ``trace`` ((time, jobs waiting) after each decision, in time
    order): from lo at the length the queue had then (the last point at or before lo; 0 before the first),
    each change inside the window, held to hi. Started at the first point inside the window, the line left out
    the queue at --from until the next decision. Empty where nothing was recorded."""
    if not trace:
        return []
    start = 0
    for t, n in trace:
        if t > lo:
            break
        start = n
    pts = [(lo, start)] + [(t, n) for t, n in trace if lo < t <= hi]
    pts.append((hi, pts[-1][1]))
    return [((t - lo) / unit, n) for t, n in pts]


def plot_timeline(result, path: str, *, t_from: float | None = None, t_to: float | None = None,
                  max_gpus: int = 48, highlight: str | None = None, title: str | None = None) -> str:
    """Draw ``result`` (a SimResult recorded with SimConfig(record=True)) to ``path`` (PNG)."""
    require_matplotlib()
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    data = timeline_data(result, t_from=t_from, t_to=t_to, max_gpus=max_gpus, highlight=highlight)
    lo, hi, unit, unit_name = data.lo, data.hi, data.unit, data.unit_name
    span = hi - lo
    shown = [r.gpu for r in data.rows]
    mixed = bool(result.spec.groups)
    height = max(3.0, 0.32 * len(shown) + 2.2)
    fig, (ax, axq) = plt.subplots(2, 1, figsize=(14, height), sharex=True,
                                  gridspec_kw={"height_ratios": [max(4.0, len(shown) * 0.32), 1.2]})
    bars = data.bars
    hl = data.highlighted
    order = {"instance": 0, "job": 1, "create": 2, "destroy": 2}
    for (k, color), items in sorted(bars.items(), key=lambda kv: order.get(kv[0][0], 3)):
        by_y: dict[tuple[float, float], list] = {}
        for x, w, y, h in items:
            by_y.setdefault((y, h), []).append((x, w))
        for (y, h), xs in by_y.items():
            ax.broken_barh(xs, (y, h), facecolors=color, edgecolor="white" if k == "job" else "none",
                           linewidth=0.2, zorder=order.get(k, 3))
    for x, w, y, h in hl:
        ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="black", linewidth=1.8, zorder=5))
    if highlight:
        rec = next((r for r in result.jobs if r.job.job_id == highlight), None)
        if rec is not None and lo <= rec.job.submit_time <= hi:
            xs = (rec.job.submit_time - lo) / unit
            ax.axvline(xs, color="black", linestyle="--", linewidth=1)
            ax.text(xs, -0.4, f" {highlight} submitted", fontsize=8, va="top",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    ax.set_yticks([r.y0 + r.slices / 2 for r in data.rows])
    ax.set_yticklabels([f"{r.gpu} {r.model}" if mixed else r.gpu for r in data.rows],
                       fontsize=7 if len(shown) > 24 else 9)
    ax.set_ylim(data.height, -0.5)  # first GPU on top
    ax.set_xlim(0, span / unit)
    hidden = data.hidden
    cluster = (" + ".join(f"{n} x {m}" for m, n in result.spec.gpus_by_model().items()) if mixed
               else f"{result.spec.gpus} x {result.spec.model}")
    ax.set_title(title or f"{result.workload} - {result.policy}: {cluster}"
                 + (f" ({hidden} more GPUs not drawn)" if hidden else ""), loc="left", fontsize=11)
    legend = [Patch(color=c, label=f"job on {k}") for k, c in COLORS.items()]
    legend += [Patch(color="#d9d9d9", label="idle instance"), Patch(color="#e15759", label="create/destroy")]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if data.queue:
        axq.step([x for x, _ in data.queue], [n for _, n in data.queue], where="post", color="#333333",
                 linewidth=0.8)
    axq.set_ylabel("jobs\nwaiting", fontsize=8)
    axq.set_xlabel(f"time since {lo / unit:.1f} {unit_name} ({unit_name})")
    axq.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
