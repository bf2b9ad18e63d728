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

Who may hold a connection is admission.py's: root always, each other uid up to its cap, all uids
without an account (a user namespace's) one small cap together, and all non-root connections
below a limit that keeps descriptors for root and the daemon. A connection over a cap gets a
one-line refusal at once.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuguard import protocol
from gpuguard.core.errors import GpuguardError
from gpuguard.daemon import admission
from gpuguard.logs import Throttle

READ_TIMEOUT = 2.0    # a PAM request is one small line; a client this slow is broken or hostile
WRITE_TIMEOUT = 10.0  # replies can be large (status of a busy server) and readers slow
MAX_CONNECTIONS_PER_USER = admission.PER_UID
READ_CHUNK = 64 * 1024
# Connections the kernel queues before accept (it caps this at net.core.somaxconn). asyncio's
# default of 100 filled up under one user's connect flood, and a login then got EAGAIN.
LISTEN_BACKLOG = 4096
# asyncio accepts up to its `backlog` connections in one go before any of them is admitted
# (admission.py): 4096 at once would pass any descriptor limit. It is given this batch, and the
# kernel's queue is set to LISTEN_BACKLOG afterwards (listen() again changes only the queue).
ACCEPT_BATCH = 32


class ServerError(GpuguardError):
    """The socket cannot be served (another daemon holds it, or the path is unusable)."""


@dataclass(frozen=True)
class Peer:
    """Who is calling, as SO_PEERCRED says (never what a message claims)."""

    pid: int
    uid: int
    gid: int


Handler = Callable[[dict[str, Any], Peer], Awaitable[dict[str, Any]]]


class Server:
    def __init__(self, path: Path, handler: Handler, read_timeout: float = READ_TIMEOUT,
                 abandoned_on_hangup: frozenset[str] = frozenset(), budget: admission.Budget | None = None,
                 kinds: admission.AccountKinds | None = None):
        self.path = Path(path)
        self.handler = handler
        # Ops that only wait for something (a queued GPU): a client that hangs up cancels them.
        # Every other op runs to its end whatever the client does, so no change stops halfway.
        self.abandoned_on_hangup = abandoned_on_hangup
        self.read_timeout = read_timeout
        # Connections held, shared with the metrics endpoint (admission.py); the daemon passes its own.
        self.budget = budget or admission.Budget.for_descriptors(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.kinds = kinds or admission.AccountKinds()
        self._server: asyncio.AbstractServer | None = None
        self.throttle = Throttle("uid")
        self.loop_errors = Throttle("what", burst=1)
        self._flusher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve on the path that claim() freed. Bound here rather than by asyncio, which would
        silently replace a socket someone else created at the path meanwhile."""
        _make_directory(self.path.parent)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o666)  # before listen(): nobody can connect yet
            self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=protocol.MAX_REQUEST,
                                                           backlog=ACCEPT_BATCH)
            sock.listen(LISTEN_BACKLOG)
        except OSError as exc:
            sock.close()
            raise ServerError(f"cannot serve on {self.path}: {exc.strerror}") from None
        asyncio.get_running_loop().set_exception_handler(self._loop_error)
        self._flusher = asyncio.create_task(self._flush_throttle())

    async def _flush_throttle(self) -> None:
        """The "suppressed N" lines of a flood that stopped come within a window, not at its next line."""
        while True:
            await asyncio.sleep(self.throttle.window)
            self.throttle.flush()
            self.loop_errors.flush()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's own error reports, once per kind a window. Out of descriptors, its accept loop
        (this socket's and the metrics endpoint's) stops accepting for a second and reports each
        time; printed whole, that was 185,000 tracebacks in 40 s."""
        exception = context.get("exception")
        self.loop_errors.event(context.get("message", "error"), logging.ERROR, "loop_error",
                               error=f"{type(exception).__name__}: {exception}" if exception else None)

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
            self.throttle.flush()
            self.loop_errors.flush()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
            self.path.unlink(missing_ok=True)
        self.kinds.close()

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
        key = await self._admit(peer)
        if isinstance(key, str):  # refused: a short line fits the socket's buffer, no waiting on the client
            writer.write(protocol.encode(protocol.refused(key)))
            writer.close()
            return
        reply: dict[str, Any] | None
        try:
            reply = await self._reply(reader, peer, _log_key(key, peer))
            if reply is not None:
                writer.write(protocol.encode(reply))
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
        except (asyncio.TimeoutError, ConnectionError):
            pass  # the client went away or stopped reading: nothing to tell it
        finally:
            self.budget.give_back(key)
            writer.close()

    async def _admit(self, peer: Peer) -> admission.Key | str:
        """The kind of connection taken from the budget (give it back at the end), or why not."""
        if peer.uid == 0:
            key: admission.Key = admission.ROOT
        else:
            has_account = self.kinds.remembered(peer.uid)
            if has_account is None:
                waiting = admission.pending_key(peer.uid)
                if refusal := self.budget.take(waiting):
                    return self._refuse(peer, waiting, refusal)
                try:
                    has_account = await self.kinds.ask(peer.uid)
                finally:
                    self.budget.give_back(waiting)
            key = admission.uid_key(peer.uid) if has_account else admission.NO_ACCOUNT_KEY
        refusal = self.budget.take(key)
        return key if refusal is None else self._refuse(peer, key, refusal)

    def _refuse(self, peer: Peer, key: admission.Key, reason: str) -> str:
        self.throttle.event(_log_key(key, peer), logging.WARNING, "refused", reason=reason, pid=peer.pid,
                            peer_uid=peer.uid)
        return reason

    async def _reply(self, reader: asyncio.StreamReader, peer: Peer, log_key: object) -> dict[str, Any] | None:
        try:
            line = await self._read_line(reader)
            if line is None:  # connected and sent nothing: nothing to answer
                return None
            request = protocol.decode_request(line)
        except protocol.ProtocolError as exc:
            self.throttle.event(log_key, logging.INFO, "bad_request", pid=peer.pid, error=str(exc))
            return protocol.refused(str(exc), 2)
        try:
            if request.get("op") in self.abandoned_on_hangup:
                return await _unless_hung_up(self.handler(request, peer), reader)
            return await self.handler(request, peer)
        except Exception:
            self.throttle.event(log_key, logging.ERROR, "internal_error", exc_info=True, op=request["op"])
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


async def _unless_hung_up(call: Awaitable[dict[str, Any]], reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The call's reply, or None after cancelling it when the client closes its end first."""
    handling = asyncio.ensure_future(call)
    hangup = asyncio.ensure_future(reader.read(1))  # a client sends one line, then only closes
    try:
        await asyncio.wait({handling, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not handling.done():
            handling.cancel()
            await asyncio.gather(handling, return_exceptions=True)
    return handling.result() if not handling.cancelled() else None


def _make_directory(directory: Path) -> None:
    """Create the socket's directory, traversable by every user (clients connect as themselves).
    One that exists keeps its mode: it is someone else's, /tmp (sticky, world-writable) or
    systemd's RuntimeDirectory."""
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        return
    os.chmod(directory, 0o755)  # mkdir applied the umask


def _log_key(key: admission.Key, peer: Peer) -> object:
    """Whose log lines these are: a user's own, or one shared key for all uids without an account
    and all not looked up yet (each subuid its own would let one namespace log 65,536 times as much)."""
    return key[0] if key[0] in ("no account", "pending") else peer.uid


def _peer(sock: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Peer(pid, uid, gid)
