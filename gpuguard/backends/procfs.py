"""What /proc says about processes and devices: who holds a node open, and who a process is.

The gate only checks at open(), so revoking a device means finding the processes that already
hold it; and before signalling one of them the watcher re-checks its identity (uid and start
time), because a pid can be reused. Every reader here tolerates processes exiting mid-scan.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")


class ProcessIdentity(NamedTuple):
    """A process as the kernel knows it: the pid is reused, the (pid, start_time) pair is not."""

    pid: int
    uid: int         # real uid: the one the gate's bpf_get_current_uid_gid() sees
    start_time: int  # clock ticks after boot, /proc/<pid>/stat field 22


def char_major(name: str) -> int | None:
    """The major number of a character driver in /proc/devices (e.g. "nvidia-caps"), if loaded."""
    in_char = False
    for line in (PROC / "devices").read_text().splitlines():
        if line.endswith(":"):
            in_char = line == "Character devices:"
        elif in_char and line.split()[1:] == [name]:
            return int(line.split()[0])
    return None


class ProcessInfo(NamedTuple):
    pid: int
    uid: int          # real uid
    euid: int
    start_time: int   # clock ticks after boot
    state: str        # one letter: R S D Z T ...
    comm: str

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.uid, self.start_time)


STATE_NAMES = {"R": "running", "S": "sleeping", "D": "uninterruptible sleep", "Z": "zombie",
               "T": "stopped", "t": "traced", "X": "dead", "I": "idle"}


def inspect(pid: int) -> ProcessInfo | None:
    """What /proc says about pid now, or None when there is no such process.

    stat and status are read through one open /proc/<pid> directory: if the pid is
    reused in between, the second read fails (ESRCH) instead of describing another process.
    """
    try:
        dirfd = os.open(PROC / str(pid), os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        stat_line = _read(dirfd, "stat")
        status = _read(dirfd, "status")
    except (FileNotFoundError, ProcessLookupError):
        return None
    finally:
        os.close(dirfd)
    # comm (field 2) may hold spaces and parentheses: the fields after the last ')' start at 3.
    comm = stat_line[stat_line.index("(") + 1:stat_line.rindex(")")]
    rest = stat_line.rpartition(")")[2].split()
    uids = next(line.split()[1:3] for line in status.splitlines() if line.startswith("Uid:"))
    return ProcessInfo(pid, int(uids[0]), int(uids[1]), int(rest[22 - 3]), rest[0], comm)


def process_identity(pid: int) -> ProcessIdentity | None:
    """uid and start time of pid, or None when it has exited."""
    info = inspect(pid)
    return info.identity if info else None


def user_of(pid: int) -> int | None:
    """Real uid of pid, or None when it has exited."""
    identity = process_identity(pid)
    return identity.uid if identity else None


def holders(dev: tuple[int, int]) -> list[int]:
    """Pids that hold the character device `dev` open, through a descriptor or a mapping.

    Matched by st_rdev, so the node's path does not matter (containers, bind mounts,
    copies made with mknod). A mapping keeps the device open after its fd is closed,
    which CUDA does, so /proc/<pid>/map_files is checked too.
    """
    return holders_of([dev])[dev]


def holders_of(devices: Collection[tuple[int, int]], uids: Collection[int] | None = None,
               ) -> dict[tuple[int, int], list[int]]:
    """holders() for several character devices in one scan of /proc: each device's pids.

    Each process's descriptors and mappings are read once whatever the number of devices,
    instead of once per device. With `uids`, only those users' processes (by real uid, which
    a process cannot hide the way a non-dumpable one hides its /proc owner) are read: the
    descriptors and mappings of every process on a busy machine take seconds to read.
    """
    wanted = {os.makedev(*dev): dev for dev in devices}
    found: dict[tuple[int, int], list[int]] = {dev: [] for dev in wanted.values()}
    if not wanted:
        return found
    mapped: dict[tuple[str, str], int | None] = {}  # (fs dev, inode) -> st_rdev, shared across pids
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            if uids is not None and ((info := inspect(int(entry.name))) is None or info.uid not in uids):
                continue
            for rdev in (_open_devices(entry) | _mapped_devices(entry, mapped)) & wanted.keys():
                found[wanted[rdev]].append(int(entry.name))
    return {dev: sorted(pids) for dev, pids in found.items()}


def _open_devices(proc: Path) -> set[int]:
    """st_rdev of the character devices the process holds a descriptor of."""
    try:
        fds = os.listdir(proc / "fd")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return set()
    devices = set()
    for fd in fds:
        link = proc / "fd" / fd
        try:
            # Sockets, pipes and anon inodes have no path: skip them without a stat.
            if os.readlink(link).startswith("/") and stat.S_ISCHR((st := os.stat(link)).st_mode):
                devices.add(st.st_rdev)
        except OSError:
            continue  # closed or exited meanwhile
    return devices


def _mapped_devices(proc: Path, seen: dict[tuple[str, str], int | None]) -> set[int]:
    """st_rdev of the character devices the process has mapped (CUDA keeps them after closing the fd)."""
    try:
        lines = (proc / "maps").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return set()
    devices = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[4] == "0":
            continue  # anonymous mapping
        key = (fields[3], fields[4])
        if key not in seen:
            # One stat per distinct file: shared libraries repeat in every process.
            # map_files names are the range without the zero padding that maps uses.
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                st = os.stat(proc / "map_files" / f"{start:x}-{end:x}")
            except OSError:
                continue
            seen[key] = st.st_rdev if stat.S_ISCHR(st.st_mode) else None
        if (device := seen[key]) is not None:
            devices.add(device)
    return devices


def _read(dirfd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY, dir_fd=dirfd)
    try:
        return os.read(fd, 65536).decode(errors="replace")
    finally:
        os.close(fd)
