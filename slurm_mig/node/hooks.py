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
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("slurm_mig.hooks")
_T0 = time.time()  # fallback start time for the latency the Prolog logs
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

    @classmethod
    def load(cls) -> "NodeSettings":
        from slurm_mig.config import find_config, load_config

        _check_trusted(find_config())
        cfg = load_config()
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
        )


def _check_trusted(path) -> None:
    """Running as root, refuse a config file others could have written: it names the files root writes
    (cache_dir, log file), the controller to obey and the key to sign with."""
    import stat

    from slurm_mig.errors import ConfigError

    if path is None or os.geteuid() != 0:
        return
    for p in (Path(path), Path(path).resolve().parent):
        try:
            st = os.stat(p)
        except OSError:
            return  # load_config reports a missing file
        sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        if st.st_uid != 0 or (st.st_mode & 0o022 and not sticky_dir):
            raise ConfigError(f"config {path}: {p} is owned by uid {st.st_uid} with mode "
                              f"{stat.S_IMODE(st.st_mode):04o}; a hook running as root only trusts files "
                              f"that only root can change (chown root, chmod go-w)")


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
                                      max_skew_s=s.max_skew_s)
            self._client = ControllerClient(s.controller_url, auth, self.name, timeout_s=s.timeout_s)
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
        try:
            with self.state.layout_lock(self.lock_wait_left):
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
        """Give the job back to Slurm's queue with a readable reason; the node stays healthy."""
        return _requeue(job_id, reason, self.settings.slurm_conf)


def _table_fingerprint(model) -> str:
    """A short digest of our MIG table for ``model`` (every number check-tables compares), so a verdict kept in
    tables.json is known to be about this table."""
    import hashlib

    return hashlib.sha256(repr((model.name, model.memory_slices, model.compute_slices,
                                model.profiles)).encode()).hexdigest()[:16]


def _blocked_gpus(observed: list[dict]) -> dict[str, str]:
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


def _closed_to_new_jobs(blocked: dict[str, str], observed: list[dict]) -> dict[str, str]:
    """Of the blocked GPUs (_blocked_gpus), those no new job may start on, even on an instance already there: a
    MIG mode change waiting for a reset (which ends the job), or a driver whose MIG profiles differ from our
    table (the instance may not be the size its name says). An instance of a profile we do not know blocks
    carving only: our instances beside it are what they say."""
    return {str(g.get("index")): blocked[str(g.get("index"))] for g in observed
            if str(g.get("index")) in blocked and (g.get("mig_pending") is not None or g.get("table_errors"))}


def _requeue(job_id: str, reason: str, slurm_conf: str | None) -> int:
    from slurm_mig.slurm.runner import SlurmClient

    client = SlurmClient(slurm_conf=slurm_conf, timeout=10)
    log.warning("job %s requeued: %s", job_id, reason)
    # AdminComment shows in `scontrol show job` and leaves the user's own Comment alone.
    client.run(["scontrol", "update", f"JobId={job_id}", f"AdminComment=slurm-mig: {reason}"[:1000]])
    res = client.run(["scontrol", "requeue", job_id])
    if not res.ok:
        log.error("scontrol requeue %s failed: %s", job_id, res.describe())
    return 0


def _job_gid(env: dict, uid: int) -> int | None:
    """The job owner's group, which may read the TaskProlog's copy of the binding: Slurm's SLURM_JOB_GID
    (set by slurmd, not the user), else the user's primary group; None when neither is known."""
    gid = _int(env.get("SLURM_JOB_GID"))
    if gid is not None and gid >= 0:
        return gid
    if uid < 0:
        return None
    import pwd

    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return None


def _job_request(node: Node, job_id: str) -> dict[str, int] | None:
    """The job's per-node MIG request from Slurm itself, every type with its count ({"1g": 1, "3g": 1};
    empty for a job without one), for when the controller cannot be asked; None if Slurm cannot say."""
    from slurm_mig.slurm.runner import SlurmClient

    detail = SlurmClient(slurm_conf=node.settings.slurm_conf, timeout=10).job_detail(job_id)
    if detail is None:
        return None
    from slurm_mig.slurm.gres import GRES_TO_KIND

    return {GRES_TO_KIND.get(gtype, gtype): int(count) for gtype, count in sorted(detail.mig.items()) if count > 0}


# -- the hooks ---------------------------------------------------------------

