"""Typed rows the Store returns and accepts, and JSON forms of the policy types."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from slurm_mig.errors import GeometryError
from slurm_mig.mig.layout import Layout, Slot, parse_layout
from slurm_mig.mig.profiles import GpuModel, get_model


@dataclass(frozen=True)
class BoundInstance:
    """One MIG instance a job is bound to."""

    gpu: int
    profile: str  # full profile name
    start: int
    uuid: str | None = None

    @property
    def slot(self) -> Slot:
        return Slot(self.start, self.profile)

    def to_json(self) -> dict:
        return {"gpu": self.gpu, "profile": self.profile, "start": self.start, "uuid": self.uuid}


@dataclass(frozen=True)
class Job:
    job_id: str
    user: str
    name: str
    partition: str
    profile: str
    count: int
    time_limit_s: float | None
    state: str
    reason: str
    submit_time: float
    start_time: float | None
    end_time: float | None
    node: str | None
    instances: tuple[BoundInstance, ...]
    priority_order: int | None
    exit_code: int | None
    updated_at: float
    blocked: str | None = None  # why Slurm will not start it now (held, dependency, ...); None: it may
    run: int = 1  # which run of the job id this row tracks now (ids are reused; Store.restart_job)
    uid: int | None = None  # the uid of its user (squeue's user_id); None: not known (older rows, a Prolog's)
    # Time the run spent suspended (schema migration 9): seconds before its last suspend or resume (None: never
    # seen suspended), and when the suspension going on began (None: not suspended now).
    suspended_s: float | None = None
    suspended_since: float | None = None

    def suspended_for(self, at: float) -> float:
        """Seconds the run had spent suspended by time ``at`` (a suspension going on counted up to ``at``)."""
        ongoing = max(0.0, at - self.suspended_since) if self.suspended_since is not None else 0.0
        return (self.suspended_s or 0.0) + ongoing

    def run_time(self, start: float, end: float) -> float:
        """Seconds the run ran from ``start`` to ``end``, the time it spent suspended left out (as Slurm's
        RunTime counts it)."""
        return max(0.0, end - start - self.suspended_for(end))


@dataclass(frozen=True)
class Node:
    name: str
    state: str
    last_seen: float | None
    health: str
    health_detail: dict
    agent_version: str | None


@dataclass(frozen=True)
class ObservedGpu:
    """A physical GPU as a node reported it."""

    gpu: int
    uuid: str | None
    # GpuModel.name; for a model this slurm-mig's tables do not list (a newer node's, during a rolling upgrade)
    # the name the node reported (known_model() gives None: nothing reads a geometry from it); None when the
    # node named none
    model: str | None
    mig_enabled: bool
    name: str | None = None  # nvmlDeviceGetName
    last_observed: float | None = None
    node: str | None = None  # filled in when read back from the store
    # Why slurm-mig must leave this GPU's layout as it is and start no new job on it (a MIG mode change
    # pending a GPU reset, GPU instances of a profile slurm-mig does not know); None: it may. Its instances,
    # and the jobs on them, run on.
    blocked: str | None = None


@dataclass(frozen=True)
class ObservedInstance:
    """A MIG instance as a node reported it."""

    gpu: int
    profile: str
    start: int
    uuid: str | None = None
    gi_id: int | None = None
    ci_id: int | None = None
    in_use: bool = False
    observed_at: float | None = None
    node: str | None = None  # filled in when read back from the store

    @property
    def slot(self) -> Slot:
        return Slot(self.start, self.profile)


@dataclass(frozen=True)
class DesiredLayout:
    node: str
    gpu: int
    spec: str  # parse_layout() text
    policy: str
    decided_at: float
    reason: str
    model: str | None = None  # the GPU's observed model, when known

    def layout(self, model: GpuModel | str | None = None) -> Layout:
        """The desired layout parsed for ``model`` (default: the GPU's observed model)."""
        m = model if model is not None else self.model
        if m is None:
            raise ValueError(f"GPU {self.node}/{self.gpu} has no known model; pass one")
        return parse_layout(self.spec, get_model(m) if isinstance(m, str) else m)


@dataclass(frozen=True)
class JournalStep:
    action: str  # "create" | "destroy"
    profile: str
    start: int

    @property
    def slot(self) -> Slot:
        return Slot(self.start, self.profile)

    def to_json(self) -> dict:
        return {"action": self.action, "profile": self.profile, "start": self.start}


@dataclass(frozen=True)
class JournalEntry:
    id: int
    node: str
    gpu: int
    from_layout: str
    to_layout: str
    steps: tuple[JournalStep, ...]
    progress: int  # how many steps are done
    step_log: tuple[dict, ...]
    state: str
    outcome: str | None
    error: str | None
    decision_id: int | None
    created_at: float
    started_at: float | None
    updated_at: float
    finished_at: float | None

    @property
    def remaining(self) -> tuple[JournalStep, ...]:
        return self.steps[self.progress:]


@dataclass(frozen=True)
class Event:
    id: int
    time: float
    kind: str
    message: str
    node: str | None
    job_id: str | None
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    job_id: str
    profile: str
    count: int
    node: str | None
    gpus: tuple[int, ...]
    instances: tuple[BoundInstance, ...]
    user: str
    partition: str
    time_limit_s: float | None
    submit_time: float | None
    start_time: float | None
    end_time: float | None
    wait_s: float | None
    run_s: float | None
    exit_code: int | None
    derived_exit_code: int | None
    state: str
    recorded_at: float
    run: int = 1  # which run of the job id (ids are reused): 1, 2, ... in the order they ran
    # The controller's guess (a run settled without Slurm's record or its Epilog: FAILED, no exit status), which
    # the run's Epilog replaces if it comes; never one from Slurm's record or an Epilog. (The column says 2 for a
    # guess of a run suspended at the end guessed: store/outcomes.py GUESSED_SUSPENDED.)
    guessed: bool = False


@dataclass(frozen=True)
class DecisionRecord:
    id: int
    time: float
    policy: str
    version: str
    shadow: bool
    inputs: Any
    action: dict
    reasons: list
    latency_ms: float | None


# -- input normalisation --------------------------------------------------------

def _get(obj: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        if isinstance(obj, Mapping):
            if n in obj:
                return obj[n]
        elif hasattr(obj, n):
            return getattr(obj, n)
    return default


def as_bound_instance(item: Any) -> BoundInstance:
    """Accept ``(gpu, Slot)``, ``(gpu, Slot, uuid)``, a BoundInstance, an nvml MigInstance or a dict."""
    if isinstance(item, BoundInstance):
        return item
    if isinstance(item, tuple) and len(item) in (2, 3) and isinstance(item[1], Slot):
        gpu, slot = item[0], item[1]
        return BoundInstance(int(gpu), slot.profile, int(slot.start), item[2] if len(item) == 3 else None)
    slot = _get(item, "slot")
    gpu = _get(item, "gpu", "gpu_index", "index")
    if isinstance(slot, Slot):
        profile, start = slot.profile, slot.start
    else:
        profile, start = _get(item, "profile"), _get(item, "start")
    if gpu is None or profile is None or start is None:
        raise ValueError(f"cannot read a MIG instance (gpu, profile, start) from {item!r}")
    return BoundInstance(int(gpu), str(profile), int(start), _get(item, "uuid"))


def known_model(name: str | GpuModel | None) -> GpuModel | None:
    """The GpuModel of a stored GPU's model, or None: none named, or one this slurm-mig's tables do not list
    (ObservedGpu.model)."""
    if name is None or isinstance(name, GpuModel):
        return name
    try:
        return get_model(name) if name else None
    except GeometryError:
        return None


def off_table(model: GpuModel, instances: Iterable[Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where the instances a node reports on a GPU of ``model`` (dicts, ObservedInstances, store rows or Slots:
    profile and start) do not form a layout this slurm-mig's table for ``model`` allows: (the profiles
    concerned, the broken rules: Layout.problems()); ((), ()) where they do. A node newer than the controller
    may name a profile our table lacks (a new driver's "+gfx" variant, a 1g.20gb-like profile), place one at a
    start it does not allow, or count more of one than it says may exist."""
    slots = frozenset(Slot(int(_get(i, "start")), str(_get(i, "profile"))) for i in instances)
    if not slots:
        return (), ()
    problems = Layout(model, slots).problems()
    if not problems:
        return (), ()
    unknown = tuple(sorted({s.profile for s in slots if not _has_profile(model, s.profile)}))
    return unknown or tuple(sorted({s.profile for s in slots})), tuple(problems)


def _has_profile(model: GpuModel, name: str) -> bool:
    try:
        model.profile(name)
    except GeometryError:
        return False
    return True


def readable_model(name: str | GpuModel | None, instances: Iterable[Any] = ()) -> GpuModel | None:
    """The GpuModel a stored GPU's geometry is read with (its layout, masks, profile names): known_model(name),
    or None where the GPU's reported ``instances`` do not form a layout that model's table allows (off_table):
    then the GPU is treated as one of a model our tables do not list (kept as it is, its instances as the
    node named them, out of the policy's view, never re-carved or bound by the controller)."""
    model = known_model(name)
    if model is None or off_table(model, instances)[1]:
        return None
    return model


def unknown_model_reason(model: str | None, instances: Iterable[Any] = ()) -> str | None:
    """Why a GPU whose geometry this slurm-mig cannot read is left as it is (ObservedGpu.blocked): a model our
    tables do not list, MIG instances on a GPU named no model, or instances (``instances``: profile, start)
    that a known model's table does not allow (off_table). None where the model and its instances are known,
    or where the GPU is named no model and holds no instance (no MIG GPU: nothing to keep)."""
    instances = list(instances)
    if model and known_model(model) is None:
        return (f"model {model!r} is not in this controller's tables (its node runs a newer slurm-mig: upgrade "
                f"the controller); left as it is")
    if not model:
        if instances:
            return ("MIG instances on a GPU its node names no model for (its slurm-mig's tables do not list the "
                    "part); left as it is")
        return None
    m = known_model(model)
    profiles, problems = off_table(m, instances)
    if not problems:
        return None
    unknown = [p for p in profiles if not _has_profile(m, p)]
    if unknown:
        what = f"unknown profile {', '.join(map(repr, unknown))}: this controller's {m.name} table lacks it"
    else:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        what = f"instances this controller's {m.name} table does not allow ({shown})"
    return f"{what} (its node runs a newer slurm-mig: upgrade the controller); left as it is"


def as_observed_gpu(item: Any) -> ObservedGpu:
    """Accept an ObservedGpu, an nvml GpuInfo or a dict with gpu/index, uuid, model, mig_enabled (and, for
    blocked_reason, mig_pending, foreign, table_errors). A model name this slurm-mig does not know is kept as
    given, and the GPU blocked (unknown_model_reason)."""
    if isinstance(item, ObservedGpu):
        return item
    gpu = _get(item, "gpu", "index")
    if gpu is None:
        raise ValueError(f"GPU report without an index: {item!r}")
    model = _get(item, "model")
    if isinstance(model, GpuModel):
        model = model.name
    elif isinstance(model, str) and model.strip():
        found = known_model(model)
        model = found.name if found is not None else model.strip()
    else:
        model = None
    unknown = unknown_model_reason(model)
    blocked = _get(item, "blocked") or "; ".join(
        w for w in (unknown, blocked_reason(_get(item, "mig_pending"), _get(item, "foreign") or (),
                                            _get(item, "table_errors") or ())) if w) or None
    return ObservedGpu(int(gpu), _get(item, "uuid"), model, bool(_get(item, "mig_enabled", default=False)),
                       _get(item, "name"), blocked=blocked)


# ObservedGpu.blocked of a GPU its node reports lost (fallen off the bus, NVML GPU_IS_LOST): nothing slurm-mig does
# brings it back, a GPU reset or a reboot does (docs/failure-modes.md). The operator tools show it as "lost"
# (is_lost), not as "MIG off".
LOST_REASON = ("the GPU is lost (fell off the bus: NVML GPU_IS_LOST); reset it (nvidia-smi -r) or reboot the node; "
               "its jobs are left alone and nothing is carved or placed there meanwhile")


def is_lost(blocked: str | None) -> bool:
    """Whether a GPU blocked for ``blocked`` (ObservedGpu.blocked) was reported lost."""
    return bool(blocked) and blocked.startswith(LOST_REASON)


def blocked_reason(mig_pending: bool | None, foreign: Iterable[Any] = (),
                   table_errors: Iterable[str] = ()) -> str | None:
    """Why slurm-mig must leave a GPU as it is (ObservedGpu.blocked), from what its node reported: the MIG
    mode a change waiting for a GPU reset will set (nvml GpuInfo.mig_pending), GPU instances of profiles
    our tables do not list (nvml ForeignInstance or dicts with start, size, profile_id), and where the
    driver's MIG profiles differ from our table (the node's `nvml check-tables` errors). None: nothing
    stops it."""
    why = []
    if mig_pending is not None:
        why.append(f"MIG mode changes to {'on' if mig_pending else 'off'} at the next GPU reset")
    held = [f"profile id {_get(f, 'profile_id')} at {_get(f, 'start')}:{_get(f, 'size')}" for f in foreign]
    if held:
        why.append("GPU instance(s) of a profile slurm-mig does not know: " + ", ".join(held))
    table = [str(e) for e in table_errors]
    if table:
        shown = "; ".join(table[:3]) + (f"; and {len(table) - 3} more" if len(table) > 3 else "")
        why.append(f"the driver's MIG profiles differ from slurm-mig's table (`slurm-mig nvml check-tables` on the "
                   f"node): {shown}")
    return "; ".join(why) or None


def as_observed_instance(item: Any) -> ObservedInstance:
    """Accept an ObservedInstance, an nvml MigInstance or a dict with gpu, profile, start, ..."""
    if isinstance(item, ObservedInstance):
        return item
    b = as_bound_instance(item)
    gi, ci = _get(item, "gi_id"), _get(item, "ci_id")
    return ObservedInstance(b.gpu, b.profile, b.start, b.uuid, None if gi is None else int(gi),
                            None if ci is None else int(ci), bool(_get(item, "in_use", default=False)))


def as_step(item: Any) -> JournalStep:
    """Accept a transitions.Step, a JournalStep or a dict {action, profile, start}."""
    if isinstance(item, JournalStep):
        return item
    action = _get(item, "action")
    slot = _get(item, "slot")
    if isinstance(slot, Slot):
        profile, start = slot.profile, slot.start
    else:
        profile, start = _get(item, "profile"), _get(item, "start")
    if action not in ("create", "destroy") or profile is None or start is None:
        raise ValueError(f"cannot read a reconfiguration step from {item!r}")
    return JournalStep(action, str(profile), int(start))


# -- JSON forms of the policy types (for decisions.inputs / decisions.action) -----

def slot_json(slot: Slot) -> dict:
    return {"profile": slot.profile, "start": slot.start}


def state_to_json(state: Any) -> dict:
    """A ClusterState as plain JSON (enough to replay a decision or train from it)."""
    return {
        "now": state.now,
        "gpus": [
            {
                "node": g.node, "gpu": g.index, "model": g.model.name, "layout": str(g.layout),
                "busy": [str(s) for s in sorted(g.busy)],
                "reconfiguring": [str(s) for s in sorted(g.reconfiguring)],
                "busy_until": [[str(s), t] for s, t in g.busy_until],
                "available": g.available,
            }
            for g in state.gpus
        ],
        "pending": [
            {"job_id": j.job_id, "profile": j.profile, "count": j.count, "submit_time": j.submit_time,
             "time_limit_s": j.time_limit_s, "user": j.user, "partition": j.partition,
             # only where Slurm restricts the job: the nodes it may start on
             **({} if j.nodes is None else {"nodes": list(j.nodes)}),
             # only where CPUs are counted (PendingJob.cpus)
             **({} if j.cpus is None else {"cpus": j.cpus}),
             **({"exclusive": True} if j.exclusive else {})}
            for j in state.pending
        ],
        **({} if state.free_cpus is None else {"free_cpus": dict(state.free_cpus)}),
    }


def decision_to_json(decision: Any) -> dict:
    """A Decision's actions as plain JSON (waiting reasons are stored separately)."""
    return {
        "changes": [
            {"node": c.node, "gpu": c.gpu, "target": str(c.target), "reason": c.reason}
            for c in decision.changes
        ],
        "assignments": [
            {"job_id": a.job_id, "node": a.node, "reason": a.reason,
             "instances": [{"gpu": g, **slot_json(s)} for g, s in a.instances]}
            for a in decision.assignments
        ],
        "extra": decision.extra,
    }


def dumps(value: Any) -> str:
    """Stable JSON text for a column (sorted keys, no NaN)."""
    return json.dumps(value, sort_keys=True, default=_json_default, allow_nan=False)


def _json_default(o: Any) -> Any:
    if isinstance(o, Slot):
        return str(o)
    if isinstance(o, tuple):
        return list(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=str)
    if hasattr(o, "to_json"):
        return o.to_json()
    raise TypeError(f"cannot store {type(o).__name__} as JSON")


# A read-only reader (ops.views.open_readonly) decodes bytes that are not UTF-8 as the text \\xNN; in a JSON column's
# string that backslash is no JSON escape. Each escape is matched whole ("\\\\" too), so only a \\xNN is doubled.
_ESCAPE = re.compile(r"\\(x[0-9a-f]{2}|.)", re.S)


def loads(text: str | None, default: Any = None) -> Any:
    """``text`` as JSON (``default`` when empty); a byte decoded as \\xNN inside a string reads as that text."""
    if text is None or text == "":
        return default
    try:
        return json.loads(text)
    except ValueError:
        if "\\x" not in text:
            raise
    return json.loads(_ESCAPE.sub(lambda m: "\\" + m.group(0) if len(m.group(1)) == 3 else m.group(0), text))


def bound_instances_from_json(items: Iterable[dict]) -> tuple[BoundInstance, ...]:
    return tuple(BoundInstance(int(i["gpu"]), i["profile"], int(i["start"]), i.get("uuid")) for i in items)
