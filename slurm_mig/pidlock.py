"""A lock a process holds for as long as it runs, naming its pid: one controller per state database, one
demo per state dir. flock, so the kernel drops it when the holder dies, however it dies."""

from __future__ import annotations

import fcntl
import os


def hold(path: str | os.PathLike) -> tuple[int | None, str]:
    """Lock ``path`` (created 0600, never through a symlink) and write this process's pid into it.

    Returns ``(fd, "")``: the lock lasts while ``fd`` stays open. When another process holds it:
    ``(None, the pid it wrote)`` ("?" if it wrote none)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        return None, holder
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd, ""
