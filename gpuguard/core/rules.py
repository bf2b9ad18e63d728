"""The watcher's decisions, pure: what to do about one sample of GPU processes. No I/O.

`decide(view, state, now, timing)` looks at one moment (who runs what where, the grants,
each user's quota) and the watcher's memory of earlier ticks, and returns actions: warn,
term, kill, unkillable, revoke, release, report. `advance(...)` folds the actions the
watcher actually carried out into the next state. Keeping the two apart lets the watcher
decide twice on two samples and act only on what both agree on (re-sample to confirm),
and lets every boundary below be unit-tested without a process or a clock.

The rules, with their boundaries:

- Memory (rule "memory"). For each user and whole GPU with a `gpu_memory` quota or a fraction's
  promise, the smaller of the two (memory_limit; not on a MIG slice: the hardware bounds its
  memory), `known` is the
  sum of the memory NVML reports for that user's processes there. Over means known > quota:
  exactly at the quota is fine. Memory NVML reports as unknown (None) counts neither as 0
  nor as over: it is left out of the sum, and a process whose memory is unknown (or 0) is
  never chosen to be stopped by this rule, since stopping it cannot be shown to help. So a
  user whose only processes are of unknown memory is never acted on by this rule, and a
  user with known usage at or under the quota plus any number of unknown processes is left
  alone. First seen over: one warning at once. Still over once `grace` has passed since
  that warning: on every tick, the processes already being stopped count as gone (those
  declared unkillable do not: their memory stays), and if what remains is still over, the
  largest processes (known memory > 0; the newest first among equals) get SIGTERM together,
  as many as it takes for the rest to fit the quota. Choosing by size, not by age, is what
  bounds the episode: small decoys started meanwhile are never the ones chosen while a
  larger process keeps the user over, and a job split across many processes loses enough
  of them in one tick. So the episode ends within grace + kill_wait (+ kill_wait when a
  process ignores SIGTERM) + a few intervals, whatever the user starts meanwhile: a process
  started while the user is over past grace is stopped on the next tick if it keeps them
  over. Back at or under the quota ends the episode; going over again warns again.
- Time (rule "time"). A grant with `expires_at`: one warning when at most 10 minutes are
  left and one when at most 1 minute is left (a grant first seen with less left gets only
  the one for the smallest threshold crossed). At `now >= expires_at`: revoke, and SIGTERM
  every process of the user on that GPU, whatever its memory.
- Idle (rule "idle"). A grant is active while any process of its user is on its GPU (known
  memory or not). Not active for `idle_timeout` since the later of the grant's stored
  `last_active` and the last tick the watcher saw a process there: release. `now - last >=
  idle_timeout` releases (the boundary releases). Sessions are not the watcher's business.
- Reclaim on demand (rule "reclaim"). Like idle with `reclaim_after`, but only while the queue
  wants GPUs (`View.demand`: how many more it needs than are free), and only that many: the
  grants idle longest go first, and only grants of units a waiter could have (`View.useful`: a
  whole GPU for a slice-only waiter frees nothing for it). Nobody waiting, nothing is reclaimed.
- Soft time (`Timing.soft_max_time`). A grant past `expires_at` is not revoked at once: its user
  is warned once that the time is over, and it is revoked (as above) only while the queue wants
  GPUs that reclaim did not cover, and it frees a unit a waiter could have; least work lost
  first: grants whose processes span the fewest GPUs (so a multi-GPU job is never stopped while
  stopping a single-GPU one would do), then the least GPU-seconds those processes have run (as
  the watcher has seen them: State.running_since), then the longest over.
- Stray (rule "stray"). Processes of a user on a GPU that user holds no grant for. The
  grace runs per user and GPU, not per process: the first such process is reported (exempt
  users, root always included: that report is all) or warned at once, and once `grace` has
  passed since that warning every process of that user on that GPU without a grant gets
  SIGTERM, however new, so rotating short-lived processes does not restart the clock. The
  episode is forgotten once the user got a grant there, or no process of theirs was on that
  GPU for STRAY_QUIET seconds (then a new stray is warned again).
- Ending (all rules). A SIGTERMed process still on a GPU `kill_wait` after the SIGTERM gets
  SIGKILL; still there `kill_wait` after the SIGKILL, it is reported unkillable, once, and
  from then on its memory counts as staying for the memory rule. A process never gets a
  second SIGTERM.
- Waits (grace, kill_wait) are lower bounds. `next_deadline` tells the watcher when the next
  one ends, so that it checks then and not up to an interval later.
- Failed GPUs (`View.failed`: NVML could not read their processes). Nothing is decided about
  them, not even a time revoke: an error must never read as "no processes". What the watcher
  remembers about them is kept, and their grants' idle clocks restart (not being seen while
  unread is no evidence of idleness), so after the GPU answers again nothing fires at once.
- Never: no action ever targets a process of root or of an exempt uid, and no rule signals a
  process it did not see in the sample it was given.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from functools import cached_property
from operator import attrgetter
from typing import Any, NamedTuple, TypedDict, TypeVar, cast

from gpuguard.core.compat import StrEnum
from gpuguard.core.model import EventKind, Grant, Origin, Quota, Rule, is_slice
from gpuguard.core.policy import ROOT_UID

TIME_WARNINGS: tuple[float, ...] = (600.0, 60.0, 0.0)  # seconds before expires_at, largest first; 0: over
# (only a soft max_time reaches 0 with the grant still held)
STRAY_QUIET = 600.0  # seconds without a stray process of a user on a GPU before its episode is forgotten

class Kind(StrEnum):
    """What an action does."""

    WARN = "warn"
    TERM = "term"
    KILL = "kill"
    UNKILLABLE = "unkillable"
    REVOKE = "revoke"
    RELEASE = "release"
    REPORT = "report"

    @property
    def event(self) -> EventKind:
        """The event an action of this kind records (a report is a warning to the admin)."""
        if self in (Kind.WARN, Kind.REPORT):
            return EventKind.WARNING
        if self in (Kind.TERM, Kind.KILL):
            return EventKind.KILL
        return EventKind(self.value)  # unkillable, revoke, release: the same word

    @property
    def signal(self) -> str | None:
        """The signal an action of this kind sends."""
        return {Kind.TERM: "SIGTERM", Kind.KILL: "SIGKILL"}.get(self)


# The members by their short names too, as the signal module exports its Signals members. The
# watcher's rules are model.Rule's first five; the others say what else takes grants back.
WARN, TERM, KILL, UNKILLABLE, REVOKE, RELEASE, REPORT = Kind
MEMORY, TIME, IDLE, STRAY, RECLAIM = Rule.MEMORY, Rule.TIME, Rule.IDLE, Rule.STRAY, Rule.RECLAIM
WATCHER_RULES = (MEMORY, TIME, IDLE, STRAY, RECLAIM)  # the rules that stop processes (a report's kills_RULE)

ProcKey = tuple[int, int]          # (pid, start_time): a pid is reused, this pair is not
Slot = tuple[int, int]             # (uid, unit)
GrantKey = tuple[int, int, float]  # (uid, unit, granted_at): a new grant starts afresh
_slot_of = attrgetter("uid", "unit")  # a grant's or a process's Slot
_K = TypeVar("_K")
_V = TypeVar("_V")


@dataclass(frozen=True)
class Proc:
    """One process on one GPU, with its owner. A process on two GPUs is two Procs."""

    pid: int
    uid: int
    start_time: int            # clock ticks after boot (/proc/<pid>/stat field 22)
    unit: int
    used_memory: int | None    # bytes; None = NVML does not know

    @cached_property
    def key(self) -> ProcKey:
        """Built once per Proc (the watcher keeps a process's Proc while its fields stay the same)."""
        return (self.pid, self.start_time)


@dataclass(frozen=True)
class Timing:
    grace: float      # over quota (or stray) this long after the warning before SIGTERM
    kill_wait: float  # SIGTERM (or SIGKILL) this long before the next step
    soft_max_time: bool = False  # past expires_at, revoke only while the queue wants GPUs


class Demand(NamedTuple):
    """What the queue wants beyond the free units (queueing.Queue.demand), for reclaim on demand."""

    short: int = 0                          # how many units it lacks
    useful: frozenset[int] | None = None    # the units a waiter could have; None: any
    keep: frozenset[Slot] = frozenset()     # (uid, unit) taking back would serve nobody (the only waiter's own)


@dataclass(frozen=True)
class View:
    """One moment as the watcher saw it."""

    procs: Sequence[Proc]
    grants: Sequence[Grant]
    quotas: Mapping[int, Quota]   # uid -> resolved quota, for every uid holding a grant
    exempt: Collection[int] = ()  # root is exempt whether listed or not
    failed: Collection[int] = ()  # units whose processes could not be read: nothing is known there
    demand: int = 0               # GPUs the queue needs beyond the free ones (reclaim on demand)
    useful: Collection[int] | None = None  # the units a waiter could have (kinds: whole, slice profiles); None: any
    keep: Collection[Slot] = ()   # grants whose taking back serves no waiter (Demand.keep)

    def readable(self) -> View:
        """This view without the failed GPUs' grants and processes."""
        if not self.failed:
            return self
        return replace(self, procs=[p for p in self.procs if p.unit not in self.failed],
                       grants=[g for g in self.grants if g.unit not in self.failed], failed=())

    # What decide, advance and next_change all need of a view, built once per view (a view is
    # never changed once made).
    @cached_property
    def on_slot(self) -> dict[Slot, list[Proc]]:
        """Each user's processes on each GPU."""
        return _by_slot(self.procs)

    @cached_property
    def granted(self) -> frozenset[Slot]:
        """(uid, unit) of every grant."""
        return frozenset(map(_slot_of, self.grants))

    @cached_property
    def proc_keys(self) -> frozenset[ProcKey]:
        return frozenset([p.key for p in self.procs])

    @cached_property
    def ruled(self) -> list[Grant]:
        """The grants a rule of their own may act on: those with a time limit, those of users with a
        memory quota, and the idle ones of users with an idle timeout, or a reclaim time while the
        queue wants GPUs. The others (all of them under a lab's defaults while nobody waits, the busy
        ones without a memory quota) are decide's only through the stray rule, so decide and
        next_change pass them by."""
        idle_clock = {uid for uid, q in self.quotas.items() if idle_clock_runs(q, self.demand)}
        idle = self.granted - self.on_slot.keys() if idle_clock else frozenset()
        limited = self.memory_limits
        return [g for g in self.grants
                if g.expires_at is not None or (g.uid, g.unit) in limited or (g.uid in idle_clock and _slot_of(g) in idle)]

    @cached_property
    def memory_limits(self) -> dict[Slot, int]:
        """What the memory rule holds each user's processes on a GPU to (memory_limit), where anything."""
        limits = {}
        for grant in self.grants:
            if (limit := memory_limit(grant, self.quotas.get(grant.uid))) is not None:
                limits[(grant.uid, grant.unit)] = limit
        return limits

    def reusing(self, earlier: View) -> View:
        """This view, with what was built for `earlier` of the same processes and grants kept: the
        watcher's next view mostly differs in one of them, or in the demand. (Equal sequences of the
        same objects compare at C speed, an identity per element.)"""
        same_procs, same_grants = self.procs == earlier.procs, self.grants == earlier.grants
        for name, same in (("on_slot", same_procs), ("proc_keys", same_procs), ("granted", same_grants)):
            if same and name in earlier.__dict__:  # where cached_property keeps what it built
                self.__dict__.setdefault(name, earlier.__dict__[name])
        return self

    def helps(self, grant: Grant) -> bool:
        """Whether taking this grant back frees a unit of a kind a waiter takes, for a waiter
        that would not wait for it again."""
        return (self.useful is None or grant.unit in self.useful) and (grant.uid, grant.unit) not in self.keep


@dataclass(frozen=True)
class Stopping:
    """A process the watcher has sent SIGTERM to, and what happened since."""

    uid: int
    unit: int
    rule: Rule
    term_at: float
    kill_at: float | None = None
    unkillable: bool = False  # reported as surviving SIGKILL


@dataclass(frozen=True)
class StrayEpisode:
    """A user's use of a GPU they hold no grant for: warned (or reported) when, last seen when."""

    reported_at: float
    last_seen: float


@dataclass(frozen=True)
class State:
    """What the watcher remembers between ticks (in memory: a restart starts afresh, which
    only means warnings are given again and grace restarts: the safe direction)."""

    over: Mapping[Slot, float] = field(default_factory=dict)           # memory warning sent at
    stray: Mapping[Slot, StrayEpisode] = field(default_factory=dict)   # ungranted (uid, unit) in use
    stopping: Mapping[ProcKey, Stopping] = field(default_factory=dict)
    time_warned: Mapping[GrantKey, float] = field(default_factory=dict)  # smallest threshold warned
    seen: Mapping[Slot, float] = field(default_factory=dict)            # last tick a process was there
    running_since: Mapping[ProcKey, float] = field(default_factory=dict)  # first tick a process was seen


class Numbers(TypedDict, total=False):
    """The numbers behind an action, for its message, its event and the log (bytes, seconds, epoch)."""

    used: int | None      # bytes on the GPU (known memory only); None: NVML does not know
    quota: int            # the memory quota, bytes
    grace: float
    kill_wait: float
    processes: int        # how many of the user's processes on the GPU
    unknown: int          # how many of them NVML gives no memory for
    warned_at: float
    term_at: float
    kill_at: float
    waited: float
    expires_at: float
    max_time: float
    reported_at: float    # when a stray episode was first reported
    waiting: int          # GPUs the queue waits for (reclaim)
    left: float           # seconds until expires_at
    threshold: float      # which time warning: 600, 60, or 0 (soft max_time, over)
    idle: float
    idle_timeout: float
    reclaim_after: float
    last_active: float
    signal: str           # added by the watcher when it sends one
    state: str            # /proc state of a process that survives SIGKILL


@dataclass(frozen=True)
class Action:
    kind: Kind
    rule: Rule
    uid: int
    unit: int
    proc: Proc | None = None
    # The numbers behind the action, for the message, the event and the log (bytes, seconds).
    numbers: Numbers = field(default_factory=lambda: Numbers(), compare=False, hash=False)

    @property
    def key(self) -> tuple[object, ...]:
        """What makes two decisions on two samples 'the same action' (numbers may differ). A
        warning is about a user on a GPU, whichever process it names: churning short-lived
        processes must not keep a warning from being confirmed. A signal is about one process."""
        return (self.kind, self.rule, self.uid, self.unit,
                self.proc.key if self.proc and self.kind != WARN else None)

    @property
    def signal(self) -> str | None:
        return self.kind.signal


# --- when a rule acts: each rule's moments, from the thresholds decide judges by (decide acts once
# `now` has reached one; next_change names the first one ahead; acts_on_arrival and the others
# below say which events make one due at once).

def time_moments(grant: Grant) -> tuple[float, ...]:
    """When the time rule acts on a grant: each warning (TIME_WARNINGS before expires_at, largest
    first), the last of them its expiry (revoke, or soft time's turn)."""
    return () if grant.expires_at is None else tuple(grant.expires_at - before for before in TIME_WARNINGS)


def idle_clock_runs(quota: Quota, demand: int) -> bool:
    """Whether a grant on these terms has an idle clock that can run out: an idle timeout, or a
    reclaim time while the queue wants GPUs (nobody waiting: nothing is reclaimed)."""
    return quota.idle_timeout is not None or (demand > 0 and quota.reclaim_after is not None)


class IdleMoments(NamedTuple):
    """When the idle rules act on a grant no process of its user is on."""

    since: float               # idle since: the later of last_active and the last tick a process was there
    release: float | None      # idle: since + idle_timeout
    reclaim: float | None      # reclaim: since + reclaim_after, only while the queue wants a unit it frees


def idle_moments(grant: Grant, quota: Quota, view: View, state: State) -> IdleMoments | None:
    """The idle rules' moments for an idle grant (None: no idle clock runs on these terms)."""
    if not idle_clock_runs(quota, view.demand):
        return None
    since = max(grant.last_active, state.seen.get((grant.uid, grant.unit), grant.last_active))
    return IdleMoments(since, None if quota.idle_timeout is None else since + quota.idle_timeout,
                       since + quota.reclaim_after if view.demand and quota.reclaim_after is not None
                       and view.helps(grant) else None)


def _grace_over(since: float, timing: Timing) -> float:
    """When a wait of grace after `since` (a memory warning, a stray report) is over."""
    return since + timing.grace


def _kill_moment(stop: Stopping, timing: Timing) -> float | None:
    """When a process being stopped gets its next step: SIGKILL kill_wait after SIGTERM, then reported
    unkillable kill_wait after SIGKILL; None once reported (nothing follows that)."""
    if stop.kill_at is None:
        return stop.term_at + timing.kill_wait
    return None if stop.unkillable else stop.kill_at + timing.kill_wait


def decide(view: View, state: State, now: float, timing: Timing) -> list[Action]:
    view = view.readable()
    exempt = {ROOT_UID, *view.exempt}
    on_slot = view.on_slot

    actions: list[Action] = []
    signalled: set[ProcKey] = set()  # one signal per process per tick, whatever its GPUs

    def term(proc: Proc, rule: Rule, **numbers: Any) -> None:
        if proc.uid in exempt or proc.key in signalled or proc.key in state.stopping:
            return
        signalled.add(proc.key)
        actions.append(Action(TERM, rule, proc.uid, proc.unit, proc,
                              cast(Numbers, {**numbers, "kill_wait": timing.kill_wait})))

    # Ending: processes already signalled move on to SIGKILL, then to "unkillable".
    for proc in view.procs if state.stopping else ():
        stop = state.stopping.get(proc.key)
        if stop is None or proc.key in signalled or proc.uid in exempt:
            continue
        due = _kill_moment(stop, timing)
        if due is None or now < due:
            continue
        if stop.kill_at is None:
            signalled.add(proc.key)
            actions.append(Action(KILL, stop.rule, proc.uid, proc.unit, proc,
                                  {"term_at": stop.term_at, "kill_wait": timing.kill_wait}))
        else:
            signalled.add(proc.key)
            actions.append(Action(UNKILLABLE, stop.rule, proc.uid, proc.unit, proc,
                                  {"kill_at": stop.kill_at, "waited": now - stop.kill_at}))

    def revoke(grant: Grant, procs: list[Proc]) -> None:
        # Its processes are ended here, not reported as strays.
        assert grant.expires_at is not None  # only an expired grant is revoked
        actions.append(Action(REVOKE, TIME, grant.uid, grant.unit, None, {
            "expires_at": grant.expires_at, "max_time": grant.expires_at - grant.granted_at,
            "processes": len({p.key for p in procs}), "kill_wait": timing.kill_wait}))
        for proc in reversed(_oldest_first(procs)):
            term(proc, TIME, expires_at=grant.expires_at)

    reclaimable: list[tuple[float, Grant, float]] = []  # (idle since, grant, reclaim_after)
    overtime: list[tuple[Grant, list[Proc]]] = []
    for grant in view.ruled:
        slot = (grant.uid, grant.unit)
        procs = on_slot.get(slot, [])
        quota = view.quotas.get(grant.uid)
        if grant.expires_at is not None and now >= time_moments(grant)[-1]:
            if not timing.soft_max_time:
                revoke(grant, procs)
                continue
            if view.helps(grant):
                overtime.append((grant, procs))
        if grant.expires_at is not None:
            actions.extend(_time_warning(grant, state, now))
        if quota is None:
            continue
        if not procs:
            idle = idle_moments(grant, quota, view, state)
            if idle is None:
                continue
            last = idle.since
            if idle.release is not None and quota.idle_timeout is not None and now >= idle.release:
                actions.append(Action(RELEASE, IDLE, grant.uid, grant.unit, None, {
                    "idle": now - last, "idle_timeout": quota.idle_timeout, "last_active": last}))
            elif idle.reclaim is not None and quota.reclaim_after is not None and now >= idle.reclaim:
                reclaimable.append((last, grant, quota.reclaim_after))  # (nobody waiting: no reclaim moment)
            continue
        # (a slice's memory is bounded in hardware)
        if (limit := view.memory_limits.get(slot)) is not None and grant.uid not in exempt:
            actions.extend(_memory(grant, limit, procs, state, now, timing, term))

    wanted = view.demand
    reclaimed = set()
    for last, grant, after in sorted(reclaimable, key=lambda r: (r[0], r[1].uid, r[1].unit))[:wanted]:
        reclaimed.add((grant.uid, grant.unit))
        actions.append(Action(RELEASE, RECLAIM, grant.uid, grant.unit, None, {
            "idle": now - last, "reclaim_after": after, "last_active": last, "waiting": view.demand}))
    overtime = [(g, p) for g, p in overtime if (g.uid, g.unit) not in reclaimed]
    spans: dict[ProcKey, int] = {}
    for proc in view.procs if overtime else ():  # only soft time's choice needs them
        key = proc.key
        spans[key] = spans.get(key, 0) + 1

    def work_lost(over: tuple[Grant, list[Proc]]) -> tuple[int, float, float, int, int]:
        """What revoking this grant throws away: its processes' widest span (GPUs), then their
        GPU-seconds run so far; the longest over first among equals."""
        grant, procs = over
        keys = {p.key for p in procs}
        lost = sum(spans[k] * (now - state.running_since.get(k, now)) for k in keys)
        return (max((spans[k] for k in keys), default=0), lost, grant.expires_at or 0.0, grant.uid, grant.unit)

    for grant, procs in sorted(overtime, key=work_lost)[:wanted - len(reclaimed)]:
        revoke(grant, procs)

    strays = on_slot.keys() - view.granted
    for slot, procs in on_slot.items() if strays else ():
        if slot in strays:
            actions.extend(_stray(slot, _oldest_first(procs), state, now, timing, slot[0] in exempt, term))
    return actions


def _by_slot(procs: Sequence[Proc]) -> dict[Slot, list[Proc]]:
    """Each user's processes on each GPU."""
    on_slot: dict[Slot, list[Proc]] = {}
    for slot, proc in zip(map(_slot_of, procs), procs, strict=True):
        on_slot.setdefault(slot, []).append(proc)
    return on_slot


def _oldest_first(procs: Iterable[Proc]) -> list[Proc]:
    return sorted(procs, key=lambda p: (p.start_time, p.pid))


def _largest_first(procs: Iterable[Proc]) -> list[Proc]:
    """By known memory, largest first; among equals the newest first (pid breaks a tie)."""
    return sorted(procs, key=lambda p: (p.used_memory or 0, p.start_time, p.pid), reverse=True)


def known_memory(procs: Iterable[Proc]) -> int:
    """The sum of the memory NVML knows; unknown entries are left out (never read as 0 or as over)."""
    return sum(p.used_memory for p in procs if p.used_memory is not None)


def memory_limit(grant: Grant, quota: Quota | None) -> int | None:
    """What the memory rule holds a user's processes on a grant's GPU to (None: nothing): their
    gpu_memory quota, and on a fraction the memory promised to it, which the GPU's other holders
    count on; the smaller of the two. Never on a MIG slice: the hardware bounds its memory."""
    if is_slice(grant.unit):
        return None
    limits = [m for m in (quota.gpu_memory if quota else None, grant.fraction) if m is not None]
    return min(limits, default=None)


def _memory(grant: Grant, limit: int, procs: list[Proc], state: State, now: float, timing: Timing,
            term: Callable[..., None]) -> list[Action]:
    used = known_memory(procs)
    if used <= limit:
        return []
    # Only processes with known, nonzero memory are candidates: stopping one is sure to help.
    candidates = [p for p in _largest_first(procs) if p.used_memory and p.key not in state.stopping]
    numbers = Numbers(used=used, quota=limit, grace=timing.grace, processes=len({p.key for p in procs}),
                      unknown=sum(1 for p in procs if p.used_memory is None))
    warned = state.over.get((grant.uid, grant.unit))
    if warned is None:
        return [Action(WARN, MEMORY, grant.uid, grant.unit, candidates[0] if candidates else None, numbers)]
    if now < _grace_over(warned, timing):
        return []
    # Being stopped counts as gone, unless it survived SIGKILL: its memory stays.
    staying = known_memory(p for p in procs if p.key not in state.stopping or state.stopping[p.key].unkillable)
    for proc in candidates:
        if staying <= limit:
            break
        term(proc, MEMORY, **numbers, warned_at=warned)
        staying -= proc.used_memory or 0  # candidates all have known memory
    return []


def _stray(slot: Slot, procs: list[Proc], state: State, now: float, timing: Timing, exempt: bool,
           term: Callable[..., None]) -> list[Action]:
    """One user's processes (oldest first) on one GPU they hold no grant for."""
    episode = state.stray.get(slot)
    fresh = [p for p in procs if p.key not in state.stopping]
    if not fresh:
        return []
    first = fresh[0]
    if exempt:
        return [] if episode else [Action(REPORT, STRAY, first.uid, first.unit, first,
                                          {"used": first.used_memory, "processes": len(fresh)})]
    if episode is None:
        return [Action(WARN, STRAY, first.uid, first.unit, first,
                       {"used": first.used_memory, "grace": timing.grace, "processes": len(fresh)})]
    if now >= _grace_over(episode.reported_at, timing):
        for proc in fresh:
            term(proc, STRAY, used=proc.used_memory, reported_at=episode.reported_at)
    return []


def _time_warning(grant: Grant, state: State, now: float) -> list[Action]:
    assert grant.expires_at is not None  # only grants with a time limit are warned
    left = grant.expires_at - now
    crossed = [t for t, moment in zip(TIME_WARNINGS, time_moments(grant), strict=True) if now >= moment]
    if not crossed:
        return []
    threshold = min(crossed)
    if threshold >= state.time_warned.get((grant.uid, grant.unit, grant.granted_at), float("inf")):
        return []
    return [Action(WARN, TIME, grant.uid, grant.unit, None, {
        "left": left, "expires_at": grant.expires_at, "threshold": threshold})]


def _waits_ending(state: State, timing: Timing) -> list[float]:
    """When each wait in `state` ends: grace after a memory warning or a stray report, kill_wait
    after a signal (none after a process was found unkillable: nothing follows that)."""
    warned = (*state.over.values(), *(episode.reported_at for episode in state.stray.values()))
    ends = [_grace_over(since, timing) for since in warned]
    return ends + [end for stop in state.stopping.values() if (end := _kill_moment(stop, timing)) is not None]


def next_deadline(state: State, timing: Timing, after: float) -> float | None:
    """The first moment after `after` at which a wait in `state` ends, or None: the daemon ticks
    then too, so waits end on time rather than up to an interval late."""
    return min((end for end in _waits_ending(state, timing) if end > after), default=None)


def advance(view: View, state: State, done: Iterable[Action], now: float) -> State:
    """The state after the actions the watcher carried out (attempted) on this view."""
    over = dict(state.over)
    stray = dict(state.stray)
    stopping = dict(state.stopping)
    time_warned = dict(state.time_warned)
    since = state.running_since
    running_since = {**dict.fromkeys(view.proc_keys, now), **_kept(since, view.proc_keys)}
    failed = frozenset(view.failed)
    granted = view.granted
    on_slot = view.on_slot
    # Idle clocks: of the grants only; now where a process was seen, and on a failed GPU (unread:
    # possibly busy, so its idle clock restarts).
    seen = _kept(state.seen, granted)
    seen.update(dict.fromkeys(granted.intersection(on_slot), now))
    if failed:
        seen.update(dict.fromkeys([(g.uid, g.unit) for g in view.grants if g.unit in failed], now))

    grant_keys = {(g.uid, g.unit, g.granted_at) for g in view.grants} if time_warned or done else set()
    for action in done:
        target = action.proc
        if action.kind == WARN and action.rule == MEMORY:
            over[(action.uid, action.unit)] = now
        elif action.kind == WARN and action.rule == TIME:
            gkey = next((k for k in grant_keys if k[:2] == (action.uid, action.unit)), None)
            if gkey is not None:
                time_warned[gkey] = float(action.numbers["threshold"])
        elif action.kind in (WARN, REPORT) and action.rule == STRAY:
            stray[(action.uid, action.unit)] = StrayEpisode(now, now)
        elif action.kind == TERM and target is not None:
            stopping[target.key] = Stopping(target.uid, target.unit, action.rule, now)
        elif action.kind == KILL and target is not None and target.key in stopping:
            stopping[target.key] = replace(stopping[target.key], kill_at=now)
        elif action.kind == UNKILLABLE and target is not None and target.key in stopping:
            stopping[target.key] = replace(stopping[target.key], unkillable=True)

    # Forget what no longer applies: processes gone, episodes over, grants ended; about failed
    # GPUs nothing is known, so what is remembered about them stays.
    present = view.proc_keys
    for slot, episode in stray.items():
        if slot in on_slot:
            stray[slot] = replace(episode, last_seen=now)

    def stray_goes_on(slot: Slot, episode: StrayEpisode) -> bool:
        return slot[1] in failed or (slot not in granted and now - episode.last_seen < STRAY_QUIET)

    def still_over(slot: Slot) -> bool:
        limit = view.memory_limits.get(slot)
        return slot in granted and limit is not None and known_memory(on_slot.get(slot, [])) > limit

    return State(
        over={slot: t for slot, t in over.items() if slot[1] in failed or still_over(slot)},
        stray={slot: e for slot, e in stray.items() if stray_goes_on(slot, e)},
        stopping={k: s for k, s in stopping.items() if k in present or s.unit in failed},
        time_warned={k: t for k, t in time_warned.items() if k in grant_keys},
        seen=seen,
        running_since=running_since,  # of the processes in this sample: one gone is forgotten
    )


def _kept(mapping: Mapping[_K, _V], keys: AbstractSet[_K]) -> dict[_K, _V]:
    """The entries of `mapping` whose keys are in `keys`: a copy less the few that went (the
    usual case from one tick to the next), without a step per entry kept."""
    kept = dict(mapping)
    for key in kept.keys() - keys:
        del kept[key]
    return kept


def next_change(view: View, state: State, timing: Timing, now: float) -> float | None:
    """The earliest moment after `now` at which decide() on this same view could act differently
    (None: never): the first of the rules' moments ahead (waits ending, time_moments, idle_moments).
    A daemon ticks then too; a replay sleeps until then instead of ticking through moments when
    nothing can happen; tests hold it against decide()."""
    view = view.readable()
    busy = view.on_slot
    times = _waits_ending(state, timing)
    for grant in view.ruled:
        times.extend(time_moments(grant))
        quota = view.quotas.get(grant.uid)
        if quota is not None and (grant.uid, grant.unit) not in busy and \
                (idle := idle_moments(grant, quota, view, state)) is not None:
            times.extend(moment for moment in (idle.release, idle.reclaim) if moment is not None)
    return min((t for t in times if t > now), default=None)


def acts_on_arrival(grant: Grant, quota: Quota, now: float) -> bool:
    """Whether a rule may act the moment a process appears on this grant's GPU: the memory rule
    under a memory quota, and time on a grant already past its time (a revoke ends every process
    there; soft time's choice weighs their work). Otherwise rules act on their moments and the
    queue's demand (a new process only stops an idle clock), stray on GPUs not held."""
    return memory_limit(grant, quota) is not None or (grant.expires_at is not None and now >= time_moments(grant)[-1])


def acts_on_grant_change(grant: Grant, busy: bool, came: bool) -> bool:
    """Whether a rule may act at once, or has a moment nobody asked next_change for yet, because this
    grant came or went (busy: a process of its user is on its GPU): one that went with that process
    still there (it is a stray now), one that came with none there (its idle clock runs) or with a
    time limit (its warnings are moments)."""
    return (grant.expires_at is not None or not busy) if came else busy


def acts_on_demand(before: Demand, after: Demand) -> bool:
    """Whether reclaim and soft time may act at once because the queue's demand moved: it wants more
    than it did, other units, or units it kept before (another waiter came). Less demand only makes
    them act later or not at all."""
    return after.short > before.short or (after.short > 0 and (after.useful != before.useful
                                                               or not before.keep <= after.keep))


def confirmed(first: Sequence[Action], second: Sequence[Action]) -> list[Action]:
    """The actions both decisions agree on (by kind, rule, user, GPU and process), with the
    second decision's numbers: the fresher sample speaks, the older one only vetoes."""
    keys = {a.key for a in first}
    return [a for a in second if a.key in keys]


def usage(view: View, seconds: float) -> dict[Slot, tuple[float, float, float]]:
    """(granted, busy, idle) seconds to add per user and GPU for `seconds` of this view; on a
    failed GPU neither busy nor idle is known, so only the granted time counts."""
    busy_slots = view.on_slot

    def split(grant: Grant) -> tuple[float, float, float]:
        if grant.unit in view.failed:
            return (seconds, 0.0, 0.0)
        return (seconds, seconds, 0.0) if (grant.uid, grant.unit) in busy_slots else (seconds, 0.0, seconds)
    return {(g.uid, g.unit): split(g) for g in view.grants}



def unused_after_logout(grants: Iterable[Grant], logged_in: Collection[int], busy: Collection[Slot],
                        read: Collection[int]) -> dict[int, frozenset[int]]:
    """uid -> all of its granted units, for users who hold a session grant, have no open session
    and no process (busy: (uid, unit) seen by NVML) on any of their GPUs, all of which were read
    (`read`: an NVML error is not idleness). A nohup or tmux job keeps its user's GPUs after
    logout: they go once it has exited.
    """
    by_uid: dict[int, list[Grant]] = {}
    for grant in grants:
        by_uid.setdefault(grant.uid, []).append(grant)
    unused = {}
    for uid, held in by_uid.items():
        units = frozenset(g.unit for g in held)
        if (uid not in logged_in and any(g.origin == Origin.SESSION for g in held)
                and not any((uid, m) in busy for m in units) and units <= set(read)):
            unused[uid] = units
    return unused
