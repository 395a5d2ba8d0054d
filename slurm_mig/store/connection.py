"""Opening the state database: its file made or checked safely before SQLite touches it, the SQLite connection,
and SQLite's errors translated into slurm-mig's (StoreBusy, StoreUnavailable, StoreError).

Opening: the file is created by ``os.open(path, O_CREAT|O_NOFOLLOW, 0o600)`` (0o640 when a group is
configured); an existing file that is a symlink, not a regular file, world-writable, or owned by a user other
than this process's and root is refused with a StoreError; any other wrong mode is repaired. SQLite's
``-wal``/``-shm`` files are checked the same way. open_store (db.py) opens a Store with these.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
import urllib.parse
from pathlib import Path

from slurm_mig.argtypes import ascii_digits
from slurm_mig.errors import SlurmMigError, StoreBusy, StoreError
from slurm_mig.folders import make_missing_folders

log = logging.getLogger("slurm_mig.store.db")  # the name the store's messages have always had

DEFAULT_BUSY_TIMEOUT_S = 5.0


class StoreUnavailable(StoreError):
    """The database cannot be written for a reason of its own (disk full, I/O error, read-only, damaged file),
    not because of what was asked: try again once an admin has fixed it (exit code 75 like StoreBusy,
    so the node API answers 503 and the nodes keep their messages)."""

    exit_code = 75


class StoreDamaged(StoreUnavailable):
    """The file is not an SQLite database, or a damaged one (SQLite: "file is not a database", "database disk image
    is malformed"). Exit code 75 like StoreUnavailable for the controller (its API answers 503); the operator's
    read-only commands report it as a plain StoreError (exit 1): waiting will not mend the file."""


MEMORY = ":memory:"


# -- opening -------------------------------------------------------------------

def resolve_gid(group: str | int | None) -> int | None:
    """The gid of ``[controller].db_group`` (a name, or a number given as one); None for no group."""
    if group is None or group == "":
        return None
    if isinstance(group, int):
        return group
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if ascii_digits(group):
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
            # Narrowed first, to what both the old mode and the final one allow: changed before the mode, the
            # group took the file's old bits for a moment (0660 gave the new group write where 0640 is meant).
            both = stat.S_IMODE(st.st_mode) & mode
            if both != stat.S_IMODE(st.st_mode):
                os.fchmod(fd, both)
            os.fchown(fd, -1, gid)
            if both != mode:
                os.fchmod(fd, mode)
        elif stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
        if stat.S_IMODE(st.st_mode) != mode:
            log.warning("state database %s had mode %04o; set it to %04o", path, stat.S_IMODE(st.st_mode), mode)
    except PermissionError:
        raise StoreError(
            f"state database {path} has mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, "
            f"gid {st.st_gid}; expected {mode:04o}{'' if gid is None else f' and gid {gid}'} and cannot fix it "
            f"as uid {os.geteuid()}"
        ) from None


def _open_checked(path: Path, flags: int, mode: int, gid: int | None) -> None:
    try:
        # O_NONBLOCK: a FIFO at the path is refused by _check_fd, never waited on (Linux opens one O_RDWR at
        # once, but POSIX leaves that undefined).
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
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


def make_db_folders(folder: Path, gid: int | None) -> None:
    """Make the database's folder (0700, or 0750 owned by ``gid``) and the missing folders above it (0755),
    each given its mode whatever the umask (folders.make_missing_folders). ``mkdir(parents=True)`` made those
    above with 0777 less the umask: world-writable under umask 0, so anyone could move the database's folder
    aside and put one of their own in its place; and under umask 0077 the group's folder came out 0700,
    which the readers of ``db_group`` cannot enter. A folder that exists is left as it is. Used by the store
    and by the controller's claim_database, which runs before it."""
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
    gid = resolve_gid(group)
    mode = 0o640 if gid is not None else 0o600
    make_db_folders(path.parent, gid)
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
        return StoreDamaged(f"state database {path} is not a usable SQLite database ({msg})")
    if "readonly" in low or "read-only" in low:
        return StoreUnavailable(f"state database {path} is read-only for this process ({msg})")
    if "disk i/o error" in low or code == getattr(sqlite3, "SQLITE_IOERR", 10):
        return StoreUnavailable(f"state database {path}: disk I/O error; nothing of this operation was written "
                                f"({msg})")
    return StoreError(f"state database {path}: {msg}")


def _passthrough(exc: BaseException) -> bool:
    """sqlite3 errors that are programming bugs, not store conditions: let them through unchanged."""
    return isinstance(exc, (sqlite3.ProgrammingError, sqlite3.InterfaceError))
