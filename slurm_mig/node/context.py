"""The node hooks' shared context: the node's settings (NodeSettings), its view of itself (Node: local
records, MIG backend, controller client, the MIG table check, layout changes under the layout lock), the
GPUs a report shows blocked, and the requeue every hook falls back on.

Every hook module imports this one; it imports none of them (slurm_mig.node.hooks is the entry point).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("slurm_mig.hooks")
# Fallback start time for the latency the Prolog logs: taken when the hook process starts (hooks.py imports
# this module first).
_T0 = time.time()
MAX_TABLE_ERRORS = 8  # differences from our MIG table a GPU report carries (the controller takes as many)
# The longest one it carries: the controller refuses a report with a longer one (node-channel.md), and with it
# the node's every report and Prolog request. The node's log has each in full.
MAX_TABLE_ERROR_CHARS = 300
#: How long a Prolog or an Epilog delivers the outbox before its own work: it starts no queued message after
#: this (the one under way ends within [node].request_timeout_s, twice with the client's retry). The first
#: hook after a long controller outage found hundreds queued, and Slurm kills (and drains the node of) a
#: Prolog or Epilog that runs past PrologEpilogTimeout; the health check, which no such timeout drains the
#: node for, delivers the rest, in order.
HOOK_FLUSH_BUDGET_S = 2.0
#: Of a Prolog's or an Epilog's time limit ([node].hook_time_limit_s), what its controller calls, lock waits
#: and Slurm queries leave for its fallback: two scontrol calls of at most 10 s each (the Prolog's requeue,
#: AdminComment then requeue; the Epilog's hold-back of a requeued job, show config then update).
HOOK_FALLBACK_RESERVE_S = 20.0
#: The time a Prolog counts for re-carving one GPU before it starts (NVML cannot be interrupted): a whole
#: H100 re-carve, 7 destroys and 7 creates at the measured 0.16-0.42 s a step, is under 5 s; about 6 s
#: were reported once tooling is counted (FACTS §2). A carve that would not fit before the fallback's reserve
#: is not started: the job is requeued, untouched.
RECARVE_S_PER_GPU = 6.0
#: A Slurm command a hook runs waits at most this long (and no longer than the hook's time limit leaves).
HOOK_SLURM_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class NodeSettings:
    """What a hook needs to know, from the [node], [auth] and [slurm] config sections."""

    controller_url: str
    timeout_s: float
    state_root: str  # the node's own records live in <state_root>/<node>
    backend: str  # "real" | "simulated"
    sim_state: str  # path; "{node}" is replaced by the node name
    sim_delay_scale: float
    auth_method: str
    auth_key_file: str | None
    munge_socket: str | None
    slurm_conf: str | None
    log_file: str | None
    log_level: str
    lock_wait_s: float | None = None  # [node].layout_lock_wait_s; None: wait for the layout lock unbounded
    # [auth].max_clock_skew_s: with MUNGE, the lifetime (TTL) of the node's credentials, which is what bounds
    # how far a node's clock may be behind the controller's for its requests to be accepted
    max_skew_s: float = 30.0
    # [auth].controller_user, resolved on this node: with MUNGE, answers signed by it (or by root) are accepted
    controller_uid: int = 0
    # [node].hook_time_limit_s: the longest a Prolog or Epilog runs in all; None: no limit (Node.start_time_limit)
    hook_time_limit_s: float | None = None

    def time_warnings(self) -> list[str]:
        """hook_time_warnings for these settings."""
        return hook_time_warnings(self.hook_time_limit_s, self.timeout_s, self.lock_wait_s)

    @classmethod
    def load(cls, node_name: str | None = None) -> "NodeSettings":
        """The settings of the config; as root refused (ConfigError) when others may change it or a folder
        it has root write in, ``node_name``'s own folders too (config.check_written_folders)."""
        from slurm_mig.config import check_written_folders, find_config, load_config

        _check_trusted(find_config())
        cfg = load_config()
        # As root, the folders it names for the hook to write in must be root's too (log, records, simulated GPUs),
        # and those of the node it acts for that exist (its records' folder, its simulated GPUs' "{node}" folder)
        check_written_folders(cfg, "a hook running as root", node=True, node_name=node_name)
        return cls(
            controller_url=cfg.node.controller_url,
            timeout_s=cfg.node.request_timeout_s,
            state_root=cfg.node.cache_dir,
            backend=cfg.node.nvml_backend,
            sim_state=cfg.node.sim_state_path,
            sim_delay_scale=cfg.node.sim_delay_scale,
            auth_method=cfg.auth.method,
            auth_key_file=cfg.auth.hmac_key_file,
            munge_socket=cfg.auth.munge_socket,
            slurm_conf=cfg.controller.slurm_conf,
            log_file=cfg.log.file,
            log_level=cfg.log.level,
            lock_wait_s=cfg.node.layout_lock_wait_s,
            max_skew_s=cfg.auth.max_clock_skew_s,
            controller_uid=cfg.auth.controller_uid,
            hook_time_limit_s=cfg.node.hook_time_limit_s,
        )