def prolog(env: dict, node: Node) -> int:
    from slurm_mig.api.client import ControllerRefused, ControllerUnavailable
    from slurm_mig.node.localstate import LayoutLockBusy

    try:
        started = int(env["SLURM_MIG_T0_NS"]) / 1e9
    except (KeyError, ValueError):
        started = _T0
    job_id = env["SLURM_JOB_ID"]
    uid = int(env.get("SLURM_JOB_UID", "-1"))
    node.state.ensure()
    # Every wait for the layout lock below comes out of one bound ([node].layout_lock_wait_s), so a holder hung
    # inside NVML costs this job a requeue, not the node a drain at PrologEpilogTimeout.
    node.start_lock_budget()
    try:
        _keep_earlier_runs_binding(node, job_id, _int(env.get("SLURM_JOB_RESTART_COUNT")), uid)
    except LayoutLockBusy as exc:
        # The record an earlier run left cannot be set aside, so this run cannot be bound (nor shown no GPU)
        # without taking it over. The controller was not asked yet: it bound nothing for this run to release.
        return _requeue_lock_busy(node, job_id, exc, tell=False)
    node.state.note_attempt(job_id, _int(env.get("SLURM_JOB_RESTART_COUNT")))
    # A bounded share of the outbox (after a long controller outage it may hold hundreds of messages); the
    # health check and later hooks deliver the rest, in order.
    node.flush_outbox(HOOK_FLUSH_BUDGET_S)
    # An older message about this job still queued (its earlier run's Epilog or binding, left behind the
    # budget or by another hook's flush under way) must reach the controller before anything this Prolog
    # says about the job: it then decides as without the controller, and its own messages queue behind.
    behind = node.state.queued_about(job_id)
    observed_at = time.time()  # before looking: a re-carve made while we look has a later time
    try:
        observed = node.observe()
    except Exception:
        # NVML cannot be read (driver gone or reloading, no GPU at all): a job that asks for no MIG instance
        # needs none of it and runs; a MIG job (or one Slurm cannot describe) is requeued by main().
        if _job_request(node, job_id) == {}:
            log.warning("job %s asks for no MIG instance; started although this node's GPUs cannot be read",
                        job_id, exc_info=True)
            return 0
        raise
    payload = {"job_id": job_id, "node": node.name, "observed": observed, "observed_at": observed_at,
               "bindings": node.bindings_json()}
    if behind:
        log.warning("job %s: an older message about it waits in the outbox and must reach the controller first; "
                    "trying instances that already exist, as without the controller", job_id)
        resp = _local_choice(node, job_id, payload["observed"],
                             "an older message about this job waits in the node's outbox")
    else:
        try:
            resp = node.client.call("/v1/prolog", payload)
        except ControllerRefused as exc:
            return node.requeue(job_id, f"the controller refused the job: {exc}")
        except ControllerUnavailable as exc:
            log.warning("controller unreachable for job %s: %s; trying instances that already exist", job_id, exc)
            resp = _local_choice(node, job_id, payload["observed"])
    action = resp.get("action")
    if action == "skip":
        return 0
    if action != "bind":
        if resp.get("requeued"):
            return 0
        return node.requeue(job_id, resp.get("reason", "no MIG instance could be made for this job"))
    gid = _job_gid(env, uid)
    # What the controller is told and why the job goes back when this Prolog cannot bind: said after the lock
    # is let go. Those are network and scontrol calls (up to ~30 s with a slow controller or slurmctld), and
    # every other Prolog on this node waits for the lock: held across them, a burst of failing Prologs ran
    # the last one past PrologEpilogTimeout, and Slurm drains a node whose Prolog it kills.
    failure: tuple[list[dict], str] | None = None
    try:
        with node.apply_lock():
            clash = node.held_by_others(job_id, resp["instances"])
            if clash:
                # Never two jobs on one instance, whatever the answer said (a bug, a forged or stale answer).
                log.error("job %s: the controller named %s, held here by job(s) %s", job_id, resp["instances"],
                          clash)
                failure = ([{"error": f"instances held by job(s) {clash}"}],
                           f"the instance chosen on {node.name} is held by another job")
            else:
                blocked = _blocked_gpus(payload["observed"])
                failure, bound, results, message = _bind_here(node, env, job_id, resp, uid, gid, blocked,
                                                              _closed_to_new_jobs(blocked, payload["observed"]))
    except LayoutLockBusy as exc:
        # Nothing was touched: the lock was never held. The controller releases the binding it made; one that
        # was not asked (a choice made here, as without it) made none.
        return _requeue_lock_busy(node, job_id, exc, tell=not resp.get("local"))
    if failure is not None:
        node.send_or_queue("/v1/bind-failed", {"job_id": job_id, "node": node.name, "results": failure[0]})
        return node.requeue(job_id, failure[1])
    node.send_or_queue("/v1/bound", message)
    # One line per bound job: `slurm-mig demo` and benchmarks/prolog_latency.py read these.
    log.info("prolog job %s bound %s in %.1f ms (reconfigured=%s)", job_id,
             ",".join(f"{b.profile}@{b.gpu}:{b.start}" for b in bound), (time.time() - started) * 1000,
             bool(results))
    return 0


def _requeue_lock_busy(node: Node, job_id: str, exc: Exception, *, tell: bool) -> int:
    """The Prolog could not take the node's layout lock within [node].layout_lock_wait_s (another hook holds
    it: hung inside NVML, or a long chain of re-carves): with ``tell`` (the controller answered this Prolog
    with a binding), tell the controller, which releases that binding, and requeue the job with the reason,
    exit 0. Waiting on, Slurm would kill this Prolog at PrologEpilogTimeout and drain the node.

    Not ``tell`` (the controller was not asked: the wait ran out at the first look, or the choice was made
    here as without it): nothing is sent. The controller bound nothing for this run (a /v1/bind-failed of a
    Prolog whose journal entries it did not know used to close every re-carve in progress on the node as
    failed, which here are the lock holder's own, carried out at that moment)."""
    log.error("job %s: %s; the job is requeued", job_id, exc)
    if tell:
        node.send_or_queue("/v1/bind-failed", {"job_id": job_id, "node": node.name,
                                               "results": [{"error": f"layout lock busy: {exc}"}]})
    wait = node.settings.lock_wait_s
    return node.requeue(job_id, f"{node.name} was busy changing its MIG layout for over "
                                f"{wait if wait is not None else 0:g} s (the node's layout lock stayed held)")


