"""Account lookups (NSS) off the event loop, each bounded by a timeout.

NSS can block for seconds on SSSD or LDAP; run on the loop, one slow answer would stall every
login and the watcher's tick. Lookups run in a small pool of their own, so a hung directory
server cannot take the threads that sample NVML either. AccountLookup caches nothing (see
backends.accounts for why); KnownAccounts keeps the short cache of names and quotas that the
watcher judges by, and that the API and the metrics read without waiting for NSS.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gpuguard import policy
from gpuguard.backends import accounts
from gpuguard.config import AccessConfig, Config
from gpuguard.edges import Lookup
from gpuguard.model import Account, Quota

NSS_TIMEOUT = 5.0  # seconds: past the PAM module's own 2 s wait, so a slow login still gets its reply
NSS_THREADS = 4
ACCOUNT_CACHE = 60.0  # seconds a user's groups (hence quota) are reused; a reload clears it


Asked = TypeVar("Asked")
Answer = TypeVar("Answer")


class LookupTimeout(accounts.UnknownUser):
    """NSS did not answer in time: treated like an unknown user (no GPUs), never like a member."""


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


class KnownAccounts:
    """Name and resolved quota per uid, asked of NSS at most once per ACCOUNT_CACHE per user, and
    again after a reload (another config object)."""

    def __init__(self, lookup: Lookup, config: Callable[[], Config]):
        self.lookup = lookup
        self.config = config
        self._accounts: dict[int, tuple[float, Config, str, Quota]] = {}  # uid -> (when, config, name, quota)

    def _stale(self, uids: Iterable[int]) -> list[int]:
        """Those of uids not cached, or cached under another config or longer than ACCOUNT_CACHE ago."""
        config, oldest = self.config(), time.monotonic() - ACCOUNT_CACHE
        cached = self._accounts
        return sorted(uid for uid in set(uids)
                      if (entry := cached.get(uid)) is None or entry[1] is not config or entry[0] <= oldest)

    async def resolve(self, uids: Iterable[int]) -> None:
        """Look up (off the loop) the users whose name and quota are not cached or are stale."""
        for uid in self._stale(uids):
            if not self._stale([uid]):
                continue  # looked up meanwhile (another caller's resolve, during an await)
            config = self.config()
            try:
                account = await self.lookup.by_uid(uid)
                entry = (account.name, policy.quota_for(account.name, account.groups, config))
            except accounts.UnknownUser:  # deleted, or NSS too slow: the defaults still bound it
                cached = self._accounts.get(uid)
                entry = (cached[2], cached[3]) if cached and cached[1] is config else (str(uid), config.defaults)
            self._accounts[uid] = (time.monotonic(), config, *entry)

    def of(self, uid: int) -> tuple[str, Quota]:
        """Name and resolved quota of uid as resolve left them; a uid it never saw (granted during
        the watcher's confirming re-sample) gets the defaults until the next tick."""
        cached = self._accounts.get(uid)
        if cached is None:
            return str(uid), self.config().defaults
        return cached[2], cached[3]

    def name_of(self, uid: int) -> str:
        return self.of(uid)[0]


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
        except accounts.UnknownUser:
            continue
        if policy.is_exempt(uid, account.name, account.groups, access):
            uids.add(uid)
    return frozenset(uids)


async def membership(lookup: Lookup, access: AccessConfig, uid: int) -> bool | None:
    """Whether uid is in the GPU group now; None when NSS cannot say (holders.HolderEnder then
    reports a holder of that uid, never ends it)."""
    try:
        account = await lookup.by_uid(uid)
    except (accounts.NssFailure, LookupTimeout):
        return None
    except accounts.UnknownUser:  # no account: a user namespace's uid, or deleted
        return False
    return policy.is_member(account.groups, access)