def hook_time_warnings(limit_s: float | None, request_timeout_s: float, lock_wait_s: float | None,
                       retries: int = 1) -> list[str]:
    """What is wrong with the [node] time settings against the hooks' time limit, in words (empty when all is
    well): a wait the limit always cuts short, or a limit that leaves the Prolog no time for its own work.
    Said by `slurm-mig install-hooks` and logged by every Prolog and Epilog; the limit itself keeps each hook
    within it (Node.start_time_limit), whatever these are."""
    if limit_s is None:
        return []
    out = []
    usable = limit_s - HOOK_FALLBACK_RESERVE_S  # what calls, lock waits and NVML share
    call = (retries + 1) * 3 * request_timeout_s + 0.2 * retries * (retries + 1) / 2
    if usable < 10:
        out.append(f"[node].hook_time_limit_s = {limit_s:g} leaves {max(0.0, usable):g} s for the controller, the "
                   f"layout lock and NVML once {HOOK_FALLBACK_RESERVE_S:g} s are kept for the requeue: most "
                   f"Prologs will requeue their job; give it at least {HOOK_FALLBACK_RESERVE_S + 30:g} s")
    if lock_wait_s is not None and lock_wait_s > usable - HOOK_FLUSH_BUDGET_S:
        out.append(f"[node].layout_lock_wait_s = {lock_wait_s:g} is never reached: a Prolog's time limit "
                   f"([node].hook_time_limit_s = {limit_s:g}, {HOOK_FALLBACK_RESERVE_S:g} s of it kept for the "
                   f"requeue) ends its wait first")
    if 3 * request_timeout_s > usable / 2:
        out.append(f"[node].request_timeout_s = {request_timeout_s:g}: one controller call may take "
                   f"{3 * request_timeout_s:g} s ({call:g} s with its retry), over half of what "
                   f"[node].hook_time_limit_s = {limit_s:g} leaves a Prolog; its later calls are then skipped "
                   f"(messages queued, the job requeued)")
    return out


def _check_trusted(path) -> None:
    """Running as root, refuse a config file others could have changed: it names the files root writes
    (cache_dir, log file), the controller to obey and the key to sign with (config.check_trusted: the
    controller's rule, and the policy store's)."""
    from slurm_mig.config import check_trusted

    check_trusted(path, "a hook running as root")


