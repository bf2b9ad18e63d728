"""The queue for GPUs as a service: the store's queue rows, served in gpuguard.scheduler's order.

The daemon and `gpuguard simulate` both run it. Every grant taken back (release.Releases: release,
idle release, reclaim, logout, expiry, revoke) is charged to its user's fair share (charge) and
then offered to the waiters first (dispatch), so a freed GPU never goes to whoever asks next
outside the queue. Listeners (the daemon: terminals and blocked `request --wait` clients) hear of
each grant it makes.
All calls come from the event-loop thread, as the store requires.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuguard import allocator, policy, rules, scheduler
from gpuguard.config import Config
from gpuguard.grants import Grants
from gpuguard.logs import event
from gpuguard.model import Grant, Origin, Quota
from gpuguard.store import Queued, Store

Listener = Callable[[Queued, tuple[int, ...]], None]
Alive = Callable[[int | None, int | None], bool]  # (pid, its start time) -> whether that process still runs


@dataclass(frozen=True)
class Standing:
    """Where a user's request stands, for whoami, status and the waiting client."""

    position: int                    # 1-based
    waiting: int                     # how many requests wait in all
    gpus: int
    since: float
    ahead: list[tuple[str, str]]     # (user, why they go first), nearest first
    estimate: float | None           # when the GPUs should be free (from grant expiries), None: unknown


