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


#: The mode slurm-mig makes its log files with (the umask can only take bits away).
LOG_MODE = 0o644


def open_to_append(path: str | os.PathLike, mode: int = LOG_MODE):
    """``path`` opened to append bytes, made with ``mode`` if it is missing: the umask can only take bits away.
    open(path, "a") made it 0666 less the umask, writable by anyone under umask 0, and root appends to it (a
    log). One that exists keeps its mode."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
    return open(path, "ab", opener=lambda p, f: os.open(p, f | flags, mode))


def log_file_handler(path: str | os.PathLike, mode: int = LOG_MODE):
    """A logging.FileHandler appending to ``path``, which is made with ``mode`` if missing (open_to_append);
    FileHandler alone made it 0666 less the umask. OSError as open() raises it."""
    import logging

    open_to_append(path, mode).close()
    return logging.FileHandler(path)


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
    # The folder as open() finds it: tempfile makes its folder absolute with os.path.abspath, which drops "L/.." by
    # the letters where the kernel follows the link L first, so the temporary file was sought in another folder
    # (FileNotFoundError, or a rename from there). The file is renamed into that same folder.
    folder = os.path.realpath(path.parent)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
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
        os.replace(tmp, os.path.join(folder, path.name))
    finally:
        if fd != -1:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
    sync_path(folder)


def _who(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def writable_by_others(path: str | os.PathLike, what: str) -> str:
    """Why others than root and the user this process runs as may change what ``path`` (a file or a folder)
    holds; '' when they may not. The one rule for what a process running as root (the controller, the node hooks)
    acts on: its config (the controller and the hooks refuse to start on it), the policy store (`slurm-mig policy
    install`, `rollback` and `retrain --install` refuse to write it) and every file of the rl model the controller
    runs (rl.model_trust_problem: refused like a model that does not load). ``path`` and every folder above it,
    as given and with its symbolic links resolved (links too: whoever owns a link in a sticky folder can swap
    it), must be owned by root or by this process's user (the owner of a folder may rename what it holds, sticky
    or not; the owner of a file may rewrite it whatever its mode); ``path`` must be writable by its owner only;
    a folder above it writable by its group or by anyone must be sticky (as /tmp is: there others cannot rename
    what is not theirs). What does not exist is judged by the folders above it."""
    import stat

    trusted = (0, os.geteuid())
    owners = "root" if os.geteuid() == 0 else f"root or uid {os.geteuid()}, this process's user"
    given = Path(os.path.abspath(path))
    # realpath of the path as given, not of ``given``: abspath drops "link/.." by the letters, where open() follows
    # the link first ("/etc/L/../x" is x in the folder above L's target, not /etc/x)
    for p in dict.fromkeys((given, Path(os.path.realpath(path)))):
        for d in (*reversed(p.parents), p):
            try:
                st = os.lstat(d)
            except OSError:  # missing (or not a folder on the way): judged by the folders above it
                break
            link = stat.S_ISLNK(st.st_mode)
            mode = stat.S_IMODE(st.st_mode)
            if d == p:
                kind = "link" if link else "folder" if stat.S_ISDIR(st.st_mode) else "file"
                can = ("put files there" if kind == "folder" and st.st_mode & stat.S_ISVTX else
                       "put files there or rename those it holds" if kind == "folder" else
                       "point it elsewhere" if link else "rewrite it")
                name = f"{what} {d} is"
            else:
                can = "rename it away and put their own in its place"
                name = f"{what} {p} lies in {d}, which is"
            if st.st_uid not in trusted:
                return (f"{name} owned by {_who(st.st_uid)}, not by {owners}: its owner could {can}; check what it "
                        f"holds, then `chown {'root' if os.geteuid() == 0 else os.geteuid()} {d}`")
            if link:
                continue  # a link's own mode means nothing
            if mode & 0o022 and (d == p or not mode & stat.S_ISVTX):
                who, bits = ("anyone", "o-w") if mode & 0o002 else (f"its group (gid {st.st_gid})", "g-w")
                head = f"{what} {d} is writable by {who}" if d == p else f"{what} {p} lies in {d}, which {who} may write"
                return (f"{head} (mode {mode:o}): {'anyone' if bits == 'o-w' else 'the group'} could {can}; check "
                        f"what it holds, then `chmod {bits} {d}` (slurm-mig makes its folders 0755, files 0644)")
    return ""
