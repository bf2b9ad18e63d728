"""Where the web view reads from: the `Source` protocol, and the local daemon behind it.

A source answers for every server it knows: one for the local daemon, each node of the fleet for
the fleet database. `LocalDaemon` asks the daemon over its socket, as the web's own account
(`[web] user`), which the daemon lets read every user's records (as root may) and nothing more:
the web changes nothing. `Memo` keeps each answer for a moment, so however many browsers poll,
the daemon is asked at most once per key and window.
"""
from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gpuguard import client, protocol
from gpuguard.client import DaemonUnreachable, Refused

T = TypeVar("T")
TIMEOUT = 10.0  # seconds for one daemon call: status of a busy server is large
# The local daemon's calls: a refused socket is a restarting daemon for client.REFUSED_FOR at most,
# so a stopped one is said within this, not after TIMEOUT on every page (status of 64 GPUs takes ms).
LOCAL_TIMEOUT = 3.0


@dataclass(frozen=True)
class ServerStatus:
    """One server's `status` reply, or why there is none."""

    name: str
    status: dict[str, Any] | None
    error: str | None = None


class Source(Protocol):
    async def servers(self) -> list[ServerStatus]:
        """Every server's GPUs, holders and queue."""

    async def whoami(self, user: str) -> dict[str, dict[str, Any]]:
        """Server name -> the user's `whoami` there (grants, queue place, events, sessions)."""

    async def report(self, by: str, since: float, until: float, user: str | None) -> dict[str, dict[str, Any]]:
        """Server name -> the usage `report` there (user None: everyone's)."""

    async def fairshare(self) -> dict[str, dict[str, Any]]:
        """Server name -> its `fairshare` reply (every user's decayed usage, share and priority);
        a server missing: the source does not know its fair share."""

    async def use_history(self, span: str) -> dict[str, dict[str, Any]]:
        """Server name -> its `use_history` of the span (hour, day, week): every GPU's and every
        user's utilisation and memory; a server missing: the source does not know it."""


async def ask(socket_path: Path | str, op: str, timeout: float = TIMEOUT, **fields: Any) -> dict[str, Any]:
    """One request to a daemon, without blocking the event loop; raises as client.call does."""
    try:
        reader, writer = await asyncio.wait_for(_connect(str(socket_path)), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        raise DaemonUnreachable(f"gpuguard daemon not reachable at {socket_path}: "
                                f"{getattr(exc, 'strerror', None) or exc or 'timed out'}") from None
    try:
        writer.write(protocol.encode({"op": op, **fields}))
        line = await asyncio.wait_for(reader.readline(), timeout)
        message = protocol.decode(line)
    except (OSError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: a line past the limit
        raise DaemonUnreachable(f"no good reply from the gpuguard daemon: {exc or 'timed out'}") from None
    finally:
        writer.close()
    if not message.get("ok"):
        raise Refused(str(message.get("error", "refused")), int(message.get("code", 1)))
    return message


async def _connect(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the users' socket, tried again (client.RETRIED, client.pauses) while its
    listen queue is full or the daemon restarts: asyncio's own connect takes EAGAIN from a full
    queue for a connect in progress and hands back a socket that is not connected."""
    waits = client.pauses()
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            if exc.errno not in client.RETRIED:
                raise
            await asyncio.sleep(next(waits))  # the caller's wait_for bounds the tries
            continue
        try:
            return await asyncio.open_unix_connection(sock=sock, limit=protocol.MAX_REPLY)
        except BaseException:
            sock.close()
            raise


class LocalDaemon:
    """The daemon of this server, over its socket."""

    def __init__(self, socket_path: Path | str, name: str):
        self.socket_path = socket_path
        self.name = name

    async def servers(self) -> list[ServerStatus]:
        try:
            return [ServerStatus(self.name, await ask(self.socket_path, "status", LOCAL_TIMEOUT))]
        except (DaemonUnreachable, Refused) as exc:
            return [ServerStatus(self.name, None, str(exc))]

    async def whoami(self, user: str) -> dict[str, dict[str, Any]]:
        return {self.name: await ask(self.socket_path, "whoami", LOCAL_TIMEOUT, user=user)}

    async def report(self, by: str, since: float, until: float, user: str | None) -> dict[str, dict[str, Any]]:
        fields: dict[str, Any] = {"by": by, "since": since, "until": until, **({"user": user} if user else {})}
        return {self.name: await ask(self.socket_path, "report", **fields)}

    async def fairshare(self) -> dict[str, dict[str, Any]]:
        return {self.name: await ask(self.socket_path, "fairshare", LOCAL_TIMEOUT)}

    async def use_history(self, span: str) -> dict[str, dict[str, Any]]:
        return {self.name: await ask(self.socket_path, "use_history", LOCAL_TIMEOUT, span=span)}


class Memo:
    """Answers kept `max_age` seconds, one computation at a time per key (callers in the
    meantime await the same one), at most `max_entries` keys (the oldest go first)."""

    def __init__(self, max_age: float, max_entries: int = 256, clock: Callable[[], float] = time.monotonic):
        self.max_age = max_age
        self.max_entries = max_entries
        self.clock = clock
        self._kept: dict[Hashable, tuple[float, asyncio.Future[Any]]] = {}

    async def get(self, key: Hashable, make: Callable[[], Awaitable[T]]) -> T:
        now = self.clock()
        kept = self._kept.get(key)
        if kept is None or now - kept[0] > self.max_age or (kept[1].done() and kept[1].exception()):
            future: asyncio.Future[Any] = asyncio.ensure_future(make())
            self._kept.pop(key, None)
            self._kept[key] = (now, future)
            while len(self._kept) > self.max_entries:
                self._kept.pop(next(iter(self._kept)))
            kept = self._kept[key]
        return await asyncio.shield(kept[1])
