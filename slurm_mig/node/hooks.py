"""The Slurm node hooks: Prolog, TaskProlog, Epilog and the periodic health check.

Run as ``python -m slurm_mig.node.hooks {prolog|taskprolog|epilog|healthcheck}``
from the small executables in prolog/ and epilog/. Rules every hook follows:

* exit 0 unless the node itself is broken: a non-zero Prolog/Epilog drains a
  healthy node in Slurm, so a job we cannot serve is requeued instead, with a
  reason the user can read (``scontrol show job``: AdminComment);
* never destroy or re-carve an instance a job holds: the node's own binding
  files are passed to every layout change as busy;
* never lose an outcome: what cannot reach the controller waits in the outbox;
* import nothing heavy (no torch, onnxruntime, numpy, rich, sqlite).

This module is the entry point (main) only; the hooks live beside it: context.py (NodeSettings, Node and
what every hook shares), prolog.py, taskprolog.py, epilog.py, healthcheck.py and layoutcache.py (the
desired layouts the health check and the Prolog keep). main imports the one hook it runs, so a TaskProlog
loads none of the others. Nothing imports this module back: run with ``-m`` it is ``__main__``, and an
import of it by name would load it a second time.
"""

from __future__ import annotations

import logging
import os
import sys

from slurm_mig.node.context import Node, NodeSettings, _requeue

log = logging.getLogger("slurm_mig.hooks")


def _setup_logging(settings: NodeSettings | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if settings and settings.log_file:
        try:
            from slurm_mig.folders import log_file_handler

            handlers.append(log_file_handler(settings.log_file))  # 0644 whatever the umask
        except OSError:
            pass
    level = getattr(logging, (settings.log_level if settings else "INFO").upper(), logging.INFO)
    logging.basicConfig(level=level, handlers=handlers, format="%(asctime)s slurm-mig-%(name)s[%(process)d] %(levelname)s %(message)s")


def _started(env: dict) -> float | None:
    """When the hook began (time.time()): the wrapper's SLURM_MIG_T0_NS (interpreter start-up included) when it
    is a time of the last minute, else None (this process's start)."""
    import time

    try:
        started = int(env["SLURM_MIG_T0_NS"]) / 1e9
    except (KeyError, ValueError):
        return None
    return started if 0 <= time.time() - started <= 60 else None


def main(argv: list[str] | None = None) -> int:
    """Run one hook. Always exits 0 for a job-level problem: only a broken node may be drained."""
    import time

    begun = time.time()
    argv = sys.argv[1:] if argv is None else argv
    kind = argv[0] if argv else ""
    from slurm_mig.node.localstate import local_node_name

    # Each hook's module is imported when it runs (a TaskProlog, run for every task, loads none of the others),
    # and outside the try below: a broken install fails here, as it did in one module, and the wrapper requeues
    # the job and holds it back (Python may die before a hook could note the attempt).
    if kind == "taskprolog":
        from slurm_mig.node.taskprolog import taskprolog as hook
    elif kind == "prolog":
        from slurm_mig.node.prolog import prolog as hook
    elif kind == "epilog":
        from slurm_mig.node.epilog import epilog as hook
    elif kind == "healthcheck":
        from slurm_mig.node.healthcheck import healthcheck as hook
    else:
        print(f"usage: {sys.argv[0]} prolog|taskprolog|epilog|healthcheck", file=sys.stderr)
        return 2
    env = dict(os.environ)
    node_name = local_node_name(env)
    settings = node = None
    try:
        settings = NodeSettings.load(node_name)
        _setup_logging(settings)
        if kind == "taskprolog":
            return hook(env, node_name, settings.state_root, settings.slurm_conf)
        node = Node(node_name, settings)
        if kind in ("prolog", "epilog"):
            for warning in settings.time_warnings():
                log.warning("config: %s", warning)
            # Slurm kills a Prolog or Epilog at PrologEpilogTimeout and drains the node: everything it waits
            # for comes out of one time limit ([node].hook_time_limit_s), counted from the wrapper's start.
            started = _started(env)
            node.start_time_limit(begun if started is None else min(begun, started))
        return hook(env, node)
    except Exception as exc:  # noqa: BLE001 - a hook crash must not drain a healthy node
        if kind == "taskprolog":
            # Said first (stdout is what Slurm reads): a task whose binding we could not read sees no GPU
            # rather than every GPU of the node, whatever it inherited.
            print("export CUDA_VISIBLE_DEVICES=", flush=True)
        _setup_logging(settings)
        log.exception("%s hook failed for job %s: %s", kind, env.get("SLURM_JOB_ID"), exc)
        if kind == "prolog" and env.get("SLURM_JOB_ID"):
            # Without settings (the config itself is the problem) Slurm's own SLURM_CONF/default is used.
            try:
                _requeue(env["SLURM_JOB_ID"], f"node hook error: {type(exc).__name__}: {exc}",
                         settings.slurm_conf if settings is not None else None,
                         timeouts=(lambda n: node.slurm_timeout(0.0, n)) if node is not None else None)
            except Exception:
                log.exception("requeue after a hook error failed")
        return 0


if __name__ == "__main__":
    sys.exit(main())
