"""`slurm-mig top`: a live dashboard of every GPU's MIG carving, the queue and the controller's reasons.

One screen, built to be read at 3 a.m. over SSH on an 80x24 terminal:

* header: the controller's health (last tick, /healthz), node states with the names of those in
  trouble, slice use, instance counts, queue length;
* GPUs: one line per GPU, drawn as its memory slices with each instance's box, profile, job and
  user, coloured busy / idle / being reconfigured, and the target layout of a reconfiguration;
  with more GPUs than fit, a per-profile summary and one line per node (busiest, most fragmented
  and troubled nodes first), paged;
* pending: the queue by profile with wait times, and why each job waits;
* recent: decisions and reconfigurations with their reasons, requeues, GRES re-assertions.

Keys: q quit, n/space/PgDn next page, p/PgUp previous page, v switch GPU bars / summary, r refresh.
``--once`` prints a single frame and exits (for scripts and tests).
"""

from __future__ import annotations

import http.client
import os
import select
import sys
import time
from dataclasses import dataclass, field

from rich.text import Text

from slurm_mig.ops import fmt as F
from slurm_mig.ops import render as R
from slurm_mig.ops import views as V
from slurm_mig.terminal import stdout_is_a_terminal

VIEWS = ("auto", "gpus", "summary")


@dataclass
class TopOptions:
    width: int = 80
    height: int = 24
    page: int = 1  # 1-based
    view: str = "auto"
    nodes: str | None = None  # hostlist / glob filter
    partition: str | None = None
    ascii: bool = False
    tick_interval_s: float = 5.0
    stale_after_s: float = 120.0


@dataclass
class Frame:
    lines: list[Text]
    mode: str  # "gpus" | "summary"
    page: int
    pages: int
    info: dict = field(default_factory=dict)

    def plain(self) -> str:
        return "\n".join(t.plain for t in self.lines)


def _wants(job: dict) -> str:
    return f"{job['count']}x{job['profile']}" if job["count"] != 1 else job["profile"]


def _header(snap: V.Snapshot, status: dict, nodes: list[dict], opts: TopOptions, g: R.Glyphs,
            width: int) -> list[Text]:
    c = status["controller"]
    t = Text()
    t.append("slurm-mig top", style="bold")
    t.append(f" {F.fmt_clock(snap.now)}  controller ")
    style = {"ok": "green", "stale": "bold yellow", "unknown": "grey62"}.get(c["state"], "bold red")
    t.append(c["state"], style=style)
    if c["tick_age_s"] is not None:
        t.append(f", tick {F.fmt_duration(c['tick_age_s'])} ago", style=style if c["state"] != "ok" else "")
    if c["healthz"] is False:
        t.append(", API DOWN", style=R.STYLE["bad"])
    if c["open_reconfigurations"]:
        t.append(f"  reconf {c['open_reconfigurations']}", style=R.STYLE["warn"])
    last = c.get("last_decision")
    if last:
        t.append(f"  {last['policy']}", style=R.STYLE["dim"])
        if last.get("latency_ms") is not None:
            t.append(f" {F.fmt_num(last['latency_ms'])}ms", style=R.STYLE["dim"])

    s = Text()
    gp = status["gpus"]
    s.append(f"GPUs {gp['total']} {round(100 * gp['busy_fraction'])}% busy  ")
    inst = status["instances"]
    s.append("busy", style=R.STYLE["busy"])
    s.append(f" {inst['busy']} ")
    s.append("idle", style=R.STYLE["idle"])
    s.append(f" {inst['idle']} ")
    s.append("reconf", style=R.STYLE["reconfiguring"])
    s.append(f" {inst['reconfiguring']}  ")
    s.append(f"queue {status['jobs']['pending']}", style="bold" if status["jobs"]["pending"] else "")
    gpu_nodes = [n for n in nodes if n["gpus"]]
    up = sum(1 for n in gpu_nodes if n["state"] == "up" and not n["stale"])
    s.append(f"  nodes {up}/{len(gpu_nodes)} up")
    bad = [n for n in gpu_nodes if n["state"] != "up" or n["stale"]
           or (n["health"] not in ("ok", "unknown", "") and n["health"])]
    if bad:
        def what(n: dict) -> str:
            if n["state"] == "up" and n["stale"]:
                return "stale"
            return n["state"] if n["state"] != "up" else str(n["health"])[:20]
        s.append(": " + ", ".join(f"{n['name']} {what(n)}" for n in bad[:8]), style=R.STYLE["bad"])
    return [R.crop(t, width, g), R.crop(s, width, g)]


