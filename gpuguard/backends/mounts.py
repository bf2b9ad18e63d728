"""Where the kernel filesystems the gate needs are mounted: the cgroup v2 root and bpffs."""
from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterator
from pathlib import Path

from gpuguard.backends import GateError

BPFFS = Path("/sys/fs/bpf")
_libc = ctypes.CDLL(None, use_errno=True)


def mounts() -> Iterator[tuple[str, str]]:
    """(mount point, fs type) from /proc/self/mountinfo, octal escapes decoded."""
    with open("/proc/self/mountinfo") as lines:
        for line in lines:
            left, _, right = line.partition(" - ")
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), left.split()[4])
            yield point, right.split()[0]


def cgroup2_root() -> Path:
    """The root of the cgroup v2 hierarchy: /sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid hosts."""
    for point, fstype in mounts():
        if fstype == "cgroup2":
            return Path(point)
    raise GateError("no cgroup v2 mount in /proc/self/mountinfo: the gate needs the unified hierarchy "
                    "(systemd.unified_cgroup_hierarchy, or mount -t cgroup2 none /sys/fs/cgroup/unified)")


def bpffs_mounted() -> bool:
    return (str(BPFFS), "bpf") in mounts()


def ensure_bpffs() -> None:
    """Mount bpffs at /sys/fs/bpf unless it is there (systemd mounts it at boot; a container may not)."""
    if bpffs_mounted():
        return
    if _libc.mount(b"bpf", str(BPFFS).encode(), b"bpf", 0, b"mode=0700") != 0:
        err = ctypes.get_errno()
        raise GateError(f"cannot mount bpffs at {BPFFS}: {os.strerror(err)}")


def unmount_bpffs() -> None:
    _libc.umount(str(BPFFS).encode())
