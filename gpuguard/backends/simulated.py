"""Simulated GPUs: NVIDIA's pynvml wrappers running over a fake NVML library.

Only the GPU is simulated. `SimulatedBackend` is `NvmlBackend` with `pynvml.nvmlLib` swapped
for `FakeNvmlLibrary`, whose C functions pynvml calls through ctypes exactly as it calls
libnvidia-ml.so: results are written through the same pointers into the same structs, errors
are nvmlReturn_t codes. So the code that runs against real GPUs is the code under test.

Device nodes are real: `paths.device_dir` gets `nvidia<minor>` (195:minor) per GPU and
`nvidiactl` (195:255), created mode 0666 like a freshly loaded driver does; existing nodes
keep their mode. With no driver behind major 195, an open() the kernel allows fails with
ENXIO, and one it refuses (file mode, ACL, the BPF gate) fails with EPERM or EACCES. Like
real NVML, the fake opens a GPU's node when asked for its handle, so a process that may not
open the node gets NVML_ERROR_NO_PERMISSION for that GPU (and GpuError from NvmlBackend).

The shape comes from `[gpu.simulated]`: count, memory, name, and topology groups of minors.
NVML numbers GPUs in PCI bus order and the driver numbers nodes in probe order; here the
two are deliberately rotated (index = (minor - count//2) mod count), so code that mixes up
NVML index and minor number fails in simulation instead of on a real server.

Processes. `gpuguard sim burn` stands in for a CUDA program: after opening its GPU's node it
registers itself in `device_dir/.gpuguard-sim/` (mode 1777, created by the backend), one
file `<pid>-<random>.json` per process:
    {"pid": 123, "uid": 1000, "start_time": 4567, "minor": 2,
     "memory": 4294967296 or null (NVML cannot tell), "util": 100, "type": "C" | "G" | "C+G"}
`start_time` is field 22 of /proc/<pid>/stat. Any process (the root daemon included) reads
the directory; a record counts only while the file owner, the record's uid and the real uid
of the live process all agree and the start time still matches, so dead processes, reused
pids and records planted for someone else's process are ignored (and removed when the
reader may). The fake reports the memory of live processes as used on their GPU and the
sum of their utilization (capped at 100%) as the GPU's utilization.

Fault injection. While `device_dir/.gpuguard-sim/fail` exists and is owned by root, it
holds an NVML error name, optionally followed by minors:
    NVML_ERROR_UNKNOWN          every process query (nvmlDeviceGet{Compute,Graphics}RunningProcesses_v3)
                                returns that code: NVML itself fails, NvmlBackend raises GpuError
    NVML_ERROR_GPU_IS_LOST 2 3  every call on GPUs 2 and 3 (anything taking their handle) returns
                                it, as for GPUs that fell off the bus; the others answer
Remove the file to heal. It persists rather than firing once so that a watcher's confirming
re-sample sees the same failure.

MIG. A GPU named like an H100 or H200 has MIG (mig_profiles: their real profiles and
placements); `[gpu.simulated] mig` gives the layout it starts with, and `gpuguard sim mig`
changes it. The layout lives in `device_dir/.gpuguard-sim/mig.json`, written by root (like
the `fail` file, one owned by anyone else is ignored) and read by the fake on every call:
    {"0": [{"gpu_instance": 7, "compute_instance": 0, "profile": "1g.10gb", "start": 0,
            "uuid": "MIG-..."}, ...], "1": []}        GPU 1: MIG mode, no slices
The fake answers pynvml's MIG calls from it (modes, MIG device handles by place, their GI/CI
ids, UUIDs, names like "NVIDIA H100 80GB HBM3 MIG 1g.10gb", memory, attributes, processes
with their instance ids; no utilization, as real NVML in MIG mode). Next to it is a
`mig-minors` file in the driver's format and with its table, which the backend reads instead
of /proc/driver/nvidia-caps/mig-minors, and the current slices' capability nodes are made
in `device_dir/nvidia-caps/` (CAPS_MAJOR:minor, 0444 root:root, as nvidia-modprobe makes them).

pynvml's library is process-wide: use one SimulatedBackend at a time per process.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import secrets
import stat
import uuid
from collections.abc import Callable
from ctypes import CFUNCTYPE, POINTER, c_int, c_uint, c_void_p
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pynvml

from gpuguard import mig_profiles
from gpuguard.backends import GpuError, mig_caps, procfs
from gpuguard.backends.devnodes import caps_node
from gpuguard.backends.nvml import NvmlBackend
from gpuguard.config import SimulatedConfig
from gpuguard.model import CI_SLOTS, GI_SLOTS, NVIDIA_MAJOR

log = logging.getLogger(__name__)

REGISTRY_DIR = ".gpuguard-sim"
FAIL_FILE = "fail"
PROCESS_TYPES = ("C", "G", "C+G")   # as nvidia-smi shows them: compute, graphics, both
CTL_MINOR = 255                     # /dev/nvidiactl
MIG_FILE = "mig.json"
MIG_MINORS_FILE = "mig-minors"
CAPS_MAJOR = mig_caps.SIMULATED_CAPS_MAJOR
MAX_MIG_DEVICES = mig_profiles.COMPUTE_SLICES  # nvmlDeviceGetMaxMigDeviceCount of an H100 or H200
_DRIVER_CAPS_GPUS = 32                         # the driver's mig-minors table covers gpu0..gpu31

_UUID_NAMESPACE = uuid.UUID("5f0c3c8e-6a51-4b7e-9a0e-7c2f9b1d4e21")  # fixed: stable UUIDs
_PCI_DEVICE_ID = 0x233010DE      # device 0x2330 (H100 SXM5), vendor 0x10DE (NVIDIA)
_PCI_SUBSYSTEM_ID = 0x16C110DE
_NO_MIG = 0xFFFFFFFF             # gpuInstanceId/computeInstanceId of a process on a non-MIG GPU
_MAX_RECORD = 4096               # bytes; records are tiny, anything bigger is not ours

_ERROR_NAMES = {value: name for name, value in vars(pynvml).items()
                if name.startswith("NVML_ERROR_") and isinstance(value, int)}


# --- process registry: written by simulated CUDA programs, read by the fake library

@dataclass(frozen=True)
class SimProcess:
    pid: int
    uid: int
    start_time: int           # clock ticks after boot, /proc/<pid>/stat field 22
    minor: int
    memory: int | None        # bytes; None = NVML cannot tell
    util: int                 # percent of the GPU this process keeps busy
    type: str = "C"
    gpu_instance: int | None = None      # the MIG slice it runs on (both ids, or neither)
    compute_instance: int | None = None

    def running(self) -> bool:
        """Whether the process this record describes still runs (not a later one with its pid)."""
        identity = _running(self.pid)
        return identity is not None and identity.start_time == self.start_time


def _running(pid: int) -> procfs.ProcessIdentity | None:
    """uid and start time of a running process; None when it is gone or a zombie (NVML drops
    a process as soon as it exits, before its parent reaps it)."""
    info = procfs.inspect(pid)
    return info.identity if info is not None and info.state not in ("Z", "X") else None


def register_process(device_dir: Path, pid: int, minor: int, memory: int | None, util: int,
                     type: str = "C", mig: tuple[int, int] | None = None) -> Path:
    """Announce that process `pid` uses GPU `minor` (its MIG slice `mig`: GI and CI ids); the
    record lives until the process does. Raises OSError (FileNotFoundError: no simulated GPUs in device_dir)."""
    identity = _running(pid)
    if identity is None:
        raise ProcessLookupError(f"no running process {pid}")
    gpu_instance, compute_instance = mig if mig is not None else (None, None)
    record = SimProcess(pid, identity.uid, identity.start_time, minor, memory, util, type,
                        gpu_instance, compute_instance)
    directory = device_dir / REGISTRY_DIR
    path = directory / f"{pid}-{secrets.token_hex(4)}.json"  # unguessable: nobody can pre-create it
    temp = directory / f".{path.name}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(fd, 0o644)  # whatever the umask: every reader must see it
        json.dump(asdict(record), handle)
    os.rename(temp, path)  # readers only ever see complete records
    return path


def _parse_record(entry: os.DirEntry) -> SimProcess | None:
    """The record in this file if it is well formed and really describes its writer's process."""
    try:
        owner = entry.stat(follow_symlinks=False).st_uid
        with open(entry.path, "rb") as handle:
            data = json.loads(handle.read(_MAX_RECORD))
        record = SimProcess(**data)
    except (OSError, ValueError, TypeError):
        return None
    numbers = (record.pid, record.uid, record.start_time, record.minor, record.util)
    ids = (record.gpu_instance, record.compute_instance)
    if not (all(type(n) is int for n in numbers)
            and (record.memory is None or type(record.memory) is int and record.memory >= 0)
            and record.type in PROCESS_TYPES and 0 <= record.util <= 100
            and (ids == (None, None) or all(type(i) is int and i >= 0 for i in ids))):
        return None
    # The directory is world-writable: a record counts only for its writer's own process,
    # or anyone could make the watcher blame (and kill) another user's process.
    if not owner == record.uid == procfs.user_of(record.pid):
        return None
    return record


