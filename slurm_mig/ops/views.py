"""What operators look at, built from the controller's state database: pure data, no printing.

Every function here takes a :class:`~slurm_mig.store.Store` (or a :class:`Snapshot` read from one)
and returns plain dicts and lists that ``json.dumps`` accepts: ``slurm-mig status|jobs|nodes|
decisions --json`` print exactly these, and the ``top`` dashboard and the text output are
drawn from them. Times are Unix seconds; durations are seconds. ``explain``'s data is built from
these helpers in :mod:`slurm_mig.ops.explain`; :mod:`slurm_mig.ops.fmt` formats the values for text.

The database is opened read-only (:func:`open_readonly`): the tools never write, never take the
write lock, never create a missing database, and work for a user who may only read the file.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from slurm_mig.controller.binding import held_region_rows
from slurm_mig.errors import SlurmMigError, StoreError
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.profiles import GpuModel, get_model
from slurm_mig.ops.fmt import _order, elapsed, fmt_duration, fmt_odd, is_number
from slurm_mig.slurm.parsers import format_exit_status
from slurm_mig.store.db import sqlite_uri
from slurm_mig.store.models import is_lost, readable_model

LIVE_JOB_STATES = ("PENDING", "REQUEUED", "RUNNING", "SUSPENDED", "COMPLETING")
RUNNING_STATES = ("RUNNING", "SUSPENDED", "COMPLETING")
# Scan at most this many of the newest decisions when looking for ones that did something (the
# controller records one per tick; each holds the whole ClusterState it saw).
DECISION_SCAN = 5000
_NOOP_ACTION = '{"assignments": [], "changes": [],%'


# -- opening the database -----------------------------------------------------------------

# The first 16 bytes of every SQLite 3 database file (https://www.sqlite.org/fileformat.html, 1.3).
SQLITE_HEADER = b"SQLite format 3\x00"


def check_state_file(path: str | os.PathLike) -> None:
    """The checks :func:`open_readonly` makes before SQLite opens the file, for every command that reads a state
    database by its path (`simulate --db`, `policy retrain` too): a StoreError (exit 1), naming the path, when it
    is missing or unreadable, not a regular file, world-writable, empty, or not an SQLite database at all."""
    path = os.fspath(path)
    try:
        # O_NONBLOCK: a FIFO given as --db (or as db_path) must not hang the open until something writes to it
        # (it is refused below, as not a regular file); on a regular file it changes nothing.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise StoreError(f"no state database at {path}: is the controller running, and is this the "
                         "[controller].db_path of its config? (choose the config with --config or "
                         "$SLURM_MIG_CONFIG)") from None
    except PermissionError:
        raise StoreError(f"state database {path}: permission denied; run as the controller's user, or set "
                         "[controller].db_group to a group you are in") from None
    except OSError as exc:
        raise StoreError(f"cannot open state database {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        head = os.read(fd, len(SQLITE_HEADER)) if stat.S_ISREG(st.st_mode) else b""
    except OSError as exc:
        raise StoreError(f"cannot read state database {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"state database {path} is not a regular file")
    if st.st_mode & stat.S_IWOTH:
        raise StoreError(f"state database {path} is world-writable; refusing to trust what it says")
    if st.st_size == 0:
        raise StoreError(f"state database {path} is empty: the controller has not initialised it yet")
    # Checked here, before SQLite opens it: a text file or any other file given as --db was SQLite's "file is
    # not a database", reported with exit status 75 (try again later) as if the controller's database were
    # only unavailable for a while.
    if head != SQLITE_HEADER:
        raise StoreError(f"state database {path} is not an SQLite database ({st.st_size} bytes, not beginning "
                         "with SQLite's header): is --db or [controller].db_path the controller's state.db?")


# (a C-level call: some 60 ms more than sqlite3's own decoding over a 1,600-GPU, 6,500-job site's snapshot and jobs)
_TEXT = functools.partial(str, encoding="utf-8", errors="backslashreplace")


def open_readonly(path: str | os.PathLike, *, busy_timeout_s: float = 5.0):
    """Open the state database read-only; StoreError (naming the path) when it cannot be read.

    Unlike :func:`slurm_mig.store.open_store` this never creates the file, never repairs its mode
    and never migrates it, so it works for a dashboard user in ``[controller].db_group`` and cannot
    disturb the controller. A symlink or a world-writable file is refused, as the store does.
    The store's ``immutable`` is True when it is an immutable snapshot (no controller up and no
    -shm this reader may make): it never sees later writes, so a reader that keeps it opens anew.
    """
    import sqlite3

    import sqlite_utils

    from slurm_mig.store import LATEST_VERSION, Store
    from slurm_mig.store.connection import StoreDamaged

    path = os.fspath(path)
    check_state_file(path)
    base = sqlite_uri(path, "ro")

    def connect(uri: str):
        conn = sqlite3.connect(uri, uri=True, timeout=busy_timeout_s, isolation_level=None,
                               check_same_thread=False)
        # Bytes that are not UTF-8 in a text column (a copy from a broken disk, a row another tool wrote) as \xNN:
        # sqlite3's default raised "Could not decode to UTF-8" and one such row took every command down.
        conn.text_factory = _TEXT
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            store = Store(sqlite_utils.Database(conn, execute_plugins=False), path=path,
                          busy_timeout_s=busy_timeout_s)
            return store, store.schema_version
        except BaseException:
            conn.close()
            raise

    immutable = False  # whether the last attempt fell back to an immutable snapshot

    def attempt():
        nonlocal immutable
        immutable = False
        try:
            return connect(base)
        except (sqlite3.OperationalError, StoreError) as exc:
            # A reader who may not write the folder cannot create the WAL index (-shm) that SQLite
            # needs while no controller has the database open (it removes both on a clean exit).
            # With no writer the file is stable: read it as an immutable snapshot instead.
            if "readonly" not in str(exc).lower() and "read-only" not in str(exc).lower():
                raise
        immutable = True
        return connect(base + "&immutable=1")

    try:
        try:
            store, version = attempt()
        except StoreDamaged:
            # Damage seen through an immutable snapshot may be a controller that started meanwhile and changed the
            # file under it (SQLite, told the file cannot change, reads a b-tree half old and half new: "database
            # disk image is malformed"). Once more: with that controller up the -shm is there and the open is an
            # ordinary WAL read, with it gone the file is stable again; a file damaged in earnest is damaged again
            # (exit 1).
            if not immutable:
                raise
            store, version = attempt()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read state database {path}: {exc}") from None
    except StoreDamaged as exc:  # SQLite's header, then a damaged file (truncated, overwritten): exit 1, not 75
        raise StoreError(str(exc)) from None
    store.immutable = immutable
    if version == 0:
        store.close()
        raise StoreError(f"state database {path} is empty: the controller has not initialised it yet")
    if version > LATEST_VERSION:
        store.close()
        raise StoreError(f"state database {path} has schema version {version}, newer than this slurm-mig "
                         f"understands ({LATEST_VERSION}); upgrade slurm-mig on this host")
    return store


def _rows(store, sql: str, params: Sequence = ()) -> list[dict]:
    """Rows of a read-only query, inside one read transaction."""
    with store.snapshot():
        return store.select_rows(sql, params)


# -- small helpers ------------------------------------------------------------------------

def kind_sort_key(kind: str) -> tuple:
    """Order profile kinds by size: 1g, 1g+me, 1g.dm, 2g, ..., 7g, then anything else."""
    head = kind.split("g", 1)[0]
    return (int(head) if head.isdigit() else 99, len(kind), kind)


def _model(name: str | None) -> GpuModel | None:
    if not name:
        return None
    try:
        return get_model(name)
    except SlurmMigError:
        return None


def _kind(model: GpuModel | None, profile: str) -> str:
    """The short kind ("3g", "1g.dm") of a full profile name, or the name when unknown."""
    if model is not None:
        try:
            return model.profile(profile).kind
        except SlurmMigError:
            pass
    m = re.fullmatch(r"(\d+g)\.\d+gb", profile)
    return m.group(1) if m else profile


def _size(model: GpuModel | None, profile: str) -> int:
    if model is not None:
        try:
            return model.profile(profile).memory_slices
        except SlurmMigError:
            pass
    return 1


def match_nodes(names: Iterable[str], patterns: str | Sequence[str] | None) -> list[str]:
    """The names matching any pattern: Slurm hostlists (``n[1-4]``), shell globs (``gpu*``) or plain names."""
    names = list(names)
    if not patterns:
        return names
    from slurm_mig.slurm.parsers import expand_hostlist

    if isinstance(patterns, str):
        patterns = [patterns]
    wanted: list[str] = []
    for p in patterns:
        if any(c in p for c in "*?") and "[" not in p:
            wanted.extend(x.strip() for x in p.split(",") if x.strip())
        else:
            wanted.extend(expand_hostlist(p))
    return [n for n in names if any(n == w or fnmatch.fnmatchcase(n, w) for w in wanted)]


# -- one consistent read of everything the dashboard shows -------------------------------------

@dataclass
class Snapshot:
    """Everything `top` and `status` show, read in one read transaction."""

    now: float
    stale_after_s: float
    nodes: list = field(default_factory=list)  # store.Node
    gpus: list = field(default_factory=list)  # store.ObservedGpu
    instances: list = field(default_factory=list)  # store.ObservedInstance
    bindings: list = field(default_factory=list)  # (job_id, node, BoundInstance)
    jobs: dict = field(default_factory=dict)  # job_id -> store.Job (live jobs only)
    pending: list = field(default_factory=list)  # PENDING/REQUEUED jobs in queue order (bound ones too)
    desired: dict = field(default_factory=dict)  # (node, gpu) -> {"layout", "policy", "decided_at", "reason"}
    open_journal: list = field(default_factory=list)  # store.JournalEntry, oldest first
    recent_journal: list = field(default_factory=list)  # newest first
    decisions: list = field(default_factory=list)  # decision summaries (no inputs) that did something
    last_decision: dict | None = None
    last_tick: float | None = None
    events: list = field(default_factory=list)  # store.Event, newest first
    reservations: dict = field(default_factory=dict)  # job_id -> {"node", "instances"}
    held: dict = field(default_factory=dict)  # job_id -> [[node, gpu, mask, ...], ...]: regions held for it
    counts: dict = field(default_factory=dict)  # decisions/journal/events totals
    _index: dict | None = field(default=None, repr=False)

    def bound_jobs(self) -> set[str]:
        """The jobs that hold a live binding."""
        return {str(job) for job, _n, _b in self.bindings}

    def index(self) -> dict:
        """Instances, bindings and open journal entries by (node, gpu), built once per snapshot."""
        if self._index is None:
            inst: dict[tuple, list] = {}
            for i in self.instances:
                inst.setdefault((i.node, i.gpu), []).append(i)
            bound: dict[tuple, dict] = {}
            for job, n, b in self.bindings:
                bound.setdefault((n, b.gpu), {})[b.start] = job
            journal: dict[tuple, list] = {}
            for e in self.open_journal:
                journal.setdefault((e.node, e.gpu), []).append(e)
            held: dict[tuple, set] = {}
            # The controller's own parser: a damaged region (a GPU index of Infinity, say) is shown held nowhere,
            # as the controller holds nothing for it.
            for jid, node, gi, _mask, _promised in held_region_rows(self.held):
                held.setdefault((node, gi), set()).add(jid)
            self._index = {"instances": inst, "bound": bound, "journal": journal,
                           "held": {k: sorted(v, key=lambda j: (len(j), j)) for k, v in held.items()}}
        return self._index


def load_snapshot(store, *, now: float | None = None, stale_after_s: float = 120.0, decisions: int = 10,
                  journal: int = 10, events: int = 30) -> Snapshot:
    """Read the state database once (one read transaction) for a dashboard frame."""
    snap = Snapshot(now=time.time() if now is None else now, stale_after_s=stale_after_s)
    with store.snapshot():
        snap.nodes = store.nodes()
        snap.gpus = store.observed_gpus()
        snap.instances = store.observed_instances()
        snap.bindings = store.live_bindings()
        live = store.jobs(LIVE_JOB_STATES)
        snap.jobs = {j.job_id: j for j in live}
        snap.pending = [j for j in live if j.state in ("PENDING", "REQUEUED")]
        for r in store.select_rows("SELECT * FROM desired_layouts ORDER BY node, gpu"):
            snap.desired[(r["node"], r["gpu"])] = {"layout": r["layout"], "policy": r["policy"],
                                                   "decided_at": r["decided_at"], "reason": r["reason"]}
        snap.open_journal = store.open_journal_entries()
        snap.recent_journal = store.journal_entries(limit=journal)
        snap.decisions = _decision_rows(store, limit=decisions, include_noop=False, include_waiting=False)
        load_tick(store, snap)
        snap.events = store.recent_events(events)
    return snap


def reservations_of(text: str | None) -> dict:
    """The meta row "reservations" (job id -> {"node", "instances"}), as far as it reads: a row edited by hand or
    damaged (not JSON, not an object, an entry that is not one) shows no job reserved for it, not a traceback."""
    from slurm_mig.store.models import loads

    try:
        value = loads(text, {})
    except ValueError:
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, dict)} if isinstance(value, dict) else {}


def load_tick(store, snap: Snapshot) -> Snapshot:
    """Fill in what :func:`controller_health` needs of ``snap``: the controller's last decision, its last
    tick (the newer of that and its last reservations write) and those reservations; all a command that
    only says whether the controller is ticking has to read."""
    from slurm_mig.store.models import loads

    with store.snapshot():
        last = _decision_rows(store, limit=1, include_noop=True)
        snap.last_decision = last[0] if last else None
        meta = {r["key"]: r for r in store.select_rows("SELECT key, value, updated_at FROM meta WHERE key IN "
                                              "('reservations', 'held')")}
    if "reservations" in meta:
        snap.last_tick = meta["reservations"]["updated_at"]
        snap.reservations = reservations_of(meta["reservations"]["value"])
    if "held" in meta:
        try:
            held = loads(meta["held"]["value"], {})
        except ValueError:  # not JSON (a row edited by hand): no GPU is shown held
            held = {}
        snap.held = held if isinstance(held, dict) else {}
    if snap.last_decision and (snap.last_tick is None or _order(snap.last_decision["time"]) > _order(snap.last_tick)):
        snap.last_tick = snap.last_decision["time"]
    return snap


# -- GPUs and nodes ---------------------------------------------------------------------------

def _largest_creatable(model: GpuModel, locked: Iterable[Slot]) -> tuple[str | None, int]:
    """The biggest basic instance (kind, memory slices) that could exist beside ``locked`` instances."""
    lay = Layout(model, frozenset(locked))
    best: tuple[str | None, int] = (None, 0)
    for p in model.basic_profiles:
        try:
            ok = bool(lay.free_starts(p))
        except SlurmMigError:
            ok = False
        if ok and (p.memory_slices, p.compute_slices) > (best[1], 0):
            best = (p.kind, p.memory_slices)
    return best


def _readable(model: GpuModel | None, insts: Sequence) -> GpuModel | None:
    """The model a GPU's slices are drawn and counted with: store.models.readable_model, the controller's own
    reading (None for a model our tables lack, or instances its table does not allow: a newer node's profile
    such as '3g.40gb+gfx', or a start it does not list; their sizes and places are the node's, unknown here),
    and None too where a stored instance's start or profile cannot be read at all."""
    try:
        return readable_model(model, insts)
    except (SlurmMigError, TypeError, ValueError):
        return None


def gpu_view(snap: Snapshot, node: str, g) -> dict:
    """One GPU: its instances (with state, job and user), open reconfiguration, free capacity. A GPU whose
    instances this controller's tables cannot place (_readable) has its instances listed by name and start
    (size None, kind the profile's name) and none of its slices counted (slices 0, geometry_known false)."""
    key = (node, g.gpu)
    idx = snap.index()
    insts = idx["instances"].get(key, [])
    named = _model(g.model)
    model = _readable(named, insts)

    def kind(profile: str) -> str:
        return _kind(model, profile) if model is not None else profile

    def size(profile: str) -> int | None:
        return _size(model, profile) if model is not None else None
    bound = idx["bound"].get(key, {})
    entries = idx["journal"].get(key, [])
    touched: dict[Slot, str] = {}
    for e in entries:
        for i, step in enumerate(e.steps):
            if i >= e.progress:
                touched[step.slot] = step.action
    existing = {Slot(i.start, i.profile) for i in insts}
    out_insts = []
    locked: set[Slot] = set()
    busy_slices = idle_slices = reconf_slices = 0
    for i in sorted(insts, key=lambda i: i.start):
        slot = Slot(i.start, i.profile)
        job_id = bound.get(i.start)
        job = snap.jobs.get(job_id) if job_id else None
        if slot in touched:
            state = "reconfiguring"
        elif job_id is not None or i.in_use:
            state = "busy"
        else:
            state = "idle"
        n = size(i.profile)
        if n is None:
            pass  # not counted: its size is the node's table's
        elif state == "busy":
            busy_slices += n
        elif state == "idle":
            idle_slices += n
        else:
            reconf_slices += n
        if state != "idle":
            locked.add(slot)
        out_insts.append({
            "profile": i.profile, "kind": kind(i.profile), "start": i.start, "size": n,
            "state": state, "job_id": job_id, "user": job.user if job else None, "uuid": i.uuid,
            "in_use": bool(i.in_use), "pending_action": touched.get(slot),
        })
    creating = []
    for slot, action in sorted(touched.items()):
        if action == "create" and slot not in existing:
            n = size(slot.profile)
            creating.append({"profile": slot.profile, "kind": kind(slot.profile), "start": slot.start, "size": n})
            locked.add(slot)
            reconf_slices += n or 0
    total = model.memory_slices if model else 0
    largest_kind, largest = (None, 0)
    if model is not None and g.mig_enabled and not g.blocked:  # (blocked: nothing is created there)
        try:
            largest_kind, largest = _largest_creatable(model, locked)
        except SlurmMigError:
            pass
    free = max(0, total - busy_slices - reconf_slices)
    layout = ""
    if model is not None:
        try:
            layout = str(Layout(model, frozenset(existing)))
        except SlurmMigError:
            layout = ",".join(f"{i.profile}@{i.start}" for i in insts)
    else:  # a model our tables do not list, or instances its table does not allow: as the node named them
        layout = ",".join(f"{i.profile}@{i.start}" for i in sorted(insts, key=lambda i: i.start))
    d = snap.desired.get(key)
    entry = entries[-1] if entries else None
    if is_lost(g.blocked):  # fallen off the bus: a GPU reset brings it back, not MIG mode
        status = "lost"
    elif not g.mig_enabled:
        status = "mig-off"
    elif named is None:
        status = "unknown-model"
    elif g.blocked:
        status = "blocked"
    elif entry is not None:
        status = "reconfiguring" if entry.state == "in_progress" else "planned"
    else:
        status = "ok"
    return {
        "node": node, "gpu": g.gpu, "model": g.model, "name": g.name, "uuid": g.uuid,
        "mig_enabled": bool(g.mig_enabled), "status": status, "blocked": g.blocked, "slices": total,
        "layout": layout or ("empty" if model else ""), "geometry_known": model is not None,
        "desired": d["layout"] if d else None,
        "reconfiguration": None if entry is None else {
            "id": entry.id, "state": entry.state, "from": entry.from_layout, "to": entry.to_layout,
            "progress": entry.progress, "steps": len(entry.steps), "since": entry.started_at or entry.created_at,
            "decision_id": entry.decision_id,
        },
        "instances": out_insts, "creating": creating, "held_for": held_for(snap, node, g.gpu),
        "busy_slices": busy_slices, "idle_slices": idle_slices, "reconfiguring_slices": reconf_slices,
        "free_slices": free, "largest_free_kind": largest_kind, "largest_free_slices": largest,
        "fragmented_slices": max(0, free - largest),
        "last_observed": g.last_observed,
    }


def held_for(snap: Snapshot, node: str, gpu: int) -> list[str]:
    """The waiting jobs a region of GPU ``gpu`` of ``node`` is held for at the last tick (the meta row "held"):
    its idle instances, and busy ones of a size no instance is idle in elsewhere on the node, are left out of
    Slurm's counts so that it drains for them (docs/architecture.md, "A reserved region drains for its job")."""
    return list(snap.index()["held"].get((node, gpu), ()))


def node_views(snap: Snapshot, *, nodes: str | Sequence[str] | None = None,
               only: Iterable[str] | None = None, include_empty: bool = True) -> list[dict]:
    """Every node (name order) with its GPUs; ``nodes`` filters by pattern, ``only`` by a name set
    (e.g. a partition's nodes). Nodes without GPUs (Slurm placeholders) are kept unless
    ``include_empty`` is false."""
    by_node: dict[str, list] = {}
    for g in snap.gpus:
        by_node.setdefault(g.node, []).append(g)
    names = sorted({n.name for n in snap.nodes} | set(by_node))
    names = match_nodes(names, nodes)
    if only is not None:
        only = set(only)
        names = [n for n in names if n in only]
    info = {n.name: n for n in snap.nodes}
    out = []
    for name in names:
        gpus = [gpu_view(snap, name, g) for g in sorted(by_node.get(name, []), key=lambda g: g.gpu)]
        if not gpus and not include_empty:
            continue
        n = info.get(name)
        last_seen = n.last_seen if n else None
        age = elapsed(snap.now, last_seen)
        total = sum(g["slices"] for g in gpus)
        busy = sum(g["busy_slices"] for g in gpus)
        out.append({
            "name": name, "state": n.state if n else "unknown", "health": n.health if n else "unknown",
            "health_detail": n.health_detail if n else {}, "agent_version": n.agent_version if n else None,
            "last_seen": last_seen, "seen_ago_s": age,
            "stale": bool(gpus) and (not is_number(age) or age > snap.stale_after_s),
            "gpus": gpus,
            "slices": total, "busy_slices": busy,
            "idle_slices": sum(g["idle_slices"] for g in gpus),
            "reconfiguring_slices": sum(g["reconfiguring_slices"] for g in gpus),
            "free_slices": sum(g["free_slices"] for g in gpus),
            "fragmented_slices": sum(g["fragmented_slices"] for g in gpus),
            "busy_fraction": (busy / total) if total else 0.0,
            # GPUs with MIG on whose slices are not in these counts (geometry_known false)
            "uncounted_gpus": sum(1 for g in gpus if g["mig_enabled"] and not g["geometry_known"]),
            "reconfiguring": any(g["reconfiguration"] for g in gpus),
        })
    return out


def hot_nodes(nodes: list[dict]) -> list[dict]:
    """Nodes worth a look first: reconfiguring, down or stale, then busiest, then most fragmented."""
    def key(n: dict) -> tuple:
        trouble = n["state"] != "up" or n["stale"]
        return (not n["reconfiguring"], not trouble, -round(n["busy_fraction"], 3), -n["fragmented_slices"],
                n["name"])
    return sorted((n for n in nodes if n["gpus"]), key=key)


# -- jobs -----------------------------------------------------------------------------------

def exit_json(status: int | None) -> str | None:
    """A wait status for JSON as sacct prints it ("3:0" for 768), None when unknown; scripts get the
    raw status beside it as ``exit_code``."""
    return None if status is None else format_exit_status(status)


WAITING_STATES = ("PENDING", "REQUEUED")


def job_dict(job, now: float, reservation: dict | None = None, *, bound: bool = False) -> dict:
    """A store Job as JSON, with wait and run times. ``bound``: the job holds a live binding now.

    A waiting job (PENDING, REQUEUED) that holds none is on no node: a job requeued while it ran (by an admin,
    Slurm after its node went down, a Prolog) keeps its first attempt's node and instances in the store, and
    was shown there, as though it held them while Slurm held it back. They are ``previous_attempt`` then
    (``{"node", "instances"}``; None where there is none), and ``node`` / ``instances`` are empty. A waiting
    job that does hold a binding (one adopted from its node's binding file before a tick saw it start) keeps
    its placement."""
    node, instances, previous = job.node, [i.to_json() for i in job.instances], None
    if job.state in WAITING_STATES and not bound:
        if node or instances:
            previous = {"node": node, "instances": instances}
        node, instances = None, []
    start = job.start_time
    wait = None
    if job.submit_time is not None:
        wait = elapsed(start if start is not None else (job.end_time or now), job.submit_time)
        if job.state in ("PENDING", "REQUEUED"):
            wait = elapsed(now, job.submit_time)
    run = None
    if start is not None:
        run = elapsed(job.end_time or now, start)
        if run is not None and (job.suspended_s or job.suspended_since is not None):
            run = max(0.0, run - job.suspended_for(job.end_time or now))  # as Slurm's RunTime: not while suspended
    return {
        "job_id": job.job_id, "run": job.run, "user": job.user, "name": job.name, "partition": job.partition,
        "profile": job.profile, "count": job.count, "state": job.state, "reason": job.reason,
        "submit_time": job.submit_time, "start_time": start, "end_time": job.end_time,
        "wait_s": wait, "run_s": run, "time_limit_s": job.time_limit_s, "node": node,
        "instances": instances, "previous_attempt": previous, "priority_order": job.priority_order,
        "exit_code": job.exit_code, "exit": exit_json(job.exit_code), "reserved": reservation,
        "blocked": job.blocked,
    }


def jobs_view(store, *, states: Sequence[str] | None = ("PENDING", "REQUEUED", "RUNNING", "SUSPENDED",
                                                         "COMPLETING"),
              user: str | None = None, partition: str | None = None, profile: str | None = None,
              limit: int | None = None, now: float | None = None) -> list[dict]:
    """Jobs in queue order (pending first by priority, then the others), filtered."""
    now = time.time() if now is None else now
    states = None if states is None else [s.upper() for s in states]
    with store.snapshot():
        jobs = store.jobs(states)
        meta = store.select_rows("SELECT value FROM meta WHERE key = 'reservations'")
        bound = {str(r["job_id"]) for r in store.select_rows("SELECT DISTINCT job_id FROM bindings WHERE released_at IS NULL")}
    res = reservations_of(meta[0]["value"]) if meta else {}
    out = []
    for j in jobs:
        if user and j.user != user:
            continue
        if partition and j.partition != partition:
            continue
        if profile and j.profile != profile and not j.profile.startswith(profile + "."):
            continue
        out.append(job_dict(j, now, res.get(j.job_id) if j.state == "PENDING" else None, bound=j.job_id in bound))
    order = {"PENDING": 0, "REQUEUED": 0, "RUNNING": 1, "SUSPENDED": 1, "COMPLETING": 1}
    def key(d: dict) -> tuple:
        group = order.get(d["state"], 2)
        if group == 0:  # pending: Slurm's priority order
            return (0, d["priority_order"] is None, d["priority_order"] or 0, _order(d["submit_time"] or 0))
        if group == 1:  # running: oldest start first
            return (1, False, 0, _order(d["start_time"] or 0))
        return (2, False, 0, -_order(d["end_time"] or 0))  # finished: newest first
    out.sort(key=key)
    return out[:limit] if limit is not None else out


def pending_by_profile(pending: list[dict]) -> list[dict]:
    """Pending jobs grouped by requested profile: jobs, instances, oldest and mean wait."""
    groups: dict[str, list[dict]] = {}
    for j in pending:
        groups.setdefault(j["profile"], []).append(j)
    out = []
    for kind in sorted(groups, key=kind_sort_key):
        js = groups[kind]
        waits = [j["wait_s"] or 0.0 for j in js]
        odd = next((w for w in waits if not is_number(w)), None)  # a wait from a time that is not a number
        out.append({"profile": kind, "jobs": len(js), "instances": sum(j["count"] for j in js),
                    "oldest_wait_s": max(waits, key=_order),
                    "mean_wait_s": odd if odd is not None else sum(waits) / len(waits)})
    return out


# -- decisions ------------------------------------------------------------------------------

def _decision_rows(store, *, limit: int, include_noop: bool, job_id: str | None = None,
                   include_waiting: bool = True,
                   since: float | None = None, until: float | None = None, newest_first: bool = True,
                   with_inputs: bool = False) -> list[dict]:
    from slurm_mig.store.models import loads

    cols = "id, time, policy, version, shadow, action, reasons, latency_ms" + (", inputs" if with_inputs else "")
    where, params = ["shadow = 0"], []
    if since is None and until is None:
        where.append("id > (SELECT COALESCE(MAX(id), 0) FROM decisions) - ?")
        params.append(DECISION_SCAN)
    if since is not None:
        where.append("time >= ?")
        params.append(since)
    if until is not None:
        where.append("time <= ?")
        params.append(until)
    if not include_noop:
        if include_waiting:
            where.append("(action NOT LIKE ? OR reasons != '[]')")
        else:
            where.append("action NOT LIKE ?")
        params.append(_NOOP_ACTION)
    if job_id is not None:
        where.append("(reasons LIKE ? OR action LIKE ?)")
        params += [f'%["{job_id}", %', f'%"job_id": "{job_id}"%']
    sql = (f"SELECT {cols} FROM decisions WHERE {' AND '.join(where)} ORDER BY id "
           f"{'DESC' if newest_first else 'ASC'} LIMIT ?")
    rows = _rows(store, sql, (*params, int(limit)))
    out = []
    for r in rows:
        action = loads(r["action"], {}) or {}
        waiting = [[str(j), why] for j, why in (loads(r["reasons"], []) or [])]
        d = {
            "id": r["id"], "time": r["time"], "policy": r["policy"], "version": r["version"],
            "latency_ms": r["latency_ms"], "changes": action.get("changes", []),
            "assignments": action.get("assignments", []), "waiting": waiting, "extra": action.get("extra", {}),
        }
        d["summary"] = decision_summary(d)
        if with_inputs:
            d["inputs"] = loads(r["inputs"], {})
        if job_id is not None and not _touches(d, job_id):
            continue
        out.append(d)
    return out


def job_decision_rows(store, job_id: str, *, since: float, until: float, limit: int = 100_000) -> list[dict]:
    """The live decisions between ``since`` and ``until`` that placed or held ``job_id``, oldest first, for
    explain: _decision_rows(job_id=...) less what explain does not read. A decision at a large site lists
    thousands of waiting jobs; parsing every one of them in each decision of a long history (some 370 at
    1,024 GPUs and 10,000 pending) took seconds for a job that waited through it. So the waiting list is
    searched for the job's own entries (JSON text as Store.record_decision writes it), "assignments" holds
    the job's alone, and the rest of the action (changes, extra, every assignment) is parsed by
    action_of only for the decisions that need it. The same rows are selected as by _decision_rows."""
    dec = json.JSONDecoder()
    needle = json.dumps([job_id])[:-1] + ", "  # ["<job_id>", : a pair's start; inside a string " is escaped
    rows = _rows(store, "SELECT id, time, policy, version, latency_ms, action, reasons, action LIKE ? AS in_action "
                        "FROM decisions WHERE shadow = 0 AND time >= ? AND time <= ? "
                        "AND (action NOT LIKE ? OR reasons != '[]') AND (reasons LIKE ? OR action LIKE ?) "
                        "ORDER BY id ASC LIMIT ?",
                 (f'%"job_id": "{job_id}"%', since, until, _NOOP_ACTION, f'%["{job_id}", %',
                  f'%"job_id": "{job_id}"%', int(limit)))
    out = []
    for r in rows:
        d = {"id": r["id"], "time": r["time"], "policy": r["policy"], "version": r["version"],
             "latency_ms": r["latency_ms"], "_action": r["action"]}
        text = r["reasons"] or ""
        waiting = []
        at = text.find(needle)
        while at >= 0:
            pair, _end = dec.raw_decode(text, at)
            waiting.append([str(pair[0]), pair[1]])
            at = text.find(needle, at + len(needle))
        d["waiting"] = waiting
        # The action names the job only where it matched (the LIKE is a superset: '_' matches any character).
        d["assignments"] = [a for a in action_of(d).get("assignments", []) or []
                            if str(a.get("job_id")) == job_id] if r["in_action"] else []
        if d["waiting"] or d["assignments"]:
            out.append(d)
    return out


def action_of(d: dict) -> dict:
    """A decision's action (changes, assignments, extra): parsed once from a job_decision_rows row's text;
    _decision_rows' rows carry it parsed."""
    got = d.get("_parsed")
    if got is None:
        if "_action" not in d:
            return {"changes": d.get("changes", []), "assignments": d.get("assignments", []),
                    "extra": d.get("extra", {})}
        from slurm_mig.store.models import loads

        got = d["_parsed"] = loads(d["_action"], {}) or {}
    return got


def _touches(d: dict, job_id: str) -> bool:
    return any(w[0] == job_id for w in d["waiting"]) or any(str(a.get("job_id")) == job_id
                                                            for a in d["assignments"])


def decision_summary(d: dict) -> str:
    """One line: what a decision did."""
    parts = []
    for c in d["changes"]:
        parts.append(f"re-carve {c['node']}/{c['gpu']} -> {c['target']}")
    for a in d["assignments"]:
        where = ", ".join(f"{i['profile']}@{i['start']} on GPU {i['gpu']}" for i in a.get("instances", []))
        parts.append(f"job {a['job_id']} -> {a['node']} ({where})")
    if d["waiting"]:
        parts.append(f"{len(d['waiting'])} waiting")
    return "; ".join(parts) if parts else "nothing to do"


def decisions_view(store, *, limit: int = 20, include_noop: bool = False, include_waiting: bool = False,
                   job_id: str | None = None) -> list[dict]:
    """The newest decisions, newest first. By default only those that re-carved a GPU or placed a job;
    ``include_waiting`` adds those that only held jobs waiting (one per tick while any job waits),
    ``include_noop`` every decision. With ``job_id``: every decision that placed or held that job."""
    if job_id is not None:
        return _decision_rows(store, limit=limit, include_noop=False, include_waiting=True, job_id=str(job_id))
    return _decision_rows(store, limit=limit, include_noop=include_noop, include_waiting=include_waiting)


# -- status and profile summary ------------------------------------------------------------------

def profile_summary(nodes: list[dict], pending: list[dict]) -> list[dict]:
    """Per profile kind: instances total/busy/idle/reconfiguring across ``nodes``, and pending demand."""
    rows: dict[str, dict] = {}

    def row(kind: str) -> dict:
        return rows.setdefault(kind, {"profile": kind, "total": 0, "busy": 0, "idle": 0, "reconfiguring": 0,
                                      "pending_jobs": 0, "pending_instances": 0, "oldest_wait_s": None})
    for n in nodes:
        for g in n["gpus"]:
            for i in g["instances"]:
                r = row(i["kind"])
                r["total"] += 1
                r[i["state"]] += 1
            for c in g["creating"]:
                row(c["kind"])["reconfiguring"] += 1
    for p in pending_by_profile(pending):
        r = row(_kind(None, p["profile"]))
        r["pending_jobs"] += p["jobs"]
        r["pending_instances"] += p["instances"]
        r["oldest_wait_s"] = max(r["oldest_wait_s"] or 0.0, p["oldest_wait_s"], key=_order)
    return [rows[k] for k in sorted(rows, key=kind_sort_key)]


def controller_health(snap: Snapshot, tick_interval_s: float, healthz: bool | None = None) -> dict:
    """Is the controller alive? From its last tick in the database and (optionally) a /healthz probe."""
    age = elapsed(snap.now, snap.last_tick)
    limit = max(3 * tick_interval_s, tick_interval_s + 10.0)
    if age is None:
        state = "unknown"
        why = "no tick recorded yet"
    elif not is_number(age) or age > limit:
        state = "stale"
        why = f"last tick {fmt_duration(age)} ago, expected every {tick_interval_s:g}s"
    else:
        state = "ok"
        why = f"last tick {fmt_duration(age)} ago"
    if healthz is False:
        state = "down" if state != "ok" else "api-down"
        why += "; /healthz does not answer"
    return {"state": state, "detail": why, "last_tick": snap.last_tick, "tick_age_s": age,
            "healthz": healthz, "open_reconfigurations": len(snap.open_journal),
            "last_decision": snap.last_decision}


def status_view(snap: Snapshot, *, tick_interval_s: float = 5.0, healthz: bool | None = None,
                nodes: list[dict] | None = None) -> dict:
    """The one-screen answer: controller, nodes, GPUs, instances by profile, the queue."""
    nodes = node_views(snap) if nodes is None else nodes
    bound = snap.bound_jobs()
    queued = [job_dict(j, snap.now, snap.reservations.get(j.job_id), bound=j.job_id in bound) for j in snap.pending]
    # Jobs Slurm will not start now (held, a dependency, ...) are not demand: a job held for a week is not
    # the queue's oldest wait.
    pending = [j for j in queued if not j["blocked"]]
    running = [j for j in snap.jobs.values() if j.state in RUNNING_STATES]
    gpu_nodes = [n for n in nodes if n["gpus"]]
    by_state: dict[str, int] = {}
    for n in gpu_nodes:
        st = "stale" if (n["state"] == "up" and n["stale"]) else n["state"]
        by_state[st] = by_state.get(st, 0) + 1
    gpus = [g for n in gpu_nodes for g in n["gpus"]]
    inst = {"busy": 0, "idle": 0, "reconfiguring": 0}
    for g in gpus:
        for i in g["instances"]:
            inst[i["state"]] += 1
        inst["reconfiguring"] += len(g["creating"])
    slices = sum(g["slices"] for g in gpus)
    busy = sum(g["busy_slices"] for g in gpus)
    return {
        "time": snap.now,
        "controller": controller_health(snap, tick_interval_s, healthz),
        "nodes": {"total": len(gpu_nodes), "by_state": dict(sorted(by_state.items())),
                  "other": [n["name"] for n in nodes if not n["gpus"]]},
        "gpus": {"total": len(gpus), "mig_enabled": sum(1 for g in gpus if g["mig_enabled"]),
                 "lost": sum(1 for g in gpus if g["status"] == "lost"),
                 "reconfiguring": sum(1 for g in gpus if g["reconfiguration"]),
                 "slices": slices, "busy_slices": busy,
                 "busy_fraction": busy / slices if slices else 0.0,
                 "fragmented_slices": sum(g["fragmented_slices"] for g in gpus),
                 "uncounted": sum(1 for g in gpus if g["mig_enabled"] and not g["geometry_known"])},
        "instances": inst,
        "profiles": profile_summary(nodes, pending),
        "jobs": {"pending": len(pending), "blocked": len(queued) - len(pending), "running": len(running),
                 "pending_by_profile": pending_by_profile(pending),
                 "oldest_pending": max(pending, key=lambda j: _order(j["wait_s"] or 0.0)) if pending else None},
        "reconfigurations": [journal_dict(e, snap.now) for e in snap.open_journal],
    }


def journal_dict(e, now: float | None = None) -> dict:
    start = e.started_at or e.created_at
    end = e.finished_at or (now if now is not None and e.state in ("planned", "in_progress") else None)
    return {
        "id": e.id, "node": e.node, "gpu": e.gpu, "from": e.from_layout, "to": e.to_layout, "state": e.state,
        "outcome": e.outcome, "error": e.error, "decision_id": e.decision_id,
        "steps": [f"{s.action} {s.profile}@{s.start}" for s in e.steps], "progress": e.progress,
        "created_at": e.created_at, "started_at": e.started_at, "finished_at": e.finished_at,
        "duration_s": elapsed(end, start),
    }


def recent_activity(snap: Snapshot, limit: int = 20) -> list[dict]:
    """Recent decisions that did something, reconfigurations (with their reasons) and notable
    events, newest first: ``{"time", "kind", "text", "reason"}``."""
    items = []
    change_reason: dict[tuple, str] = {}
    for d in snap.decisions:
        for c in d["changes"]:
            change_reason[(d["id"], c["node"], c["gpu"])] = c.get("reason", "")
        n_c, n_a = len(d["changes"]), len(d["assignments"])
        what = []
        if n_c:
            what.append(f"re-carve {n_c} GPU{'s' if n_c != 1 else ''}")
        if n_a:
            what.append(f"place {n_a} job{'s' if n_a != 1 else ''}")
        if d["waiting"]:
            what.append(f"{len(d['waiting'])} waiting")
        detail = [f"{c['node']}/{c['gpu']}->{c['target']}" for c in d["changes"]]
        detail += [f"job {a['job_id']}->{a['node']}/" + ",".join(str(i["gpu"]) for i in a.get("instances", []))
                   for a in d["assignments"]]
        reasons = sorted({c.get("reason", "").split(":")[0] for c in d["changes"] if c.get("reason")})
        if not detail and d["waiting"]:
            reasons = sorted({why for _, why in d["waiting"]})[:2]
        items.append({"time": d["time"], "kind": "decision",
                      "text": f"#{d['id']} {d['policy']}: {', '.join(what) or 'nothing'}"
                              + (f" ({' '.join(detail)})" if detail else ""),
                      "reason": "; ".join(r for r in reasons if r)})
    for e in snap.recent_journal:
        t = e.finished_at or e.started_at or e.created_at
        what = {"done": "done", "failed": "FAILED", "abandoned": "abandoned", "planned": "planned",
                "in_progress": "in progress"}.get(e.state, e.state)
        dur = ""
        if e.finished_at and (e.started_at or e.created_at):
            took = [e.finished_at, e.started_at or e.created_at]
            odd = [v for v in took if not is_number(v)]
            dur = f" in {fmt_odd(odd[0])}s" if odd else f" in {took[0] - took[1]:.1f}s"
        why = change_reason.get((e.decision_id, e.node, e.gpu), "")
        if not why:
            d = snap.desired.get((e.node, e.gpu))
            if d and d["layout"] == e.to_layout:
                why = d["reason"]
        if e.state in ("failed", "abandoned") and (e.error or e.outcome):
            why = (e.error or e.outcome or "") + (f"; {why}" if why else "")
        items.append({"time": t, "kind": "reconfig",
                      "text": f"{e.node}/{e.gpu} {e.from_layout} -> {e.to_layout} {what}{dur}", "reason": why})
    for ev in snap.events:
        if ev.kind in ("layout", "applied", "start", "end", "bind"):
            continue  # shown through the decisions and the journal, or on the GPU bars
        items.append({"time": ev.time, "kind": ev.kind, "text": ev.message, "reason": ""})
    items.sort(key=lambda x: -_order(x["time"]))
    return items[:limit]
