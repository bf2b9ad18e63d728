"""Simulated GPUs: NVIDIA's pynvml wrappers running over a fake NVML library.

Only the GPU is simulated. `SimulatedBackend` is `NvmlBackend` with `pynvml.nvmlLib` swapped
for `sim_nvml.FakeNvmlLibrary`, whose C functions pynvml calls through ctypes exactly as it calls
libnvidia-ml.so. So the code that runs against real GPUs is the code under test. Its parts:
`sim_nvml` (the fake library and its GPUs), `sim_registry` (the processes simulated CUDA
programs register, and fault injection), `sim_mig` (the MIG layout file, the driver's
capability table and nodes).

Device nodes are real: `paths.device_dir` gets `nvidia<minor>` (195:minor) per GPU and
`nvidiactl` (195:255), created mode 0666 like a freshly loaded driver does; existing nodes
keep their mode. With no driver behind major 195, an open() the kernel allows fails with
ENXIO, and one it refuses (file mode, ACL, the BPF gate) fails with EPERM or EACCES.

pynvml's library is process-wide: use one SimulatedBackend at a time per process.
"""
from __future__ import annotations

from pathlib import Path

import pynvml

from gpuguard.backends import GpuError
from gpuguard.backends.devnodes import make_driver_node
from gpuguard.backends.nvml import NvmlBackend
from gpuguard.backends.sim_mig import MIG_MINORS_FILE, start_mig
from gpuguard.backends.sim_nvml import FakeNvmlLibrary, fake_gpus
from gpuguard.backends.sim_registry import Registry, make_registry
from gpuguard.config import SimulatedConfig
from gpuguard.core.model import NVIDIA_MAJOR

CTL_MINOR = 255                     # /dev/nvidiactl


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
        gpus = fake_gpus(sim)
        for gpu in gpus:
            make_driver_node(device_dir / f"nvidia{gpu.minor}", (NVIDIA_MAJOR, gpu.minor))
        make_driver_node(device_dir / "nvidiactl", (NVIDIA_MAJOR, CTL_MINOR))
        registry = make_registry(device_dir)
        try:
            start_mig(sim, device_dir)
        except (OSError, ValueError) as exc:
            raise GpuError(f"cannot set up simulated MIG in {registry}: {exc}") from None
        self.library = FakeNvmlLibrary(gpus, device_dir, Registry(registry))
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
