"""The fake libnvidia-ml.so: NVIDIA's pynvml calls its C functions through ctypes exactly as it
calls the real library's, so results are written through the same pointers into the same
structs, and errors are nvmlReturn_t codes.

Its GPUs come from `[gpu.simulated]`: count, memory, name, and topology groups of minors.
NVML numbers GPUs in PCI bus order and the driver numbers nodes in probe order; here the two
are deliberately rotated (index = (minor - count//2) mod count), so code that mixes up NVML
index and minor number fails in simulation instead of on a real server. Like real NVML, it
opens a GPU's node when asked for its handle, so a process that may not open the node gets
NVML_ERROR_NO_PERMISSION for that GPU. Processes come from the registry (sim_registry), MIG
slices from the layout file (sim_mig): both read on every call.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import uuid
from collections.abc import Callable
from ctypes import CFUNCTYPE, POINTER, c_int, c_uint, c_void_p
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from gpuguard.backends.sim_mig import MIG_FILE, LayoutReader, SimSlice
from gpuguard.backends.sim_registry import Registry, SimProcess
from gpuguard.config import SimulatedConfig
from gpuguard.core import mig_profiles

log = logging.getLogger(__name__)

MAX_MIG_DEVICES = mig_profiles.COMPUTE_SLICES  # nvmlDeviceGetMaxMigDeviceCount of an H100 or H200

_UUID_NAMESPACE = uuid.UUID("5f0c3c8e-6a51-4b7e-9a0e-7c2f9b1d4e21")  # fixed: stable UUIDs
_PCI_DEVICE_ID = 0x233010DE      # device 0x2330 (H100 SXM5), vendor 0x10DE (NVIDIA)
_PCI_SUBSYSTEM_ID = 0x16C110DE
_NO_MIG = 0xFFFFFFFF             # gpuInstanceId/computeInstanceId of a process on a non-MIG GPU

# pynvml has no type hints: the return codes the functions below give, typed once.
NVML_ERROR_INSUFFICIENT_SIZE: int = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
NVML_ERROR_INVALID_ARGUMENT: int = pynvml.NVML_ERROR_INVALID_ARGUMENT
NVML_ERROR_NOT_FOUND: int = pynvml.NVML_ERROR_NOT_FOUND
NVML_ERROR_NOT_SUPPORTED: int = pynvml.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_NO_PERMISSION: int = pynvml.NVML_ERROR_NO_PERMISSION
NVML_ERROR_UNINITIALIZED: int = pynvml.NVML_ERROR_UNINITIALIZED
NVML_ERROR_UNKNOWN: int = pynvml.NVML_ERROR_UNKNOWN
NVML_SUCCESS: int = pynvml.NVML_SUCCESS

_ERROR_NAMES = {value: name for name, value in vars(pynvml).items()
                if name.startswith("NVML_ERROR_") and isinstance(value, int)}


@dataclass(frozen=True, eq=False)
class FakeGpu:
    index: int
    minor: int
    uuid: str
    name: str
    bus: int
    memory: int
    numa: int | None      # numbers of the config groups this GPU is in (None: in none)
    nvlink: int | None
    switch: int | None
    profiles: dict[str, mig_profiles.MigProfile] | None  # None: no MIG


def fake_gpus(sim: SimulatedConfig) -> list[FakeGpu]:
    def group_of(kind: str) -> dict[int, int]:
        return {minor: number for number, group in enumerate(sim.groups(kind)) for minor in group}

    numa, nvlink, switch = group_of("numa_nodes"), group_of("nvlink_groups"), group_of("pcie_switches")
    gpus = []
    for index in range(sim.count):
        minor = (index + sim.count // 2) % sim.count
        gpus.append(FakeGpu(
            index=index, minor=minor, name=sim.name, memory=sim.memory,
            uuid=f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{sim.name}/{minor}')}",
            bus=0x18 + 3 * index,  # ascending: NVML enumerates in PCI bus order
            numa=numa.get(minor), nvlink=nvlink.get(minor), switch=switch.get(minor),
            profiles=mig_profiles.profiles_for(sim.name)))
    return gpus


class _Return(Exception):
    """Raised inside a fake C function to make it return this nvmlReturn_t."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _c_function(*argtypes: Any, restype: Any = c_int) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Mark a FakeNvmlLibrary method as a C function with this prototype."""
    def mark(method: Callable[..., int]) -> Callable[..., int]:
        method.c_prototype = CFUNCTYPE(restype, *argtypes)  # type: ignore[attr-defined]
        return method
    return mark


