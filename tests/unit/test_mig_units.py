"""MIG slices as units: numbering, the allocator's choice, layout changes, grants on slices
(their nodes and ACLs), the quota keys, and the watcher's rules on a slice."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import CAPS_MAJOR, GROUP, FakeGate, World, gpu, mig_slice

from gpuguard import config, quota_file
from gpuguard.backends.nvml import MigLayout
from gpuguard.config import QuotaOverrides
from gpuguard.core import allocator, layout
from gpuguard.core.model import (
    NVIDIA_MAJOR,
    SLICE_UNITS,
    EventKind,
    Gpu,
    Grant,
    Origin,
    Quota,
    Rule,
    parse_unit,
    slice_place,
    slice_unit,
    unit_label,
    unit_parent,
)
from gpuguard.core.rules import Demand
from gpuguard.services.store import Store

H100 = 1 << 30


def seen_layout(slices: list[Gpu], mig_gpus: frozenset[int], unread: frozenset[int] = frozenset()) -> MigLayout:
    """What NvmlBackend.layout() reports, nothing unread unless said."""
    return MigLayout(slices, mig_gpus, unread)


def caps(piece: Gpu) -> tuple[int, int]:
    """A slice's capability minors (a whole GPU has none: asking is a test's mistake)."""
    assert piece.slice is not None, f"{piece.uuid} is not a MIG slice"
    return piece.slice.caps


# --- numbering

def test_slice_units_round_trip_and_never_collide_with_minors() -> None:
    units = {slice_unit(p, g, c) for p in (0, 7, 255) for g in range(16) for c in range(8)}
    assert len(units) == 3 * 16 * 8 and min(units) >= SLICE_UNITS > 255
    assert slice_place(slice_unit(7, 13, 2)) == (7, 13, 2) and unit_parent(slice_unit(7, 13, 2)) == 7
    assert unit_label(slice_unit(3, 1, 0)) == "3/gi1/ci0" and unit_label(3) == "3"
    assert parse_unit("3/gi1/ci0") == slice_unit(3, 1, 0) and parse_unit(" 5 ") == 5


@pytest.mark.parametrize("text", ["", "x", "3/gi1", "3/g1/ci0", "3/gi16/ci0", "3/gi1/ci8", "-1", "3/gi1/ci0/x"])
def test_bad_unit_text_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        parse_unit(text)


# --- the allocator

def _grant(uid: int, unit: int, shared: bool = False) -> Grant:
    return Grant(uid, f"u{uid}", unit, 0.0, None, 0.0, shared=shared)


MIXED = [gpu(0), gpu(1, mig_mode=True), mig_slice(1, 1, "3g.40gb"), mig_slice(1, 2, "1g.10gb"),
         mig_slice(1, 3, "2g.20gb")]


def _choose(gpus: list[Gpu], grants: Iterable[Grant] = (), count: int = 1, quota: Quota | None = None,
            share: bool = False, held_last: dict[int, float] | None = None) -> tuple[int, ...]:
    return allocator.choose(gpus, {}, grants, {}, 1001, count, share, held_last, quota)


def test_whole_gpus_first_then_the_smallest_slice() -> None:
    assert _choose(MIXED) == (0,)  # the GPU in MIG mode is never handed out whole
    assert _choose(MIXED, [_grant(2000, 0)]) == (slice_unit(1, 2, 0),)  # 1g.10gb: the smallest
    assert _choose(MIXED, count=3) == (0, slice_unit(1, 2, 0), slice_unit(1, 3, 0))


def test_the_quota_decides_which_units() -> None:
    slices_only = Quota(whole_gpus=False)
    assert _choose(MIXED, quota=slices_only) == (slice_unit(1, 2, 0),)
    preferred = Quota(whole_gpus=False, slice_profiles=("3g.40gb", "1g.10gb"))
    assert _choose(MIXED, quota=preferred) == (slice_unit(1, 1, 0),)
    assert _choose(MIXED, [_grant(2000, slice_unit(1, 1, 0))], quota=preferred) == (slice_unit(1, 2, 0),)
    only_big = Quota(whole_gpus=False, slice_profiles=("3g.40gb",))
    assert _choose(MIXED, [_grant(2000, slice_unit(1, 1, 0))], quota=only_big) == ()  # 2g.20gb is not allowed
    # slices: at most this many of the user's units, counting the ones held
    assert _choose(MIXED, count=3, quota=Quota(gpus=3, slices=1)) == (0, slice_unit(1, 2, 0))
    assert _choose(MIXED, [_grant(1001, slice_unit(1, 3, 0))], count=2, quota=Quota(gpus=3, slices=1)) == (0,)
    assert _choose(MIXED, quota=Quota(slices=0), grants=[_grant(2000, 0)]) == ()


def test_a_slice_is_never_shared_and_a_returning_user_gets_theirs_back() -> None:
    two = [gpu(0, mig_mode=True), mig_slice(0, 1), mig_slice(0, 2)]
    held = [_grant(2000, slice_unit(0, 1, 0), shared=True), _grant(2001, slice_unit(0, 2, 0), shared=True)]
    assert _choose(two, held, share=True) == ()
    sharer = Quota(sharing=True, gpu_memory=1 << 30, max_sharers=8)  # a promise that would fit: still no
    assert allocator.blocking(held, 1001, {slice_unit(0, 1, 0)}, True, {g.unit: g for g in two}, sharer) == held[:1]
    assert _choose(two, held_last={slice_unit(0, 2, 0): 50.0}) == (slice_unit(0, 2, 0),)


# --- layout changes

def test_stale_grants_follow_the_layout() -> None:
    kept, gone, recreated = mig_slice(1, 1), mig_slice(1, 2), mig_slice(1, 3, uuid="MIG-new")
    grants = [Grant(1, "a", kept.unit, 0, None, 0, uuid=kept.uuid),
              Grant(2, "b", gone.unit, 0, None, 0, uuid=gone.uuid),
              Grant(3, "c", recreated.unit, 0, None, 0, uuid="MIG-old"),
              Grant(4, "d", 0, 0, None, 0, uuid="GPU-0000"),          # GPU 0 went into MIG mode
              Grant(5, "e", 2, 0, None, 0, uuid="GPU-0002"),          # GPU 2 could not be read
              Grant(6, "f", mig_slice(3, 1).unit, 0, None, 0),       # a slice grant with no UUID on record
              Grant(7, "g", 4, 0, None, 0)]                           # a whole GPU's from before UUIDs were kept
    units = layout.grantable([gpu(0, mig_mode=True), gpu(1, mig_mode=True), gpu(2), gpu(3, mig_mode=True), gpu(4)],
                             [kept, recreated, mig_slice(3, 1)])
    ended = layout.stale(grants, units, read={0, 1, 3, 4})
    assert {g.uid: why for g, why in ended.items()} == {
        2: "MIG slice 1/gi2/ci0 is gone (the MIG layout changed)",
        3: "MIG slice 1/gi3/ci0 was re-created as another slice (the MIG layout changed)",
        4: "GPU 0 is in MIG mode now: it is handed out as slices only",
        6: "MIG slice 3/gi1/ci0 was re-created as another slice (the MIG layout changed)"}


# --- grants on slices, through the services wiring.build wires

def _update(world: World, seen: MigLayout, now: float) -> dict[Grant, str]:
    """Releases.follow_layout on the event loop, as the daemon's tick calls it (the holders of a
    revoked slice are ended in the background)."""
    async def update() -> dict[Grant, str]:
        return world.services.releases.follow_layout(seen, now)
    return asyncio.run(update())


@pytest.fixture
def mig_world(tmp_path: Path) -> World:
    """GPU 0 whole, GPU 1 in MIG mode cut into three 1g.10gb slices; the defaults are 1 unit."""
    world = World(tmp_path, gpus=[gpu(0), gpu(1, mig_mode=True), *(mig_slice(1, gi) for gi in (1, 2, 3))])
    world.lookup.add("alice", 1001, GROUP)
    world.lookup.add("bob", 1002, GROUP)
    world.quota(whole_gpus=False)
    return world


def test_two_users_on_two_slices_of_one_gpu(mig_world: World) -> None:
    alice, bob = mig_world.lookup.accounts["alice"], mig_world.lookup.accounts["bob"]
    first, second = mig_world.login(alice), mig_world.login(bob, pid=4343)
    a, b = mig_slice(1, 1), mig_slice(1, 2)
    assert first["gpus"] == [a.unit] and first["cuda_visible_devices"] == a.uuid
    assert second["gpus"] == [b.unit] and second["cuda_visible_devices"] == b.uuid
    assert "GPU 1/gi1/ci0 (Fake H100 MIG 1g.10gb) is yours" in first["message"]
    nodes = mig_world.nodes.devices
    assert nodes[(NVIDIA_MAJOR, 1)] == {1001, 1002}  # the parent: both
    assert nodes[(CAPS_MAJOR, caps(a)[0])] == nodes[(CAPS_MAJOR, caps(a)[1])] == {1001}
    assert nodes[(CAPS_MAJOR, caps(b)[0])] == {1002}
    assert mig_world.grants.opener_devices(a.unit) == [(CAPS_MAJOR, cap) for cap in caps(a)]
    # bob gives his back: the parent stays open to alice only, his caps to nobody
    mig_world.call("release", uid=1002)
    assert nodes[(NVIDIA_MAJOR, 1)] == {1001} and nodes[(CAPS_MAJOR, caps(b)[1])] == frozenset()
    whoami = mig_world.call("whoami", uid=1001)
    assert [(g["minor"], g["uuid"]) for g in whoami["grants"]] == [(a.unit, a.uuid)]


def test_a_slice_reaches_another_users_slice_only_through_a_shared_gpu_instance(tmp_path: Path) -> None:
    """Grants.reaches: whether a process of a user found on another's slice may be on its own
    (openers.OpenerEnder ends it otherwise): two compute instances of one GPU instance share its
    capability node; the parent GPU's node, which every slice holder opens, counts for none."""
    shared = [mig_slice(1, 1, ci=0), mig_slice(1, 1, ci=1)]
    world = World(tmp_path, gpus=[gpu(0), gpu(1, mig_mode=True), *shared, mig_slice(1, 2)])
    for uid, name in ((1001, "alice"), (1002, "bob"), (1003, "carol")):
        world.lookup.add(name, uid, GROUP)
    world.quota(whole_gpus=False)
    grant = {uid: world.call("grant", user=name, units=[unit])["gpus"]
             for uid, name, unit in ((1001, "alice", shared[0].unit), (1002, "bob", shared[1].unit),
                                     (1003, "carol", mig_slice(1, 2).unit))}
    assert grant == {1001: [shared[0].unit], 1002: [shared[1].unit], 1003: [mig_slice(1, 2).unit]}
    assert world.grants.reaches(1002, [shared[0].unit, 0]) == {shared[0].unit}  # the same GI
    assert world.grants.reaches(1003, [shared[0].unit]) == frozenset()  # another GI: only the parent in common
    assert world.grants.reaches(1004, [shared[0].unit, 0]) == frozenset()  # no grant at all


