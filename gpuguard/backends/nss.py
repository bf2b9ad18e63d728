"""Account lookups (NSS) off the event loop, each bounded by a timeout: the daemon's Lookup edge.

NSS can block for seconds on SSSD or LDAP; run on the loop, one slow answer would stall every
login and the watcher's tick. Lookups run in a small pool of their own, so a hung directory
server cannot take the threads that sample NVML either. AccountLookup caches nothing (see
backends.accounts for why); services.lookups.KnownAccounts keeps the short cache of names and
quotas that the watcher judges by.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gpuguard.backends import accounts
from gpuguard.config import AccessConfig
from gpuguard.core import policy
from gpuguard.core.errors import LookupTimeout, UnknownUser
from gpuguard.core.model import Account

NSS_TIMEOUT = 5.0  # seconds: past the PAM module's own 2 s wait, so a slow login still gets its reply
NSS_THREADS = 4

Asked = TypeVar("Asked")
Answer = TypeVar("Answer")


class AccountLookup:
    def __init__(self, timeout: float = NSS_TIMEOUT):
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(NSS_THREADS, thread_name_prefix="nss")

    async def by_name(self, name: str) -> Account:
        return await self._run(accounts.by_name, name, f"user {name}")

    async def by_uid(self, uid: int) -> Account:
        return await self._run(accounts.by_uid, uid, f"uid {uid}")

    async def exempt_uids(self, access: AccessConfig, logged_in: Collection[int]) -> frozenset[int]:
        """The exempt uids as NSS says now (exempt.Exempt.refresh); raises LookupTimeout."""
        return await self._run(exempt_uids, (access, frozenset(logged_in)), "the exempt groups")

    async def _run(self, lookup: Callable[[Asked], Answer], key: Asked, what: str) -> Answer:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, lookup, key), self.timeout)
        except asyncio.TimeoutError:
            raise LookupTimeout(f"no answer from NSS for {what} within {self.timeout:g}s") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def exempt_uids(asked: tuple[AccessConfig, Collection[int]]) -> frozenset[int]:
    """The exempt uids (blocking): the exempt groups' member lists (accounts.exempt_uids), and the
    logged-in users whom policy.is_exempt calls exempt by their own groups.

    The two can differ: SSSD/LDAP often list no members whose primary group it is, so a login finds
    exempt someone the member lists missed (Exempt.add). Asking again for the logged-in users keeps
    such logins exempt across a reload, while a user taken out of the exempt groups still loses it.
    """
    access, logged_in = asked
    uids = accounts.exempt_uids(access)
    for uid in set(logged_in) - uids:
        try:
            account = accounts.by_uid(uid)
        except UnknownUser:
            continue
        if policy.is_exempt(uid, account.name, account.groups, access):
            uids.add(uid)
    return frozenset(uids)
