"""Why a request waits (queueing.reason) and how whoami says it (messages.queue_why): pure."""
from gpuguard.core.messages import queue_why
from gpuguard.core.scheduler import Waiter
from gpuguard.services import queueing

NOW = 10_000.0


def waiter(uid: int, since: float = NOW - 60, priority: int = 0, share: float = 1.0) -> Waiter:
    return Waiter(uid, uid, f"u{uid}", 1, since, priority, share)


def test_the_first_in_line_waits_for_resources():
    assert queueing.reason([], waiter(1), {}, 0, NOW, 300) == queueing.RESOURCES


def test_behind_a_higher_priority_or_a_smaller_usage_or_an_earlier_asker():
    mine = waiter(2)
    assert queueing.reason([waiter(1, priority=5)], mine, {}, 0, NOW, 300) == queueing.PRIORITY
    assert queueing.reason([waiter(1)], mine, {1: 10.0, 2: 20.0}, 0, NOW, 300) == queueing.FAIRSHARE
    assert queueing.reason([waiter(1)], mine, {}, 0, NOW, 300) == queueing.RESOURCES


def test_free_gpus_held_for_a_request_that_waited_past_reserve_after():
    old = waiter(1, since=NOW - 600)
    assert queueing.reason([old], waiter(2), {}, 1, NOW, 300) == queueing.RESERVED
    assert queueing.reason([old], waiter(2), {}, 0, NOW, 300) == queueing.RESOURCES  # nothing free to hold


def test_whoami_names_the_holders_the_idle_gpus_reclaim_and_the_first_end():
    holders = [{"minor": 0, "user": "alice", "expires_at": NOW + 3600, "idle": 10.0, "reclaim_after": None},
               {"minor": 1, "user": "bob", "expires_at": None, "idle": 7200.0, "reclaim_after": 1800.0},
               {"minor": 2, "user": "carol", "expires_at": None, "idle": 600.0, "reclaim_after": None}]
    lines = queue_why({"holders": holders, "free": 0}, NOW)
    assert lines[0] == "held: GPU 0 by alice"
    assert lines[1] == "idle: GPU 1 of bob, unused for 2h; reclaim takes it back after 30m idle while someone waits"
    assert lines[2] == "idle: GPU 2 of carol, unused for 10m; reclaim is off for them"
    assert lines[3].startswith("the first grant to end runs until ") and lines[3].endswith(" (in 1h)")
    assert "gpuguard cancel" in lines[-1]


def test_whoami_says_when_free_gpus_are_held_for_others_and_when_nothing_ends():
    lines = queue_why({"holders": [{"minor": 0, "user": "alice", "expires_at": None, "idle": 0.0,
                                    "reclaim_after": None}], "free": 1}, NOW)
    assert lines[0] == "1 GPU is free but held for requests ahead of yours"
    assert "no grant has a time limit" in lines[2]


def test_behind_a_request_past_the_age_bound_the_reason_is_its_priority_whatever_the_usage():
    aged, young = waiter(1, since=NOW - 7200), waiter(2, since=NOW - 60)
    assert queueing.reason([aged], young, {1: 90.0, 2: 10.0}, 0, NOW, 86400, 3600) == queueing.PRIORITY
    both_aged = waiter(2, since=NOW - 5000)  # both past the bound: served by arrival
    assert queueing.reason([aged], both_aged, {1: 90.0, 2: 10.0}, 0, NOW, 86400, 3600) == queueing.RESOURCES
    assert queueing.reason([aged], young, {1: 90.0, 2: 10.0}, 0, NOW, 86400) == queueing.FAIRSHARE  # no bound
