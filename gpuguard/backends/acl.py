"""Device node permissions, the second layer under the gate: 0660 root:root plus one ACL entry per grantee.

ACLs are written as the kernel's binary xattr ("system.posix_acl_access"): u32 version 2, then
8-byte entries {u16 tag; u16 perm; u32 id} sorted by tag and id. Every write checks first and
does nothing when the node is already right: the NodeWatcher sees our own writes as IN_ATTRIB,
and a no-op is what ends that loop.
"""
from __future__ import annotations

import errno
import fnmatch
import logging
import os
import select
import socket
import stat
import struct
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from gpuguard.model import NVIDIA_MAJOR

log = logging.getLogger(__name__)

XATTR = "system.posix_acl_access"
VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED_ID = 0xFFFFFFFF
RW = 0o6
BASE_MODE = 0o660
_HEADER = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")

Entry = tuple[int, int, int]  # (tag, perm, id)


def set_base_mode(path: str | os.PathLike) -> None:
    """0660 root:root: nobody but root and the ACL's named users may open the node."""
    st = os.stat(path)
    if (st.st_uid, st.st_gid) != (0, 0):
        os.chown(path, 0, 0)
    if stat.S_IMODE(st.st_mode) != BASE_MODE:
        os.chmod(path, BASE_MODE)


def ensure_node(path: str | os.PathLike, dev: tuple[int, int], mode: int = BASE_MODE) -> bool:
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


def acl_entries(path: str | os.PathLike) -> list[Entry]:
    """The node's access ACL; the 3 entries its mode implies when it has none stored."""
    try:
        data = os.getxattr(path, XATTR)
    except OSError as exc:
        if exc.errno != errno.ENODATA:
            raise
        return _minimal(os.stat(path).st_mode)
    (version,) = _HEADER.unpack_from(data)
    if version != VERSION:
        raise ValueError(f"{path}: unknown ACL xattr version {version}")
    return [_ENTRY.unpack_from(data, offset) for offset in range(_HEADER.size, len(data), _ENTRY.size)]


def acl_users(path: str | os.PathLike) -> set[int]:
    """Uids with a named ACL entry on the node."""
    return {uid for tag, _, uid in acl_entries(path) if tag == USER}


def apply_acls(path: str | os.PathLike, uids: Iterable[int]) -> None:
    """Give exactly these uids rw on the node (the minimal 3-entry ACL when there are none).

    The owner, group and other entries are kept as they are; named groups are dropped.
    """
    current = acl_entries(path)
    base = {tag: perm for tag, perm, _ in current if tag in (USER_OBJ, GROUP_OBJ, OTHER)}
    users = sorted(set(uids))
    wanted = [(USER_OBJ, base[USER_OBJ], UNDEFINED_ID), *[(USER, RW, uid) for uid in users],
              (GROUP_OBJ, base[GROUP_OBJ], UNDEFINED_ID)]
    if users:  # named entries need a mask; it must not cut the owning group's rights either
        wanted.append((MASK, RW | base[GROUP_OBJ], UNDEFINED_ID))
    wanted.append((OTHER, base[OTHER], UNDEFINED_ID))
    if current != wanted:
        # For a minimal ACL the kernel just sets the mode bits and drops the xattr.
        os.setxattr(path, XATTR, _HEADER.pack(VERSION) + b"".join(_ENTRY.pack(*e) for e in wanted))


def _minimal(mode: int) -> list[Entry]:
    """The ACL that a mode alone stands for."""
    return [(USER_OBJ, mode >> 6 & 7, UNDEFINED_ID), (GROUP_OBJ, mode >> 3 & 7, UNDEFINED_ID),
            (OTHER, mode & 7, UNDEFINED_ID)]


# --- re-applying when nodes come back -----------------------------------------------------------

IN_ATTRIB, IN_MOVED_TO, IN_CREATE = 0x4, 0x80, 0x100
NETLINK_KOBJECT_UEVENT, UEVENT_KERNEL_GROUP = 15, 1
# The driver's modules: loading any of them means nodes to make or re-check (nvidia-uvm's and
# nvidia-modeset's modules usually load after the daemon started, often on first use).
DRIVER_MODULES = frozenset({"/module/nvidia", "/module/nvidia_uvm", "/module/nvidia_modeset"})