def _pending_rows(pending: list[dict], rows: int, width: int, now: float, g: R.Glyphs) -> list[Text]:
    if rows <= 0 or not pending:
        return []
    shown = pending if len(pending) <= rows else pending[: rows - 1]
    table_rows = []
    for j in shown:
        why = j["reason"] or ""
        if j.get("reserved"):
            r = j["reserved"]
            node = str(r.get("node"))
            if node not in why:
                where = ",".join(f"{node}/{gi}:{p}@{st}" for gi, p, st in r.get("instances", []))
                why = f"placed on {where}" + (f"; {why}" if why else "")
        if j["state"] == "REQUEUED":
            why = "requeued: " + why
        table_rows.append([j["job_id"], j["user"] or "-", _wants(j), F.fmt_duration(j["wait_s"]), why or "-"])
    lines = [Text(x) for x in R.table(table_rows, ["JOB", "USER", "WANTS", "WAIT", "WHY"], width, align="lllrl",
                                      ascii_only=g.ascii)]
    lines[0].stylize("bold")
    if len(pending) > len(shown):
        lines.append(Text(f"  ... {len(pending) - len(shown)} more pending", style=R.STYLE["dim"]))
    return lines[: rows + 1]


def _recent_rows(items: list[dict], rows: int, width: int, now: float, g: R.Glyphs) -> list[Text]:
    out = []
    for it in items[: max(0, rows)]:
        t = Text()
        t.append(F.fmt_when(it["time"], now), style=R.STYLE["dim"])
        style = {"reconfig": "yellow", "decision": "cyan", "requeue": "bold red", "bind-failed": "bold red",
                 "policy": "bold red", "conflict": "bold red", "gres": "magenta"}.get(it["kind"], "")
        t.append(f" {it['kind'][:8]:<8} ", style=style)
        t.append(it["text"])
        if it.get("reason"):
            t.append(f" - {it['reason']}", style=R.STYLE["dim"])
        out.append(R.crop(t, width, g))
    return out


def _paginate_gpus(nodes: list[dict], per_page: int) -> list[list[dict]]:
    """Split nodes into pages of at most ``per_page`` GPU lines (a big node may span pages)."""
    pages: list[list[dict]] = [[]]
    used = 0
    for n in nodes:
        gpus = list(n["gpus"])
        while gpus:
            room = per_page - used
            if room <= 0 or (used and len(gpus) > room and len(gpus) <= per_page):
                pages.append([])
                used, room = 0, per_page
            take, gpus = gpus[:room], gpus[room:]
            pages[-1].append({**n, "gpus": take})
            used += len(take)
    return pages if pages[0] else [[]]


