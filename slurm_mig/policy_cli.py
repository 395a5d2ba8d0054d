"""`slurm-mig policy list | install | rollback | retrain`: versions of the learned policy.

``list``, ``install`` and ``rollback`` need only onnxruntime (the head node has it).
``retrain`` runs training/retrain.py, which needs the training extra
(``pip install torch==2.13.0`` then ``pip install -e '.[train]'``) and the
repository's training/ folder.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

from slurm_mig.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policy", help="learned policy versions: list, install, rollback, retrain",
                       description="Versions of the learned rl policy in the policy store "
                                   "($SLURM_MIG_POLICY_STORE or /var/lib/slurm-mig/policies).")
    ps = p.add_subparsers(dest="policy_command", metavar="ACTION")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--store", metavar="DIR", help="policy store (default $SLURM_MIG_POLICY_STORE or "
                                                      "/var/lib/slurm-mig/policies)")
        q.add_argument("--json", action="store_true", help="print JSON")

    q = ps.add_parser("list", help="stored versions, their metrics, and which is active")
    common(q)
    q.set_defaults(func=_list)

    q = ps.add_parser("install", help="make a version active (or add a model folder/.onnx, then activate it)",
                      description="Make a stored version active. An argument with a '/' in it (./v1, /abs/v1) "
                                  "or ending in .onnx is a model folder or file to add to the store first; "
                                  "anything else is the name of a stored version, whatever the current "
                                  "directory holds.")
    common(q)
    q.add_argument("version", metavar="VERSION|PATH",
                   help="a stored version name, or a path (containing '/' or ending in .onnx) to add")
    q.set_defaults(func=_install)

    q = ps.add_parser("rollback", help="re-activate the previously active version")
    common(q)
    q.set_defaults(func=_rollback)

    q = ps.add_parser("retrain", help="fine-tune on the state DB's outcomes; keep the result only if it is better",
                      description="Build a trace from the outcomes table, fine-tune the active model on the older "
                                  "part, compare candidate and current policy on the most recent part (held out) "
                                  "over several replays, and write the candidate to the store only if it reliably "
                                  "waits less. Needs the training extra.")
    common(q)
    q.add_argument("--db", metavar="PATH", help="state DB (default: [controller].db_path of the config)")
    q.add_argument("--holdout", type=float, default=0.3, help="most recent share of jobs held out (default 0.3)")
    q.add_argument("--minutes", type=float, default=5.0, help="fine-tuning time budget (default 5)")
    q.add_argument("--iterations", type=int, default=60, help="fine-tuning iterations at most (default 60)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--replays", type=int, default=5,
                   help="replays of the recent history the comparison is paired over (default 5, at least 2)")
    q.add_argument("--jitter", type=float, default=0.05,
                   help="run times move by up to this share from the second replay on (default 0.05)")
    q.add_argument("--hold-caps", default=None, metavar="H,H,...",
                   help="also replay the current policy under these [policy].rl_max_hold_h values and show mean "
                        "and longest wait for each (default 0,6,12,24,48; \"\" for none)")
    q.add_argument("--install", action="store_true", help="also make the candidate active when it is better")
    q.add_argument("--out", metavar="DIR", help="working folder (default: a temporary one)")
    q.set_defaults(func=_retrain)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _store(args):
    from slurm_mig.policy_registry import PolicyStore

    return PolicyStore(args.store)


def _num(v) -> float | None:
    """A card's number; None for anything else (a card is hand-editable: list shows it, never crashes)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _obj(v) -> dict:
    return v if isinstance(v, dict) else {}


def _metric_line(card: dict) -> str:
    m = _obj(card.get("metrics"))
    held = _obj(m.get("heldout"))
    if held:
        parts = []
        for fam, v in sorted(held.items()):
            r = _num(_obj(v).get("rl_over_best_wait"))
            if r is not None:
                parts.append(f"{fam} {r:.2f}x")
        return "wait vs best heuristic: " + ", ".join(parts) if parts else ""
    if _num(m.get("candidate_mean_wait_s")) is not None:
        return (f"held-out wait {_num(m['candidate_mean_wait_s']):.0f} s (was "
                f"{_num(m.get('current_mean_wait_s')) or 0:.0f} s, "
                f"frag-aware {_num(m.get('frag_aware_mean_wait_s')) or 0:.0f} s)")
    r = _num(card.get("validation_wait_ratio_vs_frag_aware"))
    return f"validation wait / frag-aware {r:.3f}" if r is not None else ""


