"""The exempt users at a reload: NSS is asked in the lookups' pool, bounded in time, so a hung
directory never stalls the event loop, and keeps the exempt set as it was."""
from __future__ import annotations

import asyncio
import threading

from gpuguard.backends import nss
from gpuguard.backends.nss import AccountLookup
from gpuguard.config import AccessConfig
from gpuguard.core.errors import LookupTimeout


def test_a_hung_directory_times_out_in_the_pool_while_the_loop_goes_on(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(nss, "exempt_uids", lambda asked: release.wait(10) and frozenset({0}))
    lookup = AccountLookup(timeout=0.2)
    turns = 0

    async def loop_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0.01)

    async def main() -> Exception | None:
        ticking = asyncio.create_task(loop_turns())
        try:
            await lookup.exempt_uids(AccessConfig(exempt_groups=("admins",)), {1001})
        except LookupTimeout as exc:
            return exc
        finally:
            ticking.cancel()
        return None

    try:
        assert isinstance(asyncio.run(main()), LookupTimeout)
        assert turns >= 5  # the loop kept turning while NSS hung
    finally:
        release.set()
        lookup.close()


def test_a_refresh_nss_does_not_answer_keeps_the_exempt_users(world):
    world.exempt.set(frozenset({0, 1500}))

    async def hung(access: AccessConfig, logged_in: object) -> frozenset[int]:
        raise LookupTimeout("no answer from NSS for the exempt groups within 5s")

    world.lookup.exempt_uids = hung
    asyncio.run(world.exempt.refresh())
    assert world.exempt.uids == {0, 1500} and world.grants.exempt == {1500}


def test_a_login_made_exempt_while_the_refresh_asks_nss_stays_exempt(world):
    world.lookup.exempt = {1500}  # what the member lists say

    async def refresh_with_a_login_meanwhile() -> None:
        answered = asyncio.Event()
        real = world.lookup.exempt_uids

        async def slow(access: AccessConfig, logged_in: object) -> frozenset[int]:
            await answered.wait()
            return await real(access, logged_in)

        world.lookup.exempt_uids = slow
        refreshing = asyncio.create_task(world.exempt.refresh())
        await asyncio.sleep(0)
        world.exempt.add(1600)  # a login policy calls exempt, which the member lists miss
        answered.set()
        await refreshing

    asyncio.run(refresh_with_a_login_meanwhile())
    assert world.exempt.uids == {0, 1500, 1600}
