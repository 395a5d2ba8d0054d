"""The learned placement policy ``rl``: a trained network picks where each job goes.

What it decides, and what it does not. Jobs are taken in Slurm priority order
with EASY backfill and the same reservations as frag-aware -- it runs the very
dispatch loop of the heuristics (``DispatchPolicy.decide``) with frag-aware's
settings -- so priority order and the no-starvation guarantee are the
heuristic's. For each single-instance job that can start now, the heuristic
machinery lists the *candidates* -- every free instance and every carve of idle
slices at each legal start on each GPU that breaks no reservation -- and the
network scores each candidate from its feature row (:data:`FEATURE_NAMES`). The
highest score wins. Every candidate is a legal placement, so every decision
passes ``check_decision``. Multi-instance jobs (whole-node 7g jobs in practice)
are placed by frag-aware's node search.

One network scores one candidate at a time, so the same model works for any
cluster size and queue length: the queue and the cluster enter only through
per-candidate and context features. Candidates are pre-sorted by frag-aware's
score and cut to the best ``max_candidates`` (the cut keeps the cost bounded on
big clusters; frag-aware's choice is always candidate 0).

Serving needs onnxruntime and numpy only (never torch). The model file is an
ONNX graph with one input ``features`` [N, F] (float32) and one output
``logits`` [N]; beside it sits ``model_card.json``. The policy refuses a model
whose feature schema (:data:`FEATURE_SCHEMA`) or width differs from this code:
it raises :class:`PolicyModelError` with the reason, and the controller falls
back to its ``[policy].fallback`` heuristic and logs why.

Which model: the ``model_path`` option, else ``$SLURM_MIG_RL_MODEL``, else
``[policy].model_path`` of the config file (the controller's own, passed as the
``config_model_path`` option; else found as ``load_config`` finds it),
else the active version of the policy store (``slurm-mig policy install``; store
at ``$SLURM_MIG_POLICY_STORE`` or /var/lib/slurm-mig/policies), else the
shipped ``policy/default.onnx``. The model is loaded lazily on the first
decision (so a broken model never stops the controller from starting) and
reloaded when the resolved file, its card or its guard file changes. A model that
others than root and the controller's user may change (:func:`model_trust_problem`,
folders.writable_by_others: owned by another user, writable by its group or by
anyone, or in a folder so owned or written) is refused like one that does not load.

``rl-candidate`` is the same policy with the newest *non-active* version of the
store: set ``[policy].shadow = "rl-candidate"`` to log what a candidate model
would decide without acting on it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from slurm_mig.config import MAX_HOLD_H  # 30 days: the longest guard option, and [policy].rl_max_hold_h's bound
from slurm_mig.errors import ConfigError, SlurmMigError
from slurm_mig.folders import writable_by_others  # the one rule for what root acts on (config, store, model)
from slurm_mig.policies._core import CONFLICT, INF, NO_ROOM, PLACED, Ctx, GpuInfo
from slurm_mig.policies.base import ClusterState, Decision, PendingJob
from slurm_mig.policies.frag_aware import SIZES, FragAwarePolicy

# Bump when a feature is added, removed, reordered or computed differently: a model
# trained on another schema is refused (the controller then falls back). (Not bumped when the
# demand, queue_len and pending_limit_h began to leave out jobs no node could ever hold,
# 2026-11-27: the simulator the models are trained in queues none, so on every input a model
# saw they are computed as before. Nor when frag-aware's score terms, and so frag_loss, time_cost,
# node_cost and score, began to leave out on each GPU the jobs its node may never take,
# 2026-11-27: in the simulator's clusters, one model, nodes alike, no node restrictions, that is
# the whole look-ahead for every GPU, so again every input a model saw is computed as before. The
# demand_* features stay the whole look-ahead's.)
FEATURE_SCHEMA = "rl-candidates/1"

FEATURE_NAMES: tuple[str, ...] = (
    # the job and the queue (same for every candidate of one choice)
    "job_size",            # compute slices of the job's profile / 7
    "job_limit_h",         # log1p(time limit in hours); 0 without one
    "job_no_limit",        # 1 when the job has no time limit
    "job_waited_h",        # log1p(hours the job has waited so far)
    "queue_len",           # log1p(pending jobs some node they may start on could hold) / 5
    "demand_1g", "demand_2g", "demand_3g", "demand_4g", "demand_7g",  # compute share of the look-ahead queue (+ running prior)
    "demand_multi",        # share of multi-GPU jobs in the look-ahead
    "cluster_busy",        # share of compute slices locked (sampled)
    "n_candidates",        # log1p(candidates) / 5
    # the candidate (one GPU, one start)
    "free_instance",       # 1: an existing idle instance; 0: a carve
    "reconf_steps",        # creates + destroys / 8
    "frag_loss",           # frag-aware's demand-weighted capacity destroyed / 7
    "time_cost",           # frag-aware's end-time alignment term / 7
    "node_cost",           # frag-aware's node term / 7
    "score",               # frag-aware's total score / 7 (lower is better)
    "score_gap",           # score - best candidate's score
    "score_rank",          # position in frag-aware's order / max_candidates
    "gpu_busy_before",     # compute slices locked on this GPU / 7
    "gpu_busy_after",      # ... after placing the job
    "gpu_empty",           # 1: nothing runs on this GPU
    "postpone",            # log1p(how much later than now this GPU frees wholly / tau)
    "gpu_left_h",          # log1p(hours until this GPU's last job ends), capped at 6
    "gpu_no_end",          # 1: some job on this GPU has no time limit
    "fits_inside",         # 1: the job ends before the GPU's last job does
    "node_idle",           # idle GPUs on the node / GPUs on the node
    "node_free",           # share of the node's compute slices not locked
    "node_postpone",       # like postpone, for the node's last job
    "start",               # memory-slice start / 8
    "gpu_rank",            # GPU's position in node-name order / GPUs (first fit: 0)
    "cap_after_1g", "cap_after_2g", "cap_after_3g", "cap_after_4g", "cap_after_7g",  # instances still carvable after / max
    "reserved_gpu",        # 1: the GPU holds a (non-conflicting) reservation
    "same_profile",        # instances of this profile already locked on the GPU / 7
    # a reservation choice: two rows, "reserve" and "skip" (placement rows have zeros here)
    "is_reservation",      # 1: this row belongs to a reservation choice
    "skip_reservation",    # 1: the "do not reserve now" row
    "reserve_delay_h",     # log1p(hours until the reservation would start), capped at 6
    "reserve_gpus",        # GPUs the reservation would hold / GPUs in the cluster
    "job_count",           # instances the job asks for / 8
    "guard_left",          # share of reserve_guard_s the job has still to wait before it must be reserved
)
N_FEATURES = len(FEATURE_NAMES)
N_CONTEXT = 13  # the first 13 features describe the job and the queue, not the candidate

# The multi-GPU reservation guard: a second, small network (``guard.onnx`` beside the
# placement model, named by the card's "guard" entry). A blocked job that asks for
# several GPUs gets frag-aware's reservation, but held from ``hours`` after its
# submission at the earliest (``hours`` one of GUARD_OPTIONS_H, the network's pick):
# until then any job that ends in time may still start on the reserved GPUs, one that
# would outlast it may not. A reservation from now drains a whole node at once, which
# protects the big job and costs every small one; whether that pays depends on the
# workload (docs/rl-policy.md, "The reservation guard"), which is what the network
# reads. 0 h is frag-aware's rule; the largest option bounds how late the hold starts.
GUARD_SCHEMA = "rl-guard/2"
GUARD_OPTIONS_H: tuple[float, ...] = (0.0, 2.0, 6.0, 12.0, 24.0, 48.0)
# Only what the workload and the cluster are, not what the policy did to the queue: the
# guard is trained with one option held for a whole episode, so it must pick (nearly)
# the same option at every decision of a workload. rl-guard/1 also read the queue's
# multi-GPU share, its length and how busy the cluster was; those move with the
# option itself, and that guard switched between 0 h and 48 h within one workload
# (docs/rl-policy.md, "The reservation guard").
GUARD_FEATURE_NAMES: tuple[str, ...] = (
    "job_node_share",      # GPUs the job asks for / GPUs of the largest node
    "job_limit_h",         # log1p(the job's time limit in hours); 0: none
    "running_left_h",      # median over busy GPUs of log1p(hours until the GPU's last job ends), capped at 6
    "running_no_end",      # share of busy GPUs where some job has no time limit
    "pending_limit_h",     # median over the look-ahead of log1p(time limit in hours), capped at 6 (none: 6)
    "node_gpus",           # GPUs of the largest node / 8
    "nodes",               # log2(nodes) / 8
)
N_GUARD_FEATURES = len(GUARD_FEATURE_NAMES)

DEFAULT_STORE = Path("/var/lib/slurm-mig/policies")
log = logging.getLogger("slurm_mig.policies.rl")

# A choice whose feature rows fall outside the range the network was trained on (the card's
# ``feature_range``, widened by this share of each feature's span) is decided by frag-aware's
# rule instead: a network says nothing useful about inputs it never saw (measured: on streams
# where 30 % of jobs have no time limit, which no training workload had, the placement network
# left frag-aware's choice in over half its placements and waited 1.5-2.6x longer).
RANGE_SLACK = 0.05


def _shipped_model() -> Path:
    """policy/default.onnx of the checkout, else the copy a wheel installs under <prefix>/share/slurm-mig."""
    here = Path(__file__).resolve().parents[2] / "policy" / "default.onnx"
    if here.is_file():
        return here
    installed = Path(sys.prefix) / "share" / "slurm-mig" / "policy" / "default.onnx"
    return installed if installed.is_file() else here


SHIPPED_MODEL = _shipped_model()
CARD_NAME = "model_card.json"


class PolicyModelError(SlurmMigError):
    """The learned policy's model is missing, unreadable, or built for other features."""