def _bind_here(node: Node, env: dict, job_id: str, resp: dict, uid: int, gid: int | None,
               blocked: dict[str, str] | None = None, closed: dict[str, str] | None = None):
    """The Prolog's part under the layout lock: make the instances the answer names (if it asks), and write
    the binding. Returns (failure, bound, results, message): failure is (results for /v1/bind-failed, the
    requeue's reason) when the job cannot be bound here, for the caller to say once the lock is let go.
    ``blocked``: the GPUs this Prolog's report showed blocked (_blocked_gpus); an answer that would carve on
    one is refused. ``closed``: those of them no job may start on (_closed_to_new_jobs); an answer that names
    an instance on one is refused too."""
    from slurm_mig.node.localstate import BoundInstance

    # A named instance without its compute instance is made whole here rather than bound useless.
    remake = resp.get("targets") or node.half_made_among(resp["instances"])
    carving = {str(k) for k in resp.get("targets") or {}}
    if remake:
        carving |= {str(i["gpu"]) for i in resp["instances"]}
    # Nor does a job start on an instance already there on a GPU closed to new jobs (the node's own choice
    # without the controller starts none there either).
    starting = {str(i["gpu"]) for i in resp["instances"]} & set(closed or {})
    refused = sorted((carving & set(blocked or {})) | starting, key=lambda g: (len(g), g))
    if refused:
        # The controller stores such a GPU as blocked and plans nothing there; one that does not know the block
        # (older than this node, in a rolling upgrade) would have it carved, the wrong size where the driver
        # differs from our table. Refused as a failed re-carve: the job goes back to the queue, nothing touched.
        blocked = {**(blocked or {}), **(closed or {})}
        why = "; ".join(f"GPU {g}: {blocked[g]}" for g in refused)
        verb = "carve on" if carving & set(refused) else "start the job on"
        log.error("job %s: the controller asked to %s GPU(s) %s of %s, which this node reports as blocked "
                  "(%s); nothing was changed", job_id, verb, ", ".join(refused), node.name, why)
        return (([{"gpu": int(g), "ok": False,
                   "error": f"not {'carved' if g in carving else 'started'}: GPU {g} is blocked on {node.name}: "
                            f"{blocked[g]}"} for g in refused],
                 f"the controller asked to {verb} {node.name}'s GPU(s) blocked there ({why})"), [], [], None)
    results = node.make_instances(resp["instances"]) if remake else []
    failed = [r for r in results if not r.get("ok", False) or r.get("reached") is False]
    if failed:
        reason = "; ".join(str(r.get("error") or f"GPU {r['gpu']} shows {r.get('after')}") for r in failed)
        return (results, f"reconfiguration failed on {node.name}: {reason}"), [], results, None
    bound = []
    for inst in resp["instances"]:
        uuid = node.uuid_of(int(inst["gpu"]), inst["profile"], int(inst["start"]))
        if uuid is None:
            return (([{"error": f"instance {inst} missing"}],
                     f"MIG instance {inst['profile']}@{inst['start']} missing on {node.name}"), [], results, None)
        bound.append(BoundInstance(int(inst["gpu"]), inst["profile"], int(inst["start"]), uuid))
    # Written before the lock is released: from here on every layout change on this node sees them busy.
    node.state.write_binding(job_id, bound, uid if uid >= 0 else None, gid,
                             attempt=_int(env.get("SLURM_JOB_RESTART_COUNT")))
    for b in bound:
        node.mark_in_use(b.gpu, b.profile, b.start, f"job {job_id}")
    message = {"job_id": job_id, "node": node.name, "instances": [b.to_json() for b in bound],
               "bound_at": time.time(), "local": bool(resp.get("local"))}
    if results:
        # The controller's layouts for the GPUs this Prolog re-carved are the newest it gave this node.
        _remember_targets(node, resp.get("targets") or {})
        # The layout this Prolog made, seen under the lock, so the controller plans from it at once.
        message["observed_at"] = time.time()
        message["observed"] = node.observe()
    return None, bound, results, message


