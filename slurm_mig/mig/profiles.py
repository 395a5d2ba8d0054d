"""GPU models and their MIG GPU-instance profiles.

Source: NVIDIA's MIG user guide ("Supported profiles"), `nvidia-smi mig -lgipp`
and nvml.h, as collected in shared/docs/FACTS.md §1. A placement is
``start:size`` counted in *memory slices*; a 3g spans 4 memory slices and a 7g
spans 8, as real hardware reports (NVIDIA's go-nvml mocks say 3 and 7: wrong).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from slurm_mig.errors import GeometryError

# nvmlDeviceGetGpuInstanceProfileInfo's `profile` argument (nvml.h constants).
NVML_PROFILE_1_SLICE = 0
NVML_PROFILE_2_SLICE = 1
NVML_PROFILE_3_SLICE = 2
NVML_PROFILE_4_SLICE = 3
NVML_PROFILE_7_SLICE = 4
NVML_PROFILE_1_SLICE_REV1 = 7  # +me: the 1g that also owns the media engines
NVML_PROFILE_2_SLICE_REV1 = 8  # A30's 2g+me
NVML_PROFILE_1_SLICE_REV2 = 9  # 1g with double memory (1g.20gb on an H100)

# The profiles that tile a GPU in the common case; "maximal layouts" are built
# from these (FACTS §1 lists 19 of them for the A100/H100 family).
BASIC_KINDS = ("1g", "2g", "3g", "4g", "7g")


@dataclass(frozen=True)
class Profile:
    """One GPU-instance profile of one GPU model."""

    id: int  # GpuInstanceProfileInfo.id, the ID `nvidia-smi mig -lgip` shows
    nvml_index: int  # the NVML_GPU_INSTANCE_PROFILE_* constant used to query it
    name: str  # e.g. "3g.40gb"
    kind: str  # short name: "1g", "3g", "1g+me" or "1g.dm" (double memory)
    compute_slices: int
    memory_slices: int  # the placement size
    memory_gb: int  # nominal, from the name
    max_count: int
    starts: tuple[int, ...]  # legal placement starts, in memory slices

    @property
    def is_basic(self) -> bool:
        """True for the plain 1g/2g/3g/4g/7g profiles (not +me, not double memory)."""
        return self.kind in BASIC_KINDS

    def mask(self, start: int) -> int:
        """Bit mask of the memory slices an instance placed at ``start`` uses."""
        return ((1 << self.memory_slices) - 1) << start


@dataclass(frozen=True)
class GpuModel:
    """A MIG-capable GPU model: its slice counts and profiles."""

    name: str  # our canonical name, e.g. "H100-80GB"
    memory_slices: int
    compute_slices: int
    profiles: tuple[Profile, ...]
    # Leading words of nvmlDeviceGetName() (after "NVIDIA") that identify this model: see model_from_nvml_name.
    nvml_names: tuple[str, ...] = field(default=())

    def profile(self, name: str) -> Profile:
        """Look a profile up by full name ("3g.40gb"), kind ("3g", "1g+me") or NVML id.

        A bare kind resolves to the basic profile of that size, which is what a
        user means by ``--gres=mig:1g``.
        """
        key = name.strip().lower()
        for p in self.profiles:
            if key in (p.name, p.kind):
                return p
        if key.isascii() and key.isdigit():  # "²".isdigit() is true, int("²") fails
            for p in self.profiles:
                if p.id == int(key):
                    return p
        known = ", ".join(p.name for p in self.profiles)
        raise GeometryError(f"{self.name} has no MIG profile {name!r} (known: {known})")

    def profile_by_id(self, profile_id: int) -> Profile:
        """The profile with this GpuInstanceProfileInfo.id."""
        for p in self.profiles:
            if p.id == profile_id:
                return p
        raise GeometryError(f"{self.name} has no MIG profile with id {profile_id}")

    @property
    def basic_profiles(self) -> tuple[Profile, ...]:
        """The plain 1g/2g/3g/4g/7g profiles this model has."""
        return tuple(p for p in self.profiles if p.is_basic)

    def __repr__(self) -> str:
        return f"GpuModel({self.name})"

    @property
    def full_mask(self) -> int:
        return (1 << self.memory_slices) - 1


def _seven_slice_model(name: str, gb: dict[str, int], nvml_names: tuple[str, ...]) -> GpuModel:
    """The A100/H100/H200/B200 family: 8 memory slices, 7 compute slices."""
    one, one_dm, two, three, four, seven = (gb[k] for k in ("1g", "1g.dm", "2g", "3g", "4g", "7g"))
    profiles = (
        Profile(19, NVML_PROFILE_1_SLICE, f"1g.{one}gb", "1g", 1, 1, one, 7, (0, 1, 2, 3, 4, 5, 6)),
        Profile(20, NVML_PROFILE_1_SLICE_REV1, f"1g.{one}gb+me", "1g+me", 1, 1, one, 1, (0, 1, 2, 3, 4, 5, 6)),
        Profile(15, NVML_PROFILE_1_SLICE_REV2, f"1g.{one_dm}gb", "1g.dm", 1, 2, one_dm, 4, (0, 2, 4, 6)),
        Profile(14, NVML_PROFILE_2_SLICE, f"2g.{two}gb", "2g", 2, 2, two, 3, (0, 2, 4)),
        Profile(9, NVML_PROFILE_3_SLICE, f"3g.{three}gb", "3g", 3, 4, three, 2, (0, 4)),
        Profile(5, NVML_PROFILE_4_SLICE, f"4g.{four}gb", "4g", 4, 4, four, 1, (0,)),
        Profile(0, NVML_PROFILE_7_SLICE, f"7g.{seven}gb", "7g", 7, 8, seven, 1, (0,)),
    )
    return GpuModel(name, 8, 7, profiles, nvml_names)


def _a30() -> GpuModel:
    """A30-24GB: 4 memory slices, 4 compute slices."""
    profiles = (
        Profile(14, NVML_PROFILE_1_SLICE, "1g.6gb", "1g", 1, 1, 6, 4, (0, 1, 2, 3)),
        Profile(21, NVML_PROFILE_1_SLICE_REV1, "1g.6gb+me", "1g+me", 1, 1, 6, 1, (0, 1, 2, 3)),
        Profile(5, NVML_PROFILE_2_SLICE, "2g.12gb", "2g", 2, 2, 12, 2, (0, 2)),
        Profile(6, NVML_PROFILE_2_SLICE_REV1, "2g.12gb+me", "2g+me", 2, 2, 12, 1, (0, 2)),
        Profile(0, NVML_PROFILE_4_SLICE, "4g.24gb", "4g", 4, 4, 24, 1, (0,)),
    )
    return GpuModel("A30-24GB", 4, 4, profiles, ("A30",))


GPU_MODELS: dict[str, GpuModel] = {
    m.name: m
    for m in (
        _a30(),
        _seven_slice_model(
            "A100-40GB", {"1g": 5, "1g.dm": 10, "2g": 10, "3g": 20, "4g": 20, "7g": 40},
            ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"),
        ),
        _seven_slice_model(
            "A100-80GB", {"1g": 10, "1g.dm": 20, "2g": 20, "3g": 40, "4g": 40, "7g": 80},
            ("A100-SXM4-80GB", "A100 80GB", "A100-PCIE-80GB"),
        ),
        _seven_slice_model(
            "H100-80GB", {"1g": 10, "1g.dm": 20, "2g": 20, "3g": 40, "4g": 40, "7g": 80},
            ("H100 80GB", "H100-SXM", "H100 PCIe", "H100"),
        ),
        # The models below were not measured here: their names and memory sizes are NVIDIA's (MIG user
        # guide, "Supported GPUs"; mig-parted's config-default.yaml), their geometry the Hopper/Blackwell
        # one. A node checks every table against its driver before carving (slurm_mig/nvml/tables.py).
        _seven_slice_model(
            "H100-94GB", {"1g": 12, "1g.dm": 24, "2g": 24, "3g": 47, "4g": 47, "7g": 94},
            ("H100 NVL", "H800 NVL", "H100"),
        ),
        _seven_slice_model(
            "H100-96GB", {"1g": 12, "1g.dm": 24, "2g": 24, "3g": 48, "4g": 48, "7g": 96},
            ("GH200 480GB", "H20", "H100"),
        ),
        _seven_slice_model(
            "H200-141GB", {"1g": 18, "1g.dm": 35, "2g": 35, "3g": 71, "4g": 71, "7g": 141},
            ("H200", "H200 NVL"),
        ),
        _seven_slice_model(
            "GH200-144GB", {"1g": 18, "1g.dm": 36, "2g": 36, "3g": 72, "4g": 72, "7g": 144},
            ("GH200 144G",),
        ),
        _seven_slice_model(
            "B200-180GB", {"1g": 23, "1g.dm": 45, "2g": 45, "3g": 90, "4g": 90, "7g": 180},
            ("B200",),
        ),
        _seven_slice_model(
            "GB200-186GB", {"1g": 23, "1g.dm": 47, "2g": 47, "3g": 93, "4g": 93, "7g": 186},
            ("GB200",),
        ),
    )
}

_ALIASES = {
    "A30": "A30-24GB", "A100": "A100-80GB", "H100": "H100-80GB", "H200": "H200-141GB", "B200": "B200-180GB",
    "GB200": "GB200-186GB",
}


def get_model(name: str) -> GpuModel:
    """Look a GPU model up by canonical name ("H100-80GB") or short alias ("H100")."""
    key = name.strip()
    for candidate in (key, key.upper(), _ALIASES.get(key.upper(), "")):
        if candidate in GPU_MODELS:
            return GPU_MODELS[candidate]
    raise GeometryError(f"unknown GPU model {name!r} (known: {', '.join(GPU_MODELS)})")


# Words a device name may carry after its model's marker without changing its MIG geometry: form
# factors, and the memory types of _MEMORY_TYPES. Anything else (NVL, another memory size, ...) may be
# another part.
_FORM_FACTORS = frozenset({"SXM", "SXM2", "SXM4", "SXM5", "PCIE"})
# The memory each model is made with (NVIDIA's datasheets). A memory type in a device name is a model's only if
# it is one of these: the same marker with other memory is another part, often of another size ('H20 HBM3e'
# is a 141 GB H20, not the 96 GB one; 'GH200 480GB' has HBM3, the 144 GB GH200 HBM3e).
_MEMORY_TYPES: dict[str, frozenset[str]] = {
    "A30-24GB": frozenset({"HBM2"}),
    "A100-40GB": frozenset({"HBM2"}),
    "A100-80GB": frozenset({"HBM2E"}),
    "H100-80GB": frozenset({"HBM3", "HBM2E"}),  # SXM5: HBM3; PCIe: HBM2e
    "H100-94GB": frozenset({"HBM3", "HBM2E"}),  # NVL: HBM3; SXM5 94GB: HBM2e
    "H100-96GB": frozenset({"HBM3"}),  # GH200 480GB, H20, H100 96GB
    "H200-141GB": frozenset({"HBM3E"}),
    "GH200-144GB": frozenset({"HBM3E"}),
    "B200-180GB": frozenset({"HBM3E"}),
    "GB200-186GB": frozenset({"HBM3E"}),
}


def _name_tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[\s_-]+", text.upper()) if t]


def _default_owner_of_markers() -> dict[tuple[str, ...], str]:
    """Each marker -> the first model listing it: the part a name with no memory size means."""
    owners: dict[tuple[str, ...], str] = {}
    for model in GPU_MODELS.values():
        for marker in model.nvml_names:
            owners.setdefault(tuple(_name_tokens(marker)), model.name)
    return owners


def model_from_nvml_name(device_name: str) -> GpuModel | None:
    """Map nvmlDeviceGetName() (e.g. 'NVIDIA H100 80GB HBM3') to a model, or None for a part whose MIG
    geometry is not in our tables (the GPU is then left out of scheduling, never mislabelled).

    Whole words, not substrings: the name (less a leading NVIDIA/Tesla) must start with one of the
    model's markers, and every word after it must be a form factor, a memory type the model is made with
    (_MEMORY_TYPES: 'NVIDIA H20 HBM3e', a 141 GB part, is not our 96 GB H20), or the model's own memory size. So 'NVIDIA GH200 480GB' is not an H200 and 'NVIDIA H100 NVL' not an H100-80GB.
    The longest marker wins, so 'A100-SXM4-80GB' is not taken for a 40 GB part. A marker several
    models share ("H100") means its first model when the name gives no memory size ('NVIDIA H100
    PCIe' is an H100-80GB); the others match only with their own size in the name ('H100 94GB').
    """
    words = _name_tokens(device_name)
    while words and words[0] in ("NVIDIA", "TESLA"):
        words = words[1:]
    owners = _default_owner_of_markers()
    best: tuple[int, int, GpuModel] | None = None
    for model in GPU_MODELS.values():
        size = model.name.rsplit("-", 1)[-1].upper()  # "80GB"
        for marker in model.nvml_names:
            m = _name_tokens(marker)
            rest = words[len(m):]
            if words[:len(m)] != m or not all(w in _FORM_FACTORS or w == size
                                              or w in _MEMORY_TYPES.get(model.name, ()) for w in rest):
                continue
            sized = size in rest
            if not sized and owners[tuple(m)] != model.name:
                continue  # another model's part unless the name says this one's size
            rank = (len(m), int(sized))
            if best is None or rank > best[:2]:
                best = (*rank, model)
    return None if best is None else best[2]
