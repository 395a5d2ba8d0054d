"""Layouts: sets of placed MIG instances on one GPU, their rules and enumeration.

The same type describes what a GPU should look like (desired, from a policy)
and what it does look like (observed, from NVML), in the spirit of NVIDIA's
mig-parted, so comparing the two is plain set arithmetic.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator

from slurm_mig.errors import GeometryError, InvalidLayout
from slurm_mig.mig.profiles import GpuModel, Profile


@dataclass(frozen=True, order=True)
class Slot:
    """One GPU instance: a profile (full name, e.g. "3g.40gb") at a start memory slice."""

    start: int
    profile: str

    def __str__(self) -> str:
        return f"{self.profile}@{self.start}"


@dataclass(frozen=True)
class Layout:
    """A set of placed instances on one GPU of a given model. May be invalid: see problems()."""

    model: GpuModel
    slots: frozenset[Slot]

    @classmethod
    def of(cls, model: GpuModel, slots: Iterable[Slot | tuple[str, int]] = ()) -> "Layout":
        """Build a layout; a slot may be given as ``(profile, start)`` with a kind or full name."""
        out = set()
        for s in slots:
            if isinstance(s, Slot):
                out.add(Slot(s.start, model.profile(s.profile).name))
            else:
                name, start = s
                out.add(Slot(int(start), model.profile(name).name))
        return cls(model, frozenset(out))

    @classmethod
    def empty(cls, model: GpuModel) -> "Layout":
        return cls(model, frozenset())

    # -- queries -----------------------------------------------------------
    def profile_of(self, slot: Slot) -> Profile:
        return self.model.profile(slot.profile)

    def sorted_slots(self) -> list[Slot]:
        return sorted(self.slots)

    @property
    def used_mask(self) -> int:
        mask = 0
        for s in self.slots:
            mask |= self.profile_of(s).mask(s.start)
        return mask

    @property
    def compute_used(self) -> int:
        return sum(self.profile_of(s).compute_slices for s in self.slots)

    def counts(self) -> Counter:
        """How many instances of each profile kind ("1g", "3g", ...) the layout holds."""
        return Counter(self.profile_of(s).kind for s in self.slots)

    def problems(self) -> list[str]:
        """Every MIG rule this layout breaks, as readable sentences (empty when valid)."""
        found: list[str] = []
        by_profile: Counter = Counter()
        mask = 0
        for s in self.sorted_slots():
            try:
                p = self.profile_of(s)
            except GeometryError as exc:
                found.append(str(exc))
                continue
            by_profile[p.name] += 1
            if s.start not in p.starts:
                found.append(f"{p.name} cannot start at memory slice {s.start} (legal starts: {list(p.starts)})")
                continue
            m = p.mask(s.start)
            if mask & m:
                found.append(f"{s} overlaps another instance")
            mask |= m
        for name, n in by_profile.items():
            p = self.model.profile(name)
            if n > p.max_count:
                found.append(f"{n} x {name} exceeds its maximum of {p.max_count} per GPU")
        compute = sum(self.model.profile(s.profile).compute_slices for s in self.slots
                      if s.profile in {p.name for p in self.model.profiles})
        if compute > self.model.compute_slices:
            found.append(f"{compute} compute slices used, {self.model.name} has {self.model.compute_slices}")
        return found

    def is_valid(self) -> bool:
        return not self.problems()

    def validate(self) -> "Layout":
        """Return self, or raise InvalidLayout naming every broken rule."""
        problems = self.problems()
        if problems:
            raise InvalidLayout(f"invalid {self.model.name} layout {self}: " + "; ".join(problems))
        return self

    def can_add(self, profile: Profile, start: int) -> bool:
        """Whether an instance of ``profile`` at ``start`` fits beside this (valid) layout."""
        if start not in profile.starts:
            return False
        if self.used_mask & profile.mask(start):
            return False
        if self.compute_used + profile.compute_slices > self.model.compute_slices:
            return False
        same = sum(1 for s in self.slots if s.profile == profile.name)
        return same < profile.max_count

    def free_starts(self, profile: Profile) -> list[int]:
        """Starts at which ``profile`` could be created now without touching anything."""
        return [st for st in profile.starts if self.can_add(profile, st)]

    def is_maximal(self, profiles: Iterable[Profile] | None = None) -> bool:
        """True when no instance of ``profiles`` (default: the basic ones) can be added."""
        profiles = tuple(profiles) if profiles is not None else self.model.basic_profiles
        return not any(self.free_starts(p) for p in profiles)

    # -- building ----------------------------------------------------------
    def with_slot(self, slot: Slot) -> "Layout":
        return Layout(self.model, self.slots | {slot})

    def without(self, slots: Iterable[Slot]) -> "Layout":
        return Layout(self.model, self.slots - frozenset(slots))

    # -- rendering ---------------------------------------------------------
    def __repr__(self) -> str:
        return f"Layout({self.model.name}: {self})"

    def __str__(self) -> str:
        if not self.slots:
            return "empty"
        parts = []
        for s in self.sorted_slots():
            p = self.model.profile(s.profile)
            parts.append(f"{p.kind if p.is_basic else p.name}@{s.start}")
        return ",".join(parts)

    def to_json(self) -> list[dict]:
        """JSON form: a list of ``{"profile", "start", "size"}`` (size in memory slices)."""
        return [
            {"profile": s.profile, "start": s.start, "size": self.model.profile(s.profile).memory_slices}
            for s in self.sorted_slots()
        ]


def parse_layout(text: str, model: GpuModel) -> Layout:
    """Parse ``"3g@0,2g@4,1g@6"`` (kinds or full profile names) into a validated Layout.

    ``""`` or ``"empty"`` is the empty layout. Raises GeometryError with the bad
    item named.
    """
    text = text.strip()
    if text in ("", "empty", "none"):
        return Layout.empty(model)
    slots = []
    for item in text.split(","):
        item = item.strip()
        name, sep, start = item.partition("@")
        start = start.strip()
        # ASCII digits only: str.isdigit() takes "²" and int() takes neither it nor every
        # character str.strip() removes (a fuzzer found "1g@\x1f0").
        if not sep or not name or not (start.isascii() and start.isdigit() and len(start) <= 2):
            raise GeometryError(f"bad layout item {item!r}: expected PROFILE@START, e.g. 3g@0 or 1g.10gb@6")
        slots.append(Slot(int(start), model.profile(name).name))
    if len(set(slots)) != len(slots):
        raise InvalidLayout(f"layout {text!r} names the same instance twice")
    return Layout(model, frozenset(slots)).validate()


def _candidates(model: GpuModel, profiles: Iterable[Profile]) -> list[tuple[Profile, int]]:
    return sorted(((p, st) for p in profiles for st in p.starts), key=lambda c: (c[1], -c[0].memory_slices, c[0].name))


def iter_valid_layouts(model: GpuModel, profiles: Iterable[Profile] | None = None) -> Iterator[Layout]:
    """Every valid layout (the empty one included) built from ``profiles``; each once."""
    profiles = tuple(profiles) if profiles is not None else model.basic_profiles
    cands = _candidates(model, profiles)

    def grow(i: int, layout: Layout) -> Iterator[Layout]:
        yield layout
        for j in range(i, len(cands)):
            p, st = cands[j]
            if layout.can_add(p, st):
                yield from grow(j + 1, layout.with_slot(Slot(st, p.name)))

    yield from grow(0, Layout.empty(model))


def enumerate_maximal_layouts(model: GpuModel, profiles: Iterable[Profile] | None = None) -> list[Layout]:
    """All maximal layouts of ``profiles`` (default 1g/2g/3g/4g/7g), sorted for stable output.

    Maximal: valid, and no further instance of those profiles fits.
    """
    profiles = tuple(profiles) if profiles is not None else model.basic_profiles
    found = {l.slots: l for l in iter_valid_layouts(model, profiles) if l.slots and l.is_maximal(profiles)}
    return sorted(found.values(), key=_layout_sort_key)


def _layout_sort_key(layout: Layout) -> tuple:
    # Biggest instance first, then by position: matches how NVIDIA lists them.
    return tuple((-layout.model.profile(s.profile).compute_slices, s.start) for s in layout.sorted_slots())