@dataclass
class Choice:
    """One placement the network must make: pick a row of ``features`` (candidate index)."""

    job: PendingJob
    features: list[list[float]]  # [n, N_FEATURES]
    options: list  # (score, rank, kind, seq, gidx, slot, CarveOption | None, parts, node), same order
    state_now: float


# ---------------------------------------------------------------------------
# model files
# ---------------------------------------------------------------------------


def card_path(model_path: str | Path) -> Path:
    """The model card beside a model: ``model_card.json`` (or ``<stem>.card.json``)."""
    p = Path(model_path)
    own = p.with_suffix(".card.json")
    return own if own.exists() else p.parent / CARD_NAME


def read_card(model_path: str | Path) -> dict:
    cp = card_path(model_path)
    try:
        card = json.loads(cp.read_text())
    except FileNotFoundError:
        raise PolicyModelError(f"no model card {cp} beside {model_path}") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise PolicyModelError(f"cannot read model card {cp}: {exc}") from None
    if not isinstance(card, dict):
        raise PolicyModelError(f"model card {cp} is not a JSON object")
    return card


def created_time(card: dict) -> float | None:
    """The card's ``created`` as a Unix time; None when absent or not a number (a hand-written date)."""
    c = card.get("created")
    return float(c) if isinstance(c, (int, float)) and not isinstance(c, bool) and c == c else None


def store_dir() -> Path:
    return Path(os.environ.get("SLURM_MIG_POLICY_STORE") or DEFAULT_STORE)


