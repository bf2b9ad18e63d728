"""Unit numbers: a whole GPU is its minor, a MIG slice a number of its own (model.py re-exports these).

A module without imports, so that the users' commands (whoami, status) can name units without
loading the model's dataclasses (model.py's import costs them more than Python's own start).
"""
from __future__ import annotations

# Unit numbers of MIG slices: SLICE_UNITS + (parent * GI_SLOTS + gi) * CI_SLOTS + ci. GPU
# instance ids run 0..14 and compute instance ids 0..7 (the driver's mig-minors table).
SLICE_UNITS = 1 << 16
GI_SLOTS, CI_SLOTS = 16, 8
_MINORS = 256  # /dev/nvidia0..255


def slice_unit(parent: int, gpu_instance: int, compute_instance: int) -> int:
    """The unit number of the slice (GPU instance, compute instance) of GPU `parent`."""
    if not (0 <= parent < _MINORS and 0 <= gpu_instance < GI_SLOTS and 0 <= compute_instance < CI_SLOTS):
        raise ValueError(f"no MIG slice gpu{parent}/gi{gpu_instance}/ci{compute_instance}")
    return SLICE_UNITS + (parent * GI_SLOTS + gpu_instance) * CI_SLOTS + compute_instance


def is_slice(unit: int) -> bool:
    return unit >= SLICE_UNITS


def slice_place(unit: int) -> tuple[int, int, int]:
    """(parent minor, GPU instance id, compute instance id) of a slice's unit number."""
    if not is_slice(unit):
        raise ValueError(f"unit {unit} is a whole GPU, not a MIG slice")
    rest, compute_instance = divmod(unit - SLICE_UNITS, CI_SLOTS)
    parent, gpu_instance = divmod(rest, GI_SLOTS)
    return parent, gpu_instance, compute_instance


def unit_parent(unit: int) -> int:
    """The minor of the GPU a unit is on: itself for a whole GPU."""
    return slice_place(unit)[0] if is_slice(unit) else unit


def unit_label(unit: int) -> str:
    """How people see a unit: "3" for GPU 3, "3/gi1/ci0" for a slice of it (mig-minors' naming)."""
    if not is_slice(unit):
        return str(unit)
    parent, gpu_instance, compute_instance = slice_place(unit)
    return f"{parent}/gi{gpu_instance}/ci{compute_instance}"


def parse_unit(text: str) -> int:
    """The unit number of "3" or "3/gi1/ci0"; raises ValueError."""
    parts = text.strip().split("/")
    if len(parts) == 1 and parts[0].isdigit():
        return int(parts[0])
    if (len(parts) == 3 and parts[0].isdigit() and parts[1].startswith("gi") and parts[1][2:].isdigit()
            and parts[2].startswith("ci") and parts[2][2:].isdigit()):
        return slice_unit(int(parts[0]), int(parts[1][2:]), int(parts[2][2:]))
    raise ValueError(f"not a GPU or MIG slice: {text!r} (expected e.g. 3 or 3/gi1/ci0)")