def _keep_earlier_runs_binding(node: Node, job_id: str, restarts: int | None, uid: int | None = None) -> None:
    """The Prolog's first look: a binding record of ``job_id`` that an earlier run left (its processes outlived
    it, so its Epilog kept the record; or that Epilog was killed before removing it) is set aside under a name
    of its own (NodeState.set_aside_earlier_run) before this run binds. Written over, it lost the only word
    that the instance is still held, and as the job's own it hid that instance from the check for instances
    other jobs hold. A record is an earlier run's when an Epilog ran after the Prolog that wrote it (it took
    the attempt that Prolog noted), when it was made at a lower restart count (a requeue), or for another user
    (``uid``, SLURM_JOB_UID, against the uid the record keeps: a job id slurmctld gave again after it lost its
    state, while the earlier job's Epilog never ran here, node crashed or Epilog killed; a requeue never changes
    the user). A record of this very run (a Prolog run again) is left as it is; so is one of the same user at the
    same restart count, which only the controller can tell apart, and one written before records kept the uid.
    Until 2026-11-27 the uid was not kept, and such a record of another user's job was taken for this run's: a
    job that asks for no MIG instance then ran with the earlier job's TaskProlog copy, its instances shown to
    the new job's tasks where its user could read the copy (the same group)."""
    if not node.state.has_record(job_id):
        # Nothing to set aside (a job's first run here, almost always): no lock to wait for. The lock is what
        # a health check's re-carve and other Prologs' NVML steps hold, and a job that binds nothing (no MIG,
        # or requeued) never waited on it. A record written meanwhile is a Prolog's of this very run.
        return
    if node.state.attempt_noted(job_id):
        made_at, owner = node.state.binding_attempt(job_id), node.state.binding_uid(job_id)
        another_user = owner is not None and uid is not None and uid >= 0 and owner != uid
        if not another_user and (made_at is None or restarts is None or restarts <= made_at):
            return
    with node.apply_lock():
        key = node.state.set_aside_earlier_run(job_id)
    if key is not None:
        log.warning("job %s: the binding an earlier run of it left here (its processes outlived it) is kept as %s "
                    "until its instances are idle; this run is not bound to them", job_id, key)


def _local_choice(node: Node, job_id: str, observed: list[dict], why: str | None = None) -> dict:
    """Without the controller: bind instances that already exist and are free, every size the job asks
    for with its count, or requeue it (never start it with part of its request). ``why`` the controller
    is not asked (the requeue's reason): unreachable unless said."""
    why = why or "controller unreachable"
    req = _job_request(node, job_id)
    if req is None:
        return {"action": "requeue", "reason": f"{why} and the job's MIG request unreadable"}
    if not req:
        return {"action": "skip"}
    from slurm_mig.mig.profiles import get_model

    held = node.state.bound_slots()
    # A GPU whose MIG mode changes at its next reset, or whose driver's MIG profiles differ from our table:
    # no new job starts there (as the controller would decide).
    closed = _closed_to_new_jobs(_blocked_gpus(observed), observed)
    chosen, short = [], []
    for kind, count in req.items():
        found = []
        for g in observed:
            if str(g.get("index")) in closed:
                continue
            try:
                name = get_model(g["model"]).profile(kind).name
            except Exception:  # no model, or one without this size
                continue
            for i in g["instances"]:
                if len(found) < count and i["profile"] == name and not i["in_use"] and i["uuid"] \
                        and (i["profile"], i["start"]) not in held.get(g["index"], set()):
                    found.append({"gpu": g["index"], "profile": i["profile"], "start": i["start"]})
        chosen += found
        if len(found) < count:
            short.append(f"{count} x {kind}")
    if short:
        return {"action": "requeue",
                "reason": f"{why} and no free {', '.join(short)} instance exists on {node.name}"}
    return {"action": "bind", "instances": chosen, "targets": {}, "local": True}


def taskprolog(env: dict, node_name: str, state_root: str, slurm_conf: str | None = None) -> int:
    """Print the job's CUDA_VISIBLE_DEVICES for Slurm to export (runs as the job's user)."""
    from slurm_mig.node.localstate import NodeState

    job_id = env.get("SLURM_JOB_ID", "")
    state = NodeState(Path(state_root) / node_name)
    components = _het_components(env)
    # A job submitted from inside a het job inherits its SLURM_JOB_ID_HET_GROUP_* (--export=ALL): only a
    # step of the het job itself has its own id among them.
    het_step = bool(components) and job_id in components
    if het_step:
        # A heterogeneous job's step: every task is told the leader's job id (seen on Slurm 22.05), and the
        # component that runs here was bound under its own. Slurm does not say which component a task is
        # of, so when two are bound on this node the task cannot be given either's instances.
        here = [c for c in components if _has_task_binding(state, c)]
        if len(here) > 1:
            return _show_no_gpu(env, f"components {', '.join(here)} of heterogeneous job {job_id} are both bound "
                                     f"on this node and Slurm does not say which this task belongs to: no GPU is "
                                     f"shown to it")
        if here:
            job_id = here[0]
    try:
        insts = state.read_task_binding(job_id)
    except (OSError, ValueError) as exc:
        # The job is bound but we cannot tell to what: it must see no GPU rather than every GPU.
        return _show_no_gpu(env, f"cannot read this job's MIG binding: {exc}")
    if insts is None:
        # Not bound to an instance (not a MIG job, or its Prolog requeued it): such a job must see no
        # GPU rather than every GPU. A value Slurm's own gres/gpu plugin set is left alone, but not one a
        # slurm-mig TaskProlog set in the job this one was submitted from (sbatch/srun pass the submitting
        # shell's environment on): that names another job's instance. Ours come with SLURM_MIG_INSTANCES
        # and are all MIG-<uuid>; gres/gpu sets device indexes.
        cvd = env.get("CUDA_VISIBLE_DEVICES")
        inherited = "SLURM_MIG_INSTANCES" in env
        if cvd is None or (inherited and cvd and all(u.startswith("MIG-") for u in cvd.split(","))):
            print("export CUDA_VISIBLE_DEVICES=")
        if inherited:
            print("unset SLURM_MIG_INSTANCES")
        return 0
    # Not for a het step: its tasks know only the leader's job id, and the step record Slurm shows for
    # it is the leader's part of the step, whose request need not be this component's.
    if len(insts) > 1 and not het_step:
        insts = _step_instances(env, insts, slurm_conf)
    uuids = ",".join(i.uuid for i in insts)
    print(f"export CUDA_VISIBLE_DEVICES={uuids}")
    print(f"export SLURM_MIG_INSTANCES={','.join(f'{i.profile}@{i.gpu}:{i.start}' for i in insts)}")
    return 0


