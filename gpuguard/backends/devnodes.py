"""The NVIDIA driver's device nodes, made by gpuguard because nvidia-modprobe no longer does.

etc/modprobe.d/gpuguard.conf sets NVreg_ModifyDeviceFiles=0 so that nvidia-modprobe cannot
reset the GPU nodes to 0666; it then creates no node at all. NVML itself needs nvidiactl and
the GPU nodes to start, so they are made from what the loaded driver reports in /proc, before
NVML is opened: GPUs 0660 root:root (the ACL layer adds the grantees), and the shared control
nodes 0666, since CUDA opens them for any GPU and they reach no GPU by themselves. Without the
driver loaded nothing is made: a node nobody serves is only clutter in /dev (and a 0666 one).
"""
from __future__ import annotations

import re
from pathlib import Path

from gpuguard.backends.acl import BASE_MODE, ensure_node
from gpuguard.backends.procfs import char_major
from gpuguard.model import NVIDIA_MAJOR

DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")
SHARED_MODE = 0o666
_MINOR_LINE = re.compile(r"^Device Minor:\s*(\d+)", re.MULTILINE)


def driver_minors(gpus_dir: Path = DRIVER_GPUS) -> list[int]:
    """Minor numbers of the GPUs bound to the nvidia driver (empty when it is not loaded)."""
    minors = []
    for info in gpus_dir.glob("*/information"):
        if match := _MINOR_LINE.search(info.read_text()):
            minors.append(int(match[1]))
    return sorted(minors)


def driver_loaded() -> bool:
    """Whether the nvidia module has registered its character major (195) in /proc/devices."""
    return any(char_major(name) == NVIDIA_MAJOR for name in ("nvidia-frontend", "nvidia"))


def ensure_driver_nodes(device_dir: Path, minors: list[int]) -> list[Path]:
    """Create whichever driver nodes are missing or wrong, none without the driver; returns the ones made."""
    if not driver_loaded():
        return []
    wanted: list[tuple[str, tuple[int, int], int]] = [
        ("nvidiactl", (NVIDIA_MAJOR, 255), SHARED_MODE),
        ("nvidia-modeset", (NVIDIA_MAJOR, 254), SHARED_MODE),
    ]
    uvm = char_major("nvidia-uvm")
    if uvm is not None:
        wanted += [("nvidia-uvm", (uvm, 0), SHARED_MODE), ("nvidia-uvm-tools", (uvm, 1), SHARED_MODE)]
    wanted += [(f"nvidia{minor}", (NVIDIA_MAJOR, minor), BASE_MODE) for minor in minors]
    return [device_dir / name for name, dev, mode in wanted if ensure_node(device_dir / name, dev, mode)]