class _Registry:
    """Live simulated processes, read from the registry directory on every query.

    Parsed records are cached by (name, inode): a record is written once and renamed into
    place, so the pair identifies its content. Liveness is checked on every read."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._parsed: dict[tuple[str, int], SimProcess] = {}

    def processes(self, minor: int) -> list[SimProcess]:
        live, parsed = [], {}
        for entry in os.scandir(self.directory):
            if not entry.name[:1].isdigit() or not entry.name.endswith(".json"):  # records are <pid>-*.json
                continue
            key = (entry.name, entry.inode())
            record = self._parsed.get(key) or _parse_record(entry)
            if record is not None and record.minor != minor:
                parsed[key] = record  # the query for its own GPU checks that it still runs
            elif record is not None and record.running():
                parsed[key] = record
                live.append(record)
            else:
                with contextlib.suppress(OSError):  # dead, reused pid or bogus; root may remove any
                    os.unlink(entry.path)
        self._parsed = parsed  # every scan sees every file: forget the ones that went away
        return sorted(live, key=lambda p: p.pid)

    def fault(self) -> tuple[int, frozenset[int] | None]:
        """The injected NVML error (NVML_SUCCESS: none) and the minors it hits (None: NVML itself)."""
        path = self.directory / FAIL_FILE
        try:
            if path.lstat().st_uid != 0:  # world-writable directory: only root injects faults
                return pynvml.NVML_SUCCESS, None
            words = path.read_text().split()
        except FileNotFoundError:
            return pynvml.NVML_SUCCESS, None
        name, minors = (words[0], words[1:]) if words else ("", [])
        if not name.startswith("NVML_ERROR_") or not hasattr(pynvml, name) or not all(m.isdigit() for m in minors):
            raise ValueError(f"{path}: expected an NVML error name and optional GPU minors, got {words}")
        return getattr(pynvml, name), frozenset(map(int, minors)) if minors else None


# --- MIG: the layout file, the driver's capability table and nodes

@dataclass(frozen=True)
class SimSlice:
    gpu_instance: int
    compute_instance: int
    profile: str
    start: int  # first memory slice: also its place among the GPU's MIG devices
    uuid: str


Layout = dict[int, tuple[SimSlice, ...]]  # GPU minor -> its slices; a GPU listed is in MIG mode


def new_slices(gpu_name: str, profiles: list[str] | tuple[str, ...]) -> tuple[SimSlice, ...]:
    """Fresh GPU instances (one compute instance each) of these profiles where the driver would
    put them, each with a new random MIG UUID. Raises ValueError (one line) when they do not fit."""
    return tuple(SimSlice(placed.gpu_instance, 0, placed.profile.name, placed.start, f"MIG-{uuid.uuid4()}")
                 for placed in mig_profiles.place(gpu_name, profiles))


def driver_mig_minors() -> str:
    """mig-minors as the driver writes it: its static table (nv-caps.c), whatever the GPUs' state;
    minor 0 is the NVLink fabric-mgmt capability, listed elsewhere."""
    lines, minor = ["config 1", "monitor 2"], 3
    for gpu in range(_DRIVER_CAPS_GPUS):
        for gi in range(GI_SLOTS - 1):  # GI ids 0..14
            lines.append(f"gpu{gpu}/gi{gi}/access {minor}")
            lines += [f"gpu{gpu}/gi{gi}/ci{ci}/access {minor + 1 + ci}" for ci in range(CI_SLOTS)]
            minor += 1 + CI_SLOTS
    return "\n".join(lines) + "\n"


_DRIVER_CAPS = mig_caps.parse_mig_minors(driver_mig_minors())


def read_layout(device_dir: Path) -> Layout:
    """The MIG layout of the simulated GPUs; empty when there is none or it is not root's.
    Raises ValueError for a malformed file."""
    return _load_layout(device_dir / REGISTRY_DIR / MIG_FILE, _root_owned_stat(device_dir / REGISTRY_DIR / MIG_FILE))


def _root_owned_stat(path: Path) -> os.stat_result | None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return st if st.st_uid == 0 and stat.S_ISREG(st.st_mode) else None  # the directory is world-writable


def _load_layout(path: Path, st: os.stat_result | None) -> Layout:
    if st is None:
        return {}
    try:
        data = json.loads(path.read_text())
        layout = {int(minor): tuple(SimSlice(**entry) for entry in entries) for minor, entries in data.items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a MIG layout: {exc}") from None
    return layout


def write_layout(device_dir: Path, layout: Layout) -> None:
    """Replace the MIG layout (root only) and make the capability nodes of its slices."""
    directory = device_dir / REGISTRY_DIR
    data = {str(minor): [asdict(s) for s in slices] for minor, slices in sorted(layout.items())}
    _write_root_file(directory / MIG_FILE, json.dumps(data, indent=1) + "\n")
    for minor, slices in layout.items():
        for sim_slice in slices:
            for cap in mig_caps.slice_caps(_DRIVER_CAPS, minor, sim_slice.gpu_instance,
                                           sim_slice.compute_instance) or ():
                _make_node(caps_node(device_dir, cap), (CAPS_MAJOR, cap), 0o444)


def _write_root_file(path: Path, text: str) -> None:
    """Write atomically (readers see the old file or the new one), mode 0644."""
    temp = path.with_name(f".{path.name}-{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(fd, 0o644)
        handle.write(text)
    os.rename(temp, path)


def _start_mig(sim: SimulatedConfig, device_dir: Path) -> None:
    """As root: the driver's mig-minors file, and the configured layout unless one is in place."""
    if os.geteuid() != 0:
        return  # a user's view: whatever root has set up
    directory = device_dir / REGISTRY_DIR
    minors = directory / MIG_MINORS_FILE
    text = driver_mig_minors()
    if _root_owned_stat(minors) is None or minors.read_text() != text:
        _write_root_file(minors, text)
    current = read_layout(device_dir) if _root_owned_stat(directory / MIG_FILE) else None
    if current is None:
        current = {minor: new_slices(sim.name, profiles) for minor, profiles in sim.mig}
    write_layout(device_dir, current)  # also (re)makes the capability nodes


