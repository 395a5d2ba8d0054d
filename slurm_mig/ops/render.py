"""Text rendering of the operator views: GPU slice bars, compact node bars, tables, the timeline.

Every function returns rich ``Text`` lines (or plain strings) cropped to the width asked for, so a
screen of them never wraps: the dashboard stays readable at 80x24 over SSH, and the same lines are
what ``slurm-mig nodes`` and ``explain`` print (rich drops the colours when output is not a terminal).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from rich.cells import cell_len, set_cell_size
from rich.text import Text

from slurm_mig.controlchars import visible

from slurm_mig.ops.fmt import fmt_clock, fmt_duration, is_number
from slurm_mig.ops.views import kind_sort_key

STYLE = {
    "busy": "bold white on red3",
    "idle": "black on green3",
    "reconfiguring": "black on yellow3",
    "creating": "black on yellow3",
    "free": "grey50",
    "title": "bold cyan",
    "rule": "cyan",
    "dim": "grey62",
    "warn": "bold yellow",
    "bad": "bold red",
    "ok": "green",
}

# Every field we print goes through safe (rich keeps ESC in Text, so the dashboard needs it as much as
# print does): anyone who can name a job (sbatch -J) chose some of them.
safe = visible


def safe_tree(value):
    """A copy of a view (dicts, lists, tuples) whose strings went through :func:`safe`: what the
    text output of the ops commands renders; the JSON output keeps the stored values."""
    if isinstance(value, str):
        return safe(value)
    if isinstance(value, dict):
        return {safe_tree(k): safe_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [safe_tree(v) for v in value]
    if isinstance(value, tuple):
        items = [safe_tree(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


NODE_STATE_STYLE = {"up": "green", "down": "bold red", "drain": "bold yellow", "unknown": "grey62",
                    "stale": "bold yellow"}


class Glyphs:
    """Characters for the bars; ASCII for terminals without UTF-8."""

    def __init__(self, ascii_only: bool = False):
        self.ascii = ascii_only
        self.sep = ":" if ascii_only else "·"
        self.free = "." if ascii_only else "·"
        self.arrow = "->" if ascii_only else "→"
        self.rule = "-" if ascii_only else "─"
        self.ell = "~" if ascii_only else "…"
        self.cont = {"busy": "#", "idle": "-", "reconfiguring": "~", "creating": "+"}


def crop(text: Text | str, width: int, g: "Glyphs | None" = None) -> Text:
    """``text`` cut to ``width`` cells, ending in an ellipsis when cut (a plain cut in ASCII mode)."""
    t = text if isinstance(text, Text) else Text(text)
    t = t.copy()
    t.truncate(max(0, width), overflow="crop" if (g is not None and g.ascii) else "ellipsis")
    return t


def rule(title: str, width: int, g: Glyphs, right: str = "") -> Text:
    """``── Title ─────────── right ──``"""
    t = Text(g.rule * 2 + " ", style=STYLE["rule"])
    t.append(title, style=STYLE["title"])
    t.append(" ", style=STYLE["rule"])
    tail = (" " + right + " " + g.rule * 2) if right else ""
    fill = width - t.cell_len - len(tail)
    t.append(g.rule * max(0, fill), style=STYLE["rule"])
    if tail:
        t.append(" " + right + " ", style=STYLE["dim"])
        t.append(g.rule * 2, style=STYLE["rule"])
    return crop(t, width, g)


def _fit(label_options: Sequence[str], width: int) -> str:
    for lab in label_options:
        if len(lab) <= width:
            return lab
    return label_options[-1][:max(0, width)]


def instance_label(inst: dict, width: int, g: Glyphs) -> str:
    """The words inside an instance's box, shortened to fit: ``3g·job12·alice`` ... ``3g``."""
    kind = inst["kind"]
    s = g.sep
    if inst.get("state") == "creating":
        return _fit([f"+{kind} creating", f"+{kind} new", f"+{kind}", kind], width)
    if inst.get("state") == "reconfiguring":
        act = inst.get("pending_action") or "reconf"
        return _fit([f"{kind} {act}ing".replace("destroying", "destroy"), f"{kind} ~{act[:3]}", f"{kind}~", kind],
                    width)
    if inst.get("job_id"):
        job, user = str(inst["job_id"]), inst.get("user") or ""
        opts = [f"{kind}{s}job{job}{s}{user}" if user else f"{kind}{s}job{job}",
                f"{kind}{s}{job}{s}{user}" if user else f"{kind}{s}{job}", f"{kind}{s}{job}", kind]
        return _fit(opts, width)
    if inst.get("state") == "busy":
        return _fit([f"{kind} in use", f"{kind} busy", kind], width)
    return _fit([f"{kind} idle", kind], width)


