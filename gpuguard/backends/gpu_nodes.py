"""The /dev/nvidia<minor> nodes of the GPUs: what grants.Grants writes through (its Nodes seam)."""
from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from gpuguard.backends import devnodes
from gpuguard.model import NVIDIA_MAJOR


class AclNodes:
    """Each GPU node made when missing, 0660 root:root, plus one ACL entry per allowed user."""

    def __init__(self, device_dir: Path):
        self.device_dir = Path(device_dir)

    def path(self, minor: int) -> Path:
        return devnodes.gpu_node(self.device_dir, minor)

    def sync(self, minor: int, users: Collection[int]) -> list[str]:
        return devnodes.sync_gpu_node(self.path(minor), (NVIDIA_MAJOR, minor), users)
