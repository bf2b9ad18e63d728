"""POSIX access ACLs on device nodes, read and written as the kernel's binary xattr.

"system.posix_acl_access" is u32 version 2, then 8-byte entries {u16 tag; u16 perm; u32 id}
sorted by tag and id. apply_acls checks first and writes nothing when the node is already right:
the node watcher sees our own writes as IN_ATTRIB, and a no-op is what ends that loop.
"""
from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterable

XATTR = "system.posix_acl_access"
VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED_ID = 0xFFFFFFFF
RW = 0o6
_HEADER = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")

Entry = tuple[int, int, int]  # (tag, perm, id)


def acl_entries(path: str | os.PathLike[str]) -> list[Entry]:
    """The node's access ACL; the 3 entries its mode implies when it has none stored."""
    try:
        data = os.getxattr(path, XATTR)
    except OSError as exc:
        if exc.errno != errno.ENODATA:
            raise
        return _minimal(os.stat(path).st_mode)
    (version,) = _HEADER.unpack_from(data)
    if version != VERSION:
        raise ValueError(f"{path}: unknown ACL xattr version {version}")
    return [_ENTRY.unpack_from(data, offset) for offset in range(_HEADER.size, len(data), _ENTRY.size)]


def acl_users(path: str | os.PathLike[str]) -> set[int]:
    """Uids with a named ACL entry on the node."""
    return named_users(acl_entries(path))


def named_users(entries: Iterable[Entry]) -> set[int]:
    return {uid for tag, _, uid in entries if tag == USER}


def apply_acls(path: str | os.PathLike[str], uids: Iterable[int], current: list[Entry] | None = None,
               perm: int = RW) -> bool:
    """Give exactly these uids `perm` (rw) on the node (the minimal 3-entry ACL when there are none);
    True when something had to be written. current: the node's entries as the caller has just
    read them (acl_entries), so they are not read twice.

    The owner, group and other entries are kept as they are; named groups are dropped.
    """
    if current is None:
        current = acl_entries(path)
    base = {tag: perm for tag, perm, _ in current if tag in (USER_OBJ, GROUP_OBJ, OTHER)}
    users = sorted(set(uids))
    wanted = [(USER_OBJ, base[USER_OBJ], UNDEFINED_ID), *[(USER, perm, uid) for uid in users],
              (GROUP_OBJ, base[GROUP_OBJ], UNDEFINED_ID)]
    if users:  # named entries need a mask; it must not cut the owning group's rights either
        wanted.append((MASK, perm | base[GROUP_OBJ], UNDEFINED_ID))
    wanted.append((OTHER, base[OTHER], UNDEFINED_ID))
    if current == wanted:
        return False
    # For a minimal ACL the kernel just sets the mode bits and drops the xattr.
    os.setxattr(path, XATTR, _HEADER.pack(VERSION) + b"".join(_ENTRY.pack(*e) for e in wanted))
    return True


def _minimal(mode: int) -> list[Entry]:
    """The ACL that a mode alone stands for."""
    return [(USER_OBJ, mode >> 6 & 7, UNDEFINED_ID), (GROUP_OBJ, mode >> 3 & 7, UNDEFINED_ID),
            (OTHER, mode & 7, UNDEFINED_ID)]
