"""The queue for GPUs, pure: who goes first, who is served now, and the fair-share arithmetic. No I/O.

When no GPU is free, a request waits. The waiters are served in this order:

1. priority (the quota key `priority`), higher first;
2. age: a request that has waited `[scheduler] max_wait_boost` goes ahead of every request of its
   priority that has not, however heavy its user; such requests are served among themselves in
   order of arrival;
3. fair share: the user's recent usage divided by their `share`, less first. Recent usage is the
   GPU-seconds they were granted, each second counting less the longer ago it was: its weight
   halves every `[scheduler] half_life` (a second granted one half-life ago counts 1/2, two ago 1/4);
4. arrival: who asked first.

So priority, fair share and age combine as in Slurm's multifactor plugin, except that age here
is a bound rather than a weight: fair share orders the requests younger than max_wait_boost,
and none waits behind younger ones past it.

A request is served whole or not at all (a job asking for 4 GPUs cannot start on 3). Walking the
order, every waiter whose GPUs are free gets them. A waiter whose GPUs are not free does not stop
the walk at first: later, smaller requests may use what it cannot fill yet (backfill). Once it
has waited `[scheduler] reserve_after`, it does stop the walk: the free GPUs are held for it and
nobody behind it is served before it. So a request waits at most max_wait_boost (then it is
ahead of all younger requests of its priority, and past reserve_after it holds the free GPUs),
plus the waits of the older boosted requests ahead of it, plus the time until enough grants end
(release, idle release, reclaim, expiry), however heavy its user and however many light users'
requests keep arriving. Priority is the one exception, by design: a higher-priority request that
arrives meanwhile goes ahead of it.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

from gpuguard.core.model import Grant
from gpuguard.core.quantities import format_duration, format_gpu_hours


@dataclass(frozen=True)
class Waiter:
    id: int             # the queue's own number, increasing with arrival: the last tie-break
    uid: int
    user: str
    gpus: int           # GPUs wanted on top of those already held, all at once
    since: float        # when it joined the queue
    priority: int = 0
    share: float = 1.0


# --- fair share: decayed GPU-seconds

def decay(value: float, elapsed: float, half_life: float) -> float:
    """`value` GPU-seconds counted `elapsed` seconds later."""
    return value * math.pow(0.5, max(0.0, elapsed) / half_life)


def decayed_seconds(start: float, end: float, now: float, half_life: float) -> float:
    """One GPU held from start to end, as counted at `now`: the integral of 2^-((now - t) / half_life)
    over [start, end], i.e. half_life / ln 2 * (2^-((now - end) / half_life) - 2^-((now - start) / half_life))."""
    if end <= start:
        return 0.0
    scale = half_life / math.log(2)
    return scale * (math.pow(0.5, (now - end) / half_life) - math.pow(0.5, (now - start) / half_life))


def recent_usage(stored: tuple[float, float] | None, held: Iterable[Grant], now: float, half_life: float) -> float:
    """A user's recent usage at `now`: what was charged for ended grants (value, as counted at `at`),
    decayed since, plus the grants still held, each from when it was granted until now."""
    past = decay(stored[0], now - stored[1], half_life) if stored else 0.0
    return past + sum(decayed_seconds(g.granted_at, now, now, half_life) for g in held)


# --- the order

def boosted(waiter: Waiter, now: float, max_wait_boost: float) -> bool:
    """Whether the request has waited long enough to go ahead of younger ones whatever their usage."""
    return now - waiter.since >= max_wait_boost


def order_key(waiter: Waiter, usage: Mapping[int, float], now: float = 0.0,
              max_wait_boost: float = math.inf) -> tuple[int, bool, float, float, int]:
    old = boosted(waiter, now, max_wait_boost)
    return (-waiter.priority, not old, 0.0 if old else usage.get(waiter.uid, 0.0) / waiter.share, waiter.since,
            waiter.id)


def order(waiters: Iterable[Waiter], usage: Mapping[int, float], now: float = 0.0,
          max_wait_boost: float = math.inf) -> list[Waiter]:
    """The waiters in the order they are served (usage: uid -> recent usage; max_wait_boost: the age bound):
    sorted by order_key."""
    return list(in_order(runs(waiters).values(), usage, now, max_wait_boost))


RunKey = tuple[int, int, float]  # (uid, priority, share): which run of the order a waiter is in
arrival = attrgetter("since", "id")  # the order of arrival, the last of the order's keys


def run_of(waiter: Waiter) -> RunKey:
    """Which run a waiter is in (runs): its user's, at its priority and share."""
    return waiter.uid, waiter.priority, waiter.share


