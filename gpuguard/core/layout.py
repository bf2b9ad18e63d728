"""MIG layouts: what can be handed out, and which grants a change of layout ends. Pure.

The layout is the admin's (`nvidia-smi mig ...`); gpuguard only follows it. A GPU in MIG mode is
handed out as its slices, never whole. GPU instance ids are reused after a layout change, and
the capability nodes the driver checks belong to the ids (gpu<N>/gi<G>/access), not to the
slice: a grant left on a destroyed slice would open whatever slice is created next under its
ids. So a grant ends when its slice is gone or is another one now (another UUID, or none on
record for it), and a grant of a whole GPU ends when the GPU goes into MIG mode. A GPU whose MIG
state NVML could not read decides nothing: its grants stay, as they do for a GPU whose processes
cannot be read.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from gpuguard.core.model import Gpu, Grant, is_slice, unit_label, unit_parent


def grantable(gpus: Iterable[Gpu], slices: Iterable[Gpu]) -> dict[int, Gpu]:
    """unit -> unit: the GPUs not in MIG mode, and the slices."""
    units = {gpu.unit: gpu for gpu in gpus if not gpu.mig_mode and gpu.slice is None}
    return units | {piece.unit: piece for piece in slices}


def stale(grants: Iterable[Grant], units: Mapping[int, Gpu], read: Collection[int]) -> dict[Grant, str]:
    """The grants the layout in `units` ends, each with why in words. read: the GPUs (minors)
    whose MIG state was read; a grant on any other GPU stays."""
    ended = {}
    for grant in grants:
        if unit_parent(grant.unit) not in read:
            continue
        unit = units.get(grant.unit)
        if unit is None:
            ended[grant] = (f"MIG slice {unit_label(grant.unit)} is gone (the MIG layout changed)"
                            if grant.unit != unit_parent(grant.unit)
                            else f"GPU {grant.unit} is in MIG mode now: it is handed out as slices only")
        elif unit.uuid != grant.uuid and (grant.uuid or is_slice(grant.unit)):  # a slice's grant always has one
            ended[grant] = f"MIG slice {unit_label(grant.unit)} was re-created as another slice (the MIG layout changed)"
    return ended
