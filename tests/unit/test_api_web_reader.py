"""The web view's account ([web] user) reads every user's records as root does, and nothing more."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from fakes import GROUP, World

from gpuguard.config import AccessConfig, Config, WebConfig
from gpuguard.core.model import Quota


@pytest.fixture
def world(tmp_path) -> Iterator[World]:
    w = World(tmp_path)
    w.config = Config(access=AccessConfig(group=GROUP), defaults=Quota(gpus=1), web=WebConfig(user="ggweb"))
    yield w
    w.store.close()


def test_the_web_account_reads_anyones_whoami_report_and_events(world):
    alice = world.lookup.add("alice", 1001, GROUP)
    world.lookup.add("ggweb", 990, "ggweb")
    (unit,) = world.login(alice)["gpus"]
    seen = world.call("whoami", uid=990, user="alice")
    assert seen["ok"] and [g["minor"] for g in seen["grants"]] == [unit]
    assert world.call("events", uid=990, user="alice")["ok"]
    assert world.call("report", uid=990, since=0.0)["ok"]  # everyone's


def test_it_changes_nothing_and_others_still_read_only_their_own(world):
    alice, bob = world.lookup.add("alice", 1001, GROUP), world.lookup.add("bob", 1002, GROUP)
    world.lookup.add("ggweb", 990, "ggweb")
    world.login(alice)
    assert not world.call("grant", uid=990, user="bob", gpus=1)["ok"]
    assert not world.call("revoke", uid=990, user="alice")["ok"]
    assert not world.call("release", uid=990)["ok"]
    assert world.held(1001) and not world.held(1002)
    refused = world.call("whoami", uid=bob.uid, user="alice")
    assert not refused["ok"] and "only root" in refused["error"]
    assert not world.call("events", uid=bob.uid, user="alice")["ok"]