def build_frame(snap: V.Snapshot, opts: TopOptions, *, partition_nodes: set[str] | None = None,
                healthz: bool | None = None) -> Frame:
    """One dashboard frame as lines of at most ``opts.width`` cells, at most ``opts.height`` lines."""
    W, H = max(40, opts.width), max(12, opts.height)
    g = R.Glyphs(opts.ascii)
    all_nodes = V.node_views(snap, nodes=opts.nodes, only=partition_nodes)
    status = V.status_view(snap, tick_interval_s=opts.tick_interval_s, healthz=healthz, nodes=all_nodes)
    bound = snap.bound_jobs()
    pending = [V.job_dict(j, snap.now, snap.reservations.get(j.job_id), bound=j.job_id in bound)
               for j in snap.pending]
    if opts.partition:
        pending = [j for j in pending if j["partition"] == opts.partition]
    items = V.recent_activity(snap, limit=H)
    all_nodes, status, pending, items = R.safe_tree((all_nodes, status, pending, items))
    nodes = [n for n in all_nodes if n["gpus"]]
    lines = _header(snap, status, all_nodes, opts, g, W)
    footer = Text()
    footer.append("q", style="bold")
    footer.append(" quit ")
    footer.append("n/p", style="bold")
    footer.append(" page ")
    footer.append("v", style="bold")
    footer.append(" view  ")
    for st, lab in (("busy", "busy"), ("idle", "idle"), ("reconfiguring", "reconf")):
        footer.append(f"[{lab}]", style=R.STYLE[st])
        footer.append(" ")
    footer.append(f"{g.free} uncarved", style=R.STYLE["free"])
    filt = []
    if opts.nodes:
        filt.append(f"node={opts.nodes}")
    if opts.partition:
        filt.append(f"partition={opts.partition}")
    if filt:
        footer.append("  " + " ".join(filt), style=R.STYLE["warn"])

    avail = H - len(lines) - 1  # header and footer
    n_gpu_lines = sum(len(n["gpus"]) for n in nodes)
    P = len(pending)
    pend_min = 0 if P == 0 else 1 + min(P, 3) + (1 if P > 3 else 0)  # table header + rows (+ "more")
    recent_min = min(len(items), 2)
    fixed_rules = 3  # GPUs/Nodes, Pending, Recent
    gpu_room = avail - fixed_rules - pend_min - recent_min
    mode = opts.view
    if mode == "auto":
        # Bars when they fit, or when the operator named the nodes to look at (then paged).
        mode = "gpus" if (n_gpu_lines <= max(1, gpu_room) or opts.nodes) else "summary"

    body: list[Text] = []
    page, pages = 1, 1
    if mode == "gpus":
        per_page = max(1, gpu_room)
        page_list = _paginate_gpus(nodes, per_page)
        pages = len(page_list)
        page = min(max(1, opts.page), pages)
        shown = page_list[page - 1]
        name_w = min(12, max([len(n["name"]) for n in nodes] + [2]))
        # A filter that matches nothing is the operator's typo, not agents that are down.
        empty = ("  no nodes match " + " ".join(filt)) if filt and not all_nodes else \
            "  no GPUs reported yet (are the node agents running?)"
        gl = R.gpu_lines(shown, W, g, name_width=name_w) if shown else [Text(empty, style=R.STYLE["warn"])]
        right = f"page {page}/{pages}" if pages > 1 else f"{len(nodes)} nodes"
        others = [n["name"] for n in all_nodes if not n["gpus"]]
        if others and pages == 1:
            right = f"no GPUs: {','.join(others[:3])}{g.ell if len(others) > 3 else ''}  " + right
        body.append(R.rule("GPUs", W, g, right))
        body.extend(gl)
        spare = gpu_room - len(gl)
    else:
        profiles = status["profiles"]
        prow = R.profile_table_rows(profiles)
        ptab = R.table(prow, ["PROFILE", "TOTAL", "BUSY", "IDLE", "RECONF", "PENDING", "OLDEST WAIT"], W,
                       align="lrrrrrr", ascii_only=g.ascii)
        body.append(R.rule("Instances by profile", W, g, f"{status['gpus']['total']} GPUs"))
        body.append(Text(ptab[0], style="bold"))
        for line in ptab[1:]:
            body.append(Text(line))
        node_room = max(1, gpu_room - 1 - len(ptab))
        hot = V.hot_nodes(nodes)
        pages = R.pages(len(hot), node_room)
        page = min(max(1, opts.page), pages)
        chunk = hot[(page - 1) * node_room: page * node_room]
        name_w = min(12, max([len(n["name"]) for n in nodes] + [2]))
        body.append(R.rule("Nodes: troubled, busiest, most fragmented", W, g, f"page {page}/{pages}"))
        body.extend(R.node_summary_line(n, W, g, name_w) for n in chunk)
        spare = node_room - len(chunk)

    # The queue: by profile in the rule, then the jobs (oldest first in queue order).
    # Jobs Slurm will not start yet stay listed (with why) but are no demand, as in the header's queue count:
    # a job held for a week is not its profile's oldest wait.
    queued = [j for j in pending if not j["blocked"]]
    by_prof = V.pending_by_profile(queued)
    right = "  ".join(f"{p['profile']}x{p['jobs']} {F.fmt_duration(p['oldest_wait_s'])}" for p in by_prof)
    held = f" (+{P - len(queued)} Slurm will not start yet)" if P > len(queued) else ""
    body.append(R.rule(f"Pending {len(queued)}{held}", W, g, right if P else "queue empty"))
    pend_rows = min(P, 3 + max(0, spare)) if P else 0
    if P > pend_rows:
        pend_rows = max(1, pend_rows - 1)
    pl = _pending_rows(pending, pend_rows, W, snap.now, g)
    body.extend(pl)
    used = len(lines) + len(body) + 1 + 1  # + recent rule + footer
    recent_rows = max(0, H - used)
    body.append(R.rule("Recent decisions and reconfigurations", W, g))
    body.extend(_recent_rows(items, recent_rows, W, snap.now, g))
    lines.extend(body)
    lines = lines[: H - 1]
    while len(lines) < H - 1:
        lines.append(Text(""))
    lines.append(R.crop(footer, W, g))
    return Frame(lines, mode, page, pages, {"gpu_lines": n_gpu_lines, "pending": P, "nodes": len(nodes)})


