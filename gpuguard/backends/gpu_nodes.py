"""The device nodes grants.Grants writes through (its Nodes edge, edges.Nodes): the GPUs' /dev/nvidia<minor>
and the MIG capability nodes /dev/nvidia-caps/nvidia-cap<minor>."""
from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from gpuguard.backends import devnodes
from gpuguard.core.model import NVIDIA_MAJOR, Device


class AclNodes:
    """Each node made when missing, 0660 root:root, plus one ACL entry per allowed user. A MIG
    capability node is read (CUDA opens it read-only) and gets the same treatment: the driver
    makes them 0444, open to all."""

    def __init__(self, device_dir: Path):
        self.device_dir = Path(device_dir)

    def path(self, device: Device) -> Path:
        major, minor = device
        if major == NVIDIA_MAJOR:
            return devnodes.gpu_node(self.device_dir, minor)
        return devnodes.caps_node(self.device_dir, minor)

    def sync(self, device: Device, users: Collection[int]) -> list[str]:
        path = self.path(device)
        if device[0] != NVIDIA_MAJOR:
            path.parent.mkdir(mode=0o755, exist_ok=True)
        return devnodes.sync_gpu_node(path, device, users)