def test_a_layout_change_revokes_the_changed_slices_and_keeps_the_others(mig_world: World) -> None:
    alice, bob = mig_world.lookup.accounts["alice"], mig_world.lookup.accounts["bob"]
    mig_world.login(alice)
    mig_world.login(bob, pid=4343)
    a, b = mig_slice(1, 1), mig_slice(1, 2)
    # the admin re-creates GI 2 (same ids, new UUID) and destroys GI 3
    ended = _update(mig_world, seen_layout([a, mig_slice(1, 2, uuid="MIG-again")], frozenset({1})), 100.0)
    assert [(g.user, g.unit) for g in ended] == [("bob", b.unit)]
    assert mig_world.held(1001) == [a.unit] and mig_world.held(1002) == []
    assert mig_world.nodes.devices[(CAPS_MAJOR, caps(b)[1])] == frozenset()
    event = mig_world.store.events(1002)[-1]
    assert (event.kind, event.rule, event.unit) == ("revoke", "layout", b.unit)
    assert "re-created" in event.message
    assert set(mig_world.grants.gpus) == {0, a.unit, b.unit}  # the new slice can be handed out
    # the same layout again changes nothing; an unread GPU decides nothing
    assert _update(mig_world, seen_layout([a, mig_slice(1, 2, uuid="MIG-again")], frozenset({1})), 101.0) == {}
    assert _update(mig_world, seen_layout([], frozenset(), frozenset({0, 1})), 102.0) == {}
    assert mig_world.held(1001) == [a.unit]


