"""The node's cache of its desired layouts (``<state>/desired.json``): what the health check moves GPUs to
when it cannot reach the controller (after a reboot above all), kept by the health check and by a Prolog
that re-carved."""

from __future__ import annotations

import logging
import time

from slurm_mig.node.context import Node, blocked_gpus

log = logging.getLogger("slurm_mig.hooks")


def cache_desired(node: Node, resp: dict, observed: list[dict], observed_at: float | None = None) -> None:
    """Keep the layout every GPU should have, for a health check that cannot reach the controller (after a
    reboot above all). The controller sends only the layouts that differ from what the node reported; a
    GPU it leaves out is where it should be, so its reported layout is the one kept (caching only what was
    sent left ``{}`` on every converged node, and a node rebooted while the controller was down re-created
    nothing). A GPU left out that a Prolog re-carved after ``observed_at`` keeps the target that Prolog
    cached: the reported layout is older than it (the controller, already told of the re-carve, leaves
    the GPU out because it is where it should be)."""
    from slurm_mig.mig.layout import Layout, Slot
    from slurm_mig.mig.profiles import get_model

    desired = {str(k): v for k, v in (resp.get("desired") or {}).items()}
    blocked = blocked_gpus(observed)  # their reported layouts are not ours to keep
    with node.apply_lock():  # read and written under the lock the Prologs cache their targets with
        old, old_at = _cached_layouts(node)
        targets_at = {}
        for g in observed:
            key = str(g.get("index"))
            if key in desired:
                continue
            at = old_at.get(key)
            if observed_at is not None and isinstance(at, (int, float)) and at > observed_at \
                    and isinstance(old.get(key), str):
                desired[key], targets_at[key] = old[key], at  # a Prolog's target, newer than this report
                continue
            if not g.get("model") or not g.get("mig_enabled") or g.get("lost") or g.get("error") \
                    or str(g.get("index")) in blocked:
                continue
            try:
                layout = Layout.of(get_model(g["model"]), [Slot(int(i["start"]), str(i["profile"]))
                                                           for i in g["instances"]])
            except Exception:  # noqa: BLE001 - a layout we cannot name is not worth keeping
                continue
            if layout.is_valid():
                desired[str(g["index"])] = str(layout)
        _write_cached_layouts(node, desired, targets_at, time.time())


def remember_targets(node: Node, targets: dict) -> None:
    """Put the layouts a Prolog was told to move GPUs to in the health check's cache: kept as they were, the
    cache would take those GPUs back to an older layout at the next health check without the controller."""
    if not targets:
        return
    desired, targets_at = _cached_layouts(node)
    now = time.time()
    desired.update({str(k): str(v) for k, v in targets.items()})
    targets_at.update({str(k): now for k in targets})  # a health check that observed before now keeps these
    try:
        _write_cached_layouts(node, desired, targets_at, now)
    except OSError as exc:
        log.warning("could not keep the new target layouts for a health check without the controller: %s", exc)


def _cached_layouts(node: Node) -> tuple[dict, dict]:
    """The cache's layouts by GPU and when a Prolog put each target there ({} for what is not a mapping)."""
    cached = cached_desired(node)
    desired, targets_at = cached.get("desired"), cached.get("targets_at")
    return (desired if isinstance(desired, dict) else {}), (targets_at if isinstance(targets_at, dict) else {})


def _write_cached_layouts(node: Node, desired: dict, targets_at: dict, now: float) -> None:
    import json

    from slurm_mig.node.localstate import _atomic_write

    _atomic_write(node.state.root / "desired.json",
                  json.dumps({"desired": desired, "time": now, "targets_at": targets_at}).encode(), 0o600)


def cached_desired(node: Node) -> dict:
    """The last desired layouts, so a rebooted node re-creates its layout even with the controller down."""
    import json

    try:
        cached = json.loads((node.state.root / "desired.json").read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}
