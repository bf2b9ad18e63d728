"""Who passes the gate without a grant: root, the exempt users and groups, and the logged-in
users whom policy.is_exempt calls exempt. The gate's exempt map and the node ACLs follow."""
from __future__ import annotations

from collections.abc import Callable

from gpuguard import policy
from gpuguard.backends import accounts
from gpuguard.config import AccessConfig
from gpuguard.store import Store


class Exempt:
    def __init__(self, access: Callable[[], AccessConfig], store: Store,
                 apply: Callable[[frozenset[int]], None]):
        self._access = access  # the config in force: a reload changes the exempt groups
        self._store = store
        self._apply = apply    # the gate map and the ACLs (Grants.set_exempt and Gate.set_exempt)
        self.uids: frozenset[int] = frozenset({0})

    def refresh(self) -> None:
        """Recompute from NSS (blocking: at start and reload, never per login) and apply."""
        self.set(self.compute())

    def compute(self) -> frozenset[int]:
        """The exempt uids as NSS and the open sessions say now.

        accounts.exempt_uids gives the exempt groups' member lists; to those are added the users
        with an open session whom policy.is_exempt (their own groups) calls exempt. The two can
        differ: SSSD/LDAP often list no members whose primary group it is, so a login finds exempt
        someone the member lists missed, and adds them (add). Asking again for the users with
        sessions keeps such logins exempt across a reload, while a user taken out of the exempt
        groups still loses it.
        """
        access = self._access()
        uids = accounts.exempt_uids(access)
        for uid in {s.uid for s in self._store.sessions()} - uids:
            try:
                account = accounts.by_uid(uid)
            except accounts.UnknownUser:
                continue
            if policy.is_exempt(uid, account.name, account.groups, access):
                uids.add(uid)
        return frozenset(uids)

    def add(self, uid: int) -> None:
        """A login that policy calls exempt, which the last refresh missed."""
        if uid not in self.uids:
            self.set(self.uids | {uid})

    def set(self, uids: frozenset[int]) -> None:
        self.uids = uids
        self._apply(uids)
