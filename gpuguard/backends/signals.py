"""Signalling processes safely: through a pidfd, after re-checking who the process is.

A pid is reused once its process is reaped, so "kill pid 4242" can hit a stranger. The
order below makes that impossible:

1. `pidfd_open(pid)`: the fd now names one process for good; if that process exits and
   the pid is reused, signals through this fd fail with ESRCH instead of reaching the
   newcomer.
2. Read /proc/<pid>/stat and status and compare uid and start time with the identity the
   watcher recorded when it sampled. If the pidfd's process was still alive when step 3
   succeeds, it held the pid throughout, so what /proc said was about it.
3. `pidfd_send_signal`. ESRCH means it is gone (exited, or replaced and so never hit).

Root (real or effective uid 0) and exempt uids are refused here as a last line of defence,
whatever the caller decided. "Still on that GPU" is the caller's re-sample (NVML) taken just
before; a process whose memory NVML still reports after SIGKILL + kill_wait is what the
watcher reports as unkillable (typically state D, stuck in the kernel).
"""
from __future__ import annotations

import errno
import os
import signal
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum

from gpuguard.backends.procfs import ProcessIdentity

PROC = "/proc"


class Outcome(str, Enum):
    SENT = "sent"        # delivered to the process the identity names
    GONE = "gone"        # exited, or the pid now belongs to another process (which was not touched)
    REFUSED = "refused"  # root or exempt: never signalled


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    detail: str = ""

    @property
    def sent(self) -> bool:
        return self.outcome is Outcome.SENT


@dataclass(frozen=True)
class ProcessInfo:
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
        dirfd = os.open(f"{PROC}/{pid}", os.O_RDONLY | os.O_DIRECTORY)
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


def command(pid: int) -> str:
    """The process name (comm) for messages, printable characters only; "" when gone."""
    info = inspect(pid)
    return sanitize(info.comm) if info else ""


def sanitize(text: str) -> str:
    # Process names are chosen by their owner: keep escape sequences out of terminals and logs.
    return "".join(c if c.isprintable() else "?" for c in text)


def send(identity: ProcessIdentity, sig: int, exempt: Collection[int] = ()) -> Result:
    """Send sig to the process `identity` names, and to no other. Never raises for a gone process."""
    try:
        pidfd = os.pidfd_open(identity.pid)
    except ProcessLookupError:
        return Result(Outcome.GONE, "no such process")
    try:
        info = inspect(identity.pid)
        if info is None or info.state in ("Z", "X"):
            return Result(Outcome.GONE, "exited")
        if info.start_time != identity.start_time or info.uid != identity.uid:
            return Result(Outcome.GONE, f"pid {identity.pid} now belongs to another process (not signalled)")
        if 0 in (info.uid, info.euid) or info.uid in exempt:
            return Result(Outcome.REFUSED, "root or exempt process")
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        return Result(Outcome.GONE, "exited")
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return Result(Outcome.GONE, "exited")
        raise
    finally:
        os.close(pidfd)
    return Result(Outcome.SENT)


def state(identity: ProcessIdentity) -> str | None:
    """'D (uninterruptible sleep)' and the like for a process that is still the one named, else None."""
    info = inspect(identity.pid)
    if info is None or info.start_time != identity.start_time:
        return None
    return f"{info.state} ({STATE_NAMES.get(info.state, 'unknown')})"


def _read(dirfd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY, dir_fd=dirfd)
    try:
        return os.read(fd, 65536).decode(errors="replace")
    finally:
        os.close(fd)