def _write_string(buffer: int, length: int, value: str) -> None:
    data = value.encode() + b"\0"
    if len(data) > length:
        raise _Return(NVML_ERROR_INSUFFICIENT_SIZE)
    ctypes.memmove(buffer, data, len(data))


_HANDLE = c_void_p  # nvmlDevice_t as received: the opaque pointer's address (None for NULL)
_NEEDS_NO_INIT = {"nvmlInitWithFlags", "nvmlErrorString"}


class FakeNvmlLibrary:
    """Stands in for libnvidia-ml.so: each exported function is a ctypes callback with the C
    prototype, so pynvml's byref() arguments and buffers arrive as real pointers."""

    def __init__(self, gpus: list[FakeGpu], device_dir: Path, registry: Registry):
        self._gpus = gpus  # in NVML index order
        self._device_dir = device_dir
        self._registry = registry
        self._layout = LayoutReader(registry.directory / MIG_FILE)
        self._init_count = 0
        # Handles point at real (1-byte) objects, so they are never NULL and never reused.
        self._handle_memory = [ctypes.create_string_buffer(1) for _ in gpus]
        self._by_handle = {ctypes.addressof(memory): gpu for memory, gpu in zip(self._handle_memory, gpus, strict=True)}
        # MIG device handles, one per slice ever seen (by its UUID: a re-created slice gets a new one)
        self._mig_memory: dict[str, ctypes.Array[ctypes.c_char]] = {}
        self._by_mig_handle: dict[int, tuple[FakeGpu, str]] = {}
        self._messages: dict[int, ctypes.Array[ctypes.c_char]] = {}
        for name, member in vars(FakeNvmlLibrary).items():
            if hasattr(member, "c_prototype"):
                # The callback objects must stay referenced as long as pynvml may call them.
                setattr(self, name, member.c_prototype(self._guarded(name, getattr(self, name))))

    def _guarded(self, name: str, function: Callable[..., int]) -> Callable[..., int]:
        def call(*args: Any) -> int:
            if not self._init_count and name not in _NEEDS_NO_INIT:
                return NVML_ERROR_UNINITIALIZED
            try:
                return function(*args)
            except _Return as exc:
                return exc.code
            except Exception:  # must not reach ctypes: it would print it and return 0, NVML_SUCCESS
                log.exception("simulated %s failed", name)
                return NVML_ERROR_UNKNOWN
        return call

    def _gpu(self, handle: int | None) -> FakeGpu:
        """The GPU of a (non-MIG) device handle."""
        gpu = self._by_handle.get(handle or 0)
        if gpu is None:
            raise _Return(NVML_ERROR_INVALID_ARGUMENT)
        return self._reachable(gpu)

    def _reachable(self, gpu: FakeGpu) -> FakeGpu:
        code, minors = self._registry.fault()
        if minors is not None and gpu.minor in minors:  # this GPU is lost: every call on it (and its slices) fails
            raise _Return(code)
        return gpu

    def _device(self, handle: int | None) -> tuple[FakeGpu, SimSlice | None]:
        """The GPU of a device handle, and the slice when it is a MIG device handle."""
        if (handle or 0) in self._by_handle:
            return self._gpu(handle), None
        found = self._by_mig_handle.get(handle or 0)
        if found is None:
            raise _Return(NVML_ERROR_INVALID_ARGUMENT)
        gpu, mig_uuid = self._reachable(found[0]), found[1]
        current = next((s for s in self._layout.layout().get(gpu.minor, ()) if s.uuid == mig_uuid), None)
        if current is None:  # destroyed since: the handle is stale
            raise _Return(NVML_ERROR_INVALID_ARGUMENT)
        return gpu, current

    def _processes(self, gpu: FakeGpu, mig: SimSlice | None) -> list[SimProcess]:
        processes = self._registry.processes(gpu.minor)
        if mig is None:
            return processes
        return [p for p in processes if (p.gpu_instance, p.compute_instance) == (mig.gpu_instance, mig.compute_instance)]

    def _slice_memory(self, gpu: FakeGpu, mig: SimSlice) -> int:
        profiles = gpu.profiles or {}
        if mig.profile not in profiles:
            raise ValueError(f"GPU {gpu.minor} has no MIG profile {mig.profile!r}")
        return gpu.memory * profiles[mig.profile].memory_slices // mig_profiles.MEMORY_SLICES

    def _mig_gpu(self, handle: int | None) -> FakeGpu:
        """The GPU of a device handle, which must have MIG (else NOT_SUPPORTED, as real NVML)."""
        gpu = self._gpu(handle)
        if gpu.profiles is None:
            raise _Return(NVML_ERROR_NOT_SUPPORTED)
        return gpu

    @_c_function(c_uint)
    def nvmlInitWithFlags(self, flags: int) -> int:
        self._init_count += 1
        return NVML_SUCCESS

    @_c_function()
    def nvmlShutdown(self) -> int:
        self._init_count -= 1
        return NVML_SUCCESS

    @_c_function(c_int, restype=c_void_p)
    def nvmlErrorString(self, code: int) -> int:
        if code not in self._messages:
            name = "NVML_SUCCESS" if code == NVML_SUCCESS else _ERROR_NAMES.get(code, "NVML_ERROR_UNKNOWN")
            text = name.removeprefix("NVML_ERROR_").removeprefix("NVML_").replace("_", " ").capitalize()
            self._messages[code] = ctypes.create_string_buffer(text.encode())  # static, like the C strings
        return ctypes.addressof(self._messages[code])

    @_c_function(POINTER(c_uint))
    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        count[0] = len(self._gpus)
        return NVML_SUCCESS

    @_c_function(c_uint, POINTER(pynvml.c_nvmlDevice_t))
    def nvmlDeviceGetHandleByIndex_v2(self, index: int, device: Any) -> int:
        if index >= len(self._gpus):
            return NVML_ERROR_INVALID_ARGUMENT
        # Real NVML opens the GPU's node here and answers NO_PERMISSION when it may not,
        # while nvmlDeviceGetCount_v2 still counts every GPU.
        try:
            os.close(os.open(self._device_dir / f"nvidia{self._gpus[index].minor}", os.O_RDWR | os.O_CLOEXEC))
        except PermissionError:  # EPERM (the gate) or EACCES (file mode, ACL)
            return NVML_ERROR_NO_PERMISSION
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: allowed, and no driver behind the node
                raise
        device[0] = ctypes.cast(self._handle_memory[index], pynvml.c_nvmlDevice_t)
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_uint))
    def nvmlDeviceGetMinorNumber(self, handle: int, minor: Any) -> int:
        minor[0] = self._gpu(handle).minor
        return NVML_SUCCESS

    @_c_function(_HANDLE, c_void_p, c_uint)
    def nvmlDeviceGetUUID(self, handle: int, buffer: int, length: int) -> int:
        gpu, mig = self._device(handle)
        _write_string(buffer, length, gpu.uuid if mig is None else mig.uuid)
        return NVML_SUCCESS

    @_c_function(_HANDLE, c_void_p, c_uint)
    def nvmlDeviceGetName(self, handle: int, buffer: int, length: int) -> int:
        gpu, mig = self._device(handle)
        _write_string(buffer, length, gpu.name if mig is None else f"{gpu.name} MIG {mig.profile}")
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(pynvml.nvmlPciInfo_t))
    def nvmlDeviceGetPciInfo_v3(self, handle: int, pci: Any) -> int:
        gpu, info = self._gpu(handle), pci.contents
        info.domain, info.bus, info.device = 0, gpu.bus, 0
        info.pciDeviceId, info.pciSubSystemId = _PCI_DEVICE_ID, _PCI_SUBSYSTEM_ID
        info.busIdLegacy = f"0000:{gpu.bus:02X}:00.0".encode()
        info.busId = f"00000000:{gpu.bus:02X}:00.0".encode()
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(pynvml.c_nvmlMemory_t))
    def nvmlDeviceGetMemoryInfo(self, handle: int, memory: Any) -> int:
        (gpu, mig), info = self._device(handle), memory.contents
        total = gpu.memory if mig is None else self._slice_memory(gpu, mig)
        used = min(total, sum(p.memory or 0 for p in self._processes(gpu, mig)))
        info.total, info.used, info.free = total, used, total - used
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(pynvml.c_nvmlUtilization_t))
    def nvmlDeviceGetUtilizationRates(self, handle: int, utilization: Any) -> int:
        (gpu, mig), info = self._device(handle), utilization.contents
        if mig is not None or gpu.minor in self._layout.layout():  # NVML cannot tell in MIG mode
            return NVML_ERROR_NOT_SUPPORTED
        busy = min(100, sum(p.util for p in self._registry.processes(gpu.minor)))
        info.gpu = info.memory = busy
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_int))
    def nvmlDeviceGetNumaNodeId(self, handle: int, node: Any) -> int:
        gpu = self._gpu(handle)
        if gpu.numa is None:
            return NVML_ERROR_NOT_SUPPORTED
        node[0] = gpu.numa
        return NVML_SUCCESS

    @_c_function(_HANDLE, _HANDLE, POINTER(c_uint))
    def nvmlDeviceGetTopologyCommonAncestor(self, handle_a: int, handle_b: int, level: Any) -> int:
        a, b = self._gpu(handle_a), self._gpu(handle_b)
        if a is b:
            level[0] = pynvml.NVML_TOPOLOGY_INTERNAL
        elif a.switch is not None and a.switch == b.switch:
            level[0] = pynvml.NVML_TOPOLOGY_SINGLE
        elif a.numa is not None and a.numa == b.numa:
            level[0] = pynvml.NVML_TOPOLOGY_NODE
        else:
            level[0] = pynvml.NVML_TOPOLOGY_SYSTEM
        return NVML_SUCCESS

    @_c_function(_HANDLE, _HANDLE, c_uint, POINTER(c_uint))
    def nvmlDeviceGetP2PStatus(self, handle_a: int, handle_b: int, caps: int, status: Any) -> int:
        a, b = self._gpu(handle_a), self._gpu(handle_b)
        nvlinked = a.nvlink is not None and a.nvlink == b.nvlink
        # Peer access over PCIe works between any two simulated GPUs; NVLink only within a group.
        ok = nvlinked or caps != pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        status[0] = pynvml.NVML_P2P_STATUS_OK if ok else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_uint), POINTER(pynvml.c_nvmlProcessInfo_v3_t))
    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: int, count: Any, infos: Any) -> int:
        return self._running(handle, count, infos, "C")

    @_c_function(_HANDLE, POINTER(c_uint), POINTER(pynvml.c_nvmlProcessInfo_v3_t))
    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: int, count: Any, infos: Any) -> int:
        return self._running(handle, count, infos, "G")

    def _running(self, handle: int, count: Any, infos: Any, kind: str) -> int:
        """The C contract: report the needed size if the caller's array is too small."""
        gpu, mig = self._device(handle)
        code, minors = self._registry.fault()
        if minors is None and code != NVML_SUCCESS:  # NVML itself fails
            return code
        in_mig_mode = gpu.minor in self._layout.layout()
        processes = [p for p in self._processes(gpu, mig) if kind in p.type]
        if count[0] < len(processes):
            count[0] = len(processes)
            return NVML_ERROR_INSUFFICIENT_SIZE
        if processes and not infos:
            return NVML_ERROR_INVALID_ARGUMENT
        for slot, process in enumerate(processes):
            info = infos[slot]
            info.pid = process.pid
            info.usedGpuMemory = (pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                                  if process.memory is None else process.memory)
            placed = in_mig_mode and process.gpu_instance is not None and process.compute_instance is not None
            info.gpuInstanceId = process.gpu_instance if placed else _NO_MIG
            info.computeInstanceId = process.compute_instance if placed else _NO_MIG
        count[0] = len(processes)
        return NVML_SUCCESS

    # MIG

    @_c_function(_HANDLE, POINTER(c_uint), POINTER(c_uint))
    def nvmlDeviceGetMigMode(self, handle: int, current: Any, pending: Any) -> int:
        gpu = self._mig_gpu(handle)
        enabled = gpu.minor in self._layout.layout()
        current[0] = pending[0] = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_uint))
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int, count: Any) -> int:
        self._mig_gpu(handle)
        count[0] = MAX_MIG_DEVICES
        return NVML_SUCCESS

    @_c_function(_HANDLE, c_uint, POINTER(pynvml.c_nvmlDevice_t))
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, index: int, device: Any) -> int:
        gpu = self._mig_gpu(handle)
        slices = self._layout.layout().get(gpu.minor)
        if slices is None or index >= MAX_MIG_DEVICES:  # not in MIG mode, or past the last place
            return NVML_ERROR_INVALID_ARGUMENT
        # A slice's place is where its memory starts, so places between slices are empty.
        found = next((s for s in slices if s.start == index), None)
        if found is None:
            return NVML_ERROR_NOT_FOUND
        if found.uuid not in self._mig_memory:
            memory = self._mig_memory[found.uuid] = ctypes.create_string_buffer(1)
            self._by_mig_handle[ctypes.addressof(memory)] = (gpu, found.uuid)
        device[0] = ctypes.cast(self._mig_memory[found.uuid], pynvml.c_nvmlDevice_t)
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_uint))
    def nvmlDeviceIsMigDeviceHandle(self, handle: int, is_mig: Any) -> int:
        is_mig[0] = int(self._device(handle)[1] is not None)
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_uint))
    def nvmlDeviceGetGpuInstanceId(self, handle: int, gpu_instance: Any) -> int:
        mig = self._device(handle)[1]
        if mig is None:
            return NVML_ERROR_NOT_SUPPORTED
        gpu_instance[0] = mig.gpu_instance
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_uint))
    def nvmlDeviceGetComputeInstanceId(self, handle: int, compute_instance: Any) -> int:
        mig = self._device(handle)[1]
        if mig is None:
            return NVML_ERROR_NOT_SUPPORTED
        compute_instance[0] = mig.compute_instance
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(pynvml.c_nvmlDevice_t))
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: int, device: Any) -> int:
        gpu, mig = self._device(handle)
        if mig is None:
            return NVML_ERROR_INVALID_ARGUMENT
        device[0] = ctypes.cast(self._handle_memory[gpu.index], pynvml.c_nvmlDevice_t)
        return NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(pynvml.c_nvmlDeviceAttributes))
    def nvmlDeviceGetAttributes_v2(self, handle: int, attributes: Any) -> int:
        (gpu, mig), info = self._device(handle), attributes.contents
        slices = mig_profiles.COMPUTE_SLICES if mig is None else (gpu.profiles or {})[mig.profile].compute_slices
        memory = gpu.memory if mig is None else self._slice_memory(gpu, mig)
        info.multiprocessorCount = 16 * slices + (4 if mig is None else 0)  # an H100 SXM: 132 SMs, 16 per 1g
        info.gpuInstanceSliceCount = info.computeInstanceSliceCount = slices
        info.memorySizeMB = memory >> 20
        return NVML_SUCCESS
