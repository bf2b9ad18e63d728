"""What gpuguard's replay is measured against, on the same trace and pool in the same run: a
Slurm-like multifactor priority with backfill, and a clairvoyant shortest-job-first.

Both schedule what static reservation (engine.static_reservation) schedules, so that the three
compare like for like: each session is one allocation of its largest job's GPUs, held from when
it is given to its end (an open session's: its last job's end), as `salloc` holds an interactive
session's and a batch job holds its own; a session that waits is shifted by its wait, and its
jobs with it. Neither shares a GPU, stops a job, or takes an idle GPU back: they differ from
static reservation only in the order in which waiting sessions get GPUs.

- **Slurm-like** (`multifactor`): priority/multifactor with sched/backfill, the weights of a
  typical site (SlurmWeights): fair share weighted ten times age, the age factor full after 14
  days of waiting, usage halved every 14 days, a small job-size term that favours large jobs
  (PriorityFavorSmall=NO). Fair share is Slurm's classic factor 2^(-usage/share), every user
  seen so far with an equal share, usage the GPU-seconds of ended allocations decayed by the half
  life plus those running now. Backfill is EASY backfill with exact run times (Slurm's uses the
  jobs' time limits, which users overstate: this is the kindest Slurm): the first waiting
  session in priority order gets a reservation at the earliest moment enough GPUs will be free;
  later ones start now if they fit and end before it, or fit beside it.
- **Clairvoyant shortest-job-first** (`shortest_first`): whenever GPUs are free, the waiting
  sessions that fit start, shortest first, by their true length, which no real scheduler knows.
  For one GPU per job it gives the least mean wait of any order that does not stop jobs; with
  jobs of several GPUs it is a reference, not a proven bound.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpuguard.replay.engine import Result, fractional
from gpuguard.replay.trace import Session

DAY = 86400.0


@dataclass(frozen=True)
class SlurmWeights:
    age: float = 1000.0
    fairshare: float = 10000.0
    job_size: float = 1000.0
    max_age: float = 14 * DAY
    half_life: float = 14 * DAY


@dataclass
class _Allocation:
    """A session as the baselines schedule it: `gpus` for `length` seconds from when it starts."""

    order: int          # arrival order: the last tie-break, as Slurm's job id
    session: Session
    gpus: int
    length: float


@dataclass
class _Usage:
    """Decayed GPU-seconds per user (Slurm's fair-share usage): ended allocations, decayed, plus
    the running ones' use so far."""

    half_life: float
    ended: dict[str, tuple[float, float]] = field(default_factory=dict)  # user -> (usage, as of)
    running: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # user -> (start, gpus)

    def of(self, user: str, now: float) -> float:
        usage, at = self.ended.get(user, (0.0, now))
        decayed = usage * math.pow(0.5, (now - at) / self.half_life)
        return decayed + sum(gpus * (now - start) for start, gpus in self.running.get(user, ()))

    def start(self, user: str, now: float, gpus: int) -> None:
        self.running.setdefault(user, []).append((now, gpus))

    def end(self, user: str, started: float, gpus: int, now: float) -> None:
        self.running[user].remove((started, gpus))
        usage, at = self.ended.get(user, (0.0, now))
        self.ended[user] = (usage * math.pow(0.5, (now - at) / self.half_life) + gpus * (now - started), now)


Order = Callable[[list[_Allocation], float], list[_Allocation]]


def multifactor(sessions: Iterable[Session], gpus: int, weights: SlurmWeights = SlurmWeights()) -> Result:
    usage = _Usage(weights.half_life)
    users: set[str] = set()

    def by_priority(waiting: list[_Allocation], now: float) -> list[_Allocation]:
        users.update(a.session.user for a in waiting)
        shares = {user: usage.of(user, now) for user in users}
        total = sum(shares.values())
        share = 1.0 / len(users)

        def priority(a: _Allocation) -> tuple[float, int]:
            normalized = shares[a.session.user] / total if total > 0 else 0.0
            factor = (weights.age * min(1.0, (now - a.session.start) / weights.max_age)
                      + weights.fairshare * math.pow(2.0, -normalized / share)
                      + weights.job_size * a.gpus / gpus)
            return (-factor, a.order)
        return sorted(waiting, key=priority)

    return _schedule(sessions, gpus, by_priority, backfill=True, usage=usage)


def shortest_first(sessions: Iterable[Session], gpus: int) -> Result:
    def by_length(waiting: list[_Allocation], now: float) -> list[_Allocation]:
        return sorted(waiting, key=lambda a: (a.length, a.order))
    return _schedule(sessions, gpus, by_length, backfill=False, greedy=True)


def _schedule(sessions: Iterable[Session], gpus: int, order: Order, backfill: bool, greedy: bool = False,
              usage: _Usage | None = None) -> Result:
    """Allocations started in `order` at each arrival and end: the first that does not fit stops
    the rest (backfill: unless they end before its reservation or fit beside it; greedy: never)."""
    result = Result()
    arrivals: list[_Allocation] = []
    for index, session in enumerate(sessions):
        need = max((job.gpus for job in session.jobs), default=0)
        demanded = sum(job.gpus * job.duration for job in session.jobs)
        result.demanded += demanded
        result.per_user.setdefault(session.user, [0.0, 0.0])[1] += demanded
        if need == 0:
            continue
        if need > gpus:  # more than the pool has, as static reservation counts it
            result.never_ran += len(session.jobs)
            result.over_quota += len(session.jobs)
            for job in session.jobs:
                result.count(session.user, 0.0, job.duration, None, not fractional(job))
            continue
        arrivals.append(_Allocation(index, session, need, session.last - session.start))
    arrivals.sort(key=lambda a: (a.session.start, a.order))
    free = gpus
    running: list[tuple[float, int, _Allocation, float]] = []  # (end, order, allocation, started)
    waiting: list[_Allocation] = []
    first = arrivals[0].session.start if arrivals else 0.0
    last_end = first
    next_arrival = 0

    def start(a: _Allocation, now: float) -> None:
        nonlocal free, last_end
        free -= a.gpus
        heapq.heappush(running, (now + a.length, a.order, a, now))
        if usage is not None:
            usage.start(a.session.user, now, a.gpus)
        delay = now - a.session.start
        result.granted += a.gpus * a.length
        result.per_user[a.session.user][0] += a.gpus * a.length
        result.busy += sum(job.gpus * job.duration for job in a.session.jobs)
        for job in a.session.jobs:
            result.count(a.session.user, delay, job.duration, job.duration, not fractional(job))
            result.stretch.append(1.0)
        result.releases += 1
        last_end = max(last_end, now + a.length)

    while next_arrival < len(arrivals) or running:
        now = min(arrivals[next_arrival].session.start if next_arrival < len(arrivals) else math.inf,
                  running[0][0] if running else math.inf)
        while running and running[0][0] <= now:
            end, _, ended, started = heapq.heappop(running)
            free += ended.gpus
            if usage is not None:
                usage.end(ended.session.user, started, ended.gpus, end)
        while next_arrival < len(arrivals) and arrivals[next_arrival].session.start <= now:
            waiting.append(arrivals[next_arrival])
            next_arrival += 1
        if not waiting or free == 0:
            continue
        started_now: set[int] = set()
        shadow, extra = math.inf, 0
        for a in order(waiting, now):
            if math.isinf(shadow):
                if a.gpus <= free:
                    start(a, now)
                    started_now.add(a.order)
                    continue
                if greedy:
                    continue
                if not backfill:
                    break
                shadow, extra = _reservation(running, free, a.gpus)
                continue
            if a.gpus <= free and (now + a.length <= shadow or a.gpus <= extra):
                if now + a.length > shadow:
                    extra -= a.gpus
                start(a, now)
                started_now.add(a.order)
        waiting = [a for a in waiting if a.order not in started_now]
    result.most_sharers = 1 if result.releases else 0
    result.span = last_end - first
    return result


def _reservation(running: list[tuple[float, int, _Allocation, float]], free: int, need: int) -> tuple[float, int]:
    """When `need` GPUs will first be free as the running allocations end, and how many beyond
    `need` are free then (what backfill may still give to a session that outlasts that moment)."""
    for end, _, allocation, _ in sorted(running):
        free += allocation.gpus
        if free >= need:
            return end, free - need
    return math.inf, 0  # unreachable: need <= the pool