def epilog(env: dict, node: Node) -> int:
    job_id = env["SLURM_JOB_ID"]
    node.state.ensure()
    unreadable = False
    try:
        insts = node.state.read_binding(job_id) or []
    except ValueError as exc:
        # Bound, but the file is damaged: the outcome still goes out; the controller knows the instances.
        log.error("job %s: binding file unreadable (%s); reporting the outcome without it", job_id, exc)
        insts, unreadable = [], True
    # The simulated GPU's stand-in for the job's processes ends with it; a process that outlived the job
    # (another mark) stays, and keeps the binding below, as a real GPU's leftover process does.
    node.end_job_processes(job_id, insts)
    lingering = [i.to_json() for i in _wait_for_processes(node, job_id, insts)]
    # Slurm raises SLURM_JOB_RESTART_COUNT when it requeues a job, before this Epilog runs: a binding made
    # at a lower count belongs to an attempt that was requeued (e.g. its Prolog was killed and the wrapper
    # requeued it), whose end is not the job's outcome.
    noted = node.state.take_attempt(job_id)
    attempt, restarts = node.state.binding_attempt(job_id), _int(env.get("SLURM_JOB_RESTART_COUNT"))
    attempt = noted if attempt is None else attempt
    requeued = attempt is not None and restarts is not None and restarts > attempt
    # Whose job it was: Slurm's SLURM_JOB_UID, else the binding record's. The controller ends a run with this id
    # only if it is that user's (the id may have been given again to another user's job meanwhile).
    uid = _int(env.get("SLURM_JOB_UID"))
    uid = uid if uid is not None and uid >= 0 else node.state.binding_uid(job_id)
    payload = {"job_id": job_id, "node": node.name, "instances": [i.to_json() for i in insts],
               "exit_code": _int(env.get("SLURM_JOB_EXIT_CODE")), "derived_ec": _int(env.get("SLURM_JOB_DERIVED_EC")),
               "end_time": time.time(), "lingering": lingering, "binding_unreadable": unreadable,
               "requeued": requeued, "uid": uid}
    # The outcome goes to the outbox first (written and fsynced), then the outbox is delivered in order:
    # killed from here on, the next hook or health check still delivers it, and it never overtakes an
    # older message about the same job (a binding made while the controller was down).
    node.state.enqueue("/v1/epilog", payload)
    node.flush_outbox(HOOK_FLUSH_BUDGET_S)  # behind a long backlog, its outcome waits for the health check
    if requeued:
        _hold_back(node, job_id)
    if lingering:
        # Keep the binding so no layout change destroys an instance that still has processes;
        # the health check releases it once the processes are gone.
        log.error("job %s ended but its instance(s) still run processes: %s", job_id, lingering)
    else:
        node.state.remove_binding(job_id)
    return 0


EPILOG_WAIT_S = 5.0  # how long the Epilog waits, for all of a job's instances together, for processes to exit
EPILOG_POLL_S = 0.5


def _wait_for_processes(node: Node, job_id: str, insts: list) -> list:
    """The instances of ``insts`` that still run processes after EPILOG_WAIT_S, or whose GPU cannot be read.

    On a real GPU a job's processes may take a moment to exit after its cgroup is killed. Every instance is
    polled together against one deadline, with one listing per GPU per poll, so a job with many instances
    waits no longer than a job with one: the admin guide gives this bound against Slurm's
    PrologEpilogTimeout. A GPU that cannot be read (lost, driver gone) is not asked again: its instances
    count as busy, so their binding is kept until it can be read.
    """
    deadline = time.monotonic() + EPILOG_WAIT_S
    waiting, unreadable = list(insts), []
    while waiting:
        busy = []
        for gpu in sorted({i.gpu for i in waiting}):
            on_gpu = [i for i in waiting if i.gpu == gpu]
            try:
                in_use = {x.uuid for x in node.backend.instances(gpu) if x.in_use}
            except Exception as exc:  # noqa: BLE001 - the outcome still goes out
                for i in on_gpu:
                    log.error("job %s: cannot check %s@%d on GPU %d (%s); its binding is kept until the GPU "
                              "can be read", job_id, i.profile, i.start, i.gpu, exc)
                unreadable += on_gpu
                continue
            busy += [i for i in on_gpu if i.uuid in in_use]
        waiting = busy
        left = deadline - time.monotonic()
        if not waiting or left <= 0:
            break
        time.sleep(min(EPILOG_POLL_S, left))
    kept = {id(i) for i in waiting + unreadable}
    return [i for i in insts if id(i) in kept]  # in the binding's order, as the controller is told


