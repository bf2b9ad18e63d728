"""`gpuguard gpus [--json]`: the GPU inventory, who owns each GPU, and how the GPUs are connected.

A user's is asked of the daemon, so that every user sees it (NVML refuses a user every GPU they
may not open). Root's is read from NVML directly: root may open every GPU, also those Slurm or
Kubernetes own ([coexist]), whose MIG slices the daemon never reads. GPUs are listed and named by
minor number ("GPU 2" is /dev/nvidia2), the number every other gpuguard message uses; the NVML
index is shown only so it can be compared with nvidia-smi. A GPU in MIG mode is handed out as its
slices, listed under it by unit ("2/gi7/ci0"). A shared GPU's fractions (the memory promised to
each sharer) and the memory left to promise come from the daemon, also for root.
"""
from __future__ import annotations

import os
import sys

from gpuguard.cli import load_config, print_json, print_rows, summary
from gpuguard.cli.calls import ask
from gpuguard.core.errors import EXIT_OK
from gpuguard.core.quantities import format_size

TYPE_CHECKING = False  # not typing's: a user's `gpus` asks the daemon, and needs no config, NVML or model
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from typing import Any

    from gpuguard.config import Config

# nvidia-smi topo -m's abbreviations, which admins already know
_SHORT = {"NVLINK": "NV", "PCIE_SWITCH": "PIX", "NUMA_NODE": "NODE", "SYSTEM": "SYS", "X": "X"}
CSV_COLUMNS = ("gpu", "index", "name", "mig", "memory_used_bytes", "memory_total_bytes", "utilization_percent",
               "numa_node", "processes", "pci_bus_id", "uuid", "owner")
FRACTIONS_WAIT = 5.0  # seconds root's `gpus` waits for the daemon's fractions: NVML's view needs no daemon
_LEGEND = "NV = NVLink, PIX = same PCIe switch, NODE = same NUMA node, SYS = across CPU sockets"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("gpus", help=summary("gpus"),
                                   description="Every GPU (and MIG slice): its minor and NVML index, model, memory, "
                                               "who holds it and how it is linked to the others. "
                                               "Examples: gpuguard gpus; gpuguard gpus --csv",
                                   epilog=f"--csv columns: {','.join(CSV_COLUMNS)} (a MIG slice's row: its unit as "
                                          "gpu, its profile as mig; a GPU's mig: mode, unread or empty)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON")
    output.add_argument("--csv", action="store_true", help="print CSV, one line per GPU and MIG slice, after a header")
    parser.set_defaults(func=show_gpus)


def show_gpus(args: argparse.Namespace) -> int:
    found = _with_fractions(args, _from_nvml(args)) if os.geteuid() == 0 else ask(args, "gpus")
    if args.json:
        print_json(found)
    elif args.csv:
        import csv
        csv.writer(sys.stdout, lineterminator="\n").writerows([CSV_COLUMNS, *csv_rows(found["gpus"])])
    else:
        _print_table(found["gpus"], found["topology"])
    return EXIT_OK


def csv_rows(gpus: list[dict[str, Any]]) -> list[list[Any]]:
    """A row per GPU and one per MIG slice after it, numbers in bytes and percent, empty where unknown."""
    rows = []
    for gpu in gpus:
        mig = "unread" if gpu["mig_unread"] else "mode" if gpu["mig_mode"] else ""
        rows.append([gpu["minor"], gpu["index"], gpu["name"], mig, *_blanks(gpu, "memory_used", "memory_total",
                     "utilization", "numa_node", "processes", "pci_bus_id", "uuid", "owner")])
        rows += [[each["label"], "", gpu["name"], each["profile"], *_blanks(each, "memory_used", "memory_total",
                  "utilization"), "", each["processes"], "", each["uuid"], gpu["owner"]] for each in gpu["slices"]]
    return rows


def _blanks(record: dict[str, Any], *keys: str) -> list[Any]:
    return ["" if record[key] is None else record[key] for key in keys]


def _from_nvml(args: argparse.Namespace) -> dict[str, Any]:
    from collections import Counter

    from gpuguard.backends import open_gpu_backend  # loads pynvml: only for commands that need it
    from gpuguard.core import inventory

    config = load_config(args)
    owners = _owners(config)
    with open_gpu_backend(config) as backend:
        gpus = backend.gpus()
        links = backend.topology()
        layout = backend.layout()
        processes = Counter(process.unit for process in backend.processes())
    return inventory.view(gpus, layout.slices, layout.unread, links, processes, owner=owners)


def _with_fractions(args: argparse.Namespace, found: dict[str, Any]) -> dict[str, Any]:
    """NVML's view with each GPU's fractions and memory left, as the daemon's own `gpus` says them
    (NVML knows nothing of promises); unknown (None) while no daemon answers within FRACTIONS_WAIT."""
    from gpuguard import client
    from gpuguard.cli.calls import socket_of
    from gpuguard.core.errors import GpuguardError
    try:
        said = {gpu["minor"]: gpu for gpu in client.call(socket_of(args)[0], "gpus", timeout=FRACTIONS_WAIT)["gpus"]}
    except GpuguardError:
        said = {}
    for gpu in found["gpus"]:
        known = said.get(gpu["minor"], {})
        gpu.update(fractions=known.get("fractions", []), memory_promised=known.get("memory_promised"),
                   memory_left=known.get("memory_left"))
    return found


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
    from gpuguard.cli.status_cmd import fraction_words

    # LEFT: memory left to promise to sharers; SHARED: the fractions, each holder's promised memory
    rows = [["GPU", "INDEX", "NAME", "MEMORY USED", "TOTAL", "LEFT", "UTIL", "NUMA", "PROCS", "PCI BUS ID", "UUID",
             "OWNER", "SHARED"]]
    for gpu in gpus:
        mode = " (MIG: slices unreadable)" if gpu["mig_unread"] else " (MIG mode)" if gpu["mig_mode"] else ""
        rows.append([str(gpu["minor"]), str(gpu["index"]), gpu["name"] + mode, _size(gpu["memory_used"]),
                     _size(gpu["memory_total"]), _size(gpu.get("memory_left")), _percent(gpu["utilization"]),
                     _text(gpu["numa_node"]), _text(gpu["processes"]), _text(gpu["pci_bus_id"]), gpu["uuid"],
                     gpu["owner"], fraction_words(gpu.get("fractions") or []) or "-"])
        for each in gpu["slices"]:  # indented under their GPU, by unit
            rows.append([f"  {each['label']}", "", f"  MIG {each['profile']}", _size(each["memory_used"]),
                         _size(each["memory_total"]), "", _percent(each["utilization"]), "", str(each["processes"]),
                         "", each["uuid"], "", ""])
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
