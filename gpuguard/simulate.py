"""`gpuguard simulate`: replay a trace on a virtual clock through the daemon's own code.

What runs is what the daemon runs: the quotas (policy.quota_for), the store, the grant manager
and its allocator (grants.Grants), the queue (queueing.Queue over gpuguard.scheduler), the
watcher's rules (rules.decide / rules.advance: idle, reclaim, time, memory) and the logout
release (logout.LogoutRelease). Only the edges are replaced: the clock is virtual, the GPU
sample is built from the jobs running at that moment, the store is a scratch file without
fsync, and there are no device nodes, gate, NSS or terminals.

The replay: a session opens (a login; it grants nothing: jobs ask for their GPUs); each job asks
for the GPUs it needs as `gpuguard request --wait` would (its user's idle granted GPUs count) and
runs once they are granted: the time between is its time to GPU. A job still waiting when its
session ends never runs (its waiter leaves the queue, as a login's does). While it runs, its
processes are on its GPUs, so the rules see them busy; a SIGTERM from a rule ends the job there.
The rules are evaluated after every batch of simultaneous events (one of job ends only, which no
rule acts on at once, just moves the next wake) and at the next moment one of them can fire
(rules.next_change), rounded up to the watcher's interval as the daemon's tick would see it.
A grant freed there goes to the queue in the same instant, so a replay's time to GPU is up to
one watcher interval shorter than a daemon's would be.

Beside it, in the same run, static reservation: each session holds the GPUs of its largest job
from its start to its end, sessions served first come first served, a session that waits is
shifted by its wait (its jobs then wait as long).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpuguard import messages, policy, rules
from gpuguard.backends.exits import ExitWatch
from gpuguard.backends.processes import HostProcesses
from gpuguard.backends.procfs import ProcessIdentity
from gpuguard.config import Config
from gpuguard.grants import Grants
from gpuguard.logout import LogoutRelease
from gpuguard.model import Event, Gpu, GpuProcess, Grant, Origin, Quota
from gpuguard.queueing import Queue
from gpuguard.release import Releases
from gpuguard.sampling import Sample
from gpuguard.scans import Scans
from gpuguard.store import Queued, Store
from gpuguard.trace import Job, Session
from gpuguard.watcher import timing_of

FIRST_UID = 100000


@dataclass
class Result:
    """What one policy did with the trace (seconds and counts)."""

    granted: float = 0.0             # GPU-seconds granted
    busy: float = 0.0                # GPU-seconds jobs ran
    demanded: float = 0.0            # GPU-seconds the jobs asked for
    span: float = 0.0                # seconds from the first login to the last event
    waits: list[float] = field(default_factory=list)  # time to GPU of each job that ran
    never_ran: int = 0
    over_quota: int = 0              # of never_ran: asked for more GPUs than the quota allows
    releases: int = 0                # idle and logout releases (GPU grants)
    reclaims: int = 0
    revokes: int = 0                 # time limit
    kills: int = 0                   # jobs ended by a rule
    most_sharers: int = 0            # the most jobs seen on one GPU at once (1 unless users share)
    per_user: dict[str, list[float]] = field(default_factory=dict)  # user -> [granted, demanded]

    def summary(self, gpus: int) -> dict[str, float | int | None]:
        waits = sorted(self.waits)
        shares = [g / d for g, d in self.per_user.values() if d > 0]
        return {
            "gpu_seconds_granted": round(self.granted, 1),
            "gpu_seconds_busy": round(self.busy, 1),
            "busy_of_granted": round(self.busy / self.granted, 4) if self.granted else None,
            "pool_busy": round(self.busy / (gpus * self.span), 4) if self.span else None,
            "wait_p50": percentile(waits, 0.50),
            "wait_p95": percentile(waits, 0.95),
            "wait_max": waits[-1] if waits else None,
            "jobs_ran": len(waits),
            "jobs_never_ran": self.never_ran,
            "jobs_over_quota": self.over_quota,
            "jain": round(jain(shares), 4) if shares else None,
            "releases": self.releases,
            "reclaims": self.reclaims,
            "revokes": self.revokes,
            "kills": self.kills,
            "most_sharers": self.most_sharers,
        }


def percentile(ordered: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def jain(values: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2), 1 when all are equal, 1/n at worst."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0


class _ScratchStore(Store):
    """The store with its grants and queue read once per change (a replay is its only writer, and
    reads them far more often than it changes them), and events counted by kind and rule instead
    of kept (a replay reports how many releases, reclaims and revokes there were, never a history)."""

    def __init__(self, path: Path):
        super().__init__(path, durable=False)
        self._grants: list[Grant] | None = None
        self._queue: list[Queued] | None = None
        self.event_counts: Counter[tuple[str, str]] = Counter()

    def add_event(self, event: Event) -> int:
        self.event_counts[(event.kind, event.rule)] += 1
        return 0

    def grants(self, uid: int | None = None) -> list[Grant]:
        if self._grants is None:
            self._grants = super().grants()
        return self._grants if uid is None else [g for g in self._grants if g.uid == uid]

    def queue(self, uid: int | None = None) -> list[Queued]:
        if self._queue is None:
            self._queue = super().queue()
        return self._queue if uid is None else [q for q in self._queue if q.waiter.uid == uid]

    def join_queue(self, *args, **kwargs) -> Queued:
        self._queue = None
        return super().join_queue(*args, **kwargs)

    def leave_queue(self, ids: Iterable[int]) -> int:
        self._queue = None
        return super().leave_queue(ids)

    def add_grants(self, uid: int, *args, **kwargs) -> None:
        super().add_grants(uid, *args, **kwargs)
        if self._grants is not None:  # only this user's rows are read again
            others = [g for g in self._grants if g.uid != uid]
            self._grants = sorted(others + super().grants(uid), key=lambda g: (g.uid, g.minor))

    def remove_grants(self, uid: int, *args, **kwargs) -> list[Grant]:
        removed = super().remove_grants(uid, *args, **kwargs)
        if self._grants is not None:
            gone = {(g.uid, g.minor) for g in removed}
            self._grants = [g for g in self._grants if (g.uid, g.minor) not in gone]
        return removed

    def mark_active(self, *args, **kwargs) -> None:
        self._grants = None
        super().mark_active(*args, **kwargs)


class _NoNodes:
    """A replay has no device nodes to keep in step."""

    def sync(self, device: tuple[int, int], users: Collection[int]) -> list[str]:
        return []


@dataclass
class _Running:
    job: Job
    uid: int
    minors: tuple[int, ...]
    pid: int
    started: float
    ends: float


class Replay:
    """One replay of the configured policy on a pool of `gpus` GPUs (use it once)."""

    def __init__(self, config: Config, gpus: int, scratch: Path):
        self.config = config
        self.store = _ScratchStore(scratch / "state.db")
        inventory = {m: Gpu(m, m, f"GPU-replay-{m}", "replay", f"replay:{m}", 80 << 30, 0, None, None)
                     for m in range(gpus)}
        self.grants = Grants(self.store, None, _NoNodes(), range(gpus), gpus=inventory)
        self.queue = Queue(lambda: config, self.store, self.grants)
        self.queue.listeners.append(self._served)
        self.releases = Releases(self.grants, self.queue, end_holders=lambda *_: None, tell=lambda *_: None)
        self.logout = LogoutRelease(self.store, self.releases, Scans(lambda minors, uids: []), ExitWatch(),  # no /proc
                                    HostProcesses())
        self.timing = timing_of(config)
        self.state = rules.State()
        self.result = Result()
        self.now = 0.0
        self.uids: dict[str, int] = {}
        self.names: dict[int, str] = {}
        self.quotas: dict[str, Quota] = {}
        self.running: dict[int, _Running] = {}    # pid -> job
        self.pending: dict[int, tuple[Job, int]] = {}  # queue row id -> (job, session pid)
        self.session_uid: dict[int, int] = {}     # session pid -> uid
        self._joining: tuple[Job, int] | None = None  # the job whose request is being queued
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._pids = itertools.count(1000)
        self._next_wake: float | None = None
        self._first: float | None = None

    # --- the event loop

    async def run(self, sessions: Iterable[Session]) -> Result:
        upcoming: Iterator[Session] = iter(sessions)
        following = next(upcoming, None)
        while following is not None or self._events:
            # Read the trace only as far as the clock: memory holds the open sessions, not the file.
            while following is not None and (not self._events or following.start <= self._events[0][0]):
                self._open_at(following)
                following = next(upcoming, None)
            when = self._events[0][0]
            self.now = when
            kinds = set()
            while self._events and self._events[0][0] == when:
                _, _, kind, payload = heapq.heappop(self._events)
                kinds.add(kind)
                await getattr(self, f"_on_{kind}")(payload)
            if kinds == {"end"}:
                # Jobs ending change no grant and no demand, and no rule acts the moment a GPU
                # falls idle: only the time at which one may act (idle, reclaim) moves.
                self._wake_for(self._view())
            else:
                self._tick()
        self._finish()
        return self.result

    def _at(self, when: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, payload))

    def _open_at(self, session: Session) -> None:
        if self._first is None:
            self._first = session.start
        self._at(session.start, "login", session)

    # --- events

    async def _on_login(self, session: Session) -> None:
        uid = self._uid(session.user)
        pid = next(self._pids)
        self.store.open_session(uid, session.user, "replay", "", "", pid, self.now)
        self.session_uid[pid] = uid
        for job in session.jobs:
            self.result.demanded += job.gpus * job.duration
            self._user_totals(session.user)[1] += job.gpus * job.duration
            self._at(job.start, "arrive", (job, pid))
        self._at(session.end, "logout", (uid, pid))

    async def _on_arrive(self, payload: tuple[Job, int]) -> None:
        job, session = payload
        uid = self.session_uid[session]
        name = self.names[uid]
        quota = self._quota(name)
        if job.gpus > quota.gpus:
            self.result.never_ran += 1
            self.result.over_quota += 1
            return
        more = job.gpus - len(self._idle_held(uid))
        if more <= 0:
            self._start(job, uid, job.start)
            return
        self._joining = (job, session)
        try:
            queued, waits = self.queue.join(uid, name, more, quota, self.now, Origin.SESSION, pid=session)
        finally:
            self._joining = None
        if waits:
            self.pending[queued.waiter.id] = (job, session)

    async def _on_end(self, pid: int) -> None:
        running = self.running.pop(pid, None)
        if running is None:
            return  # ended earlier by a rule
        self._stop(running, self.now)

    async def _on_logout(self, payload: tuple[int, int]) -> None:
        uid, pid = payload
        self.store.close_session(uid, pid)
        logged_in = {s.uid for s in self.store.sessions()}
        gone = self.queue.gone(logged_in, alive=lambda pid, start: True)
        self.queue.leave(q.waiter.id for q in gone)
        for queued in gone:
            if self.pending.pop(queued.waiter.id, None) is not None:
                self.result.never_ran += 1
        if uid not in logged_in:
            self._removed(await self.logout.release_unused(self._sample(), [uid], now=self.now), self.now)

    async def _on_wake(self, _: object) -> None:
        self._next_wake = None  # the tick after this batch of events runs the rules

    # --- the queue and the jobs

    def _served(self, queued: Queued, minors: tuple[int, ...]) -> None:
        """The queue granted a waiter its GPUs: its job starts now."""
        waiting = self.pending.pop(queued.waiter.id, None) or self._joining  # None: served as it joined
        assert waiting is not None, "the queue served a request the replay did not make"
        self._start(waiting[0], queued.waiter.uid, waiting[0].start)

    def _start(self, job: Job, uid: int, arrived: float) -> None:
        minors = tuple(sorted(self._idle_held(uid)))[:job.gpus]
        pid = next(self._pids)
        self.running[pid] = _Running(job, uid, minors, pid, self.now, self.now + job.duration)
        on = [m for r in self.running.values() for m in r.minors]
        self.result.most_sharers = max(self.result.most_sharers, *(on.count(m) for m in minors))
        self.result.waits.append(self.now - arrived)
        self._at(self.now + job.duration, "end", pid)

    def _stop(self, running: _Running, when: float) -> None:
        self.result.busy += len(running.minors) * (when - running.started)
        # The watcher saw it there up to its last moment: the idle clocks start from here.
        seen = {**self.state.seen, **{(running.uid, m): when for m in running.minors}}
        self.state = replace(self.state, seen=seen)

    def _idle_held(self, uid: int) -> set[int]:
        busy = {m for r in self.running.values() if r.uid == uid for m in r.minors}
        return {g.minor for g in self.store.grants(uid)} - busy

    # --- the watcher's rules

    def _procs(self) -> list[rules.Proc]:
        return [rules.Proc(r.pid, r.uid, r.pid, m, r.job.memory or None)
                for r in self.running.values() for m in r.minors]

    def _sample(self) -> Sample:
        procs = self._procs()
        return Sample(self.now, tuple(GpuProcess(p.pid, p.minor, p.used_memory) for p in procs),
                      {p.pid: ProcessIdentity(p.pid, p.uid, p.start_time) for p in procs},
                      frozenset(self.grants.gpus))

    def _view(self) -> rules.View:
        grants = self.store.grants()
        quotas = {g.uid: self._quota(g.user) for g in grants}
        wanted = self.queue.demand()
        return rules.View(self._procs(), grants, quotas, demand=wanted.short, useful=wanted.useful)

    def _tick(self) -> None:
        view = self._view()
        actions = rules.decide(view, self.state, self.now, self.timing)
        done = [action for action in actions if self._act(action)]
        self.state = rules.advance(view, self.state, done, self.now)
        self._wake_for(self._view() if done else view)

    def _wake_for(self, view: rules.View) -> None:
        wake = rules.next_change(view, self.state, self.timing, self.now)
        if wake is not None:
            interval = self.config.watcher.interval
            wake = math.ceil(wake / interval) * interval  # the daemon's tick comes at its own pace
            if self._next_wake is None or wake < self._next_wake:
                self._next_wake = wake
                self._at(wake, "wake")

    def _act(self, action: rules.Action) -> bool:
        if action.kind == rules.RELEASE and any(
                r.uid == action.uid and action.minor in r.minors for r in self.running.values()):
            # A job of this user started on it since the decision (an earlier action of this tick
            # freed a GPU the queue gave them): the daemon's confirming re-sample would see it busy.
            return False
        if action.kind in (rules.RELEASE, rules.REVOKE):
            removed = self.releases.take_back(action.uid, [action.minor], self.now, kind=action.kind.event,
                                              rule=action.rule, message=messages.action_message(action))
            self._removed(removed, self.now)
            return bool(removed)
        if action.kind in (rules.TERM, rules.KILL) and action.proc is not None:
            running = self.running.pop(action.proc.pid, None)
            if running is None:
                return False
            self._stop(running, self.now)  # a replayed job ends at SIGTERM
            self.result.kills += 1
        return True

    # --- bookkeeping

    def _removed(self, grants: list[Grant], now: float) -> None:
        for grant in grants:
            self.result.granted += now - grant.granted_at
            self._user_totals(grant.user)[0] += now - grant.granted_at

    def _finish(self) -> None:
        for grant in self.store.grants():
            self.result.granted += self.now - grant.granted_at
            self._user_totals(grant.user)[0] += self.now - grant.granted_at
        self.result.never_ran += len(self.pending)
        counts = self.store.event_counts
        self.result.releases = sum(n for (kind, rule), n in counts.items()
                                   if kind == "release" and rule != rules.RECLAIM)
        self.result.reclaims = counts.get(("release", rules.RECLAIM), 0)
        self.result.revokes = counts.get(("revoke", rules.TIME), 0)
        self.result.span = self.now - (self._first or 0.0)
        self.store.close()

    def _quota(self, user: str) -> Quota:
        """The user's quota as the daemon resolves it (every replayed user is in access.group)."""
        if user not in self.quotas:
            self.quotas[user] = policy.quota_for(user, {self.config.access.group}, self.config)
        return self.quotas[user]

    def _uid(self, user: str) -> int:
        if user not in self.uids:
            self.uids[user] = FIRST_UID + len(self.uids)
            self.names[self.uids[user]] = user
        return self.uids[user]

    def _user_totals(self, user: str) -> list[float]:
        return self.result.per_user.setdefault(user, [0.0, 0.0])


