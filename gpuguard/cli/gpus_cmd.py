"""`gpuguard gpus [--json]`: the GPU inventory, who owns each GPU, and how the GPUs are connected.

A user's is asked of the daemon, so that every user sees it (NVML refuses a user every GPU they
may not open). Root's is read from NVML directly: root may open every GPU, also those Slurm or
Kubernetes own ([coexist]), whose MIG slices the daemon never reads. GPUs are listed and named by
minor number ("GPU 2" is /dev/nvidia2), the number every other gpuguard message uses; the NVML
index is shown only so it can be compared with nvidia-smi. A GPU in MIG mode is handed out as its
slices, listed under it by unit ("2/gi7/ci0").
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from gpuguard.cli import load_config, print_json, print_rows
from gpuguard.cli.calls import ask
from gpuguard.config import Config
from gpuguard.core import inventory
from gpuguard.core.errors import EXIT_OK
from gpuguard.core.quantities import format_size

# nvidia-smi topo -m's abbreviations, which admins already know
_SHORT = {"NVLINK": "NV", "PCIE_SWITCH": "PIX", "NUMA_NODE": "NODE", "SYSTEM": "SYS", "X": "X"}
_LEGEND = "NV = NVLink, PIX = same PCIe switch, NODE = same NUMA node, SYS = across CPU sockets"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("gpus", help="list GPUs, their use and topology",
                                   description="Every GPU (and MIG slice): its minor and NVML index, model, memory, "
                                               "who holds it and how it is linked to the others. "
                                               "Examples: gpuguard gpus; gpuguard gpus --json")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=show_gpus)


def show_gpus(args: argparse.Namespace) -> int:
    found = _from_nvml(args) if os.geteuid() == 0 else ask(args, "gpus")
    if args.json:
        print_json(found)
    else:
        _print_table(found["gpus"], found["topology"])
    return EXIT_OK


def _from_nvml(args: argparse.Namespace) -> dict[str, Any]:
    from gpuguard.backends import open_gpu_backend  # loads pynvml: only for commands that need it

    config = load_config(args)
    owners = _owners(config)
    with open_gpu_backend(config) as backend:
        gpus = backend.gpus()
        links = backend.topology()
        layout = backend.layout()
        processes = Counter(process.unit for process in backend.processes())
    return inventory.view(gpus, layout.slices, layout.unread, links, processes, owner=owners)


def _owners(config: Config) -> Callable[[int], str]:
    """Who owns each GPU (gpuguard.core.coexist, from gres.conf without asking scontrol: a listing must
    not wait on slurmctld); "?" for all, with a warning, where that cannot be told."""
    from gpuguard.backends import driver_minors, slurm
    from gpuguard.core.coexist import CoexistError
    try:
        ownership = slurm.ownership(config.coexist, driver_minors(config), ask_scontrol=False)
    except CoexistError as exc:
        print(f"gpuguard: warning: owners unknown: {exc.line()}", file=sys.stderr)
        return lambda minor: "?"
    return lambda minor: str(ownership.owner(minor))


def _print_table(gpus: list[dict[str, Any]], topology: dict[str, dict[str, str]]) -> None:
    if not gpus:
        print("no GPUs")
        return
    rows = [["GPU", "INDEX", "NAME", "MEMORY USED", "TOTAL", "UTIL", "NUMA", "PROCS", "PCI BUS ID", "UUID", "OWNER"]]
    for gpu in gpus:
        mode = " (MIG: slices unreadable)" if gpu["mig_unread"] else " (MIG mode)" if gpu["mig_mode"] else ""
        rows.append([str(gpu["minor"]), str(gpu["index"]), gpu["name"] + mode, _size(gpu["memory_used"]),
                     _size(gpu["memory_total"]), _percent(gpu["utilization"]),
                     _text(gpu["numa_node"]), _text(gpu["processes"]), _text(gpu["pci_bus_id"]), gpu["uuid"],
                     gpu["owner"]])
        for each in gpu["slices"]:  # indented under their GPU, by unit
            rows.append([f"  {each['label']}", "", f"  MIG {each['profile']}", _size(each["memory_used"]),
                         _size(each["memory_total"]), _percent(each["utilization"]), "", str(each["processes"]),
                         "", each["uuid"], ""])
    print_rows(rows)
    if len(topology) > 1:
        print()
        print_rows([[""] + [f"GPU{b}" for b in topology]] +
                   [[f"GPU{a}"] + [_SHORT[link] for link in row.values()] for a, row in topology.items()])
        print(_LEGEND)


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def _percent(value: int | None) -> str:
    return "-" if value is None else f"{value}%"
