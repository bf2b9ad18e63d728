"""A grant taken back, as one step: Releases.take_back.

Whatever takes GPUs back (a user's release, an admin's revoke, the watcher's time, idle and
reclaim rules, a logout, a MIG layout change) calls take_back, which, in this order:

1. takes the grants back (Grants.remove: the gate closes, the store forgets, the ACLs follow,
   the event is recorded);
2. ends the user's processes still holding those nodes, in the background (OpenerEnder.schedule),
   unless the caller ends them itself to report on them (an admin's revoke);
3. charges the ended grants to their users' fair share (Queue.charge), and, where a rule took
   them (KEEPS_TOTAL), lets the user's place in the queue wait for as many more (Queue.keep_total);
   a time limit's starts the user's cool-down for that kind of GPU (Grants.note_time_limit);
4. on a fleet's node, tells the fleet (gpuguard.fleet: gone from its database before any later
   grant-time check, so the queue served next may have the same GPU; their usage to its ledger);
5. serves the queue (Queue.dispatch): at once, or, inside `batch()`, once when the batch ends.

A batch is a set of take-backs decided on one view: the watcher's actions of one tick, the
users a logout check or a layout change ends. A waiter handed a freed GPU in the middle of the
batch would be judged by the rest of it as if they did not hold it (their process on it stopped
as a stray), so the queue is served after it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from gpuguard.core.messages import layout_message, unit_list
from gpuguard.core.model import EventKind, Grant, Rule
from gpuguard.logs import event
from gpuguard.services.grants import Grants
from gpuguard.services.queueing import Queue

if TYPE_CHECKING:
    from gpuguard.backends.nvml import MigLayout

# (uid, user, units, why): end that user's processes still holding these units' nodes (OpenerEnder.schedule)
EndOpeners = Callable[[int, str, Iterable[int], Rule], None]
# (uid, user, message): tell a user on their terminals (not an exempt one)
Tell = Callable[[int, str, str], None]
# (grants taken back, now): the fleet's record of them (gpuguard.fleet.node.FleetNode.ended)
Ended = Callable[[list[Grant], float], None]


# Taken back without the user's or an admin's say: a request of theirs that counted these GPUs
# waits for as many more (Queue.keep_total). A user's own release, an admin's revoke or the
# group's loss means less, not the same elsewhere.
KEEPS_TOTAL = frozenset({Rule.IDLE, Rule.RECLAIM, Rule.TIME, Rule.LOGOUT, Rule.LAYOUT, Rule.COEXIST})


class Releases:
    def __init__(self, grants: Grants, queue: Queue, end_openers: EndOpeners, tell: Tell,
                 fleet_ended: Ended | None = None):
        self.grants = grants
        self.queue = queue
        self.end_openers = end_openers
        self.tell = tell
        self.fleet_ended = fleet_ended  # None on a single server
        self._freed_in_batch: bool | None = None  # None: no batch open

    def take_back(self, uid: int, units: Iterable[int] | None, now: float, *, kind: EventKind, rule: Rule,
                  message: str, end_openers: bool = True) -> list[Grant]:
        """Take back a user's units (all, or these): kind release (the user's, idle, reclaim,
        logout) or revoke (an admin, a time limit, a layout change). Returns what was held.
        end_openers=False: the caller ends the holders itself (OpenerEnder.end) to report on them."""
        removed = self.grants.remove(uid, units, now, kind=kind, rule=rule, message=message)
        if not removed:
            return []
        if end_openers:
            self.end_openers(uid, removed[0].user, [g.unit for g in removed], rule)
        self.queue.charge(removed, now)
        if rule in KEEPS_TOTAL:
            self.queue.keep_total(uid, [g.unit for g in removed])
        if rule == Rule.TIME:
            self.grants.note_time_limit(uid, removed, now)
        if self.fleet_ended is not None:
            self.fleet_ended(removed, now)
        if self._freed_in_batch is None:
            self.queue.dispatch(now)
        else:
            self._freed_in_batch = True
        return removed

    @contextmanager
    def batch(self, now: float) -> Iterator[None]:
        """The take-backs inside serve the queue once, when the batch ends (a nested batch is part
        of the outer one). A batch that raises leaves the queue to the next dispatch (every tick)."""
        if self._freed_in_batch is not None:
            yield
            return
        self._freed_in_batch = False
        try:
            yield
            freed = self._freed_in_batch
        finally:
            self._freed_in_batch = None
        if freed:
            self.queue.dispatch(now)

    def follow_layout(self, seen: MigLayout | None, now: float) -> dict[Grant, str]:
        """Follow the admin's MIG layout (`nvidia-smi mig ...`), read at each sample and on reload:
        the grants a change ends (Grants.update_layout) are revoked, one batch, and their users told
        why. Returns the ended grants with why; a revoke that fails is logged (retried at the next
        sample) and the others go on."""
        if seen is None:
            return {}
        stale = self.grants.update_layout(seen)
        ended: dict[Grant, str] = {}
        with self.batch(now):
            for uid in sorted({grant.uid for grant in stale}):
                mine = [grant for grant in stale if grant.uid == uid]
                try:
                    self.take_back(uid, [grant.unit for grant in mine], now, kind=EventKind.REVOKE, rule=Rule.LAYOUT,
                                   message="; ".join(stale[grant] for grant in mine))
                except Exception:  # one user's failing revoke must not keep the others'
                    event(logging.ERROR, "revoke_failed", exc_info=True, user=mine[0].user, uid=uid, rule=Rule.LAYOUT,
                          gpus=unit_list(grant.unit for grant in mine))
                else:
                    ended.update({grant: stale[grant] for grant in mine})
        for uid in sorted({grant.uid for grant in ended}):
            mine = [grant for grant in ended if grant.uid == uid]
            self.tell(uid, mine[0].user, layout_message([ended[grant] for grant in mine]))
        return ended