# -- the live loop ---------------------------------------------------------------------------

def probe_healthz(cfg, timeout: float = 0.5) -> bool | None:
    """GET /healthz on the controller's API: True only for the controller's own answer (200 and HEALTHZ_BODY);
    None when no config says where it is.

    Any 200 read as ok: a web server or another service on the port, or a proxy's page, passed for a live
    controller. The request goes straight to the port, never through $http_proxy: a proxy cannot reach the
    head node's 127.0.0.1 and may answer 200 itself."""
    from slurm_mig.api import HEALTHZ_BODY
    from slurm_mig.api.client import direct_opener

    if cfg is None:
        return None
    host = cfg.controller.listen_host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    try:
        with direct_opener().open(f"http://{host}:{cfg.controller.listen_port}/healthz", timeout=timeout) as r:
            return r.status == 200 and r.read(len(HEALTHZ_BODY) + 1) == HEALTHZ_BODY
    except (OSError, http.client.HTTPException, ValueError):
        # Down; something there that does not speak HTTP; or (ValueError) a listen_host urllib cannot put in
        # a URL, "head-node:7677", which the controller itself refuses at its start
        return False


class PartitionNodes:
    """Names of a partition's nodes from sinfo, refreshed every ``every_s``."""

    def __init__(self, cfg, partition: str | None, every_s: float = 30.0):
        self.cfg, self.partition, self.every_s = cfg, partition, every_s
        self._at, self._names = 0.0, None
        #: why the last lookup failed (None when it worked): sinfo missing, failing or timing out
        self.error: str | None = None

    def get(self) -> set[str] | None:
        if not self.partition:
            return None
        if self._names is None or time.time() - self._at > self.every_s:
            from slurm_mig.slurm.runner import SlurmClient

            try:
                nodes = SlurmClient.from_config(self.cfg).nodes() if self.cfg else None
                self.error = None if nodes is not None else "sinfo failed (see the message above)"
            except Exception as exc:  # sinfo missing or failing: keep what we had
                nodes = None
                self.error = f"{type(exc).__name__}: {exc}"
            if nodes is not None:
                self._names = {n.name for n in nodes if self.partition in n.partitions}
            elif self._names is None:
                self._names = set()
            self._at = time.time()
        return self._names

    def get_or_fail(self) -> set[str] | None:
        """get(), but a SlurmMigError when Slurm could not be asked and no earlier answer is known:
        an empty set would read as "the partition has no nodes"."""
        names = self.get()
        if self.partition and self.error is not None and not names:
            from slurm_mig.errors import SlurmMigError

            raise SlurmMigError(f"--partition {self.partition}: cannot ask Slurm which nodes it has: "
                                f"{self.error}; use --node instead, or run where sinfo works")
        return names


class _Keys:
    """Single key presses from the terminal (cbreak mode), or nothing when stdin is not a terminal."""

    def __init__(self):
        self.fd = None
        self.saved = None

    def __enter__(self) -> "_Keys":
        try:
            if sys.stdin.isatty():
                import termios
                import tty

                self.fd = sys.stdin.fileno()
                self.saved = termios.tcgetattr(self.fd)
                tty.setcbreak(self.fd)
        except Exception:
            self.fd = None
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None and self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    def wait(self, timeout: float) -> str | None:
        if self.fd is None:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return None
        return os.read(self.fd, 32).decode(errors="ignore")


