"""Talking to the daemon from the CLI and the pam_exec hook.

Through `_socket`, the C module under `socket`: socket.py's enum conversions and selectors cost
every command and every pam_exec login a few milliseconds, a third of Python's own start-up, for
nothing a client of one request needs.
"""
from __future__ import annotations

import _socket

from gpuguard import protocol
from gpuguard.core.errors import EXIT_UNREACHABLE, GpuguardError

TYPE_CHECKING = False  # not typing's: it costs the pam_exec hook (gpuguard.pam_hook) a few ms per login
if TYPE_CHECKING:
    from typing import Any


class DaemonUnreachable(GpuguardError):
    """No daemon answered on the socket (not running, wrong path, or too slow)."""

    code = EXIT_UNREACHABLE


class Refused(GpuguardError):
    """The daemon answered with an error, and the exit code it asked for."""


def call(socket_path: str, op: str, timeout: float | None = 5.0, **fields: Any) -> dict[str, Any]:
    """Send one request, return the daemon's reply fields; raise Refused on `ok: false`."""
    request = protocol.encode({"op": op, **fields})
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(socket_path)
            sock.sendall(request)
            reply = _read_line(sock)
        finally:
            sock.close()
    except (OSError, TimeoutError) as exc:
        raise DaemonUnreachable(f"gpuguard daemon not reachable at {socket_path}: {exc.strerror or exc}; "
                                "tell your admin") from None
    try:
        message = protocol.decode(reply)
    except protocol.ProtocolError as exc:
        raise DaemonUnreachable(f"bad reply from gpuguard daemon: {exc}") from None
    if not message.get("ok"):
        raise Refused(str(message.get("error", "refused")), int(message.get("code", 1)))
    return message


def _read_line(sock: _socket.socket) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n") or size > protocol.MAX_REPLY:
            break
    return b"".join(chunks)
