"""The clients blocked in `gpuguard request --wait` (the `wait` operation), by queue row: woken
when the queue serves their row (a queue listener), or refused when the row leaves the queue
unserved, however it leaves (a departure listener): a login's place that ended with its last
session left a `wait` outside that session (tmux, nohup) blocked for good.

A grant from the queue is also told to its user on their terminals, with the line a shell
evaluates to see it. Rows served before their client's `wait` call arrives are kept for it (a
grant may come between the `request` reply and the `wait` call).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

from gpuguard.core.errors import Refusal
from gpuguard.core.messages import cuda_export, grant_reply
from gpuguard.core.model import Origin
from gpuguard.core.quantities import format_duration
from gpuguard.logs import event
from gpuguard.services.edges import Clock, Terminals
from gpuguard.services.grants import Grants
from gpuguard.services.queueing import Queue
from gpuguard.services.store import Queued, Store

KEPT_SERVED = 1000  # rows served that no client came back for, kept for a late `wait` (the oldest go)


class Tickets:
    def __init__(self, store: Store, queue: Queue, grants: Grants, terminals: Terminals, clock: Clock):
        self.store = store
        self.queue = queue
        self.grants = grants
        self.terminals = terminals
        self.clock = clock
        self._waiting: dict[int, asyncio.Future[tuple[int, ...]]] = {}  # ticket (queue row) -> its blocked client
        self._served: dict[int, tuple[int, tuple[int, ...]]] = {}  # ticket -> (its uid, the GPUs), not yet collected

    def served(self, queued: Queued, units: tuple[int, ...]) -> None:
        """The queue granted this row (a Queue listener): wake its client, tell its user."""
        waiter = queued.waiter
        self._served[waiter.id] = (waiter.uid, units)
        if len(self._served) > KEPT_SERVED:
            self._served.pop(next(iter(self._served)))
        future = self._waiting.get(waiter.id)
        if future is not None and not future.done():
            future.set_result(units)
        waited = format_duration(max(0, round(self.clock() - waiter.since)))
        reply = grant_reply(self.grants.gpus, self.store.grants(waiter.uid), ending=f" (from the queue, after {waited})",
                            new=units)
        text = f"{reply['message']}\r\n{cuda_export(reply['cuda_visible_devices'].split(','))}"
        self.terminals.tell(waiter.user, waiter.uid, text, self.store.ttys(waiter.uid))

    def departed(self, tickets: Collection[int]) -> None:
        """These rows left the queue unserved (a Queue departure listener): their blocked clients
        are refused, never left waiting for a row nothing will serve."""
        for ticket in tickets:
            future = self._waiting.get(ticket)
            if future is not None and not future.done():
                future.set_exception(Refusal("your request left the queue (its login's last session ended, or "
                                             "its client is gone); gpuguard request --wait asks again"))
                future.exception()  # retrieved: a wait that left it itself (timed out, hung up) awaits it no more

    def collect(self, ticket: int, uid: int) -> tuple[int, ...] | None:
        """What the queue served this ticket of uid's before anyone waited for it (None: nothing yet;
        another user's ticket is not theirs to take)."""
        if self._served.get(ticket, (None,))[0] != uid:
            return None
        return self._served.pop(ticket)[1]

    async def wait(self, ticket: int, uid: int, limit: float | None) -> tuple[int, ...]:
        """Block until uid's queued request `ticket` is granted (its units), or `limit` seconds pass
        (then it leaves the queue, unless it is a login's place): Refusal. A client that hangs up
        leaves the queue too: the server cancels this call."""
        if (units := self.collect(ticket, uid)) is not None:
            return units
        if not any(q.waiter.id == ticket for q in self.store.queue(uid)):
            raise Refusal(f"request {ticket} is not in the queue (left it, or not yours)")
        future = self._waiting.setdefault(ticket, asyncio.get_running_loop().create_future())
        try:
            units = await asyncio.wait_for(asyncio.shield(future), limit)
        except asyncio.TimeoutError:  # not the builtin on Python 3.10
            left = self._leave_unless_login(ticket)
            assert limit is not None  # no limit waits until served or cancelled
            raise Refusal(f"no GPU within {format_duration(limit)}"
                          f"{'; you left the queue' if left else '; your login keeps its place'}", 1) from None
        except asyncio.CancelledError:
            if self._leave_unless_login(ticket):  # the client hung up
                event(logging.INFO, "queue_left", uid=uid, ticket=ticket, reason="client gone")
            raise
        finally:
            self._waiting.pop(ticket, None)
        self._served.pop(ticket, None)
        return units

    def _leave_unless_login(self, ticket: int) -> bool:
        """A client that stops waiting takes its request out of the queue; a login's place (one
        `request --wait` may wait on) stays until its last session ends. True when it left."""
        if any(q.waiter.id == ticket and q.origin == Origin.SESSION for q in self.store.queue()):
            return False
        return self.queue.leave([ticket]) > 0

    def leave_all(self, uid: int) -> int:
        """Take every queued request of uid out of the queue, and wake their waiting clients with a
        refusal; how many there were."""
        ids = [q.waiter.id for q in self.store.queue(uid)]
        for ticket in ids:  # before they leave: said as a cancel, not as departed() says it
            future = self._waiting.get(ticket)
            if future is not None and not future.done():
                future.set_exception(Refusal("you left the queue (gpuguard cancel)"))
        left = self.queue.leave(ids) if ids else 0
        if left:
            event(logging.INFO, "queue_left", uid=uid, reason="cancel")
        return left
