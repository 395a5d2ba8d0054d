"""``slurm-mig cluster up|down|status``: the local Slurm cluster for tests and demos."""

from __future__ import annotations

import argparse
import json
import time

from slurm_mig.argtypes import seconds
from slurm_mig.errors import SlurmMigError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``cluster`` command group."""
    p = subparsers.add_parser("cluster", help="start/stop/inspect the local Slurm test cluster",
                              description="A real Slurm cluster (slurmctld, one slurmd per node, munged) "
                                          "on this machine, under one state directory. Needs root.")
    sub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    sub.required = True

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--state-dir", metavar="DIR", default=None,
                        help="where config, logs and spool live (default: <repo>/.run/cluster)")
        sp.add_argument("--json", action="store_true", help="print a JSON summary")

    up = sub.add_parser("up", help="install Slurm if needed, start the cluster, wait until nodes are idle")
    common(up)
    up.add_argument("--nodes", type=int, default=3, metavar="N", help="number of nodes n1..nN (default 3)")
    up.add_argument("--gpus-per-node", type=int, default=2, metavar="G",
                    help="simulated MIG GPUs per node (default 2); each starts as 3g+2g+1g+1g")
    up.add_argument("--capacity-node", metavar="NAME", default=None,
                    help="add a drained placeholder node advertising every mig type (see LocalCluster)")
    up.add_argument("--timeout", type=seconds(0.0, more_than=True), default=60.0, help="seconds to wait for the nodes (default 60)")
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help="stop every daemon of the cluster")
    common(down)
    down.add_argument("--purge", action="store_true", help="also delete the state directory")
    down.set_defaults(func=_down)

    status = sub.add_parser("status", help="show daemons and node states; exit 1 when not up")
    common(status)
    status.set_defaults(func=_status)


def _cluster(args: argparse.Namespace, **kwargs):
    from slurm_mig.slurm.localcluster import LocalCluster

    if "nodes" not in kwargs:
        # down/status act on whatever cluster lives in the state dir.
        from slurm_mig.slurm.localcluster import DEFAULT_STATE_DIR

        state_dir = args.state_dir or DEFAULT_STATE_DIR
        try:
            with open(f"{state_dir}/cluster.json") as fh:
                kwargs["nodes"] = json.load(fh).get("nodes") or 3
        except (OSError, ValueError):
            kwargs["nodes"] = 3
    return LocalCluster(args.state_dir, **kwargs)


def _print(args: argparse.Namespace, summary: dict, text: str) -> None:
    print(json.dumps(summary, indent=2) if args.json else text)


def _up(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise SlurmMigError("--nodes and --gpus-per-node must be at least 1")
    c = _cluster(args, nodes=args.nodes, gpus_per_node=args.gpus_per_node, capacity_node=args.capacity_node)
    t0 = time.monotonic()
    installed = c.ensure_installed()
    c.start(wait=True, timeout=args.timeout)
    summary = c.status() | {"installed_now": installed, "seconds": round(time.monotonic() - t0, 2)}
    _print(args, summary, f"cluster up in {summary['seconds']}s: {len(c.node_names)} nodes, "
                          f"state in {c.state_dir}\nexport SLURM_CONF={c.slurm_conf}")
    return 0


def _down(args: argparse.Namespace) -> int:
    c = _cluster(args)
    c.stop(purge=args.purge)
    _print(args, {"state_dir": str(c.state_dir), "up": False}, f"cluster in {c.state_dir} stopped")
    return 0


def _status(args: argparse.Namespace) -> int:
    c = _cluster(args)
    st = c.status()
    lines = [f"state dir: {st['state_dir']}", f"up: {st['up']}"]
    for name, pid in st["daemons"].items():
        lines.append(f"  {name:<12} {pid if pid else '-'}")
    if st["nodes"]:
        lines.append("nodes: " + ", ".join(f"{n}={s}" for n, s in st["nodes"].items()))
    if st["up"]:
        lines.append(f"export SLURM_CONF={st['slurm_conf']}")
    _print(args, st, "\n".join(lines))
    return 0 if st["up"] else 1