def _hold_back(node: Node, job_id: str) -> None:
    """Keep a requeued job from starting again until this node has forgotten its credential.

    slurmd skips the Prolog of a job id whose credential it still caches, until cred_expire after this
    Epilog ends; Slurm holds the requeued job back for cred_expire counted from the requeue, a little
    earlier. Started on this node in between, the job would run without its Prolog, so without its MIG
    instance. Pushing its StartTime to cred_expire (+5 s) from now closes that window.
    """
    from slurm_mig.slurm.runner import SlurmClient

    client = SlurmClient(slurm_conf=node.settings.slurm_conf, timeout=10)
    res = client.run(["scontrol", "show", "config"])
    found = re.search(r"cred_expire=(\d+)", res.stdout) if res.ok else None
    wait = (int(found.group(1)) if found else 120) + 5  # Slurm's default cred_expire is 120 s
    res = client.run(["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{wait}"])
    if res.ok:
        log.info("job %s was requeued: held back %d s, until this node has forgotten its credential", job_id, wait)
    else:
        log.warning("could not hold back requeued job %s: %s", job_id, res.describe())


def healthcheck(env: dict, node: Node) -> int:
    """Report the node's state, receive desired layouts and apply them on idle slices.

    Its steps under the layout lock wait for it [node].layout_lock_wait_s in all (a holder may hang inside
    NVML); a step that cannot have it is left to the next round, and the report goes out all the same."""
    from slurm_mig.api.client import ControllerRefused, ControllerUnavailable

    node.state.ensure()
    node.start_lock_budget()
    # The MIG table check is made once per health check: its repair, its report and the report after a
    # re-carve all read this round's verdicts (`node sync --loop` runs many rounds on one Node).
    node._table_verdicts = {}
    node.flush_outbox()
    with _unless_lock_busy("making half-made instances whole"):
        with node.apply_lock():
            node.repair_half_made()  # before observing: the report then never offers one as usable
    observed_at = time.time()
    # With when each binding was written, so the controller can tell a file an earlier run of a job id left
    # (its processes outlived it) from a binding of the run that waits now.
    report = {"node": node.name, "observed": node.observe(), "observed_at": observed_at,
              "bindings": node.bindings_json(), "binding_times": node.state.binding_times(), "time": time.time()}
    try:
        resp = node.client.call("/v1/report", report)
    except (ControllerUnavailable, ControllerRefused) as exc:
        log.warning("health check: controller unreachable: %s", exc)
        resp = _cached_desired(node)
    else:
        with _unless_lock_busy("keeping the desired layouts"):
            _cache_desired(node, resp, report["observed"], observed_at)
    with _unless_lock_busy("releasing the bindings of jobs that ended"):
        _release_ended_bindings(node, [str(j) for j in resp.get("release") or []])
    targets = resp.get("desired") or {}
    # A GPU this report shows blocked (a MIG mode change waiting for a reset, an instance of a profile we do not
    # know, a driver whose MIG profiles differ from our table) is left as it is, whoever asks: the layouts
    # cached while the controller is down were made before the block (a node rebooted onto a new driver
    # re-created them there), and a controller older than the block does not know to leave it out.
    blocked = _blocked_gpus(report["observed"])
    left = sorted({str(k) for k in targets} & set(blocked), key=lambda g: (len(g), g))
    if left:
        log.warning("health check: GPU(s) %s not moved to their layouts: %s", ", ".join(left),
                    "; ".join(f"GPU {g}: {blocked[g]}" for g in left))
        targets = {k: v for k, v in targets.items() if str(k) not in blocked}
    if targets:
        results = []
        with _unless_lock_busy(f"moving GPU(s) {', '.join(sorted(str(k) for k in targets))} to their layouts"):
            results = node.apply_targets(targets)
        changed = [r for r in results if r.get("plan") or r.get("error")]
        if changed:
            observed_at = time.time()
            node.send_or_queue("/v1/applied", {"node": node.name, "results": changed, "observed": node.observe(),
                                               "observed_at": observed_at, "time": time.time()})
    return 0


@contextlib.contextmanager
def _unless_lock_busy(what: str):
    """Run a health check's step under the layout lock, or leave it to the next round when the lock stays
    held past the health check's wait (the report itself needs no lock)."""
    from slurm_mig.node.localstate import LayoutLockBusy

    try:
        yield
    except LayoutLockBusy as exc:
        log.warning("health check: %s left to the next round: %s", what, exc)


ORPHAN_AGE_S = 60.0


def _jobs_slurm_runs_here(node: Node) -> set[str] | None:
    """Ids of the jobs Slurm runs on this node (starting, running, ending or suspended); None when Slurm
    cannot be asked."""
    from slurm_mig.slurm.runner import SlurmClient

    res = SlurmClient(slurm_conf=node.settings.slurm_conf, timeout=10).run(
        ["squeue", "-h", "-w", node.name, "-t", "CF,R,CG,S,ST", "-o", "%A"])
    if not res.ok:
        log.warning("cannot ask Slurm which jobs run on %s: %s", node.name, res.describe())
        return None
    return set(res.stdout.split())


