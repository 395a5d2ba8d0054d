"""The `slurm-mig` command line.

Each area of the project keeps its own subcommands in a module that exposes
``register(subparsers)``; the module adds its parsers and sets ``func`` on each
one (a callable taking the parsed ``argparse.Namespace`` and returning an exit
code). Add a module to COMMAND_MODULES to make its commands appear.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from slurm_mig.errors import SlurmMigError

# Imported lazily so that `slurm-mig --help` stays fast and a broken optional
# area cannot take the whole CLI down.
COMMAND_MODULES = [
    "slurm_mig.mig.cli",
    "slurm_mig.nvml.cli",
    "slurm_mig.slurm.cli",
    "slurm_mig.controller.cli",
    "slurm_mig.api.cli",
    "slurm_mig.node.cli",
    "slurm_mig.ops.cli",
    "slurm_mig.sim.cli",
    "slurm_mig.policy_cli",
    "slurm_mig.demo",
]


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="slurm-mig",
        description="Dynamic NVIDIA MIG partitioning for Slurm.",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="slurm-mig TOML config (default: $SLURM_MIG_CONFIG or /etc/slurm-mig/slurm-mig.toml if present)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code.

    A reader that leaves early (`slurm-mig jobs | head -1`) ends any command as it ends a tool killed by SIGPIPE:
    no traceback, nothing on stderr, status 141 (128 + SIGPIPE). Handled here, once, for every command: print()
    raising BrokenPipeError, rich's console (which raises SystemExit(1) for it), argparse's --help, and the output
    still buffered when the command returns (flushed here: at the interpreter's exit it printed "Exception ignored
    ... BrokenPipeError" and the status was 120). With file descriptor 1 closed (``>&-``) sys.stdout is None:
    nothing to flush, and the command's own status stands."""
    try:
        try:
            code = _run(argv)
            _flush_stdout()
            return code
        except SystemExit as exc:
            if isinstance(exc.__context__, BrokenPipeError):  # rich's Console.on_broken_pipe
                raise exc.__context__ from None
            _flush_stdout()  # argparse's --help and usage errors exit with what they printed still buffered
            raise
    except BrokenPipeError:
        # Whatever is still buffered goes to /dev/null, so the flush at exit does not fail again.
        import os

        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a file descriptor (one captured in tests)
            pass
        return 141


def _flush_stdout() -> None:
    if sys.stdout is not None:  # None when the process started with file descriptor 1 closed
        sys.stdout.flush()


def _run(argv: list[str] | None) -> int:
    from slurm_mig.terminal import tolerate_unencodable_output

    tolerate_unencodable_output()
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except SlurmMigError as exc:
        print(f"slurm-mig: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
