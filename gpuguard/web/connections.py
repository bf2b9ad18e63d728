"""What connections may hold: per client, in all, and for how long, so none can starve the page.

aiohttp keeps an idle connection 75 s and one that never finishes its request headers for ever,
so 1,100 idle connections from one local account took the web's 1,024 descriptors. `Guard`
stands between the listener and aiohttp's protocol (`Guarded`): at most `per_client` connections
per client address (a trusted proxy's excepted; all of loopback one client, since any local user
can bind each of 127/8's addresses: as several, a flood of served connections from them took all
`total` and refused everyone else; a client at its bound pushes out its own oldest that has not
sent a request yet), at most `total` in all; a connection must have
sent a whole request within `first_request` seconds, and one that sends nothing for `idle`
seconds is closed. When all `total` are taken, a new connection pushes out the oldest that has
not sent a request yet (a browser's sends its own at once), else it is refused. A malformed
request is one counted log line (`malformed`), not aiohttp's traceback.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

from gpuguard.web.counted import Counted
from gpuguard.web.slots import LOOPBACK, is_loopback

PER_CLIENT = 64         # a browser opens 6 per host; a lab PC's few users fit
FIRST_REQUEST = 10.0    # seconds from connect to a whole request
IDLE = 15.0             # seconds without a byte from the client (the pages poll every 2 s)
CHECK_EVERY = 1.0
# asyncio accepts up to the listen backlog at once, before any reaches the guard: the descriptors
# beyond `total` must hold such a batch, and the daemon's socket, PAM, NSS and the journal besides.
BACKLOG = 128
HEADROOM = 3 * BACKLOG  # a batch accepted, the last batch's refusals not closed yet, and the rest


def total_for(descriptors: int) -> int:
    """The connections allowed under a descriptor limit, leaving HEADROOM."""
    return max(16, descriptors - HEADROOM)


@dataclass
class Connection:
    peer: str
    opened: float
    heard: float
    served: bool = False  # a whole request arrived (the app saw it)


class Guard:
    def __init__(self, total: int, exempt: Callable[[str], bool] = lambda peer: False,
                 per_client: int = PER_CLIENT, first_request: float = FIRST_REQUEST, idle: float = IDLE,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.exempt, self.per_client = total, exempt, per_client
        self.first_request, self.idle, self.clock = first_request, idle, clock
        self.refused = Counted("web_connection_refused")
        self.closed = Counted("web_connection_closed", level=logging.INFO)
        self._open: dict[asyncio.BaseTransport, Connection] = {}  # oldest first
        self._per_peer: dict[str, int] = {}

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        peername = transport.get_extra_info("peername")
        address = str(peername[0]) if isinstance(peername, tuple) else "?"
        exempt = self.exempt(address)
        peer = address if exempt else client_of(address)
        if self._per_peer.get(peer, 0) >= self.per_client and not exempt:
            # its own oldest that has not sent a request gives way (idlers from its other
            # addresses must not keep a browser of the same host out), else it is refused
            oldest = next((t for t, c in self._open.items() if c.peer == peer and not c.served), None)
            if oldest is None:
                self.refused.add(client=peer, why="per_client")
                return False
            self._close(oldest, "pushed_out")
        if len(self._open) >= self.total:
            oldest = next((t for t, c in self._open.items() if not c.served), None)
            if oldest is None:
                self.refused.add(client=peer, why="total")
                return False
            self._close(oldest, "pushed_out")
        now = self.clock()
        self._open[transport] = Connection(peer, now, now)
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        return True

    def heard(self, transport: asyncio.BaseTransport) -> None:
        if (connection := self._open.get(transport)) is not None:
            connection.heard = self.clock()

    def served(self, transport: asyncio.BaseTransport | None) -> None:
        if transport is not None and (connection := self._open.get(transport)) is not None:
            connection.served = True

    def left(self, transport: asyncio.BaseTransport) -> None:
        connection = self._open.pop(transport, None)
        if connection is not None:
            self._per_peer[connection.peer] -= 1
            if not self._per_peer[connection.peer]:
                del self._per_peer[connection.peer]

    def __len__(self) -> int:
        return len(self._open)

    def check(self) -> None:
        """Close the connections past their time: no whole request within first_request, or
        nothing heard for idle."""
        now = self.clock()
        late = [t for t, c in self._open.items()
                if (not c.served and now - c.opened >= self.first_request) or now - c.heard >= self.idle]
        for transport in late:
            self._close(transport, "timed_out")

    def _close(self, transport: asyncio.BaseTransport, why: str) -> None:
        connection = self._open.get(transport)
        self.closed.add(client=connection.peer if connection else "?", why=why)
        self.left(transport)
        transport.close() if why == "timed_out" else _abort(transport)

    async def checking(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY)
            self.check()

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The listener's protocol factory: aiohttp's (`make`) behind this guard."""
        return lambda: Guarded(self, make())


def client_of(address: str) -> str:
    """Whose share of `per_client` a connection from `address` takes: the address, but all of
    loopback is one client (slots.is_loopback)."""
    return LOOPBACK if is_loopback(address) else address


def _abort(transport: asyncio.BaseTransport) -> None:
    abort = getattr(transport, "abort", None)
    (abort or transport.close)()


class Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, admitted by the guard first and timed by it."""

    def __init__(self, guard: Guard, inner: asyncio.Protocol):
        self.guard, self.inner = guard, inner
        self.transport: asyncio.BaseTransport | None = None
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.admitted = self.guard.admit(transport)
        if not self.admitted:
            _abort(transport)
            return
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.admitted and self.transport is not None:
            self.guard.heard(self.transport)
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.guard.left(self.transport)
        if self.admitted:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()


class Malformed(logging.Filter):
    """On aiohttp's server logger: a request aiohttp could not parse (too many or too long
    headers, a bad request line) becomes one count in a line a minute instead of a traceback;
    anything else (a bug of ours) is logged as aiohttp logs it."""

    def __init__(self) -> None:
        super().__init__()
        self.counted = Counted("web_request_malformed")

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            args: Any = record.args
            self.counted.add(client=str(args[0]) if isinstance(args, tuple) and args else "?",
                             error=type(exc).__name__)
            return False
        return True
