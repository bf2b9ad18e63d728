"""The watcher's confirming decision is skipped only when it could not differ: the re-sample is the
same sample over the same grants (a replay's, or a sampler's reuse within MAX_AGE). A fresh sample
is decided again, and what it no longer shows is not acted on."""
from __future__ import annotations

import asyncio

from fakes import GROUP

from gpuguard.core import rules
from gpuguard.core.model import Origin, Quota


def _count_decisions(monkeypatch) -> list[int]:
    calls = [0]
    decide = rules.decide

    def counted(*args, **kwargs):
        calls[0] += 1
        return decide(*args, **kwargs)
    monkeypatch.setattr(rules, "decide", counted)
    return calls


def test_the_same_sample_is_decided_once(world, monkeypatch):
    world.quota(gpu_memory=4 << 30)
    alice = world.lookup.add("alice", 1001, GROUP)
    (unit,) = world.login(alice)["gpus"]
    world.sampler.set([(321, 1001, unit, 6 << 30)])
    calls = _count_decisions(monkeypatch)
    done = asyncio.run(world.watcher.check(world.sampler.last, 1000.0))
    assert [(a.kind, a.rule) for a in done] == [("warn", "memory")]
    assert calls[0] == 1


def test_a_fresh_sample_is_decided_again_and_vetoes(world, monkeypatch):
    world.quota(gpu_memory=4 << 30)
    alice = world.lookup.add("alice", 1001, GROUP)
    (unit,) = world.login(alice)["gpus"]
    first = world.sampler.set([(321, 1001, unit, 6 << 30)])
    world.sampler.set([(321, 1001, unit, 3 << 30)])  # the re-sample: back under the quota
    calls = _count_decisions(monkeypatch)
    done = asyncio.run(world.watcher.check(first, 1000.0))
    assert done == [] and calls[0] == 2


def _resampled_after(world, change) -> None:
    """The confirming re-sample returns the same sample object (as a replay's does), after `change`
    happened during its await."""
    async def take_or_log(*args, **kwargs):
        change()
        return world.sampler.last
    world.sampler.take_or_log = take_or_log


def test_the_same_sample_is_decided_again_when_the_queue_or_the_grants_moved_meanwhile(world, monkeypatch):
    world.quota(gpu_memory=4 << 30)
    alice = world.lookup.add("alice", 1001, GROUP)
    (unit,) = world.login(alice)["gpus"]
    others = [world.lookup.add(f"h{i}", 2000 + i, GROUP) for i in range(3)]
    for i, account in enumerate(others):
        world.login(account, pid=5000 + i)  # every GPU held: a request now waits
    world.sampler.set([(321, 1001, unit, 6 << 30)])
    calls = _count_decisions(monkeypatch)
    _resampled_after(world, lambda: world.store.join_queue(1005, "eve", 1, 1000.0, Quota(), Origin.REQUEST))
    asyncio.run(world.watcher.check(world.sampler.last, 1000.0))
    assert world.queue.demand().short == 1 and calls[0] == 2  # the demand moved: decided again
    world.watcher.state = rules.State()  # forgotten: alice is warned again, which is confirmed again
    _resampled_after(world, lambda: world.store.remove_grants(others[0].uid, None, 1001.0))
    asyncio.run(world.watcher.check(world.sampler.last, 1001.0))
    assert calls[0] == 4  # a grant went: decided again
    world.watcher.state = rules.State()
    _resampled_after(world, lambda: None)
    done = asyncio.run(world.watcher.check(world.sampler.last, 1002.0))
    assert [a.kind for a in done] == ["warn"] and calls[0] == 5  # nothing moved: decided once
