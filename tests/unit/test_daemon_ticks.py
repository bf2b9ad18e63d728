"""When the daemon ticks: gpuguard.daemon.main.next_wake (pure), and the watcher's next moment."""
from __future__ import annotations

import asyncio

from fakes import GROUP

from gpuguard.daemon.main import next_wake


def test_the_tick_comes_at_a_waits_end_and_never_in_a_burst():
    """Daemon ticks (loop seconds, interval 0.5): the regular one, or earlier at a wait's end,
    never closer than a quarter interval to the tick before; a wait ending just after the regular
    tick delays that tick to it rather than be judged a quarter interval later."""
    last, regular = 10.0, 10.5
    assert next_wake(last, regular, None, 0.5) == 10.5
    assert next_wake(last, regular, 10.3, 0.5) == 10.3      # a wait ends between two ticks: a tick then
    assert next_wake(last, regular, 10.05, 0.5) == 10.125   # not 50 ms after the last: a quarter interval
    assert next_wake(last, regular, 10.52, 0.5) == 10.52    # just after the regular one: that tick waits for it
    assert next_wake(last, regular, 10.7, 0.5) == 10.5      # later: the regular tick, the next one sees to it
    assert next_wake(last, regular, 9.9, 0.5) == 10.5       # ended before the last tick began: that tick's


def test_a_waits_end_is_counted_from_the_last_check_not_from_the_clock(world):
    """The stray warned at the check of 1000 s is due at 1000 + grace whatever the clock reads
    when the ticker asks (the check may have ended after that moment: it is still due)."""
    world.lookup.add("alice", 1001, GROUP)
    world.sampler.set([(321, 1001, 0, 1 << 30)])
    done = asyncio.run(world.watcher.check(world.sampler.last, 1000.0))
    assert [(a.kind, a.rule) for a in done] == [("warn", "stray")]
    assert world.watcher.next_moment() == 1000.0 + world.config.watcher.grace
    asyncio.run(world.watcher.check(world.sampler.last, 1000.0 + world.config.watcher.grace))  # judged: stopped
    assert world.watcher.next_moment() == 1000.0 + world.config.watcher.grace + world.config.watcher.kill_wait


def test_the_next_moment_includes_an_idle_release_due_between_two_ticks(world):
    """The daemon ticks at the idle clock's end too, not only at a wait's (one moment list for
    both: rules.next_change), so an idle grant goes on time rather than up to an interval late."""
    alice = world.lookup.add("alice", 1001, GROUP)
    world.quota(idle_timeout=300.0)
    world.call("request", uid=alice.uid)
    (grant,) = world.store.grants(alice.uid)
    world.sampler.set([])
    asyncio.run(world.watcher.check(world.sampler.last, grant.granted_at + 10.0))
    assert world.watcher.next_moment() == grant.granted_at + 300.0
