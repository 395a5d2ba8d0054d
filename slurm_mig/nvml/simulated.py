"""A simulated MIG GPU node: the MigBackend semantics without hardware.

Same geometry (``Layout.can_add``), same typed errors (InsufficientResources for
an illegal or occupied placement, InUse when destroying a busy instance,
NoPermission when configuration is not allowed, GpuLost, NotSupported with MIG
off), NVIDIA-format UUIDs, and the measured reconfiguration times of
``slurm_mig.mig.timing`` multiplied by ``delay_scale`` (0 for fast tests).

State lives in one JSON file so that separate processes (the Prolog, Epilog
and controller on one node) see and change the same GPUs.

Locking design
--------------
* ``<state>.lock`` — an ``flock`` guarding the JSON file. Readers take it
  shared, writers exclusive, and every operation re-reads the file under it.
  It is only ever held for a read-modify-write (milliseconds), never across a
  reconfiguration delay, so ``gpus()``/``instances()`` never wait for a
  create/destroy in progress.
* ``<state>.gpu<N>.lock`` — an exclusive ``flock`` held for a whole create or
  destroy on GPU N, delay included: NVML serialises reconfigurations of one GPU,
  and so do we; different GPUs reconfigure in parallel.
* Lock order is always GPU lock, then state lock.
* With delays, a create and a destroy are NVML's two calls each, each taking
  half the measured time. A create checks the placement, sleeps, commits the
  GPU instance after checking again (only set_in_use/reset/lose_gpu can have
  run meanwhile), sleeps, then adds its compute instance (MIG UUID). A destroy
  checks InUse and drops the compute instance at once (no job can be bound to
  an instance being torn down: it has no UUID), sleeps, drops the GPU
  instance, sleeps. A process killed mid-way leaves a half-made instance, as on
  a real GPU. Without delays each is one atomic change.
* Writes go to a temporary file in the same folder, are fsynced and renamed
  over the state (and the folder fsynced), so a crash leaves the old or the new
  state, never half of one. Files are created mode 0600.

Sim-only methods (not in MigBackend): set_in_use, owners, set_mig_mode,
fail_next, lose_gpu, reset, half_make, make_foreign, destroy_foreign. Like
RealBackend it also lists ``foreign_instances`` (GPU instances of profiles our
tables do not list), which every create respects.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import time
import uuid as uuidlib
from pathlib import Path
from typing import Any, Iterable, Iterator

from slurm_mig.argtypes import ascii_digits
from slurm_mig.errors import ConfigError
from slurm_mig.folders import make_missing_folders, write_durably
from slurm_mig.mig import timing
from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.mig.profiles import GpuModel, get_model
from slurm_mig.nvml import base
from slurm_mig.nvml.base import (
    ForeignInstance,
    GpuInfo,
    GpuLost,
    InsufficientResources,
    InUse,
    InvalidArgument,
    MigInstance,
    NoPermission,
    NotFound,
    NotSupported,
    NvmlError,
    NvmlUnavailable,
)
from slurm_mig.nvml.tables import ProfileReading

STATE_VERSION = 1

# What nvmlDeviceGetName says for each model (model_from_nvml_name maps them back).
SIM_DEVICE_NAMES = {
    "A30-24GB": "NVIDIA A30",
    "A100-40GB": "NVIDIA A100-SXM4-40GB",
    "A100-80GB": "NVIDIA A100-SXM4-80GB",
    "H100-80GB": "NVIDIA H100 80GB HBM3",
    "H100-94GB": "NVIDIA H100 NVL",
    "H100-96GB": "NVIDIA GH200 480GB",
    "H200-141GB": "NVIDIA H200",
    "GH200-144GB": "NVIDIA GH200 144G HBM3e",
    "B200-180GB": "NVIDIA B200",
    "GB200-186GB": "NVIDIA GB200",
}
# Models whose MIG mode survives a driver reload (FACTS §2: A100/A30 persist, Hopper+ lose it).
_MODE_PERSISTS = ("A100", "A30")

FAULT_OPS = ("gpus", "instances", "create", "destroy", "set_in_use", "set_mig_mode")

GpuSpec = Iterable["tuple[str, int] | str"]


def parse_gpu_spec(spec: str) -> list[tuple[str, int]]:
    """``"H100-80GB:2,A100-40GB"`` -> ``[("H100-80GB", 2), ("A100-40GB", 1)]`` (names checked).

    1 to config.MAX_SIM_GPUS GPUs in all, as [node].sim_gpu_count: ":0" made a node of no GPUs, and a huge
    count ran sim-init out of memory."""
    from slurm_mig.config import MAX_SIM_GPUS

    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, count = item.partition(":")
        count = count.strip()
        if count and (not ascii_digits(count) or int(count) < 1):
            raise ConfigError(f"bad GPU spec {item!r}: expected MODEL[:COUNT] with COUNT 1 to {MAX_SIM_GPUS}, "
                              "e.g. H100-80GB:2")
        out.append((get_model(name).name, int(count) if count else 1))
        if sum(n for _, n in out) > MAX_SIM_GPUS:
            raise ConfigError(f"bad GPU spec {spec!r}: more than {MAX_SIM_GPUS} GPUs on one node")
    if not out:
        raise ConfigError("empty GPU spec: expected MODEL[:COUNT][,...], e.g. H100-80GB:2")
    return out


def _models_of(gpus: GpuSpec) -> list[str]:
    names: list[str] = []
    for g in gpus:
        if isinstance(g, str):
            for name, n in parse_gpu_spec(g):
                names += [name] * n
        else:
            name, n = g
            names += [get_model(name).name] * int(n)
    return names


def _uuid(seed: str, n: int) -> str:
    """The n-th UUID of a state: uuid4-shaped, deterministic from the seed, unique per n."""
    digest = hashlib.sha256(f"{seed}:{n}".encode()).digest()[:16]
    return str(uuidlib.UUID(bytes=digest, version=4))


_ERROR_CLASSES = {
    cls.__name__: cls for cls in vars(base).values()
    if isinstance(cls, type) and issubclass(cls, NvmlError)
}


@contextlib.contextmanager
def _flock(path: Path, exclusive: bool) -> Iterator[None]:
    # A fresh open file description per acquisition: flock then excludes other
    # threads of this process as well as other processes.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _atomic_write(path: Path, state: dict) -> None:
    """Write ``state`` as JSON to ``path``: temp file, fsync, rename, fsync the folder; mode 0600."""
    write_durably(path, json.dumps(state, indent=1, sort_keys=True).encode(), 0o600)


def _lock_path(state_path: Path) -> Path:
    return state_path.with_name(state_path.name + ".lock")


class SimulatedBackend:
    """Simulated MIG GPUs whose state is the JSON file at ``state_path``.

    ``gpus``: the GPUs to create the state with when the file does not exist,
    e.g. ``[("H100-80GB", 2)]`` or ``["H100-80GB:2"]``; if it exists it must
    hold the same models. Without ``gpus`` the file must exist (see
    :func:`init_state`). ``delay_scale`` multiplies the measured
    create/destroy seconds. ``allow_config=False`` makes create/destroy/
    set_mig_mode raise NoPermission, and so does ``require_root=True`` for a
    caller whose effective uid is not 0 (real MIG needs root or the mig/config
    capability).
    """

    def __init__(self, state_path: str | os.PathLike, *, gpus: GpuSpec | None = None,
                 delay_scale: float = 0.0, allow_config: bool = True, require_root: bool = False,
                 seed: str | None = None):
        self.state_path = Path(state_path)
        from slurm_mig.config import MAX_SIM_DELAY_SCALE

        self.delay_scale = float(delay_scale)
        if not 0 <= self.delay_scale <= MAX_SIM_DELAY_SCALE:  # (nan and inf too)
            raise ValueError(f"delay_scale must be from 0 to {MAX_SIM_DELAY_SCALE:g}, not {delay_scale!r}")
        self.allow_config = allow_config
        self.require_root = require_root
        self._lock_path = _lock_path(self.state_path)
        if gpus is not None:
            wanted = _models_of(gpus)
            make_missing_folders(self.state_path.parent, lambda d: 0o755)  # 0755 whatever the umask
            with _flock(self._lock_path, exclusive=True):
                if self.state_path.exists():
                    have = [g["model"] for g in self._read()["gpus"]]
                    if have != wanted:
                        raise ConfigError(
                            f"simulated GPU state {self.state_path} holds {have}, not {wanted}; "
                            "re-create it with `slurm-mig nvml sim-init --force`")
                else:
                    self._write(_new_state(wanted, seed))
        elif not self.state_path.exists():
            raise NvmlUnavailable(
                f"no simulated GPUs at {self.state_path}: create them with `slurm-mig nvml sim-init`")

    def __repr__(self) -> str:
        return f"SimulatedBackend({str(self.state_path)!r}, delay_scale={self.delay_scale})"

    # -- file --------------------------------------------------------------
    def _read(self) -> dict:
        try:
            with open(self.state_path, encoding="utf-8") as fh:
                state = json.load(fh)
        except FileNotFoundError as exc:
            raise NvmlUnavailable(f"simulated GPU state {self.state_path} is gone") from exc
        except (OSError, ValueError) as exc:
            raise NvmlUnavailable(f"simulated GPU state {self.state_path} is unreadable: {exc}") from exc
        if not isinstance(state, dict):  # a list or a number: AttributeError, KeyError tracebacks below
            raise NvmlUnavailable(f"simulated GPU state {self.state_path} is unreadable: not a JSON object")
        if state.get("version") != STATE_VERSION:
            raise NvmlUnavailable(
                f"simulated GPU state {self.state_path} has version {state.get('version')!r}, "
                f"expected {STATE_VERSION}")
        bad = [k for k, t in (("gpus", list), ("faults", list), ("next_uuid", int), ("seed", str))
               if not isinstance(state.get(k), t)]
        bad += [f"gpus[{i}]" for i, g in enumerate(state.get("gpus") if "gpus" not in bad else [])
                if not (isinstance(g, dict) and isinstance(g.get("model"), str) and isinstance(g.get("instances"), list))]
        if bad:
            raise NvmlUnavailable(f"simulated GPU state {self.state_path} is damaged: {', '.join(bad[:5])} missing or "
                                  f"of the wrong type; make it again with `slurm-mig nvml sim-init --force`")
        return state

    def _write(self, state: dict) -> None:
        _atomic_write(self.state_path, state)

    @contextlib.contextmanager
    def _txn(self) -> Iterator[dict]:
        """Exclusive read-modify-write: yields the state; writes it back if the block succeeds."""
        with _flock(self._lock_path, exclusive=True):
            state = self._read()
            before = json.dumps(state, sort_keys=True)
            try:
                yield state
            except NvmlError:
                # A consumed fault must stay consumed even though the op failed.
                if json.dumps(state, sort_keys=True) != before:
                    self._write(state)
                raise
            if json.dumps(state, sort_keys=True) != before:
                self._write(state)

    def _snapshot(self) -> dict:
        with _flock(self._lock_path, exclusive=False):
            return self._read()

    def _gpu_lock(self, gpu: int):
        return _flock(self.state_path.with_name(f"{self.state_path.name}.gpu{gpu}.lock"), exclusive=True)

    # -- helpers -----------------------------------------------------------
    @staticmethod
    def _gpu(state: dict, gpu: int) -> dict:
        if not isinstance(gpu, int) or not 0 <= gpu < len(state["gpus"]):
            raise InvalidArgument(f"no GPU {gpu!r} (this node has {len(state['gpus'])})")
        return state["gpus"][gpu]

    @staticmethod
    def _take_fault(state: dict, op: str, gpu: int | None) -> NvmlError | None:
        for i, fault in enumerate(state["faults"]):
            if fault["op"] == op and fault["gpu"] in (None, gpu):
                fault["times"] -= 1
                if fault["times"] <= 0:
                    del state["faults"][i]
                cls = _ERROR_CLASSES.get(fault["error"], NvmlError)
                return cls(fault["message"] or f"injected {fault['error']} on {op} (GPU {gpu})")
        return None

    def _fault_pending(self, state: dict, op: str, gpu: int | None) -> bool:
        return any(f["op"] == op and f["gpu"] in (None, gpu) for f in state["faults"])

    def _raise_fault(self, op: str, gpu: int | None) -> None:
        with self._txn() as state:
            err = self._take_fault(state, op, gpu)
            if err is not None:
                raise err

    def _check_config_allowed(self, what: str) -> None:
        if not self.allow_config:
            raise NoPermission(f"{what}: MIG configuration is not allowed for this caller (NVML_ERROR_NO_PERMISSION)")
        if self.require_root and os.geteuid() != 0:
            raise NoPermission(f"{what}: needs root or the mig/config capability (NVML_ERROR_NO_PERMISSION)")

    @staticmethod
    def _model(g: dict) -> GpuModel:
        return get_model(g["model"])

    @staticmethod
    def _check_usable(g: dict, gpu: int) -> None:
        if g["lost"]:
            raise GpuLost(f"GPU {gpu} has fallen off the bus (NVML_ERROR_GPU_IS_LOST)")

    def _usable_gpu(self, state: dict, gpu: int, op: str | None) -> dict:
        """GPU ``gpu``'s record for a call ``op``: InvalidArgument for no such GPU, then a fault injected for
        ``op`` (None: no fault is taken), then GpuLost for a lost GPU."""
        g = self._gpu(state, gpu)
        err = self._take_fault(state, op, gpu) if op is not None else None
        if err is not None:
            raise err
        self._check_usable(g, gpu)
        return g

    def _layout(self, g: dict) -> Layout:
        return Layout(self._model(g), frozenset(Slot(i["start"], i["profile"]) for i in g["instances"]))

    @staticmethod
    def _to_instance(gpu: int, inst: dict) -> MigInstance:
        return MigInstance(gpu, Slot(inst["start"], inst["profile"]), inst["uuid"], inst["gi_id"],
                           inst["ci_id"], inst["owner"] is not None)

    def _find(self, g: dict, gpu: int, which: Slot | str) -> dict:
        model = self._model(g)
        if isinstance(which, str) and which.startswith("MIG-"):
            for inst in g["instances"]:
                if inst["uuid"] == which:
                    return inst
            raise NotFound(f"GPU {gpu} has no MIG instance {which}")
        if isinstance(which, str):  # "3g@0"
            name, _, start = which.partition("@")
            if not ascii_digits(start.strip()):
                raise InvalidArgument(f"bad instance {which!r}: expected PROFILE@START or a MIG- UUID")
            which = Slot(int(start), name)
        slot = Slot(which.start, model.profile(which.profile).name)
        for inst in g["instances"]:
            if inst["start"] == slot.start and inst["profile"] == slot.profile:
                return inst
        raise NotFound(f"GPU {gpu} has no MIG instance {slot}")

    # -- MigBackend --------------------------------------------------------
    def gpus(self) -> list[GpuInfo]:
        state = self._snapshot()
        if self._fault_pending(state, "gpus", None):
            self._raise_fault("gpus", None)
        return [
            GpuInfo(i, g["uuid"], g["name"], self._model(g), bool(g["mig_enabled"]) and not g["lost"], lost=g["lost"],
                    mig_pending=None if g["lost"] else g.get("mig_pending"))
            for i, g in enumerate(state["gpus"])
        ]

    def instances(self, gpu: int) -> list[MigInstance]:
        state = self._snapshot()
        g = self._gpu(state, gpu)
        if self._fault_pending(state, "instances", gpu):
            self._raise_fault("instances", gpu)
        self._check_usable(g, gpu)
        if not g["mig_enabled"]:
            return []
        return sorted((self._to_instance(gpu, i) for i in g["instances"]), key=lambda m: m.slot)

    def foreign_instances(self, gpu: int) -> list[ForeignInstance]:
        """GPU instances of profiles our tables do not list (made with make_foreign), sorted by start."""
        state = self._snapshot()
        g = self._gpu(state, gpu)
        self._check_usable(g, gpu)
        if not g["mig_enabled"]:
            return []
        return sorted((self._foreign(gpu, f) for f in g.get("foreign", ())), key=lambda f: f.start)

    def profile_readings(self, gpu: int) -> list[ProfileReading]:
        """The GPU-instance profiles this simulated GPU offers, as NVML lists them: its model's table (which
        its create enforces), with nominal memory; with MIG mode off too, as an H200 on driver 580 does."""
        state = self._snapshot()
        g = self._gpu(state, gpu)
        self._check_usable(g, gpu)
        drivers = g.get("driver_profiles") or {}
        out = []
        for p in sorted(self._model(g).profiles, key=lambda p: p.nvml_index):
            fields = {"nvml_index": p.nvml_index, "id": p.id, "compute_slices": p.compute_slices,
                      "max_count": p.max_count, "memory_mib": p.memory_gb * 1024, "name": f"MIG {p.name}",
                      "placements": tuple((s, p.memory_slices) for s in p.starts)}
            if str(p.nvml_index) in drivers:
                if drivers[str(p.nvml_index)] is None:
                    continue  # this driver does not offer it
                fields.update(drivers[str(p.nvml_index)])
                if fields["placements"] is not None:
                    fields["placements"] = tuple(tuple(pair) for pair in fields["placements"])
            out.append(ProfileReading(**fields))
        return out

    def driver_version(self) -> str:
        """The simulated driver's version (nvmlSystemGetDriverVersion): "simulated", or what
        set_driver_profiles set."""
        return str(self._snapshot().get("driver") or "simulated")

    def set_driver_profiles(self, gpu: int, changes: dict[int, dict | None], *, driver: str) -> None:
        """Simulate a driver (version ``driver``, for the whole node) whose GPU-instance profiles on GPU ``gpu``
        differ from slurm-mig's table: NVML profile index -> the ProfileReading fields it reports otherwise
        (``id``, ``compute_slices``, ``max_count``, ``name``, ``placements`` as (start, size) pairs), or None
        for a profile it does not offer. profile_readings reports them, and create refuses a profile the
        driver does not offer or a placement it does not list, as such a driver would."""
        with self._txn() as state:
            g = self._gpu(state, gpu)
            g["driver_profiles"] = {str(int(k)): (None if v is None else dict(v)) for k, v in changes.items()}
            state["driver"] = str(driver)

    def _check_create(self, state: dict, gpu: int, slot: Slot, *, faults: bool = True) -> tuple[dict, Slot]:
        g = self._usable_gpu(state, gpu, "create" if faults else None)
        if not g["mig_enabled"]:
            raise NotSupported(f"GPU {gpu}: MIG mode is disabled (NVML_ERROR_NOT_SUPPORTED)")
        model = self._model(g)
        prof = model.profile(slot.profile)
        slot = Slot(slot.start, prof.name)
        driver = (g.get("driver_profiles") or {})
        if str(prof.nvml_index) in driver:  # a simulated driver that differs from our table (set_driver_profiles)
            changed = driver[str(prof.nvml_index)]
            if changed is None:
                raise NotSupported(f"GPU {gpu}: this driver offers no profile {prof.name} (NVML_ERROR_NOT_SUPPORTED)")
            allowed = changed.get("placements")
            if allowed is not None and [slot.start, prof.memory_slices] not in [list(a) for a in allowed]:
                raise InsufficientResources(f"GPU {gpu}: this driver has no placement {slot.start}:"
                                            f"{prof.memory_slices} for {prof.name} (NVML_ERROR_INSUFFICIENT_RESOURCES)")
        layout = self._layout(g)
        if not layout.can_add(prof, slot.start):
            why = layout.with_slot(slot).problems() or [f"{slot} already exists"]
            raise InsufficientResources(
                f"GPU {gpu}: cannot create {slot} beside {layout}: {'; '.join(why)} "
                "(NVML_ERROR_INSUFFICIENT_RESOURCES)")
        for f in (self._foreign(gpu, f) for f in g.get("foreign", ())):
            if f.mask & prof.mask(slot.start):
                raise InsufficientResources(f"GPU {gpu}: cannot create {slot}: GPU instance {f} holds its slices "
                                            "(NVML_ERROR_INSUFFICIENT_RESOURCES)")
        if layout.compute_used + self._foreign_compute(g) + prof.compute_slices > model.compute_slices:
            raise InsufficientResources(f"GPU {gpu}: cannot create {slot}: not enough compute slices left beside "
                                        f"{layout} and the other GPU instances (NVML_ERROR_INSUFFICIENT_RESOURCES)")
        return g, slot

    def create(self, gpu: int, slot: Slot) -> MigInstance:
        return self._create(gpu, slot, compute=True)

    def half_make(self, gpu: int, slot: Slot) -> MigInstance:
        """Create only the GPU instance at ``slot``, as a creator killed between NVML's GPU-instance and
        compute-instance calls leaves it: listed with uuid "" and ci_id -1, nothing can run on it."""
        return self._create(gpu, slot, compute=False)

    def _create(self, gpu: int, slot: Slot, *, compute: bool) -> MigInstance:
        self._check_config_allowed(f"create {slot} on GPU {gpu}")
        with self._gpu_lock(gpu):
            if self.delay_scale <= 0:
                with self._txn() as state:
                    g, slot = self._check_create(state, gpu, slot)
                    inst = self._add_gpu_instance(g, slot)
                    if compute:
                        self._add_compute_instance(state, inst)
                    return self._to_instance(gpu, inst)
            # NVML's two calls, each taking half the measured time: the GPU instance, then its compute
            # instance. A creator killed between them leaves a half-made instance, as on a real GPU.
            with self._txn() as state:
                g, slot = self._check_create(state, gpu, slot)
                generation = g["generation"]
                model = self._model(g)
            half = timing.step_seconds(model, slot.profile, "create") * self.delay_scale / 2
            time.sleep(half)
            with self._txn() as state:
                g, slot = self._check_create(state, gpu, slot, faults=False)
                if g["generation"] != generation:
                    raise NvmlError(f"GPU {gpu} was reset while {slot} was being created", code=999)
                inst = self._add_gpu_instance(g, slot)
                gi_id = inst["gi_id"]
                if not compute:
                    return self._to_instance(gpu, inst)
            time.sleep(half)
            with self._txn() as state:
                g = self._gpu(state, gpu)
                found = [i for i in g["instances"] if i["gi_id"] == gi_id and i["start"] == slot.start
                         and i["profile"] == slot.profile]
                if g["generation"] != generation or not found:
                    raise NvmlError(f"GPU {gpu} was reset while {slot} was being created", code=999)
                self._add_compute_instance(state, found[0])
                return self._to_instance(gpu, found[0])

    @staticmethod
    def _foreign(gpu: int, f: dict) -> ForeignInstance:
        return ForeignInstance(gpu, f["start"], f["size"], f["profile_id"], f["gi_id"], f["compute_slices"],
                               f["owner"] is not None)

    @staticmethod
    def _foreign_compute(g: dict) -> int:
        return sum(f["compute_slices"] or 0 for f in g.get("foreign", ()))

    @staticmethod
    def _add_gpu_instance(g: dict, slot: Slot) -> dict:
        """A GPU instance at ``slot`` without a compute instance (placement already checked)."""
        used = {i["gi_id"] for i in g["instances"]} | {f["gi_id"] for f in g.get("foreign", ())}
        gi_id = next(n for n in range(1, 64) if n not in used)
        inst = {"profile": slot.profile, "start": slot.start, "gi_id": gi_id, "ci_id": -1, "uuid": "", "owner": None}
        g["instances"].append(inst)
        g["instances"].sort(key=lambda i: (i["start"], i["profile"]))
        return inst

    @staticmethod
    def _add_compute_instance(state: dict, inst: dict) -> None:
        inst.update(ci_id=0, uuid="MIG-" + _uuid(state["seed"], state["next_uuid"]))
        state["next_uuid"] += 1

    def destroy(self, gpu: int, slot: Slot) -> None:
        self._check_config_allowed(f"destroy {slot} on GPU {gpu}")
        with self._gpu_lock(gpu):
            with self._txn() as state:
                g = self._usable_gpu(state, gpu, "destroy")
                if not g["mig_enabled"]:
                    raise NotSupported(f"GPU {gpu}: MIG mode is disabled (NVML_ERROR_NOT_SUPPORTED)")
                inst = self._find(g, gpu, slot)
                if inst["owner"] is not None:
                    raise InUse(f"GPU {gpu}: MIG instance {inst['profile']}@{inst['start']} ({inst['uuid']}) "
                                f"is in use by {inst['owner']} (NVML_ERROR_IN_USE)")
                model = self._model(g)
                if self.delay_scale <= 0:
                    g["instances"].remove(inst)
                    return
                # NVML's two calls: the compute instance goes first (no job can be bound to the instance
                # from here on: it has no UUID), then the GPU instance. A destroyer killed between them
                # leaves a half-made instance, as on a real GPU.
                inst.update(ci_id=-1, uuid="")
                gi_id, generation = inst["gi_id"], g["generation"]
            half = timing.step_seconds(model, inst["profile"], "destroy") * self.delay_scale / 2
            time.sleep(half)
            with self._txn() as state:
                g = self._gpu(state, gpu)
                if g["generation"] == generation:
                    g["instances"] = [i for i in g["instances"] if not (
                        i["gi_id"] == gi_id and i["start"] == inst["start"] and i["profile"] == inst["profile"])]
            time.sleep(half)

    def close(self) -> None:
        """Nothing to release: every call opens, locks and closes the state itself."""

    # -- sim-only ------------------------------------------------------------
    def set_in_use(self, gpu: int, slot_or_uuid: Slot | str, owner: str | None) -> MigInstance:
        """Mark an instance as running processes of ``owner`` (e.g. "job 42"), or idle with None.

        Stands in for the processes the simulator cannot see; a busy instance
        cannot be destroyed (InUse). ``slot_or_uuid``: a Slot, "3g@0" or a MIG UUID.
        """
        with self._txn() as state:
            g = self._usable_gpu(state, gpu, "set_in_use")
            inst = self._find(g, gpu, slot_or_uuid)
            if owner is not None and not inst["uuid"]:
                raise InvalidArgument(f"GPU {gpu}: {inst['profile']}@{inst['start']} has no compute instance; "
                                      "no process can run on it")
            inst["owner"] = None if owner is None else str(owner)
            return self._to_instance(gpu, inst)

    def owners(self, gpu: int) -> dict[Slot, str]:
        """The busy instances of GPU ``gpu`` and who uses them."""
        g = self._gpu(self._snapshot(), gpu)
        return {Slot(i["start"], i["profile"]): i["owner"] for i in g["instances"] if i["owner"] is not None}

    def set_mig_mode(self, gpu: int, enabled: bool, *, pending: bool = False) -> None:
        """Turn MIG mode on or off (off needs no instances left: InUse otherwise).

        ``pending=True`` is ``nvidia-smi -mig 0|1`` on a GPU that must be reset first: the change is
        recorded (``GpuInfo.mig_pending``) and takes effect at the next reset(); the current mode and
        the instances, busy ones included, stay until then. Asking for the current mode clears it.
        """
        self._check_config_allowed(f"set MIG mode on GPU {gpu}")
        with self._gpu_lock(gpu), self._txn() as state:
            g = self._usable_gpu(state, gpu, "set_mig_mode")
            if pending:
                g["mig_pending"] = None if bool(enabled) == bool(g["mig_enabled"]) else bool(enabled)
                return
            if not enabled and (g["instances"] or g.get("foreign")):
                n = len(g["instances"]) + len(g.get("foreign", ()))
                raise InUse(f"GPU {gpu}: cannot disable MIG mode while {n} instance(s) exist")
            g["mig_enabled"] = bool(enabled)
            g["mig_pending"] = None

    def make_foreign(self, gpu: int, start: int, size: int, *, profile_id: int, compute_slices: int | None = 1,
                     owner: str | None = None) -> ForeignInstance:
        """Create, as an admin by hand or a newer driver would, a GPU instance of a profile our tables do not
        list (``profile_id``) at placement ``start:size``; ``owner`` marks processes running on it.

        Same rules as a create: InsufficientResources if its slices or compute slices are taken.
        """
        self._check_config_allowed(f"create a GPU instance at {start}:{size} on GPU {gpu}")
        with self._gpu_lock(gpu), self._txn() as state:
            g = self._gpu(state, gpu)
            self._check_usable(g, gpu)
            if not g["mig_enabled"]:
                raise NotSupported(f"GPU {gpu}: MIG mode is disabled (NVML_ERROR_NOT_SUPPORTED)")
            model = self._model(g)
            if any(p.id == profile_id for p in model.profiles):
                raise InvalidArgument(f"profile id {profile_id} is in {model.name}'s table: use create()")
            if not (0 <= start and 1 <= size and start + size <= model.memory_slices):
                raise InsufficientResources(f"GPU {gpu}: no placement {start}:{size} on a {model.name} "
                                            "(NVML_ERROR_INSUFFICIENT_RESOURCES)")
            new = ForeignInstance(gpu, start, size, profile_id, 0, compute_slices)
            layout = self._layout(g)
            taken = layout.used_mask | sum(self._foreign(gpu, f).mask for f in g.get("foreign", ()))
            if taken & new.mask or (layout.compute_used + self._foreign_compute(g) + (compute_slices or 0)
                                    > model.compute_slices):
                raise InsufficientResources(f"GPU {gpu}: placement {start}:{size} is taken "
                                            "(NVML_ERROR_INSUFFICIENT_RESOURCES)")
            used = {i["gi_id"] for i in g["instances"]} | {f["gi_id"] for f in g.get("foreign", ())}
            entry = {"start": start, "size": size, "profile_id": int(profile_id),
                     "gi_id": next(n for n in range(1, 64) if n not in used),
                     "compute_slices": compute_slices, "owner": owner}
            g.setdefault("foreign", []).append(entry)
            return self._foreign(gpu, entry)

    def destroy_foreign(self, gpu: int, start: int) -> None:
        """Remove the foreign GPU instance placed at ``start``, as its maker would (InUse while busy)."""
        self._check_config_allowed(f"destroy the GPU instance at {start} on GPU {gpu}")
        with self._gpu_lock(gpu), self._txn() as state:
            g = self._gpu(state, gpu)
            self._check_usable(g, gpu)
            for f in g.get("foreign", ()):
                if f["start"] == start:
                    if f["owner"] is not None:
                        raise InUse(f"GPU {gpu}: GPU instance {self._foreign(gpu, f)} is in use (NVML_ERROR_IN_USE)")
                    g["foreign"].remove(f)
                    return
            raise NotFound(f"GPU {gpu} has no foreign GPU instance at {start}")

    def fail_next(self, op: str, error: type[NvmlError] | NvmlError | str, *, gpu: int | None = None,
                  times: int = 1) -> None:
        """Make the next ``times`` calls of ``op`` (on ``gpu``, or any GPU) raise ``error``.

        ``op``: one of FAULT_OPS; ``error``: an NvmlError subclass, instance or
        class name ("InUse"). Stored in the state file, so the fault hits
        whichever process makes the call next.
        """
        if op not in FAULT_OPS:
            raise ValueError(f"unknown op {op!r} (known: {', '.join(FAULT_OPS)})")
        message = ""
        if isinstance(error, NvmlError):
            message, error = str(error), type(error).__name__
        elif isinstance(error, type):
            error = error.__name__
        if error not in _ERROR_CLASSES:
            raise ValueError(f"unknown NVML error {error!r} (known: {', '.join(sorted(_ERROR_CLASSES))})")
        with self._txn() as state:
            state["faults"].append({"op": op, "gpu": gpu, "error": error, "message": message, "times": int(times)})

    def clear_faults(self) -> None:
        with self._txn() as state:
            state["faults"].clear()

    def lose_gpu(self, gpu: int, lost: bool = True) -> None:
        """GPU ``gpu`` falls off the bus: its calls raise GpuLost until reset() (or lost=False)."""
        with self._txn() as state:
            g = self._gpu(state, gpu)
            g["lost"] = bool(lost)
            g["generation"] += 1

    def reset(self, *, mig_mode: bool | None = None) -> None:
        """A driver reload or reboot: every instance vanishes and lost GPUs come back.

        A pending MIG mode change (set_mig_mode(..., pending=True)) takes effect. Otherwise MIG mode
        survives on A100/A30 and is lost on Hopper and later (FACTS §2); ``mig_mode`` overrides both.
        """
        with self._txn() as state:
            for g in state["gpus"]:
                g["instances"] = []
                g.pop("foreign", None)
                g["lost"] = False
                g["generation"] += 1
                pending = g.pop("mig_pending", None)
                if mig_mode is not None:
                    g["mig_enabled"] = bool(mig_mode)
                elif pending is not None:
                    g["mig_enabled"] = bool(pending)
                elif not g["model"].startswith(_MODE_PERSISTS):
                    g["mig_enabled"] = False


def _new_state(models: list[str], seed: str | None) -> dict:
    seed = seed if seed is not None else secrets.token_hex(8)
    gpus = []
    for i, name in enumerate(models):
        gpus.append({
            "model": name, "name": SIM_DEVICE_NAMES.get(name, f"NVIDIA {name}"),
            "uuid": "GPU-" + _uuid(seed, i), "mig_enabled": True, "lost": False,
            "generation": 0, "instances": [],
        })
    return {"version": STATE_VERSION, "seed": seed, "next_uuid": len(models), "gpus": gpus, "faults": []}


def init_state(state_path: str | os.PathLike, gpus: GpuSpec, *, layouts: dict[int, Any] | None = None,
               seed: str | None = None, overwrite: bool = False, **backend_opts: Any) -> SimulatedBackend:
    """Create a simulated node's state file (``overwrite`` replaces an existing one).

    ``layouts`` maps a GPU index to a layout (a Layout, or text like "3g@0,2g@4,1g@6")
    created on it right away. Returns a backend on the new state.
    """
    from slurm_mig.mig.layout import parse_layout

    path = Path(state_path)
    make_missing_folders(path.parent, lambda d: 0o755)  # 0755 whatever the umask (mkdir -p: 0777 under umask 0)
    models = _models_of(gpus)
    if path.exists() and not overwrite:
        raise ConfigError(f"simulated GPU state {path} exists already (use --force to replace it)")
    with _flock(_lock_path(path), exclusive=True):
        _atomic_write(path, _new_state(models, seed))
    backend = SimulatedBackend(path, **{"delay_scale": 0.0, **backend_opts})
    fast = SimulatedBackend(path)  # the initial layout is set up without delays
    for gpu, spec in (layouts or {}).items():
        layout = spec if isinstance(spec, Layout) else parse_layout(str(spec), get_model(models[gpu]))
        for slot in layout.sorted_slots():
            fast.create(gpu, slot)
    return backend
