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
- MIG: a GPU in MIG mode is handed out as its slices (NVML's MIG devices), each a `Gpu` whose
  minor is its unit number (model.slice_unit) and whose MigSlice names the capability minors
  the driver checks (mig_caps). layout() reads them; a GPU whose mode or slices cannot be read,
  or a slice whose capabilities the driver does not list, makes its GPU `unread`: fail closed.
  NVML places each process of a MIG GPU in its slice (gpuInstanceId, computeInstanceId), and
  cannot tell a MIG device's utilization (None).
- Process queries take milliseconds and serialize on the driver lock: callers poll them
  no faster than once a second.
"""
from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import pynvml

from gpuguard.backends import GpuError, mig_caps
from gpuguard.core.model import MIG_PROFILE, Gpu, GpuProcess, GpuUse, Link, MigSlice, slice_unit

__all__ = ["GpuError", "MigLayout", "NvmlBackend", "ProcessQuery"]

T = TypeVar("T")

# NVML says "this GPU or driver cannot tell": the value is unknown, which is not an error.
_CANNOT_TELL = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

_NO_MIG_ID = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of a process NVML places in no MIG slice
_PROFILE_IN_NAME = re.compile(rf" MIG ({MIG_PROFILE.pattern})$")  # "NVIDIA H100 80GB HBM3 MIG 1g.10gb"

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
    """Compute and graphics processes of one GPU, one entry per pid, each on its MIG slice's
    unit when NVML places it in one."""
    found: dict[int, GpuProcess] = {}
    for query in _PROCESS_QUERIES:
        for info in _call(query, handle, minor=minor):
            used = _known_memory(info.usedGpuMemory)
            seen = found.get(info.pid)
            if seen is not None and seen.used_memory is not None:
                # Listed as compute and graphics: both report the process's memory.
                used = max(seen.used_memory, used or 0)
            found[info.pid] = GpuProcess(pid=info.pid, unit=_unit_of(info, minor), used_memory=used)
    return list(found.values())


def _unit_of(info: Any, minor: int) -> int:
    """The unit a process runs on: its MIG slice's when NVML names both instance ids, else the GPU."""
    gpu_instance = getattr(info, "gpuInstanceId", _NO_MIG_ID)
    compute_instance = getattr(info, "computeInstanceId", _NO_MIG_ID)
    if _NO_MIG_ID in (gpu_instance, compute_instance):
        return minor
    try:
        return slice_unit(minor, gpu_instance, compute_instance)
    except ValueError:  # ids past the driver's table: no slice gpuguard can name
        return minor


def _known_memory(used: int | None) -> int | None:
    # pynvml already maps NVML_VALUE_NOT_AVAILABLE to None in its process wrappers;
    # checking again keeps us right if a pynvml version stops doing so.
    if used is None or used == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        return None
    return used


class ProcessQuery(NamedTuple):
    processes: list[GpuProcess]  # of the GPUs in `read` only
    read: frozenset[int]         # units whose processes were read: GPU minors, and the slices (of the
                                 # last layout()) of the GPUs read
    failed: dict[int, str]       # minor -> NVML error, for GPUs whose processes could not be read


class MigLayout(NamedTuple):
    slices: list[Gpu]            # every slice of the GPUs in mig_gpus and not in unread, by unit number
    mig_gpus: frozenset[int]     # minors of the GPUs in MIG mode now
    unread: frozenset[int]       # minors of GPUs whose MIG mode or slices (or their capabilities) could
                                 # not be read: decide nothing about them


def _profile(name: str, mig: Any, minor: int) -> str:
    """A slice's profile ("1g.10gb"): from the end of NVML's name for it, else from its attributes."""
    if match := _PROFILE_IN_NAME.search(name):
        return match[1]
    attributes = _call(pynvml.nvmlDeviceGetAttributes, mig, minor=minor)
    return f"{attributes.gpuInstanceSliceCount}g.{round(attributes.memorySizeMB / 1024)}gb"


class NvmlBackend:
    """One NVML session. Device handles and minors are read once: they are fixed while
    NVML stays initialized (a GPU that falls off the bus makes calls on it fail)."""

    def __init__(self, mig_minors: Path = mig_caps.MIG_MINORS) -> None:
        self._mig_minors_path = mig_minors
        self._caps: dict[str, int] = {}  # the driver's capability table: fixed while it is loaded
        self._slice_handles: dict[int, tuple[int, Any]] = {}  # unit -> (parent minor, MIG device handle), last layout()
        self._locations: dict[int, tuple[str, int | None]] = {}  # minor -> (PCI bus id, NUMA node)
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
        pci_bus_id, numa = self._location(handle, minor)
        return Gpu(
            index=index,
            unit=minor,  # a whole GPU's unit is its minor
            uuid=_call(pynvml.nvmlDeviceGetUUID, handle, minor=minor),
            name=_call(pynvml.nvmlDeviceGetName, handle, minor=minor),
            pci_bus_id=pci_bus_id,
            memory_total=memory.total,
            memory_used=memory.used,
            numa_node=numa,
            utilization=utilization.gpu if utilization is not None else None,
            mig_mode=self._mig_mode(handle, minor),
        )

    def _location(self, handle: Any, minor: int) -> tuple[str, int | None]:
        """PCI bus id and NUMA node of a GPU (its slices share them); they never change, so read once."""
        if minor not in self._locations:
            numa = _optional(pynvml.nvmlDeviceGetNumaNodeId, handle, minor=minor)
            self._locations[minor] = (
                _call(pynvml.nvmlDeviceGetPciInfo, handle, minor=minor).busId,  # pynvml decodes char arrays
                numa if numa is not None and numa >= 0 else None)  # -1: no NUMA affinity
        return self._locations[minor]

    @staticmethod
    def _mig_mode(handle: Any, minor: int) -> bool:
        """Whether MIG is enabled now (the current mode; a pending one takes effect at reset)."""
        modes = _optional(pynvml.nvmlDeviceGetMigMode, handle, minor=minor)  # a GPU without MIG cannot tell
        return modes is not None and modes[0] == pynvml.NVML_DEVICE_MIG_ENABLE

    def layout(self) -> MigLayout:
        """The MIG slices of every GPU in MIG mode. Cheap enough for every watcher tick: one mode
        query per GPU, MIG devices only for GPUs in MIG mode."""
        slices: list[Gpu] = []
        handles: dict[int, tuple[int, Any]] = {}
        mig_gpus: set[int] = set()
        unread: set[int] = set()
        for index, handle, minor in self._devices:
            try:
                if not self._mig_mode(handle, minor):
                    continue
                mig_gpus.add(minor)
                found = self._slices_of(index, handle, minor)
            except GpuError:
                unread.add(minor)
                continue
            if any(gpu.slice is None for gpu, _ in found):  # a slice the driver lists no capabilities for
                unread.add(minor)
                continue
            for gpu, mig_handle in found:
                slices.append(gpu)
                handles[gpu.unit] = (minor, mig_handle)
        self._slice_handles = handles
        return MigLayout(sorted(slices, key=lambda gpu: gpu.unit), frozenset(mig_gpus), frozenset(unread))

    def _slices_of(self, index: int, handle: Any, minor: int) -> list[tuple[Gpu, Any]]:
        """The MIG devices of one GPU in MIG mode, with their handles; a slice whose capabilities the
        driver does not list has slice None. Raises GpuError."""
        pci_bus_id, numa = self._location(handle, minor)
        found = []
        for place in range(_call(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle, minor=minor)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, place)
            except pynvml.NVMLError_NotFound:
                continue  # an empty place
            except pynvml.NVMLError as exc:
                raise GpuError(f"NVML nvmlDeviceGetMigDeviceHandleByIndex failed on GPU {minor}: {exc}") from None
            found.append((self._slice(index, minor, pci_bus_id, numa, mig), mig))
        return found

    def _slice(self, index: int, minor: int, pci_bus_id: str, numa: int | None, mig: Any) -> Gpu:
        gpu_instance = _call(pynvml.nvmlDeviceGetGpuInstanceId, mig, minor=minor)
        compute_instance = _call(pynvml.nvmlDeviceGetComputeInstanceId, mig, minor=minor)
        name = _call(pynvml.nvmlDeviceGetName, mig, minor=minor)
        memory = _call(pynvml.nvmlDeviceGetMemoryInfo, mig, minor=minor)
        utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, mig, minor=minor)
        try:
            unit = slice_unit(minor, gpu_instance, compute_instance)
        except ValueError:
            raise GpuError(f"NVML names MIG slice gi{gpu_instance}/ci{compute_instance} on GPU {minor}, "
                           "past the driver's table") from None
        caps = self._slice_caps(minor, gpu_instance, compute_instance)
        return Gpu(
            index=index,
            unit=unit,
            uuid=_call(pynvml.nvmlDeviceGetUUID, mig, minor=minor),
            name=name,
            pci_bus_id=pci_bus_id,
            memory_total=memory.total,
            memory_used=memory.used,
            numa_node=numa,
            utilization=utilization.gpu if utilization is not None else None,
            slice=None if caps is None else MigSlice(minor, gpu_instance, compute_instance,
                                                     _profile(name, mig, minor), caps),
        )

    def _slice_caps(self, minor: int, gpu_instance: int, compute_instance: int) -> tuple[int, int] | None:
        caps = mig_caps.slice_caps(self._caps, minor, gpu_instance, compute_instance)
        if caps is None:  # not read yet, or the driver (nvidia-caps) loaded since
            try:
                self._caps = mig_caps.read_mig_minors(self._mig_minors_path)
            except OSError as exc:
                raise GpuError(f"cannot read {self._mig_minors_path}: {exc.strerror}") from None
            caps = mig_caps.slice_caps(self._caps, minor, gpu_instance, compute_instance)
        return caps

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
        read |= {unit for unit, (parent, _) in self._slice_handles.items() if parent in read}
        return ProcessQuery(sorted(found, key=lambda p: (p.unit, p.pid)), read, failed)

    def use(self) -> dict[int, GpuUse]:
        """Memory and utilisation of each GPU that answers; one that fails is left out (no
        decision hangs on these numbers: they are for status and metrics)."""
        devices = [(minor, handle, minor) for _, handle, minor in self._devices]
        devices += [(unit, handle, parent) for unit, (parent, handle) in self._slice_handles.items()]
        found = {}
        for unit, handle, minor in devices:  # the GPUs, and the slices of the last layout()
            try:
                memory = _call(pynvml.nvmlDeviceGetMemoryInfo, handle, minor=minor)
                utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle, minor=minor)
            except GpuError:
                continue
            found[unit] = GpuUse(memory.used, memory.total, utilization.gpu if utilization is not None else None)
        return found

    def close(self) -> None:
        _call(pynvml.nvmlShutdown)

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
