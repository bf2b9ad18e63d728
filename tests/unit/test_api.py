"""Api driven with fakes (tests/unit/fakes.py): no root, no daemon, no GPUs."""
from __future__ import annotations

import asyncio

from fakes import GROUP

from gpuguard.config import AccessConfig
from gpuguard.core.sample import Opener


def test_a_member_login_gets_a_gpu_and_a_second_session_reuses_it(world):
    alice = world.lookup.add("alice", 1001, GROUP)
    first = world.login(alice)
    assert first["ok"] and first["gpus"] == world.held(1001) and len(first["gpus"]) == 1
    (unit,) = first["gpus"]
    assert first["cuda_visible_devices"] == f"GPU-{unit:04d}"
    assert world.nodes.users[unit] == {1001}  # the node's ACL followed the store
    second = world.login(alice, pid=4343)
    assert second["gpus"] == [unit] and world.held(1001) == [unit]


def test_a_non_member_and_an_unknown_user_open_their_session_without_gpus(world):
    bob = world.lookup.add("bob", 1002, "staff")
    assert world.login(bob)["gpus"] == [] and world.held(1002) == []
    reply = world.call("session_open", user="ghost", pid=1, service="sshd")
    assert reply["ok"] and reply["gpus"] == [] and "internal error" in reply["message"]


def test_an_exempt_login_joins_the_exempt_set_and_the_acls(world):
    world.config = world.config.__class__(access=AccessConfig(group=GROUP, exempt_groups=("ops",)))
    ops = world.lookup.add("ops", 1003, "ops")
    assert world.login(ops)["gpus"] == []
    assert 1003 in world.exempt.uids
    assert all(1003 in users for users in world.nodes.users.values()) and len(world.nodes.users) == 4


def test_logout_releases_unused_session_grants_and_keeps_held_ones(world):
    alice, bob = world.lookup.add("alice", 1001, GROUP), world.lookup.add("bob", 1002, GROUP)
    (a_minor,) = world.login(alice, pid=11)["gpus"]
    (b_minor,) = world.login(bob, pid=12)["gpus"]
    world.openers.append(Opener(pid=99, uid=1002, unit=b_minor))  # bob's nohup job holds the node open
    closed = world.call("session_close", user="alice", pid=11)
    assert closed["held"] == [a_minor] and closed["release_pending"]
    assert world.held(1001) == [] and world.nodes.users[a_minor] == frozenset()
    kept = world.call("session_close", user="bob", pid=12)
    assert kept["release_pending"] and world.held(1002) == [b_minor]
    assert world.exits.watched[1002][0] == {99}  # the holder is watched, not looked for again


def test_a_close_that_is_not_the_last_starts_no_release(world):
    alice = world.lookup.add("alice", 1001, GROUP)
    (unit,) = world.login(alice, pid=11)["gpus"]
    world.login(alice, pid=12)
    closed = world.call("session_close", user="alice", pid=11)
    assert (closed["closed"], closed["held"], closed["release_pending"]) == (True, [unit], False)
    assert world.scans == 0 and world.held(1001) == [unit]


def test_a_kept_grant_is_not_looked_for_each_tick_but_when_its_holder_exits(world):
    bob = world.lookup.add("bob", 1002, GROUP)
    (unit,) = world.login(bob, pid=12)["gpus"]
    world.openers.append(Opener(pid=99, uid=1002, unit=unit))
    world.call("session_close", user="bob", pid=12)
    tick = lambda: asyncio.run(world.logout.release_unused(world.sampler.last))  # noqa: E731
    for _ in range(5):
        tick()
    assert world.scans == 1 and world.held(1002) == [unit]
    world.openers.clear()
    world.exits.exit(99)
    tick()  # looks again (only a look can release it), and Grants.remove has the OpenerEnder look too
    assert world.held(1002) == []
    assert 1002 not in world.exits.watched


def test_a_nvml_process_keeps_the_grant_after_logout(world):
    alice = world.lookup.add("alice", 1001, GROUP)
    (unit,) = world.login(alice, pid=11)["gpus"]
    world.sampler.set([(500, 1001, unit, 1 << 30)])
    assert world.call("session_close", user="alice", pid=11)["release_pending"]
    assert world.held(1001) == [unit]


