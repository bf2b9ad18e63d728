"""The device nodes of the GPUs another system owns (gpuguard.core.coexist), made as that owner expects.

Slurm (its cgroup device control, ConstrainDevices) and the Kubernetes device plugin decide who
opens a GPU in the kernel's cgroup, not by file permissions: their jobs open the node as the driver
makes it, GPUs 0666 root:root and MIG capability nodes 0444, with no ACL. A GPU that was gpuguard's
and became theirs at a restart still has what gpuguard gave it, 0660 root:root and an ACL entry for
each holder it had: Slurm's jobs would get EACCES and the old holder keep a way in. hand_over
gives such nodes back: the named entries removed, gpuguard's 0660 root:root widened to the
driver's mode. A node someone else set otherwise (another owner or group) keeps its mode.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuguard.backends import caps_major, mig_minors
from gpuguard.backends.devnodes import BASE_MODE, SHARED_MODE, caps_node, gpu_node
from gpuguard.backends.posix_acl import GROUP, USER, acl_entries, apply_acls, named_users
from gpuguard.config import Config
from gpuguard.core.coexist import Ownership
from gpuguard.core.model import NVIDIA_MAJOR

CAPS_MODE = 0o444  # nvidia-modprobe makes capability nodes read-only for all


def hand_over(config: Config, ownership: Ownership) -> list[str]:
    """Make the nodes of the GPUs (and their MIG capabilities) that `ownership` gives another system
    as the driver makes them; returns what was changed, one "<path>: <what it was>" each."""
    if not ownership.foreign:
        return []
    major = caps_major(config)
    devices = ownership.unmanaged(major, mig_minors(config) if major is not None else {})
    changed = []
    for dev_major, minor in devices:
        gpu = dev_major == NVIDIA_MAJOR
        path = gpu_node(config.paths.device_dir, minor) if gpu else caps_node(config.paths.device_dir, minor)
        if (what := hand_over_node(path, (dev_major, minor), SHARED_MODE if gpu else CAPS_MODE)):
            changed.append(f"{path}: {what}")
    return changed


def hand_over_node(path: Path, dev: tuple[int, int], mode: int) -> str:
    """One node: named ACL entries dropped, 0660 root:root made `mode`. "" when it was right, is
    missing, or is not the device (nothing of gpuguard's to undo there)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ""
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != os.makedev(*dev):
        return ""
    was = []
    current = acl_entries(path)
    if any(tag in (USER, GROUP) for tag, _, _ in current):
        was.append(f"ACL users {sorted(named_users(current))}")
        apply_acls(path, (), current)
    st = os.stat(path)
    if (st.st_uid, st.st_gid) == (0, 0) and stat.S_IMODE(st.st_mode) == BASE_MODE:
        os.chmod(path, mode)
        was.append(f"mode {BASE_MODE:04o}")
    return ", ".join(was)
