"""MIG as a Slurm GRES: type names, profile-name mapping and Gres string helpers.

Every MIG instance is advertised to Slurm as one unit of the count-only GRES
``mig`` with a *type* that names its size, e.g. a node holding two 1g and one
3g instance has ``Gres=mig:1g:2,mig:3g:1``.

Type names never contain a dot: Slurm splits GRES strings on ``:`` and reads a
trailing ``3g``/``40gb`` as a count with a size suffix, so ``mig:3g.40gb``
cannot be a type. We use the short kinds below; they describe compute size and
variant, not memory, so one name covers every GPU model:

========  ======================================================  ===========
type      meaning (profile id)                                    max per GPU
========  ======================================================  ===========
``1g``    1 compute slice, 1 memory slice (19)                    7 (A30: 4)
``1gme``  ``1g`` with media extensions, ``+me`` (20)              1
``1gdm``  1 compute slice, double memory: 2 memory slices (15)    4
``2g``    2 compute slices (14)                                   3 (A30: 2)
``2gme``  A30 only: ``2g.12gb+me``                                1
``3g``    3 compute slices, 4 memory slices (9)                   2
``4g``    4 compute slices (5)                                    1
``7g``    the whole GPU (0)                                       1
========  ======================================================  ===========

**Padding.** slurmd re-registers with slurmctld now and then and reports the
counts written in slurm.conf; if their *total* differs from the total set at run
time while jobs hold mig instances (or is lower at any time), Slurm drains the
node with INVALID_REG (measured, docs/reliability.md section 2). A node whose
Gres lists ``mig:pad:N`` therefore keeps a constant total, 7 per GPU
(``MAX_INSTANCES_PER_GPU``): the controller sets the real counts and pads the
rest. ``pad`` is no size: job_submit.lua refuses it, so Slurm never hands it to
a job. slurm.conf's total must be that same 7 x GPUs.

``etc/job_submit.lua`` carries a copy of PROFILE_TO_GRES and MAX_PER_GPU (Lua
cannot import Python); ``tests/test_job_submit_table.py`` fails if they drift.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from slurm_mig.errors import GeometryError
from slurm_mig.mig.profiles import GPU_MODELS

#: The GRES name every MIG instance is counted under.
GRES_NAME = "mig"

#: All GRES types, in the stable order used when formatting Gres strings.
GRES_TYPES: tuple[str, ...] = ("1g", "1gme", "1gdm", "2g", "2gme", "3g", "4g", "7g")

#: The padding type: counts no instance, keeps a node's mig total constant (see the module doc).
PAD_TYPE = "pad"

#: The most instances any MIG GPU can hold at once (seven 1g slices on every model).
MAX_INSTANCES_PER_GPU = 7

#: The most instances of a type one GPU can ever hold (largest over GPU models).
MAX_PER_GPU: dict[str, int] = {
    "1g": 7, "1gme": 1, "1gdm": 4, "2g": 3, "2gme": 1, "3g": 2, "4g": 1, "7g": 1,
}

#: Compute slices used by one instance of each type (a GPU has at most 7).
COMPUTE_SLICES: dict[str, int] = {
    "1g": 1, "1gme": 1, "1gdm": 1, "2g": 2, "2gme": 2, "3g": 3, "4g": 4, "7g": 7,
}

#: Profile names whose meaning depends on the GPU model, and the type we pick.
#: "1g.10gb" is the plain 1g on A100-80GB/H100-80GB (this project's reference
#: hardware) but the double-memory 1g on A100-40GB; A100-40GB users who want the
#: latter ask for ``mig:1gdm``.
AMBIGUOUS_PROFILES: dict[str, str] = {"1g.10gb": "1g"}


def _merge_profiles() -> dict[str, str]:
    merged: dict[str, str] = {}
    for table in PROFILES_BY_MODEL.values():
        for name, gtype in table.items():
            if name in merged and merged[name] != gtype and name not in AMBIGUOUS_PROFILES:
                raise AssertionError(f"profile {name} maps to {merged[name]} and {gtype}")
            merged[name] = gtype
    merged.update(AMBIGUOUS_PROFILES)
    return dict(sorted(merged.items()))


#: slurm_mig.mig.profiles Profile.kind -> GRES type (the geometry code spells
#: variants "1g+me", "1g.dm", "2g+me"; GRES types cannot hold "." or "+").
KIND_TO_GRES: dict[str, str] = {
    "1g": "1g", "1g+me": "1gme", "1g.dm": "1gdm", "2g": "2g", "2g+me": "2gme",
    "3g": "3g", "4g": "4g", "7g": "7g",
}
GRES_TO_KIND: dict[str, str] = {v: k for k, v in KIND_TO_GRES.items()}

#: Full NVIDIA profile names per GPU model -> GRES type, from the geometry tables (slurm_mig.mig.profiles).
PROFILES_BY_MODEL: dict[str, dict[str, str]] = {
    model.name: {p.name: KIND_TO_GRES[p.kind] for p in model.profiles} for model in GPU_MODELS.values()
}

#: Every known full profile name (lower case, no "MIG " prefix) -> GRES type.
PROFILE_TO_GRES: dict[str, str] = _merge_profiles()


def gres_type_for_kind(kind: str) -> str:
    """GRES type for a geometry kind: ``"1g+me"`` -> ``"1gme"``, ``"3g"`` -> ``"3g"``."""
    try:
        return KIND_TO_GRES[kind]
    except KeyError:
        raise GeometryError(f"unknown MIG kind {kind!r}; known: {', '.join(KIND_TO_GRES)}") from None


def gres_type_for_profile(name: str) -> str:
    """Return the GRES type for a profile name or a GRES type.

    Accepts ``"3g.40gb"``, ``"MIG 3g.40gb"``, ``"1g.5gb+me"`` and the types
    themselves (``"3g"``, ``"1gdm"``); case does not matter. Raises
    GeometryError for anything else.
    """
    key = name.strip().lower()
    if key.startswith("mig "):
        key = key[4:].strip()
    if key in MAX_PER_GPU:
        return key
    try:
        return PROFILE_TO_GRES[key]
    except KeyError:
        raise GeometryError(
            f"unknown MIG profile {name!r}: expected one of {', '.join(GRES_TYPES)} "
            f"or a profile name such as 3g.40gb"
        ) from None


def format_node_gres(counts: Mapping[str, int], *, include_all: bool = False,
                     other: Iterable[str] = (), pad_to: int | None = None) -> str:
    """Format per-type instance counts as a node ``Gres=`` value.

    ``format_node_gres({"1g": 2, "3g": 1}) == "mig:1g:2,mig:3g:1"``. Types come in
    GRES_TYPES order whatever the mapping's order. Zero counts are left out unless
    ``include_all`` is true, in which case every known type appears (with 0 where
    absent) so that ``scontrol update ... Gres=`` overwrites types that a previous
    update set. With ``pad_to`` a ``mig:pad:N`` item is appended so the mig total
    is exactly ``pad_to`` (GeometryError when the instances alone exceed it); a
    ``pad`` key in ``counts`` is ignored then, and formatted like a type
    otherwise. ``other`` items (non-mig GRES such as ``"gpu:2"``) are appended
    unchanged. An empty result is ``""``; note that ``scontrol update Gres=``
    needs a non-empty value (use include_all for "no instances").
    """
    unknown = set(counts) - set(GRES_TYPES) - {PAD_TYPE}
    if unknown:
        raise GeometryError(f"unknown MIG GRES type(s) {sorted(unknown)}; known: {', '.join(GRES_TYPES)}")
    parts = []
    real = 0
    for gtype in GRES_TYPES:
        n = int(counts.get(gtype, 0))
        if n < 0:
            raise GeometryError(f"negative count {n} for mig:{gtype}")
        real += n
        if n or include_all:
            parts.append(f"{GRES_NAME}:{gtype}:{n}")
    if pad_to is not None:
        if real > pad_to:
            raise GeometryError(f"{real} MIG instances do not fit a padded mig total of {pad_to}")
        parts.append(f"{GRES_NAME}:{PAD_TYPE}:{int(pad_to) - real}")
    elif PAD_TYPE in counts:
        n = int(counts[PAD_TYPE])
        if n < 0:
            raise GeometryError(f"negative count {n} for mig:{PAD_TYPE}")
        parts.append(f"{GRES_NAME}:{PAD_TYPE}:{n}")
    parts.extend(other)
    return ",".join(parts)


def padded_total(gpus: int) -> int:
    """The constant mig total of a padded node with ``gpus`` MIG GPUs."""
    return MAX_INSTANCES_PER_GPU * int(gpus)


def mig_total(counts: Mapping[str, int]) -> int:
    """Sum of every mig count, padding included (what slurmd's registration is checked against)."""
    return sum(int(n) for n in counts.values())


# One GRES item: name[:type][:count][(socket/index detail)]. Slurm prints
# "mig:1g:2(S:0)" in node Gres and "mig:1g:0(IDX:N/A)" in GresUsed.
_ITEM_RE = re.compile(r"^(?P<body>[^()]*)(?:\((?P<detail>[^)]*)\))?$")


def split_gres(value: str | None) -> list[str]:
    """Split a GRES list on top-level commas (commas inside parentheses stay).

    ``"mig:1g:2(S:0-1),gpu:1"`` -> ``["mig:1g:2(S:0-1)", "gpu:1"]``. ``None``,
    ``""`` and Slurm's ``"(null)"`` give ``[]``.
    """
    if not value or value.strip() in ("(null)", "N/A"):
        return []
    items, depth, cur = [], 0, []
    for ch in value:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            items.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur).strip())
    return [i for i in items if i]