def _release_ended_bindings(node: Node, asked: list[str]) -> None:
    """Drop the bindings of jobs that ended without their Epilog: those the controller names, and files
    older than ORPHAN_AGE_S (a node crash or reboot, a Prolog killed after writing one, a controller that
    lost its database and cannot name them).

    Slurm has the last word, not the controller (whose view may be stale, or forged): a binding goes only
    if squeue answered and does not list its job here, and only once its instances are idle. Done under
    the apply lock, so no Prolog binds meanwhile; a binding written after squeue was asked is kept.
    """
    from slurm_mig.node.localstate import is_earlier_run

    times = node.state.binding_times()
    earlier = sorted(key for key in times if is_earlier_run(key))
    if earlier:
        # An earlier run's record set aside when its job id ran again here: that run has ended (Slurm started
        # the next one), so only its instances being idle keep it.
        with node.apply_lock():
            for key in earlier:
                _release_stale_binding(node, key, earlier_run=True)
    asked = {job for job in asked if job in times}
    old = {job for job, mtime in times.items()
           if time.time() - mtime > ORPHAN_AGE_S and job.replace("_", "").isascii() and job.replace("_", "").isdigit()}
    if not asked and not old:
        return
    asked_at = time.time()
    running = _jobs_slurm_runs_here(node)
    if running is None:
        log.warning("binding(s) of job(s) %s kept until Slurm can say whether they run here",
                    ", ".join(sorted(asked | old)))
        return
    with node.apply_lock():
        for job_id in sorted(asked | old):
            if job_id in running:
                if job_id in asked:
                    log.warning("the controller asked to release job %s, but Slurm runs it on %s; binding kept",
                                job_id, node.name)
                continue
            if node.state.binding_times().get(job_id, asked_at) >= asked_at:
                continue  # gone, or bound again after Slurm was asked: its answer says nothing about this one
            log.warning("job %s holds a binding on %s but Slurm does not run it here", job_id, node.name)
            _release_stale_binding(node, job_id)


def _release_stale_binding(node: Node, job_id: str, *, earlier_run: bool = False) -> None:
    """Drop the binding of a job Slurm no longer runs here, unless its instances are still in use
    (processes that outlived the job: the binding keeps them from being destroyed until they are gone).
    ``earlier_run``: ``job_id`` names an earlier run's record set aside (its own marks went with its Epilog).
    Call with apply_lock() held."""
    try:
        insts = node.state.read_record(job_id) or []
    except ValueError:
        insts = []  # damaged: it names nothing we could check or protect
    if not earlier_run:
        node.end_job_processes(job_id, insts)
    try:
        busy = [i for i in insts for x in node.backend.instances(i.gpu) if x.uuid == i.uuid and x.in_use]
    except Exception as exc:  # the GPU cannot be read (lost): keep the binding until it can
        log.warning("job %s ended but its GPU cannot be read (%s); binding kept", job_id, exc)
        return
    if busy:
        log.warning("job %s ended but %s still in use; binding kept until it is idle",
                    job_id, ", ".join(f"{i.profile}@{i.start} on GPU {i.gpu}" for i in busy))
        return
    node.state.remove_record(job_id)
    if earlier_run:
        log.info("released %s, the binding an earlier run left: its instances are idle", job_id)
    else:
        log.info("released the stale binding of job %s (it ended without its Epilog)", job_id)


def _cache_desired(node: Node, resp: dict, observed: list[dict], observed_at: float | None = None) -> None:
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
    blocked = _blocked_gpus(observed)  # their reported layouts are not ours to keep
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


def _remember_targets(node: Node, targets: dict) -> None:
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
    cached = _cached_desired(node)
    desired, targets_at = cached.get("desired"), cached.get("targets_at")
    return (desired if isinstance(desired, dict) else {}), (targets_at if isinstance(targets_at, dict) else {})


def _write_cached_layouts(node: Node, desired: dict, targets_at: dict, now: float) -> None:
    import json

    from slurm_mig.node.localstate import _atomic_write

    _atomic_write(node.state.root / "desired.json",
                  json.dumps({"desired": desired, "time": now, "targets_at": targets_at}).encode(), 0o600)


