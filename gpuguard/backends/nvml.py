"""GPU inventory, topology and processes from NVML (through NVIDIA's pynvml bindings).

Rules that matter here:
- A GPU is its minor number (nvmlDeviceGetMinorNumber, the N of /dev/nvidiaN), never its
  NVML index: NVML orders GPUs by PCI bus id, the driver numbers nodes in probe order.
- Every NVML failure raises GpuError or is reported per GPU. A failed process query must
  never look like an idle GPU: the watcher would release or hand out a GPU that is in use.
- One failing GPU must not blind gpuguard to the others: GPUs are queried one by one, a GPU
  that cannot be read at start is left out (its error in `unavailable`), and
  query_processes() names the GPUs it could not read. Only when no GPU answers is NVML
  itself taken to be failing, and that raises.
- A process's used memory may be unknown (NVML_VALUE_NOT_AVAILABLE); that is None, never 0.
- Process queries take milliseconds and serialize on the driver lock: callers poll them
  no faster than once a second.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import pynvml

from gpuguard.backends import GpuError
from gpuguard.model import Gpu, GpuProcess, GpuUse, Link

__all__ = ["GpuError", "NvmlBackend", "ProcessQuery"]

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


def _processes_of(handle: Any, minor: int) -> list[GpuProcess]:
    """Compute and graphics processes of one GPU, one entry per pid."""
    found: dict[int, GpuProcess] = {}
    for query in _PROCESS_QUERIES:
        for info in _call(query, handle, minor=minor):
            used = _known_memory(info.usedGpuMemory)
            seen = found.get(info.pid)
            if seen is not None and seen.used_memory is not None:
                # Listed as compute and graphics: both report the process's memory.
                used = max(seen.used_memory, used or 0)
            found[info.pid] = GpuProcess(pid=info.pid, minor=minor, used_memory=used)
    return list(found.values())


def _known_memory(used: int | None) -> int | None:
    # pynvml already maps NVML_VALUE_NOT_AVAILABLE to None in its process wrappers;
    # checking again keeps us right if a pynvml version stops doing so.
    if used is None or used == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        return None
    return used


class ProcessQuery(NamedTuple):
    processes: list[GpuProcess]  # of the GPUs in `read` only
    read: frozenset[int]         # minors whose processes were read
    failed: dict[int, str]       # minor -> NVML error, for GPUs whose processes could not be read


class NvmlBackend:
    """One NVML session. Device handles and minors are read once: they are fixed while
    NVML stays initialized (a GPU that falls off the bus makes calls on it fail)."""

    def __init__(self) -> None:
        _call(pynvml.nvmlInit)
        self._devices: list[tuple[int, Any, int]] = []  # (NVML index, handle, minor) per GPU, in NVML order
        self._unreachable: list[str] = []  # errors of the GPUs NVML gives no handle or minor for
        self._left_out: dict[int, str] = {}  # minor -> error, for the GPUs gpus() could not read
        try:
            for index in range(_call(pynvml.nvmlDeviceGetCount)):
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    self._devices.append((index, handle, pynvml.nvmlDeviceGetMinorNumber(handle)))
                except pynvml.NVMLError as exc:
                    self._unreachable.append(f"NVML cannot reach the GPU at NVML index {index}: {exc}")
            if self._unreachable and not self._devices:
                raise GpuError(self._unreachable[0])  # not one GPU answers: NVML itself fails
        except GpuError:
            with contextlib.suppress(pynvml.NVMLError):  # the first error is the one to report
                pynvml.nvmlShutdown()
            raise

    @property
    def unavailable(self) -> list[str]:
        """One error per GPU left out: not reachable at start, or not readable by gpus()."""
        return [*self._unreachable, *self._left_out.values()]

    def gpus(self) -> list[Gpu]:
        """The GPUs NVML can read. One it cannot is left out (see `unavailable`) and topology()
        skips it; raises GpuError only when no GPU can be read."""
        gpus = []
        self._left_out = {}
        for index, handle, minor in self._devices:
            try:
                gpus.append(self._gpu(index, handle, minor))
            except GpuError as exc:
                self._left_out[minor] = str(exc)
        if self._devices and not gpus:
            raise GpuError(next(iter(self._left_out.values())))  # not one GPU answers: NVML itself fails
        return gpus

    def _gpu(self, index: int, handle: Any, minor: int) -> Gpu:
        memory = _call(pynvml.nvmlDeviceGetMemoryInfo, handle, minor=minor)
        utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle, minor=minor)
        numa = _optional(pynvml.nvmlDeviceGetNumaNodeId, handle, minor=minor)
        return Gpu(
            index=index,
            minor=minor,
            uuid=_call(pynvml.nvmlDeviceGetUUID, handle, minor=minor),
            name=_call(pynvml.nvmlDeviceGetName, handle, minor=minor),
            pci_bus_id=_call(pynvml.nvmlDeviceGetPciInfo, handle, minor=minor).busId,  # pynvml decodes char arrays
            memory_total=memory.total,
            memory_used=memory.used,
            numa_node=numa if numa is not None and numa >= 0 else None,  # -1: no NUMA affinity
            utilization=utilization.gpu if utilization is not None else None,
        )

    def topology(self) -> dict[tuple[int, int], Link]:
        """How each pair of GPUs is connected, keyed (minor_a, minor_b) with minor_a < minor_b
        (GPUs that gpus() left out are skipped)."""
        links = {}
        devices = [d for d in self._devices if d[2] not in self._left_out]
        for (_, handle_a, minor_a), (_, handle_b, minor_b) in itertools.combinations(devices, 2):
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
        """Compute and graphics processes of every GPU, one entry per (pid, GPU). Raises
        GpuError when any GPU cannot be read (one NVML could not reach at start included)."""
        query = self.query_processes()
        errors = [*query.failed.values(), *self._unreachable]
        if errors:
            raise GpuError(errors[0])
        return query.processes

    def query_processes(self) -> ProcessQuery:
        """Each GPU's processes, queried GPU by GPU, with the GPUs that failed. Raises GpuError
        when none could be read: then NVML itself is failing."""
        found: list[GpuProcess] = []
        failed: dict[int, str] = {}
        for _, handle, minor in self._devices:
            try:
                found += _processes_of(handle, minor)
            except GpuError as exc:
                failed[minor] = str(exc)
        if self._devices and len(failed) == len(self._devices):
            raise GpuError(next(iter(failed.values())))  # not one GPU answers: NVML itself fails
        read = frozenset(minor for _, _, minor in self._devices) - failed.keys()
        return ProcessQuery(sorted(found, key=lambda p: (p.minor, p.pid)), read, failed)

    def use(self) -> dict[int, GpuUse]:
        """Memory and utilisation of each GPU that answers; one that fails is left out (no
        decision hangs on these numbers: they are for status and metrics)."""
        found = {}
        for _, handle, minor in self._devices:
            try:
                memory = _call(pynvml.nvmlDeviceGetMemoryInfo, handle, minor=minor)
                utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle, minor=minor)
            except GpuError:
                continue
            found[minor] = GpuUse(memory.used, memory.total, utilization.gpu if utilization is not None else None)
        return found

    def close(self) -> None:
        _call(pynvml.nvmlShutdown)

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
