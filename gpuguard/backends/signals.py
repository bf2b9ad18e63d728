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

from gpuguard.backends.procfs import STATE_NAMES, comm, inspect
from gpuguard.core.escape import printable
from gpuguard.core.model import ProcessIdentity, SignalOutcome, SignalResult


def command(pid: int) -> str:
    """The process name (comm) for messages, control characters escaped (its owner chose it:
    escape.printable); "" when gone."""
    name = comm(pid)
    return printable(name) if name else ""


def send(identity: ProcessIdentity, sig: int, exempt: Collection[int] = ()) -> SignalResult:
    """Send sig to the process `identity` names, and to no other. Never raises for a gone process."""
    try:
        pidfd = os.pidfd_open(identity.pid)
    except ProcessLookupError:
        return SignalResult(SignalOutcome.GONE, "no such process")
    try:
        info = inspect(identity.pid)
        if info is None or info.state in ("Z", "X"):
            return SignalResult(SignalOutcome.GONE, "exited")
        if info.start_time != identity.start_time or info.uid != identity.uid:
            return SignalResult(SignalOutcome.GONE, f"pid {identity.pid} now belongs to another process (not signalled)")
        if 0 in (info.uid, info.euid) or info.uid in exempt:
            return SignalResult(SignalOutcome.REFUSED, "root or exempt process")
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        return SignalResult(SignalOutcome.GONE, "exited")
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return SignalResult(SignalOutcome.GONE, "exited")
        raise
    finally:
        os.close(pidfd)
    return SignalResult(SignalOutcome.SENT)


def state(identity: ProcessIdentity) -> str | None:
    """'D (uninterruptible sleep)' and the like for a process that is still the one named, else None."""
    info = inspect(identity.pid)
    if info is None or info.start_time != identity.start_time:
        return None
    return f"{info.state} ({STATE_NAMES.get(info.state, 'unknown')})"

