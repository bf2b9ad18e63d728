"""Watcher driven with fakes (tests/unit/fakes.py): no root, no daemon, no GPUs.

Signals go to the fake Processes edge, which records them (the real pidfd edge has its system
tests); these cases cover what the watcher decides and does through its services: warnings told
and stored, expiry and idle release through the release step, quotas resolved through the (fake)
NSS lookup.
"""
from __future__ import annotations

import asyncio

from fakes import GROUP, World

from gpuguard.services.watcher import ACTIVE_WRITE_EVERY


def check(world: World, now: float) -> list:
    return asyncio.run(world.watcher.check(world.sampler.last, now))


def test_over_quota_is_warned_to_the_user_and_stored(world):
    world.quota(gpu_memory=4 << 30)
    alice = world.lookup.add("alice", 1001, GROUP)
    (unit,) = world.login(alice)["gpus"]
    world.sampler.set([(321, 1001, unit, 6 << 30)])
    done = check(world, 1000.0)
    assert [(a.kind, a.rule, a.uid) for a in done] == [("warn", "memory", 1001)]
    assert [user for user, _ in world.notifier.told] == ["alice"]
    assert [e.kind for e in world.store.events(1001)][-1] == "warning"


def test_an_expired_grant_is_revoked_through_the_grant_manager(world):
    world.quota(max_time=60.0)
    alice = world.lookup.add("alice", 1001, GROUP)
    (unit,) = world.login(alice)["gpus"]
    expires = world.store.grants(1001)[0].expires_at
    done = check(world, expires + 1)
    assert [(a.kind, a.rule) for a in done] == [("revoke", "time")]
    assert world.held(1001) == [] and world.nodes.users[unit] == frozenset()
    assert "alice" in {user for user, _ in world.notifier.told}


def test_an_idle_grant_is_released(world):
    world.quota(idle_timeout=60.0)
    alice = world.lookup.add("alice", 1001, GROUP)
    world.login(alice)
    granted_at = world.store.grants(1001)[0].granted_at
    interval = world.config.watcher.interval  # ticks at the configured pace: a gap restarts idle clocks
    ticks = [granted_at + interval * i for i in range(1, int(62 / interval) + 1)]
    done = {now: check(world, now) for now in ticks}
    assert all(done[now] == [] for now in ticks if now - granted_at < 60)
    assert [(a.kind, a.rule) for now in ticks for a in done[now]] == [("release", "idle")]
    assert world.held(1001) == []


def test_a_user_nss_does_not_know_is_judged_on_the_defaults(world):
    world.quota(gpu_memory=1 << 30)
    world.store.add_grants(1005, "gone", [0], 1.0, None, shared=False, origin="admin")
    world.sampler.set([(77, 1005, 0, 2 << 30)])
    done = check(world, 1000.0)
    assert [(a.kind, a.rule, a.uid) for a in done] == [("warn", "memory", 1005)]


def test_the_idle_clock_is_kept_in_the_store_unless_nobody_restarts_from_it(world):
    """A daemon's store keeps last_active within ACTIVE_WRITE_EVERY (a restarted daemon must not
    release a GPU in use); a replay's scratch store (active_write_every None) is never written,
    and the watcher's memory still releases only after the idle time since the process left."""
    world.quota(idle_timeout=120.0)
    alice = world.lookup.add("alice", 1001, GROUP)
    (unit,) = world.login(alice)["gpus"]
    granted_at = world.store.grants(1001)[0].granted_at
    world.sampler.set([(321, 1001, unit, 1 << 30)])
    interval = world.config.watcher.interval
    busy_until = granted_at + 10 * ACTIVE_WRITE_EVERY
    for now in [granted_at + interval * i for i in range(1, int(10 * ACTIVE_WRITE_EVERY / interval) + 1)]:
        check(world, now)
    assert world.store.grants(1001)[0].last_active >= busy_until - ACTIVE_WRITE_EVERY
    world.watcher.active_write_every = None
    written = world.store.grants(1001)[0].last_active
    for now in [busy_until + interval * i for i in range(1, int(2 * ACTIVE_WRITE_EVERY / interval) + 1)]:
        check(world, now)
    assert world.store.grants(1001)[0].last_active == written
    last_busy = busy_until + 2 * ACTIVE_WRITE_EVERY
    world.sampler.set([])  # the process left: idle from the last tick that saw it
    ticks = [last_busy + interval * i for i in range(1, int(130 / interval) + 1)]
    done = {now: check(world, now) for now in ticks}
    assert [now for now in ticks if done[now]] == [min(now for now in ticks if now - last_busy >= 120.0)]