def _cached_desired(node: Node) -> dict:
    """The last desired layouts, so a rebooted node re-creates its layout even with the controller down."""
    import json

    try:
        cached = json.loads((node.state.root / "desired.json").read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _show_no_gpu(env: dict, why: str) -> int:
    """The TaskProlog's answer for a task that must see no GPU rather than a wrong one: says why to the task."""
    print(f"print slurm-mig: {why}")
    print("export CUDA_VISIBLE_DEVICES=")
    if "SLURM_MIG_INSTANCES" in env:
        print("unset SLURM_MIG_INSTANCES")
    return 0


# Step ids from here up are Slurm's batch, extern and interactive steps: they hold the whole job.
_SPECIAL_STEPS = 0xFFFFFFF0


def _step_instances(env: dict, insts: list, slurm_conf: str | None) -> list:
    """The instances a one-task step that asked for fewer than its job holds is shown.

    Slurm tells the task nothing of its step's GRES (22.05: no variable), so two concurrent
    ``srun --gres=mig:1g`` steps of a ``mig:1g:2`` job both saw both instances and CUDA put both on the
    first. Slurm's own record of the step says how many it asked for; the step gets that many, taken
    round-robin by step id, so steps started together get different instances, and the instances the job's
    other running steps were shown are taken last (``_instances_of_other_steps``). Steps with several tasks
    keep every instance (their tasks split them by SLURM_LOCALID), and so does any step Slurm cannot be
    asked about.
    """
    from slurm_mig.slurm.parsers import parse_step_mig_request
    from slurm_mig.slurm.runner import run_slurm

    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")
    if not (job.isascii() and job.isdigit() and step.isascii() and step.isdigit()) or int(step) >= _SPECIAL_STEPS:
        return insts
    if _int(env.get("SLURM_STEP_NUM_TASKS")) != 1:
        return insts
    res = run_slurm(["scontrol", "-d", "show", "step", f"{job}.{step}"], timeout=5, slurm_conf=slurm_conf)
    asked = parse_step_mig_request(res.stdout) if res.ok else None
    want = sum(asked.values()) if asked else 0
    if not 0 < want < len(insts):
        return insts
    first = int(step) * want % len(insts)
    order = [insts[(first + i) % len(insts)] for i in range(len(insts))]
    # Round-robin alone gave a step the instance of one still running whenever the steps had not started
    # together: a long step 0 (the first instance) and a short step 1 (the second), then step 2, whose turn is
    # the first again, ran beside step 0 on one instance while the other idled. The job's other steps that run
    # here now are asked first: the least used instances are taken, round-robin among equals.
    used = _instances_of_other_steps(job, step)
    return sorted(order, key=lambda i: len(used.get(i.uuid, ())))[:want]


#: Where the TaskProlog reads the job's other tasks from (a test points it elsewhere).
PROC_ROOT = "/proc"


def _instances_of_other_steps(job: str, step: str) -> dict[str, set[str]]:
    """MIG UUID -> the other steps of ``job`` running on this node that were shown it, read from their tasks'
    environments (CUDA_VISIBLE_DEVICES, which this TaskProlog exported to them). Only this user's processes are
    read (the TaskProlog runs as the job's user; Slurm's special steps, the batch shell and srun itself, which
    see every instance, are left out). A process that cannot be read is skipped: this only orders instances."""
    want_job = f"SLURM_JOB_ID={job}".encode()
    uid = os.getuid()
    used: dict[str, set[str]] = {}
    try:
        pids = [p for p in os.listdir(PROC_ROOT) if p.isdigit()]
    except OSError:
        return used
    for pid in pids:
        try:
            if os.stat(os.path.join(PROC_ROOT, pid)).st_uid != uid:
                continue
            with open(os.path.join(PROC_ROOT, pid, "environ"), "rb") as f:
                data = f.read(1 << 20)
        except OSError:
            continue
        if want_job not in data:
            continue
        env = dict(v.split(b"=", 1) for v in data.split(b"\0") if b"=" in v)
        other = env.get(b"SLURM_STEP_ID", b"").decode("ascii", "replace")
        if env.get(b"SLURM_JOB_ID") != job.encode() or not other.isdigit() or other == step \
                or int(other) >= _SPECIAL_STEPS:
            continue
        for uuid in env.get(b"CUDA_VISIBLE_DEVICES", b"").decode("ascii", "replace").split(","):
            if uuid.startswith("MIG-"):
                used.setdefault(uuid, set()).add(other)
    return used


def _het_components(env: dict) -> list[str]:
    """The job ids of a heterogeneous job's components (SLURM_JOB_ID_HET_GROUP_<k>), [] for any other job."""
    size = _int(env.get("SLURM_HET_SIZE"))
    if not size or size < 2:
        return []
    ids = [env.get(f"SLURM_JOB_ID_HET_GROUP_{k}", "") for k in range(min(size, 128))]
    return [j for j in ids if j.isascii() and j.isdigit()]


def _has_task_binding(state, job_id: str) -> bool:
    try:
        return state.read_task_binding(job_id) is not None
    except (OSError, ValueError):
        return True  # there, if unreadable: the caller must not guess past it


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _setup_logging(settings: NodeSettings | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if settings and settings.log_file:
        try:
            handlers.append(logging.FileHandler(settings.log_file))
        except OSError:
            pass
    level = getattr(logging, (settings.log_level if settings else "INFO").upper(), logging.INFO)
    logging.basicConfig(level=level, handlers=handlers, format="%(asctime)s slurm-mig-%(name)s[%(process)d] %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    """Run one hook. Always exits 0 for a job-level problem: only a broken node may be drained."""
    argv = sys.argv[1:] if argv is None else argv
    kind = argv[0] if argv else ""
    from slurm_mig.node.localstate import local_node_name

    env = dict(os.environ)
    node_name = local_node_name(env)
    settings = None
    try:
        settings = NodeSettings.load()
        _setup_logging(settings)
        if kind == "taskprolog":
            return taskprolog(env, node_name, settings.state_root, settings.slurm_conf)
        node = Node(node_name, settings)
        if kind == "prolog":
            return prolog(env, node)
        if kind == "epilog":
            return epilog(env, node)
        if kind == "healthcheck":
            return healthcheck(env, node)
        print(f"usage: {sys.argv[0]} prolog|taskprolog|epilog|healthcheck", file=sys.stderr)
        return 2
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
                         settings.slurm_conf if settings is not None else None)
            except Exception:
                log.exception("requeue after a hook error failed")
        return 0


if __name__ == "__main__":
    sys.exit(main())