def test_memory_quota_does_not_apply_inside_a_slice(mig_world: World) -> None:
    mig_world.quota(gpu_memory=1 << 30)
    alice = mig_world.lookup.accounts["alice"]
    unit = mig_world.login(alice)["gpus"][0]
    mig_world.sampler.set([(500, 1001, unit, 9 << 30)], units={0, unit})
    assert _check(mig_world) == []


def _check(world: World) -> list:
    return asyncio.run(world.watcher.check(world.sampler.last, 1000.0))


def test_memory_quota_still_applies_on_a_whole_gpu(tmp_path: Path) -> None:
    world = World(tmp_path)  # the control: the same over-quota process on a whole GPU is warned
    world.lookup.add("alice", 1001, GROUP)
    world.quota(gpu_memory=1 << 30)
    unit = world.login(world.lookup.accounts["alice"])["gpus"][0]
    world.sampler.set([(500, 1001, unit, 9 << 30)])
    assert [(a.kind, a.rule) for a in _check(world)] == [("warn", "memory")]


# --- quotas and the store

def test_mig_quota_keys_parse_and_show_as_quota_set_takes_them() -> None:
    keys = config.QUOTA_KEYS
    assert keys["slices"]("any") is None and keys["slices"](2) == 2
    assert keys["slice_profiles"](["1g.18gb", "1g.10gb+me"]) == ("1g.18gb", "1g.10gb+me")
    with pytest.raises(ValueError, match="expected MIG profiles such as 1g.18gb, got '18gb'"):
        keys["slice_profiles"](["18gb"])
    for key, text in (("slices", "any"), ("slices", "1"), ("whole_gpus", "false"),
                      ("slice_profiles", '["1g.18gb", "2g.35gb"]')):
        parsed = keys[key](quota_file.parse_assignment(f"{key}={text}")[1])
        assert quota_file.show_value(key, parsed) == text