def change_layout(sim: SimulatedConfig, device_dir: Path, minor: int,
                  profiles: list[str] | None) -> tuple[SimSlice, ...] | None:
    """As root, destroy GPU `minor`'s GPU instances and create ones of `profiles` in their place
    (new UUIDs; GI ids are the places', so the same place gives the same id again), or leave MIG
    mode (None). Returns the new slices. Raises ValueError for a layout that does not fit and
    GpuError while processes run on the GPU (the driver refuses to destroy instances in use)."""
    slices = None if profiles is None else new_slices(sim.name, profiles)
    _make_registry(device_dir)
    _start_mig(sim, device_dir)
    busy = _Registry(device_dir / REGISTRY_DIR).processes(minor)
    if busy:
        raise GpuError(f"GPU {minor} is in use by pids {', '.join(str(p.pid) for p in busy)}: "
                       "end them before changing its MIG layout")
    layout = dict(read_layout(device_dir))
    if slices is None:
        layout.pop(minor, None)
    else:
        layout[minor] = slices
    write_layout(device_dir, layout)
    return slices


class _LayoutReader:
    """The layout file, parsed again only when it was replaced (root writes it by rename)."""

    def __init__(self, path: Path):
        self.path = path
        self._key: tuple[int, int, int] | None = None
        self._layout: Layout = {}

    def layout(self) -> Layout:
        st = _root_owned_stat(self.path)
        key = None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key:
            self._layout, self._key = _load_layout(self.path, st), key
        return self._layout


