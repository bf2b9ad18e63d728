"""Account lookups through NSS (pwd/grp): the only place gpuguard asks who someone is.

Lookups go through NSS every time rather than a cache: an admin who adds alice to the
GPU group expects her next login to see it, and sites with LDAP/SSSD have their own caches.
"""
from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuguard.config import AccessConfig
from gpuguard.errors import GpuguardError


class UnknownUser(GpuguardError, LookupError):
    """No such account (or NSS could not say in time)."""


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    groups: frozenset[str]  # names of the primary and all supplementary groups


def by_name(name: str) -> Account:
    return _account(pwd.getpwnam, name, f"no such user: {name}")


def by_uid(uid: int) -> Account:
    return _account(pwd.getpwuid, uid, f"no user with uid {uid}")


def _account(lookup: Callable[[Any], pwd.struct_passwd], key: Any, missing: str) -> Account:
    try:
        entry = lookup(key)
    except (KeyError, ValueError, OverflowError):  # a name with a NUL, a uid past 2**32: nobody either
        raise UnknownUser(missing) from None
    return Account(entry.pw_name, entry.pw_uid, _group_names(entry))


def _group_names(entry: pwd.struct_passwd) -> frozenset[str]:
    # getgrouplist asks NSS for one user's groups (initgroups), instead of walking every group.
    names = set()
    for gid in os.getgrouplist(entry.pw_name, entry.pw_gid):
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue  # a gid with no name cannot match a configured group name
    return frozenset(names)


def user_exists(name: str) -> bool:
    return _exists(pwd.getpwnam, name)


def group_exists(name: str) -> bool:
    return _exists(grp.getgrnam, name)


def _exists(lookup: Callable[[str], Any], name: str) -> bool:
    try:
        lookup(name)
    except KeyError:
        return False
    return True


def exempt_uids(access: AccessConfig) -> set[int]:
    """root, the configured exempt users and every member of the exempt groups (unknown names
    skipped): a group's listed members plus the users whose primary group it is."""
    names = set(access.exempt_users)
    primary_gids = set()
    for name in access.exempt_groups:
        try:
            group = grp.getgrnam(name)
        except KeyError:
            continue
        names |= set(group.gr_mem)
        primary_gids.add(group.gr_gid)
    uids = {0}
    if primary_gids:  # one walk of the user database, however many groups (slow on LDAP)
        uids |= {entry.pw_uid for entry in pwd.getpwall() if entry.pw_gid in primary_gids}
    for name in names:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            continue  # listed but not (yet) an account: nothing to exempt
    return uids