def _list(args) -> int:
    from slurm_mig.policies.rl import PLACEMENT_NETWORK  # what a card without the key means
    from slurm_mig.policy_registry import created_time

    st = _store(args)
    if args.store or os.environ.get("SLURM_MIG_POLICY_STORE"):
        # A store someone named that is not there: a typo would list "active: default" whatever the real store runs
        st.check_listable()
    else:
        # The default store before the first install: the shipped default is what runs, so it is listed (its card
        # says who places); exit 2 here left a fresh rl site without it (found by the review of the same day)
        st.check_not_a_file()
    vs = st.versions()
    problem = st.active_problem()
    if problem:  # the controller runs its fallback meanwhile, and logs this
        print(f"slurm-mig: warning: {problem}; until then the controller's rl policy fails and its "
              "[policy].fallback decides", file=sys.stderr)
    if args.json:
        print(json.dumps({"store": str(st.root), "active": st.active() or None, "active_problem": problem or None,
                          "versions": [v.to_json() for v in vs]}))
        return 0
    print(f"policy store {st.root} (active: {st.active() or 'none'})")
    if not vs:
        print("  no versions (and no shipped policy/default.onnx)")
    for v in vs:
        created = created_time(v.card)
        raw = v.card.get("created")
        try:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if created is not None else None
        except (OverflowError, OSError, ValueError):  # no date at all (1e300, infinity)
            when = None
        if when is None:
            when = str(raw)[:16] if raw else "-"  # a hand-written date is shown as written
        mark = "*" if v.active else " "
        places = f"places: {v.card.get('placement', PLACEMENT_NETWORK)}"
        schema = str(v.card.get("feature_schema", "?"))
        print(f" {mark} {v.version:28s} {when:16s} {schema:18s} {places:20s} {_metric_line(v.card)}")
    return 0


def _install(args) -> int:
    st = _store(args)
    target = args.version
    # A bare name is always a stored version: a folder that happens to share its name in the
    # current directory must not be installed in its place.
    if "/" in target or target.endswith(".onnx"):
        if not Path(target).exists():
            raise ConfigError(f"{target}: no such model folder or .onnx file")
        # A history.json that cannot be read refuses the activation: asked first, so the model is not added either
        # (it stayed inactive in the store, and the same install once the file was fixed said "already exists")
        st.history()
        target = st.add(target).version
    elif target != "default" and target not in {v.version for v in st.versions()} and Path(target).exists():
        raise ConfigError(f"no policy version {target!r} in {st.root}; to add the folder or file {target!r} "
                          f"here, name it as a path: ./{target}")
    if target == "default":
        st.install("default")  # load-checked as any version is
        v_json = {"version": "default", "active": True}
    else:
        v_json = st.install(target).to_json()
    pin = pinned_by(args)
    if args.json:
        print(json.dumps({**v_json, "pinned_by": pin or None}))
    elif pin:
        print(f"active policy version: {target}")
    else:
        print(f"active policy version: {target} (the controller's rl policy reloads it within seconds)")
    warn_if_pinned(pin)
    return 0


def pinned_by(args) -> str:
    """What makes the rl policy run another model than the store's active version ('' when nothing):
    the environment, else the model_path of ``args.config`` when given, else of the config found."""
    from slurm_mig.policies.rl import model_pin

    config_path = None
    if getattr(args, "config", None):
        from slurm_mig.config import load_config
        from slurm_mig.errors import SlurmMigError

        try:
            config_path = load_config(args.config).policy.model_path
        except SlurmMigError as exc:
            # Installing goes on (the store is not the config), but "not pinned" would be a guess.
            print(f"slurm-mig: warning: cannot tell whether {args.config} pins the rl policy's model: {exc}",
                  file=sys.stderr)
            config_path = ""
    return model_pin(config_path)


def warn_if_pinned(pin: str) -> None:
    """Say on stderr that ``pin`` (from :func:`pinned_by`) keeps the controller off the store's version."""
    # Installing succeeds either way; an admin who expects the new version to run must hear that it will not.
    if pin:
        print(f"slurm-mig: warning: {pin} pins the rl policy's model, so the controller keeps running that "
              "file, not the active store version; remove the pin to use the store", file=sys.stderr)