class Node:
    """One node's view: its settings, local records, MIG backend and controller client (all lazy)."""

    def __init__(self, name: str, settings: NodeSettings):
        from slurm_mig.node.localstate import NodeState

        self.name = name
        self.settings = settings
        self.state = NodeState(Path(settings.state_root) / name)
        self._backend = None
        self._client = None
        # Seconds this hook run may still wait for the layout lock, in all (start_lock_budget); None: unbounded.
        self.lock_wait_left: float | None = None
        # When (time.monotonic()) this hook run's time limit ends (start_time_limit); None: no limit.
        self.deadline: float | None = None
        # Whether the last apply_lock() that gave up did so because the time limit, not layout_lock_wait_s, ran out.
        self.lock_wait_cut: bool = False
        # The MIG table verdicts this hook run (or health check round) made or read (table_errors), by (GPU
        # uuid, model, MIG mode).
        self._table_verdicts: dict[tuple, list[str]] = {}

    @property
    def backend(self):
        if self._backend is None:
            from slurm_mig.nvml import open_backend

            s = self.settings
            if s.backend == "simulated":
                self._backend = open_backend("simulated", state_path=s.sim_state.replace("{node}", self.name),
                                             delay_scale=s.sim_delay_scale)
            else:
                self._backend = open_backend(s.backend)
        return self._backend

    @property
    def client(self):
        if self._client is None:
            from slurm_mig.api.auth import auth_from_settings
            from slurm_mig.api.client import ControllerClient

            s = self.settings
            auth = auth_from_settings(s.auth_method, munge_socket=s.munge_socket, key_file=s.auth_key_file,
                                      max_skew_s=s.max_skew_s, controller_uid=s.controller_uid)
            self._client = ControllerClient(s.controller_url, auth, self.name, timeout_s=s.timeout_s,
                                            time_left=self.time_left)
        return self._client

    # -- observation -----------------------------------------------------------
    TABLES_FILE = "tables.json"

    def table_errors(self, gpus) -> dict[int, list[str]]:
        """Where the driver's MIG profiles differ from our table for each GPU of ``gpus`` (GpuInfo), by index,
        as ``nvml check-tables`` words them; [] where they agree or cannot be read (nothing is blocked on a
        guess: a check that fails is logged and made again next time).

        Asked once per GPU, driver version and table of ours (a few dozen read-only NVML calls) and kept in
        ``<state>/tables.json``, which is read (and the driver version asked) once per call, so a Prolog
        reads a file, not NVML, to know. A verdict is also kept for the rest of this hook run (a health check
        round: healthcheck starts each afresh), so a health check, which asks for its repair, its report and
        the report after a re-carve, reads the file (and asks NVML) once; a check that failed is not kept,
        and is made again at the next ask."""
        import json

        from slurm_mig.node.localstate import _atomic_write
        from slurm_mig.nvml.tables import check_gpu

        out: dict[int, list[str]] = {}
        gpus = [g for g in gpus if g.model is not None and not g.lost and g.uuid]
        if not gpus:
            return out
        remembered = getattr(self, "_table_verdicts", None)  # None: a Node made without __init__ (tests)

        def key(gpu) -> tuple:
            return gpu.uuid, gpu.model.name, bool(gpu.mig_enabled)

        if remembered is not None and all(key(g) in remembered for g in gpus):
            return {g.index: list(remembered[key(g)]) for g in gpus}
        version = getattr(self.backend, "driver_version", None)
        driver = str(version()) if version is not None else "unknown"
        path = self.state.root / self.TABLES_FILE
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        cache = cache if isinstance(cache, dict) else {}
        changed = False
        for gpu in gpus:
            table = _table_fingerprint(gpu.model)
            seen = cache.get(gpu.uuid)
            # The verdict is about our table as much as the driver: one kept for another table (slurm-mig
            # upgraded since, or a verdict an older version kept without a fingerprint) is made again. And about
            # the MIG mode it was made in: a driver may list no profile with MIG off (nvml.h: NOT_SUPPORTED
            # without MIG mode), so that answer says nothing once MIG is turned on, which needs no new driver.
            if isinstance(seen, dict) and seen.get("driver") == driver and seen.get("model") == gpu.model.name \
                    and seen.get("table") == table and isinstance(seen.get("errors"), list) \
                    and ("unreadable" not in seen or seen.get("mig_enabled") == bool(gpu.mig_enabled)):
                out[gpu.index] = [str(e) for e in seen["errors"]]
                if remembered is not None:
                    remembered[key(gpu)] = list(out[gpu.index])
                continue
            out[gpu.index] = []
            try:
                check = check_gpu(self.backend, gpu)
            except Exception as exc:  # noqa: BLE001 - a check that fails blocks nothing; the others go on
                log.warning("GPU %s: the MIG table check failed: %s: %s", gpu.index, type(exc).__name__, exc)
                continue
            errors = [f"{f.profile}: {f.message}" for f in check.errors]
            if check.unreadable is not None:
                log.warning("GPU %s: the driver's MIG profiles could not be compared with ours: %s", gpu.index,
                            check.unreadable)
                if check.failed:
                    continue  # an NVML call failed: asked again next time
                # The driver answered (no profile at all), and answers the same until it changes: kept like a
                # verdict that blocks nothing, so the Prologs do not ask NVML again, nor log it, in every report.
                errors = []
            if errors:
                log.error("GPU %s (%s, driver %s): the driver's MIG profiles differ from slurm-mig's table, so "
                          "nothing is carved or started there: %s", gpu.index, gpu.name, driver, "; ".join(errors))
            cache[gpu.uuid] = {"driver": driver, "model": gpu.model.name, "table": table, "errors": errors}
            if check.unreadable is not None:
                cache[gpu.uuid].update(unreadable=check.unreadable, mig_enabled=bool(gpu.mig_enabled))
            out[gpu.index], changed = errors, True
            if remembered is not None:
                remembered[key(gpu)] = list(errors)
        if changed:
            try:
                self.state.ensure()
                _atomic_write(path, json.dumps(cache, sort_keys=True).encode(), 0o600)
            except OSError as exc:  # asked again next time
                log.warning("could not keep the MIG table check in %s: %s", path, exc)
        return out

    def _table_errors_or_none(self, gpus) -> dict[int, list[str]]:
        """table_errors, or {} (nothing blocked) when even the driver version cannot be read."""
        try:
            return self.table_errors(gpus)
        except Exception as exc:  # noqa: BLE001 - a check that fails blocks nothing; the report goes on
            log.warning("the MIG table check failed: %s: %s", type(exc).__name__, exc)
            return {}

    def observe(self) -> list[dict]:
        """Every GPU and its instances, as JSON for the controller."""
        from slurm_mig.nvml import foreign_instances

        out = []
        gpus = self.backend.gpus()
        tables = self._table_errors_or_none(gpus)
        for g in gpus:
            entry = {"index": g.index, "uuid": g.uuid, "name": g.name,
                     "model": g.model.name if g.model else None, "mig_enabled": g.mig_enabled,
                     "lost": getattr(g, "lost", False), "instances": []}
            if g.mig_pending is not None:
                # A MIG mode change waits for a GPU reset: the controller carves nothing there meanwhile.
                entry["mig_pending"] = g.mig_pending
            table = tables.get(g.index)
            if table:
                # The driver would refuse (or mislabel) what our table plans: nothing new there, as for mig_pending.
                entry["table_errors"] = [e if len(e) <= MAX_TABLE_ERROR_CHARS else e[:MAX_TABLE_ERROR_CHARS - 3] + "..."
                                         for e in table[:MAX_TABLE_ERRORS]]
            if g.model is not None and g.mig_enabled and not entry["lost"]:
                try:
                    for i in self.backend.instances(g.index):
                        entry["instances"].append({"profile": i.slot.profile, "start": i.slot.start,
                                                   "uuid": i.uuid, "in_use": i.in_use})
                    # Instances of profiles our tables do not list hold slices: the controller must know.
                    foreign = [{"start": f.start, "size": f.size, "profile_id": f.profile_id, "in_use": f.in_use}
                               for f in foreign_instances(self.backend, g.index)]
                    if foreign:
                        entry["foreign"] = foreign
                except Exception as exc:  # one bad GPU must not hide the others
                    entry["error"] = f"{type(exc).__name__}: {exc}"
            out.append(entry)
        return out

    def bindings_json(self) -> dict[str, list[dict]]:
        return {job: [i.to_json() for i in insts] for job, insts in self.state.all_bindings().items()}

    def held_by_others(self, job_id: str, wanted: list[dict]) -> list[str]:
        """Jobs other than ``job_id`` whose binding files hold any of ``wanted`` or overlapping slices."""
        models = {g.index: g.model for g in self.backend.gpus()}
        clash = set()
        for other, insts in self.state.all_bindings().items():
            if other == str(job_id):
                continue
            for w in wanted:
                for i in insts:
                    if i.gpu != int(w["gpu"]):
                        continue
                    model = models.get(i.gpu)
                    try:
                        overlap = bool(model.profile(i.profile).mask(i.start)
                                       & model.profile(str(w["profile"])).mask(int(w["start"])))
                    except Exception:
                        overlap = i.start == int(w["start"])
                    if overlap or i.start == int(w["start"]):
                        clash.add(other)
        return sorted(clash)

    def bound_on(self, gpu: int):
        from slurm_mig.mig.layout import Slot

        return {Slot(start, profile) for profile, start in self.state.bound_slots().get(gpu, set())}

    def flush_outbox(self, budget_s: float | None = None) -> None:
        """Deliver the outbox in order; with ``budget_s`` (a Prolog or Epilog, which Slurm kills at
        PrologEpilogTimeout) start no message after that many seconds, leaving the rest, in order, to the
        health check or the next hook."""
        from slurm_mig.api.client import ControllerUnavailable

        try:
            sent = self.state.flush(self.client, budget_s)
            if sent:
                log.info("delivered %d queued message(s) to the controller", sent)
        except ControllerUnavailable as exc:
            log.info("controller still unreachable; outbox kept: %s", exc)

    def send_or_queue(self, route: str, payload: dict) -> dict | None:
        """Deliver a message, or keep it: in the outbox when the controller is unreachable (sent later),
        as ``<outbox>/*.refused`` for an admin when the controller refused it (an outcome is never dropped).
        A message about a job that an older message about it still waits in the outbox for goes behind that
        one, unsent: delivered first, it would overtake it (a bounded flush, or another hook's flush under
        way, leaves messages queued while the controller answers)."""
        from slurm_mig.api.client import ControllerRefused, ControllerUnavailable
        from slurm_mig.node.localstate import identified

        # The id goes with the first try: the controller may have handled it when only its answer was lost.
        payload = identified(payload)
        if payload.get("job_id") is not None and self.state.queued_about(str(payload["job_id"])):
            kept = self.state.enqueue(route, payload)
            log.info("%s for job %s queued behind an older message about it in the outbox: %s", route,
                     payload["job_id"], kept.name)
            return None
        try:
            return self.client.call(route, payload)
        except ControllerUnavailable as exc:
            log.warning("controller unreachable (%s); %s queued in the outbox", exc, route)
            self.state.enqueue(route, payload)
        except ControllerRefused as exc:
            kept = self.state.enqueue(route, payload)
            kept = kept.rename(kept.with_suffix(".refused"))
            log.error("%s; the message is kept in %s", exc, kept)
        return None

    def apply_targets(self, targets: dict, *, locked: bool = False) -> list[dict]:
        """Move GPUs to the controller's target layouts, never touching locally bound instances.

        ``locked``: the caller already holds apply_lock() (the Prolog holds it until its binding is
        written, so no other layout change can take the instances it just created).
        """
        if not locked:
            with self.apply_lock():
                return self.apply_targets(targets, locked=True)
        models = {g.index: g.model for g in self.backend.gpus()}
        return [self._apply_one(int(gpu_s), spec, models.get(int(gpu_s))) for gpu_s, spec in sorted(targets.items())]

    def start_time_limit(self, started: float | None = None) -> None:
        """Start this hook run's time limit, ``[node].hook_time_limit_s`` counted from ``started`` (time.time()
        when the hook began: the wrapper's start, else this process's), for a Prolog or an Epilog, which Slurm
        kills at PrologEpilogTimeout and drains the node for. Every controller call (its retry included), lock
        wait and Slurm query then gets only what is left (time_left), less HOOK_FALLBACK_RESERVE_S for the
        fallback's scontrol calls; without it each had its own timeout, and together they ran past 120 s."""
        limit = getattr(self.settings, "hook_time_limit_s", None)
        if limit is None:
            self.deadline = None
            return
        spent = max(0.0, time.time() - (_T0 if started is None else started))
        self.deadline = time.monotonic() + limit - spent

    def time_left(self, reserve: float = HOOK_FALLBACK_RESERVE_S) -> float | None:
        """Seconds left of this hook run's time limit, less ``reserve`` (what the fallback keeps); None without
        a limit. May be negative."""
        deadline = getattr(self, "deadline", None)  # (a Node made without __init__: tests)
        if deadline is None:
            return None
        return deadline - time.monotonic() - reserve

    def slurm_timeout(self, reserve: float = HOOK_FALLBACK_RESERVE_S, commands: int = 1) -> float:
        """The timeout for the next of ``commands`` Slurm commands a hook runs: HOOK_SLURM_TIMEOUT_S, or an even
        share of what the time limit leaves (time_left(reserve)), never under one second."""
        left = self.time_left(reserve)
        if left is None:
            return HOOK_SLURM_TIMEOUT_S
        return max(1.0, min(HOOK_SLURM_TIMEOUT_S, left / max(1, commands)))

    def start_lock_budget(self) -> None:
        """Give this hook run its time to wait for the layout lock, in all: ``[node].layout_lock_wait_s``.

        A holder hung inside NVML (or a long chain of re-carves) would otherwise keep every Prolog waiting
        until Slurm kills them at PrologEpilogTimeout, which drains the node. Each apply_lock() takes what
        it waited from it; once it is spent, apply_lock() tries the lock once and raises LayoutLockBusy."""
        self.lock_wait_left = self.settings.lock_wait_s

    @contextlib.contextmanager
    def apply_lock(self):
        """One layout change at a time on this node (Prolog, health check and `nvml apply` may overlap).
        Raises LayoutLockBusy when this hook run's wait (start_lock_budget) is spent before the lock frees."""
        from slurm_mig.node.localstate import LayoutLockBusy

        self.state.ensure()
        t0 = time.monotonic()
        wait, self.lock_wait_cut = getattr(self, "lock_wait_left", None), False
        left = self.time_left()
        if left is not None and (wait is None or left < wait):
            # The hook's time limit ends first: wait only what it leaves (its fallback keeps the rest).
            wait, self.lock_wait_cut = max(0.0, left), True
        try:
            with self.state.layout_lock(wait):
                if self.lock_wait_left is not None:
                    self.lock_wait_left = max(0.0, self.lock_wait_left - (time.monotonic() - t0))
                yield
        except LayoutLockBusy:
            self.lock_wait_left = 0.0 if self.lock_wait_left is not None else None
            raise

    def make_instances(self, wanted: list[dict]) -> list[dict]:
        """Create just the instances a starting job needs, destroying only idle instances in their way.

        The controller's full target for the GPU is left to the health check: doing less here starts
        the job sooner and cannot collide with another Prolog that changed the GPU meanwhile.
        Call with apply_lock() held.
        """
        from slurm_mig.mig.layout import Layout, Slot
        from slurm_mig.mig.transitions import carve_options

        results = []
        models = {g.index: g.model for g in self.backend.gpus()}
        by_gpu: dict[int, list[Slot]] = {}
        for w in wanted:
            by_gpu.setdefault(int(w["gpu"]), []).append(Slot(int(w["start"]), str(w["profile"])))
        for gpu, slots in sorted(by_gpu.items()):
            model = models.get(gpu)
            if model is None:
                results.append({"gpu": gpu, "ok": False, "error": "unknown GPU or not a MIG model"})
                continue
            insts = self.backend.instances(gpu)
            layout = Layout(model, frozenset(i.slot for i in insts))
            locked = (self.bound_on(gpu) | {i.slot for i in insts if i.in_use}) & layout.slots
            target = layout
            error = None
            for slot in slots:
                if slot in target.slots:
                    continue
                options = [o for o in carve_options(target, slot.profile, locked | set(slots) & target.slots)
                           if o.slot == slot]
                if not options:
                    error = f"{slot} cannot be made on GPU {gpu} without touching a busy instance (now {target})"
                    break
                target = options[0].target
            if error:
                results.append({"gpu": gpu, "ok": False, "error": error})
                continue
            results.append(self._apply_one(gpu, str(target), model))
        return results

    def _apply_one(self, gpu: int, spec: str, model) -> dict:
        from slurm_mig.mig.layout import parse_layout
        from slurm_mig.nvml import apply_layout

        if model is None:
            return {"gpu": gpu, "ok": False, "error": "unknown GPU or not a MIG model"}
        try:
            target = parse_layout(spec, model)
            present = {i.slot for i in self.backend.instances(gpu)}
            busy = self.bound_on(gpu) & present
            return apply_layout(self.backend, gpu, target, extra_busy=busy).to_json()
        except Exception as exc:  # TransitionBlocked, InvalidLayout, NVML errors
            return {"gpu": gpu, "ok": False, "target": spec, "error": str(exc), "error_type": type(exc).__name__}

    def uuid_of(self, gpu: int, profile: str, start: int) -> str | None:
        """The MIG device UUID of an instance; None if it is missing or half-made (no compute instance)."""
        for i in self.backend.instances(gpu):
            if i.slot.profile == profile and i.slot.start == start:
                return i.uuid or None
        return None

    def half_made_among(self, wanted: list[dict]) -> bool:
        """Whether any of ``wanted`` exists without its compute instance (make_instances repairs it)."""
        for w in wanted:
            for i in self.backend.instances(int(w["gpu"])):
                if i.half_made and (i.slot.profile, i.slot.start) == (str(w["profile"]), int(w["start"])):
                    return True
        return False

    def repair_half_made(self) -> list[dict]:
        """Re-create every idle half-made instance on this node (each GPU's layout applied to itself), so
        none is reported as usable. Call with apply_lock() held."""
        from slurm_mig.mig.layout import Layout

        results = []
        gpus = self.backend.gpus()
        tables = self._table_errors_or_none(gpus)
        for g in gpus:
            if g.model is None or not g.mig_enabled or g.lost or g.mig_pending is not None:
                continue  # (a MIG mode change pending a reset: apply_layout refuses to touch the GPU)
            if tables.get(g.index):
                continue  # the driver's profiles differ from the table a re-creation would follow
            try:
                insts = self.backend.instances(g.index)
            except Exception:  # noqa: BLE001 - observe() reports this GPU's error; the others go on
                continue
            if any(i.half_made for i in insts):
                result = self._apply_one(g.index, str(Layout(g.model, frozenset(i.slot for i in insts))), g.model)
                done = result.get("error") or "; ".join(result.get("plan", [])) or "kept, bound to a job"
                log.warning("GPU %d has half-made MIG instance(s) (no compute instance): %s", g.index, done)
                results.append(result)
        return results

    def end_job_processes(self, job_id: str, insts) -> None:
        """The simulated GPU's stand-in for a job's processes ("job N" marks), cleared once Slurm says the
        job no longer runs here: a real GPU's die with the job's cgroup. Other marks (processes that
        outlived a job, set with ``nvml sim-busy``) stay, as leftover processes would on a real GPU."""
        owners = getattr(self.backend, "owners", None)
        if owners is None:
            return
        from slurm_mig.mig.layout import Slot

        for i in insts:
            try:
                mine = owners(i.gpu).get(Slot(i.start, i.profile)) == f"job {job_id}"
            except Exception:  # the GPU cannot be read: the busy check that follows keeps the binding
                continue
            if mine:
                self.mark_in_use(i.gpu, i.profile, i.start, None)

    def end_marks_no_other_record_names(self, key: str, insts=None) -> list:
        """end_job_processes for the run whose record is ``key`` (a job id, or an earlier run's record
        ``<job>.earlier-<n>``), on those of ``insts`` no other record names, by UUID or by slot
        (NodeState.named_by_others): never a mark another record's run may hold, "job <job>" too for another run
        of the same id. ``insts`` None: the record is damaged and names nothing we can read, so every instance
        marked "job <job>" is taken. None at all while another record of the same job id cannot be read (it may
        name any of them). Returns the instances whose marks it cleared. Call with apply_lock() held, or from
        the Epilog of the run (no other run of its id binds meanwhile)."""
        from slurm_mig.node.localstate import EARLIER_RUN

        job_id = str(key).partition(EARLIER_RUN)[0]
        named = self.state.named_by_others(key)
        damaged = sorted(k for k in named.unreadable if k.partition(EARLIER_RUN)[0] == job_id)
        if damaged:
            log.error("job %s: its marks on the simulated GPU are kept: its record(s) %s cannot be read and may "
                      "name them", job_id, ", ".join(damaged))
            return []
        if insts is None:
            insts = self.marked_by(f"job {job_id}")
        insts = [i for i in insts if i not in named]
        self.end_job_processes(job_id, insts)
        return insts

    def marked_by(self, owner: str) -> list:
        """The instances the simulated GPU marks as run by ``owner`` (BoundInstance); none on a real GPU. A GPU
        that cannot be read is skipped."""
        from slurm_mig.node.localstate import BoundInstance

        owners = getattr(self.backend, "owners", None)
        if owners is None:
            return []
        try:
            gpus = self.backend.gpus()
        except Exception:  # noqa: BLE001 - no GPU can be read: no mark can be cleared either
            return []
        out = []
        for g in gpus:
            try:
                marks = owners(g.index)
                insts = self.backend.instances(g.index) if owner in marks.values() else []
            except Exception:  # noqa: BLE001 - lost or unreadable: its marks cannot be cleared anyway
                continue
            out += [BoundInstance(g.index, i.slot.profile, i.slot.start, i.uuid) for i in insts
                    if marks.get(i.slot) == owner]
        return out

    def mark_in_use(self, gpu: int, profile: str, start: int, owner: str | None) -> None:
        # Only the simulated GPU needs telling: a real one sees the job's CUDA processes.
        setter = getattr(self.backend, "set_in_use", None)
        if setter is not None:
            from slurm_mig.mig.layout import Slot

            try:
                setter(gpu, Slot(start, profile), owner)
            except Exception as exc:
                log.warning("could not mark %s@%d on GPU %d: %s", profile, start, gpu, exc)

    # -- Slurm -----------------------------------------------------------------
    def requeue(self, job_id: str, reason: str) -> int:
        """Give the job back to Slurm's queue with a readable reason; the node stays healthy. Its two scontrol
        calls share what the hook's time limit leaves (the reserve included)."""
        return _requeue(job_id, reason, self.settings.slurm_conf,
                        timeouts=lambda commands: self.slurm_timeout(0.0, commands))