MAX_POOL = 100_000  # GPUs in a replayed pool; more is a typo


def static_reservation(sessions: Iterable[Session], gpus: int) -> Result:
    """Each session holds its largest job's GPUs from start to end, first come first served; a
    session that has to wait is shifted by its wait, and its jobs with it."""
    result = Result()
    free = gpus
    holding: list[tuple[float, int]] = []  # (end, GPUs) of the sessions holding GPUs
    last_grant = float("-inf")
    first: float | None = None
    last_end = 0.0
    for session in sessions:
        first = session.start if first is None else first
        need = max((job.gpus for job in session.jobs), default=0)
        demanded = sum(job.gpus * job.duration for job in session.jobs)
        result.demanded += demanded
        totals = result.per_user.setdefault(session.user, [0.0, 0.0])
        totals[1] += demanded
        if need == 0:
            continue
        if need > gpus:
            result.never_ran += len(session.jobs)
            continue
        at = max(session.start, last_grant)  # nobody overtakes an earlier session
        while holding and holding[0][0] <= at:
            free += heapq.heappop(holding)[1]
        while free < need:
            end, count = heapq.heappop(holding)
            free += count
            at = max(at, end)
        delay = at - session.start
        free -= need
        heapq.heappush(holding, (session.end + delay, need))
        last_grant = at
        last_end = max(last_end, session.end + delay)
        result.granted += need * (session.end - session.start)
        totals[0] += need * (session.end - session.start)
        result.busy += demanded
        result.waits.extend([delay] * len(session.jobs))
        result.releases += 1
        result.most_sharers = 1
    result.span = last_end - (first or 0.0)
    return result


def replay(sessions: Iterable[Session], config: Config, gpus: int) -> Result:
    """The configured policy on `gpus` GPUs."""
    with tempfile.TemporaryDirectory(prefix="gpuguard-replay-") as scratch:
        return asyncio.run(Replay(config, gpus, Path(scratch)).run(sessions))


def describe(sessions: Iterable[Session]) -> dict[str, float | int]:
    count = jobs = 0
    first, last = float("inf"), float("-inf")
    for session in sessions:
        count += 1
        jobs += len(session.jobs)
        first, last = min(first, session.start), max(last, session.end)
    return {"sessions": count, "jobs": jobs, "hours": (last - first) / 3600 if count else 0.0}


def compare(open_trace: Callable[[], Iterable[Session]], config: Config, gpus: int) -> dict:
    """The configured policy and static reservation on the same pool, in one run (the trace is
    read once per pass, never held whole)."""
    started = time.perf_counter()
    ours = replay(open_trace(), config, gpus)
    elapsed = time.perf_counter() - started
    static = static_reservation(open_trace(), gpus)
    return {"gpus": gpus, "trace": describe(open_trace()), "seconds": elapsed,
            "policy": ours.summary(gpus), "static": static.summary(gpus)}
