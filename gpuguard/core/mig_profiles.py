"""MIG profiles of the GPUs gpuguard simulates, and where a layout of them goes on a GPU.

Pure data and arithmetic (no I/O): config.py validates `[gpu.simulated] mig` with it, and the
simulated backend cuts its GPUs with it.

A GPU in MIG mode has 7 compute slices and 8 memory slices. A GPU instance (GI) takes a
profile's compute slices and a run of memory slices at one of the profile's placements; the
driver names the GI by its placement (the "swizzle id": 0 for the whole GPU, 1-2 for halves,
3-6 for quarters, 7-14 for eighths), which is why GI ids run 0..14 and come back the same when
a layout is re-created in the same places. Profiles, their counts and placements: NVIDIA's MIG
user guide, "Supported MIG Profiles" (H100 80GB and H200 141GB tables).
"""
from __future__ import annotations

from dataclasses import dataclass

COMPUTE_SLICES = 7
MEMORY_SLICES = 8


@dataclass(frozen=True)
class MigProfile:
    name: str                  # "1g.10gb": compute slices, memory in GB (what NVML's device name ends with)
    compute_slices: int
    memory_slices: int         # eighths of the GPU's memory
    max_count: int             # instances of this profile one GPU can hold
    starts: tuple[int, ...]    # first memory slice of each placement the driver allows


def _table(*profiles: MigProfile) -> dict[str, MigProfile]:
    return {profile.name: profile for profile in profiles}


_ONE_EIGHTH, _QUARTERS, _TWO_GI_QUARTERS = tuple(range(7)), (0, 2, 4, 6), (0, 2, 4)

# Keyed by what the simulated GPU's name contains; the first match wins.
PROFILES: dict[str, dict[str, MigProfile]] = {
    "H200": _table(
        MigProfile("1g.18gb", 1, 1, 7, _ONE_EIGHTH),
        MigProfile("1g.35gb", 1, 2, 4, _QUARTERS),
        MigProfile("2g.35gb", 2, 2, 3, _TWO_GI_QUARTERS),
        MigProfile("3g.71gb", 3, 4, 2, (0, 4)),
        MigProfile("4g.71gb", 4, 4, 1, (0,)),
        MigProfile("7g.141gb", 7, 8, 1, (0,)),
    ),
    "H100": _table(
        MigProfile("1g.10gb", 1, 1, 7, _ONE_EIGHTH),
        MigProfile("1g.20gb", 1, 2, 4, _QUARTERS),
        MigProfile("2g.20gb", 2, 2, 3, _TWO_GI_QUARTERS),
        MigProfile("3g.40gb", 3, 4, 2, (0, 4)),
        MigProfile("4g.40gb", 4, 4, 1, (0,)),
        MigProfile("7g.80gb", 7, 8, 1, (0,)),
    ),
}


@dataclass(frozen=True)
class Placement:
    profile: MigProfile
    start: int  # first memory slice

    @property
    def gpu_instance(self) -> int:
        """The GI id the driver gives an instance here (its swizzle id)."""
        return {8: 0, 4: 1, 2: 3, 1: 7}[self.profile.memory_slices] + self.start // self.profile.memory_slices


def profiles_for(gpu_name: str) -> dict[str, MigProfile] | None:
    """The MIG profiles of a GPU with this name; None when it has no MIG."""
    return next((table for model, table in PROFILES.items() if model in gpu_name), None)


def place(gpu_name: str, names: list[str] | tuple[str, ...]) -> list[Placement]:
    """Where GPU instances of these profiles go (in the order given). Raises ValueError, one line,
    for a GPU without MIG, an unknown profile, or a layout that does not fit."""
    table = profiles_for(gpu_name)
    if table is None:
        raise ValueError(f"{gpu_name!r} has no MIG (simulated MIG GPUs: {', '.join(PROFILES)})")
    unknown = [name for name in names if name not in table]
    if unknown:
        raise ValueError(f"no MIG profile {unknown[0]!r} on {gpu_name} (known: {', '.join(table)})")
    profiles = [table[name] for name in names]
    for profile in table.values():
        if (count := profiles.count(profile)) > profile.max_count:
            raise ValueError(f"{count} x {profile.name} do not fit: at most {profile.max_count} on {gpu_name}")
    if (compute := sum(p.compute_slices for p in profiles)) > COMPUTE_SLICES:
        raise ValueError(f"{' '.join(names)} take {compute} compute slices: a GPU has {COMPUTE_SLICES}")
    # Largest first, each at the lowest free placement, backtracking when the rest cannot fit.
    order = sorted(range(len(profiles)), key=lambda i: -profiles[i].memory_slices)
    starts = _fit([profiles[i] for i in order], used=0)
    if starts is None:
        raise ValueError(f"{' '.join(names)} do not fit in the {MEMORY_SLICES} memory slices of a GPU")
    placed = dict(zip(order, starts, strict=True))
    return [Placement(profile, placed[i]) for i, profile in enumerate(profiles)]


def _fit(profiles: list[MigProfile], used: int) -> list[int] | None:
    """Start slices for the profiles, none overlapping the memory slices set in `used`."""
    if not profiles:
        return []
    first, rest = profiles[0], profiles[1:]
    for start in first.starts:
        mask = ((1 << first.memory_slices) - 1) << start
        if not used & mask and (tail := _fit(rest, used | mask)) is not None:
            return [start, *tail]
    return None
