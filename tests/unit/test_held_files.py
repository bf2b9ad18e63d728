"""Each holder's held-devices file (what the PAM module reads when no daemon answers) follows every
grant given or taken back, whatever gave or took it: Grants writes it, no listener in between."""
from __future__ import annotations

from fakes import GROUP


def test_the_file_follows_a_login_a_release_and_a_grant_from_the_queue(world):
    alice, carol, bob = (world.lookup.add(name, uid, GROUP) for name, uid in (("alice", 1001), ("carol", 1003),
                                                                              ("bob", 1002)))
    world.quota(gpus=2)
    assert world.login(alice, pid=5001)["gpus"] == [0, 1]
    assert world.login(carol, pid=5003)["gpus"] == [2, 3]
    assert world.visible_devices.files == {1001: ["GPU-0000", "GPU-0001"], 1003: ["GPU-0002", "GPU-0003"]}
    assert world.login(bob, pid=5002)["gpus"] == []  # all four held: bob waits
    assert world.call("release", uid=1003, units=[3])["released"] == [3]
    assert world.visible_devices.files[1003] == ["GPU-0002"]  # what carol still holds
    assert world.call("release", uid=1001)["released"] == [0, 1]
    # Alice's file goes; bob, served from the queue in the same step, has his.
    assert world.visible_devices.files == {1003: ["GPU-0002"], 1002: ["GPU-0000", "GPU-0001"]}
    world.call("revoke", user="carol")
    assert world.visible_devices.files == {1002: ["GPU-0000", "GPU-0001"]}


def test_at_start_every_holder_gets_a_file_and_a_file_left_for_someone_else_goes(world):
    alice = world.lookup.add("alice", 1001, GROUP)
    world.login(alice, pid=5001)
    world.visible_devices.files = {1003: ["GPU-0002"]}  # left from before: 1003 holds nothing now
    world.grants.write_all_visible_devices()
    assert world.visible_devices.files == {1001: ["GPU-0000"]}
