"""Whose subordinate uids a uid is (/etc/subuid): the uids a user may become in a user namespace.

newuidmap(1) maps into an unprivileged user's namespace only the ranges /etc/subuid gives that
user (without one, only their own uid), so any uid a local user can connect as is their own or
one of their ranges. The daemon counts a range's connections against its owner without asking
NSS: a namespace's root may connect as another of its 65,536 uids each time, and one NSS lookup
per new uid is what such a flood was after. Ranges that NSS gives instead of the file (a
`subid:` line in nsswitch.conf, as sssd offers) are not read here.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SUBUID = Path("/etc/subuid")
CHECK_EVERY = 1.0  # seconds between looks at whether the file changed (usermod -v edits it in place)


@dataclass(frozen=True)
class Range:
    owner: str   # a login name, or a uid written as digits (subuid(5) allows both)
    start: int
    count: int

    def __contains__(self, uid: int) -> bool:
        return self.start <= uid < self.start + self.count


def parse(text: str) -> tuple[Range, ...]:
    """The ranges of a subuid file; a line not of the form owner:start:count is skipped (newuidmap
    skips it too)."""
    ranges = []
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) != 3 or not fields[0] or not (fields[1].isdigit() and fields[2].isdigit()):
            continue
        ranges.append(Range(fields[0], int(fields[1]), int(fields[2])))
    return tuple(ranges)


class SubuidOwners:
    """owner(uid): who may become uid through their subuid ranges, or None. The file is read
    again when it changes (looked at once a CHECK_EVERY at most); absent, it gives no ranges;
    unreadable for a moment (descriptors run out under a flood), the ranges last read stay.
    Called only for uids not remembered yet, so a scan of the ranges is cheap enough."""

    def __init__(self, path: Path = SUBUID, clock: Callable[[], float] = time.monotonic):
        self._path = path
        self._clock = clock
        self._ranges: tuple[Range, ...] = ()
        self._version: tuple[int, int, int] | None = None  # (inode, size, mtime) of what was read
        self._checked = float("-inf")

    def owner(self, uid: int) -> str | None:
        self._refresh()
        return next((r.owner for r in self._ranges if uid in r), None)

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked < CHECK_EVERY:
            return
        self._checked = now
        try:
            info = os.stat(self._path)
        except FileNotFoundError:
            self._ranges, self._version = (), None
            return
        except OSError:
            return  # kept as last read: unreadable for a moment is no reason to forget the ranges
        version = (info.st_ino, info.st_size, info.st_mtime_ns)
        if version == self._version:
            return
        try:
            text = self._path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return  # out of descriptors under a flood, say: kept, and read at the next look
        self._ranges, self._version = parse(text), version
