"""`slurm-mig nvml ...`: look at MIG GPUs, move one to a layout, manage simulated GPUs.

    slurm-mig nvml show [--json]
    slurm-mig nvml apply --gpu 0 --layout 3g@0,2g@4,1g@6 [--dry-run] [--busy 3g@0] [--ignore-bindings]
                         [--lock-wait SECONDS] [--json]
    slurm-mig nvml assert --gpu 0 --layout 3g@0,2g@4,1g@6 [--json]
    slurm-mig nvml check-tables [--gpu 0] [--json]
    slurm-mig nvml sim-init [--gpus H100-80GB:2] [--layout 3g@0,3g@4 | --layout 1=7g@0] [--force]
    slurm-mig nvml sim-busy --gpu 0 3g@0 --owner job42 | --clear

The backend comes from ``--backend real|simulated`` and ``--sim-state PATH``,
defaulting to $SLURM_MIG_NVML_BACKEND and $SLURM_MIG_SIM_STATE; with neither,
the config's ``[node].nvml_backend``, otherwise "real". Every subcommand finds the
simulated state file one way (``sim_state_path``): --sim-state, $SLURM_MIG_SIM_STATE,
then the config's ``[node].sim_state_path`` with ``{node}`` the node's name, as the
hooks read it. Only ``sim-init`` makes simulated GPUs.

``sim-init`` without ``--gpus`` makes the config's ``[node].sim_gpu_model`` x ``sim_gpu_count`` GPUs (the
config file the other commands read) and says which it used.

``apply`` keeps every instance a job is bound to on this node (the hooks' binding
records under ``[node].cache_dir``), as it keeps the ones NVML reports in use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from slurm_mig.argtypes import ascii_digits, seconds, sim_delay_scale
from slurm_mig.errors import AlreadyRunning, BindingsUnreadable, ConfigError, GeometryError, TransitionBlocked
from slurm_mig.mig.layout import Layout, Slot, parse_layout
from slurm_mig.mig.profiles import get_model

ENV_BACKEND = "SLURM_MIG_NVML_BACKEND"
ENV_SIM_STATE = "SLURM_MIG_SIM_STATE"
ENV_SIM_DELAY = "SLURM_MIG_SIM_DELAY_SCALE"


def _load_config(path: str | None = None, node_name: str | None = None):
    """The config, refused as the hooks refuse it when others may change it and this runs as root (it names
    the node's records, its layout lock and the simulated GPUs' files, which root then writes), with the folders
    of ``node_name`` (the node acted for) judged as the hooks judge them."""
    from slurm_mig.config import check_trusted, check_written_folders, find_config, load_config

    check_trusted(find_config(path), "`slurm-mig nvml` running as root")
    cfg = load_config(path)
    check_written_folders(cfg, "`slurm-mig nvml` running as root", node=True,  # as the hooks (context.py)
                          node_name=node_name)
    return cfg


def _config(args: argparse.Namespace):
    """``(file, Config)``: the config file (--config, $SLURM_MIG_CONFIG or /etc/slurm-mig/slurm-mig.toml; None when
    there is none, and the Config is the defaults) and what it says, read and checked once per command and kept
    on ``args``. Each part of a command (the backend, the simulated state file, the binding records, the layout
    lock's wait) read it again, up to four times: a file changed meanwhile gave one command two configs."""
    cached = getattr(args, "_nvml_config", None)
    if cached is None:
        from slurm_mig.config import find_config

        path = getattr(args, "config", None)
        cached = (find_config(path), _load_config(path, _node_name(args)))
        args._nvml_config = cached
    return cached


def _node_config(args: argparse.Namespace):
    """The config file's [node] section, if there is a config file (else None: no file, no opinion)."""
    where, cfg = _config(args)
    return cfg.node if where is not None else None


def _node_name(args: argparse.Namespace) -> str:
    from slurm_mig.node.localstate import local_node_name

    return getattr(args, "node", None) or local_node_name()


def sim_state_path(args: argparse.Namespace) -> tuple[str, str]:
    """The simulated GPUs' state file, and where it came from, for every nvml subcommand: --sim-state, else
    $SLURM_MIG_SIM_STATE, else the config file's [node].sim_state_path (--config, $SLURM_MIG_CONFIG or
    /etc/slurm-mig/slurm-mig.toml), a "{node}" in it standing for the node's name (--node, $SLURMD_NODENAME or
    the short host name) as the hooks read it: one file per node on one host. Naming a file makes nothing:
    only sim-init writes GPUs into it."""
    flag = getattr(args, "sim_state", None)
    if flag:
        return flag, "--sim-state"
    env = os.environ.get(ENV_SIM_STATE)
    if env:
        return env, f"${ENV_SIM_STATE}"
    node = _node_config(args)
    if node is None:
        raise ConfigError(f"which simulated state file? pass --sim-state PATH, set ${ENV_SIM_STATE}, or set "
                          f"[node].sim_state_path in the config (--config PATH, $SLURM_MIG_CONFIG or "
                          f"/etc/slurm-mig/slurm-mig.toml; there is none)")
    return (node.sim_state_path.replace("{node}", _node_name(args)),
            f"[node].sim_state_path in {_config(args)[0]}")


def backend_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The backend kind and options from flags, then environment, then the config file's [node]
    (what the hooks on this node use); real NVML when none says. The simulated state file is
    sim_state_path's."""
    explicit = getattr(args, "sim_state", None) or os.environ.get(ENV_SIM_STATE) or None
    kind = getattr(args, "backend", None) or os.environ.get(ENV_BACKEND)
    node = _node_config(args) if kind is None and explicit is None else None
    if kind is None:
        kind = "simulated" if explicit else node.nvml_backend if node is not None else "real"
    kind = kind.strip().lower()
    if kind == "sim":
        kind = "simulated"
    if kind not in ("real", "simulated"):
        raise ConfigError(f"unknown MIG backend {kind!r}: expected real or simulated")
    opts: dict[str, Any] = {}
    if kind == "simulated":
        state = sim_state_path(args)[0]
        # the config's delay goes with the config's file (a --sim-state or $SLURM_MIG_SIM_STATE file: instant)
        config_delay = None
        if explicit is None:
            config_delay = (node or _node_config(args)).sim_delay_scale
        delay = getattr(args, "sim_delay_scale", None)
        if delay is None and ENV_SIM_DELAY not in os.environ:
            delay = config_delay
        if delay is None:
            raw = os.environ.get(ENV_SIM_DELAY, "0")
            try:
                delay = sim_delay_scale()(raw)  # the flag's parser, and the config's bound
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(f"${ENV_SIM_DELAY}: {exc}") from None
        opts = {"state_path": state, "delay_scale": delay}
    return {"kind": kind, **opts}


def backend_from_args(args: argparse.Namespace):
    """Open the MigBackend the flags and environment select."""
    from slurm_mig.nvml import open_backend

    settings = backend_settings(args)
    return open_backend(settings.pop("kind"), **settings)


# -- show ------------------------------------------------------------------
def _gpu_entries(backend) -> list[dict]:
    from slurm_mig.nvml.base import NvmlError, foreign_instances

    entries = []
    for g in backend.gpus():
        entry: dict[str, Any] = {
            "index": g.index, "uuid": g.uuid, "name": g.name,
            "model": g.model.name if g.model else None, "mig_enabled": g.mig_enabled, "lost": g.lost,
            "mig_pending": g.mig_pending, "mig_mode": g.mig_mode,
            "layout": None, "instances": [], "foreign": [], "error": None,
        }
        if not g.lost:
            try:
                insts = backend.instances(g.index)
            except NvmlError as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"
                insts = []
            if g.model is not None and g.mig_enabled:
                entry["layout"] = str(Layout(g.model, frozenset(i.slot for i in insts)))
            entry["instances"] = [
                {"profile": i.profile, "start": i.slot.start,
                 "size": g.model.profile(i.profile).memory_slices if g.model else None,
                 "uuid": i.uuid, "gi_id": i.gi_id, "ci_id": i.ci_id, "in_use": i.in_use}
                for i in insts
            ]
            try:
                foreign = foreign_instances(backend, g.index) if entry["error"] is None else []
            except NvmlError as exc:
                entry["error"], foreign = f"{type(exc).__name__}: {exc}", []
            # GPU instances of a profile our tables do not list: shown, never touched.
            entry["foreign"] = [{"profile_id": f.profile_id, "start": f.start, "size": f.size, "gi_id": f.gi_id,
                                 "compute_slices": f.compute_slices, "in_use": f.in_use} for f in foreign]
        entries.append(entry)
    return entries


def _cmd_show(args: argparse.Namespace) -> int:
    backend = backend_from_args(args)
    try:
        entries = _gpu_entries(backend)
    finally:
        backend.close()
    kind = backend_settings(args)["kind"]
    if args.json:
        print(json.dumps({"backend": kind, "gpus": entries}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not entries:
        console.print(f"No GPUs ({kind} backend).")
        return 0
    for e in entries:
        state = "LOST" if e["lost"] else f"MIG {e['mig_mode']}"
        title = f"GPU {e['index']}: {e['name'] or '?'} ({e['model'] or 'unknown model'}) {e['uuid']} [{state}]"
        if e["layout"] is not None:
            title += f"  layout {e['layout']}"
        table = Table(title=title, title_justify="left")
        for col in ("profile", "placement", "GI", "CI"):
            table.add_column(col)
        table.add_column("MIG UUID", overflow="fold")
        table.add_column("in use")
        for f in e["foreign"]:
            table.add_row(f"profile id {f['profile_id']} (unknown)", f"{f['start']}:{f['size']}", str(f["gi_id"]),
                          "-", "not managed by slurm-mig", "yes" if f["in_use"] else "no")
        for i in e["instances"]:
            table.add_row(i["profile"], f"{i['start']}:{i['size']}", str(i["gi_id"]), str(i["ci_id"]),
                          i["uuid"], "yes" if i["in_use"] else "no")
        console.print(table)
        if e["mig_pending"] is not None and not e["lost"]:
            console.print(f"[yellow]GPU {e['index']}: MIG mode changes to "
                          f"{'on' if e['mig_pending'] else 'off'} at the next GPU reset; slurm-mig creates and "
                          f"destroys nothing on it until then[/yellow]")
        if e["error"]:
            console.print(f"[red]GPU {e['index']}: {e['error']}[/red]")
    return 0


# -- apply / assert ----------------------------------------------------------
def _target(backend, gpu: int, spec: str) -> Layout:
    from slurm_mig.nvml.base import InvalidArgument, NotSupported

    gpus = backend.gpus()
    if not 0 <= gpu < len(gpus):
        raise InvalidArgument(f"no GPU {gpu} (this node has {len(gpus)})")
    model = gpus[gpu].model
    if model is None:
        raise NotSupported(f"GPU {gpu} ({gpus[gpu].name}) is not a MIG model slurm-mig knows")
    return parse_layout(spec, model)


def _node_state(args: argparse.Namespace):
    """This node's binding records, where its hooks keep them: ``<[node].cache_dir>/<node name>`` (the
    default cache_dir without a config file, as for the hooks)."""
    from slurm_mig.node.localstate import NodeState

    return NodeState(Path(_config(args)[1].node.cache_dir) / _node_name(args))


def _check_node_name(args: argparse.Namespace, state) -> None:
    """Refuse a node name guessed from the host name (no --node, no $SLURMD_NODENAME) that has no state folder
    while other node names in cache_dir have binding records: Slurm's NodeName need not be the host name, and
    reading "no bindings" there would let the apply destroy an instance a job is bound to."""
    if getattr(args, "node", None) or os.environ.get("SLURMD_NODENAME"):
        return
    try:
        # Its records folder, which only the hooks make: an apply makes the node's folder for its lock.
        os.stat(state.records_dir)
        return
    except FileNotFoundError:
        pass
    except OSError:
        return  # _take_layout_lock says why it cannot be read
    try:
        others = sorted(e.name for e in os.scandir(state.root.parent) if (Path(e.path) / "records").is_dir())
    except OSError:
        others = []
    if others:
        raise BindingsUnreadable(
            f"this node's name was taken from the host name, {state.root.name!r}, which has no state in "
            f"{state.root.parent}, but {', '.join(others)} {'has' if len(others) == 1 else 'have'} binding "
            f"records there. Nothing was changed: pass --node with this node's Slurm name (NodeName)")


def _bound_instances(state, backend, gpu: int, model) -> tuple[dict, list[str]]:
    """The instances on GPU ``gpu`` that jobs are bound to (Slot -> job ids), and a note for each binding
    that names an instance the GPU does not have (nothing there to keep; the hooks skip those too).

    Strict: a binding record that cannot be read, or names a profile the model lacks, raises
    BindingsUnreadable; "no bindings" is only said of a node whose records are all readable.
    """
    held: dict = {}
    for job, insts in state.all_bindings(strict=True).items():
        for i in insts:
            if i.gpu != gpu:
                continue
            try:
                slot = Slot(i.start, model.profile(i.profile).name)
            except GeometryError as exc:
                raise BindingsUnreadable(f"the binding of job {job} names {i.profile}@{i.start} on GPU {gpu}, "
                                         f"which a {model.name} cannot have ({exc})") from exc
            held.setdefault(slot, []).append(job)
    present = {i.slot for i in backend.instances(gpu)}
    notes = [f"job {', '.join(jobs)}: bound to {slot} on GPU {gpu}, which the GPU does not have; nothing to keep"
             for slot, jobs in sorted(held.items()) if slot not in present]
    return {slot: jobs for slot, jobs in held.items() if slot in present}, notes


def _lock_wait(args: argparse.Namespace) -> float:
    """How long an apply waits for the node's layout lock: --lock-wait, else [node].layout_lock_wait_s (the
    hooks' own bound)."""
    if getattr(args, "lock_wait", None) is not None:
        return args.lock_wait
    return _config(args)[1].node.layout_lock_wait_s


def _take_layout_lock(stack: contextlib.ExitStack, state, wait_s: float) -> None:
    """Hold the lock the hooks change layouts and write bindings under, so no Prolog binds an instance
    between our reading the bindings and our last step. A node without its folder (no hook has run yet, or
    it was removed) has it made first, as the hooks make it (NodeState.ensure_root): a Prolog starting
    meanwhile makes or finds the same folder and waits for our lock. Until 2026-11-26 such an apply took no
    lock. One that can neither make the folder nor take the lock is refused, never made without it.

    Waits at most ``wait_s`` for a holder to let go, then raises AlreadyRunning (exit 75): a holder hung inside
    NVML kept the apply waiting without end until 2026-11-27."""
    from slurm_mig.node.localstate import LayoutLockBusy

    try:
        state.ensure_root()
    except OSError as exc:
        raise BindingsUnreadable(f"this node's state folder {state.root} is missing and cannot be made "
                                 f"({exc.strerror or exc}), so the layout lock the hooks change layouts under "
                                 f"cannot be held. Nothing was changed: run it as root") from exc
    try:
        stack.enter_context(state.layout_lock(wait_s))
    except LayoutLockBusy as exc:  # (a TimeoutError, so an OSError: caught first)
        raise AlreadyRunning(f"{exc}: a Prolog or health check is changing this node's MIG layout, or one hung "
                             f"inside NVML (`fuser -v {state.root / 'apply.lock'}` names it). Nothing was "
                             f"changed: try again, or wait longer with --lock-wait SECONDS (default "
                             f"[node].layout_lock_wait_s)") from exc
    except OSError as exc:
        raise BindingsUnreadable(f"cannot take the layout lock in {state.root}: {exc.strerror or exc}. "
                                 f"Nothing was changed") from exc


IGNORE_BINDINGS_WARNING = (
    "slurm-mig: WARNING: --ignore-bindings: this node's binding records ({root}) are not read. An instance "
    "bound to a job whose processes have not started yet can be destroyed, and that job then starts with a "
    "CUDA_VISIBLE_DEVICES naming an instance that no longer exists. Use it only on a node with no jobs "
    "(drained, `squeue -w {node}` empty).")


def _cmd_apply(args: argparse.Namespace) -> int:
    from slurm_mig.nvml.apply import apply_layout

    backend = backend_from_args(args)
    try:
        target = _target(backend, args.gpu, args.layout)
        extra = [s for item in args.busy for s in parse_layout(item, target.model).slots] if args.busy else []
        state = _node_state(args)
        if not args.ignore_bindings:
            _check_node_name(args, state)
        with contextlib.ExitStack() as stack:
            if not args.dry_run:
                _take_layout_lock(stack, state, _lock_wait(args))
            if args.ignore_bindings:
                print(IGNORE_BINDINGS_WARNING.format(root=state.records_dir, node=_node_name(args)), file=sys.stderr)
                held, notes = {}, []
            else:
                try:
                    held, notes = _bound_instances(state, backend, args.gpu, target.model)
                except BindingsUnreadable as exc:
                    raise BindingsUnreadable(
                        f"{exc}. Nothing was changed: a job may hold an instance on this node. Repair or remove "
                        f"the record (docs/failure-modes.md), or, on a node with no jobs, pass --ignore-bindings"
                    ) from exc
            for note in notes:
                print(f"slurm-mig: note: {note}", file=sys.stderr)
            try:
                result = apply_layout(backend, args.gpu, target, extra_busy=[*extra, *held], dry_run=args.dry_run)
            except TransitionBlocked as exc:
                why = {s: f" (bound to job {', '.join(held[s])})" for s in exc.blocking if s in held}
                busy = ", ".join(f"{s}{why.get(s, '')}" for s in exc.blocking)
                if args.json:
                    print(json.dumps({"gpu": args.gpu, "target": str(target), "ok": False, "refused": True,
                                      "blocking": [str(s) for s in exc.blocking],
                                      "bound": {str(s): held[s] for s in exc.blocking if s in held},
                                      "error": str(exc)}, indent=2))
                print(f"slurm-mig: refused: GPU {args.gpu} cannot move to {target}: busy instance(s) {busy} "
                      f"would have to be destroyed. Nothing was changed; wait for their jobs to end or choose a "
                      f"layout that keeps them. ({exc})", file=sys.stderr)
                return exc.exit_code
    finally:
        backend.close()
    if args.json:
        doc = result.to_json()
        doc["bound"] = {str(s): jobs for s, jobs in sorted(held.items())}
        doc["bindings_checked"] = not args.ignore_bindings
        print(json.dumps(doc, indent=2))
    else:
        from rich.console import Console

        console = Console()
        console.print(f"GPU {args.gpu} ({target.model.name}): {result.before} -> {target}")
        if not result.plan:
            console.print("Already in that layout: nothing to do.")
        for n, step in enumerate(result.plan, 1):
            mark = ("would " if args.dry_run else "") + str(step)
            if not args.dry_run:
                mark += " ... " + ("ok" if step in result.done else "FAILED" if step == result.failed else "skipped")
            console.print(f"  {n}. {mark}")
        for slot, jobs in sorted(held.items()):
            console.print(f"  kept: {slot}, bound to job {', '.join(jobs)}", highlight=False)
        if not args.dry_run and result.after is not None:
            console.print(f"GPU {args.gpu} now: {result.after}")
    if not result.ok:
        print(f"slurm-mig: error: {result.summary()}", file=sys.stderr)
        return 1
    return 0


def _cmd_assert(args: argparse.Namespace) -> int:
    from slurm_mig.nvml.apply import assert_layout

    backend = backend_from_args(args)
    try:
        target = _target(backend, args.gpu, args.layout)
        diff = assert_layout(backend, args.gpu, target)
    finally:
        backend.close()
    if args.json:
        print(json.dumps({"gpu": args.gpu, "matches": not diff, "observed": str(diff.observed),
                          "target": str(target), "missing": [str(s) for s in sorted(diff.missing)],
                          "extra": [str(s) for s in sorted(diff.extra)]}, indent=2))
    else:
        print(str(diff), file=sys.stderr if diff else sys.stdout)
    return 1 if diff else 0


# -- check-tables ------------------------------------------------------------
def _cmd_check_tables(args: argparse.Namespace) -> int:
    """Compare our profile tables with the driver's, GPU by GPU: exit 0 when every GPU agrees, 1 when a
    number differs, 2 when a GPU's profiles could not be read. Creates and destroys nothing."""
    from slurm_mig.nvml.base import InvalidArgument
    from slurm_mig.nvml.tables import check_gpu

    backend = backend_from_args(args)
    try:
        gpus = backend.gpus()
        if args.gpu is not None and not 0 <= args.gpu < len(gpus):
            raise InvalidArgument(f"no GPU {args.gpu} (this node has {len(gpus)})")
        checks = [check_gpu(backend, g) for g in gpus if args.gpu in (None, g.index)]
    finally:
        backend.close()
    code = 0 if all(c.ok for c in checks) else (2 if any(c.unreadable for c in checks) else 1)
    if args.json:
        print(json.dumps({"backend": backend_settings(args)["kind"], "ok": code == 0,
                          "gpus": [c.to_json() for c in checks]}, indent=2))
        return code
    if not checks:
        print("No GPUs.")
    for c in checks:
        print(f"GPU {c.gpu}: {c.name or '?'} ({c.model or 'unknown model'}) [MIG {c.mig_mode}]")
        for r in c.readings:
            where = "?" if r.placements is None else ",".join(f"{s}:{n}" for s, n in sorted(r.placements))
            memory = "?" if r.memory_mib is None else f"{r.memory_mib} MiB"
            print(f"  index {r.nvml_index:>2}  id {r.id:>2}  {r.short_name or '?':<14} {r.compute_slices} compute "
                  f"slices, at most {r.max_count}, {memory}, placements {where}")
        if c.unreadable:
            print(f"  not compared: {c.unreadable}")
        for f in c.findings:
            print(f"  {f.level.upper()}: {f.profile}: {f.message}")
        if c.ok:
            print(f"  our {c.model} table agrees with the driver ({len(c.readings)} profiles read)")
    return code


# -- simulated GPUs ------------------------------------------------------------
def _sim_gpus(args: argparse.Namespace) -> tuple[str, str]:
    """The GPUs sim-init makes (MODEL:N,...) and where they came from: --gpus, else the config file's
    [node].sim_gpu_model and sim_gpu_count (--config, $SLURM_MIG_CONFIG or /etc/slurm-mig/slurm-mig.toml, the
    file the other nvml commands read). No file and no --gpus is refused: nothing says which GPUs."""
    if args.gpus is not None:
        return args.gpus, "--gpus"
    node = _node_config(args)
    if node is None:
        raise ConfigError("which GPUs? pass --gpus MODEL[:N] (e.g. H100-80GB:2), or set [node].sim_gpu_model and "
                          "sim_gpu_count in the config (--config PATH, $SLURM_MIG_CONFIG or "
                          "/etc/slurm-mig/slurm-mig.toml; there is none)")
    where = _config(args)[0]
    return f"{node.sim_gpu_model}:{node.sim_gpu_count}", f"[node].sim_gpu_model and sim_gpu_count in {where}"


def _cmd_sim_init(args: argparse.Namespace) -> int:
    from slurm_mig.nvml.simulated import init_state, parse_gpu_spec

    gpus, source = _sim_gpus(args)
    spec = parse_gpu_spec(gpus)
    models = [name for name, n in spec for _ in range(n)]
    layouts: dict[int, Layout] = {}
    for item in args.layout or []:
        which, sep, text = item.rpartition("=")
        targets = range(len(models)) if not sep else [int(which)] if ascii_digits(which.strip()) else None
        if targets is None or any(not 0 <= t < len(models) for t in targets):
            raise ConfigError(f"bad --layout {item!r}: expected LAYOUT or GPU=LAYOUT with GPU in 0..{len(models) - 1}")
        for t in targets:
            layouts[t] = parse_layout(text, get_model(models[t]))
    path, where = sim_state_path(args)
    init_state(path, spec, layouts=layouts, seed=args.seed, overwrite=args.force)
    print(f"simulated node at {path} (from {where}): "
          + ", ".join(f"GPU {i} {m} [{layouts.get(i, 'empty')}]" for i, m in enumerate(models))
          + f" (GPUs from {source})")
    return 0


def _cmd_sim_busy(args: argparse.Namespace) -> int:
    from slurm_mig.nvml.simulated import SimulatedBackend

    if args.clear == (args.owner is not None):
        raise ConfigError("give exactly one of --owner NAME or --clear")
    backend = SimulatedBackend(sim_state_path(args)[0])
    inst = backend.set_in_use(args.gpu, args.instance, None if args.clear else args.owner)
    print(f"GPU {args.gpu} {inst.slot} {inst.uuid}: " + (f"in use by {args.owner}" if inst.in_use else "idle"))
    return 0


def _layout_spec(text: str) -> str:
    """--layout of apply and assert: a layout, or "empty" said in words. A blank one (`--layout "$LAYOUT"` with the
    variable unset) read as the empty layout, and apply destroyed every idle instance on the GPU (exit 0)."""
    if not text.strip():
        raise argparse.ArgumentTypeError('no layout given: name the instances (e.g. 3g@0,2g@4,1g@6), or "empty" '
                                         'for none')
    return text


def _busy_spec(text: str) -> str:
    """--busy of apply: instances to keep, or "empty" said in words. A blank one (`--busy "$KEEP"` with the variable
    unset) read as the empty layout: nothing kept, and apply destroyed the instances it was there to keep (exit 0)."""
    if not text.strip():
        raise argparse.ArgumentTypeError('no instances given: name those to keep (e.g. 3g@0), or leave --busy out')
    return text


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `slurm-mig nvml ...`."""
    from slurm_mig.config import MAX_SIM_DELAY_SCALE

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", choices=("real", "simulated", "sim"),
                        help=f"MIG backend (default: ${ENV_BACKEND}, else simulated if --sim-state or "
                             f"${ENV_SIM_STATE} is set, else the config's [node].nvml_backend as the hooks use it, "
                             f"else real when there is no config file)")
    common.add_argument("--sim-state", metavar="PATH",
                        help=f"simulated node state file (default: ${ENV_SIM_STATE}, else the config's "
                             f"[node].sim_state_path)")
    common.add_argument("--sim-delay-scale", type=sim_delay_scale(), metavar="X",
                        help=f"multiply the simulated create/destroy times, 0 to {MAX_SIM_DELAY_SCALE:g} (default: "
                             f"${ENV_SIM_DELAY}, else the config's [node].sim_delay_scale with its state file, else 0)")
    common.add_argument("--node", metavar="NAME",
                        help="this node's Slurm name: apply honours the bindings in <[node].cache_dir>/NAME, and "
                             "a {node} in [node].sim_state_path becomes NAME (default: $SLURMD_NODENAME or the "
                             "short host name)")

    nvml = subparsers.add_parser("nvml", help="MIG GPUs through NVML (or simulated ones)",
                                 description="Look at MIG GPUs, move one to a layout, manage simulated GPUs.")
    sub = nvml.add_subparsers(dest="nvml_command", metavar="ACTION", required=True)

    p = sub.add_parser("show", parents=[common], help="list GPUs and their MIG instances")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("apply", parents=[common], help="move a GPU to a layout without touching busy instances")
    p.add_argument("--gpu", type=int, required=True, metavar="N")
    p.add_argument("--layout", required=True, type=_layout_spec, metavar="SPEC",
                   help='e.g. "3g@0,2g@4,1g@6" or "empty"')
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--busy", action="append", type=_busy_spec, metavar="SPEC",
                   help="also treat these instances as busy (instances bound to jobs on this node are, always)")
    p.add_argument("--ignore-bindings", action="store_true",
                   help="do not read this node's binding records (DANGER: only on a node with no jobs)")
    p.add_argument("--lock-wait", type=seconds(0.0), metavar="SECONDS",
                   help="wait at most this long for the node's layout lock, which the hooks hold while they change "
                        "a layout, then exit 75 having changed nothing (default: [node].layout_lock_wait_s, 30)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_apply)

    p = sub.add_parser("assert", parents=[common], help="exit 1 unless a GPU has exactly this layout")
    p.add_argument("--gpu", type=int, required=True, metavar="N")
    p.add_argument("--layout", required=True, type=_layout_spec, metavar="SPEC", help='e.g. "3g@0,3g@4" or "empty"')
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_assert)

    p = sub.add_parser("check-tables", parents=[common],
                       help="compare slurm-mig's MIG profile tables with what the driver reports (read-only)")
    p.add_argument("--gpu", type=int, metavar="N", help="only this GPU (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_check_tables)

    p = sub.add_parser("sim-init", parents=[common], help="create a simulated node's GPUs")
    p.add_argument("--gpus", metavar="MODEL[:N],...",
                   help="e.g. H100-80GB:2,A100-40GB; 1 to 64 GPUs in all (default: the config's "
                        "[node].sim_gpu_model:sim_gpu_count)")
    p.add_argument("--layout", action="append", metavar="[GPU=]SPEC",
                   help="initial layout for every GPU, or for one with GPU=SPEC (repeatable)")
    p.add_argument("--seed", help="seed for the UUIDs (default: random)")
    p.add_argument("--force", action="store_true", help="replace an existing state file")
    p.set_defaults(func=_cmd_sim_init)

    p = sub.add_parser("sim-busy", parents=[common], help="mark a simulated instance busy (a job runs on it) or idle")
    p.add_argument("--gpu", type=int, required=True, metavar="N")
    p.add_argument("instance", help="PROFILE@START (e.g. 3g@0) or a MIG- UUID")
    p.add_argument("--owner", help="who runs on it, e.g. job42")
    p.add_argument("--clear", action="store_true", help="mark it idle")
    p.set_defaults(func=_cmd_sim_busy)
