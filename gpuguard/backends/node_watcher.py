"""Watching for GPU device nodes that come back or change, so their permissions are re-applied.

nvidia-modprobe and admins create nodes with mknod, which sends no uevent: hence inotify on the
device directory; the driver's modules loading and GPUs binding come as kernel uevents (netlink).
"""
from __future__ import annotations

import errno
import fnmatch
import logging
import os
import select
import socket
from collections.abc import Callable, Collection
from pathlib import Path

from gpuguard.core.model import NVIDIA_MAJOR

log = logging.getLogger(__name__)

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

    def __init__(self, device_dir: str | os.PathLike[str], callback: Callable[[Path | None], None],
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
            elif self._uevents:  # the only other fd registered
                self._read_uevents(self._uevents)

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

    def _read_uevents(self, uevents: socket.socket) -> None:
        relevant = False
        while True:
            try:
                data = uevents.recv(65536)
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
