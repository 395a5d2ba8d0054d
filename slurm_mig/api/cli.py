"""`slurm-mig keys`: one HMAC key per node, so that no node can sign a request for another."""

from __future__ import annotations

import argparse
import os
import stat
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="create one HMAC key per node ([auth].hmac_node_keys_dir)",
                       description="Create a key file <dir>/<node>.key (0600) for each node that has none; "
                                   "never overwrites one. Copy each to its node as [auth].hmac_key_file.")
    p.add_argument("nodes", nargs="+", help="node names or Slurm host lists (gpu[01-16])")
    p.add_argument("--dir", required=True, help="the controller's [auth].hmac_node_keys_dir")
    p.set_defaults(func=_keys)


def create_node_keys(folder: str, nodes: list[str]) -> list[tuple[str, str, bool]]:
    """(node, key file, created) for each node; a node that already has a key keeps it.

    Raises SlurmMigError for a name that cannot name a key file, or a folder others can read.
    """
    from slurm_mig.api.auth import NodeKeys, create_key
    from slurm_mig.errors import SlurmMigError

    keys = NodeKeys(folder)
    bad = [n for n in nodes if keys.path(n) is None]
    if bad:
        raise SlurmMigError(f"not a node name: {', '.join(repr(b) for b in bad[:5])} "
                            f"(letters, digits, '.', '_', '-'; 64 at most)")
    # Not os.makedirs: it made the folders above 0777 less the umask (world-writable under umask 0: anyone could
    # move the key folder aside and put theirs there), and a file in the way was its traceback.
    from pathlib import Path

    from slurm_mig.folders import make_missing_folders

    leaf = Path(folder)
    try:
        make_missing_folders(leaf, lambda d: 0o700 if d == leaf else 0o755)
        st = os.stat(folder)
    except OSError as exc:
        raise SlurmMigError(f"cannot make the key folder {folder}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SlurmMigError(f"cannot make the key folder {folder}: a file of that name is in the way")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise SlurmMigError(f"{folder} has mode {oct(mode)}; a folder of keys must be 0700 (chmod 700 {folder})")
    out = []
    for node in dict.fromkeys(nodes):  # once each, in the order given
        path = keys.path(node)
        try:
            create_key(path)
            out.append((node, path, True))
        except FileExistsError:
            keys.get(node)  # refuses a key file others can read, or one too short
            out.append((node, path, False))
    return out


def _keys(args: argparse.Namespace) -> int:
    from slurm_mig.slurm.parsers import expand_hostlist

    nodes = [n for expr in args.nodes for n in expand_hostlist(expr)]
    for node, path, created in create_node_keys(args.dir, nodes):
        print(f"{node}\t{path}\t{'created' if created else 'kept'}")
    print(f"copy each key to its node as [auth].hmac_key_file (0600, root), then set "
          f"[auth].hmac_node_keys_dir = {args.dir!r} on the controller", file=sys.stderr)
    return 0
