"""GPU inventory, topology and processes from NVML (through NVIDIA's pynvml bindings).

Rules that matter here:
- A GPU is its minor number (nvmlDeviceGetMinorNumber, the N of /dev/nvidiaN), never its
  NVML index: NVML orders GPUs by PCI bus id, the driver numbers nodes in probe order.
- Every NVML failure raises GpuError. A failed process query must never look like an idle
  GPU: the watcher would release or hand out a GPU that is in use.
- A process's used memory may be unknown (NVML_VALUE_NOT_AVAILABLE); that is None, never 0.
- Process queries take milliseconds and serialize on the driver lock: callers poll them
  no faster than once a second.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from gpuguard.backends import GpuError
from gpuguard.model import Gpu, GpuProcess, Link

__all__ = ["GpuError", "NvmlBackend"]

T = TypeVar("T")

# NVML says "this GPU or driver cannot tell": the value is unknown, which is not an error.
_CANNOT_TELL = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

_PROCESS_QUERIES = (pynvml.nvmlDeviceGetComputeRunningProcesses_v3,
                    pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3)


def _call(fn: Callable[..., T], *args: Any, minor: int | None = None) -> T:
    """Call a pynvml function, turning its NVMLError into a one-line GpuError."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        where = f" on GPU {minor}" if minor is not None else ""
        raise GpuError(f"NVML {fn.__name__} failed{where}: {exc}") from None


def _optional(fn: Callable[..., T], *args: Any, minor: int) -> T | None:
    """Like _call, but None when NVML cannot tell on this GPU or driver."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        if exc.value in _CANNOT_TELL:
            return None
        raise GpuError(f"NVML {fn.__name__} failed on GPU {minor}: {exc}") from None


def _link_for_level(level: int | None) -> Link:
    """Map NVML's common-ancestor level onto the allocator's coarser Link scale."""
    if level is None:  # e.g. in some VMs NVML cannot tell: assume the worst path
        return Link.SYSTEM
    if level <= pynvml.NVML_TOPOLOGY_MULTIPLE:   # same board or behind PCIe switches
        return Link.PCIE_SWITCH
    if level <= pynvml.NVML_TOPOLOGY_NODE:       # same host bridge or NUMA node
        return Link.NUMA_NODE
    return Link.SYSTEM                           # across the CPU interconnect


def _known_memory(used: int | None) -> int | None:
    # pynvml already maps NVML_VALUE_NOT_AVAILABLE to None in its process wrappers;
    # checking again keeps us right if a pynvml version stops doing so.
    if used is None or used == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        return None
    return used


class NvmlBackend:
    """One NVML session. Device handles and minors are read once: they are fixed while
    NVML stays initialized (a GPU that falls off the bus makes calls fail, which raises)."""

    def __init__(self) -> None:
        _call(pynvml.nvmlInit)
        try:
            count = _call(pynvml.nvmlDeviceGetCount)
            handles = [_call(pynvml.nvmlDeviceGetHandleByIndex, index) for index in range(count)]
            # (NVML index, handle, minor) per GPU, in NVML order
            self._devices = [(index, handle, _call(pynvml.nvmlDeviceGetMinorNumber, handle))
                             for index, handle in enumerate(handles)]
        except GpuError:
            with contextlib.suppress(pynvml.NVMLError):  # the first error is the one to report
                pynvml.nvmlShutdown()
            raise

    def gpus(self) -> list[Gpu]:
        gpus = []
        for index, handle, minor in self._devices:
            memory = _call(pynvml.nvmlDeviceGetMemoryInfo, handle, minor=minor)
            utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle, minor=minor)
            numa = _optional(pynvml.nvmlDeviceGetNumaNodeId, handle, minor=minor)
            gpus.append(Gpu(
                index=index,
                minor=minor,
                uuid=_call(pynvml.nvmlDeviceGetUUID, handle, minor=minor),
                name=_call(pynvml.nvmlDeviceGetName, handle, minor=minor),
                pci_bus_id=_call(pynvml.nvmlDeviceGetPciInfo, handle, minor=minor).busId,  # pynvml decodes char arrays
                memory_total=memory.total,
                memory_used=memory.used,
                numa_node=numa if numa is not None and numa >= 0 else None,  # -1: no NUMA affinity
                utilization=utilization.gpu if utilization is not None else None,
            ))
        return gpus

    def topology(self) -> dict[tuple[int, int], Link]:
        """How each pair of GPUs is connected, keyed (minor_a, minor_b) with minor_a < minor_b."""
        links = {}
        for (_, handle_a, minor_a), (_, handle_b, minor_b) in itertools.combinations(self._devices, 2):
            # P2P-over-NVLink status also sees links through NVSwitches, where the remote end
            # of each link is the switch rather than the peer GPU.
            p2p = _optional(pynvml.nvmlDeviceGetP2PStatus, handle_a, handle_b,
                            pynvml.NVML_P2P_CAPS_INDEX_NVLINK, minor=minor_a)
            if p2p == pynvml.NVML_P2P_STATUS_OK:
                link = Link.NVLINK
            else:
                link = _link_for_level(_optional(pynvml.nvmlDeviceGetTopologyCommonAncestor,
                                                 handle_a, handle_b, minor=minor_a))
            links[(min(minor_a, minor_b), max(minor_a, minor_b))] = link
        return dict(sorted(links.items()))

    def processes(self) -> list[GpuProcess]:
        """Compute and graphics processes of every GPU, one entry per (pid, GPU)."""
        found: dict[tuple[int, int], GpuProcess] = {}
        for _, handle, minor in self._devices:
            for query in _PROCESS_QUERIES:
                for info in _call(query, handle, minor=minor):
                    used = _known_memory(info.usedGpuMemory)
                    seen = found.get((info.pid, minor))
                    if seen is not None and seen.used_memory is not None:
                        # Listed as compute and graphics: both report the process's memory.
                        used = max(seen.used_memory, used or 0)
                    found[(info.pid, minor)] = GpuProcess(pid=info.pid, minor=minor, used_memory=used)
        return sorted(found.values(), key=lambda p: (p.minor, p.pid))

    def close(self) -> None:
        _call(pynvml.nvmlShutdown)

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
