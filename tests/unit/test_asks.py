"""Asks.ask, the one path for asking for GPUs: a login, `gpuguard request` and a replayed job all
reach it, and every grant they get comes from it (at once, or from the queue serving a place it
made); what it decides, step by step."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
from fakes import GROUP, World

from gpuguard import config as configuration
from gpuguard.core.model import Account, Origin, Quota
from gpuguard.replay import engine, trace
from gpuguard.services.asks import Ask, Asks, Outcome, Waits, Why
from gpuguard.services.grants import Grants
from gpuguard.services.queueing import Queue
from gpuguard.services.store import Store


class Spy:
    """Where each grant and each place in the queue was made: inside Asks.ask, or inside a
    dispatch of the queue (which serves only places asks made)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.asked: list[Ask] = []
        self.grants: list[str] = []  # for each grant made: "ask" or "queue"
        self._in: list[str] = []
        real_ask, real_dispatch = Asks.ask, Queue.dispatch
        real_allocate, real_join, real_add = Grants.allocate, Store.join_queue, Grants.add
        spy = self

        def ask(asks: Asks, asked: Ask, now: float):
            spy.asked.append(asked)
            with spy.inside("ask"):
                return real_ask(asks, asked, now)

        def dispatch(queue: Queue, now: float):
            with spy.inside("queue"):
                return real_dispatch(queue, now)

        def allocate(grants: Grants, *args, **kwargs):
            units = real_allocate(grants, *args, **kwargs)
            if units:
                assert spy._in, "a grant made outside Asks.ask and the queue"
                spy.grants.append(spy._in[-1])
            return units

        def join(store: Store, *args, **kwargs):
            assert "ask" in spy._in, "a place in the queue that no ask made"
            return real_join(store, *args, **kwargs)

        def add(grants: Grants, *args, **kwargs):
            assert spy._in, "a grant made outside Asks.ask and the queue"
            return real_add(grants, *args, **kwargs)

        monkeypatch.setattr(Asks, "ask", ask)
        monkeypatch.setattr(Queue, "dispatch", dispatch)
        monkeypatch.setattr(Grants, "allocate", allocate)
        monkeypatch.setattr(Grants, "add", add)
        monkeypatch.setattr(Store, "join_queue", join)

    @contextmanager
    def inside(self, where: str) -> Iterator[None]:
        self._in.append(where)
        try:
            yield
        finally:
            self._in.pop()


def test_every_grant_of_a_replay_comes_from_an_ask(monkeypatch):
    spy = Spy(monkeypatch)
    base = configuration.Config()
    config = replace(base, defaults=replace(base.defaults, gpus=8, reclaim_after=30.0))
    sessions = list(trace.generate_batch(60, users=6, seed=11))
    result = engine.replay(sessions, config, 8)
    jobs = sum(len(s.jobs) for s in sessions)
    assert len(spy.asked) == jobs  # every job asked, through the one path
    assert all(a.whole and not a.one_place and a.waits == Waits.YES for a in spy.asked)
    assert "queue" in spy.grants and result.summary(8)["jobs_ran"] > 0


def test_a_login_and_a_request_reach_the_same_ask(world: World, monkeypatch):
    spy = Spy(monkeypatch)
    alice, bob = world.lookup.add("alice", 1001, GROUP), world.lookup.add("bob", 1002, GROUP)
    world.quota(gpus=2)
    assert len(world.login(alice)["gpus"]) == 2
    assert world.call("request", uid=bob.uid, gpus=2)["gpus"] == [2, 3]
    assert [(a.account.name, a.origin, a.waits) for a in spy.asked] == [
        ("alice", Origin.SESSION, Waits.IF_NOTHING), ("bob", Origin.REQUEST, Waits.NEVER)]
    assert spy.grants == ["ask", "ask"]


@pytest.fixture
def asks(world: World) -> Iterator[Asks]:
    world.quota(gpus=2)
    yield world.services.asks


def member(world: World, name: str = "alice", uid: int = 1001) -> Account:
    return world.lookup.add(name, uid, GROUP)


def ask(account: Account, gpus: int | None = None, waits: Waits = Waits.NEVER, **fields) -> Ask:
    return Ask(account, gpus, Origin.REQUEST, waits, "asked in a test", **fields)


def test_who_asks_decides_first(world: World, asks: Asks):
    outsider = world.lookup.add("eve", 1005, "other")
    assert asks.ask(ask(outsider), 1.0).why == Why.OUTSIDER
    assert asks.ask(ask(Account("root", 0, frozenset())), 1.0).why == Why.EXEMPT
    assert world.store.grants() == [] and world.store.queue() == []


def test_over_the_quota_and_more_than_the_server_has_are_refused_and_the_quota_cut(world: World, asks: Asks):
    alice = member(world)
    assert asks.ask(ask(alice, 3), 1.0).why == Why.OVER_QUOTA
    world.quota(gpus=8)
    too_big = asks.ask(ask(alice, 5), 1.0)
    assert too_big.why == Why.TOO_BIG and too_big.capacity == 4
    cut = asks.ask(ask(alice), 1.0)  # the quota's worth (8), cut to what the server has (4)
    assert cut.outcome == Outcome.GRANTED and cut.wanted == 4 and len(cut.granted) == 4


def test_with_others_waiting_an_ask_takes_its_turn_and_one_place_per_user(world: World, asks: Asks):
    alice, bob, carol = member(world), member(world, "bob", 1002), member(world, "carol", 1003)
    world.quota(gpus=4)
    asks.ask(ask(alice, 3), 1.0)  # one GPU left free
    waiting = asks.ask(ask(bob, 2, Waits.YES), 2.0)  # nobody waits: the free one now, the other waited for
    assert waiting.outcome == Outcome.WAITING and waiting.granted == (3,)
    assert waiting.place is not None and waiting.place.counted == (3,) and waiting.place.waiter.gpus == 1
    assert asks.ask(ask(carol, 1), 3.0).why == Why.NONE_FREE  # she does not wait: no place left behind
    again = asks.ask(ask(bob, 2, Waits.YES), 4.0)
    assert again.outcome == Outcome.WAITING and again.place == waiting.place  # his one place
    assert asks.ask(ask(bob, 2), 4.0).why == Why.ALREADY_WAITING
    assert [q.waiter.user for q in world.store.queue()] == ["bob"]


def test_a_whole_ask_waits_for_all_of_it_and_counts_what_its_asker_keeps(world: World, asks: Asks):
    alice, bob = member(world), member(world, "bob", 1002)
    world.quota(gpus=4)
    asks.ask(ask(bob, 2), 1.0)
    kept = asks.ask(ask(alice, 1), 1.0).granted
    whole = asks.ask(ask(alice, 3, Waits.YES, keeps=kept, whole=True, one_place=False), 2.0)
    assert whole.outcome == Outcome.WAITING and whole.granted == ()  # one free, two wanted beside the kept one
    assert whole.place is not None and whole.place.counted == kept and whole.place.waiter.gpus == 2


def test_an_ask_for_a_quota_of_no_gpus_gets_none(world: World, asks: Asks):
    world.quota(gpus=0)
    answer = asks.ask(ask(member(world)), 1.0)
    assert answer.outcome == Outcome.GRANTED and answer.granted == () and answer.wanted == 0


def test_the_quota_is_the_users_own(world: World, asks: Asks):
    world.config = replace(world.config, defaults=Quota(gpus=1))
    alice = member(world)
    assert asks.ask(ask(alice, 2), 1.0).why == Why.OVER_QUOTA
