"""NvmlBackend through pynvml's own wrappers over the simulated NVML library, and `gpuguard gpus`.

Everything real except the GPU: pynvml's wrappers and structs, device nodes, processes, /proc.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import stat
import subprocess
from collections.abc import Iterator
from ctypes import CFUNCTYPE, c_int, c_void_p
from pathlib import Path

import pynvml
import pytest
from sim_helpers import GiB, burn, gpuguard, open_backend, write_config

from gpuguard.backends import GpuError, procfs
from gpuguard.backends.sim_registry import FAIL_FILE, REGISTRY_DIR, register_process
from gpuguard.backends.simulated import SimulatedBackend
from gpuguard.config import SimulatedConfig
from gpuguard.core.model import GpuProcess, Link


@pytest.fixture
def sleepers() -> Iterator:
    """Factory for real processes (root's `sleep`) that simulated NVML can report."""
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        started.append(subprocess.Popen(["sleep", "300"]))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def plant_record(device_dir: Path, owner: int = 0, **fields) -> Path:
    """Write a registry record by hand, as a confused or hostile user could."""
    path = device_dir / REGISTRY_DIR / f"{fields['pid']}-planted.json"
    path.write_text(json.dumps({"util": 0, "type": "C", **fields}))
    os.chown(path, owner, -1)
    return path


def start_ticks(pid: int) -> int:
    return procfs.process_identity(pid).start_time


class LibraryWith:
    """The simulated library with some C functions replaced or missing (as in older drivers)."""

    def __init__(self, library: object, missing: tuple[str, ...] = (), returning: dict[str, int] | None = None):
        self._library, self._missing = library, missing
        # Every replaced function here takes (handle, out-pointer).
        self._returning = {name: CFUNCTYPE(c_int, c_void_p, c_void_p)(lambda handle, out, code=code: code)
                           for name, code in (returning or {}).items()}

    def __getattr__(self, name: str) -> object:
        if name in self._missing:
            raise AttributeError(name)  # what ctypes raises for a symbol the library lacks
        return self._returning.get(name) or getattr(self._library, name)


def test_inventory_comes_through_pynvml_with_minor_numbers(device_dir: Path) -> None:
    sim = SimulatedConfig(count=4, memory=16 * GiB, name="Test GPU 16GB", numa_nodes=((0, 1), (2,)))
    with SimulatedBackend(sim, device_dir) as backend:
        assert pynvml.nvmlLib is backend.library
        gpus = backend.gpus()
    # NVML enumerates in PCI order; the minors are rotated against it on purpose.
    assert [(gpu.index, gpu.unit) for gpu in gpus] == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert all(gpu.name == "Test GPU 16GB" and gpu.memory_total == 16 * GiB for gpu in gpus)
    assert all(gpu.memory_used == 0 and gpu.utilization == 0 for gpu in gpus)
    assert {gpu.unit: gpu.numa_node for gpu in gpus} == {0: 0, 1: 0, 2: 1, 3: None}
    buses = [gpu.pci_bus_id for gpu in gpus]
    assert all(re.fullmatch(r"00000000:[0-9A-F]{2}:00\.0", bus) for bus in buses) and buses == sorted(set(buses))
    uuids = [gpu.uuid for gpu in gpus]
    assert all(re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", u) for u in uuids)
    assert len(set(uuids)) == 4
    with SimulatedBackend(sim, device_dir) as again:  # deterministic per name and minor
        assert [gpu.uuid for gpu in again.gpus()] == uuids
    assert pynvml.nvmlLib is None  # closing uninstalls the fake


def test_device_nodes_are_created_like_a_fresh_driver(backend: SimulatedBackend, device_dir: Path) -> None:
    for name, minor in [("nvidia0", 0), ("nvidia3", 3), ("nvidiactl", 255)]:
        st = os.lstat(device_dir / name)
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(195, minor)
        assert stat.S_IMODE(st.st_mode) == 0o666
    assert stat.S_IMODE(os.lstat(device_dir / REGISTRY_DIR).st_mode) == 0o1777
    assert not (device_dir / "nvidia4").exists()


def test_existing_nodes_keep_their_mode_and_impostors_are_refused(device_dir: Path) -> None:
    SimulatedBackend(SimulatedConfig(count=4), device_dir).close()
    os.chmod(device_dir / "nvidia1", 0o600)
    with SimulatedBackend(SimulatedConfig(count=4), device_dir):
        assert stat.S_IMODE(os.lstat(device_dir / "nvidia1").st_mode) == 0o600
    (device_dir / "nvidia2").unlink()
    (device_dir / "nvidia2").write_text("not a device")
    with pytest.raises(GpuError, match=r"nvidia2 exists but is not the device node 195:2"):
        SimulatedBackend(SimulatedConfig(count=4), device_dir)
    with pytest.raises(GpuError, match="not /dev"):
        SimulatedBackend(SimulatedConfig(count=4), Path("/dev"))


def test_topology_comes_from_the_configured_groups(device_dir: Path) -> None:
    sim = SimulatedConfig(count=6, nvlink_groups=((0, 1), (4, 5)), pcie_switches=((0, 1, 2), (3, 4, 5)),
                          numa_nodes=((0, 1, 2, 3), (4, 5)))
    NV, PIX, NODE, SYS = Link.NVLINK, Link.PCIE_SWITCH, Link.NUMA_NODE, Link.SYSTEM
    with SimulatedBackend(sim, device_dir) as backend:
        assert backend.topology() == {
            (0, 1): NV, (0, 2): PIX, (0, 3): NODE, (0, 4): SYS, (0, 5): SYS,
            (1, 2): PIX, (1, 3): NODE, (1, 4): SYS, (1, 5): SYS,
            (2, 3): NODE, (2, 4): SYS, (2, 5): SYS,
            (3, 4): PIX, (3, 5): PIX,
            (4, 5): NV,
        }


def test_processes_with_known_and_unknown_memory(backend: SimulatedBackend, device_dir: Path, sleepers) -> None:
    known, unknown, graphics = sleepers(), sleepers(), sleepers()
    register_process(device_dir, known.pid, 1, 4 * GiB, util=30)
    register_process(device_dir, unknown.pid, 1, None, util=50, type="C+G")  # in both NVML lists
    register_process(device_dir, graphics.pid, 2, GiB, util=10, type="G")
    assert backend.processes() == sorted([
        GpuProcess(known.pid, 1, 4 * GiB),
        GpuProcess(unknown.pid, 1, None),   # unknown stays unknown: never 0
        GpuProcess(graphics.pid, 2, GiB),
    ], key=lambda p: (p.unit, p.pid))
    usage = {gpu.unit: (gpu.memory_used, gpu.utilization) for gpu in backend.gpus()}
    assert usage == {0: (0, 0), 1: (4 * GiB, 80), 2: (GiB, 10), 3: (0, 0)}


def test_dead_process_is_dropped(backend: SimulatedBackend, device_dir: Path, sleepers) -> None:
    proc = sleepers()
    record = register_process(device_dir, proc.pid, 0, GiB, util=100)
    assert backend.processes() == [GpuProcess(proc.pid, 0, GiB)]
    proc.kill()
    proc.wait()
    assert backend.processes() == []
    assert not record.exists()  # root's reader also cleans up after SIGKILLed programs


def test_record_of_an_earlier_process_with_the_same_pid_is_ignored(backend: SimulatedBackend, device_dir: Path,
                                                                   sleepers) -> None:
    proc = sleepers()
    fields = {"pid": proc.pid, "uid": 0, "minor": 3, "memory": GiB}
    plant_record(device_dir, start_time=start_ticks(proc.pid) - 1, **fields)  # the pid was reused since
    assert backend.processes() == []
    plant_record(device_dir, start_time=start_ticks(proc.pid), **fields)  # control: the same record, current
    assert backend.processes() == [GpuProcess(proc.pid, 3, GiB)]


@pytest.mark.parametrize("owner, claimed_uid", [(65534, 65534), (65534, 0), (0, 65534)])
def test_record_about_another_users_process_is_ignored(backend: SimulatedBackend, device_dir: Path, sleepers,
                                                        owner: int, claimed_uid: int) -> None:
    proc = sleepers()  # runs as root
    record = plant_record(device_dir, owner=owner, pid=proc.pid, uid=claimed_uid,
                          start_time=start_ticks(proc.pid), minor=0, memory=70 * GiB)
    assert backend.processes() == []
    assert not record.exists()


def test_nvml_error_raises_instead_of_reading_as_no_processes(backend: SimulatedBackend, device_dir: Path,
                                                              sleepers) -> None:
    proc = sleepers()
    register_process(device_dir, proc.pid, 2, GiB, util=100)
    fail = device_dir / REGISTRY_DIR / FAIL_FILE
    for name, message in [("NVML_ERROR_GPU_IS_LOST", "GPU is lost"), ("NVML_ERROR_UNKNOWN", "Unknown Error"),
                          ("NVML_ERROR_NO_DATA", "No data")]:  # the last one's text comes from nvmlErrorString
        fail.write_text(name + "\n")
        with pytest.raises(GpuError) as raised:
            backend.processes()
        assert str(raised.value) == f"NVML nvmlDeviceGetComputeRunningProcesses_v3 failed on GPU 2: {message}"
    os.chown(fail, 65534, -1)  # the registry is world-writable: users cannot inject faults
    assert backend.processes() == [GpuProcess(proc.pid, 2, GiB)]
    fail.unlink()
    assert backend.processes() == [GpuProcess(proc.pid, 2, GiB)]


def test_one_failing_gpu_fails_alone(backend: SimulatedBackend, device_dir: Path, sleepers) -> None:
    on_1, on_2 = sleepers(), sleepers()
    register_process(device_dir, on_1.pid, 1, GiB, util=100)
    register_process(device_dir, on_2.pid, 2, GiB, util=100)
    fail = device_dir / REGISTRY_DIR / FAIL_FILE
    fail.write_text("NVML_ERROR_GPU_IS_LOST 2\n")
    query = backend.query_processes()
    assert query.processes == [GpuProcess(on_1.pid, 1, GiB)]  # never "GPU 2 has no processes"
    assert query.read == {0, 1, 3}
    assert query.failed == {2: "NVML nvmlDeviceGetComputeRunningProcesses_v3 failed on GPU 2: GPU is lost"}
    with pytest.raises(GpuError, match="on GPU 2: GPU is lost"):
        backend.processes()  # the all-or-nothing view, for `gpuguard gpus`
    fail.write_text("NVML_ERROR_GPU_IS_LOST 0 1 2 3\n")  # no GPU answers: NVML itself is failing
    with pytest.raises(GpuError, match="on GPU 2: GPU is lost"):
        backend.query_processes()
    fail.unlink()
    assert backend.query_processes().read == {0, 1, 2, 3}


def test_a_gpu_lost_before_start_is_left_out(device_dir: Path) -> None:
    SimulatedBackend(SimulatedConfig(count=4), device_dir).close()  # makes the registry directory
    (device_dir / REGISTRY_DIR / FAIL_FILE).write_text("NVML_ERROR_GPU_IS_LOST 2\n")
    with SimulatedBackend(SimulatedConfig(count=4), device_dir) as backend:
        assert [gpu.unit for gpu in backend.gpus()] == [3, 0, 1]  # NVML order; GPU 2 is NVML index 0
        assert backend.unavailable == ["NVML cannot reach the GPU at NVML index 0: GPU is lost"]
        assert sorted(backend.topology()) == [(0, 1), (0, 3), (1, 3)]
        assert backend.query_processes().read == {0, 1, 3}
        with pytest.raises(GpuError, match="NVML index 0: GPU is lost"):
            backend.processes()
    (device_dir / REGISTRY_DIR / FAIL_FILE).write_text("NVML_ERROR_GPU_IS_LOST 0 1 2 3\n")
    with pytest.raises(GpuError, match="NVML index 0: GPU is lost"):
        SimulatedBackend(SimulatedConfig(count=4), device_dir)  # not one GPU: NVML itself fails


def test_a_gpu_whose_inventory_fails_is_left_out(backend: SimulatedBackend, device_dir: Path) -> None:
    (device_dir / REGISTRY_DIR / FAIL_FILE).write_text("NVML_ERROR_UNKNOWN 3\n")  # lost after NVML started
    assert [gpu.unit for gpu in backend.gpus()] == [2, 0, 1]
    assert backend.unavailable == ["NVML nvmlDeviceGetMemoryInfo failed on GPU 3: Unknown Error"]
    assert sorted(backend.topology()) == [(0, 1), (0, 2), (1, 2)]
    (device_dir / REGISTRY_DIR / FAIL_FILE).unlink()
    assert len(backend.gpus()) == 4 and backend.unavailable == []


def test_values_nvml_cannot_tell_are_none(backend: SimulatedBackend, swap_library) -> None:
    swap_library(LibraryWith(backend.library, missing=("nvmlDeviceGetNumaNodeId",),
                             returning={"nvmlDeviceGetUtilizationRates": pynvml.NVML_ERROR_NOT_SUPPORTED}))
    gpus = backend.gpus()
    assert [(gpu.numa_node, gpu.utilization) for gpu in gpus] == [(None, None)] * 4
    assert all(gpu.memory_total == 16 * GiB for gpu in gpus)  # everything else still answers


def test_other_nvml_errors_in_the_inventory_raise(backend: SimulatedBackend, swap_library) -> None:
    swap_library(LibraryWith(backend.library, returning={"nvmlDeviceGetUtilizationRates": pynvml.NVML_ERROR_GPU_IS_LOST}))
    with pytest.raises(GpuError, match=r"^NVML nvmlDeviceGetUtilizationRates failed on GPU 2: GPU is lost$"):
        backend.gpus()


def test_calls_before_init_are_refused_like_nvml(device_dir: Path) -> None:
    backend = SimulatedBackend(SimulatedConfig(count=1), device_dir)
    library = backend.library
    backend.close()
    minor = ctypes.c_uint()
    assert library.nvmlDeviceGetMinorNumber(None, ctypes.byref(minor)) == pynvml.NVML_ERROR_UNINITIALIZED


def test_gpus_json_shows_inventory_processes_and_topology(sandbox: Path) -> None:
    config = write_config(sandbox, count=4, memory="40GiB")
    with open_backend(config):
        pass  # creates the device nodes
    with burn(config, gpu=2, mem="4GiB", util=25):
        result = subprocess.run(gpuguard(config, "gpus", "--json"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    gpus = {gpu["minor"]: gpu for gpu in data["gpus"]}
    assert sorted(gpus) == [0, 1, 2, 3] and [gpu["minor"] for gpu in data["gpus"]] == [0, 1, 2, 3]
    assert {minor: gpu["index"] for minor, gpu in gpus.items()} == {0: 2, 1: 3, 2: 0, 3: 1}
    assert (gpus[2]["processes"], gpus[2]["memory_used"], gpus[2]["utilization"]) == (1, 4 * GiB, 25)
    assert all((gpus[m]["processes"], gpus[m]["memory_used"]) == (0, 0) for m in (0, 1, 3))
    assert gpus[2]["memory_total"] == 40 * GiB and gpus[2]["uuid"].startswith("GPU-")
    assert gpus[0]["numa_node"] == 0 and gpus[3]["numa_node"] == 1
    topology = data["topology"]
    assert topology["0"] == {"0": "X", "1": "NVLINK", "2": "PCIE_SWITCH", "3": "PCIE_SWITCH"}
    assert topology["3"]["2"] == "NVLINK" and topology["2"]["0"] == "PCIE_SWITCH"


def test_gpus_on_a_machine_without_nvidia_driver_fails_in_one_line(sandbox: Path) -> None:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        pytest.skip("this machine has a real NVIDIA driver")
    except OSError:
        pass
    config = sandbox / "nvml.toml"
    config.write_text('[gpu]\nbackend = "nvml"\n')
    result = subprocess.run(gpuguard(config, "gpus"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr == "gpuguard: NVML nvmlInit failed: NVML Shared Library Not Found\n"
