"""`slurm-mig node ...` and `slurm-mig install-hooks`: the node side from the command line."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from slurm_mig.argtypes import seconds

HOOKS = {
    "slurm-mig-prolog": "prolog",
    "slurm-mig-taskprolog": "prolog",
    "slurm-mig-epilog": "epilog",
    "slurm-mig-healthcheck": "epilog",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="node-side actions (what the hooks do, by hand)")
    nsub = p.add_subparsers(dest="node_command", metavar="ACTION")
    s = nsub.add_parser("sync", help="report this node's MIG state and apply the controller's desired layouts")
    s.add_argument("--node", help="node name (default: $SLURMD_NODENAME or the short host name)")
    s.add_argument("--loop", type=seconds(0.0, more_than=True), metavar="SECONDS", help="repeat every SECONDS until interrupted")
    s.set_defaults(func=_sync)

    p = sub.add_parser("install-hooks", help="install the Prolog/Epilog/TaskProlog/health-check executables")
    p.add_argument("--prefix", default="/usr/local/libexec/slurm-mig", help="directory to install into")
    p.add_argument("--python", default=sys.executable, help="interpreter that has slurm-mig installed")
    p.add_argument("--hook-config", help="config file the hooks read (default: the --config given, or "
                   "/etc/slurm-mig/slurm-mig.toml)")
    p.set_defaults(func=_install)


def hook_source_dir() -> Path:
    """The folder holding prolog/ and epilog/: the source checkout, else the wheel's share/slurm-mig."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "prolog" / "slurm-mig-prolog").is_file():
        return checkout
    return Path(sys.prefix) / "share" / "slurm-mig"


#: Hooks Slurm runs as the job's user, with the job's environment (the others run as root with slurmd's).
USER_HOOKS = frozenset({"slurm-mig-taskprolog"})

#: Paths written into the root hooks' shell text: absolute, and no character the shell would read
#: (quotes, $, `, \, }, spaces, newlines), so no path can turn into a command.
SAFE_PATH = re.compile(r"/[A-Za-z0-9_./+@:-]*")


def _check_safe_paths(python: str, config: str) -> None:
    from slurm_mig.errors import SlurmMigError

    for what, value in (("--python", python), ("--hook-config", config)):
        if not SAFE_PATH.fullmatch(str(value)):
            raise SlurmMigError(f"{what} {value!r}: use an absolute path of letters, digits and _ . / + @ : - "
                                f"only (it is written into the root hooks' shell text)")


def _check_prefix(prefix: Path) -> None:
    """Raise SlurmMigError unless only root (or the installer) can change what ``prefix`` holds: every
    folder and link on its way, as given and resolved, that exists must be theirs, and every folder above
    it writable by nobody else unless sticky (as /tmp). Whoever can write such a folder can rename the
    prefix away and put their own prolog in its place, and slurmd runs it as root. The prefix itself is
    chmod-ed 0755 after.

    A twin of folders.writable_by_others (the same owners, the same two passes, as given and resolved), kept
    apart for two differences that are the point here: the prefix's own mode is not judged, since install-hooks
    makes it 0755 before it writes a hook there (a prefix left 0777 is fixed, not refused; writable_by_others
    refuses a path others may write, sticky or not: its callers use the path as it is), and a folder on the way that
    cannot be read is an error, not a missing one. The messages name --prefix and `chmod go-w` (tested)."""
    import stat

    from slurm_mig.errors import SlurmMigError

    trusted = {0, os.geteuid()}
    given = Path(os.path.abspath(prefix))
    # realpath of the prefix as given: abspath drops "link/.." by the letters, where the kernel follows the link first
    for path in (given, Path(os.path.realpath(prefix))):
        for d in (*reversed(path.parents), path):
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                break  # made below, 0755
            except OSError as exc:
                raise SlurmMigError(f"--prefix {prefix}: cannot read {d}: {exc.strerror}") from None
            if st.st_uid not in trusted:
                raise SlurmMigError(f"--prefix {prefix}: {d} is owned by uid {st.st_uid}; slurmd runs the hooks "
                                    f"as root, so only root may own the folders (and links) they are in")
            if (d != path and stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022
                    and not st.st_mode & stat.S_ISVTX):
                raise SlurmMigError(f"--prefix {prefix}: {d} has mode {stat.S_IMODE(st.st_mode):04o}; others "
                                    f"could swap the hooks root runs (chmod go-w {d}, or install elsewhere)")


