"""Fractions through Asks.ask and the queue, over the daemon's own services (fakes.World): what
a queued fraction waits for, what the placement's mix of asks counts, and what a fraction is
refused for."""
from __future__ import annotations

import time
from dataclasses import replace

from fakes import GROUP, World

from gpuguard.core.model import EventKind, Rule
from gpuguard.services import grants

GIB = 1 << 30


def test_a_queued_fraction_stays_one_fraction_when_a_rule_takes_what_its_user_held(tmp_path):
    world = World(tmp_path)
    world.quota(gpus=2)
    holders = [world.lookup.add(f"ggt-h{i}", 2000 + i, GROUP) for i in range(3)]
    alice = world.lookup.add("ggt-alice", 1005, GROUP)
    assert world.call("request", uid=alice.uid, gpus=1)["granted"] == [0]
    for holder in holders:
        assert world.call("request", uid=holder.uid, gpus=1)["granted"]
    bob = world.lookup.add("ggt-bob", 1006, GROUP)
    assert world.call("request", uid=bob.uid, gpus=1, wait=True)["queued"]  # first in the queue
    assert world.call("request", uid=alice.uid, memory=10 * GIB, wait=True)["queued"]
    # The idle rule takes alice's whole GPU while her fraction waits (bob's turn: he gets it); her
    # fraction still asks for one unit, not for the one taken as well.
    world.services.releases.take_back(alice.uid, [0], time.time(), kind=EventKind.RELEASE, rule=Rule.IDLE,
                                      message="idle", end_openers=False)
    assert world.held(bob.uid) == [0]
    [row] = world.store.queue()
    assert (row.waiter.uid, row.waiter.gpus, row.quota.fraction, row.counted) == (alice.uid, 1, 10 * GIB, ())
    # ... and is served as one when a GPU is free.
    world.call("release", uid=holders[0].uid)
    [grant] = world.store.grants(alice.uid)
    assert (grant.shared, grant.memory) == (True, 10 * GIB)
    assert world.store.queue() == []


def test_the_mix_of_asks_counts_those_granted_or_queued(tmp_path):
    world = World(tmp_path)
    world.quota(gpus=1)
    flood, other = world.lookup.add("ggt-flood", 1001, GROUP), world.lookup.add("ggt-other", 1002, GROUP)
    assert world.call("request", uid=other.uid, memory=30 * GIB)["granted"]
    assert world.call("request", uid=flood.uid, memory=5 * GIB)["granted"]
    for _ in range(3):  # refused (they hold their quota): none of these counts
        assert world.call("request", uid=flood.uid, memory=33 * GIB)["ok"] is False
    world.call("release", uid=flood.uid)
    assert world.call("request", uid=flood.uid, memory=7 * GIB)["granted"]
    assert dict(world.grants.demand_mix()) == {30 * GIB: 1, 5 * GIB: 1, 7 * GIB: 1}


def test_one_users_asks_are_at_most_a_sixteenth_of_the_mix(tmp_path):
    world = World(tmp_path)
    for uid in range(1000, 1100):  # a lab's asks, one each
        world.grants.note_asked(uid, 40 * GIB)
    for _ in range(1000):  # one user's flood of 1 GiB asks
        world.grants.note_asked(7, GIB)
    assert world.grants.demand_mix() == {40 * GIB: 100, GIB: grants.ASKS_PER_USER}


def test_a_quota_without_whole_gpus_takes_no_fractions(tmp_path):
    world = World(tmp_path)
    world.config = replace(world.config, defaults=replace(world.config.defaults, whole_gpus=False))
    alice = world.lookup.add("ggt-alice", 1005, GROUP)
    reply = world.call("request", uid=alice.uid, memory=10 * GIB)
    assert reply["ok"] is False and reply["error"] == (
        "your quota takes no fractions of a GPU (gpuguard whoami shows it; ask your admin)")
