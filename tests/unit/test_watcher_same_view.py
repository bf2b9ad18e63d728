"""The watcher's confirming decision is skipped only when it could not differ: the re-sample is the
same sample over the same grants (a replay's, or a sampler's reuse within MAX_AGE). A fresh sample
is decided again, and what it no longer shows is not acted on."""
from __future__ import annotations

import asyncio

from fakes import GROUP

from gpuguard import rules


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