#: What to do about an ``active`` file that names no version.
_ACTIVE_FIX = ("`slurm-mig policy install VERSION` makes one active again (`slurm-mig policy list` names them; "
               "`default` is the shipped model)")


def read_active(store: Path) -> str | None:
    """The version the store's ``active`` file names; None without one (no store, or none installed yet:
    the shipped model). An ``active`` that is empty (a power cut while it was written, before it was
    fsynced), unreadable or names no version raises PolicyModelError: running the shipped model instead
    would silently run another model than the admin installed, so the controller uses its
    ``[policy].fallback`` and logs this reason."""
    path = store / "active"
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise PolicyModelError(f"cannot read the policy store's {path}: {exc.strerror or exc}; {_ACTIVE_FIX}"
                               ) from None
    try:
        version = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        version = None
    if version == "":
        raise PolicyModelError(f"the policy store's {path} is empty (cut off while written?), so it names no "
                               f"version; {_ACTIVE_FIX}")
    if version is None or not (version == "default" or VERSION_RE.fullmatch(version)):
        raise PolicyModelError(f"the policy store's {path} names no version ({raw[:40]!r}); {_ACTIVE_FIX}")
    return version


def _store_active(store: Path) -> Path | None:
    version = read_active(store)
    if version is None or version == "default":
        return None
    return store / version / "model.onnx"


#: A stored version's name (use with fullmatch: "$" lets "v1\n" through). A folder of the store named otherwise
#: is none: the temporary ".<version>.<random>" of a `policy install` that was stopped, half copied.
VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _store_candidate(store: Path) -> Path | None:
    """The newest stored version that is not the active one."""
    try:
        active = _store_active(store)
    except PolicyModelError:  # the live policy says why; the shadow still tries the newest stored version
        active = None
    best = None
    try:
        entries = list(store.iterdir())
    except OSError:
        return None
    for d in entries:
        m = d / "model.onnx"
        if not VERSION_RE.fullmatch(d.name) or not m.is_file() or (active is not None and m == active):
            continue
        try:
            created = created_time(read_card(m)) or 0.0
        except PolicyModelError:
            created = 0.0
        key = (created, d.name)
        if best is None or key > best[0]:
            best = (key, m)
    return best[1] if best else None


def _config_model_path() -> str:
    try:
        from slurm_mig.config import find_config, load_config

        if find_config() is None:
            return ""
        return load_config().policy.model_path
    except SlurmMigError:
        return ""


def _pins(config_model_path: str | None = None) -> list[tuple[str, str]]:
    """The settings that pin the rl policy's model over the store, in the order they win: (what, path)."""
    config = _config_model_path() if config_model_path is None else config_model_path
    return [("$SLURM_MIG_RL_MODEL=", os.environ.get("SLURM_MIG_RL_MODEL") or ""),
            ("[policy].model_path = ", config or "")]


def model_pin(config_model_path: str | None = None) -> str:
    """What makes the rl policy run another model than the store's active version ('' when nothing),
    e.g. ``$SLURM_MIG_RL_MODEL=/x.onnx``; ``config_model_path`` stands for the found config's setting."""
    for what, path in _pins(config_model_path):
        if path:
            return what + path
    return ""


def resolve_model_path(explicit: str | Path | None = None, *, candidate: bool = False,
                       config_model_path: str | None = None) -> Path:
    """Which model file the ``rl`` (or ``rl-candidate``) policy uses now (see module doc).
    ``config_model_path``: the ``[policy].model_path`` of the caller's own config ('' for none); None looks it up
    in the config load_config finds."""
    if candidate:
        c = _store_candidate(store_dir())
        if c is None:
            raise PolicyModelError(f"no candidate model in the policy store {store_dir()} "
                                   "(`slurm-mig policy retrain` writes one)")
        return c
    for p in (explicit, *(path for _, path in _pins(config_model_path))):
        if p:
            return Path(p)
    active = _store_active(store_dir())
    return active if active is not None else SHIPPED_MODEL


def model_trust_problem(path: str | Path) -> str:
    """Why the controller must not run the model at ``path`` ('' when it may): whoever can change one of its files
    chooses where every job goes, in a process that runs as root. Checked by :func:`writable_by_others` (folders.py), the
    rule for the config and the policy store too: the folder holding the model (where a ``<name>.card.json`` or a missing guard could be added), the
    model, its card and the guard file the card names; for a version of the policy store, the store and its
    ``active`` too. The shipped model as well: a pip install under umask 0 can leave it writable by anyone."""
    path = Path(path)
    checks = [(path.parent, "the rl model's folder"), (path, "rl model"), (card_path(path), "model card")]
    try:
        g = read_card(path).get("guard")
    except PolicyModelError:  # loading says what is wrong with the card
        g = None
    name = g.get("file") if isinstance(g, dict) else None
    if isinstance(name, str) and name and "/" not in name and "\0" not in name and not name.startswith("."):
        checks.append((path.parent / name, "guard model"))
    store = store_dir()
    if Path(os.path.abspath(path)).parent.parent == Path(os.path.abspath(store)):
        checks[:0] = [(store, "policy store"), (store / "active", "the policy store's pointer")]
    for p, what in checks:
        problem = writable_by_others(p, what)
        if problem:
            return problem
    return ""


def _feature_range(entry, names: tuple[str, ...], what: str):
    """The card's optional ``feature_range`` ({"lo": [...], "hi": [...]}, one number per feature): the
    values the network was trained on. None when the card has none (older models: no range check)."""
    if entry is None:
        return None
    lo = entry.get("lo") if isinstance(entry, dict) else None
    hi = entry.get("hi") if isinstance(entry, dict) else None
    ok = (isinstance(lo, list) and isinstance(hi, list) and len(lo) == len(hi) == len(names)
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in lo + hi)
          and all(a <= b for a, b in zip(lo, hi)))
    if not ok:
        raise PolicyModelError(f"{what}: the card's feature_range must give lo <= hi, {len(names)} finite numbers each")
    import numpy as np

    lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    # float32 rounding, and a little room on features that varied in training; none where a feature was
    # constant there (a job without a time limit when every training job had one: the network never saw it)
    slack = RANGE_SLACK * (hi - lo) + 1e-5
    return lo - slack, hi + slack