def test_the_store_keeps_uuids_and_a_waiters_profiles(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.add_grants(1001, "alice", [slice_unit(1, 1, 0), 0], 1.0, None, uuids={slice_unit(1, 1, 0): "MIG-x"})
    assert {g.unit: g.uuid for g in store.grants()} == {0: "", slice_unit(1, 1, 0): "MIG-x"}
    quota = Quota(whole_gpus=False, slices=1, slice_profiles=("1g.18gb",))
    store.join_queue(1001, "alice", 1, 2.0, quota, Origin.SESSION, None, None)
    assert store.queue()[0].quota == quota


# --- the gate's entries, restarts, the queue and failures during a layout change

def test_gate_entries_are_the_union_of_a_users_grants(tmp_path: Path) -> None:
    a, b = mig_slice(1, 1), mig_slice(1, 2)
    gate = FakeGate()
    world = World(tmp_path, gpus=[gpu(0), gpu(1, mig_mode=True), a, b], gate=gate)
    world.grants.add(1001, "alice", [a.unit], 0.0, expires_at=None, shared=False, origin=Origin.ADMIN, message="")
    world.grants.add(1001, "alice", [b.unit], 0.0, expires_at=None, shared=False, origin=Origin.ADMIN, message="")
    both = {(1001, (CAPS_MAJOR, cap)) for piece in (a, b) for cap in caps(piece)}
    assert gate.entries() == {(1001, (NVIDIA_MAJOR, 1))} | both
    _remove(world, 1001, [a.unit])  # the other slice still needs the parent's node
    assert gate.entries() == {(1001, (NVIDIA_MAJOR, 1))} | {(1001, (CAPS_MAJOR, cap)) for cap in caps(b)}
    _remove(world, 1001, None)
    assert gate.entries() == set()


def _remove(world: World, uid: int, units: list[int] | None) -> None:
    world.grants.remove(uid, units, 1.0, kind=EventKind.RELEASE, rule=Rule.USER, message="")


def _restarted(world: World, tmp_path: Path, gpus: list[Gpu]) -> World:
    """The same store (the same database file) under a daemon started again on `gpus` (the layout of
    now), once the first has stopped (the daemon is its store's one writer)."""
    world.services.close()
    return World(tmp_path, gpus=gpus, gate=FakeGate())


def test_grants_on_slices_changed_while_no_daemon_ran_end_at_the_first_look(tmp_path: Path) -> None:
    before = [gpu(0), gpu(1, mig_mode=True), mig_slice(1, 1), mig_slice(1, 2)]
    world = World(tmp_path, gpus=before)
    for uid, unit in ((1001, mig_slice(1, 1).unit), (1002, mig_slice(1, 2).unit)):
        world.grants.add(uid, f"u{uid}", [unit], 0.0, expires_at=None, shared=False, origin=Origin.ADMIN, message="")
    # while no daemon ran: GI 1 re-created as another slice, GI 2 destroyed
    now = [gpu(0), gpu(1, mig_mode=True), mig_slice(1, 1, "3g.40gb", uuid="MIG-new")]
    again = _restarted(world, tmp_path, now)
    ended = _update(again, seen_layout(now[2:], frozenset({1})), 50.0)  # the same layout the daemon started with
    assert sorted(g.uid for g in ended) == [1001, 1002] and again.store.grants() == []


def test_a_gpu_that_left_mig_mode_while_no_daemon_ran_is_not_handed_out_over_its_old_slice(tmp_path: Path) -> None:
    world = World(tmp_path, gpus=[gpu(0), gpu(1, mig_mode=True), mig_slice(1, 2)])
    world.grants.add(1001, "alice", [mig_slice(1, 2).unit], 0.0, expires_at=None, shared=False,
                     origin=Origin.ADMIN, message="")
    again = _restarted(world, tmp_path, [gpu(0), gpu(1)])
    # before the first look the allocator keeps GPU 1 (its node is still alice's) off anyone else
    assert again.grants.choose(1002, 2, Quota(gpus=2)) == (0,)
    assert [g.user for g in _update(again, seen_layout([], frozenset()), 50.0)] == ["alice"]
    assert again.grants.choose(1002, 2, Quota(gpus=2)) == (0, 1)


def test_what_a_layout_change_frees_goes_to_the_queue_from_the_new_layout(tmp_path: Path) -> None:
    world = World(tmp_path, gpus=[gpu(0), gpu(1, mig_mode=True), mig_slice(1, 1)])
    for name, uid in (("alice", 1001), ("bob", 1002), ("carol", 1003)):
        world.lookup.add(name, uid, GROUP)
    assert world.login(world.lookup.accounts["alice"])["gpus"] == [0]
    assert world.login(world.lookup.accounts["bob"], pid=4343)["gpus"] == [mig_slice(1, 1).unit]
    assert world.login(world.lookup.accounts["carol"], pid=4444)["queue"]["position"] == 1
    # GPU 0 goes into MIG mode with one slice, and GPU 1's slice is destroyed
    ended = _update(world, seen_layout([mig_slice(0, 2)], frozenset({0, 1})), 100.0)
    assert sorted(g.user for g in ended) == ["alice", "bob"]
    assert world.held(1003) == [mig_slice(0, 2).unit]  # not GPU 0 whole, which is in MIG mode now


def test_a_revoke_that_fails_is_logged_and_the_others_go_on(tmp_path: Path) -> None:
    gate = FakeGate()
    world = World(tmp_path, gpus=[gpu(0, mig_mode=True), mig_slice(0, 1), mig_slice(0, 2)], gate=gate)
    for uid, gi in ((1001, 1), (1002, 2)):
        world.grants.add(uid, f"u{uid}", [mig_slice(0, gi).unit], 0.0, expires_at=None, shared=False,
                         origin=Origin.ADMIN, message="")
    gate.failing.add(1001)
    ended = _update(world, seen_layout([], frozenset({0})), 10.0)
    assert [g.uid for g in ended] == [1002] and world.held(1001) == [mig_slice(0, 1).unit]
    gate.failing.clear()  # the next sample tries again
    assert [g.uid for g in _update(world, seen_layout([], frozenset({0})), 11.0)] == [1001]


def test_caps_learned_after_start_open_the_gate_for_the_grants_on_them(tmp_path: Path) -> None:
    piece = mig_slice(0, 1)
    gate = FakeGate()
    world = World(tmp_path, gpus=[gpu(0, mig_mode=True)], gate=gate)  # its slices could not be read at start
    world.store.add_grants(1001, "alice", [piece.unit], 0.0, None, uuids={piece.unit: piece.uuid})
    world.grants.reconcile()
    assert gate.entries() == {(1001, (NVIDIA_MAJOR, 0))}
    assert _update(world, seen_layout([piece], frozenset({0})), 5.0) == {}
    assert gate.entries() == {(1001, (NVIDIA_MAJOR, 0))} | {(1001, (CAPS_MAJOR, cap)) for cap in caps(piece)}


def test_reclaim_on_demand_frees_only_units_the_waiter_can_have(tmp_path: Path) -> None:
    world = World(tmp_path, gpus=[gpu(0), gpu(1, mig_mode=True), mig_slice(1, 1)])
    world.quota(reclaim_after=60.0)
    world.config = replace(world.config, quotas=QuotaOverrides(users={"carol": {"whole_gpus": False}}))
    for name, uid in (("alice", 1001), ("bob", 1002), ("carol", 1003)):
        world.lookup.add(name, uid, GROUP)
    piece = mig_slice(1, 1).unit
    assert world.login(world.lookup.accounts["alice"])["gpus"] == [0]
    assert world.login(world.lookup.accounts["bob"], pid=4343)["gpus"] == [piece]
    assert world.login(world.lookup.accounts["carol"], pid=4444)["queue"]["position"] == 1
    assert world.queue.demand() == Demand(1, frozenset({piece}))  # GPU 0 whole is of no use to carol
    world.sampler.set([], units={0, piece})  # both grants idle for an hour
    actions = asyncio.run(world.watcher.check(world.sampler.last, time.time() + 3600))
    assert [(a.kind, a.rule, a.uid) for a in actions] == [("release", "reclaim", 1002)]
    assert world.held(1001) == [0] and world.held(1003) == [piece]