def _table_fingerprint(model) -> str:
    """A short digest of our MIG table for ``model`` (every number check-tables compares), so a verdict kept in
    tables.json is known to be about this table."""
    import hashlib

    return hashlib.sha256(repr((model.name, model.memory_slices, model.compute_slices,
                                model.profiles)).encode()).hexdigest()[:16]


def blocked_gpus(observed: list[dict]) -> dict[str, str]:
    """The GPUs of a node's report (Node.observe) that nothing may be carved on, by index (a string), with
    why: a MIG mode change waiting for a reset, GPU instances of a profile our tables do not list, or a
    driver whose MIG profiles differ from our table. The controller stores each as blocked and plans nothing
    there; the node refuses, whoever asks (an older controller in a rolling upgrade, the cached layouts)."""
    out = {}
    for g in observed:
        if g.get("mig_pending") is not None:
            why = "its MIG mode changes at the next GPU reset"
        elif g.get("foreign"):
            why = "it holds GPU instance(s) of a profile slurm-mig does not know"
        elif g.get("table_errors"):
            why = "the driver's MIG profiles differ from slurm-mig's table"
        else:
            continue
        out[str(g.get("index"))] = why
    return out


def closed_to_new_jobs(blocked: dict[str, str], observed: list[dict]) -> dict[str, str]:
    """Of the blocked GPUs (blocked_gpus), those no new job may start on, even on an instance already there: a
    MIG mode change waiting for a reset (which ends the job), or a driver whose MIG profiles differ from our
    table (the instance may not be the size its name says). An instance of a profile we do not know blocks
    carving only: our instances beside it are what they say."""
    return {str(g.get("index")): blocked[str(g.get("index"))] for g in observed
            if str(g.get("index")) in blocked and (g.get("mig_pending") is not None or g.get("table_errors"))}


def _requeue(job_id: str, reason: str, slurm_conf: str | None, timeouts=None) -> int:
    """``timeouts(commands)``: the timeout of the next of ``commands`` scontrol calls (Node.slurm_timeout);
    None: HOOK_SLURM_TIMEOUT_S each."""
    from slurm_mig.slurm.runner import SlurmClient

    timeouts = timeouts or (lambda commands: HOOK_SLURM_TIMEOUT_S)
    client = SlurmClient(slurm_conf=slurm_conf, timeout=HOOK_SLURM_TIMEOUT_S)
    log.warning("job %s requeued: %s", job_id, reason)
    # AdminComment shows in `scontrol show job` and leaves the user's own Comment alone.
    client.run(["scontrol", "update", f"JobId={job_id}", f"AdminComment=slurm-mig: {reason}"[:1000]],
               timeout=timeouts(2))
    res = client.run(["scontrol", "requeue", job_id], timeout=timeouts(1))
    if not res.ok:
        log.error("scontrol requeue %s failed: %s", job_id, res.describe())
    return 0


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
