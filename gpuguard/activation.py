"""What `gpuguard enable` turns on and `gpuguard disable` turns off (file side effects only).

Installing gpuguard (the Debian package, `make install`) changes nothing on the machine: the
modprobe.d option that stops nvidia-modprobe from making the GPU nodes, and the udev rule that
re-applies gpuguard's modes when the driver loads, lie inert in /usr/lib/gpuguard. Enabling
links them where modprobe and udev read them (/etc, where the admin's own files live, so an
admin's file of the same name is never replaced); disabling removes exactly those links and
opens the GPU nodes as the driver makes them. The PAM profile and the systemd unit are
switched by their own tools (cli/enable_cmd.py).
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuguard.backends.posix_acl import apply_acls
from gpuguard.core.errors import GpuguardError

VENDOR_DIR = Path("/usr/lib/gpuguard")
# nvidia-modprobe's defaults (NVreg_DeviceFileMode/UID/GID): GPUs 0666 root:root; it makes the
# MIG capability nodes 0444.
DRIVER_GPU_MODE = 0o666
DRIVER_CAPS_MODE = 0o444
_GPU_NODE = re.compile(r"nvidia[0-9]+")
_CAPS_NODE = re.compile(r"nvidia-cap[0-9]+")


class ActivationError(GpuguardError):
    """A link cannot be made or removed (one line naming the file)."""


@dataclass(frozen=True)
class Link:
    path: Path    # where modprobe or udev reads it
    target: Path  # the installed, inert copy

    def state(self) -> str:
        """"on" (our link), "off" (nothing there) or "foreign" (a file or link of someone else's)."""
        if not os.path.lexists(self.path):
            return "off"
        if self.path.is_symlink() and Path(os.readlink(self.path)) == self.target:
            return "on"
        return "foreign"


def links(etc: Path = Path("/etc"), vendor: Path = VENDOR_DIR) -> tuple[Link, ...]:
    return (Link(etc / "modprobe.d/gpuguard.conf", vendor / "modprobe.d/gpuguard.conf"),
            Link(etc / "udev/rules.d/70-gpuguard.rules", vendor / "udev/70-gpuguard.rules"))


def make_links(wanted: tuple[Link, ...]) -> list[str]:
    """Link each; what was done, one line each. Nothing is done when one of them cannot be."""
    for link in wanted:
        if not link.target.is_file():
            raise ActivationError(f"{link.target}: missing: install gpuguard (package or make install) first")
        if link.state() == "foreign":
            raise ActivationError(f"{link.path}: exists and is not gpuguard's link to {link.target}; "
                                  "move it away first")
    done = []
    for link in wanted:
        if link.state() == "off":
            link.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            link.path.symlink_to(link.target)
            done.append(f"linked {link.path} -> {link.target}")
    return done


def remove_links(wanted: tuple[Link, ...]) -> list[str]:
    """Remove our links (never someone else's file); what was done, one line each."""
    done = []
    for link in wanted:
        if link.state() == "on":
            link.path.unlink()
            done.append(f"removed {link.path}")
    return done


def open_nodes(device_dir: Path) -> list[str]:
    """Every GPU node 0666 and every MIG capability node 0444, root:root, no ACL entries: as the
    driver makes them. Returns the nodes changed."""
    nodes = [(p, DRIVER_GPU_MODE) for p in _char_nodes(device_dir, _GPU_NODE)]
    nodes += [(p, DRIVER_CAPS_MODE) for p in _char_nodes(device_dir / "nvidia-caps", _CAPS_NODE)]
    changed = []
    for path, mode in nodes:
        st = os.stat(path)
        acl_changed = apply_acls(path, ())  # drops the named entries (and the mask with them)
        if acl_changed or (st.st_uid, st.st_gid) != (0, 0) or stat.S_IMODE(os.stat(path).st_mode) != mode:
            os.chown(path, 0, 0)
            os.chmod(path, mode)
            changed.append(str(path))
    return changed


def _char_nodes(directory: Path, name: re.Pattern[str]) -> list[Path]:
    try:
        entries = sorted(directory.iterdir())
    except FileNotFoundError:
        return []
    return [p for p in entries if name.fullmatch(p.name) and stat.S_ISCHR(p.lstat().st_mode)]
