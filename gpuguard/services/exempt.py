"""Who passes the gate without a grant: root, the exempt users and groups, and the logged-in
users whom policy.is_exempt calls exempt. The gate's exempt map and the node ACLs follow."""
from __future__ import annotations

import logging
from collections.abc import Callable

from gpuguard.config import AccessConfig
from gpuguard.core.errors import UnknownUser
from gpuguard.logs import event
from gpuguard.services.edges import Lookup
from gpuguard.services.store import Store


class Exempt:
    def __init__(self, access: Callable[[], AccessConfig], store: Store,
                 apply: Callable[[frozenset[int]], None], lookup: Lookup):
        self._access = access  # the config in force: a reload changes the exempt groups
        self._store = store
        self._apply = apply    # the gate map and the ACLs (Grants.set_exempt and Gate.set_exempt)
        self._lookup = lookup  # NSS off the loop, for refresh
        self.uids: frozenset[int] = frozenset({0})
        self._added: set[int] | None = None  # logins made exempt while a refresh asks NSS

    async def refresh(self) -> None:
        """Ask NSS again (a reload) in the lookups' pool, bounded in time, and apply. A directory
        that does not answer keeps the exempt set as it was (logged): the loop never waits for it."""
        self._added = set()
        try:
            uids = await self._lookup.exempt_uids(self._access(), self._logged_in())
        except UnknownUser as exc:  # LookupTimeout
            event(logging.ERROR, "exempt_refresh_failed", error=str(exc), kept="the exempt users as they were")
            return
        finally:
            added, self._added = self._added, None
        self.set(uids | added)

    def _logged_in(self) -> set[int]:
        return self._store.users_logged_in()

    def add(self, uid: int) -> None:
        """A login that policy calls exempt, which the last refresh missed."""
        if self._added is not None:
            self._added.add(uid)
        if uid not in self.uids:
            self.set(self.uids | {uid})

    def set(self, uids: frozenset[int]) -> None:
        self.uids = uids
        self._apply(uids)