def is_driver_event(uevent: bytes, majors: Collection[str]) -> bool:
    """Whether a kernel uevent means nodes to re-check: a managed node (by major), a device the
    nvidia driver binds or unbinds, or one of its modules loading or unloading."""
    # "ACTION@DEVPATH\0KEY=VALUE\0...": keep the KEY=VALUE part.
    fields = dict(item.split("=", 1) for item in uevent.decode(errors="replace").split("\0") if "=" in item)
    return (fields.get("MAJOR") in majors or fields.get("DRIVER") == "nvidia"
            or fields.get("DEVPATH") in DRIVER_MODULES)


class NodeWatcher:
    """Calls `callback(path)` when a node matching `pattern` in `device_dir` is created or changed,
    and `callback(None)` ("re-apply everything") when one of the NVIDIA driver's modules loads or
    unloads (DRIVER_MODULES), the driver binds or unbinds a device, a managed node's uevent
    arrives, or inotify overflowed.

    nvidia-modprobe and admins create nodes with mknod, which sends no uevent: hence inotify on
    the directory (IN_CREATE, IN_MOVED_TO; IN_ATTRIB catches a reset mode or a flushed ACL).
    The callback must be idempotent and write nothing when the node is right (set_base_mode and
    apply_acls are): its own writes come back as IN_ATTRIB. A failing callback is logged and the
    watch goes on. Poll fileno() and call process() (the daemon's event loop does).
    """

    def __init__(self, device_dir: str | os.PathLike, callback: Callable[[Path | None], None],
                 pattern: str = "nvidia*", majors: Collection[int] = (NVIDIA_MAJOR,),
                 uevents: bool = True):
        # Imported here: pyroute2 costs 0.1 s at import, and most users of this module never watch.
        from pyroute2.inotify.inotify_fd import Inotify

        self.device_dir = Path(device_dir)
        self._callback = callback
        self._pattern = pattern
        self._majors = {str(m) for m in majors}
        self._inotify = Inotify(path=[])
        self._inotify.bind()
        if self._inotify.fd < 0:
            raise OSError(errno.EMFILE, "inotify_init failed")
        self._inotify.register_path(str(self.device_dir), IN_CREATE | IN_MOVED_TO | IN_ATTRIB)
        # A plain netlink socket, not pyroute2's UeventSocket: that one (0.9) buffers datagrams in
        # its asyncio core, so a poll on its fd misses queued events (measured: 2 of 5 seen).
        self._uevents: socket.socket | None = None
        if uevents:
            self._uevents = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK,
                                          NETLINK_KOBJECT_UEVENT)
            self._uevents.bind((0, UEVENT_KERNEL_GROUP))
        self._epoll = select.epoll()
        for fd in (self._inotify.fd, *([self._uevents.fileno()] if self._uevents else [])):
            self._epoll.register(fd, select.EPOLLIN)

    def fileno(self) -> int:
        """Readable when process() has something to do."""
        return self._epoll.fileno()

    def process(self) -> None:
        """Handle what is pending, without waiting."""
        for fd, _ in self._epoll.poll(0):
            if fd == self._inotify.fd:
                self._read_inotify()
            else:
                self._read_uevents()

    def close(self) -> None:
        self._epoll.close()
        self._inotify.close()
        if self._uevents:
            self._uevents.close()

    def _read_inotify(self) -> None:
        data = os.read(self._inotify.fd, 65536)
        try:
            paths = {msg["name"] for msg in self._inotify.parse(data)
                     if fnmatch.fnmatch(msg["name"], self._pattern)}
        except KeyError:  # IN_Q_OVERFLOW has no watch descriptor: events were lost
            self._call(None)
            return
        for name in sorted(paths):
            self._call(self.device_dir / name)

    def _read_uevents(self) -> None:
        relevant = False
        while True:
            try:
                data = self._uevents.recv(65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:  # ENOBUFS: events were lost
                    raise
                relevant = True
                continue
            relevant |= is_driver_event(data, self._majors)
        if relevant:
            self._call(None)

    def _call(self, path: Path | None) -> None:
        try:
            self._callback(path)
        except Exception:
            log.exception("re-applying device permissions for %s failed", path or "all nodes")
