"""What /proc says about processes and devices: who holds a node open, and who a process is.

The gate only checks at open(), so revoking a device means finding the processes that already
hold it; and before signalling one of them the watcher re-checks its identity (uid and start
time), because a pid can be reused. Every reader here tolerates processes exiting mid-scan.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Callable, Collection, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import NamedTuple

from gpuguard.core.model import ProcessIdentity

PROC = Path("/proc")


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


class IdentityCache:
    """process_identity for the pids asked about again and again (NVML's GPU processes, each
    tick), at the cost of one stat of /proc/<pid> for a pid seen before.

    The kernel gives /proc/<pid> a new inode number when a pid is reused (and whenever it
    instantiates the inode again), and its owner is the effective uid: while both stay as they
    were, the process is the one read before and its identity is reused. Anything else reads
    it again. Signals re-check the identity through a pidfd anyway (backends.signals).
    """

    def __init__(self) -> None:
        self._known: dict[int, tuple[int, int, ProcessIdentity]] = {}  # pid -> (inode, owner, identity)

    def identities(self, pids: Iterable[int]) -> dict[int, ProcessIdentity]:
        """pid -> identity for the pids that run; only these are remembered for next time."""
        known: dict[int, tuple[int, int, ProcessIdentity]] = {}
        for pid in pids:
            try:
                st = os.stat(f"{PROC}/{pid}")  # a str: a Path would cost as much as the stat
            except (FileNotFoundError, ProcessLookupError):
                continue
            seen = self._known.get(pid)
            if seen is not None and seen[:2] == (st.st_ino, st.st_uid):
                known[pid] = seen
            elif (identity := process_identity(pid)) is not None:
                known[pid] = (st.st_ino, st.st_uid, identity)
        self._known = known
        return {pid: identity for pid, (_, _, identity) in known.items()}


def comm(pid: int) -> str | None:
    """The process name (the kernel's comm, as in /proc/<pid>/stat), or None when it has exited.
    One read, where inspect() takes three: a sample names every GPU process, each tick."""
    try:
        fd = os.open(f"{PROC}/{pid}/comm", os.O_RDONLY)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        return os.read(fd, 64).decode(errors="replace").removesuffix("\n")
    except ProcessLookupError:
        return None
    finally:
        os.close(fd)


def user_of(pid: int) -> int | None:
    """Real uid of pid, or None when it has exited."""
    identity = process_identity(pid)
    return identity.uid if identity else None


def controlling_ttys() -> dict[int, set[int]]:
    """uid -> the device numbers of its processes' controlling terminals, in one walk of /proc.
    The uid is the owner of /proc/<pid> (the effective one): the user a shell under `su - bob`
    or `sudo -u bob` runs as, on the terminal of whoever ran su."""
    found: dict[int, set[int]] = {}
    for pid in _walk(None, None):
        try:
            dirfd = os.open(f"{PROC}/{pid}", os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, ProcessLookupError):
            continue
        try:
            owner = os.fstat(dirfd).st_uid
            tty_nr = int(_read(dirfd, "stat").rpartition(")")[2].split()[7 - 3])  # field 7, after comm
        except (OSError, ValueError, IndexError):
            continue
        finally:
            os.close(dirfd)
        if tty_nr:  # the kernel's encoding: major in bits 8-19, minor in 0-7 and 20-31
            major, minor = (tty_nr >> 8) & 0xFFF, (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00)
            found.setdefault(owner, set()).add(os.makedev(major, minor))
    return found


def holders(dev: tuple[int, int], owners: Collection[int] | None = None) -> list[int]:
    """Pids that hold the character device `dev` open, through a descriptor or a mapping.

    Matched by st_rdev, so the node's path does not matter (containers, bind mounts,
    copies made with mknod). A mapping keeps the device open after its fd is closed,
    which CUDA does, so /proc/<pid>/map_files is checked too. See openers_of for `owners`.
    """
    return openers_of([dev], owners)[dev]


class RealUids:
    """The real uid of the root-owned /proc entries seen before, so that a walk reads
    /proc/<pid>/status only for those it has not seen: a host has thousands of root's processes
    (kernel threads, containers) and each logout's scan read every one (577 ms at 5,000).

    An entry is the same process while its inode and owner are (a pid reused gets a new inode,
    as IdentityCache relies on); a root-owned process keeps its real uid unless it calls
    setreuid() keeping euid 0, which no login path does. Each walk keeps only what it saw."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[int, int]] = {}  # pid -> (inode, real uid)
        self._seen: dict[int, tuple[int, int]] = {}

    def real_uid(self, pid: int, inode: int, read: Callable[[], int]) -> int:
        known = self._known.get(pid)
        uid = known[1] if known is not None and known[0] == inode else read()
        self._seen[pid] = (inode, uid)
        return uid

    def walked(self) -> None:
        """A walk ended: what it saw is what is known (a swap: walks in two threads lose entries at worst)."""
        self._known, self._seen = self._seen, {}


