"""Account lookups through NSS (pwd/grp): the only place gpuguard asks who someone is.

Lookups go through NSS every time rather than a cache: an admin who adds alice to the
GPU group expects her next login to see it, and sites with LDAP/SSSD have their own caches.
"""
from __future__ import annotations

import ctypes
import errno
import grp
import os
import pwd
from collections.abc import Callable
from typing import Any

from gpuguard.config import AccessConfig
from gpuguard.core.errors import NssFailure, UnknownUser
from gpuguard.core.model import Account


def by_name(name: str) -> Account:
    return _account(pwd.getpwnam, name, f"no such user: {name}", f"user {name}")


def by_uid(uid: int) -> Account:
    return _account(pwd.getpwuid, uid, f"no user with uid {uid}", f"uid {uid}")


def has_account(uid: int) -> bool:
    """Whether uid has a passwd entry (a subuid of a user namespace has none); NssFailure when
    NSS cannot say."""
    return _entry(pwd.getpwuid, uid, f"uid {uid}") is not None


def _account(lookup: Callable[[Any], pwd.struct_passwd], key: Any, missing: str, what: str) -> Account:
    entry = _entry(lookup, key, what)
    if entry is None:
        raise UnknownUser(missing)
    return Account(entry.pw_name, entry.pw_uid, _group_names(entry))


def _entry(lookup: Callable[[Any], pwd.struct_passwd], key: Any, what: str) -> pwd.struct_passwd | None:
    """The passwd entry, None when there is none, NssFailure when NSS failed. Python's pwd raises
    KeyError for both, so a KeyError is asked again through getpw*_r, whose return value tells."""
    try:
        return lookup(key)
    except (ValueError, OverflowError):  # a name with a NUL, a uid past 2**32: nobody
        return None
    except KeyError:
        failure = nss_errno(key)
    if failure:
        raise NssFailure(f"cannot look up {what}: NSS failed ({os.strerror(failure)})")
    try:
        return lookup(key)  # found by the second look: the first failure passed
    except KeyError:
        return None


# getpw*_r's "not found" answers (getpwnam_r(3)); anything else non-zero is a failure of NSS.
# Loaded with this module: asked when descriptors may have run out, it must need none then.
_LIBC = ctypes.CDLL(None, use_errno=True)
_NOT_FOUND = frozenset({0, errno.ENOENT, errno.ESRCH, errno.EBADF, errno.EPERM})


def nss_errno(key: int | str) -> int:
    """0 when NSS answers for this uid or name (found or not), else the errno of its failure."""
    entry, result = ctypes.create_string_buffer(256), ctypes.c_void_p()  # struct passwd is 48 bytes
    size = 16384
    while True:
        buffer = ctypes.create_string_buffer(size)
        if isinstance(key, int):
            status = _LIBC.getpwuid_r(ctypes.c_uint(key), entry, buffer, ctypes.c_size_t(size), ctypes.byref(result))
        else:
            status = _LIBC.getpwnam_r(key.encode(), entry, buffer, ctypes.c_size_t(size), ctypes.byref(result))
        if status != errno.ERANGE or size >= 1 << 20:
            return 0 if status in _NOT_FOUND else status
        size *= 4


def _group_names(entry: pwd.struct_passwd) -> frozenset[str]:
    # getgrouplist asks NSS for one user's groups (initgroups), instead of walking every group.
    names = set()
    try:
        gids = os.getgrouplist(entry.pw_name, entry.pw_gid)
    except OSError as exc:
        raise NssFailure(f"cannot look up the groups of {entry.pw_name}: NSS failed ({exc.strerror})") from None
    for gid in gids:
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
