"""The queue in the daemon's services, driven with fakes (tests/unit/fakes.py): logins and
`request --wait` join it, freed GPUs go to it first, the waiter is told, and it leaves when it should."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from fakes import GROUP, World

from gpuguard.core import policy
from gpuguard.core.model import Origin
from gpuguard.daemon.server import Peer


def fill(world: World) -> list:
    """Four members holding the four GPUs."""
    holders = [world.lookup.add(f"h{i}", 2000 + i, GROUP) for i in range(4)]
    for i, account in enumerate(holders):
        assert world.login(account, pid=5000 + i)["gpus"] == [i]
    return holders


def test_a_login_that_finds_no_gpu_joins_the_queue_and_is_granted_when_one_is_released(world):
    holders = fill(world)
    eve = world.lookup.add("eve", 1005, GROUP)
    opened = world.login(eve, pid=6000)
    assert opened["gpus"] == []
    assert "number 1 of 1 in the queue for 1 GPU" in opened["message"]
    assert world.call("whoami", uid=1005)["queue"]["position"] == 1
    assert [q["user"] for q in world.call("status", uid=1005)["queue"]] == ["eve"]

    world.call("release", uid=holders[2].uid)  # no process on it: released, and straight to eve
    assert world.held(1005) == [2]
    assert world.store.queue() == []
    user, told = world.notifier.told[-1]
    assert user == "eve" and "export CUDA_VISIBLE_DEVICES=GPU-0002" in told
    mine = world.call("whoami", uid=1005)
    assert [g["minor"] for g in mine["grants"]] == [2] and mine["queue"] is None


def test_a_queued_login_leaves_the_queue_with_its_last_session(world):
    fill(world)
    eve = world.lookup.add("eve", 1005, GROUP)
    world.login(eve, pid=6000)
    world.login(eve, pid=6001)
    world.call("session_close", user="eve", pid=6000)
    assert len(world.store.queue()) == 1  # one session still open
    world.call("session_close", user="eve", pid=6001)
    assert world.store.queue() == []


def test_whoami_says_why_someone_is_ahead(world):
    fill(world)
    eve, fred = world.lookup.add("eve", 1005, GROUP), world.lookup.add("fred", 1006, GROUP)
    world.login(eve, pid=6000)
    world.login(fred, pid=6001)
    ahead = world.call("whoami", uid=1006)["queue"]["ahead"]
    assert ahead == [{"user": "eve", "why": "asked earlier"}]


async def _request_then_wait(world: World, uid: int, release_uid: int | None, timeout: float | None) -> tuple:
    peer = Peer(pid=1, uid=uid, gid=uid)
    queued = await world.api.handle({"op": "request", "wait": True}, peer)
    waiting = asyncio.ensure_future(world.api.handle({"op": "wait", "ticket": queued["ticket"], "limit": timeout},
                                                     peer))
    await asyncio.sleep(0)
    if release_uid is not None:
        await world.api.handle({"op": "release"}, Peer(pid=1, uid=release_uid, gid=release_uid))
    return queued, await waiting


def test_request_wait_blocks_until_a_gpu_is_freed(world):
    holders = fill(world)
    world.lookup.add("eve", 1005, GROUP)
    queued, granted = asyncio.run(_request_then_wait(world, 1005, holders[1].uid, timeout=30))
    assert queued["queued"] is True and queued["position"] == 1
    assert granted["ok"] and granted["gpus"] == [1]
    assert granted["cuda_visible_devices"] == "GPU-0001"


def test_request_wait_times_out_and_leaves_the_queue(world):
    fill(world)
    world.lookup.add("eve", 1005, GROUP)
    _, reply = asyncio.run(_request_then_wait(world, 1005, None, timeout=0.05))
    assert reply["ok"] is False and reply["code"] == 1 and "left the queue" in reply["error"]
    assert world.store.queue() == []


def test_a_plain_request_does_not_jump_the_queue(world):
    holders = fill(world)
    eve, fred = world.lookup.add("eve", 1005, GROUP), world.lookup.add("fred", 1006, GROUP)
    world.login(eve, pid=6000)  # queued
    world.call("release", uid=holders[0].uid)  # GPU 0 goes to eve, not to whoever asks next
    assert world.held(1005) == [0]
    refused = world.call("request", uid=fred.uid)
    assert refused["ok"] is False and "request --wait" in refused["error"]
    assert world.store.queue() == []  # a plain request does not stay queued


def test_an_idle_grant_is_reclaimed_for_a_waiter_and_goes_to_it(world):
    world.quota(reclaim_after=60.0)
    holders = fill(world)
    eve = world.lookup.add("eve", 1005, GROUP)
    world.login(eve, pid=6000)
    busy = [(100 + i, holders[i].uid, i, 1 << 30) for i in (0, 1, 3)]  # GPU 2 idle
    world.sampler.set(busy)
    later = time.time() + 120
    asyncio.run(world.watcher.check(world.sampler.last, later))
    assert world.held(holders[2].uid) == []
    assert world.held(1005) == [2]
    assert any("for someone waiting" in told for _, told in world.notifier.told)


def test_a_waiters_own_gpu_taken_back_by_reclaim_is_waited_for_again_so_the_request_comes_whole(world):
    # eve holds GPU 3 and waits for 1 more (2 in all, her quota); fred waits too. Reclaim takes her
    # idle GPU 3 for the queue: she now waits for 2, so she is not served GPU 3 alone as if whole
    holders = fill(world)  # a GPU each
    world.quota(reclaim_after=60.0, gpus=2)
    # arrival order (everyone past max_wait_boost), and what is free held for the first at once
    world.config = replace(world.config, scheduler=replace(world.config.scheduler, reserve_after=0.0,
                                                           max_wait_boost=0.0))
    eve, fred = holders[3], world.lookup.add("fred", 1006, GROUP)
    queued = world.call("request", uid=eve.uid, wait=True)
    assert queued["queued"] is True and [q.waiter.gpus for q in world.store.queue()] == [1]
    assert world.call("request", uid=fred.uid, gpus=1, wait=True)["queued"] is True
    world.sampler.set([(100 + i, holders[i].uid, i, 1 << 30) for i in (0, 1, 2)])  # GPU 3 idle
    asyncio.run(world.watcher.check(world.sampler.last, time.time() + 120))
    assert world.held(eve.uid) == [] and [(q.waiter.user, q.waiter.gpus) for q in world.store.queue()] == [
        ("h3", 2), ("fred", 1)]
    assert world.store.queue()[0].waiter.id == queued["ticket"]  # her place and ticket kept
    assert world.held(fred.uid) == []  # GPU 3 is held for eve, first and waiting past reserve_after
    world.sampler.set([(100 + i, holders[i].uid, i, 1 << 30) for i in (0, 2)])
    world.call("release", uid=holders[1].uid)
    assert world.held(eve.uid) == [1, 3] and [q.waiter.user for q in world.store.queue()] == ["fred"]


def test_the_only_waiters_own_idle_gpu_is_not_reclaimed_for_her(world):
    # taking back what she counts on would only make her wait for it again (and free it for the
    # next one who asks): it stays hers while nobody else waits
    holders = fill(world)
    world.quota(reclaim_after=60.0, gpus=2)
    eve = holders[3]
    assert world.call("request", uid=eve.uid, wait=True)["queued"] is True
    assert world.queue.demand().keep == {(eve.uid, 3)}
    world.sampler.set([(100 + i, holders[i].uid, i, 1 << 30) for i in (0, 1, 2)])  # GPU 3 idle
    asyncio.run(world.watcher.check(world.sampler.last, time.time() + 120))
    assert world.held(eve.uid) == [3] and [q.waiter.gpus for q in world.store.queue()] == [1]
    assert not any("for someone waiting" in told for _, told in world.notifier.told)
    world.call("release", uid=holders[1].uid)
    assert world.held(eve.uid) == [1, 3] and world.store.queue() == []


def test_an_admins_revoke_does_not_grow_what_they_wait_for(world):
    holders = fill(world)
    world.quota(gpus=2)
    eve = holders[3]
    world.call("request", uid=eve.uid, wait=True)
    world.call("revoke", user=eve.name, gpu=[3])  # the admin wants her to have less: still 1 to wait for,
    assert world.held(eve.uid) == [3] and world.store.queue() == []  # which the freed GPU serves


def test_a_waiter_a_drain_made_too_big_holds_nothing_and_is_no_ones_reason_to_wait(world):
    holders = fill(world)
    world.quota(gpus=4)
    world.config = replace(world.config, scheduler=replace(world.config.scheduler, reserve_after=0.0))
    eve, fred = world.lookup.add("eve", 1005, GROUP), world.lookup.add("fred", 1006, GROUP)
    assert world.call("request", uid=eve.uid, wait=True)["queued"] is True  # for all 4
    world.drains.drain([3], "ggt-test", 0.0)  # now 3 can be hers at most
    world.call("release", uid=holders[0].uid)  # GPU 0 free: not held for eve, who cannot have 4
    assert world.call("request", uid=fred.uid, gpus=2, wait=True)["queued"] is True  # 1 free: fred waits
    why = {row["user"]: row["reason"] for row in world.call("status")["queue"]}
    assert why == {"eve": "Resources", "fred": "Resources"}  # not "Reserved" (for eve)


def test_a_waiter_a_drain_made_too_big_is_no_ones_demand_so_nothing_is_reclaimed_or_stopped_for_it(world):
    holders = fill(world)
    world.quota(gpus=4, reclaim_after=60.0)
    eve = world.lookup.add("eve", 1005, GROUP)
    assert world.call("request", uid=eve.uid, wait=True)["queued"] is True  # for all 4
    assert world.queue.demand().short == 4
    world.drains.drain([3], "ggt-test", 0.0)  # 3 at most could be hers now
    assert world.queue.demand().short == 0
    world.sampler.set([(103, holders[3].uid, 3, 1 << 30)])  # GPUs 0-2 idle
    asyncio.run(world.watcher.check(world.sampler.last, time.time() + 120))
    assert all(world.held(h.uid) for h in holders)  # not taken back for a request nothing can serve
    world.drains.resume([3])
    assert world.queue.demand().short == 4  # the pool back: her wait is demand again
    (row,) = world.store.queue()
    world.quota(gpus=1, reclaim_after=60.0)
    assert world.call("request", uid=world.lookup.add("fred", 1006, GROUP).uid, wait=True)["queued"] is True
    world.holds.hold([row.waiter.id])  # an admin holds her place while the GPU is drained again
    world.drains.drain([3], "ggt-test", 0.0)
    assert world.queue.demand().short == 1  # fred's
    world.holds.release([row.waiter.id])  # released from the hold: still too big
    assert world.queue.demand().short == 1


def test_a_gpu_the_waiter_keeps_on_a_drained_gpu_does_not_make_her_request_look_too_big(world):
    holders = fill(world)
    world.quota(gpus=4)
    world.config = replace(world.config, scheduler=replace(world.config.scheduler, reserve_after=0.0,
                                                           max_wait_boost=0.0))  # arrival order
    alice, fred = holders[0], world.lookup.add("fred", 1006, GROUP)
    world.call("release", uid=holders[1].uid)
    assert world.call("request", uid=alice.uid, gpus=4, wait=True)["queued"] is True  # holds 0, 1; 2 more
    world.drains.drain([1], "ggt-test", 0.0)  # alice keeps GPU 1: GPUs 2 and 3 would still do
    assert world.call("request", uid=fred.uid, gpus=1, wait=True)["queued"] is True
    world.call("release", uid=holders[2].uid)  # held for alice, first and waiting past reserve_after
    assert world.held(fred.uid) == [] and world.held(alice.uid) == [0, 1]
    world.call("release", uid=holders[3].uid)
    assert world.held(alice.uid) == [0, 1, 2, 3]
    world.call("release", uid=alice.uid)
    again = world.call("request", uid=alice.uid, gpus=4)  # 3 open GPUs: more could never come whole
    assert again["ok"] is False and "this server has 3 GPUs" in again["error"]


def test_whoami_expects_a_gpu_from_the_first_expiry_when_only_a_held_request_is_ahead(world):
    world.quota(max_time=3600.0)
    holders = fill(world)
    world.quota(max_time=3600.0, gpus=4)
    expiries = sorted(g.expires_at for g in world.store.grants())
    fred, eve = world.lookup.add("fred", 1006, GROUP), world.lookup.add("eve", 1005, GROUP)
    assert world.call("request", uid=fred.uid, gpus=4, wait=True)["queued"] is True
    assert world.call("request", uid=eve.uid, gpus=1, wait=True)["queued"] is True
    assert world.queue.standing(eve.uid, time.time()).estimate is None  # behind fred's 4: a 5th, of no known end
    world.holds.hold([world.store.queue(fred.uid)[0].waiter.id])  # an admin holds fred's: he keeps nobody waiting
    assert world.queue.standing(eve.uid, time.time()).estimate == expiries[0]
    assert len(holders) == 4


def test_a_walk_that_leaves_nothing_free_stops_there(world):
    # one user holding every GPU, with a long line of 1-GPU requests of theirs behind (a job
    # array in a replay): the release of one serves the first, which leaves nothing free, and the
    # rest of the line is not looked at (it was, row by row, at every such release)
    holders = fill(world)
    world.quota(gpus=4)
    world.config = replace(world.config, scheduler=replace(world.config.scheduler, reserve_after=0.0))
    eve = holders[0]
    for other in holders[1:]:
        world.call("release", uid=other.uid)
    assert world.call("request", uid=eve.uid, gpus=4)["gpus"] == [0, 1, 2, 3]
    quota = policy.quota_for(eve.name, frozenset({GROUP}), world.config)
    for _ in range(50):
        assert world.queue.join(eve.uid, eve.name, 1, quota, time.time(), Origin.REQUEST)[1] is None  # waits
    looked: list[int] = []
    possible = world.queue._possible
    world.queue._possible = lambda queued: looked.append(queued.waiter.id) or possible(queued)
    world.call("release", uid=eve.uid, units=[2])
    assert world.held(eve.uid) == [0, 1, 2, 3] and len(world.store.queue()) == 49
    assert looked == []


def test_nothing_is_reclaimed_while_nobody_waits(world):
    world.quota(reclaim_after=60.0)
    holders = fill(world)
    world.sampler.set([])
    asyncio.run(world.watcher.check(world.sampler.last, time.time() + 3600))
    assert all(world.held(h.uid) for h in holders)


def test_one_place_per_user_and_a_login_keeps_its_place_when_a_waiting_client_gives_up(world):
    fill(world)
    eve = world.lookup.add("eve", 1005, GROUP)
    world.login(eve, pid=6000)
    refused = world.call("request", uid=eve.uid)
    assert refused["ok"] is False and "in the queue already" in refused["error"]
    _, reply = asyncio.run(_request_then_wait(world, eve.uid, None, timeout=0.05))
    assert reply["ok"] is False and "your login keeps its place" in reply["error"]
    assert [q.waiter.user for q in world.store.queue()] == ["eve"]


def test_fair_share_puts_the_user_who_just_had_a_gpu_behind(world):
    holders = fill(world)
    eve, fred = world.lookup.add("eve", 1005, GROUP), world.lookup.add("fred", 1006, GROUP)
    world.login(fred, pid=6001)                   # fred asked first...
    world.store.set_fairshare(fred.uid, 36000.0, time.time())  # ...but had 10 GPU-hours lately
    world.login(eve, pid=6000)
    assert world.call("whoami", uid=fred.uid)["queue"]["ahead"][0]["why"].startswith("less recent GPU usage")
    world.call("release", uid=holders[3].uid)
    assert world.held(eve.uid) == [3] and world.held(fred.uid) == []


def test_demand_follows_the_queue_the_grants_holds_and_drains(world):
    """What reclaim may take (Queue.demand) is worked out again when any of what it comes from
    changes, not only when the queue does."""
    from gpuguard.core.rules import Demand
    holders = fill(world)
    world.login(world.lookup.add("eve", 1005, GROUP), pid=6000)
    (waiting,) = world.store.queue()
    assert world.queue.demand() == Demand(1)
    world.holds.hold([waiting.waiter.id])  # an admin holds it: nobody to reclaim for
    assert world.queue.demand() == Demand(0)
    world.holds.release(world.holds.ids)
    assert world.queue.demand() == Demand(1)
    world.store.remove_grants(holders[0].uid, None, time.time())  # a GPU free (not yet served)
    assert world.queue.demand() == Demand(0)
    world.drains.drain([0], "maintenance", time.time())  # the free one goes to nobody new
    assert world.queue.demand() == Demand(1)


def test_the_waiters_kept_between_changes_are_those_worked_out_afresh(world):
    """dispatch and demand take the waiters as kept from one change of the queue to the next
    (Queue.waiting: moved on by the store's log of changes, worked out afresh when the holds
    change): after every step of random joins (some sharing, some at another priority or share,
    arrival times out of order), leaves of one or many rows, rows grown in place and holds, they
    are what the queue's rows and the holds say."""
    import math
    import random

    from gpuguard.core import scheduler
    from gpuguard.core.model import Origin, Quota
    rng = random.Random(7)
    quotas = [Quota(gpus=8), Quota(gpus=8, priority=1), Quota(gpus=8, sharing=True, gpu_memory=1 << 30),
              Quota(gpus=8, share=2.0)]
    for step in range(200):
        rows = world.store.queue_read()
        choice = rng.random()
        if choice < 0.6 or not rows:
            uid = rng.choice([1001, 1002, 1003])
            world.store.join_queue(uid, f"u{uid}", rng.randrange(1, 5), float(rng.randrange(1000)),
                                   rng.choice(quotas), Origin.REQUEST)
        elif choice < 0.8:
            world.store.leave_queue(q.waiter.id for q in rng.sample(rows, rng.randrange(1, len(rows) + 1)))
        elif choice < 0.88:
            grown = rng.choice(rows)
            world.store.regrow_queued(grown, grown.waiter.gpus + 1, ())
        elif choice < 0.95:
            world.holds.hold([rng.choice(rows).waiter.id])
        else:
            world.holds.release(world.holds.ids)
        kept = world.queue.waiting()
        waiting = [q for q in world.store.queue_read() if q.waiter.id not in world.holds.ids]
        alone = [q.waiter.gpus for q in waiting if not q.quota.sharing]
        assert list(kept.by_id.values()) == waiting, step
        assert kept.runs == scheduler.runs(q.waiter for q in waiting), step
        assert (kept.gpus, kept.fewest, kept.sharers) == \
            (sum(q.waiter.gpus for q in waiting), min(alone, default=math.inf), len(waiting) - len(alone)), step


