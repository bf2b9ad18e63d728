"""A replay's pool (no links, one NUMA node, hundreds of GPUs) is ranked by the module's order
alone: nobody's GPUs first, then the shared ones by fewest holders; among equals the ones the
user held last (most recently first), then least recently released, then the lowest units.
Checked on random pools against that order written out, and against the general search over
sets (the same pool with every link declared as the worst, which links nothing better)."""
from __future__ import annotations

import random
from itertools import combinations

from gpuguard.core import allocator
from gpuguard.core.model import Gpu, Grant, Link, Quota

GIB = 1 << 30


def random_case(rng: random.Random, size: int, uid: int):
    """A flat pool of `size` GPUs with random grants (shared or not), release times and the
    user's own release times (held_last), several equal so that every tie-break is used."""
    pool = [Gpu(index=m, unit=m, uuid=f"GPU-{m}", name="H100", pci_bus_id=f"0:{m}", memory_total=80 * GIB,
                memory_used=0, numa_node=None, utilization=0) for m in range(size)]
    share = rng.random() < 0.5
    quota = Quota(gpus=8, sharing=share, gpu_memory=10 * GIB if share else None, max_sharers=4)
    grants = [Grant(uid=rng.choice([uid, 1001, 1002, 1003]), user="u", unit=m, granted_at=0.0, expires_at=None,
                    last_active=0.0, shared=share, memory=10 * GIB if share else None)
              for m in rng.sample(range(size), rng.randint(0, size))]
    grants = list({(g.uid, g.unit): g for g in grants}.values())
    released = {m: float(rng.choice([0, 5, 10])) for m in range(size) if rng.random() < 0.6}
    held_last = {m: float(rng.choice([0, 5, 10])) for m in range(size) if rng.random() < 0.3}
    return pool, share, quota, grants, released, held_last


def test_a_flat_pool_is_ranked_by_holders_then_held_last_then_release_time_then_unit():
    rng = random.Random(8)
    uid = 1000
    for _ in range(300):
        size = rng.randint(1, 60)
        pool, share, quota, grants, released, held_last = random_case(rng, size, uid)
        count = rng.randint(1, 8)
        got = allocator.choose(pool, {}, grants, released, uid, count, share, held_last, quota)

        own = {g.unit for g in grants if g.uid == uid}
        holders = {m: sum(1 for g in grants if g.unit == m and g.uid != uid) for m in range(size)}
        candidates = [m for m in range(size) if m not in own and (share or holders[m] == 0)]
        expected = sorted(candidates, key=lambda m: (holders[m] > 0, holders[m], m not in held_last,
                                                     -held_last.get(m, 0.0), released.get(m, 0.0), m))
        assert got == tuple(sorted(expected[:count]))


def test_a_flat_pool_chooses_what_the_search_over_sets_chooses():
    rng = random.Random(20)
    uid = 1000
    for _ in range(300):
        size = rng.randint(1, 12)  # small enough for the exhaustive search
        pool, share, quota, grants, released, held_last = random_case(rng, size, uid)
        count = rng.randint(1, 4)
        worst = {pair: Link.SYSTEM for pair in combinations(range(size), 2)} or {(0, 1): Link.SYSTEM}
        flat = allocator.choose(pool, {}, grants, released, uid, count, share, held_last, quota)
        searched = allocator.choose(pool, worst, grants, released, uid, count, share, held_last, quota)
        assert flat == searched