def test_request_respects_the_quota_and_tops_up(world):
    world.quota(gpus=2)
    alice = world.lookup.add("alice", 1001, GROUP)
    assert world.call("request", uid=1001, gpus=3)["code"] == 1
    assert world.call("request", uid=1001, gpus=0)["code"] == 2
    reply = world.call("request", uid=1001, gpus=2)
    assert reply["ok"] and len(reply["gpus"]) == 2 and world.held(alice.uid) == sorted(reply["gpus"])


def test_request_with_a_grant_on_a_gpu_missing_from_the_inventory_still_works(world):
    """allocator.choose once raised KeyError here: a GPU NVML could not read at start."""
    world.quota(gpus=2)
    world.lookup.add("alice", 1001, GROUP)
    world.store.add_grants(1001, "alice", [9], 1.0, None, shared=False, origin="request")
    reply = world.call("request", uid=1001, gpus=2)
    assert reply["ok"] and len(world.held(1001)) == 2 and 9 in world.held(1001)


def test_root_only_operations_are_refused_to_users(world):
    world.lookup.add("alice", 1001, GROUP)
    for op in ("session_open", "grant", "revoke", "reload", "sync_nodes"):
        reply = world.call(op, uid=1001, user="alice")
        assert not reply["ok"] and "root only" in reply["error"], op
    assert world.reloads == 0


def test_admin_grant_and_revoke(world):
    world.lookup.add("alice", 1001, GROUP)
    granted = world.call("grant", user="alice", units=[2], **{"for": "1h"})
    assert granted["ok"] and world.held(1001) == [2]
    assert world.call("grant", user="alice", units=[7])["code"] == 2  # no such GPU
    revoked = world.call("revoke", user="alice")
    assert revoked["revoked"] == [2] and world.held(1001) == []
    assert world.call("revoke", user="alice")["code"] == 1  # holds nothing now


def test_closing_sessions_already_gone_scans_nothing(world):
    """The hang of issue 9: 50 sessions of 10 users closed one after another took over 280 s.
    Their sessions were gone (the restarted daemon's tick had dropped them), their grants kept
    by processes holding the nodes, so every close took a sample and scanned all of /proc again.
    Only the close that ends a user's last session may try the release now."""
    users = [world.lookup.add(f"u{i}", 1100 + i, GROUP) for i in range(4)]
    for user in users:
        world.login(user, pid=9000 + user.uid)
        (unit,) = world.held(user.uid)
        world.openers.append(Opener(pid=500 + user.uid, uid=user.uid, unit=unit))  # a job without a CUDA context
    world.store.remove_sessions(s.id for s in world.store.sessions())  # as drop_dead_sessions does
    for _ in range(5):
        for user in users:
            assert world.call("session_close", user=user.name, pid=9000 + user.uid)["closed"] is False
    assert world.scans == 0
    assert all(world.held(user.uid) for user in users)  # the tick's release_unused still decides about them


def test_the_close_that_ends_the_last_session_scans_only_that_users_processes(world):
    users = [world.lookup.add(f"u{i}", 1100 + i, GROUP) for i in range(3)]
    for user in users:
        for pid in (1, 2):
            world.login(user, pid=pid * 10000 + user.uid)
    for user in users:
        world.openers.append(Opener(pid=500 + user.uid, uid=user.uid, unit=world.held(user.uid)[0]))
    for pid in (1, 2):
        for user in users:
            world.call("session_close", user=user.name, pid=pid * 10000 + user.uid)
    assert world.scans == len(users)  # one per last close, none for the first ones
    assert world.scanned_uids == [frozenset({user.uid}) for user in users]  # each reads one user's processes


def test_requests_and_releases_are_rate_limited_per_user(world):
    """Each request writes the store and each release scans /proc: a burst, then a refusal that
    says when to try again; another user is not held back."""
    world.quota(gpus=1)
    world.lookup.add("alice", 1001, GROUP)
    world.lookup.add("bob", 1002, GROUP)
    replies = [world.call(op, uid=1001) for _ in range(8) for op in ("request", "release")]
    assert all(r["ok"] for r in replies[:10]), replies[:10]  # a burst of 5 of each
    limited = [r for r in replies[10:] if not r["ok"]]
    assert limited and all(r["error"].startswith("too many ") and "try again in" in r["error"] for r in limited)
    assert world.call("request", uid=1002)["ok"]
