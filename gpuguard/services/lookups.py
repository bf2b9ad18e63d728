"""Who accounts are, as the services need it without waiting for NSS: KnownAccounts keeps the
short cache of names and quotas that the watcher judges by, and that the API and the metrics
read; membership asks whether a uid is in the GPU group now. NSS itself is the Lookup edge
(backends.nss.AccountLookup: off the event loop, bounded in time)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from gpuguard.config import AccessConfig, Config
from gpuguard.core import policy
from gpuguard.core.errors import LookupTimeout, NssFailure, UnknownUser
from gpuguard.core.model import Account, Quota
from gpuguard.services.edges import Lookup

ACCOUNT_CACHE = 60.0  # seconds a user's groups (hence quota) are reused; a reload clears it
NAMES_KEPT = 4096     # names looked up by name (a fleet's other servers' users) kept at most



class KnownAccounts:
    """Name and resolved quota per uid, asked of NSS at most once per ACCOUNT_CACHE per user, and
    again after a reload (another config object)."""

    def __init__(self, lookup: Lookup, config: Callable[[], Config]):
        self.lookup = lookup
        self.config = config
        self._accounts: dict[int, tuple[float, Config, str, Quota]] = {}  # uid -> (when, config, name, quota)
        # name -> (when, config, its uid; None: NSS knows no such name), oldest first
        self._names: dict[str, tuple[float, Config, int | None]] = {}

    def _fresh(self, entry: tuple[float, Config, object] | tuple[float, Config, str, Quota]) -> bool:
        """Whether a cached (when, config, ...) still holds: asked under this config, within ACCOUNT_CACHE."""
        return entry[1] is self.config() and entry[0] > time.monotonic() - ACCOUNT_CACHE

    def _stale(self, uids: Iterable[int]) -> list[int]:
        """Those of uids not cached, or cached under another config or longer than ACCOUNT_CACHE ago."""
        return sorted(uid for uid in set(uids) if (entry := self._accounts.get(uid)) is None or not self._fresh(entry))

    async def resolve(self, uids: Iterable[int]) -> None:
        """Look up (off the loop) the users whose name and quota are not cached or are stale."""
        for uid in self._stale(uids):
            if not self._stale([uid]):
                continue  # looked up meanwhile (another caller's resolve, during an await)
            config = self.config()
            try:
                account = await self.lookup.by_uid(uid)
                entry = _named(account, config)
            except UnknownUser:  # deleted, or NSS too slow: the defaults still bound it
                cached = self._accounts.get(uid)
                entry = (cached[2], cached[3]) if cached and cached[1] is config else (str(uid), config.defaults)
            self._accounts[uid] = (time.monotonic(), config, *entry)

    async def by_names(self, names: Iterable[str]) -> dict[int, tuple[str, Quota]]:
        """uid -> name and quota of those of `names` NSS knows (the users a fleet's other servers
        report), each asked at most once per ACCOUNT_CACHE, a name it does not know too: anyone may
        ask `fairshare` as often as they like, and these names are the other servers' users."""
        found: dict[int, tuple[str, Quota]] = {}
        for name in names:
            cached = self._names.get(name)
            if cached is None or not self._fresh(cached):
                config = self.config()
                try:
                    account = await self.lookup.by_name(name)
                except UnknownUser:  # a user this server cannot name
                    cached = (time.monotonic(), config, None)
                else:
                    cached = (time.monotonic(), config, account.uid)
                    self._accounts[account.uid] = (*cached[:2], *_named(account, config))
                self._names.pop(name, None)  # to the end: the oldest go first past NAMES_KEPT
                self._names[name] = cached
                while len(self._names) > NAMES_KEPT:
                    del self._names[next(iter(self._names))]
            if cached[2] is not None and cached[2] in self._accounts:
                found[cached[2]] = self.of(cached[2])
        return found

    def of(self, uid: int) -> tuple[str, Quota]:
        """Name and resolved quota of uid as resolve left them; a uid it never saw (granted during
        the watcher's confirming re-sample) gets the defaults until the next tick."""
        cached = self._accounts.get(uid)
        if cached is None:
            return str(uid), self.config().defaults
        return cached[2], cached[3]

    def name_of(self, uid: int) -> str:
        return self.of(uid)[0]


def _named(account: Account, config: Config) -> tuple[str, Quota]:
    """What the cache keeps of an account NSS answered: its name and its quota under `config`."""
    return account.name, policy.quota_for(account.name, account.groups, config)


async def membership(lookup: Lookup, access: AccessConfig, uid: int) -> bool | None:
    """Whether uid is in the GPU group now; None when NSS cannot say (openers.OpenerEnder then
    reports a holder of that uid, never ends it)."""
    try:
        account = await lookup.by_uid(uid)
    except (NssFailure, LookupTimeout):
        return None
    except UnknownUser:  # no account: a user namespace's uid, or deleted
        return False
    return policy.is_member(account.groups, access)