def openers_of(devices: Collection[tuple[int, int]],
               owners: Collection[int] | None = None,
               real_uids: RealUids | None = None,
               candidates: Iterable[int] | None = None) -> dict[tuple[int, int], list[int]]:
    """holders() for several character devices in one pass over /proc: each device's pids.

    Each process's descriptors and mappings are read once whatever the number of devices.
    With `owners` (real uids), only processes that may belong to them are opened: the owner
    of /proc/<pid> (one lstat, before any fd is listed) is the process's effective uid (root
    for a process that is not dumpable, on some kernels). A process owned by root there is
    judged by its real uid in /proc/<pid>/status: a user's setuid-root program is theirs. So
    the cost follows the owners' processes (plus root's), not the host's. Missed: a process
    whose real and effective uids are two different non-root users, which nothing on a
    login path makes. The kernel keeps no index from a file to the processes holding it (lsof
    and fuser walk /proc the same way; /proc/<pid>/fdinfo names the inode, not the device),
    so this walk is the cheapest answer outside the kernel (docs/performance.md). real_uids:
    remembered real uids of root-owned entries (RealUids), so that a root process seen before
    costs the lstat only. candidates: the owners' pids as an index knows them (proc_events): then
    only these are read, no walk at all, and the cost follows the owners' processes alone.
    """
    wanted = {os.makedev(*dev): dev for dev in devices}
    found: dict[tuple[int, int], list[int]] = {dev: [] for dev in wanted.values()}
    if not wanted or (owners is not None and not owners):
        return found
    mapped: dict[tuple[str, str], int | None] = {}  # (fs dev, inode) -> st_rdev, shared across pids
    for pid in _walk(owners, real_uids) if candidates is None else candidates:
        proc = PROC / str(pid)
        for rdev in (_open_devices(proc) | _mapped_devices(proc, mapped)) & wanted.keys():
            found[wanted[rdev]].append(pid)
    return {dev: sorted(pids) for dev, pids in found.items()}


def _walk(owners: Collection[int] | None, real_uids: RealUids | None) -> Iterator[int]:
    """The pids in /proc that may belong to `owners` (None: every pid)."""
    with os.scandir(PROC) as entries:
        for entry in entries:
            if entry.name.isdigit() and (owners is None or _may_belong(entry, owners, real_uids)):
                yield int(entry.name)
    if real_uids is not None and owners is not None:
        real_uids.walked()


def _may_belong(entry: os.DirEntry[str], owners: Collection[int], real_uids: RealUids | None) -> bool:
    """Whether the process of this /proc entry may have one of `owners` as its real uid."""
    try:
        st = entry.stat(follow_symlinks=False)
        if st.st_uid in owners:
            return True
        if st.st_uid != 0:
            return False
        # not dumpable (a setuid program) or root's: the real uid decides
        read = partial(_status_real_uid, entry.path)
        return (real_uids.real_uid(int(entry.name), st.st_ino, read) if real_uids else read()) in owners
    except (OSError, StopIteration):
        return False  # exited meanwhile


def _status_real_uid(path: str) -> int:
    with open(os.path.join(path, "status"), "rb") as status:
        uid_line = next(line for line in status if line.startswith(b"Uid:"))
    return int(uid_line.split()[1])


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
