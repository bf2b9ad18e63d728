"""The queue for GPUs as a service: the store's queue rows, served in gpuguard.core.scheduler's order.

The daemon and `gpuguard replay` both run it. Every grant taken back (release.Releases: release,
idle release, reclaim, logout, expiry, revoke) is charged to its user's fair share (charge) and
then offered to the waiters first (dispatch), so a freed GPU never goes to whoever asks next
outside the queue. Listeners (the daemon: terminals and blocked `request --wait` clients) hear of
each grant it makes, and departure listeners (those clients) of each row that leaves unserved.
All calls come from the event-loop thread, as the store requires.
"""
from __future__ import annotations

import bisect
import logging
import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol, runtime_checkable

from gpuguard.config import Config
from gpuguard.core import allocator, policy, rules, scheduler
from gpuguard.core.model import Grant, Origin, Quota
from gpuguard.logs import event
from gpuguard.services.grants import Grants
from gpuguard.services.holds import QueueHolds
from gpuguard.services.store import QueueChange, Queued, Store

Listener = Callable[[Queued, tuple[int, ...]], None]
Alive = Callable[[int | None, int | None], bool]  # (pid, its start time) -> whether that process still runs

# Why a request waits, one word each as squeue prints them (`gpuguard status`'s REASON column).
RESOURCES = "Resources"   # first in line (or only behind earlier askers): waiting for GPUs to be free
PRIORITY = "Priority"     # behind a request of higher priority, or one past max_wait_boost (age, as in Slurm)
FAIRSHARE = "FairShare"   # behind a user with less recent usage
RESERVED = "Reserved"     # GPUs are free, but held for a request that has waited reserve_after
HELD = "Held"             # an admin holds the request (`gpuguard hold`): it keeps its place, is not served
COOLING = "CoolDown"      # a time limit just took its user's GPU: none of that kind for them until reclaim_after
FLEET = "FleetQuota"      # its user holds their whole fleet quota on this and other servers: served once one is released


def reason(ahead: Sequence[scheduler.Waiter], mine: scheduler.Waiter, usage: Mapping[int, float], free: int,
           now: float, reserve_after: float, max_wait_boost: float = math.inf) -> str:
    """Why `mine` waits, behind `ahead` (in order), with `free` units nobody holds."""
    if free and any(now - waiter.since >= reserve_after for waiter in ahead):
        return RESERVED
    if not ahead:
        return RESOURCES
    nearest = ahead[-1]
    if nearest.priority != mine.priority:
        return PRIORITY
    if scheduler.boosted(nearest, now, max_wait_boost):  # ahead by its age; both past the bound: by arrival
        return RESOURCES if scheduler.boosted(mine, now, max_wait_boost) else PRIORITY
    if usage.get(nearest.uid, 0.0) / nearest.share != usage.get(mine.uid, 0.0) / mine.share:
        return FAIRSHARE
    return RESOURCES


@runtime_checkable
class FleetUsage(Protocol):
    """A fleet's usage elsewhere (gpuguard.fleet.node.RemoteUsage): a user's, as the queue orders
    by it, and every user's with any, as `fairshare` shows it."""

    def __call__(self, user: str) -> float: ...

    async def everyone(self) -> tuple[dict[str, float], float | None]: ...


@dataclass(frozen=True)
class Standing:
    """Where a user's request stands, for whoami, status and the waiting client."""

    position: int                    # 1-based
    waiting: int                     # how many requests wait in all
    gpus: int
    since: float
    ahead: list[tuple[str, str]]     # (user, why they go first), nearest first
    estimate: float | None           # when the GPUs should be free (from grant expiries), None: unknown
    priority: int = 0                # the factors of this request's place: its priority,
    usage: float = 0.0               # its user's recent usage (decayed GPU-seconds) over their share,
    boost_at: float | None = None    # and when it goes ahead of younger requests whatever their usage
    fleet_quota: int | None = None   # the user's fleet quota when they hold all of it (served once they release one)
    fleet_elsewhere: int = 0         # then: how many of those GPUs are on other servers


