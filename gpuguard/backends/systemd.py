"""sd_notify(3) with the standard library: tell systemd (Type=notify) how the daemon is doing."""
from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send e.g. `READY=1` to $NOTIFY_SOCKET; False when not started by systemd or nobody listens.

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
            sock.sendall(state.encode())
    except OSError:
        return False
    return True
