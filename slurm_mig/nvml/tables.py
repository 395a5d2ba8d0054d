"""Our MIG profile tables against what a GPU's driver says: read-only.

Every placement slurm-mig plans comes from ``slurm_mig.mig.profiles``, written from NVIDIA's MIG
user guide (FACTS §1). A driver may disagree (a new release renumbers a profile, drops the +me
variant, caps a count), and a table that is wrong on one number makes the planner ask for
placements the driver refuses, or leave slices it could use idle. ``slurm-mig nvml check-tables``
asks the driver, through the backend's ``profile_readings``, for every GPU-instance profile it offers
and where each may be placed, and compares profile by profile. It creates and destroys nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from slurm_mig.mig.profiles import GpuModel


@dataclass(frozen=True)
class ProfileReading:
    """One GPU-instance profile as the driver reports it (nvmlDeviceGetGpuInstanceProfileInfo and
    nvmlDeviceGetGpuInstancePossiblePlacements)."""

    nvml_index: int  # the NVML_GPU_INSTANCE_PROFILE_* constant it was asked with
    id: int
    compute_slices: int  # sliceCount
    max_count: int  # instanceCount
    memory_mib: int | None = None  # memorySizeMB; None where the driver's struct has none
    name: str | None = None  # e.g. "MIG 1g.10gb" (version 2 of the struct); None with version 1
    # (start, size) in memory slices; None where the placements could not be read
    placements: tuple[tuple[int, int], ...] | None = None

    @property
    def short_name(self) -> str | None:
        """The name without NVML's "MIG " prefix, as our tables write it ("1g.10gb")."""
        if self.name is None:
            return None
        text = self.name.strip()
        return text[4:].strip() if text.upper().startswith("MIG ") else text


@dataclass(frozen=True)
class Finding:
    """One difference (or note) between our table and the driver."""

    level: str  # "error": we would plan what the driver refuses or mislabel it; "warning"; "note"
    profile: str  # our profile name, or the driver's for a profile we do not list
    message: str


@dataclass
class TableCheck:
    """What check_gpu found for one GPU."""

    gpu: int
    name: str
    model: str | None
    mig_mode: str
    readings: list[ProfileReading] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    unreadable: str | None = None  # why nothing could be compared
    failed: bool = False  # unreadable because an NVML call failed (maybe transient), not by the driver's answer

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def ok(self) -> bool:
        """True when the driver agrees with every number of our table for this GPU."""
        return self.unreadable is None and not self.errors

    def to_json(self) -> dict:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def compare_tables(model: GpuModel, readings: list[ProfileReading]) -> list[Finding]:
    """Compare ``model``'s profiles with the driver's ``readings``, profile by profile.

    A basic profile (1g/2g/3g/4g/7g) the driver lacks, or any number that differs (profile id, compute
    slices, instance count, name, placements), is an error: the planner would ask for what the driver
    refuses. A +me or double-memory profile the driver lacks is a warning (only a job that names it is
    affected). A profile the driver offers that our table does not list is a note: its instances are
    shown as foreign and block their GPU.
    """
    by_index = {r.nvml_index: r for r in readings}
    findings: list[Finding] = []
    for p in model.profiles:
        r = by_index.get(p.nvml_index)
        if r is None:
            level = "error" if p.is_basic else "warning"
            findings.append(Finding(level, p.name, f"the driver offers no profile at NVML index {p.nvml_index}"))
            continue
        diffs = []
        if r.id != p.id:
            diffs.append(f"profile id {r.id}, ours {p.id}")
        if r.compute_slices != p.compute_slices:
            diffs.append(f"{r.compute_slices} compute slices, ours {p.compute_slices}")
        if r.max_count != p.max_count:
            diffs.append(f"at most {r.max_count} instances, ours {p.max_count}")
        if r.short_name is not None and r.short_name.lower() != p.name:
            diffs.append(f"named {r.short_name!r}, ours {p.name!r}")
        if r.placements is not None:
            theirs = sorted(r.placements)
            ours = [(s, p.memory_slices) for s in p.starts]
            if theirs != ours:
                diffs.append(f"placements {_placements(theirs)}, ours {_placements(ours)}")
        findings.extend(Finding("error", p.name, d) for d in diffs)
        if r.placements is None:
            findings.append(Finding("warning", p.name, "the driver's placements could not be read: not compared"))
    ours = {p.nvml_index for p in model.profiles}
    for r in readings:
        label = r.short_name or f"id {r.id}"
        if r.placements is not None and any(s < 0 or n < 1 or s + n > model.memory_slices for s, n in r.placements):
            # our slice masks (and so every overlap test) assume placements inside the GPU
            findings.append(Finding("error", label, f"a placement lies outside the model's {model.memory_slices} "
                                                    f"memory slices: {_placements(sorted(r.placements))}"))
        if r.nvml_index not in ours:
            where = "" if r.placements is None else f", placements {_placements(sorted(r.placements))}"
            findings.append(Finding(
                "note", label,
                f"offered at NVML index {r.nvml_index} (profile id {r.id}, {r.compute_slices} compute slices"
                f"{where}) but not in our table: its instances are shown as foreign and block their GPU"))
    return findings


def _placements(pairs: list[tuple[int, int]]) -> str:
    if not pairs:
        return "none"
    sizes = {n for _, n in pairs}
    if len(sizes) == 1:
        return "{" + ",".join(str(s) for s, _ in pairs) + "}:" + str(sizes.pop())
    return ",".join(f"{s}:{n}" for s, n in pairs)


def check_gpu(backend, gpu) -> TableCheck:
    """Read GPU ``gpu``'s profiles from ``backend`` (a GpuInfo from its ``gpus()``) and compare them with
    our table for its model. Read-only."""
    from slurm_mig.nvml.base import NvmlError

    check = TableCheck(gpu.index, gpu.name, gpu.model.name if gpu.model else None, gpu.mig_mode)
    if gpu.lost:
        check.unreadable = "the GPU is lost (NVML GPU_IS_LOST)"
        return check
    reader = getattr(backend, "profile_readings", None)
    if reader is None:
        check.unreadable = "this backend cannot list the driver's profiles"
        return check
    try:
        check.readings = reader(gpu.index)
    except NvmlError as exc:
        check.unreadable, check.failed = f"{type(exc).__name__}: {exc}", True
        return check
    if gpu.model is None:
        check.unreadable = f"{gpu.name!r} is not a GPU model slurm-mig has a table for"
    elif not check.readings:
        # Not MIG mode: an H200 on driver 580 listed every profile and placement with MIG off.
        check.unreadable = "the driver offers no GPU-instance profile on this GPU"
    else:
        check.findings = compare_tables(gpu.model, check.readings)
    return check
