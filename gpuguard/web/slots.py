"""The PAM conversations of the web's logins, shared fairly between clients.

At most `at_once` conversations run (each a thread; a failure sleeps ~2 s in pam_faildelay): that
global bound is what bounds password guessing from many addresses at once, so it stays. Within
it, one client (`group_of`: an IPv4 address, an IPv6 /64, the whole loopback) holds at most
`per_group` of them and waits with at most `per_group_waiting` more: a client past that is
refused at once, taking nobody's place. The waiters get a free conversation by their standing,
the client's failed logins across all names (sessions.LoginDelay.standing), fewest first, then in
the order they came: a flood of failures from one address waits behind anyone else, however many
names it makes up. A `trusted` login (the web: its browser's device cookie for the name, which
only an earlier login of that name from that browser set) goes ahead of every other waiter, in
the order they came, whatever its client's standing: a flood from fresh addresses (standing 0
each, an IPv6 /56 is 256 clients) fills the queue but never keeps out a user who has logged in
from that browser before. When the queue is full a newcomer of a better rank takes the place of
the worst waiter (refused in its stead); a waiter is refused after `wait_most` seconds.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

LOOPBACK = "loopback"


class Busy(Exception):
    """No conversation for this login now: its client holds its share, or the queue is full."""


def client_key(address: str) -> str:
    """The client as a login's standing counts it (sessions.LoginDelay.standing_of): an IPv4
    address, an IPv6 address's /64 (what one household or host is given: its 2^64 addresses are
    one client), anything else as it is. Not the delay's: a campus's /64 is hundreds of hosts."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return str(parsed)


def is_loopback(address: str) -> bool:
    """127/8, ::1 or an IPv4-mapped 127/8: any local user can bind each of them, so all are one host."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return parsed.ipv4_mapped.is_loopback
    return parsed.is_loopback


def group_of(address: str) -> str:
    """Whose share of the conversations a login takes: its client_key, but all of loopback is one."""
    return LOOPBACK if is_loopback(address) else client_key(address)


@dataclass(eq=False)
class _Waiter:
    group: str
    standing: int
    trusted: bool
    order: int
    granted: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def rank(self) -> tuple[bool, int]:
        """Lower goes first: the trusted, in the order they came; then the fewest failures."""
        return (not self.trusted, 0 if self.trusted else self.standing)


class LoginSlots:
    def __init__(self, at_once: int = 2, per_group: int = 1, per_group_waiting: int = 4, waiting: int = 64,
                 wait_most: float = 30.0):
        self.at_once, self.per_group, self.per_group_waiting = at_once, per_group, per_group_waiting
        self.waiting, self.wait_most = waiting, wait_most
        self._running: dict[str, int] = {}
        self._queue: list[_Waiter] = []
        self._order = itertools.count()

    @property
    def running(self) -> int:
        return sum(self._running.values())

    def queued(self, group: str | None = None) -> int:
        return sum(1 for w in self._queue if group is None or w.group == group)

    @contextlib.asynccontextmanager
    async def slot(self, group: str, standing: int, trusted: bool = False) -> AsyncIterator[None]:
        """A conversation for a login of `group` with `standing` failures, `trusted` or not (Busy: none)."""
        waiter = self._ask(_Waiter(group, standing, trusted, next(self._order)))
        if waiter is not None:
            try:
                await asyncio.wait_for(asyncio.shield(waiter.granted), self.wait_most)
            except BaseException as exc:  # waited too long, or the request was cancelled
                if waiter.granted.done() and not waiter.granted.cancelled():
                    if waiter.granted.result():  # granted meanwhile: given back
                        self._release(group)
                else:
                    self._withdraw(waiter)
                if isinstance(exc, asyncio.TimeoutError):
                    raise Busy("waited too long") from None
                raise
            if not waiter.granted.result():
                raise Busy("its place in the queue was taken")
        try:
            yield
        finally:
            self._release(group)

    def _ask(self, waiter: _Waiter) -> _Waiter | None:
        """None: the conversation is the caller's now; else its place in the queue."""
        group = waiter.group
        if self.running < self.at_once and self._running.get(group, 0) < self.per_group:
            self._running[group] = self._running.get(group, 0) + 1  # no waiter may have it (see _dispatch)
            return None
        if self._running.get(group, 0) + self.queued(group) >= self.per_group + self.per_group_waiting:
            self._displace([w for w in self._queue if w.group == group], waiter, "its client holds its share")
        elif len(self._queue) >= self.waiting:
            self._displace(self._queue, waiter, "the queue is full")
        self._queue.append(waiter)
        return waiter

    def _displace(self, among: list[_Waiter], newcomer: _Waiter, why: str) -> None:
        """Make room among `among` for `newcomer`: the worst waiter goes if it ranks worse (Busy
        otherwise: the newcomer is refused)."""
        worst = max(among, key=lambda w: (w.rank, w.order), default=None)
        if worst is None or worst.rank <= newcomer.rank:
            raise Busy(why)
        self._queue.remove(worst)
        worst.granted.set_result(False)

    def _withdraw(self, waiter: _Waiter) -> None:
        with contextlib.suppress(ValueError):
            self._queue.remove(waiter)
        waiter.granted.cancel()

    def _release(self, group: str) -> None:
        self._running[group] -= 1
        if not self._running[group]:
            del self._running[group]
        self._dispatch()

    def _dispatch(self) -> None:
        """Free conversations to the best waiters whose client is under its share."""
        while self.running < self.at_once:
            ready = [w for w in self._queue if self._running.get(w.group, 0) < self.per_group]
            if not ready:
                return
            best = min(ready, key=lambda w: (w.rank, w.order))
            self._queue.remove(best)
            self._running[best.group] = self._running.get(best.group, 0) + 1
            best.granted.set_result(True)
