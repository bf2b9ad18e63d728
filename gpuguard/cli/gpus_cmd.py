"""`gpuguard gpus [--json]`: the GPU inventory and how the GPUs are connected.

GPUs are listed and named by minor number ("GPU 2" is /dev/nvidia2), the number every other
gpuguard message uses; the NVML index is shown only so it can be compared with nvidia-smi.
"""
from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from gpuguard.cli import load_config, print_json, print_rows
from gpuguard.errors import EXIT_OK
from gpuguard.model import Gpu, Link
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

    with open_gpu_backend(load_config(args)) as backend:
        gpus = sorted(backend.gpus(), key=lambda gpu: gpu.minor)
        links = backend.topology()
        processes = Counter(process.minor for process in backend.processes())
    matrix = _matrix([gpu.minor for gpu in gpus], links)
    if args.json:
        print_json({
            "gpus": [{**_fields(gpu), "processes": processes[gpu.minor]} for gpu in gpus],
            # topology[a][b]: how GPU a reaches GPU b ("X": itself), keyed by minor
            "topology": {str(a): {str(b): link for b, link in row.items()} for a, row in matrix.items()},
        })
    else:
        _print_table(gpus, processes, matrix)
    return EXIT_OK


def _fields(gpu: Gpu) -> dict[str, Any]:
    return {"index": gpu.index, "minor": gpu.minor, "uuid": gpu.uuid, "name": gpu.name,
            "pci_bus_id": gpu.pci_bus_id, "memory_total": gpu.memory_total, "memory_used": gpu.memory_used,
            "numa_node": gpu.numa_node, "utilization": gpu.utilization}


def _matrix(minors: list[int], links: dict[tuple[int, int], Link]) -> dict[int, dict[int, str]]:
    return {a: {b: "X" if a == b else links[min(a, b), max(a, b)].name for b in minors} for a in minors}


def _print_table(gpus: list[Gpu], processes: Counter, matrix: dict[int, dict[int, str]]) -> None:
    if not gpus:
        print("no GPUs")
        return
    rows = [["GPU", "INDEX", "NAME", "MEMORY USED", "TOTAL", "UTIL", "NUMA", "PROCS", "PCI BUS ID", "UUID"]]
    for gpu in gpus:
        rows.append([str(gpu.minor), str(gpu.index), gpu.name, format_size(gpu.memory_used),
                     format_size(gpu.memory_total), "-" if gpu.utilization is None else f"{gpu.utilization}%",
                     "-" if gpu.numa_node is None else str(gpu.numa_node), str(processes[gpu.minor]),
                     gpu.pci_bus_id, gpu.uuid])
    print_rows(rows)
    if len(gpus) > 1:
        print()
        short = {link.name: abbreviation for link, abbreviation in _SHORT.items()} | {"X": "X"}
        print_rows([[""] + [f"GPU{b}" for b in matrix]] +
                    [[f"GPU{a}"] + [short[name] for name in row.values()] for a, row in matrix.items()])
        print(_LEGEND)
