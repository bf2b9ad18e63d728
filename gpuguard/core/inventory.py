"""What `gpuguard gpus` shows: the GPUs, their MIG slices, their use and how they are linked (pure).

The daemon builds it from what it has read already (the GPUs at start, the MIG layout and the
use of its last sample), so any user can ask it: NVML itself refuses a user the GPUs they may not
open. Root's `gpuguard gpus` builds the same view from NVML directly when no daemon answers.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpuguard.core.model import Gpu, GpuUse, Link, unit_label

GPUGUARD = "gpuguard"  # the owner of the GPUs the daemon hands out (coexist.Owner.GPUGUARD)


def view(gpus: Iterable[Gpu], slices: Iterable[Gpu], unread: Iterable[int], topology: Mapping[tuple[int, int], Link],
         processes: Counter[int], use: Mapping[int, GpuUse] | None = None,
         owner: Callable[[int], str] = lambda minor: GPUGUARD) -> dict[str, Any]:
    """{"gpus": [...], "topology": {a: {b: link}}}; `use`: memory and utilisation newer than the
    Gpu objects' own (a sample's), by unit; `owner`: who owns each GPU (coexist.Owner's words)."""
    ordered = sorted(gpus, key=lambda gpu: gpu.unit)
    unread = frozenset(unread)
    under: dict[int, list[Gpu]] = {gpu.unit: [] for gpu in ordered}
    for each in sorted(slices, key=lambda s: s.unit):
        if each.slice is not None and each.slice.parent in under:
            under[each.slice.parent].append(each)
    use = use or {}
    minors = [gpu.unit for gpu in ordered]
    return {
        "gpus": [{**_fields(gpu, use.get(gpu.unit)), "processes": processes[gpu.unit], "mig_unread": gpu.unit in unread,
                  "owner": owner(gpu.unit),
                  "slices": [{**_slice_fields(s, use.get(s.unit)), "processes": processes[s.unit]}
                             for s in under[gpu.unit]]}
                 for gpu in ordered],
        # topology[a][b]: how GPU a reaches GPU b ("X": itself), keyed by minor
        "topology": {str(a): {str(b): "X" if a == b else topology[min(a, b), max(a, b)].name for b in minors}
                     for a in minors},
    }


def foreign(entries: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the GPUs Slurm or Kubernetes own, from their `status` entries (coexist.status_entries):
    what the daemon read of them at start; their use and slices are their owner's business."""
    return [{"index": entry["index"], "minor": entry["minor"], "uuid": entry["uuid"], "name": entry["name"],
             "pci_bus_id": None, "memory_total": entry["memory_total"], "memory_used": None, "utilization": None,
             "numa_node": None, "mig_mode": False, "processes": None, "mig_unread": False, "slices": [],
             "owner": entry["owner"]} for entry in entries]


def _numbers(gpu: Gpu, use: GpuUse | None) -> dict[str, Any]:
    if use is None:
        return {"memory_total": gpu.memory_total, "memory_used": gpu.memory_used, "utilization": gpu.utilization}
    return {"memory_total": use.memory_total, "memory_used": use.memory_used, "utilization": use.utilization}


def _fields(gpu: Gpu, use: GpuUse | None) -> dict[str, Any]:
    return {"index": gpu.index, "minor": gpu.unit, "uuid": gpu.uuid, "name": gpu.name,
            "pci_bus_id": gpu.pci_bus_id, **_numbers(gpu, use), "numa_node": gpu.numa_node, "mig_mode": gpu.mig_mode}


def _slice_fields(gpu: Gpu, use: GpuUse | None) -> dict[str, Any]:
    assert gpu.slice is not None  # listed under their GPU: slices only
    return {"unit": gpu.unit, "label": unit_label(gpu.unit), "uuid": gpu.uuid, "name": gpu.name,
            "profile": gpu.slice.profile, "gpu_instance": gpu.slice.gpu_instance,
            "compute_instance": gpu.slice.compute_instance, "caps": list(gpu.slice.caps), **_numbers(gpu, use)}