def _session(ort, so, path: Path, what: str, input_name: str, width: int, schema: str):
    """An onnxruntime session for ``path`` whose one input is ``input_name`` with ``width`` features per row."""
    try:
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise PolicyModelError(f"cannot load {what} {path}: {exc}") from None
    inputs = sess.get_inputs()
    if len(inputs) != 1 or inputs[0].name != input_name:
        raise PolicyModelError(f"{what} {path} must have one input named {input_name!r}")
    got = inputs[0].shape[-1]
    if isinstance(got, int) and got != width:
        raise PolicyModelError(f"{what} {path} takes {got} features per row; schema {schema} has {width}")
    return sess


PLACEMENT_NETWORK = "network"
PLACEMENT_FRAG_AWARE = "frag-aware"
PLACEMENTS = (PLACEMENT_NETWORK, PLACEMENT_FRAG_AWARE)


class OnnxScorer:
    """An ONNX model that maps candidate features [N, F] to logits [N] (onnxruntime, one thread)."""

    def __init__(self, path: str | Path, *, guard: bool = True) -> None:
        path = Path(path)
        if not path.is_file():
            raise PolicyModelError(f"RL model {path} does not exist")
        card = read_card(path)
        schema = card.get("feature_schema")
        if schema != FEATURE_SCHEMA:
            raise PolicyModelError(f"model {path} was trained on feature schema {schema!r}; this slurm-mig "
                                   f"computes {FEATURE_SCHEMA!r}")
        names = card.get("features")
        if names is not None and (not isinstance(names, list) or tuple(names) != FEATURE_NAMES):
            raise PolicyModelError(f"model {path}: the card's feature list differs from this slurm-mig's")
        try:
            import numpy as np
            import onnxruntime as ort
        except ImportError as exc:
            raise PolicyModelError(f"the rl policy needs onnxruntime and numpy: {exc}") from None
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self.session = _session(ort, so, path, "RL model", "features", N_FEATURES, FEATURE_SCHEMA)
        meta = self.session.get_modelmeta().custom_metadata_map
        if meta.get("feature_schema", FEATURE_SCHEMA) != FEATURE_SCHEMA:
            raise PolicyModelError(f"model {path} embeds feature schema {meta['feature_schema']!r}, "
                                   f"expected {FEATURE_SCHEMA!r}")
        self.np = np
        self.path = path
        self.card = card
        self.version = str(card.get("version", path.parent.name))
        self.output = self.session.get_outputs()[0].name
        self.range = _feature_range(card.get("feature_range"), FEATURE_NAMES, f"model {path}")
        # Who places single-instance jobs: the network, or frag-aware (candidate 0) while the network has not
        # been shown to do better (docs/rl-policy.md, "Who places"). Cards from before this key: the network.
        self.placement = card.get("placement", PLACEMENT_NETWORK)
        if self.placement not in PLACEMENTS:
            raise PolicyModelError(f"model {path}: the card's placement must be one of {', '.join(PLACEMENTS)}, "
                                   f"got {self.placement!r}")
        self.guard_session = None
        self.guard_range = None
        self.guard_options: tuple[float, ...] = ()
        if guard and card.get("guard") is not None:
            self._load_guard(path, card["guard"], ort, so)

    def _load_guard(self, path: Path, g, ort, so) -> None:
        """The reservation guard named by the card; any mismatch refuses the whole model."""
        if not isinstance(g, dict):
            raise PolicyModelError(f"model {path}: the card's 'guard' entry is not an object")
        if g.get("feature_schema") != GUARD_SCHEMA:
            raise PolicyModelError(f"model {path}: guard trained on schema {g.get('feature_schema')!r}; this "
                                   f"slurm-mig computes {GUARD_SCHEMA!r}")
        if not isinstance(g.get("features"), list) or tuple(g["features"]) != GUARD_FEATURE_NAMES:
            raise PolicyModelError(f"model {path}: the guard's feature list differs from this slurm-mig's")
        opts = g.get("options_h")
        if (not isinstance(opts, list) or not opts
                or not all(isinstance(o, (int, float)) and 0 <= o <= MAX_HOLD_H for o in opts)):
            raise PolicyModelError(f"model {path}: the guard's options_h must be a list of hours (0-{MAX_HOLD_H:g})")
        name = g.get("file")
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise PolicyModelError(f"model {path}: the guard's file must be a plain file name beside the model")
        gp = path.parent / name
        if not gp.is_file():
            raise PolicyModelError(f"model {path}: its guard {gp} does not exist")
        sess = _session(ort, so, gp, "guard", "guard_features", N_GUARD_FEATURES, GUARD_SCHEMA)
        outputs = sess.get_outputs()
        out_w = outputs[0].shape[-1]
        if isinstance(out_w, int) and out_w != len(opts):
            raise PolicyModelError(f"guard {gp} scores {out_w} options; its card lists {len(opts)}")
        self.guard_range = _feature_range(g.get("feature_range"), GUARD_FEATURE_NAMES, f"model {path}'s guard")
        self.guard_session = sess
        self.guard_output = outputs[0].name
        self.guard_options = tuple(float(o) for o in opts)

    def guard_logits(self, features: list[float]):
        x = self.np.asarray([features], dtype=self.np.float32)
        out = self.guard_session.run([self.guard_output], {"guard_features": x})[0].reshape(-1)
        return self._finite(self._sized(out, len(self.guard_options), "the guard of model"), "the guard of model")

    def logits(self, features: list[list[float]]):
        x = self.np.asarray(features, dtype=self.np.float32)
        return self._finite(self._sized(self.session.run([self.output], {"features": x})[0].reshape(-1), len(x),
                                        "model"), "model")

    def _sized(self, out, want: int, what: str):
        # One score per option: an output of another size (a dynamic output width the load could not check)
        # would make argmax pick an index that names no option, or a subset of them, and be obeyed silently.
        if out.size != want:
            raise PolicyModelError(f"{what} {self.path} (version {self.version}) gave {out.size} scores for "
                                   f"{want} options")
        return out

    def _finite(self, out, what: str):
        # argmax takes the first NaN as the largest score: a broken network would be obeyed, not noticed
        bad = ~self.np.isfinite(out)
        if bad.any():
            raise PolicyModelError(f"{what} {self.path} (version {self.version}) scored {int(bad.sum())} of "
                                   f"{out.size} options as NaN or infinite")
        return out

    def pick(self, features: list[list[float]]) -> int:
        return int(self.logits(features).argmax())

    def outside(self, rows, guard: bool = False) -> list[str]:
        """Names of the features of ``rows`` (a list of rows) outside the training range; [] when inside
        or when the card gives no range."""
        rng = self.guard_range if guard else self.range
        if rng is None:
            return []
        x = self.np.asarray(rows, dtype=self.np.float32)  # what the network reads; the slack covers the rounding
        bad = ((x < rng[0]) | (x > rng[1])).any(axis=0)
        names = GUARD_FEATURE_NAMES if guard else FEATURE_NAMES
        return [names[i] for i in self.np.flatnonzero(bad)]


