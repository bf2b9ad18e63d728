"""The queue's pure decisions (gpuguard.core.scheduler): order, admission, no starvation, fair-share arithmetic."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from gpuguard.core import scheduler
from gpuguard.core.model import Grant
from gpuguard.core.quantities import format_gpu_hours
from gpuguard.core.scheduler import Waiter

DAY = 86400.0
WEEK = 7 * DAY


def waiter(id: int, uid: int, gpus: int = 1, since: float = 0.0, priority: int = 0, share: float = 1.0) -> Waiter:
    return Waiter(id, uid, f"u{uid}", gpus, since, priority, share)


def test_decay_halves_every_half_life():
    assert scheduler.decay(100.0, WEEK, WEEK) == pytest.approx(50.0)
    assert scheduler.decay(100.0, 2 * WEEK, WEEK) == pytest.approx(25.0)
    assert scheduler.decay(100.0, 0.0, WEEK) == 100.0


def test_a_gpu_held_for_one_half_life_counts_half_life_over_2ln2_at_its_end():
    # integral of 2^-(7d - t)/7d dt over [0, 7d] = 7d / ln 2 * (1 - 1/2) = 436,270.98 GPU-seconds
    counted = scheduler.decayed_seconds(0.0, WEEK, WEEK, WEEK)
    assert counted == pytest.approx(WEEK / (2 * math.log(2)))
    assert counted == pytest.approx(436_270.98, abs=0.01)
    # A second just ended counts almost fully; a whole day, a bit less than a day.
    assert scheduler.decayed_seconds(0.0, 1.0, 1.0, WEEK) == pytest.approx(1.0, rel=1e-5)
    assert DAY * 0.94 < scheduler.decayed_seconds(0.0, DAY, DAY, WEEK) < DAY


def test_recent_usage_is_the_charged_past_decayed_plus_what_is_held_now():
    held = [Grant(1, "a", 0, granted_at=0.0, expires_at=None, last_active=0.0)]
    usage = scheduler.recent_usage((3600.0, 0.0), held, WEEK, WEEK)
    assert usage == pytest.approx(1800.0 + WEEK / (2 * math.log(2)))
    assert scheduler.recent_usage(None, [], 5.0, WEEK) == 0.0


def test_order_is_priority_then_fair_share_then_arrival():
    usage = {1: 10 * 3600.0, 2: 1 * 3600.0, 3: 1 * 3600.0, 4: 50 * 3600.0}
    first_come = waiter(1, 1, since=0)      # much usage
    light = waiter(2, 2, since=10)          # little usage
    light_later = waiter(3, 3, since=20)    # as little, came later
    important = waiter(4, 4, since=30, priority=5)  # most usage, but priority
    ordered = scheduler.order([first_come, light, light_later, important], usage)
    assert [w.id for w in ordered] == [4, 2, 3, 1]
    assert scheduler.why_ahead(important, light, usage) == "higher priority (5 > 0)"
    assert scheduler.why_ahead(light, first_come, usage).startswith("less recent GPU usage (1.0 < 10.0")
    assert scheduler.why_ahead(light, light_later, usage) == "asked earlier"


def test_a_fair_share_reason_shows_the_two_usages_apart_however_small():
    usage = {1: 0.4, 2: 7.0, 3: 3600.0, 4: 3600.4}  # GPU-seconds: 0.00011 and 0.0019 GPU-hours
    assert scheduler.why_ahead(waiter(1, 1), waiter(2, 2), usage) == \
        "less recent GPU usage (0.000 < 0.002 GPU-hours)"
    assert scheduler.why_ahead(waiter(3, 3), waiter(4, 4), usage).startswith("less recent GPU usage (1.0000 < 1.0001")
    assert format_gpu_hours(5400.0) == ("1.5",) and format_gpu_hours(0.0, 0.0) == ("0.0", "0.0")


def test_a_request_older_than_max_wait_boost_goes_ahead_of_younger_ones_whatever_the_usage():
    usage = {1: 500 * 3600.0, 2: 0.0, 3: 0.0}
    heavy = waiter(1, 1, since=0)
    light = waiter(2, 2, since=50)
    older_light = waiter(3, 3, since=-10, priority=0)
    assert [w.id for w in scheduler.order([heavy, light], usage, now=99, max_wait_boost=100)] == [2, 1]
    assert [w.id for w in scheduler.order([heavy, light], usage, now=100, max_wait_boost=100)] == [1, 2]
    assert scheduler.why_ahead(heavy, light, usage, 100, 100) == "waited longer than max_wait_boost (1m40s)"
    # among boosted requests, arrival decides (fair share no longer does)
    assert [w.id for w in scheduler.order([heavy, older_light], usage, now=200, max_wait_boost=100)] == [3, 1]
    # priority stays first
    urgent = waiter(4, 4, since=150, priority=1)
    assert scheduler.order([heavy, urgent], usage, now=200, max_wait_boost=100)[0] is urgent


@pytest.mark.parametrize("seed", range(40))
def test_the_order_merged_from_runs_is_the_order_sorted_by_its_key(seed: int) -> None:
    """order (and dispatch's lazy in_order) merge per-user runs: the same order as sorting every
    waiter by order_key, on random queues of priorities, shares, ties in usage, requests past the
    age bound and arrival times that go back (a clock stepped back between two requests)."""
    rng = random.Random(seed)
    waiters = [waiter(i, rng.randrange(6), since=rng.choice([rng.uniform(0, 1000), 500.0]),
                      priority=rng.choice([0, 0, 0, 1]), share=rng.choice([1.0, 1.0, 2.0]))
               for i in range(rng.randrange(60))]
    rng.shuffle(waiters)
    usage = {uid: rng.choice([0.0, 3600.0, rng.uniform(0, 1e5)]) for uid in range(5)}  # uid 5: none yet
    now, boost = rng.uniform(0, 1500), rng.choice([math.inf, 500.0, 200.0])
    expected = sorted(waiters, key=lambda w: scheduler.order_key(w, usage, now, boost))
    assert scheduler.order(waiters, usage, now, boost) == expected
    lazily = scheduler.in_order(scheduler.runs(waiters).values(), usage, now, boost)
    assert list(itertools.islice(lazily, 5)) == expected[:5]


def test_share_divides_usage():
    usage = {1: 10 * 3600.0, 2: 6 * 3600.0}
    weighted = waiter(1, 1, since=5, share=2.0)  # 10 h / 2 = 5 h < 6 h
    plain = waiter(2, 2, since=0)
    assert [w.id for w in scheduler.order([plain, weighted], usage)] == [1, 2]


def _admit(ordered, free, now, reserve_after):
    """Run admit with a pool of `free` GPUs, granting what it yields."""
    left = [free]

    def fits(w):
        return w.gpus <= left[0]

    served = []
    for w in scheduler.admit(ordered, fits, now, reserve_after):
        left[0] -= w.gpus
        served.append(w.id)
    return served


def test_smaller_requests_backfill_until_the_head_has_waited_reserve_after():
    big = waiter(1, 1, gpus=4, since=0)
    small = waiter(2, 2, gpus=1, since=1)
    assert _admit([big, small], free=2, now=100, reserve_after=300) == [2]
    assert _admit([big, small], free=2, now=300, reserve_after=300) == []  # held for the head now
    assert _admit([big, small], free=5, now=300, reserve_after=300) == [1, 2]


def test_a_request_the_pool_could_never_hold_does_not_hold_the_free_gpus():
    big, small = waiter(1, 1, gpus=4, since=0), waiter(2, 2, gpus=1, since=1)
    served = scheduler.admit([big, small], lambda w: w.gpus <= 2, now=300, reserve_after=300,
                             possible=lambda w: w.gpus <= 3)  # a pool of 3: 4 never come whole
    assert [w.id for w in served] == [2]
    assert [w.id for w in scheduler.admit([big, small], lambda w: w.gpus <= 2, now=300, reserve_after=300)] == []


def test_a_multi_gpu_request_is_not_starved_by_a_stream_of_single_gpu_requests() -> None:
    """2 GPUs; one job of each user runs 60 s; a single-GPU request arrives every 30 s. The 2-GPU
    request gets both within reserve_after plus one job length, although singles never stop."""
    reserve_after, length = 120.0, 60.0
    big = waiter(0, 99, gpus=2, since=0.0)
    running: list[float] = [0.0 + length, 15.0 + length]  # ends of the two jobs holding the GPUs
    waiting = [big]
    next_id = 1
    served_big_at = None
    for step in range(1, 200):
        now = step * 15.0
        if step % 2 == 0:
            waiting.append(waiter(next_id, next_id, gpus=1, since=now))
            next_id += 1
        running = [end for end in running if end > now]
        free = 2 - len(running)
        for wid in _admit(sorted(waiting, key=lambda w: (w.since, w.id)), free, now, reserve_after):
            w = next(w for w in waiting if w.id == wid)
            waiting.remove(w)
            running.extend([now + length] * w.gpus)
            if w is big:
                served_big_at = now
        if served_big_at is not None:
            break
    assert served_big_at is not None and served_big_at <= reserve_after + length
    # ...and without the reservation it would have waited for ever behind the singles.
    assert _admit([big, waiter(7, 7, since=10)], free=1, now=10_000, reserve_after=float("inf")) == [7]


def test_position_and_estimate():
    ws = [waiter(1, 1, gpus=2), waiter(2, 2, gpus=1)]
    assert scheduler.position(ws, 2) == 2 and scheduler.position(ws, 9) is None
    assert scheduler.estimate(2, [500.0, 100.0, 300.0], now=0.0) == 300.0
    assert scheduler.estimate(4, [500.0, 100.0, 300.0], now=0.0) is None
    assert scheduler.estimate(0, [], now=7.0) == 7.0