# --- the fake libnvidia-ml.so

@dataclass(frozen=True, eq=False)
class _FakeGpu:
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


def _fake_gpus(sim: SimulatedConfig) -> list[_FakeGpu]:
    def group_of(kind: str) -> dict[int, int]:
        return {minor: number for number, group in enumerate(sim.groups(kind)) for minor in group}

    numa, nvlink, switch = group_of("numa_nodes"), group_of("nvlink_groups"), group_of("pcie_switches")
    gpus = []
    for index in range(sim.count):
        minor = (index + sim.count // 2) % sim.count
        gpus.append(_FakeGpu(
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


def _c_function(*argtypes: Any, restype: Any = c_int) -> Callable:
    """Mark a FakeNvmlLibrary method as a C function with this prototype."""
    def mark(method: Callable) -> Callable:
        method.c_prototype = CFUNCTYPE(restype, *argtypes)  # type: ignore[attr-defined]
        return method
    return mark


def _write_string(buffer: int, length: int, value: str) -> None:
    data = value.encode() + b"\0"
    if len(data) > length:
        raise _Return(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    ctypes.memmove(buffer, data, len(data))


_HANDLE = c_void_p  # nvmlDevice_t as received: the opaque pointer's address (None for NULL)
_NEEDS_NO_INIT = {"nvmlInitWithFlags", "nvmlErrorString"}


class FakeNvmlLibrary:
    """Stands in for libnvidia-ml.so: each exported function is a ctypes callback with the C
    prototype, so pynvml's byref() arguments and buffers arrive as real pointers."""

    def __init__(self, gpus: list[_FakeGpu], device_dir: Path, registry: _Registry):
        self._gpus = gpus  # in NVML index order
        self._device_dir = device_dir
        self._registry = registry
        self._layout = _LayoutReader(registry.directory / MIG_FILE)
        self._init_count = 0
        # Handles point at real (1-byte) objects, so they are never NULL and never reused.
        self._handle_memory = [ctypes.create_string_buffer(1) for _ in gpus]
        self._by_handle = {ctypes.addressof(memory): gpu for memory, gpu in zip(self._handle_memory, gpus, strict=True)}
        # MIG device handles, one per slice ever seen (by its UUID: a re-created slice gets a new one)
        self._mig_memory: dict[str, ctypes.Array] = {}
        self._by_mig_handle: dict[int, tuple[_FakeGpu, str]] = {}
        self._messages: dict[int, ctypes.Array] = {}
        for name, member in vars(FakeNvmlLibrary).items():
            if hasattr(member, "c_prototype"):
                # The callback objects must stay referenced as long as pynvml may call them.
                setattr(self, name, member.c_prototype(self._guarded(name, getattr(self, name))))

    def _guarded(self, name: str, function: Callable[..., int]) -> Callable[..., int]:
        def call(*args: Any) -> int:
            if not self._init_count and name not in _NEEDS_NO_INIT:
                return pynvml.NVML_ERROR_UNINITIALIZED
            try:
                return function(*args)
            except _Return as exc:
                return exc.code
            except Exception:  # must not reach ctypes: it would print it and return 0, NVML_SUCCESS
                log.exception("simulated %s failed", name)
                return pynvml.NVML_ERROR_UNKNOWN
        return call

    def _gpu(self, handle: int | None) -> _FakeGpu:
        """The GPU of a (non-MIG) device handle."""
        gpu = self._by_handle.get(handle or 0)
        if gpu is None:
            raise _Return(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._reachable(gpu)

    def _reachable(self, gpu: _FakeGpu) -> _FakeGpu:
        code, minors = self._registry.fault()
        if minors is not None and gpu.minor in minors:  # this GPU is lost: every call on it (and its slices) fails
            raise _Return(code)
        return gpu

    def _device(self, handle: int | None) -> tuple[_FakeGpu, SimSlice | None]:
        """The GPU of a device handle, and the slice when it is a MIG device handle."""
        if (handle or 0) in self._by_handle:
            return self._gpu(handle), None
        found = self._by_mig_handle.get(handle or 0)
        if found is None:
            raise _Return(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu, mig_uuid = self._reachable(found[0]), found[1]
        current = next((s for s in self._layout.layout().get(gpu.minor, ()) if s.uuid == mig_uuid), None)
        if current is None:  # destroyed since: the handle is stale
            raise _Return(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu, current

    def _processes(self, gpu: _FakeGpu, mig: SimSlice | None) -> list[SimProcess]:
        processes = self._registry.processes(gpu.minor)
        if mig is None:
            return processes
        return [p for p in processes if (p.gpu_instance, p.compute_instance) == (mig.gpu_instance, mig.compute_instance)]

    def _slice_memory(self, gpu: _FakeGpu, mig: SimSlice) -> int:
        profiles = gpu.profiles or {}
        if mig.profile not in profiles:
            raise ValueError(f"GPU {gpu.minor} has no MIG profile {mig.profile!r}")
        return gpu.memory * profiles[mig.profile].memory_slices // mig_profiles.MEMORY_SLICES

    def _mig_gpu(self, handle: int | None) -> _FakeGpu:
        """The GPU of a device handle, which must have MIG (else NOT_SUPPORTED, as real NVML)."""
        gpu = self._gpu(handle)
        if gpu.profiles is None:
            raise _Return(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    @_c_function(c_uint)
    def nvmlInitWithFlags(self, flags: int) -> int:
        self._init_count += 1
        return pynvml.NVML_SUCCESS

    @_c_function()
    def nvmlShutdown(self) -> int:
        self._init_count -= 1
        return pynvml.NVML_SUCCESS

    @_c_function(c_int, restype=c_void_p)
    def nvmlErrorString(self, code: int) -> int:
        if code not in self._messages:
            name = "NVML_SUCCESS" if code == pynvml.NVML_SUCCESS else _ERROR_NAMES.get(code, "NVML_ERROR_UNKNOWN")
            text = name.removeprefix("NVML_ERROR_").removeprefix("NVML_").replace("_", " ").capitalize()
            self._messages[code] = ctypes.create_string_buffer(text.encode())  # static, like the C strings
        return ctypes.addressof(self._messages[code])

    @_c_function(POINTER(c_uint))
    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        count[0] = len(self._gpus)
        return pynvml.NVML_SUCCESS

    @_c_function(c_uint, POINTER(pynvml.c_nvmlDevice_t))
    def nvmlDeviceGetHandleByIndex_v2(self, index: int, device: Any) -> int:
        if index >= len(self._gpus):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        # Real NVML opens the GPU's node here and answers NO_PERMISSION when it may not,
        # while nvmlDeviceGetCount_v2 still counts every GPU.
        try:
            os.close(os.open(self._device_dir / f"nvidia{self._gpus[index].minor}", os.O_RDWR | os.O_CLOEXEC))
        except PermissionError:  # EPERM (the gate) or EACCES (file mode, ACL)
            return pynvml.NVML_ERROR_NO_PERMISSION
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: allowed, and no driver behind the node
                raise
        device[0] = ctypes.cast(self._handle_memory[index], pynvml.c_nvmlDevice_t)
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_uint))
    def nvmlDeviceGetMinorNumber(self, handle: int, minor: Any) -> int:
        minor[0] = self._gpu(handle).minor
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, c_void_p, c_uint)
    def nvmlDeviceGetUUID(self, handle: int, buffer: int, length: int) -> int:
        gpu, mig = self._device(handle)
        _write_string(buffer, length, gpu.uuid if mig is None else mig.uuid)
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, c_void_p, c_uint)
    def nvmlDeviceGetName(self, handle: int, buffer: int, length: int) -> int:
        gpu, mig = self._device(handle)
        _write_string(buffer, length, gpu.name if mig is None else f"{gpu.name} MIG {mig.profile}")
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(pynvml.nvmlPciInfo_t))
    def nvmlDeviceGetPciInfo_v3(self, handle: int, pci: Any) -> int:
        gpu, info = self._gpu(handle), pci.contents
        info.domain, info.bus, info.device = 0, gpu.bus, 0
        info.pciDeviceId, info.pciSubSystemId = _PCI_DEVICE_ID, _PCI_SUBSYSTEM_ID
        info.busIdLegacy = f"0000:{gpu.bus:02X}:00.0".encode()
        info.busId = f"00000000:{gpu.bus:02X}:00.0".encode()
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(pynvml.c_nvmlMemory_t))
    def nvmlDeviceGetMemoryInfo(self, handle: int, memory: Any) -> int:
        (gpu, mig), info = self._device(handle), memory.contents
        total = gpu.memory if mig is None else self._slice_memory(gpu, mig)
        used = min(total, sum(p.memory or 0 for p in self._processes(gpu, mig)))
        info.total, info.used, info.free = total, used, total - used
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(pynvml.c_nvmlUtilization_t))
    def nvmlDeviceGetUtilizationRates(self, handle: int, utilization: Any) -> int:
        (gpu, mig), info = self._device(handle), utilization.contents
        if mig is not None or gpu.minor in self._layout.layout():  # NVML cannot tell in MIG mode
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        busy = min(100, sum(p.util for p in self._registry.processes(gpu.minor)))
        info.gpu = info.memory = busy
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_int))
    def nvmlDeviceGetNumaNodeId(self, handle: int, node: Any) -> int:
        gpu = self._gpu(handle)
        if gpu.numa is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        node[0] = gpu.numa
        return pynvml.NVML_SUCCESS

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
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, _HANDLE, c_uint, POINTER(c_uint))
    def nvmlDeviceGetP2PStatus(self, handle_a: int, handle_b: int, caps: int, status: Any) -> int:
        a, b = self._gpu(handle_a), self._gpu(handle_b)
        nvlinked = a.nvlink is not None and a.nvlink == b.nvlink
        # Peer access over PCIe works between any two simulated GPUs; NVLink only within a group.
        ok = nvlinked or caps != pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        status[0] = pynvml.NVML_P2P_STATUS_OK if ok else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
        return pynvml.NVML_SUCCESS

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
        if minors is None and code != pynvml.NVML_SUCCESS:  # NVML itself fails
            return code
        in_mig_mode = gpu.minor in self._layout.layout()
        processes = [p for p in self._processes(gpu, mig) if kind in p.type]
        if count[0] < len(processes):
            count[0] = len(processes)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        if processes and not infos:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        for slot, process in enumerate(processes):
            info = infos[slot]
            info.pid = process.pid
            info.usedGpuMemory = (pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                                  if process.memory is None else process.memory)
            placed = in_mig_mode and process.gpu_instance is not None and process.compute_instance is not None
            info.gpuInstanceId = process.gpu_instance if placed else _NO_MIG
            info.computeInstanceId = process.compute_instance if placed else _NO_MIG
        count[0] = len(processes)
        return pynvml.NVML_SUCCESS

    # MIG

    @_c_function(_HANDLE, POINTER(c_uint), POINTER(c_uint))
    def nvmlDeviceGetMigMode(self, handle: int, current: Any, pending: Any) -> int:
        gpu = self._mig_gpu(handle)
        enabled = gpu.minor in self._layout.layout()
        current[0] = pending[0] = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_uint))
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int, count: Any) -> int:
        self._mig_gpu(handle)
        count[0] = MAX_MIG_DEVICES
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, c_uint, POINTER(pynvml.c_nvmlDevice_t))
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, index: int, device: Any) -> int:
        gpu = self._mig_gpu(handle)
        slices = self._layout.layout().get(gpu.minor)
        if slices is None or index >= MAX_MIG_DEVICES:  # not in MIG mode, or past the last place
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        # A slice's place is where its memory starts, so places between slices are empty.
        found = next((s for s in slices if s.start == index), None)
        if found is None:
            return pynvml.NVML_ERROR_NOT_FOUND
        if found.uuid not in self._mig_memory:
            memory = self._mig_memory[found.uuid] = ctypes.create_string_buffer(1)
            self._by_mig_handle[ctypes.addressof(memory)] = (gpu, found.uuid)
        device[0] = ctypes.cast(self._mig_memory[found.uuid], pynvml.c_nvmlDevice_t)
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_uint))
    def nvmlDeviceIsMigDeviceHandle(self, handle: int, is_mig: Any) -> int:
        is_mig[0] = int(self._device(handle)[1] is not None)
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_uint))
    def nvmlDeviceGetGpuInstanceId(self, handle: int, gpu_instance: Any) -> int:
        mig = self._device(handle)[1]
        if mig is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        gpu_instance[0] = mig.gpu_instance
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(c_uint))
    def nvmlDeviceGetComputeInstanceId(self, handle: int, compute_instance: Any) -> int:
        mig = self._device(handle)[1]
        if mig is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        compute_instance[0] = mig.compute_instance
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(pynvml.c_nvmlDevice_t))
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: int, device: Any) -> int:
        gpu, mig = self._device(handle)
        if mig is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        device[0] = ctypes.cast(self._handle_memory[gpu.index], pynvml.c_nvmlDevice_t)
        return pynvml.NVML_SUCCESS

    @_c_function(_HANDLE, POINTER(pynvml.c_nvmlDeviceAttributes))
    def nvmlDeviceGetAttributes_v2(self, handle: int, attributes: Any) -> int:
        (gpu, mig), info = self._device(handle), attributes.contents
        slices = mig_profiles.COMPUTE_SLICES if mig is None else (gpu.profiles or {})[mig.profile].compute_slices
        memory = gpu.memory if mig is None else self._slice_memory(gpu, mig)
        info.multiprocessorCount = 16 * slices + (4 if mig is None else 0)  # an H100 SXM: 132 SMs, 16 per 1g
        info.gpuInstanceSliceCount = info.computeInstanceSliceCount = slices
        info.memorySizeMB = memory >> 20
        return pynvml.NVML_SUCCESS


