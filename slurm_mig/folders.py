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
