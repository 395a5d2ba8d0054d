"""The controller's state store: one SQLite file (WAL) behind typed methods.

Opening: the file is created by ``os.open(path, O_CREAT|O_NOFOLLOW, 0o600)``
(0o640 when a group is configured) before SQLite touches it; an existing file
that is a symlink, not a regular file, world-writable, or owned by a user other
than this process's and root is refused with a StoreError; any other wrong mode
is repaired. SQLite's ``-wal``/``-shm`` files
are checked the same way (SQLite creates them with the database's mode).

Transactions: ``store.transaction()`` opens ``BEGIN IMMEDIATE`` (the write
lock is taken up front, so concurrent writers queue on the busy timeout instead
of failing on a lock upgrade); nested use becomes a SAVEPOINT. Every public
method runs in one, so each call is atomic on its own and a whole controller
tick is atomic when wrapped in an outer ``transaction()``. Any exception rolls
back. SQLite errors come out typed: StoreBusy when the database stayed locked
past the busy timeout, StoreError for a full disk, an I/O error or a file that
is not a database, BindingConflict from ``bind``. A Store may be shared between
threads (calls are serialised), but not between processes: open one per process.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import logging
import math
import os
import sqlite3
import stat
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import sqlite_utils

from slurm_mig.errors import BindingConflict, SlurmMigError, StoreBusy, StoreError
from slurm_mig.folders import make_missing_folders
from slurm_mig.mig.layout import Layout, Slot, parse_layout
from slurm_mig.mig.profiles import GpuModel
from slurm_mig.store import schema
from slurm_mig.store.models import (
    BoundInstance,
    DecisionRecord,
    DesiredLayout,
    Event,
    Job,
    JournalEntry,
    JournalStep,
    Node,
    ObservedGpu,
    ObservedInstance,
    Outcome,
    as_bound_instance,
    as_observed_gpu,
    as_observed_instance,
    as_step,
    bound_instances_from_json,
    decision_to_json,
    dumps,
    known_model,
    loads,
    readable_model,
    state_to_json,
    unknown_model_reason,
)
from slurm_mig.store.schema import (
    JOB_STATES,
    JOURNAL_OPEN_STATES,
    JOURNAL_STATES,
    NODE_STATES,
    RUNNING_STATES,
    TERMINAL_STATES,
)

log = logging.getLogger(__name__)

DEFAULT_BUSY_TIMEOUT_S = 5.0


#: How long after Slurm starts a job its unbound instance still counts as promised in cluster_state
#: (a Prolog binds within seconds; past this the controller's no-Prolog check takes over).
UNBOUND_START_WINDOW_S = 120.0

#: Store.prune deletes old decisions this many bytes of them per transaction, and at most so many per call.
PRUNE_STEP_BYTES = 64 * 1024 * 1024
PRUNE_MAX_BYTES = 256 * 1024 * 1024


class StoreUnavailable(StoreError):
    """The database cannot be written for a reason of its own (disk full, I/O error, read-only, damaged file),
    not because of what was asked: try again once an admin has fixed it (exit code 75 like StoreBusy,
    so the node API answers 503 and the nodes keep their messages)."""

    exit_code = 75
MEMORY = ":memory:"


# -- opening -------------------------------------------------------------------

def _resolve_gid(group: str | int | None) -> int | None:
    if group is None or group == "":
        return None
    if isinstance(group, int):
        return group
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise StoreError(f"state database group {group!r} does not exist") from None


def _check_fd(fd: int, path: Path, mode: int, gid: int | None) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"state database {path} is not a regular file")
    if st.st_mode & stat.S_IWOTH:
        raise StoreError(
            f"state database {path} is world-writable (mode {stat.S_IMODE(st.st_mode):04o}); refusing to "
            f"use it, since anyone could have changed it. Check its contents, then `chmod {mode:o} {path}`"
        )
    if st.st_uid not in (os.geteuid(), 0):
        # Its owner may rewrite it whatever its mode: a state.db planted, in a folder others can write, by
        # a user who then decides what the controller binds and carves.
        raise StoreError(
            f"state database {path} is owned by uid {st.st_uid}, neither this process's (uid {os.geteuid()}) "
            f"nor root's; refusing to use it, since its owner can change it. Check its contents, then "
            f"`chown {os.geteuid()} {path}`"
        )
    try:
        if gid is not None and st.st_gid != gid:
            os.fchown(fd, -1, gid)
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
            log.warning("state database %s had mode %04o; set it to %04o", path, stat.S_IMODE(st.st_mode), mode)
    except PermissionError:
        raise StoreError(
            f"state database {path} has mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, "
            f"gid {st.st_gid}; expected {mode:04o}{'' if gid is None else f' and gid {gid}'} and cannot fix it "
            f"as uid {os.geteuid()}"
        ) from None


def _open_checked(path: Path, flags: int, mode: int, gid: int | None) -> None:
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(
                f"state database {path} is a symbolic link; refusing to follow it (set the db path to the real file)"
            ) from None
        raise StoreError(f"cannot open state database {path}: {exc.strerror}") from None
    try:
        _check_fd(fd, path, mode, gid)
    finally:
        os.close(fd)


def _make_db_folders(folder: Path, gid: int | None) -> None:
    """Make the database's folder (0700, or 0750 owned by ``gid``) and the missing folders above it (0755),
    each given its mode whatever the umask (folders.make_missing_folders). ``mkdir(parents=True)`` made those
    above with 0777 less the umask: world-writable under umask 0, so anyone could move the database's folder
    aside and put one of their own in its place; and under umask 0077 the group's folder came out 0700,
    which the readers of ``db_group`` cannot enter. A folder that exists is left as it is."""
    own = 0o750 if gid is not None else 0o700
    try:
        made = make_missing_folders(folder, lambda d: own if d == folder else 0o755)
        if folder in made and gid is not None and os.geteuid() == 0:
            os.chown(folder, -1, gid)  # group readers must be able to enter it
    except OSError as exc:
        raise StoreError(f"cannot create the state database directory {exc.filename or folder}: "
                         f"{exc.strerror}") from None


def prepare_db_file(path: str | os.PathLike, group: str | int | None = None) -> Path:
    """Create (0600, or 0640 with ``group``) or check/repair the database file and its WAL companions."""
    path = Path(path)
    gid = _resolve_gid(group)
    mode = 0o640 if gid is not None else 0o600
    _make_db_folders(path.parent, gid)
    _open_checked(path, os.O_RDWR | os.O_CREAT, mode, gid)
    for suffix in ("-wal", "-shm", "-journal"):
        extra = Path(str(path) + suffix)
        if os.path.lexists(extra):
            _open_checked(extra, os.O_RDWR, mode, gid)
    return path


def sqlite_uri(path: str | os.PathLike, mode: str) -> str:
    """The SQLite URI of the file ``path`` opened with ``mode`` ("ro", "rw"): the absolute path quoted, so a
    '#', '?' or '%' in it is part of the name (unquoted, '#' and '?' end the path and '%41' reads as 'A')."""
    return "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=" + mode


def _connect(path: str, busy_timeout_s: float) -> sqlite3.Connection:
    if path == MEMORY:
        conn = sqlite3.connect(MEMORY, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    else:
        # mode=rw: SQLite must never create the file itself (prepare_db_file did, with the right mode).
        uri = sqlite_uri(path, "rw")
        conn = sqlite3.connect(uri, uri=True, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    return conn


def open_store(
    path: str | os.PathLike = MEMORY,
    *,
    busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
    group: str | int | None = None,
    migrate: bool = True,
) -> "Store":
    """Open (creating if needed) the state database at ``path`` (``":memory:"`` for a private one).

    ``busy_timeout_s``: how long a call waits for another writer before StoreBusy.
    ``group``: make the file 0640 and owned by this group (for a read-only dashboard user).
    ``migrate``: bring the schema up to date (idempotent).
    """
    if busy_timeout_s < 0:
        raise StoreError(f"busy timeout must be >= 0 s, got {busy_timeout_s}")
    path = os.fspath(path)
    if path != MEMORY:
        prepare_db_file(path, group)
    conn = None
    try:
        conn = _connect(path, busy_timeout_s)
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        if path != MEMORY:
            journal = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(journal).lower() != "wal":
                log.warning("state database %s: WAL not available (journal_mode=%s)", path, journal)
            conn.execute("PRAGMA synchronous = NORMAL")
        db = sqlite_utils.Database(conn, execute_plugins=False)
        store = Store(db, path=path, busy_timeout_s=busy_timeout_s)
        if migrate:
            with store._locked():
                with store._translated():
                    schema.migrate(db)
        return store
    except sqlite3.Error as exc:
        if conn is not None:
            conn.close()
        raise _translate(exc, path, busy_timeout_s) from exc
    except BaseException:
        if conn is not None:
            conn.close()
        raise


def open_store_from_config(config: Any) -> "Store":
    """Open the store a slurm_mig.config.Config names (``[controller]`` db_path, db_busy_timeout_s, db_group)."""
    c = config.controller
    return open_store(c.db_path, busy_timeout_s=c.db_busy_timeout_s, group=c.db_group or None)


def _translate(exc: sqlite3.Error, path: str, busy_timeout_s: float) -> SlurmMigError:
    msg = str(exc)
    low = msg.lower()
    code = getattr(exc, "sqlite_errorcode", None)
    # By code, or SQLite's own words: a message that merely contains "locked" ("no column named blocked")
    # is not a lock.
    if isinstance(exc, sqlite3.OperationalError) and (
            (code is not None and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED))
            or any(w in low for w in ("database is locked", "table is locked", "database is busy"))):
        return StoreBusy(
            f"state database {path} stayed locked by another writer for more than the busy timeout "
            f"({busy_timeout_s:g} s); nothing was written (sqlite: {msg})"
        )
    if "full" in low:
        return StoreUnavailable(f"state database {path}: disk or database full; nothing of this operation was "
                                f"written ({msg})")
    if "not a database" in low or "malformed" in low:
        return StoreUnavailable(f"state database {path} is not a usable SQLite database ({msg})")
    if "readonly" in low or "read-only" in low:
        return StoreUnavailable(f"state database {path} is read-only for this process ({msg})")
    if "disk i/o error" in low or code == getattr(sqlite3, "SQLITE_IOERR", 10):
        return StoreUnavailable(f"state database {path}: disk I/O error; nothing of this operation was written "
                                f"({msg})")
    return StoreError(f"state database {path}: {msg}")


def _passthrough(exc: BaseException) -> bool:
    """sqlite3 errors that are programming bugs, not store conditions: let them through unchanged."""
    return isinstance(exc, (sqlite3.ProgrammingError, sqlite3.InterfaceError))


def _now(now: float | None) -> float:
    return time.time() if now is None else float(now)


def finite(value: Any) -> Any:
    """``value`` (JSON-ready) with every infinite or NaN float as None: JSON cannot hold them, and a policy may
    well say "never" (frag-aware reserves a GPU until ``inf`` behind jobs without a time limit)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _dumps_finite(value: Any) -> str:
    """``dumps(finite(value))``, walking ``value`` only when JSON refuses one of its floats: a decision's
    inputs at 10,000 queued jobs are some 100,000 values, and most hold no infinite or NaN float."""
    try:
        return dumps(value)
    except ValueError:
        return dumps(finite(value))


