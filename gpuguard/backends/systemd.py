"""sd_notify(3) with the standard library: tell systemd (Type=notify) how the daemon is doing."""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def notify(*assignments: str) -> bool:
    """Send e.g. `READY=1` (several at once: one datagram) to $NOTIFY_SOCKET; False when not
    started by systemd or nobody listens.

    Best effort, as sd_notify(3) is: the service manager going away must not stop the daemon.
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(assignments).encode())
    except OSError:
        return False
    return True


def status(text: str) -> bool:
    """One line for `systemctl status` (STATUS=); newlines would end the assignment."""
    return notify("STATUS=" + " ".join(text.split()))


def watchdog_period(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings when systemd watches this process (WatchdogSec=): half
    the timeout, as sd_watchdog_enabled(3) advises. None when nobody watches, or the watchdog is
    meant for another process (WATCHDOG_PID)."""
    environ = os.environ if environ is None else environ
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    owner = environ.get("WATCHDOG_PID")
    if usec <= 0 or (owner and owner != str(os.getpid() if pid is None else pid)):
        return None
    return usec / 2e6