# ---------------------------------------------------------------------------
# the policy
# ---------------------------------------------------------------------------


class RLPolicy(FragAwarePolicy):
    """Learned candidate scoring inside frag-aware's priority/backfill/reservation loop."""

    name = "rl"
    version = "1"

    def __init__(self, *, model_path: str | None = None, config_model_path: str | None = None,
                 max_candidates: int = 32,
                 chooser: Callable[[Choice], int] | None = None, candidate: bool = False,
                 learn_reservations: bool = True, reserve_guard_s: float = 2 * 3600.0,
                 guard_chooser: Callable[[list[float]], float] | None = None, max_hold_h: float = 48.0,
                 explain_waiting: bool = True, **frag) -> None:
        super().__init__(explain_waiting=explain_waiting, **frag)
        if isinstance(max_hold_h, bool) or not (isinstance(max_hold_h, (int, float)) and 0 <= max_hold_h <= MAX_HOLD_H):
            raise ConfigError(f"rl: max_hold_h must be between 0 and {MAX_HOLD_H:g} hours, got {max_hold_h!r}")
        # the admin's bound on the guard: no whole-node reservation is held back longer than this after
        # submission ([policy].rl_max_hold_h; 0 = frag-aware's reservations for multi-GPU jobs)
        self.max_hold_h = float(max_hold_h)
        self.learn_reservations = learn_reservations
        # training: features -> guard hours (e.g. one option held for a whole episode); serving: None -> the
        # model's guard, if it has one
        self.guard_chooser = guard_chooser
        self.reserve_guard_s = reserve_guard_s
        self.model_path = model_path
        # the controller's own [policy].model_path ('' for none), below $SLURM_MIG_RL_MODEL; None: the config
        # load_config finds (the command-line tools)
        self.config_model_path = config_model_path
        self.max_candidates = max_candidates
        self.chooser = chooser  # training: sample; serving: None -> the ONNX model's argmax
        self.candidate = candidate
        if candidate:
            self.name = "rl-candidate"
        self._scorer: OnnxScorer | None = None
        self._loaded_key: tuple | None = None
        self._guard_of: tuple[tuple, str | None] | None = None  # (model and card key, the guard file the card names)
        self._error: PolicyModelError | None = None
        self._checked_at = -math.inf
        self._locked: list[int] | None = None
        self._locked_sum = 0
        self._cap_sum = 0
        # choices the heuristic made because the features left the training range: feature -> count
        self.out_of_range: dict[str, int] = {}
        self._fallbacks = 0

    # -- model -------------------------------------------------------------------
    @staticmethod
    def _stat_key(st: os.stat_result) -> tuple:
        # ctime and inode as well as mtime and size: a copy into place that keeps the old mtime (cp -p,
        # rsync -a) of a file of the same size is a change too
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _file_key(self, path: Path) -> tuple:
        """What a reload is decided on: the model, its card and the guard file the card names (before
        2026-11-27 not the guard: a pinned model whose guard.onnx alone was replaced kept the old one)."""
        try:
            cp = card_path(path)
            key = (str(path), self._stat_key(path.stat()), str(cp), self._stat_key(cp.stat()))
        except OSError:
            return (str(path), None)
        if self._guard_of is None or self._guard_of[0] != key:  # the card is read again only when it changed
            try:
                g = read_card(path).get("guard")
            except PolicyModelError:
                g = None
            name = g.get("file") if isinstance(g, dict) else None
            self._guard_of = (key, name if isinstance(name, str) and name else None)
        name = self._guard_of[1]
        if name is None:
            return key
        try:
            return key + (name, self._stat_key((path.parent / name).stat()))
        except (OSError, ValueError):  # gone, or a name no file can have: loading says which
            return key + (name, None)

    def scorer(self) -> OnnxScorer:
        """The loaded model; re-resolved at most every 5 s of wall time, reloaded when its files change."""
        t = time.monotonic()
        if self._scorer is not None and t - self._checked_at < 5.0:
            return self._scorer
        if self._error is not None and t - self._checked_at < 5.0:
            raise self._error
        self._checked_at = t
        try:
            path = resolve_model_path(self.model_path, candidate=self.candidate,
                                      config_model_path=self.config_model_path)
            # every re-resolution, not only a reload: a chmod of a folder changes no file's key
            problem = model_trust_problem(path)
            if problem:
                raise PolicyModelError(f"refusing to run the rl model {path}: {problem}")
            key = self._file_key(path)
            if self._scorer is None or key != self._loaded_key:
                # a training guard_chooser stands in for the model's guard: do not load (or check) that one
                self._scorer = OnnxScorer(path, guard=self.guard_chooser is None)
                self._loaded_key = key
                self.version = self._scorer.version
            self._error = None
            return self._scorer
        except PolicyModelError as exc:
            self._scorer, self._error = None, exc
            raise
        except Exception as exc:  # anything else about a model is a model error too: never the old model kept
            err = PolicyModelError(f"cannot use the rl model: {type(exc).__name__}: {exc}")
            self._scorer, self._error = None, err
            raise err from None

    def load(self) -> "RLPolicy":
        """Load the model now (raises PolicyModelError with the reason)."""
        if self.chooser is None:
            self.scorer()
        return self

    # -- deciding ------------------------------------------------------------------
    def decide(self, state: ClusterState) -> Decision:
        """The dispatch loop of the heuristics (priority order, EASY backfill, reservations) with
        :meth:`place` choosing by the model."""
        if self.chooser is None:
            self.scorer()  # raises PolicyModelError (the controller falls back) before anything is decided
        self._fallbacks = 0
        d = super().decide(state)
        if self._fallbacks:
            d.extra["rl_outside_training_range"] = self._fallbacks
        return d

    def _inside(self, sc: OnnxScorer, rows, guard: bool = False) -> bool:
        """Whether the network may decide on ``rows``; counts (and logs once per feature) when not."""
        bad = sc.outside(rows, guard)
        if not bad:
            return True
        self._fallbacks += 1
        for name in bad:
            n = self.out_of_range.get(name, 0)
            self.out_of_range[name] = n + 1
            if n == 0:
                log.warning("rl: feature %s%s is outside the range model %s was trained on; frag-aware's rule "
                            "decides such choices", "guard " if guard else "", name, sc.version)
        return False

    def choose(self, choice: Choice) -> int:
        if self.chooser is not None:
            k = self.chooser(choice)
        else:
            sc = self.scorer()
            x = sc.np.asarray(choice.features, dtype=sc.np.float32)  # once: checked, then scored
            k = sc.pick(x) if self._inside(sc, x) else 0
        if not 0 <= k < len(choice.options):
            raise PolicyModelError(f"chooser picked candidate {k} of {len(choice.options)}")
        return k

    def begin(self, ctx: Ctx, state: ClusterState) -> None:
        super().begin(ctx, state)
        # Whether placements (and the reserve-now-or-not choice) are the network's this decision: a training
        # chooser, or a card whose ``placement`` is "network". Otherwise frag-aware's own code decides them
        # and the candidate features are never computed; the guard still acts.
        self._network_places = self.chooser is not None or self.scorer().placement == PLACEMENT_NETWORK
        self._busy = self._cluster_busy(ctx.idx)
        # Jobs no node they may start on could ever hold are left out, as from the demand (FragAwarePolicy.begin):
        # the simulator the model was trained in queues none.
        self._queue = math.log1p(len(ctx.idx.runnable(state.pending))) / 5.0
        self._state = state
        self._guard_ctx: tuple[int, list[float]] | None = None
        reserve = ctx.reserve
        ctx.reserve = lambda job: self._reserve(ctx, job, reserve)

    def _reserve(self, ctx: Ctx, job: PendingJob, reserve: Callable) -> object:
        """A job asking for several GPUs: frag-aware's reservation, held from the guard's hours after its
        submission at the earliest (the guard network's choice; from now, frag-aware's rule, without one).

        Otherwise the first reservation of a decision, for a job younger than ``reserve_guard_s``, is the
        model's choice: reserve now (as frag-aware does) or not yet. Older jobs, and every later
        reservation, are the heuristic's: so no job waits more than the guard plus its reservation's delay."""
        if job.count > 1:
            hours = self._guard_hours(ctx, job)
            if hours is not None:
                hours = min(hours, self.max_hold_h)
                r = reserve(job)
                if r is not None:
                    # The node is held from `hours` after submission: until then any job that ends in time
                    # may still start there; one that would outlast it may not, so the node drains by then.
                    r.t = max(r.t, job.submit_time + hours * 3600.0)
                return r
        if not self.learn_reservations or not self._network_places:
            return reserve(job)
        if ctx.reservations or ctx.now - job.submit_time >= self.reserve_guard_s:
            return reserve(job)
        r = reserve(job)
        if r is None:
            return None
        rows = self._reservation_rows(ctx, job, r)
        if self.choose(Choice(job, rows, [("reserve", r), ("skip", None)], ctx.now)) == 1:
            ctx.reservations.remove(r)
            return None
        return r

    def _guard_hours(self, ctx: Ctx, job: PendingJob) -> float | None:
        """Hours after submission from which ``job``'s (several GPUs) reservation holds at the earliest;
        None: no guard (frag-aware's rule)."""
        if self.guard_chooser is not None:
            return self.guard_chooser(self.guard_features(ctx, job))
        sc = self.scorer() if self.chooser is None else None
        if sc is None or sc.guard_session is None:
            return None
        row = self.guard_features(ctx, job)
        if not self._inside(sc, [row], guard=True):
            return None
        logits = sc.guard_logits(row)
        return sc.guard_options[int(logits.argmax())]

    def guard_features(self, ctx: Ctx, job: PendingJob) -> list[float]:
        """One row of GUARD_FEATURE_NAMES for ``job``; the cluster and queue part is computed once per decision."""
        if self._guard_ctx is None:
            self._guard_ctx = self._guard_context(ctx)
        per_node, rest = self._guard_ctx
        tl = job.time_limit_s
        return [min(2.0, job.count / per_node), math.log1p(tl / 3600.0) if tl else 0.0, *rest]

    def _guard_context(self, ctx: Ctx) -> tuple[int, list[float]]:
        """(GPUs of the largest node, the guard features after the job's own two)."""
        idx = ctx.idx
        now = ctx.now
        left: list[float] = []
        no_end = 0
        for g in range(len(idx.infos)):
            info = ctx.info(g)
            if not info.locked:
                continue
            end = info.busy_end
            if end == INF:
                no_end += 1
                left.append(6.0)
            else:
                left.append(min(6.0, math.log1p(max(0.0, end - now) / 3600.0)))
        busy = len(left)
        look = self._look  # the demand's look-ahead: the next jobs some node could hold
        limits = [min(6.0, math.log1p(j.time_limit_s / 3600.0)) if j.time_limit_s else 6.0 for j in look]
        per_node = max((len(v) for v in idx.node_gpus), default=1)
        return per_node, [
            statistics.median(left) if left else 0.0,
            no_end / busy if busy else 0.0,
            statistics.median(limits) if limits else 0.0,
            per_node / 8.0,
            math.log2(max(len(idx.node_gpus), 1)) / 8.0,
        ]

    def _reservation_rows(self, ctx: Ctx, job: PendingJob, r) -> list[list[float]]:
        info = ctx.idx.infos[next(iter(r.regions))] if r.regions else ctx.idx.infos[0]
        pi = info.t.resolve(job.profile) or info.t.smallest
        context = self._context(job, ctx.now, pi.compute / float(info.t.compute), 2)
        if r.t == INF:
            delay = 6.0
        else:
            delay = min(6.0, math.log1p(max(0.0, r.t - ctx.now) / 3600.0))
        waited = ctx.now - job.submit_time
        extra = [delay, len(r.regions) / max(len(ctx.idx.infos), 1), job.count / 8.0,
                 max(0.0, 1.0 - waited / self.reserve_guard_s)]
        zeros = [0.0] * (N_FEATURES - N_CONTEXT - 6)
        gap = FEATURE_NAMES.index("score_gap") - N_CONTEXT
        reserve_row = zeros.copy()
        skip_row = zeros.copy()
        skip_row[gap] = 1.0  # frag-aware reserves: "skip" is 1 behind (the behaviour-cloning teacher)
        return [context + reserve_row + [1.0, 0.0] + extra, context + skip_row + [1.0, 1.0] + extra]

    def _context(self, job: PendingJob, now: float, size: float, n: int) -> list[float]:
        w = self._weights
        tl = job.time_limit_s
        return [
            size,
            math.log1p(tl / 3600.0) if tl else 0.0,
            0.0 if tl else 1.0,
            math.log1p(max(0.0, now - job.submit_time) / 3600.0),
            self._queue,
            w.get("1g", 0.0), w.get("2g", 0.0), w.get("3g", 0.0), w.get("4g", 0.0), w.get("7g", 0.0),
            self._multi,
            self._busy,
            math.log1p(n) / 5.0,
        ]

    def _cluster_busy(self, idx) -> float:
        """Share of the cluster's compute slices locked, kept up to date by the index's identity diff."""
        lc = self._locked
        if idx.rebuilt or lc is None or len(lc) != len(idx.infos):
            lc = self._locked = [i.locked_compute for i in idx.infos]
            self._locked_sum = sum(lc)
            self._cap_sum = sum(i.t.compute for i in idx.infos)
        else:
            for g in idx.changed_since:
                new = idx.infos[g].locked_compute
                self._locked_sum += new - lc[g]
                lc[g] = new
        return self._locked_sum / self._cap_sum if self._cap_sum else 0.0

    # -- candidates ---------------------------------------------------------------------
    def candidates(self, ctx: Ctx, job: PendingJob, end: float) -> tuple[list, bool]:
        """frag-aware's options for a single-instance job, best first, cut to max_candidates.

        Each option: (score, GPU rank, 0 free / 1 carve, seq, gidx, slot, CarveOption | None, score parts,
        node stats); sorted by the first four, which is frag-aware's order whatever the set iteration order.
        Returns (options, conflicted): conflicted when a reservation ruled some place out.
        """
        idx = ctx.idx
        key = job.profile
        conflicted = [False]
        out: list = []
        K = self.max_candidates

        def consider(g: int, info: GpuInfo) -> bool:
            """Add g's options; whether it had any (a GPU held by a reservation has none)."""
            pi = info.t.resolve(key)
            if pi is None or not info.avail or not ctx.allows(g):
                return False
            before = len(out)
            self._scored_options(ctx, g, info, pi, end, self._node(ctx, info.node), out, conflicted)
            return len(out) > before

        ki = idx.key(key)
        if len(ki.gpus) <= self.exact_limit:
            for g in ctx.candidate_gpus(key):
                consider(g, ctx.info(g))
        else:  # large cluster: signature groups by frag-loss lower bound, as frag-aware does
            for g in self._touched(ctx, key):
                consider(g, ctx.work[g])
            groups, order = self._walk_groups(ctx, ki, key)
            for lb, sig in order:
                if len(out) >= K:
                    out.sort(key=_order_key)
                    del out[K:]
                    if lb >= out[-1][0]:
                        break
                seen = 0
                for _, _, g in groups.get(sig, ()):
                    if g in ctx.work:
                        continue
                    # Only GPUs that offer a place count, as in frag-aware: the first ones are often the node
                    # a reservation holds, and stopping there hid the idle GPUs beyond it.
                    if consider(g, idx.infos[g]):
                        seen += 1
                        if seen >= self.group_width:
                            break
        out.sort(key=_order_key)
        del out[K:]
        return out, conflicted[0]

    def _scored_options(self, ctx: Ctx, g: int, info: GpuInfo, pi, end: float, node: tuple,
                        out: list, conflicted: list) -> None:
        """frag-aware's places on g (its _offers, kept for the decision until g changes) with score_terms'
        parts, term for term."""
        big, offers = self._offers(ctx, g, info, pi, True)
        if not offers:
            return
        t_cost, n_cost, ext, node_ext = self._end_terms(ctx, info, big, end, node)
        # the bigger model's charge (several models only) is in the total, as in score_terms
        gpu_cost = n_cost + self._model_cost(info.t, pi) if self._spare is not None else n_cost
        w_reconf = self.w_reconf
        rank = ctx.idx.rank[g]
        check = bool(ctx.reservations)
        seq = 0  # enumeration order on this GPU: breaks exact ties as frag-aware does, whatever the set order
        for mask, kind, slot, opt, loss, steps in offers:
            if check and ctx.conflicts(g, mask, end):
                conflicted[0] = True
                continue
            parts = (loss + t_cost + gpu_cost + w_reconf * steps, loss, t_cost, n_cost, ext, node_ext, steps)
            out.append((parts[0], rank, kind, seq, g, slot, opt, parts, node))
            seq += 1

    def features(self, ctx: Ctx, job: PendingJob, end: float, options: list) -> list[list[float]]:
        """One row of FEATURE_NAMES per option (see the tuple's comments for each)."""
        now = ctx.now
        idx = ctx.idx
        ngpus = max(len(idx.infos), 1)
        K = float(self.max_candidates)
        first = options[0]
        info0 = ctx.info(first[4])
        pi0 = info0.t.resolve(job.profile)
        context = self._context(job, now, pi0.compute / float(info0.t.compute), len(options))
        tail = [0.0, 0.0, 0.0, 0.0, job.count / 8.0, 0.0]
        best = first[0]
        reserved = {g for r in ctx.reservations for g in r.regions}
        rows = []
        for pos, (total, _rank, _kind, _seq, g, slot, opt, parts, node) in enumerate(options):
            info = ctx.info(g)
            pi = info.t.resolve(job.profile)
            Cg = float(info.t.compute)
            _, loss, t_cost, n_cost, ext, node_ext, steps = parts
            node_idle, node_size, node_free, _node_end = node
            mask = info.locked_mask | pi.mask(slot.start)
            comp = info.locked_compute + pi.compute
            be = info.busy_end
            if be == INF:
                left = 6.0
            elif be <= now:
                left = 0.0
            else:
                left = min(6.0, math.log1p((be - now) / 3600.0))
            # depends on the GPU and the place alone: kept with the GPU's other facts until a job is placed there
            per_gpu = ctx.gpu_memo.get(g)
            if per_gpu is None:
                per_gpu = ctx.gpu_memo[g] = {}
            caps = per_gpu.get((pi, slot.start))
            if caps is None:
                caps = per_gpu[(pi, slot.start)] = self._caps_after(info, pi, mask, comp)
            rows.append(context + [
                1.0 if opt is None else 0.0,
                steps / 8.0,
                loss / Cg,
                t_cost / Cg,
                n_cost / Cg,
                total / Cg,
                (total - best) / Cg,
                pos / K,
                info.locked_compute / Cg,
                comp / Cg,
                1.0 if info.locked_mask == 0 else 0.0,
                ext,
                left,
                1.0 if be == INF else 0.0,
                1.0 if end <= be else 0.0,
                node_idle / max(node_size, 1),
                node_free,
                node_ext,
                slot.start / 8.0,
                g / ngpus,
                *caps,
                1.0 if g in reserved else 0.0,
                info.same.get(pi.name, 0) / 7.0,
                *tail,
            ])
        return rows

    @staticmethod
    def _caps_after(info: GpuInfo, pi, mask: int, comp: int) -> list[float]:
        """cap_after_* of a place on ``info`` (memory-slice mask and compute slices locked after it)."""
        caps = []
        for k in SIZES:
            q = info.t.resolve(k)
            if q is None:
                caps.append(0.0)
                continue
            room = q.max_count - info.same.get(q.name, 0) - (1 if q is pi else 0)
            caps.append(len(q.pack(mask, info.t.compute - comp, room)) / max(q.max_count, 1))
        return caps

    def place(self, ctx: Ctx, job: PendingJob, end: float):
        if job.count != 1 or not self._network_places:  # several instances: frag-aware's node search
            return super().place(ctx, job, end)
        options, conflicted = self.candidates(ctx, job, end)
        if not options:
            return (CONFLICT if conflicted else NO_ROOM), None
        k = 0 if len(options) == 1 else self.choose(Choice(job, self.features(ctx, job, end, options), options,
                                                           ctx.now))
        _, _, _, _, g, slot, opt, _, _ = options[k]
        w = ctx.info(g).clone()
        pi = w.t.resolve(job.profile)
        if opt is None:
            w.take(slot, pi, end)
        else:
            w.carve(opt, pi, end)
        ctx.commit({g: w})
        return PLACED, self.assignment(job, ctx, [(g, slot)], "carved" if opt else "free instance")


def _order_key(o: tuple) -> tuple:
    return o[:4]


def frag_aware_chooser(choice: Choice) -> int:
    """Pick what frag-aware would (its best score): the teacher for behaviour cloning."""
    return 0


def make_rl(**options) -> RLPolicy:
    return RLPolicy(**options)


def make_rl_candidate(**options) -> RLPolicy:
    return RLPolicy(candidate=True, **options)