def gpu_bar(gpu: dict, width: int, g: Glyphs, color: bool = True) -> Text:
    """One GPU as its memory slices, each instance a box: ``[3g·job12·alice    ][2g idle ][1g]·``.

    ``width`` is the whole bar; every memory slice gets ``width // slices`` columns.
    """
    slices = gpu.get("slices") or 0
    if gpu.get("status") == "lost":  # fallen off the bus (views.gpu_view)
        return crop(Text(f"lost: fell off the bus ({gpu.get('name') or gpu.get('model') or 'unknown GPU'})",
                         style=STYLE["bad"]), width, g)
    if not gpu.get("mig_enabled"):
        return crop(Text(f"MIG off ({gpu.get('name') or gpu.get('model') or 'unknown GPU'})", style=STYLE["warn"]),
                    width, g)
    if slices <= 0:
        return crop(unreadable_gpu_text(gpu, g, color), width, g)
    cell = max(1, width // slices)
    # Existing instances first; an instance being created shows on the slices it covers that are
    # free now (it may overlap instances still being destroyed).
    owner: list[dict | None] = [None] * slices
    for i in sorted(gpu["instances"], key=lambda i: i["start"]):
        for k in range(i["start"], min(slices, i["start"] + i["size"])):
            owner[k] = i
    for c in gpu["creating"]:
        box = {**c, "state": "creating"}
        for k in range(c["start"], min(slices, c["start"] + c["size"])):
            if owner[k] is None:
                owner[k] = box
    t = Text()
    k = 0
    while k < slices:
        inst = owner[k]
        run = 1
        while k + run < slices and owner[k + run] is inst:
            run += 1
        if inst is None:
            t.append(g.free * (run * cell), style=STYLE["free"])
        else:
            w = run * cell
            state = inst.get("state", "idle")
            style = STYLE.get(state, "") if color else ""
            if w >= 3:
                inner = w - 2
                t.append("[", style=style)
                t.append(instance_label(inst, inner, g).ljust(inner), style=style)
                t.append("]", style=style)
            else:
                t.append(inst["kind"][:w].ljust(w), style=style)
        k += run
    return crop(t, width, g)


def unreadable_gpu_text(gpu: dict, g: Glyphs, color: bool = True) -> Text:
    """A GPU whose slices this controller cannot place (a model its tables lack, or instances its table does not
    allow: views.gpu_view's geometry_known false): its instances by name, start and job, in their states'
    colours, never drawn on slices: ``blocked (off-table): 3g.40gb+gfx@0·job5·alice, 3g.40gb@4 idle``."""
    if gpu.get("status") == "unknown-model" or not gpu.get("model"):
        head = f"unknown model {gpu.get('model')!r}" if gpu.get("model") else "no model named"
    else:
        head = "blocked (off-table)"
    t = Text(head + ":", style=STYLE["warn"] if color else "")
    insts = sorted(gpu.get("instances") or [], key=lambda i: i["start"])
    for k, i in enumerate(insts):
        t.append("," if k else "")
        t.append(" ")
        name = f"{i['profile']}@{i['start']}"
        if i.get("job_id"):
            label = g.sep.join([name, f"job{i['job_id']}"] + ([i["user"]] if i.get("user") else []))
        elif i.get("state") == "busy":
            label = f"{name} in use"
        elif i.get("state") == "reconfiguring":
            label = f"{name} {i.get('pending_action') or 'reconf'}"
        else:
            label = f"{name} idle"
        t.append(label, style=STYLE.get(i.get("state", ""), "") if color else "")
    if not insts:
        t.append(" no instances")
    return t


def mini_bar(gpu: dict, g: Glyphs) -> Text:
    """A GPU in one character per memory slice: the kind's digit where an instance starts, then
    ``#`` busy, ``-`` idle, ``~`` reconfiguring, ``+`` being created, ``.`` not carved."""
    slices = gpu.get("slices") or 0
    if gpu.get("status") == "lost":
        return Text("lost".ljust(max(4, slices)), style=STYLE["warn"])
    if not gpu.get("mig_enabled"):
        return Text("off".ljust(max(3, slices)), style=STYLE["warn"])
    if slices <= 0:  # slices not counted: its geometry is unknown here (unreadable_gpu_text)
        return Text("???", style=STYLE["warn"])
    cells: list[tuple[str, str]] = [(g.free, "free")] * slices
    items = [(i["start"], i["size"], i["kind"], i["state"]) for i in gpu["instances"]]
    items += [(c["start"], c["size"], c["kind"], "creating") for c in gpu["creating"]]
    for start, size, kind, state in sorted(items):
        head = kind[0]
        for k in range(size):
            if 0 <= start + k < slices:
                cells[start + k] = (head if k == 0 else g.cont.get(state, "?"), state)
    t = Text()
    for ch, state in cells:
        t.append(ch, style=STYLE.get(state, ""))
    return t


def node_state_text(node: dict) -> Text:
    st = node["state"]
    if st == "up" and node.get("stale"):
        st = "stale"
    return Text(st, style=NODE_STATE_STYLE.get(st, ""))


def gpu_lines(nodes: list[dict], width: int, g: Glyphs, *, name_width: int | None = None) -> list[Text]:
    """One line per GPU: ``n1    up  0 [3g·job1·root      ][2g idle][1g]``; the node on its first GPU."""
    name_width = name_width or min(12, max([len(n["name"]) for n in nodes] + [2]))
    gpu_w = max([len(str(x["gpu"])) for n in nodes for x in n["gpus"]] + [1])
    lines: list[Text] = []
    for n in nodes:
        if not n["gpus"]:
            continue
        for k, gpu in enumerate(n["gpus"]):
            t = Text()
            if k == 0:
                t.append(n["name"][:name_width].ljust(name_width), style="bold")
                t.append(" ")
                st = node_state_text(n)
                st.truncate(5)
                t.append_text(st)
                t.append(" " * (5 - st.cell_len))
            else:
                t.append(" " * (name_width + 6))
            t.append(f" {str(gpu['gpu']).rjust(gpu_w)} ")
            rest = width - t.cell_len
            # leave room for a target marker when the GPU is being reconfigured
            rc = gpu.get("reconfiguration")
            marker = ""
            if rc:
                marker = f" {g.arrow}{rc['to']}" if rc["state"] == "in_progress" else f" plan{g.arrow}{rc['to']}"
            elif gpu.get("held_for"):
                marker = f" held:{','.join(gpu['held_for'])}"
            slices = gpu.get("slices") or 8
            bar_w = rest
            if marker and rest - len(marker) >= slices * 3:
                bar_w = rest - len(marker)
            bar_w = (bar_w // slices) * slices if slices else bar_w
            t.append_text(gpu_bar(gpu, bar_w, g))
            if marker and t.cell_len + len(marker) <= width:
                t.append(marker, style=STYLE["warn"])
            lines.append(crop(t, width, g))
    return lines


def node_summary_line(n: dict, width: int, g: Glyphs, name_width: int) -> Text:
    """A node in one line: name, state, a mini bar per GPU, busy share."""
    t = Text()
    t.append(n["name"][:name_width].ljust(name_width), style="bold")
    t.append(" ")
    st = node_state_text(n)
    st.truncate(5)
    t.append_text(st)
    t.append(" " * (6 - st.cell_len))
    tail = f" {round(100 * n['busy_fraction']):3d}%"
    room = width - t.cell_len - len(tail)
    for k, gpu in enumerate(n["gpus"]):
        mb = mini_bar(gpu, g)
        need = mb.cell_len + (1 if k else 0)
        if room < need + (1 if k < len(n["gpus"]) - 1 else 0):
            t.append(g.ell, style=STYLE["dim"])
            room -= 1
            break
        if k:
            t.append(" ")
        t.append_text(mb)
        room -= need
    t.append(" " * max(0, room))
    t.append(tail, style=STYLE["dim"])
    return crop(t, width, g)


# The narrowest a table cuts a column to (or its header's width) when the line is too short for all of them.
MIN_COLUMN = 12


def table(rows: Sequence[Sequence[str]], header: Sequence[str], width: int, *, flex: int = -1,
          align: str | None = None, ascii_only: bool = False) -> list[str]:
    """A plain aligned table; column ``flex`` (default: the last) takes what is left and is cropped.

    Measured in terminal cells, not characters: a CJK or emoji character (a user, a reason) takes two. When the
    table is wider than ``width``, the widest other columns but the first (the key) are cut first, down to
    ``MIN_COLUMN`` cells or their header, so that ``flex`` keeps up to a third of the line: one wide cell (a job on
    seven instances, a long user name) must not take the reasons of every row off the screen. Columns that fit in
    ``MIN_COLUMN`` (a state, a wait) are never cut: on a line too short for them all, it is cut at its end."""
    cols = len(header)
    flex = flex % cols
    align = align or "l" * cols
    widths = [cell_len(h) for h in header]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], cell_len(str(c)))
    gaps = 2 * (cols - 1)
    need = min(widths[flex], max(cell_len(header[flex]), width // 3))
    floor = [widths[0]] + [min(w, max(cell_len(h), MIN_COLUMN)) for w, h in zip(widths[1:], header[1:])]
    excess = sum(w for i, w in enumerate(widths) if i != flex) + gaps + need - width
    while excess > 0:
        cut = [i for i in range(cols) if i != flex and widths[i] > floor[i]]
        if not cut:
            break
        i = max(cut, key=lambda k: widths[k])
        second = max([widths[k] for k in cut if k != i] + [floor[i]])
        step = min(excess, widths[i] - second or 1)
        widths[i] -= step
        excess -= step
    fixed = sum(w for i, w in enumerate(widths) if i != flex) + gaps
    widths[flex] = max(4, min(widths[flex], width - fixed))

    def line(r: Sequence[str]) -> str:
        parts = []
        for i, c in enumerate(r):
            c = str(c)
            if cell_len(c) > widths[i]:
                c = set_cell_size(c, max(0, widths[i] - 1)).rstrip(" ") + ("~" if ascii_only else "…")
            pad = " " * max(0, widths[i] - cell_len(c))
            parts.append(pad + c if align[i] == "r" else c + pad)
        out = "  ".join(parts).rstrip()
        return set_cell_size(out, width).rstrip(" ") if cell_len(out) > width else out
    return [line(header)] + [line(r) for r in rows]


# -- timeline ------------------------------------------------------------------------------

def render_timeline(segments: Iterable, t0: float, t1: float, width: int, *, job_id: str | None = None,
                    submit: float | None = None, start: float | None = None, g: Glyphs | None = None) -> list[str]:
    """An ASCII timeline: one row per GPU instance slot, one column per time step.

    ``segments`` are ``Segment``-like objects or dicts with gpu, kind, slot, t0, t1, job_id (the
    simulator's ``SimResult.timeline`` works as is). ``#`` the job asked about, ``=`` other jobs,
    ``-`` instance exists, ``x`` being destroyed, ``+`` being created; a first ``queue`` row shows
    ``w`` while the job waited (from ``submit`` to ``start``).
    """
    g = g or Glyphs()
    if not (is_number(t0) and is_number(t1)):  # text or a blob where a time was stored
        return [f"no timeline: its times ({fmt_clock(t0)} .. {fmt_clock(t1)}) are not usable"]
    segs = [s if isinstance(s, dict) else {"gpu": s.gpu, "kind": s.kind, "slot": None if s.slot is None else str(s.slot),
                                           "t0": s.t0, "t1": s.t1, "job_id": getattr(s, "job_id", "")}
            for s in segments]
    # A span whose ends are not numbers (text, a blob) has no place on it; nor has a wait from or to such a time.
    segs = [s for s in segs if is_number(s["t0"]) and is_number(s["t1"])]
    submit = submit if is_number(submit) else None
    start = start if is_number(start) else None
    t1 = max(t1, t0 + 1e-6)
    label_w = max([len(f"{s['gpu']} {s['slot']}") for s in segs] + [len("queue")])
    cols = max(10, width - label_w - 2)
    step = (t1 - t0) / cols
    if not (math.isfinite(t0) and math.isfinite(step) and step > 0):
        # Times no timeline can span (1e300, infinity: a row a person or a bug wrote).
        return [f"no timeline: its times ({fmt_clock(t0)} .. {fmt_clock(t1)}) are not usable"]

    def col(t: float) -> int:
        x = (t - t0) / step
        if x >= cols:
            return cols - 1
        return int(x) if x > 0 else 0  # (NaN and minus infinity too)

    rows: dict[str, list[str]] = {}
    prio = {" ": 0, "-": 1, "=": 2, "x": 3, "+": 3, "#": 4}
    keyorder = sorted({(s["gpu"], s["slot"]) for s in segs if s["slot"]},
                      key=lambda k: (k[0], int(str(k[1]).rpartition("@")[2] or 0), k[1]))
    for gpu, slot in keyorder:
        rows[f"{gpu} {slot}"] = [" "] * cols
    for s in segs:
        if not s["slot"]:
            continue
        ch = {"instance": "-", "create": "+", "destroy": "x", "reconfig": "~"}.get(s["kind"], "=")
        if s["kind"] == "job":
            ch = "#" if job_id is not None and str(s.get("job_id")) == str(job_id) else "="
        row = rows[f"{s['gpu']} {s['slot']}"]
        a, b = col(s["t0"]), col(max(s["t0"], s["t1"] - 1e-9))
        for c in range(a, b + 1):
            if prio.get(ch, 1) >= prio.get(row[c], 0):
                row[c] = ch
    out = []
    span = f"{fmt_clock(t0)} .. {fmt_clock(t1)}, one column = {fmt_step(step)}"
    out.append(span)
    if submit is not None:
        q = [" "] * cols
        end = start if start is not None else t1
        for c in range(col(submit), col(end) + 1):
            q[c] = "w"
        if start is not None:
            q[col(start)] = ">"
        out.append("queue".ljust(label_w) + " |" + "".join(q))
    for label, row in rows.items():
        out.append(label.ljust(label_w) + " |" + "".join(row))
    out.append("legend: w waiting  > started  # this job  = other job  - instance  x destroy  + create")
    return out


def fmt_step(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return fmt_duration(seconds)


def profile_table_rows(profiles: list[dict]) -> list[list[str]]:
    rows = []
    for p in sorted(profiles, key=lambda p: kind_sort_key(p["profile"])):
        rows.append([p["profile"], str(p["total"]), str(p["busy"]), str(p["idle"]), str(p["reconfiguring"]),
                     str(p["pending_jobs"]) if p["pending_jobs"] else "-",
                     fmt_duration(p["oldest_wait_s"]) if p["oldest_wait_s"] is not None else "-"])
    return rows


def pages(n_items: int, per_page: int) -> int:
    return max(1, math.ceil(n_items / max(1, per_page)))