class Queue:
    def __init__(self, config: Callable[[], Config], store: Store, grants: Grants):
        self.config = config
        self.store = store
        self.grants = grants
        self.listeners: list[Listener] = []

    # --- the order

    def usage(self, now: float, uids: Iterable[int]) -> dict[int, float]:
        """uid -> recent usage (decayed GPU-seconds) of these users."""
        half_life = self.config().scheduler.half_life
        stored = self.store.fairshare()
        held: dict[int, list[Grant]] = {uid: [] for uid in uids}
        for grant in self.store.grants():
            if grant.uid in held:
                held[grant.uid].append(grant)
        return {uid: scheduler.recent_usage(stored.get(uid), grants, now, half_life) for uid, grants in held.items()}

    def ordered(self, now: float) -> list[Queued]:
        return self._ordered(now)[0]

    def _ordered(self, now: float) -> tuple[list[Queued], dict[int, float]]:
        """The waiters in the order they are served, and the recent usage that ordered them."""
        entries = {q.waiter.id: q for q in self.store.queue()}
        if not entries:
            return [], {}
        usage = self.usage(now, {q.waiter.uid for q in entries.values()})
        return [entries[w.id] for w in scheduler.order((q.waiter for q in entries.values()), usage)], usage

    def standing(self, uid: int, now: float) -> Standing | None:
        ordered, usage = self._ordered(now)
        waiters = [q.waiter for q in ordered]
        place = scheduler.position(waiters, uid)
        if place is None:
            return None
        mine = waiters[place - 1]
        ahead = [(w.user, scheduler.why_ahead(w, mine, usage)) for w in reversed(waiters[:place - 1])]
        need = sum(w.gpus for w in waiters[:place]) - self.free()
        expiries = [g.expires_at for g in self.store.grants() if g.expires_at is not None]
        return Standing(place, len(waiters), mine.gpus, mine.since, ahead, scheduler.estimate(need, expiries, now))

    # --- joining and leaving

    def join(self, uid: int, user: str, gpus: int, quota: Quota, now: float, origin: Origin,
             pid: int | None = None, pid_start: int | None = None) -> tuple[Queued, bool]:
        """Queue a request and serve the queue at once: the row, and whether it still waits."""
        queued = self.store.join_queue(uid, user, gpus, now, quota, origin, pid, pid_start)
        self.dispatch(now)
        return queued, self.waits(queued.waiter.id)

    def waits(self, waiter_id: int) -> bool:
        return any(q.waiter.id == waiter_id for q in self.store.queue())

    def leave(self, ids: Iterable[int]) -> int:
        return self.store.leave_queue(ids)

    def gone(self, logged_in: set[int], alive: Alive) -> list[Queued]:
        """Waiters nobody waits for any more: a login's, once its user has no session; a request's,
        once its client process is gone."""
        return [q for q in self.store.queue()
                if (q.origin == Origin.SESSION and q.waiter.uid not in logged_in)
                or (q.origin == Origin.REQUEST and not alive(q.pid, q.pid_start))]

    def drop_gone(self, alive: Alive) -> list[Queued]:
        """Take out the requests nobody waits for (gone): a login's whose user has no session left,
        a request's whose client is gone (also one that died while no daemon ran). Each tick."""
        gone = self.gone({s.uid for s in self.store.sessions()}, alive)
        if gone:
            self.leave(q.waiter.id for q in gone)
            for queued in gone:
                event(logging.INFO, "queue_left", user=queued.waiter.user, ticket=queued.waiter.id,
                      reason="no session left" if queued.origin == Origin.SESSION else "client gone")
        return gone

    # --- serving

    def free(self) -> int:
        """GPUs nobody holds."""
        return len(set(self.grants.gpus) - {g.minor for g in self.store.grants()})

    def demand(self) -> rules.Demand:
        """Units the queue needs beyond the free ones, and which units would serve it: what reclaim
        on demand may take. With MIG slices a free unit counts only for a waiter whose quota takes
        its kind (allocator.suits), so the waiters are served in turn on paper: allocator.choose
        over the grants plus what those before them got."""
        waiting = self.store.queue()
        if not waiting:  # the usual case: no grants to read
            return rules.Demand()
        units = list(self.grants.gpus.values())
        if all(gpu.slice is None for gpu in units):
            return rules.Demand(scheduler.demand((q.waiter for q in waiting), self.free()))
        grants = self.store.grants()
        short, useful = 0, set()
        for queued in waiting:
            waiter = queued.waiter
            got = allocator.choose(units, self.grants.topology, grants, {}, waiter.uid, waiter.gpus,
                                   policy.may_share(queued.quota), None, queued.quota)
            if len(got) < waiter.gpus:
                short += waiter.gpus - len(got)
                useful |= {gpu.minor for gpu in units if allocator.suits(gpu, queued.quota)}
            grants += [Grant(waiter.uid, waiter.user, unit, 0.0, None, 0.0) for unit in got]
        return rules.Demand(short, frozenset(useful))

    def dispatch(self, now: float) -> list[tuple[Queued, tuple[int, ...]]]:
        """Grant what the order admits now; each grant is announced to the listeners."""
        ordered = self.ordered(now)
        if not ordered:  # nobody waits: nothing to count
            return []
        entries = {q.waiter.id: q for q in ordered}
        free = self.free()  # counted again after each grant: the cheap answer for a long queue

        def fits(waiter: scheduler.Waiter) -> bool:
            quota = entries[waiter.id].quota
            if not policy.may_share(quota) and waiter.gpus > free:
                return False
            return len(self.grants.choose(waiter.uid, waiter.gpus, quota)) >= waiter.gpus

        served = []
        for waiter in scheduler.admit([q.waiter for q in ordered], fits, now, self.config().scheduler.reserve_after):
            queued = entries[waiter.id]
            # As for gpuguard request: from a login the grant ends with the sessions, else it stays.
            origin = Origin.SESSION if queued.origin == Origin.SESSION or self.store.sessions(waiter.uid) else Origin.REQUEST
            minors = self.grants.allocate(waiter.uid, waiter.user, queued.quota, waiter.gpus, now, origin,
                                          "granted from the queue")
            self.store.leave_queue([waiter.id])
            free = self.free()
            served.append((queued, minors))
            for listener in self.listeners:
                listener(queued, minors)
        return served

    def charge(self, removed: list[Grant], now: float) -> None:
        """Add ended grants to their users' recent usage."""
        half_life = self.config().scheduler.half_life
        stored = self.store.fairshare()
        by_uid: dict[int, list[Grant]] = {}
        for grant in removed:
            by_uid.setdefault(grant.uid, []).append(grant)
        for uid, grants in by_uid.items():
            value = scheduler.recent_usage(stored.get(uid), grants, now, half_life)
            self.store.set_fairshare(uid, value, now)