def install_hooks(prefix: str | os.PathLike, python: str, config: str) -> dict[str, Path]:
    """Copy the hook executables into ``prefix`` (0755, the installer's) with the interpreter and config set.

    Raises SlurmMigError, before writing anything, when ``python`` or ``config`` is not an absolute
    path made of plain characters (they are substituted into shell text that runs as root), or when
    others could change what ``prefix`` holds (see _check_prefix).
    """
    from slurm_mig.errors import SlurmMigError
    from slurm_mig.folders import make_missing_folders, write_durably

    _check_safe_paths(python, config)
    prefix = Path(prefix)
    texts = {}
    for name, folder in HOOKS.items():
        src = hook_source_dir() / folder / name
        text = src.read_text()
        if name in USER_HOOKS:
            # Runs with the job's environment: a SLURM_MIG_CONFIG the user exported for the command-line
            # tools (or a SLURM_MIG_PYTHON) must not redirect it, silently leaving the job without its GPU.
            pairs = ((': "${SLURM_MIG_PYTHON:=/usr/bin/python3}"', f"SLURM_MIG_PYTHON={python}"),
                     (': "${SLURM_MIG_CONFIG:=/etc/slurm-mig/slurm-mig.toml}"', f"SLURM_MIG_CONFIG={config}"))
        else:
            pairs = ((': "${SLURM_MIG_PYTHON:=/usr/bin/python3}"', f': "${{SLURM_MIG_PYTHON:={python}}}"'),
                     (': "${SLURM_MIG_CONFIG:=/etc/slurm-mig/slurm-mig.toml}"', f': "${{SLURM_MIG_CONFIG:={config}}}"'))
        for old, new in pairs:
            if old not in text:
                raise SlurmMigError(f"{src} has no line {old!r} to set; is this a slurm-mig checkout?")
            text = text.replace(old, new)
        texts[name] = text
    _check_prefix(prefix)
    try:
        make_missing_folders(prefix, lambda d: 0o755)
    except OSError as exc:
        raise SlurmMigError(f"--prefix {prefix}: cannot make {exc.filename or prefix}: {exc.strerror}") from None
    if not prefix.is_dir():  # a file in the way was chmod-ed 0755, then a hook's write failed with a traceback
        raise SlurmMigError(f"--prefix {prefix}: not a folder")
    os.chmod(prefix, 0o755)
    out = {}
    for name, text in texts.items():
        dst = prefix / name
        # A temporary file of its own (O_EXCL: no link planted in the prefix is followed), fsynced, renamed
        # over the hook, the folder fsynced: two installs at once each put a whole hook there, and a power
        # cut leaves the old hook or the new one, never an empty file slurmd cannot exec (a failed Prolog
        # drains the node). A hook name that is a link is replaced, not written through.
        write_durably(dst, text.encode(), 0o755)
        out[name] = dst
    return out


def check_hook_inputs(python: str, config: str) -> None:
    """Raise SlurmMigError unless ``python`` runs slurm-mig and ``config`` is a config it accepts.

    The hooks pass the config to slurm-mig as the file to read, so a missing or wrong one fails every
    hook on the node, as does an interpreter without slurm-mig: each Prolog then requeues its job
    (a hook never drains the node), and no job with a MIG request starts there. Better said once, here.
    """
    import subprocess

    from slurm_mig.config import check_trusted, check_written_folders, load_config
    from slurm_mig.errors import ConfigError, SlurmMigError

    _check_safe_paths(python, config)
    try:
        cfg = load_config(config)
        check_trusted(config, "the hooks, run as root by slurmd,")  # each would refuse it (context._check_trusted)
        check_written_folders(cfg, "the hooks, run as root by slurmd,", node=True)  # and this (NodeSettings.load)
    except ConfigError as exc:
        raise ConfigError(f"--hook-config: {exc}; every hook would fail on it (see docs/admin-guide.md "
                            f"step 3)") from None
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise SlurmMigError(f"--python {python}: not an executable file")
    try:
        # -I as the hooks run it: slurm-mig must be installed for that interpreter, not found on a path.
        res = subprocess.run([python, "-I", "-c", "import slurm_mig.node.hooks"], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmMigError(f"--python {python}: could not run it: {exc}") from None
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise SlurmMigError(f"--python {python}: cannot import slurm-mig ({last}); give the interpreter of "
                            f"the environment slurm-mig is installed in")


def _install(args: argparse.Namespace) -> int:
    config = os.path.abspath(args.hook_config or args.config or "/etc/slurm-mig/slurm-mig.toml")
    check_hook_inputs(args.python, config)
    for name, path in install_hooks(args.prefix, args.python, config).items():
        print(f"installed {path}")
    from slurm_mig.config import load_config
    from slurm_mig.node.context import hook_time_warnings

    node = load_config(config).node
    for warning in hook_time_warnings(node.hook_time_limit_s, node.request_timeout_s, node.layout_lock_wait_s):
        print(f"warning: {warning}", file=sys.stderr)
    print(f"the Prolog and Epilog each end within [node].hook_time_limit_s = {node.hook_time_limit_s:g} s (a "
          f"second or two more at worst): leave Slurm's PrologEpilogTimeout unset or set it to at least "
          f"{node.hook_time_limit_s + 30:g} s (docs/failure-modes.md)")
    print("now add the lines of etc/slurm.conf.snippet to slurm.conf (see docs/admin-guide.md)")
    return 0


def _sync(args: argparse.Namespace) -> int:
    from slurm_mig.node.healthcheck import healthcheck
    from slurm_mig.node.hooks import Node, NodeSettings, _setup_logging

    if args.config:
        os.environ["SLURM_MIG_CONFIG"] = args.config
    from slurm_mig.node.localstate import local_node_name

    name = args.node or local_node_name()
    settings = NodeSettings.load(name)
    _setup_logging(settings)
    node = Node(name, settings)
    while True:
        try:
            healthcheck(dict(os.environ), node)
        except Exception as exc:  # keep looping: the next round may succeed
            print(f"slurm-mig node sync: {type(exc).__name__}: {exc}", file=sys.stderr)
            if not args.loop:
                return 1
        if not args.loop:
            return 0
        time.sleep(args.loop)
