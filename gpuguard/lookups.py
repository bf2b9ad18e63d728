"""Account lookups (NSS) off the event loop, each bounded by a timeout.

NSS can block for seconds on SSSD or LDAP; run on the loop, one slow answer would stall every
login and the watcher's tick. Lookups run in a small pool of their own, so a hung directory
server cannot take the threads that sample NVML either. Nothing is cached here (see
backends.accounts for why); the watcher keeps its own short cache of quotas.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from gpuguard.backends import accounts
from gpuguard.backends.accounts import Account

NSS_TIMEOUT = 5.0  # seconds: past the PAM module's own 2 s wait, so a slow login still gets its reply
NSS_THREADS = 4


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

    async def _run(self, lookup, key, what: str) -> Account:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, lookup, key), self.timeout)
        except asyncio.TimeoutError:
            raise LookupTimeout(f"no answer from NSS for {what} within {self.timeout:g}s") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
