"""`gpuguard gpus [--json]`: the GPU inventory and how the GPUs are connected.

GPUs are listed and named by minor number ("GPU 2" is /dev/nvidia2), the number every other
gpuguard message uses; the NVML index is shown only so it can be compared with nvidia-smi.
A GPU in MIG mode is handed out as its slices, listed under it by unit ("2/gi7/ci0").
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from gpuguard.cli import load_config, print_json, print_rows
from gpuguard.config import Config
from gpuguard.errors import EXIT_OK
from gpuguard.model import Gpu, Link, unit_label
from gpuguard.units import format_size

# nvidia-smi topo -m's abbreviations, which admins already know
_SHORT = {Link.NVLINK: "NV", Link.PCIE_SWITCH: "PIX", Link.NUMA_NODE: "NODE", Link.SYSTEM: "SYS"}
_LEGEND = "NV = NVLink, PIX = same PCIe switch, NODE = same NUMA node, SYS = across CPU sockets"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gpus", help="list GPUs, their use and topology")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=show_gpus)


def show_gpus(args: argparse.Namespace) -> int:
    from gpuguard.backends import open_gpu_backend  # loads pynvml: only for commands that need it

    config = load_config(args)
    owners = _owners(config)
    with open_gpu_backend(config) as backend:
        gpus = sorted(backend.gpus(), key=lambda gpu: gpu.minor)
        links = backend.topology()
        layout = backend.layout()
        processes = Counter(process.minor for process in backend.processes())
    slices = {gpu.minor: [s for s in layout.slices if s.slice and s.slice.parent == gpu.minor] for gpu in gpus}
    matrix = _matrix([gpu.minor for gpu in gpus], links)
    if args.json:
        print_json({
            "gpus": [{**_fields(gpu), "owner": owners(gpu.minor), "processes": processes[gpu.minor],
                      "mig_unread": gpu.minor in layout.unread,
                      "slices": [{**_slice_fields(s), "processes": processes[s.minor]} for s in slices[gpu.minor]]}
                     for gpu in gpus],
            # topology[a][b]: how GPU a reaches GPU b ("X": itself), keyed by minor
            "topology": {str(a): {str(b): link for b, link in row.items()} for a, row in matrix.items()},
        })
    else:
        _print_table(gpus, slices, layout.unread, processes, matrix, owners)
    return EXIT_OK


def _owners(config: Config) -> Callable[[int], str]:
    """Who owns each GPU (gpuguard.coexist, from gres.conf without asking scontrol: a listing must
    not wait on slurmctld); "?" for all, with a warning, where that cannot be told."""
    from gpuguard.backends import driver_minors, slurm
    from gpuguard.coexist import CoexistError
    try:
        ownership = slurm.ownership(config.coexist, driver_minors(config), ask_scontrol=False)
    except CoexistError as exc:
        print(f"gpuguard: warning: owners unknown: {exc.line()}", file=sys.stderr)
        return lambda minor: "?"
    return lambda minor: str(ownership.owner(minor))


def _fields(gpu: Gpu) -> dict[str, Any]:
    return {"index": gpu.index, "minor": gpu.minor, "uuid": gpu.uuid, "name": gpu.name,
            "pci_bus_id": gpu.pci_bus_id, "memory_total": gpu.memory_total, "memory_used": gpu.memory_used,
            "numa_node": gpu.numa_node, "utilization": gpu.utilization, "mig_mode": gpu.mig_mode}


def _slice_fields(gpu: Gpu) -> dict[str, Any]:
    assert gpu.slice is not None  # layout() lists slices only
    return {"unit": gpu.minor, "label": unit_label(gpu.minor), "uuid": gpu.uuid, "name": gpu.name,
            "profile": gpu.slice.profile, "gpu_instance": gpu.slice.gpu_instance,
            "compute_instance": gpu.slice.compute_instance, "caps": list(gpu.slice.caps),
            "memory_total": gpu.memory_total, "memory_used": gpu.memory_used, "utilization": gpu.utilization}


def _matrix(minors: list[int], links: dict[tuple[int, int], Link]) -> dict[int, dict[int, str]]:
    return {a: {b: "X" if a == b else links[min(a, b), max(a, b)].name for b in minors} for a in minors}


def _print_table(gpus: list[Gpu], slices: dict[int, list[Gpu]], unread: frozenset[int], processes: Counter,
                 matrix: dict[int, dict[int, str]], owners: Callable[[int], str]) -> None:
    if not gpus:
        print("no GPUs")
        return
    rows = [["GPU", "INDEX", "NAME", "MEMORY USED", "TOTAL", "UTIL", "NUMA", "PROCS", "PCI BUS ID", "UUID", "OWNER"]]
    for gpu in gpus:
        mode = " (MIG: slices unreadable)" if gpu.minor in unread else " (MIG mode)" if gpu.mig_mode else ""
        rows.append([str(gpu.minor), str(gpu.index), gpu.name + mode, format_size(gpu.memory_used),
                     format_size(gpu.memory_total), _percent(gpu.utilization),
                     "-" if gpu.numa_node is None else str(gpu.numa_node), str(processes[gpu.minor]),
                     gpu.pci_bus_id, gpu.uuid, owners(gpu.minor)])
        for each in slices[gpu.minor]:  # indented under their GPU, by unit
            profile = each.slice.profile if each.slice else "?"
            rows.append([f"  {unit_label(each.minor)}", "", f"  MIG {profile}", format_size(each.memory_used),
                         format_size(each.memory_total), _percent(each.utilization), "", str(processes[each.minor]),
                         "", each.uuid, ""])
    print_rows(rows)
    if len(gpus) > 1:
        print()
        short = {link.name: abbreviation for link, abbreviation in _SHORT.items()} | {"X": "X"}
        print_rows([[""] + [f"GPU{b}" for b in matrix]] +
                    [[f"GPU{a}"] + [short[name] for name in row.values()] for a, row in matrix.items()])
        print(_LEGEND)


def _percent(value: int | None) -> str:
    return "-" if value is None else f"{value}%"
