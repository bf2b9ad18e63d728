"""A release is one step (release.Releases.take_back): the grant ends, its holders are ended, its
user is charged, and the queue is served once, after the batch of actions it was part of."""
from __future__ import annotations

import asyncio
import signal
from dataclasses import replace

from fakes import GROUP


def test_a_tick_that_releases_a_gpu_acts_on_another_users_process_there_as_decided_then_serves_the_queue(world):
    """One batch, decided on one view: h0's idle GPU 0 is released, and eve's stray process on it is
    stopped (she held no grant there when it was decided). The queue hands GPU 0 to eve only after
    the batch: a waiter served in its middle would have her process stopped on a GPU she holds."""
    world.config = replace(world.config, watcher=replace(world.config.watcher, interval=5.0, grace=30.0))
    world.quota(idle_timeout=35.0)
    holders = [world.lookup.add(f"h{i}", 2000 + i, GROUP) for i in range(4)]
    for i, account in enumerate(holders):
        assert world.login(account, pid=5000 + i)["gpus"] == [i]
    eve = world.lookup.add("eve", 1005, GROUP)
    assert world.login(eve, pid=6000)["gpus"] == []  # all four held: eve waits
    # h1-h3 keep theirs busy; eve runs on GPU 0 without a grant.
    world.sampler.set([(700, 1005, 0, 1 << 30), *((710 + i, 2000 + i, i, 1 << 30) for i in (1, 2, 3))])
    granted_at = max(g.granted_at for g in world.store.grants())
    done = []
    for tick in range(1, 9):  # at the configured pace: warned at tick 1, grace over at 7, idle at 7
        done += [(a.kind, a.rule, a.uid, a.unit) for a in asyncio.run(world.watcher.check(world.sampler.last,
                                                                                           granted_at + 5.0 * tick))]
        if world.held(1005):
            break
    assert done == [("warn", "stray", 1005, 0), ("release", "idle", 2000, 0), ("term", "stray", 1005, 0)]
    assert world.processes.signals == [(700, signal.SIGTERM)]
    assert world.held(1005) == [0]  # served once the batch was done
    kinds = [e.kind for e in sorted(world.store.events(1005), key=lambda e: e.id)]
    assert kinds == ["warning", "kill", "grant"]  # stopped while not hers, then granted
