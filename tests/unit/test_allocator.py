"""The allocator on its own: pure choices over an inventory, a topology and the current grants."""
from __future__ import annotations

import random
from itertools import combinations
from math import comb

import pytest

from gpuguard.core import allocator
from gpuguard.core.model import Gpu, Grant, Link, Quota

ALICE, BOB, CAROL, DAVE = 1001, 1002, 1003, 1004
GIB = 1 << 30
SHARER = Quota(gpus=8, sharing=True, gpu_memory=20 * GIB)  # 4 such promises fit an 80 GiB GPU


def gpus(count: int, numa: dict[int, int] | None = None) -> list[Gpu]:
    numa = numa if numa is not None else {m: 0 if m < count // 2 else 1 for m in range(count)}
    return [Gpu(index=m, unit=m, uuid=f"GPU-{m}", name="H100", pci_bus_id=f"0:{m}", memory_total=80 << 30,
                memory_used=0, numa_node=numa.get(m), utilization=0) for m in range(count)]


def box(count: int = 8) -> dict[tuple[int, int], Link]:
    """A typical 8-GPU machine: NVLink pairs, PCIe switches of four, two NUMA nodes (as the simulator)."""
    links = {}
    for a, b in combinations(range(count), 2):
        if a // 2 == b // 2:
            links[(a, b)] = Link.NVLINK
        elif a // 4 == b // 4:
            links[(a, b)] = Link.PCIE_SWITCH
        else:
            links[(a, b)] = Link.SYSTEM
    return links


def held(uid: int, *units: int, shared: bool = False, memory: int | None = 20 * GIB) -> list[Grant]:
    return [Grant(uid=uid, user=str(uid), unit=m, granted_at=0.0, expires_at=None, last_active=0.0, shared=shared,
                  memory=memory if shared else None)
            for m in units]


def choose(count: int = 1, grants=(), uid: int = ALICE, share: bool = False, last_released=None,
           inventory=None, topology=None, held_last=None, quota: Quota | None = None) -> tuple[int, ...]:
    return allocator.choose(inventory or gpus(8), box() if topology is None else topology, list(grants),
                            last_released or {}, uid, count, share, held_last, quota or (SHARER if share else None))


def test_one_gpu_is_a_free_one_lowest_first():
    assert choose() == (0,)
    assert choose(grants=held(BOB, 0, 1, 2)) == (3,)


def test_no_gpu_free_gives_nothing():
    assert choose(grants=held(BOB, *range(8))) == ()
    assert choose(count=0) == ()


def test_fewer_free_than_wanted_gives_what_is_free():
    assert choose(count=3, grants=held(BOB, *range(6))) == (6, 7)


def test_two_gpus_are_an_nvlink_pair():
    assert choose(count=2) == (0, 1)
    # 0 taken: the next whole NVLink pair, not 1 + 2 (PCIe switch)
    assert choose(count=2, grants=held(BOB, 0)) == (2, 3)


def test_four_gpus_stay_behind_one_switch():
    assert choose(count=4, grants=held(BOB, 1)) == (4, 5, 6, 7)


def test_worst_link_counts_before_the_sum():
    # {0,1,2}: links NV, PIX, PIX (worst PIX). {0,1,4}: NV, SYS, SYS (worst SYS), despite 0,1 being NVLinked.
    free = held(BOB, 3, 5, 6, 7)
    assert choose(count=3, grants=free) == (0, 1, 2)


def test_a_top_up_lands_next_to_the_gpus_already_held():
    assert choose(count=1, grants=held(ALICE, 4)) == (5,)
    assert choose(count=1, grants=held(ALICE, 3)) == (2,)


def test_equal_links_prefer_one_numa_node():
    flat = {pair: Link.SYSTEM for pair in combinations(range(4), 2)}
    inventory = gpus(4, numa={0: 0, 1: 1, 2: 0, 3: 1})
    assert choose(count=2, inventory=inventory, topology=flat) == (0, 2)


def test_least_recently_released_first():
    # Never released counts as longest ago.
    assert choose(last_released={0: 50.0, 1: 10.0}) == (2,)
    everything = {m: 100.0 + m for m in range(8)}
    assert choose(last_released=everything) == (0,)
    assert choose(last_released={**everything, 0: 500.0}) == (1,)


def test_connectivity_counts_before_recency():
    recent = {0: 900.0, 1: 900.0}
    assert choose(count=2, last_released=recent, grants=held(BOB, 2, 4, 6)) == (0, 1)


def test_undeclared_links_count_as_the_worst():
    partial = {(0, 1): Link.NVLINK}
    assert allocator.link(partial, 1, 0) is Link.NVLINK
    assert allocator.link(partial, 0, 2) is Link.SYSTEM
    assert choose(count=2, inventory=gpus(4), topology=partial) == (0, 1)


def test_exclusive_users_never_get_a_held_gpu():
    assert choose(grants=held(BOB, *range(7))) == (7,)
    assert choose(grants=held(BOB, *range(8), shared=True)) == ()


def test_sharing_only_onto_gpus_whose_holders_all_share():
    grants = held(BOB, 0, 1, 2, 3, shared=True) + held(CAROL, 4, 5, 6, 7) + held(CAROL, 1)
    # free ones first: none; then shared ones that no exclusive holder is on (1 has carol, exclusive)
    assert choose(grants=grants, share=True) == (0,)
    assert choose(count=8, grants=grants, share=True) == (0, 2, 3)


def test_sharing_users_still_prefer_free_gpus_then_the_least_crowded():
    grants = held(BOB, 0, 1, shared=True) + held(CAROL, 0, shared=True)
    assert choose(grants=grants, share=True) == (2,)
    crowded = grants + held(CAROL, *range(2, 8))
    assert choose(grants=crowded, share=True) == (1,)


def test_sharers_promised_memory_never_adds_up_to_more_than_the_gpu():
    quota = Quota(gpus=1, sharing=True, gpu_memory=40 * GIB, max_sharers=8)
    one = gpus(1)
    assert choose(grants=held(BOB, 0, shared=True, memory=40 * GIB), share=True, inventory=one, quota=quota) == (0,)
    full = held(BOB, 0, shared=True, memory=40 * GIB) + held(CAROL, 0, shared=True, memory=40 * GIB)
    assert choose(grants=full, share=True, inventory=one, quota=quota) == ()  # 120 GiB on 80 would not fit
    over = held(BOB, 0, shared=True, memory=41 * GIB)
    assert choose(grants=over, share=True, inventory=one, quota=quota) == ()  # 81 GiB


def test_at_most_max_sharers_users_on_a_gpu():
    one = gpus(1)
    two = held(BOB, 0, shared=True) + held(CAROL, 0, shared=True)  # 40 GiB of 80 promised: memory is no bar
    assert choose(grants=two, share=True, inventory=one) == ()  # the default max_sharers is 2
    assert choose(grants=two, share=True, inventory=one, quota=Quota(sharing=True, gpu_memory=GIB,
                                                                      max_sharers=3)) == (0,)


def test_a_sharing_grant_without_a_memory_promise_takes_no_sharer():
    assert choose(grants=held(BOB, 0, shared=True, memory=None), share=True, inventory=gpus(1)) == ()
    # nor does a user without a memory quota join anyone: sharing needs one
    assert choose(grants=held(BOB, 0, shared=True), share=True, inventory=gpus(1), quota=Quota(sharing=True)) == ()


def test_a_user_never_gets_a_gpu_twice():
    assert choose(count=8, grants=held(ALICE, 0, 1)) == (2, 3, 4, 5, 6, 7)


def test_many_gpus_use_the_greedy_search_and_still_find_a_whole_nvlink_domain():
    count = 64
    domains = {(a, b): Link.NVLINK if a // 8 == b // 8 else Link.SYSTEM for a, b in combinations(range(count), 2)}
    inventory = gpus(count, numa={m: m // 32 for m in range(count)})
    assert comb(count, 8) > allocator.EXHAUSTIVE_LIMIT
    grants = held(BOB, 0, 9)
    chosen = allocator.choose(inventory, domains, grants, {}, ALICE, 8, False)
    assert chosen == tuple(range(16, 24))


@pytest.mark.parametrize("seed", range(30))
def test_random_machines_never_break_the_invariants(seed):
    rng = random.Random(seed)
    count = rng.choice([2, 4, 8, 10])
    inventory = gpus(count)
    topology = {pair: rng.choice(list(Link)) for pair in combinations(range(count), 2)}
    grants = []
    for uid in (BOB, CAROL):
        grants += held(uid, *rng.sample(range(count), rng.randint(0, count // 2)), shared=rng.random() < 0.5)
    share = rng.random() < 0.5
    want = rng.randint(1, count)
    chosen = allocator.choose(inventory, topology, grants, {}, ALICE, want, share, None, SHARER)
    exclusive = {g.unit for g in grants if not g.shared}
    taken = {g.unit for g in grants}
    full = {m for m in taken if sum(g.unit == m for g in grants) >= SHARER.max_sharers}
    assert len(chosen) == len(set(chosen)) <= want
    assert not set(chosen) & (exclusive | full)
    if not share:
        assert not set(chosen) & taken
    available = [m for m in range(count) if m not in (exclusive | full if share else taken)]
    assert len(chosen) == min(want, len(available))
    # free GPUs are used up before any shared one
    free = set(range(count)) - taken
    assert set(chosen) >= free or set(chosen) <= free


def test_a_returning_user_gets_the_gpus_held_last_when_free():
    assert choose(last_released={5: 100.0}) == (0,)
    assert choose(held_last={5: 100.0}) == (5,)  # before lowest, least recent, and ...
    assert choose(count=2, held_last={5: 100.0, 2: 100.0}) == (2, 5)  # ... before connectivity
    assert choose(held_last={5: 100.0, 2: 200.0}) == (2,)  # the most recently held first
    assert choose(held_last={5: 100.0}, grants=held(BOB, 5)) == (0,)  # taken meanwhile: another one
    assert choose(count=2, held_last={5: 100.0}) == (4, 5)  # the rest next to it


def test_a_returning_user_gets_the_gpus_held_last_in_a_pool_without_topology_too():
    flat = gpus(8, numa={})  # no links, no NUMA node: a replay's pool, ranked GPU by GPU
    assert choose(inventory=flat, topology={}, last_released={5: 100.0}) == (0,)
    assert choose(inventory=flat, topology={}, last_released={5: 100.0}, held_last={5: 100.0}) == (5,)
    assert choose(inventory=flat, topology={}, held_last={5: 100.0, 2: 200.0}) == (2,)
    assert choose(inventory=flat, topology={}, count=3, held_last={5: 100.0, 2: 200.0}) == (0, 2, 5)