def parse_gres_item(item: str) -> tuple[str, str | None, int]:
    """Parse one GRES item into ``(name, type, count)``.

    Strips a ``gres:`` / ``gres/`` prefix (tres_per_node spells items
    ``gres:mig:3g:1`` in 22.05 and ``gres/mig:3g:1`` in later releases) and any
    ``(S:0)``/``(IDX:..)`` detail. A missing count is 1, as Slurm reads it. Raises
    ValueError when the count is not a plain integer.
    """
    m = _ITEM_RE.match(item.strip())
    body = (m.group("body") if m else item).strip()
    for prefix in ("gres:", "gres/"):
        if body.startswith(prefix):
            body = body[len(prefix):]
    parts = body.split(":")
    name = parts[0]
    if len(parts) == 1:
        return name, None, 1
    if len(parts) == 2:
        # "mig:3" is an untyped count, "mig:3g" a type with the default count.
        if parts[1].isascii() and parts[1].isdigit():
            return name, None, int(parts[1])
        return name, parts[1], 1
    return name, parts[1] or None, int(parts[2])


def parse_node_gres(value: str | None) -> dict[str, int]:
    """Parse a node Gres / GresUsed / JOB_GRES string into ``{type: count}`` for mig.

    ``parse_node_gres("mig:1g:2,mig:3g:1(S:0)") == {"1g": 2, "3g": 1}``. Non-mig
    items are ignored, repeated types are summed and zero counts are kept (so a
    type set to 0 is distinguishable from a type never configured). Items whose
    count is not an integer are skipped.
    """
    counts: dict[str, int] = {}
    for item in split_gres(value):
        try:
            name, gtype, n = parse_gres_item(item)
        except ValueError:
            continue
        if name != GRES_NAME or gtype is None:
            continue
        counts[gtype] = counts.get(gtype, 0) + n
    return counts


def other_gres(value: str | None) -> list[str]:
    """Return the non-mig items of a Gres string without their ``(S:..)`` detail."""
    out = []
    for item in split_gres(value):
        body = item.split("(", 1)[0]
        if body.split(":", 1)[0] != GRES_NAME:
            out.append(body)
    return out


def max_per_node(gtype: str, gpus_per_node: int) -> int:
    """Most instances of ``gtype`` a node with ``gpus_per_node`` GPUs can hold."""
    return MAX_PER_GPU[gtype] * gpus_per_node
