"""The replay's baselines (gpuguard/replay/baselines.py) on sessions small enough to work out by
hand: the order each gives, against static reservation's first come, first served."""
from __future__ import annotations

import pytest

from gpuguard.replay import baselines, engine
from gpuguard.replay.trace import Job, Session


def session(user: str, start: float, length: float, gpus: int = 1) -> Session:
    return Session(user, start, start + length, (Job(start, length, gpus, 0),))


def waits(result: engine.Result) -> dict[str, float]:
    return {user: sum(every) for user, every in result.user_waits.items()}


def test_shortest_first_serves_the_short_sessions_first_where_static_keeps_arrival_order():
    sessions = [session("long", 0, 3), session("short", 0, 1), session("middle", 0, 2)]
    assert waits(baselines.shortest_first(sessions, 1)) == {"short": 0, "middle": 1, "long": 3}
    assert waits(engine.static_reservation(sessions, 1)) == {"long": 0, "short": 3, "middle": 4}
    # the least mean completion time of the three orders, one GPU each
    assert baselines.shortest_first(sessions, 1).summary(1)["jct_mean"] == pytest.approx((1 + 3 + 6) / 3, abs=0.05)


def test_backfill_starts_a_session_that_ends_before_the_first_waiters_reservation():
    # b needs both GPUs, free only at 10 when a ends; c fits now and is done by 7: it goes first.
    sessions = [session("a", 0, 10), session("b", 1, 5, gpus=2), session("c", 2, 5)]
    slurm = waits(baselines.multifactor(sessions, 2))
    assert slurm == {"a": 0, "b": 9, "c": 0}
    assert waits(engine.static_reservation(sessions, 2)) == {"a": 0, "b": 9, "c": 13}


def test_backfill_never_delays_the_reservation():
    # c fits now but would run past 10, where b's reservation needs both GPUs: it waits for b.
    sessions = [session("a", 0, 10), session("b", 1, 5, gpus=2), session("c", 2, 20)]
    assert waits(baselines.multifactor(sessions, 2)) == {"a": 0, "b": 9, "c": 13}


def test_fair_share_puts_a_heavy_users_waiter_behind_a_light_users_later_one():
    sessions = [session("heavy", 0, 100), session("heavy", 10, 10), session("light", 20, 10)]
    assert waits(baselines.multifactor(sessions, 1)) == {"heavy": 0 + 100, "light": 80}
    assert waits(engine.static_reservation(sessions, 1)) == {"heavy": 0 + 90, "light": 90}


def test_a_session_bigger_than_the_pool_is_counted_as_never_run_by_each():
    sessions = [session("a", 0, 10, gpus=3), session("b", 0, 10)]
    for result in (baselines.multifactor(sessions, 2), baselines.shortest_first(sessions, 2),
                   engine.static_reservation(sessions, 2)):
        summary = result.summary(2)
        assert summary["jobs_never_ran"] == summary["jobs_over_quota"] == 1 and summary["jobs_ran"] == 1
