"""`gpuguard gpus [--json]`: the GPU inventory and how the GPUs are connected.

Asked of the daemon, so that every user sees it (NVML refuses a user every GPU they may not
open); root's falls back to NVML when no daemon answers. GPUs are listed and named by minor
number ("GPU 2" is /dev/nvidia2), the number every other gpuguard message uses; the NVML index is
shown only so it can be compared with nvidia-smi. A GPU in MIG mode is handed out as its slices,
listed under it by unit ("2/gi7/ci0").
"""
from __future__ import annotations

import argparse
import os
from collections import Counter
from typing import Any

from gpuguard import client, inventory
from gpuguard.cli import load_config, print_json, print_rows
from gpuguard.cli.calls import ask
from gpuguard.errors import EXIT_OK
from gpuguard.units import format_size

# nvidia-smi topo -m's abbreviations, which admins already know
_SHORT = {"NVLINK": "NV", "PCIE_SWITCH": "PIX", "NUMA_NODE": "NODE", "SYSTEM": "SYS", "X": "X"}
_LEGEND = "NV = NVLink, PIX = same PCIe switch, NODE = same NUMA node, SYS = across CPU sockets"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gpus", help="list GPUs, their use and topology")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=show_gpus)


def show_gpus(args: argparse.Namespace) -> int:
    try:
        found = ask(args, "gpus")
    except client.DaemonUnreachable:
        if os.geteuid() != 0:
            raise
        found = _from_nvml(args)  # root, with no daemon: NVML answers root for every GPU
    if args.json:
        print_json(found)
    else:
        _print_table(found["gpus"], found["topology"])
    return EXIT_OK


def _from_nvml(args: argparse.Namespace) -> dict[str, Any]:
    from gpuguard.backends import open_gpu_backend  # loads pynvml: only for commands that need it

    with open_gpu_backend(load_config(args)) as backend:
        gpus = backend.gpus()
        links = backend.topology()
        layout = backend.layout()
        processes = Counter(process.minor for process in backend.processes())
    return inventory.view(gpus, layout.slices, layout.unread, links, processes)


def _print_table(gpus: list[dict[str, Any]], topology: dict[str, dict[str, str]]) -> None:
    if not gpus:
        print("no GPUs")
        return
    rows = [["GPU", "INDEX", "NAME", "MEMORY USED", "TOTAL", "UTIL", "NUMA", "PROCS", "PCI BUS ID", "UUID"]]
    for gpu in gpus:
        mode = " (MIG: slices unreadable)" if gpu["mig_unread"] else " (MIG mode)" if gpu["mig_mode"] else ""
        rows.append([str(gpu["minor"]), str(gpu["index"]), gpu["name"] + mode, format_size(gpu["memory_used"]),
                     format_size(gpu["memory_total"]), _percent(gpu["utilization"]),
                     "-" if gpu["numa_node"] is None else str(gpu["numa_node"]), str(gpu["processes"]),
                     gpu["pci_bus_id"], gpu["uuid"]])
        for each in gpu["slices"]:  # indented under their GPU, by unit
            rows.append([f"  {each['label']}", "", f"  MIG {each['profile']}", format_size(each["memory_used"]),
                         format_size(each["memory_total"]), _percent(each["utilization"]), "", str(each["processes"]),
                         "", each["uuid"]])
    print_rows(rows)
    if len(gpus) > 1:
        print()
        print_rows([[""] + [f"GPU{b}" for b in topology]] +
                   [[f"GPU{a}"] + [_SHORT[link] for link in row.values()] for a, row in topology.items()])
        print(_LEGEND)


def _percent(value: int | None) -> str:
    return "-" if value is None else f"{value}%"