class Queue:
    def __init__(self, config: Callable[[], Config], store: Store, grants: Grants, holds: QueueHolds,
                 remote_usage: Callable[[str], float] | None = None,
                 held_elsewhere: Callable[[str], int | None] | None = None):
        self.config = config
        # A fleet's (gpuguard.fleet): a user's recent usage on the other servers, added to theirs
        # here, and the GPUs they hold there as last seen (None: not known), against a fleet quota.
        self.remote_usage = remote_usage
        self.held_elsewhere = held_elsewhere
        self.store = store
        self.grants = grants
        self.holds = holds  # the rows an admin holds: kept in place, never served (`gpuguard hold`)
        self.listeners: list[Listener] = []
        # ... and of each row that leaves unserved (a login's last session ended, a client gone, a cancel)
        self.departures: list[Callable[[Collection[int]], None]] = []
        # The last demand() and the versions it was worked out from (the waiters, the grants, the
        # pool): the watcher asks at every view, the queue and the grants change far less often.
        self._demand: tuple[tuple[object, ...], rules.Demand] | None = None
        self._waiting: Waiting | None = None  # the waiters, as dispatch takes them, until the queue or holds change
        # The pool and admins' holds the rows were last held against, and those that ask more than
        # it has (_too_big_of).
        self._too_big: tuple[tuple[object, ...], frozenset[int]] | None = None

    # --- the order

    def usage(self, now: float, uids: Iterable[int]) -> dict[int, float]:
        """uid -> recent usage (decayed GPU-seconds) of these users."""
        usage_of = self._usage_of(now)
        return {uid: usage_of(uid) for uid in uids}

    async def usage_elsewhere(self) -> tuple[dict[str, float], float | None] | None:
        """user -> recent usage on a fleet's other servers of every user with any there, and when
        the fleet database said so (FleetUsage.everyone); None on a lone server."""
        remote = self.remote_usage
        return await remote.everyone() if isinstance(remote, FleetUsage) else None

    def _usage_of(self, now: float) -> Callable[[int], float]:
        """A user's recent usage at `now` (fair share as charged read once, for every user asked)."""
        half_life, stored = self.config().scheduler.half_life, self.store.fairshare()
        return lambda uid: scheduler.recent_usage(stored.get(uid), self.store.grants(uid), now, half_life)

    def _fleet_usage(self, now: float, waiters: Iterable[scheduler.Waiter]) -> Mapping[int, float]:
        """uid -> recent usage of these waiters' users, with their usage on a fleet's other servers;
        each worked out when the order first asks for it (it never asks for that of a user whose
        requests are all past max_wait_boost)."""
        # Worked out during dispatch's walk, after some of its grants: those count nothing yet
        # (granted now), so the usage is the same as when the walk began.
        names, here = {w.uid: w.user for w in waiters}, self._usage_of(now)
        remote = self.remote_usage

        def of(uid: int) -> float:
            return here(uid) if remote is None else here(uid) + remote(names[uid])
        return _WorkedOutWhenAsked(names.keys(), of)

    def _ordered(self, now: float) -> tuple[list[Queued], Mapping[int, float]]:
        """The waiters in the order they are served, and the recent usage that ordered them."""
        entries = {q.waiter.id: q for q in self.store.queue()}
        if not entries:
            return [], {}
        usage = self._fleet_usage(now, (q.waiter for q in entries.values()))
        boost = self.config().scheduler.max_wait_boost
        return [entries[w.id] for w in scheduler.order((q.waiter for q in entries.values()), usage, now, boost)], usage

    def reasons(self, now: float) -> list[tuple[Queued, str]]:
        """The waiters in the order they are served, each with why it waits (`reason`)."""
        ordered, usage = self._ordered(now)
        if not ordered:
            return []
        waiters, free = [q.waiter for q in ordered], self.free()
        blocks = list(map(self._blocks, ordered))
        scheduling = self.config().scheduler
        held = self.holds.ids
        return [(queued, HELD if queued.waiter.id in held else
                 COOLING if self.grants.cooling(queued.waiter.uid, queued.quota, now) else
                 FLEET if self._fleet_held(queued.waiter.uid, queued.waiter.user, queued.quota) is not None else
                 reason([w for w, block in zip(waiters[:i], blocks[:i], strict=True) if block], queued.waiter, usage, free, now,
                        scheduling.reserve_after, scheduling.max_wait_boost))
                for i, queued in enumerate(ordered)]

    def standing(self, uid: int, now: float) -> Standing | None:
        ordered, usage = self._ordered(now)
        waiters = [q.waiter for q in ordered]
        place = scheduler.position(waiters, uid)
        if place is None:
            return None
        mine = waiters[place - 1]
        boost = self.config().scheduler.max_wait_boost
        ahead = [(w.user, scheduler.why_ahead(w, mine, usage, now, boost)) for w in reversed(waiters[:place - 1])]
        need = sum(q.waiter.gpus for q in ordered[:place - 1] if self._blocks(q)) + mine.gpus - self.free()
        expiries = [g.expires_at for g in self.store.grants() if g.expires_at is not None]
        elsewhere = self._fleet_held(uid, mine.user, ordered[place - 1].quota)
        return Standing(place, len(waiters), mine.gpus, mine.since, ahead, scheduler.estimate(need, expiries, now),
                        mine.priority, usage.get(mine.uid, 0.0) / mine.share,
                        mine.since + boost if boost < float("inf") else None,
                        ordered[place - 1].quota.fleet_gpus if elsewhere is not None else None, elsewhere or 0)

    def _fleet_held(self, uid: int, user: str, quota: Quota) -> int | None:
        """How many GPUs of the user's fleet quota are on other servers, when they hold all of it
        (policy.fleet_quota_held); None when they do not, or on a single server."""
        if self.held_elsewhere is None:
            return None
        elsewhere = self.held_elsewhere(user)
        return elsewhere if policy.fleet_quota_held(quota, elsewhere, len(self.store.grants(uid))) else None

    def _blocks(self, queued: Queued) -> bool:
        """Whether this waiter keeps those behind it waiting: not one an admin holds, nor one the
        pool could never hold (_possible)."""
        return queued.waiter.id not in self.holds.ids and self._possible(queued)

    def _possible(self, queued: Queued) -> bool:
        """Whether this server could hold the waiter's GPUs, were every other user's grant given
        back (its user keeps those they hold while they wait): a drain may have made it too big."""
        return queued.waiter.gpus <= self.grants.room(queued.waiter.uid, queued.quota)

    # --- joining and leaving

    def join(self, uid: int, user: str, gpus: int, quota: Quota, now: float, origin: Origin,
             pid: int | None = None, pid_start: int | None = None,
             counted: Iterable[int] = ()) -> tuple[Queued, tuple[int, ...] | None]:
        """Queue a request for `gpus` more, on top of the `counted` units its user holds, and serve
        the queue at once: the row, and the units it was served (None: it waits). Only
        asks.Asks.ask joins: a login, a request and a replayed job alike."""
        queued = self.store.join_queue(uid, user, gpus, now, quota, origin, pid, pid_start, counted)
        served = self.dispatch(now)  # its queue rows are the ones dispatch took out: no read of the queue again
        return queued, next((units for q, units in served if q.waiter.id == queued.waiter.id), None)

    def leave(self, ids: Iterable[int]) -> int:
        """Take these rows out unserved; the departure listeners hear of them. How many there were."""
        ids = list(ids)
        left = self.store.leave_queue(ids)
        for departed in self.departures:
            departed(ids)
        return left

    def keep_total(self, uid: int, taken: Iterable[int]) -> None:
        """A rule (release.KEEPS_TOTAL: idle, reclaim, a time limit, a last logout, ...) took back
        these units of a user: a place of theirs that counted on one of them now waits for as many
        more (never more than the quota's count), so that it is served the total it asked for, not
        short by what a rule took while it waited."""
        taken = set(taken)
        for queued in self.store.queue(uid):
            lost = taken.intersection(queued.counted)
            if lost:  # never more than the server has either (demand: rows never ask for more)
                gpus = min(queued.waiter.gpus + len(lost), queued.quota.gpus, self.grants.capacity(queued.quota))
                self.store.regrow_queued(queued, gpus, tuple(u for u in queued.counted if u not in lost))

    def gone(self, logged_in: set[int], alive: Alive) -> list[Queued]:
        """Waiters nobody waits for any more: a login's, once its user has no session; a request's,
        once its client process is gone."""
        return [q for q in self.store.queue()
                if (q.origin == Origin.SESSION and q.waiter.uid not in logged_in)
                or (q.origin == Origin.REQUEST and not alive(q.pid, q.pid_start))]

    def drop_gone(self, alive: Alive) -> list[Queued]:
        """Take out the requests nobody waits for (gone): a login's whose user has no session left,
        a request's whose client is gone (also one that died while no daemon ran). Each tick."""
        gone = self.gone(self.store.users_logged_in(), alive)
        if gone:
            self.leave(q.waiter.id for q in gone)
            for queued in gone:
                event(logging.INFO, "queue_left", user=queued.waiter.user, ticket=queued.waiter.id,
                      reason="no session left" if queued.origin == Origin.SESSION else "client gone")
        return gone

    # --- serving

    def free(self) -> int:
        """GPUs nobody holds (and not drained)."""
        return len(self.grants.pool().units.difference(map(attrgetter("unit"), self.store.grants_read())))

    def demand(self) -> rules.Demand:
        """Units the queue needs beyond the free ones, and which units would serve it: what reclaim
        on demand may take. With MIG slices a free unit counts only for a waiter whose quota takes
        its kind (allocator.suits), so the waiters are served in turn on paper: allocator.choose
        over the grants plus what those before them got."""
        waiting, pool = self.waiting(), self.grants.pool()
        versions = (waiting.version, waiting.holds, self.store.grants_version, self.grants.pool_version)
        last = self._demand
        if last is not None and last[0] == versions:
            return last[1]
        wanted = self._demand_of(waiting, pool)
        self._demand = (versions, wanted)
        return wanted

    def _demand_of(self, waiting: Waiting, pool: allocator.Pool) -> rules.Demand:
        if not waiting.gpus:  # the usual case: no grants to read
            return rules.Demand()
        too_big = self._too_big_of(waiting, pool)
        # Taking back what the only waiter counts on serves nobody: it would wait for it again.
        keep = (frozenset((q.waiter.uid, unit) for q in waiting.by_id.values() for unit in q.counted)
                if len(waiting.by_id) == 1 else frozenset())
        if not pool.slices:
            servable = waiting.gpus - sum(waiting.by_id[row].waiter.gpus for row in too_big)
            return rules.Demand(max(0, servable - self.free()), keep=keep)
        units = self.grants.open_units()
        grants = self.store.grants()
        short, useful = 0, set()
        for queued in waiting.by_id.values():
            waiter = queued.waiter
            if waiter.id in too_big:
                continue
            got = allocator.choose(pool, self.grants.topology, grants, {}, waiter.uid, waiter.gpus,
                                   policy.may_share(queued.quota), None, queued.quota)
            if len(got) < waiter.gpus:
                short += waiter.gpus - len(got)
                useful |= {gpu.unit for gpu in units if allocator.suits(gpu, queued.quota)}
            grants += [Grant(waiter.uid, waiter.user, unit, 0.0, None, 0.0) for unit in got]
        return rules.Demand(short, frozenset(useful), keep)

    def _too_big_of(self, waiting: Waiting, pool: allocator.Pool) -> list[int]:
        """The waiters that ask for more than the server has of the kind their quota takes: a
        drain or a new MIG layout made the pool smaller than when they asked. Nothing reclaim or
        soft time could take back would serve them, so demand leaves them out. A row joins within
        the pool (gpuguard request refuses more, a login asks at most that) and grows within it
        (keep_total), so only a change of the pool can make one too big: the rows are looked at
        then, not at every demand."""
        looked_at = (self.grants.pool_version, waiting.holds)
        if self._too_big is None or self._too_big[0] != looked_at:
            # (a row an admin held is not among the waiters: looked at again when it is released)
            self._too_big = (looked_at, frozenset(q.waiter.id for q in waiting.by_id.values()
                                                  if q.waiter.gpus > self.grants.capacity(q.quota)))
        return [row for row in self._too_big[1] if row in waiting.by_id]

    def dispatch(self, now: float) -> list[tuple[Queued, tuple[int, ...]]]:
        """Grant what the order admits now; each grant is announced to the listeners."""
        waiting = self.waiting()
        if not waiting.by_id:  # nobody waits: nothing to count
            return []
        # GPUs nobody holds: the cheap answer for a long queue, counted when a waiter that does not
        # share first asks, and again after each grant (None: not counted since)
        free: int | None = None
        if not waiting.sharers:
            free = self.free()
            if waiting.fewest > free:
                return []  # the usual answer when the pool is busy: nobody fits, so no order is needed
        entries = waiting.by_id
        chosen: dict[int, tuple[int, ...]] = {}  # waiter id -> what fits chose, since the last grant

        def fits(waiter: scheduler.Waiter) -> bool:
            nonlocal free
            quota = entries[waiter.id].quota
            if not policy.may_share(quota):
                free = self.free() if free is None else free
                if waiter.gpus > free:
                    return False
            chosen[waiter.id] = self.grants.choose(waiter.uid, waiter.gpus, quota)
            return len(chosen[waiter.id]) >= waiter.gpus

        served = []
        scheduling = self.config().scheduler
        usage = self._fleet_usage(now, (run[0] for run in waiting.runs.values()))
        ordered = scheduler.in_order(waiting.runs.values(), usage, now, scheduling.max_wait_boost)
        for waiter in scheduler.admit(ordered, fits, now, scheduling.reserve_after,
                                      lambda waiter: self._possible(entries[waiter.id])):
            queued = entries[waiter.id]
            origin = policy.grant_origin(queued.origin, self.store.logged_in(waiter.uid))
            units = self.grants.allocate(waiter.uid, waiter.user, queued.quota, waiter.gpus, now, origin,
                                         "granted from the queue", chosen.pop(waiter.id))
            chosen.clear()  # chosen before this grant: choose again
            if not units:  # a fleet quota in use on other servers (gpuguard.fleet): it keeps its place
                continue
            self.store.leave_queue([waiter.id])
            served.append((queued, units))
            for listener in self.listeners:
                listener(queued, units)
            free = None if waiting.sharers else self.free()
            if free is not None and waiting.fewest > free:
                break  # nothing left that anyone could take: the rest of the walk would grant nothing
        return served

    def waiting(self) -> Waiting:
        """The waiters not held, as the queue's rows and the holds now say: kept, and moved on by
        the queue's changes since (Store.queue_changes), not worked out again at each change."""
        store, holds, last = self.store, self.holds.ids, self._waiting
        version = store.queue_version
        if last is not None and last.holds == holds and last.version == version:
            return last
        changes = store.queue_changes(last.version) if last is not None and last.holds == holds else None
        self._waiting = (Waiting.of(store.queue_read(), version, holds) if last is None or changes is None
                         else last.following(changes, version))
        return self._waiting

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


