"""The daemon's unix socket: one JSON request line per connection, one reply line, identity from SO_PEERCRED.

Every connection is its own task with a read deadline, so a client that connects and
sends nothing (or sends slowly) costs one file descriptor for a moment and never delays
a login. Requests are bounded by protocol.MAX_REQUEST. Access control is by the kernel's
peer credentials, not by file modes: the socket is 0666 on purpose.

Whatever a client sends, it gets one reply line or, if it sent nothing at all, none: a
malformed request (not JSON, wrong types, too long, cut off before its newline, unfinished
at the read deadline) is refused with code 2 and one log line, and those lines are
throttled per uid (logs.Throttle), so no client can flood the log. A traceback is logged
only for a fault of the daemon's own, and that too is throttled per uid.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuguard import protocol
from gpuguard.errors import GpuguardError
from gpuguard.logs import Throttle

READ_TIMEOUT = 2.0    # a PAM request is one small line; a client this slow is broken or hostile
WRITE_TIMEOUT = 10.0  # replies can be large (status of a busy server) and readers slow
MAX_CONNECTIONS_PER_USER = 64  # a user flooding the socket runs out of slots, root (logins) never does
READ_CHUNK = 64 * 1024
# Connections the kernel queues before accept (it caps this at net.core.somaxconn). asyncio's
# default of 100 filled up under one user's connect flood, and a login then got EAGAIN.
LISTEN_BACKLOG = 4096


class ServerError(GpuguardError):
    """The socket cannot be served (another daemon holds it, or the path is unusable)."""


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


Handler = Callable[[dict[str, Any], Peer], Awaitable[dict[str, Any]]]


class Server:
    def __init__(self, path: Path, handler: Handler, read_timeout: float = READ_TIMEOUT):
        self.path = Path(path)
        self.handler = handler
        self.read_timeout = read_timeout
        self._open: Counter[int] = Counter()  # connections in progress per uid
        self._server: asyncio.AbstractServer | None = None
        self.throttle = Throttle("uid")
        self._flusher: asyncio.Task | None = None

    async def start(self) -> None:
        """Serve on the path that claim() freed. Bound here rather than by asyncio, which would
        silently replace a socket someone else created at the path meanwhile."""
        _make_directory(self.path.parent)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o666)  # before listen(): nobody can connect yet
            self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=protocol.MAX_REQUEST,
                                                           backlog=LISTEN_BACKLOG)
        except OSError as exc:
            sock.close()
            raise ServerError(f"cannot serve on {self.path}: {exc.strerror}") from None
        self._flusher = asyncio.create_task(self._flush_throttle())

    async def _flush_throttle(self) -> None:
        """The "suppressed N" lines of a flood that stopped come within a window, not at its next line."""
        while True:
            await asyncio.sleep(self.throttle.window)
            self.throttle.flush()

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
            self.throttle.flush()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
            self.path.unlink(missing_ok=True)

    def claim(self) -> None:
        """Remove a socket left by a crashed daemon; raise ServerError when a live one answers on it.
        Call it before start(), as early as possible: the daemon does, before it touches anything."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise ServerError(f"{self.path} exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(self.path))
            except OSError as exc:
                if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                    raise ServerError(f"{self.path}: {exc.strerror}") from None
            else:
                raise ServerError(f"another gpuguard daemon is serving on {self.path}")
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _peer(writer.get_extra_info("socket"))
        self._open[peer.uid] += 1
        reply: dict[str, Any] | None
        try:
            if peer.uid != 0 and self._open[peer.uid] > MAX_CONNECTIONS_PER_USER:
                self.throttle.event(peer.uid, logging.WARNING, "refused", reason="too many connections", pid=peer.pid)
                reply = protocol.refused(f"more than {MAX_CONNECTIONS_PER_USER} connections at once from your user")
            else:
                reply = await self._reply(reader, peer)
            if reply is not None:
                writer.write(protocol.encode(reply))
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
        except (asyncio.TimeoutError, ConnectionError):
            pass  # the client went away or stopped reading: nothing to tell it
        finally:
            self._open[peer.uid] -= 1
            if not self._open[peer.uid]:
                del self._open[peer.uid]
            writer.close()

    async def _reply(self, reader: asyncio.StreamReader, peer: Peer) -> dict[str, Any] | None:
        try:
            line = await self._read_line(reader)
            if line is None:  # connected and sent nothing: nothing to answer
                return None
            request = protocol.decode_request(line)
        except protocol.ProtocolError as exc:
            self.throttle.event(peer.uid, logging.INFO, "bad_request", pid=peer.pid, error=str(exc))
            return protocol.refused(str(exc), 2)
        try:
            return await self.handler(request, peer)
        except Exception:
            self.throttle.event(peer.uid, logging.ERROR, "internal_error", exc_info=True, op=request["op"])
            return protocol.refused("internal error in the gpuguard daemon (see its log)")

    async def _read_line(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request line, read within the read timeout; None when the client sent nothing
        at all (it hung up, or stayed silent). Raises protocol.ProtocolError for anything else
        that is not a whole line: too long, cut off, or unfinished in time."""
        line = _Line()
        try:
            # One deadline for the whole line: a timer per chunk would cost a task each.
            await asyncio.wait_for(line.read(reader), self.read_timeout)
        except asyncio.TimeoutError:
            if not line.received:
                return None
            raise protocol.ProtocolError(f"incomplete request: no end of line within {self.read_timeout:g}s") from None
        return line.finished()


class _Line:
    """A request line as it arrives. A line too long is read on to its end but not kept:
    closing on unread data would reset the connection and lose the reply."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.received = 0  # bytes, kept or not

    async def read(self, reader: asyncio.StreamReader) -> None:
        while self.data.find(b"\n") < 0:
            if len(self.data) > protocol.MAX_REQUEST:
                self.data.clear()  # too long already: only its end is looked for
            chunk = await reader.read(READ_CHUNK)
            if not chunk:  # the client closed its side
                return
            self.data += chunk
            self.received += len(chunk)

    def finished(self) -> bytes | None:
        end = self.data.find(b"\n")
        if end < 0 and not self.received:
            return None
        dropped = self.received - len(self.data)
        if dropped or end + 1 > protocol.MAX_REQUEST or (end < 0 and self.received > protocol.MAX_REQUEST):
            raise protocol.ProtocolError(f"request exceeds {protocol.MAX_REQUEST} bytes")
        if end < 0:
            raise protocol.ProtocolError("incomplete request: the connection closed before the end of the line")
        return bytes(self.data[:end + 1])


def _make_directory(directory: Path) -> None:
    """Create the socket's directory, traversable by every user (clients connect as themselves).
    One that exists keeps its mode: it is someone else's, /tmp (sticky, world-writable) or
    systemd's RuntimeDirectory."""
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        return
    os.chmod(directory, 0o755)  # mkdir applied the umask


def _peer(sock: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Peer(pid, uid, gid)
