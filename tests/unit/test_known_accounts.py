"""KnownAccounts.by_names: the users a fleet's other servers report, looked up by name for
`fairshare` (which anyone may ask as often as they like) at most once a minute each, the names
NSS does not know too, and never more than NAMES_KEPT names kept."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from fakes import FakeLookup

from gpuguard.config import AccessConfig, Config
from gpuguard.core.model import Account, Quota
from gpuguard.services import lookups
from gpuguard.services.lookups import KnownAccounts


class CountingLookup(FakeLookup):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    async def by_name(self, name: str) -> Account:
        self.asked.append(name)
        return await super().by_name(name)


def _accounts() -> tuple[KnownAccounts, CountingLookup, list[Config]]:
    lookup = CountingLookup()
    lookup.add("alice", 1001, "gpu")
    config = [Config(access=AccessConfig(group="gpu"), defaults=Quota(gpus=1, share=2.0))]
    return KnownAccounts(lookup, lambda: config[0]), lookup, config


def test_each_name_is_asked_once_a_minute_however_often_fairshare_is() -> None:
    accounts, lookup, _ = _accounts()
    for _ in range(50):
        found = asyncio.run(accounts.by_names(["alice", "bob"]))  # bob: a user of another server only
        assert found == {1001: ("alice", Quota(gpus=1, share=2.0))}
    assert lookup.asked == ["alice", "bob"]


def test_a_name_is_asked_again_after_a_minute_or_a_reload(monkeypatch) -> None:
    accounts, lookup, config = _accounts()
    asyncio.run(accounts.by_names(["alice"]))
    config[0] = replace(config[0], defaults=Quota(gpus=2))  # a reload: another config object
    assert asyncio.run(accounts.by_names(["alice"])) == {1001: ("alice", Quota(gpus=2))}
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + lookups.ACCOUNT_CACHE + 1)
    asyncio.run(accounts.by_names(["alice"]))
    assert lookup.asked == ["alice"] * 3


def test_names_kept_are_bounded_the_oldest_going_first(monkeypatch) -> None:
    monkeypatch.setattr(lookups, "NAMES_KEPT", 10)
    accounts, lookup, _ = _accounts()
    asyncio.run(accounts.by_names(["alice", *(f"stranger{n}" for n in range(30))]))
    assert len(accounts._names) == 10 and "alice" not in accounts._names
    asyncio.run(accounts.by_names(["alice", "stranger29"]))  # alice went first: asked again
    assert lookup.asked[31:] == ["alice"]