def _rollback(args) -> int:
    st = _store(args)
    prev = st.rollback()
    if args.json:
        print(json.dumps({"active": prev}))
    else:
        print(f"rolled back; active policy version: {prev}")
    return 0


def _training_module(name: str):
    """Import training.<name>, from the checkout beside this package when it is not installed."""
    try:
        return importlib.import_module(f"training.{name}")
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing not in ("training", f"training.{name}"):
            raise ConfigError(f"`slurm-mig policy retrain` needs the training extra ({missing} is missing): "
                              "pip install torch==2.13.0 && pip install -e '.[train]'") from None
    root = Path(__file__).resolve().parents[1]
    if not (root / "training" / f"{name}.py").is_file():
        raise ConfigError(f"training/{name}.py not found beside {root / 'slurm_mig'}: retraining runs from a "
                          "slurm-mig checkout")
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(f"training.{name}")
    except ModuleNotFoundError as exc:
        raise ConfigError(f"`slurm-mig policy retrain` needs the training extra ({exc.name} is missing): "
                          "pip install torch==2.13.0 && pip install -e '.[train]'") from None


def _check_out(out: str, store: str | None, config_model_path: str | None = None) -> None:
    """Refuse a ``--out`` folder where training would overwrite a model in use: training writes model.onnx, its
    card and model.pt there whatever the decision, so the store (a version's folder: the controller ran the
    unjudged candidate under the installed name), the shipped policy/ folder or a pinned model's folder would
    lose the model they hold."""
    from slurm_mig.policies.rl import SHIPPED_MODEL, _pins
    from slurm_mig.policy_registry import PolicyStore

    where = Path(out).resolve()
    root = PolicyStore(store).root.resolve()
    if where == root or root in where.parents:
        raise ConfigError(f"--out {out} is inside the policy store {root}: refusing to train there (a version's "
                          "files would be overwritten, or a folder there taken for a version); name a folder "
                          "outside it, or leave --out out (a temporary folder); a better candidate is copied "
                          "into the store")
    for what, path in (("the shipped model's folder", str(SHIPPED_MODEL)),
                       *((f"the folder of the model {w.strip(' =')} pins", p) for w, p in _pins(config_model_path) if p)):
        if where == Path(path).resolve().parent:
            raise ConfigError(f"--out {out} is {what}: refusing to train there (its model.onnx, card and model.pt "
                              "would be overwritten); name another folder, or leave --out out")


def check_retrain_configs(config: str | None) -> None:
    """As root, refuse the configs retraining reads when others may change them (config.check_trusted, the
    controller's and the hooks' rule): ``config`` (--config, else the one found), whose db_path it trains on
    without --db, and the config found ($SLURM_MIG_CONFIG, else /etc/slurm-mig/slurm-mig.toml), whose
    [policy].model_path names the model it fine-tunes. Whoever can change either chooses what root's retraining
    reads, loads and, with --install, activates."""
    from slurm_mig.config import check_trusted, find_config

    for path in dict.fromkeys((find_config(config), find_config())):
        check_trusted(path, "`slurm-mig policy retrain` running as root")


def _retrain(args) -> int:
    check_retrain_configs(getattr(args, "config", None))
    db = args.db
    if not db:
        from slurm_mig.config import load_config

        db = load_config(getattr(args, "config", None)).controller.db_path
    if not os.path.exists(db):  # (not is_file(): a FIFO or a folder is "not a regular file", replay_site says)
        raise ConfigError(f"state DB {db} does not exist")
    config_model_path = None  # the config found names the model, as for the controller without --config
    if getattr(args, "config", None):
        from slurm_mig.config import load_config

        config_model_path = load_config(args.config).policy.model_path
    if args.out:
        _check_out(args.out, args.store, config_model_path)
    mod = _training_module("retrain")
    report = mod.retrain(db, store=args.store, holdout=args.holdout, minutes=args.minutes,
                         iterations=args.iterations, seed=args.seed, replays=args.replays, jitter=args.jitter,
                         hold_caps=args.hold_caps, install=args.install, out=args.out,
                         config_model_path=config_model_path,
                         log=None if args.json else (lambda m: print(m, file=sys.stderr, flush=True)))
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(mod.format_report(report))
    if report.get("decision") == "installed":
        warn_if_pinned(pinned_by(args))
    return 0
