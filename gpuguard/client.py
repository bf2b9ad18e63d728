"""Talking to the daemon from the CLI and the pam_exec hook.

Root's calls (logins through the hook, admins' commands) go through root's door
(daemon_socket.root_door), which no other user can reach, and through the users' socket only
when no daemon serves root's door (one from before it existed). A connect that finds the listen
queue full (EAGAIN) or the daemon between two lives (ECONNREFUSED, for REFUSED_FOR at most) is
tried again, with a backoff, until the call's deadline: the connect is a blocking one (SO_SNDTIMEO bounds it), so a
full queue puts the caller among the kernel's waiters for it, each woken in turn as the daemon
accepts, rather than losing a race with a flood at every try.

Through `_socket`, the C module under `socket`: socket.py's enum conversions and selectors cost
every command and every pam_exec login a few milliseconds, a third of Python's own start-up, for
nothing a client of one request needs.
"""
from __future__ import annotations

import _socket
import errno
import os
import struct
import time

from gpuguard import daemon_socket, protocol
from gpuguard.core.errors import EXIT_UNREACHABLE, GpuguardError

TYPE_CHECKING = False  # not typing's: it costs the pam_exec hook (gpuguard.pam_hook) a few ms per login
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any


class DaemonUnreachable(GpuguardError):
    """No daemon answered on the socket (not running, wrong path, or too slow)."""

    code = EXIT_UNREACHABLE


class Refused(GpuguardError):
    """The daemon answered with an error, and the exit code it asked for."""


# Worth another try until the deadline: the queue is full, or the daemon is restarting.
RETRIED = frozenset({errno.EAGAIN, errno.ECONNREFUSED})
# A socket refused this long is a dead daemon's, not one restarting (the unit's RestartSec is 2 s):
# say so then, not at a deadline of 30 s.
REFUSED_FOR = 3.0
FIRST_PAUSE, LONGEST_PAUSE = 0.002, 0.05  # seconds between tries, doubling


def pauses() -> Iterator[float]:
    """The waits between connect tries: short at first (a queue drains in milliseconds), then capped."""
    pause = FIRST_PAUSE
    while True:
        yield pause
        pause = min(pause * 2, LONGEST_PAUSE)


def doors(socket_path: str, uid: int) -> list[str]:
    """The sockets to try, in order: root's door first for root."""
    return [daemon_socket.root_door(socket_path), socket_path] if uid == 0 else [socket_path]


def call(socket_path: str, op: str, timeout: float | None = 5.0, **fields: Any) -> dict[str, Any]:
    """Send one request, return the daemon's reply fields; raise Refused on `ok: false`."""
    request = protocol.encode({"op": op, **fields})
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        sock = connect(doors(socket_path, os.geteuid()), deadline)
        try:
            left = _left(deadline)
            sock.settimeout(None if left is None else max(left, 0.001))
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


def connect(paths: list[str], deadline: float | None) -> _socket.socket:
    """A socket connected to the first of paths that a daemon serves, tried again while the
    reason is one of RETRIED and the deadline allows; raises the last OSError. A path before the
    last one is a door only root's daemon may hold: one that does not exist, or is held by
    anyone else, is passed over for the next."""
    waits = pauses()
    refused_since: float | None = None
    while True:
        failure: OSError | None = None
        for index, path in enumerate(paths):
            last = index == len(paths) - 1
            try:
                sock = _connect_once(path, deadline)
            except OSError as exc:
                if exc.errno == errno.EAGAIN or (last and exc.errno in RETRIED):
                    failure = exc
                    break  # this door is served and full, or the last: wait for it
                if last:
                    raise
                continue  # not there or not served (a daemon from before root's door): the next door
            if last or _peer_uid(sock) == 0:
                return sock
            sock.close()
        left = _left(deadline)
        assert failure is not None  # the loop returns or raises otherwise
        if failure.errno != errno.ECONNREFUSED:
            refused_since = None
        elif refused_since is None:
            refused_since = time.monotonic()
        if (left is not None and left <= 0) or (refused_since is not None
                                                and time.monotonic() - refused_since >= REFUSED_FOR):
            raise failure
        time.sleep(next(waits) if left is None else min(next(waits), left))


def _connect_once(path: str, deadline: float | None) -> _socket.socket:
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        left = _left(deadline)
        if left is not None:  # a blocking connect waits this long at most for room in the queue
            left = max(left, 1e-6)
            seconds = int(left)
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDTIMEO,
                            struct.pack("@ll", seconds, int((left - seconds) * 1e6) + 1))  # a struct timeval
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def _peer_uid(sock: _socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12))
    return int(uid)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


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
