"""Folders that root's files live in, made with their modes whatever the umask."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def make_missing_folders(leaf: Path, mode_of: Callable[[Path], int]) -> list[Path]:
    """Make ``leaf`` and the folders above it that are missing, each with ``mode_of(folder)`` whatever the
    umask: made with that mode (the umask can only take bits away) and then chmod-ed, so no kill in between
    leaves one with another mode. ``mkdir(parents=True)`` gives those above 0777 less the umask
    (world-writable under umask 0). A folder that exists, or that another process makes meanwhile, is left
    as it is. Returns the folders made here, outermost first; OSError (its ``filename`` the folder) when
    one cannot be made."""
    missing, d = [], Path(leaf)
    while not os.path.lexists(d) and d != d.parent:
        missing.append(d)
        d = d.parent
    made = []
    for d in reversed(missing):
        mode = mode_of(d)
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue
        os.chmod(d, mode)
        made.append(d)
    return made


def sync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder by its name: a folder's fsync makes the names renamed or made in it
    survive a power cut."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str | os.PathLike, data: bytes, mode: int, uid: int | None = None,
                  gid: int | None = None) -> None:
    """Put ``data`` at ``path`` so that a crash or a power cut leaves the old file or the new one, whole:
    a temporary file in the same folder (mode ``mode``, and owner ``uid``/``gid`` when run as root, set
    before anything is written), the data written and fsynced, renamed over ``path``, then the folder
    fsynced (without it the rename itself may be lost, and after a power cut the name may point to an
    empty file on some file systems). The temporary file is removed when anything fails."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        os.fchmod(fd, mode)
        if uid is not None and os.geteuid() == 0:
            os.fchown(fd, uid, -1 if gid is None else gid)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    finally:
        if fd != -1:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
    sync_path(path.parent)
