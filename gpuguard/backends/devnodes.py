"""The NVIDIA driver's device nodes, made by gpuguard because nvidia-modprobe no longer does.

etc/modprobe.d/gpuguard.conf sets NVreg_ModifyDeviceFiles=0 so that nvidia-modprobe cannot
reset the GPU nodes to 0666; it then creates no node at all. NVML itself needs nvidiactl and
the GPU nodes to start, so they are made from what the loaded driver reports in /proc, before
NVML is opened: GPUs 0660 root:root (the ACL layer adds the grantees), and the shared control
nodes 0666, since CUDA opens them for any GPU and they reach no GPU by themselves. Without the
driver loaded nothing is made: a node nobody serves is only clutter in /dev (and a 0666 one).
"""
from __future__ import annotations

import os
import re
import stat
from collections.abc import Collection, Iterable
from pathlib import Path

from gpuguard.backends import GpuError
from gpuguard.backends.posix_acl import acl_entries, apply_acls, named_users
from gpuguard.backends.procfs import char_major
from gpuguard.core.model import NVIDIA_MAJOR

DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")
BASE_MODE = 0o660  # GPU nodes: nobody but root and the ACL's named users may open them
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


def ensure_driver_nodes(device_dir: Path, minors: list[int], foreign: Collection[int] = ()) -> list[Path]:
    """Create whichever driver nodes are missing or wrong, none without the driver; returns the ones made.
    foreign: GPUs another system owns (gpuguard.core.coexist), whose nodes are made 0666 as the driver
    would and otherwise left as they are: Slurm's cgroups or the container runtime guard them."""
    if not driver_loaded():
        return []
    wanted: list[tuple[str, tuple[int, int], int]] = [
        ("nvidiactl", (NVIDIA_MAJOR, 255), SHARED_MODE),
        ("nvidia-modeset", (NVIDIA_MAJOR, 254), SHARED_MODE),
    ]
    uvm = char_major("nvidia-uvm")
    if uvm is not None:
        wanted += [("nvidia-uvm", (uvm, 0), SHARED_MODE), ("nvidia-uvm-tools", (uvm, 1), SHARED_MODE)]
    made = [device_dir / name for name, dev, mode in wanted if ensure_node(device_dir / name, dev, mode)]
    return made + [gpu_node(device_dir, minor) for minor in minors
                   if ensure_node(gpu_node(device_dir, minor), (NVIDIA_MAJOR, minor),
                                  SHARED_MODE if minor in foreign else BASE_MODE)]


def gpu_node(device_dir: Path, minor: int) -> Path:
    return device_dir / f"nvidia{minor}"


def caps_node(device_dir: Path, minor: int) -> Path:
    """A MIG capability node, as nvidia-modprobe names them: /dev/nvidia-caps/nvidia-cap<minor>."""
    return device_dir / "nvidia-caps" / f"nvidia-cap{minor}"


def ensure_node(path: str | os.PathLike[str], dev: tuple[int, int], mode: int = BASE_MODE) -> bool:
    """Create the character node, root-owned, when it is missing or is not `dev`; True when made.

    With NVreg_ModifyDeviceFiles=0 nvidia-modprobe creates no nodes, so gpuguard does: GPUs with
    the base mode, and nvidiactl, nvidia-modeset and nvidia-uvm with 0666.
    """
    try:
        st = os.lstat(path)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(*dev):
            return False
        os.unlink(path)
    except FileNotFoundError:
        pass
    # 0600 at birth (the umask only narrows it), widened once the owner is right.
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(*dev))
    os.chown(path, 0, 0)
    os.chmod(path, mode)
    return True


def set_base_mode(path: str | os.PathLike[str]) -> list[str]:
    """0660 root:root: nobody but root and the ACL's named users may open the node.
    Returns what had to change ("owner 1000:0", "mode 0666": what it was), empty when nothing."""
    st = os.stat(path)
    changed = []
    if (st.st_uid, st.st_gid) != (0, 0):
        os.chown(path, 0, 0)
        changed.append(f"owner {st.st_uid}:{st.st_gid}")
    if stat.S_IMODE(st.st_mode) != BASE_MODE:
        os.chmod(path, BASE_MODE)
        changed.append(f"mode {stat.S_IMODE(st.st_mode):04o}")
    return changed


def sync_gpu_node(path: Path, dev: tuple[int, int], uids: Iterable[int]) -> list[str]:
    """Make a GPU (or MIG capability) node what it should be: present as `dev`, 0660 root:root, an ACL entry for
    exactly `uids`. Idempotent, and writes nothing when the node is right (the node watcher
    sees every write). Returns what was wrong, as "<path>: <what it was>", empty when nothing."""
    uids = set(uids)
    if ensure_node(path, dev):  # made 0660 root:root: only its ACL is left to write
        apply_acls(path, uids)
        return [f"{path}: missing or not the device"]
    wrong = set_base_mode(path)
    current = acl_entries(path)
    before = named_users(current)
    if apply_acls(path, uids, current):
        wrong.append(f"ACL users {sorted(before)} instead of {sorted(uids)}" if before != uids
                     else "ACL entries")
    return [f"{path}: {what}" for what in wrong]


def make_driver_node(path: Path, dev: tuple[int, int], mode: int = 0o666) -> None:
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
