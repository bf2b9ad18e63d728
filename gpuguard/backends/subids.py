"""Whose subordinate uids a uid is (/etc/subuid): the uids a user may become in a user namespace.

newuidmap(1) maps into an unprivileged user's namespace only the ranges /etc/subuid gives that
user (without one, only their own uid), so any uid a local user can connect as is their own or
one of their ranges. The daemon counts a range's connections against its owner without asking
NSS: a namespace's root may connect as another of its 65,536 uids each time, and one NSS lookup
per new uid is what such a flood was after. Ranges that NSS gives instead of the file (a
`subid:` line in nsswitch.conf, as sssd offers) are not read here.
"""
from __future__ import annotations

import bisect
import itertools
import os
import re
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

    @property
    def end(self) -> int:
        return self.start + self.count

    def __contains__(self, uid: int) -> bool:
        return self.start <= uid < self.end


_ID = re.compile(r"[0-9]{1,10}")  # a uid or a count: 32 bits, ASCII digits only


def parse(text: str) -> tuple[Range, ...]:
    """The ranges of a subuid file, ordered by their start; a line not of the form
    owner:start:count is skipped (newuidmap skips it too)."""
    ranges = []
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) == 3 and fields[0] and _ID.fullmatch(fields[1]) and _ID.fullmatch(fields[2]):
            ranges.append(Range(fields[0], int(fields[1]), int(fields[2])))
    return tuple(sorted(ranges, key=lambda r: r.start))


class Ranges:
    """Ranges found by bisection: a site with 10,000 users has as many lines, and a namespace's
    connections each ask (a scan cost 2.2 ms at 10,000 lines, on the daemon's loop). Ranges that
    overlap (the admin's mistake) give the uid to the one reaching furthest."""

    def __init__(self, ranges: tuple[Range, ...]):
        self._ranges = ranges  # ordered by start (parse)
        self._starts = [r.start for r in ranges]
        # furthest[i]: of ranges[:i + 1], the one that ends last; it holds a uid past ranges[i]'s
        # start if any of them does
        self._furthest: list[Range] = list(itertools.accumulate(ranges, _reaching_further))

    def owner(self, uid: int) -> str | None:
        i = bisect.bisect_right(self._starts, uid) - 1
        if i < 0:
            return None
        for candidate in (self._ranges[i], self._furthest[i]):
            if uid in candidate:
                return candidate.owner
        return None


def _reaching_further(a: Range, b: Range) -> Range:
    return b if b.end > a.end else a


class SubuidOwners:
    """owner(uid): who may become uid through their subuid ranges, or None. The file is read
    again when it changes (looked at once a CHECK_EVERY at most); absent, it gives no ranges;
    unreadable for a moment (descriptors run out under a flood), the ranges last read stay."""

    def __init__(self, path: Path = SUBUID, clock: Callable[[], float] = time.monotonic):
        self._path = path
        self._clock = clock
        self._ranges = Ranges(())
        self._version: tuple[int, int, int] | None = None  # (inode, size, mtime) of what was read
        self._checked = float("-inf")

    def owner(self, uid: int) -> str | None:
        self._refresh()
        return self._ranges.owner(uid)

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked < CHECK_EVERY:
            return
        self._checked = now
        try:
            info = os.stat(self._path)
        except FileNotFoundError:
            self._ranges, self._version = Ranges(()), None
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
        self._ranges, self._version = Ranges(parse(text)), version