NEXT = ("n", " ", "\x1b[6~", "\x1b[C", "j")
PREV = ("p", "\x1b[5~", "\x1b[D", "k")


def run(store, opts: TopOptions, *, cfg=None, interval: float = 2.0, once: bool = False, console=None,
        parts: PartitionNodes | None = None, reopen=None) -> int:
    """Draw the dashboard until q (or one frame with ``once``). ``parts`` looks up ``opts.partition``'s
    nodes (default: through ``cfg``'s Slurm). ``reopen``: opens the database again (views.open_readonly), for
    each frame while ``store`` is an immutable snapshot, which never sees what a controller writes after it
    was opened (the dashboard froze at that frame, or said "malformed" at every one once the controller,
    started meanwhile, had changed the file under it)."""
    from rich.console import Console

    parts = parts if parts is not None else PartitionNodes(cfg, opts.partition)
    current, drawn = store, False

    def frame(width: int, height: int) -> Frame:
        nonlocal current, drawn
        if drawn and reopen is not None and current.immutable:
            fresh = reopen()
            if current is not store:  # the caller closes its own
                current.close()
            current = fresh
        drawn = True
        snap = V.load_snapshot(current, stale_after_s=opts.stale_after_s)
        o = TopOptions(**{**opts.__dict__, "width": width, "height": height})
        return build_frame(snap, o, partition_nodes=parts.get(), healthz=probe_healthz(cfg))

    # A terminal that cannot move its cursor (TERM=dumb or unknown: an Emacs shell buffer, a serial console): rich's
    # Live draws nothing on it while it runs and, transient, nothing when it ends, so the screen stayed empty.
    dumb = not once and stdout_is_a_terminal() and (console or Console()).is_dumb_terminal
    if dumb:
        print("slurm-mig top: this terminal (TERM=dumb or unknown) cannot redraw a screen: one frame, as with --once",
              file=sys.stderr)
    if once or not stdout_is_a_terminal() or dumb:
        console = console or Console(width=opts.width, height=opts.height, highlight=False,
                                     force_terminal=stdout_is_a_terminal() or None)
        f = frame(opts.width, opts.height)
        for line in f.lines:
            console.print(line, overflow="crop", no_wrap=True, soft_wrap=False, crop=True)
        return 0

    console = console or Console(highlight=False)
    try:
        return _run_live(console, frame, opts, interval)
    finally:
        if current is not store:
            current.close()


def _run_live(console, frame, opts: TopOptions, interval: float) -> int:
    """The interactive dashboard: a frame every ``interval`` seconds and at each key, until q."""
    from rich.console import Group
    from rich.live import Live

    with _Keys() as keys, Live(console=console, screen=True, auto_refresh=False, transient=True) as live:
        while True:
            w, h = console.size
            try:
                f = frame(w, h)
                opts.page = f.page
                for line in f.lines:  # a frame is at least 40 columns: in a narrower terminal, cut, never wrap
                    line.no_wrap, line.overflow = True, "crop"
                live.update(Group(*f.lines), refresh=True)
            except Exception as exc:  # a locked or vanished database must not kill the dashboard
                live.update(Text(f"slurm-mig top: cannot read the state database: {exc}\nretrying every "
                                 f"{interval:g}s; q quits", style="bold red"), refresh=True)
                f = None
            key = keys.wait(interval)
            if key is None:
                continue
            if key in ("q", "Q", "\x03", "\x1b"):
                return 0
            if key in NEXT and f is not None:
                opts.page = 1 if f.page >= f.pages else f.page + 1
            elif key in PREV and f is not None:
                opts.page = f.pages if f.page <= 1 else f.page - 1
            elif key in ("v", "V"):
                cur = f.mode if f is not None else "gpus"
                opts.view = "summary" if cur == "gpus" else "gpus"
                opts.page = 1
            elif key in ("g", "Home", "\x1b[H"):
                opts.page = 1
