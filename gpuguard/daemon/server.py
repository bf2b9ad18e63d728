"""The daemon's unix sockets: one JSON request line per connection, one reply line, identity from SO_PEERCRED.

Two doors (daemon_socket.py): the users' socket, and root's door in a directory only root may
enter, which the PAM module, the hook and admins' commands use. Both are accepted here, a batch
at a time, and a connection over its cap is refused before any task is made for it, so the
kernel's queue of the users' socket drains faster than one uid can fill it.

Every connection is its own task with a read deadline, so a client that connects and
sends nothing (or sends slowly) costs one file descriptor for a moment and never delays
a login. Requests are bounded by protocol.MAX_REQUEST. Access control is by the kernel's
peer credentials, not by file modes: the socket is 0666 on purpose.

Whatever a client sends, it gets one reply line or, if it sent nothing at all, none: a
malformed request (not JSON, wrong types, too long, cut off before its newline, unfinished
at the read deadline) is refused with code 2 and one log line, and those lines are
throttled per uid (logs.Throttle), so no client can flood the log. A traceback is logged
only for a fault of the daemon's own, and that too is throttled per uid.

Who may hold a connection is admission.py's: root always, each other uid up to its cap, the
subuids of each user's /etc/subuid ranges (their user namespaces') one small cap per user, all
other uids without an account one small cap together, and all non-root connections
below a limit that keeps descriptors for root and the daemon. A connection over a cap gets a
one-line refusal at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
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

from gpuguard import daemon_socket, protocol
from gpuguard.backends import subids
from gpuguard.core.errors import GpuguardError
from gpuguard.daemon import admission
from gpuguard.logs import Throttle, event

READ_TIMEOUT = 2.0    # a PAM request is one small line; a client this slow is broken or hostile
WRITE_TIMEOUT = 10.0  # replies can be large (status of a busy server) and readers slow
MAX_CONNECTIONS_PER_USER = admission.PER_UID
READ_CHUNK = 64 * 1024
# Connections the kernel queues before accept (it caps this at net.core.somaxconn). Root's door
# takes a login storm's worth. The users' socket takes one uid's cap: a flood fills any queue, and
# a caller who got in waits behind all of it (4,096 refusals were ~100 ms of the daemon's time; a
# member's whoami under a connect flood took 115 ms with 256, 69 ms with 64), while one who did not
# waits in a blocking connect (client.py) among the kernel's waiters, woken as the daemon accepts.
ROOT_BACKLOG = 4096
USERS_BACKLOG = admission.PER_UID
# Connections accepted in one turn of the loop, refusals included. Small: a turn of the loop
# costs little beside an accept, and every step of a login in flight waits for the turn to end.
ACCEPT_BATCH = 8
ACCEPT_PAUSE = 0.1  # seconds without accepting after the descriptors ran out


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
                 kinds: admission.AccountKinds | None = None,
                 subuid_owner: Callable[[int], str | None] | None = None):
        self.path = Path(path)
        self.handler = handler
        # Ops that only wait for something (a queued GPU): a client that hangs up cancels them.
        # Every other op runs to its end whatever the client does, so no change stops halfway.
        self.abandoned_on_hangup = abandoned_on_hangup
        self.read_timeout = read_timeout
        # Connections held, shared with the metrics endpoint (admission.py); the daemon passes its own.
        self.budget = budget or admission.Budget.for_descriptors(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.kinds = kinds or admission.AccountKinds()
        self.subuid_owner = subuid_owner or subids.SubuidOwners().owner
        self.root_path = Path(daemon_socket.root_door(str(self.path)))
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()  # the connections being served
        self.throttle = Throttle("uid")
        self.loop_errors = Throttle("what", burst=1)
        self._flusher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve on the path that claim() freed, and on root's door beside it. Bound here rather
        than by asyncio, which would silently replace a socket someone else created at the path
        meanwhile, and accepted by _accept, not by asyncio's accept loop (see there)."""
        _make_directory(self.path.parent)
        self._listeners = [self._listen(self.path, 0o666, USERS_BACKLOG)]
        if _make_root_directory(self.root_path.parent):
            try:
                _unlink_socket(self.root_path)  # claimed with the users' socket: only a dead daemon's is here
                self._listeners.append(self._listen(self.root_path, 0o600, ROOT_BACKLOG))
            except ServerError as exc:  # the users' socket still serves root, as before root's door
                event(logging.ERROR, "root_door", error=str(exc))
        loop = asyncio.get_running_loop()
        for listener in self._listeners:
            loop.add_reader(listener.fileno(), self._accept, listener)
        loop.set_exception_handler(self._loop_error)
        self._flusher = asyncio.create_task(self._flush_throttle())

    def _listen(self, path: Path, mode: int, backlog: int) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(path))
            os.chmod(path, mode)  # before listen(): nobody can connect yet
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            raise ServerError(f"cannot serve on {path}: {exc.strerror}") from None
        return sock

    def _accept(self, listener: socket.socket) -> None:
        """Take what waits in the kernel's queue, a batch a turn of the loop (so root's door and
        the work in flight get their turns between batches of a flood), and refuse a connection
        over its cap at once: its line is written without waiting and it is closed unread, no task
        made for it. asyncio's own accept loop made a transport, a protocol and a task for every
        connection before admission could refuse it, so a flood refused at the rate the loop
        could make them, and the queue, which every caller shares, stayed full."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors (EMFILE, ENFILE) or buffers: pause, as asyncio does
                self._pause(listener, exc)
                return
            self._arrived(conn)

    def _pause(self, listener: socket.socket, exc: OSError) -> None:
        self.loop_errors.event("accept failed", logging.ERROR, "loop_error", error=f"{type(exc).__name__}: {exc}")
        loop = asyncio.get_running_loop()
        loop.remove_reader(listener.fileno())
        loop.call_later(ACCEPT_PAUSE, self._resume, listener)

    def _resume(self, listener: socket.socket) -> None:
        if listener in self._listeners:  # not closed meanwhile
            asyncio.get_running_loop().add_reader(listener.fileno(), self._accept, listener)

    def _arrived(self, conn: socket.socket) -> None:
        peer = _peer(conn)
        key = self._admit_known(peer)
        if isinstance(key, str):
            _refuse_at_once(conn, key)
            return
        conn.setblocking(False)
        task = asyncio.get_running_loop().create_task(self._serve(conn, peer, key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
        loop = asyncio.get_running_loop()
        for listener in self._listeners:
            loop.remove_reader(listener.fileno())
            path = listener.getsockname()
            listener.close()
            Path(path).unlink(missing_ok=True)
        self._listeners = []
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

    async def _serve(self, conn: socket.socket, peer: Peer, key: admission.Key | None) -> None:
        """One admitted connection (key None: its uid is being looked up) to its end."""
        if key is None:
            looked_up = await self._admit_looked_up(peer)
            if isinstance(looked_up, str):
                _refuse_at_once(conn, looked_up)
                return
            key = looked_up
        try:
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=protocol.MAX_REQUEST)
        except BaseException:
            self.budget.give_back(key)
            conn.close()
            raise
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

    def _admit_known(self, peer: Peer) -> admission.Key | str | None:
        """The kind of connection taken from the budget (give it back at the end), why not, or
        None when NSS must say first whether the uid has an account (_admit_looked_up)."""
        if peer.uid == 0:
            return self._take(peer, admission.ROOT)
        has_account = self.kinds.remembered(peer.uid)
        if has_account is not None:
            return self._take(peer, _account_key(peer.uid, has_account))
        if (owner := self.subuid_owner(peer.uid)) is not None:
            return self._take(peer, admission.subuids_key(owner))
        waiting = admission.pending_key(peer.uid)
        if refusal := self.budget.take(waiting):
            return self._refuse(peer, waiting, refusal)
        return None

    async def _admit_looked_up(self, peer: Peer) -> admission.Key | str:
        """_admit_known's answer for a uid whose pending slot it took, once NSS has answered."""
        try:
            has_account = await self.kinds.ask(peer.uid)
        finally:
            self.budget.give_back(admission.pending_key(peer.uid))
        return self._take(peer, _account_key(peer.uid, bool(has_account)))

    def _take(self, peer: Peer, key: admission.Key) -> admission.Key | str:
        """key, taken from the budget; or why it was not, said once in the log (throttled)."""
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