def test_dispatch_asks_for_no_usage_of_a_user_whose_requests_all_waited_past_the_age_bound(world):
    """Requests past max_wait_boost go by arrival, whatever their users' usage, so dispatch never
    works that usage out (here and, on a fleet, on the other servers)."""
    from gpuguard.core.model import Origin, Quota
    asked: list[str] = []
    world.queue.remote_usage = lambda user: asked.append(user) or 0.0
    holders = fill(world)
    now = time.time()
    for name, uid, since in (("eve", 1005, now - 2 * 86400), ("fred", 1006, now - 60), ("gil", 1007, now - 30)):
        world.lookup.add(name, uid, GROUP)
        world.store.join_queue(uid, name, 1, since, Quota(), Origin.REQUEST)
    world.store.remove_grants(holders[0].uid, None, now)  # one GPU free, for the oldest request
    served = world.queue.dispatch(now)
    assert [q.waiter.user for q, _ in served] == ["eve"]
    assert sorted(asked) == ["fred", "gil"]  # the two it ordered by usage; eve's was never needed


def test_kept_waiters_follow_rows_grown_in_place_and_a_log_left_far_behind(world):
    """A row grown in place (keep_total) is one change out and one in, its place kept; a follower
    further behind than the store's log of changes works the waiters out afresh: either way they
    equal Waiting.of the rows."""
    from gpuguard.core.model import Origin, Quota
    from gpuguard.services import store as store_module
    from gpuguard.services.queueing import Waiting

    def fresh() -> Waiting:
        return Waiting.of(world.store.queue_read(), world.store.queue_version, world.holds.ids)

    def same(kept: Waiting, other: Waiting) -> bool:
        return (kept.by_id == other.by_id and {k: [w.id for w in r] for k, r in kept.runs.items()}
                == {k: [w.id for w in r] for k, r in other.runs.items()}
                and (kept.gpus, kept.alone, kept.sharers) == (other.gpus, other.alone, other.sharers))

    rows = [world.store.join_queue(1001 + i % 2, "u", 1, float(i), Quota(gpus=8), Origin.REQUEST) for i in range(5)]
    world.queue.waiting()
    world.store.regrow_queued(rows[1], 3, ())
    kept = world.queue.waiting()
    assert kept.by_id[rows[1].waiter.id].waiter.gpus == 3 and kept.gpus == 7 and same(kept, fresh())
    for i in range(store_module._QUEUE_LOG + 5):  # more changes than the log keeps, unseen
        world.store.leave_queue([world.store.join_queue(1003, "v", 2, 100.0 + i, Quota(gpus=8), Origin.REQUEST).waiter.id])
    world.store.join_queue(1003, "v", 2, 1e6, Quota(gpus=8), Origin.REQUEST)
    assert world.store.queue_changes(kept.version) is None
    assert same(world.queue.waiting(), fresh())
