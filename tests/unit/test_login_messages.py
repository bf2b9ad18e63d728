"""What a queued login is told: where the news of its GPU will come (api._login_reply)."""
from __future__ import annotations

from dataclasses import replace

from fakes import GROUP, World


def fill_the_server(world: World) -> None:
    for n in range(4):
        holder = world.lookup.add(f"holder{n}", 2000 + n, GROUP)
        assert world.login(holder)["gpus"]


def test_a_queued_login_on_a_terminal_is_told_there(world: World):
    fill_the_server(world)
    alice = world.lookup.add("alice", 1001, GROUP)
    reply = world.call("session_open", user=alice.name, pid=4243, service="sshd", tty="pts/7")
    assert reply["queue"] and "you will be told here when it is yours" in reply["message"]


def test_a_queued_login_without_a_terminal_is_told_where_the_news_will_come(world: World):
    world.config = replace(world.config, sessions=replace(world.config.sessions, services=("jupyterhub",)))
    fill_the_server(world)
    alice = world.lookup.add("alice", 1001, GROUP)
    reply = world.call("session_open", user=alice.name, pid=4243, service="jupyterhub", tty="")
    assert reply["queue"], reply
    assert "your terminals will be told when it is yours" in reply["message"] and " here " not in reply["message"]
