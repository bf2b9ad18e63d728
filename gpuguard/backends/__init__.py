"""The only code that touches hardware or the kernel. This module stays light (no pynvml,
no ctypes) because every CLI command imports it for the backends' errors; backends load on demand."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from gpuguard.core.errors import GpuguardError

# The Debian package runs gpuguard from dist-packages on Debian's libraries, and carries
# nvidia-ml-py (pynvml), which Debian does not ship, in a directory of its own: only that install
# looks there (a checkout or venv never does), before anything else, so it runs the pynvml it was built with.
DEBIAN_VENDOR_DIR = "/usr/lib/gpuguard/vendor"
if __file__.startswith("/usr/lib/python3/dist-packages/") and DEBIAN_VENDOR_DIR not in sys.path:
    sys.path.insert(0, DEBIAN_VENDOR_DIR)

if TYPE_CHECKING:
    from gpuguard.backends.gate import DeviceRange, Gate
    from gpuguard.backends.nvml import NvmlBackend
    from gpuguard.config import Config
    from gpuguard.core.coexist import Ownership


class GpuError(GpuguardError):
    """An NVML call failed; one line naming the call, the GPU and NVML's error string."""


class GateError(GpuguardError):
    """The gate cannot be set up or changed; the message names the cause in its first line."""


def open_gpu_backend(config: Config) -> NvmlBackend:
    """The GPU backend the config asks for: real NVML or simulated GPUs. Raises GpuError."""
    from gpuguard.config import GpuBackend  # loaded already by whoever holds a config
    if config.gpu.backend == GpuBackend.SIMULATED:
        from gpuguard.backends.simulated import SimulatedBackend
        return SimulatedBackend(config.gpu.simulated, config.paths.device_dir)
    from gpuguard.backends.nvml import NvmlBackend
    return NvmlBackend()


def driver_minors(config: Config) -> set[int]:
    """The GPUs the driver has, whether or not NVML can read them (simulated: all of them)."""
    from gpuguard.config import GpuBackend
    if config.gpu.backend == GpuBackend.SIMULATED:
        return set(range(config.gpu.simulated.count))
    from gpuguard.backends.devnodes import driver_minors as loaded
    return set(loaded())


def caps_major(config: Config) -> int | None:
    """The major of the nvidia-caps nodes that guard MIG slices; None when the driver has not loaded it."""
    from gpuguard.config import GpuBackend
    if config.gpu.backend == GpuBackend.SIMULATED:
        from gpuguard.backends.mig_caps import SIMULATED_CAPS_MAJOR
        return SIMULATED_CAPS_MAJOR
    from gpuguard.backends.procfs import char_major
    return char_major("nvidia-caps")


def open_gate(config: Config, name: str, ownership: Ownership | None = None) -> Gate:
    """The gate over the GPU nodes and the MIG capability nodes of this config's GPUs, less those
    of the GPUs another system owns (gpuguard.core.coexist); the ranges are asked again at every attach
    and repair (an nvidia-caps module may load after start, and its table with it)."""
    from gpuguard.backends.gate import Gate, managed_ranges

    def managed() -> tuple[DeviceRange, ...]:
        major = caps_major(config)
        if ownership is None or not ownership.foreign:
            return managed_ranges(major)
        return managed_ranges(major, ownership.unmanaged(major, mig_minors(config) if major is not None else {}))
    return Gate(name, managed=managed)


def mig_minors(config: Config) -> dict[str, int]:
    """The driver's table of MIG capability minors, by name (`gpu0/gi1/access`); empty without nvidia-caps."""
    from gpuguard.backends import mig_caps
    from gpuguard.config import GpuBackend
    if config.gpu.backend == GpuBackend.SIMULATED:
        from gpuguard.backends.sim_mig import driver_mig_minors
        return mig_caps.parse_mig_minors(driver_mig_minors())
    return mig_caps.read_mig_minors()
