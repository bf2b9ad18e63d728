"""Grants.pool(): the units that may be handed out, sorted by kind for the allocator, kept from one
choice to the next. After each kind of change (a drain, its end, a MIG layout change) it is what a
fresh sort of open_units() gives."""
from __future__ import annotations

import asyncio
from pathlib import Path

from fakes import World, gpu, mig_slice

from gpuguard.backends.nvml import MigLayout
from gpuguard.core import allocator


def described(pool: allocator.Pool) -> tuple[object, ...]:
    return (pool.units, pool.whole.by_unit, pool.whole.numa, pool.whole.one_node, pool.slices)


def assert_fresh(world: World) -> None:
    assert described(world.grants.pool()) == described(allocator.Pool(world.grants.open_units()))


def test_the_pool_follows_drains_and_layout_changes(tmp_path: Path) -> None:
    world = World(tmp_path, gpus=[gpu(0), gpu(1, mig_mode=True), gpu(2), *(mig_slice(1, gi) for gi in (1, 2))])
    grants = world.grants
    assert_fresh(world)
    assert grants.pool().units == {0, 2, *(u for u in grants.gpus if u > 2)}
    assert set(grants.pool().whole.by_unit) == {0, 2}  # GPU 1 is in MIG mode: only its slices
    assert grants.pool() is grants.pool()  # nothing changed: the same one

    world.drains.drain([2], "maintenance", 10.0)
    assert_fresh(world)
    assert 2 not in grants.pool().units
    world.drains.drain([1], "maintenance", 11.0)  # a drained GPU's slices go too
    assert_fresh(world)
    assert grants.pool().slices == ()
    world.drains.resume([1, 2])
    assert_fresh(world)
    assert 2 in grants.pool().units

    async def follow(seen: MigLayout) -> None:
        world.services.releases.follow_layout(seen, 20.0)
    # GPU 1 leaves MIG mode, GPU 2 enters it with one slice
    asyncio.run(follow(MigLayout([mig_slice(2, 1)], frozenset({2}), frozenset())))
    assert_fresh(world)
    assert set(grants.pool().whole.by_unit) == {0, 1}
    assert [s.slice.parent for s in grants.pool().slices if s.slice] == [2]