@functools.lru_cache(maxsize=64)
def _refusal_line(reason: str) -> bytes:
    """A refusal's line, encoded once per reason: a flood is refused thousands of times a second."""
    return protocol.encode(protocol.refused(reason))


def _refuse_at_once(conn: socket.socket, reason: str) -> None:
    """The refusal line, if the socket's buffer takes it now (a fresh one always does), then close."""
    try:
        conn.send(_refusal_line(reason), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
    except OSError:
        pass  # the client is gone already
    conn.close()


def _unlink_socket(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            path.unlink()


def _make_root_directory(directory: Path) -> bool:
    """Root's door's directory, root's alone (0700). One that exists and is not root's, or is a
    link, is left alone and logged: whoever owns it could reach, or replace, what is in it."""
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        event(logging.ERROR, "root_door", error=f"cannot make {directory}: {exc.strerror}")
        return False
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0:
        event(logging.ERROR, "root_door", error=f"{directory} is not a directory of root's; "
              "root's door is not served, logins and admins share the users' socket")
        return False
    os.chmod(directory, 0o700)
    return True


def _make_directory(directory: Path) -> None:
    """Create the socket's directory, traversable by every user (clients connect as themselves).
    One that exists keeps its mode: it is someone else's, /tmp (sticky, world-writable) or
    systemd's RuntimeDirectory."""
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        return
    os.chmod(directory, 0o755)  # mkdir applied the umask


def _account_key(uid: int, has_account: bool) -> admission.Key:
    """A uid's own key, or the one all uids without an account share (NSS failing counts as none)."""
    return admission.uid_key(uid) if has_account else admission.NO_ACCOUNT_KEY


def _log_key(key: admission.Key, peer: Peer) -> object:
    """Whose log lines these are: a user's own, one per owner of subuid ranges, or one shared key
    for all other uids without an account and all not looked up yet (each subuid its own would
    let one namespace log 65,536 times as much)."""
    if key[0] == "subuids of":
        return f"subuids of {key[1]}"
    return key[0] if key[0] in ("no account", "pending") else peer.uid


def _peer(sock: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Peer(pid, uid, gid)