def runs(waiters: Iterable[Waiter]) -> dict[RunKey, list[Waiter]]:
    """The waiters in runs that the order never reorders (run_of: one per user, priority and share),
    each by arrival: what in_order merges. The queue keeps them from one change to the next."""
    grouped: dict[RunKey, list[Waiter]] = {}
    for waiter in waiters:
        grouped.setdefault(run_of(waiter), []).append(waiter)
    for run in grouped.values():
        run.sort(key=arrival)  # already in order as the queue keeps its rows: one pass
    return grouped


def in_order(each_run: Iterable[Sequence[Waiter]], usage: Mapping[int, float], now: float = 0.0,
             max_wait_boost: float = math.inf) -> Iterator[Waiter]:
    """The waiters of the runs (runs().values()) in order_key's order, one at a time: dispatch's
    walk mostly stops after a few, so it pays for those (a log of the number of runs each), not
    for sorting a long queue. Within a run order_key already rises with arrival (the requests past
    max_wait_boost, the oldest, first; then the others, of one usage), so the order is a merge of
    the runs."""
    def key(waiter: Waiter) -> tuple[int, bool, float, float, int]:
        return order_key(waiter, usage, now, max_wait_boost)
    listed = list(each_run)
    return iter(listed[0]) if len(listed) == 1 else heapq.merge(*listed, key=key)  # one run: its own order


def why_ahead(first: Waiter, second: Waiter, usage: Mapping[int, float], now: float = 0.0,
              max_wait_boost: float = math.inf) -> str:
    """Why `first` is served before `second`, in words for `gpuguard whoami`."""
    if first.priority != second.priority:
        return f"higher priority ({first.priority} > {second.priority})"
    if boosted(first, now, max_wait_boost) and not boosted(second, now, max_wait_boost):
        return f"waited longer than max_wait_boost ({format_duration(max_wait_boost)})"
    if boosted(first, now, max_wait_boost):
        return "asked earlier (both waited longer than max_wait_boost)"
    mine, theirs = (usage.get(w.uid, 0.0) / w.share for w in (first, second))
    if mine != theirs:
        shown_mine, shown_theirs = format_gpu_hours(mine, theirs)
        return (f"less recent GPU usage ({shown_mine} < {shown_theirs} GPU-hours"
                f"{', after share weights' if first.share != 1 or second.share != 1 else ''})")
    return "asked earlier"


# --- who is served now

def admit(ordered: Iterable[Waiter], fits: Callable[[Waiter], bool], now: float,
          reserve_after: float, possible: Callable[[Waiter], bool] = lambda waiter: True) -> Iterator[Waiter]:
    """The waiters to serve now, in order. `fits(waiter)` says whether its GPUs are free now; the
    caller grants each yielded waiter before asking for the next, so `fits` sees those grants.
    A waiter that does not fit and has waited `reserve_after` stops the walk: what is free is
    held for it. Unless it could not fit even were every other grant given back (`possible`:
    more GPUs than the pool has for it, since a drain say): holding GPUs for it would stop the
    queue for good."""
    for waiter in ordered:
        if fits(waiter):
            yield waiter
        elif now - waiter.since >= reserve_after and possible(waiter):
            return


def position(ordered: Sequence[Waiter], uid: int) -> int | None:
    """1-based place of uid's first request in the order, None when it does not wait."""
    return next((i for i, w in enumerate(ordered, start=1) if w.uid == uid), None)


def estimate(need: int, expiries: Iterable[float], now: float) -> float | None:
    """When `need` more GPUs should be free, if grants ending at `expiries` are all that frees them:
    the need-th earliest expiry; None when nothing is needed or too few grants have an end."""
    if need <= 0:
        return now
    ends = sorted(expiries)
    return max(now, ends[need - 1]) if len(ends) >= need else None
