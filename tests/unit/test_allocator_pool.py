"""A replay's pool (no links, one NUMA node, hundreds of GPUs) is ranked by the module's order
alone: nobody's GPUs first, least recently released first, then the shared ones by fewest
holders; the lowest units among equals. Checked on random pools against that order written out."""
from __future__ import annotations

import random

from gpuguard import allocator
from gpuguard.model import Gpu, Grant, Quota

GIB = 1 << 30


def test_a_flat_pool_is_ranked_by_holders_then_release_time_then_unit():
    rng = random.Random(8)
    for _ in range(300):
        size = rng.randint(1, 60)
        pool = [Gpu(index=m, unit=m, uuid=f"GPU-{m}", name="H100", pci_bus_id=f"0:{m}", memory_total=80 * GIB,
                    memory_used=0, numa_node=None, utilization=0) for m in range(size)]
        uid = 1000
        share = rng.random() < 0.5
        quota = Quota(gpus=8, sharing=share, gpu_memory=10 * GIB if share else None, max_sharers=4)
        grants = [Grant(uid=rng.choice([uid, 1001, 1002, 1003]), user="u", unit=m, granted_at=0.0, expires_at=None,
                        last_active=0.0, shared=share, memory=10 * GIB if share else None)
                  for m in rng.sample(range(size), rng.randint(0, size))]
        grants = list({(g.uid, g.unit): g for g in grants}.values())
        released = {m: float(rng.choice([0, 5, 10])) for m in range(size) if rng.random() < 0.6}
        count = rng.randint(1, 8)
        got = allocator.choose(pool, {}, grants, released, uid, count, share, None, quota)

        own = {g.unit for g in grants if g.uid == uid}
        holders = {m: sum(1 for g in grants if g.unit == m and g.uid != uid) for m in range(size)}
        candidates = [m for m in range(size) if m not in own and (share or holders[m] == 0)]
        expected = sorted(candidates, key=lambda m: (holders[m] > 0, holders[m], released.get(m, 0.0), m))
        assert got == tuple(sorted(expected[:count]))
