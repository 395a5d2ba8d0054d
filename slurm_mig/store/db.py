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

The Store's methods live in modules named for the tables they hold, as mixins Store is made of: nodes.py
(nodes, gpus, instances), desired.py (desired_layouts), jobs.py, bindings.py, outcomes.py, journal.py
(reconfig_journal), history.py (decisions, events, node_messages, and prune), cluster_state.py (the policy's
view); this module keeps its core (transactions, locking, meta) and open_store. connection.py opens the file
and translates SQLite's errors, rows.py converts rows, lock.py holds the Store's lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from typing import Any, Iterable, Iterator, Sequence

import sqlite_utils

from slurm_mig.errors import StoreBusy, StoreError
from slurm_mig.store import schema
from slurm_mig.store.bindings import BindingsMixin
from slurm_mig.store.cluster_state import ClusterStateMixin
from slurm_mig.store.connection import (  # noqa: F401  (re-exported: importers use them from here)
    DEFAULT_BUSY_TIMEOUT_S,
    MEMORY,
    StoreDamaged,
    StoreUnavailable,
    _connect,
    _passthrough,
    _translate,
    prepare_db_file,
    sqlite_uri,
)
from slurm_mig.store.desired import DesiredLayoutsMixin
from slurm_mig.store.history import HistoryMixin
from slurm_mig.store.jobs import JobsMixin
from slurm_mig.store.journal import JournalMixin
from slurm_mig.store.lock import _FairRLock
from slurm_mig.store.models import dumps, loads
from slurm_mig.store.nodes import NodesMixin
from slurm_mig.store.outcomes import OutcomesMixin
from slurm_mig.store.rows import _now, finite, row_journal  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)


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


class Store(NodesMixin, DesiredLayoutsMixin, JobsMixin, BindingsMixin, OutcomesMixin, HistoryMixin, JournalMixin,
            ClusterStateMixin):
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
        # Opened as an immutable snapshot (ops.views.open_readonly, for a reader who cannot make the -shm while no
        # controller is up): it never sees a writer's changes, and a writer's checkpoint under it reads as damage.
        self.immutable = False

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

    def select_rows(self, sql: str, params: Sequence | dict = ()) -> list[dict]:
        """The rows (column -> value) of one SELECT, for readers outside the store (the operator's views, which open
        the database read-only); values go in ``params``, never into ``sql``. Anything but a SELECT is a ValueError:
        writes go through the store's own methods. Inside ``snapshot()`` for a consistent view of several."""
        if not sql.lstrip().upper().startswith("SELECT"):
            raise ValueError(f"select_rows runs a SELECT only, not {sql.lstrip()[:40]!r}")
        return self._q(sql, params)

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