def _utf8_len(text: str) -> int:
    """The bytes ``text`` takes in the database (UTF-8); ``dumps`` writes ASCII, so mostly ``len``."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _row_job(r: dict) -> Job:
    return Job(
        job_id=r["job_id"], user=r["user"], name=r["name"], partition=r["partition"], profile=r["profile"],
        count=r["count"], time_limit_s=r["time_limit_s"], state=r["state"], reason=r["reason"],
        submit_time=r["submit_time"], start_time=r["start_time"], end_time=r["end_time"], node=r["node"],
        # Most rows hold no instance: "[]" is not decoded (a tick reads every queued job's row, 2-3 times).
        instances=() if r["instances"] in ("[]", None, "") else bound_instances_from_json(loads(r["instances"], [])),
        priority_order=r["priority_order"],
        exit_code=r["exit_code"], updated_at=r["updated_at"],
        # Absent from a version-2 database that the read-only views open without migrating it.
        blocked=r.get("blocked"),
        run=r.get("run") or 1,  # absent before version 4
        uid=r.get("uid"),  # absent before version 8
        suspended_s=r.get("suspended_s"), suspended_since=r.get("suspended_since"),  # absent before version 9
    )


def _row_node(r) -> Node:
    return Node(r["name"], r["state"], r["last_seen"], r["health"], loads(r["health_detail"], {}), r["agent_version"])


def _row_journal(r: dict) -> JournalEntry:
    return JournalEntry(
        id=r["id"], node=r["node"], gpu=r["gpu"], from_layout=r["from_layout"], to_layout=r["to_layout"],
        steps=tuple(JournalStep(s["action"], s["profile"], int(s["start"])) for s in loads(r["steps"], [])),
        progress=r["progress"], step_log=tuple(loads(r["step_log"], [])), state=r["state"], outcome=r["outcome"],
        error=r["error"], decision_id=r["decision_id"], created_at=r["created_at"], started_at=r["started_at"],
        updated_at=r["updated_at"], finished_at=r["finished_at"],
    )


def _check_state(state: str, allowed: Sequence[str], what: str) -> str:
    if state not in allowed:
        raise ValueError(f"unknown {what} {state!r} (expected one of: {', '.join(allowed)})")
    return state


class _FairRLock:
    """A reentrant lock granted in arrival order, with a timeout.

    threading.RLock is not fair: under many concurrent callers (every node's hooks at once, the tick
    among them) a few threads re-take it again and again while others wait past the busy timeout and
    fail. Here each waiter queues and is handed the lock by the releasing thread, so a caller waits
    for those ahead of it only.
    """

    def __init__(self):
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self._count = 0
        self._waiters: collections.deque[tuple[int, threading.Lock]] = collections.deque()

    def acquire(self, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._count += 1
                return True
            if self._owner is None and not self._waiters:
                self._owner, self._count = me, 1
                return True
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append((me, gate))
        gate.acquire(timeout=timeout) if timeout is not None and timeout >= 0 else gate.acquire()
        with self._mutex:
            if self._owner == me:  # handed over (perhaps just as the wait timed out)
                return True
            self._waiters.remove((me, gate))
            return False

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a store lock this thread does not hold")
            self._count -= 1
            if self._count:
                return
            if self._waiters:
                self._owner, gate = self._waiters.popleft()
                self._count = 1
                gate.release()
            else:
                self._owner = None

    def __enter__(self) -> "_FairRLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Store:
    """Typed access to the state database. Build one with open_store()."""

    def __init__(self, db: sqlite_utils.Database, *, path: str = MEMORY,
                 busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S):
        self.db = db
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._lock = _FairRLock()
        self._depth = 0
        # Bytes of decisions this Store recorded since it last pruned them (Store.prune): the controller
        # prunes early when they pass a part of [controller].keep_decisions_mb. A rolled-back decision is
        # counted too (an early prune, no harm).
        self.decision_bytes_unpruned = 0
        self._read_only = False

    # -- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            self.db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Store {self.path}>"

    @property
    def schema_version(self) -> int:
        with self.snapshot():
            return schema.schema_version(self.db)

    # -- transactions ----------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if not self._lock.acquire(timeout=self.busy_timeout_s):
            raise StoreBusy(f"state database {self.path} is in use by another thread for more than "
                            f"{self.busy_timeout_s:g} s")
        try:
            yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            if _passthrough(exc):
                raise
            raise _translate(exc, self.path, self.busy_timeout_s) from exc

    def _rollback(self) -> None:
        conn = self.db.conn
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:  # e.g. after an I/O error SQLite may already have rolled back
                log.exception("rollback of the state database failed")

    def _check_alive(self) -> None:
        """Inside a transaction, refuse to go on once SQLite has rolled all of it back by itself.

        SQLite does that on SQLITE_FULL, an I/O error or running out of memory, not just the failing
        statement or savepoint. A caller that catches the StoreError of an inner block and goes on
        would otherwise write the rest in autocommit mode, one statement (or SAVEPOINT) at a time:
        half a tick, or half a node request, committed while the outer block's COMMIT then fails."""
        if self._depth > 0 and not self.db.conn.in_transaction:
            raise self._rolled_back()

    def _rolled_back(self) -> StoreUnavailable:
        return StoreUnavailable(
            f"state database {self.path}: SQLite rolled back the whole transaction after an earlier error "
            f"in it (disk full, I/O error); nothing of it was written")

    @contextlib.contextmanager
    def _tx(self, begin: str) -> Iterator["Store"]:
        with self._locked():
            conn = self.db.conn
            if self._depth > 0:
                self._check_alive()
            if self._depth == 0:
                with self._translated():
                    conn.execute(begin)
                self._depth = 1
                self._read_only = begin == "BEGIN DEFERRED"
                try:
                    with self._translated():
                        yield self
                except BaseException:
                    self._depth = 0
                    self._rollback()
                    raise
                self._depth = 0
                try:
                    if not conn.in_transaction:
                        raise self._rolled_back()
                    with self._translated():
                        conn.execute("COMMIT")
                except BaseException:
                    self._rollback()
                    raise
            elif begin == "BEGIN DEFERRED":
                # A read inside an open transaction: it has nothing to undo, so no savepoint (SAVEPOINT and
                # RELEASE around reads were half the statements a node request ran).
                self._depth += 1
                try:
                    with self._translated():
                        yield self
                finally:
                    self._depth -= 1
            else:
                if self._read_only:
                    raise StoreError("cannot write inside store.snapshot(), which is read-only; "
                                     "use store.transaction() for the outer block")
                name = f"slurm_mig_sp{self._depth}"
                with self._translated():
                    conn.execute(f"SAVEPOINT {name}")
                self._depth += 1
                try:
                    with self._translated():
                        yield self
                except BaseException:
                    if conn.in_transaction:
                        try:
                            conn.execute(f"ROLLBACK TO {name}")
                            conn.execute(f"RELEASE {name}")
                        except sqlite3.Error:
                            log.exception("rollback to savepoint failed")
                    raise
                else:
                    with self._translated():
                        conn.execute(f"RELEASE {name}")
                finally:
                    self._depth -= 1

    def transaction(self) -> contextlib.AbstractContextManager["Store"]:
        """A write transaction (``with store.transaction(): ...``): all of it is written, or none.

        The outermost one takes the database's write lock at once (BEGIN
        IMMEDIATE), waiting up to the busy timeout (then StoreBusy); nested ones
        are savepoints, so an exception inside a nested block undoes only that
        block if the caller catches it.
        """
        return self._tx("BEGIN IMMEDIATE")

    def snapshot(self) -> contextlib.AbstractContextManager["Store"]:
        """A read transaction: a consistent view of several tables (does not block writers in WAL mode)."""
        return self._tx("BEGIN DEFERRED")

    @property
    def in_transaction(self) -> bool:
        return self._depth > 0

    def _q(self, sql: str, params: Sequence | dict = ()) -> list[dict]:
        self._check_alive()
        cur = self.db.conn.execute(sql, params)
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row)) for row in cur.fetchall()]

    def _x(self, sql: str, params: Sequence | dict = ()) -> sqlite3.Cursor:
        self._check_alive()
        return self.db.conn.execute(sql, params)

    def _xm(self, sql: str, rows: Iterable[Sequence]) -> None:
        """``sql`` run once per parameter row, in order (executemany: the per-job updates of a tick)."""
        self._check_alive()
        self.db.conn.executemany(sql, rows)

    # -- meta ------------------------------------------------------------------
    def get_meta(self, key: str, default: Any = None) -> Any:
        with self.snapshot():
            rows = self._q("SELECT value FROM meta WHERE key = ?", (key,))
        return loads(rows[0]["value"]) if rows else default

    def set_meta(self, key: str, value: Any, *, now: float | None = None) -> None:
        with self.transaction():
            self._x(
                "INSERT INTO meta (key, value, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
                (key, dumps(value), _now(now)),
            )

    def meta_with_prefix(self, prefix: str) -> dict[str, Any]:
        """Every meta entry whose key starts with ``prefix``: ``{key: value}``."""
        with self.snapshot():
            rows = self._q("SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?", (len(prefix), prefix))
        return {r["key"]: loads(r["value"]) for r in rows}

    def delete_meta(self, keys: Iterable[str]) -> None:
        """Remove the meta entries ``keys`` (those that exist), in one transaction."""
        keys = list(keys)
        if not keys:
            return
        with self.transaction():
            for k in keys:
                self._x("DELETE FROM meta WHERE key = ?", (k,))

    # -- nodes -----------------------------------------------------------------
    def upsert_node(self, name: str, *, state: str | None = None, health: str | None = None,
                    health_detail: dict | None = None, agent_version: str | None = None,
                    last_seen: float | None = None) -> None:
        """Create node ``name`` or update the fields given (others keep their values)."""
        if state is not None:
            _check_state(state, NODE_STATES, "node state")
        with self.transaction():
            self._x("INSERT INTO nodes (name) VALUES (?) ON CONFLICT(name) DO NOTHING", (name,))
            sets, params = [], []
            for col, val in (("state", state), ("health", health), ("agent_version", agent_version),
                             ("last_seen", last_seen)):
                if val is not None:
                    sets.append(f"{col} = ?")
                    params.append(val)
            if health_detail is not None:
                sets.append("health_detail = ?")
                params.append(dumps(health_detail))
            if sets:
                self._x(f"UPDATE nodes SET {', '.join(sets)} WHERE name = ?", (*params, name))

    def set_node_state(self, name: str, state: str) -> None:
        self.upsert_node(name, state=state)

    def nodes(self) -> list[Node]:
        with self.snapshot():
            rows = self._q("SELECT * FROM nodes ORDER BY name")
        return [_row_node(r) for r in rows]

    def node(self, name: str) -> Node | None:
        """One node by name (a keyed lookup: every node report asks, so not a scan of every node)."""
        with self.snapshot():
            rows = self._q("SELECT * FROM nodes WHERE name = ?", (name,))
        return _row_node(rows[0]) if rows else None

    # -- observed state ---------------------------------------------------------
    def replace_observed(self, node: str, gpus: Iterable[Any], instances: Iterable[Any], *,
                         now: float | None = None, state: str = "up", health: str | None = None,
                         health_detail: dict | None = None, agent_version: str | None = None) -> None:
        """Replace everything known about ``node``'s GPUs and MIG instances with this report, atomically.

        ``gpus``: ObservedGpu / nvml GpuInfo / dicts (gpu or index, uuid, model, mig_enabled, name).
        ``instances``: ObservedInstance / nvml MigInstance / dicts (gpu, profile, start, uuid, gi_id,
        ci_id, in_use). Profiles given as kinds ("3g") are stored as full names. Marks the node seen.
        """
        t = _now(now)
        gpu_rows = [as_observed_gpu(g) for g in gpus]
        inst_rows = [as_observed_instance(i) for i in instances]
        # A model this slurm-mig's tables do not list (a newer node's) is stored as named, the GPU blocked
        # (as_observed_gpu); so is a GPU named no model that holds instances, and one of a known model whose
        # instances that model's table does not allow (a newer node's profile or placement): their profiles are
        # kept as given, and nothing reads a geometry from them (readable_model).
        by_gpu: dict[int, list[ObservedInstance]] = {}
        for i in inst_rows:
            by_gpu.setdefault(i.gpu, []).append(i)
        models = {g.gpu: readable_model(g.model, by_gpu.get(g.gpu, ())) for g in gpu_rows}
        gpu_rows = [g if models.get(g.gpu) is not None else self._with_unknown_reason(g, by_gpu.get(g.gpu, ()))
                    for g in gpu_rows]
        if len(models) != len(gpu_rows):
            raise ValueError(f"node {node} reported the same GPU index twice")
        normalised = []
        for i in inst_rows:
            if i.gpu not in models:
                raise ValueError(f"node {node} reported a MIG instance on GPU {i.gpu}, which it did not list")
            m = models[i.gpu]
            profile = m.profile(i.profile).name if m is not None else i.profile
            normalised.append((i, profile))
        with self.transaction():
            self.upsert_node(node, state=state, health=health, health_detail=health_detail,
                             agent_version=agent_version, last_seen=t)
            self._x("DELETE FROM instances WHERE node = ?", (node,))
            self._x("DELETE FROM gpus WHERE node = ?", (node,))
            for g in gpu_rows:
                self._x(
                    "INSERT INTO gpus (node, gpu, uuid, name, model, mig_enabled, last_observed, blocked) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (node, g.gpu, g.uuid, g.name, g.model, int(g.mig_enabled), t, g.blocked),
                )
            for i, profile in normalised:
                self._x(
                    "INSERT INTO instances (node, gpu, profile, start, uuid, gi_id, ci_id, in_use, observed_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (node, i.gpu, profile, i.start, i.uuid, i.gi_id, i.ci_id, int(i.in_use), t),
                )

    @staticmethod
    def _with_unknown_reason(g: ObservedGpu, instances: Iterable[ObservedInstance]) -> ObservedGpu:
        """``g`` blocked with unknown_model_reason's words too, where they apply and it does not say them yet."""
        why = unknown_model_reason(g.model, instances)
        if why is None or why in (g.blocked or ""):
            return g
        return dataclasses.replace(g, blocked="; ".join(filter(None, (why, g.blocked))))

    def observed_gpus(self, node: str | None = None) -> list[ObservedGpu]:
        sql, params = "SELECT * FROM gpus", ()
        if node is not None:
            sql, params = sql + " WHERE node = ?", (node,)
        with self.snapshot():
            rows = self._q(sql + " ORDER BY node, gpu", params)
        return [ObservedGpu(r["gpu"], r["uuid"], r["model"], bool(r["mig_enabled"]), r["name"], r["last_observed"],
                            r["node"], r.get("blocked")) for r in rows]  # (no column before schema 5)

    def observed_instances(self, node: str | None = None, gpu: int | None = None) -> list[ObservedInstance]:
        where, params = [], []
        if node is not None:
            where.append("node = ?")
            params.append(node)
        if gpu is not None:
            where.append("gpu = ?")
            params.append(gpu)
        sql = "SELECT * FROM instances" + (" WHERE " + " AND ".join(where) if where else "")
        with self.snapshot():
            rows = self._q(sql + " ORDER BY node, gpu, start", params)
        return [ObservedInstance(r["gpu"], r["profile"], r["start"], r["uuid"], r["gi_id"], r["ci_id"],
                                 bool(r["in_use"]), r["observed_at"], r["node"]) for r in rows]

    def observed_layout(self, node: str, gpu: int) -> Layout | None:
        """The layout ``node``/``gpu`` last reported, or None if the GPU or its model is unknown."""
        with self.snapshot():
            g = self._q("SELECT model FROM gpus WHERE node = ? AND gpu = ?", (node, gpu))
            if not g or known_model(g[0]["model"]) is None:
                return None
            rows = self._q("SELECT profile, start FROM instances WHERE node = ? AND gpu = ?", (node, gpu))
        model = readable_model(g[0]["model"], rows)  # None: instances its table does not allow (a newer node's)
        if model is None:
            return None
        return Layout(model, frozenset(Slot(r["start"], r["profile"]) for r in rows))

    # -- desired layouts --------------------------------------------------------
    def set_desired(self, node: str, gpu: int, layout: Layout | str, policy: str, reason: str = "", *,
                    now: float | None = None) -> None:
        """Record the layout a policy wants on ``node``/``gpu`` (a Layout or a parse_layout() spec)."""
        spec = str(layout) if isinstance(layout, Layout) else str(layout).strip()
        with self.transaction():
            self._x(
                "INSERT INTO desired_layouts (node, gpu, layout, policy, decided_at, reason) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(node, gpu) DO UPDATE SET layout = excluded.layout, policy = excluded.policy, "
                "decided_at = excluded.decided_at, reason = excluded.reason",
                (node, int(gpu), spec, policy, _now(now), reason),
            )

    def clear_desired(self, node: str, gpu: int | None = None) -> None:
        with self.transaction():
            if gpu is None:
                self._x("DELETE FROM desired_layouts WHERE node = ?", (node,))
            else:
                self._x("DELETE FROM desired_layouts WHERE node = ? AND gpu = ?", (node, int(gpu)))

    def desired(self, node: str) -> dict[int, DesiredLayout]:
        """The desired layout of each GPU of ``node`` that has one, by GPU index."""
        with self.snapshot():
            rows = self._q(
                "SELECT d.*, g.model AS model FROM desired_layouts d "
                "LEFT JOIN gpus g ON g.node = d.node AND g.gpu = d.gpu WHERE d.node = ? ORDER BY d.gpu",
                (node,),
            )
        return {r["gpu"]: DesiredLayout(r["node"], r["gpu"], r["layout"], r["policy"], r["decided_at"], r["reason"],
                                        r["model"]) for r in rows}

    # -- jobs ------------------------------------------------------------------
    def upsert_job(self, job_id: str, *, profile: str, count: int = 1, user: str = "", name: str = "",
                   partition: str = "", time_limit_s: float | None = None, submit_time: float | None = None,
                   state: str | None = None, priority_order: int | None = None, now: float | None = None,
                   blocked: str | None = None, uid: int | None = None) -> None:
        """Insert a job as Slurm reports it, or update its request fields.

        A new job starts PENDING unless ``state`` says otherwise; for an existing
        one ``state`` (when given) goes through set_job_state(), and start/end
        times, bindings and the reason are kept. ``blocked``: why Slurm will not
        start it now (it is then left out of the policy's view and its reason says
        so); None: it may start. ``uid``: its user's uid; None (not known) keeps the
        stored one where ``user`` is the stored name, else leaves none.
        """
        job_id = str(job_id)
        if count < 1:
            raise ValueError(f"job {job_id}: count must be >= 1, got {count}")
        if state is not None:
            _check_state(state, JOB_STATES, "job state")
        t = _now(now)
        with self.transaction():
            self._x(
                # A new row for an id with outcomes (its old row was forgotten) is a later run of the id.
                "INSERT INTO jobs (job_id, user, name, partition, profile, count, time_limit_s, state, submit_time, "
                "priority_order, updated_at, blocked, uid, run) VALUES (?, ?, ?, ?, ?, ?, ?, 'PENDING', ?, ?, ?, ?, ?, "
                "(SELECT COALESCE(MAX(o.run), 0) + 1 FROM outcomes o WHERE o.job_id = ?)) "
                "ON CONFLICT(job_id) DO UPDATE SET "
                "uid = CASE WHEN excluded.uid IS NOT NULL THEN excluded.uid WHEN excluded.user = jobs.user "
                "THEN jobs.uid END, "
                "user = excluded.user, name = excluded.name, "
                "partition = excluded.partition, profile = excluded.profile, count = excluded.count, "
                "time_limit_s = excluded.time_limit_s, "
                "priority_order = COALESCE(excluded.priority_order, jobs.priority_order), "
                "updated_at = excluded.updated_at, blocked = excluded.blocked, "
                # No longer blocked: its reason said why it could not start (the policy's next word follows).
                "reason = CASE WHEN jobs.blocked IS NOT NULL AND excluded.blocked IS NULL AND jobs.state = 'PENDING' "
                "THEN '' ELSE jobs.reason END",
                (job_id, user, name, partition, profile, int(count), time_limit_s,
                 t if submit_time is None else submit_time, priority_order, t, blocked,
                 None if uid is None else int(uid), job_id),
            )
            if blocked is not None:
                # What `jobs` and `explain` show; the policy's next word replaces it once it may start.
                self._x("UPDATE jobs SET reason = ? WHERE job_id = ? AND state = 'PENDING'", (blocked, job_id))
            if state is not None:
                self.set_job_state(job_id, state, now=t)

    def set_job_order(self, job_ids: Sequence[str]) -> None:
        """Set the pending queue order (Slurm's priority order): ``job_ids[0]`` runs first."""
        with self.transaction():
            for i, job_id in enumerate(job_ids):
                self._x("UPDATE jobs SET priority_order = ? WHERE job_id = ?", (i, str(job_id)))

    def set_job_state(self, job_id: str, state: str, *, now: float | None = None, reason: str | None = None,
                      node: str | None = None, exit_code: int | None = None, end_time: float | None = None) -> None:
        """Move a job to ``state``. RUNNING stamps start_time (once); a terminal state stamps end_time (once:
        ``end_time`` where the caller knows when the job ended, an Epilog's or Slurm's, else ``now``) and releases
        the job's bindings; PENDING/REQUEUED clear start/end so a requeued job waits afresh."""
        _check_state(state, JOB_STATES, "job state")
        job_id = str(job_id)
        t = _now(now)
        with self.transaction():
            if not self._q("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)):
                raise StoreError(f"unknown job {job_id}")
            sets = ["state = ?", "updated_at = ?"]
            params: list[Any] = [state, t]
            if state in RUNNING_STATES:
                sets.append("start_time = COALESCE(start_time, ?)")
                params.append(t)
            elif state in TERMINAL_STATES:
                sets.append("end_time = COALESCE(end_time, ?)")
                params.append(t if end_time is None else float(end_time))
            elif state in ("PENDING", "REQUEUED"):
                sets.append("start_time = NULL, end_time = NULL, suspended_s = NULL, suspended_since = NULL")
            for col, val in (("reason", reason), ("node", node), ("exit_code", exit_code)):
                if val is not None:
                    sets.append(f"{col} = ?")
                    params.append(val)
            self._x(f"UPDATE jobs SET {', '.join(sets)} WHERE job_id = ?", (*params, job_id))
            if state in TERMINAL_STATES:
                self.release(job_id, now=t)

    def set_suspension(self, job_id: str, *, suspended_s: float, since: float | None, ended: bool = False,
                       ran_to_end: bool = False) -> None:
        """Note the time the current run of ``job_id`` has spent suspended, as Slurm's record says
        (SlurmJob.suspended_before_s): ``suspended_s`` seconds before its last suspend or resume, and ``since``
        when the suspension going on began (None: it runs). Only for a job that runs here (RUNNING, SUSPENDED,
        COMPLETING, or ended): a waiting one has no run yet. ``ended``: Slurm's record of the run's end (or its
        COMPLETING): the seconds only grow, and the suspension noted as going on is kept (Slurm gives a job
        killed while suspended its suspend time as end, with the same figures as before the kill), unless
        ``ran_to_end``: Slurm's record says it ran after its last resume (it ended after its suspend time), a
        resume no tick saw (within one tick interval, or while the controller was down). The run's outcome, if
        its Epilog recorded it already, gets the run time these figures give (record_outcome's)."""
        with self.transaction():
            if ended:
                if ran_to_end:
                    cur = self._x("UPDATE jobs SET suspended_s = MAX(COALESCE(suspended_s, 0.0), ?), "
                                  "suspended_since = NULL WHERE job_id = ? AND state NOT IN ('PENDING', 'REQUEUED') "
                                  "AND (suspended_since IS NOT NULL OR suspended_s IS NULL OR suspended_s < ?)",
                                  (float(suspended_s), str(job_id), float(suspended_s)))
                else:
                    cur = self._x("UPDATE jobs SET suspended_s = ? WHERE job_id = ? AND state NOT IN ('PENDING', "
                                  "'REQUEUED') AND (suspended_s IS NULL OR suspended_s < ?)",
                                  (float(suspended_s), str(job_id), float(suspended_s)))
                if cur.rowcount:
                    # Its Epilog may have come first, with the figures of a suspension no tick saw end (the
                    # run time after the resume left out) or none seen at all (the time suspended counted).
                    job = _row_job(self._q("SELECT * FROM jobs WHERE job_id = ?", (str(job_id),))[0])
                    for o in self._q("SELECT start_time, end_time FROM outcomes WHERE job_id = ? AND run = ? AND "
                                     "start_time IS NOT NULL AND end_time IS NOT NULL", (job.job_id, job.run)):
                        run_s = job.run_time(o["start_time"], o["end_time"])
                        self._x("UPDATE outcomes SET run_s = ? WHERE job_id = ? AND run = ?",
                                (run_s, job.job_id, job.run))
            else:
                self._x("UPDATE jobs SET suspended_s = ?, suspended_since = ? WHERE job_id = ? AND state IN "
                        "('RUNNING', 'SUSPENDED', 'COMPLETING') AND (suspended_s IS NOT ? OR suspended_since IS NOT ?)",
                        (float(suspended_s), since, str(job_id), float(suspended_s), since))

    def restart_job(self, job_id: str, *, now: float | None = None, reason: str,
                    submit_time: float | None = None) -> None:
        """A job that ended here runs again under the same id: PENDING afresh as its next run, without the
        ended run's node, exit code and instances (its outcome row stays, the next run gets its own).
        ``submit_time``: the new run's, as Slurm gives it (upsert_job keeps the first one it saw)."""
        with self.transaction():
            self.set_job_state(job_id, "PENDING", now=now, reason=reason)
            # run + 1 whether or not the ended run recorded an outcome: a number is never given twice.
            self._x("UPDATE jobs SET node = NULL, exit_code = NULL, instances = '[]', run = run + 1, "
                    "submit_time = COALESCE(?, submit_time) WHERE job_id = ?", (submit_time, str(job_id)))

    def forget_pending_job(self, job_id: str) -> bool:
        """Delete a PENDING job that holds no binding (an array task Slurm now runs under an id of its
        own); False, and nothing done, for any other job."""
        with self.transaction():
            cur = self._x("DELETE FROM jobs WHERE job_id = ? AND state = 'PENDING' AND NOT EXISTS "
                          "(SELECT 1 FROM bindings b WHERE b.job_id = jobs.job_id)", (str(job_id),))
        return bool(cur.rowcount)

    def get_job(self, job_id: str) -> Job | None:
        with self.snapshot():
            rows = self._q("SELECT * FROM jobs WHERE job_id = ?", (str(job_id),))
        return _row_job(rows[0]) if rows else None

    def jobs(self, states: Iterable[str] | None = None, *, limit: int | None = None) -> list[Job]:
        """Jobs (optionally only in ``states``), in queue order then submit time."""
        sql, params = "SELECT * FROM jobs", []
        if states is not None:
            states = [_check_state(s, JOB_STATES, "job state") for s in states]
            sql += f" WHERE state IN ({', '.join('?' for _ in states)})"
            params += states
        sql += " ORDER BY priority_order IS NULL, priority_order, submit_time, job_id"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        with self.snapshot():
            return [_row_job(r) for r in self._q(sql, params)]

    def job_ids(self, states: Iterable[str]) -> list[str]:
        """The ids of the jobs in ``states``, in the order of jobs(states): where a caller needs no more (a tick
        asks for every waiting job's, 10,000 on a large site, to find those Slurm no longer lists)."""
        states = [_check_state(s, JOB_STATES, "job state") for s in states]
        with self.snapshot():
            return [r[0] for r in self._x(
                f"SELECT job_id FROM jobs WHERE state IN ({', '.join('?' for _ in states)}) "
                "ORDER BY priority_order IS NULL, priority_order, submit_time, job_id", states).fetchall()]

    def job_users(self, states: Iterable[str]) -> dict[str, tuple[str, int | None]]:
        """``{job_id: (user, uid)}`` of the jobs in ``states`` (uid None: not known): what a tick needs of the
        stored runs before it writes Slurm's records over them (one query, not a row read per job)."""
        states = [_check_state(s, JOB_STATES, "job state") for s in states]
        with self.snapshot():
            return {r[0]: (r[1], r[2]) for r in self._x(
                f"SELECT job_id, user, uid FROM jobs WHERE state IN ({', '.join('?' for _ in states)})",
                states).fetchall()}

    def pending_jobs(self, *, include_bound: bool = False, include_blocked: bool = False) -> list[Job]:
        """PENDING jobs in Slurm priority order (priority_order, then submit time).

        Jobs that already hold a live binding (assigned, waiting for Slurm to
        start them) are left out unless ``include_bound``: a policy must not place them again.
        Jobs Slurm will not start now (``blocked``) are left out unless ``include_blocked``.
        """
        sql = "SELECT * FROM jobs j WHERE j.state = 'PENDING'"
        if not include_blocked:
            sql += " AND j.blocked IS NULL"
        if not include_bound:
            sql += " AND NOT EXISTS (SELECT 1 FROM bindings b WHERE b.job_id = j.job_id AND b.released_at IS NULL)"
        sql += " ORDER BY j.priority_order IS NULL, j.priority_order, j.submit_time, j.job_id"
        with self.snapshot():
            return [_row_job(r) for r in self._q(sql)]

    def running_jobs(self) -> list[Job]:
        """Jobs Slurm runs now (RUNNING, SUSPENDED, COMPLETING), oldest start first."""
        with self.snapshot():
            rows = self._q(
                f"SELECT * FROM jobs WHERE state IN ({', '.join('?' for _ in RUNNING_STATES)}) "
                "ORDER BY start_time, job_id",
                RUNNING_STATES,
            )
        return [_row_job(r) for r in rows]

    # -- bindings --------------------------------------------------------------
    def _gpu_model(self, node: str, gpu: int) -> GpuModel | None:
        rows = self._q("SELECT model FROM gpus WHERE node = ? AND gpu = ?", (node, gpu))
        if not rows or known_model(rows[0]["model"]) is None:
            return None  # (None for a model not in our tables too)
        # and for one whose instances its table does not allow (a newer node's profile or placement)
        return readable_model(rows[0]["model"], self._q("SELECT profile, start FROM instances "
                                                        "WHERE node = ? AND gpu = ?", (node, gpu)))

    def bind(self, job_id: str, node: str, instances: Iterable[Any], *, now: float | None = None
             ) -> tuple[BoundInstance, ...]:
        """Bind ``job_id`` to MIG instances on ``node``; returns what was bound (with UUIDs where known).

        ``instances``: ``(gpu, Slot)`` pairs (an Assignment's ``instances``), BoundInstances or dicts.
        Raises BindingConflict if any instance (or an overlapping one) is bound to another live job, or
        the job is already bound to different instances; binding the same instances again is a no-op.
        """
        job_id = str(job_id)
        items = [as_bound_instance(i) for i in instances]
        if not items:
            raise ValueError(f"bind job {job_id}: no instances given")
        t = _now(now)
        with self.transaction():
            job = self._q("SELECT state FROM jobs WHERE job_id = ?", (job_id,))
            if not job:
                raise StoreError(f"cannot bind unknown job {job_id}")
            if job[0]["state"] in TERMINAL_STATES:
                raise StoreError(f"cannot bind job {job_id}: it already ended ({job[0]['state']})")
            resolved: list[BoundInstance] = []
            for b in items:
                model = self._gpu_model(node, b.gpu)
                profile = model.profile(b.profile).name if model is not None else b.profile
                uuid = b.uuid
                if uuid is None:
                    obs = self._q("SELECT uuid FROM instances WHERE node = ? AND gpu = ? AND start = ? AND profile = ?",
                                  (node, b.gpu, b.start, profile))
                    uuid = obs[0]["uuid"] if obs else None
                resolved.append(BoundInstance(b.gpu, profile, b.start, uuid))
            keys = [(b.gpu, b.start) for b in resolved]
            if len(set(keys)) != len(keys):
                raise ValueError(f"bind job {job_id}: the same instance is listed twice")
            live = self._q("SELECT * FROM bindings WHERE job_id = ? AND released_at IS NULL", (job_id,))
            if live:
                current = {(r["node"], r["gpu"], r["start"], r["profile"]) for r in live}
                if current == {(node, b.gpu, b.start, b.profile) for b in resolved}:
                    return tuple(BoundInstance(r["gpu"], r["profile"], r["start"], r["uuid"])
                                 for r in sorted(live, key=lambda r: (r["gpu"], r["start"])))
                raise BindingConflict(
                    f"job {job_id} is already bound to "
                    + ", ".join(f"{r['node']}/{r['gpu']}/{r['profile']}@{r['start']}" for r in live),
                    tuple((r["node"], r["gpu"], r["start"], job_id) for r in live),
                )
            conflicts = []
            for b in resolved:
                model = self._gpu_model(node, b.gpu)
                others = self._q("SELECT job_id, gpu, start, profile, uuid FROM bindings "
                                 "WHERE node = ? AND gpu = ? AND released_at IS NULL", (node, b.gpu))
                if b.uuid is not None:
                    others += self._q("SELECT job_id, gpu, start, profile, uuid FROM bindings "
                                      "WHERE uuid = ? AND released_at IS NULL", (b.uuid,))
                for o in others:
                    same = o["start"] == b.start or (b.uuid is not None and o["uuid"] == b.uuid)
                    overlap = False
                    if model is not None and not same:
                        try:
                            overlap = bool(model.profile(o["profile"]).mask(o["start"])
                                           & model.profile(b.profile).mask(b.start))
                        except SlurmMigError:
                            overlap = False
                    if same or overlap:
                        conflicts.append((node, b.gpu, b.start, o["job_id"]))
            if conflicts:
                raise BindingConflict(
                    f"cannot bind job {job_id} on {node}: "
                    + "; ".join(f"GPU {g} slice {s} is held by live job {other}" for _, g, s, other in conflicts),
                    tuple(dict.fromkeys(conflicts)),
                )
            try:
                for b in resolved:
                    self._x(
                        "INSERT INTO bindings (job_id, node, gpu, start, profile, uuid, bound_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (job_id, node, b.gpu, b.start, b.profile, b.uuid, t),
                    )
            except sqlite3.IntegrityError as exc:  # the partial unique indexes: a second line of defence
                raise BindingConflict(f"cannot bind job {job_id} on {node}: an instance is already bound ({exc})") from exc
            self._x("UPDATE jobs SET node = ?, instances = ?, updated_at = ? WHERE job_id = ?",
                    (node, dumps([b.to_json() for b in resolved]), t, job_id))
        return tuple(resolved)

    def release(self, job_id: str, *, node: str | None = None, starts: Iterable[tuple[int, int]] | None = None,
                now: float | None = None) -> int:
        """Release the live bindings of ``job_id`` (only those on ``node``, and only the ``(gpu, start)``
        instances in ``starts``, when given); returns how many were released (0 if none)."""
        sql, params = "UPDATE bindings SET released_at = ? WHERE job_id = ? AND released_at IS NULL", [_now(now),
                                                                                                     str(job_id)]
        if node is not None:
            sql += " AND node = ?"
            params.append(node)
        if starts is not None:
            pairs = sorted({(int(g), int(st)) for g, st in starts})
            if not pairs:
                return 0
            sql += " AND (" + " OR ".join("(gpu = ? AND start = ?)" for _ in pairs) + ")"
            params += [v for pair in pairs for v in pair]
        with self.transaction():
            return self._x(sql, params).rowcount

    def bound_instances(self, job_id: str) -> tuple[BoundInstance, ...]:
        """The instances ``job_id`` holds now (live bindings), by GPU then start."""
        with self.snapshot():
            rows = self._q("SELECT gpu, profile, start, uuid FROM bindings WHERE job_id = ? AND released_at IS NULL "
                           "ORDER BY gpu, start", (str(job_id),))
        return tuple(BoundInstance(r["gpu"], r["profile"], r["start"], r["uuid"]) for r in rows)

    def bound_nodes(self, job_id: str) -> set[str]:
        """The nodes on which ``job_id`` holds live bindings."""
        with self.snapshot():
            rows = self._q("SELECT DISTINCT node FROM bindings WHERE job_id = ? AND released_at IS NULL",
                           (str(job_id),))
        return {r["node"] for r in rows}

    def live_bindings(self, node: str | None = None) -> list[tuple[str, str, BoundInstance]]:
        """``(job_id, node, instance)`` for every live binding (optionally on one node)."""
        sql, params = "SELECT * FROM bindings WHERE released_at IS NULL", []
        if node is not None:
            sql += " AND node = ?"
            params.append(node)
        with self.snapshot():
            rows = self._q(sql + " ORDER BY node, gpu, start", params)
        return [(r["job_id"], r["node"], BoundInstance(r["gpu"], r["profile"], r["start"], r["uuid"])) for r in rows]

    def job_on_instance(self, node: str, gpu: int, start: int) -> str | None:
        """The live job bound to the instance at ``start`` on ``node``/``gpu``, if any."""
        with self.snapshot():
            rows = self._q("SELECT job_id FROM bindings WHERE node = ? AND gpu = ? AND start = ? AND released_at IS NULL",
                           (node, int(gpu), int(start)))
        return rows[0]["job_id"] if rows else None

    # -- outcomes --------------------------------------------------------------
    def correct_end_state(self, job_id: str, state: str, *, now: float | None = None) -> bool:
        """Slurm's own word on how a job ended (CANCELLED, TIMEOUT, ...) over the one its Epilog gave: an
        Epilog sees exit status 0 for a job cancelled or timed out. Changes the job and its current run's
        outcome when they say COMPLETED or FAILED (an earlier run's keeps its end); True when it changed
        anything."""
        _check_state(state, TERMINAL_STATES, "end state")
        job_id = str(job_id)
        with self.transaction():
            a = self._x("UPDATE jobs SET state = ?, updated_at = ? WHERE job_id = ? AND state IN ('COMPLETED', "
                        "'FAILED') AND state != ?", (state, _now(now), job_id, state)).rowcount
            b = self._x("UPDATE outcomes SET state = ? WHERE job_id = ? AND state IN ('COMPLETED', 'FAILED') "
                        "AND state != ? AND run = (SELECT j.run FROM jobs j WHERE j.job_id = ?)",
                        (state, job_id, state, job_id)).rowcount
        return bool(a or b)

    def forget_guessed_end(self, job_id: str) -> bool:
        """The current run of ``job_id`` was settled as FAILED without an exit status (the controller's guess, Slurm
        having forgotten the job): forget that outcome and the job's end, for its Epilog's account to be recorded
        in their place (record_outcome, set_job_state). True when it did."""
        job_id = str(job_id)
        with self.transaction():
            cur = self._x("DELETE FROM outcomes WHERE job_id = ? AND state = 'FAILED' AND exit_code IS NULL AND "
                          "run = (SELECT j.run FROM jobs j WHERE j.job_id = ? AND j.state = 'FAILED')", (job_id, job_id))
            if not cur.rowcount:
                return False
            self._x("UPDATE jobs SET end_time = NULL, exit_code = NULL WHERE job_id = ?", (job_id,))
            return True

    def requeued_outcome(self, job_id: str, run: int) -> bool:
        """Run ``run`` of ``job_id`` was ended by a requeue, not by its exit: its outcome, recorded COMPLETED or
        FAILED from its Epilog's exit status, says REQUEUED. True when it changed."""
        with self.transaction():
            return bool(self._x("UPDATE outcomes SET state = 'REQUEUED' WHERE job_id = ? AND run = ? AND state IN "
                                "('COMPLETED', 'FAILED')", (str(job_id), int(run))).rowcount)

    def record_outcome(self, job_id: str, *, state: str, exit_code: int | None = None,
                       derived_exit_code: int | None = None, end_time: float | None = None,
                       now: float | None = None, run: int | None = None, **fields: Any) -> bool:
        """Record how the current run of ``job_id`` ended, exactly once per run: True when written, False
        if it already was. The run is the jobs row's (schema migration 4); without a jobs row there is no
        telling runs apart, and it counts as the latest run recorded.

        ``run``: an earlier run than the jobs row's (an Epilog that arrived after the id ran again). The
        jobs row is the current run's, request and all (the tick stores the new run's profile, count, user,
        partition and time limit before it tracks it as a new run; a reused id is another user's job), so
        nothing is taken from it: pass in ``fields`` what is known of that run, its profile at least;
        what is not given stays empty.

        Missing fields (profile, count, node, instances, user, partition,
        time_limit_s, submit/start times) come from the jobs row; ``fields``
        overrides any of them. wait_s and run_s are derived from the times; run_s leaves out the time the
        run spent suspended (jobs.suspended_s, suspended_since), so it is end - start only for a job never
        suspended.
        """
        _check_state(state, JOB_STATES, "job state")
        allowed = {"profile", "count", "node", "gpus", "instances", "user", "partition", "time_limit_s",
                   "submit_time", "start_time"}
        unknown = set(fields) - allowed
        if unknown:
            raise TypeError(f"record_outcome() got unknown field(s): {', '.join(sorted(unknown))}")
        job_id = str(job_id)
        t = _now(now)
        with self.transaction():
            rows = self._q("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
            job = _row_job(rows[0]) if rows else None
            current = rows[0]["run"] if rows else self._q(
                "SELECT COALESCE(MAX(run), 1) AS run FROM outcomes WHERE job_id = ?", (job_id,))[0]["run"]
            if run is not None and not 1 <= int(run) <= current:
                raise StoreError(f"cannot record an outcome for run {run} of job {job_id}: its runs are 1 to {current}")
            earlier = run is not None and int(run) < current
            run = current if run is None else int(run)
            if self._q("SELECT 1 FROM outcomes WHERE job_id = ? AND run = ?", (job_id, run)):
                return False
            if (job is None or earlier) and "profile" not in fields:
                which = f"run {run} of job {job_id}, an earlier run than its jobs row's," if earlier \
                    else f"unknown job {job_id}"
                raise StoreError(f"cannot record an outcome for {which} without its profile")
            v: dict[str, Any] = {}
            if job is not None and not earlier:
                v.update(profile=job.profile, count=job.count, user=job.user, partition=job.partition,
                         time_limit_s=job.time_limit_s, node=job.node, instances=list(job.instances),
                         submit_time=job.submit_time, start_time=job.start_time)
            v.update(fields)
            instances = [as_bound_instance(i) for i in v.get("instances") or ()]
            gpus = v.get("gpus") or sorted({i.gpu for i in instances})
            end = end_time if end_time is not None else (job.end_time if job and job.end_time and not earlier else t)
            submit, start = v.get("submit_time"), v.get("start_time")
            wait_s = max(0.0, start - submit) if start is not None and submit is not None else None
            run_s = (end - start) if start is not None and end is not None else None
            if run_s is not None and job is not None and not earlier:
                # Without the time it was suspended (schema migration 9), as Slurm's RunTime counts it: the
                # retrainer's trace replays run_s, and a job suspended for an hour did not run for one more.
                run_s = job.run_time(start, end)
            cur = self._x(
                "INSERT INTO outcomes (job_id, run, profile, count, node, gpus, instances, user, partition, "
                "time_limit_s, submit_time, start_time, end_time, wait_s, run_s, exit_code, derived_exit_code, "
                "state, recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(job_id, run) DO NOTHING",
                (job_id, int(run), v["profile"], int(v.get("count") or 1), v.get("node"), dumps(list(gpus)),
                 dumps([i.to_json() for i in instances]), v.get("user") or "", v.get("partition") or "",
                 v.get("time_limit_s"), submit, start, end, wait_s, run_s, exit_code, derived_exit_code, state, t),
            )
            return cur.rowcount == 1

    def outcome(self, job_id: str, *, run: int | None = None) -> Outcome | None:
        """The outcome of the latest recorded run of ``job_id``, or of its run ``run`` (None if there is none)."""
        rows = self._outcomes("WHERE job_id = ?", (str(job_id),))
        if run is not None:
            rows = [o for o in rows if o.run == int(run)]
        return max(rows, key=lambda o: o.run) if rows else None

    def outcomes(self, *, since: float | None = None, limit: int | None = None) -> list[Outcome]:
        """Recorded outcomes, every run of every job id, by end time (optionally those ending at or after
        ``since``)."""
        where, params = "", []
        if since is not None:
            where, params = "WHERE end_time >= ?", [since]
        # rowid: the order runs were recorded in, and a column a version-3 database (read unmigrated) has.
        tail = " ORDER BY end_time, job_id, rowid" + (" LIMIT ?" if limit is not None else "")
        if limit is not None:
            params.append(int(limit))
        return self._outcomes(where + tail, params)

    def _outcomes(self, tail: str, params: Sequence) -> list[Outcome]:
        with self.snapshot():
            rows = self._q("SELECT * FROM outcomes " + tail, params)
        return [Outcome(
            job_id=r["job_id"], profile=r["profile"], count=r["count"], node=r["node"],
            gpus=tuple(loads(r["gpus"], [])), instances=bound_instances_from_json(loads(r["instances"], [])),
            user=r["user"], partition=r["partition"], time_limit_s=r["time_limit_s"], submit_time=r["submit_time"],
            start_time=r["start_time"], end_time=r["end_time"], wait_s=r["wait_s"], run_s=r["run_s"],
            exit_code=r["exit_code"], derived_exit_code=r["derived_exit_code"], state=r["state"],
            recorded_at=r["recorded_at"],
            # Absent from a version-3 database that the read-only views open without migrating it.
            run=r.get("run") or 1,
        ) for r in rows]

    # -- decisions -------------------------------------------------------------
    def record_decision(self, decision: Any, *, state: Any = None, inputs: Any = None,
                        latency_ms: float | None = None, shadow: bool = False, now: float | None = None) -> int:
        """Store a policy Decision (and the ClusterState it saw) for `explain`, replay and training.

        For a live (non-shadow) decision, each waiting job's reason is copied to its jobs row.
        Returns the decision id.
        """
        t = _now(now)
        if inputs is None:
            inputs = state_to_json(state) if state is not None else {}
        waiting = [[str(j), r] for j, r in decision.waiting]
        texts = (_dumps_finite(inputs), _dumps_finite(decision_to_json(decision)), dumps(waiting))
        size = sum(_utf8_len(x) for x in texts)
        with self.transaction():
            cur = self._x(
                "INSERT INTO decisions (time, policy, version, shadow, inputs, action, reasons, latency_ms) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (t, decision.policy or "", decision.version or "", int(bool(shadow)), *texts, latency_ms),
            )
            self._x("INSERT INTO decision_bytes (id, bytes) VALUES (?, ?)", (cur.lastrowid, size))
            self.decision_bytes_unpruned += size
            if not shadow:
                # One statement run for every job, in this order (a job both waiting and assigned ends with the
                # assignment's reason), as the one statement per job it replaces.
                update = "UPDATE jobs SET reason = ? WHERE job_id = ? AND state = 'PENDING'"
                self._xm(update, [(reason, job_id) for job_id, reason in waiting])
                self._xm(update, [(a.reason, a.job_id) for a in decision.assignments])
            return int(cur.lastrowid)

    def recent_decisions(self, n: int = 20, *, shadow: bool | None = None) -> list[DecisionRecord]:
        """The last ``n`` decisions, newest first (only live or only shadow ones if ``shadow`` is set)."""
        sql, params = "SELECT * FROM decisions", []
        if shadow is not None:
            sql += " WHERE shadow = ?"
            params.append(int(shadow))
        with self.snapshot():
            rows = self._q(sql + " ORDER BY id DESC LIMIT ?", (*params, int(n)))
        return [DecisionRecord(r["id"], r["time"], r["policy"], r["version"], bool(r["shadow"]), loads(r["inputs"]),
                               loads(r["action"], {}), loads(r["reasons"], []), r["latency_ms"]) for r in rows]

    # -- reconfiguration journal -------------------------------------------------
    def journal_begin(self, node: str, gpu: int, from_layout: Layout | str, to_layout: Layout | str,
                      steps: Iterable[Any], *, decision_id: int | None = None, started: bool = True,
                      now: float | None = None) -> int:
        """Write the intent of a reconfiguration before touching the GPU; returns the entry id.

        ``steps``: transitions.Step objects (or dicts {action, profile, start}), in order.
        The entry is ``in_progress`` (or ``planned`` with ``started=False``) until journal_finish().
        """
        t = _now(now)
        step_rows = [as_step(s) for s in steps]
        with self.transaction():
            cur = self._x(
                "INSERT INTO reconfig_journal (node, gpu, from_layout, to_layout, steps, state, decision_id, "
                "created_at, started_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (node, int(gpu), str(from_layout), str(to_layout), dumps([s.to_json() for s in step_rows]),
                 "in_progress" if started else "planned", decision_id, t, t if started else None, t),
            )
            return int(cur.lastrowid)

    def journal_entry(self, entry_id: int) -> JournalEntry:
        with self.snapshot():
            rows = self._q("SELECT * FROM reconfig_journal WHERE id = ?", (int(entry_id),))
        if not rows:
            raise StoreError(f"no reconfiguration journal entry {entry_id}")
        return _row_journal(rows[0])

    def journal_step(self, entry_id: int, step: int | None = None, *, ok: bool = True, error: str | None = None,
                     now: float | None = None) -> JournalEntry:
        """Record that step number ``step`` (default: the next one) finished (``ok``) or failed.

        A successful step advances ``progress``; a planned entry becomes in_progress.
        """
        t = _now(now)
        with self.transaction():
            entry = self.journal_entry(entry_id)
            if entry.state not in JOURNAL_OPEN_STATES:
                raise StoreError(f"journal entry {entry_id} is already {entry.state}")
            index = entry.progress if step is None else int(step)
            if index != entry.progress or index >= len(entry.steps):
                raise StoreError(f"journal entry {entry_id}: step {index} is not the next step "
                                 f"(progress {entry.progress} of {len(entry.steps)})")
            log_item = {"step": index, "action": entry.steps[index].action, "slot": str(entry.steps[index].slot),
                        "ok": bool(ok), "error": error, "at": t}
            self._x(
                "UPDATE reconfig_journal SET progress = ?, step_log = ?, state = 'in_progress', "
                "started_at = COALESCE(started_at, ?), updated_at = ?, error = COALESCE(?, error) WHERE id = ?",
                (entry.progress + (1 if ok else 0), dumps([*entry.step_log, log_item]), t, t, error, int(entry_id)),
            )
            return self.journal_entry(entry_id)

    def journal_finish(self, entry_id: int, state: str = "done", *, outcome: str | None = None,
                       error: str | None = None, now: float | None = None) -> JournalEntry:
        """Close a journal entry as done, failed or abandoned."""
        if state not in ("done", "failed", "abandoned"):
            raise ValueError(f"journal entries finish as done, failed or abandoned, not {state!r}")
        t = _now(now)
        with self.transaction():
            entry = self.journal_entry(entry_id)
            if entry.state not in JOURNAL_OPEN_STATES:
                raise StoreError(f"journal entry {entry_id} is already {entry.state}")
            self._x("UPDATE reconfig_journal SET state = ?, outcome = ?, error = COALESCE(?, error), updated_at = ?, "
                    "finished_at = ? WHERE id = ?", (state, outcome, error, t, t, int(entry_id)))
            return self.journal_entry(entry_id)

    def journal_started(self, entry_id: int, *, now: float | None = None) -> None:
        """Mark an open entry as taken up by a node (``in_progress``); its start time is kept if it had one."""
        with self.transaction():
            self._x("UPDATE reconfig_journal SET state = 'in_progress', started_at = COALESCE(started_at, ?) "
                    "WHERE id = ? AND state IN ('planned', 'in_progress')", (_now(now), int(entry_id)))

    def open_journal_entries(self, node: str | None = None) -> list[JournalEntry]:
        """Entries still planned or in progress (after a crash: what to resume or undo), oldest first."""
        sql, params = "SELECT * FROM reconfig_journal WHERE state IN ('planned', 'in_progress')", []
        if node is not None:
            sql += " AND node = ?"
            params.append(node)
        with self.snapshot():
            return [_row_journal(r) for r in self._q(sql + " ORDER BY id", params)]

    def journal_entries(self, *, limit: int = 50) -> list[JournalEntry]:
        """The most recent journal entries, newest first."""
        with self.snapshot():
            return [_row_journal(r) for r in self._q("SELECT * FROM reconfig_journal ORDER BY id DESC LIMIT ?",
                                                     (int(limit),))]

    # -- events ----------------------------------------------------------------
    def prune(self, *, keep_decisions: int = 50_000, keep_decisions_bytes: int | None = None,
              keep_events: int = 200_000, keep_journal_days: float = 30.0,
              now: float | None = None) -> dict[str, int]:
        """Bound the history tables: the newest decisions/events by count, finished journal entries by age.

        Decisions are also bound by size when ``keep_decisions_bytes`` is given: the oldest go until the
        newest ones' inputs, action and reasons (as stored, table decision_bytes) fit in it; the newest one
        is always kept, whatever its size. The sizes are read from decision_bytes, never from the JSON.
        Deleting a decision reads its pages (SQLite frees them one by one, some 7 ms a MB), so they go
        oldest first, PRUNE_STEP_BYTES per transaction (node requests get the lock in between), and at most
        PRUNE_MAX_BYTES per call; what is left to go is then ``decision_bytes_unpruned``, and the controller
        prunes again next tick when that is a tenth of its budget (the first prune of an upgraded database
        that has grown to tens of GB).
        The record of handled node messages (node_messages) is kept as long as finished journal entries: a
        node re-sends a message within minutes, or when it is back from a failure.
        Jobs, bindings and outcomes are never pruned here (outcomes are training data).
        """
        cutoff = _now(now) - keep_journal_days * 86400
        with self.snapshot():
            last = self._x("SELECT MAX(id) FROM decisions").fetchone()[0] or 0
            upto = last - int(keep_decisions)  # decisions with an id up to this go
            if keep_decisions_bytes is not None:
                # SQLite's integers are 64-bit: a budget past them keeps everything, as one just below does.
                budget = min(max(int(keep_decisions_bytes), 0), 2 ** 62)
                row = self._x(
                    "SELECT MAX(id) FROM (SELECT id, SUM(bytes) OVER (ORDER BY id DESC) AS newer FROM decision_bytes) "
                    "WHERE newer > ?", (budget,)).fetchone()
                if row[0] is not None:
                    upto = max(upto, min(int(row[0]), last - 1))  # the newest one stays
            going = self._x("SELECT id, bytes FROM decision_bytes WHERE id <= ? ORDER BY id", (upto,)).fetchall()
        # The steps: the last id each deletes. The final one takes any decision without a size, too.
        ends, step, total, left = [], 0, 0, 0
        for i, (did, size) in enumerate(going):
            if total and total + size > PRUNE_MAX_BYTES:
                left = sum(b for _, b in going[i:])
                break
            if step and step + size > PRUNE_STEP_BYTES:
                ends.append(going[i - 1][0])
                step = 0
            step += size
            total += size
        else:
            ends.append(upto)
        if left:
            ends.append(going[i - 1][0])
        d = 0
        for end_id in ends:
            with self.transaction():
                d += self._x("DELETE FROM decisions WHERE id <= ?", (end_id,)).rowcount
                self._x("DELETE FROM decision_bytes WHERE id <= ?", (end_id,))
        self.decision_bytes_unpruned = left
        with self.transaction():
            e = self._x("DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (int(keep_events),)).rowcount
            j = self._x("DELETE FROM reconfig_journal WHERE finished_at IS NOT NULL AND finished_at < ?",
                        (cutoff,)).rowcount
            m = self._x("DELETE FROM node_messages WHERE handled_at < ?", (cutoff,)).rowcount
        return {"decisions": d, "events": e, "journal": j, "messages": m}

    def message_answer(self, node: str, route: str, message_id: str) -> dict | None:
        """The answer the node message ``message_id`` from ``node`` on ``route`` was given when it was
        handled (see record_message); None if it was not (or that was longer ago than prune keeps). Ask
        inside the transaction that would handle it, so that a second delivery cannot slip in between."""
        with self.snapshot():
            rows = self._q("SELECT answer FROM node_messages WHERE node = ? AND route = ? AND message_id = ?",
                           (node, route, str(message_id)))
        return loads(rows[0]["answer"], {}) if rows else None

    def record_message(self, node: str, route: str, message_id: str, answer: dict, *,
                       now: float | None = None) -> None:
        """Note that the node message ``message_id`` was handled and answered ``answer``, in the
        transaction of its effects: a later delivery of it is answered the same and changes nothing."""
        with self.transaction():
            self._x("INSERT INTO node_messages (node, route, message_id, answer, handled_at) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT(node, route, message_id) DO NOTHING",
                    (node, route, str(message_id), dumps(answer), _now(now)))

    def add_event(self, kind: str, message: str, details: dict | None = None, *, node: str | None = None,
                  job_id: str | None = None, now: float | None = None) -> int:
        with self.transaction():
            cur = self._x("INSERT INTO events (time, kind, message, node, job_id, details) VALUES (?, ?, ?, ?, ?, ?)",
                          (_now(now), kind, message, node, None if job_id is None else str(job_id),
                           dumps(details or {})))
            return int(cur.lastrowid)

    def recent_events(self, n: int = 50, *, kind: str | None = None, node: str | None = None,
                      job_id: str | None = None) -> list[Event]:
        """The last ``n`` events, newest first, optionally filtered."""
        where, params = [], []
        for col, val in (("kind", kind), ("node", node), ("job_id", job_id)):
            if val is not None:
                where.append(f"{col} = ?")
                params.append(str(val))
        sql = "SELECT * FROM events" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id DESC LIMIT ?"
        with self.snapshot():
            rows = self._q(sql, (*params, int(n)))
        return [Event(r["id"], r["time"], r["kind"], r["message"], r["node"], r["job_id"], loads(r["details"], {}))
                for r in rows]

    # -- the policy's view ------------------------------------------------------
    def cluster_state(self, now: float | None = None, *, stale_after_s: float | None = None,
                      prolog_choice: Callable[[str, str, str, int, list[dict]], Iterable[tuple[int, Slot]]]
                      | None = None) -> Any:
        """A policies.base.ClusterState built from the database, so a policy can run straight from it.

        Per GPU with a known model: ``layout`` = the observed instances, with the
        finished steps of open journal entries applied and instances those
        entries are still creating added (when they fit). ``reconfiguring`` =
        every instance an open journal entry names. ``busy`` = instances bound
        to a live job, plus any the node reports in use. ``busy_until`` = start
        + time limit (+ the time it was suspended) of running bound jobs; none for a job suspended now. ``available`` = node up, MIG on, the
        GPU not blocked, and (with ``stale_after_s``) seen recently. ``pending`` = pending_jobs().
        GPUs whose model slurm-mig does not know are left out. ``prolog_choice(job_id, node, profile, count,
        gpus)``: the ``(gpu, slot)`` instances the Prolog of a job Slurm started on ``node`` would bind now, on
        ``gpus`` (the node's GPUs as this view holds them: dicts of index, observed, mig_enabled, blocked,
        desired and bound); the controller's (Controller._prolog_choice), so the store needs none of its
        rules (see "promised" below). Without it such a job holds the lowest free instances of its size.
        """
        from slurm_mig.policies.base import ClusterState, GpuState, PendingJob

        t = _now(now)
        with self.snapshot():
            nodes = {r["name"]: r for r in self._q("SELECT * FROM nodes")}
            gpu_rows = self._q("SELECT * FROM gpus ORDER BY node, gpu")
            inst_rows = self._q("SELECT * FROM instances ORDER BY node, gpu, start")
            bind_rows = self._q(
                "SELECT b.node, b.gpu, b.start, b.profile, b.job_id, j.start_time, j.time_limit_s, j.state, j.suspended_s "
                "FROM bindings b JOIN jobs j ON j.job_id = b.job_id WHERE b.released_at IS NULL"
            )
            journal = [_row_journal(r) for r in self._q(
                "SELECT * FROM reconfig_journal WHERE state IN ('planned', 'in_progress') ORDER BY id")]
            pending = self.pending_jobs()
            # Jobs Slurm has started whose Prolog has not bound them yet: Slurm gave each an instance of
            # its size on its node, which the Prolog is about to take (see "promised" below).
            unbound = self._q(
                "SELECT job_id, node, profile, count, start_time FROM jobs WHERE state IN ('RUNNING', 'CONFIGURING') "
                "AND node IS NOT NULL AND (start_time IS NULL OR start_time >= ?) AND job_id NOT IN "
                "(SELECT job_id FROM bindings WHERE released_at IS NULL) ORDER BY start_time, job_id",
                (t - UNBOUND_START_WINDOW_S,))
            desired_rows = self._q("SELECT node, gpu, layout FROM desired_layouts") if unbound else []
        observed: dict[tuple[str, int], list[dict]] = {}
        for r in inst_rows:
            observed.setdefault((r["node"], r["gpu"]), []).append(r)
        bound: dict[tuple[str, int], list[dict]] = {}
        for r in bind_rows:
            bound.setdefault((r["node"], r["gpu"]), []).append(r)
        open_entries: dict[tuple[str, int], list[JournalEntry]] = {}
        for e in journal:
            open_entries.setdefault((e.node, e.gpu), []).append(e)

        gpus = []
        flags: dict[tuple[str, int], tuple[bool, bool]] = {}  # (MIG on, blocked), for prolog_choice
        for g in gpu_rows:
            key = (g["node"], g["gpu"])
            model = known_model(g["model"])
            if model is not None and g.get("blocked"):
                # Only a blocked GPU may hold instances its table does not allow (replace_observed blocks every
                # one): the check is not made for the others, every tick.
                model = readable_model(model, observed.get(key, ()))
            if model is None:
                # No model, one our tables do not list (a newer node's), or instances its table does not allow (a
                # newer node's profile or placement): left out of the policy's view. Not logged here, every tick:
                # the controller warns when the report comes (Controller._store_observed).
                continue
            layout = Layout(model, frozenset(Slot(r["start"], r["profile"]) for r in observed.get(key, ())))
            in_use = {Slot(r["start"], r["profile"]) for r in observed.get(key, ()) if r["in_use"]}
            touched: set[Slot] = set()

            def fits(lay: Layout, slot: Slot) -> bool:
                try:
                    return lay.with_slot(slot).is_valid()
                except SlurmMigError:
                    return False

            for e in open_entries.get(key, ()):
                for i, step in enumerate(e.steps):
                    slot = step.slot
                    touched.add(slot)
                    if step.action == "destroy" and i < e.progress:
                        layout = layout.without([slot])
                    elif step.action == "create" and slot not in layout.slots and fits(layout, slot):
                        layout = layout.with_slot(slot)
            bound_slots = set()
            until = []
            held = {Slot(b["start"], b["profile"]) for b in bound.get(key, ())}
            for b in bound.get(key, ()):
                slot = Slot(b["start"], b["profile"])
                if slot not in layout.slots and not fits(layout, slot):
                    # A Prolog is creating this bound instance right now: the binding is the truth, the
                    # idle instances in its way are on their way out.
                    try:
                        mask = model.profile(slot.profile).mask(slot.start)
                        layout = layout.without(s for s in layout.slots if s not in held
                                                and model.profile(s.profile).mask(s.start) & mask)
                    except SlurmMigError:
                        pass
                if slot not in layout.slots and fits(layout, slot):
                    layout = layout.with_slot(slot)
                if slot not in layout.slots:
                    log.warning("job %s is bound to %s on %s/%s, which overlaps the GPU's layout %s",
                                b["job_id"], slot, key[0], key[1], layout)
                    continue
                bound_slots.add(slot)
                if b["start_time"] is not None and b["time_limit_s"] is not None and b["state"] != "SUSPENDED":
                    # Slurm does not count suspended time against the limit (it moves the end on resume): a
                    # job once suspended ends that much later. One suspended now has no bounded end until it
                    # is resumed (left out: INF, as a job without a limit), so no reservation counts on its
                    # instance; start + limit there freed it while it may stay suspended for hours.
                    until.append((slot, float(b["start_time"]) + float(b["time_limit_s"])
                                  + float(b.get("suspended_s") or 0.0)))
            node = nodes.get(g["node"])
            # A blocked GPU (a MIG mode change pending a reset, an unknown profile's instance) keeps its layout
            # and busy instances in view, but no policy may change it or start a job on it, as on a drained node.
            available = bool(g["mig_enabled"]) and not g.get("blocked") and node is not None and node["state"] == "up"
            if available and stale_after_s is not None:
                available = node["last_seen"] is not None and t - node["last_seen"] <= stale_after_s
            flags[key] = (bool(g["mig_enabled"]), bool(g.get("blocked")))
            gpus.append(dict(
                node=g["node"], index=g["gpu"], model=model, layout=layout,
                busy=set((bound_slots | in_use) & layout.slots),
                reconfiguring=frozenset(touched & layout.slots),
                busy_until=tuple(sorted(until)), available=available,
            ))
        # Promised instances: a job Slurm started minutes ago, not bound yet, holds an idle instance of its
        # size on its node in the policy's view, so no plan destroys the instance its Prolog is about to
        # take. Without this a burst at start-up had Slurm hand out a node's boot instances while the same
        # tick planned them away, and the Prologs of bigger jobs sent there found the slices taken. The
        # instance is the one its Prolog would choose now (choose_binding, its reservation first): counted as
        # the lowest free one, a job reserved 3g@4 held 3g@0 in the plan, which re-carved 3g@4 under it. Where
        # the Prolog would create one, the lowest free existing one is held (a plan cannot promise the rest).
        desired = {(r["node"], r["gpu"]): r["layout"] for r in desired_rows}
        for j in unbound:
            count = max(1, int(j["count"] or 1))
            on_node = [g for g in gpus if g["node"] == j["node"]]
            for gi, slot in self._prolog_choice(j, on_node, count, desired, flags, prolog_choice):
                next(g for g in on_node if g["index"] == gi)["busy"].add(slot)
                count -= 1
            for _ in range(count):
                for g in on_node:
                    try:
                        want = g["model"].profile(j["profile"]).name
                    except SlurmMigError:
                        continue
                    free = sorted((sl for sl in g["layout"].slots if sl.profile == want and sl not in g["busy"]
                                   and sl not in g["reconfiguring"]), key=lambda sl: sl.start)
                    if free:
                        g["busy"].add(free[0])
                        break
        gpus = [GpuState(**{**g, "busy": frozenset(g["busy"])}) for g in gpus]
        jobs = tuple(PendingJob(job_id=j.job_id, profile=j.profile, count=j.count, submit_time=j.submit_time,
                                time_limit_s=j.time_limit_s, user=j.user, partition=j.partition) for j in pending)
        return ClusterState(now=t, gpus=tuple(gpus), pending=jobs)

    @staticmethod
    def _prolog_choice(job: dict, on_node: list[dict], count: int, desired: dict, flags: dict,
                       prolog_choice: Callable[[str, str, str, int, list[dict]], Iterable[tuple[int, Slot]]] | None
                       ) -> list[tuple[int, Slot]]:
        """The idle existing instances the Prolog of started, unbound ``job`` would bind now (``prolog_choice``
        on its node's GPUs as the policy sees them). Picks it would create are left out."""
        if prolog_choice is None or not on_node:
            return []
        gpus = []
        for g in on_node:
            key = (g["node"], g["index"])
            want = None
            if key in desired:
                try:
                    want = parse_layout(desired[key], g["model"])
                except (ValueError, SlurmMigError):
                    pass
            mig_enabled, blocked = flags[key]
            gpus.append(dict(index=g["index"], observed=g["layout"], mig_enabled=mig_enabled, blocked=blocked,
                             desired=want, bound=frozenset(g["busy"])))
        try:
            plan = list(prolog_choice(str(job["job_id"]), job["node"], job["profile"], count, gpus))
        except (ValueError, KeyError, TypeError, SlurmMigError) as exc:
            log.warning("could not tell which instance job %s's Prolog will take: %s", job["job_id"], exc)
            return []
        by = {g["index"]: g for g in on_node}
        return [(gi, s) for gi, s in plan if gi in by and s in by[gi]["layout"].slots and s not in by[gi]["busy"]]