@dataclass(frozen=True, eq=False)  # compared and hashed as itself: it holds dicts and lists
class Waiting:
    """The queue's waiters as dispatch and demand take them, kept from one change of the queue to
    the next (a long queue under load is served many times between changes, mostly with nothing
    free) and moved on by what changed, not worked out again."""

    version: int                         # the store's queue version this is of
    holds: frozenset[int]
    by_id: dict[int, Queued]             # the waiters not held, by id
    runs: dict[scheduler.RunKey, list[scheduler.Waiter]]  # scheduler.runs of their waiters
    gpus: int                            # how many GPUs they want in all
    alone: Counter[int]                  # how many waiters that do not share want each number of GPUs
    sharers: int                         # how many may share a GPU (such a one may fit with nothing free)

    @property
    def fewest(self) -> float:
        """The fewest GPUs a waiter that does not share wants (inf: there is none)."""
        return min(self.alone, default=math.inf)

    @classmethod
    def of(cls, rows: Iterable[Queued], version: int, holds: frozenset[int]) -> Waiting:
        return cls(version, holds, {}, {}, 0, Counter(), 0).following([(None, queued) for queued in rows], version)

    def following(self, changes: Iterable[QueueChange], version: int) -> Waiting:
        """This moved on by the queue's changes (a row in, or out), to `version`: a step per change,
        not per row (a queue under load is thousands long). Copies throughout: a dispatch may still
        be walking this one's runs."""
        by_id, runs, alone = dict(self.by_id), dict(self.runs), Counter(self.alone)
        gpus, sharers, holds = self.gpus, self.sharers, self.holds
        copied: set[scheduler.RunKey] = set()

        def moved(queued: Queued, sign: int) -> list[scheduler.Waiter]:
            """Count a waiter in (1) or out (-1); its run, copied."""
            nonlocal gpus, sharers
            waiter = queued.waiter
            gpus += sign * waiter.gpus
            if policy.may_share(queued.quota):
                sharers += sign
            else:
                alone[waiter.gpus] += sign
            key = scheduler.run_of(waiter)
            if key not in copied:
                runs[key] = list(runs.get(key, ()))
                copied.add(key)
            return runs[key]
        for before, after in changes:
            row = (after or before).waiter.id  # type: ignore[union-attr]  # a change has one side at least
            was = by_id.get(row)  # a held one was never in
            if was is not None:
                moved(was, -1).remove(was.waiter)
            if after is not None and row not in holds:
                by_id[row] = after  # one grown in place keeps its place; one that joined comes last (ids only grow)
                bisect.insort(moved(after, 1), after.waiter, key=scheduler.arrival)  # at the end, unless a clock went back
            elif was is not None:
                del by_id[row]
        return Waiting(version, holds, by_id, {key: run for key, run in runs.items() if run}, gpus, +alone, sharers)


class _WorkedOutWhenAsked(Mapping[int, float]):
    """A mapping whose values are worked out the first time each is asked for."""

    def __init__(self, keys: Collection[int], value_of: Callable[[int], float]) -> None:
        self._keys, self._value_of = keys, value_of
        self._known: dict[int, float] = {}

    def __getitem__(self, key: int) -> float:
        if key not in self._known:
            if key not in self._keys:
                raise KeyError(key)
            self._known[key] = self._value_of(key)
        return self._known[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
