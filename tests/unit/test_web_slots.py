"""The web login's PAM conversations shared between clients (gpuguard/web/slots.py), with a login
standing in for PAM that holds its conversation until the test lets it go."""
from __future__ import annotations

import asyncio

import pytest

from gpuguard.web.slots import LOOPBACK, Busy, LoginSlots, client_key, group_of


def test_the_client_an_ipv6_64_and_all_of_loopback_as_one():
    assert client_key("192.0.2.7") == group_of("192.0.2.7") == "192.0.2.7"
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert client_key("127.0.0.2") == "127.0.0.2"  # the delay counts each loopback address alone
    for local in ("127.0.0.1", "127.200.3.4", "::1", "::ffff:127.0.0.9"):
        assert group_of(local) == LOOPBACK  # any local user binds them all: one share
    assert client_key("?") == group_of("?") == "?"


class Logins:
    """Logins of (group, standing) that each hold their slot until released."""

    def __init__(self, slots: LoginSlots):
        self.slots = slots
        self.running: list[str] = []
        self.outcome: dict[str, str] = {}
        self._release: dict[str, asyncio.Event] = {}

    def start(self, name: str, group: str, standing: int = 0, trusted: bool = False) -> asyncio.Task:
        self._release[name] = asyncio.Event()

        async def login():
            try:
                async with self.slots.slot(group, standing, trusted):
                    self.running.append(name)
                    await self._release[name].wait()
                self.outcome[name] = "ran"
            except Busy:
                self.outcome[name] = "busy"
        return asyncio.create_task(login())

    async def release(self, name: str) -> None:
        self._release[name].set()
        for _ in range(5):
            await asyncio.sleep(0)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_one_client_holds_its_share_and_is_refused_past_its_waiters():
    async def scenario():
        slots = LoginSlots(at_once=2, per_group=1, per_group_waiting=2, waiting=10)
        logins = Logins(slots)
        tasks = [logins.start(f"junk{i}", "10.0.0.66", standing=i) for i in range(5)]
        await settle()
        assert logins.running == ["junk0"] and slots.queued("10.0.0.66") == 2
        assert logins.outcome == {"junk3": "busy", "junk4": "busy"}  # refused at once, no slot taken
        tasks.append(logins.start("alice", "192.0.2.1"))
        await settle()
        assert logins.running == ["junk0", "alice"]  # the other slot was free for her
        for name in ("alice", "junk0", "junk1", "junk2"):
            await logins.release(name)
        await asyncio.gather(*tasks)
        assert slots.running == 0 and slots.queued() == 0
        assert logins.running == ["junk0", "alice", "junk1", "junk2"]
    asyncio.run(scenario())


def test_waiters_of_fewer_failures_go_first_and_take_a_worse_ones_place():
    async def scenario():
        slots = LoginSlots(at_once=1, per_group=1, per_group_waiting=3, waiting=3)
        logins = Logins(slots)
        tasks = [logins.start("first", "10.0.0.1", standing=0)]
        tasks += [logins.start(f"junk{i}", f"10.0.0.{66 + i}", standing=50) for i in range(3)]
        await settle()
        assert slots.queued() == 3
        tasks.append(logins.start("equal", "10.0.0.99", standing=50))  # no better than the worst: refused
        tasks.append(logins.start("alice", "192.0.2.1", standing=1))   # better: junk2 (the last of the worst) goes
        await settle()
        assert logins.outcome == {"equal": "busy", "junk2": "busy"}
        await logins.release("first")
        assert logins.running == ["first", "alice"]  # ahead of the junk that came before her
        for name in ("alice", "junk0", "junk1"):
            await logins.release(name)
        await asyncio.gather(*tasks)
        assert logins.running == ["first", "alice", "junk0", "junk1"] and slots.running == 0
    asyncio.run(scenario())


def test_a_trusted_login_goes_ahead_of_a_full_queue_of_fresh_addresses():
    """The finding: fresh addresses (an IPv6 /56's 256 /64s) stand at 0 each and fill the queue;
    alice at 1 and carol at 0 were refused. A trusted login (its device cookie) takes the place
    of the last untrusted waiter and goes first; trusted ones among themselves in their order."""
    async def scenario():
        slots = LoginSlots(at_once=1, per_group=1, per_group_waiting=4, waiting=4)
        logins = Logins(slots)
        tasks = [logins.start("junk0", "2001:db8:0:100::/64")]
        tasks += [logins.start(f"junk{i}", f"2001:db8:0:1{i:02x}::/64") for i in range(1, 5)]
        await settle()
        assert slots.queued() == 4
        tasks.append(logins.start("carol", "192.0.2.3"))               # standing 0: no better than the flood
        tasks.append(logins.start("alice", "192.0.2.1", standing=1))   # worse still
        tasks.append(logins.start("bob", "192.0.2.2", standing=9, trusted=True))  # junk4, the last, goes
        tasks.append(logins.start("dave", "192.0.2.4", standing=50, trusted=True))  # junk3
        await settle()
        assert logins.outcome == {"carol": "busy", "alice": "busy", "junk4": "busy", "junk3": "busy"}
        tasks.append(logins.start("eve", "192.0.2.5", trusted=True))    # junk2
        tasks.append(logins.start("frank", "192.0.2.6", trusted=True))  # junk1
        tasks.append(logins.start("gina", "192.0.2.7", trusted=True))   # only trusted waiters left: refused
        await settle()
        assert {name for name, got in logins.outcome.items() if got == "busy"} == {
            "carol", "alice", "junk1", "junk2", "junk3", "junk4", "gina"}
        assert slots.queued() == 4
        for name in ("junk0", "bob", "dave", "eve", "frank"):
            await logins.release(name)
        await asyncio.gather(*tasks)
        assert logins.running == ["junk0", "bob", "dave", "eve", "frank"] and slots.running == 0
    asyncio.run(scenario())


def test_a_trusted_login_takes_an_untrusted_place_of_its_own_client():
    async def scenario():
        slots = LoginSlots(at_once=1, per_group=1, per_group_waiting=1, waiting=10)
        logins = Logins(slots)
        tasks = [logins.start("junk0", "2001:db8::/64"), logins.start("junk1", "2001:db8::/64")]
        tasks.append(logins.start("bob", "2001:db8::/64", standing=40, trusted=True))  # the LAN's flood is his /64's
        await settle()
        assert logins.outcome == {"junk1": "busy"}
        await logins.release("junk0")
        await logins.release("bob")
        await asyncio.gather(*tasks)
        assert logins.running == ["junk0", "bob"]
    asyncio.run(scenario())


def test_a_waiter_refused_after_waiting_or_cancelled_leaves_no_slot_behind():
    async def scenario():
        slots = LoginSlots(at_once=1, per_group=1, per_group_waiting=4, waiting=4, wait_most=0.05)
        logins = Logins(slots)
        holder = logins.start("holder", "10.0.0.1")
        late = logins.start("late", "10.0.0.2")
        await asyncio.sleep(0.2)
        assert logins.outcome == {"late": "busy"} and slots.queued() == 0
        slots.wait_most = 30.0
        cancelled = logins.start("cancelled", "10.0.0.3")
        await settle()
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert slots.queued() == 0
        await logins.release("holder")
        await asyncio.gather(holder, late)
        assert slots.running == 0
        after = logins.start("after", "10.0.0.4")
        await settle()
        assert logins.running == ["holder", "after"]  # the slot came back whole
        await logins.release("after")
        await after
    asyncio.run(scenario())
