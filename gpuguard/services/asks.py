"""Asking for GPUs: the one path that a login, `gpuguard request` and a replayed job all take.

Asks.ask decides, in this order, each step here and nowhere else:

1. who: only members of access.group get GPUs (exempt users need none, outsiders get none);
2. how many: at most the quota's count (a fraction, part of one GPU's memory, is one unit, of a
   size within policy.fraction_bounds, at most policy.fraction_limit of them held; it is then
   served on policy.fraction_terms, here and in the queue alike); more than the server could ever serve whole beside what
   the asker keeps (Grants.room_beside) is refused when a count was asked for, and the quota's
   worth is cut to it when none was;
3. one place: a login and a request keep one place in the queue per user (a second could bring
   them more than their quota), and a user already waiting is told so; a replayed batch job is a
   place of its own, as each job of a batch system is;
4. now: while nobody waits, what is free is granted at once (part of it, unless the ask is whole);
   with others waiting, the ask takes its turn like them; a user whose GPU a time limit just took
   gets none of its kind, now or from the queue, until their cool-down ends (Grants.allocate:
   policy.cool_downs), so `request` right after the revoke is no fresh max_time;
5. the rest waits in the queue (Queue.join, which serves the queue at once): when the ask waits
   for it, or when the asker holds nothing at all; an ask that does not keep its place leaves the
   queue again when its turn has not come.

What a grant is (it ends with the user's sessions, or stays) is policy.grant_origin, for the
grants made here and those the queue makes later alike.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gpuguard.config import Config
from gpuguard.core import policy
from gpuguard.core.compat import StrEnum
from gpuguard.core.model import Account, Origin, Quota
from gpuguard.services.grants import Grants
from gpuguard.services.queueing import Queue
from gpuguard.services.store import Queued, Store


class Waits(StrEnum):
    """What an ask does with what it cannot have now."""

    NEVER = "never"          # granted now or not at all (`gpuguard request`): a place only for an immediate turn
    IF_NOTHING = "if_nothing"  # a login: waits only when it got nothing now, and keeps its place
    YES = "yes"              # `gpuguard request --wait`, a replayed job: waits for the rest, keeps its place


class Outcome(StrEnum):
    GRANTED = "granted"      # the asker holds what they asked for (some of it: see Answer.granted)
    WAITING = "waiting"      # in the queue for the rest (Answer.place)
    REFUSED = "refused"      # see Answer.why


class Why(StrEnum):
    """Why an ask got nothing."""

    EXEMPT = "exempt"            # every GPU is open to them already
    OUTSIDER = "outsider"        # not in access.group
    OVER_QUOTA = "over_quota"    # asked for more than their quota's count
    TOO_BIG = "too_big"          # asked for more than this server could ever serve them whole
    ALREADY_WAITING = "already_waiting"  # one place per user: theirs is in the queue already
    NONE_FREE = "none_free"      # nothing free now, and the ask does not wait
    COOLING_DOWN = "cooling_down"  # a time limit just took their GPU: none of its kind for reclaim_after
    FRACTION_SIZE = "fraction_size"  # a fraction outside policy.fraction_bounds (Answer.bounds)
    MAX_FRACTIONS = "max_fractions"  # they hold policy.fraction_limit fractions already


@dataclass(frozen=True)
class Ask:
    account: Account
    gpus: int | None             # the total wanted, the kept units included (None: the quota's worth)
    origin: Origin               # the queue row's: a login's (waits while its user has a session) or a request's
    waits: Waits
    message: str                 # what a grant made at once records ("granted at login (sshd)")
    keeps: tuple[int, ...] = ()  # units the asker holds that count towards it (a request: all they hold)
    whole: bool = False          # granted all of it at once or not at all (a job cannot start on part)
    one_place: bool = True       # at most one place in the queue per user
    pid: int | None = None       # the client (a request) or the PAM caller (a login): the place lives while it does
    pid_start: int | None = None
    # A fraction: this many bytes of one GPU's memory, shared (None: whole GPUs, or the quota's
    # fraction_memory when no count is asked either)
    memory: int | None = None


@dataclass(frozen=True)
class Answer:
    outcome: Outcome
    quota: Quota
    wanted: int = 0                       # the total it asked for (the quota's worth, cut to what the server has)
    granted: tuple[int, ...] = ()         # the units given for it now
    place: Queued | None = None           # its place in the queue (WAITING; ALREADY_WAITING: the user's)
    why: Why | None = None                # REFUSED only
    capacity: int = field(default=0)      # TOO_BIG: what the server has of a kind the quota takes
    until: float | None = None            # COOLING_DOWN: when the first of the user's cool-downs ends
    bounds: tuple[int, int] = (0, 0)      # FRACTION_SIZE: the smallest and largest fraction allowed


class Asks:
    def __init__(self, config: Callable[[], Config], store: Store, grants: Grants, queue: Queue):
        self.config = config  # the config in force, which a reload replaces
        self.store = store
        self.grants = grants
        self.queue = queue

    def eligibility(self, account: Account) -> policy.Eligibility:
        """Where an account stands (policy.eligibility, under the access rules in force)."""
        return policy.eligibility(account.uid, account.name, account.groups, self.config().access)

    def ask(self, ask: Ask, now: float) -> Answer:
        account = ask.account
        eligible = self.eligibility(account)
        quota = policy.quota_for(account.name, account.groups, self.config())
        if eligible != policy.Eligibility.MEMBER:
            why = Why.EXEMPT if eligible == policy.Eligibility.EXEMPT else Why.OUTSIDER
            return Answer(Outcome.REFUSED, quota, why=why)
        uid = account.uid
        wanted = quota.gpus if ask.gpus is None else ask.gpus
        memory = ask.memory if ask.memory is not None or ask.gpus is not None else quota.fraction_memory
        if memory is not None:
            low, high = policy.fraction_bounds(quota, self.grants.largest_whole())
            if not low <= memory <= high:
                return Answer(Outcome.REFUSED, quota, 1, why=Why.FRACTION_SIZE, bounds=(low, high))
            # One more fraction; a plain ask (the quota's fraction) tops up to one, as it tops up to the quota
            wanted = len(ask.keeps) + 1 if ask.memory is not None else max(1, len(ask.keeps))
            held = sum(g.fraction is not None for g in self.store.grants(uid))
            if wanted > len(ask.keeps) and held >= policy.fraction_limit(quota):
                return Answer(Outcome.REFUSED, quota, wanted, why=Why.MAX_FRACTIONS)
            quota = policy.fraction_terms(quota, memory)
        if wanted > quota.gpus:
            return Answer(Outcome.REFUSED, quota, wanted, why=Why.OVER_QUOTA)
        # More than this server has for the user could never be served whole, and a place in the
        # queue for it would hold the free GPUs for ever once reserved.
        more, room = wanted - len(ask.keeps), self.grants.room_beside(quota, ask.keeps)
        if more > room:
            if ask.gpus is not None:
                return Answer(Outcome.REFUSED, quota, wanted, why=Why.TOO_BIG, capacity=self.grants.capacity(quota))
            wanted, more = len(ask.keeps) + room, room
        if more <= 0:
            return Answer(Outcome.GRANTED, quota, wanted)
        if ask.one_place and (mine := self.store.queue(uid)):
            return Answer(Outcome.WAITING if ask.waits == Waits.YES else Outcome.REFUSED, quota, wanted,
                          place=mine[0], why=None if ask.waits == Waits.YES else Why.ALREADY_WAITING)
        granted: tuple[int, ...] = ()
        if not ask.whole and not self.store.queue():  # with others waiting, it takes its turn like them
            origin = policy.grant_origin(ask.origin, self.store.logged_in(uid))
            granted = self.grants.allocate(uid, account.name, quota, more, now, origin, ask.message)
            more -= len(granted)
        joins = more > 0 and (ask.waits == Waits.YES or not self.store.grants(uid))
        if granted or joins:
            self.grants.note_asked(uid, memory)  # the sizes fractions are placed for (allocator.place_fraction)
        if joins:
            # A fraction is a unit of its own, not a top-up of what its user holds: it counts on none
            # of theirs (Queue.keep_total would grow it past the one unit a fraction is).
            counted = () if quota.fraction is not None else (*ask.keeps, *granted)
            place, served = self.queue.join(uid, account.name, more, quota, now, ask.origin, ask.pid, ask.pid_start,
                                            counted=counted)
            if served is not None:
                return Answer(Outcome.GRANTED, quota, wanted, (*granted, *served))
            if ask.waits != Waits.NEVER:
                return Answer(Outcome.WAITING, quota, wanted, granted, place)
            self.queue.leave([place.waiter.id])  # its turn has not come, and it does not wait for it
            if cooling := self.grants.cooling(uid, quota, now):
                return Answer(Outcome.REFUSED, quota, wanted, why=Why.COOLING_DOWN, until=min(cooling.values()))
            return Answer(Outcome.REFUSED, quota, wanted, why=Why.NONE_FREE)
        # What was free now (maybe nothing, with others waiting): the asker keeps what they hold.
        return Answer(Outcome.GRANTED, quota, wanted, granted)