# --- the backend

def _make_node(path: Path, dev: tuple[int, int], mode: int = 0o666) -> None:
    """The character device `dev`, created with `mode` as a freshly loaded driver does (GPUs
    0666; nvidia-modprobe makes capability nodes 0444). An existing node keeps its mode: an
    admin or gpuguard's ACLs may have set it."""
    rdev = os.makedev(*dev)
    try:
        path.parent.mkdir(mode=0o755, exist_ok=True)
        os.mknod(path, stat.S_IFCHR | mode, rdev)
        os.chmod(path, mode)  # mknod applied the umask
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise GpuError(f"cannot create simulated GPU node {path}: {exc.strerror}") from None
    st = os.lstat(path)
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != rdev:
        raise GpuError(f"{path} exists but is not the device node {dev[0]}:{dev[1]}")


def _make_registry(device_dir: Path) -> Path:
    directory = device_dir / REGISTRY_DIR
    try:
        directory.mkdir()
        os.chmod(directory, 0o1777)  # like /tmp: every user registers, nobody removes others' records
    except FileExistsError:
        pass
    except OSError as exc:
        raise GpuError(f"cannot create {directory}: {exc.strerror}") from None
    return directory


class SimulatedBackend(NvmlBackend):
    """NvmlBackend over simulated GPUs described by `[gpu.simulated]`, with device nodes in
    `device_dir` (a directory of its own: never /dev)."""

    def __init__(self, sim: SimulatedConfig, device_dir: Path):
        if device_dir.resolve() == Path("/dev"):
            raise GpuError("simulated GPUs need a paths.device_dir of their own, not /dev")
        try:
            device_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise GpuError(f"cannot create {device_dir}: {exc.strerror}") from None
        gpus = _fake_gpus(sim)
        for gpu in gpus:
            _make_node(device_dir / f"nvidia{gpu.minor}", (NVIDIA_MAJOR, gpu.minor))
        _make_node(device_dir / "nvidiactl", (NVIDIA_MAJOR, CTL_MINOR))
        registry = _make_registry(device_dir)
        try:
            _start_mig(sim, device_dir)
        except (OSError, ValueError) as exc:
            raise GpuError(f"cannot set up simulated MIG in {registry}: {exc}") from None
        self.library = FakeNvmlLibrary(gpus, device_dir, _Registry(registry))
        with pynvml.libLoadLock:
            pynvml.nvmlLib = self.library
            pynvml._nvmlGetFunctionPointer_cache.clear()
        super().__init__(mig_minors=registry / MIG_MINORS_FILE)

    def close(self) -> None:
        try:
            super().close()
        finally:
            with pynvml.libLoadLock:  # let a later NvmlBackend load the real library
                if pynvml.nvmlLib is self.library:
                    pynvml.nvmlLib = None
                    pynvml._nvmlGetFunctionPointer_cache.clear()
