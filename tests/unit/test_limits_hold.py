"""Limits that a user cannot reset by giving GPUs back and asking again: idle_timeout counts from
the last use of any GPU they held within it (policy.idle_since), and a time limit's revoke is
followed by a cool-down of reclaim_after for that kind of GPU (policy.cool_downs). Pure cases,
then the services wired as the daemon wires them (tests/unit/fakes.py)."""
from __future__ import annotations

import asyncio

import pytest
from fakes import GROUP, World

from gpuguard.core import policy
from gpuguard.core.model import Account, EventKind, Origin, Quota, Rule
from gpuguard.services.asks import Ask, Outcome, Waits, Why
from gpuguard.services.queueing import COOLING

IDLE = Quota(idle_timeout=100.0)


def test_a_new_grant_starts_its_idle_clock_at_the_last_use_within_idle_timeout():
    assert policy.idle_since(IDLE, 1000.0, [], None) == 1000.0  # nothing held: a fresh clock
    assert policy.idle_since(IDLE, 1000.0, [950.0], (970.0, 990.0)) == 970.0  # the latest use counts
    # A grant that ended within idle_timeout carries its last use, however old that use is:
    assert policy.idle_since(IDLE, 1000.0, [], (850.0, 990.0)) == 850.0
    # one that ended idle_timeout ago or more carries nothing; a GPU still held always does.
    assert policy.idle_since(IDLE, 1000.0, [], (850.0, 900.0)) == 1000.0
    assert policy.idle_since(IDLE, 1000.0, [700.0], None) == 700.0
    assert policy.idle_since(Quota(), 1000.0, [700.0], (850.0, 990.0)) == 1000.0  # no idle limit: no clock


def test_a_cool_down_lasts_reclaim_after_per_kind():
    quota = Quota(reclaim_after=300.0)
    limited = {"A100": 1000.0, "H100": 600.0}
    assert policy.cool_downs(quota, 1200.0, limited) == {"A100": 1300.0}  # H100's ended at 900
    assert policy.cool_downs(quota, 1300.0, limited) == {}  # the boundary is over
    assert policy.cool_downs(Quota(), 1001.0, limited) == {}  # no reclaim_after: no cool-down


def check(world: World, now: float) -> list:
    return asyncio.run(world.watcher.check(world.sampler.last, now))


def request(world: World, account: Account, now: float, waits: Waits = Waits.NEVER):
    keeps = tuple(g.unit for g in world.store.grants(account.uid))
    return world.services.asks.ask(Ask(account, 1, Origin.REQUEST, waits, "asked in a test", keeps=keeps), now)


def release(world: World, uid: int, now: float, rule: Rule = Rule.USER) -> None:
    """Take the user's grants back as `rule` does (no holders to end: there is no process)."""
    assert world.services.releases.take_back(uid, None, now, kind=EventKind.RELEASE, rule=rule, message="released",
                                             end_openers=False)


@pytest.fixture
def alice(world: World) -> Account:
    return world.lookup.add("alice", 1001, GROUP)


def test_release_and_request_keep_the_idle_clock_of_the_last_use(world: World, alice: Account):
    world.quota(idle_timeout=120.0)
    interval = world.config.watcher.interval  # ticks at the configured pace: a gap restarts idle clocks
    start = 1000.0
    (unit,) = request(world, alice, start).granted
    world.sampler.set([(321, alice.uid, unit, 1 << 30)])
    ticks = [start + interval * i for i in range(1, 150)]
    last_use = start + 20.0  # under ACTIVE_WRITE_EVERY after the grant: the store's last_active stays
    released_at: float | None = None
    asked_again = start + 60.0
    for now in ticks:
        if now > last_use:
            world.sampler.set([])  # the job ended
        if now == asked_again:
            assert world.store.grants(alice.uid)[0].last_active == start  # the watcher's memory is exact
            release(world, alice.uid, now)
            assert len(request(world, alice, now).granted) == 1
            assert world.store.grants(alice.uid)[0].last_active == last_use  # not now
        done = check(world, now)
        if any(a.rule == Rule.IDLE for a in done):
            released_at = now
            break
    assert released_at is not None and world.held(alice.uid) == []
    assert last_use + 120.0 <= released_at < asked_again + 120.0  # idle_timeout after the use, not after the ask


def test_asking_again_and_again_after_the_last_use_gets_no_fresh_clock(world: World, alice: Account):
    world.quota(idle_timeout=120.0)
    (unit,) = request(world, alice, 1000.0).granted
    for now in (1008.0, 1016.0, 1024.0):  # release then request every 8 s
        release(world, alice.uid, now)
        request(world, alice, now)
    assert world.store.grants(alice.uid)[0].last_active == 1000.0
    release(world, alice.uid, 1119.0)
    request(world, alice, 1119.0)  # ended within idle_timeout: still the clock of 1000
    assert world.store.grants(alice.uid)[0].last_active == 1000.0


def test_an_idle_release_is_a_fresh_start(world: World, alice: Account):
    world.quota(idle_timeout=120.0)
    request(world, alice, 1000.0)
    world.sampler.set([])
    release(world, alice.uid, 1120.0, Rule.IDLE)
    assert world.held(alice.uid) == []
    request(world, alice, 1125.0)
    assert world.store.grants(alice.uid)[0].last_active == 1125.0


def test_after_a_time_limit_the_same_kind_waits_out_a_cool_down(world: World, alice: Account):
    world.quota(max_time=60.0, reclaim_after=300.0)
    bob = world.lookup.add("bob", 1002, GROUP)
    (unit,) = request(world, alice, 1000.0).granted
    done = check(world, 1061.0)
    assert [(a.kind, a.rule) for a in done] == [("revoke", "time")] and world.held(alice.uid) == []
    refused = request(world, alice, 1062.0)
    assert refused.outcome == Outcome.REFUSED and refused.why == Why.COOLING_DOWN and refused.until == 1361.0
    assert world.store.queue() == []  # no place left behind
    assert len(request(world, bob, 1063.0).granted) == 1  # the others are served as before
    waiting = request(world, alice, 1064.0, Waits.YES)
    assert waiting.outcome == Outcome.WAITING and waiting.place is not None
    assert [why for _, why in world.queue.reasons(1100.0)] == [COOLING]
    assert world.queue.dispatch(1360.0) == [] and world.held(alice.uid) == []
    [(served, units)] = world.queue.dispatch(1361.0)  # the tick after the cool-down serves her place
    assert served.waiter.uid == alice.uid and len(units) == 1
    assert world.store.grants(alice.uid)[0].expires_at == 1361.0 + 60.0


def test_the_cool_down_survives_a_restart_and_needs_reclaim_after(world: World, alice: Account, tmp_path):
    world.quota(max_time=60.0, reclaim_after=300.0)
    request(world, alice, 1000.0)
    check(world, 1061.0)
    again = World(tmp_path)  # another daemon on the same state database
    try:
        again.lookup.add("alice", 1001, GROUP)
        again.quota(max_time=60.0, reclaim_after=300.0)
        assert request(again, alice, 1100.0).why == Why.COOLING_DOWN
        again.quota(max_time=60.0, reclaim_after=None)
        assert len(request(again, alice, 1101.0).granted) == 1
    finally:
        again.services.close()
